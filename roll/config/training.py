"""Training arguments: every Hugging Face ``TrainingArguments`` field, plus the Megatron knobs.

The class subclasses HF's so users keep every familiar key and its help text, but its
``__post_init__`` only validates: HF's own set-up (device and distributed initialisation,
DeepSpeed plugin) would run at config time. The standard backend builds the real HF object
with :meth:`TrainingArguments.hf_kwargs`; the Megatron backend reads the fields directly.
"""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass
from typing import Literal

import transformers

from roll.errors import ConfigError, RollError

_HF_FIELDS = frozenset(f.name for f in dataclasses.fields(transformers.TrainingArguments))


def read_json_object(path: str, what: str, error: type[RollError] = ConfigError) -> dict:
    """The JSON object in an existing file; ``error`` naming ``what`` when it is not JSON or not an object."""
    try:
        with open(path, encoding="utf-8") as fh:
            content = json.load(fh)
    except json.JSONDecodeError as exc:
        raise error(f"{what} is not valid JSON: {exc}.") from None
    if not isinstance(content, dict):
        raise error(f"{what} must hold a JSON object, got {type(content).__name__}.")
    return content


def read_deepspeed_json(path: str) -> dict:
    """The DeepSpeed config file a recipe names, as a dict; a clear ConfigError when unusable."""
    if not os.path.isfile(path):
        raise ConfigError(f"deepspeed config file {path!r} does not exist. Use one of recipes/deepspeed/"
                          "ds_z0.json, ds_z2.json, ds_z3.json, ds_z3_offload.json or drop the 'deepspeed' key.")
    return read_json_object(path, f"deepspeed config {path!r}")


@dataclass
class TrainingArguments(transformers.TrainingArguments):
    output_dir: str = "outputs/roll"
    """Where checkpoints, logs and the final HF-format model are written."""

    use_mca: bool = False
    """Backend switch: true trains with Megatron-Core (mca), false with HF Trainer/TRL + DeepSpeed (standard)."""

    nproc_per_node: int = 1
    """Processes per node. >1 outside a launcher re-executes roll-train under torchrun or the deepspeed launcher."""

    nnodes: int = 1
    """Number of nodes (multi-node runs are started by your cluster launcher on each node)."""

    tensor_model_parallel_size: int = 1
    """[mca] Tensor parallel size (TP)."""

    pipeline_model_parallel_size: int = 1
    """[mca] Pipeline parallel size (PP)."""

    virtual_pipeline_model_parallel_size: int | None = None
    """[mca] Virtual pipeline stages per pipeline rank (VPP, interleaved 1F1B)."""

    context_parallel_size: int = 1
    """[mca] Context parallel size (CP): each sequence is split across CP ranks."""

    expert_model_parallel_size: int = 1
    """[mca] Expert parallel size (EP) for MoE models."""

    expert_tensor_parallel_size: int | None = None
    """[mca] Tensor parallel size inside each expert (ETP); default: TP."""

    sequence_parallel: bool = False
    """[mca] Shard layer-norm/dropout activations along the sequence over the TP group (forced on with TP>1 and EP>1)."""

    use_distributed_optimizer: bool = False
    """[mca] Shard optimizer state across data-parallel ranks (ZeRO-1 style)."""

    overlap_grad_reduce: bool = False
    """[mca] Overlap the gradient reduce-scatter/all-reduce with the backward pass."""

    overlap_param_gather: bool = False
    """[mca] Overlap the parameter all-gather with the forward pass (needs the distributed optimizer)."""

    recompute_granularity: Literal["full", "selective"] | None = None
    """[mca] Activation recomputation: full layers or selective (attention core)."""

    recompute_method: Literal["uniform", "block"] | None = None
    """[mca] With full recompute: how layers are grouped for recomputation."""

    recompute_num_layers: int | None = None
    """[mca] With full recompute: layers per recompute group (uniform) or recomputed layers per stage (block)."""

    moe_token_dispatcher_type: Literal["allgather", "alltoall"] = "alltoall"
    """[mca] MoE token dispatcher; alltoall accepts sequences of different lengths, allgather needs equal ones."""

    moe_grouped_gemm: bool = False
    """[mca] Run all local experts in one grouped GEMM (needs Transformer Engine on GPU)."""

    moe_aux_loss_coeff: float | None = None
    """[mca] Load-balancing auxiliary loss coefficient; default: the model config's router_aux_loss_coef."""

    calculate_per_token_loss: bool = True
    """Loss = sum of token losses / trainable tokens of the global batch. This is roll's loss definition on both backends; false falls back to Megatron's mean of micro-batch means (mca only, breaks backend parity)."""

    transformer_impl: Literal["auto", "local", "transformer_engine"] = "auto"
    """[mca] Layer implementation: Transformer Engine when importable on a GPU ('auto'), else Megatron's local spec."""

    save_hf_model: bool = True
    """Write the final model in Hugging Face format (safetensors + config + tokenizer) to output_dir."""

    def __post_init__(self) -> None:  # noqa: D105 - deliberately not calling HF's (see module doc)
        positive = ("per_device_train_batch_size", "gradient_accumulation_steps", "nproc_per_node", "nnodes",
                    "tensor_model_parallel_size", "pipeline_model_parallel_size", "context_parallel_size",
                    "expert_model_parallel_size")
        for name in positive:
            if getattr(self, name) < 1:
                raise ConfigError(f"{name} must be >= 1, got {getattr(self, name)}.")
        if self.learning_rate < 0:
            raise ConfigError(f"learning_rate must be >= 0, got {self.learning_rate}.")
        if self.max_steps == 0 or self.max_steps < -1:
            raise ConfigError(f"max_steps must be a positive step count or -1 (use num_train_epochs), got {self.max_steps}.")
        if self.bf16 and self.fp16:
            raise ConfigError("bf16 and fp16 are both true: choose one precision.")
        if self.overlap_param_gather and not self.use_distributed_optimizer:
            raise ConfigError("overlap_param_gather=true needs use_distributed_optimizer=true.")
        if isinstance(self.deepspeed, str):
            read_deepspeed_json(self.deepspeed)

    @property
    def world_size_from_launch(self) -> int:
        """World size: the launcher's WORLD_SIZE when running under one, else nproc_per_node * nnodes."""
        if "WORLD_SIZE" in os.environ:
            return int(os.environ["WORLD_SIZE"])
        return self.nproc_per_node * self.nnodes

    def hf_kwargs(self) -> dict:
        """The HF ``TrainingArguments`` fields as constructor kwargs (for HF/TRL config classes)."""
        return {name: getattr(self, name) for name in _HF_FIELDS if name in self.__dataclass_fields__
                and self.__dataclass_fields__[name].init}

    @property
    def mca_field_names(self) -> list[str]:
        """Fields that only the Megatron backend reads (documented with an [mca] prefix)."""
        from roll.config.docs import field_doc
        return [f.name for f in dataclasses.fields(self) if field_doc(type(self), f).startswith("[mca]")]
