"""Benchmark and acceptance check of the data pipeline on the shared demo datasets (not a test:
it needs /work/shared, which a fresh clone does not have).

usage: python scripts/bench_data.py --shared ../shared   (the shared/ folder beside the repo) [--out bench_data.json]

Runs ``roll-train RECIPE --dry-run --json`` with the real Qwen2.5 tokenizer on:
  - alpaca_en_demo.json (sft, cutoff_len 1024, packing): packing_efficiency >= 0.95 and num_samples
    equal to a fresh count of the file; run twice, the second run reuses the datasets cache;
  - dpo_en_demo.json (dpo) and c4_demo.jsonl (pt);
  - a copy of alpaca_en_demo.json with one broken row: the error names the file and the row.
Prints one line per case and exits 1 if any check fails.
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def roll_train(recipe: dict, workdir: str, *flags: str, timeout: float = 600) -> subprocess.CompletedProcess:
    path = os.path.join(workdir, f"recipe_{int(time.time() * 1e6)}.yaml")
    with open(path, "w", encoding="utf-8") as handle:
        json.dump(recipe, handle)  # JSON is valid YAML
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    return subprocess.run([sys.executable, "-m", "roll.cli", path, *flags], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=timeout)


def fresh_count(path: str) -> int:
    with open(path, encoding="utf-8") as handle:
        if path.endswith(".jsonl"):
            return sum(1 for line in handle if line.strip())
        return len(json.load(handle))


def dry_run(recipe: dict, workdir: str) -> tuple[dict, float]:
    start = time.perf_counter()
    proc = roll_train(recipe, workdir, "--dry-run", "--json")
    if proc.returncode != 0:
        raise RuntimeError(f"roll-train failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout), time.perf_counter() - start


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shared", required=True, help="the shared inputs directory (data/, tokenizers/)")
    parser.add_argument("--out", help="also write all results to this JSON file")
    args = parser.parse_args()
    data = os.path.join(args.shared, "data")
    base = {"model_name_or_path": os.path.join(args.shared, "tokenizers", "qwen2.5"), "cutoff_len": 1024,
            "output_dir": "outputs/bench_data", "report_to": "none"}
    results, failures = {}, []

    def check(name: str, ok: bool, detail: str) -> None:
        print(f"{'PASS' if ok else 'FAIL'}  {name}: {detail}", flush=True)
        if not ok:
            failures.append(name)

    with tempfile.TemporaryDirectory() as workdir:
        alpaca = os.path.join(data, "alpaca_en_demo.json")
        sft = {**base, "stage": "sft", "dataset": alpaca, "packing": True}
        for attempt in ("first run", "second run (cache)"):
            summary, wall = dry_run(sft, workdir)
            results[f"sft {attempt}"] = {**summary, "wall_seconds": round(wall, 2)}
            check(f"sft alpaca packing, {attempt}",
                  summary["packing_efficiency"] >= 0.95 and summary["num_samples"] == fresh_count(alpaca),
                  f"packing_efficiency={summary['packing_efficiency']:.4f} "
                  f"num_samples={summary['num_samples']} (file has {fresh_count(alpaca)}) "
                  f"rows={summary['num_rows']} tokens={summary['num_tokens']} "
                  f"trainable={summary['num_trainable_tokens']} preprocess={summary['preprocess_seconds']}s "
                  f"wall={wall:.1f}s")
        for stage, name in (("dpo", "dpo_en_demo.json"), ("pt", "c4_demo.jsonl")):
            path = os.path.join(data, name)
            summary, wall = dry_run({**base, "stage": stage, "dataset": path}, workdir)
            results[stage] = {**summary, "wall_seconds": round(wall, 2)}
            check(f"{stage} {name}", summary["num_samples"] + summary["num_dropped"] == fresh_count(path),
                  f"num_samples={summary['num_samples']} dropped={summary['dropped']} "
                  f"truncated={summary['num_truncated']} rows={summary['num_rows']} "
                  f"tokens={summary['num_tokens']} "
                  f"trainable={summary['num_trainable_tokens']} preprocess={summary['preprocess_seconds']}s")
        with open(alpaca, encoding="utf-8") as handle:
            rows = json.load(handle)
        rows[123]["output"] = {"oops": "not a string"}
        broken = os.path.join(workdir, "alpaca_broken.json")
        with open(broken, "w", encoding="utf-8") as handle:
            json.dump(rows, handle)
        proc = roll_train({**sft, "dataset": broken}, workdir, "--dry-run")
        message = proc.stderr.strip().splitlines()[-1] if proc.stderr.strip() else ""
        check("broken row reported", proc.returncode == 2 and f"{broken}, row 123" in message
              and "Traceback" not in proc.stderr, message)
    if args.out:
        with open(args.out, "w", encoding="utf-8") as handle:
            json.dump(results, handle, indent=1)
    print(f"{len(failures)} check(s) failed" if failures else "all checks passed")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
