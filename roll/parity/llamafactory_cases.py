"""LLaMA-Factory's own example recipes, by name, for ``scripts/llamafactory_parity.py --case NAME``
(docs/llamafactory-parity.md has each one's measured result).

Each case is one recipe of an LLaMA-Factory checkout (``--llamafactory-dir``: its ``examples/`` and ``data/``,
run from there as LLaMA-Factory runs them, ``dataset_dir: data``), unedited, with only this machine's values
overridden on every side: a local tiny model for its Hub id, fp32 on a CPU (``bf16=false``), one preprocessing
process, no dataloader workers, no DeepSpeed (LLaMA-Factory's venv here has none); a case may add keys for one
side (``roll``: roll's name for an LLaMA-Factory behaviour, e.g. ``packing_algorithm: llamafactory``).
"""

from __future__ import annotations

from dataclasses import dataclass

MACHINE = ("bf16=false", "preprocessing_num_workers=1", "dataloader_num_workers=0")
"""This machine's values, on every side of every case (a CPU, fp32; tokenization in one process, so each
tokenization batch is the whole batch as LLaMA-Factory's with one worker)."""
TINY_QWEN2 = ".demo/tiny-qwen2"
TINY_QWEN3_MOE = ".demo/tiny-qwen3-moe"
MODELS = {TINY_QWEN2: "python scripts/make_tiny_model.py --out .demo/tiny-qwen2",
          TINY_QWEN3_MOE: "python scripts/make_tiny_model.py --out .demo/tiny-qwen3-moe --kind qwen3_moe "
                          "--num-layers 4"}
"""The tiny models the cases train (relative to roll's checkout) and the command that builds each."""
EXAMPLES_BAR = 1e-3
"""Issue 30's bar for LLaMA-Factory's examples on roll's two backends: the same losses within 1e-3 (3 steps)."""


@dataclass(frozen=True)
class LlamaFactoryCase:
    name: str
    recipe: str
    """The recipe's path in the LLaMA-Factory checkout."""
    what: str
    overrides: tuple[str, ...] = ()
    """``key=value`` on every side, beside MACHINE."""
    roll: tuple[str, ...] = ()
    """``key=value`` on roll's sides only."""
    model: str = TINY_QWEN2
    tolerance: float = EXAMPLES_BAR
    first_step_tolerance: float = EXAMPLES_BAR
    backends: tuple[str, ...] = ("standard", "mca")
    llamafactory: bool = True
    """False: roll's two backends only (roll-parity), for a recipe LLaMA-Factory runs through mcore_adapter
    (``USE_MCA=1``), which its CPU venv does not have."""
    steps: int = 3

    def arguments(self, model: str) -> list[str]:
        """Every side's ``key=value`` overrides."""
        return [f"model_name_or_path={model}", *MACHINE, *self.overrides]


CASES = {case.name: case for case in (
    LlamaFactoryCase("full_sft", "examples/train_full/qwen3_full_sft.yaml",
                     "full-parameter sft (identity,alpaca_en_demo, qwen3_nothink); issue 30's bars 1e-5 / 1e-4",
                     overrides=("deepspeed=null",), tolerance=1e-4, first_step_tolerance=1e-5),
    LlamaFactoryCase("lora_sft", "examples/train_lora/qwen3_lora_sft.yaml", "LoRA sft; step 1 within 1e-5",
                     tolerance=1e-4, first_step_tolerance=1e-5),
    LlamaFactoryCase("lora_pretrain", "examples/train_lora/qwen3_lora_pretrain.yaml",
                     "LoRA pt (c4_demo); 4.9e-4 apart by the pt loss scale 2047/2048 (docs/llamafactory.md)"),
    LlamaFactoryCase("lora_dpo", "examples/train_lora/qwen3_lora_dpo.yaml", "LoRA dpo (dpo_en_demo, sigmoid)"),
    LlamaFactoryCase("lora_kto", "examples/train_lora/qwen3_lora_kto.yaml",
                     "LoRA kto (kto_en_demo, 1 row a micro-batch: its rows paired when tokenized, as there)"),
    LlamaFactoryCase("lora_reward", "examples/train_lora/qwen3_lora_reward.yaml",
                     "LoRA rm (dpo_en_demo); LLaMA-Factory's head differs (trl's value head)"),
    LlamaFactoryCase("megatron_qwen3_moe", "examples/megatron/qwen3_moe_full.yaml",
                     "the Megatron Qwen3-MoE recipe on a tiny Qwen3-MoE, its experts on 2 processes (EP2 x DP2; its "
                     "PP4 x EP2 needs 8 processes, roll-train runs one a CPU core here: 2), grouped GEMM off (it "
                     "needs Transformer Engine or grouped_gemm); roll's standard backend vs mca only (LLaMA-Factory "
                     "runs it through mcore_adapter)",
                     overrides=("nproc_per_node=2", "pipeline_model_parallel_size=1", "moe_grouped_gemm=false"),
                     model=TINY_QWEN3_MOE, llamafactory=False),
    LlamaFactoryCase("packed_sft", "examples/train_full/qwen3_full_sft.yaml",
                     "full sft with neat_packing (LLaMA-Factory's packed rows: packing_algorithm: llamafactory on "
                     "roll's side); issue 30's bars 1e-5 / 1e-4",
                     overrides=("deepspeed=null", "neat_packing=true"), roll=("packing_algorithm=llamafactory",),
                     tolerance=1e-4, first_step_tolerance=1e-5, backends=("standard",)),
)}


def format_cases() -> str:
    """One case a line: its name, recipe and what it checks."""
    width = max(map(len, CASES))
    return "\n".join(f"{case.name:<{width}}  {case.recipe}: {case.what}" for case in CASES.values())
