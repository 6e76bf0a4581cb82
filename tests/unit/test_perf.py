"""roll.perf: model FLOPs per token against hand counts and torch's FLOP counter, the GPU peak table,
the CPU matmul probe, peak memory and the log fields built from them."""

from __future__ import annotations

import math
import resource
import time

import pytest
import torch

from roll import perf


def mm(n_in: int, n_out: int) -> int:
    """FLOPs of one token through an n_in -> n_out matmul (a multiply-add is 2)."""
    return 2 * n_in * n_out


def test_dense_flops_match_a_hand_count():
    # GQA (4 query heads, 2 KV heads), head_dim 8 = hidden / heads, untied head, 2 layers, s = 10
    config = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
              "num_key_value_heads": 2, "vocab_size": 100, "tie_word_embeddings": False}
    s = 10
    q, k, v, o = mm(32, 4 * 8), mm(32, 2 * 8), mm(32, 2 * 8), mm(4 * 8, 32)
    scores = 4 * (2 * 8 * s)  # per head: the token's query against s keys
    values = 4 * (2 * s * 8)  # per head: s probabilities times s value rows
    gate, up, down = mm(32, 64), mm(32, 64), mm(64, 32)
    layer = q + k + v + o + scores + values + gate + up + down
    head = mm(32, 100)
    forward = 2 * layer + head
    assert forward == 45824  # the numbers above, added up by hand
    assert perf.flops_per_token(config, s) == 3 * forward


def test_moe_flops_count_the_active_experts_only():
    # 8 experts, top-2, a shared expert; layer 1 is dense (mlp_only_layers); head_dim 8 != hidden / heads
    config = {"hidden_size": 16, "intermediate_size": 20, "num_hidden_layers": 2, "num_attention_heads": 4,
              "num_key_value_heads": 2, "head_dim": 8, "vocab_size": 50, "num_experts": 8,
              "num_experts_per_tok": 2, "moe_intermediate_size": 12, "shared_expert_intermediate_size": 24,
              "decoder_sparse_step": 1, "mlp_only_layers": [1], "tie_word_embeddings": True}
    s = 6
    attention = mm(16, 32) + mm(16, 16) + mm(16, 16) + mm(32, 16) + 4 * (2 * 8 * s) * 2
    router = mm(16, 8)
    expert = mm(16, 12) + mm(16, 12) + mm(12, 16)  # gate, up, down of one expert
    shared = mm(16, 24) + mm(16, 24) + mm(24, 16) + mm(16, 1)  # the shared expert and its 1-wide gate
    moe_layer = attention + router + 2 * expert + shared
    dense_layer = attention + mm(16, 20) + mm(16, 20) + mm(20, 16)
    forward = moe_layer + dense_layer + mm(16, 50)  # tied: the head is still a matmul
    assert perf.flops_per_token(config, s) == 3 * forward
    # more experts at the same top-k change only the router
    wider = {**config, "num_experts": 64}
    assert perf.flops_per_token(wider, s) - perf.flops_per_token(config, s) == 3 * mm(16, 64 - 8)


@pytest.mark.parametrize("family", ["qwen2", "qwen2_moe", "qwen3_moe"])
def test_flops_equal_torch_flop_counter_on_hf_models(family):
    """An independent count: torch's FlopCounterMode over a real forward + backward of the HF model
    (eager attention counts the full s x s scores, as flops_per_token does; eager experts run only
    the routed tokens)."""
    import transformers
    from torch.utils.flop_counter import FlopCounterMode

    common = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, vocab_size=100, attn_implementation="eager")
    moe = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16, experts_implementation="eager")
    configs = {
        "qwen2": (transformers.Qwen2Config(**common, tie_word_embeddings=False),
                  transformers.Qwen2ForCausalLM),
        "qwen2_moe": (transformers.Qwen2MoeConfig(**common, **moe, shared_expert_intermediate_size=48),
                      transformers.Qwen2MoeForCausalLM),
        "qwen3_moe": (transformers.Qwen3MoeConfig(**common, **moe, head_dim=16),
                      transformers.Qwen3MoeForCausalLM),
    }
    config, model_class = configs[family]
    torch.manual_seed(0)
    model, s = model_class(config), 12
    ids = torch.randint(0, config.vocab_size, (1, s))
    with FlopCounterMode(display=False) as counter:
        model(input_ids=ids, labels=ids).loss.backward()
    assert counter.get_total_flops() == perf.flops_per_token(config, s) * s


