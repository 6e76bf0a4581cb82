"""What both backends share, written once in roll/: the crash-safe checkpoint publish, the speed window, the
real-token count, the train_log.jsonl writer and the config.json reader. The end-to-end runs (tests/recipes,
tests/distributed/test_reliability.py) check the backends use them; these check each piece's rules."""

from __future__ import annotations

import json
import os

import pytest
import torch

from roll import checkpoints, perf, train_log
from roll.errors import ConfigError, ModelError
from roll.hf_config import has_hf_config, read_hf_config, text_config


def _write(path: str, text: str = "x") -> None:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w", encoding="utf-8") as fh:
        fh.write(text)


# ---- checkpoints.publishing -----------------------------------------------------------------------

def test_publishing_flushes_then_renames_then_rotates(tmp_path, monkeypatch):
    out = str(tmp_path)
    events = []
    monkeypatch.setattr(checkpoints, "barrier", lambda: events.append("barrier"))
    monkeypatch.setattr(checkpoints, "flush_to_disk", lambda: events.append("flush"))
    for step in (1, 2):
        _write(os.path.join(out, f"checkpoint-{step}", "weights"))
    _write(os.path.join(out, "checkpoint-3.tmp", "leftover"))  # a save of this step that died earlier
    with checkpoints.publishing(out, 3, is_writer=True, keep=2) as staging:
        assert staging == os.path.join(out, "checkpoint-3.tmp") and os.listdir(staging) == []
        assert events == ["barrier"]  # no rank writes before the writer emptied the staging directory
        _write(os.path.join(staging, "weights"), "3")
        events.append("body")
        assert checkpoints.last_checkpoint(out).endswith("checkpoint-2")  # not published while writing
    assert events == ["barrier", "body", "flush", "barrier", "barrier"]
    assert sorted(os.listdir(out)) == ["checkpoint-2", "checkpoint-3"]  # rotated to keep=2, no .tmp/.old
    with open(os.path.join(out, "checkpoint-3", "weights"), encoding="utf-8") as fh:
        assert fh.read() == "3"


def test_publishing_nested_renames_the_inner_directory(tmp_path):
    """HF's Trainer names its checkpoint directory itself: it writes STAGING/checkpoint-N."""
    out = str(tmp_path)
    with checkpoints.publishing(out, 4, is_writer=True, nested=True) as staging:
        _write(os.path.join(staging, "checkpoint-4", "model.safetensors"))
    assert os.listdir(out) == ["checkpoint-4"]
    assert os.listdir(os.path.join(out, "checkpoint-4")) == ["model.safetensors"]


def test_publishing_leaves_no_partial_checkpoint_when_the_body_raises(tmp_path):
    out = str(tmp_path)
    _write(os.path.join(out, "checkpoint-1", "weights"))
    with pytest.raises(OSError, match="disk full"):
        with checkpoints.publishing(out, 2, is_writer=True, keep=1) as staging:
            _write(os.path.join(staging, "half-written"))
            raise OSError("disk full")
    assert checkpoints.last_checkpoint(out).endswith("checkpoint-1")  # not rotated away either
    assert not os.path.exists(os.path.join(out, "checkpoint-2"))
    assert [os.path.basename(p) for p in checkpoints.clean_stale(out)] == ["checkpoint-2.tmp"]


def test_publishing_only_the_writer_renames(tmp_path):
    out = str(tmp_path)
    os.makedirs(os.path.join(out, "checkpoint-5.tmp"))  # made by the writer on a shared filesystem
    with checkpoints.publishing(out, 5, is_writer=False) as staging:
        _write(os.path.join(staging, "shard-1"))
    assert sorted(os.listdir(out)) == ["checkpoint-5.tmp"]


# ---- the speed window and real tokens -------------------------------------------------------------

class _Meter:
    def __init__(self):
        self.calls = []

    def metrics(self, tokens, seconds, steps, seq_length):
        self.calls.append((tokens, seconds, steps, seq_length))
        return {"tokens": tokens, "steps": steps}


