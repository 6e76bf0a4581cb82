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

The table in two modules: here the model, data, finetuning and Megatron keys; roll.config.coverage_training
the training keys (Hugging Face's TrainingArguments and roll's own); the statuses are roll.config.key_status's.
"""

from __future__ import annotations

from roll.config.coverage_training import TRAINING_ROWS
from roll.config.key_status import BACKENDS, PARITY, Honoured, NoEffect, Refused, Row
from roll.config.key_status import row as _row

__all__ = ["ALL_ROWS", "BACKENDS", "Honoured", "NoEffect", "Refused", "ROWS", "Row", "TRAINING_ROWS"]
"""What other modules import from here (the statuses are roll.config.key_status's)."""

# Tests that many rows name.
LAYOUTS = "tests/distributed/test_mca_train.py::test_layouts_give_the_same_losses"
LORA = "tests/distributed/test_mca_train.py::test_lora_trajectories_across_layouts_and_backends"
DPO = "tests/distributed/test_mca_dpo.py::test_dpo_layouts_and_backend_parity"
REF_FREE_LOSSES = ("refused with pref_loss orpo and simpo, which read no reference: "
                   "tests/unit/test_preference.py::test_the_keys_of_the_reference_free_losses")
PREF_LOSSES = "tests/distributed/test_mca_pref_losses_dist.py::test_orpo_and_simpo_match_across_backends_and_layouts"
KTO = "tests/parity/test_sweep.py::test_kto_metrics_on_both_backends_and_every_layout"
RM = "tests/distributed/test_mca_rm.py::test_rm_layouts_backend_parity_and_export"
PIPELINE = "tests/unit/test_data_pipeline.py::test_max_samples_val_size_and_eval_dataset"
MOE_AUX = "tests/unit/test_loss.py::test_load_balancing_loss_is_megatrons_summed_over_layers_without_padding"
MOE_Z = "tests/unit/test_loss.py::test_router_z_loss_is_megatrons_summed_over_layers_without_padding"

MEGATRON_ONLY = NoEffect("a Megatron-Core setting: the standard backend warns once and ignores it, so one "
                         "recipe runs on both backends")

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
    _row("image_max_pixels image_min_pixels", both=Honoured(
        "tests/unit/test_vl_image_pixels.py::test_images_are_resized_first_as_llamafactory_does",
        "vision-language models: each image resized first as LLaMA-Factory 0.9.5 does, in the shared data pipeline; "
        "unset: LLaMA-Factory's 768*768 / 32*32 with template qwen2_vl (or the other key set), else no resize "
        "first (docs/vl.md)")),
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
    _row("kto_mismatched_rows", both=Honoured(
        "tests/unit/test_named_templates.py::test_kto_rows_paired_in_the_tokenization_batch_as_llamafactory",
        "stage kto; the shared pipeline pairs the rows (llamafactory) or the shared collator (micro_batch), both "
        "backends train them; LLaMA-Factory's kto example (1 row a micro-batch) on both: docs/llamafactory-parity.md",
        parity="kto_tokenization_pairs")),
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

ALL_ROWS = ROWS + TRAINING_ROWS
