"""The key-coverage table's rows for training: Hugging Face's TrainingArguments and roll's own keys
(roll.config.coverage holds the rest of the table and ALL_ROWS; its docstring says what a row means)."""

from __future__ import annotations

from roll.config.key_status import PARITY, Honoured, NoEffect, Refused, Row
from roll.config.key_status import row as _row

HF = Honoured("tests/unit/test_startup.py::test_roll_training_arguments_hand_hf_every_field",
              "passed to HF Trainer unchanged: transformers' meaning")
SCHEDULE = ("tests/distributed/test_mca_param_groups.py::"
            "test_weight_decay_and_an_hf_schedule_match_the_standard_backend")
RESUME_MCA = "tests/distributed/test_mca_train.py::test_resume_reproduces_the_uninterrupted_run"
RESUME_STD = "tests/unit/test_standard_train.py::test_resume_reproduces_the_uninterrupted_run"
SAVE_ASYNC = ("tests/distributed/test_reliability.py::"
              "test_sigkill_inside_an_async_save_resumes_as_a_sync_save_does")
MID_EVAL = "tests/distributed/test_mca_train.py::test_mid_run_eval_at_the_same_steps_with_the_same_eval_loss"
LAUNCH = "tests/unit/test_cli.py::test_launch_command_uses_torchrun_or_deepspeed"
SLURM_SIGNALS = "tests/distributed/test_slurm_dist.py::test_srun_tasks_signal_burst_then_the_requeued_job_resumes"
LOGGING = NoEffect("logging only: what and where train_log.jsonl, the console and reporters show")
SPEED = NoEffect("data-loading speed and memory only; the batches are the same")
METRICS = NoEffect("roll evaluates eval_loss only (no compute_metrics): nothing for the key to change")
RECOMPUTE = "recompute_granularity: full (with recompute_method: uniform and recompute_num_layers: 1)"
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
