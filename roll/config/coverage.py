"""What every recipe key does on each backend: honoured, refused, or no effect on training.

One row per key (or per group of keys that share a status): a status for the standard backend and one
for mca. ``Honoured`` names the test or parity case that proves it, ``Refused`` says what to use instead,
``NoEffect`` says why the key cannot change what is trained. Key names may be glob patterns
(``hub_*``); an explicit name beats a pattern.

``roll.config.key_table.refuse_unhonoured`` turns the ``Refused`` rows into config errors at validation
time (exit 2), so the table and the behaviour cannot drift; rows with ``by`` are refused by the named
check elsewhere. docs/keys.md is generated from this table (scripts/update_key_table.py), and
tests/unit/test_key_coverage.py checks that every key of every group has exactly one row, that every
``Refused`` row refuses its example, and that the page is current.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Union

BACKENDS = ("standard", "mca")


@dataclass(frozen=True)
class Honoured:
    test: str | None
    """The test node id (``tests/...py::name``) that proves the key's effect."""
    note: str = ""
    gap: str = ""
    """Why no test covers it yet (only with ``test=None``)."""
    parity: str = ""
    """The case of the parity sweep (tests/parity/) that runs the key on both backends."""


@dataclass(frozen=True)
class Refused:
    use: str
    """What to use instead (the end of the error message)."""
    example: object
    """A value the backend refuses (the coverage test sets it and expects exit 2)."""
    examples: dict | None = None
    """Per-key examples where the row's keys take different types."""
    allowed: tuple = ()
    """Values accepted besides the key's default."""
    by: str = ""
    """Where an existing check refuses it; empty: ``refuse_unhonoured`` does, for any value not allowed."""


@dataclass(frozen=True)
class NoEffect:
    reason: str


Status = Union[Honoured, Refused, NoEffect]


@dataclass(frozen=True)
class Row:
    keys: str
    """Space-separated key names or glob patterns."""
    standard: Status
    mca: Status

    def status(self, backend: str) -> Status:
        return getattr(self, backend)


def both(status: Status) -> dict[str, Status]:
    return {"standard": status, "mca": status}


def _row(keys: str, standard: Status | None = None, mca: Status | None = None, **shared: Status) -> Row:
    statuses = shared.get("both") and both(shared["both"]) or {"standard": standard, "mca": mca}
    return Row(keys, **statuses)


# Tests that many rows name.
HF = Honoured("tests/unit/test_startup.py::test_roll_training_arguments_hand_hf_every_field",
              "passed to HF Trainer unchanged: transformers' meaning")
PARITY = "tests/distributed/test_mca_train.py::test_backend_parity_sft_and_pt"
SCHEDULE = ("tests/distributed/test_mca_param_groups.py::"
            "test_weight_decay_and_an_hf_schedule_match_the_standard_backend")
RESUME_MCA = "tests/distributed/test_mca_train.py::test_resume_reproduces_the_uninterrupted_run"
RESUME_STD = "tests/unit/test_standard_train.py::test_resume_reproduces_the_uninterrupted_run"
SAVE_ASYNC = ("tests/distributed/test_reliability.py::"
              "test_sigkill_inside_an_async_save_resumes_as_a_sync_save_does")
MID_EVAL = "tests/distributed/test_mca_train.py::test_mid_run_eval_at_the_same_steps_with_the_same_eval_loss"
LAYOUTS = "tests/distributed/test_mca_train.py::test_layouts_give_the_same_losses"
LORA = "tests/distributed/test_mca_train.py::test_lora_trajectories_across_layouts_and_backends"
DPO = "tests/distributed/test_mca_dpo.py::test_dpo_layouts_and_backend_parity"
REF_FREE_LOSSES = ("refused with pref_loss orpo and simpo, which read no reference: "
                   "tests/unit/test_preference.py::test_the_keys_of_the_reference_free_losses")
