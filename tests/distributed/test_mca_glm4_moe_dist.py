"""GLM-4.5 (``glm4_moe``) HF <-> Megatron under one 2-process torchrun (gloo, fp32, CPU): ``roll-convert check``
logits parity at TP1, TP2 (experts split by ETP2), PP2 (the first stage holds only the dense first layers)
and EP2, and HF -> Megatron (EP2) -> HF bit-exact at PP2 and TP2, the router's correction bias included.

The model: hidden 48 with 4 heads of 16 in 2 KV groups (heads x head_dim != hidden, as in GLM-4.5), a
509-token vocabulary (TP2 pads it), a quarter of each head rotated, q/k/v bias, 4 layers of which the first 2
are dense, 4 experts (top 2) plus a shared expert, routed scores scaled by 2.5, every tensor random (the
correction bias too: a zero bias would hide a missing mapping).
"""

from __future__ import annotations

import pytest
import torch

from roll.launch import free_port
from tests.bounds import assert_within
from tests.distributed.test_mca_conversion import (_assert_exported_like, _read_weights, logit_comparisons,
                                                   randomized, run_cases)

pytest.importorskip("megatron.core")
pytestmark = [pytest.mark.distributed, pytest.mark.mca]


def test_glm4_moe_logits_tp1_tp2_pp2_ep2_and_round_trip(tiny_model_factory, tmp_path):
    hf = randomized(tiny_model_factory("glm4_moe", num_layers=4, first_k_dense_replace=2,
                                       tie_word_embeddings=False), str(tmp_path / "glm4_moe"), vocab=509)
    bias = _read_weights(hf)["model.layers.2.mlp.gate.e_score_correction_bias"]
    assert bias.abs().min() > 0 and bias.dtype == torch.float32
    mca, out_pp2, out_tp2 = (str(tmp_path / n) for n in ("mca_ep2", "hf_pp2", "hf_tp2"))
    res = run_cases([dict(name="glm4_moe_tp1", kind="check", dir=hf),
                     dict(name="glm4_moe_tp2", kind="check", dir=hf, tp=2),
                     dict(name="glm4_moe_pp2", kind="check", dir=hf, pp=2),
                     dict(name="glm4_moe_ep2", kind="check", dir=hf, ep=2),
                     dict(name="glm4_moe_to_mca_ep2", kind="hf2mca", dir=hf, out=mca, ep=2),
                     dict(name="glm4_moe_to_hf_pp2", kind="mca2hf", dir=mca, out=out_pp2, pp=2,
                          max_shard_bytes=60_000),
                     dict(name="glm4_moe_to_hf_tp2", kind="mca2hf", dir=mca, out=out_tp2, tp=2,
                          max_shard_bytes=60_000)], tmp_path)
    _assert_exported_like(hf, out_pp2)
    _assert_exported_like(hf, out_tp2)
    assert_within(logit_comparisons(res))


def test_bf16_training_keeps_the_fp32_correction_bias(tiny_model_factory, tmp_path):
    """Float16Module casts every buffer to bf16; Megatron casts the expert bias back to fp32 in the forward, with
    the rounding kept (1.6e-4 here): the mca trainer's wrap puts the loaded fp32 values back, as HF keeps them."""
    import os
    import sys

    from tests.helpers import REPO, output_of, results, run

    hf = randomized(tiny_model_factory("glm4_moe", num_layers=3), str(tmp_path / "glm4_moe"))
    worker = os.path.join(REPO, "tests", "distributed", "_mca_workers", "bf16_expert_bias.py")
    proc = run([sys.executable, worker, hf], timeout=180, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()),
               RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
    assert proc.returncode == 0, output_of(proc)
    assert results(proc.stdout) == [{"exact": True, "layers": [1, 2], "dtypes": ["torch.float32"]}], output_of(proc)
