"""LoRA on Megatron (backends/mca/lora) under real 2-process torchrun (gloo, fp32, CPU).

One launch runs every layout (tests/distributed/_mca_workers/lora_checks.py); the HF / PEFT side is
checked here, in the pytest process (Megatron is never initialised in it):
- the adapter utilities return the documented layer patterns (dense and MoE);
- the exported adapter on the HF model (``PeftModel.from_pretrained``) gives the Megatron model's
  logits: <= 1e-5 at TP1, TP2, TP2 + sequence parallelism, PP2; <= 1e-4 on MoE at EP2, on DeepSeek-V3's
  multi-latent attention (with and without a q LoRA rank) at TP1 and TP2 + SP, and on Qwen2-MoE's shared
  expert at TP2 + SP;
- the merged export equals base + adapter (<= 1e-5 relative to the largest logit);
- the initial adapter equals PEFT's on the HF model with the same seed, bit for bit, at every layout;
- SGD steps on the adapters leave the base bit-identical; TP2 (and TP2 + SP) gradients and losses
  equal TP1's (<= 1e-5);
- an adapter-only checkpoint saved at TP2 loads at TP1 (bit-exact);
- LoRA on routed experts (add_lora) carries the expert tags and gets gradients at EP2.
"""

from __future__ import annotations

import json
import os

import pytest
import torch

from tests.helpers import REPO, output_of, torchrun

pytest.importorskip("megatron.core")
pytestmark = [pytest.mark.distributed, pytest.mark.mca]

WORKER = os.path.join(REPO, "tests", "distributed", "_mca_workers", "lora_checks.py")
SEED, RANK, ALPHA = 1234, 4, 8
ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
MLA = "q_a_proj,q_b_proj,kv_a_proj_with_mqa,kv_b_proj,o_proj"
CASES = [
    dict(name="tp1", model="dense", tp=1, target="all", merged=True, steps=True),
    dict(name="tp2", model="dense", tp=2, target="all", steps=True, save_ckpt=True),
    dict(name="tp2sp", model="dense", tp=2, sp=True, target="all", steps=True),
    dict(name="tp2_qvd", model="dense", tp=2, target="q_proj,v_proj,down_proj"),
    dict(name="pp2", model="dense", pp=2, target="all"),
    dict(name="moe_ep2", model="moe", ep=2, target="all", expert_lora=True),
    dict(name="tp1_reload", model="dense", tp=1, target="all", load_ckpt=True),
    # DeepSeek-V3's multi-latent attention with and without a q LoRA rank (its MLP targets PEFT moves to the
    # routed experts: refused on mca); Qwen2-MoE's shared expert (PEFT adapts it as gate/up/down_proj)
    dict(name="mla_tp1", model="mla", tp=1, target=MLA, steps=True),
    dict(name="mla_tp2sp", model="mla", tp=2, sp=True, target=MLA, steps=True),
    dict(name="mla_no_q_lora_tp2sp", model="mla_no_q_lora", tp=2, sp=True, target="q_proj,kv_a_proj_with_mqa,o_proj"),
    dict(name="shared_expert_tp2sp", model="qwen2_moe", tp=2, sp=True, target="gate_proj,up_proj,down_proj"),
]
MOE_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj"]  # routed experts have no HF nn.Linear (transformers 5)


def _targets(case: dict) -> list[str]:
    """What the standard backend's PEFT adapts for the case's lora_target (``all``: every nn.Linear name)."""
    if case["model"] == "moe":
        return MOE_TARGETS
    return ALL if case["target"] == "all" else case["target"].split(",")


@pytest.fixture(scope="module")
def run(tiny_model_factory, tmp_path_factory):
    from tests.distributed.test_mca_conversion import randomized

    tmp = tmp_path_factory.mktemp("mca_lora")
    dirs = {"dense": randomized(tiny_model_factory("qwen2", tie_word_embeddings=False), str(tmp / "dense")),
            "moe": randomized(tiny_model_factory("qwen3_moe", tie_word_embeddings=False), str(tmp / "moe")),
            "mla": randomized(tiny_model_factory("deepseek_v3", tie_word_embeddings=False), str(tmp / "mla")),
            "mla_no_q_lora": randomized(tiny_model_factory("deepseek_v3", q_lora_rank=None, tie_word_embeddings=False),
                                        str(tmp / "mla_no_q_lora")),
            "qwen2_moe": randomized(tiny_model_factory("qwen2_moe", tie_word_embeddings=False), str(tmp / "qwen2_moe"))}
    ckpt = {"save_ckpt": str(tmp / "adapter_ckpt"), "load_ckpt": str(tmp / "adapter_ckpt")}
    cases = [{**case, **{k: ckpt[k] for k in ckpt if case.get(k)}, "dir": dirs[case["model"]]} for case in CASES]
    (tmp / "cases.json").write_text(json.dumps(cases))
    proc = torchrun(WORKER, str(tmp / "cases.json"), str(tmp / "out"), timeout=360)
    assert proc.returncode == 0, output_of(proc)
    return {"out": tmp / "out", "dirs": dirs}


