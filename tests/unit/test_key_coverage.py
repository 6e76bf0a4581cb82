"""Every recipe key has exactly one row in roll/config/coverage.py, every refusal it lists happens at config
time with a message naming the key, the tests it names exist, and docs/keys.md is generated from it."""

from __future__ import annotations

import os
import re

import pytest

from roll.config import parse_args
from roll.config.coverage import ALL_ROWS, BACKENDS, Honoured, Refused
from roll.config.key_table import recipe_keys, render_markdown, resolve
from roll.errors import ConfigError
from tests.helpers import roll_train

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
ALL_KEYS = [key for keys in recipe_keys().values() for key in keys]
INDEX, PROBLEMS = resolve(ALL_KEYS)


def test_every_recipe_key_has_exactly_one_row_and_every_row_a_key():
    assert len(ALL_KEYS) > 170 and "adam_beta1" in ALL_KEYS and "hub_token" in ALL_KEYS  # HF's fields too
    assert PROBLEMS == []
    # A key added to a group without a row, or a row left behind by a removed key, is reported.
    _, problems = resolve(ALL_KEYS + ["a_new_key"])
    assert problems == ["a_new_key: 0 rows (add one to roll/config/coverage.py)"]
    _, problems = resolve([key for key in ALL_KEYS if key != "neftune_noise_alpha"])
    assert problems == ["row 'neftune_noise_alpha': 'neftune_noise_alpha' is no recipe key (remove it)"]


def _honoured(field: str) -> list[str]:
    return sorted({getattr(status, field) for row in ALL_ROWS for b in BACKENDS
                   if isinstance(status := row.status(b), Honoured) and getattr(status, field)})


@pytest.mark.parametrize("reference", _honoured("test"))
def test_named_tests_exist(reference):
    path, _, name = reference.partition("::")
    source = open(os.path.join(ROOT, path), encoding="utf-8").read()
    assert not name or re.search(rf"^\s*def {re.escape(name)}\(", source, re.M), reference


@pytest.mark.parametrize("case", _honoured("parity"))
def test_named_parity_cases_exist(case):
    from roll.parity.cases import get_case

    assert get_case(case).name == case


def test_every_honoured_key_names_its_test_or_says_why_not():
    for row in ALL_ROWS:
        for backend in BACKENDS:
            status = row.status(backend)
            if isinstance(status, Honoured):
                assert bool(status.test or status.parity) != bool(status.gap), (row.keys, backend)


REFUSALS = [(backend, key, INDEX[key].status(backend)) for key in INDEX for backend in BACKENDS
            if isinstance(INDEX[key].status(backend), Refused)]


@pytest.mark.parametrize("backend, key, status", REFUSALS, ids=[f"{b}-{k}" for b, k, _ in REFUSALS])
def test_refused_keys_are_config_errors_naming_the_key_and_the_alternative(recipe, backend, key, status):
    with pytest.raises(ConfigError) as raised:
        value = (status.examples or {}).get(key, status.example)
        parse_args([recipe(**{key: value}), f"use_mca={str(backend == 'mca').lower()}"])
    message = str(raised.value)
    assert key in message
    if not status.by:  # refused by roll.config.key_table: the row's own text
        assert message.endswith(f": {status.use}."), message


@pytest.mark.parametrize("argv", [
    ["optim=adamw_torch"], ["dtype=float32", "bf16=true"], ["data_seed=null"],
    ["hub_model_id=me/model"], ["tensor_model_parallel_size=1", "deepspeed=recipes/deepspeed/ds_z2.json"],
])
def test_accepted_values_pass_on_mca(recipe, argv):
    parse_args([recipe(), "--use-mca", *argv])


def test_the_command_line_exits_2_on_a_refused_key(recipe):
    proc = roll_train(recipe(), "--use-mca", "optim=adafactor", "--print-config", timeout=120)
    assert proc.returncode == 2, proc.stderr
    assert "optim='adafactor' is not available on the mca backend" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_docs_keys_md_is_generated_from_the_table():
    with open(os.path.join(ROOT, "docs", "keys.md"), encoding="utf-8") as fh:
        assert fh.read() == render_markdown(), "docs/keys.md is stale: run python scripts/update_key_table.py"
