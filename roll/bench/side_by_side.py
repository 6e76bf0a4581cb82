"""roll against LLaMA-Factory, whole command to whole command: the same model, data and settings trained by
``llamafactory-cli train``, ``roll-train`` (standard backend) and ``roll-train --use-mca``, each a fresh
process timed from outside (start-up, data, model load, training, the final save and exit), in interleaved
rounds so that a change of the machine's load hits the three alike.

The setting (issue 20's "held-out side by side"): supervised fine-tuning on alpaca-format rows, full
fine-tuning, fp32, one process, a constant learning rate, ``steps`` optimizer steps, the final model saved
(LLaMA-Factory always saves it at the end; roll's ``save_hf_model``), no intermediate checkpoints. The model
is roll-bench's ``bench`` shape (roll.bench.prepare.SHAPES: a Qwen2 of hidden 512, 8 layers, the real
Qwen2.5 vocabulary), written so that LLaMA-Factory's older transformers reads it as roll's does (the
original Qwen2.5 tokenizer files, ``rope_theta`` and ``torch_dtype`` at the top of config.json). The data is
generated (seeded, ``roll.bench.data.write_rows``): alpaca rows of English words, about 170 tokens a row.
Both tools use the same chat format (``template: qwen``, LLaMA-Factory's layout, with the system prompt "You
are a helpful assistant." as ``default_system`` for both).

Each run's log file is polled while it runs, so its wall time splits into: before the first step is logged
(start-up, data, model load, step 1), the loop (steps 2..N) and after the last step (save and exit).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field

TOOLS = ("llamafactory", "standard", "mca")
SYSTEM = "You are a helpful assistant."
DATASET = "roll_side_by_side"
@dataclass
class Settings:
    steps: int = 12
    batch_size: int = 2
    """Rows per optimizer step (one process, no gradient accumulation)."""
    cutoff_len: int = 256
    learning_rate: float = 1.0e-4
    threads: int = 0
    """torch threads of every run (0: all cores)."""
    rows: int = 0
    """Rows of generated data (0: enough for every step twice over)."""
    timeout: float = 900.0


def prepare_data(data_dir: str, settings: Settings) -> str:
    """The alpaca file (and LLaMA-Factory's ``dataset_info.json`` naming it) in ``data_dir``; its path."""
    from roll.bench.data import write_rows

    os.makedirs(data_dir, exist_ok=True)
    rows = settings.rows or max(64, 2 * settings.steps * settings.batch_size)
    path = os.path.join(data_dir, f"{DATASET}-{rows}.jsonl")
    write_rows(path, rows)  # seeded: the same rows for every tool and every run
    with open(os.path.join(data_dir, "dataset_info.json"), "w", encoding="utf-8") as fh:
        json.dump({DATASET: {"file_name": os.path.basename(path)}}, fh, indent=1)
    return path


def prepare_model(model_dir: str) -> str:
    """roll-bench's ``bench`` model, readable by LLaMA-Factory's transformers too (see the module doc)."""
    from roll.bench.prepare import prepare_model as bench_model
    from roll.demo.tiny_model import qwen_tokenizer_dir

    bench_model(model_dir, "bench")
    config_path = os.path.join(model_dir, "config.json")
    with open(config_path, encoding="utf-8") as fh:
        config = json.load(fh)
    rope = (config.get("rope_parameters") or {}).get("rope_theta", config.get("rope_theta", 10000.0))
    config.update(rope_theta=rope, torch_dtype="float32")
    with open(config_path, "w", encoding="utf-8") as fh:
        json.dump(config, fh, indent=1)
    source = qwen_tokenizer_dir()
    for name in os.listdir(source):  # the original files: transformers 5 writes a format 4.x cannot read
        shutil.copy(os.path.join(source, name), os.path.join(model_dir, name))
    for stale in ("special_tokens_map.json", "added_tokens.json", "chat_template.jinja"):
        if stale not in os.listdir(source) and os.path.exists(os.path.join(model_dir, stale)):
            os.remove(os.path.join(model_dir, stale))
    return model_dir


def common_keys(model_dir: str, output_dir: str, settings: Settings) -> dict:
    """The keys both tools read alike (both are HF TrainingArguments underneath)."""
    return {"model_name_or_path": model_dir, "stage": "sft", "finetuning_type": "full",
            "cutoff_len": settings.cutoff_len, "output_dir": output_dir, "overwrite_output_dir": True,
            "per_device_train_batch_size": settings.batch_size, "gradient_accumulation_steps": 1,
            "learning_rate": settings.learning_rate, "lr_scheduler_type": "constant", "warmup_ratio": 0.0,
            "max_steps": settings.steps, "logging_steps": 1, "save_strategy": "no", "report_to": "none",
            "seed": 0, "bf16": False, "dataloader_num_workers": 0}


def llamafactory_config(model_dir: str, data_dir: str, output_dir: str, settings: Settings) -> dict:
    return {**common_keys(model_dir, output_dir, settings), "do_train": True, "dataset": DATASET,
            "dataset_dir": data_dir, "template": "qwen", "default_system": SYSTEM, "overwrite_cache": True,
            "plot_loss": False}


def roll_recipe(model_dir: str, data_path: str, output_dir: str, settings: Settings) -> dict:
    return {**common_keys(model_dir, output_dir, settings), "dataset": data_path, "template": "qwen",
            "default_system": SYSTEM}


def log_file(tool: str, output_dir: str) -> str:
    """The file a run appends one line to per logged step."""
    return os.path.join(output_dir, "trainer_log.jsonl" if tool == "llamafactory" else "train_log.jsonl")


def command(tool: str, config_path: str, llamafactory_cli: str) -> list[str]:
    if tool == "llamafactory":
        return [llamafactory_cli, "train", config_path]
    return [sys.executable, "-m", "roll.cli", config_path, *(["--use-mca"] if tool == "mca" else [])]


def environment(tool: str, settings: Settings, cache_dir: str) -> dict[str, str]:
    """Offline, the same threads, a fresh datasets cache (every run tokenizes its data, as a first run does).
    LLaMA-Factory's interpreter lives in its own venv: none of roll's PYTHONPATH reaches it."""
    env = {**os.environ, "OMP_NUM_THREADS": str(settings.threads or os.cpu_count() or 1),
           "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
           "TOKENIZERS_PARALLELISM": "false", "HF_DATASETS_CACHE": cache_dir, "PYTHONUNBUFFERED": "1",
           "DISABLE_VERSION_CHECK": "1", "LLAMAFACTORY_VERBOSITY": "WARN"}
    if tool == "llamafactory":
        env.pop("PYTHONPATH", None)
    return env


@dataclass
class RunResult:
    tool: str
    round: int
    status: str
    wall_s: float = 0.0
    first_step_s: float | None = None
    """Seconds from the start until the first step was logged (start-up, data, model load, step 1)."""
    last_step_s: float | None = None
    steps_logged: int = 0
    final_loss: float | None = None
    load: list[float] = field(default_factory=list)
    log_tail: str = ""

    @property
    def loop_s(self) -> float | None:
        """Steps 2..N."""
        ok = self.first_step_s is not None and self.last_step_s is not None
        return self.last_step_s - self.first_step_s if ok else None

    @property
    def after_s(self) -> float | None:
        """After the last step: the final save and exit."""
        return None if self.last_step_s is None else self.wall_s - self.last_step_s


def _records(path: str) -> list[dict]:
    if not os.path.isfile(path):
        return []
    with open(path, encoding="utf-8") as fh:
        lines = [line for line in fh if line.strip()]
    out = []
    for line in lines:
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:  # a line being written
            break
    return [r for r in out if "loss" in r]


def run_one(tool: str, round_index: int, root: str, paths: dict, settings: Settings,
            llamafactory_cli: str) -> RunResult:
    """One whole command, its log polled every 0.1 s for the time of its first and last logged step."""
    name = f"{tool}-r{round_index}"
    output_dir, cache = os.path.join(root, "runs", name), os.path.join(root, "cache", name)
    shutil.rmtree(output_dir, ignore_errors=True)
    shutil.rmtree(cache, ignore_errors=True)
    config = (llamafactory_config(paths["model"], paths["data_dir"], output_dir, settings) if tool == "llamafactory"
              else roll_recipe(paths["model"], paths["data"], output_dir, settings))
    config_path = os.path.join(root, "runs", f"{name}.yaml")
    os.makedirs(os.path.dirname(config_path), exist_ok=True)
    with open(config_path, "w", encoding="utf-8") as fh:
        json.dump(config, fh, indent=1)  # JSON is YAML
    result = RunResult(tool, round_index, "ok", load=[round(x, 2) for x in os.getloadavg()])
    log, seen = log_file(tool, output_dir), 0
    start = time.perf_counter()
    with open(os.path.join(root, "runs", f"{name}.log"), "w", encoding="utf-8") as out:
        proc = subprocess.Popen(command(tool, config_path, llamafactory_cli), env=environment(tool, settings, cache),
                                stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        while proc.poll() is None:
            if time.perf_counter() - start > settings.timeout:
                os.killpg(proc.pid, 9)
                proc.wait()
                result.status = f"timeout ({settings.timeout:.0f} s)"
                break
            count = len(_records(log))
            if count > seen:
                now = time.perf_counter() - start
                result.first_step_s = now if result.first_step_s is None else result.first_step_s
                result.last_step_s, seen = (now if count >= settings.steps else result.last_step_s), count
            time.sleep(0.1)
    result.wall_s = round(time.perf_counter() - start, 2)
    records = _records(log)
    result.steps_logged, result.final_loss = len(records), (records[-1]["loss"] if records else None)
    if result.status == "ok" and proc.returncode != 0:
        result.status = f"failed (exit {proc.returncode})"
    if result.status == "ok" and result.steps_logged < settings.steps:
        result.status = f"failed ({result.steps_logged} of {settings.steps} steps logged)"
    if result.status != "ok":
        with open(os.path.join(root, "runs", f"{name}.log"), encoding="utf-8", errors="replace") as fh:
            result.log_tail = fh.read()[-3000:]
    return result


def round_order(round_index: int) -> tuple[str, ...]:
    """A, B, C; then B, C, A; then C, A, B: each tool in every position once per three rounds."""
    shift = round_index % len(TOOLS)
    return TOOLS[shift:] + TOOLS[:shift]


def ratios(results: list[RunResult]) -> dict[str, dict]:
    """Per roll tool: LLaMA-Factory's wall time over the tool's, per round and the median (>= 1: as fast or
    faster), and the median of each phase for every tool."""
    by = {(r.tool, r.round): r for r in results if r.status == "ok"}
    rounds = sorted({r.round for r in results})
    out: dict[str, dict] = {}
    for tool in TOOLS:
        runs = [by[(tool, i)] for i in rounds if (tool, i) in by]
        phases = {key: _median([getattr(r, key) for r in runs]) for key in ("wall_s", "first_step_s", "loop_s",
                                                                            "after_s")}
        per_round = [round(by[("llamafactory", i)].wall_s / by[(tool, i)].wall_s, 3) for i in rounds
                     if ("llamafactory", i) in by and (tool, i) in by]
        out[tool] = {**phases, "runs": len(runs), "ratio_per_round": per_round,
                     "ratio": _median(per_round)}
    return out


def _median(values: list) -> float | None:
    values = [v for v in values if v is not None]
    return round(statistics.median(values), 3) if values else None


def markdown(results: list[RunResult], summary: dict[str, dict], header: dict) -> str:
    names = {"llamafactory": "LLaMA-Factory", "standard": "roll standard", "mca": "roll mca"}
    lines = [f"- date: {header['date']}; command: `{header['command']}` (commit {header['commit']})",
             f"- {header['machine']}; LLaMA-Factory {header['llamafactory_version']}",
             f"- load average (1/5/15 min) at start {header['load_start']}, at end {header['load_end']}",
             f"- settings: {header['settings']}", "",
             "| tool | runs | wall s (median) | until step 1 s | steps 2..N s | save + exit s | "
             "LLaMA-Factory wall / this wall (per round) | median |",
             "|---|---|---|---|---|---|---|---|"]
    for tool in TOOLS:
        row = summary[tool]
        per_round = ", ".join(f"{r:.2f}" for r in row["ratio_per_round"]) or "-"
        lines.append(f"| {names[tool]} | {row['runs']} | {_fmt(row['wall_s'])} | {_fmt(row['first_step_s'])} | "
                     f"{_fmt(row['loop_s'])} | {_fmt(row['after_s'])} | {per_round} | {_fmt(row['ratio'], 2)} |")
    lines += ["", "| round | tool | status | wall s | until step 1 s | steps 2..N s | save + exit s | loss @N | "
              "load (1 min) at start |", "|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        loss = "-" if r.final_loss is None else f"{r.final_loss:.4f}"
        lines.append(f"| {r.round + 1} | {names[r.tool]} | {r.status} | {_fmt(r.wall_s)} | {_fmt(r.first_step_s)} | "
                     f"{_fmt(r.loop_s)} | {_fmt(r.after_s)} | {loss} | {r.load[0] if r.load else '-'} |")
    return "\n".join(lines) + "\n"


def _fmt(value, digits: int = 1) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def llamafactory_version(cli: str) -> str | None:
    """``llamafactory-cli version``'s version number, or None when it does not run."""
    try:
        proc = subprocess.run([cli, "version"], capture_output=True, text=True, timeout=300,
                              env={k: v for k, v in os.environ.items() if k != "PYTHONPATH"})
    except (OSError, subprocess.TimeoutExpired):
        return None
    text = proc.stdout + proc.stderr
    match = re.search(r"LLaMA[- ]Factory[^0-9]*([0-9][0-9a-z.+-]*)", text, re.IGNORECASE)
    return match.group(1) if proc.returncode == 0 and match else ("unknown" if proc.returncode == 0 else None)


def result_dicts(results: list[RunResult]) -> list[dict]:
    return [{**asdict(r), "loop_s": r.loop_s, "after_s": r.after_s} for r in results]