def test_speed_window_counts_a_window_from_its_first_step_to_its_record(monkeypatch):
    # the run's first window opens at its first step (10.0); each later one where the previous closed
    clock = iter([10.0, 12.0, 20.0, 23.0])
    monkeypatch.setattr(perf.time, "perf_counter", lambda: next(clock))
    meter = _Meter()
    window = perf.SpeedWindow(meter)
    for _ in range(4):  # two steps of two micro-batches: only the first begin() of a window counts
        window.begin(3)
        window.add(torch.tensor(30), rows=2)
    window.close(5)
    window.begin(5)
    window.add(None, rows=1)  # not computable: this window's tokens are null, the next one's are not
    window.close(6, over_ranks=lambda tokens, rows: (tokens * 2, rows * 2))
    assert meter.calls == [(120, 2.0, 2, 15.0), (None, 8.0, 1, 0.0)]
    window.begin(6)
    window.add(7, rows=1)
    assert window.close(7)["tokens"] == 7


def test_real_tokens_counts_non_pad_tokens_of_padded_and_packed_rows():
    padded = {"input_ids": torch.tensor([[5, 6, 7], [8, 0, 0]]),
              "attention_mask": torch.tensor([[1, 1, 1], [1, 0, 0]])}
    packed = {"input_ids": torch.tensor([[5, 6, 7, 8, 0, 0]]),
              "position_ids": torch.tensor([[0, 1, 0, 1, 0, 1]])}
    assert int(perf.real_tokens(padded, pad_token_id=0)) == 4
    assert int(perf.real_tokens(packed, pad_token_id=0)) == 4
    assert int(perf.real_tokens(packed, pad_token_id=None)) == 6


# ---- train_log.jsonl ------------------------------------------------------------------------------

def _records(out: str) -> list[dict]:
    with open(train_log.train_log_path(out), encoding="utf-8") as fh:
        return [json.loads(line) for line in fh]


def test_train_log_records_are_the_same_on_both_backends(tmp_path, monkeypatch):
    out = str(tmp_path / "run")
    monkeypatch.delenv("RANK", raising=False)
    train_log.start_train_log(out, fresh=True)
    record = train_log.append_record(out, 1, {"loss": 2.5, "tokens_per_second": 10.0})
    train_log.append_record(out, 1, {"eval_loss": 2.4})
    assert record == {"step": 1, "loss": 2.5, "tokens_per_second": 10.0, "step_time": None, "mfu": None,
                      "peak_memory_gb": None}
    assert _records(out) == [record, {"step": 1, "eval_loss": 2.4}]  # eval records carry no speed fields
    train_log.start_train_log(out, fresh=False)  # a resumed run appends
    train_log.append_record(out, 2, {"loss": 2.0})
    assert [r["step"] for r in _records(out)] == [1, 1, 2]
    monkeypatch.setenv("RANK", "1")  # other ranks write nothing
    train_log.append_record(out, 3, {"loss": 1.0})
    train_log.start_train_log(out, fresh=True)
    assert len(_records(out)) == 3
    monkeypatch.setenv("RANK", "0")
    train_log.start_train_log(out, fresh=True)
    assert _records(out) == []


# ---- config.json ----------------------------------------------------------------------------------

def test_read_hf_config_names_the_file_and_the_error_kind(tmp_path):
    model = str(tmp_path / "model")
    assert not has_hf_config(model) and not has_hf_config(None)
    _write(os.path.join(model, "config.json"), json.dumps({"model_type": "llava",
                                                           "text_config": {"vocab_size": 7}}))
    assert has_hf_config(model) and text_config(read_hf_config(model)) == {"vocab_size": 7}
    assert text_config({"vocab_size": 9}) == {"vocab_size": 9}
    _write(os.path.join(model, "config.json"), "[1, 2]")
    with pytest.raises(ModelError, match=r"config\.json must hold a JSON object"):
        read_hf_config(model)
    _write(os.path.join(model, "config.json"), "{")
    with pytest.raises(ConfigError, match=r"^checkpoint-3/config\.json is not valid JSON"):
        read_hf_config(model, "checkpoint-3/config.json", ConfigError)
