"""The parity sweep: named cases, each one recipe trained on both backends and compared.

A case is a key set (``overrides`` over a ``base`` recipe) at one parallel ``layout`` on a tiny model built
locally (``roll.demo.tiny_model``). ``tests/parity`` runs every case (grouped per process launch) and ``roll-parity
--case NAME`` runs one from the command line; both plan the two runs the same way (``roll.parity.cli.plan_runs``:
the standard run is one process whose gradient accumulation covers the mca run's data-parallel ranks) and
compare them with ``roll.parity.report``. Every bound is a measurement: ``measured`` holds the largest gaps
seen on CPU, fp32 unless the case says otherwise, and a bound is about 10x to 100x its measured gap (bf16:
about 3x), so that a real parity bug (a key one backend ignores moves the loss by 1e-3 or more within 8
steps) fails it. Add a case here and both the test and the command line know it.
"""

from __future__ import annotations

import json

from roll.parity.case_spec import BASES, LAYOUTS, MODELS, REPO, Bounds, Case, Layout, M, build_model

__all__ = ["BASES", "CASES", "LAYOUTS", "MODELS", "REPO", "Bounds", "Case", "Layout", "M", "build_model",
           "case_names", "format_cases", "get_case"]
"""What other modules import from here (the parts of a case are roll.parity.case_spec's)."""


def _lora(**keys) -> dict:
    return {"finetuning_type": "lora", "lora_dropout": 0.0, "learning_rate": 1.0e-2, **keys}


_MLA_LORA = _lora(lora_rank=4, lora_alpha=16, lora_target="q_a_proj,q_b_proj,kv_a_proj_with_mqa,kv_b_proj,o_proj")


_WARMUP = {"warmup_steps": 3}
_SIMPO_FTX = {"pref_loss": "simpo", "pref_beta": 2.0, "simpo_gamma": 0.3, "pref_ftx": 0.5}
_MOE_OFF = {"moe_aux_loss_coeff": 0.0}
_ORPO_FTX_MOE = {"pref_loss": "orpo", "pref_ftx": 0.5, **_MOE_OFF}
_MOE_LOSSES = {"moe_aux_loss_coeff": 0.1, "moe_z_loss_coeff": 0.01,
               "dataset": "recipes/demo/data/uneven_sft.json", "cutoff_len": 128}
_EVAL = {"val_size": 0.1, "eval_strategy": "steps", "eval_steps": 3, "eval_on_start": True,
         "per_device_eval_batch_size": 4}
_KTO_EVAL = {"eval_dataset": "recipes/demo/data/arithmetic_kto.json", "eval_strategy": "steps", "eval_steps": 3,
             "eval_on_start": True, "per_device_eval_batch_size": 4}
"""KTO's evaluation on both backends: the training file itself (val_size would change the training order)."""

