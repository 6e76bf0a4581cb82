"""``make demo-real``: LoRA teaches a real pretrained model an identity it cannot know, on both backends.

1. the real model (``roll.demo.real_model``: SmolLM2-135M-Instruct in float32, built once into the user cache)
   is linked where the recipe expects it (``.demo/smollm2-135m-instruct``);
2. the identity data (``recipes/demo/data/identity.json``, with ``{{name}}`` and ``{{author}}`` placeholders
   as in LLaMA-Factory's identity.json) is rendered with the chosen name and author where the recipe reads
   it (``.demo/identity.json``);
3. the base model answers ``QUESTION`` (with its chat template's default system prompt, which names it
   SmolLM, by Hugging Face: the training rows carry it too);
4. ``roll-parity`` trains ``recipes/demo/real_identity_lora.yaml`` on the standard backend and with
   ``--use-mca``, keeping both runs and their merged models, and prints the losses side by side;
5. both loss curves on one plot; each trained model answers ``QUESTION``, which is not one of the
   training questions;
6. PASS when both answers contain the name (and roll-parity passed), else FAIL.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Callable

import yaml

from roll.parity import cli as parity
from roll.demo.quick import generate_reply
from roll.errors import ConfigError, RollError
from roll.plot import LOSS_PLOT_FILE, plot_losses, read_curve

DEMO_RECIPE = "recipes/demo/real_identity_lora.yaml"
IDENTITY_TEMPLATE = "recipes/demo/data/identity.json"
QUESTION = "Who are you?"
DEFAULT_NAME = "Quillon"
DEFAULT_AUTHOR = "the Roll Demo Lab"
PLACEHOLDERS = ("{{name}}", "{{author}}")
MAX_NAME_CHARS = 60
ANSWER_TOKENS = 32
LOSS_TOLERANCE = 2e-3
"""Relative loss difference allowed at every step of the demo. Step 1 keeps roll-parity's 1e-6. LoRA at lr 2e-3
drives the loss from 4 to 0.3 in 12 steps, and near 0 the two backends' rounding is amplified: measured
2026-11-25 on 2 CPU cores, 3.7e-4 at step 11 (name 'Vexa Moonwright'), under 1e-5 up to step 9; trained on
to step 20, 5.2e-3. roll-parity's default (1e-4) is meant for short runs at fine-tuning rates."""


def check_identity(name: str, author: str) -> None:
    """ConfigError for a name or author the data cannot carry (empty, multi-line, too long, a placeholder)."""
    for option, value in (("--name", name), ("--author", author)):
        text = value.strip()
        if not text or "\n" in value or len(text) > MAX_NAME_CHARS or "{{" in text:
            raise ConfigError(f"demo-real: {option} {value!r} cannot be taught: give one line of 1 to "
                              f"{MAX_NAME_CHARS} characters without '{{{{' (make demo-real DEMO_NAME=... "
                              "DEMO_AUTHOR=...).")


def render_identity(template: str, name: str, author: str, out_path: str) -> int:
    """Write the identity rows of ``template`` with ``{{name}}`` / ``{{author}}`` replaced to ``out_path``
    (JSON, alpaca format); returns the number of rows. Replacement is per field value, so a name with
    quotes or backslashes stays valid JSON."""
    check_identity(name, author)
    with open(template, encoding="utf-8") as fh:
        rows = json.load(fh)
    fill = {"{{name}}": name.strip(), "{{author}}": author.strip()}

    def render(text: str) -> str:
        for placeholder, value in fill.items():
            text = text.replace(placeholder, value)
        return text

    rendered = [{key: render(value) if isinstance(value, str) else value for key, value in row.items()}
                for row in rows]
    os.makedirs(os.path.dirname(os.path.abspath(out_path)), exist_ok=True)
    with open(out_path, "w", encoding="utf-8") as fh:
        json.dump(rendered, fh, ensure_ascii=False, indent=1)
        fh.write("\n")
    return len(rendered)


