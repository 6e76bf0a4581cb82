"""Impossible data settings: rows far longer than cutoff_len are cut before tokenization (same result), JSON
nested beyond a sane depth and empty files are refused with a message, worker counts are clamped, and a
global batch larger than the training set is refused."""

from __future__ import annotations

import json
import logging
from types import SimpleNamespace

import pytest

from roll import IGNORE_INDEX
from roll.data.loading import MAX_JSON_DEPTH, check_json_depth, load_sources
from roll.data.processors import PairwiseProcessor, SupervisedProcessor, char_bound, truncate_turns
from roll.data.templates import Renderer
from roll.errors import ConfigError, DataError
from tests.helpers import batch_of


class _Spy:
    """The tokenizer, counting the characters it was asked to tokenize."""

    def __init__(self, tokenizer):
        self.tokenizer, self.chars = tokenizer, 0

    def __call__(self, texts, **kwargs):
        self.chars += sum(map(len, [texts] if isinstance(texts, str) else texts))
        return self.tokenizer(texts, **kwargs)

    def __getattr__(self, name):
        return getattr(self.tokenizer, name)


def _reference(tokenizer, row: dict, cutoff_len: int) -> tuple[list[int], list[int]]:
    """Tokenize the whole rendered turn, then truncate: what the processor did before rows were bounded."""
    from roll.data import formats

    turns = Renderer.for_tokenizer(tokenizer).turns(formats.conversation(row, "alpaca"), "all")
    ids = tokenizer([text for p, r, _ in turns for text in (p, r)], add_special_tokens=False)["input_ids"]
    input_ids, labels, _ = truncate_turns([(ids[0], ids[1], True)], cutoff_len)
    return input_ids, labels


@pytest.mark.parametrize("long_side", ["instruction", "output"])
def test_a_huge_row_is_cut_before_tokenization_with_the_same_result(bpe, long_side):
    cutoff = 32
    row = {"instruction": "What is 1 plus 1?", "input": "", "output": "Two."}
    row[long_side] = " ".join(f"w{i}" for i in range(60_000))  # ~400k characters, far over 32 tokens
    spy = _Spy(bpe)
    out = SupervisedProcessor(spy, cutoff, "alpaca", "mem.json")(batch_of([row]), [0])
    limit = char_bound(bpe, cutoff)
    # Each text at most `limit` characters: the prompt, the answer, and both again for the first row's
    # segmentation check.
    assert spy.chars <= 4 * limit and limit < len(row[long_side]) / 10
    assert (out["input_ids"][0], out["labels"][0]) == _reference(bpe, row, cutoff)
    assert out["_truncated"] == [True] and len(out["input_ids"][0]) == cutoff


def test_a_huge_pair_is_cut_before_tokenization(bpe):
    row = {"prompt": "Hi " * 100_000, "chosen": "Yes. " * 50_000, "rejected": "No."}
    spy = _Spy(bpe)
    out = PairwiseProcessor(spy, 32, "pairwise", "mem.json")(batch_of([row]), [0])
    assert spy.chars <= 3 * char_bound(bpe, 32) < len(row["prompt"]) / 10
    assert len(out["chosen_input_ids"][0]) == 32 and out["chosen_labels"][0][-1] != IGNORE_INDEX


def _write(path, text: str) -> str:
    path.write_text(text)
    return str(path)


def test_json_depth_limit(tmp_path):
    ok = "[" * (MAX_JSON_DEPTH - 1) + "]" * (MAX_JSON_DEPTH - 1)
    # Brackets inside strings (an escaped quote too) do not count.
    check_json_depth(_write(tmp_path / "ok.jsonl", f'{{"a": "[[[[\\"{{", "x": {ok}}}\n'))
    deep = "[" * MAX_JSON_DEPTH + "]" * MAX_JSON_DEPTH
    path = _write(tmp_path / "deep.jsonl", '{"a": 1}\n{"a": "]]]"}\n' + f'{{"x": {deep}}}\n')
    with pytest.raises(DataError, match=rf"deep.jsonl: JSON nested more than {MAX_JSON_DEPTH} levels deep "
                                        r"\(line 3\)"):
        check_json_depth(path)


def test_a_deep_file_and_an_empty_file_are_refused_before_loading(tmp_path):
    depth = 100_000  # Python's json raises RecursionError, pyarrow's reader segfaults
    deep = _write(tmp_path / "deep.jsonl", '{"instruction": "hi", "x": ' + "[" * depth + "]" * depth + "}\n")
    with pytest.raises(DataError, match="nested more than"):
        load_sources(deep)
    for text in ("", "  \n\n"):
        with pytest.raises(DataError, match=r"empty.json is empty \(no rows\)"):
            load_sources(_write(tmp_path / "empty.json", text))


def _config(tiny_model_dir: str, tmp_path, **overrides):
    from roll.config.parser import resolve

    rows = [{"instruction": "Hi", "input": "", "output": "Yo."}] * 4
    data = _write(tmp_path / "sft.json", json.dumps(rows))
    values = dict(model_name_or_path=tiny_model_dir, stage="sft", dataset=data,
                  output_dir=str(tmp_path / "out"), report_to="none", **overrides)
    return resolve(values, {}, None)


def test_worker_counts_are_clamped_to_the_machine(tiny_model_dir, tmp_path, caplog):
    import os

    cores = len(os.sched_getaffinity(0))
    with caplog.at_level(logging.WARNING):
        config = _config(tiny_model_dir, tmp_path, dataloader_num_workers=1000,
                         preprocessing_num_workers=1000)
    assert config.data.preprocessing_num_workers == cores
    assert config.training.dataloader_num_workers == cores
    assert "dataloader_num_workers=1000 is more than" in caplog.text
    config = _config(tiny_model_dir, tmp_path, dataloader_num_workers=1, preprocessing_num_workers=1)
    assert (config.data.preprocessing_num_workers, config.training.dataloader_num_workers) == (1, 1)
    # LLaMA-Factory packs per worker's shard: with its packing the recipe's count sets the rows, so it is kept
    config = _config(tiny_model_dir, tmp_path, preprocessing_num_workers=1000, packing=True,
                     packing_algorithm="llamafactory")
    assert config.data.preprocessing_num_workers == 1000


def test_a_global_batch_larger_than_the_training_set_is_refused():
    from roll.router import check_batch_fits

    training = SimpleNamespace(per_device_train_batch_size=4, gradient_accumulation_steps=2)
    config = SimpleNamespace(training=training, data=SimpleNamespace(packing=True))
    check_batch_fits(config, rows=16, dp_size=2)  # 4 * 2 * 2 = 16: one full step
    with pytest.raises(ConfigError, match=r"one global batch is 16 samples .* has 15 packed rows"):
        check_batch_fits(config, rows=15, dp_size=2)
