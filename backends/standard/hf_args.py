"""Build the real HF ``TrainingArguments`` / TRL ``DPOConfig`` / ``RewardConfig`` from roll's validated config.

roll's TrainingArguments skips HF's ``__post_init__`` (it would initialise devices and DeepSpeed
at parse time); this is where that set-up happens, once, inside the backend.
"""

from __future__ import annotations

import copy

from backends.standard._compat import cpu_training_kwargs


def build_hf_args(config, deepspeed):
    """HF/TRL arguments for ``config`` (a RunConfig); ``deepspeed``: parsed DeepSpeedSettings or None."""
    training, finetuning = config.training, config.finetuning
    kwargs = training.hf_kwargs()
    kwargs.update(cpu_training_kwargs())  # W1
    # HF fills "auto" values into the dict it gets; give it a copy so the parsed file stays as written.
    kwargs["deepspeed"] = copy.deepcopy(deepspeed.config) if deepspeed is not None else None
    kwargs["resume_from_checkpoint"] = None  # passed to train() by the backend
    # The shared collator decides what a batch holds; HF must not drop columns by the model's signature.
    kwargs["remove_unused_columns"] = False
    if kwargs.get("ddp_find_unused_parameters") is None:
        kwargs["ddp_find_unused_parameters"] = False  # every trainable parameter is used in each step
    assert kwargs["average_tokens_across_devices"], "refused at config time (roll/config/coverage.py)"
    if finetuning.stage == "dpo":
        from trl import DPOConfig

        # router_aux_loss_coef 0: roll's DPO trains MoE models without the load-balancing loss here
        # (backends/standard/models.moe_loss_coefficients warns); TRL 1.16 would add HF's pooled one at the
        # model config's coefficient (Mixtral, Qwen-MoE: 0.001), which the mca backend never computes
        return DPOConfig(**kwargs, beta=finetuning.pref_beta, **_dpo_loss(finetuning),
                         label_smoothing=finetuning.pref_label_smoothing, max_length=config.data.cutoff_len,
                         precompute_ref_log_probs=finetuning.reference_free,  # RollDPOTrainer fills zeros
                         router_aux_loss_coef=0.0)
    if finetuning.stage == "kto":
        from trl import KTOConfig

        # roll's trainer samples in the pipeline's order anyway (RollTrainerMixin); TRL refuses another strategy.
        kwargs["train_sampling_strategy"] = "sequential"
        return KTOConfig(**kwargs, beta=finetuning.pref_beta, desirable_weight=finetuning.kto_desirable_weight,
                         undesirable_weight=finetuning.kto_undesirable_weight, max_length=config.data.cutoff_len,
                         router_aux_loss_coef=0.0)  # as DPO above: roll's KTO trains MoE models without it here
    if finetuning.stage == "rm":
        from trl import RewardConfig

        # no centring term (roll.reward's definition); max_length only filters TRL's own tokenization, not used
        return RewardConfig(**kwargs, max_length=config.data.cutoff_len, center_rewards_coefficient=None)
    from transformers import TrainingArguments

    return TrainingArguments(**kwargs)


def _dpo_loss(finetuning) -> dict:
    """TRL's loss_type (and weights) for pref_loss.

    TRL 1.16's ``sigmoid`` ignores ``label_smoothing``; conservative DPO,
    ``-(1 - eps) logsigmoid(x) - eps logsigmoid(-x)``, is exactly ``2 (1 - eps) * sigmoid - (1 - 2 eps) *
    robust`` in TRL's terms (``robust = (-(1 - eps) logsigmoid(x) + eps logsigmoid(-x)) / (1 - 2 eps)``),
    so that is what pref_label_smoothing > 0 asks TRL for (the mca backend computes the same loss).
    orpo and simpo are not TRL's DPO losses: RollDPOTrainer computes them (``reference_free.py``).
    """
    eps = finetuning.pref_label_smoothing
    if finetuning.pref_loss == "sigmoid" and eps > 0:
        return {"loss_type": ["sigmoid", "robust"], "loss_weights": [2 * (1 - eps), -(1 - 2 * eps)]}
    return {"loss_type": [finetuning.pref_loss]}