PREF_LOSSES = "tests/distributed/test_mca_pref_losses_dist.py::test_orpo_and_simpo_match_across_backends_and_layouts"
KTO = "tests/parity/test_sweep.py::test_kto_metrics_on_both_backends_and_every_layout"
RM = "tests/distributed/test_mca_rm.py::test_rm_layouts_backend_parity_and_export"
LAUNCH = "tests/unit/test_cli.py::test_launch_command_uses_torchrun_or_deepspeed"
SLURM_SIGNALS = "tests/distributed/test_slurm_dist.py::test_srun_tasks_signal_burst_then_the_requeued_job_resumes"
PIPELINE = "tests/unit/test_data_pipeline.py::test_max_samples_val_size_and_eval_dataset"
MOE_AUX = "tests/unit/test_loss.py::test_load_balancing_loss_is_megatrons_summed_over_layers_without_padding"
MOE_Z = "tests/unit/test_loss.py::test_router_z_loss_is_megatrons_summed_over_layers_without_padding"

LOGGING = NoEffect("logging only: what and where train_log.jsonl, the console and reporters show")
SPEED = NoEffect("data-loading speed and memory only; the batches are the same")
METRICS = NoEffect("roll evaluates eval_loss only (no compute_metrics): nothing for the key to change")
MEGATRON_ONLY = NoEffect("a Megatron-Core setting: the standard backend warns once and ignores it, so one "
                         "recipe runs on both backends")
RECOMPUTE = "recompute_granularity: full (with recompute_method: uniform and recompute_num_layers: 1)"

