"""The mutation gate's cheap part, inside ``make test``: every anchor of tests/mutants.py still matches
exactly once (the list is maintained with the code, the full gate is ``make mutation``), and each ``fast``
mutant, applied to a copy of the tree, makes its tests fail. The same tests pass on the real tree in this
very run; a control mutant that changes nothing must survive in the copy, so a broken copy cannot pass off
every mutant as caught. The mutants run two at a time, each pytest run in a copy of the tree of its own."""

from __future__ import annotations

import ast
import importlib.util

import pytest

from tests.mutants import MUTANTS, Mutant
from tests.mutation_gate import REPO, Outcome, StaleAnchor, check_anchor, copy_tree, run_mutants

FAST = [mutant for mutant in MUTANTS if mutant.fast]
TIMEOUT = 300
"""Seconds per pytest run in the copy: each takes about 7 s of CPU on an idle machine."""
WORKERS = 2
"""pytest runs at a time: each is one mostly single-threaded process (OMP_NUM_THREADS=1), CI has 2 cores."""
_CASE_TEST = "test_fast_mutant_is_caught"
_CONTROL_TEST = "test_a_mutant_that_changes_nothing_survives"


def test_every_anchor_matches_exactly_once_and_names_are_unique():
    stale = []
    for mutant in MUTANTS:
        try:
            check_anchor(mutant)
        except (StaleAnchor, OSError) as exc:
            stale.append(str(exc))
    assert not stale, "\n".join(stale)
    names = [mutant.name for mutant in MUTANTS]
    assert len(names) == len(set(names)), names


def test_every_listed_test_exists():
    """A renamed test would make its mutant look caught (pytest fails on an unknown node id)."""
    missing = []
    for mutant in MUTANTS:
        for node in mutant.tests:
            path, _, name = node.partition("::")
            file = REPO / path
            functions = ({n.name for n in ast.walk(ast.parse(file.read_text(encoding="utf-8")))
                          if isinstance(n, ast.FunctionDef)} if file.is_file() else set())
            if name.split("[")[0] not in functions:
                missing.append(f"{mutant.name}: {node}")
    assert not missing, missing


def _control() -> Mutant:
    """A mutant that changes nothing (its anchor replaced by itself), with a fast mutant's tests."""
    model = next(mutant for mutant in FAST if not mutant.file.startswith("backends/mca/"))  # no Megatron needed
    return Mutant("control", "no change", model.file, model.anchor, model.anchor, model.tests)


@pytest.fixture(scope="module")
def outcomes(request, tmp_path_factory) -> dict[str, Outcome]:
    """The selected fast mutants' runs (and the control's), WORKERS at a time, by mutant name."""
    items = request.session.items
    names = {item.callspec.params["mutant"].name for item in items
             if getattr(item, "originalname", "") == _CASE_TEST and hasattr(item, "callspec")}
    has_megatron = importlib.util.find_spec("megatron") is not None  # else those tests skip: nothing to run
    selected = [mutant for mutant in FAST if mutant.name in names
                and (has_megatron or not mutant.file.startswith("backends/mca/"))]
    if any(getattr(item, "originalname", "") == _CONTROL_TEST for item in items):
        selected.insert(0, _control())
    roots = [copy_tree(tmp_path_factory.mktemp("mutation-tree")) for _ in range(max(1, min(WORKERS, len(selected))))]
    return {mutant.name: outcome for mutant, outcome in zip(selected, run_mutants(roots, selected, TIMEOUT))}


def test_a_mutant_that_changes_nothing_survives(outcomes):
    outcome = outcomes["control"]
    assert outcome.status == "survived", outcome.output


@pytest.mark.parametrize("mutant", FAST, ids=[mutant.name for mutant in FAST])
def test_fast_mutant_is_caught(outcomes, mutant):
    if mutant.file.startswith("backends/mca/"):
        pytest.importorskip("megatron.core")  # its tests skip without it, and a skipped test catches nothing
    outcome = outcomes[mutant.name]
    assert outcome.status == "caught", (f"{mutant.name} ({mutant.bug}) {outcome.status} {mutant.tests}:\n"
                                        f"{outcome.output}")
    assert (REPO / mutant.file).read_text(encoding="utf-8").count(mutant.anchor) == 1  # the real tree untouched
