"""roll-bench's checkpoint-save timings: the training time one save costs, synchronous (``save_async: false``)
against asynchronous (``save_async: true``, the default), on both backends (1 process, fp32, the bench model).

Per backend three runs of STEPS steps, interleaved so that a change of the machine's load hits them alike: no
saves, synchronous saves, asynchronous saves, every SAVE_EVERY steps; all of it ROUNDS times, each figure the
mean of its rounds (a run's training time moves by a few tenths of a second between runs even on an idle
machine, as much as an asynchronous save costs). A run's training time is the sum of
``train_log.jsonl``'s ``step_time`` over steps 2..STEPS (each record's window runs from the previous log to
this one, so the save after step k is inside step k+1's record; the first step's start-up and the save at
the last step, which both backends make after their last log, are outside). Time lost per save = (the run's
training time - the no-save run's) / the saves inside the span; it needs a steady load. For an asynchronous
save that is the copy to host memory, the small files, the publish, and what the background writer takes from
training (on a CPU it competes for the same cores; on a GPU it only copies device to host). A second figure
holds under a changing load: the step after each save against the median of the run's other steps
(``save_step_excess``), which leaves out what a background writer takes from later steps."""

from __future__ import annotations

import os
import re
import statistics

from roll.bench.cli import Case, case_recipe, read_log, run_process

STEPS = 9
ROUNDS = 2
SAVE_EVERY = 3
"""Saves after steps 3 and 6 are inside the timed span; the one after step 9 is not (see the module doc)."""
MODES = ("none", "sync", "async")


def saves_in_span() -> int:
    return len(range(SAVE_EVERY, STEPS, SAVE_EVERY))


def save_recipe(base: dict, mode: str) -> dict:
    """The bench case's recipe with the mode's saving keys (``none``: no saves)."""
    recipe = {**base, "max_steps": STEPS}
    if mode == "none":
        return {**recipe, "save_strategy": "no"}
    return {**recipe, "save_strategy": "steps", "save_steps": SAVE_EVERY, "save_total_limit": 2,
            "save_async": mode == "async"}


def training_seconds(records: list[dict]) -> float | None:
    """Sum of ``step_time`` over the training records of steps 2..STEPS; None unless all were logged."""
    times = {r["step"]: r.get("step_time") for r in records if "loss" in r}
    span = range(2, STEPS + 1)
    if any(times.get(step) is None for step in span):
        return None
    return sum(times[step] for step in span)


def save_step_excess(records: list[dict]) -> float | None:
    """Mean over the saves in the span of (the step_time of the step after the save - the median step_time
    of the run's other steps 2..STEPS): a per-save cost within one run, so a load that changes between runs
    cancels out; it leaves out what a background writer takes from the later steps."""
    times = {r["step"]: r.get("step_time") for r in records if "loss" in r}
    after = [step + 1 for step in range(SAVE_EVERY, STEPS, SAVE_EVERY)]
    others = sorted(times[s] for s in range(2, STEPS + 1) if s not in after and times.get(s) is not None)
    if not others or any(times.get(step) is None for step in after):
        return None
    median = statistics.median(others)
    return sum(times[step] - median for step in after) / len(after)


_BACKGROUND_LOG = re.compile(r"in the background in [0-9.]+s \((?:the update after it waited ([0-9.]+)s for the "
                             r"writer)?(?:; )?(?:the writer used ([0-9.]+) CPU s)?\)")


def background_costs(log_text: str) -> tuple[float | None, float | None]:
    """(seconds the update after a save waited for its writer, the writer's CPU seconds), each the mean over the
    background saves the run logged (``roll.background_save``'s line); None where no save logged it."""
    waits, cpus = [], []
    for wait, cpu in _BACKGROUND_LOG.findall(log_text):
        if wait:
            waits.append(float(wait))
        if cpu:
            cpus.append(float(cpu))
    return (statistics.mean(waits) if waits else None), (statistics.mean(cpus) if cpus else None)


def lost_per_save(rows: list[dict]) -> list[dict]:
    """Fill ``lost_per_save_s`` per backend and, for async, its share of the sync figure by the two measures:
    ``vs_sync`` by training time, ``excess_vs_sync`` by the step that holds a save (which a change of the load
    between runs does not move: the rounds' training times of one setting differ by seconds on an idle machine)."""
    by = {(r["runner"], r["mode"]): r for r in rows}
    for row in rows:
        base = by.get((row["runner"], "none"), {}).get("train_s")
        if row["mode"] != "none" and base is not None and row["train_s"] is not None:
            row["lost_per_save_s"] = round((row["train_s"] - base) / saves_in_span(), 2)
    for row in rows:
        sync = by.get((row["runner"], "sync"), {}).get("lost_per_save_s")
        if row["mode"] == "async" and row.get("lost_per_save_s") is not None and sync:
            row["vs_sync"] = round(row["lost_per_save_s"] / sync, 2)
        sync_excess = by.get((row["runner"], "sync"), {}).get("save_step_excess_s")
        if row["mode"] == "async" and row.get("save_step_excess_s") is not None and sync_excess:
            row["excess_vs_sync"] = round(row["save_step_excess_s"] / sync_excess, 2)
    return rows


def time_saves(options, model_dir: str, data_path: str, root: str) -> list[dict]:
    """One row per backend and mode: status, training seconds, time lost per save (means over ROUNDS rounds;
    ``train_s_rounds`` keeps each round's)."""
    runs: dict[tuple[str, str], list[dict]] = {}
    for _ in range(ROUNDS):
        for runner in ("standard", "mca"):
            case = Case(runner, "1p", "fp32", options.seqs[0], False)
            for mode in MODES:
                name = f"saves-{runner}-{mode}"
                out = os.path.join(root, name)
                base = case_recipe(case, options, model_dir, data_path, out)
                status, wall, _ = run_process(case, options, save_recipe(base, mode), root, name)
                records = read_log(out) if status == "ok" else []
                wait, cpu = background_costs(_text(os.path.join(root, f"{name}.log")))
                runs.setdefault((runner, mode), []).append(
                    {"status": status, "wall": wall, "train": training_seconds(records),
                     "excess": save_step_excess(records), "wait": wait, "cpu": cpu})
    rows = []
    for (runner, mode), done in runs.items():
        train, excess = [r["train"] for r in done], [r["excess"] for r in done]
        failed = next((r["status"] for r in done if r["status"] != "ok"), "ok")
        rows.append({"runner": runner, "mode": mode, "status": failed,
                     "wall_s": round(statistics.mean(r["wall"] for r in done), 1),
                     "saves": 0 if mode == "none" else saves_in_span(),
                     "train_s": None if None in train else round(statistics.mean(train), 2),
                     "train_s_rounds": [None if t is None else round(t, 2) for t in train],
                     "save_step_excess_s": None if None in excess or mode == "none"
                     else round(statistics.mean(excess), 2),
                     "update_waited_s": _mean_of(r["wait"] for r in done),
                     "writer_cpu_s": _mean_of(r["cpu"] for r in done)})
    return lost_per_save(rows)


def _mean_of(values) -> float | None:
    known = [v for v in values if v is not None]
    return round(statistics.mean(known), 2) if known else None


def _text(path: str) -> str:
    try:
        with open(path, encoding="utf-8", errors="replace") as fh:
            return fh.read()
    except OSError:
        return ""
