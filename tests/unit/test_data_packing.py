"""Sequence packing invariants: no sample split, bins within capacity, positions restart, no label leaks."""

from __future__ import annotations

import json
import random

import pytest

from roll import IGNORE_INDEX
from roll.config.data import DataArguments
from roll.data import build_datasets
from roll.data.packing import best_fit_decreasing, llamafactory_batches, llamafactory_bins, packed_fingerprint
from roll.errors import ConfigError, DataError

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


def test_llamafactory_bins_hand_computed():
    # LLaMA-Factory 0.9.5's greedy_knapsack by hand, bin size 10, lengths by index 0:4 1:7 2:3 3:3 4:6 5:2 6:1.
    # bin 1: the longest that fits 10 is 7 (#1), room 3: a 3, the later of the two first (#3), room 0
    # bin 2: 6 (#4), room 4: 4 (#0), room 0
    # bin 3: 3 (#2), room 7: 2 (#5), room 5: 1 (#6)
    assert llamafactory_bins([4, 7, 3, 3, 6, 2, 1], 10) == [[1, 3], [4, 0], [2, 5, 6]]
    # (best-fit decreasing packs the same lengths into two rows of 10 and one of 6 as well, but other ones)
    assert best_fit_decreasing([4, 7, 3, 3, 6, 2, 1], 10) == [[1, 2], [4, 0], [3, 5, 6]]
    with pytest.raises(DataError, match="sample 1 has 9 tokens"):
        llamafactory_bins([3, 9], 8)
    # the batches datasets.map hands LLaMA-Factory's processor: batch_size rows per contiguous num_proc shard
    assert llamafactory_batches(10, 3, None) == [(0, 3), (3, 6), (6, 9), (9, 10)]
    assert llamafactory_batches(10, 3, 2) == [(0, 3), (3, 5), (5, 8), (8, 10)]
    assert llamafactory_batches(2, 3, 4) == [(0, 1), (1, 2)]  # at most one shard per row


def test_llamafactory_packing_refused_where_it_has_no_meaning(tmp_path):
    with pytest.raises(ConfigError, match="streaming"):
        DataArguments(dataset="x", packing=True, streaming=True, packing_algorithm="llamafactory")
    args = DataArguments(dataset=str(tmp_path / "t.json"), packing=True, packing_algorithm="llamafactory")
    with pytest.raises(ConfigError, match="packing: false"):
        build_datasets(args, None, stage="pt", processor="pretrain", formats=("text",), seed=0)


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


def _greedy_rows(samples, capacity, batch):
    """LLaMA-Factory's packing written out plainly: per batch of rows, each new row takes the longest sample left
    that fits (among equal lengths the last), until none fits."""
    rows = []
    for start in range(0, len(samples), batch):
        part = samples[start:start + batch]
        left = sorted(range(len(part)), key=lambda i: (len(part[i][0]), i))
        while left:
            room, row = capacity, []
            while fits := [i for i in left if len(part[i][0]) <= room]:
                left.remove(fits[-1])
                row.append(part[fits[-1]])
                room -= len(part[fits[-1]][0])
            rows.append(row)
    return rows


def test_llamafactory_packing_gives_its_rows_in_its_order(bpe, tmp_path, monkeypatch):
    import datasets

    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(tmp_path / "hf_cache"))
    rng = random.Random(1)
    words = "the cat sees a dog one two three four five".split()
    rows = [{"instruction": " ".join(rng.choices(words, k=rng.randint(1, 4 if i % 8 else 30))), "input": "",
             "output": " ".join(rng.choices(words, k=rng.randint(1, 6 if i % 8 else 40)))} for i in range(40)]
    path = tmp_path / "a.json"
    path.write_text(json.dumps(rows))

    def build(**keys):
        args = DataArguments(dataset=str(path), **keys)
        return build_datasets(args, bpe, stage="sft", processor="supervised", formats=("alpaca",), seed=0)

    # LLaMA-Factory cuts samples to cutoff_len - 1 with packing and fills rows of cutoff_len - 1 tokens
    plain = build(cutoff_len=63)
    packed = build(cutoff_len=64, packing=True, packing_algorithm="llamafactory", preprocessing_batch_size=16)
    samples = list(zip(plain.train["input_ids"], plain.train["labels"]))
    assert plain.stats.num_truncated > 0
    got = [[(seg["input_ids"], seg["labels"]) for seg in _segments(row)] for row in packed.train]
    assert got == _greedy_rows(samples, 63, 16)
    best_fit = build(cutoff_len=64, packing=True)
    assert best_fit.train["seq_lens"] != packed.train["seq_lens"]
    keys = {packed_fingerprint(plain.train, 63, lf) for lf in (None, (16, None), (8, None), (16, 2))}
    assert len(keys) == 4  # the rule and LLaMA-Factory's batches are part of the packed cache's key


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
