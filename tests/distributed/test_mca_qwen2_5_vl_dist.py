"""Qwen2.5-VL on Megatron, under one 2-process torchrun (gloo, fp32, CPU): the family's conversion guarantees.

Two tiny models with random values in every tensor (vision tower included): roll.demo.tiny_vl's (hidden 64, 4 heads
over 2 KV groups, M-RoPE sections 2/3/3, tied) and an odd-shaped one (hidden 48, 6 heads of 8 over 2 KV groups,
sections 1/1/2, a 517-row vocabulary that TP2 pads to 518, untied, merger out width 48):

- ``roll-convert check``'s logits parity (``convert.check_parity``) on a batch with two images of different sizes
  (grids 4x6 and 6x2 patches) and a text-only row, HF's ``Qwen2_5_VLForConditionalGeneration`` against the
  Megatron model (the vision tower on the first stage), at TP1, TP2 and PP2, within the bounds of tests/bounds.py;
- HF -> Megatron -> HF bit-exact across TP1, TP2 and PP2 (written at one layout, exported at another), the vision
  tower's tensors included; the export loads with transformers and keeps the image processor.
"""

from __future__ import annotations

import os

import pytest
import torch

from tests.bounds import assert_within
from tests.distributed.test_mca_conversion import _read_weights, logit_comparisons, randomized, run_cases

pytest.importorskip("megatron.core")
pytestmark = [pytest.mark.distributed, pytest.mark.mca]


def odd_vl_model(out_dir: str) -> str:
    """roll.demo.tiny_vl's model at an odd shape (see the module docstring)."""
    from transformers import Qwen2_5_VLForConditionalGeneration

    from roll.demo.tiny_vl import build_vl_tokenizer, tiny_image_processor, tiny_vl_config

    tok = build_vl_tokenizer()
    config = tiny_vl_config(tok, tie_word_embeddings=False)
    text = config.text_config
    text.hidden_size, text.num_attention_heads, text.num_key_value_heads = 48, 6, 2
    text.intermediate_size, text.vocab_size = 96, 517
    text.rope_parameters["mrope_section"] = [1, 1, 2]
    config.vision_config.out_hidden_size = 48
    Qwen2_5_VLForConditionalGeneration(config).save_pretrained(out_dir)
    tok.save_pretrained(out_dir)
    tiny_image_processor().save_pretrained(out_dir)
    return out_dir


def assert_vl_exported_like(original: str, exported: str) -> None:
    """Bit-exact tensors (the vision tower's too), the same config.json, the image processor kept, and
    transformers loads it as the vision-language model it was."""
    import json

    from transformers import Qwen2_5_VLForConditionalGeneration

    a, b = _read_weights(original), _read_weights(exported)
    assert sorted(a) == sorted(b) and any(name.startswith("visual.") for name in a)
    assert all(torch.equal(a[n], b[n]) for n in a), [n for n in a if not torch.equal(a[n], b[n])]
    with open(os.path.join(original, "config.json"), encoding="utf-8") as fa, \
            open(os.path.join(exported, "config.json"), encoding="utf-8") as fb:
        assert json.load(fa) == json.load(fb)
    assert os.path.isfile(os.path.join(exported, "preprocessor_config.json"))
    model = Qwen2_5_VLForConditionalGeneration.from_pretrained(exported, dtype=torch.float32)
    assert torch.equal(model.model.visual.patch_embed.proj.weight, a["visual.patch_embed.proj.weight"])
    assert torch.equal(model.model.language_model.embed_tokens.weight, a["model.embed_tokens.weight"])


ROUND_TRIPS = (("tp1", {}, "tp2", {"tp": 2}), ("tp2", {"tp": 2}, "pp2", {"pp": 2}), ("pp2", {"pp": 2}, "tp1", {}))
"""(written at, its layout, exported at, its layout): every layout on both sides once."""


def test_qwen2_5_vl_logits_tp1_tp2_pp2_and_bit_exact_round_trips(tmp_path):
    from roll.demo.tiny_vl import make_tiny_vl_model

    tiny = randomized(make_tiny_vl_model(str(tmp_path / "tiny_src")), str(tmp_path / "tiny"))
    odd = randomized(odd_vl_model(str(tmp_path / "odd_src")), str(tmp_path / "odd"))
    cases = [dict(name="vl_tp1", kind="check", dir=tiny),
             dict(name="vl_tp2", kind="check", dir=tiny, tp=2),
             dict(name="vl_pp2", kind="check", dir=tiny, pp=2),
             dict(name="vl_odd_tp1", kind="check", dir=odd),
             dict(name="vl_odd_tp2_padded_vocab", kind="check", dir=odd, tp=2)]
    for (written, write_layout, exported, export_layout), hf in zip(ROUND_TRIPS, (tiny, odd, tiny)):
        mca, out = str(tmp_path / f"mca_{written}"), str(tmp_path / f"hf_{written}_{exported}")
        cases += [dict(name=f"to_mca_{written}", kind="hf2mca", dir=hf, out=mca, **write_layout),
                  dict(name=f"to_hf_{written}_{exported}", kind="mca2hf", dir=mca, out=out, max_shard_bytes=60_000,
                       **export_layout)]
    res = run_cases(cases, tmp_path, timeout=420)
    assert all(rows[0]["diff"] == rows[1]["diff"] for rows in res.values() if "diff" in rows[0])
    assert_within(logit_comparisons(res))
    for (written, _, exported, _), hf in zip(ROUND_TRIPS, (tiny, odd, tiny)):
        assert_vl_exported_like(hf, str(tmp_path / f"hf_{written}_{exported}"))
