"""roll's image rows against LLaMA-Factory's own code, once, offline: token ids, labels, image grids and pixel values
of the same multimodal rows under ``template: qwen2_vl`` and ``image_max_pixels`` / ``image_min_pixels``
(docs/vl.md, "Image sizes"). No test runs it: LLaMA-Factory is no dependency of roll.

usage: python scripts/compare_llamafactory_images.py --model DIR [--lf-python lf/bin/python] [--work-dir DIR]
           [--image-max-pixels N] [--image-min-pixels N]

DIR: a tiny Qwen2.5-VL with the real Qwen2.5 tokenizer and Qwen2.5-VL's own image bounds
(``python scripts/make_tiny_vl_demo.py --model DIR --tokenizer qwen --image-pixels qwen2.5``). The images are drawn
here: sizes above and below the bounds, a side under 28 pixels, an aspect ratio over 200, and the modes RGB, RGBA, L
and P (a palette: LLaMA-Factory resizes it before converting it to RGB). LLaMA-Factory's side runs in its own
environment (this script with ``--lf-worker``, through roll.parity.llamafactory_worker: its get_train_args,
load_tokenizer, get_template_and_fix_tokenizer, get_dataset as run_sft calls them, then its plugin's get_mm_inputs
on each row's images; the processor as scripts/llamafactory_vl_cli.py builds it); roll's side is
roll.router.build_job and the collator. It prints one line per row and exits 1 on any difference.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
IMAGES = {"big.png": ((2000, 1000), "RGB"), "wide_rgba.png": ((1500, 700), "RGBA"), "grey.png": ((640, 480), "L"),
          "palette.png": ((1200, 900), "P"), "tiny.png": ((20, 10), "RGB"), "thin.png": ((9000, 20), "RGB"),
          "small.png": ((97, 61), "RGB")}
ROWS = [(["big.png"], "<image>What is it?", "A red field."),
        (["wide_rgba.png", "grey.png"], "<image><image>Compare them.", "The first is wider."),
        (["palette.png"], "Describe <image> please.", "Stripes."),
        ([], "Hello there.", "Hi."),
        (["tiny.png", "thin.png", "small.png"], "<image> then <image> and <image>?", "Three small ones.")]


def draw(folder: str) -> None:
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(0)
    for name, ((width, height), mode) in IMAGES.items():
        pixels = rng.integers(0, 256, (height, width, 4), dtype=np.uint8)
        pixels[..., :3] = (pixels[..., :3] // 64) * 64  # coarse colours: a palette holds them
        image = Image.fromarray(pixels, "RGBA")
        image = image if mode == "RGBA" else image.convert("RGB").convert(mode) if mode != "P" else \
            image.convert("RGB").quantize(16)
        image.save(os.path.join(folder, name))


def write_rows(folder: str) -> str:
    rows = [{"messages": [{"role": "user", "content": user}, {"role": "assistant", "content": reply}],
             "images": images} for images, user, reply in ROWS]
    path = os.path.join(folder, "rows.json")
    with open(path, "w", encoding="utf-8") as handle:
        json.dump(rows, handle)
    with open(os.path.join(folder, "dataset_info.json"), "w", encoding="utf-8") as handle:
        json.dump({"rows": {"file_name": "rows.json", "formatting": "sharegpt",
                            "columns": {"messages": "messages", "images": "images"},
                            "tags": {"role_tag": "role", "content_tag": "content", "user_tag": "user",
                                     "assistant_tag": "assistant"}}}, handle)
    return path


# ---- LLaMA-Factory's side (in its own environment) ----------------------------------------------------------

def lf_worker(spec_path: str) -> None:
    import numpy as np

    sys.path.insert(0, os.path.join(ROOT, "scripts"))
    from llamafactory_vl_cli import patch_auto_processor

    patch_auto_processor()
    from llamafactory.data import get_dataset, get_template_and_fix_tokenizer
    from llamafactory.hparams import get_train_args
    from llamafactory.model import load_tokenizer

    spec = json.load(open(spec_path, encoding="utf-8"))
    keys = {k: spec[k] for k in ("image_max_pixels", "image_min_pixels") if spec[k] is not None}
    model_args, data_args, training_args, _, _ = get_train_args(dict(
        model_name_or_path=spec["model"], stage="sft", do_train=True, finetuning_type="full", dataset="rows",
        dataset_dir=spec["folder"], template="qwen2_vl", cutoff_len=4096, output_dir=spec["out"],
        overwrite_output_dir=True, overwrite_cache=True, report_to="none", **keys))
    module = load_tokenizer(model_args)
    template = get_template_and_fix_tokenizer(module["tokenizer"], data_args)
    train = get_dataset(template, model_args, data_args, training_args, stage="sft", **module)["train_dataset"]
    out = {"input_ids": list(train["input_ids"]), "labels": list(train["labels"]), "grids": []}
    for i, row in enumerate(train):
        images = [os.path.join(spec["folder"], p) if isinstance(p, str) else p for p in (row["images"] or [])]
        if not images:
            out["grids"].append([])
            continue
        inputs = template.mm_plugin.get_mm_inputs(images, [], [], [len(images)], [0], [0], [row["input_ids"]],
                                                  module["processor"])
        out["grids"].append(inputs["image_grid_thw"].tolist())
        np.save(os.path.join(spec["folder"], f"lf_pixels_{i}.npy"), inputs["pixel_values"].numpy())
    with open(spec["out_json"], "w", encoding="utf-8") as handle:
        json.dump(out, handle)


# ---- roll's side --------------------------------------------------------------------------------------------

def roll_rows(spec: dict) -> tuple[dict, list]:
    from roll import router
    from roll.config.parser import parse_args
    from roll.data.policy import PaddingPolicy

    keys = [f"{k}={spec[k]}" for k in ("image_max_pixels", "image_min_pixels") if spec[k] is not None]
    _, config = parse_args(["recipes/demo/tiny_vl_sft.yaml", f"model_name_or_path={spec['model']}",
                            f"dataset={spec['data']}", "template=qwen2_vl", "cutoff_len=4096", "shuffle=false",
                            "overwrite_cache=true", *keys])
    job, _ = router.build_job(config, PaddingPolicy())
    rows = job.train_dataset
    batches = [job.collator([rows[i]]) for i in range(len(rows))]
    return {"input_ids": list(rows["input_ids"]), "labels": list(rows["labels"])}, batches


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", help="the tiny Qwen2.5-VL (required)")
    parser.add_argument("--lf-python", default=os.path.join(ROOT, "lf", "bin", "python"))
    parser.add_argument("--work-dir", default=None)
    parser.add_argument("--image-max-pixels", type=int, default=None)
    parser.add_argument("--image-min-pixels", type=int, default=None)
    parser.add_argument("--lf-worker", help=argparse.SUPPRESS)  # roll.parity.llamafactory_worker runs it
    opts = parser.parse_args()
    if opts.lf_worker:
        lf_worker(opts.lf_worker)
        return 0
    if not opts.model:
        parser.error("--model is required")
    import numpy as np

    from roll.parity.llamafactory_worker import WorkerFailed, missing_python, run_worker

    problem = missing_python(opts.lf_python)
    if problem:
        print(problem, file=sys.stderr)
        return 2

    folder = opts.work_dir or tempfile.mkdtemp(prefix="lf-images-")
    os.makedirs(folder, exist_ok=True)
    draw(folder)
    spec = {"model": os.path.abspath(opts.model), "folder": os.path.abspath(folder), "data": write_rows(folder),
            "image_max_pixels": opts.image_max_pixels, "image_min_pixels": opts.image_min_pixels}
    try:
        lf = run_worker(opts.lf_python, __file__, spec, folder)
    except WorkerFailed as exc:
        print(f"LLaMA-Factory failed: {exc.stderr[-2000:]}")
        return 1
    roll, batches = roll_rows(spec)
    bad = 0
    for i, (images, _, _) in enumerate(ROWS):
        labels = list(lf["labels"][i])
        labels[:1] = [-100]  # roll never trains the first position (nothing predicts it)
        ids_ok, labels_ok = roll["input_ids"][i] == lf["input_ids"][i], roll["labels"][i] == labels
        grid = batches[i]["image_grid_thw"].tolist() if images else []
        pixels, pixels_ok = "no image", True
        if images:
            theirs = np.load(os.path.join(folder, f"lf_pixels_{i}.npy"))
            ours = batches[i]["pixel_values"].numpy()
            pixels_ok = ours.shape == theirs.shape and bool((ours == theirs).all())
            pixels = (f"pixel_values {ours.shape}, max |diff| {np.abs(ours - theirs).max():.3g}"
                      if ours.shape == theirs.shape else f"pixel_values shapes {ours.shape} vs {theirs.shape}")
        ok = ids_ok and labels_ok and grid == lf["grids"][i] and pixels_ok
        bad += not ok
        sizes = ", ".join(f"{IMAGES[n][0][0]}x{IMAGES[n][0][1]} {IMAGES[n][1]}" for n in images) or "text only"
        print(f"row {i} ({sizes}): {len(lf['input_ids'][i])} tokens, input_ids {'same' if ids_ok else 'DIFFER'}, "
              f"labels {'same' if labels_ok else 'DIFFER'}, grids {grid} {'same' if grid == lf['grids'][i] else 'vs ' + str(lf['grids'][i])}, "
              f"{pixels}", flush=True)
    print(f"{len(ROWS) - bad} of {len(ROWS)} rows identical")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
