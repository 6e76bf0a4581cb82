"""The whole run's configuration and its one cross-field validation step."""

from __future__ import annotations

import dataclasses
import enum
import logging
import os
from dataclasses import dataclass, field

from roll.config.data import DataArguments, check_streaming
from roll.config.key_table import refuse_unhonoured
from roll.config.finetuning import FinetuningArguments
from roll.config.layout import ParallelLayout
from roll.config.megatron import MegatronArguments
from roll.config.model import ModelArguments
from roll.config.training import TrainingArguments
from roll.data.dataset_info import check_sources
from roll.errors import ConfigError
from roll.hf_config import EXPERT_COUNT_KEYS, has_hf_config, hf_config_path, read_hf_config, text_config
from roll.logging import log_rank0, warn_once

logger = logging.getLogger(__name__)

GROUPS = {
    "model": ModelArguments,
    "data": DataArguments,
    "finetuning": FinetuningArguments,
    "training": TrainingArguments,
    "megatron": MegatronArguments,
}
"""Argument groups in --help / --print-config order. Keys are unique across groups (flat recipes)."""


@dataclass
class RunConfig:
    model: ModelArguments
    data: DataArguments
    finetuning: FinetuningArguments
    training: TrainingArguments
    megatron: MegatronArguments = field(default_factory=MegatronArguments)
    """Megatron-Core settings (read by the mca backend only)."""
    recipe_path: str | None = None
    explicit_keys: frozenset[str] = frozenset()
    """Keys set by the recipe or command line (the rest are defaults)."""
    layout: ParallelLayout | None = field(default=None, init=False)
    """The Megatron parallel layout, built once from ``megatron`` by validate() when use_mca is on."""

    @property
    def backend_name(self) -> str:
        return "mca" if self.training.use_mca else "standard"

    def validate(self) -> None:
        """Cross-field rules, run once after all overrides."""
        from roll.registry import get_backend_class

        backend_cls = get_backend_class(self.backend_name)
        backend_cls.check_support(self.finetuning.stage, self.finetuning.finetuning_type)
        refuse_unhonoured(self)  # the keys roll/config/coverage.py marks refused on this backend
        from roll.data.vision import check_config as vision_check_config

        vision_check_config(self)  # what a vision-language model cannot do yet (docs/vl.md), before mca's checks
        if self.training.use_mca:
            self._validate_mca()
        else:
            self._validate_standard()
        backend_cls.check_config(self)
        self._check_precision()
        evaluates = str(getattr(self.training.eval_strategy, "value", self.training.eval_strategy))
        if evaluates != "no" and not (self.data.val_size or self.data.eval_dataset):
            raise ConfigError(f"eval_strategy={evaluates} needs an evaluation set: set val_size (e.g. 0.1) "
                              "or eval_dataset, or eval_strategy: no.")
        check_streaming(self.data, self.training, self.finetuning.stage)
        check_sources(self.data)  # the names of LLaMA-Factory's dataset registry (dataset_dir)
        if self.finetuning.stage == "dpo" and self.data.packing:
            raise ConfigError("packing is not supported for stage dpo (pairs are collated chosen over rejected); "
                              "set packing: false.")
        if self.finetuning.stage == "pt" and self.data.packing and self.data.packing_algorithm == "llamafactory":
            from roll.data.packing import PT_LLAMAFACTORY_PACKING  # lazily: it imports the data stack

            raise ConfigError(PT_LLAMAFACTORY_PACKING)
        if self.finetuning.stage == "kto":
            self._check_kto()
        elif "kto_mismatched_rows" in self.explicit_keys and self.data.kto_mismatched_rows != "auto":
            raise ConfigError(f"kto_mismatched_rows={self.data.kto_mismatched_rows} only applies to stage: kto; "
                              f"drop it for stage {self.finetuning.stage}.")
        if self.finetuning.stage not in ("dpo", "kto") and ({"ref_model", "ref_free"} & self.explicit_keys):
            warn_once(logger, f"ref_model/ref_free are only used by stage dpo; ignored for stage {self.finetuning.stage}.")
        if self.finetuning.stage == "rm":
            from roll import reward

            reward.check_config(self)
        self._clamp_workers()

    def _check_kto(self) -> None:
        """KTO's reference point pairs each row's prompt with another row's reply: from its micro-batch (2 rows
        or more) or, kto_mismatched_rows: llamafactory (auto with a one-row micro-batch), from its
        tokenization batch."""
        if self.data.packing:
            raise ConfigError("packing is not supported for stage kto (each micro-batch is collated with its "
                              "mismatched rows); set packing: false.")
        t = self.training
        sizes = [("per_device_train_batch_size", t.per_device_train_batch_size)]
        if self.data.val_size or self.data.eval_dataset:
            sizes.append(("per_device_eval_batch_size", t.per_device_eval_batch_size))
        small = [(key, size) for key, size in sizes if size < 2]
        if self.data.kto_mismatched_rows == "auto":
            self.data.kto_mismatched_rows = "llamafactory" if small else "micro_batch"
            if small:
                log_rank0(logger, "stage kto with %s=%d: each row's mismatched row (the KL reference point) takes "
                          "the reply of the previous row of its tokenization batch, as LLaMA-Factory pairs them "
                          "(kto_mismatched_rows: llamafactory).", *small[0])
        for key, size in small if self.data.kto_mismatched_rows == "micro_batch" else ():
            raise ConfigError(
                f"stage kto with kto_mismatched_rows: micro_batch needs {key} >= 2, got {size}: each row's "
                "mismatched row takes the reply of another row of its micro-batch, and a micro-batch of one row "
                "pairs its prompt with its own reply (TRL refuses it too). Set it to 2 or more (lowering "
                "gradient_accumulation_steps keeps the global batch), or kto_mismatched_rows: llamafactory (or "
                "auto) to pair rows at tokenization time, as LLaMA-Factory does.")

    def _clamp_workers(self) -> None:
        """Worker counts above this machine's CPU cores start hundreds of processes for nothing: clamp them
        (one warning each). Each process of the node starts its own dataloader workers."""
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
        per_process = max(1, cores // self.training.nproc_per_node)
        lf_packing = (self.data.packing and self.data.packing_algorithm == "llamafactory") or (
            self.finetuning.stage == "kto" and self.data.kto_mismatched_rows == "llamafactory")
        for section, key, limit in ((self.data, "preprocessing_num_workers", cores),
                                    (self.training, "dataloader_num_workers", per_process)):
            value = getattr(section, key)
            if value is not None and value > limit and key == "preprocessing_num_workers" and lf_packing:
                warn_once(logger, f"{key}={value} is more than this machine's {cores} CPU core(s), kept: with "
                                  "packing_algorithm: llamafactory (kto_mismatched_rows: llamafactory) it sets the "
                                  "packed rows (the mismatched rows): LLaMA-Factory works per worker's shard.")
            elif value is not None and value > limit:
                warn_once(logger, f"{key}={value} is more than this machine's {cores} CPU core(s) allow"
                                  f"{' per process' if limit != cores else ''}; using {limit}.")
                setattr(section, key, limit)

    def _check_precision(self) -> None:
        """dtype (how the weights are loaded) and bf16 / fp16 (the compute precision) must not contradict."""
        dtype, training = self.model.dtype, self.training
        wanted = "bfloat16" if training.bf16 else "float16" if training.fp16 else None
        if wanted and dtype in ("bfloat16", "float16") and dtype != wanted:
            flag = "bf16" if training.bf16 else "fp16"
            raise ConfigError(f"dtype={dtype} contradicts {flag}=true (weights in {dtype}, computation in "
                              f"{wanted}): choose one precision, e.g. dtype: auto with {flag}: true.")

    def _validate_mca(self) -> None:
        self.layout = self.megatron.build_layout(self.training.world_size_from_launch,
                                                 moe=bool(self.model_num_experts()))
        if self.training.deepspeed:
            warn_once(logger, "deepspeed config ignored: the mca backend shards with Megatron-Core "
                              "(use_distributed_optimizer for ZeRO-1 style optimizer sharding).")
        num_layers = self.model_num_layers()
        if num_layers is not None:
            self.layout.check_num_layers(num_layers)
        self._check_model_divides_layout()
        self.layout.check_micro_batches(self.training.gradient_accumulation_steps)

    def _validate_standard(self) -> None:
        if not self.megatron.calculate_per_token_loss:
            raise ConfigError("calculate_per_token_loss=false is only available with use_mca=true; the standard "
                              "backend always uses the per-token mean over the global batch.")
        ignored = self.megatron.non_defaults()
        if ignored:
            warn_once(logger, "standard backend: ignoring Megatron-only settings "
                              + ", ".join(f"{n}={v}" for n, v in ignored.items()) + " (they apply with --use-mca).")

    def model_num_layers(self) -> int | None:
        """num_hidden_layers from a local model's config.json, or None when not known yet."""
        return self.model_hf_config().get("num_hidden_layers")

    def model_num_experts(self) -> int | None:
        """The routed experts of a local model's config.json (each family's name for them), or None: a dense
        model, or not known yet."""
        hf = self.model_hf_config()
        return next((hf[name] for name in EXPERT_COUNT_KEYS if isinstance(hf.get(name), int)), None)

    def model_hf_config(self) -> dict:
        """A local model's config.json (its text_config for a multimodal one); {} when not known yet."""
        path = self.model.model_name_or_path
        if not has_hf_config(path):
            return {}
        return text_config(read_hf_config(path, f"{hf_config_path(path)} (model_name_or_path)"))

    def _check_model_divides_layout(self) -> None:
        """Megatron splits attention heads and KV groups over TP ranks and experts over EP ranks; it asserts
        (a traceback per rank) when they do not divide, so say here which size to change."""
        hf, layout = self.model_hf_config(), self.layout
        heads = hf.get("num_attention_heads")
        sizes = [("num_attention_heads", heads, layout.tp, "tensor_model_parallel_size"),
                 ("num_key_value_heads", hf.get("num_key_value_heads") or heads, layout.tp,
                  "tensor_model_parallel_size"),
                 ("num_experts", self.model_num_experts(), layout.ep, "expert_model_parallel_size")]
        for name, count, size, key in sizes:
            if isinstance(count, int) and count % size:
                fits = ", ".join(str(d) for d in range(1, count + 1) if count % d == 0)
                raise ConfigError(f"{key}={size} does not divide the model's {name} ({count}): Megatron "
                                  f"gives each rank an equal share. Set {key} to one of {fits}.")

    def to_dict(self) -> dict[str, dict]:
        """Plain nested dict of every field, for --print-config and logging."""
        out: dict[str, dict] = {}
        for group in GROUPS:
            obj = getattr(self, group)
            out[group] = {f.name: _plain(getattr(obj, f.name)) for f in dataclasses.fields(obj) if f.init}
        return out


def _plain(value):
    if isinstance(value, enum.Enum):
        return value.value
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    return value
