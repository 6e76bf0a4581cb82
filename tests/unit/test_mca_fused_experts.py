"""Checkpoints with transformers 5's fused experts (``save_pretrained(save_original_format=False)``:
``mlp.experts.gate_up_proj`` [E, 2I, H], ``down_proj`` [E, H, I]; Mixtral's router as ``mlp.gate``) load into
Megatron exactly as the per-expert checkpoint of the same model does, as any TP / EP rank, and convert back to the
per-expert tensors bit for bit; a fused tensor of another layout is an error naming it. In-process, on tiny odd
shapes (hidden 48, experts of 24 or 32), every tensor random."""

from __future__ import annotations

import json
import os

import pytest
import torch

pytest.importorskip("megatron.core")
pytestmark = pytest.mark.mca

from backends.mca.models import layout, sharding  # noqa: E402
from backends.mca.models.config import McaModelConfig  # noqa: E402
from backends.mca.models.template import get_template  # noqa: E402
from roll.errors import ModelError  # noqa: E402
from tests.unit.test_mca_templates import _fake_chunk, _to_local  # noqa: E402

ODD = {"mixtral": dict(hidden_size=48, num_attention_heads=6, num_key_value_heads=2, head_dim=8, intermediate_size=24),
       "deepseek_v3": {}}


def _save_both(kind: str, root) -> tuple[str, str]:
    """The same random model saved per expert (transformers' default) and fused."""
    from transformers import AutoModelForCausalLM

    from roll.demo.tiny_model import tiny_config

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_config(kind, 509, tie_word_embeddings=False, **ODD[kind]))
    with torch.no_grad():
        for param in model.parameters():
            param.normal_(0.0, 0.2)
    per_expert, fused = str(root / "per_expert"), str(root / "fused")
    model.save_pretrained(per_expert)
    model.save_pretrained(fused, save_original_format=False)
    return per_expert, fused


@pytest.mark.parametrize("kind", ["mixtral", "deepseek_v3"])
def test_fused_experts_load_as_the_per_expert_checkpoint(kind, tmp_path):
    from safetensors import safe_open

    from backends.mca.models.loader import load_hf_weights

    per_expert, fused = _save_both(kind, tmp_path)
    with safe_open(os.path.join(fused, "model.safetensors"), "pt") as fh:
        assert "model.layers.1.mlp.experts.gate_up_proj" in fh.keys()  # transformers 5.23's fused spelling
    with open(os.path.join(per_expert, "config.json"), encoding="utf-8") as fh:
        hf_config = json.load(fh)
    with safe_open(os.path.join(per_expert, "model.safetensors"), "pt") as fh:
        hf_sd = {name: fh.get_tensor(name) for name in fh.keys()}
    template = get_template(kind)
    for tp_rank, ep_rank in ((1, 0), (0, 1)):
        config = McaModelConfig.from_hf(hf_config, tensor_model_parallel_size=2, expert_model_parallel_size=2,
                                        sequence_parallel=True)
        place = layout.placement(config, pp_rank=0, vpp_stage=0, ep_rank=ep_rank)
        per_rank = config.num_moe_experts // 2
        expected = {}
        for name, tensor in template.hf_to_mca(hf_sd, config).items():
            expert = layout._EXPERT_SEQ.search(name)
            if expert and not place.expert_offset <= int(expert.group(1)) < place.expert_offset + per_rank:
                continue
            expected[_to_local(place, name)] = sharding.shard_for_rank(name, tensor, config, (2, tp_rank),
                                                                       (2, tp_rank))
        coords = {"tp_size": 2, "tp_rank": tp_rank, "etp_size": 2, "etp_rank": tp_rank}
        loaded = {}
        for model_dir in (per_expert, fused):
            chunk = _fake_chunk({n: tuple(t.shape) for n, t in expected.items()})
            report = load_hf_weights([chunk], config, model_dir, placements=[place], coords=coords)
            assert report.params_loaded == len(expected)
            loaded[model_dir] = chunk.state_dict()
        for name, tensor in expected.items():
            assert torch.equal(loaded[per_expert][name], tensor), name
            assert torch.equal(loaded[fused][name], tensor), name
    # back to HF: the per-expert tensors (the layout export writes), bit for bit
    config = McaModelConfig.from_hf(hf_config)
    back = template.mca_to_hf(template.hf_to_mca(hf_sd, config), config)
    assert back.keys() == hf_sd.keys() and all(torch.equal(back[name], hf_sd[name]) for name in hf_sd)


def _rewrite(src: str, dst, edit) -> str:
    from safetensors.torch import load_file, save_file

    os.makedirs(dst)
    for name in os.listdir(src):
        if name != "model.safetensors":
            with open(os.path.join(src, name), "rb") as fh, open(os.path.join(dst, name), "wb") as out:
                out.write(fh.read())
    save_file(edit(load_file(os.path.join(src, "model.safetensors"))), os.path.join(dst, "model.safetensors"))
    return str(dst)


def test_a_fused_layout_of_another_shape_is_an_error_naming_the_key(tmp_path):
    """A transposed gate_up_proj (Qwen3-VL-MoE ships [E, H, 2I]) or a fused tensor no template declares."""
    from safetensors.torch import load_file

    from backends.mca.models.loader import load_hf_weights

    per_expert, fused = _save_both("deepseek_v3", tmp_path)
    key = "model.layers.1.mlp.experts.gate_up_proj"
    with open(os.path.join(fused, "config.json"), encoding="utf-8") as fh:
        config = McaModelConfig.from_hf(json.load(fh))
    canonical = get_template("deepseek_v3").hf_to_mca(load_file(os.path.join(per_expert, "model.safetensors")), config)

    def load(model_dir: str) -> None:
        chunk = _fake_chunk({name: tuple(t.shape) for name, t in canonical.items()})
        load_hf_weights([chunk], config, model_dir, placements=[layout.placement(config, 0, 0, 0)],
                        coords={"tp_size": 1, "tp_rank": 0, "etp_size": 1, "etp_rank": 0})

    transposed = _rewrite(fused, tmp_path / "transposed",
                          lambda sd: {**sd, key: sd[key].transpose(1, 2).contiguous()})
    with pytest.raises(ModelError, match=rf"{key}' has shape \[4, 48, 64\].*\[experts 4, 2 x moe_ffn_hidden_size 32, "
                                         r"hidden_size 48\].*save_pretrained"):
        load(transposed)
    with pytest.raises(ModelError, match=f"{key}_bias"):
        load(_rewrite(fused, tmp_path / "extra", lambda sd: {**sd, key + "_bias": torch.zeros(4, 64)}))
