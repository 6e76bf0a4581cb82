"""The mutation gate's cheap part, inside ``make test``: every anchor of tests/mutants.py still matches
exactly once (the list is maintained with the code, the full gate is ``make mutation``), and each ``fast``
mutant, applied to a copy of the tree, makes its tests fail. The same tests pass on the real tree in this
very run; a control mutant that changes nothing must survive in the copy, so a broken copy cannot pass off
every mutant as caught."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from tests.mutants import MUTANTS, Mutant
from tests.mutation_gate import REPO, StaleAnchor, check_anchor, copy_tree, run_mutant

FAST = [mutant for mutant in MUTANTS if mutant.fast]
TIMEOUT = 300
"""Seconds per pytest run in the copy: each takes about 7 s of CPU on an idle machine."""


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


@pytest.fixture(scope="module")
def tree(tmp_path_factory) -> Path:
    return copy_tree(tmp_path_factory.mktemp("mutation-tree"))


def test_a_mutant_that_changes_nothing_survives(tree):
    model = next(mutant for mutant in FAST if not mutant.file.startswith("backends/mca/"))  # no Megatron needed
    control = Mutant("control", "no change", model.file, model.anchor, model.anchor, model.tests)
    outcome = run_mutant(tree, control, TIMEOUT)
    assert outcome.status == "survived", outcome.output


@pytest.mark.parametrize("mutant", FAST, ids=[mutant.name for mutant in FAST])
def test_fast_mutant_is_caught(tree, mutant):
    if mutant.file.startswith("backends/mca/"):
        pytest.importorskip("megatron.core")  # its tests skip without it, and a skipped test catches nothing
    outcome = run_mutant(tree, mutant, TIMEOUT)
    assert outcome.status == "caught", (f"{mutant.name} ({mutant.bug}) {outcome.status} {mutant.tests}:\n"
                                        f"{outcome.output}")
    assert (REPO / mutant.file).read_text(encoding="utf-8").count(mutant.anchor) == 1  # the real tree untouched
