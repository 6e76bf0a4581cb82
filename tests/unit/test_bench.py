"""roll-bench: the case plan, the log summary and the ledger file on literal inputs, and one smoke run of
``roll-bench --quick`` on two cases (no timing assertion: a benchmark is a script, not a timed test)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from roll.bench import cli as bench
from roll.bench import report as bench_report
from roll.bench import prepare as bench_setup
from roll.bench.prepare import BenchOptions, parse_options
from roll.errors import ConfigError
from tests.helpers import wait_until

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_default_plan_covers_every_runner_and_layout_and_full_is_the_cross_product():
    default = bench.plan_cases(BenchOptions())
    assert {(c.runner, c.layout) for c in default} == {("hf", "1p"), ("standard", "1p"), ("mca", "1p"),
                                                       ("mca", "DP2"), ("mca", "TP2")}
    assert {c.seq for c in default} == {256, 1024} and {c.dtype for c in default} == {"fp32", "bf16"}
    assert {c.packing for c in default} == {False, True}
    assert len(set(default)) == len(default)
    # every case has its plain-HF baseline in the plan, so each gets a ratio
    assert all(c.baseline in default for c in default)
    full = bench.plan_cases(BenchOptions(full=True))
    assert len(full) == 5 * 2 * 2 * 2 and set(default) <= set(full)
    only = bench.plan_cases(BenchOptions(only=("mca", "s1024")))
    assert only and all("mca" in c.name or "s1024" in c.name for c in only)


def test_rows_per_step_keeps_tokens_per_step_and_one_row_per_data_parallel_rank():
    opts = BenchOptions(tokens_per_step=512)
    assert bench.rows_per_step(bench.Case("hf", "1p", "fp32", 256, False), opts) == 2
    assert bench.rows_per_step(bench.Case("mca", "TP2", "fp32", 1024, False), opts) == 1
    assert bench.rows_per_step(bench.Case("mca", "DP2", "fp32", 1024, False), opts) == 2
    recipe = bench.case_recipe(bench.Case("mca", "DP2", "bf16", 256, True), opts, "m", "d.jsonl", "out")
    assert recipe["per_device_train_batch_size"] == 1 and recipe["nproc_per_node"] == 2
    assert recipe["bf16"] is True and recipe["packing"] is True and recipe["tensor_model_parallel_size"] == 1


def test_summarize_log_skips_warmup_and_weights_steps_by_their_time():
    records = [{"step": 1, "loss": 5.0, "tokens_per_second": 10.0, "step_time": 10.0},
               {"step": 2, "loss": 4.0, "tokens_per_second": 100.0, "step_time": 1.0, "mfu": 0.2},
               {"step": 3, "loss": 3.0, "tokens_per_second": 50.0, "step_time": 3.0, "mfu": 0.4},
               {"step": 3, "train_runtime": 9.0}]
    out = bench.summarize_log(records, warmup=1)
    assert out["steps_timed"] == 2 and out["loss"] == 3.0 and out["first_loss"] == 5.0
    assert out["tokens_per_second"] == pytest.approx((100 + 150) / 4)
    assert out["step_time"] == pytest.approx(2.0) and out["logged_mfu"] == pytest.approx(0.3)
    # without step_time every step is taken to have the same tokens: the harmonic mean
    no_time = [{k: v for k, v in r.items() if k != "step_time"} for r in records[:3]]
    harmonic = 2 / (1 / 100 + 1 / 50)
    assert bench.summarize_log(no_time, warmup=1)["tokens_per_second"] == pytest.approx(harmonic)
    assert "tokens_per_second" not in bench.summarize_log(records[:1], warmup=1)


def test_bf16_runs_on_cpu_only_where_it_is_not_slower_than_fp32_unless_asked_for():
    slow = {"fp32": {"flops": 150e9}, "bf16": {"flops": 80e9}}
    fast = {"fp32": {"flops": 150e9}, "bf16": {"flops": 300e9}}
    assert bench_setup.bf16_support("cpu", slow, flags=["avx512_bf16"]) == (
        False, "CPU has avx512_bf16 but no AMX: a bf16 GEMM runs at 80 GFLOP/s vs fp32 150 (probe), so bf16 "
        "would be slower; --dtype fp32,bf16 runs it anyway")
    assert bench_setup.bf16_support("cpu", slow, forced=True, flags=["avx512_bf16"])[0] is True
    assert bench_setup.bf16_support("cpu", fast, flags=["avx512_bf16"])[0] is True
    assert bench_setup.bf16_support("cpu", slow, flags=["amx_bf16"])[0] is True
    assert bench_setup.bf16_support("cpu", fast, flags=[])[0] is False
    assert bench_setup.bf16_support("nvidia-h100", {})[0] is True
    assert parse_options(["--dtype", "bf16"]).dtype_forced and not parse_options([]).dtype_forced


def test_options_are_checked_before_anything_runs():
    with pytest.raises(ConfigError, match="--quick and --full"):
        parse_options(["--quick", "--full"])
    with pytest.raises(ConfigError, match="--dtype"):
        parse_options(["--dtype", "fp16"])
    opts = parse_options(["--seq", "4096", "--model-shape", "qwen2.5-1.5b", "--work-dir", "w"])
    assert opts.seqs == (4096,) and opts.model_shape == "qwen2.5-1.5b"
    assert opts.markdown_out.endswith(os.path.join("docs", "performance.md"))
    assert parse_options(["--quick", "--work-dir", "w"]).markdown_out == os.path.join("w", "bench.md")


def test_the_recorded_command_names_no_users_directory(tmp_path):
    """The ledger's command line (docs/performance.md) has the checkout's own absolute paths relative to it (an
    absolute --work-dir once put the author's directory in the docs, which test_doc_links refuses); a path
    outside the checkout, and every other word, stays as typed."""
    from roll.bench.prepare import REPO

    inside = os.path.join(REPO, "outputs", "bench")
    (tmp_path / "d.json").write_text("[]")
    options = parse_options(["--work-dir", inside, f"--json-out={inside}/b.json", "--only", "mca",
                             "--data", str(tmp_path / "d.json")])
    assert options.command == (f"roll-bench --work-dir {os.path.join('outputs', 'bench')} --json-out="
                               f"{os.path.join('outputs', 'bench', 'b.json')} --only mca --data {tmp_path / 'd.json'}")
    assert options.work_dir == inside  # only the record changes: the run writes where it was told


def _report(status: str = "ok") -> dict:
    case = bench.Case("hf", "1p", "fp32", 64, False)
    result = bench.CaseResult(case, status, wall_s=3.0, peak_rss_gb=0.5,
                              metrics={"tokens_per_second": 100.0, "step_time": 0.5, "loss": 2.5})
    machine = {"cpu": "x", "cores": 2, "ram_gb": 1, "torch": "t"}
    return {"date": "today", "command": "roll-bench", "machine": machine,
            "device_kind": "cpu", "model_shape": "tiny", "tokens_per_step": 128, "warmup": 1, "steps": 2,
            "load_start": [0, 0, 0], "bf16": {"supported": False, "reason": "no"}, "peak_flops": {},
            "cases": bench_report.case_rows([result], {}, {}), "conversion": []}


def test_time_lost_per_save_is_the_difference_to_the_run_without_saves_per_save_in_the_span():
    from roll.bench import saves

    records = [{"step": s, "loss": 1.0, "step_time": 1.0 + (s == 4) * 3 + (s == 7) * 5} for s in range(1, 10)]
    assert saves.saves_in_span() == 2  # after steps 3 and 6; the one after the last step is outside
    assert saves.training_seconds(records) == 8 + 3 + 5  # steps 2..9; step 1's start-up left out
    assert saves.training_seconds(records[:-1]) is None  # a step missing: no number rather than a wrong one
    assert saves.save_step_excess(records) == (3 + 5) / 2  # steps 4 and 7 against the others' median (1.0)
    rows = [{"runner": "mca", "mode": m, "train_s": t, "save_step_excess_s": e}
            for m, t, e in (("none", 8.0, None), ("sync", 16.0, 2.5), ("async", 9.0, 0.4))]
    rows = {r["mode"]: r for r in saves.lost_per_save(rows)}
    assert rows["sync"]["lost_per_save_s"] == 4.0 and rows["async"]["lost_per_save_s"] == 0.5
    assert rows["async"]["vs_sync"] == 0.12 and "lost_per_save_s" not in rows["none"]
    assert rows["async"]["excess_vs_sync"] == 0.16 and "excess_vs_sync" not in rows["sync"]
    recipe = saves.save_recipe({"max_steps": 5, "save_strategy": "no"}, "async")
    assert (recipe["max_steps"], recipe["save_steps"], recipe["save_async"]) == (9, 3, True)


def test_rerun_replaces_its_block_and_keeps_the_rest_of_the_page(tmp_path):
    page = tmp_path / "performance.md"
    page.write_text("# Performance\n\n## Metrics in every log line\n\nkept\n")
    opts = BenchOptions(json_out=str(tmp_path / "b.json"), markdown_out=str(page))
    bench_report.write(_report(), opts)
    page.write_text(page.read_text() + "\n## What the numbers say\n\nalso kept\n")
    bench_report.write(_report("failed (exit 1)"), opts)
    text = page.read_text()
    assert text.count(bench_report.BEGIN) == 1 and "kept" in text and "also kept" in text
    assert "| (a) HF Trainer | 1 | 1p | fp32 | 64 | off | 100 | 0.50 |" in text and "failed (exit 1)" in text
    assert json.loads((tmp_path / "b.json").read_text())["cases"][0]["ratio_to_hf"] == 1.0


def test_roll_bench_quick_runs_two_cases_and_writes_both_files(tmp_path):
    """The plain-HF baseline and the standard backend train the same model on the same rows: same losses."""
    cases = "hf-1p-fp32-s64-nopack,standard-1p-fp32-s64-nopack"
    cmd = [sys.executable, "-m", "roll.bench.cli", "--quick", "--only", cases, "--no-convert", "--no-saves",
           "--threads", "1", "--work-dir", str(tmp_path / "w"), "--markdown-out", str(tmp_path / "perf.md")]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads((tmp_path / "w" / "bench.json").read_text())
    rows = {row["runner"]: row for row in report["cases"]}
    assert set(rows) == {"hf", "standard"}
    for row in rows.values():
        assert row["status"] == "ok" and row["metrics"]["steps_timed"] == 2
        assert row["metrics"]["tokens_per_second"] > 0 and row["peak_rss_gb"] > 0 and row["mfu"] > 0
    assert rows["hf"]["ratio_to_hf"] == 1.0 and rows["standard"]["ratio_to_hf"] > 0
    assert rows["standard"]["metrics"]["loss"] == pytest.approx(rows["hf"]["metrics"]["loss"], rel=1e-4)
    text = (tmp_path / "perf.md").read_text()
    assert "| (b) standard | 1 | 1p | fp32 | 64 | off |" in text and "load average" in text


def test_gloo_bandwidth_script_times_every_collective(tmp_path):
    """scripts/gloo_bandwidth.py (the DP2 floor in docs/performance.md) on 2 processes and 4 MB: one line per
    collective, dtype and bucketing, each with seconds and GB/s."""
    cmd = [sys.executable, os.path.join(REPO, "scripts", "gloo_bandwidth.py"), "--mb", "4", "--repeat", "1"]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=180,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = [line for line in proc.stdout.splitlines() if "GB/s" in line]
    names = [line.split("  ")[0] for line in lines]
    for dtype in ("fp32", "bf16"):
        for what in ("all_reduce", "reduce_scatter_tensor", "all_gather_into_tensor"):
            assert any(name.startswith(f"{what} {dtype}") for name in names), (what, dtype, proc.stdout)
    assert len(lines) == 11 and all(float(line.split()[-4]) > 0 for line in lines), proc.stdout


def test_data_bench_rows_memory_probe_and_targets(tmp_path):
    """roll.bench.data's pieces without its (minutes-long) starts: the generated rows, the /proc probe, and the
    target lines computed from a results table."""
    from roll.bench import data as bench_data

    path = tmp_path / "rows.jsonl"
    bench_data.write_rows(str(path), 25)
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    assert len(rows) == 25 and set(rows[0]) == {"instruction", "input", "output"}
    assert all(10 <= len(r["output"].split()) <= 200 for r in rows)
    child = subprocess.Popen([sys.executable, "-c", "import time; b = bytearray(64 << 20); time.sleep(30)"])
    try:
        assert wait_until(lambda: bench_data.rss_anon(child.pid) > 60 << 20, timeout=60)
        assert child.pid in bench_data.tree(os.getpid())
    finally:
        child.kill()
        child.wait()
    runs = [{"runner": "roll", "rows": 10, "ranks": 1, "packing": packing, "start": "warm", "status": "ok",
             "start_s": seconds, "anon_mb": mb}
            for packing, seconds, mb in (("off", 10.0, 500), ("on", 11.0, 650))]
    assert bench_data.targets(runs) == [
        "- 10 rows, 1 rank(s): packed warm start 1.10x the unpacked, anonymous memory 1.30x (targets: 1.2x)"]
    # the streamed corpus: at least the size asked for, documents numbered (no two lines alike)
    from roll.bench.data_stream import write_corpus

    corpus = tmp_path / "corpus.jsonl"
    docs = write_corpus(str(corpus), 1)
    lines = corpus.read_text().splitlines()
    assert corpus.stat().st_size >= 1 << 20 and len(lines) == docs == len(set(lines))
    assert json.loads(lines[5])["text"].startswith("document 5. ")


def test_save_timings_are_the_means_of_interleaved_rounds(monkeypatch, tmp_path):
    """``time_saves`` runs no-save / sync / async per backend, ROUNDS times in that order, and reports each figure
    as the mean of its rounds (each round's training time kept): a load that changes between rounds cancels."""
    from types import SimpleNamespace

    from roll.bench import saves

    order, extra = [], {"none": 0.0, "sync": 4.0, "async": 1.0}

    def run_process(case, options, recipe, root, name):
        order.append(name)
        return "ok", 10.0, None

    def read_log(out):  # round 2 runs 1 s slower per step (the machine's load changed)
        slow = order.count(f"saves-{os.path.basename(out).split('-')[1]}-none") - 1
        mode = os.path.basename(out).split("-")[2]
        return [{"step": s, "loss": 1.0, "step_time": 1.0 + slow + (s in (4, 7)) * extra[mode]} for s in range(1, 10)]

    monkeypatch.setattr(saves, "run_process", run_process)
    monkeypatch.setattr(saves, "read_log", read_log)
    monkeypatch.setattr(saves, "case_recipe", lambda *args: {"max_steps": 3})
    rows = {(r["runner"], r["mode"]): r for r in saves.time_saves(SimpleNamespace(seqs=[64]), "m", "d", str(tmp_path))}
    assert order == [f"saves-{b}-{m}" for _ in range(saves.ROUNDS) for b in ("standard", "mca") for m in saves.MODES]
    mca = rows[("mca", "async")]
    assert mca["train_s_rounds"] == [10.0, 18.0] and mca["train_s"] == 14.0
    assert mca["lost_per_save_s"] == 1.0 and mca["vs_sync"] == 0.25 and mca["save_step_excess_s"] == 1.0
    assert mca["excess_vs_sync"] == 0.25 and rows[("mca", "sync")]["save_step_excess_s"] == 4.0
    from roll.bench.report import saves_table

    table = "\n".join(saves_table(list(rows.values())))
    assert "| mca (save_async: true) | 2 | 14.00 (10.00 / 18.00) | 1.00 | 0.25 | 1.00 | 0.25 | - | - | 10 | ok |" in table


def test_background_save_costs_are_read_from_the_runs_log():
    """The saves table's last figures come from ``roll.background_save``'s log line: means over the saves."""
    from roll.bench.saves import background_costs

    log = ("[rank0] roll.background_save: saved checkpoint /o/checkpoint-3 in the background in 3.7s (the update after "
           "it waited 0.20s for the writer; the writer used 0.30 CPU s)\n"
           "[rank0] roll.background_save: saved checkpoint /o/checkpoint-6 in the background in 4.1s (the update after "
           "it waited 0.00s for the writer; the writer used 0.50 CPU s)\n"
           "[rank0] roll.background_save: saved checkpoint /o/checkpoint-9 in the background in 1.1s (the writer used "
           "0.70 CPU s)\n")
    assert background_costs(log) == (0.1, 0.5)
    assert background_costs("saved checkpoint /o/checkpoint-3 in 1.2s") == (None, None)


def test_conversion_net_is_roll_converts_own_time_next_to_its_wall_net_of_each_start_up(monkeypatch, tmp_path):
    """Each conversion runs CONVERT_ROUNDS times; net s is the median of the times roll-convert logs for its own
    work, and wall - start-up the median of each run's wall time minus that of the import-only process sampled
    just before it: a start-up that moves between samples (here 3.0 / 3.8 / 3.2 s) cancels within each pair.
    A run without its log line has no time to give: the row fails instead of showing a number."""
    from roll.bench import convert

    startups, calls = iter([3.0, 3.0, 3.8, 3.8, 3.2, 3.2]), []

    def timed(cmd, timeout, stderr_too=False):
        if cmd[1:] == ["-c", convert.STARTUP]:
            return next(startups), "ok", "", 300_000_000, 2.0
        if cmd[1] == "-c":  # the raw read / copy rows
            return 1.0, "ok", '{"read_s": 0.2, "cpu_s": 0.3}', 800_000_000, 1.0
        assert stderr_too and not os.path.exists(cmd[-1])  # a fresh output directory: the last round's is gone
        os.makedirs(cmd[-1])
        calls.append(cmd[3])
        start = calls.count(cmd[3]) - 1
        wall = [3.0, 3.8, 3.2][start] + (0.4 if cmd[3] == "hf2mca" else 0.5) + 0.1 * start
        own = [0.31, 0.35, 0.33][start] + (0.0 if cmd[3] == "hf2mca" else 0.1)
        line = f"[INFO] backends.mca.convert_cli: {cmd[3]}: converted 0.470 GB of HF weights in {own:.2f} s (1 GB/s)"
        return wall, "ok", "progress bars\n" + line + "\n", 350_000_000, 2.5

    monkeypatch.setattr(convert, "_timed", timed)
    monkeypatch.setattr(convert, "safetensors_bytes", lambda model_dir: 470_000_000)
    rows = {row["what"].split()[1]: row for row in convert.time_conversion("m", str(tmp_path), 60)
            if row["what"].startswith("roll-convert")}
    assert calls == ["hf2mca", "mca2hf"] * convert.CONVERT_ROUNDS
    assert rows["hf2mca"]["own_s_rounds"] == [0.31, 0.35, 0.33] and rows["hf2mca"]["net_s"] == 0.33
    assert rows["hf2mca"]["net_gb_per_s"] == round(0.47 / 0.33, 3)
    assert rows["hf2mca"]["net_s_rounds"] == [0.4, 0.5, 0.6] and rows["hf2mca"]["wall_minus_startup_s"] == 0.5
    assert rows["mca2hf"]["net_s"] == 0.43 and rows["mca2hf"]["wall_minus_startup_s"] == 0.6
    assert rows["mca2hf"]["net_cpu_s"] == 0.5

    def silent(cmd, timeout, stderr_too=False):
        wall, status, out, rss, cpu = timed(cmd, timeout, stderr_too)
        return wall, status, out.replace("converted", "wrote") if cmd[1] == "-m" else out, rss, cpu

    startups = iter([3.0] * 6)
    calls.clear()
    monkeypatch.setattr(convert, "_timed", silent)
    rows = [row for row in convert.time_conversion("m", str(tmp_path), 60) if row["what"].startswith("roll-convert")]
    assert all(row["net_s"] is None and row["status"].startswith("failed: no 'converted") for row in rows)

