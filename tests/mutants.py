"""Realistic bugs (mutants) and the tests that must catch each: the proof that those tests are sharp.

Each mutant replaces one exact ``anchor`` (it must occur exactly once in ``file``) with ``replacement`` in a
copy of the tree; ``tests`` (pytest node ids, cheapest first) must then fail. ``fast`` mutants also run
inside ``make test`` (``tests/unit/test_mutation_gate.py``); all of them run with ``make mutation``
(``scripts/mutation.py``). The list is ordered cheapest first.

Keep anchors short (a line or two) so that unrelated edits around them do not make them stale; when one is
stale the gate says which, and the fix is to re-anchor the same bug in the changed code. A new bug class
found in the wild belongs here, with the test that now catches it.
"""

from __future__ import annotations

from dataclasses import dataclass

LOOP = "backends/mca/trainer/loop.py"
LOSS = "backends/mca/trainer/loss.py"
ROLL_LOSS = "roll/loss.py"
HF_ARGS = "backends/standard/hf_args.py"
TRAINERS = "backends/standard/trainers.py"
PREFERENCE = "roll/preference.py"

MCA_UNIT = "tests/unit/test_mca_trainer.py"
KTO_UNIT = "tests/unit/test_kto.py"
GLM_UNIT = "tests/unit/test_mca_glm4_moe.py"
LOSS_UNIT = "tests/unit/test_loss.py"
MCA_MODELS = "tests/unit/test_mca_models.py"
STD_UNIT = "tests/unit/test_standard_train.py"
PREF_UNIT = "tests/unit/test_preference.py"
PREF_DIST = "tests/distributed/test_mca_pref_losses_dist.py"
PARITY_TP1 = "tests/distributed/test_parity_tool.py::test_tp1_on_one_process_matches_the_standard_backend"
DECAY_PARITY = ("tests/distributed/test_mca_param_groups.py::"
                "test_weight_decay_and_an_hf_schedule_match_the_standard_backend")
MCA_TRAIN = "tests/distributed/test_mca_train.py"
MCA_DPO = "tests/distributed/test_mca_dpo.py"
ONE_PROCESS = f"{MCA_TRAIN}::test_export_accumulation_and_resume_on_one_process"
SWEEP = "tests/parity/test_sweep.py"
BACKGROUND = "tests/unit/test_background_save.py"
DIRECT_WRITE_UNIT = "tests/unit/test_direct_write.py"
ASYNC_KILL = ("tests/distributed/test_reliability.py::"
              "test_sigkill_inside_an_async_save_resumes_as_a_sync_save_does")
ASYNC_KILL_MCA = f"{ASYNC_KILL}[mca]"
STD_FILES = ("tests/unit/test_standard_checkpoint_files.py::"
             "test_optimizer_file_loads_as_torch_saves_and_its_large_tensors_are_written_in_place")


@dataclass(frozen=True)
class Mutant:
    name: str
    bug: str
    """What the bug does, in a user's words."""
    file: str
    anchor: str
    replacement: str
    tests: tuple[str, ...]
    fast: bool = False
    """Cheap enough (unit tests only, seconds) to run inside ``make test``."""


BURST = 'return "SLURM_JOB_ID" in os.environ and time.monotonic() - self._first_at < BURST_S'
"""roll.reliability.StopSignal._in_burst's test."""
STREAM_UNIT = "tests/unit/test_data_streaming.py"
STREAM_ORDER = f"{STREAM_UNIT}::test_stream_order_is_seeded_and_a_resumed_reader_gets_the_same_rows"

NAMED = "roll/data/named_templates.py"
NAMED_UNIT = "tests/unit/test_named_templates.py"
TOOLS_UNIT = "tests/unit/test_named_template_tools.py"
RM_UNIT = "tests/unit/test_reward.py"
MCA_RM = "tests/distributed/test_mca_rm.py::test_rm_layouts_backend_parity_and_export"
RM_ZERO3 = "tests/distributed/test_standard_deepspeed.py::test_rm_zero3_two_processes_matches_one"

VL_DATA = "tests/unit/test_vl_data.py"
VL_PIXELS = "tests/unit/test_vl_image_pixels.py"
VL_STD = "tests/unit/test_vl_standard.py"

ELASTIC = "backends/standard/elastic.py"
ELASTIC_UNIT = "tests/unit/test_elastic_resume.py::test_converts_only_when_the_data_parallel_size_changed"
ELASTIC_RUN = ("tests/distributed/test_elastic_resume_dist.py::"
               "test_zero_checkpoint_resumes_on_another_number_of_processes[ds_z2.json]")

