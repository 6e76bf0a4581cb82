"""HF <-> Megatron templates: bit-exact round trips for every family, on random weights."""

from __future__ import annotations

import json
import re

import pytest
import torch

pytest.importorskip("megatron.core")
pytestmark = pytest.mark.mca

from backends.mca.models import layout, sharding  # noqa: E402
from backends.mca.models.config import McaModelConfig  # noqa: E402
from backends.mca.models.template import get_template  # noqa: E402
from roll.errors import ModelError  # noqa: E402
from tests.helpers import random_checkpoint  # noqa: E402

KINDS = ["qwen2", "qwen3", "llama", "mistral", "qwen2_moe", "qwen3_moe", "glm4_moe", "deepseek_v3", "mixtral"]


@pytest.mark.parametrize("tied", [True, False])
@pytest.mark.parametrize("kind", KINDS)
def test_round_trip_is_bit_exact(tiny_model_factory, kind, tied):
    hf_config, hf_sd = random_checkpoint(tiny_model_factory(kind, tie_word_embeddings=tied))
    config = McaModelConfig.from_hf(hf_config)
    template = get_template(kind)
    mca_sd = template.hf_to_mca(hf_sd, config)
    assert ("output_layer.weight" in mca_sd) is (not tied)
    back = template.mca_to_hf(mca_sd, config)
    assert sorted(back) == sorted(hf_sd)
    for name, tensor in hf_sd.items():
        assert torch.equal(back[name], tensor), name


@pytest.mark.parametrize("kind", ["qwen2", "qwen3_moe"])
def test_canonical_names_match_a_built_megatron_model(tiny_model_factory, kind):
    """The converted names are exactly the local-spec GPTModel's parameter names (no _extra_state)."""
    hf_config, hf_sd = random_checkpoint(tiny_model_factory(kind))
    config = McaModelConfig.from_hf(hf_config)
    mca_sd = get_template(kind).hf_to_mca(hf_sd, config)
    expected = {"embedding.word_embeddings.weight", "decoder.final_layernorm.weight"}
    layer = {"input_layernorm.weight", "self_attention.linear_qkv.weight", "self_attention.linear_proj.weight",
             "pre_mlp_layernorm.weight"}
    if kind == "qwen2":
        layer |= {"self_attention.linear_qkv.bias", "mlp.linear_fc1.weight", "mlp.linear_fc2.weight"}
    else:
        layer |= {"self_attention.q_layernorm.weight", "self_attention.k_layernorm.weight", "mlp.router.weight"}
        layer |= {f"mlp.experts.local_experts.{e}.linear_fc{i}.weight" for e in range(4) for i in (1, 2)}
    expected |= {f"decoder.layers.{i}.{n}" for i in range(2) for n in layer}
    assert set(mca_sd) == expected
    qkv = mca_sd["decoder.layers.0.self_attention.linear_qkv.weight"]
    assert qkv.shape == ((4 + 2 * 2) * 16, 64)


def test_qkv_is_interleaved_per_query_group(tiny_model_factory):
    """Megatron layout [g0: q0 q1 k0 v0 | g1: q2 q3 k1 v1] (4 heads, 2 groups, head_dim 16)."""
    hf_config, hf_sd = random_checkpoint(tiny_model_factory("qwen2"))
    config = McaModelConfig.from_hf(hf_config)
    fused = get_template("qwen2").hf_to_mca(hf_sd, config)["decoder.layers.1.self_attention.linear_qkv.weight"]
    p = "model.layers.1.self_attn."
    q, k, v = (hf_sd[p + f"{n}_proj.weight"] for n in "qkv")
    d = 16
    for g in range(2):
        block = fused[g * 4 * d:(g + 1) * 4 * d]
        assert torch.equal(block[:2 * d], q[g * 2 * d:(g + 1) * 2 * d])
        assert torch.equal(block[2 * d:3 * d], k[g * d:(g + 1) * d])
        assert torch.equal(block[3 * d:], v[g * d:(g + 1) * d])


def test_shared_expert_and_gate_are_mapped(tiny_model_factory):
    hf_config, hf_sd = random_checkpoint(tiny_model_factory("qwen2_moe"))
    config = McaModelConfig.from_hf(hf_config)
    assert config.moe_shared_expert_gate and config.moe_shared_expert_intermediate_size == 64
    mca_sd = get_template("qwen2_moe").hf_to_mca(hf_sd, config)
    assert torch.equal(mca_sd["decoder.layers.0.mlp.shared_experts.gate_weight"],
                       hf_sd["model.layers.0.mlp.shared_expert_gate.weight"])
    gate = hf_sd["model.layers.0.mlp.shared_expert.gate_proj.weight"]
    assert torch.equal(mca_sd["decoder.layers.0.mlp.shared_experts.linear_fc1.weight"][:64], gate)


