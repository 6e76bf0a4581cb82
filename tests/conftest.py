"""Shared fixtures: tiny models and the test tokenizer, built once per session (no hub access)."""

from __future__ import annotations

import logging
import os

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("DS_ACCELERATOR", "cpu")


@pytest.fixture(scope="session")
def tiny_model_factory(tmp_path_factory):
    """``make(kind='qwen2', tokenizer='bpe', **config_overrides) -> model dir``, cached per session."""
    from roll.tiny import make_tiny_model

    cache: dict[tuple, str] = {}

    def make(kind: str = "qwen2", tokenizer: str = "bpe", **overrides) -> str:
        key = (kind, tokenizer, tuple(sorted(overrides.items())))
        if key not in cache:
            out = str(tmp_path_factory.mktemp(f"tiny_{kind}_{tokenizer}"))
            cache[key] = make_tiny_model(out, kind=kind, tokenizer=tokenizer, **overrides)
        return cache[key]

    return make


@pytest.fixture(scope="session")
def tiny_model_dir(tiny_model_factory) -> str:
    """A tiny Qwen2 (hidden 64, 2 layers, GQA 4/2, tied embeddings) with a 512-token BPE tokenizer."""
    return tiny_model_factory("qwen2")


@pytest.fixture(scope="session")
def bpe():
    """The 512-token byte-level BPE test tokenizer with ChatML specials (roll.tiny). Do not mutate it:
    tests that change its template or specials build their own."""
    from roll.tiny import build_bpe_tokenizer

    return build_bpe_tokenizer()


@pytest.fixture
def roll_warnings(caplog, monkeypatch):
    """``caplog`` capturing roll's warnings: the warn-once memory is cleared (an earlier test may
    already have emitted the message) and the 'roll' logger propagates (setup_logging turns it off)."""
    from roll import logging as roll_logging

    monkeypatch.setattr(roll_logging, "_warned", set())
    monkeypatch.setattr(logging.getLogger("roll"), "propagate", True)
    caplog.set_level(logging.WARNING, logger="roll")
    return caplog