ROWS: tuple[Row, ...] = (
    # -- model ------------------------------------------------------------------------------------------
    _row("model_name_or_path", both=Honoured(PARITY)),
    _row("tokenizer_name_or_path", both=Honoured("tests/unit/test_data_tokenizer.py::test_template_override",
                                                 "the shared data pipeline loads it")),
    _row("trust_remote_code", both=Honoured(
        "tests/reliability/test_preflight.py::test_remote_code_needs_trust_and_says_so")),
    _row("trust_checkpoint_pickles", both=Honoured(
        "tests/reliability/test_trust.py::test_a_payload_in_a_checkpoint_is_refused_on_resume")),
    _row("dtype", standard=Honoured("tests/unit/test_config.py::test_optional_and_literal_values"),
         mca=Refused("the mca backend keeps fp32 master weights in its optimizer and computes in the precision "
                     "bf16 / fp16 select (16-bit weights without an fp32 copy are a standard-backend mode): "
                     "drop dtype (auto) and set bf16: true or fp16: true", "bfloat16", allowed=("float32",))),
    _row("attn_implementation", standard=NoEffect(
        "the attention kernel HF loads (eager, sdpa, flash_attention_2): the same attention, faster"),
         mca=NoEffect("Megatron-Core builds its own attention (transformer_impl): the same attention")),
    _row("cache_dir", both=NoEffect("where downloaded files are cached")),
    # -- data (one pipeline in roll/data serves both backends) -------------------------------------------
    _row("dataset formatting", both=Honoured(
        "tests/unit/test_data_pipeline.py::test_file_types_give_the_same_rows")),
    _row("eval_dataset max_samples val_size", both=Honoured(PIPELINE)),
    _row("dataset_dir", both=Honoured(
        "tests/unit/test_dataset_info.py::test_registered_names_load_with_their_columns_and_tags",
        "LLaMA-Factory's registry of dataset names (dataset_info.json)")),
    _row("template default_system", both=Honoured(
        "tests/unit/test_named_templates.py::test_each_name_lays_out_llamafactorys_text_and_labels",
        "the named templates are LLaMA-Factory's layouts; unset: the tokenizer's own chat template")),
    _row("tool_format", both=Honoured(
        "tests/unit/test_named_template_tools.py::test_tool_format_replaces_the_templates_own",
        "LLaMA-Factory's tool formats; unset: the template's own")),
    _row("enable_thinking preserve_thinking", both=Honoured(
        "tests/unit/test_named_templates.py::test_qwen3_thinking_is_trained_or_prompt")),
    _row("train_on_prompt", both=Honoured(
        "tests/unit/test_named_templates.py::test_train_on_prompt_and_mask_history")),
    _row("train_on_last_turn_only", both=Honoured(
        "tests/unit/test_data_templates.py::test_train_on_last_turn_only")),
    _row("cutoff_len", both=Honoured(
        "tests/unit/test_data_processors.py::test_sft_truncation_keeps_the_answer_and_the_assistant_header")),
    _row("packing", standard=Honoured(
        "tests/unit/test_standard_train.py::test_packed_rows_give_the_same_loss_as_padded_ones",
        "vision-language models: each packed sample its own M-RoPE positions (tests/unit/test_vl_data.py::"
        "test_the_standard_backend_trains_packed_vl_rows_as_the_unpacked_ones)"),
         mca=Honoured(
             "tests/distributed/test_mca_train.py::test_packed_equals_unpacked_on_the_same_samples",
             "vision-language models: tests/distributed/test_mca_qwen2_5_vl_dist.py::"
             "test_qwen2_5_vl_trains_through_the_mca_trainer_tp1_tp2_pp2_tower_trained_and_frozen, also with "
             "context_parallel_size > 1")),
    _row("packing_algorithm", both=Honoured(
        "tests/unit/test_data_packing.py::test_llamafactory_packing_gives_its_rows_in_its_order",
        "the shared pipeline packs (roll.data.packing), both backends train its rows; llamafactory: LLaMA-Factory "
        "0.9.5's greedy rows, in its order")),
    _row("shuffle", standard=Honoured("tests/unit/test_standard_train.py::test_trainer_consumes_the_shared_order"),
         mca=Honoured("tests/unit/test_sample_order.py::test_both_backends_draw_accelerates_batches_epoch_after_epoch")),
    _row("preprocessing_num_workers preprocessing_batch_size", both=Honoured(
        "tests/unit/test_data_packing.py::test_llamafactory_packing_gives_its_rows_in_its_order",
        "tokenization speed only, except where LLaMA-Factory's rows depend on its tokenization batches: "
        "stage pt's concatenation and packing_algorithm: llamafactory")),
    _row("overwrite_cache", both=NoEffect("re-tokenizes instead of reusing the cache: the same rows")),
    _row("streaming buffer_size mix_strategy interleave_probs", both=Honoured(
        "tests/distributed/test_streaming.py::test_streaming_same_losses_on_both_backends_and_across_a_resume",
        "the shared pipeline streams and mixes (roll.data.streaming, roll.data.mixing); both backends read its "
        "order; tests/unit/test_data_streaming.py checks the order itself")),
    _row("tokenized_path", both=Honoured(
        "tests/unit/test_data_prepared.py::test_tokenized_path_round_trip_and_refusals")),
    # -- finetuning ---------------------------------------------------------------------------------------
    _row("stage", both=Honoured(PARITY, "pt and sft; dpo: " + DPO + "; kto: " + KTO + "; rm: " + RM,
                                parity="rm_mid_run_eval")),
    _row("finetuning_type", standard=Honoured(
        "tests/unit/test_standard_train.py::test_freeze_trains_only_the_last_layers"),
         mca=Refused("finetuning_type: full or lora", "freeze", by="McaBackend.check_support")),
    _row("lora_rank lora_alpha lora_target lora_dropout", both=Honoured(LORA, parity="lora_qv_r4_alpha16")),
    _row("use_rslora", both=Honoured(
        "tests/unit/test_mca_lora_utils.py::test_lora_output_is_base_plus_alpha_over_rank_times_b_a",
        "the scaling round-trips through adapter_config.json", parity="lora_rslora_all_r16")),
    _row("freeze_trainable_layers", standard=Honoured(
        "tests/unit/test_standard_train.py::test_freeze_trains_only_the_last_layers"),
         mca=NoEffect("read with finetuning_type: freeze only, which the mca backend refuses")),
    _row("freeze_vision_tower freeze_multi_modal_projector freeze_language_model", standard=Honoured(
        "tests/unit/test_vl_standard.py::test_full_fine_tuning_trains_the_parts_not_frozen",
        "vision-language models (docs/vl.md); LoRA: tests/unit/test_vl_standard.py::"
        "test_lora_adapts_the_language_model_only_by_default_and_the_tower_when_unfrozen; no effect on a text model"),
         mca=Honoured("tests/distributed/test_mca_qwen2_5_vl_dist.py::"
                      "test_qwen2_5_vl_trains_through_the_mca_trainer_tp1_tp2_pp2_tower_trained_and_frozen",
                      "vision-language models (docs/vl.md; LoRA: the language model only, an unfrozen tower or "
                      "merger refused); no effect on a text model")),
    _row("export_merged", standard=Honoured(
        "tests/distributed/test_standard_deepspeed.py::test_lora_zero3_exports_adapter_and_merged_model"),
         mca=Honoured("tests/distributed/test_mca_lora.py::test_merged_export_equals_base_plus_adapter")),
    _row("pref_beta pref_loss pref_label_smoothing", both=Honoured(
        DPO, "stage dpo; orpo and simpo: " + PREF_LOSSES + "; their definitions: tests/unit/test_preference.py; "
        "pref_beta is kto's beta too: " + KTO + "; stage rm's loss has no beta: it warns once and ignores them",
        parity="dpo_ipo")),
    _row("simpo_gamma", both=Honoured(
        "tests/unit/test_preference.py::test_simpo_is_trls_cpo_simpo_without_its_nll_term",
        "backend parity: " + PREF_LOSSES + "; stage rm warns once and ignores it", parity="dpo_simpo_ftx")),
    _row("kto_desirable_weight kto_undesirable_weight kto_chosen_weight kto_rejected_weight", both=Honoured(
        "tests/unit/test_kto.py::test_standard_kto_equals_trls_own_kto_loss_on_one_batch",
        "stage kto; kto_chosen/rejected_weight: LLaMA-Factory's spelling of the same keys",
        parity="kto_weights_lora_eval")),
    _row("pref_ftx", both=Honoured(
        "tests/unit/test_loss.py::test_pref_ftx_adds_each_chosen_responses_mean_token_nll",
        "orpo and simpo: tests/unit/test_preference.py::test_pref_ftx_adds_each_chosen_responses_mean_nll",
        parity="cp2_dpo_sigmoid_ftx")),
    _row("ref_model", standard=Honoured(
        "tests/unit/test_standard_train.py::test_dpo_with_a_separate_reference_model", REF_FREE_LOSSES),
         mca=Honoured(DPO, REF_FREE_LOSSES)),
    _row("ref_free", standard=Honoured(
        "tests/unit/test_standard_train.py::test_dpo_reference_free"), mca=Honoured(DPO)),
    # -- megatron (read by the mca backend only) -----------------------------------------------------------
    _row("tensor_model_parallel_size pipeline_model_parallel_size virtual_pipeline_model_parallel_size "
         "sequence_parallel", standard=MEGATRON_ONLY, mca=Honoured(LAYOUTS)),
    _row("context_parallel_size", standard=MEGATRON_ONLY, mca=Honoured(
        "tests/distributed/test_mca_platform_dist.py::test_local_attention_packed_and_context_parallel",
        "vision-language models too (tests/distributed/test_mca_qwen2_5_vl_dist.py::"
        "test_qwen2_5_vl_trains_through_the_mca_trainer_tp1_tp2_pp2_tower_trained_and_frozen), packed too")),
    _row("moe_aux_loss_coeff moe_aux_loss_coef", standard=Honoured(
        MOE_AUX, "pt and sft; stages dpo and kto train without it, with one warning (docs/mca-training.md)",
        parity="moe_default_aux_loss"), mca=Honoured(MOE_AUX, parity="moe_default_aux_loss")),
    _row("moe_z_loss_coeff", both=Honoured(MOE_Z, parity="mixtral_moe_losses")),
    _row("moe_expert_capacity_factor", both=Refused(
        "both backends route every token to its top-k experts (drop-less: Hugging Face's MoE models have no "
        "capacity factor, so a dropping run could not match the standard backend); drop the key", 1.25)),
    _row("expert_model_parallel_size moe_token_dispatcher_type", standard=MEGATRON_ONLY,
         mca=Honoured("tests/distributed/test_mca_conversion.py::test_moe_logits_parity_ep2_tp2_and_export")),
    _row("expert_tensor_parallel_size", standard=MEGATRON_ONLY, mca=Honoured(
        "tests/distributed/test_mca_platform_dist.py::test_moe_expert_tensor_parallel_on_gloo")),
    _row("moe_grouped_gemm", standard=MEGATRON_ONLY, mca=Honoured(
        "tests/unit/test_mca_platform.py::test_local_spec_rejects_grouped_gemm_without_a_kernel",
        "the grouped-GEMM kernel needs a GPU; CPU runs refuse it")),
    _row("use_distributed_optimizer overlap_grad_reduce overlap_param_gather", standard=MEGATRON_ONLY,
         mca=Honoured("tests/distributed/test_mca_export.py::test_the_export_equals_the_trained_model_at_tp2_pp2_dp2")),
    _row("grad_reduce_in_fp32", standard=Refused(
        "the standard backend reduces gradients in the dtype they are computed in (torch DDP; DeepSpeed: its "
        "JSON's communication_data_type); drop the key, or use_mca: true", False),
         mca=Honoured("tests/distributed/test_mca_train.py::test_layouts_give_the_same_losses",
                      "bf16 DP2 reduced in bf16 vs fp32; no effect in fp32 training")),
    _row("optimizer_cpu_offload", standard=MEGATRON_ONLY, mca=Honoured(
        None, gap="Megatron's hybrid CPU optimizer needs a GPU; no CPU test")),
    _row("recompute_*", standard=MEGATRON_ONLY, mca=Honoured(
        "tests/unit/test_mca_models.py", "recompute changes memory, not the result")),
    _row("bias_activation_fusion apply_rope_fusion", standard=MEGATRON_ONLY, mca=Honoured(
        "tests/unit/test_llamafactory.py::test_fusion_flags_reach_megatron_only_with_transformer_engine",
        "Transformer Engine's fused kernels; on Megatron-Core's local layers (CPU) no effect, said once")),
    _row("make_vocab_size_divisible_by", standard=MEGATRON_ONLY, mca=Honoured(
        "tests/distributed/test_parity_tool.py::"
        "test_tp2_with_a_padded_vocabulary_matches_the_standard_backend")),
    _row("calculate_per_token_loss", standard=Refused(
        "the standard backend always uses the per-token mean over the global batch; use_mca: true for "
        "calculate_per_token_loss: false", False, by="RunConfig._validate_standard"),
         mca=Honoured("tests/unit/test_mca_models.py")),
    _row("transformer_impl", standard=MEGATRON_ONLY, mca=Honoured(
        "tests/unit/test_mca_platform.py::test_auto_and_local_resolve_to_local_without_a_gpu")),
)

