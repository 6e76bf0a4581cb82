"""Data built once: packed rows cached and memory-mapped (roll/data/packing.py), the same bins as the
list-based best-fit decreasing it replaced, and ``tokenized_path`` / ``--prepare-data``
(roll/data/prepared.py)."""

from __future__ import annotations

import bisect
import json
import os
import random

import numpy as np
import pytest

from roll.config.data import DataArguments
from roll.data import build_datasets, packing, pipeline
from roll.errors import ConfigError


def reference_bins(lengths: list[int], capacity: int) -> list[list[int]]:
    """The best-fit decreasing roll shipped before the array version (a sorted list of (room, bin id)): the
    bins the goldens and parity runs were recorded with."""
    bins: list[list[int]] = []
    free: list[tuple[int, int]] = []
    for index in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        need = lengths[index]
        pos = bisect.bisect_left(free, (need, -1))
        if pos < len(free):
            room, bin_id = free.pop(pos)
        else:
            room, bin_id = capacity, len(bins)
            bins.append([])
        bins[bin_id].append(index)
        if room - need > 0:
            bisect.insort(free, (room - need, bin_id))
    return bins


@pytest.mark.parametrize("capacity", [8, 100, 1024])
def test_array_packing_gives_the_same_bins_as_the_list_version(capacity):
    rng = random.Random(capacity)
    for size in (0, 1, 7, 3000):
        lengths = [rng.randint(1, capacity) for _ in range(size)]
        assert packing.best_fit_decreasing(lengths, capacity) == reference_bins(lengths, capacity)
    # Many equal lengths: the ties (oldest bin first, lower sample index first) decide everything.
    lengths = [rng.choice([3, 5, capacity // 2 or 1]) for _ in range(500)]
    assert packing.best_fit_decreasing(lengths, capacity) == reference_bins(lengths, capacity)


def test_packed_rows_equal_a_plain_concatenation_of_each_bin(tmp_path, monkeypatch):
    import datasets

    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(tmp_path))
    monkeypatch.setattr(packing, "TOKENS_PER_WRITE", 64)  # several record batches, bins cut across none
    rng = np.random.default_rng(0)
    ids = [rng.integers(0, 500, int(n)).tolist() for n in rng.integers(1, 40, 300)]
    labels = [[-100] + row[1:] for row in ids]
    ds = datasets.Dataset.from_dict({"input_ids": ids, "labels": labels}).shuffle(seed=1)  # indices mapping
    packed, efficiency = packing.pack_dataset(ds, 64)
    bins = reference_bins([len(row) for row in ds["input_ids"]], 64)
    rows = ds[:]
    expected = [{"input_ids": sum((rows["input_ids"][i] for i in b), []),
                 "labels": sum((rows["labels"][i] for i in b), []),
                 "position_ids": sum((list(range(len(rows["input_ids"][i]))) for i in b), []),
                 "seq_lens": [len(rows["input_ids"][i]) for i in b]} for b in bins]
    assert packed.to_list() == expected
    assert {k: str(v) for k, v in packed.features.items()} == {  # the types the datasets.map version inferred
        "input_ids": "List(Value('int32'))", "labels": "List(Value('int64'))",
        "position_ids": "List(Value('int64'))", "seq_lens": "List(Value('int64'))"}
    assert efficiency == sum(map(len, ids)) / (len(bins) * 64)
    smaller, _ = packing.pack_dataset(ds, 48)  # the same tokens, another bin size: not the 64-token file
    assert max(map(len, smaller["input_ids"])) <= 48 and len(smaller) > len(packed)


def _rows(tmp_path, n: int = 80) -> str:
    rng = random.Random(0)
    words = "the cat sees a dog one two three four five".split()
    rows = [{"instruction": " ".join(rng.choices(words, k=rng.randint(2, 30))), "input": "",
             "output": " ".join(rng.choices(words, k=rng.randint(1, 40)))} for _ in range(n)]
    path = tmp_path / "a.json"
    path.write_text(json.dumps(rows))
    return str(path)


def _build(tokenizer, **keys):
    return build_datasets(DataArguments(**keys), tokenizer, stage="sft", processor="supervised",
                          formats=("alpaca",), seed=0)


@pytest.fixture
def counted(monkeypatch, tmp_path):
    """Counts of packing passes (``_write_packed``) and tokenizer passes (``_build``), on a fresh cache."""
    import datasets

    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(tmp_path / "hf_cache"))
    calls = {"pack": 0, "build": 0}

    def spy(real, key):
        def counted(*args, **kwargs):
            calls[key] += 1
            return real(*args, **kwargs)
        return counted

    monkeypatch.setattr(packing, "_write_packed", spy(packing._write_packed, "pack"))
    monkeypatch.setattr(pipeline, "_build", spy(pipeline._build, "build"))
    return calls


def test_packed_rows_are_cached_memory_mapped_and_reused(bpe, tmp_path, counted, monkeypatch):
    data = _rows(tmp_path)
    first = _build(bpe, dataset=data, cutoff_len=128, packing=True)
    monkeypatch.setattr(pipeline, "COUNT_BATCH_ROWS", 7)  # the same counts summed over many batches
    again = _build(bpe, dataset=data, cutoff_len=128, packing=True)
    assert counted["pack"] == 1  # the second start packed nothing
    assert again.train.to_list() == first.train.to_list() and again.stats == first.stats.__class__(
        **{**vars(first.stats), "preprocess_seconds": again.stats.preprocess_seconds})
    files = {os.path.dirname(f["filename"]) for f in again.train.cache_files}
    assert files == {str(tmp_path / "hf_cache" / "roll-packed")}  # memory-mapped from the cache
    _build(bpe, dataset=data, cutoff_len=96, packing=True)  # another bin size: its own file
    _build(bpe, dataset=data, cutoff_len=128, packing=True, overwrite_cache=True)
    assert counted["pack"] == 3


def test_tokenized_path_round_trip_and_refusals(bpe, tmp_path, counted):
    data, prepared = _rows(tmp_path), str(tmp_path / "prepared")
    keys = dict(dataset=data, cutoff_len=128, packing=True, val_size=0.1, tokenized_path=prepared)
    first = _build(bpe, **keys)
    assert sorted(os.listdir(prepared)) == ["eval", "roll_data.json", "train"] and counted["build"] == 1
    os.rename(data, data + ".moved")  # a later run (another node) needs no source file
    loaded = _build(bpe, **keys)
    assert counted == {"pack": 2, "build": 1}  # no tokenizer pass, no packing: train and eval were loaded
    assert loaded.train.to_list() == first.train.to_list() and loaded.eval.to_list() == first.eval.to_list()
    assert loaded.stats.num_samples == first.stats.num_samples and loaded.stats.packing_efficiency > 0.5
    with pytest.raises(ConfigError) as refused:
        _build(bpe, **{**keys, "cutoff_len": 96, "packing": False})
    assert "tokenized_path " + prepared in str(refused.value)
    assert "cutoff_len: 128 there, 96 here; packing: true there, false here." in str(refused.value)
    from roll.demo.tiny_model import build_bpe_tokenizer

    other = build_bpe_tokenizer()
    other.chat_template = "{{ messages }}"
    with pytest.raises(ConfigError, match=r"^tokenized_path .*: tokenizer: \"\w+\" there, \"\w+\" here\. "):
        _build(other, **keys)
    (tmp_path / "not_roll").mkdir()
    (tmp_path / "not_roll" / "dataset_dict.json").write_text("{}")
    with pytest.raises(ConfigError, match="holds no roll_data.json: it was not prepared by roll"):
        _build(bpe, **{**keys, "tokenized_path": str(tmp_path / "not_roll")})
    assert counted["build"] == 1


def test_prepare_data_command(tiny_model_dir, tmp_path, capsys):
    from roll.cli import main as roll_train

    prepared = str(tmp_path / "prepared")
    common = [f"model_name_or_path={tiny_model_dir}", "stage=sft", f"dataset={_rows(tmp_path, 40)}",
              "cutoff_len=128", "packing=true", f"output_dir={tmp_path / 'out'}"]
    assert roll_train([*common, "--prepare-data"]) == 2  # no tokenized_path: nowhere to prepare into
    assert "--prepare-data saves the prepared data to tokenized_path, which is not" in capsys.readouterr().err
    assert roll_train([*common, f"tokenized_path={prepared}", "--prepare-data", "--json"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["already_prepared"] is False and summary["num_samples"] == 40 and summary["num_rows"] < 40
    assert not os.path.exists(tmp_path / "out")  # prepared only: no output_dir, no model loaded
    assert roll_train([*common, f"tokenized_path={prepared}", "--dry-run", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["num_rows"] == summary["num_rows"]
    assert roll_train([*common, "cutoff_len=64", f"tokenized_path={prepared}", "--dry-run"]) == 2
    assert "cutoff_len: 128 there, 64 here." in capsys.readouterr().err