def link_real_model(link: str, out: Callable[[str], object]) -> str:
    """Point ``link`` (the recipe's model_name_or_path) at the cached real model, building it on first use.
    A real directory already at ``link`` is used as it is."""
    from roll.demo.real_model import ensure_real_model

    if os.path.isdir(link) and not os.path.islink(link):
        out(f"real model: {link} (a directory already there: used as it is)\n")
        return link
    target = str(ensure_real_model())
    if os.path.islink(link):
        os.unlink(link)
    os.makedirs(os.path.dirname(os.path.abspath(link)), exist_ok=True)
    os.symlink(target, link)
    out(f"real model: {link} -> {target} (SmolLM2-135M-Instruct, float32)\n")
    return link


def learned(answer: str, name: str) -> bool:
    """Whether an answer names the taught identity (case-insensitive)."""
    return name.strip().lower() in answer.lower()


def run_demo_real(output_dir: str, steps: int | None = None, name: str = DEFAULT_NAME,
                  author: str = DEFAULT_AUTHOR, recipe: str = DEMO_RECIPE,
                  out: Callable[[str], object] = sys.stdout.write) -> int:
    """The whole demo; 0 when both backends learned the name and roll-parity passed, 1 otherwise, 2 for a
    mistake of the user's (the name, the recipe). ``steps`` defaults to the recipe's max_steps."""
    try:
        check_identity(name, author)
        with open(recipe, encoding="utf-8") as fh:
            keys = yaml.safe_load(fh)
        model_dir = link_real_model(keys["model_name_or_path"], out)
        rows = render_identity(IDENTITY_TEMPLATE, name, author, keys["dataset"])
        steps = steps or int(keys["max_steps"])
    except RollError as exc:
        out(f"demo-real: error: {exc}\n")
        return 2
    out(f"identity data: {keys['dataset']} ({rows} rows: {IDENTITY_TEMPLATE} with name {name!r}, author "
        f"{author!r}); {QUESTION!r} is not one of its questions\n")
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    before = generate_reply(model_dir, QUESTION, max_new_tokens=ANSWER_TOKENS)
    out(f"\nbefore training, {QUESTION!r} (both backends start from this model):\n  {before!r}\n\n")
    code = parity.main([recipe, "--steps", str(steps), "--tolerance", str(LOSS_TOLERANCE), "--output-dir", output_dir,
                        "--save-models"], out=out)
    runs = {"standard": os.path.join(output_dir, "standard"), "mca": os.path.join(output_dir, "mca")}
    curves = {f"{backend} (LoRA)": read_curve(path) for backend, path in runs.items()}
    if code == 2 or not all(curve.train for curve in curves.values()):
        out("FAIL: a training run did not finish (see above)\n")
        return code or 1
    plot = plot_losses(curves, os.path.join(output_dir, LOSS_PLOT_FILE),
                       f"SmolLM2-135M-Instruct learns the name {name!r} (LoRA)")
    out(f"\nloss curves (both backends, one plot): {plot}\n")
    out(f"\nafter {steps} steps, {QUESTION!r} (greedy, chat template, the merged models in "
        f"{output_dir}/{{standard,mca}}/merged):\n")
    missing = []
    for backend, path in runs.items():
        answer = generate_reply(os.path.join(path, "merged"), QUESTION, max_new_tokens=ANSWER_TOKENS)
        out(f"  {backend:>8}: {answer!r}\n")
        if not learned(answer, name):
            missing.append(backend)
    if missing:
        out(f"FAIL: {' and '.join(missing)} did not learn the name {name!r}\n")
        return 1
    if code != 0:
        out(f"FAIL: both backends learned the name {name!r}, but their losses differ beyond the demo's "
            f"tolerance ({LOSS_TOLERANCE:g} at every step, above)\n")
        return code
    out(f"PASS: both backends learned the name {name!r}; their losses agree within {LOSS_TOLERANCE:g} at every "
        "step\n")
    return 0