# -- training: Hugging Face TrainingArguments and roll's own keys ------------------------------------------
MCA_OPTIMIZER = ("adamw_torch", "adamw_torch_fused")
"""``optim`` values the mca backend runs: Megatron's Adam with decoupled weight decay is torch's AdamW."""


def _mca_refuses(keys: str, use: str, example: object, **kwargs) -> Row:
    """Keys HF Trainer applies and the mca backend does not: refused there."""
    return _row(keys, standard=HF, mca=Refused(use, example, **kwargs))


TRAINING_ROWS: tuple[Row, ...] = (
    _row("per_device_train_batch_size gradient_accumulation_steps", both=Honoured(PARITY)),
    _row("num_train_epochs max_steps", both=Honoured(
        "tests/unit/test_mca_trainer.py::test_batch_plan_covers_every_sample_once_per_epoch",
        "both backends take HF's step count (the mca batch plan is checked against it)")),
    _row("learning_rate lr_scheduler_kwargs warmup_steps weight_decay",
         both=Honoured(SCHEDULE, parity="weight_decay")),
    _row("lr_scheduler_type", standard=Honoured(SCHEDULE), mca=Refused(
        "a step-based schedule (linear, cosine, cosine_with_min_lr, ...)", "reduce_lr_on_plateau",
        by="backends/mca/trainer/optim.py check_schedule_name")),
    _row("warmup_ratio", both=Honoured(
        "tests/unit/test_mca_trainer.py::test_warmup_ratio_is_warmup_steps_below_one", parity="lr_cosine_warmup")),
    _row("adam_beta1 adam_beta2 adam_epsilon", both=Honoured(None, parity="adam_hyperparameters")),
    _row("max_grad_norm", both=Honoured(None, parity="grad_clipping")),
    _row("bf16", both=Honoured(None, parity="bf16")),
    _row("fp16", standard=HF, mca=Honoured(None, gap="fp16 needs a GPU (loss scaling); no CPU parity case")),
    _row("optim", standard=HF, mca=Refused(
        f"the mca backend runs Megatron's AdamW: set optim to one of {', '.join(MCA_OPTIMIZER)}",
        "adafactor", allowed=MCA_OPTIMIZER)),
    _mca_refuses("optim_args optim_target_modules", "the mca backend takes its optimizer settings from "
                 "learning_rate, weight_decay, adam_beta1/2, adam_epsilon and max_grad_norm only: drop it",
                 "betas=(0.9,0.95)"),
    _row("average_tokens_across_devices", both=Refused(
        "roll's loss is always the per-token mean over the global batch, which needs every rank's token "
        "count: drop the key", False)),
    _mca_refuses("label_smoothing_factor", "the mca backend trains the plain token cross-entropy: drop it",
                 0.1),
    _mca_refuses("bf16_full_eval fp16_full_eval", "the mca backend evaluates in the training precision "
                 "(bf16 / fp16): drop it", True),
    _mca_refuses("tf32", "the mca backend leaves PyTorch's TF32 setting alone: drop it (or set "
                 "NVIDIA_TF32_OVERRIDE)", True),
    _row("gradient_checkpointing", standard=HF, mca=Refused(
        f"the mca backend recomputes activations with Megatron's settings: use {RECOMPUTE}", True)),
    _mca_refuses("activation_checkpointing activation_checkpointing_kwargs gradient_checkpointing_kwargs",
                 f"the mca backend recomputes activations with Megatron's settings: use {RECOMPUTE}", True,
                 examples={"activation_checkpointing_kwargs": {"use_reentrant": False},
                           "gradient_checkpointing_kwargs": {"use_reentrant": False}}),
    _mca_refuses("torch_compile torch_compile_backend torch_compile_mode", "the mca backend does not "
                 "torch.compile its model: drop it", True,
                 examples={"torch_compile_backend": "inductor", "torch_compile_mode": "max-autotune"}),
    _mca_refuses("use_liger_kernel liger_kernel_config", "Liger kernels patch HF models; the mca backend "
                 "runs "
                 "Megatron-Core's (transformer_impl): drop it", True,
                 examples={"liger_kernel_config": {"rope": True}}),
    _mca_refuses("neftune_noise_alpha", "the mca backend adds no embedding noise: drop it", 5.0),
    _mca_refuses("torch_empty_cache_steps", "the mca backend does not empty the CUDA cache on a schedule: "
                 "drop it", 10),
    _mca_refuses("auto_find_batch_size", "set per_device_train_batch_size (roll-train RECIPE --plan "
                 "estimates what fits)", True),
    _mca_refuses("logging_strategy", "the mca backend logs every logging_steps steps: use "
                 "logging_strategy: steps", "epoch"),
    _mca_refuses("save_only_model", "mca checkpoints always hold the optimizer state (resume needs it): "
                 "drop it; the final HF model holds the weights only", True),
    _mca_refuses("save_on_each_node", "the mca backend writes one checkpoint on a filesystem every node "
                 "shares: drop it", True),
    _mca_refuses("enable_jit_checkpoint", "use save_on_preemption (on by default): SIGTERM saves a "
                 "checkpoint on both backends", True),
    _mca_refuses("push_to_hub", "the mca backend does not upload: drop it and upload output_dir's HF "
                 "model (huggingface-cli upload)", True),
    _row("hub_*", standard=HF, mca=NoEffect("read with push_to_hub only, which the mca backend refuses")),
    _mca_refuses("load_best_model_at_end metric_for_best_model", "the mca backend keeps the last model: "
                 "pick a checkpoint-N from train_log.jsonl's eval_loss instead", True,
                 examples={"metric_for_best_model": "eval_loss"}),
    _row("greater_is_better", standard=HF, mca=NoEffect(
        "read with metric_for_best_model only, which the mca backend refuses")),
    _mca_refuses("ignore_data_skip", "a resumed mca run always continues at the next unseen sample: drop "
                 "it", True),
    _mca_refuses("full_determinism", "the mca backend seeds with seed; deterministic kernels are not "
                 "switched on: drop it", True),
    _row("data_seed", standard=Honoured("tests/unit/test_standard_train.py::test_trainer_consumes_the_shared_order"),
         mca=Honoured("tests/unit/test_sample_order.py::test_shuffle_false_and_data_seed")),
    _row("train_sampling_strategy", both=Refused(
        "the sample order is the data pipeline's: shuffle: true (random) or shuffle: false (sequential)",
        "group_by_length")),
    _row("length_column_name", both=NoEffect("read with train_sampling_strategy: group_by_length only, "
                                             "which is refused")),
    _mca_refuses("use_cpu", "the mca backend picks the device itself (CUDA, else CPU with gloo): drop it",
                 True),
    _mca_refuses("accelerator_config parallelism_config fsdp fsdp_config", "the mca backend shards with "
                 "Megatron-Core: use tensor/pipeline/context/expert_model_parallel_size and "
                 "use_distributed_optimizer", "full_shard"),
    _mca_refuses("dataloader_drop_last", "the mca backend trains the epoch's last, shorter batch as HF "
                 "Trainer does by default: drop it", True),
    _mca_refuses("label_names", "the shared collator names the labels (labels): drop it", ["target"]),
    _mca_refuses("ddp_find_unused_parameters ddp_bucket_cap_mb ddp_broadcast_buffers ddp_static_graph "
                 "ddp_backend", "the mca backend reduces gradients with Megatron's DDP "
                 "(overlap_grad_reduce, use_distributed_optimizer): drop it", True,
                 examples={"ddp_bucket_cap_mb": 25, "ddp_backend": "gloo"}),
    _mca_refuses("debug", "HF's debug options hook HF modules: drop it", "underflow_overflow"),
    _row("ddp_timeout", both=Honoured(
        "tests/distributed/test_reliability.py::test_a_hung_rank_times_out_after_ddp_timeout")),
    _row("deepspeed", standard=Honoured(
        "tests/distributed/test_standard_deepspeed.py::test_sft_zero_two_processes_matches_one"),
         mca=NoEffect("the mca backend shards with Megatron-Core (warned once), so one recipe runs on both")),
    _row("eval_strategy eval_steps eval_delay eval_on_start per_device_eval_batch_size",
         both=Honoured(MID_EVAL, parity="mid_run_eval")),
    _row("save_strategy", standard=Honoured(RESUME_STD), mca=Refused(
        "save_strategy: steps, epoch or no", "best", by="McaBackend.check_config")),
    _row("save_steps save_total_limit resume_from_checkpoint", standard=Honoured(RESUME_STD),
         mca=Honoured(RESUME_MCA)),
    _row("seed", standard=Honoured("tests/unit/test_standard_train.py::test_trainer_consumes_the_shared_order",
                                   "the sample order, and the model's initial LoRA weights"),
         mca=Honoured("tests/unit/test_sample_order.py::test_both_backends_draw_accelerates_batches_epoch_after_epoch",
                      "the sample order, and the model's initial LoRA weights")),
    _row("output_dir overwrite_output_dir save_hf_model", both=NoEffect(
        "where and whether the outputs are written (tests/reliability/test_outputs.py)")),
    _row("logging_steps logging_first_step log_on_each_node logging_nan_inf_filter "
         "include_num_input_tokens_seen "
         "log_level log_level_replica disable_tqdm run_name project trackio_* report_to skip_memory_metrics",
         both=LOGGING),
    _row("prediction_loss_only eval_do_concat_batches eval_use_gather_object eval_accumulation_steps "
         "include_for_metrics batch_eval_metrics", both=METRICS),
    _row("dataloader_num_workers dataloader_pin_memory dataloader_persistent_workers "
         "dataloader_prefetch_factor "
         "dataloader_multiprocessing_context dataloader_in_order", both=SPEED),
    _row("restore_callback_states_from_checkpoint", both=NoEffect("roll runs no user callbacks")),
    _row("remove_unused_columns", both=NoEffect("the shared collator decides what a batch holds (roll passes "
                                                "false to HF)")),
    _row("use_cache", both=NoEffect("the KV cache is for generation; training forwards do not use it")),
    _row("do_train do_eval do_predict", both=NoEffect(
        "HF's flags for scripts: roll-train always trains, and evaluates when there is an eval set")),
    _row("local_rank", both=NoEffect("set by the launcher (torchrun / deepspeed)")),
    _row("use_mca", both=Honoured(PARITY, "the backend switch")),
    _row("nproc_per_node nnodes node_rank master_addr master_port", both=Honoured(LAUNCH)),
    _row("gpu_memory_gb", both=NoEffect("read by the planner (--plan) only")),
    _row("save_on_preemption", both=Honoured(
        "tests/distributed/test_reliability.py::test_sigterm_saves_a_checkpoint_exits_75_and_resumes")),
    _row("slurm_signal slurm_requeue", both=Honoured(SLURM_SIGNALS)),
    _row("save_async", standard=Honoured(SAVE_ASYNC, "synchronous under DeepSpeed / FSDP, which write their "
                                                     "own files (warned once)"), mca=Honoured(SAVE_ASYNC)),
    _row("max_consecutive_skipped_steps", both=Honoured(
        "tests/distributed/test_reliability.py::test_nan_steps_are_skipped_counted_then_stop_the_run")),
)
ALL_ROWS = ROWS + TRAINING_ROWS

