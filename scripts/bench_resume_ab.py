"""A/B of an mca resume: two checkouts of roll resume the same checkpoint of the bench model in one command,
interleaved, so that both see the same load (the ledger's rule for speed comparisons on a shared machine).

    python scripts/bench_resume_ab.py --before /path/to/old/checkout --after . --model outputs/bench/model \
        --rounds 2 --work-dir /tmp/resume-ab

Once, from ``after``: a 1-process ``--use-mca`` run (fp32, the bench model, the demo's arithmetic sft data) trains
one step and saves ``checkpoint-1`` (weights and Adam's state). Then each round resumes it with ``before`` then
``after``: a whole ``roll.router.run`` in a fresh process (the production path; nothing left to train), with
``backends.mca.trainer.checkpointing.load`` timed inside the process: CPU seconds (user + system of every thread)
and wall seconds of the load; its peak memory, the kernel's high-water mark (``VmHWM``, reset through
``/proc/self/clear_refs`` as the load starts) minus the resident size before it; and its transient, that mark
minus the resident size after it. The optimizer's Adam state is created inside the load (both checkouts:
Megatron's ``init_state_fn``), so the peak holds it (2x the weights) plus the transient. The same process measures
the online HF -> Megatron load at the run's start (``load_hf_weights``, the reader of ``roll-convert hf2mca``) the
same way, its transient as a multiple of the largest safetensors shard. Last, the arithmetic of the resume's
transient for a 7B shape (``--shape``).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

_RUN = """
import json, os, sys, time
import torch.distributed as dist
from backends.mca.models import auto
from backends.mca.trainer import checkpointing
from roll.config.parser import resolve
from roll.logging import setup_logging
from roll.router import run

def status(field):
    with open("/proc/self/status") as fh:
        return next(int(line.split()[1]) * 1024 for line in fh if line.startswith(field + ":"))

measured = {}

def timed(name, function):
    def wrapper(*args, **kwargs):
        with open("/proc/self/clear_refs", "w") as fh:
            fh.write("5")  # VmHWM := VmRSS
        before, cpu, wall = status("VmRSS"), time.process_time(), time.perf_counter()
        done = function(*args, **kwargs)
        measured[name] = dict(cpu_s=time.process_time() - cpu, wall_s=time.perf_counter() - wall,
                              rss_before=before, peak_extra=status("VmHWM") - before,
                              transient=status("VmHWM") - status("VmRSS"))
        return done
    return wrapper

