"""Recipe regression tests: every demo recipe (pt, sft, dpo, kto, lora, orpo, simpo, rm, vl_sft) trains STEPS steps
on CPU on each backend (standard: 1 process, in this process; mca: 1 process, TP1, one torchrun job for all recipes),
and its loss at every step must equal the golden value in tests/recipes/goldens.json within GOLDEN, and
the two backends must agree within BACKEND (tests/bounds.py: both measured, with the measurement written
there). Also: every run writes loss.png.

The goldens are regenerated only by hand (scripts/update_goldens.py, which writes into goldens.json the
command, the library versions and the commit that produced them), never by a test: the last test here
checks that the file is byte for byte what it was before these runs.
"""

from __future__ import annotations

import os

import pytest

from tests.bounds import BACKEND, GOLDEN, Comparison, assert_within
from tests.recipes.recipe_runs import (GOLDENS, RECIPES, STEPS, VL_RECIPES, make_vl_demo, read_goldens, run_mca,
                                      run_standard, run_vl_standard)

REGENERATE = ("If the change of the losses is intended, regenerate the goldens with "
              "`OMP_NUM_THREADS=1 python scripts/update_goldens.py` and say in the commit message why the "
              "losses changed.")


@pytest.fixture(scope="module")
def goldens_before() -> bytes:
    """goldens.json as it was before this module's runs (requested by the first test, so taken first)."""
    with open(GOLDENS, "rb") as fh:
        return fh.read()


@pytest.fixture(scope="module")
def tiny_model(tiny_model_factory) -> str:
    return tiny_model_factory("qwen2")  # the model scripts/update_goldens.py builds


@pytest.fixture(scope="module")
def runs_root(tmp_path_factory) -> str:
    return str(tmp_path_factory.mktemp("recipe_runs"))


@pytest.fixture(scope="module")
def vl_demo(runs_root) -> tuple[str, str]:
    """The tiny Qwen2.5-VL and its generated pictures (docs/vl.md), for VL_RECIPES."""
    return make_vl_demo(runs_root)


@pytest.fixture(scope="module")
def standard_losses(tiny_model, vl_demo, runs_root) -> dict[str, list[float]]:
    losses = {name: run_standard(name, tiny_model, os.path.join(runs_root, name, "standard")) for name in RECIPES}
    return {**losses, **{name: run_vl_standard(name, *vl_demo, os.path.join(runs_root, name, "standard"))
                         for name in VL_RECIPES}}


@pytest.fixture(scope="module")
def mca_losses(tiny_model, vl_demo, runs_root) -> dict[str, list[float]]:
    pytest.importorskip("megatron.core")
    return run_mca(RECIPES + VL_RECIPES, tiny_model, runs_root, vl_demo)


def golden_comparison(name: str, backend: str, losses: list[float]) -> Comparison:
    return Comparison(f"recipes/demo/{name}.yaml on {backend}", losses, read_goldens()["losses"][name][backend],
                      GOLDEN)


def _check_golden(name: str, backend: str, losses: list[float]) -> None:
    comparison = golden_comparison(name, backend, losses)
    assert not comparison.failures(), ("per-step losses differ from tests/recipes/goldens.json: "
                                       + "; ".join(comparison.failures())
                                       + f"\n  got    {losses}\n  golden {comparison.reference}\n{REGENERATE}")


def test_goldens_cover_every_recipe_and_backend_and_say_how_they_were_made(goldens_before):
    goldens = read_goldens()
    assert goldens["steps"] == STEPS
    for name in RECIPES + VL_RECIPES:
        for backend in ("standard", "mca"):
            values = goldens["losses"][name][backend]
            assert len(values) == STEPS and all(v > 0 for v in values), (name, backend, values)
    assert goldens["generated_by"].startswith("OMP_NUM_THREADS=1 python scripts/update_goldens.py"), goldens
    for key in ("torch", "transformers", "trl", "peft", "megatron-core", "python", "commit", "date"):
        assert goldens["environment"].get(key), (key, goldens["environment"])


@pytest.mark.parametrize("name", RECIPES + VL_RECIPES)
def test_standard_backend_matches_goldens(standard_losses, runs_root, name):
    """VL_RECIPES: the tiny Qwen2.5-VL on generated pictures (images in the batch, the vision tower frozen)."""
    _check_golden(name, "standard", standard_losses[name])
    assert os.path.isfile(os.path.join(runs_root, name, "standard", "loss.png"))


@pytest.mark.distributed
@pytest.mark.mca
@pytest.mark.parametrize("name", RECIPES + VL_RECIPES)
def test_mca_backend_matches_goldens(mca_losses, runs_root, name):
    _check_golden(name, "mca", mca_losses[name])
    assert os.path.isfile(os.path.join(runs_root, name, "mca", "loss.png"))


def backend_comparison(name: str, standard: list[float], mca: list[float]) -> Comparison:
    return Comparison(f"recipes/demo/{name}.yaml mca vs standard", mca, standard, BACKEND)


@pytest.mark.distributed
@pytest.mark.mca
@pytest.mark.parametrize("name", RECIPES + VL_RECIPES)
def test_both_backends_agree(standard_losses, mca_losses, name):
    assert_within([backend_comparison(name, standard_losses[name], mca_losses[name])])


def test_the_checking_runs_left_goldens_untouched(goldens_before, standard_losses):
    """Last in this module: after every run above, goldens.json is byte for byte what it was."""
    with open(GOLDENS, "rb") as fh:
        assert fh.read() == goldens_before, "a test run rewrote tests/recipes/goldens.json"
