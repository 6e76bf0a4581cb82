"""How launched standard-backend ranks end: a rank that fails ends the run at once (W2)."""

from __future__ import annotations

import time

from tests.helpers import output_of, torchrun

# The router's shape (set-up, work, teardown in `finally`) on 2 ranks: rank 1 fails while rank 0
# is still busy in what would be a long training step.
_WORKER = """
import os, sys, time
from backends.standard.backend import StandardBackend
from roll.config.parser import resolve

backend = StandardBackend(resolve(dict(stage="sft", output_dir=sys.argv[1], report_to="none"), {}, None))
backend.setup_distributed()
try:
    if os.environ["RANK"] == "1":
        raise RuntimeError("rank 1 failed")
    time.sleep(150)
finally:
    backend.teardown()
"""


def test_a_failing_rank_ends_the_run_without_waiting_for_the_others(tmp_path):
    worker = tmp_path / "worker.py"
    worker.write_text(_WORKER)
    start = time.monotonic()
    # Were the failing rank to wait in a teardown barrier, it would exit only after rank 0's 150 s.
    proc = torchrun(str(worker), str(tmp_path), nproc=2, timeout=120, PYTHONPATH=".")
    elapsed = time.monotonic() - start
    assert proc.returncode == 1, output_of(proc)  # torchrun's code for a failed rank (a RuntimeError: 1)
    assert "rank 1 failed" in proc.stdout + proc.stderr, output_of(proc)
    assert elapsed < 100, f"the run took {elapsed:.0f} s to report a failed rank"