def test_mixtral_maps_its_router_and_experts_and_refuses_what_megatron_cannot_express(tiny_model_factory):
    """block_sparse_moe.gate -> router; experts.{e}.[w1; w3] (gate; up) -> linear_fc1, w2 -> linear_fc2; HF's
    softmax-top-k-renormalise router is Megatron's top-k-then-softmax; no shared expert."""
    hf_config, hf_sd = random_checkpoint(tiny_model_factory("mixtral"))
    config = McaModelConfig.from_hf(hf_config)
    assert (config.num_moe_experts, config.moe_router_topk, config.moe_ffn_hidden_size) == (4, 2, 32)
    assert config.moe_router_score_function == "softmax" and not config.moe_router_pre_softmax
    assert not config.moe_shared_expert_intermediate_size and not config.add_qkv_bias
    mca_sd = get_template("mixtral").hf_to_mca(hf_sd, config)
    moe = "model.layers.1.block_sparse_moe."
    assert torch.equal(mca_sd["decoder.layers.1.mlp.router.weight"], hf_sd[moe + "gate.weight"])
    expert = "decoder.layers.1.mlp.experts.local_experts.3."
    assert torch.equal(mca_sd[expert + "linear_fc1.weight"],
                       torch.cat([hf_sd[moe + "experts.3.w1.weight"], hf_sd[moe + "experts.3.w3.weight"]]))
    assert torch.equal(mca_sd[expert + "linear_fc2.weight"], hf_sd[moe + "experts.3.w2.weight"])
    for key, value, field in (("sliding_window", 4096, "sliding_window"),
                              ("router_jitter_noise", 0.01, "router_jitter_noise")):
        with pytest.raises(ModelError, match=f"mixtral: {field}={value}.*in config.json"):
            McaModelConfig.from_hf({**hf_config, key: value})


@pytest.mark.parametrize("kind,grouped", [("qwen2", False), ("qwen3_moe", False), ("qwen3_moe", True)])
def test_te_and_grouped_naming_round_trips(tiny_model_factory, kind, grouped):
    """TE fuses norms into linears (dense only) and names grouped experts weight{e}; no TE import needed."""
    hf_config, hf_sd = random_checkpoint(tiny_model_factory(kind))
    config = McaModelConfig.from_hf(hf_config, transformer_impl="transformer_engine", moe_grouped_gemm=grouped)
    mca_sd = get_template(kind).hf_to_mca(hf_sd, config)
    te_names = {layout.to_impl_name(n, config): n for n in mca_sd}
    assert len(te_names) == len(mca_sd)
    assert "decoder.layers.0.self_attention.linear_qkv.layer_norm_weight" in te_names
    if kind == "qwen2":
        assert "decoder.layers.0.mlp.linear_fc1.layer_norm_weight" in te_names
    else:
        assert "decoder.layers.0.pre_mlp_layernorm.weight" in te_names  # MoE keeps its own norm under TE
        assert ("decoder.layers.1.mlp.experts.linear_fc2.weight3" in te_names) is grouped
    assert all(layout.from_impl_name(te, config) == local for te, local in te_names.items())


def test_tp_ep_sharding_round_trips_and_splits_gate_up_separately(tiny_model_factory):
    hf_config, hf_sd = random_checkpoint(tiny_model_factory("qwen2_moe"))
    config = McaModelConfig.from_hf(hf_config, vocab_size=511, tensor_model_parallel_size=2)
    assert config.padded_vocab_size == 512
    hf_sd["model.embed_tokens.weight"] = hf_sd["model.embed_tokens.weight"][:511]
    mca_sd = get_template("qwen2_moe").hf_to_mca(hf_sd, config)
    for name, tensor in mca_sd.items():
        kind = sharding.tp_kind(name, config)
        shards = [sharding.split(sharding.pad_vocab(name, tensor, config), kind, 2, r) for r in range(2)]
        merged = sharding.unpad_vocab(name, sharding.merge(shards, kind), config)
        assert torch.equal(merged, tensor), name
    fc1 = mca_sd["decoder.layers.0.mlp.shared_experts.linear_fc1.weight"]
    rank1 = sharding.split(fc1, "swiglu", 2, 1)
    gate, up = fc1.chunk(2)
    assert torch.equal(rank1, torch.cat([gate.chunk(2)[1], up.chunk(2)[1]]))


