"""Compare two exported models trained from one base: by the norm of their difference relative to the norm of
the update, not by the largest element.

Adam turns a near-zero, noisy gradient into a full-size step of either sign, so two correct runs can differ
by a whole update in a few coordinates (on SmolLM2-135M after 8 sft steps: 1.0e-4 in 2 of 49152 embedding
rows, where the update itself is at most 8e-5) while their updates agree to 0.3% in norm. A bug shows in
the norm: a wrong gradient moves every coordinate.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class ExportDifference:
    """``overall``: ||a - b|| / ||a - base|| over every tensor; ``worst``: the tensor with the largest such
    ratio and its ratio; ``tensors``: how many were compared."""

    overall: float
    worst: str
    worst_ratio: float
    tensors: int


def load_weights(model_dir: str) -> dict[str, torch.Tensor]:
    """The float32 tensors of an HF model directory's safetensors files (sharded or not)."""
    from safetensors.torch import load_file

    names = sorted(f for f in os.listdir(model_dir) if f.endswith(".safetensors"))
    if not names:
        raise FileNotFoundError(f"no *.safetensors in {model_dir}")
    weights: dict[str, torch.Tensor] = {}
    for name in names:
        weights.update({key: value.float() for key, value in load_file(os.path.join(model_dir, name)).items()})
    return weights


def export_difference(base_dir: str, a_dir: str, b_dir: str) -> ExportDifference:
    """How far two exports of one base are apart, relative to how far ``a`` moved from the base.

    Tensors missing from the base (none for full fine-tuning) are skipped; a tensor of ``a`` missing from
    ``b`` is an error. A tensor ``a`` did not update (ratio undefined) counts in the overall sums only."""
    base, a, b = load_weights(base_dir), load_weights(a_dir), load_weights(b_dir)
    missing = sorted(set(a) - set(b))
    if missing:
        raise KeyError(f"{b_dir} lacks {len(missing)} tensors of {a_dir}, e.g. {missing[:3]}")
    diff_sq = update_sq = 0.0
    worst, worst_ratio, count = "", 0.0, 0
    for name in sorted(set(a) & set(base)):
        diff = (a[name] - b[name]).double().norm().item()
        update = (a[name] - base[name]).double().norm().item()
        diff_sq, update_sq, count = diff_sq + diff**2, update_sq + update**2, count + 1
        if update > 0 and diff / update > worst_ratio:
            worst, worst_ratio = name, diff / update
    overall = math.sqrt(diff_sq) / math.sqrt(update_sq) if update_sq > 0 else math.inf
    return ExportDifference(overall, worst, worst_ratio, count)


def greedy_answer(model_dir: str, question: str, max_new_tokens: int = 24) -> str:
    """The model's greedy answer to one user turn (its tokenizer's chat template), decoded."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    ids = tokenizer.apply_chat_template([{"role": "user", "content": question}], add_generation_prompt=True,
                                        return_tensors="pt", return_dict=True)
    with torch.no_grad():
        out = model.generate(**ids, max_new_tokens=max_new_tokens, do_sample=False)
    return tokenizer.decode(out[0, ids["input_ids"].shape[1]:], skip_special_tokens=True)
