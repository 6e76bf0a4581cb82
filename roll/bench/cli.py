"""roll-bench: the speed ledger. One model and one data set through a plain ``transformers.Trainer``
(the baseline), the standard backend and the mca backend (1 process, DP2, TP2), per dtype, sequence
length and packing; then HF <-> Megatron conversion throughput next to a raw safetensors read.

Every case is a real subprocess (``roll-train`` or ``python -m roll.bench.hf``) with a timeout; the
numbers come from the run's ``train_log.jsonl`` (steps after the warm-up only) and from sampling the
resident memory of its process tree. A case that fails is recorded as failed, with its log tail.
The pure pieces (case plan, log summary) take literal inputs so tests call them directly; the
tables are rendered by ``roll.bench.report``.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import subprocess
import sys
import threading
import time
from dataclasses import asdict, dataclass, field

from roll.bench.prepare import SHAPES, BenchOptions, bf16_support, parse_options, prepare_data, prepare_model
from roll.errors import RollError

logger = logging.getLogger(__name__)

RUNNERS = ("hf", "standard", "mca")
"""(a) plain transformers.Trainer, (b) the standard backend, (c)/(d) the mca backend."""
LAYOUTS = {"1p": (1, 1), "DP2": (2, 1), "TP2": (2, 2)}
"""layout name -> (processes, tensor parallel size)."""
LOG_TAIL_CHARS = 3000


@dataclass(frozen=True)
class Case:
    runner: str
    layout: str
    dtype: str
    seq: int
    packing: bool

    @property
    def processes(self) -> int:
        return LAYOUTS[self.layout][0]

    @property
    def name(self) -> str:
        return f"{self.runner}-{self.layout}-{self.dtype}-s{self.seq}-{'pack' if self.packing else 'nopack'}"

    @property
    def baseline(self) -> Case:
        """The plain-HF case this one is compared to (same dtype, sequence length and packing)."""
        return Case("hf", "1p", self.dtype, self.seq, self.packing)


def _all_runner_layouts() -> list[tuple[str, str]]:
    return [("hf", "1p"), ("standard", "1p"), ("mca", "1p"), ("mca", "DP2"), ("mca", "TP2")]


def plan_cases(options: BenchOptions) -> list[Case]:
    """The cases to run. ``--full``: every runner/layout x dtype x seq x packing. Default: a cut that fits
    in ~10 minutes on 2 cores (every runner/layout at fp32, the first seq, no packing; (a), (b), (c) at the
    other dtypes; (a) and (c) with packing, and at the other seqs with and without packing). ``--quick``:
    every runner/layout at the first seq, no packing (fp32 unless --dtype says otherwise)."""
    seqs, dtypes = options.seqs, options.dtypes
    if options.full:
        cases = [Case(r, lay, d, s, p) for s in seqs for p in (False, True) for d in dtypes
                 for r, lay in _all_runner_layouts()]
    elif options.quick:
        cases = [Case(r, lay, d, seqs[0], False) for d in dtypes for r, lay in _all_runner_layouts()]
    else:
        first = seqs[0]
        cases = [Case(r, lay, "fp32", first, False) for r, lay in _all_runner_layouts()]
        cases += [Case(r, "1p", d, first, False) for d in dtypes if d != "fp32" for r in RUNNERS]
        cases += [Case(r, "1p", "fp32", first, True) for r in ("hf", "mca")]
        cases += [Case(r, "1p", "fp32", s, p) for s in seqs[1:] for p in (False, True) for r in ("hf", "mca")]
    if options.only:
        wanted = set(options.only)
        cases = [c for c in cases if wanted & {c.name, *c.name.split("-")}]
    return cases


# ---- one case -------------------------------------------------------------------------------------


def rows_per_step(case: Case, options: BenchOptions) -> int:
    """Global batch rows: ``tokens_per_step // seq``, at least one per data-parallel rank."""
    dp = case.processes // LAYOUTS[case.layout][1]
    rows = max(1, options.tokens_per_step // case.seq)
    return -(-rows // dp) * dp


def case_recipe(case: Case, options: BenchOptions, model_dir: str, data_path: str, output_dir: str) -> dict:
    """The roll-train recipe of a case (the baseline reads the same one for its data and batch)."""
    processes, tp = LAYOUTS[case.layout]
    rows = rows_per_step(case, options)
    recipe = {
        "model_name_or_path": model_dir, "stage": "pt", "dataset": data_path, "cutoff_len": case.seq,
        "packing": case.packing, "output_dir": output_dir, "overwrite_output_dir": True,
        "per_device_train_batch_size": rows // (processes // tp), "gradient_accumulation_steps": 1,
        "learning_rate": 1.0e-4, "lr_scheduler_type": "constant", "max_steps": options.warmup + options.steps,
        "logging_steps": 1, "save_strategy": "no", "report_to": "none", "seed": 0, "save_hf_model": False,
        "bf16": case.dtype == "bf16", "dataloader_num_workers": options.dataloader_workers,
    }
    if processes > 1:
        recipe.update(nproc_per_node=processes, master_port=_free_port())
    if case.runner == "mca":
        recipe["tensor_model_parallel_size"] = tp
    return recipe


def case_command(case: Case, recipe_path: str, output_dir: str) -> list[str]:
    if case.runner == "hf":
        return [sys.executable, "-m", "roll.bench.hf", recipe_path, output_dir]
    switch = ["--use-mca"] if case.runner == "mca" else []
    return [sys.executable, "-m", "roll.cli", recipe_path, *switch]


def case_env(case: Case, options: BenchOptions) -> dict[str, str]:
    """Threads: the machine's cores split over the case's processes (or --threads per process)."""
    threads = options.threads or max(1, (os.cpu_count() or 1) // case.processes)
    return {**os.environ, "OMP_NUM_THREADS": str(threads), "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
            "TOKENIZERS_PARALLELISM": "false", "PYTHONUNBUFFERED": "1"}


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class MemorySampler:
    """Peak resident memory of a process and all its descendants (summed), sampled every ``interval``
    seconds: the same measure for every case, whatever the backend logs."""

    def __init__(self, pid: int, interval: float = 0.25) -> None:
        self.pid, self.interval, self.peak = pid, interval, 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        import psutil

        try:
            root = psutil.Process(self.pid)
        except psutil.Error:
            return
        while not self._stop.is_set():
            total = 0
            try:
                for proc in [root, *root.children(recursive=True)]:
                    try:
                        total += proc.memory_info().rss
                    except psutil.Error:
                        pass
            except psutil.Error:
                break
            self.peak = max(self.peak, total)
            self._stop.wait(self.interval)

    def stop(self) -> int:
        self._stop.set()
        self._thread.join(timeout=5)
        return self.peak


def summarize_log(records: list[dict], warmup: int) -> dict:
    """Speed and loss from a run's ``train_log.jsonl`` records (one per step), excluding the first
    ``warmup`` steps. tokens/s = timed tokens / timed seconds; each step's tokens are tokens_per_second x
    step_time (a log without step_time: equal tokens per step, so the harmonic mean of tokens/s)."""
    steps = sorted((r for r in records if "loss" in r and "tokens_per_second" in r), key=lambda r: r["step"])
    timed = [r for r in steps if r["step"] > warmup]
    first, last = (steps[0]["loss"], steps[-1]["loss"]) if steps else (None, None)
    out: dict = {"steps_logged": len(steps), "steps_timed": len(timed), "loss": last, "first_loss": first}
    if not timed or any(r["tokens_per_second"] <= 0 for r in timed):
        return out
    if all("step_time" in r for r in timed):
        seconds = sum(r["step_time"] for r in timed)
        tokens = sum(r["tokens_per_second"] * r["step_time"] for r in timed)
        out["tokens_per_second"] = tokens / seconds
        out["step_time"] = seconds / len(timed)
    else:
        out["tokens_per_second"] = len(timed) / sum(1 / r["tokens_per_second"] for r in timed)
    for key in ("mfu", "peak_memory_gb"):
        values = [r[key] for r in timed if r.get(key) is not None]
        if values:
            out[f"logged_{key}"] = max(values) if key == "peak_memory_gb" else sum(values) / len(values)
    return out


def read_log(output_dir: str) -> list[dict]:
    path = os.path.join(output_dir, "train_log.jsonl")
    if not os.path.isfile(path):
        return []
    with open(path, encoding="utf-8") as fh:
        return [json.loads(line) for line in fh if line.strip()]


@dataclass
class CaseResult:
    case: Case
    status: str
    """'ok', 'failed (exit N)', 'timeout (N s)' or 'skipped: reason'."""
    wall_s: float = 0.0
    rows_per_step: int = 0
    peak_rss_gb: float | None = None
    metrics: dict = field(default_factory=dict)
    command: str = ""
    log_tail: str = ""

    def to_dict(self) -> dict:
        return {**asdict(self.case), "name": self.case.name, "processes": self.case.processes,
                **{k: v for k, v in asdict(self).items() if k != "case"}}


def run_case(case: Case, options: BenchOptions, model_dir: str, data_path: str, root: str) -> CaseResult:
    output_dir = os.path.join(root, case.name)
    recipe = case_recipe(case, options, model_dir, data_path, output_dir)
    result = CaseResult(case, "ok", rows_per_step=rows_per_step(case, options))
    result.status, wall, peak = run_process(case, options, recipe, root, case.name)
    result.command = " ".join(case_command(case, os.path.join(root, f"{case.name}.yaml"), output_dir))
    result.peak_rss_gb = round(peak / 2**30, 3)
    result.wall_s = round(wall, 1)
    result.metrics = summarize_log(read_log(output_dir), options.warmup)
    if result.status != "ok" or "tokens_per_second" not in result.metrics:
        with open(os.path.join(root, f"{case.name}.log"), encoding="utf-8", errors="replace") as fh:
            result.log_tail = fh.read()[-LOG_TAIL_CHARS:]
        if result.status == "ok":
            result.status = "failed (no timed steps in train_log.jsonl)"
    return result


def run_process(case: Case, options: BenchOptions, recipe: dict, root: str,
                name: str) -> tuple[str, float, int]:
    """Run ``recipe`` as ``case``'s runner (``ROOT/NAME.yaml``, log ``ROOT/NAME.log``): (status, wall seconds,
    peak resident bytes of its process tree)."""
    os.makedirs(recipe["output_dir"], exist_ok=True)
    recipe_path = os.path.join(root, f"{name}.yaml")
    with open(recipe_path, "w", encoding="utf-8") as fh:
        json.dump(recipe, fh, indent=1)  # JSON is YAML
    command = case_command(case, recipe_path, recipe["output_dir"])
    status = "ok"
    start = time.perf_counter()
    with open(os.path.join(root, f"{name}.log"), "w", encoding="utf-8") as log:
        proc = subprocess.Popen(command, env=case_env(case, options), stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)
        sampler = MemorySampler(proc.pid)
        try:
            code = proc.wait(timeout=options.timeout)
            if code != 0:
                status = f"failed (exit {code})"
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, 9)  # the case's own process group (torchrun and its ranks included)
            proc.wait()
            status = f"timeout ({options.timeout:.0f} s)"
        peak = sampler.stop()
    return status, time.perf_counter() - start, peak


# ---- the whole run --------------------------------------------------------------------------------


def run_bench(options: BenchOptions) -> dict:
    """Prepare the model and data once, run every case and the conversion timings; returns the report."""
    from roll.bench import report as bench_report
    from roll.bench.convert import time_conversion
    from roll.bench.saves import time_saves

    root = os.path.abspath(options.work_dir)
    os.makedirs(root, exist_ok=True)
    report = bench_report.header(options, os.getloadavg())
    started = time.perf_counter()
    model_dir, model_config = prepare_model(os.path.join(root, "model"), options.model_shape)
    data_path = prepare_data(os.path.join(root, "data.jsonl"), options, options.data)
    report["peak_flops"] = bench_report.peak_flops(("fp32", "bf16"))  # bf16's probe decides whether it runs
    bf16_ok, bf16_reason = bf16_support(options.device_kind, report["peak_flops"], options.dtype_forced)
    report["bf16"] = {"supported": bf16_ok, "reason": bf16_reason}
    results: list[CaseResult] = []
    for case in plan_cases(options):
        if case.dtype == "bf16" and not bf16_ok:
            results.append(CaseResult(case, f"skipped: {bf16_reason}"))
            continue
        logger.info("case %s ...", case.name)
        results.append(run_case(case, options, model_dir, data_path, os.path.join(root, "runs")))
        logger.info("case %s: %s, %s tokens/s, %.0f s wall", case.name, results[-1].status,
                    _fmt(results[-1].metrics.get("tokens_per_second")), results[-1].wall_s)
    end_peaks = bench_report.peak_flops(("fp32", "bf16"))
    for name, peak in report["peak_flops"].items():
        peak["probes"] = [peak["flops"], end_peaks[name]["flops"]]
        peak["flops"] = max(peak["probes"])
    report["cases"] = bench_report.case_rows(results, model_config, report["peak_flops"])
    runs = os.path.join(root, "runs")
    report["saves"] = [] if options.no_saves else time_saves(options, model_dir, data_path, runs)
    report["conversion"] = [] if options.no_convert else time_conversion(model_dir, root, options.timeout)
    report["load_end"] = [round(x, 2) for x in os.getloadavg()]
    report["total_wall_s"] = round(time.perf_counter() - started, 1)
    return report


def _fmt(value) -> str:
    return "-" if value is None else f"{value:.1f}"


def main(argv: list[str] | None = None) -> None:
    from roll.bench import report as bench_report
    from roll.logging import setup_logging

    setup_logging()
    try:
        options = parse_options(sys.argv[1:] if argv is None else argv)
        report = run_bench(options)
    except RollError as exc:
        sys.stderr.write(f"roll-bench: {exc}\n")
        raise SystemExit(2) from None
    bench_report.write(report, options)
    failed = [c["name"] for c in report["cases"] if c["status"] not in ("ok",) and
              not c["status"].startswith("skipped")]
    if failed:
        logger.warning("%d case(s) failed: %s (their log tails are in %s)", len(failed), ", ".join(failed),
                       options.json_out)
    raise SystemExit(1 if failed else 0)


__all__ = ["SHAPES", "Case", "plan_cases", "summarize_log", "run_bench", "main"]


if __name__ == "__main__":
    main()
