"""Sequence packing invariants: no sample split, bins within capacity, positions restart, no label leaks."""

from __future__ import annotations

import json
import random

import pytest

from roll import IGNORE_INDEX
from roll.config.data import DataArguments
from roll.data import build_datasets
from roll.data.packing import best_fit_decreasing
from roll.errors import DataError

X = IGNORE_INDEX


def test_best_fit_decreasing_docstring_example():
    assert best_fit_decreasing([3, 5, 2, 4], 7) == [[1, 2], [3, 0]]


@pytest.mark.parametrize("seed", range(5))
def test_every_sample_in_exactly_one_bin_within_capacity(seed):
    rng = random.Random(seed)
    lengths = [rng.randint(1, 100) for _ in range(500)]
    bins = best_fit_decreasing(lengths, 128)
    assert sorted(i for b in bins for i in b) == list(range(len(lengths)))
    assert all(sum(lengths[i] for i in b) <= 128 for b in bins)
    # best-fit decreasing uses at most 11/9 OPT + 1 bins; OPT >= total / capacity
    assert len(bins) <= 11 / 9 * (sum(lengths) / 128) + 2


def test_sample_longer_than_a_bin_is_an_error():
    with pytest.raises(DataError, match="sample 1 has 9 tokens"):
        best_fit_decreasing([3, 9], 8)


def _segments(row):
    start = 0
    for n in row["seq_lens"]:
        yield {k: row[k][start:start + n] for k in ("input_ids", "labels", "position_ids")}
        start += n


def test_packed_dataset_invariants(bpe, tmp_path, monkeypatch):
    import datasets

    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(tmp_path / "hf_cache"))
    rng = random.Random(0)
    words = "the cat sees a dog one two three four five".split()
    rows = [{"instruction": " ".join(rng.choices(words, k=rng.randint(2, 30))), "input": "",
             "output": " ".join(rng.choices(words, k=rng.randint(1, 40)))} for _ in range(60)]
    path = tmp_path / "a.json"
    path.write_text(json.dumps(rows))

    def build(packing):
        args = DataArguments(dataset=str(path), cutoff_len=128, packing=packing)
        return build_datasets(args, bpe, stage="sft", processor="supervised", formats=("alpaca",), seed=0)

    plain, packed = build(False), build(True)
    samples = sorted(zip(plain.train["input_ids"], plain.train["labels"]))
    segments = [seg for row in packed.train for seg in _segments(row)]
    assert all(len(row["input_ids"]) <= 128 for row in packed.train)
    for row in packed.train:
        assert sum(row["seq_lens"]) == len(row["input_ids"]) == len(row["position_ids"])
    # no sample split or lost: the segments are exactly the unpacked samples
    assert sorted((s["input_ids"], s["labels"]) for s in segments) == samples
    for seg in segments:
        assert seg["position_ids"] == list(range(len(seg["input_ids"])))  # restart at 0
        assert seg["labels"][0] == IGNORE_INDEX  # no segment's first token is predicted from the previous one
    stats = packed.stats
    assert stats.num_samples == 60 and stats.num_rows == len(packed.train) < 60
    assert stats.packing_efficiency == pytest.approx(stats.num_tokens / (len(packed.train) * 128))
    assert stats.num_tokens == plain.stats.num_tokens and plain.stats.packing_efficiency is None


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
def test_hf_model_attends_within_packed_samples(tiny_model_dir, attn):
    """The packed batch as the collator emits it (position_ids + cu_seqlens, no attention_mask) gives an HF
    model the same logits per sample as running each sample alone: attention never crosses a boundary."""
    import torch
    from transformers import AutoModelForCausalLM

    from roll.data.collators import SequenceCollator
    from roll.data.policy import PaddingPolicy

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, attn_implementation=attn).eval()
    a, b = [5, 6, 7, 8], [9, 10, 11]
    row = {"input_ids": a + b, "labels": [X] + a[1:] + [X] + b[1:], "position_ids": [0, 1, 2, 3, 0, 1, 2]}
    batch = SequenceCollator(pad_token_id=0, policy=PaddingPolicy(packing=True, pad_to_multiple_of=8))([row])
    with torch.no_grad():
        packed = model(**batch, use_cache=False).logits[0]  # with a cache HF ignores packed position_ids
        alone = [model(input_ids=torch.tensor([s])).logits[0] for s in (a, b)]
    starts = batch["cu_seqlens"].tolist()  # each sample padded to 8: [0, 8, 16]
    torch.testing.assert_close(packed[starts[0]:starts[0] + 4], alone[0])
    torch.testing.assert_close(packed[starts[1]:starts[1] + 3], alone[1])