def _result(run, name: str) -> dict:
    return json.loads((run["out"] / name / "result.rank0.json").read_text())


def _hf(model_dir: str):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="eager").eval()


def _ids(model_dir: str) -> torch.Tensor:
    from transformers import AutoConfig

    gen = torch.Generator().manual_seed(1234)  # backends.mca.convert.sample_input_ids, without importing Megatron
    return torch.randint(0, AutoConfig.from_pretrained(model_dir).vocab_size, (2, 16), generator=gen)


def test_utilities_return_the_documented_names(run):
    dense, moe = _result(run, "tp1")["names"], _result(run, "moe_ep2")["names"]
    linear = {"self_attention.linear_qkv", "self_attention.linear_proj", "mlp.linear_fc1", "mlp.linear_fc2"}
    assert set(dense["linear"]) == linear and len(dense["linear"]) == 4
    assert set(dense["linear_with_head"]) == linear | {"output_layer"}
    assert dense["embedding"] == ["embedding"] and dense["router"] == [] and dense["experts_marked"] == 0
    assert set(moe["linear"]) == {"self_attention.linear_qkv", "self_attention.linear_proj",
                                  "mlp.experts.local_experts.linear_fc1", "mlp.experts.local_experts.linear_fc2"}
    assert moe["router"] == ["mlp.router"] and moe["embedding"] == ["embedding"]
    assert moe["experts_marked"] == 2 * 2 * 2  # 2 layers x 2 local experts (EP2 of 4) x fc1/fc2


@pytest.mark.parametrize("name, tol", [("tp1", 1e-5), ("tp2", 1e-5), ("tp2sp", 1e-5), ("tp2_qvd", 1e-5),
                                       ("pp2", 1e-5), ("moe_ep2", 1e-4), ("mla_tp1", 1e-4), ("mla_tp2sp", 1e-4),
                                       ("mla_no_q_lora_tp2sp", 1e-4), ("shared_expert_tp2sp", 1e-4)])
def test_exported_adapter_on_hf_gives_megatron_logits(run, name, tol):
    from peft import PeftModel

    case = next(c for c in CASES if c["name"] == name)
    model_dir, adapter = run["dirs"][case["model"]], run["out"] / name / "adapter"
    config = json.loads((adapter / "adapter_config.json").read_text())
    assert sorted(config["target_modules"]) == sorted(_targets(case))
    assert (config["peft_type"], config["r"], config["lora_alpha"], config["task_type"]) == ("LORA", RANK, ALPHA,
                                                                                             "CAUSAL_LM")
    ids = _ids(model_dir)
    with torch.no_grad():
        base_logits = _hf(model_dir)(input_ids=ids).logits
        peft_logits = PeftModel.from_pretrained(_hf(model_dir), str(adapter)).eval()(input_ids=ids).logits
    megatron_logits = torch.load(run["out"] / name / "logits.pt")
    assert (peft_logits - base_logits).abs().max() > 0.05  # the adapter matters, so the parity means something
    assert (peft_logits - megatron_logits).abs().max() <= tol


def test_merged_export_equals_base_plus_adapter(run):
    from peft import PeftModel

    model_dir, out = run["dirs"]["dense"], run["out"] / "tp1"
    ids = _ids(model_dir)
    with torch.no_grad():
        merged = _hf(str(out / "merged"))(input_ids=ids).logits
        peft_logits = PeftModel.from_pretrained(_hf(model_dir), str(out / "adapter")).eval()(input_ids=ids).logits
    # PEFT's fp32 merge (W + s * B @ A) rounds differently from the unmerged sum: relative 1e-5
    # (measured: 1.1e-5 absolute on logits up to ~5 with these 0.1-scale random adapters).
    assert (merged - peft_logits).abs().max() <= 1e-5 * peft_logits.abs().max()


