"""roll-bench's conversion timings: ``roll-convert hf2mca`` and ``mca2hf`` on the bench model, next to a
raw read of the same safetensors files (``safetensors.torch.load_file``) and a raw copy of them (read into
new memory, written to a new file: every conversion must do at least that, so it is this machine's floor).

Each is a subprocess timed from outside (what a user waits for). The time net of start-up is each one's own
time inside its process (roll-convert logs it: from after its imports, Python, torch, transformers, megatron,
which no conversion can avoid, to its files written); next to it the conversions' wall time minus that of a
process that only imports the converter. GB/s uses the HF safetensors bytes of the model (the same bytes
both ways). Each row
also has the process's peak resident memory, and the table states it net of the start-up process's as a
multiple of the model's bytes (one shard here: the bench model is a single file).
"""

from __future__ import annotations

import glob
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time

_RAW_READ = """
import glob, json, sys, time
from safetensors.torch import load_file
start = time.perf_counter()
# load_file maps the file; clone() makes every byte be read, as a conversion must
files = sorted(glob.glob(sys.argv[1] + '/*.safetensors'))
n = sum(t.clone().numel() for f in files for t in load_file(f).values())
print(json.dumps({"read_s": time.perf_counter() - start, "elements": n}))
"""

_RAW_COPY = """
import glob, json, os, sys, time
import torch
start, cpu = time.perf_counter(), time.process_time()
os.makedirs(sys.argv[2], exist_ok=True)
for path in sorted(glob.glob(sys.argv[1] + '/*.safetensors')):
    data = memoryview(torch.empty(os.path.getsize(path), dtype=torch.uint8).numpy())  # new memory, as a model's
    with open(path, 'rb', buffering=0) as src:
        done = 0
        while done < len(data):
            done += src.readinto(data[done:])
    with open(os.path.join(sys.argv[2], os.path.basename(path)), 'wb') as dst:
        dst.write(data)
print(json.dumps({"read_s": time.perf_counter() - start, "cpu_s": time.process_time() - cpu}))
"""


def safetensors_bytes(model_dir: str) -> int:
    return sum(os.path.getsize(f) for f in glob.glob(os.path.join(model_dir, "*.safetensors")))


def _timed(command: list[str], timeout: float, *, stderr_too: bool = False) -> tuple[float, str, str, int, float]:
    """(wall seconds, status, stdout (then stderr with ``stderr_too``), peak RSS bytes, CPU seconds) of one
    subprocess (OMP threads: all cores,
    as a user would run it). The peak is the kernel's own high-water mark of the process's memory
    (``VmHWM``; file pages it maps count too), read every 20 ms while it runs: ``wait4``'s ``ru_maxrss``
    cannot be used, as Linux carries the forking parent's resident size into it (this bench process's
    1.3 GB floored every row on 2026-11-27). CPU seconds (user + system) move far less than wall time when
    other jobs share the machine."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": str(os.cpu_count() or 1)}
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        start = time.perf_counter()
        proc = subprocess.Popen(command, env=env, stdout=out, stderr=err)
        timer = threading.Timer(timeout, proc.kill)
        timer.start()
        hwm = [0]
        watcher = threading.Thread(target=_watch_hwm, args=(proc.pid, hwm), daemon=True)
        watcher.start()
        try:
            _, status, usage = os.wait4(proc.pid, 0)
        finally:
            timer.cancel()
            watcher.join()
        wall = time.perf_counter() - start
        proc.returncode = os.waitstatus_to_exitcode(status)
        out.seek(0)
        err.seek(0)
        stdout, stderr = out.read().decode(errors="replace"), err.read().decode(errors="replace")
    peak, cpu = hwm[0], usage.ru_utime + usage.ru_stime
    if wall >= timeout and proc.returncode < 0:
        return wall, f"timeout ({timeout:.0f} s)", "", peak, cpu
    status_text = "ok" if proc.returncode == 0 else f"failed (exit {proc.returncode}): {stderr[-500:]}"
    return wall, status_text, stdout + stderr if stderr_too else stdout, peak, cpu


def _watch_hwm(pid: int, hwm: list[int]) -> None:
    """Keeps ``hwm[0]`` at the largest ``VmHWM`` (bytes) of process ``pid`` read until it has exited."""
    path = f"/proc/{pid}/status"
    while True:
        try:
            with open(path, encoding="ascii") as fh:
                found = [line for line in fh if line.startswith("VmHWM:")]
        except OSError:
            return  # reaped
        if not found:
            return  # a zombie: its memory is gone, the last reading stands
        hwm[0] = max(hwm[0], int(found[0].split()[1]) * 1024)  # kB
        time.sleep(0.02)


CONVERT_ROUNDS = 3
"""Runs of each conversion; the row gives medians over them."""

STARTUP = "import backends.mca.convert; from roll.fast_exit import end_process; end_process(0)"
"""The import-only process: roll-convert's imports, ended as roll-convert ends (``roll.fast_exit``)."""