CASES = (
    # --- key sets on one process --------------------------------------------------------------------------
    Case("sft_plain", "sft", {},
         measured=M(2.0e-8, 1.1e-7, None, 5.8e-5)),
    Case("pt_plain", "pt", {},
         measured=M(5.6e-8, 1.9e-7, None, 1.9e-6)),
    Case("weight_decay", "sft", {"weight_decay": 0.1, "learning_rate": 1.0e-2},
         measured=M(2.0e-8, 6.6e-7, None, 1.2e-4)),
    Case("lr_linear_warmup", "sft", {"lr_scheduler_type": "linear", **_WARMUP},
         measured=M(2.0e-8, 9.0e-8, None, 9.8e-7)),
    Case("lr_cosine_warmup", "sft", {"lr_scheduler_type": "cosine", "warmup_ratio": 0.25},
         measured=M(2.0e-8, 8.2e-8, None, 8.2e-7)),
    Case("lr_constant_with_warmup", "sft", {"lr_scheduler_type": "constant_with_warmup", **_WARMUP},
         measured=M(2.0e-8, 9.0e-8, None, 9.6e-7)),
    Case("lr_cosine_with_restarts", "sft", {"lr_scheduler_type": "cosine_with_restarts", **_WARMUP,
                                            "lr_scheduler_kwargs": {"num_cycles": 2}},
         measured=M(2.0e-8, 9.0e-8, None, 9.6e-7)),
    Case("lr_polynomial", "sft", {"lr_scheduler_type": "polynomial", **_WARMUP,
                                  "lr_scheduler_kwargs": {"power": 2.0, "lr_end": 1.0e-5}},
         measured=M(2.0e-8, 1.1e-7, None, 1.1e-6)),
    Case("lr_inverse_sqrt", "sft", {"lr_scheduler_type": "inverse_sqrt", **_WARMUP},
         measured=M(2.0e-8, 9.0e-8, None, 8.9e-7)),
    Case("lr_cosine_with_min_lr", "sft", {"lr_scheduler_type": "cosine_with_min_lr", **_WARMUP,
                                          "lr_scheduler_kwargs": {"min_lr_rate": 0.1}},
         measured=M(2.0e-8, 9.0e-8, None, 9.9e-7)),
    Case("lr_cosine_warmup_with_min_lr", "sft", {"lr_scheduler_type": "cosine_warmup_with_min_lr", **_WARMUP,
                                                 "lr_scheduler_kwargs": {"min_lr_rate": 0.1}},
         measured=M(2.0e-8, 1.1e-7, None, 2.5e-5)),
    Case("lr_warmup_stable_decay", "sft", {"lr_scheduler_type": "warmup_stable_decay", **_WARMUP,
                                           "lr_scheduler_kwargs": {"num_decay_steps": 3}},
         measured=M(2.0e-8, 9.0e-8, None, 9.5e-7)),
    Case("grad_clipping", "sft", {"max_grad_norm": 0.5, "learning_rate": 1.0e-2}, clips=True,
         measured=M(2.0e-8, 4.7e-7, None, 9.7e-5)),
    Case("ga_uneven_lengths", "sft", {"dataset": "recipes/demo/data/uneven_sft.json", "cutoff_len": 128,
                                      "per_device_train_batch_size": 1, "gradient_accumulation_steps": 8},
         measured=M(9.1e-8, 1.1e-7, None, 1.6e-6)),
    Case("adam_hyperparameters", "sft", {"adam_beta1": 0.8, "adam_beta2": 0.9, "adam_epsilon": 1.0e-4,
                                         "learning_rate": 3.0e-3},
         measured=M(2.0e-8, 1.6e-7, None, 3.9e-7)),
    Case("packing", "sft", {"packing": True, "cutoff_len": 128},
         measured=M(3.0e-8, 1.0e-7, None, 5.0e-6)),
    Case("mid_run_eval", "sft", _EVAL,
         measured=M(3.7e-8, 1.1e-7, 3.6e-8, 1.0e-6)),
    Case("resume_mid_run", "sft", {}, resume_at=4,
         measured=M(2.0e-8, 1.1e-7, None, 5.8e-5)),
    Case("bf16", "sft", {"bf16": True}, bounds=Bounds(step1=2e-4, steps=3e-3, eval=3e-3, weights=0.2),
         measured=M(2.2e-5, 4.6e-4, None, 5.1e-2)),
    Case("dpo_sigmoid", "dpo", {},
         measured=M(0, 2.6e-7, None, 5.6e-5)),
    Case("dpo_sigmoid_label_smoothing", "dpo", {"pref_label_smoothing": 0.2},
         measured=M(0, 1.3e-7, None, 3.6e-5)),
    Case("dpo_ipo", "dpo", {"pref_loss": "ipo"},
         measured=M(0, 1.1e-7, None, 7.3e-5)),
    Case("dpo_hinge", "dpo", {"pref_loss": "hinge"},
         measured=M(0, 6.3e-7, None, 7.7e-5)),
    # the reference-free losses (roll.preference): orpo at its defaults, simpo with an SFT term
    Case("dpo_orpo", "dpo", {"pref_loss": "orpo"},
         measured=M(3.6e-8, 3.6e-8, None, 1.5e-6)),
    Case("dpo_simpo_ftx", "dpo", _SIMPO_FTX,
         measured=M(1.7e-8, 4.1e-8, None, 1.3e-6)),
    Case("lora_all_r8", "sft", _lora(lora_rank=8, lora_target="all"),
         measured=M(2.0e-8, 6.9e-8, None, 2.2e-7)),
    Case("lora_qv_r4_alpha16", "sft", _lora(lora_rank=4, lora_alpha=16, lora_target="q_proj,v_proj"),
         measured=M(2.0e-8, 1.1e-7, None, 4.5e-7)),
    Case("lora_mlp_r16_alpha8", "sft",
         _lora(lora_rank=16, lora_alpha=8, lora_target="gate_proj,up_proj,down_proj"),
         measured=M(2.0e-8, 8.7e-8, None, 4.3e-7)),
    Case("lora_rslora_all_r16", "sft", _lora(lora_rank=16, lora_alpha=8, lora_target="all", use_rslora=True),
         measured=M(3.0e-9, 5.6e-8, None, 1.6e-6)),
    # --- each layout with a representative key set ------------------------------------------------------
    Case("tp2_weight_decay_cosine", "sft", {"weight_decay": 0.1, "lr_scheduler_type": "cosine", **_WARMUP},
         layout="tp2",
         measured=M(2.0e-8, 8.9e-8, None, 1.0e-6)),
    Case("pp2_vpp2_mid_run_eval", "sft", _EVAL, layout="pp2_vpp2", model="qwen2_4l",
         measured=M(1.2e-7, 2.0e-7, 3.8e-8, 1.6e-5)),
    Case("dp2_overlap_clipping_decay", "sft", {"max_grad_norm": 0.5, "weight_decay": 0.1,
                                               "learning_rate": 1.0e-2}, layout="dp2_overlap", clips=True,
         measured=M(2.0e-8, 4.8e-7, None, 9.8e-5)),
    Case("cp2_packing", "sft", {"packing": True, "cutoff_len": 128}, layout="cp2",
         measured=M(1.4e-8, 1.2e-7, None, 8.1e-6)),
    Case("ep2_moe_adam", "sft", {"adam_beta1": 0.8, "adam_beta2": 0.9, "moe_aux_loss_coeff": 0.0},
         layout="ep2", model="moe",
         measured=M(0, 1.5e-7, None, 3.8e-6)),
    # the load-balancing loss on, at the model's coefficient; samples of uneven length: padding left out
    Case("moe_default_aux_loss", "sft", {"dataset": "recipes/demo/data/uneven_sft.json", "cutoff_len": 128},
         model="moe", measured=M(8.5e-9, 8.5e-9, None, 2.9e-6)),
    # GLM-4.5's routing (sigmoid scores, correction bias, scaled), its dense first layer and partial RoPE
    Case("glm4_moe_sft", "sft", {}, model="glm4_moe", steps=10,
         measured=M(2.7e-9, 8.5e-9, None, 2.6e-5)),
    Case("ep2_glm4_moe_sft", "sft", {}, layout="ep2", model="glm4_moe", steps=10,
         measured=M(2.7e-9, 8.5e-9, None, 2.4e-5)),
    # DeepSeek-V3's multi-latent attention (q LoRA rank, decoupled RoPE part, YaRN) and group-limited routing
    Case("deepseek_v3_sft", "sft", {}, model="deepseek_v3", steps=10,
         measured=M(5.3e-9, 1.0e-8, None, 3.0e-6)),
    Case("ep2_deepseek_v3_sft", "sft", {}, layout="ep2", model="deepseek_v3", steps=10,
         measured=M(5.3e-9, 1.1e-8, None, 2.9e-6)),
    # TP2 (the kv down-projection column-parallel): before backends/mca/mla_rope_key_grad.py the shared RoPE key
    # trained with one rank's heads' gradient (weights 8.3e-2 apart; with LoRA on the attention 8.7e-2)
    Case("tp2_deepseek_v3_sft", "sft", {}, layout="tp2", model="deepseek_v3", steps=10,
         measured=M(1.3e-9, 1.7e-8, None, 1.1e-5)),
    # LoRA on multi-latent attention (its MLP targets go to the routed experts under PEFT: refused on mca)
    Case("deepseek_v3_lora_mla", "sft", _MLA_LORA, model="deepseek_v3",
         measured=M(6.7e-9, 8.2e-9, None, 5.2e-7)),
    Case("tp2_deepseek_v3_lora_mla", "sft", _MLA_LORA, layout="tp2", model="deepseek_v3",
         measured=M(1.3e-9, 8.3e-9, None, 3.9e-7)),
    # LoRA on GLM-4.5's attention (q/k/v bias, partial RoPE) and on Mixtral with all (= q, k, v, o on both backends)
    Case("glm4_moe_lora_attention", "sft", _lora(lora_rank=4, lora_target="q_proj,k_proj,v_proj,o_proj"),
         model="glm4_moe", measured=M(5.4e-9, 7.0e-9, None, 1.2e-5)),
    Case("mixtral_lora_all", "sft", _lora(lora_rank=4, lora_target="all", moe_aux_loss_coeff=0.0), model="mixtral",
         measured=M(1.3e-9, 5.6e-9, None, 1.4e-6)),
    Case("deepseek_v3_no_q_lora_lora", "sft",
         _lora(lora_rank=8, lora_target="q_proj,kv_a_proj_with_mqa,kv_b_proj,o_proj"), model="deepseek_v3_no_q_lora",
         measured=M(1.4e-16, 7.0e-9, None, 5.3e-6)),
    # DPO on the families of issue 21 (the standard backend's DPO has no MoE losses: Mixtral's is set to 0 for mca).
    # Before backends/standard/hf_args.py passed router_aux_loss_coef 0, TRL added HF's pooled load-balancing loss
    # at the config's 0.001 on the standard side: dpo_mixtral 2.9e-3 apart at step 1, weights 7.7e-2
    Case("dpo_glm4_moe", "dpo", {}, model="glm4_moe",
         measured=M(2.7e-9, 8.6e-8, None, 2.2e-5)),
    Case("dpo_deepseek_v3", "dpo", {}, model="deepseek_v3",
         measured=M(2.7e-9, 7.5e-8, None, 4.0e-5)),
    Case("dpo_deepseek_v3_lora_mla", "dpo", _MLA_LORA, model="deepseek_v3",
         measured=M(2.7e-9, 7.0e-8, None, 3.5e-6)),
    Case("dpo_mixtral", "dpo", {"moe_aux_loss_coeff": 0.0}, model="mixtral",
         measured=M(2.7e-9, 5.9e-8, None, 1.8e-5)),
    # Mixtral with both MoE losses at large coefficients, so that a mismatch shows, 10 steps on samples of
    # uneven length; the same key set at EP2, TP2 (experts split by ETP2, a padded vocabulary) and
    # accumulating 8 micro-batches of one sample. At TP2 the z-loss trained at half its coefficient before
    # backends/mca/moe_loss_scale.py (losses 2.7e-4 apart, weights 1.1e-1)
    Case("mixtral_moe_losses", "sft", _MOE_LOSSES, model="mixtral", steps=10,
         measured=M(0, 1.9e-8, None, 5.8e-6)),
    Case("ep2_mixtral_moe_losses", "sft", _MOE_LOSSES, layout="ep2", model="mixtral", steps=10,
         measured=M(0, 2.0e-8, None, 5.9e-6)),
    Case("tp2_mixtral_moe_losses", "sft", _MOE_LOSSES, layout="tp2", model="mixtral", steps=10,
         measured=M(1.4e-16, 8.7e-9, None, 3.1e-6)),  # 1.9e-8 / 6.6e-6 counting the kept token (see below)
    Case("ep2_mixtral_moe_losses_ga8", "sft", {**_MOE_LOSSES, "per_device_train_batch_size": 1,
                                               "gradient_accumulation_steps": 8},
         layout="ep2", model="mixtral", steps=10, measured=M(1.9e-9, 4.0e-9, None, 1.8e-6)),
    # the load-balancing loss alone on the held-out Mixtral of issue 21, 2 rows x 4 micro-batches, at TP2 + SP. The
    # MoE losses on mca counted the longest row's last token when the sequence-parallel padding kept it in the
    # shifted batch (63 vs 62 tokens in a micro-batch of odd length) until roll/data/collators.py masked it:
    # losses 5.5e-5 apart, weights 6.2e-2 before
    Case("tp2_mixtral_80_aux", "sft", {"moe_aux_loss_coeff": 0.1, "dataset": "recipes/demo/data/uneven_sft.json",
                                       "cutoff_len": 128, "per_device_train_batch_size": 2,
                                       "gradient_accumulation_steps": 4},
         layout="tp2", model="mixtral_80", steps=10, measured=M(5.8e-9, 1.1e-8, None, 3.2e-6)),
    Case("tp2_dpo_ipo", "dpo", {"pref_loss": "ipo"}, layout="tp2",
         measured=M(0, 2.3e-7, None, 1.1e-4)),
    Case("cp2_dpo_sigmoid_ftx", "dpo", {"pref_ftx": 0.5}, layout="cp2",
         measured=M(2.6e-8, 2.7e-8, None, 3.9e-6)),
    Case("pp2_vpp2_lora_qv", "sft", _lora(lora_rank=4, lora_alpha=16, lora_target="q_proj,v_proj"),
         layout="pp2_vpp2", model="qwen2_4l",
         measured=M(7.2e-8, 1.3e-7, None, 1.1e-6)),
    # KTO (5 steps, the metrics too: tests/parity test_kto_metrics_on_both_backends_and_every_layout): one model
    # for the three layouts, so that one standard run is their reference; weights and LoRA (the reference: the
    # policy with its adapters off on mca, TRL's frozen copy of the fresh adapter on the standard backend) with
    # eval_loss at steps 0, 3 and 5
    Case("kto", "kto", {}, model="qwen2_4l", steps=5,
         measured=M(0, 8.4e-8, None, 8.2e-6)),
    Case("tp2_kto", "kto", {}, layout="tp2", model="qwen2_4l", steps=5,
         measured=M(0, 8.1e-8, None, 1.4e-5)),
    Case("pp2_vpp2_kto", "kto", {}, layout="pp2_vpp2", model="qwen2_4l", steps=5,
         measured=M(0, 7.3e-8, None, 8.1e-6)),
    Case("kto_weights_lora_eval", "kto", _lora(kto_desirable_weight=0.8, kto_undesirable_weight=1.25,
                                               pref_beta=0.5, **_KTO_EVAL), steps=5,
         measured=M(0, 1.5e-7, 3.0e-8, 2.2e-7)),
    # kto at one row a micro-batch (LLaMA-Factory's kto example): each row's mismatched row paired when tokenized,
    # the previous row of its tokenization batch (kto_mismatched_rows: auto -> llamafactory), on both backends
    Case("kto_tokenization_pairs", "kto", {"per_device_train_batch_size": 1, "gradient_accumulation_steps": 8},
         steps=5, measured=M(0, 5.9e-8, None, 1.7e-6)),
    # stage rm: the score head (zero at the start: step 1 is ln 2 on both) with a mid-run eval on held-out
    # pairs (alpaca's pairwise rows); at TP2 + SP (the head whole on each TP rank), PP2 x VPP2 (the head on the
    # last virtual stage; sharegpt pairs), and LoRA (the head trained in full, exported in the adapter as
    # modules_to_save)
    Case("rm_mid_run_eval", "rm", _EVAL,
         measured=M(2.7e-9, 8.2e-8, 5.9e-8, 3.4e-5)),
    Case("tp2_rm", "rm", {}, layout="tp2",
         measured=M(2.7e-9, 7.1e-8, None, 4.0e-5)),
    Case("pp2_vpp2_rm", "rm", {"dataset": "recipes/demo/data/arithmetic_dpo.json"}, layout="pp2_vpp2",
         model="qwen2_4l", measured=M(2.7e-9, 9.6e-8, None, 4.3e-5)),
    Case("rm_lora_all", "rm", _lora(lora_rank=4, lora_target="all"),
         measured=M(2.7e-9, 5.7e-8, None, 1.1e-6)),
    # pref_ftx with another DPO loss, at TP2 + SP (its NLL from vocab-parallel log-probs; sigmoid + ftx:
    # cp2_dpo_sigmoid_ftx, simpo: dpo_simpo_ftx, orpo: dpo_orpo_ftx_moe)
    Case("tp2_dpo_hinge_ftx", "dpo", {"pref_loss": "hinge", "pref_ftx": 0.5}, layout="tp2", steps=5,
         measured=M(2.2e-8, 4.6e-8, None, 2.4e-6)),
    # issue 22's stages and losses on the Qwen3-MoE (4 experts), 5 steps, at EP1 and EP2 (EP2 vs EP1 and the
    # metrics: test_new_stages_on_moe_ep2_equal_ep1). The MoE losses off on both runs, as in dpo_mixtral: the
    # standard backend's dpo / kto / rm train without them. rm, orpo (with pref_ftx) and simpo at EP2 x DP2 (the
    # score head and the dense weights reduced over DP2, the experts over their expert-data-parallel group of 1);
    # kto at TP2 x EP2 (DP1), because its reference point is a mean over the data-parallel ranks (docs/kto.md)
    Case("kto_moe", "kto", _MOE_OFF, model="moe", steps=5, measured=M(0, 3.3e-8, None, 5.9e-6)),
    Case("tp2_ep2_kto_moe", "kto", _MOE_OFF, layout="tp2_ep2", model="moe", steps=5,
         measured=M(0, 4.5e-8, None, 1.5e-5)),
    Case("rm_moe", "rm", _MOE_OFF, model="moe", steps=5, measured=M(2.7e-9, 9.7e-8, None, 3.8e-5)),
    Case("ep2_rm_moe", "rm", _MOE_OFF, layout="ep2", model="moe", steps=5,
         measured=M(2.7e-9, 9.7e-8, None, 3.8e-5)),
    Case("dpo_orpo_ftx_moe", "dpo", _ORPO_FTX_MOE, model="moe", steps=5,
         measured=M(6.5e-9, 4.7e-8, None, 2.1e-6)),
    Case("ep2_dpo_orpo_ftx_moe", "dpo", _ORPO_FTX_MOE, layout="ep2", model="moe", steps=5,
         measured=M(6.5e-9, 4.6e-8, None, 2.0e-6)),
    Case("dpo_simpo_ftx_moe", "dpo", {**_SIMPO_FTX, **_MOE_OFF}, model="moe", steps=5,
         measured=M(5.6e-8, 1.1e-7, None, 8.4e-5)),
    Case("ep2_dpo_simpo_ftx_moe", "dpo", {**_SIMPO_FTX, **_MOE_OFF}, layout="ep2", model="moe", steps=5,
         measured=M(5.6e-8, 1.0e-7, None, 8.4e-5)),
)


def case_names() -> list[str]:
    return [case.name for case in CASES]


def get_case(name: str) -> Case:
    """The case called ``name``; ConfigError naming the known cases otherwise."""
    from roll.errors import ConfigError

    for case in CASES:
        if case.name == name:
            return case
    raise ConfigError(f"no parity case named {name!r}; the cases are (roll-parity --list-cases): "
                      f"{', '.join(case_names())}.")


def format_cases() -> str:
    """``roll-parity --list-cases``: one case a line (name, layout, model, stage, key set)."""
    width = max(len(name) for name in case_names())
    return "\n".join(f"{case.name:<{width}}  {case.layout:<11}  {case.model:<8}  {case.base:<3}  "
                     + (" ".join(f"{k}={json.dumps(v)}" for k, v in case.overrides.items()) or "-")
                     + (f"  (resumed at step {case.resume_at})" if case.resume_at else "") for case in CASES)
