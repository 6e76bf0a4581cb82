"""What is trained: the stage (pt/sft/dpo/rm), which parameters, and the preference-loss knobs."""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from typing import Literal

from roll.errors import ConfigError
from roll.logging import warn_once

logger = logging.getLogger(__name__)

REFERENCE_FREE_LOSSES = ("orpo", "simpo")
"""pref_loss values that read no reference model (roll.preference computes them)."""


@dataclass
class FinetuningArguments:
    stage: Literal["pt", "sft", "dpo", "kto", "rm"] = "sft"
    """Training stage: pt (pre-training on plain text), sft (supervised fine-tuning), dpo (preference optimisation),
    kto (KTO on unpaired desirable / undesirable replies: rows with a boolean kto_tag), rm (pairwise reward model:
    a 1-wide head without bias, HF's ``score`` of ``...ForSequenceClassification``, read at each sequence's
    rightmost non-pad token, zero at the start unless the checkpoint has one; loss mean over pairs of
    -log sigmoid(r_chosen - r_rejected), so step 1 is ln 2; docs/mca-training.md, "Reward modelling")."""

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

    freeze_vision_tower: bool = True
    """Vision-language models (docs/vl.md): keep the vision tower (``model.visual`` but its merger) frozen
    (LLaMA-Factory's key and default). No effect on a text model."""

    freeze_multi_modal_projector: bool = True
    """Vision-language models: keep the multi-modal projector (Qwen-VL's ``visual.merger``) frozen
    (LLaMA-Factory's key and default). No effect on a text model."""

    freeze_language_model: bool = False
    """Vision-language models, finetuning_type full or lora: keep the language model (and its output head)
    frozen, training only the unfrozen vision parts (LLaMA-Factory's key). No effect on a text model."""

    export_merged: bool = False
    """With LoRA: also write base + adapter merged into a plain HF model."""

    pref_beta: float = 0.1
    """DPO and KTO beta (strength of the KL constraint to the reference model); orpo: the weight of the odds-ratio
    term; simpo: the scale of the mean log-prob difference (the SimPO paper uses 2 to 10)."""

    pref_loss: Literal["sigmoid", "ipo", "hinge", "orpo", "simpo"] = "sigmoid"
    """Preference loss of stage dpo (TRL's definitions for sigmoid, ipo, hinge). orpo and simpo use no reference
    model (LLaMA-Factory's definitions, from each response's mean token log-prob A): orpo = -A_chosen + pref_beta
    * -log sigmoid(log odds(A_chosen) - log odds(A_rejected)) (TRL's ORPO averages its NLL over the batch's
    chosen prompt and response tokens instead); simpo = -log sigmoid(pref_beta * (A_chosen - A_rejected) -
    simpo_gamma) (TRL's CPO with cpo_alpha=0: no NLL term unless pref_ftx). docs/standard.md has the details."""

    pref_label_smoothing: float = 0.0
    """Label smoothing eps of the sigmoid DPO loss (conservative DPO) and of simpo (TRL's CPO form), in [0, 0.5)."""

    pref_ftx: float = 0.0
    """DPO: weight of an SFT term added to each pair's preference loss, the chosen response's mean per-token
    negative log-likelihood (LLaMA-Factory's pref_ftx; >= 0, 0 = off), for every pref_loss (orpo already holds
    this term with weight 1: with pref_ftx it weighs 1 + pref_ftx, as in LLaMA-Factory)."""

    simpo_gamma: float | None = None
    """pref_loss simpo: the target margin gamma, absolute (subtracted from pref_beta * (A_chosen - A_rejected);
    the SimPO paper's gamma_beta_ratio times pref_beta), >= 0; default 0.5 (LLaMA-Factory's and TRL's)."""

    kto_desirable_weight: float = 1.0
    """KTO: weight of a desirable row's loss (TRL's desirable_weight); with unequal classes, keep
    desirable_weight * desirable rows / (undesirable_weight * undesirable rows) in [1, 4/3] (the KTO paper)."""

    kto_undesirable_weight: float = 1.0
    """KTO: weight of an undesirable row's loss (TRL's undesirable_weight)."""

    kto_chosen_weight: float | None = None
    """LLaMA-Factory's spelling of kto_desirable_weight (give one of them)."""

    kto_rejected_weight: float | None = None
    """LLaMA-Factory's spelling of kto_undesirable_weight (give one of them)."""

    ref_model: str | None = None
    """Reference model directory for DPO and KTO; default: a frozen copy of the starting weights (none for
    pref_loss orpo and simpo)."""

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
        if self.pref_label_smoothing and self.pref_loss not in ("sigmoid", "simpo"):
            raise ConfigError(f"pref_label_smoothing={self.pref_label_smoothing} applies to pref_loss sigmoid "
                              f"(conservative DPO) and simpo; pref_loss {self.pref_loss} has no label-smoothed "
                              "form: drop pref_label_smoothing or choose one of those losses.")
        if not 0.0 <= self.pref_ftx < math.inf:
            raise ConfigError(f"pref_ftx must be a finite number >= 0, got {self.pref_ftx}.")
        if self.pref_ftx and self.stage != "dpo":
            raise ConfigError(f"pref_ftx={self.pref_ftx} only applies to stage: dpo (it weights an SFT term in "
                              f"the preference loss); stage {self.stage} trains on the token loss alone: drop "
                              "pref_ftx.")
        if self.ref_free and self.ref_model:
            raise ConfigError("ref_free=true and ref_model are contradictory: drop one of them.")
        self._check_reference_free()
        self._check_kto()

    def _check_reference_free(self) -> None:
        """simpo_gamma belongs to simpo; orpo and simpo take no reference model."""
        if self.pref_loss == "simpo" and self.simpo_gamma is None:
            self.simpo_gamma = 0.5
        if self.simpo_gamma is not None:
            if self.pref_loss != "simpo":
                raise ConfigError(f"simpo_gamma={self.simpo_gamma} is the margin of pref_loss simpo; pref_loss is "
                                  f"{self.pref_loss}: drop simpo_gamma or set pref_loss: simpo.")
            if not 0.0 <= self.simpo_gamma < math.inf:
                raise ConfigError(f"simpo_gamma must be a finite number >= 0, got {self.simpo_gamma}.")
        if self.stage != "dpo" or self.pref_loss not in REFERENCE_FREE_LOSSES:
            return
        if self.ref_model:
            raise ConfigError(f"ref_model={self.ref_model!r}: pref_loss {self.pref_loss} uses no reference model "
                              "(its loss reads only the policy's log-probs): drop ref_model, or choose pref_loss "
                              "sigmoid, ipo or hinge to train against it.")
        if self.ref_free:
            warn_once(logger, f"ref_free=true has no effect with pref_loss {self.pref_loss}: it never uses a "
                              "reference model.")

    @property
    def reference_free(self) -> bool:
        """Stage dpo builds no reference model: ref_free, or a pref_loss that reads none (orpo, simpo); never with
        stage kto (it refuses both)."""
        return self.ref_free or self.pref_loss in REFERENCE_FREE_LOSSES

    def _check_kto(self) -> None:
        """The KTO weights (LLaMA-Factory's kto_chosen/rejected_weight spelling folded in) and what stage kto
        does not take."""
        for alias, name in (("kto_chosen_weight", "kto_desirable_weight"),
                            ("kto_rejected_weight", "kto_undesirable_weight")):
            given = getattr(self, alias)
            if given is not None and getattr(self, name) not in (1.0, given):
                raise ConfigError(f"{alias}={given} and {name}={getattr(self, name)} are the same key "
                                  "(LLaMA-Factory's spelling and TRL's): give one of them.")
            if given is not None:
                setattr(self, name, given)
            setattr(self, alias, None)  # one field holds the value
            value = getattr(self, name)
            if not 0 < value < math.inf:
                raise ConfigError(f"{name} must be a finite number > 0, got {value}.")
            if value != 1.0 and self.stage != "kto":
                raise ConfigError(f"{name}={value} only applies to stage: kto; drop it for stage {self.stage}.")
        if self.stage != "kto":
            return
        for name, default, why in (("pref_loss", "sigmoid", "it picks a DPO loss"),
                                   ("pref_label_smoothing", 0.0, "it smooths the DPO sigmoid loss"),
                                   ("ref_free", False, "KTO measures every reward against the reference model")):
            if getattr(self, name) != default:
                raise ConfigError(f"{name}={getattr(self, name)} does not apply to stage kto ({why}); drop it. "
                                  "KTO takes pref_beta, kto_desirable_weight, kto_undesirable_weight and ref_model.")

    @property
    def lora_targets(self) -> list[str] | str:
        """'all' or the explicit list of target module names."""
        if self.lora_target.strip() == "all":
            return "all"
        return [name.strip() for name in self.lora_target.split(",") if name.strip()]
