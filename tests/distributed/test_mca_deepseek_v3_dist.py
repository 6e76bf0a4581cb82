"""DeepSeek-V3 (``deepseek_v3``) HF <-> Megatron under one 2-process torchrun (gloo, fp32, CPU): ``roll-convert
check`` logits parity of multi-latent attention with a q LoRA rank and YaRN (the real config's kind of RoPE) at TP1,
TP2, PP2 (the first stage holds only the dense first layers) and EP2, without a q LoRA rank and with plain RoPE at
TP1 and TP2, and HF -> Megatron (EP2) -> HF bit-exact at PP2 and TP2, the router's correction bias included.

The model (``roll.demo.tiny_model``): hidden 48, 4 heads with 8 + 8 q/k head dims and v heads of 12, q and kv
LoRA ranks 16, a 509-token vocabulary (TP2 pads it), 4 layers of which the first 2 are dense, 4 experts in 2
groups (top 2 from 1 group) plus a shared expert, routed scores scaled by 2.5, every tensor random.
"""

from __future__ import annotations

import pytest

from tests.bounds import assert_within
from tests.distributed.test_mca_conversion import (_assert_exported_like, _read_weights, logit_comparisons,
                                                   randomized, run_cases)

pytest.importorskip("megatron.core")
pytestmark = [pytest.mark.distributed, pytest.mark.mca]


def test_deepseek_v3_logits_tp1_tp2_pp2_ep2_and_round_trip(tiny_model_factory, tmp_path):
    layers = dict(num_layers=4, first_k_dense_replace=2, tie_word_embeddings=False)
    hf = randomized(tiny_model_factory("deepseek_v3", **layers), str(tmp_path / "mla"), vocab=509)
    from roll.demo.tiny_model import make_tiny_model

    plain = {"rope_type": "default", "rope_theta": 10000.0}
    no_q_lora = randomized(make_tiny_model(str(tmp_path / "no_q_lora_src"), kind="deepseek_v3", q_lora_rank=None,
                                           rope_parameters=plain, **layers), str(tmp_path / "mla_no_q_lora"))
    assert "model.layers.0.self_attn.q_proj.weight" in _read_weights(no_q_lora)  # no q_a_proj / q_b_proj
    mca, out_pp2, out_tp2 = (str(tmp_path / n) for n in ("mca_ep2", "hf_pp2", "hf_tp2"))
    res = run_cases([dict(name="deepseek_v3_tp1", kind="check", dir=hf),
                     dict(name="deepseek_v3_tp2", kind="check", dir=hf, tp=2),
                     dict(name="deepseek_v3_pp2", kind="check", dir=hf, pp=2),
                     dict(name="deepseek_v3_ep2", kind="check", dir=hf, ep=2),
                     dict(name="deepseek_v3_no_q_lora_tp1", kind="check", dir=no_q_lora),
                     dict(name="deepseek_v3_no_q_lora_tp2", kind="check", dir=no_q_lora, tp=2),
                     dict(name="deepseek_v3_to_mca_ep2", kind="hf2mca", dir=hf, out=mca, ep=2),
                     dict(name="deepseek_v3_to_hf_pp2", kind="mca2hf", dir=mca, out=out_pp2, pp=2,
                          max_shard_bytes=60_000),
                     dict(name="deepseek_v3_to_hf_tp2", kind="mca2hf", dir=mca, out=out_tp2, tp=2,
                          max_shard_bytes=60_000)], tmp_path)
    _assert_exported_like(hf, out_pp2)
    _assert_exported_like(hf, out_tp2)
    assert_within(logit_comparisons(res))