@pytest.mark.parametrize("name,dtype,expected", [
    ("NVIDIA H100 80GB HBM3", torch.bfloat16, 989.4e12),
    ("NVIDIA H100 PCIe", torch.float16, 756e12),
    ("NVIDIA H100 NVL", torch.bfloat16, 835e12),
    ("NVIDIA H200", torch.bfloat16, 989.4e12),
    ("NVIDIA A100-SXM4-80GB", torch.bfloat16, 312e12),
    ("NVIDIA A100 80GB PCIe", torch.bfloat16, 312e12),
    ("NVIDIA A10", torch.bfloat16, 125e12),
    ("NVIDIA L4", torch.bfloat16, 121e12),
    ("NVIDIA L40S", torch.bfloat16, 362e12),
    ("NVIDIA L40", torch.bfloat16, 181e12),
    ("Tesla V100-SXM2-32GB", torch.float16, 125e12),
])
def test_gpu_peak_table(name, dtype, expected):
    peak, description = perf.gpu_table_peak(name, dtype)
    assert peak == pytest.approx(expected)
    assert "datasheet" in description


def test_gpu_peak_table_fp32_column_and_unknown_names():
    before = torch.get_float32_matmul_precision()
    try:
        torch.set_float32_matmul_precision("high")
        assert perf.gpu_table_peak("NVIDIA A100-SXM4-40GB", torch.float32) == (pytest.approx(156e12),
                                                                              "A100 datasheet, dense tf32")
        torch.set_float32_matmul_precision("highest")
        assert perf.gpu_table_peak("NVIDIA A100-SXM4-40GB", torch.float32)[0] == pytest.approx(19.5e12)
    finally:
        torch.set_float32_matmul_precision(before)
    assert perf.gpu_table_peak("NVIDIA A10G", torch.bfloat16) is None  # not A10, not on a datasheet
    assert perf.gpu_table_peak("Some Future GPU", torch.bfloat16) is None


def test_cpu_probe_is_fast_positive_and_finite():
    start = time.perf_counter()
    peak, description = perf.hardware_peak_flops("cpu", torch.float32)
    assert time.perf_counter() - start < 1.0
    assert math.isfinite(peak) and peak > 1e8  # any CPU of this decade does far more than 0.1 GFLOP/s
    assert description.startswith("CPU matmul probe, float32, ")


def test_peak_memory_is_this_process_peak_rss_on_cpu():
    peak = perf.peak_memory_bytes("cpu")
    assert peak > 0
    assert peak >= resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - 1  # KiB -> bytes, not less


def test_speed_metrics_fields():
    fields = perf.speed_metrics(tokens=1000, seconds=2.0, steps=4, world_size=2, flops_per_token=1e6,
                                peak_flops=1e9, device="cpu")
    assert set(fields) == set(perf.SPEED_KEYS)
    assert fields["step_time"] == 0.5
    assert fields["tokens_per_second"] == 500.0
    assert fields["mfu"] == pytest.approx(500 * 1e6 / 2 / 1e9)  # per rank: half the model FLOP/s
    assert fields["peak_memory_gb"] > 0


def test_speed_meter_uses_the_window_sequence_length():
    config = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
              "num_key_value_heads": 2, "vocab_size": 100}
    meter = perf.SpeedMeter(config, world_size=1, device="cpu")
    short, long = (meter.metrics(100, 1.0, 1, seq_length=n)["mfu"] for n in (8, 800))
    assert 0 < short < long  # the attention term grows with the sequence
    assert long / short == pytest.approx(perf.flops_per_token(config, 800) / perf.flops_per_token(config, 8),
                                         rel=1e-3)
