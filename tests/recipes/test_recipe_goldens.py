"""Recipe regression tests: every demo recipe (pt, sft, dpo, lora) trains STEPS steps on CPU on each
backend (standard: 1 process, in this process; mca: 1 process, TP1, one torchrun job for all recipes),
and its per-step losses must equal the golden values in tests/recipes/goldens.json within GOLDEN_RTOL,
and the two backends must agree within BACKEND_RTOL. Also: every run writes loss.png.

The goldens are regenerated only by hand (scripts/update_goldens.py), never by a test.
"""

from __future__ import annotations

import os

import pytest

from roll.parity_report import DEFAULT_TOLERANCE
from tests.recipes.recipe_runs import RECIPES, STEPS, read_goldens, run_mca, run_standard

GOLDEN_RTOL = 1e-4
"""Relative difference allowed against the goldens: CPU fp32 runs repeat to ~1e-7 here; 1e-4 leaves room
for another BLAS or thread count, and is far below what a changed loss, mask or shift does (>1e-2)."""
BACKEND_RTOL = DEFAULT_TOLERANCE
"""Relative difference allowed between the standard and mca backends at any step (roll-parity's default)."""
REGENERATE = ("If the change of the losses is intended, regenerate the goldens with "
              "`OMP_NUM_THREADS=1 python scripts/update_goldens.py` and say in the commit message why the "
              "losses changed.")


@pytest.fixture(scope="module")
def tiny_model(tiny_model_factory) -> str:
    return tiny_model_factory("qwen2")  # the model scripts/update_goldens.py builds


@pytest.fixture(scope="module")
def runs_root(tmp_path_factory) -> str:
    return str(tmp_path_factory.mktemp("recipe_runs"))


@pytest.fixture(scope="module")
def standard_losses(tiny_model, runs_root) -> dict[str, list[float]]:
    return {name: run_standard(name, tiny_model, os.path.join(runs_root, name, "standard")) for name in RECIPES}


@pytest.fixture(scope="module")
def mca_losses(tiny_model, runs_root) -> dict[str, list[float]]:
    pytest.importorskip("megatron.core")
    return run_mca(RECIPES, tiny_model, runs_root)


def _mismatches(losses: list[float], reference: list[float], rtol: float) -> list[str]:
    if len(losses) != len(reference):
        return [f"{len(losses)} logged steps, expected {len(reference)}"]
    return [f"step {step}: {a:.8f} vs {b:.8f} (rel {abs(a - b) / abs(b):.2e})"
            for step, (a, b) in enumerate(zip(losses, reference), start=1) if abs(a - b) > rtol * abs(b)]


def _check_golden(name: str, backend: str, losses: list[float]) -> None:
    golden = read_goldens()["losses"][name][backend]
    bad = _mismatches(losses, golden, GOLDEN_RTOL)
    assert not bad, (f"recipes/demo/{name}.yaml on the {backend} backend: per-step losses differ from "
                     f"tests/recipes/goldens.json beyond {GOLDEN_RTOL:g} (relative): " + "; ".join(bad)
                     + f"\n  got    {losses}\n  golden {golden}\n{REGENERATE}")


def test_goldens_cover_every_recipe_and_backend():
    goldens = read_goldens()
    assert goldens["steps"] == STEPS
    for name in RECIPES:
        for backend in ("standard", "mca"):
            values = goldens["losses"][name][backend]
            assert len(values) == STEPS and all(v > 0 for v in values), (name, backend, values)


@pytest.mark.parametrize("name", RECIPES)
def test_standard_backend_matches_goldens(standard_losses, runs_root, name):
    _check_golden(name, "standard", standard_losses[name])
    assert os.path.isfile(os.path.join(runs_root, name, "standard", "loss.png"))


@pytest.mark.distributed
@pytest.mark.mca
@pytest.mark.parametrize("name", RECIPES)
def test_mca_backend_matches_goldens(mca_losses, runs_root, name):
    _check_golden(name, "mca", mca_losses[name])
    assert os.path.isfile(os.path.join(runs_root, name, "mca", "loss.png"))


@pytest.mark.distributed
@pytest.mark.mca
@pytest.mark.parametrize("name", RECIPES)
def test_both_backends_agree(standard_losses, mca_losses, name):
    bad = _mismatches(mca_losses[name], standard_losses[name], BACKEND_RTOL)
    assert not bad, (f"recipes/demo/{name}.yaml: the mca backend's losses differ from the standard backend's "
                     f"beyond {BACKEND_RTOL:g} (relative): " + "; ".join(bad))
