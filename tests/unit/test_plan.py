"""The layout planner's arithmetic (roll/plan/planner.py), hand-checked on a small Llama-shaped model, and `--plan`.

The model: hidden 64, 4 layers, 4 heads (no GQA), ffn 128, vocab 256, untied, no biases. Per layer:
attention 4 * 64 * 64 = 16384, MLP 3 * 64 * 128 = 24576, two norms 128 -> 41088; embedding = head = 16384;
final norm 64; N = 4 * 41088 + 2 * 16384 + 64 = 197184 parameters.
"""

from __future__ import annotations

import json
import math

import pytest

from roll.cli import main as roll_train
from roll.config.parser import resolve
from roll.errors import ConfigError, ModelError
from roll.plan.shape import KNOWN_SHAPES, ModelShape, resolve_shape, shape_from_hf_config
from roll.plan.planner import GIB, activation_bytes, plan_run, stage_params
from roll.plan.strategy import Strategy, strategy_for

N = 197184
LLAMA = {"model_type": "llama", "hidden_size": 64, "num_hidden_layers": 4, "num_attention_heads": 4,
         "num_key_value_heads": 4, "intermediate_size": 128, "vocab_size": 256, "tie_word_embeddings": False}
SHAPE = shape_from_hf_config(LLAMA)


