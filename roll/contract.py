"""Values passed between the router and a backend (see backends/base.py for the interface)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable


@dataclass(frozen=True)
class DistributedInfo:
    """This process's place in the run, as the backend set it up."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    dp_rank: int = 0
    dp_size: int = 1


@dataclass
class ModelBundle:
    """The trainable model and, for DPO, the frozen reference model.

    ``policy`` is an HF ``PreTrainedModel`` (standard backend) or a ``list[nn.Module]`` of model
    chunks, one per virtual pipeline stage (mca backend).
    """

    policy: Any
    ref: Any | None = None


@dataclass
class TrainJob:
    """Everything the backend needs to train one stage; built by the router."""

    stage: str
    tokenizer: Any
    train_dataset: Any
    """A tokenized ``datasets.Dataset``, already in the one shared sample order."""
    collator: Callable[[list[dict]], dict]
    eval_dataset: Any | None = None


@dataclass
class TrainResult:
    """What training produced: per-step logs and where the outputs are."""

    log_history: list[dict] = field(default_factory=list)
    output_dir: str | None = None
    hf_model_dir: str | None = None
    """Directory with the final model in HF format (or the LoRA adapter), if written."""
    metrics: dict[str, float] = field(default_factory=dict)
