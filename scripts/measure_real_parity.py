"""Measure the standard-vs-mca gap on a real model: the loss arithmetic, roll-parity at TP1 and PP2, the exports.

    python scripts/measure_real_parity.py --model HF_DIR --data alpaca_en_demo.json --out DIR [--steps 8]

What it measures (the numbers behind roll-parity's default tolerances and the real-weight tests' bounds,
docs/mca-training.md "Real weights"):

1. ``arithmetic``: on one real sample (the data's first row, whole sequence supervised), the token-loss sum
   in float32 by ``F.cross_entropy`` (a Hugging Face model's own loss) and by ``roll.loss`` (both backends
   since issue 32), relative to a float64 reference on the same logits;
2. ``tp1`` / ``pp2``: roll-parity sft (cutoff 256, batch 2 x grad-accum 2, lr 2e-5 cosine) for ``--steps``
   steps, standard vs mca at TP1 and at ``nproc_per_node=2 pipeline_model_parallel_size=2``: the step-1 and
   largest relative loss differences;
3. ``exports``: the two TP1 runs' final models: ``||standard - mca|| / ||standard - base||`` overall and for
   the worst tensor (``roll.export_diff``), and both greedy answers to one question.

Prints one JSON object and writes it to DIR/summary.json. About 10-20 minutes on 2 CPU cores for 8 steps.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

import torch
import torch.nn.functional as F

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
QUESTION = "What is the capital of France?"


def recipe_text(model: str, data: str) -> str:
    return (f"model_name_or_path: {model}\nstage: sft\nfinetuning_type: full\ndataset: {data}\n"
            "cutoff_len: 256\nper_device_train_batch_size: 2\ngradient_accumulation_steps: 2\n"
            "learning_rate: 2.0e-5\nlr_scheduler_type: cosine\nseed: 0\nreport_to: none\n")


def arithmetic(model_dir: str, data: str) -> dict[str, float]:
    """Relative error of the float32 token-loss sum of one real sample, by F.cross_entropy and by roll.loss."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from roll import loss as roll_loss

    row = json.load(open(data, encoding="utf-8"))[0]
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    messages = [{"role": "user", "content": (row["instruction"] + "\n" + row.get("input", "")).strip()},
                {"role": "assistant", "content": row["output"]}]
    ids = tokenizer.apply_chat_template(messages, return_tensors="pt", return_dict=True)["input_ids"][:, :256]
    with torch.no_grad():
        logits = model(input_ids=ids).logits[:, :-1]
    labels = ids[:, 1:]
    reference = F.cross_entropy(logits.double().flatten(0, 1), labels.flatten(), reduction="sum").item()
    plain = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), reduction="sum").item()
    ours = roll_loss.causal_lm_loss_sum(torch.cat([logits, logits[:, -1:]], 1), ids)[0].item()
    return {"tokens": labels.numel(), "mean_loss": reference / labels.numel(),
            "f_cross_entropy_rel_error": abs(plain / reference - 1), "roll_loss_rel_error": abs(ours / reference - 1)}


def parity(recipe: str, out: str, steps: int, *overrides: str, save: bool = False) -> dict:
    """roll-parity's JSON for one layout (its exit status kept: 1 means beyond the default tolerances)."""
    command = [sys.executable, "-m", "roll.parity.cli", recipe, "--steps", str(steps), "--output-dir", out, "--json",
               "--tolerance", "1", "--first-step-tolerance", "1", *(["--save-models"] if save else []), *overrides]
    start = time.perf_counter()
    proc = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=3600)
    if not proc.stdout.strip():
        raise SystemExit(f"roll-parity failed ({proc.returncode}):\n{proc.stderr[-4000:]}")
    result = json.loads(proc.stdout)
    diffs = result.get("rel_diff") or []
    return {"first_step_rel_diff": diffs[0] if diffs else None, "max_rel_diff": result.get("max_rel_diff"),
            "rel_diffs": diffs, "losses": result.get("losses"), "seconds": round(time.perf_counter() - start)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True, help="an HF-format model directory (float32)")
    parser.add_argument("--data", required=True, help="an alpaca-format JSON file")
    parser.add_argument("--out", required=True, help="where the runs and summary.json go")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--skip", nargs="*", default=[], choices=["arithmetic", "tp1", "pp2", "exports"])
    args = parser.parse_args(argv)
    from roll.export_diff import export_difference, greedy_answer

    os.makedirs(args.out, exist_ok=True)
    recipe = os.path.join(args.out, "sft.yaml")
    with open(recipe, "w", encoding="utf-8") as fh:
        fh.write(recipe_text(os.path.abspath(args.model), os.path.abspath(args.data)))
    summary: dict = {}
    if "arithmetic" not in args.skip:
        summary["arithmetic"] = arithmetic(args.model, args.data)
    if "tp1" not in args.skip:
        summary["tp1"] = parity(recipe, os.path.join(args.out, "tp1"), args.steps, save=True)
    if "pp2" not in args.skip:
        summary["pp2"] = parity(recipe, os.path.join(args.out, "pp2"), args.steps, "nproc_per_node=2",
                                "pipeline_model_parallel_size=2")
    if "exports" not in args.skip:
        runs = os.path.join(args.out, "tp1")
        diff = export_difference(args.model, os.path.join(runs, "standard"), os.path.join(runs, "mca"))
        summary["exports"] = {**vars(diff), "answers": {name: greedy_answer(os.path.join(runs, name), QUESTION)
                                                         for name in ("standard", "mca")}}
    text = json.dumps(summary, indent=1)
    with open(os.path.join(args.out, "summary.json"), "w", encoding="utf-8") as fh:
        fh.write(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
