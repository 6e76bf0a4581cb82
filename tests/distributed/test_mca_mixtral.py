"""Mixtral on Megatron, under one 2-process torchrun (gloo, fp32, CPU): the family's conversion guarantees.

A tiny Mixtral of odd shape (hidden 48, not a power of two; 6 heads over 2 KV groups, head_dim 8; an odd
vocabulary of 509 rows that TP2 pads to 510; 4 experts of 24, top-2, no shared expert) with random values in
every tensor:

- ``roll-convert check``'s logits parity (``convert.check_parity``) at TP1, TP2 (experts split by ETP2),
  PP2, EP2 and TP2 x EP2 x ETP1 (sequence parallelism forced on), within the bounds of tests/bounds.py;
- HF -> Megatron -> HF bit-exact at TP1, TP2, PP2 and EP2 (each written and exported at its layout), and the
  export loads with ``AutoModelForCausalLM``;
- the same model saved with transformers 5's fused experts (``save_original_format=False``): logits at TP2
  (experts split by ETP2), and fused HF -> Megatron (EP2) -> HF the per-expert checkpoint bit for bit.
"""

from __future__ import annotations

import os
import shutil

import pytest

from tests.distributed.test_mca_conversion import (_assert_exported_like, logit_comparisons, randomized,
                                                   run_cases)
from tests.bounds import assert_within

pytest.importorskip("megatron.core")
pytestmark = [pytest.mark.distributed, pytest.mark.mca]

ODD_SHAPE = dict(hidden_size=48, num_attention_heads=6, num_key_value_heads=2, head_dim=8,
                 intermediate_size=24, tie_word_embeddings=False)
"""The tiny Mixtral's shape (roll.demo.tiny_model overrides)."""

LAYOUTS = {"tp1": {}, "tp2": {"tp": 2}, "pp2": {"pp": 2}, "ep2": {"ep": 2}}
"""Layouts of the round trip (name -> convert_worker layout keys)."""


def test_mixtral_logits_parity_and_bit_exact_round_trips(tiny_model_factory, tmp_path):
    hf = randomized(tiny_model_factory("mixtral", **ODD_SHAPE), str(tmp_path / "mixtral"), vocab=509)
    cases = [dict(name="mixtral_tp1", kind="check", dir=hf),
             dict(name="mixtral_tp2_etp2_padded_vocab", kind="check", dir=hf, tp=2),
             dict(name="mixtral_pp2", kind="check", dir=hf, pp=2),
             dict(name="mixtral_ep2", kind="check", dir=hf, ep=2),
             dict(name="mixtral_tp2_ep2_sp", kind="check", dir=hf, tp=2, ep=2, etp=1)]
    for name, layout in LAYOUTS.items():
        mca, out = str(tmp_path / f"mca_{name}"), str(tmp_path / f"hf_{name}")
        cases += [dict(name=f"to_mca_{name}", kind="hf2mca", dir=hf, out=mca, **layout),
                  dict(name=f"to_hf_{name}", kind="mca2hf", dir=mca, out=out, max_shard_bytes=60_000,
                       **layout)]
    fused, fused_mca, fused_out = (str(tmp_path / n) for n in ("fused", "mca_fused", "hf_fused"))
    _save_fused(hf, fused)
    cases += [dict(name="mixtral_fused_tp2", kind="check", dir=fused, tp=2),
              dict(name="to_mca_fused_ep2", kind="hf2mca", dir=fused, out=fused_mca, ep=2),
              dict(name="to_hf_fused", kind="mca2hf", dir=fused_mca, out=fused_out, max_shard_bytes=60_000)]
    res = run_cases(cases, tmp_path, timeout=480)
    assert all(rows[0]["diff"] == rows[1]["diff"] for rows in res.values() if "diff" in rows[0])
    assert_within(logit_comparisons(res))
    for name in LAYOUTS:
        _assert_exported_like(hf, str(tmp_path / f"hf_{name}"))
    _assert_exported_like(hf, fused_out)  # the per-expert layout transformers' save_pretrained writes by default


def _save_fused(hf: str, out: str) -> None:
    import torch
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(hf, dtype=torch.float32)
    model.save_pretrained(out, save_original_format=False)
    with safe_open(f"{out}/model.safetensors", "pt") as fh:
        assert {"model.layers.1.mlp.experts.gate_up_proj", "model.layers.1.mlp.gate.weight"} <= set(fh.keys())
    for name in os.listdir(hf):  # the original config.json and tokenizer: only the weights' layout differs
        if not name.endswith((".safetensors", ".index.json")):
            shutil.copy2(os.path.join(hf, name), out)