checkpointing.load = timed("resume", checkpointing.load)
auto.load_hf_weights = timed("hf_load", auto.load_hf_weights)
setup_logging("WARNING")
dist.init_process_group("gloo")
run(resolve(json.loads(sys.argv[1]), {}, None))
print("MEASURED " + json.dumps(measured))
"""


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _run(repo: str, recipe: dict, timeout: float) -> dict:
    env = {**os.environ, "PYTHONPATH": repo, "HF_HUB_OFFLINE": "1", "RANK": "0", "LOCAL_RANK": "0",
           "WORLD_SIZE": "1", "LOCAL_WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_free_port()),
           "OMP_NUM_THREADS": str(os.cpu_count() or 1)}
    proc = subprocess.run([sys.executable, "-c", _RUN, json.dumps(recipe)], cwd=repo, env=env, capture_output=True,
                          text=True, timeout=timeout)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("MEASURED ")]
    if proc.returncode != 0 or not lines:
        raise SystemExit(f"run failed in {repo} (exit {proc.returncode}):\n{proc.stderr[-4000:]}")
    return json.loads(lines[-1].split(" ", 1)[1])


def resume_transient(shape_name: str) -> str:
    """The load's transient on top of the model and its Adam state, one process at the saved layout, fp32: PyTorch's
    reader stages the largest tensor twice (the file slice in a BytesIO, then ``torch.load`` of it) and Megatron
    concatenates every layer's gate/up halves into new tensors for the weights and both Adam moments, all held
    until the state dicts are applied; roll's reader reads each into place and merges into the tensor itself."""
    from roll.plan.shape import KNOWN_SHAPES

    shape = KNOWN_SHAPES[shape_name]
    h, f, v, layers = shape.hidden_size, shape.intermediate_size, shape.vocab_size, shape.num_layers
    gate_up = 2 * f * h * 4 * layers * 3  # weights, exp_avg, exp_avg_sq
    staged = 2 * v * h * 4
    state = shape.total_params() * 4 * 3
    return (f"{shape_name}, fp32, one process: weights + Adam state {state / 1e9:.1f} GB; the old load adds "
            f"{(gate_up + staged) / 1e9:.1f} GB ({gate_up / 1e9:.1f} GB of concatenated gate/up for the weights and "
            f"both moments, {staged / 1e9:.1f} GB staging the embedding), the direct load 0")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--before", required=True, help="checkout of roll timed first in each round")
    parser.add_argument("--after", required=True, help="checkout of roll timed second in each round")
    parser.add_argument("--model", required=True, help="HF model directory (roll-bench's: outputs/bench/model)")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--work-dir", default="outputs/resume-ab")
    parser.add_argument("--shape", default="qwen2.5-7b")
    parser.add_argument("--timeout", type=float, default=900.0)
    args = parser.parse_args()
    work = os.path.abspath(args.work_dir)
    after = os.path.abspath(args.after)
    base = {"model_name_or_path": os.path.abspath(args.model), "stage": "sft", "cutoff_len": 64,
            "dataset": os.path.join(after, "recipes", "demo", "data", "arithmetic_sft.json"),
            "per_device_train_batch_size": 2, "learning_rate": 1e-4, "max_steps": 1, "logging_steps": 1,
            "report_to": "none", "seed": 0, "save_hf_model": False, "use_mca": True, "nproc_per_node": 1}
    checkpoint = os.path.join(work, "trained", "checkpoint-1")
    if not os.path.isdir(checkpoint):
        _run(after, {**base, "output_dir": os.path.dirname(checkpoint), "save_strategy": "steps", "save_steps": 1},
             args.timeout)
    size = sum(os.path.getsize(os.path.join(checkpoint, f)) for f in os.listdir(checkpoint) if f.endswith(".distcp"))
    print(f"checkpoint {checkpoint}: {size / 1e9:.2f} GB of weights and Adam state")
    results: dict[str, list] = {}
    model_bytes = sum(os.path.getsize(os.path.join(args.model, f)) for f in os.listdir(args.model)
                      if f.endswith(".safetensors"))  # fp32 files into the fp32 model: the model's bytes
    largest_shard = max(os.path.getsize(os.path.join(args.model, f)) for f in os.listdir(args.model)
                        if f.endswith(".safetensors"))
    for round_ in range(args.rounds):
        for name, repo in (("before", args.before), ("after", args.after)):
            load = os.getloadavg()
            got = _run(os.path.abspath(repo), {**base, "resume_from_checkpoint": checkpoint, "save_strategy": "no",
                                               "output_dir": os.path.join(work, f"{name}-{round_}")}, args.timeout)
            results.setdefault(name, []).append({**got, "load": load})
            resume, hf = got["resume"], got["hf_load"]
            print(f"round {round_} {name:>6}: resume CPU {resume['cpu_s']:.2f} s, wall {resume['wall_s']:.2f} s, peak "
                  f"+{resume['peak_extra'] / 1e9:.2f} GB over the {resume['rss_before'] / 1e9:.2f} GB before it, "
                  f"{resume['transient'] / 1e9:.3f} GB above the resident size after it; online HF load CPU "
                  f"{hf['cpu_s']:.2f} s, peak +{hf['peak_extra'] / 1e9:.3f} GB (the model: {model_bytes / 1e9:.3f} GB), "
                  f"{hf['transient'] / largest_shard:.3f}x the largest shard above the resident size after it "
                  f"(load average {load[0]:.1f} at start, {os.getloadavg()[0]:.1f} at end)", flush=True)
    print(resume_transient(args.shape))
    with open(os.path.join(work, "ab.json"), "w", encoding="utf-8") as fh:
        json.dump(results, fh, indent=1)


if __name__ == "__main__":
    main()
