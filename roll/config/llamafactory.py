"""LLaMA-Factory's recipe keys that are not roll's own: read under roll's name, accepted without effect, or
refused naming what to use, so that a LLaMA-Factory recipe runs with ``roll-train X.yaml`` unchanged.

Keys both tools share with one meaning (``learning_rate``, ``template``, ``dataset_dir``, ``lora_rank``,
``tensor_model_parallel_size`` ...) are roll's own fields, with their rows in roll/config/coverage.py. The
rest of LLaMA-Factory's training arguments (its ``hparams``: data, model, fine-tuning, training and
mcore_adapter's Megatron arguments; generation, evaluation and export arguments are not training keys) are
in ``KEYS``:

- ``Renamed``: the same meaning under roll's name (``mask_history`` -> ``train_on_last_turn_only``).
- ``Inert``: no effect on what roll trains (``plot_loss``: roll always writes loss.png; a multimodal or
  inference setting; a feature switched off). One info line says so. With ``only``, the values listed
  are accepted (the feature off) and any other value is refused (exit 2) naming ``use``.

``translate`` applies the table to a recipe (or the command line) before unknown keys are reported
(roll.config.parser.resolve); docs/keys.md shows it (roll.config.key_table).
"""

from __future__ import annotations

import fnmatch
import logging
from dataclasses import dataclass
from typing import Any, Callable

from roll.errors import ConfigError

logger = logging.getLogger(__name__)

DROP = object()
"""What a ``Renamed.convert`` returns when the value sets nothing (``neat_packing: false``)."""


@dataclass(frozen=True)
class Renamed:
    target: str
    """roll's key of the same meaning."""
    convert: Callable[[Any], Any] | None = None
    """LLaMA-Factory's value -> roll's (None: the same value); DROP: nothing to set."""
    note: str = ""


@dataclass(frozen=True)
class Inert:
    reason: str
    """Why it changes nothing roll trains (the info line and docs/keys.md)."""
    only: tuple | None = None
    """The values accepted (the feature off); None: any value."""
    use: str = ""
    """What to use instead, when a value outside ``only`` is refused."""


_ATTN = {"auto": DROP, "disabled": "eager", "sdpa": "sdpa", "fa2": "flash_attention_2",
         "fa3": "flash_attention_3"}


def _flash_attn(value):
    if value not in _ATTN:
        raise ConfigError(f"flash_attn={value!r} is not one of LLaMA-Factory's values ({', '.join(_ATTN)}); roll "
                          "reads it as attn_implementation.")
    return _ATTN[value]


def _off(use: str, *values) -> Inert:
    """A LLaMA-Factory feature roll does not have: accepted when off (``values``, default false)."""
    return Inert("the feature is off", only=values or (False,), use=use)


def _with(switch: str) -> Inert:
    return Inert(f"read with {switch} only, which is off (any other value of it is refused)")


MULTIMODAL = Inert("a multimodal setting roll does not read: it trains on text and images (docs/vl.md), not videos "
                   "or audio")
INFERENCE = Inert("an inference setting: roll-train does not generate")
SPEED = Inert("speed or memory only: the same training")
PPO = Inert("read by stage ppo only, which roll does not train (stages pt, sft, dpo)")
DEFAULT_MEGATRON = Inert("a Megatron-Core setting roll leaves at its default (the same training)")

