"""The template a model family declares (config key table + weight mappings) and the registry.

A family file (``templates/<family>.py``) only *declares*: which HF config keys become which
Megatron fields (both ways), constants of the architecture, and a list of weight mappings. This
module does the generic work: building an ``McaModelConfig`` from an HF config, restoring the HF
config on export, and converting whole global state dicts in either direction.
"""

from __future__ import annotations

import copy
import importlib
import re
from dataclasses import dataclass
from functools import cached_property
from typing import Any, Callable

import torch

from backends.mca.models.mapping import Mapping, Match, compile_pattern
from roll.errors import ModelError

_TEMPLATES: dict[str, Template] = {}
FAMILY_MODULES = ("qwen2", "qwen3", "llama", "mistral", "qwen2_moe", "qwen3_moe", "glm4_moe", "deepseek_v3",
                  "mixtral", "qwen2_5_vl", "qwen2_vl", "qwen3_vl")


@dataclass(frozen=True)
class ConfigKey:
    """HF key (dotted path into the config dict) <-> Megatron field, with optional value converters."""

    hf: str
    mca: str
    to_mca: Callable[[Any], Any] | None = None
    to_hf: Callable[[Any], Any] | None = None


@dataclass
class Template:
    model_type: str
    config_keys: list[ConfigKey]
    constants: dict[str, Any]
    weights: list[Mapping]
    config_hook: Callable[[dict, dict], None] | None = None
    """Family-specific HF -> Megatron config logic (e.g. RoPE scaling) that a key table cannot express."""
    config_class: str = "McaModelConfig"
    """The ``backends.mca.models.config`` class the family's config is (McaMLAModelConfig: multi-latent attention)."""
    optional: tuple[str, ...] = ()
    """HF tensors a checkpoint may lack: their Megatron parameter then starts at zero (a reward head)."""
    ignored: tuple[str, ...] = ()
    """HF tensors a checkpoint may hold that this model does not use (a causal LM's head in a reward model)."""
    model_class: str = "megatron.core.models.gpt.GPTModel"
    """The GPTModel (sub)class the family builds (dotted path): a vision-language family's adds its vision tower to
    the first pipeline stage (``backends.mca.models.qwen2_5_vl``)."""
    on_disk: tuple = ()
    """Other spellings a checkpoint may store the HF tensors in (``fused_experts.Fused``: transformers 5's fused
    experts), read as the names the weight rows map."""
    @cached_property
    def _hf_regex(self) -> list[tuple[re.Pattern, Mapping, int]]:
        # Compiled on first use: a process converts one family, and get_template registers all twelve (487
        # patterns; compiling them all was 12-16 ms of every roll-convert and model load).
        return [(compile_pattern(name), mapping, pos) for mapping in self.weights for pos, name in enumerate(mapping.hf)]

    @cached_property
    def _mca_regex(self) -> list[tuple[re.Pattern, Mapping]]:
        return [(compile_pattern(mapping.mca), mapping) for mapping in self.weights]

    # ---- config -------------------------------------------------------------------------------
    def mca_config_kwargs(self, hf: dict) -> dict[str, Any]:
        """Megatron config fields for an HF config dict (key table, then constants, then the hook)."""
        out: dict[str, Any] = {}
        for key in self.config_keys:
            value = _get_path(hf, key.hf)
            if value is not None:
                out[key.mca] = key.to_mca(value) if key.to_mca else value
        out.update(self.constants)
        if self.config_hook is not None:
            self.config_hook(hf, out)
        return out

    def hf_config_dict(self, mca: Any) -> dict:
        """The original HF config with every mapped key taken back from the Megatron config."""
        hf = copy.deepcopy(mca.hf_config)
        for key in self.config_keys:
            if _get_path(hf, key.hf) is None:
                continue  # keep keys the original left unset as they were
            value = getattr(mca, key.mca)
            _set_path(hf, key.hf, key.to_hf(value) if key.to_hf else value)
        return hf

    # ---- weights ------------------------------------------------------------------------------
    def match_hf(self, name: str) -> tuple[Match, int]:
        """The mapping that consumes HF parameter ``name``; error listing known patterns if none does."""
        for regex, mapping, pos in self._hf_regex:
            m = regex.match(name)
            if m:
                return Match(mapping, {k: int(v) for k, v in m.groupdict().items()}), pos
        known = "\n  ".join(sorted({n for mp in self.weights for n in mp.hf}))
        raise ModelError(f"HF parameter {name!r} has no mapping in the {self.model_type!r} template. "
                         f"Known HF patterns:\n  {known}")

    def match_mca(self, name: str) -> Match:
        for regex, mapping in self._mca_regex:
            m = regex.match(name)
            if m:
                return Match(mapping, {k: int(v) for k, v in m.groupdict().items()})
        known = "\n  ".join(sorted(mp.mca for mp in self.weights))
        raise ModelError(f"Megatron parameter {name!r} has no mapping in the {self.model_type!r} template. "
                         f"Known Megatron patterns:\n  {known}")

    def hf_to_mca(self, hf_sd: dict[str, torch.Tensor], config: Any) -> dict[str, torch.Tensor]:
        """Convert a complete HF state dict (global names) to Megatron's canonical global names."""
        groups: dict[str, tuple[Match, list]] = {}
        for name in hf_sd:
            match, pos = self.match_hf(name)
            entry = groups.setdefault(match.mca_name, (match, [None] * len(match.mapping.hf)))
            entry[1][pos] = hf_sd[name]
        out = {}
        for mca_name, (match, tensors) in groups.items():
            missing = [n for n, t in zip(match.hf_names, tensors) if t is None]
            if missing:
                raise ModelError(f"{mca_name} needs HF parameters {missing}, which the checkpoint lacks.")
            out[mca_name] = match.mapping.to_mca(tensors, config)
        return out

    def mca_to_hf(self, mca_sd: dict[str, torch.Tensor], config: Any) -> dict[str, torch.Tensor]:
        """Exact inverse of ``hf_to_mca``."""
        out = {}
        for name, tensor in mca_sd.items():
            match = self.match_mca(name)
            out.update(zip(match.hf_names, match.mapping.to_hf(tensor, config)))
        return out