@pytest.mark.parametrize("name", ["tp1", "tp2", "tp2sp", "tp2_qvd", "pp2", "moe_ep2", "mla_tp1", "mla_tp2sp",
                                  "mla_no_q_lora_tp2sp", "shared_expert_tp2sp"])
def test_initial_adapter_equals_peft_with_the_same_seed(run, name):
    from peft import LoraConfig, get_peft_model, get_peft_model_state_dict
    from safetensors.torch import load_file
    from transformers import set_seed

    case = next(c for c in CASES if c["name"] == name)
    model_dir = run["dirs"][case["model"]]
    targets = _targets(case)
    model = _hf(model_dir)
    set_seed(SEED)  # what the standard backend does right before get_peft_model
    peft = get_peft_model(model, LoraConfig(task_type="CAUSAL_LM", r=RANK, lora_alpha=ALPHA, target_modules=targets))
    expected = get_peft_model_state_dict(peft)
    got = load_file(str(run["out"] / name / "init" / "adapter_model.safetensors"))
    assert sorted(got) == sorted(expected)
    for key, tensor in expected.items():
        assert torch.equal(got[key], tensor), key


@pytest.mark.parametrize("name", ["tp1", "tp2", "tp2sp", "mla_tp1", "mla_tp2sp"])
def test_sgd_steps_train_only_the_adapter(run, name):
    result = _result(run, name)
    assert result["base_same"] and result["lora_moved"] and result["trainable_all_lora"] and result["lora_fp32"]


@pytest.mark.parametrize("name, tp1", [("tp2", "tp1"), ("tp2sp", "tp1"), ("mla_tp2sp", "mla_tp1")])
def test_tensor_parallel_gradients_and_losses_equal_tp1(run, name, tp1):
    reference, other = (torch.load(run["out"] / n / "steps.pt") for n in (tp1, name))
    assert reference["losses"] == pytest.approx(other["losses"], abs=1e-5)
    for step, (ref_grads, grads) in enumerate(zip(reference["grads"], other["grads"])):
        assert sorted(ref_grads) == sorted(grads)
        for key, grad in ref_grads.items():
            assert (grad - grads[key]).abs().max() <= 1e-5, (step, key)


def test_adapter_checkpoint_saved_at_tp2_loads_at_tp1(run):
    """save_adapter_checkpoint holds only adapters, sharded by LoraParallelLinear.sharded_state_dict;
    loaded at TP1 and exported again it is the TP2 adapter bit for bit."""
    from safetensors.torch import load_file

    saved = load_file(str(run["out"] / "tp2" / "adapter" / "adapter_model.safetensors"))
    reloaded = load_file(str(run["out"] / "tp1_reload" / "reloaded" / "adapter_model.safetensors"))
    assert sorted(saved) == sorted(reloaded)
    for key, tensor in saved.items():
        assert torch.equal(tensor, reloaded[key]), key


def test_expert_lora_uses_the_expert_groups(run):
    expert = _result(run, "moe_ep2")["expert_lora"]
    assert expert == {"modules": 8, "is_expert": True, "allreduce_false": True, "all_have_grad": True,
                      "finite": True}


def test_tiny_lora_recipe_at_tp2_from_the_command_line(tiny_model_factory, tmp_path):
    """The demo LoRA recipe with --use-mca at TP2 ends in an adapter PeftModel loads on the base model,
    and a merged model equal to it."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from tests.helpers import roll_train

    model_dir = tiny_model_factory("qwen2", tokenizer="qwen")
    out = tmp_path / "out"
    proc = roll_train("recipes/demo/tiny_lora.yaml", "--use-mca", "nproc_per_node=2", "tensor_model_parallel_size=2",
                      f"model_name_or_path={model_dir}", f"output_dir={out}", "max_steps=10", timeout=600)
    assert proc.returncode == 0, output_of(proc)
    with open(out / "train_log.jsonl", encoding="utf-8") as fh:
        losses = [json.loads(line)["loss"] for line in fh if '"loss"' in line]
    assert losses[-1] < losses[0], losses
    tokens = torch.tensor([[1, 2, 3, 4]])
    with torch.no_grad():
        adapted = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(model_dir), out)(tokens).logits
        merged = AutoModelForCausalLM.from_pretrained(out / "merged")(tokens).logits
        base = AutoModelForCausalLM.from_pretrained(model_dir)(tokens).logits
    assert (adapted - base).abs().max() > 1e-3  # the adapter learned something
    assert (adapted - merged).abs().max() <= 1e-5 * adapted.abs().max()
