"""The mutation gate's engine: apply one realistic bug (``tests/mutants.py``) to a copy of the tree, run the
tests that should catch it there, and say whether they did.

The real tree is never touched: the tracked (and untracked, not ignored) files are copied once to a
temporary directory, each mutant is written into that copy, its tests run there (``PYTHONPATH`` = the copy,
no bytecode written, so an edited file is always re-read), and the file is restored before the next one. An
anchor that does not occur exactly once is a ``StaleAnchor``: the list is maintained with the code.

``scripts/mutation.py`` (``make mutation``) runs the whole list; ``tests/unit/test_mutation_gate.py`` runs
the cheap subset inside ``make test`` and checks every anchor of the list.
"""

from __future__ import annotations

import os
import queue
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from tests.mutants import Mutant

REPO = Path(__file__).resolve().parent.parent
_SUMMARY = re.compile(r"^(FAILED|ERROR) (\S+)")


class StaleAnchor(Exception):
    """A mutant's anchor no longer occurs exactly once in its file."""


@dataclass
class Outcome:
    """What the listed tests did under one mutant (or on the unmutated tree)."""

    name: str
    status: str
    """``caught`` (some test failed), ``survived`` (all passed), ``timeout``, ``stale`` or ``broken``
    (pytest could not run the listed tests: a wrong node id)."""
    caught_by: list[str]
    seconds: float
    output: str = ""

    @property
    def ok(self) -> bool:
        return self.status == "caught"


def copy_tree(destination: Path, source: Path = REPO) -> Path:
    """The files git knows (tracked, and untracked not ignored) of ``source``, copied under ``destination``."""
    listed = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=source,
                            capture_output=True, check=True).stdout.decode().split("\0")
    for name in filter(None, listed):
        src = source / name
        if not src.is_file():  # deleted in the work tree but still in the index
            continue
        dst = destination / name
        dst.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(src, dst)
    return destination


def patched(text: str, mutant: Mutant) -> str:
    """``text`` with the mutant's anchor replaced; ``StaleAnchor`` unless the anchor occurs exactly once."""
    count = text.count(mutant.anchor)
    if count != 1:
        raise StaleAnchor(f"{mutant.name}: the anchor occurs {count} times in {mutant.file} (must be once); "
                          f"update tests/mutants.py with the code. Anchor:\n{mutant.anchor}")
    return text.replace(mutant.anchor, mutant.replacement)


def check_anchor(mutant: Mutant, root: Path = REPO) -> None:
    patched((root / mutant.file).read_text(encoding="utf-8"), mutant)


def run_tests(root: Path, tests: list[str], timeout: float) -> tuple[str, list[str], float, str]:
    """pytest on ``tests`` in the tree at ``root``: (status, failed node ids, seconds, output tail)."""
    env = {**os.environ, "PYTHONPATH": str(root), "PYTHONDONTWRITEBYTECODE": "1", "OMP_NUM_THREADS": "1",
           "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
           "TOKENIZERS_PARALLELISM": "false", "DS_ACCELERATOR": "cpu"}
    env.pop("CI", None)  # a skip is a skip here: the baseline run reports it
    cmd = [sys.executable, "-m", "pytest", "-q", "-x", "-rfE", "-p", "no:cacheprovider", *tests]
    start = time.monotonic()
    # A session of its own: on a timeout the whole tree (pytest, torchrun, its ranks) is killed.
    proc = subprocess.Popen(cmd, cwd=root, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        return "timeout", [], time.monotonic() - start, out[-3000:]
    except BaseException:  # the gate itself stopped (Ctrl-C): leave no test tree running
        os.killpg(proc.pid, signal.SIGKILL)
        raise
    seconds = time.monotonic() - start
    failed = [match.group(2) for match in map(_SUMMARY.match, out.splitlines()) if match]
    if proc.returncode == 0:
        return "passed", [], seconds, out[-3000:]
    if proc.returncode in (1, 3) or failed:  # tests failed (1) or crashed pytest (3)
        return "failed", failed or ["(pytest exit %d)" % proc.returncode], seconds, out[-3000:]
    return "broken", [], seconds, out[-3000:]  # 2: interrupted/usage, 4: bad node id, 5: nothing collected


def run_mutant(root: Path, mutant: Mutant, timeout: float) -> Outcome:
    """Apply ``mutant`` in the copy at ``root``, run its tests, restore the file."""
    path = root / mutant.file
    original = path.read_text(encoding="utf-8")
    try:
        mutated = patched(original, mutant)
    except StaleAnchor as exc:
        return Outcome(mutant.name, "stale", [], 0.0, str(exc))
    path.write_text(mutated, encoding="utf-8")
    try:
        status, failed, seconds, out = run_tests(root, list(mutant.tests), timeout)
    finally:
        path.write_text(original, encoding="utf-8")
    verdict = {"failed": "caught", "passed": "survived"}.get(status, status)
    return Outcome(mutant.name, verdict, failed, seconds, out)


def run_mutants(roots: list[Path], mutants: list[Mutant], timeout: float) -> list[Outcome]:
    """``run_mutant`` for each of ``mutants``, ``len(roots)`` at a time: each run takes a copy of the tree
    (``roots``, one per worker) no other run is using, so a mutant never sees another's edit. Outcomes in
    the order of ``mutants``."""
    free: queue.Queue[Path] = queue.Queue()
    for root in roots:
        free.put(root)

    def one(mutant: Mutant) -> Outcome:
        root = free.get()
        try:
            return run_mutant(root, mutant, timeout)
        finally:
            free.put(root)

    with ThreadPoolExecutor(max_workers=len(roots)) as pool:
        return list(pool.map(one, mutants))


def baseline(root: Path, mutants: list[Mutant], timeout: float) -> Outcome:
    """The union of the mutants' tests on the unmutated copy: they must pass, or "caught" means nothing."""
    tests = sorted({test for mutant in mutants for test in mutant.tests})
    status, failed, seconds, out = run_tests(root, tests, timeout)
    return Outcome("(unmutated tree)", status, failed, seconds, out)


def temporary_copy() -> tempfile.TemporaryDirectory:
    """A temporary directory to ``copy_tree`` into (removed when closed)."""
    return tempfile.TemporaryDirectory(prefix="roll-mutation-")
