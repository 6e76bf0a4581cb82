"""TEMPORARY: ``real_model_dir`` until issue 32's real-model fixture (tests/conftest.py, roll.real_model) is
merged; then delete this file. Same name and type (a str path); it reads ROLL_REAL_MODEL_DIR and skips
without it."""

from __future__ import annotations

import os
from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def real_model_dir() -> str:
    path = os.environ.get("ROLL_REAL_MODEL_DIR")
    if not path or not (Path(path) / "config.json").is_file():
        pytest.skip("real model unavailable: set ROLL_REAL_MODEL_DIR to an HF directory of SmolLM2-135M-Instruct")
    return str(Path(path))
