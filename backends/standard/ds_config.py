"""Read and check the DeepSpeed JSON a recipe names, before any model is loaded.

DeepSpeed itself reports a bad combination deep inside engine set-up, after the models are
loaded, often as an assertion about batch sizes. These checks say which key to change instead.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from roll.config.training import read_deepspeed_json
from roll.errors import ConfigError

_BATCH_KEYS = {
    "train_micro_batch_size_per_gpu": "per_device_train_batch_size",
    "gradient_accumulation_steps": "gradient_accumulation_steps",
    "gradient_clipping": "max_grad_norm",
}
"""DeepSpeed keys that must agree with a recipe field (or be "auto", which HF fills in)."""


@dataclass(frozen=True)
class DeepSpeedSettings:
    """The parsed DeepSpeed config and the facts the backend branches on."""

    source: str
    """The file the config came from (or '<dict>'), for error messages."""
    config: dict[str, Any]
    zero_stage: int
    offload_optimizer: bool
    offload_param: bool

    @property
    def is_zero3(self) -> bool:
        return self.zero_stage == 3


def load_deepspeed_config(value: str | dict | None) -> DeepSpeedSettings | None:
    """Parse ``deepspeed:`` (a JSON file path or an inline dict); None when DeepSpeed is off."""
    if value is None or value == "" or value == {}:
        return None
    if isinstance(value, dict):
        source, config = "<dict>", value
    else:
        source, config = str(value), read_deepspeed_json(str(value))
    zero = config.get("zero_optimization", {}) or {}
    if not isinstance(zero, dict):
        raise ConfigError(f"deepspeed config {source}: 'zero_optimization' must be an object, got {zero!r}.")
    stage = zero.get("stage", 0)
    if stage not in (0, 1, 2, 3):
        raise ConfigError(f"deepspeed config {source}: zero_optimization.stage must be 0, 1, 2 or 3, "
                          f"got {stage!r}.")
    return DeepSpeedSettings(source=source, config=config, zero_stage=int(stage),
                             offload_optimizer=_offloads(zero, "offload_optimizer"),
                             offload_param=_offloads(zero, "offload_param"))


def _offloads(zero: dict, key: str) -> bool:
    device = (zero.get(key) or {}).get("device", "none")
    return device not in (None, "none")


def check_combination(ds: DeepSpeedSettings, training) -> None:
    """Reject settings DeepSpeed (or roll's use of it) cannot combine, naming the key to change.

    ``training`` is roll's TrainingArguments (only its HF fields are read).
    """
    where = f"deepspeed config {ds.source}"
    if ds.offload_param and not ds.is_zero3:
        raise ConfigError(f"{where}: offload_param needs zero_optimization.stage 3 "
                          f"(got stage {ds.zero_stage}); "
                          "use recipes/deepspeed/ds_z3_offload.json or remove offload_param.")
    if ds.offload_optimizer and ds.zero_stage == 0:
        raise ConfigError(f"{where}: offload_optimizer needs ZeRO stage 1, 2 or 3 (got stage 0).")
    if _enabled(ds.config, "bf16") is True and _enabled(ds.config, "fp16") is True:
        raise ConfigError(f"{where}: bf16.enabled and fp16.enabled are both true; "
                          "choose one (or use \"auto\").")
    for ds_key, recipe_key in _BATCH_KEYS.items():
        value = ds.config.get(ds_key, "auto")
        if value == "auto":
            continue
        try:
            agrees = float(value) == float(getattr(training, recipe_key))
        except (TypeError, ValueError):
            raise ConfigError(f"{where}: {ds_key} must be a number or \"auto\", got {value!r}.") from None
        if not agrees:
            raise ConfigError(f"{where}: {ds_key}={value} disagrees with the recipe's {recipe_key}="
                              f"{getattr(training, recipe_key)}; set it to \"auto\" so the recipe decides.")
    if ds.is_zero3:
        _check_zero3(ds, training, where)


def _check_zero3(ds: DeepSpeedSettings, training, where: str) -> None:
    zero = ds.config.get("zero_optimization", {})
    gather = zero.get("stage3_gather_16bit_weights_on_model_save",
                      zero.get("gather_16bit_weights_on_model_save", False))
    if training.save_hf_model and not gather:
        raise ConfigError(f"{where}: ZeRO-3 without stage3_gather_16bit_weights_on_model_save=true "
                          "cannot write the final HF model (the weights stay partitioned). "
                          "Set it to true, or save_hf_model=false.")


def _enabled(config: dict, key: str) -> Any:
    section = config.get(key) or {}
    return section.get("enabled", False) if isinstance(section, dict) else section
