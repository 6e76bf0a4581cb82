"""Training arguments: every Hugging Face ``TrainingArguments`` field, plus the backend switch and launch sizes.

The class subclasses HF's so users keep every familiar key and its help text, but its
``__post_init__`` only validates: HF's own set-up (device and distributed initialisation,
DeepSpeed plugin) would run at config time. The standard backend builds the real HF object
with :meth:`TrainingArguments.hf_kwargs`; the Megatron backend reads the fields directly. Megatron's
own settings are a separate group (``roll.config.megatron.MegatronArguments``).
"""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass

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

    save_hf_model: bool = True
    """Write the final model in Hugging Face format (safetensors + config + tokenizer) to output_dir."""

    def __post_init__(self) -> None:  # noqa: D105 - deliberately not calling HF's (see module doc)
        positive = ("per_device_train_batch_size", "gradient_accumulation_steps", "nproc_per_node", "nnodes")
        for name in positive:
            if getattr(self, name) < 1:
                raise ConfigError(f"{name} must be >= 1, got {getattr(self, name)}.")
        if self.learning_rate < 0:
            raise ConfigError(f"learning_rate must be >= 0, got {self.learning_rate}.")
        if self.max_steps == 0 or self.max_steps < -1:
            raise ConfigError(f"max_steps must be a positive step count or -1 (use num_train_epochs), got {self.max_steps}.")
        if self.bf16 and self.fp16:
            raise ConfigError("bf16 and fp16 are both true: choose one precision.")
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