def register_template(template: Template) -> Template:
    if template.model_type in _TEMPLATES:
        raise ValueError(f"a template for model_type {template.model_type!r} is already registered")
    _TEMPLATES[template.model_type] = template
    return template


def get_template(model_type: str) -> Template:
    """The template for an HF ``model_type``; a clear error listing the supported families otherwise."""
    for module in FAMILY_MODULES:
        importlib.import_module(f"backends.mca.models.templates.{module}")
    if model_type not in _TEMPLATES:
        raise ModelError(f"model_type {model_type!r} has no Megatron conversion template. Supported families: "
                         f"{', '.join(sorted(_TEMPLATES))}. Train it with use_mca: false (the standard backend) "
                         "or add a template under backends/mca/models/templates/. (If the weights are of a "
                         "supported family, config.json's model_type is wrong: use the config.json that came "
                         "with them.)")
    return _TEMPLATES[model_type]


def template_for(config: Any) -> Template:
    """The template of a built model's config: its family's, or for a reward model (``reward_head``, stage rm)
    the family's with the 1-wide ``score`` head in place of ``lm_head`` (``backends.mca.models.reward``)."""
    template = get_template(config.hf_model_type)
    if getattr(config, "reward_head", False):
        from backends.mca.models.reward import reward_template

        return reward_template(template)
    return template


def _get_path(data: dict, path: str) -> Any:
    for part in path.split("."):
        if not isinstance(data, dict) or part not in data:
            return None
        data = data[part]
    return data


def _set_path(data: dict, path: str, value: Any) -> None:
    *parents, last = path.split(".")
    for part in parents:
        data = data.setdefault(part, {})
    data[last] = value