_CONVERTED = re.compile(r"converted [0-9.]+ GB of HF weights in ([0-9.]+) s")
"""roll-convert's own line (``convert_cli._log_converted``): the conversion's time after the imports."""


def time_conversion(model_dir: str, root: str, timeout: float) -> list[dict]:
    """Rows: raw read, raw copy, hf2mca, mca2hf; each with bytes, wall_s, GB/s, and the time net of start-up: the
    raw rows' and each conversion's own time inside its process (roll-convert logs it: from after its imports to
    its files written; median over CONVERT_ROUNDS runs), next to the conversions' wall time minus that of an
    import-only process sampled just before each run (``wall_minus_startup_s``, median; each pair in
    ``net_s_rounds``: start-up moves by +-0.5 s between samples even on an idle machine, more than converting
    the bench model takes), and the process's peak RSS next to that of the import-only process.

    Each copy and conversion writes into a directory removed just before its process starts, as converting a
    model into a new folder does: over the previous run's files the file system first frees their blocks (hf2mca
    of the bench model 0.49-0.54 s over an existing output, 0.33-0.38 s into a fresh one; 2026-11-28, idle)."""
    size = safetensors_bytes(model_dir)
    mca_dir, back_dir = os.path.join(root, "convert", "mca"), os.path.join(root, "convert", "hf")
    py = sys.executable
    rows = []
    wall, status, out, rss, cpu = _timed([py, "-c", _RAW_READ, model_dir], timeout)
    read_s = json.loads(out.strip().splitlines()[-1])["read_s"] if status == "ok" else None
    rows.append(_row("raw read (safetensors load_file + clone)", size, wall, status, net=read_s, rss=rss))
    copy_dir = os.path.join(root, "convert", "copy")
    shutil.rmtree(copy_dir, ignore_errors=True)  # every row writes new files (the docstring)
    wall, status, out, rss, cpu = _timed([py, "-c", _RAW_COPY, model_dir, copy_dir], timeout)
    copied = json.loads(out.strip().splitlines()[-1]) if status == "ok" else {}
    rows.append(_row("raw copy (read into new memory + write a new file)", size, wall, status,
                     net=copied.get("read_s"), rss=rss))
    rows[-1]["net_cpu_s"] = round(copied["cpu_s"], 2) if copied else None
    samples: dict[str, list[tuple]] = {"hf2mca": [], "mca2hf": []}
    startups = []  # (wall, peak RSS) of each import-only process
    for _ in range(CONVERT_ROUNDS):  # each run paired with a start-up sample of its own, taken just before it
        for name, src, dst in (("hf2mca", model_dir, mca_dir), ("mca2hf", mca_dir, back_dir)):
            startup, _, _, base_rss, base_cpu = _timed([py, "-c", STARTUP], timeout)
            startups.append((startup, base_rss))
            shutil.rmtree(dst, ignore_errors=True)
            cmd = [py, "-m", "backends.mca.convert_cli", name, "--input", src, "--output", dst]
            wall, status, out, rss, cpu = _timed(cmd, timeout, stderr_too=True)
            own = _CONVERTED.search(out)
            if status == "ok" and own is None:
                status = "failed: no 'converted ... in N s' line in its output"
            own_s = float(own.group(1)) if own else None
            samples[name].append((wall, status, rss, wall - startup, cpu - base_cpu, own_s))
    for name, runs in samples.items():
        status = next((run[1] for run in runs if run[1] != "ok"), "ok")
        own = [run[5] for run in runs if run[5] is not None]
        rows.append(_row(f"roll-convert {name} (TP1)", size, statistics.median(run[0] for run in runs), status,
                         net=statistics.median(own) if own else None, rss=max(run[2] for run in runs)))
        rows[-1]["net_cpu_s"] = round(statistics.median(run[4] for run in runs), 2)
        rows[-1]["wall_minus_startup_s"] = round(statistics.median(run[3] for run in runs), 2)
        rows[-1]["net_s_rounds"] = [round(run[3], 2) for run in runs]
        rows[-1]["own_s_rounds"] = [round(s, 2) for s in own]
    for row in rows:  # the first start-up sample's
        row["startup_s"] = round(startups[0][0], 2)
        row["startup_rss_gb"] = round(startups[0][1] / 1e9, 3)
    return rows


def _row(what: str, size: int, wall: float, status: str, net: float | None, rss: int) -> dict:
    gb = size / 1e9
    return {"what": what, "status": status, "bytes": size, "wall_s": round(wall, 2),
            "gb_per_s": round(gb / wall, 3) if status == "ok" else None,
            "net_s": round(net, 2) if net is not None and status == "ok" else None,
            "net_gb_per_s": round(gb / net, 3) if net and status == "ok" else None,
            "peak_rss_gb": round(rss / 1e9, 3)}
