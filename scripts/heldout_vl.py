"""Issue 24's held-out check: multimodal data no test uses, trained on both backends from the command line.

Not a test (CI has the demo's goldens and backend comparison); run by hand after a change to the VL path.

usage: python scripts/heldout_vl.py [--out OUT] [--steps 10] [--only NAME ...] [--family qwen3_vl]
  OUT (default a temporary folder) keeps the data, the tiny model and the runs.

The script draws its own images with PIL, unlike the demo's (roll.demo.vl_data: white pictures of one shape, four
sizes): stripes, gradients, checkerboards and noise in other sizes and aspect ratios (wide 300 x 50, tall 40 x 200,
small 29 x 31 scaled up by the processor, large 500 x 500 scaled down, odd 97 x 61), rows with one, two and
three images (placeholders at the start, in the middle, in a second user turn), text-only rows mixed into the same
file, and a system prompt. It builds the tiny Qwen2.5-VL (roll.demo.tiny_vl; ``--family qwen3_vl``: the tiny
Qwen3-VL, interleaved M-RoPE and deepstack into its first two layers) and runs ``roll-parity`` (the
standard backend on one process, mca at the layout) with the vision tower and merger frozen (the defaults) and
with both trained (``freeze_vision_tower=false freeze_multi_modal_projector=false``), at TP1 and at TP2 / PP2 / CP2,
packed (``packing: true``: the same packed rows on both backends) at TP1 and, tower trained, at CP2, and LoRA on the
language model at TP1 and TP2, exporting both adapters (``--save-models``: PEFT's format, compared).
Then ``roll-train`` on a copy of the data with one row's image path broken must exit 2 with a message naming the
file, the row and the image. Prints one line per check; exits 1 if one fails.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile

from roll.parity.heldout import offline_env, run_parity

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SIZES = ((300, 50), (40, 200), (29, 31), (500, 500), (97, 61), (64, 128), (150, 90))
KINDS = ("stripes", "gradient", "checker", "noise")
COMMON = {"stage": "sft", "cutoff_len": 96, "per_device_train_batch_size": 2, "gradient_accumulation_steps": 2,
          "learning_rate": 3.0e-3, "seed": 0}
"""4 rows a step; every row fits cutoff 96 (the largest, three images of up to 16 tokens plus text, about 80)."""
LAYOUTS = {"tp1": {}, "tp2": {"tensor_model_parallel_size": 2, "nproc_per_node": 2},
           "pp2": {"pipeline_model_parallel_size": 2, "nproc_per_node": 2},
           "cp2": {"context_parallel_size": 2, "nproc_per_node": 2}}
TRAIN_TOWER = {"freeze_vision_tower": False, "freeze_multi_modal_projector": False}
LORA = {"finetuning_type": "lora", "lora_rank": 8, "learning_rate": 1.0e-2}
CHECKS = {"tp1": ("tp1", {}), "tp1_tower": ("tp1", TRAIN_TOWER), "tp2": ("tp2", {}), "pp2_tower": ("pp2", TRAIN_TOWER),
          "tp1_lora": ("tp1", LORA), "tp2_lora": ("tp2", LORA), "cp2_tower": ("cp2", TRAIN_TOWER),
          "packed": ("tp1", {"packing": True}), "packed_cp2_tower": ("cp2", {"packing": True, **TRAIN_TOWER})}
"""LoRA checks also export both adapters (roll-parity --save-models: the PEFT adapters compared tensor by tensor)."""


def draw(kind: str, size: tuple[int, int], rng: random.Random):
    """A PIL image of ``size``: coloured stripes, a gradient, a checkerboard or noise."""
    from PIL import Image

    width, height = size
    image = Image.new("RGB", size)
    a, b = [tuple(rng.randrange(256) for _ in range(3)) for _ in range(2)]
    period = rng.randrange(3, 12)
    pixels = []
    for y in range(height):
        for x in range(width):
            if kind == "stripes":
                pixels.append(a if (x // period) % 2 else b)
            elif kind == "gradient":
                t = x / max(width - 1, 1)
                pixels.append(tuple(int(p * (1 - t) + q * t) for p, q in zip(a, b)))
            elif kind == "checker":
                pixels.append(a if (x // period + y // period) % 2 else b)
            else:
                pixels.append(tuple(rng.randrange(256) for _ in range(3)))
    image.putdata(pixels)
    return image


def write_data(out: str, num_rows: int = 40) -> str:
    """OUT/pictures/*.png and OUT/heldout.json (sharegpt ``conversations`` + ``images``); the json path."""
    rng = random.Random(1234)
    os.makedirs(os.path.join(out, "pictures"), exist_ok=True)
    rows = []
    for i in range(num_rows):
        n_images = (1, 2, 0, 3, 1)[i % 5]
        names = []
        for j in range(n_images):
            kind, size = KINDS[(i + j) % len(KINDS)], SIZES[(3 * i + j) % len(SIZES)]
            name = f"pictures/{i:02d}_{j}_{kind}_{size[0]}x{size[1]}.png"
            draw(kind, size, rng).save(os.path.join(out, name))
            names.append(name)
        describe = ", ".join(n.split("_")[2] for n in names)
        if n_images == 0:
            turns = [("human", f"Count to {i % 7 + 2}."), ("gpt", " ".join(str(k) for k in range(1, i % 7 + 3)))]
        elif n_images == 3:  # two in the first turn, one in a second user turn
            turns = [("human", "Here are two pictures: <image> and <image>. What patterns are they?"),
                     ("gpt", ", ".join(describe.split(", ")[:2]) + "."),
                     ("human", "<image>And this one?"), ("gpt", describe.split(", ")[2] + ".")]
        else:
            turns = [("human", "<image>" * n_images + "Which patterns do you see?"), ("gpt", describe + ".")]
        rows.append({"conversations": [{"from": f, "value": v} for f, v in turns],
                     "system": "You describe pictures briefly.", "images": names})
    path = os.path.join(out, "heldout.json")
    with open(path, "w", encoding="utf-8") as fh:
        json.dump(rows, fh, indent=1)
    return path


def _env() -> dict[str, str]:
    return offline_env(OMP_NUM_THREADS="1")


def run_check(name: str, recipe: dict, out: str, steps: int) -> dict:
    """roll-parity on RECIPE (roll.parity.heldout; a LoRA check exports and compares both adapters)."""
    return run_parity(recipe, os.path.join(out, "runs", name), steps, save_models="lora_rank" in recipe, env=_env())


def check_bad_path(dataset: str, model: str, out: str) -> tuple[bool, str]:
    """roll-train on a copy of DATASET whose row 8 names a missing image: exit 2, the file, row and image named."""
    with open(dataset, encoding="utf-8") as fh:
        rows = json.load(fh)
    rows[8]["images"][1] = "pictures/no_such_picture.png"
    bad = os.path.join(os.path.dirname(dataset), "heldout_bad_path.json")
    with open(bad, "w", encoding="utf-8") as fh:
        json.dump(rows, fh, indent=1)
    command = [sys.executable, "-m", "roll.cli", f"model_name_or_path={model}", f"dataset={bad}", "max_steps=1",
               f"output_dir={os.path.join(out, 'runs', 'bad_path')}", "report_to=none"]
    command += [f"{k}={v}" for k, v in COMMON.items()]
    proc = subprocess.run(command, cwd=REPO, env=_env(), capture_output=True, text=True, timeout=900)
    message = proc.stderr.strip()
    ok = (proc.returncode == 2 and "heldout_bad_path.json" in message and "row 8" in message
          and "no_such_picture.png" in message and "Traceback" not in message)
    return ok, f"exit {proc.returncode}: {message[-600:]}"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", help="keep the data, model and runs here (default: a temporary folder)")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--only", action="append", help=f"run only these checks ({', '.join(CHECKS)}, bad_path)")
    parser.add_argument("--family", choices=("qwen2_5_vl", "qwen3_vl"), default="qwen2_5_vl")
    args = parser.parse_args()
    from roll.demo.tiny_vl import make_tiny_qwen3_vl_model, make_tiny_vl_model

    failed = 0
    with tempfile.TemporaryDirectory(prefix="roll-heldout-vl-") as tmp:
        out = os.path.abspath(args.out or tmp)
        dataset = write_data(os.path.join(out, "data"))
        model = os.path.join(out, "tiny-vl" if args.family == "qwen2_5_vl" else "tiny-qwen3-vl")
        if not os.path.isfile(os.path.join(model, "config.json")):
            (make_tiny_vl_model if args.family == "qwen2_5_vl" else make_tiny_qwen3_vl_model)(model, seed=0)
        results = {}
        for name, (layout, keys) in CHECKS.items():
            if args.only and name not in args.only:
                continue
            recipe = {"model_name_or_path": model, "dataset": dataset, **COMMON, **LAYOUTS[layout], **keys}
            verdict = results[name] = run_check(name, recipe, out, args.steps)
            failed += not verdict.get("passed")
            losses = verdict.get("losses", {})
            print(f"{name:<10} {'PASS' if verdict.get('passed') else 'FAIL'}  step 1 rel diff "
                  f"{(verdict.get('rel_diff') or [float('nan')])[0]:.1e}  max rel diff "
                  f"{verdict.get('max_rel_diff', float('nan')):.1e}  "
                  + (f"adapter rel diff {verdict['weights']['rel_diff']:.1e}  " if verdict.get("weights") else "")
                  + "standard "
                  f"{[round(v, 5) for v in losses.get('standard', [])]}", flush=True)
            if not verdict.get("passed"):
                print(json.dumps({k: verdict.get(k) for k in ("failures", "error", "exit")})[:3000])
        if not args.only or "bad_path" in args.only:
            ok, message = check_bad_path(dataset, model, out)
            failed += not ok
            results["bad_path"] = {"passed": ok, "message": message}
            print(f"{'bad_path':<10} {'PASS' if ok else 'FAIL'}  {message}", flush=True)
        with open(os.path.join(out, "heldout_vl.json"), "w", encoding="utf-8") as fh:
            json.dump(results, fh, indent=1)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
