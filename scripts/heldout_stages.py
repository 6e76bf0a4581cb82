"""Issue 22's stages on held-out data in each format, from the command line, on both backends.

Not a test: the source file is not part of roll; it is LLaMA-Factory's data/dpo_en_demo.json.

usage: python scripts/heldout_stages.py --data DIR [--out OUT] [--steps 3] [--only NAME ...]
  DIR holds dpo_en_demo.json (300 real preference pairs, sharegpt); default ../shared/data. OUT (default
  a temporary folder) keeps the data, the tiny model and both runs of each check.

From dpo_en_demo.json the script writes the data of every format the stages accept, rows no test uses:
  - pairwise sharegpt: the file itself, registered as LLaMA-Factory registers it (``dataset_info.json``:
    ``ranking: true``, ``formatting: sharegpt``, columns ``conversations`` / ``chosen`` / ``rejected``);
  - pairwise alpaca: its one-turn rows as ``instruction`` + ``chosen`` / ``rejected`` strings (read by detection);
  - kto sharegpt: LLaMA-Factory's ``kto_en_demo.json`` layout (``messages`` of role / content and a boolean
    ``label``, registered with ``columns: {messages, kto_tag: label}`` and role / content tags), a row's reply
    the pair's chosen one (``label`` true) or rejected one (false), alternately, so that no prompt repeats;
  - kto alpaca: ``instruction`` / ``output`` / ``kto_tag`` rows the same way (read by detection).
Then, on a tiny Qwen2 with the real Qwen2.5 tokenizer (scripts/make_tiny_model.py --tokenizer qwen), it runs
``roll-parity`` (the standard backend on one process, mca at TP1) for stage rm, kto, and dpo with pref_loss
orpo and simpo (+ pref_ftx) on each format: 8 checks, 2 trainings each. Prints one line per check: its loss
gap (roll-parity's verdict) and the largest gap of every other metric both backends log (relative for the
loss, log-probs and orpo's NLL; absolute for rewards, margins, accuracies, kl and log-odds). Exits 1 if a check
fails, 2 if the input is missing.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

from roll.parity.heldout import run_parity

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SOURCE = "dpo_en_demo.json"
COMMON = {"cutoff_len": 128, "per_device_train_batch_size": 2, "gradient_accumulation_steps": 2,
          "learning_rate": 1.0e-3, "seed": 0, "logging_steps": 1}
"""4 samples a step; cutoff 128 (the 151,936-token head's logits dominate the memory and time)."""
STAGES = {"rm": {"stage": "rm"}, "kto": {"stage": "kto", "pref_beta": 0.1},
          "orpo": {"stage": "dpo", "pref_loss": "orpo"},
          "simpo": {"stage": "dpo", "pref_loss": "simpo", "pref_beta": 2.0, "simpo_gamma": 0.3, "pref_ftx": 0.5}}
FORMATS = {"rm": ("pairwise_sharegpt", "pairwise_alpaca"), "orpo": ("pairwise_sharegpt", "pairwise_alpaca"),
           "simpo": ("pairwise_sharegpt", "pairwise_alpaca"), "kto": ("kto_sharegpt", "kto_alpaca")}
REGISTRY = {
    "pairwise_sharegpt": {"file_name": SOURCE, "ranking": True, "formatting": "sharegpt",
                          "columns": {"messages": "conversations", "chosen": "chosen", "rejected": "rejected"}},
    "kto_sharegpt": {"file_name": "kto_sharegpt.json", "formatting": "sharegpt",
                     "columns": {"messages": "messages", "kto_tag": "label"},
                     "tags": {"role_tag": "role", "content_tag": "content", "user_tag": "user",
                              "assistant_tag": "assistant"}},
}
"""LLaMA-Factory's own dataset_info.json entries for dpo_en_demo and kto_en_demo (the latter's file ours)."""
PLAIN_FILES = {"pairwise_alpaca": "pairwise_alpaca.json", "kto_alpaca": "kto_alpaca.json"}


def write_data(source: str, out: str) -> dict[str, dict]:
    """The formats' files in OUT (and OUT/dataset_info.json); {format: the recipe keys that read it}."""
    with open(source, encoding="utf-8") as fh:
        rows = json.load(fh)
    one_turn = [r for r in rows if len(r["conversations"]) == 1 and r["conversations"][0]["from"] == "human"]
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, SOURCE), "w", encoding="utf-8") as fh:
        json.dump(rows, fh)
    pairwise_alpaca = [{"instruction": r["conversations"][0]["value"], "chosen": r["chosen"]["value"],
                        "rejected": r["rejected"]["value"]} for r in one_turn]
    replies = [(r, i % 2 == 0) for i, r in enumerate(one_turn)]  # chosen, rejected, chosen, ... one per prompt
    kto_sharegpt = [{"messages": [{"role": "user", "content": r["conversations"][0]["value"]},
                                  {"role": "assistant", "content": r["chosen" if good else "rejected"]["value"]}],
                     "label": good} for r, good in replies]
    kto_alpaca = [{"instruction": r["conversations"][0]["value"],
                   "output": r["chosen" if good else "rejected"]["value"], "kto_tag": good} for r, good in replies]
    for name, data in (("pairwise_alpaca.json", pairwise_alpaca), ("kto_sharegpt.json", kto_sharegpt),
                       ("kto_alpaca.json", kto_alpaca)):
        with open(os.path.join(out, name), "w", encoding="utf-8") as fh:
            json.dump(data, fh, indent=1)
    with open(os.path.join(out, "dataset_info.json"), "w", encoding="utf-8") as fh:
        json.dump(REGISTRY, fh, indent=1)
    keys = {name: {"dataset": name, "dataset_dir": out} for name in REGISTRY}
    keys.update({name: {"dataset": os.path.join(out, file)} for name, file in PLAIN_FILES.items()})
    return keys


