"""Streaming and dataset mixing in the shared pipeline (roll.data.streaming, roll.data.mixing), in process.

Both backends read the training set by index, global step k rows [k*B, (k+1)*B): the rows a streamed set
returns for an index are therefore the whole contract. tests/distributed/test_streaming.py trains both
backends on a stream and resumes each mid-stream.
"""

from __future__ import annotations

import itertools
import json
import os
from collections import Counter

import numpy as np
import pytest

from roll.config.data import DataArguments
from roll.config.parser import resolve
from roll.data import build_datasets
from roll.data.mixing import interleave, mixed_indices
from roll.data import streaming
from roll.data.streaming import (FIRST_PACK_BLOCK, StreamedRows, TrainingStream, pack_block_sizes, packed,
                                 set_stream_length, share_stream, shuffled)
from roll.errors import ConfigError

SFT = ("supervised", ("alpaca", "sharegpt"))


@pytest.fixture(autouse=True)
def datasets_cache(tmp_path, monkeypatch):
    import datasets

    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(tmp_path / "hf_cache"))


def write_rows(path, first: int, count: int) -> str:
    rows = [{"instruction": f"What is {a} plus {a % 7}?", "output": f"{a} plus {a % 7} equals {a + a % 7}."}
            for a in range(first, first + count)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def build(tokenizer, seed=0, length=None, **data):
    bundle = build_datasets(DataArguments(**{"cutoff_len": 64, **data}), tokenizer, stage="sft",
                            processor=SFT[0], formats=SFT[1], seed=seed)
    if length is not None:
        set_stream_length(bundle.train, length, 1)
    return bundle.train


def texts(tokenizer, rows) -> list[str]:
    return [tokenizer.decode(row["input_ids"]) for row in rows]


# ---- streaming ------------------------------------------------------------------------------------------

def test_stream_order_is_seeded_and_a_resumed_reader_gets_the_same_rows(bpe, tmp_path):
    data = write_rows(tmp_path / "a.jsonl", 0, 30)
    stream = dict(dataset=data, streaming=True, buffer_size=8, preprocessing_batch_size=7)
    rows = build(bpe, length=75, **stream)
    assert isinstance(rows, StreamedRows) and len(rows) == 75
    read = [rows[i] for i in range(75)]  # 2.5 passes over the 30 rows
    epochs = [texts(bpe, read[i:i + 30]) for i in (0, 30)]
    # every epoch holds every row once, in another order (reshuffled with seed + epoch), never file order
    assert sorted(epochs[0]) == sorted(epochs[1]) and len(set(epochs[0])) == 30
    assert epochs[0] != epochs[1] and epochs[0] != texts(bpe, build(bpe, dataset=data, shuffle=False))
    # a resumed run asks first for the row after its consumed samples: replayed to the same row
    for start in (0, 29, 47):
        assert build(bpe, length=75, **stream)[start] == read[start]
    assert rows[0] == read[0] and rows[74] == read[74] and rows.rows_read == 75  # row 0 kept for fillers
    again, other = build(bpe, length=75, **stream), build(bpe, seed=1, length=75, **stream)
    assert [again[i] for i in range(30)] == read[:30] and [other[i] for i in range(30)] != read[:30]
    # the stream fingerprint (roll_resume.json) follows the data keys and the seed, not max_steps
    assert again.fingerprint == rows.fingerprint != other.fingerprint
    # without shuffle the stream is the in-memory pipeline's order (the same tokenized rows)
    plain = build(bpe, length=30, dataset=data, streaming=True, shuffle=False)
    assert [plain[i] for i in range(30)] == list(build(bpe, dataset=data, shuffle=False))


def test_one_reader_per_node_hands_each_rank_its_rows_and_resumes_exactly(bpe, tmp_path, monkeypatch):
    """Two local ranks of a launched run, in one process, asking for rows as both backends do (global batch
    B = 4: micro-batch 2 x dp 2; rank r takes slice r of each step): local rank 0 reads the stream, rank 1
    reads and tokenizes none of it, and both get the rows one process reading alone gets, also resumed."""
    data = write_rows(tmp_path / "a.jsonl", 0, 30)
    stream = dict(dataset=data, streaming=True, buffer_size=8, packing=True, cutoff_len=64)
    alone = build(bpe, **stream)
    set_stream_length(alone, 10, 4)
    expected = [alone[i] for i in range(40)]
    assert any(len(row["seq_lens"]) > 1 for row in expected)  # packed rows cross the spool whole

    def node(output_dir):
        ranks = []
        monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
        for rank in (0, 1):
            monkeypatch.setenv("LOCAL_RANK", str(rank))
            rows = build(bpe, **stream)
            set_stream_length(rows, 10, 4)
            share_stream(rows, str(output_dir))
            ranks.append(rows)
        return ranks

    reader, other = node(tmp_path / "out")
    got = {}
    for step in range(10):  # local rank 0 first: in one process the other rank cannot wait for it
        for rank, rows in ((0, reader), (1, other)):
            got.update({i: rows[i] for i in range(4 * step + 2 * rank, 4 * step + 2 * rank + 2)})
    assert [got[i] for i in range(40)] == expected
    assert (reader.rows_read, other.rows_read) == (40, 0)
    assert other[0] == expected[0]  # the filler row: kept, not asked of local rank 0 again
    assert not [name for name in os.listdir(reader.spool.directory)]  # each block read once, then gone
    # resumed at step 6, the mca backend asking for row 0 (its filler row) first
    reader, other = node(tmp_path / "resumed")
    for rows in (reader, other):
        assert rows[0] == expected[0]
    for rows in (reader, other):
        assert [rows[i] for i in range(24, 28)] == expected[24:28]
    assert (reader.rows_read, other.rows_read) == (28, 0)


def test_a_resumed_stream_may_run_longer_but_not_on_other_data(bpe, tmp_path):
    from roll import resume_record

    data = write_rows(tmp_path / "a.jsonl", 0, 30)
    stream = dict(dataset=data, streaming=True)
    resume_record.write(str(tmp_path), build(bpe, length=24, **stream), dataset_spec=data, global_step=3,
                        global_batch_size=4, skipped_steps=0)
    assert resume_record.read(str(tmp_path))["streamed"] is True
    # max_steps raised from 6 to 10 (24 -> 40 rows): the same stream, 12 rows consumed
    resume_record.check_same_data(str(tmp_path), build(bpe, length=40, **stream), dataset_spec=data,
                                  global_batch_size=4)
    for changed in (dict(seed=1), dict(cutoff_len=32)):
        other = build(bpe, length=40, **{**stream, **changed})
        with pytest.raises(ConfigError, match="other contents or order"):
            resume_record.check_same_data(str(tmp_path), other, dataset_spec=data, global_batch_size=4)


def test_pt_streams_the_in_memory_rows_and_eval_dataset_is_read_in_full(bpe, tmp_path):
    corpus = tmp_path / "c.jsonl"
    corpus.write_text("".join(json.dumps({"text": f"document {i} " + "word " * (i % 30)}) + "\n"
                              for i in range(60)))
    pt = dict(dataset=str(corpus), cutoff_len=32, shuffle=False, preprocessing_batch_size=16)
    memory = build_datasets(DataArguments(**pt), bpe, stage="pt", processor="pretrain", formats=("text",),
                            seed=0).train
    bundle = build_datasets(DataArguments(**pt, streaming=True, eval_dataset=str(corpus)), bpe, stage="pt",
                            processor="pretrain", formats=("text",), seed=0)
    set_stream_length(bundle.train, len(memory), 1)
    assert [bundle.train[i] for i in range(len(memory))] == list(memory)  # documents cut into 32-token rows
    assert bundle.eval is not None and list(bundle.eval) == list(memory)


def test_a_broken_row_met_in_the_stream_is_named(bpe, tmp_path):
    from roll.errors import DataError

    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"instruction": "a", "output": "b"}\n{"instruction": "c", "output": \n')
    rows = build(bpe, length=4, dataset=str(bad), streaming=True)
    with pytest.raises(DataError, match=r"bad.jsonl while streaming it: invalid JSON on line 2 \(row 1\)"):
        rows[0]


def test_the_shuffle_buffer_reads_lazily_and_draws_every_row_once():
    consumed = []

    def endless():
        for i in itertools.count():
            consumed.append(i)
            yield {"i": i}

    first = list(itertools.islice(shuffled(endless(), 100, seed=0), 10))
    assert len(consumed) == 110 and all(row["i"] < 110 for row in first)  # memory: the buffer, not the corpus
    out = [row["i"] for row in shuffled(({"i": i} for i in range(1000)), 100, seed=0)]
    assert sorted(out) == list(range(1000)) and out != list(range(1000))
    assert out == [row["i"] for row in shuffled(({"i": i} for i in range(1000)), 100, seed=0)]
    # a row can come out long after it went in (not a windowed shuffle that keeps rows near their place)
    assert max(out.index(value) - value for value in range(1000)) > 300


def test_packing_on_the_fly_packs_every_sample_once_per_epoch(bpe, tmp_path):
    data = write_rows(tmp_path / "a.jsonl", 0, 40)
    lengths = sorted(len(r["input_ids"]) for r in build(bpe, dataset=data, shuffle=False))
    args = DataArguments(dataset=data, cutoff_len=64, streaming=True, packing=True, buffer_size=16,
                         preprocessing_batch_size=7)
    rows = list(TrainingStream(args, _processor(bpe, args), 0).epoch(0))
    assert sorted(n for row in rows for n in row["seq_lens"]) == lengths
    assert all(len(row["input_ids"]) == sum(row["seq_lens"]) <= 64 for row in rows)
    assert len(rows) < len(lengths) / 2 + 3  # ~25-token samples: two to a 64-token row
    for row in rows:  # positions restart per sample; the first label of each sample is not trained
        starts = [sum(row["seq_lens"][:k]) for k in range(len(row["seq_lens"]))]
        assert [int(row["position_ids"][s]) for s in starts] == [0] * len(starts)
        assert all(int(row["labels"][s]) == -100 for s in starts)


def test_packing_starts_with_a_small_block_that_doubles_up_to_buffer_size():
    """Best-fit decreasing needs its whole block before the first row: the first block of an epoch is
    FIRST_PACK_BLOCK samples (not buffer_size), each next one twice the last, up to buffer_size."""
    consumed = []

    def samples(count):
        for i in range(count):
            consumed.append(i)
            n = 20 + (i * 37) % 200  # 20-219 tokens, every value of sample i's tokens is i
            yield {"input_ids": np.full(n, i, np.int32), "labels": np.full(n, i, np.int32)}

    rows = packed(samples(12_000), 1024, pack_block_sizes(4096), np.random.default_rng(0))
    first = next(rows)
    assert FIRST_PACK_BLOCK == 512 and len(consumed) == 512 and max(first["input_ids"]) < 512
    seen = [(len(consumed), first)] + [(len(consumed), row) for row in rows]
    # the samples read when each row came out: the block ends 512, +1024, +2048, then +4096 each
    ends = [512, 1536, 3584, 7680, 11776, 12000]
    assert sorted({at for at, _ in seen}) == ends
    ids = []
    for at, row in seen:
        starts = np.cumsum([0] + row["seq_lens"][:-1])
        members = [int(row["input_ids"][s]) for s in starts]
        block_start = max([0] + [end for end in ends if end < at])
        assert all(block_start <= m < at for m in members) and len(row["input_ids"]) <= 1024
        ids += members
    assert sorted(ids) == list(range(12_000))  # every sample once
    # a buffer_size below FIRST_PACK_BLOCK: every block is buffer_size, as before
    assert list(itertools.islice(pack_block_sizes(100), 3)) == [100, 100, 100]


def test_a_packed_stream_gives_its_first_row_after_the_buffer_and_a_first_block(bpe, tmp_path, monkeypatch):
    data = write_rows(tmp_path / "a.jsonl", 0, 40)
    read = []
    tokenized_rows = streaming.tokenized_rows

    def counted(*args, **kwargs):
        for row in tokenized_rows(*args, **kwargs):
            read.append(row)
            yield row

    monkeypatch.setattr(streaming, "tokenized_rows", counted)
    monkeypatch.setattr(streaming, "FIRST_PACK_BLOCK", 4)
    stream = dict(dataset=data, streaming=True, buffer_size=16, packing=True)
    rows = build(bpe, length=50, **stream)
    assert rows[0]["seq_lens"] and len(read) == 16 + 4  # the shuffle buffer, then 4 samples (not 16 more)
    # blocks of 4, 8, 16, 16 samples: ~20 packed rows a pass, so 50 rows cross blocks and passes; a resumed
    # reader asking first for row k replays to the same row
    expected = [rows[i] for i in range(50)]
    for start in (21, 44):
        assert build(bpe, length=50, **stream)[start] == expected[start]


def _processor(tokenizer, args):
    import functools

    from roll.data.pipeline import make_processor

    return functools.partial(make_processor, data_args=args, tokenizer=tokenizer, stage="sft",
                             processor=SFT[0], allowed=SFT[1])


# ---- mixing ---------------------------------------------------------------------------------------------

def test_interleave_strategies_round_robin():
    a, b = ["a0", "a1"], ["b0", "b1", "b2"]
    under = [item for _, item in interleave([lambda: a, lambda: b], "interleave_under", None, 0)]
    over = [item for _, item in interleave([lambda: a, lambda: b], "interleave_over", None, 0)]
    assert under == ["a0", "b0", "a1", "b1"]
    assert over == ["a0", "b0", "a1", "b1", "a0", "b2", "a1"]  # a again; b exhausted after all


def test_interleave_probs_are_seeded_and_respected():
    probs = [0.7, 0.2, 0.1]
    order = mixed_indices([20000, 20000, 20000], "interleave_under", probs, seed=0)
    entries = order // 20000
    assert list(order[:200]) == list(mixed_indices([20000] * 3, "interleave_under", probs, seed=0)[:200])
    assert list(order[:200]) != list(mixed_indices([20000] * 3, "interleave_under", probs, seed=1)[:200])
    # under stops when entry 0 (drawn 70% of the time) runs out: ~20000 / 0.7 draws
    counts = Counter(entries.tolist())
    assert counts[0] == 20000 and 27500 < len(order) < 29700
    assert abs(counts[1] / len(order) - 0.2) < 0.01 and abs(counts[2] / len(order) - 0.1) < 0.01
    # each entry's rows come in their order, none twice
    assert all(list(order[entries == e] % 20000) == list(range(counts[e])) for e in range(3))
    # over: the small entry repeats until the big one is exhausted
    over = mixed_indices([100, 5000], "interleave_over", [0.5, 0.5], seed=0)
    assert Counter((over >= 100).tolist())[True] == 5000 and abs(len(over) - 10000) < 300
    assert len(set(over.tolist())) == 5100


def test_mixing_is_the_same_in_memory_and_streamed(bpe, tmp_path):
    a, b = write_rows(tmp_path / "a.jsonl", 0, 12), write_rows(tmp_path / "b.jsonl", 100, 30)
    mix = dict(dataset=f"{a},{b}", mix_strategy="interleave_under", interleave_probs=[0.6, 0.4],
               shuffle=False)
    memory = list(build(bpe, seed=5, **mix))
    streamed = build(bpe, seed=5, length=len(memory), streaming=True, **mix)
    assert [streamed[i] for i in range(len(memory))] == memory
    words = [t.split("What is ")[1].split(" ")[0] for t in texts(bpe, memory)]
    assert sum(int(w) < 100 for w in words) == 12 and 12 < len(memory) < 30  # under: a (60%) runs out
    assert memory != list(build(bpe, seed=6, **mix))
    concat = list(build(bpe, dataset=f"{a},{b}", shuffle=False))
    assert len(concat) == 42 and texts(bpe, concat[:12]) == texts(bpe, build(bpe, dataset=a, shuffle=False))


# ---- refusals -------------------------------------------------------------------------------------------

BASE = {"stage": "sft", "dataset": "recipes/demo/data/arithmetic_sft.json", "model_name_or_path": "m"}


@pytest.mark.parametrize("recipe,message", [
    ({"streaming": True}, "needs max_steps"),
    ({"streaming": True, "max_steps": 5, "val_size": 0.1}, "set eval_dataset"),
    ({"streaming": True, "max_steps": 5, "max_samples": 10}, "drop max_samples"),
    ({"streaming": True, "max_steps": 5, "tokenized_path": "prepared"}, "drop tokenized_path"),
    ({"streaming": True, "max_steps": 5, "save_strategy": "epoch"}, "save_strategy=epoch"),
    ({"streaming": True, "max_steps": 5, "stage": "dpo"}, "stage dpo cannot stream"),
    ({"streaming": True, "max_steps": 5, "buffer_size": 0}, "buffer_size must be positive"),
    ({"mix_strategy": "interleave_unde"}, "did you mean 'interleave_under'"),
    ({"interleave_probs": "0.5,0.5"}, "with concat every row"),
    ({"mix_strategy": "interleave_over", "interleave_probs": "0.5,0.5"}, "dataset has 1 comma-separated"),
    ({"mix_strategy": "interleave_over", "dataset": "a,b", "interleave_probs": "0.5,0.6"}, "sum to 1"),
])
def test_what_streaming_and_mixing_refuse(recipe, message):
    with pytest.raises(ConfigError, match=message):
        resolve({**BASE, **recipe}, {}, None)
    if recipe.get("mix_strategy") == "interleave_unde":  # the dataclass checks its own choices too
        with pytest.raises(ConfigError, match="did you mean"):
            DataArguments(mix_strategy="interleave_unde")
