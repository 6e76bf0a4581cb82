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


# Families whose forward + backward torch's FlopCounterMode counts exactly as flops_per_token does: dense
# (gated and GPT-2 style MLPs, multi-query, parallel blocks), MoE under each family's names, shared experts
# and dense first layers, MLA, sliding-window and gated attention. The other families of the installed
# transformers train with a numeric mfu (tests/unit/test_family_matrix.py); docs/performance.md says
# which parts of them are counted.
EXACT_FAMILIES = ["qwen2", "llama", "mistral", "gpt2", "falcon", "opt", "phi3", "granite", "gemma3_text",
                  "qwen2_moe", "qwen3_moe", "mixtral", "olmoe", "phimoe", "gpt_oss", "glm4_moe",
                  "deepseek_v2", "deepseek_v3", "qwen3_next"]


def _counted_flops(family: str, s: int, monkeypatch) -> tuple[int, object]:
    """(FlopCounterMode's count of one forward + backward over ``s`` tokens, the config) of a tiny model
    (tests/families.py) with eager attention (the full s x s scores, as flops_per_token counts them) and
    eager experts (only the routed tokens run). Qwen3-Next's gated-DeltaNet recurrence is replaced by a
    matmul-free stand-in that keeps every input in the graph: torch's chunked fallback pads the sequence
    to 64-token chunks (its count is the padding's, not the model's); the stand-in leaves the projections,
    the convolution and everything else to the counter."""
    from torch.utils.flop_counter import FlopCounterMode
    from transformers import AutoModelForCausalLM

    from tests.families import tiny_config

    config = tiny_config(family, 100, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    config._attn_implementation = "eager"
    if hasattr(config, "_experts_implementation"):
        config._experts_implementation = "eager"
    if family == "qwen3_next":
        from transformers.models.qwen3_next import modeling_qwen3_next

        def stand_in(query, key, value, g, beta, **kwargs):
            return value * (1 + g.unsqueeze(-1) + beta.unsqueeze(-1)) + 0 * (query.sum() + key.sum()), None

        monkeypatch.setattr(modeling_qwen3_next, "torch_chunk_gated_delta_rule", stand_in)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="eager")
    ids = torch.randint(3, 100, (1, s))
    with FlopCounterMode(display=False) as counter:
        model(input_ids=ids, labels=ids, use_cache=False).loss.backward()
    ops = counter.get_flop_counts()["Global"]
    return sum(v for op, v in ops.items() if "convolution" not in str(op)), config


@pytest.mark.parametrize("family", EXACT_FAMILIES)
def test_flops_equal_torch_flop_counter_on_hf_models(family, monkeypatch):
    """An independent count: torch's FlopCounterMode over a real forward + backward of the HF model."""
    s = 12
    counted, config = _counted_flops(family, s, monkeypatch)
    expected = perf.flops_per_token(config, s) * s
    if family == "qwen3_next":
        # Not seen by the counter: the stand-in recurrence (3 d_k x d_v products per value head and token)
        # and the depthwise causal conv (torch counts it over the padded length, and its backward as a
        # dense conv), both counted by hand here: 4 value heads of 8 x 8, 64 conv channels of 4 taps.
        state, conv = 3 * 2 * 4 * 8 * 8, 2 * 4 * (2 * 2 * 8 + 4 * 8)
        expected -= 3 * (state + conv) * s  # forward + backward, one linear-attention layer
    assert counted == expected


def test_sliding_window_layers_count_the_window():
    """Gemma-3 style: layer 0 slides over a 4-token window, layer 1 attends over everything."""
    config = {"model_type": "gemma3_text", "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
              "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8, "vocab_size": 100,
              "sliding_window": 4, "layer_types": ["sliding_attention", "full_attention"]}
    s = 10
    scores = 4 * (2 * 8 * 2)  # per position attended: q.k and p.v of 4 heads of 8
    full = {**config, "layer_types": ["full_attention", "full_attention"]}
    assert perf.flops_per_token(full, s) - perf.flops_per_token(config, s) == 3 * scores * (s - 4)
    assert perf.flops_per_token(config, 3) == perf.flops_per_token(full, 3)  # shorter than the window


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
    # test_dense_flops_match_a_hand_count's model: per layer 2*(1024+512+512+1024+3*2048) + 128*s, head 6400
    hand = {n: 2 * (18432 + 128 * n) + 6400 for n in (8, 800)}
    assert long / short == pytest.approx(hand[800] / hand[8], rel=1e-3)