def _relative(metric: str) -> bool:
    return metric in ("loss", "nll_loss") or metric.startswith("logps/")


def metric_gaps(run_dir: str) -> dict[str, float]:
    """{metric: its largest gap over the steps} between OUT/standard and OUT/mca's train logs."""
    logs = {}
    for backend in ("standard", "mca"):
        with open(os.path.join(run_dir, backend, "train_log.jsonl"), encoding="utf-8") as fh:
            logs[backend] = {r["step"]: r for r in map(json.loads, filter(str.strip, fh)) if "loss" in r}
    skip = {"step", "epoch", "learning_rate", "grad_norm", "step_time", "tokens_per_second", "mfu",
            "peak_memory_gb", "train_runtime", "train_samples_per_second", "train_steps_per_second"}
    gaps: dict[str, float] = {}
    for step, std in logs["standard"].items():
        mca = logs["mca"].get(step, {})
        for metric, value in std.items():
            if metric in skip or metric not in mca or not isinstance(value, (int, float)):
                continue
            gap = abs(mca[metric] - value) / (abs(value) if _relative(metric) and value else 1.0)
            gaps[metric] = max(gaps.get(metric, 0.0), gap)
    return gaps


def run_check(name: str, recipe: dict, out: str, steps: int) -> dict:
    """roll-parity on RECIPE (roll.parity.heldout); its JSON verdict plus the metrics' gaps."""
    run_dir = os.path.join(out, "runs", name)
    verdict = run_parity(recipe, run_dir, steps, timeout=1800)
    if verdict.get("losses"):
        verdict["metric_gaps"] = metric_gaps(os.path.join(run_dir, "out"))
    return verdict


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", default=os.path.join(REPO, "..", "shared", "data"),
                        help=f"a folder with LLaMA-Factory's {SOURCE}")
    parser.add_argument("--out", help="keep the data, model and runs here (default: a temporary folder)")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--only", action="append", help="run only these checks (e.g. rm/pairwise_alpaca)")
    args = parser.parse_args()
    source = os.path.join(args.data, SOURCE)
    if not os.path.isfile(source):
        print(f"no {source}: give --data DIR, a folder with LLaMA-Factory's {SOURCE} (its data/ folder)",
              file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory(prefix="roll-heldout-") as tmp:
        out = os.path.abspath(args.out or tmp)
        formats = write_data(source, os.path.join(out, "data"))
        model = os.path.join(out, "tiny-qwen2-qwentok")
        subprocess.run([sys.executable, os.path.join(REPO, "scripts", "make_tiny_model.py"), "--out", model,
                        "--tokenizer", "qwen"], check=True, capture_output=True, timeout=600)
        results, failed = {}, 0
        for stage, keys in STAGES.items():
            for fmt in FORMATS[stage]:
                name = f"{stage}/{fmt}"
                if args.only and name not in args.only:
                    continue
                recipe = {"model_name_or_path": model, **COMMON, **keys, **formats[fmt]}
                verdict = results[name] = run_check(name.replace("/", "_"), recipe, out, args.steps)
                failed += not verdict.get("passed")
                gaps = verdict.get("metric_gaps", {})
                worst = max(((k, v) for k, v in gaps.items() if k != "loss"), key=lambda kv: kv[1],
                            default=("-", 0.0))
                print(f"{name:<24} {'PASS' if verdict.get('passed') else 'FAIL'}  loss max rel diff "
                      f"{verdict.get('max_rel_diff', float('nan')):.1e}  losses "
                      f"{[round(v, 6) for v in verdict.get('losses', {}).get('standard', [])]}  worst other metric "
                      f"{worst[0]} {worst[1]:.1e}", flush=True)
                if not verdict.get("passed"):
                    print(json.dumps({k: verdict.get(k) for k in ("failures", "error", "exit")})[:3000])
        with open(os.path.join(out, "heldout_stages.json"), "w", encoding="utf-8") as fh:
            json.dump(results, fh, indent=1)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