def test_placement_maps_local_layers_and_experts_to_global(tiny_model_factory):
    hf_config, _ = random_checkpoint(tiny_model_factory("qwen3_moe"))
    config = McaModelConfig.from_hf(hf_config, num_layers=8, pipeline_model_parallel_size=2,
                                    virtual_pipeline_model_parallel_size=2, expert_model_parallel_size=2)
    chunk = layout.placement(config, pp_rank=1, vpp_stage=1, ep_rank=1)
    assert (chunk.layer_offset, chunk.expert_offset, chunk.pre_process, chunk.post_process) == (6, 2, False, True)
    local = "decoder.layers.1.mlp.experts.local_experts.0.linear_fc1.weight"
    assert chunk.to_global(local) == "decoder.layers.7.mlp.experts.local_experts.2.linear_fc1.weight"
    assert _to_local(chunk, chunk.to_global(local)) == local


def _to_local(place: layout.Placement, name: str) -> str:
    """Inverse of ``Placement.to_global`` (the production code only maps local -> global)."""
    name = layout._shift(layout._LAYER, name, -place.layer_offset, "decoder.layers.{}.")
    return layout._shift_expert(name, -place.expert_offset)


def test_unmapped_hf_parameter_lists_known_patterns(tiny_model_factory):
    hf_config, hf_sd = random_checkpoint(tiny_model_factory("llama"))
    hf_sd["model.layers.0.self_attn.rotary_emb.inv_freq_extra"] = torch.zeros(2)
    with pytest.raises(ModelError, match=r"(?s)rotary_emb.inv_freq_extra.*Known HF patterns.*q_proj"):
        get_template("llama").hf_to_mca(hf_sd, McaModelConfig.from_hf(hf_config))


def _fake_chunk(shapes: dict[str, tuple]) -> torch.nn.Module:
    """A module whose state dict has exactly ``shapes`` (stands in for a built TE GPTModel chunk)."""
    root = torch.nn.Module()
    for name, shape in shapes.items():
        *path, leaf = name.split(".")
        module = root
        for part in path:
            if not hasattr(module, part):
                module.add_module(part, torch.nn.Module())
            module = getattr(module, part)
        module.register_parameter(leaf, torch.nn.Parameter(torch.full(shape, float("nan"))))
    return root


