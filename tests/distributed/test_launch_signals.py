"""roll-train with nproc_per_node > 1 re-executes itself under a launcher; SIGTERM stops every rank."""

from __future__ import annotations

import signal
import subprocess
import sys

import psutil

from tests.helpers import REPO, clean_env, wait_until


def test_sigterm_stops_all_ranks(tiny_model_dir, tmp_path):
    out = tmp_path / "out"
    recipe = tmp_path / "r.yaml"
    recipe.write_text(f"model_name_or_path: {tiny_model_dir}\nstage: sft\n"
                      "dataset: recipes/demo/data/arithmetic_sft.json\ncutoff_len: 64\n"
                      f"output_dir: {out}\nmax_steps: 100000\nlogging_steps: 1\nsave_strategy: \"no\"\n"
                      "per_device_train_batch_size: 2\nnproc_per_node: 2\nreport_to: none\n")
    log = open(tmp_path / "roll-train.log", "w")
    proc = subprocess.Popen([sys.executable, "-m", "roll.cli", str(recipe)], cwd=REPO, env=clean_env(),
                            stdout=log, stderr=subprocess.STDOUT)
    parent = psutil.Process(proc.pid)
    descendants: list[psutil.Process] = []
    try:
        # Training has started on every rank once the log has a few steps.
        started = wait_until(lambda: (out / "train_log.jsonl").exists()
                            and len((out / "train_log.jsonl").read_text().splitlines()) >= 2, timeout=240)
        assert started, (tmp_path / "roll-train.log").read_text()[-3000:]
        # The launcher's own command line ends in `-m roll.cli` too: count only the ranks it started.
        cmdlines = [" ".join(p.cmdline()) for p in parent.children(recursive=True)]
        ranks = [c for c in cmdlines if "roll.cli" in c and "roll.torchrun" not in c]
        assert len(ranks) == 2, cmdlines
        descendants = parent.children(recursive=True)
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=90)
        # every rank finished its step and saved (save_on_preemption, on by default): the documented 75
        assert proc.returncode == 75, (tmp_path / "roll-train.log").read_text()[-3000:]
        gone, alive = psutil.wait_procs(descendants, timeout=30)
        assert not alive, [p.cmdline() for p in alive]
    finally:  # never leave ranks behind, even when the test fails
        for child in descendants + [parent]:
            try:
                child.kill()
            except psutil.NoSuchProcess:
                pass
        log.close()
