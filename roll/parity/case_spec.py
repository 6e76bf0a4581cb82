"""What a case of the parity sweep (roll.parity.cases) is made of: the tiny models, the recipe bases, the mca
run's parallel layouts, the bounds, and the Case record that names one of each.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
"""Dataset paths of the bases are relative to the repository (roll-parity --case runs from any directory)."""

MODELS = {
    "qwen2": {"kind": "qwen2"},
    "qwen2_4l": {"kind": "qwen2", "num_layers": 4},
    "moe": {"kind": "qwen3_moe"},
    "glm4_moe": {"kind": "glm4_moe", "tie_word_embeddings": False},
    "deepseek_v3": {"kind": "deepseek_v3", "tie_word_embeddings": False},
    "deepseek_v3_no_q_lora": {"kind": "deepseek_v3", "q_lora_rank": None, "tie_word_embeddings": False},
    "mixtral": {"kind": "mixtral", "hidden_size": 48, "num_attention_heads": 6, "num_key_value_heads": 2,
                "head_dim": 8, "intermediate_size": 24, "vocab_size": 513, "tie_word_embeddings": False},
    "mixtral_80": {"kind": "mixtral", "num_layers": 3, "hidden_size": 80, "num_attention_heads": 10,
                   "num_key_value_heads": 2, "head_dim": 12, "intermediate_size": 20, "num_local_experts": 6,
                   "vocab_size": 515, "seed": 1},
}
"""Tiny models (``roll.demo.tiny_model.make_tiny_model`` keyword arguments): hidden 64, a 512-token BPE tokenizer.
qwen2_4l has 4 layers so that PP2 x VPP2 gets one layer per chunk; moe is a Qwen3-MoE with 4 experts; glm4_moe a
GLM-4.5 (hidden 48, a dense first layer, sigmoid routing with a correction bias, a shared expert, partial RoPE);
deepseek_v3 a DeepSeek-V3 (multi-latent attention with a q LoRA rank and YaRN, expert groups, GLM-4.5's router),
deepseek_v3_no_q_lora the same without a q LoRA rank (HF's q_proj, Megatron's linear_q_proj);
mixtral has odd shapes (hidden 48, 6 heads over 2 KV groups, 4 experts of 24, top-2, 513 vocabulary rows: padded
under TP2); mixtral_80 is another odd Mixtral (3 layers, hidden 80, 10 heads over 2 KV groups of head_dim 12,
6 experts of 20, tied embeddings, 515 vocabulary rows), once a held-out shape, built from seed 1: from seed 0 one
token's second and third router probabilities are 1 float32 ulp apart, and any layout's other summation order
flips its expert (the losses 3.9e-6 apart at step 1 at TP2 with ETP2, not at ETP1)."""

_COMMON = {"cutoff_len": 64, "per_device_train_batch_size": 4, "gradient_accumulation_steps": 2,
           "learning_rate": 1.0e-3, "seed": 0}
BASES = {
    "sft": {"stage": "sft", "dataset": "recipes/demo/data/arithmetic_sft.json", **_COMMON},
    "pt": {"stage": "pt", "dataset": "recipes/demo/data/arithmetic_pt.jsonl", **_COMMON},
    "dpo": {"stage": "dpo", "dataset": "recipes/demo/data/arithmetic_dpo.json", "pref_beta": 0.1, **_COMMON},
    "kto": {"stage": "kto", "dataset": "recipes/demo/data/arithmetic_kto.json", "pref_beta": 0.1, **_COMMON},
    "rm": {"stage": "rm", "dataset": "recipes/demo/data/arithmetic_rm.json", **_COMMON},
}
"""Recipe bases: 8 samples a step (4 x 2 micro-batches at data-parallel size 1)."""


@dataclass(frozen=True)
class Layout:
    processes: int
    dp: int
    """Data-parallel size: the layout's gradient accumulation is the base's divided by it (the same global
    batch)."""
    keys: dict = field(default_factory=dict)


LAYOUTS = {
    "1p": Layout(1, 1),
    "tp2": Layout(2, 1, {"tensor_model_parallel_size": 2, "sequence_parallel": True}),
    "pp2_vpp2": Layout(2, 1, {"pipeline_model_parallel_size": 2, "virtual_pipeline_model_parallel_size": 2}),
    "dp2_overlap": Layout(2, 2, {"use_distributed_optimizer": True, "overlap_grad_reduce": True,
                                 "overlap_param_gather": True}),
    "cp2": Layout(2, 1, {"context_parallel_size": 2}),
    "ep2": Layout(2, 2, {"expert_model_parallel_size": 2}),
    "tp2_ep2": Layout(2, 1, {"tensor_model_parallel_size": 2, "expert_model_parallel_size": 2,
                             "expert_tensor_parallel_size": 1}),
}
"""The mca run's parallel layouts (the standard run is one process whatever the layout). tp2_ep2 is expert
parallelism at data-parallel size 1 (each rank holds 2 of the 4 experts whole, ETP1; sequence parallelism on, as
Megatron requires): for a loss whose definition depends on the data-parallel size (KTO's reference point)."""


@dataclass(frozen=True)
class Bounds:
    """Largest relative gaps allowed between the two runs."""

    step1: float | None = 1e-6
    """Loss at the first step (same weights, same batch: only reduction order differs). fp32 measured: 1.2e-7
    at most (PP2 x VPP2), 2e-8 typically."""
    steps: float | None = 1e-5
    """Loss at every step. fp32 measured: 6.6e-7 at most (weight decay at lr 1e-2)."""
    eval: float | None = 1e-6
    """eval_loss at every step both runs evaluated (the same steps, or the case fails). fp32 measured:
    3.8e-8."""
    weights: float | None = 1e-3
    """Exported weights: ||mca - standard|| / ||standard - start|| over every exported tensor. fp32 measured:
    1.2e-4 at most; Adam's first steps move a weight by about lr whatever the size of its gradient, so a
    gradient that is noise on both backends (1e-8 apart) still moves the weight by lr in either direction."""


def M(step1: float | None, steps: float | None, eval: float | None, weights: float | None) -> Bounds:
    """A measured gap (``None``: not measured, e.g. eval in a case without eval)."""
    return Bounds(step1, steps, eval, weights)


@dataclass(frozen=True)
class Case:
    name: str
    base: str
    """A key of BASES."""
    overrides: dict
    """The key set under test, on both runs (recipe keys, as YAML values)."""
    layout: str = "1p"
    model: str = "qwen2"
    steps: int = 8
    bounds: Bounds = Bounds()
    measured: Bounds | None = None
    """The largest gaps measured on CPU (fp32 unless the key set says otherwise), for the record."""
    resume_at: int | None = None
    """Resume mid-run: both runs save at this step, then each resumes from its own checkpoint; compared are
    the full runs and the resumed ones (steps resume_at+1..steps)."""
    clips: bool = False
    """The key set clips gradients: every logged grad_norm (before clipping) must exceed max_grad_norm."""

    def __post_init__(self) -> None:
        assert self.base in BASES and self.layout in LAYOUTS and self.model in MODELS, self
        if self.resume_at is not None:
            assert 0 < self.resume_at < self.steps, self

    @property
    def standard_key(self) -> str:
        """Cases with equal keys have the same standard run: it is one process whatever the mca layout, and
        the layout keeps the global batch."""
        return json.dumps([self.base, self.overrides, self.model, self.steps, self.resume_at], sort_keys=True)

    def recipe(self, model_dir: str) -> dict:
        """The recipe both runs share (the mca run's layout included; roll-parity plans the runs from it)."""
        base = dict(BASES[self.base])
        base["dataset"] = os.path.join(REPO, base["dataset"])
        layout = LAYOUTS[self.layout]
        recipe = {**base, "model_name_or_path": model_dir, **self.overrides, **layout.keys,
                  "nproc_per_node": layout.processes}
        gas = recipe["gradient_accumulation_steps"]
        assert gas % layout.dp == 0, (self.name, gas, layout.dp)
        recipe["gradient_accumulation_steps"] = gas // layout.dp
        for key in ("dataset", "eval_dataset"):  # a case's own data file, relative to the repository too
            if isinstance(recipe.get(key), str) and not os.path.isabs(recipe[key]):
                recipe[key] = os.path.join(REPO, recipe[key])
        return recipe


def build_model(name: str, root: str) -> str:
    """The tiny model ``name`` (MODELS) in ROOT/NAME, built once (a finished build has config.json)."""
    from roll.demo.tiny_model import make_tiny_model

    out = os.path.join(root, name)
    if not os.path.isfile(os.path.join(out, "config.json")):
        make_tiny_model(out, **MODELS[name])
    return out