KEYS: dict[str, Renamed | Inert] = {
    # -- data ------------------------------------------------------------------------------------------
    "mask_history": Renamed("train_on_last_turn_only"),
    "neat_packing": Renamed("packing", lambda v: True if v else DROP,
                            "roll's packing never attends across samples, which is neat_packing; LLaMA-Factory's "
                            "packing without it attends across samples"),
    "media_dir": Inert("the default", only=(None,), use="image paths are read relative to dataset_dir for a "
                                                      "registry entry, to the dataset file's folder otherwise, "
                                                      "or absolute (docs/vl.md)"),
    "eval_num_beams": INFERENCE,
    "ignore_pad_token_for_loss": Inert("padding is never trained in roll", only=(True,),
                                       use="padding is always left out of the loss"),
    "eval_on_each_dataset": _off("evaluate one eval_dataset per run (eval_loss of the whole set)"),
    "data_shared_file_system": Inert("where data is prepared first: each node's local rank 0 tokenizes first, "
                                     "the others load its cache (the same rows)"),
    # -- fine-tuning ---------------------------------------------------------------------------------------
    "pure_bf16": _off("dtype: bfloat16 with bf16: true loads and trains 16-bit weights (standard backend)"),
    "use_llama_pro": _off("finetuning_type: freeze trains the last freeze_trainable_layers layers"),
    "use_adam_mini": _off("set optim (HF Trainer's optimizers, standard backend)"),
    "use_muon": _off("set optim (HF Trainer's optimizers, standard backend)"),
    "use_megatron_bridge": _off("roll's Megatron-Core backend: use_mca: true (or --use-mca)"),
    "use_hyper_parallel": _off("use_mca: true with tensor_model_parallel_size / context_parallel_size"),
    "hyper_parallel_args": _with("use_hyper_parallel"),
    "hyper_parallel_cp_size": _with("use_hyper_parallel"),
    "use_dft_loss": _off("roll trains the token cross-entropy"),
    "use_asft_loss": _off("roll trains the token cross-entropy"),
    "use_eaft_loss": _off("roll trains the token cross-entropy"),
    "asft_alpha": _with("use_asft_loss"),
    "eaft_alpha": _with("use_eaft_loss"),
    "compute_accuracy": _off("roll evaluates eval_loss only"),
    "disable_shuffling": Renamed("shuffle", lambda v: not v),
    "early_stopping_steps": Inert("the default", only=(None,), use="roll trains max_steps / num_train_epochs; "
                                                                  "pick a checkpoint by eval_loss in train_log.jsonl"),
    "plot_loss": Inert("roll always writes loss.png to output_dir"),
    "include_effective_tokens_per_second": Inert("logging only: train_log.jsonl records tokens per second"),
    "additional_target": Inert("the default", only=(None,), use="LoRA trains its adapters only; "
                                                                "finetuning_type: full trains every module"),
    "loraplus_lr_ratio": Inert("the default", only=(None,), use="LoRA+ is not available: one learning rate"),
    "loraplus_lr_embedding": _with("loraplus_lr_ratio"),
    "use_dora": _off("plain LoRA (finetuning_type: lora)"),
    "pissa_init": _off("LoRA's default initialisation"),
    "pissa_convert": _off("LoRA's default initialisation"),
    "pissa_iter": _with("pissa_init"),
    "create_new_adapter": _off("roll starts LoRA from the base model"),
    "oft_*": Inert("read with finetuning_type: oft only, which roll does not train (full, lora, freeze)"),
    "module_dropout": Inert("read with finetuning_type: oft only, which roll does not train"),
    "freeze_trainable_modules": Inert("every module of the trained layers", only=("all",),
                                      use="freeze_trainable_layers trains whole layers"),
    "freeze_extra_modules": Inert("the default", only=(None,), use="freeze_trainable_layers trains whole layers"),
    "dpo_label_smoothing": Renamed("pref_label_smoothing"),
    "pref_bco_weight": _off("BCO is not available: pref_loss sigmoid, ipo or hinge", 0, 0.0),
    "ppo_*": PPO,
    "reward_model": PPO,
    "reward_model_adapters": PPO,
    "reward_model_quantization_bit": PPO,
    "reward_model_type": PPO,
    "ref_model_adapters": Inert("the default", only=(None,), use="ref_model: a merged model directory"),
    "ref_model_quantization_bit": Inert("the default", only=(None,), use="the reference model is not quantized"),
    "ld_alpha": Inert("the default", only=(None,), use="LD-DPO is not available"),
    "use_galore": _off("set optim (GaLore is not available)"),
    "galore_*": _with("use_galore"),
    "use_apollo": _off("set optim (APOLLO is not available)"),
    "apollo_*": _with("use_apollo"),
    "use_badam": _off("set optim (BAdam is not available)"),
    "badam_*": _with("use_badam"),
    "use_swanlab": _off("report_to: swanlab (HF Trainer's SwanLab integration)"),
    "swanlab_*": _with("use_swanlab"),
    # -- model -------------------------------------------------------------------------------------------
    "adapter_name_or_path": Inert("the default", only=(None,), use="start from a merged model (export_merged "
                                                                   "writes one), or resume_from_checkpoint"),
    "adapter_folder": Inert("the default", only=(None,), use="start from a merged model"),
    "use_fast_tokenizer": Inert("roll loads the fast tokenizer", only=(True,), use="roll loads the fast tokenizer"),
    "resize_vocab": _off("extend the vocabulary in the model's folder first"),
    "split_special_tokens": _off("special tokens stay whole"),
    "add_tokens": Inert("the default", only=(None,), use="extend the vocabulary in the model's folder first"),
    "add_special_tokens": Inert("the default", only=(None,), use="extend the vocabulary in the model's folder "
                                                                 "first"),
    "new_special_tokens_config": Inert("the default", only=(None,), use="extend the vocabulary in the model's "
                                                                        "folder first"),
    "init_special_tokens": _with("add_special_tokens"),
    "model_revision": Inert("the default", only=("main",), use="roll loads local directories: download that "
                                                               "revision"),
    "low_cpu_mem_usage": SPEED,
    "rope_scaling": Inert("the default", only=(None,), use="set rope_scaling in the model's config.json"),
    "flash_attn": Renamed("attn_implementation", _flash_attn,
                          "auto -> HF's choice, disabled -> eager, sdpa, fa2 -> flash_attention_2"),
    "shift_attn": _off("standard attention"),
    "mixture_of_depths": Inert("the default", only=(None,), use="mixture of depths is not available"),
    "use_unsloth": _off("HF's model (standard backend) or Megatron-Core's (use_mca)"),
    "use_unsloth_gc": _off("gradient_checkpointing: true"),
    "enable_liger_kernel": Renamed("use_liger_kernel"),
    "disable_gradient_checkpointing": Inert("memory only: roll checkpoints activations only with "
                                            "gradient_checkpointing: true (standard) or recompute_granularity (mca)"),
    "use_reentrant_gc": SPEED,
    "upcast_layernorm": _off("layer norms run in the training precision"),
    "upcast_lmhead_output": _off("the output layer runs in the training precision"),
    "train_from_scratch": _off("save a randomly initialised model and start from it"),
    "print_param_status": Inert("logging only"),
    "hf_hub_token": Inert("roll downloads no models (a Hub dataset reads HF_TOKEN)"),
    "ms_hub_token": Inert("roll downloads no models"),
    "om_hub_token": Inert("roll downloads no models"),
    "infer_backend": INFERENCE,
    "offload_folder": INFERENCE,
    "use_kv_cache": INFERENCE,
    "infer_dtype": INFERENCE,
    "vllm_*": INFERENCE,
    "sglang_*": INFERENCE,
    "quantization_bit": Inert("the default", only=(None,), use="QLoRA is not available: LoRA on the unquantized "
                                                              "model"),
    "quantization_method": _with("quantization_bit"),
    "quantization_type": _with("quantization_bit"),
    "double_quantization": _with("quantization_bit"),
    "quantization_device_map": _with("quantization_bit"),
    "image_do_pan_and_scan": _off("Gemma 3's pan and scan: roll trains Qwen-VL models, whose images are resized "
                                  "(image_max_pixels / image_min_pixels; docs/vl.md)"),
    "video_*": MULTIMODAL,
    "audio_sampling_rate": MULTIMODAL,
    "use_audio_in_video": MULTIMODAL,
    "crop_to_patches": MULTIMODAL,
    "use_kt": _off("KTransformers is not available"),
    "kt_*": _with("use_kt"),
    # -- training --------------------------------------------------------------------------------------
    "predict_with_generate": _off("roll-train trains; it does not generate"),
    "sortish_sampler": _off("the sample order is the data pipeline's: shuffle"),
    "generation_max_length": INFERENCE,
    "generation_num_beams": INFERENCE,
    "generation_config": INFERENCE,
    "ray_num_workers": Inert("the default", only=(1,), use="nproc_per_node and nnodes"),
    "ray_init_kwargs": Inert("the default", only=(None,), use="nproc_per_node and nnodes"),
    "enable_torch_profiler": _off("run PyTorch's profiler around roll-train"),
    "profiler_*": _with("enable_torch_profiler"),
    "profile_modules": _with("enable_torch_profiler"),
    "fp8": _off("bf16: true", None),
    "fp8_backend": _with("fp8"),
    "fp8_enable_fsdp_float8_all_gather": _with("fp8"),
    "use_v1_kernels": SPEED,
    # -- transformers 4's training arguments (LLaMA-Factory's transformers), gone from transformers 5 -------
    "evaluation_strategy": Renamed("eval_strategy"),
    "no_cuda": Renamed("use_cpu"),
    "per_gpu_train_batch_size": Renamed("per_device_train_batch_size"),
    "per_gpu_eval_batch_size": Renamed("per_device_eval_batch_size"),
    "logging_dir": Inert("logging only (TensorBoard's folder)"),
    "save_safetensors": Inert("roll writes safetensors", only=(True,), use="the HF model is written as "
                                                                          "safetensors"),
    "group_by_length": _off("the sample order is the data pipeline's: shuffle"),
    "torchdynamo": _off("torch_compile", None),
    "use_ipex": _off("the CPU runs PyTorch's own kernels"),
    "jit_mode_eval": _off("roll evaluates eval_loss in the training model"),
    "use_mps_device": _off("the device is picked by roll (CUDA, else CPU)"),
    "fp16_backend": SPEED,
    "half_precision_backend": SPEED,
    "fp16_opt_level": _with("apex (fp16_backend)"),
    "tpu_num_cores": Inert("TPUs are not used"),
    "tpu_metrics_debug": Inert("TPUs are not used"),
    "past_index": Inert("the default", only=(-1,), use="models with mems are not trained by roll"),
    "mp_parameters": Inert("SageMaker only"),
    "ray_scope": Inert("hyperparameter search only"),
    "include_tokens_per_second": Inert("logging only: train_log.jsonl records tokens per second"),
    "include_inputs_for_metrics": Inert("roll evaluates eval_loss only"),
    "use_legacy_prediction_loop": Inert("roll evaluates eval_loss only"),
    "dispatch_batches": _off("accelerator_config", None),
    "split_batches": _off("accelerator_config", None),
    "fsdp_min_num_params": _with("fsdp"),
    "fsdp_transformer_layer_cls_to_wrap": _with("fsdp"),
    "push_to_hub_model_id": _with("push_to_hub (hub_model_id)"),
    "push_to_hub_organization": _with("push_to_hub (hub_model_id)"),
    "push_to_hub_token": _with("push_to_hub (hub_token)"),
    # -- mcore_adapter's Megatron arguments (LLaMA-Factory's USE_MCA=1) ------------------------------------
    "accumulate_allreduce_grads_in_fp32": Inert(
        "LLaMA-Factory's Megatron path turns it on with bf16 (no effect in fp32); roll's grad_reduce_in_fp32 "
        "is on by default"),
    "sequence_packing": Renamed("packing", lambda v: True if v else DROP,
                                "mcore_adapter's packing without cross-attention, which is roll's packing"),
    "save_merged_model": Renamed("export_merged"),
    "cross_entropy_loss_fusion": SPEED,
    "moe_layer_recompute": SPEED,
    "moe_shared_expert_overlap": SPEED,
    "overlap_p2p_comm": SPEED,
    "delay_grad_reduce": SPEED,
    "ddp_bucket_size": SPEED,
    "ddp_average_in_collective": SPEED,
    "variable_seq_lengths": SPEED,
    "compile_warmup": SPEED,
    "masked_softmax_fusion": SPEED,
    "bias_dropout_fusion": SPEED,
    "gradient_accumulation_fusion": SPEED,
    "persist_layer_norm": SPEED,
    "check_for_nan_in_loss_and_grad": Inert("roll skips and counts non-finite steps itself "
                                            "(max_consecutive_skipped_steps)"),
    "ckpt_format": Inert("roll's checkpoints are Megatron's distributed format, reshardable"),
    "ckpt_d2h_non_blocking": SPEED,
    "distrib_optim_fully_reshardable": Inert("roll's checkpoints are reshardable"),
    "distrib_optim_fully_reshardable_mem_efficient": Inert("roll's checkpoints are reshardable"),
    "optimizer": Inert("Adam", only=("adam",), use="optim: adamw_torch (Megatron's Adam)"),
    "optimizer_offload_fraction": Inert("the default", only=(0, 0.0),
                                        use="optimizer_cpu_offload offloads the whole optimizer"),
    "recompute_modules": Inert("the default", only=(None,), use="recompute_granularity: selective (the attention "
                                                                "core) or full"),
    "moe_router_dtype": DEFAULT_MEGATRON,
    "moe_enable_routing_replay": _off("routing is recomputed each step"),
    "moe_pad_expert_input_to_capacity": _with("moe_expert_capacity_factor"),
    "moe_token_drop_policy": _with("moe_expert_capacity_factor"),
    "mtp_num_layers": Inert("the default", only=(0, None), use="multi-token prediction is not available"),
    "micro_batch_size": Renamed("per_device_train_batch_size"),
    "account_for_embedding_in_pipeline_split": _off("roll splits the decoder layers evenly", None),
    "account_for_loss_in_pipeline_split": _off("roll splits the decoder layers evenly", None),
    "pipeline_model_parallel_layout": Inert("the default", only=(None,), use="roll splits the decoder layers "
                                                                             "evenly"),
    "cuda_graph_impl": Inert("the default", only=(None,), use="CUDA graphs are not used"),
    "cuda_graph_scope": SPEED,
    "fp8_recipe": _with("fp8"),
    "fp8_param": _off("bf16: true"),
    "fp8_format": _with("fp8"),
    "use_flash_attn": Inert("an Ascend NPU attention switch: Megatron-Core picks its attention"),
    "use_flash_attn_npu_batch_invariant": Inert("an Ascend NPU attention switch"),
    "additional_configs": Inert("the default", only=(None, {}), use="roll's Megatron keys (roll-train --help)"),
}
"""LLaMA-Factory key (or ``*`` pattern) -> what roll does with it."""


