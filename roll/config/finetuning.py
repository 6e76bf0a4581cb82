"""What is trained: the stage (pt/sft/dpo/rm), which parameters, and the preference-loss knobs."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

from roll.errors import ConfigError


@dataclass
class FinetuningArguments:
    stage: Literal["pt", "sft", "dpo", "rm"] = "sft"
    """Training stage: pt (pre-training on plain text), sft (supervised fine-tuning), dpo (preference optimisation),
    rm (pairwise reward model: a 1-wide head without bias, HF's ``score`` of ``...ForSequenceClassification``, read
    at each sequence's rightmost non-pad token, zero at the start unless the checkpoint has one; loss
    mean over pairs of -log sigmoid(r_chosen - r_rejected), so step 1 is ln 2; docs/mca-training.md, "Reward
    modelling")."""

    finetuning_type: Literal["full", "lora", "freeze"] = "full"
    """full: all weights; lora: low-rank adapters only; freeze: only the last freeze_trainable_layers layers."""

    lora_rank: int = 8
    """LoRA rank r."""

    lora_alpha: int | None = None
    """LoRA scaling alpha; default 2 * lora_rank."""

    lora_dropout: float = 0.0
    """Dropout on the LoRA input."""

    lora_target: str = "all"
    """Comma-separated module names to adapt, or 'all' for every linear layer except the output head."""

    use_rslora: bool = False
    """LoRA: scale the adapter by lora_alpha / sqrt(lora_rank) (rank-stabilised LoRA, PEFT's use_rslora)
    instead of lora_alpha / lora_rank."""

    freeze_trainable_layers: int = 2
    """With finetuning_type=freeze: how many of the last decoder layers are trained."""

    export_merged: bool = False
    """With LoRA: also write base + adapter merged into a plain HF model."""

    pref_beta: float = 0.1
    """DPO beta (strength of the KL constraint to the reference model)."""

    pref_loss: Literal["sigmoid", "ipo", "hinge"] = "sigmoid"
    """DPO loss type."""

    pref_label_smoothing: float = 0.0
    """Label smoothing for the sigmoid DPO loss (conservative DPO), in [0, 0.5)."""

    pref_ftx: float = 0.0
    """DPO: weight of an SFT term added to each pair's preference loss, the chosen response's mean per-token
    negative log-likelihood (LLaMA-Factory's pref_ftx; >= 0, 0 = off)."""

    ref_model: str | None = None
    """Reference model directory for DPO; default: a frozen copy of the starting weights."""

    ref_free: bool = False
    """Reference-free DPO (no reference model; implicit reference log-probs of 0)."""

    def __post_init__(self) -> None:
        if self.lora_rank < 1:
            raise ConfigError(f"lora_rank must be >= 1, got {self.lora_rank}.")
        if self.lora_alpha is None:
            self.lora_alpha = 2 * self.lora_rank
        if not 0.0 <= self.lora_dropout < 1.0:
            raise ConfigError(f"lora_dropout must be in [0, 1), got {self.lora_dropout}.")
        if not self.lora_target.strip():
            raise ConfigError("lora_target is empty: use 'all' or a comma-separated list such as 'q_proj,v_proj'.")
        if self.use_rslora and self.finetuning_type != "lora":
            raise ConfigError(f"use_rslora only applies to finetuning_type: lora (it scales the LoRA adapter); "
                              f"finetuning_type is {self.finetuning_type}: drop use_rslora or set "
                              "finetuning_type: lora.")
        if self.freeze_trainable_layers < 1:
            raise ConfigError(f"freeze_trainable_layers must be >= 1, got {self.freeze_trainable_layers}.")
        if self.pref_beta <= 0:
            raise ConfigError(f"pref_beta must be > 0, got {self.pref_beta}.")
        if not 0.0 <= self.pref_label_smoothing < 0.5:
            raise ConfigError(f"pref_label_smoothing must be in [0, 0.5), got {self.pref_label_smoothing}.")
        if not 0.0 <= self.pref_ftx < math.inf:
            raise ConfigError(f"pref_ftx must be a finite number >= 0, got {self.pref_ftx}.")
        if self.pref_ftx and self.stage != "dpo":
            raise ConfigError(f"pref_ftx={self.pref_ftx} only applies to stage: dpo (it weights an SFT term in "
                              f"the preference loss); stage {self.stage} trains on the token loss alone: drop "
                              "pref_ftx.")
        if self.ref_free and self.ref_model:
            raise ConfigError("ref_free=true and ref_model are contradictory: drop one of them.")

    @property
    def lora_targets(self) -> list[str] | str:
        """'all' or the explicit list of target module names."""
        if self.lora_target.strip() == "all":
            return "all"
        return [name.strip() for name in self.lora_target.split(",") if name.strip()]
