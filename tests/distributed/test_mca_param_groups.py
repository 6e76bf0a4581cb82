"""Optimizer parameter groups and LR schedules: the mca backend decays, and schedules, as HF Trainer does.

- The parameters each backend's optimizer decays, listed by HF name, are the same sets on dense Qwen2
  (biases; also at TP2 and PP2), Qwen3 (q_norm / k_norm), Qwen2-MoE (experts, router, shared expert),
  Qwen3-MoE, Llama and Qwen2 + LoRA (adapters decay; the frozen base is in no group): the standard side
  is HF Trainer's own ``create_optimizer``, the mca side ``build_optimizer`` (one 2-rank torchrun launch
  for all cases).
- roll-parity with a large weight decay and an HF-only schedule with warmup (cosine_with_min_lr) gives the
  same loss at every step on both backends, within the measured backend gap (tests/bounds.py).
"""

from __future__ import annotations

import json

import pytest

from tests.bounds import BACKEND_DECAY, Comparison, assert_within
from tests.distributed.test_parity_tool import roll_parity
from tests.helpers import output_of, results, torchrun

pytest.importorskip("megatron.core")
pytestmark = [pytest.mark.distributed, pytest.mark.mca]

WORKER = "tests/distributed/_mca_workers/param_groups.py"
MODELS = {"qwen2": ("qwen2", False, {}), "qwen3": ("qwen3", False, {}), "qwen2_moe": ("qwen2_moe", False, {}),
          "qwen3_moe": ("qwen3_moe", False, {}), "llama": ("llama", False, {}),
          "qwen2_lora": ("qwen2", True, {}), "qwen2_tp2": ("qwen2", False, {"tp": 2}),
          "qwen2_pp2": ("qwen2", False, {"pp": 2})}
"""name: (tiny model kind, LoRA, layout); two ranks each (DP2 where the layout does not use them)."""
LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def _hf_name(name: str) -> str:
    """PEFT / HF parameter name -> the worker's naming (``model.`` kept, adapters shortened)."""
    name = name.removeprefix("base_model.model.")
    if ".lora_" in name:  # model.layers.0.self_attn.q_proj.lora_A.default.weight -> layers.0.q_proj.lora_A
        parts = name.split(".")
        return f"layers.{parts[2]}.{parts[-4]}.{parts[-3]}"
    return _experts(name)


def _experts(name: str) -> str:
    """Routed experts as one entry per layer: transformers 5 fuses them (``experts.gate_up_proj``), the
    checkpoint names the mca side reports do not (``experts.3.gate_proj.weight``)."""
    head, sep, _ = name.partition(".mlp.experts.")
    return head + ".mlp.experts" if sep else name


def _as_sets(groups: dict[str, list[str]]) -> dict[str, list[str]]:
    return {key: sorted({_experts(name) for name in names}) for key, names in groups.items()}


def standard_groups(model_dir: str, lora: bool, out_dir: str) -> dict[str, list[str]]:
    """HF Trainer's optimizer groups (weight_decay 0.1) as sorted HF names."""
    from transformers import AutoModelForCausalLM, Trainer, TrainingArguments

    model = AutoModelForCausalLM.from_pretrained(model_dir)
    if lora:
        from peft import LoraConfig, get_peft_model

        lora = LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=LORA_TARGETS)
        model = get_peft_model(model, lora)
    args = TrainingArguments(output_dir=out_dir, weight_decay=0.1, report_to=[], use_cpu=True)
    optimizer = Trainer(model=model, args=args).create_optimizer()
    names = {id(param): _hf_name(name) for name, param in model.named_parameters()}
    out: dict[str, list[str]] = {"decayed": [], "undecayed": []}
    for group in optimizer.param_groups:
        key = "decayed" if group["weight_decay"] > 0 else "undecayed"
        out[key] += [names[id(p)] for p in group["params"]]
    return {key: sorted(value) for key, value in out.items()}