def _tp2_rank1_by_hand(hf: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Layer 0 and the embeddings of the tiny Qwen2 (hidden 64, 4 heads of 16 in 2 KV groups, FFN 128,
    vocab 512, untied) as Megatron's TP rank 1 of 2 holds them: vocab rows 256-511; the second query group,
    [q heads 2-3; k 1; v 1]; the second halves of gate and up stacked; o/down's second half of columns."""
    at = "model.layers.0."
    q, k, v = (hf[at + f"self_attn.{p}_proj.weight"] for p in "qkv")
    qb, kb, vb = (hf[at + f"self_attn.{p}_proj.bias"] for p in "qkv")
    gate, up, down = (hf[at + f"mlp.{p}_proj.weight"] for p in ("gate", "up", "down"))
    return {
        "embedding.word_embeddings.weight": hf["model.embed_tokens.weight"][256:],
        "output_layer.weight": hf["lm_head.weight"][256:],
        "decoder.layers.0.self_attention.linear_qkv.weight": torch.cat([q[32:64], k[16:32], v[16:32]]),
        "decoder.layers.0.self_attention.linear_qkv.bias": torch.cat([qb[32:64], kb[16:32], vb[16:32]]),
        "decoder.layers.0.self_attention.linear_proj.weight": hf[at + "self_attn.o_proj.weight"][:, 32:],
        "decoder.layers.0.mlp.linear_fc1.weight": torch.cat([gate[64:], up[64:]]),
        "decoder.layers.0.mlp.linear_fc2.weight": down[:, 64:],
        "decoder.layers.0.self_attention.linear_qkv.layer_norm_weight": hf[at + "input_layernorm.weight"],
        "decoder.layers.0.mlp.linear_fc1.layer_norm_weight": hf[at + "post_attention_layernorm.weight"],
    }


@pytest.mark.parametrize("kind,tp_rank,ep_rank", [("qwen2", 1, 0), ("qwen3_moe", 0, 1)])
def test_streaming_loader_fills_a_te_layout_chunk_as_any_rank(tiny_model_factory, tmp_path, kind, tp_rank, ep_rank):
    """TE names (fused norms, grouped experts weight{e}), TP2 / EP2 shards, strict: no NaN left."""
    from safetensors.torch import save_file

    from backends.mca.models.loader import load_hf_weights

    src = tiny_model_factory(kind, tie_word_embeddings=False)
    hf_config, hf_sd = random_checkpoint(src)
    model_dir = tmp_path / "model"
    model_dir.mkdir()
    (model_dir / "config.json").write_text(json.dumps(hf_config))
    save_file(hf_sd, str(model_dir / "model.safetensors"))
    tp, ep = (2, 1) if kind == "qwen2" else (1, 2)
    config = McaModelConfig.from_hf(hf_config, transformer_impl="transformer_engine", moe_grouped_gemm=True,
                                    tensor_model_parallel_size=tp, expert_model_parallel_size=ep)
    place = layout.placement(config, pp_rank=0, vpp_stage=0, ep_rank=ep_rank)
    coords = {"tp_size": tp, "tp_rank": tp_rank, "etp_size": tp, "etp_rank": tp_rank}
    canonical = get_template(kind).hf_to_mca(hf_sd, config)
    per_rank = (config.num_moe_experts or 0) // ep
    expected = {}
    for name, tensor in canonical.items():
        expert = re.search(r"\.local_experts\.(\d+)\.", name)
        if expert and not place.expert_offset <= int(expert.group(1)) < place.expert_offset + per_rank:
            continue  # held by the other EP rank
        expected[layout.to_impl_name(_to_local(place, name), config)] = sharding.shard_for_rank(
            name, tensor, config, (tp, tp_rank), (tp, tp_rank))
    chunk = _fake_chunk({n: tuple(t.shape) for n, t in expected.items()})
    report = load_hf_weights([chunk], config, str(model_dir), placements=[place], coords=coords)
    loaded = chunk.state_dict()
    assert report.params_loaded == len(expected)
    for name, tensor in expected.items():
        assert torch.equal(loaded[name], tensor), name
    assert "decoder.layers.0.self_attention.linear_qkv.layer_norm_weight" in loaded
    if kind == "qwen2":  # TP rank 1 of 2, sliced by hand from the HF tensors (not by roll's sharding code)
        assert loaded.keys() >= _tp2_rank1_by_hand(hf_sd).keys()
        for name, tensor in _tp2_rank1_by_hand(hf_sd).items():
            assert torch.equal(loaded[name], tensor), name
    if kind == "qwen3_moe":
        assert torch.equal(loaded["decoder.layers.0.mlp.experts.linear_fc2.weight0"],  # local 0 = global 2
                           hf_sd["model.layers.0.mlp.experts.2.down_proj.weight"])


def test_streaming_loader_refuses_weights_that_do_not_fit_the_config(tiny_model_factory, tmp_path):
    """Strict both ways, with the standard backend's message (roll.weights): a tensor no rank reads (a layer
    past num_hidden_layers) and a weight the checkpoint lacks each stop the load, naming the key."""
    from safetensors.torch import save_file

    from backends.mca.models.loader import load_hf_weights

    hf_config, hf_sd = random_checkpoint(tiny_model_factory("qwen2", tie_word_embeddings=False))
    config = McaModelConfig.from_hf(hf_config)
    place = layout.placement(config, pp_rank=0, vpp_stage=0, ep_rank=0)
    coords = {"tp_size": 1, "tp_rank": 0, "etp_size": 1, "etp_rank": 0}
    shapes = {layout.to_impl_name(name, config): tuple(tensor.shape)
              for name, tensor in get_template("qwen2").hf_to_mca(hf_sd, config).items()}

    def load(tensors: dict[str, torch.Tensor], name: str):
        model_dir = tmp_path / name
        model_dir.mkdir()
        (model_dir / "config.json").write_text(json.dumps(hf_config))
        save_file(tensors, str(model_dir / "model.safetensors"))
        return load_hf_weights([_fake_chunk(shapes)], config, str(model_dir), placements=[place],
                               coords=coords)

    assert load(hf_sd, "complete").params_loaded == len(shapes)
    extra_layer = {**hf_sd, "model.layers.2.input_layernorm.weight": torch.ones(64)}
    with pytest.raises(ModelError, match=r"1 checkpoint tensor\(s\) are not used by the model "
                                         r"\(model\.layers\.2\.input_layernorm\.weight\)"):
        load(extra_layer, "extra_layer")
    without_bias = {k: v for k, v in hf_sd.items() if not k.endswith("q_proj.bias")}
    with pytest.raises(ModelError, match=r"2 weight\(s\) of the model are not in the checkpoint "
                                         r"\(model\.layers\.0\.self_attn\.q_proj\.bias.*Likely cause"):
        load(without_bias, "without_bias")