def entry(key: str) -> Renamed | Inert | None:
    """The table's entry for ``key`` (an explicit name beats a pattern), or None."""
    if key in KEYS:
        return KEYS[key]
    return next((value for pattern, value in KEYS.items() if "*" in pattern and fnmatch.fnmatchcase(key, pattern)),
                None)


def translate(values: dict[str, Any], source: str, known: set[str]) -> dict[str, Any]:
    """``values`` (one recipe's or the command line's, already typed) with LLaMA-Factory's keys applied:
    renamed to roll's key, dropped with one info line, or refused (ConfigError naming the key). Keys in
    ``known`` (roll's own) and unknown keys pass unchanged."""
    from roll.logging import log_rank0

    out: dict[str, Any] = {}
    renamed: dict[str, str] = {}
    for key, value in values.items():
        found = None if key in known else entry(key)
        if found is None:
            out.setdefault(key, value)
            if key in renamed:
                _check_same(key, renamed[key], out[key], value, source)
            continue
        if isinstance(found, Inert):
            if found.only is not None and not _among(value, found.only):
                raise ConfigError(f"{key}={value!r} (LLaMA-Factory's key, in {source}) is not available in roll: "
                                  f"{found.use}.")
            log_rank0(logger, "%s: LLaMA-Factory's %s has no effect in roll (%s).", source, key, found.reason)
            continue
        converted = found.convert(value) if found.convert else value
        if converted is DROP:
            continue
        if found.target in out:
            _check_same(found.target, key, out[found.target], converted, source)
        out[found.target] = converted
        renamed[found.target] = key
    return out


def _among(value: Any, accepted: tuple) -> bool:
    """Whether ``value`` is one of ``accepted`` (true is not 1 here)."""
    return any(value == a and isinstance(value, bool) == isinstance(a, bool) for a in accepted)


def _check_same(target: str, key: str, first: Any, second: Any, source: str) -> None:
    if first != second:
        raise ConfigError(f"{key} (LLaMA-Factory's name) and {target} are the same key in roll, set to different "
                          f"values in {source} ({second!r} and {first!r}): give one of them.")