@pytest.fixture(scope="module")
def mca_groups(tiny_model_factory, tmp_path_factory) -> dict[str, dict]:
    tmp = tmp_path_factory.mktemp("param_groups")
    cases = [{"name": name, "dir": tiny_model_factory(kind, tie_word_embeddings=False), "lora": lora,
              **layout} for name, (kind, lora, layout) in MODELS.items()]
    (tmp / "cases.json").write_text(json.dumps(cases))
    proc = torchrun(WORKER, str(tmp / "cases.json"), nproc=2, timeout=240)
    assert proc.returncode == 0, output_of(proc)
    return {"groups": {case["name"]: case for case in results(proc.stdout)},
            "dirs": {case["name"]: case["dir"] for case in cases}}


@pytest.mark.parametrize("name", list(MODELS))
def test_the_decayed_parameters_are_hf_trainers(mca_groups, name, tmp_path):
    mca = _as_sets(mca_groups["groups"][name])
    standard = _as_sets(standard_groups(mca_groups["dirs"][name], MODELS[name][1], str(tmp_path)))
    assert mca["decayed"] == standard["decayed"], name
    assert mca["undecayed"] == standard["undecayed"], name
    assert standard["decayed"] and (standard["undecayed"] or MODELS[name][1])  # LoRA: only adapters train
    if name == "qwen2":
        assert "model.layers.0.self_attn.q_proj.bias" in mca["undecayed"]
        assert "model.norm.weight" in mca["undecayed"] and "model.embed_tokens.weight" in mca["decayed"]


def decay_parity_run(model_dir: str, tmp_path) -> tuple[int, dict, str]:
    """roll-parity, 8 steps, weight_decay 1.0, learning rate 1e-2, cosine_with_min_lr after 2 warmup steps:
    (exit code, its JSON, stderr)."""
    recipe = tmp_path / "sft.yaml"
    recipe.write_text(f"model_name_or_path: {model_dir}\nstage: sft\n"
                      "dataset: recipes/demo/data/arithmetic_sft.json\ncutoff_len: 64\n"
                      "per_device_train_batch_size: 4\nlearning_rate: 1.0e-2\nseed: 0\n"
                      "lr_scheduler_type: cosine_with_min_lr\nlr_scheduler_kwargs: {min_lr_rate: 0.1}\n")
    return roll_parity(str(recipe), "--steps", "8", "--tolerance", f"{BACKEND_DECAY.rel:g}",
                       "--first-step-tolerance", f"{BACKEND_DECAY.rel:g}", "--output-dir", str(tmp_path / "parity"),
                       "weight_decay=1.0", "warmup_steps=2", timeout=300)


def decay_comparison(result: dict) -> Comparison:
    return Comparison("weight_decay 1.0 mca vs standard", result["losses"]["mca"], result["losses"]["standard"],
                      BACKEND_DECAY)


def test_weight_decay_and_an_hf_schedule_match_the_standard_backend(tiny_model_factory, tmp_path):
    """Step-by-step parity within the measured backend gap (BACKEND_DECAY in tests/bounds.py) with weight_decay
    1.0 (decaying a norm weight or a bias shows at step 2) and cosine_with_min_lr after 2 warmup steps; when
    mca decayed every parameter: 2.3e-2 apart by step 8."""
    code, result, stderr = decay_parity_run(tiny_model_factory("qwen2"), tmp_path)
    assert result["steps"] == list(range(1, 9)), result
    assert_within([decay_comparison(result)])
    assert code == 0 and result["passed"], (result, stderr[-4000:])
    # The same learning_rate column: HF Trainer logs the rate each update used (0 at warmup step 1).
    out = tmp_path / "parity"
    rates = {backend: [record["learning_rate"] for record in read_records(out / backend / "train_log.jsonl")
                       if "loss" in record] for backend in ("standard", "mca")}
    assert rates["mca"] == pytest.approx(rates["standard"], rel=1e-6), rates
    assert rates["mca"][:3] == pytest.approx([0.0, 5e-3, 1e-2]), rates


def read_records(path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
