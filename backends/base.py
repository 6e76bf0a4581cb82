"""The Backend interface both training backends implement.

The router (roll/router.py) drives a backend through these steps, in order::

    padding_policy -> setup_distributed -> load_models -> apply_finetuning -> train
    -> evaluate (when there is an eval set) -> save -> teardown

``padding_policy`` comes first because ``--dry-run`` needs it without starting any process group;
it must depend on the config only. ``teardown`` runs even when a step after setup_distributed raised.

Contract (DESIGN.md): both backends train on the same tokenized dataset in the same sample order,
with the shared collators shaped by ``padding_policy``, and report the same loss: the per-token mean
over the global batch. Outputs end in Hugging Face format.
"""

from __future__ import annotations

import abc
from typing import TYPE_CHECKING, ClassVar

from roll.contract import DistributedInfo, ModelBundle, TrainJob, TrainResult
from roll.data.policy import PaddingPolicy
from roll.errors import ConfigError
from roll.registry import register_backend

if TYPE_CHECKING:
    from roll.config import RunConfig

__all__ = ["Backend", "DistributedInfo", "ModelBundle", "PaddingPolicy", "TrainJob", "TrainResult",
           "register_backend"]


class Backend(abc.ABC):
    name: ClassVar[str] = "abstract"
    supported_stages: ClassVar[frozenset[str]] = frozenset()
    supported_finetuning_types: ClassVar[frozenset[str]] = frozenset()

    def __init__(self, config: RunConfig) -> None:
        self.config = config

    @classmethod
    def check_support(cls, stage: str, finetuning_type: str) -> None:
        """Raise ConfigError when this backend cannot run ``stage`` with ``finetuning_type``.

        Called during config validation, so it must not import heavy dependencies.
        """
        if stage not in cls.supported_stages:
            supported = ", ".join(sorted(cls.supported_stages)) or "none yet"
            raise ConfigError(f"stage {stage!r} is not supported by the {cls.name} backend (supported: {supported}).")
        if finetuning_type not in cls.supported_finetuning_types:
            supported = ", ".join(sorted(cls.supported_finetuning_types)) or "none yet"
            raise ConfigError(f"finetuning_type {finetuning_type!r} is not supported by the {cls.name} backend "
                              f"(supported: {supported}).")

    @classmethod
    def check_config(cls, config: RunConfig) -> None:
        """Raise ConfigError for settings this backend cannot honour (after check_support, at config
        time, so ``--print-config`` reports them too). Must not import heavy dependencies."""

    @abc.abstractmethod
    def setup_distributed(self) -> DistributedInfo:
        """Initialise torch.distributed (and model-parallel groups) if needed; idempotent."""

    @abc.abstractmethod
    def padding_policy(self, stage: str) -> PaddingPolicy:
        """How the shared collator must pad/shift batches for this backend and layout."""

    @abc.abstractmethod
    def load_models(self, stage: str, tokenizer) -> ModelBundle:
        """Load the policy model (and the reference model for dpo) from the configured paths."""

    @abc.abstractmethod
    def apply_finetuning(self, models: ModelBundle) -> ModelBundle:
        """Apply finetuning_type: LoRA adapters, freezing, or nothing (full)."""

    @abc.abstractmethod
    def train(self, job: TrainJob, models: ModelBundle) -> TrainResult:
        """Train with the per-token global-batch loss; log loss/lr/grad_norm/tokens per second on rank 0."""

    @abc.abstractmethod
    def evaluate(self, job: TrainJob, models: ModelBundle) -> dict[str, float]:
        """Loss (same definition as training) on job.eval_dataset."""

    @abc.abstractmethod
    def save(self, models: ModelBundle, tokenizer, output_dir: str) -> str:
        """Write the final model in HF format (native checkpoints are written during train); return the HF dir."""

    def teardown(self) -> None:
        """Release process groups so every rank exits cleanly."""