@pytest.fixture
def model_dir(tmp_path, monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    (tmp_path / "config.json").write_text(json.dumps(LLAMA))
    return str(tmp_path)


def plan_of(model_dir: str, **overrides):
    config = resolve({"model_name_or_path": model_dir, **overrides}, {}, None)
    plan = plan_run(config)
    return plan, {line.key: line.bytes for line in plan.lines}


def deepspeed_file(tmp_path, stage: int, offload: bool = False) -> str:
    zero = {"stage": stage}
    if offload:
        zero.update(offload_optimizer={"device": "cpu"}, offload_param={"device": "cpu"})
    path = tmp_path / f"ds_z{stage}{'_offload' if offload else ''}.json"
    path.write_text(json.dumps({"zero_optimization": zero}))
    return str(path)


def test_parameter_count_by_hand():
    assert SHAPE.total_params() == N


@pytest.mark.parametrize("kind", ["qwen2", "qwen3_moe"])
def test_parameter_count_matches_a_saved_model(tiny_model_factory, kind):
    """The count from config.json equals the tensors actually saved (biases, QK norms, router, experts)."""
    from safetensors import safe_open

    path = tiny_model_factory(kind)
    shape, source = resolve_shape(path)
    assert "config.json" in source
    with safe_open(f"{path}/model.safetensors", "pt") as fh:
        saved = sum(math.prod(fh.get_slice(k).get_shape()) for k in fh.keys())
    assert shape.total_params() == saved


@pytest.mark.parametrize("family", ["mixtral", "qwen2_moe", "glm4_moe", "deepseek_v2", "deepseek_v3", "phi3"])
def test_parameter_count_of_moe_and_mla_families(family):
    """Experts sized by intermediate_size (Mixtral), shared experts with a gate (Qwen2-MoE), n_routed_experts
    with a dense first layer (GLM-4-MoE, DeepSeek), latent attention (DeepSeek): the count from the config
    dict equals the HF model's own parameters (built on the meta device: no memory)."""
    import torch
    from transformers import AutoModelForCausalLM

    from tests.families import tiny_config

    config = tiny_config(family, 1000, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    assert shape_from_hf_config(config.to_dict()).total_params() == sum(p.numel() for p in model.parameters())


def test_builtin_shapes_give_the_published_sizes():
    """Totals of the real checkpoints (their safetensors index): the table rows are the public config.json."""
    assert KNOWN_SHAPES["qwen2.5-7b"].total_params() == 7_615_616_512
    assert KNOWN_SHAPES["qwen3-30b-a3b"].total_params() == 30_532_122_624
    assert KNOWN_SHAPES["llama-3-8b"].total_params() == 8_030_261_248
    shape, source = resolve_shape("Qwen/Qwen2.5-7B-Instruct")
    assert shape is KNOWN_SHAPES["qwen2.5-7b"] and "built-in" in source
    assert resolve_shape("meta-llama/Llama-3.1-8B-Instruct")[0] is KNOWN_SHAPES["llama-3-8b"]
    with pytest.raises(ModelError, match="not a built-in shape"):
        resolve_shape("org/Unknown-13B")


def test_standard_fp32_without_deepspeed(model_dir):
    """fp32 weights, grads and Adam m, v: 4 + 4 + 8 bytes per parameter, nothing sharded."""
    _, by = plan_of(model_dir)
    assert (by["parameters"], by["gradients"], by["optimizer states"]) == (4 * N, 4 * N, 8 * N)
    assert "DDP buckets" not in by


@pytest.mark.parametrize("stage, params, grads, optim", [
    (0, 2 * N, 2 * N, 12 * N),
    (1, 2 * N, 2 * N, 12 * N / 4),
    (2, 2 * N, 2 * N / 4, 12 * N / 4),
    (3, 2 * N / 4, 2 * N / 4, 12 * N / 4),
])
def test_zero_stages_shard_over_all_ranks(model_dir, tmp_path, stage, params, grads, optim):
    """bf16 with DeepSpeed: 2 + 2 + 12 bytes per parameter; ZeRO-1 shards the optimizer, -2 also the grads,
    -3 also the parameters."""
    _, by = plan_of(model_dir, bf16=True, nproc_per_node=4, deepspeed=deepspeed_file(tmp_path, stage))
    assert (by["parameters"], by["gradients"], by["optimizer states"]) == (params, grads, optim)
    assert ("ZeRO-3 gathers" in by) == (stage == 3)
    # the reduce bucket (reduce_bucket_size 5e8 elements > N: all gradients) + the fp32 gradient partition
    assert by.get("ZeRO grad buffers") == (2 * N + 4 * N / 4 if stage else None)


def test_zero_keeps_an_fp32_master_partition_in_fp32_training_too(model_dir, tmp_path):
    _, by = plan_of(model_dir, nproc_per_node=2, deepspeed=deepspeed_file(tmp_path, 2))
    assert (by["parameters"], by["gradients"], by["optimizer states"]) == (4 * N, 4 * N / 2, 12 * N / 2)


def test_zero3_offload_moves_params_and_optimizer_to_cpu(model_dir, tmp_path):
    ds = deepspeed_file(tmp_path, 3, offload=True)
    plan, by = plan_of(model_dir, bf16=True, nproc_per_node=4, deepspeed=ds)
    assert by["parameters"] == 0 and by["optimizer states"] == 0
    assert plan.cpu_offload_bytes == 12 * N / 4 + 2 * N / 4


def test_ddp_keeps_a_second_copy_of_the_gradients(model_dir):
    _, by = plan_of(model_dir, nproc_per_node=2)
    assert by["DDP buckets"] == 4 * N


def test_mca_tensor_parallel_and_distributed_optimizer(model_dir):
    """TP2 halves every linear (and the vocab-parallel embedding and head), not the norms:
    4 * (16384 + 24576) / 2 + 4 * 128 + 2 * 16384 / 2 + 64 = 98880 per rank. Megatron keeps an fp32
    main_grad buffer; the distributed optimizer shards the 12 bytes of fp32 master + m + v over DP."""
    per_rank = 98880
    _, by = plan_of(model_dir, use_mca=True, nproc_per_node=2, tensor_model_parallel_size=2)
    assert (by["parameters"], by["gradients"], by["optimizer states"]) == (4 * per_rank, 4 * per_rank,
                                                                            8 * per_rank)
    _, by = plan_of(model_dir, use_mca=True, nproc_per_node=4, tensor_model_parallel_size=2, bf16=True,
                    use_distributed_optimizer=True)
    assert (by["parameters"], by["gradients"], by["optimizer states"]) == (2 * per_rank, 4 * per_rank,
                                                                            12 * per_rank / 2)
    # grad_reduce_in_fp32: false keeps main_grad in bf16 (2 bytes); in fp32 training it changes nothing.
    _, by = plan_of(model_dir, use_mca=True, nproc_per_node=2, tensor_model_parallel_size=2, bf16=True,
                    grad_reduce_in_fp32=False)
    assert by["gradients"] == 2 * per_rank
    _, by = plan_of(model_dir, use_mca=True, nproc_per_node=2, tensor_model_parallel_size=2,
                    grad_reduce_in_fp32=False)
    assert by["gradients"] == 4 * per_rank


def test_pipeline_stages_split_layers_embedding_and_head():
    st = Strategy(backend="mca", world_size=2, pp=2)
    full = type("F", (), {"finetuning_type": "full"})()
    first, last = stage_params(SHAPE, st, full, 0), stage_params(SHAPE, st, full, 1)
    assert first.dense == 2 * 41088 + 16384
    assert last.dense == 2 * 41088 + 16384 + 64
    assert first.dense + last.dense == N


# s=8, b=1, h=64, a=4: s*b*h = 512; 34 * 512 = 17408 bytes per layer (16-bit); 5*a*s/h = 2.5 without flash.
@pytest.mark.parametrize("overrides, stage, expected", [
    ({}, 0, 4 * 17408),
    ({"act_bytes": 4}, 0, 2 * 4 * 17408),
    ({"flash": False}, 0, 4 * 36.5 * 512),
    ({"flash": False, "recompute": "selective"}, 0, 4 * 17408),
    ({"tp": 2, "sp": True}, 0, 4 * 17408 / 2),
    ({"tp": 2}, 0, 4 * (10 + 24 / 2) * 512),
    ({"cp": 2}, 0, 4 * 17408 / 2),
    ({"recompute": "full"}, 0, 4 * 2 * 512 + 17408),
    ({"recompute": "full", "recompute_method": "block", "recompute_num_layers": 2}, 0,
     2 * 2 * 512 + 2 * 17408 + 17408),
    ({"pp": 2}, 0, 2 * 17408 * 2),  # 1F1B: the first stage holds pp micro-batches
    ({"pp": 2}, 1, 2 * 17408 * 1),
    ({"pp": 2, "vpp": 2}, 0, 2 * 17408 * 2 * (1 + 1 / 4)),
])
def test_activations_korthikanti(overrides, stage, expected):
    st = Strategy(**{"backend": "mca", "world_size": 1, **overrides})
    got = activation_bytes(SHAPE, st, seq=8, batch=1, micro_batches=4, stage=stage)
    assert got == pytest.approx(expected)


def test_lora_trains_only_the_adapters(model_dir):
    """rank 2 on every linear: per layer 4 * 2 * (64 + 64) + 3 * 2 * (64 + 128) = 2176; 4 layers."""
    _, by = plan_of(model_dir, finetuning_type="lora", lora_rank=2)
    assert by["gradients"] == 4 * 8704 and by["optimizer states"] == 8 * 8704
    assert by["parameters"] == 4 * (N + 8704)
    _, by = plan_of(model_dir, finetuning_type="lora", lora_rank=2, lora_target="q_proj,v_proj")
    assert by["gradients"] == 4 * 4 * 2 * 2 * 128


def test_moe_experts_divide_by_expert_parallel(tiny_model_factory):
    shape, _ = resolve_shape(tiny_model_factory("qwen3_moe"))
    full = type("F", (), {"finetuning_type": "full"})()
    ep1 = stage_params(shape, Strategy(backend="mca", world_size=2), full, 0)
    ep2 = stage_params(shape, Strategy(backend="mca", world_size=2, ep=2), full, 0)
    assert ep1.expert == shape.num_layers * shape.expert_params() > 0
    assert ep2.expert == ep1.expert / 2 and ep2.dense == ep1.dense


def test_fits_and_what_to_change(model_dir):
    plan, _ = plan_of(model_dir, gpu_memory_gb=80)
    assert plan.fits and "fits" in plan.format()
    plan, _ = plan_of(model_dir, use_mca=True, gpu_memory_gb=0.5)  # the 2 GiB runtime reserve exceeds it
    assert not plan.fits and plan.total_bytes > 0.5 * GIB
    text = plan.format()
    assert "does not fit" in text and "use_distributed_optimizer" not in text  # DP1: nothing to shard over
    assert "recompute_granularity: full" in text


def test_plan_switch_prints_and_exits_zero(model_dir, capsys):
    assert roll_train([f"model_name_or_path={model_dir}", "--plan", "gpu_memory_gb=1"]) == 0
    out = capsys.readouterr().out
    assert "does not fit" in out and "gradient_checkpointing: true" in out
    assert roll_train([f"model_name_or_path={model_dir}", "--plan", "--json", "--gpu_memory_gb", "40"]) == 0
    record = json.loads(capsys.readouterr().out)
    assert record["fits"] and record["gpu_memory_gb"] == 40
    assert record["total_bytes"] == pytest.approx(sum(line["bytes"] for line in record["lines"]))


def test_builtin_shape_layers_must_divide_the_pipeline(monkeypatch):
    """Qwen2.5-7B has 28 layers: PP8 cannot split them (validate() only sees a local config.json)."""
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    config = resolve({"model_name_or_path": "Qwen/Qwen2.5-7B-Instruct", "use_mca": True, "nproc_per_node": 8,
                      "pipeline_model_parallel_size": 8}, {}, None)
    with pytest.raises(ConfigError, match="num_layers\\(28\\) is not divisible"):
        plan_run(config)


def test_gpu_memory_gb_is_validated(model_dir):
    with pytest.raises(ConfigError, match="gpu_memory_gb"):
        resolve({"model_name_or_path": model_dir, "gpu_memory_gb": 0}, {}, None)


def test_shape_defaults_for_missing_keys():
    """GQA and head_dim default like HF: kv heads = heads, head_dim = hidden / heads."""
    shape = shape_from_hf_config({"model_type": "qwen2", "hidden_size": 64, "num_hidden_layers": 1,
                                  "num_attention_heads": 4, "vocab_size": 10, "intermediate_size": 8})
    got = (shape.num_kv_heads, shape.head_dim, shape.qkv_bias, shape.tie_word_embeddings)
    assert got == (4, 16, True, False)
    assert isinstance(shape, ModelShape)


QWEN2_5_VL_7B = {  # Qwen/Qwen2.5-VL-7B-Instruct's config.json on the Hub (the fields that size it)
    "architectures": ["Qwen2_5_VLForConditionalGeneration"], "model_type": "qwen2_5_vl", "hidden_size": 3584,
    "intermediate_size": 18944, "num_hidden_layers": 28, "num_attention_heads": 28, "num_key_value_heads": 4,
    "vocab_size": 152064, "tie_word_embeddings": False, "sliding_window": 32768, "use_sliding_window": False,
    "rope_scaling": {"type": "mrope", "mrope_section": [16, 24, 24]}, "image_token_id": 151655,
    "vision_start_token_id": 151652, "vision_end_token_id": 151653, "video_token_id": 151656,
    "vision_config": {"depth": 32, "hidden_act": "silu", "hidden_size": 1280, "intermediate_size": 3420,
                      "num_heads": 16, "in_chans": 3, "out_hidden_size": 3584, "patch_size": 14,
                      "spatial_merge_size": 2, "spatial_patch_size": 14, "window_size": 112,
                      "fullatt_block_indexes": [7, 15, 23, 31], "tokens_per_second": 2, "temporal_patch_size": 2}}


QWEN3_VL_8B = {  # Qwen/Qwen3-VL-8B-Instruct's config.json on the Hub (the fields that size it)
    "architectures": ["Qwen3VLForConditionalGeneration"], "model_type": "qwen3_vl", "image_token_id": 151655,
    "vision_start_token_id": 151652, "vision_end_token_id": 151653, "video_token_id": 151656,
    "tie_word_embeddings": False,
    "text_config": {"model_type": "qwen3_vl_text", "hidden_size": 4096, "intermediate_size": 12288,
                    "num_hidden_layers": 36, "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128,
                    "vocab_size": 151936, "tie_word_embeddings": False,
                    "rope_scaling": {"rope_type": "default", "mrope_section": [24, 20, 20], "mrope_interleaved": True}},
    "vision_config": {"model_type": "qwen3_vl", "depth": 27, "hidden_size": 1152, "intermediate_size": 4304,
                      "num_heads": 16, "in_channels": 3, "out_hidden_size": 4096, "patch_size": 16,
                      "spatial_merge_size": 2, "temporal_patch_size": 2, "num_position_embeddings": 2304,
                      "deepstack_visual_indexes": [8, 16, 24]}}


def test_plan_counts_qwen3_vl_deepstack_features(tmp_path, monkeypatch):
    """Qwen3-VL-8B through recipes/qwen2_5_vl_sft.yaml (cutoff_len 4096, micro-batch 1, bf16, GA 8): the deepstack
    features are 3 x 4096 tokens x 4096 wide x 2 bytes = 100,663,296 bytes at most (every token an image's) on the
    standard backend; mca's TP2 + SP halves them (50,331,648); its full recompute keeps one copy per micro-batch in
    flight on stage 0: PP2 doubles that (100,663,296), CP2 halves it again (50,331,648). A trained tower's
    activations count the 3 deepstack mergers like the merger: (27 blocks x 2 (their inputs, recomputed) + 34 (the
    block recomputed) + 4 (merger) + 3 x 4) x 16384 patches x 1152 = 1,962,934,272 bytes."""
    from roll.config import parse_args

    monkeypatch.delenv("WORLD_SIZE", raising=False)
    (tmp_path / "config.json").write_text(json.dumps(QWEN3_VL_8B))
    expected = {(): 100_663_296, ("--use-mca",): 50_331_648,
                ("--use-mca", "pipeline_model_parallel_size=2"): 100_663_296,
                ("--use-mca", "pipeline_model_parallel_size=2", "context_parallel_size=2"): 50_331_648}
    for argv, want in expected.items():
        _, config = parse_args(["recipes/qwen2_5_vl_sft.yaml", f"model_name_or_path={tmp_path}", *argv])
        lines = {line.key: line.bytes for line in plan_run(config).lines}
        assert lines["deepstack features"] == want, argv
    _, config = parse_args(["recipes/qwen2_5_vl_sft.yaml", f"model_name_or_path={tmp_path}", "--use-mca",
                            "freeze_vision_tower=false"])
    lines = {line.key: line.bytes for line in plan_run(config).lines}
    assert lines["vision activations"] == (27 * 2 + 34 + 4 + 3 * 4) * 16384 * 1152 == 1_962_934_272


@pytest.mark.parametrize("family", ["qwen2_5_vl", "qwen2_vl", "qwen3_vl"])
def test_vision_tower_count_matches_transformers(family):
    """The tower and merger counts of roll.plan.vision against transformers' own modules (tiny odd shapes)."""
    import importlib

    import transformers

    from roll.plan.vision import vision_shape

    config_class, model_class, vision = {
        "qwen2_5_vl": ("Qwen2_5_VLConfig", "Qwen2_5_VisionTransformerPretrainedModel",
                       dict(depth=3, hidden_size=24, intermediate_size=40, num_heads=2, out_hidden_size=48)),
        "qwen2_vl": ("Qwen2VLConfig", "Qwen2VisionTransformerPretrainedModel",
                     dict(depth=3, embed_dim=24, mlp_ratio=3, num_heads=2, hidden_size=48)),
        "qwen3_vl": ("Qwen3VLConfig", "Qwen3VLVisionModel",
                     dict(depth=3, hidden_size=24, intermediate_size=40, num_heads=2, out_hidden_size=48,
                          num_position_embeddings=16, deepstack_visual_indexes=[0, 2])),
    }[family]
    config = getattr(transformers, config_class)(vision_config=vision)
    modeling = importlib.import_module(f"transformers.models.{family}.modeling_{family}")
    tower = getattr(modeling, model_class)._from_config(config.vision_config)
    shape = vision_shape(config.to_dict())
    assert shape.total_params() == sum(p.numel() for p in tower.parameters())
    assert shape.merger_params() == sum(p.numel() for p in tower.merger.parameters())


def test_plan_counts_the_vision_tower_of_the_vl_recipe(tmp_path, monkeypatch):
    """recipes/qwen2_5_vl_sft.yaml's --plan from a local config.json of the real model: 8.29B parameters (the
    published size; 676.6M of them the tower and merger, by hand: patch embedding 1176 * 1280, 32 blocks of
    19,702,200, merger 44,574,464), the tower on pipeline stage 0 only and trained only when unfrozen."""
    from roll.config import parse_args

    monkeypatch.delenv("WORLD_SIZE", raising=False)
    (tmp_path / "config.json").write_text(json.dumps(QWEN2_5_VL_7B))
    shape, _ = resolve_shape(str(tmp_path))
    assert shape.vision.total_params() == 1176 * 1280 + 32 * 19_702_200 + 44_574_464
    builtin = KNOWN_SHAPES["qwen2.5-vl-7b"]
    assert builtin.vision == shape.vision and builtin.total_params() == shape.total_params()
    assert round(shape.total_params() / 1e7) == 829
    plans = {}
    for argv in ([], ["--use-mca"], ["--use-mca", "freeze_vision_tower=false", "pipeline_model_parallel_size=2"]):
        _, config = parse_args(["recipes/qwen2_5_vl_sft.yaml", f"model_name_or_path={tmp_path}", *argv])
        plans[" ".join(argv)] = plan = plan_run(config)
        assert plan.fits and "vision tower + merger 0.677B" in plan.model
    mca = {line.key: line for line in plans["--use-mca"].lines}
    assert "3.81B trainable" in mca["gradients"].detail and mca["vision activations"].bytes == 0  # frozen
    trained = plans["--use-mca freeze_vision_tower=false pipeline_model_parallel_size=2"]
    lines = {line.key: line.bytes for line in trained.lines}
    assert trained.stage == 0 and lines["vision activations"] > 0
    p0 = stage_params(shape, strategy_for(config, shape), config.finetuning, 0)
    p1 = stage_params(shape, strategy_for(config, shape), config.finetuning, 1)
    # stage 0: embedding + tower + merger, stage 1: head + final norm (untied: embedding = head)
    assert p0.dense - p1.dense == shape.vision.total_params() - shape.hidden_size
    assert p0.trainable_dense - p1.trainable_dense == shape.vision.tower_params() - shape.hidden_size  # merger frozen