MUTANTS: list[Mutant] = [
    # ---- cheap: unit tests only ------------------------------------------------------------------------
    Mutant("preflight_imports_transformers_first", "roll-train imports transformers and torch (seconds) before it "
           "checks the data files and the checkpoint named, so a typo there waits for the training stack",
           "roll/preflight.py", "use_mca=training.use_mca, key=key)\n    check_reference_vocab(config)",
           "use_mca=training.use_mca, key=key)\n        check_model_dir_type(path, trust_remote_code=model."
           "trust_remote_code, use_mca=training.use_mca)\n    check_reference_vocab(config)",
           ("tests/unit/test_startup.py::test_mistakes_preflight_finds_in_a_complete_model_dir_import_no_training_stack",)),
    Mutant("vl_lora_adapter_text_names_mca", "mca: a VL model's LoRA adapter saved under a text model's keys "
           "(model.layers.*), which PEFT does not find in transformers' VL model", "backends/mca/lora/export.py",
           'return VL_LAYERS if hf_config and "vision_config" in hf_config else TEXT_LAYERS', "return TEXT_LAYERS",
           ("tests/unit/test_mca_qwen2_5_vl.py::test_a_vl_lora_adapter_is_named_as_peft_names_it_on_transformers_vl_model",),
           fast=True),
    Mutant("plan_vision_tower_never_trained", "--plan: an unfrozen vision tower counted as frozen (no gradients "
           "or optimizer states for its 0.6B parameters)", "roll/plan/planner.py",
           "(0 if finetuning.freeze_vision_tower else vision.tower_params())", "0",
           ("tests/unit/test_plan.py::test_plan_counts_the_vision_tower_of_the_vl_recipe",), fast=True),
    Mutant("llamafactory_log_wrong_step_key", "scripts/llamafactory_parity.py files every LLaMA-Factory loss "
           "under the run's last step (total_steps read for current_steps)", "roll/parity/llamafactory.py",
           'losses[int(record["current_steps"])]', 'losses[int(record["total_steps"])]',
           ("tests/unit/test_llamafactory_parity.py::test_parse_llamafactory_log_keeps_the_losses_by_step",),
           fast=True),
    Mutant("jit_fuser_runs_eager", "megatron's fused kernels (jit_fuser) run uncompiled: other numerics and "
           "speed on a GPU", "backends/mca/lazy_jit.py", "compiled = torch.compile(fn, **options)",
           "compiled = fn",
           ("tests/unit/test_lazy_jit.py::test_compiles_once_on_the_first_call_with_the_options_and_binds_as_a_method",),
           fast=True),
    Mutant("slurm_tasks_not_mapped", "srun -n 2 roll-train: each task trains alone (SLURM's variables "
           "ignored)",
           "roll/cli.py", "        _adopt_slurm(argv)\n", "",
           ("tests/unit/test_slurm.py::test_roll_train_under_srun_resolves_the_whole_step",), fast=True),
    Mutant("slurm_signal_burst_stops_at_once", "under SLURM, the SIGTERM that srun or the launcher forwards "
           "after SLURM's own stops the rank at once, mid-save", "roll/reliability.py",
           BURST, "return False",
           ("tests/unit/test_reliability_units.py::test_under_slurm_a_burst_of_signals_is_one_stop",),
           fast=True),
    Mutant("slurm_early_warning_ignored", "slurm_signal: the early warning saves no checkpoint",
           "roll/reliability.py", "Action.SAVE if self.warned else", "Action.CONTINUE if self.warned else",
           ("tests/unit/test_reliability_units.py::test_the_early_warning_saves_and_trains_on_or_stops_for_a_requeue",),
           fast=True),
    Mutant("slurm_requeue_trains_from_scratch", "a requeued SLURM job does not resume by itself",
           "roll/config/parser.py", "    if restarts and \"resume_from_checkpoint\" not in recipe",
           "    if False and \"resume_from_checkpoint\" not in recipe",
           ("tests/unit/test_slurm.py::test_a_requeued_job_resumes_by_default",), fast=True),
    Mutant("padded_vocab_unmasked", "padded-vocab columns (TP1 or the last TP rank) enter the softmax",
           ROLL_LOSS, "width = max(0, min(flat.shape[1], vocab - first))", "width = flat.shape[1]",
           (f"{LOSS_UNIT}::test_kernel_gradcheck_in_float64_ignored_labels_padded_vocab",),
           fast=True),
    Mutant("elastic_converts_at_the_same_size_standard", "standard: every ZeRO resume pays the universal "
           "conversion, at the size the checkpoint was saved at too", ELASTIC,
           'saved.zero_family == "0" or saved.dp_size == world_size:', 'saved.zero_family == "0":',
           (ELASTIC_UNIT,), fast=True),
    Mutant("elastic_universal_not_loaded_standard", "standard: a ZeRO checkpoint resumed on another number of "
           "processes is converted but loaded DeepSpeed's own way (it refuses: traceback)", ELASTIC,
           'config["checkpoint"] = {**(config.get("checkpoint") or {}), "load_universal": True}',
           'config["checkpoint"] = config.get("checkpoint") or {}', (ELASTIC_UNIT,), fast=True),
    Mutant("rm_scores_the_last_token", "rm: each side scored at its last token even when that is the pad id "
           "(pad == eos), where transformers' exported model reads the token before it", "roll/data/reward.py",
           "        if input_ids[index] != pad_token_id:", "        if True:",
           (f"{RM_UNIT}::test_the_scored_token_is_the_one_transformers_pools",), fast=True),
    Mutant("rm_margin_reversed_mca", "mca rm: the loss rewards the rejected answer (margin r_rejected - r_chosen)",
           "backends/mca/trainer/reward.py", "    margin = chosen - rejected", "    margin = rejected - chosen",
           (f"{RM_UNIT}::test_filler_pairs_count_for_nothing",), fast=True),
    Mutant("data_order_swap_mca", "mca: samples B-1 and B of the shared order swapped (crosses steps 1 and 2)",
           "backends/mca/trainer/data.py", "for i in range(first, first + self.micro_batch_size)])",
           "for i in ({self.global_batch_size - 1: self.global_batch_size, self.global_batch_size: "
           "self.global_batch_size - 1}.get(j, j) for j in range(first, first + self.micro_batch_size))])",
           (f"{MCA_UNIT}::test_batch_plan_docstring_example",), fast=True),
    Mutant("nonfinite_step_applied_mca", "mca: a step with a NaN gradient or loss updates the weights (the skip "
           "flag computed on the device but not handed to the fused Adam)", "backends/mca/trainer/update.py",
           "        inner.optimizer.found_inf = found_inf\n", "        inner.optimizer.found_inf = None\n",
           (f"{MCA_UNIT}::test_a_step_clips_and_skips_on_the_device_as_megatron_does_on_the_host",), fast=True),
    Mutant("reply_separator_untrained", "template: qwen trains the reply and <|im_end|> but not the newline after "
           "it (LLaMA-Factory trains the whole reply slot; issue 30's last 2.3e-5)", NAMED,
           "if last_turn_only and k != 0 else list(reply)",
           "if last_turn_only and k != 0 else list(reply[:-1]) + [IGNORE_INDEX] * bool(reply)",
           (f"{NAMED_UNIT}::test_qwen_ids_written_out",), fast=True),
    Mutant("qwen_default_system_not_llamafactorys", "template: qwen's default system prompt is not LLaMA-Factory's "
           "(\"You are Qwen, created by Alibaba Cloud...\": issue 30's first cause)", NAMED,
           'default_system="You are Qwen, created by Alibaba Cloud. You are a helpful "',
           'default_system="You are a helpful "',
           (f"{NAMED_UNIT}::test_each_name_lays_out_llamafactorys_text_and_labels[qwen]",), fast=True),
    Mutant("named_truncation_keeps_the_prompt_end", "a named template truncates the prompt from the left (roll's "
           "rule for the tokenizer's template), not from the right as LLaMA-Factory does", NAMED,
           "prompt, reply = prompt[:p_keep], reply[:r_keep]",
           "prompt, reply = prompt[len(prompt) - p_keep:], reply[:r_keep]",
           (f"{NAMED_UNIT}::test_truncation_keeps_the_start_of_prompt_and_reply_and_mask_history_keeps_the_last_turn",)),
    Mutant("system_laid_out_as_a_user_turn", "a named template without a system slot (deepseek3) lays the system "
           "prompt out in its user slot (LLaMA-Factory: the text alone)", NAMED,
           'object.__setattr__(self, "system", self.system or (CONTENT,))',
           'object.__setattr__(self, "system", self.system or self.user)',
           (f"{NAMED_UNIT}::test_default_system_replaces_the_templates_and_the_rows_own_wins",)),
    Mutant("kto_named_rows_keep_the_prompt_end", "stage kto with template: cuts a row's prompt from the left "
           "(the tokenizer template's rule), not keeping its start as LLaMA-Factory's kto rows do",
           "roll/data/feedback.py", "ids, labels = _join(prompt, answer, p_keep, a_keep, keep_prompt_start=named)",
           "ids, labels = _join(prompt, answer, p_keep, a_keep)",
           (f"{NAMED_UNIT}::test_kto_named_template_truncation_is_llamafactorys_for_rows_and_kl_rows",), fast=True),
    Mutant("tools_replace_the_system_prompt", "a row's tool list replaces the system prompt (LLaMA-Factory appends "
           "it to the system prompt, the template's default one included)", NAMED,
           'system = system + (tools_text(t.tool_format, tools) if tools else "")',
           'system = tools_text(t.tool_format, tools) if tools else system',
           (f"{TOOLS_UNIT}::test_tools_calls_and_observations_in_each_templates_layout[qwen]",)),
    Mutant("glm4_call_in_the_reply_slot", "template glm4 lays a function call out in its reply slot (with the "
           "newline before it); LLaMA-Factory's glm4 has a function slot of its own", NAMED,
           'function=("{{content}}",), tool_format="glm4"', 'tool_format="glm4"',
           (f"{TOOLS_UNIT}::test_glm4_calls_in_their_own_slot_and_efficient_eos",)),
    Mutant("registry_prompt_and_query_joined_by_a_space", "a registered alpaca row's prompt and query are joined by "
           "a space (LLaMA-Factory: a newline)", "roll/data/dataset_info.py", '{"instruction": "\\n".join(parts)',
           '{"instruction": " ".join(parts)',
           ("tests/unit/test_dataset_info.py::test_registered_names_load_with_their_columns_and_tags",)),
    Mutant("moe_aux_coeff_times_tp", "MoE aux-loss coefficient multiplied by the TP size",
           "backends/mca/models/config.py",
           "        kwargs.update(overrides)\n        return _CONFIG_CLASSES[template.config_class](**kwargs)",
           "        kwargs.update(overrides)\n        if kwargs.get('moe_aux_loss_coeff'):\n"
           "            kwargs['moe_aux_loss_coeff'] *= kwargs.get('tensor_model_parallel_size', 1)\n"
           "        return _CONFIG_CLASSES[template.config_class](**kwargs)",
           ("tests/unit/test_mca_models.py::test_moe_aux_loss_coefficient_is_hf_router_aux_loss_coef_at_any_tp",),
           fast=True),
    Mutant("dense_stage_refuses_moe_weights", "mca: a pipeline stage of dense first layers only (GLM-4.5, DeepSeek-V3 "
           "at PP > 1) calls the MoE layers' checkpoint tensors unused and refuses to load",
           "backends/mca/models/loader.py",
           "return kind == moe if kind is not None else pattern in layer_patterns[not moe]", "return False",
           (f"{GLM_UNIT}::test_a_stage_of_dense_layers_only_loads_and_mtp_layers_are_left_out_saying_so",), fast=True),
    Mutant("partial_rotary_from_rope_parameters_ignored", "glm4_moe: a transformers-5 config's partial_rotary_factor "
           "(inside rope_parameters) ignored, the default 0.5 rotated instead",
           "backends/mca/models/templates/_common.py",
           'value = rope.get("partial_rotary_factor", hf.get("partial_rotary_factor"))',
           'value = hf.get("partial_rotary_factor")',
           (f"{GLM_UNIT}::test_config_maps_partial_rotary_dense_first_layers_and_sigmoid_routing",), fast=True),
    Mutant("yarn_mscale_all_dim_dropped", "deepseek_v3: YaRN's mscale_all_dim not passed to Megatron (its softmax "
           "scale and RoPE magnitude then differ from HF's)", "backends/mca/models/templates/deepseek_v3.py",
           "out.update(mscale=float(mscale), mscale_all_dim=float(all_dim))",
           "out.update(mscale=float(mscale), mscale_all_dim=0.0)",
           ("tests/unit/test_mca_deepseek_v3.py::test_config_maps_latent_attention_yarn_groups_and_dense_first_layers",),
           fast=True),
    Mutant("vl_positions_one_dimensional", "qwen2_5_vl: the Megatron model rotates with 1-D positions (text "
           "order) instead of HF's image-grid M-RoPE positions", "roll/mrope.py",
           "if image_grid_thw is None or len(image_grid_thw) == 0:", "if True:",
           ("tests/unit/test_mca_qwen2_5_vl.py::test_mrope_positions_are_the_image_grid_offset_by_the_text_before_it",),
           fast=True),
    Mutant("vl_packed_positions_not_restarted", "VL packing: a packed row's M-RoPE positions run on over its "
           "samples (one get_rope_index over the whole row) instead of restarting per sample as for the sample "
           "alone", "roll/mrope.py", "starts = (position_ids == 0).clone()",
           "starts = torch.zeros_like(position_ids, dtype=torch.bool)",
           (f"{VL_DATA}::test_packed_rows_keep_their_images_each_samples_positions_and_the_per_token_loss",),
           fast=True),
    Mutant("vl_packed_batch_not_converted", "standard backend, VL packing: the packed batch goes to HF as the text "
           "collator leaves it (2-D position_ids, cu_seqlens kept: the vision tower takes it for its own)",
           "backends/standard/backend.py",
           "if self.config.data.packing and is_vl_model(self.config.model.model_name_or_path):", "if False:",
           (f"{VL_DATA}::test_the_standard_backend_trains_packed_vl_rows_as_the_unpacked_ones",)),
    Mutant("vl_language_model_kv_cache_on", "standard backend, VL: the language model keeps its KV cache on in "
           "training (text_config.use_cache), so its mask builder skips the packed-sequence rule and packed samples "
           "attend to each other", "backends/standard/models.py",
           "    model.config.get_text_config().use_cache = False", "    pass",
           (f"{VL_DATA}::test_packed_rows_keep_their_images_each_samples_positions_and_the_per_token_loss",)),
    Mutant("vl_images_scattered_sequence_major", "qwen2_5_vl on mca: the images' features fill the placeholders in "
           "[seq, batch] order (Megatron's layout) instead of HF's row by row", "backends/mca/models/qwen2_5_vl.py",
           "rows, tokens = placeholders.nonzero(as_tuple=True)",
           "tokens, rows = placeholders.t().nonzero(as_tuple=True)",
           ("tests/distributed/test_mca_qwen2_5_vl_dist.py::"
            "test_qwen2_5_vl_logits_tp1_tp2_pp2_and_bit_exact_round_trips",)),
    Mutant("qwen3_vl_mrope_chunked", "qwen3_vl on mca: M-RoPE's sections as contiguous chunks of frequencies "
           "(Qwen2.5-VL's layout, Megatron's MultimodalRotaryEmbedding) instead of Qwen3-VL's interleaved T/H/W",
           "backends/mca/models/qwen3_vl.py", "        axes[axis:3 * section[axis]:3] = axis",
           "        axes[sum(section[:axis]):sum(section[:axis + 1])] = axis",
           ("tests/unit/test_mca_qwen3_vl.py::test_interleaved_mrope_is_transformers_rotary_embedding",), fast=True),
    Mutant("qwen3_vl_deepstack_one_layer_late", "qwen3_vl on mca: deepstack feature j added after decoder layer j + 1 "
           "instead of j (layer_number taken as the 0-based index)", "backends/mca/models/qwen3_vl.py",
           "                if layer.layer_number - 1 < self.deepstack_layers:\n"
           "                    add_deepstack_after(layer, layer.layer_number - 1)",
           "                if 1 < layer.layer_number <= self.deepstack_layers + 1:\n"
           "                    add_deepstack_after(layer, layer.layer_number - 2)",
           ("tests/distributed/test_mca_qwen2_5_vl_dist.py::"
            "test_qwen2_5_vl_logits_tp1_tp2_pp2_and_bit_exact_round_trips",)),
    Mutant("vl_cp_features_in_batch_order", "VL with context parallelism: each CP rank fills its placeholders with "
           "the batch's first image features instead of those of the placeholders it holds", "backends/mca/vision.py",
           'out["image_feature_rows"] = ordinal[:, cp_index][mine].to(device)',
           'out["image_feature_rows"] = ordinal[placeholders][:int(mine.sum())].to(device)',
           ("tests/distributed/test_mca_qwen2_5_vl_dist.py::"
            "test_qwen2_5_vl_trains_through_the_mca_trainer_tp1_tp2_pp2_tower_trained_and_frozen",)),
    Mutant("qwen3_vl_cp_deepstack_in_batch_order", "qwen3_vl with context parallelism (packed or not): each CP rank "
           "adds the batch's first deepstack features instead of the rows of the placeholders it holds (the main "
           "image features' ``image_feature_rows``)", "backends/mca/models/qwen3_vl.py",
           "            features = features.index_select(0, feature_rows)",
           "            features = features[:len(feature_rows)]",
           ("tests/distributed/test_mca_qwen2_5_vl_dist.py::"
            "test_qwen2_5_vl_trains_through_the_mca_trainer_tp1_tp2_pp2_tower_trained_and_frozen",)),
    Mutant("vl_packed_cp_rope_cut_over_the_stream", "VL packed rows with context parallelism: the M-RoPE angles "
           "cut into 2 * CP chunks of the whole packed stream (Megatron's multimodal rotary embedding) instead of "
           "per packed sample", "backends/mca/models/qwen2_5_vl.py",
           "if packed_seq_params is None or rope.cp_group is None or rope.cp_group.size() == 1:", "if True:",
           ("tests/distributed/test_mca_qwen2_5_vl_dist.py::"
            "test_qwen2_5_vl_trains_through_the_mca_trainer_tp1_tp2_pp2_tower_trained_and_frozen",)),
    Mutant("vl_frozen_tower_trains", "qwen2_5_vl on mca: freeze_vision_tower / freeze_multi_modal_projector "
           "ignored (the tower and projector train)", "backends/mca/vision.py",
           "                param.requires_grad_(False)", "                pass",
           ("tests/distributed/test_mca_qwen2_5_vl_dist.py::"
            "test_qwen2_5_vl_trains_through_the_mca_trainer_tp1_tp2_pp2_tower_trained_and_frozen",)),
    Mutant("lora_scaling_sqrt_rank_mca", "mca LoRA scaled by alpha/sqrt(r) (rsLoRA) instead of alpha/r",
           "backends/mca/lora/layers.py", "alpha / rank, rank, True", "alpha / rank ** 0.5, rank, True",
           ("tests/unit/test_mca_lora_utils.py::test_lora_output_is_base_plus_alpha_over_rank_times_b_a",),
           fast=True),
    Mutant("rslora_ignored_mca", "mca: use_rslora ignored (LoRA scaled by alpha/r)",
           "backends/mca/lora/layers.py", "        module.lora_scaling = alpha / math.sqrt(rank)", "        pass",
           ("tests/unit/test_mca_lora_utils.py::test_lora_output_is_base_plus_alpha_over_rank_times_b_a",),
           fast=True),
    Mutant("lora_mlp_targets_on_peft_expert_family_mca", "mca LoRA on deepseek_v3 adapts the dense MLP and shared "
           "experts for gate/up/down_proj, where the standard backend's PEFT adapts the routed experts",
           "backends/mca/lora/utils.py", 'PEFT_EXPERT_MLP_FAMILIES = ("deepseek_v3", ', 'PEFT_EXPERT_MLP_FAMILIES = (',
           ("tests/unit/test_mca_lora_utils.py::test_mlp_targets_refused_where_peft_moves_them_to_the_routed_experts",),
           fast=True),
    Mutant("te_mla_norms_as_gqa", "DeepSeek-V3 under Transformer Engine: the input norm loaded into a fused "
           "linear_qkv norm that MLA does not have, the q/kv latent norms not into the up-projections",
           "backends/mca/models/layout.py", '_TE_MLA_RENAMES if getattr(config, "multi_latent_attention", False) '
           'else _TE_RENAMES', "_TE_RENAMES",
           ("tests/unit/test_mca_deepseek_v3.py::test_transformer_engine_names_follow_megatrons_te_spec",),
           fast=True),
    Mutant("te_mla_down_proj_split", "DeepSeek-V3 under Transformer Engine: the duplicated down-projections split "
           "across TP ranks like the local spec's column-parallel ones", "backends/mca/models/sharding.py",
           '    return config.transformer_impl == "transformer_engine" and name.endswith(_TE_DUPLICATED)',
           "    return False",
           ("tests/unit/test_mca_deepseek_v3.py::test_transformer_engine_names_follow_megatrons_te_spec",)),
    Mutant("moe_aux_tokens_with_padding", "the MoE load-balancing loss counts padding tokens (standard)",
           "roll/loss.py", "routed, probs = routed * valid.unsqueeze(-1), probs * valid.unsqueeze(-1)", "pass",
           ("tests/unit/test_loss.py::test_load_balancing_loss_is_megatrons_summed_over_layers_without_padding",),
           fast=True),
    Mutant("z_loss_padding_counted", "the MoE router z-loss averages over padding tokens too (standard)",
           ROLL_LOSS, "total = total + (values * valid).sum() / valid.sum().clamp(min=1)",
           "total = total + values.mean()",
           (f"{LOSS_UNIT}::test_router_z_loss_is_megatrons_summed_over_layers_without_padding",), fast=True),
    Mutant("moe_z_loss_coeff_ignored_mca", "mca: the recipe's moe_z_loss_coeff never reaches Megatron",
           "backends/mca/models/config.py", 'out["moe_z_loss_coeff"] = m.moe_z_loss_coeff', "pass",
           (f"{MCA_MODELS}::test_moe_aux_loss_coefficient_is_hf_router_aux_loss_coef_at_any_tp",), fast=True),
    Mutant("pref_ftx_per_token_not_per_pair", "pref_ftx's SFT term averaged over the batch's chosen tokens "
           "(TRL's sft) instead of each pair's mean", "roll/loss.py",
           "return -chosen_logps / chosen_tokens.clamp(min=1).to(chosen_logps.dtype)",
           "return -chosen_logps.sum() / chosen_tokens.sum().clamp(min=1) + 0 * chosen_logps",
           ("tests/unit/test_loss.py::test_pref_ftx_adds_each_chosen_responses_mean_token_nll",), fast=True),
    Mutant("orpo_nll_batch_token_mean", "ORPO's NLL term averaged over the batch's chosen tokens (TRL's "
           "reduction) instead of each chosen response's mean (LLaMA-Factory's, the key's definition)",
           PREFERENCE, "nll = roll_loss.chosen_sft_losses(chosen_logps, chosen_tokens)  # -A_c",
           "nll = -chosen_logps.sum() / chosen_tokens.sum() + 0 * chosen_logps  # -A_c",
           (f"{PREF_UNIT}::test_orpo_is_llamafactorys_nll_plus_trls_odds_ratio_term",), fast=True),
    Mutant("simpo_gamma_over_beta", "simpo_gamma taken as the SimPO paper's gamma_beta_ratio (divided by pref_beta) "
           "instead of the absolute margin", PREFERENCE, "margin = beta * (chosen - rejected) - gamma",
           "margin = beta * (chosen - rejected) - gamma / beta",
           (f"{PREF_UNIT}::test_simpo_is_trls_cpo_simpo_without_its_nll_term",)),
    Mutant("pref_ftx_dropped_reference_free_standard", "standard: pref_ftx ignored with pref_loss orpo and simpo",
           TRAINERS, "ftx=self._roll_pref_ftx)", "ftx=0.0)",
           (f"{PREF_UNIT}::test_standard_backend_trains_them_without_a_reference",)),
    Mutant("packed_cache_key_without_cutoff", "a packed-rows cache file is reused for another cutoff_len",
           "roll/data/packing.py", "settings_digest(dataset._fingerprint, str(capacity), rule,",
           "settings_digest(dataset._fingerprint, rule,",
           ("tests/unit/test_data_prepared.py::test_packed_rows_equal_a_plain_concatenation_of_each_bin",),
           fast=True),
    Mutant("tokenized_path_settings_unchecked", "tokenized_path loads data prepared with other settings",
           "roll/data/prepared.py", "    if differences:\n", "    if False:\n",
           ("tests/unit/test_data_prepared.py::test_tokenized_path_round_trip_and_refusals",), fast=True),
    Mutant("packing_ties_newest_bin", "packing puts a sample into the newest of equally full bins",
           "roll/data/packing.py", "bin_id = heapq.heappop(heap)", "bin_id = heap.pop()",
           ("tests/unit/test_data_prepared.py::test_array_packing_gives_the_same_bins_as_the_list_version",)),
    Mutant("packing_llamafactory_ties_first", "packing_algorithm: llamafactory takes the first of equally long "
           "samples, where LLaMA-Factory takes the last (other rows than LLaMA-Factory's)",
           "roll/data/packing.py", "members.append(by_length[length].pop())",
           "members.append(by_length[length].pop(0))",
           ("tests/unit/test_data_packing.py::test_llamafactory_bins_hand_computed",), fast=True),
    Mutant("data_order_recipe_ignored_standard", "standard: the sampler ignores data_seed and shuffle: false",
           TRAINERS, "return EpochSampler(len(dataset), self.roll_sample_order())",
           "return EpochSampler(len(dataset), SampleOrder(self.args.seed))",
           (f"{STD_UNIT}::test_trainer_consumes_the_shared_order",), fast=True),
    Mutant("data_order_resume_epoch_lost_standard", "standard: a resumed epoch on several ranks reads epoch 0's order",
           TRAINERS, "loader.set_sampler(sampler)", "None",
           ("tests/unit/test_sample_order.py::test_a_resumed_epoch_keeps_its_order_on_every_rank",)),
    Mutant("data_order_same_every_epoch", "every epoch in the first epoch's order (HF reseeds per epoch)",
           "roll/data/order.py", "_permutation(num_samples, self.seed + epoch)", "_permutation(num_samples, self.seed)",
           ("tests/unit/test_sample_order.py::test_both_backends_draw_accelerates_batches_epoch_after_epoch",),
           fast=True),
    Mutant("labels_shifted_twice_standard", "standard: the collator shifts labels and HF's loss shifts again",
           "backends/standard/backend.py", "PaddingPolicy(packing=self.config.data.packing)",
           "PaddingPolicy(packing=self.config.data.packing, shift_labels=True)",
           ("tests/recipes/test_recipe_goldens.py::test_standard_backend_matches_goldens",)),
    Mutant("loss_per_micro_batch_standard", "standard: loss normalised per micro-batch, not per global batch",
           TRAINERS, "return super().training_step(model, inputs, num_items_in_batch)",
           "return super().training_step(model, inputs, None)",
           (f"{STD_UNIT}::test_loss_is_per_token_mean_over_global_batch",)),
    Mutant("eval_label_mask_dropped_standard", "standard: eval loss over every token (prompt and padding too)",
           TRAINERS, 'rows = token_loss_rows(outputs.logits, inputs["labels"])',
           'rows = token_loss_rows(outputs.logits, inputs["input_ids"])',
           (f"{STD_UNIT}::test_evaluate_reports_the_loss_on_the_eval_set",)),
    Mutant("resume_restarts_data_standard", "standard: a resumed run repeats the batches before the checkpoint",
           HF_ARGS, 'kwargs["remove_unused_columns"] = False',
           'kwargs["remove_unused_columns"] = False\n    kwargs["ignore_data_skip"] = True',
           (f"{STD_UNIT}::test_resume_reproduces_the_uninterrupted_run",)),
    Mutant("stream_shuffle_unseeded", "streaming: the shuffle buffer draws without the seed (another order on "
           "every read: a resumed run or another rank trains other rows)", "roll/data/streaming.py",
           "rng = np.random.default_rng(seed)\n    buffer", "rng = np.random.default_rng()\n    buffer",
           (STREAM_ORDER,)),
    Mutant("stream_epochs_same_order", "streaming: every pass over the corpus in the same order",
           "roll/data/streaming.py", "seed = self.data_args, self.seed + epoch", "seed = self.data_args, self.seed",
           (STREAM_ORDER,)),
    Mutant("stream_replay_one_late", "streaming: a resumed reader's replay starts one row into the stream",
           "roll/data/streaming.py", "self._iter, self._next_block = iter(self.stream), 0",
           "self._iter, self._next_block = iter(self.stream), 0\n            next(self._iter)",
           (STREAM_ORDER,), fast=True),
    Mutant("stream_read_by_every_rank", "streaming: every local rank reads and tokenizes the whole stream "
           "itself (no spool from local rank 0)", "roll/data/streaming.py",
           'if not getattr(dataset, "streamed", False) or local_world_size() < 2:', "if True:",
           (f"{STREAM_UNIT}::test_one_reader_per_node_hands_each_rank_its_rows_and_resumes_exactly",),
           fast=True),
    Mutant("stream_pack_full_first_block", "streaming, packing: the first packing block is a whole buffer_size "
           "(step 1 waits for buffer_size more rows tokenized)", "roll/data/streaming.py",
           "size = min(FIRST_PACK_BLOCK, buffer_size)", "size = buffer_size",
           (f"{STREAM_UNIT}::test_packing_starts_with_a_small_block_that_doubles_up_to_buffer_size",), fast=True),
    Mutant("interleave_over_stops_early", "mix_strategy interleave_over stops at the first exhausted dataset",
           "roll/data/mixing.py", 'if strategy == "interleave_under":', 'if strategy.startswith("interleave"):',
           (f"{STREAM_UNIT}::test_interleave_strategies_round_robin",), fast=True),
    Mutant("interleave_probs_unseeded", "interleave_probs drawn without the seed", "roll/data/mixing.py",
           "rng = np.random.default_rng(seed)", "rng = np.random.default_rng()",
           (f"{STREAM_UNIT}::test_interleave_probs_are_seeded_and_respected",)),
    Mutant("mix_ignored_in_memory", "mix_strategy ignored without streaming (datasets concatenated)",
           "roll/data/mixing.py", 'if data_args.mix_strategy == "concat":', "if True:",
           (f"{STREAM_UNIT}::test_mixing_is_the_same_in_memory_and_streamed",)),
    Mutant("async_save_without_host_copy", "save_async: the background writer writes the live tensors, which "
           "training changes in place, instead of a copy taken at the save", "roll/background_save.py",
           'copies[key] = value.detach().to("cpu", copy=True)', "copies[key] = value.detach()",
           (f"{BACKGROUND}::test_host_copy_is_a_snapshot_that_keeps_ties_and_frozen_tensors",),
           fast=True),
    Mutant("async_save_update_not_fenced", "save_async on a CPU run: the optimizer step does not wait while the "
           "background writer reads the live weights (the checkpoint then holds a later step's)",
           "roll/background_save.py", "        pending.written.wait()\n", "        pass\n",
           (f"{BACKGROUND}::test_a_live_save_holds_the_update_until_written_and_is_finalized_before_the_publish",),
           fast=True),
    Mutant("async_save_no_fence_in_the_mca_loop", "mca, save_async on CPU: the loop updates the weights while the "
           "checkpoint's writer still reads them", LOOP, "            self._background.fence()  # a checkpoint's",
           "            pass  # a checkpoint's", (ASYNC_KILL_MCA,)),
    Mutant("async_save_no_fence_on_the_standard_optimizer", "standard, save_async on CPU: the torch optimizer "
           "steps while the checkpoint's writer still reads its state and the weights",
           "backends/standard/reliability.py", "            inner.register_step_pre_hook(lambda *_: saves.fence())\n",
           "", (f"{ASYNC_KILL}[standard]",)),
    Mutant("async_save_published_while_writing", "save_async: checkpoint-N published before every rank's "
           "writer finished (a kill then leaves an incomplete latest checkpoint)", "roll/background_save.py",
           "if any_rank(not pending.done.is_set()):", "if False:",
           (f"{BACKGROUND}::test_published_only_after_the_writer_finished_and_older_ones_rotated",), fast=True),
    Mutant("kto_mismatched_row_is_its_own", "kto: a row's mismatched row keeps its own completion (the KL "
           "reference point then equals the row's own reward: TRL#1911)", "roll/data/feedback.py",
           "prompt, completion = spans[i][0], spans[real[k - 1]][1]", "prompt, completion = spans[i]",
           (f"{KTO_UNIT}::test_feedback_collator_docstring_example",), fast=True),
    Mutant("kto_llamafactory_pairs_a_row_with_itself", "kto_mismatched_rows: llamafactory: a row's mismatched row "
           "takes its own reply (the reference point then equals the row's own reward)", "roll/data/feedback.py",
           "other = replies[rank[k] - 1]", "other = tokens[k][1]",
           (f"{NAMED_UNIT}::test_kto_rows_paired_in_the_tokenization_batch_as_llamafactory",), fast=True),
    Mutant("kto_llamafactory_pairs_ignored_by_the_collator", "kto_mismatched_rows: llamafactory: the collator "
           "rotates the micro-batch anyway (one row a micro-batch: its own reply)", "roll/data/feedback.py",
           "mismatched = (paired_rows(features) if features and KL[0] in features[0] else",
           "mismatched = (mismatched_rows(features, self.cutoff_len) if features and KL[0] in features[0] else",
           (f"{NAMED_UNIT}::test_kto_rows_paired_in_the_tokenization_batch_as_llamafactory",), fast=True),
    Mutant("kto_reference_point_not_clamped", "kto: a negative KL estimate used as the reference point",
           "roll/kto.py", "return (stats[0] / stats[1].clamp(min=1)).clamp(min=0)",
           "return stats[0] / stats[1].clamp(min=1)",
           (f"{KTO_UNIT}::test_kto_loss_reference_point_and_metrics_by_hand",), fast=True),
    Mutant("kto_weights_swapped_standard", "standard: kto_desirable_weight weighs the undesirable rows",
           "backends/standard/kto_trainer.py", "desirable_weight=self.args.desirable_weight,",
           "desirable_weight=self.args.undesirable_weight,",
           (f"{KTO_UNIT}::test_standard_kto_equals_trls_own_kto_loss_on_one_batch",)),
    # ---- one or two torchrun / roll-parity launches --------------------------------------------------
    Mutant("every_rank_packs", "every rank of a node tokenizes and packs the data itself at the same time (the "
           "local rank 0 first barrier gone): N times the work and memory, racing writes into one cache",
           "roll/data/pipeline.py", "    first = local_rank() == 0\n", "    first = True\n",
           ("tests/distributed/test_pack_once_dist.py::test_local_rank_0_packs_and_the_other_rank_loads_its_file",)),
    Mutant("kto_reference_point_dropped_mca", "mca: the KTO loss measured against 0, not the KL reference point",
           "backends/mca/trainer/kto.py", 'batch["kto_kl"] = reference[index]["logps"][:rows], z[index]',
           'batch["kto_kl"] = reference[index]["logps"][:rows], z[index] * 0',
           (f"{SWEEP}::test_case[kto]",)),
    Mutant("stream_resume_restarts_standard", "standard, streaming: a resumed run reads the stream from its start",
           HF_ARGS, 'kwargs["remove_unused_columns"] = False',
           'kwargs["remove_unused_columns"] = False\n    kwargs["ignore_data_skip"] = True',
           ("tests/distributed/test_streaming.py::test_streaming_same_losses_on_both_backends_and_across_a_resume",)),
    Mutant("padded_vocab_rank_offset", "TP: a rank's vocabulary slice read as starting at token 0",
           ROLL_LOSS, "width = max(0, min(flat.shape[1], vocab - first))",
           "width = max(0, min(flat.shape[1], vocab))",
           ("tests/distributed/test_loss_vocab_parallel.py::"
            "test_vocab_split_over_two_ranks_with_padding_matches_float64_log_softmax",
            f"{MCA_DPO}::test_reference_stays_frozen_and_log_probs_match_hf")),
    Mutant("dpo_reference_is_policy_mca", "mca: DPO reference log-probs taken from the policy",
           "backends/mca/backend.py", "return DPOObjective(vocab_size, settings, models.ref)",
           "return DPOObjective(vocab_size, settings, models.policy if models.ref is not None else None)",
           (f"{MCA_DPO}::test_dpo_on_one_process_matches_trl_every_step",)),
    Mutant("labels_shifted_twice_mca", "mca: the loss shifts the collator's already shifted labels again",
           LOSS, "log_probs, mask = token_log_probs(logits, labels, vocab_size)\n    return roll_loss.loss_sum(",
           "log_probs, mask = token_log_probs(logits[:, :-1], labels[:, 1:], vocab_size)\n"
           "    return roll_loss.loss_sum(",
           (PARITY_TP1,)),
    Mutant("loss_per_sequence_mca", "mca: loss normalised per sequence instead of per token",
           LOSS, "return roll_loss.loss_sum(log_probs), mask.sum()",
           "return roll_loss.loss_sum(log_probs.sum(-1) / mask.sum(-1).clamp(min=1)), (mask.sum(-1) > 0).sum()",
           (PARITY_TP1,)),
    Mutant("weight_decay_megatron_default_mca", "mca: the recipe's weight_decay replaced by Megatron's 0.01",
           "backends/mca/trainer/optim.py", "apply_weight_decay(optimizer, training.weight_decay)",
           "apply_weight_decay(optimizer, 0.01)", (DECAY_PARITY,)),
    Mutant("weight_decay_on_norms_mca", "mca: weight decay applied to norm weights and biases",
           "backends/mca/trainer/param_groups.py", "ParamGroupOverride(wd_mult=0.0)", "ParamGroupOverride(wd_mult=1.0)",
           (DECAY_PARITY,)),
    Mutant("weight_decay_dropped_standard", "standard: the recipe's weight_decay dropped",
           HF_ARGS, 'kwargs["remove_unused_columns"] = False',
           'kwargs["remove_unused_columns"] = False\n    kwargs["weight_decay"] = 0.0', (DECAY_PARITY,)),
    Mutant("grad_clip_skipped_mca", "mca: gradient clipping skipped", "backends/mca/trainer/optim.py",
           "clip_grad=training.max_grad_norm or 0.0", "clip_grad=0.0", (PARITY_TP1, DECAY_PARITY)),
    Mutant("grad_clip_skipped_standard", "standard: gradient clipping skipped",
           HF_ARGS, 'kwargs["remove_unused_columns"] = False',
           'kwargs["remove_unused_columns"] = False\n    kwargs["max_grad_norm"] = 0.0',
           (PARITY_TP1, DECAY_PARITY)),
    Mutant("export_stale_mca", "mca: the last optimizer step is not in the exported weights",
           LOOP, "        numbers = self._update(self._local_sums(outputs, batches))\n",
           "        sums = self._local_sums(outputs, batches)\n"
           "        if self.state.global_step + 1 < self.plan.total_steps(\n"
           "                self.training.max_steps, self.training.num_train_epochs, len(dataset)):\n"
           "            numbers = self._update(sums)\n"
           "        else:\n"
           "            dist.all_reduce(sums)\n"
           "            numbers = torch.cat([sums, sums.new_tensor([0.0, 0.0])])\n",
           (ONE_PROCESS,)),
    Mutant("resume_repeats_batch_mca", "mca: a resumed run repeats the checkpoint's last batch",
           "backends/mca/trainer/checkpointing.py", "state = TrainerState(**json.load(fh))",
           "state = TrainerState(**json.load(fh))\n    state.global_step -= 1", (ONE_PROCESS,)),
    Mutant("resume_skips_batch_mca", "mca: a resumed run skips the batch after the checkpoint",
           "backends/mca/trainer/checkpointing.py", "state = TrainerState(**json.load(fh))",
           "state = TrainerState(**json.load(fh))\n    state.global_step += 1", (ONE_PROCESS,)),
    Mutant("resume_through_pytorch_reader_mca", "mca: a resume reads its checkpoint through PyTorch's reader (three "
           "copies of every tensor, Megatron's gate/up concatenations held until applied) instead of in place",
           "backends/mca/trainer/checkpointing.py",
           'loaded, nbytes = load_sharded(sharded, ckpt_dir, "checkpoint" if updated else "checkpoint weights")',
           'from megatron.core import dist_checkpointing\n    loaded, nbytes = dist_checkpointing.load(sharded, ckpt_dir), 0',
           (ONE_PROCESS,)),
    Mutant("loss_per_micro_batch_mca", "mca: loss normalised per micro-batch, not per global batch",
           "backends/mca/trainer/step.py", "return loss_sum.float(), count, {REPORT:",
           "return (loss_sum / count.clamp(min=1)).float(), torch.ones_like(count), {REPORT:",
           (ONE_PROCESS,)),
    Mutant("pref_ftx_dropped_standard", "standard: pref_ftx's SFT term never added to TRL's DPO loss",
           TRAINERS, "extra = self._roll_pref_ftx * sft.mean()", "extra = 0.0 * sft.mean()",
           (f"{SWEEP}::test_case[cp2_dpo_sigmoid_ftx]",)),
    Mutant("pref_ftx_dropped_reference_free_mca", "mca: pref_ftx ignored with pref_loss orpo and simpo", LOSS,
           "gamma=settings.simpo_gamma, label_smoothing=settings.label_smoothing, ftx=settings.ftx)",
           "gamma=settings.simpo_gamma, label_smoothing=settings.label_smoothing, ftx=0.0)",
           (f"{PREF_DIST}::test_orpo_and_simpo_match_across_backends_and_layouts",)),
    Mutant("moe_aux_padding_counted_mca", "mca: padding tokens counted in the MoE load-balancing loss",
           "backends/mca/trainer/data.py", '"padding_mask": None if padding is None else padding.to(device)}',
           '"padding_mask": None}', (f"{SWEEP}::test_case[moe_default_aux_loss]",)),
    Mutant("expert_bias_updated_mca", "mca: the sigmoid router's correction bias updated during training (Megatron's "
           "default rate), which HF's GLM-4.5 never does", "backends/mca/models/templates/glm4_moe.py",
           '"moe_router_bias_update_rate": 0.0', '"moe_router_bias_update_rate": 1.0e-3',
           (f"{SWEEP}::test_case[glm4_moe_sft]",)),
    Mutant("moe_z_loss_halved_by_tp_mca", "mca at TP2: the router z-loss trains at half its coefficient "
           "(megatron-core 0.16's per-token scale, unpatched)", "backends/mca/moe_loss_scale.py",
           "config.moe_z_loss_coeff = coeff * size", "config.moe_z_loss_coeff = coeff",
           (f"{SWEEP}::test_case[tp2_mixtral_moe_losses]",)),
    Mutant("moe_tokens_kept_by_sp_padding_mca", "mca under sequence parallelism: the MoE losses count the longest "
           "row's last token, which the padding to a multiple of TP keeps in the shifted batch",
           "roll/data/collators.py", 'batch["attention_mask"][:, longest - 1:] = 0', "pass",
           ("tests/unit/test_data_collators.py::test_pad_to_max_length_with_shift_gives_max_length_after_shift",
            f"{SWEEP}::test_case[tp2_mixtral_80_aux]")),
    Mutant("dpo_moe_aux_loss_added_standard", "standard, stage dpo on an MoE model: TRL's own pooled "
           "load-balancing loss added at the model config's router_aux_loss_coef (TRL 1.16's default)",
           "backends/standard/hf_args.py", "# RollDPOTrainer fills zeros\n                         router_aux_loss_coef=0.0)",
           "# RollDPOTrainer fills zeros\n                         router_aux_loss_coef=None)",
           (f"{SWEEP}::test_case[dpo_mixtral]",)),
    Mutant("moe_z_loss_dropped_standard", "standard: moe_z_loss_coeff trains without the router z-loss",
           TRAINERS, '("moe_z_loss", self.moe_z_coeff,', '("moe_z_loss", 0.0,',
           (f"{SWEEP}::test_case[mixtral_moe_losses]",)),
    Mutant("export_stale_overlap_mca", "mca, overlap_param_gather: the export misses the last update's all-gather",
           LOOP, "        sync_params(self.chunks)  # the final eval and the HF export",
           "        pass  # the final eval and the HF export",
           ("tests/distributed/test_mca_export.py::test_the_export_equals_the_trained_model_at_tp2_pp2_dp2",)),
    Mutant("grad_reduce_in_fp32_ignored_mca", "mca: grad_reduce_in_fp32: false ignored (bf16 gradients still "
           "reduced in fp32)", "backends/mca/trainer/optim.py",
           "grad_reduce_in_fp32=megatron_args.grad_reduce_in_fp32,", "grad_reduce_in_fp32=True,",
           (f"{MCA_TRAIN}::test_layouts_give_the_same_losses",)),
    Mutant("elastic_resume_not_prepared_standard", "standard: a ZeRO checkpoint resumed on another number "
           "of processes goes to DeepSpeed's own load, which refuses it (traceback)", "backends/standard/backend.py",
           "self._deepspeed = self._for_resume(self._deepspeed)", "pass", (ELASTIC_RUN,)),
    Mutant("zero3_universal_step_shared_standard", "standard, ZeRO-3 resumed on another number of processes: "
           "both parameter groups count Adam steps on one tensor (DeepSpeed 0.19.8, W10)",
           "backends/standard/_compat.py", '                state["step"] = state["step"].clone()',
           "                pass", (ELASTIC_RUN.replace("ds_z2", "ds_z3"),)),
    Mutant("slurm_signal_burst_stops_at_once_2proc", "under SLURM, the SIGTERM that srun or the launcher "
           "forwards after SLURM's own kills two srun tasks mid-save", "roll/reliability.py",
           BURST, "return False",
           ("tests/distributed/test_slurm_dist.py::test_srun_tasks_signal_burst_then_the_requeued_job_resumes",)),
    Mutant("rm_head_random_standard", "standard rm: the head starts at transformers' random init, not zero (step 1 "
           "is not ln 2, the backends start apart)", "backends/standard/reward.py", "        zero_head(model)\n",
           "        pass\n", (f"{SWEEP}::test_case[rm_mid_run_eval]", MCA_RM)),
    Mutant("rm_head_not_zeroed_under_zero3_standard", "standard rm under ZeRO-3: the head zeroed without gathering "
           "it (a no-op on the partitioned weight): it starts at transformers' random init",
           "backends/standard/reward.py", "    if is_deepspeed_zero3_enabled():", "    if False:",
           (RM_ZERO3,)),
    Mutant("rm_eval_loss_of_batch_means_standard", "standard rm on 2 processes: eval_loss HF's mean of eval-batch "
           "means, counting the rows accelerate repeats to even out the last batch", "backends/standard/reward.py",
           '                    logs["eval_loss"] = loss / max(count, 1.0)', "                    pass",
           (RM_ZERO3,)),
    Mutant("rm_head_reduced_as_expert_mca", "mca rm on an MoE model at EP2 x DP2: the score head tagged as an "
           "expert weight (Megatron's allreduce=False), so its gradient is reduced over the expert-data-parallel "
           "group (1 rank) instead of DP2 and each rank's head drifts (loss 6.5e-4 apart at step 5, weights 0.85)",
           "backends/mca/models/reward.py",
           "        self.weight = nn.Parameter(torch.zeros(1, config.hidden_size, dtype=config.params_dtype))\n",
           "        self.weight = nn.Parameter(torch.zeros(1, config.hidden_size, dtype=config.params_dtype))\n"
           "        self.weight.allreduce = False\n", (f"{SWEEP}::test_case[ep2_rm_moe]",)),
    Mutant("rm_head_not_in_lora_checkpoint_mca", "mca rm with LoRA: the adapter-only checkpoint leaves the trained "
           "head out (the save fails: the optimizer holds the head's state)", "backends/mca/lora/checkpoint.py",
           "is_lora_param(\".\" + name) or name in head}", "is_lora_param(\".\" + name)}", (MCA_RM,)),
    Mutant("rm_labels_shifted_mca", "mca rm: labels shifted like the LM stages', so each side is scored one token "
           "early", "backends/mca/backend.py", '        if stage == "rm":  # rm\'s labels', '        if False:  # rm\'s labels',
           (f"{SWEEP}::test_case[rm_mid_run_eval]", MCA_RM)),
    Mutant("rm_sp_head_gradient_doubled_mca", "mca rm at TP2 + SP: the hidden-state gradient below the score head "
           "reduce-scattered (summed over TP) instead of sliced: twice the decoder's gradient",
           "backends/mca/models/reward.py", "tensor_parallel_output_grad=False", "tensor_parallel_output_grad=True",
           (f"{SWEEP}::test_case[tp2_rm]", MCA_RM)),
    Mutant("rm_head_frozen_by_lora_mca", "mca rm with LoRA: the score head stays frozen at zero (the loss never "
           "leaves ln 2)", "backends/mca/backend.py", "                train_score_heads(models.policy)",
           "                pass", (f"{SWEEP}::test_case[rm_lora_all]", MCA_RM)),
    Mutant("checkpoint_read_ignores_stride", "mca checkpoint loads: a stored tensor that is not contiguous (a "
           "transpose) is read byte for byte into a contiguous parameter, its elements out of order",
           "backends/mca/checkpoint_io.py", "or (numel > 1 and record.stride != expected_stride)", "or False",
           ("tests/unit/test_convert_streaming.py::test_stored_tensor_finds_whole_contiguous_tensors_only",), fast=True),
    Mutant("checkpoint_part_read_from_the_start", "mca checkpoint loads at another layout: a TP shard of a stored "
           "tensor is read from the tensor's first element, so every rank but the first gets the first rank's rows",
           "backends/mca/checkpoint_io.py",
           "head = sum(offsets[d] * strides[d] for d in range(split, ndim))", "head = 0",
           ("tests/unit/test_convert_streaming.py::test_parts_of_stored_tensors_are_read_in_place_at_another_layout",),
           fast=True),
    Mutant("mapped_span_not_adjacent", "roll-convert hf2mca: a parameter mapped over the file from its first input's "
           "offset though its inputs are not stored one after the other (another tensor between gate and up), so it "
           "holds the wrong bytes", "backends/mca/models/safetensors_io.py",
           'if entry["torch_dtype"] != dtype or entry["data_offsets"][0] != end:', 'if entry["torch_dtype"] != dtype:',
           ("tests/unit/test_convert_streaming.py::test_safetensors_spans_are_mapped_copy_on_write",)),
    Mutant("mapped_checkpoint_tensor_at_its_archive", "roll-convert mca2hf: a parameter mapped over the .distcp file "
           "from its archive's start, not its bytes' (off by the zip header and data.pkl), so the HF export holds "
           "the wrong bytes", "backends/mca/checkpoint_io.py",
           "if whole and take is not None and take(info.offset + data_offset, target):",
           "if whole and take is not None and take(info.offset, target):",
           ("tests/unit/test_convert_streaming.py::test_roll_convert_writes_from_its_own_process_with_progress",)),
    Mutant("mapped_checkpoint_silently_read", "roll-convert mca2hf: the map of the .distcp files never taken (a "
           "check too strict), every parameter read into fresh memory and written from it again: right bytes, "
           "3x the page faults", "backends/mca/checkpoint_map.py",
           "if param.dtype != target.dtype or position % target.element_size():", "if True:",
           ("tests/unit/test_convert_streaming.py::test_roll_convert_writes_from_its_own_process_with_progress",)),
    Mutant("mapped_gate_up_halves_swapped", "roll-convert mca2hf: the fused gate/up weight's halves recorded at each "
           "other's rows in its file spans, so the HF export's gate_proj holds up_proj's bytes and the other way round",
           "backends/mca/checkpoint_map.py", "file_backed(memory, begin, nbytes, source, position)",
           "file_backed(memory, param.nbytes - begin - nbytes, nbytes, source, position)",
           ("tests/unit/test_convert_streaming.py::test_mapped_params_take_row_blocks_whole_or_partly",
            "tests/unit/test_convert_streaming.py::test_roll_convert_writes_from_its_own_process_with_progress")),
    Mutant("mapped_gate_up_halves_read", "roll-convert mca2hf: the gate/up halves (two archives of one parameter) "
           "never taken, read into fresh memory and written from it: right bytes, the page faults of 15 GB at a 7B "
           "shape in fp32", "backends/mca/checkpoint_map.py",
           "self._alone = not dist.is_initialized() or dist.get_world_size() == 1", "self._alone = False",
           ("tests/unit/test_convert_streaming.py::test_mapped_params_take_row_blocks_whole_or_partly",
            "tests/unit/test_convert_streaming.py::test_roll_convert_writes_from_its_own_process_with_progress")),
    Mutant("gate_up_merged_into_a_copy", "mca checkpoint loads: every layer's fused gate/up weight concatenated "
           "into a new tensor and held until the whole state dict is applied (+15 GB at a 7B shape in fp32)",
           "backends/mca/checkpoint_io.py", "factory.merge_fn = _merge_into(factory.data, factory.merge_fn)", "pass",
           ("tests/unit/test_convert_streaming.py::test_fused_gate_up_merges_into_the_parameter_itself",)),
    Mutant("vl_vision_tokens_trained", "VL sft with train_on_prompt: the vision tokens (<|image_pad|> runs) are "
           "trained as text", "roll/data/vision.py",
           "labels = [IGNORE_INDEX if t in vision_ids else y for t, y in zip(ids, labels)]", "labels = labels",
           (f"{VL_DATA}::test_each_placeholder_becomes_its_images_hand_counted_vision_tokens_never_trained",)),
    Mutant("vl_image_cut_kept", "VL: cutoff_len cuts into an image's vision tokens and the row is kept (the model "
           "then fails on fewer image tokens than image features)", "roll/data/vision.py",
           "if ids.count(image_id) != sum(counts) or ids.count(start_id) != len(paths):", "if False:",
           (f"{VL_DATA}::test_cutoff_len_never_cuts_an_image_the_row_is_dropped_and_counted",)),
    Mutant("vl_no_mm_token_type_ids", "VL: the batch lacks mm_token_type_ids, so transformers' Qwen2.5-VL gives "
           "the image tokens 1-D positions instead of M-RoPE (silently)", "roll/data/vision.py",
           'batch["mm_token_type_ids"] = (batch["input_ids"] == self.vision.token_ids[0]).long()', "pass",
           (f"{VL_DATA}::test_the_batch_gives_the_model_its_3d_positions",)),
    Mutant("vl_resize_after_rgb", "image_max_pixels: the image converted to RGB before LLaMA-Factory's resize (a "
           "palette image resized bicubically: other pixels than LLaMA-Factory's)", "roll/data/vision.py",
           'return (resize.apply(image) if resize else image).convert("RGB")',
           'return resize.apply(image.convert("RGB")) if resize else image.convert("RGB")',
           (f"{VL_PIXELS}::test_the_resize_runs_in_the_files_mode_with_pils_default_filter_then_rgb",), fast=True),
    Mutant("vl_collator_skips_resize", "image_max_pixels: the tokens follow the resized image but the collator "
           "gives the model the image as it is (more patches than image tokens)", "roll/data/vision.py",
           "images = [open_image(p, self.vision.resize) for p in paths]", "images = [open_image(p) for p in paths]",
           (f"{VL_PIXELS}::test_images_are_resized_first_as_llamafactory_does[qwen2_vl_template]",)),
    Mutant("vl_qwen2_vl_template_keeps_processor_sizes", "template: qwen2_vl without image_max_pixels: images not "
           "resized to LLaMA-Factory's 768*768 default (other token counts than under LLaMA-Factory)",
           "roll/data/vision_resize.py", "named = data_args.template in TEMPLATES", "named = False",
           (f"{VL_PIXELS}::test_images_are_resized_first_as_llamafactory_does[qwen2_vl_template]",)),
    Mutant("vl_resize_rounds", "image_max_pixels: the scaled sides rounded instead of truncated as LLaMA-Factory "
           "does (a pixel more on some images)", "roll/data/vision_resize.py",
           "width, height = int(width * factor), int(height * factor)",
           "width, height = round(width * factor), round(height * factor)",
           (f"{VL_PIXELS}::test_the_resize_steps_are_llamafactorys_arithmetic",), fast=True),
    Mutant("vl_lora_on_frozen_tower", "VL LoRA: adapters on the frozen vision tower too (short module names such "
           "as gate_proj match its blocks)", "backends/standard/vision.py",
           "in short_names and part_of(name) not in frozen]", "in short_names]",
           (f"{VL_STD}::test_lora_adapts_the_language_model_only_by_default_and_the_tower_when_unfrozen",)),
    Mutant("async_save_unfinished_at_the_end_mca", "mca, save_async: the last checkpoint, still being written "
           "when training ends, is never published", LOOP, "            self._finish_saves()\n        finally:",
           "        finally:", (ASYNC_KILL_MCA,)),
    Mutant("mla_lora_kv_b_shape_of_q", "mca LoRA init replays PEFT's draws for kv_b_proj with q's head width (nope + "
           "rope) instead of k's nope + v's: every later adapter starts from other values than PEFT's",
           "backends/mca/lora/apply.py", "heads * (config.qk_head_dim + config.v_head_dim)",
           "heads * (config.qk_head_dim + config.qk_pos_emb_head_dim)",
           ("tests/distributed/test_mca_lora.py::test_initial_adapter_equals_peft_with_the_same_seed[mla_tp1]",)),
    Mutant("mla_rope_key_grad_not_summed", "DeepSeek-V3 at TP2 (local spec): the shared RoPE key's gradient keeps "
           "one rank's heads' share (megatron-core 0.16.1 as it is)", "backends/mca/mla_rope_key_grad.py",
           "        dist.all_reduce(key, group=ctx.group)", "        pass",
           ("tests/distributed/test_mca_lora.py::test_tensor_parallel_gradients_and_losses_equal_tp1[mla_tp2sp-mla_tp1]",
            f"{SWEEP}::test_case[tp2_deepseek_v3_sft]")),
    Mutant("fused_experts_part_major", "a fused gate_up_proj read as all experts' gate rows, then all up rows "
           "([2, E, I, H]) instead of each expert's gate then up ([E, 2I, H])", "backends/mca/models/fused_experts.py",
           "start = begin + (expert * len(row.parts) + k) * size", "start = begin + (k * experts + expert) * size",
           ("tests/unit/test_mca_fused_experts.py::test_fused_experts_load_as_the_per_expert_checkpoint",)),
    Mutant("packed_windows_attend_across_samples_mca", "mca packed batches: a window's samples attend to each other "
           "(causal over the window instead of block-diagonal)", "backends/mca/attention.py",
           "allowed = (sequence[:, :, None] == sequence[:, None, :]) & causal",
           "allowed = causal.expand(len(windows), size, size)",
           ("tests/unit/test_mca_platform.py::test_packed_windows_hold_whole_sequences_and_equal_per_sequence_attention",)),
    Mutant("wgrad_fusion_drops_the_tied_head_under_ga", "mca with gradient accumulation, tied embedding: from the "
           "second micro-batch on, the head's weight gradient never reaches main_grad (only the embedding's rows do)",
           "backends/mca/wgrad_fusion.py", "            weight.__dict__[PENDING] = wgrad", "            pass",
           ("tests/unit/test_mca_platform.py::test_initialize_megatron_single_process_idempotent_and_reproducible",)),
    Mutant("stop_poll_reads_the_device_every_step", "a GPU run (NCCL) all-reduces its stop flag on the default "
           "group: a device tensor whose read waits for the device after every step",
           "roll/reliability.py", "op=dist.ReduceOp.MAX, group=host_group())", "op=dist.ReduceOp.MAX)",
           ("tests/distributed/test_stop_poll_dist.py::test_the_stop_poll_all_reduces_a_host_tensor_over_one_gloo_group",)),
    Mutant("host_group_outlives_the_default_group", "a GPU run's stop-poll group is still referenced after "
           "destroy_process_group: it goes at interpreter exit, where gloo's threads abort a finished run (SIGABRT)",
           "roll/reliability.py", "        _host = (weakref.ref(world), weakref.ref(group))",
           "        _host = (weakref.ref(world), lambda kept=group: kept)",
           ("tests/unit/test_reliability_units.py::test_the_stop_polls_host_group_goes_with_the_default_group",),
           fast=True),
    Mutant("training_walks_the_start_up_objects", "the router trains without freezing the start-up's objects: a full "
           "collection mid-training walks every import and module again (0.24 s inside the first save's planning)",
           "roll/router.py", "        with start_up_objects_frozen():", "        with __import__('contextlib').nullcontext():",
           ("tests/unit/test_stage_dispatch.py::test_the_backend_trains_with_the_start_ups_objects_frozen",),
           fast=True),
    Mutant("gc_freeze_never_handed_back", "the frozen objects stay frozen after training: a process that trains again "
           "(tests, sweeps) never frees an earlier run's cyclic garbage", "roll/gc_pause.py",
           "        gc.unfreeze()", "        pass",
           ("tests/unit/test_gc_pause.py::test_the_start_ups_objects_are_frozen_and_handed_back",), fast=True),
    Mutant("fast_exit_skips_atexit", "roll-convert ends without running the atexit handlers: logging's last lines "
           "(the conversion's summary) and a wandb run's finish lost", "roll/fast_exit.py",
           "    atexit._run_exitfuncs()", "    pass  #",
           ("tests/unit/test_convert_cli.py::test_end_process_skips_the_finalization_not_atexit_nor_a_running_thread",),
           fast=True),
    Mutant("roll_convert_finalizes_the_interpreter", "roll-convert ends through Python's finalization again: about a "
           "second after its files are written, twice what converting a 0.47 GB model takes",
           "backends/mca/convert_cli.py", "    end_process(_command(None))", "    sys.exit(_command(None))",
           ("tests/unit/test_convert_cli.py::test_the_commands_end_through_end_process_and_main_with_argv_raises",),
           fast=True),
    Mutant("roll_train_finalizes_the_interpreter", "roll-train ends through Python's finalization again: 1-2 s "
           "after a run's last line, in the launcher and in every rank", "roll/cli.py",
           "    end_process(main())", "    sys.exit(main())",
           ("tests/unit/test_convert_cli.py::test_the_commands_end_through_end_process_and_main_with_argv_raises",),
           fast=True),
    Mutant("direct_write_tail_not_cut", "a checkpoint file written past the page cache keeps the zero padding "
           "of its last block (the ftruncate to its length missing; test_mca_checkpoint's byte check catches it too)",
           "roll/direct_write.py",
           "            os.ftruncate(self._fd, self._base + self._fill)", "            pass",
           ("tests/unit/test_direct_write.py::test_the_file_holds_exactly_the_bytes_written",), fast=True),
    Mutant("direct_write_silently_buffered", "checkpoint files said to be written past the page cache go through "
           "it (O_DIRECT left out of the open): the background writer takes training's CPU again",
           "roll/direct_write.py", "self._fd = os.open(self.path, flags | direct, 0o666)",
           "self._fd = os.open(self.path, flags, 0o666)",
           ("tests/unit/test_direct_write.py::test_a_file_system_that_takes_o_direct_gets_it",), fast=True),
    Mutant("direct_write_in_place_head_lost", "a write handed to the device from the caller's memory loses the bytes "
           "before its first whole block (a checkpoint tensor's first bytes missing, every later one shifted)",
           "roll/direct_write.py", "        self.write(view[:head])\n", "",
           ("tests/unit/test_direct_write.py::test_a_source_in_memory_order_goes_to_the_device_uncopied_with_the_same_bytes",),
           fast=True),
    Mutant("mca_background_archive_off_its_alignment", "save_async on the mca backend pads an archive to its tensor's "
           "address without keeping its start at a multiple of 64 bytes (mca2hf's maps then read the wrong bytes)",
           "backends/mca/checkpoint_background.py", " or (tensor.data_ptr() - data_at) % ALIGNMENT:", ":",
           (f"{DIRECT_WRITE_UNIT}::test_mca_background_writer_writes_torch_saves_bytes_each_large_tensor_in_place",),
           fast=True),
    Mutant("mca_background_frame_keyed_by_size", "save_async on the mca backend reuses a cached torch.save frame for "
           "any tensor of the same dtype and byte count: a [8, 4] tensor is written with a [4, 8] tensor's header "
           "(it loads with the wrong shape)",
           "backends/mca/checkpoint_background.py", "key = (tensor.dtype, tuple(tensor.shape), tensor.stride(),",
           "key = (tensor.dtype, tensor.nbytes,",
           (f"{DIRECT_WRITE_UNIT}::test_mca_background_writer_writes_torch_saves_bytes_each_large_tensor_in_place",),
           fast=True),
    Mutant("standard_optimizer_padding_misses_the_descriptor", "the standard backend's optimizer.pt placement "
           "forgets the 16-byte descriptor after each zip member: its large tensors land off their addresses and "
           "are copied through the aligned buffer again (the writer's CPU back up)",
           "backends/standard/checkpoint_files.py", "return 24 if cursor >= _U32_MAX else 16",
           "return 24 if cursor >= _U32_MAX else 0", (STD_FILES,), fast=True),
    Mutant("standard_optimizer_padding_misses_zip64", "the standard backend's optimizer.pt placement forgets the zip64 "
           "offset field of headers past 4 GiB: every large tensor after the first 4 GiB of a big model's Adam state "
           "is copied through the aligned buffer again",
           "backends/standard/checkpoint_files.py", " + (8 if cursor >= _U32_MAX else 0)", "",
           ("tests/unit/test_standard_checkpoint_files.py::test_placement_holds_past_4_gib_where_the_archive_is_zip64",),
           fast=True),
    Mutant("standard_optimizer_crc32_back", "the standard backend's optimizer.pt computes torch.save's CRC-32 again "
           "(reading every byte once more: 0.3 CPU s per GB, in the writer training shares its cores with)",
           "backends/standard/_compat.py", "PyTorchFileWriter(stream, False, _get_storage_alignment())",
           "PyTorchFileWriter(stream, True, _get_storage_alignment())", (STD_FILES,), fast=True),
    Mutant("safetensors_header_not_placed", "a background save's model.safetensors header is never padded: weights "
           "loaded from a file with another header length are copied through the aligned buffer again",
           "roll/safetensors_file.py", "    if not best:\n        return header\n", "    return header\n",
           ("tests/unit/test_standard_checkpoint_files.py::"
            "test_weights_in_one_buffer_in_file_order_go_to_the_device_whole",), fast=True),

]