# ---- a metric never stops a run -------------------------------------------------------------------

def _uncountable(config, seq_length):
    raise TypeError("int() argument must be a string, a bytes-like object or a real number, not 'NoneType'")


def test_speed_fields_that_cannot_be_computed_are_null_with_one_warning(monkeypatch, roll_warnings):
    monkeypatch.setattr(perf, "flops_per_token", _uncountable)  # a family the formula cannot read
    meter = perf.SpeedMeter({"model_type": "mystery"}, world_size=1, device="cpu")
    records = [meter.metrics(100, 1.0, 1, seq_length=8) for _ in range(3)]
    for record in records:
        assert record["mfu"] is None and record["tokens_per_second"] == 100.0, record
        assert record["peak_memory_gb"] > 0, record
    monkeypatch.setattr(perf, "peak_memory_bytes", lambda device=None: 1 / 0)
    assert meter.metrics(100, 1.0, 1, seq_length=8)["peak_memory_gb"] is None
    warnings = [r.getMessage() for r in roll_warnings.records]
    assert len(warnings) == 2, warnings  # one per field, however many windows
    assert "mfu is logged as null" in warnings[0] and "'mystery'" in warnings[0] and "NoneType" in warnings[0]
    assert "peak_memory_gb is logged as null" in warnings[1] and "ZeroDivisionError" in warnings[1]


def test_a_config_without_sizes_names_what_is_missing():
    from roll.errors import ModelError

    with pytest.raises(ModelError, match="lacks hidden_size / d_model / n_embd"):
        perf.flops_per_token({"model_type": "mystery", "num_hidden_layers": 2, "vocab_size": 10}, 8)


def test_standard_backend_trains_on_when_mfu_and_memory_cannot_be_computed(tiny_model_dir, tmp_path,
                                                                        monkeypatch, roll_warnings):
    """The crash of issue 19 (a TypeError in the FLOPs formula after step 1), forced: the run finishes,
    train_log.jsonl carries null for the fields that failed and numbers for the rest."""
    import json

    from tests.unit.test_standard_train import train_in_process

    monkeypatch.setattr(perf, "flops_per_token", _uncountable)
    monkeypatch.setattr(perf, "peak_memory_bytes", lambda device=None: 1 / 0)
    train_in_process(tiny_model_dir, tmp_path, max_steps=3)
    records = [json.loads(line) for line in (tmp_path / "train_log.jsonl").read_text().splitlines()]
    steps = [r for r in records if "loss" in r]
    assert [r["step"] for r in steps] == [1, 2, 3]
    for record in steps:
        assert record["mfu"] is None and record["peak_memory_gb"] is None, record
        assert record["tokens_per_second"] > 0 and record["step_time"] > 0, record
    nulls = [r.getMessage() for r in roll_warnings.records if "logged as null" in r.getMessage()]
    assert len(nulls) == 2, nulls


def test_mca_metrics_writer_takes_null_fields(tmp_path):
    """The mca backend's writer: null in train_log.jsonl, left out of TensorBoard and the progress bar."""
    import json

    pytest.importorskip("tensorboard")
    from backends.mca.trainer.metrics import MetricsWriter, bar_postfix

    record = {"loss": 2.5, "step_time": 0.5, "tokens_per_second": 100.0, "mfu": None, "peak_memory_gb": None}
    writer = MetricsWriter(str(tmp_path), total_steps=1, report_to="tensorboard")
    writer.log(1, record)
    writer.close()
    assert json.loads((tmp_path / "train_log.jsonl").read_text()) == {"step": 1, **record}
    assert bar_postfix(record) == {"loss": "2.5000", "tok/s": "100"}
