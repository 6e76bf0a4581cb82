"""McaModelConfig: a Megatron ``TransformerConfig`` that also saves/loads itself like an HF config.

It is built from an HF ``config.json`` through the family template's config key table
(``backends/mca/models/templates``), carries the verbatim HF config so export restores it, and
validates the parallel layout against the architecture before any model is built, with errors that
name the numbers (Megatron's own asserts fire later and say less).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from megatron.core.transformer import TransformerConfig
from megatron.core.transformer.transformer_config import MLATransformerConfig

from roll.config.layout import check_num_layers
from roll.errors import ConfigError, ModelError
from roll.logging import log_rank0, warn_once

if TYPE_CHECKING:
    from roll.config.megatron import MegatronArguments

logger = logging.getLogger(__name__)

MCA_CONFIG_NAME = "mca_config.json"
_ACTIVATIONS = {"silu": F.silu, "gelu": F.gelu}
_PARALLEL_FIELDS = ("tensor_model_parallel_size", "pipeline_model_parallel_size",
                    "virtual_pipeline_model_parallel_size", "context_parallel_size", "expert_model_parallel_size",
                    "expert_tensor_parallel_size", "sequence_parallel")
_DISTRIBUTE_FIELDS = ("tensor_model_parallel_size", "pipeline_model_parallel_size",
                      "virtual_pipeline_model_parallel_size", "expert_model_parallel_size",
                      "expert_tensor_parallel_size", "transformer_impl")


@dataclass
class McaModelConfig(TransformerConfig):
    """Megatron transformer config plus what GPTModel and HF export need (vocab, RoPE, tying)."""

    hf_model_type: str = ""
    """The HF ``model_type`` whose template converts this model's weights."""

    hf_config: dict = field(default_factory=dict)
    """The original HF config.json, verbatim: export writes it back so HF loads the result."""

    vocab_size: int = 0
    """The tokenizer-facing vocabulary (HF ``vocab_size``); the embedding may be padded beyond it."""

    make_vocab_size_divisible_by: int = 1
    """The padded vocab is a multiple of this times TP (1: pad only as much as TP needs)."""

    max_sequence_length: int = 4096
    position_embedding_type: str = "rope"
    rotary_base: float = 10000.0
    rotary_percent: float = 1.0
    rope_scaling: bool = False
    """Llama-3.x frequency scaling (Megatron fixes low/high freq factors 1/4 and 8192 original context)."""

    rope_scaling_factor: float = 8.0
    tie_embeddings_and_output_weights: bool = False
    activation: str = "silu"
    """Name of the MLP activation; ``activation_func`` is derived from it (callables do not serialise)."""

    transformer_impl: str = "local"
    """'local' (Megatron's torch modules) or 'transformer_engine': decides the weight naming layout."""

    reward_head: bool = False
    """Stage rm: the output layer is a 1-wide score head (HF's ``score``, no bias, whole on every TP rank) in
    place of the vocabulary projection (``backends.mca.models.reward``)."""

    def __post_init__(self) -> None:
        if self.activation not in _ACTIVATIONS:
            raise ConfigError(f"activation {self.activation!r} is not supported; choose one of {sorted(_ACTIVATIONS)}.")
        self.activation_func = _ACTIVATIONS[self.activation]
        if self.transformer_impl not in ("local", "transformer_engine"):
            raise ConfigError(f"transformer_impl must be 'local' or 'transformer_engine', got {self.transformer_impl!r}.")
        self._check_layout()
        if self.variable_seq_lengths and self.num_moe_experts and self.moe_token_dispatcher_type == "allgather":
            log_rank0(logger, "moe_token_dispatcher_type set to 'alltoall': allgather cannot handle varying lengths.")
            self.moe_token_dispatcher_type = "alltoall"
        if self.pipeline_model_parallel_size > 1 and self.pipeline_dtype is None:
            self.pipeline_dtype = self.params_dtype
        super().__post_init__()

    def _check_layout(self) -> None:
        """The architecture/layout rules, checked before Megatron's less specific asserts."""
        tp, pp = self.tensor_model_parallel_size, self.pipeline_model_parallel_size
        check_num_layers(self.num_layers, pp, self.virtual_pipeline_model_parallel_size)
        groups = self.num_query_groups or self.num_attention_heads
        for name, value in (("num_attention_heads", self.num_attention_heads), ("num_query_groups", groups)):
            if value % tp:
                raise ConfigError(f"tensor_model_parallel_size({tp}) does not divide {name}({value}) of this model. "
                                  f"Choose a TP that divides {value}.")
        experts, ep = self.num_moe_experts, self.expert_model_parallel_size
        if ep > 1 and not experts:
            raise ConfigError(f"expert_model_parallel_size({ep}) > 1 but the model has no experts. Set it to 1.")
        if experts and experts % ep:
            raise ConfigError(f"expert_model_parallel_size({ep}) does not divide num_moe_experts({experts}).")
        if experts and self.moe_router_load_balancing_type == "none" and self.moe_aux_loss_coeff:
            raise ConfigError(f"moe_aux_loss_coeff={self.moe_aux_loss_coeff}: model_type {self.hf_model_type!r} has no "
                              "load-balancing loss (it balances its experts with the router's score-correction "
                              "bias, and its HF implementation computes none). Set moe_aux_loss_coeff: 0 (or leave "
                              "it out).")
        # The sequence-parallel rule is applied once, by ParallelLayout (parallel_overrides passes the
        # resolved value); here a config built by hand must already obey it.
        if self.sequence_parallel and tp == 1:
            raise ConfigError("sequence_parallel=true needs tensor_model_parallel_size > 1 (Megatron refuses it at TP1).")
        if tp > 1 and ep > 1 and not self.sequence_parallel:
            raise ConfigError(f"tensor_model_parallel_size({tp}) > 1 with expert_model_parallel_size({ep}) > 1 needs "
                              "sequence_parallel=true (ParallelLayout turns it on for a run).")

    @property
    def padded_vocab_size(self) -> int:
        """``vocab_size`` rounded up to a multiple of ``make_vocab_size_divisible_by * TP``."""
        multiple = self.make_vocab_size_divisible_by * self.tensor_model_parallel_size
        return -(-self.vocab_size // multiple) * multiple

    def is_moe_layer(self, layer: int) -> bool:
        """Whether global decoder layer ``layer`` (from 0) has experts (``moe_layer_freq``: every N-th layer, or
        a 0/1 list such as DeepSeek's and GLM's dense first layers)."""
        if not self.num_moe_experts:
            return False
        freq = self.moe_layer_freq
        return bool(freq[layer]) if isinstance(freq, list) else layer % freq == 0

    @property
    def num_layers_per_chunk(self) -> int:
        return self.num_layers // (self.pipeline_model_parallel_size * (self.virtual_pipeline_model_parallel_size or 1))

    def distribute_config_match(self, other: McaModelConfig) -> bool:
        """True when a checkpoint written with ``other``'s layout has exactly this layout's shards."""
        return all(getattr(self, name) == getattr(other, name) for name in _DISTRIBUTE_FIELDS)

    def to_dict(self) -> dict[str, Any]:
        """JSON-able fields that differ from the dataclass defaults (callables are rebuilt from names)."""
        out: dict[str, Any] = {}
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            default = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
            if isinstance(value, torch.dtype):
                value = str(value).removeprefix("torch.")
            elif not _is_json(value) or f.name in ("activation_func",):
                continue
            if value != default or f.name in ("hf_model_type", "vocab_size"):
                out[f.name] = value
        if out.get("expert_tensor_parallel_size") == self.tensor_model_parallel_size:
            del out["expert_tensor_parallel_size"]  # Megatron's default (= TP): re-derived at any new TP
        out["config_class"] = type(self).__name__
        return out

    @classmethod
    def from_dict(cls, data: dict[str, Any], **overrides: Any) -> McaModelConfig:
        data = {**data, **overrides}
        config_class = data.pop("config_class", cls.__name__)
        if config_class != cls.__name__:
            if cls is McaModelConfig and config_class in _CONFIG_CLASSES:
                return _CONFIG_CLASSES[config_class].from_dict(data)
            raise ModelError(f"{MCA_CONFIG_NAME} was written for {config_class}; this version of roll only builds "
                             f"{', '.join(_CONFIG_CLASSES)}.")
        names = {f.name: f for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - set(names))
        if unknown:
            raise ModelError(f"{MCA_CONFIG_NAME} has keys {unknown} that this version of {cls.__name__} does not know.")
        for key in ("params_dtype", "pipeline_dtype", "autocast_dtype"):
            if isinstance(data.get(key), str):
                data[key] = getattr(torch, data[key])
        return cls(**data)

    def save_pretrained(self, out_dir: str) -> str:
        os.makedirs(out_dir, exist_ok=True)
        path = os.path.join(out_dir, MCA_CONFIG_NAME)
        with open(path, "w", encoding="utf-8") as fh:
            json.dump(self.to_dict(), fh, indent=2, sort_keys=True)
        return path

    @classmethod
    def from_pretrained(cls, path: str, **overrides: Any) -> McaModelConfig:
        """Load ``mca_config.json`` from a directory; ``overrides`` (e.g. a new layout) win."""
        file = os.path.join(path, MCA_CONFIG_NAME) if os.path.isdir(path) else path
        if not os.path.isfile(file):
            raise ModelError(f"{path!r} has no {MCA_CONFIG_NAME}: it is not a roll Megatron checkpoint.")
        with open(file, encoding="utf-8") as fh:
            return cls.from_dict(json.load(fh), **overrides)

    @classmethod
    def from_hf(cls, hf_config: dict[str, Any], **overrides: Any) -> McaModelConfig:
        """Build from an HF config dict through its family template; ``overrides`` (layout, dtype) win."""
        from backends.mca.models.template import get_template

        model_type = hf_config.get("model_type")
        if not model_type:
            raise ModelError("the HF config has no 'model_type': cannot pick a conversion template.")
        template = get_template(model_type)
        kwargs = template.mca_config_kwargs(hf_config)
        verbatim = json.loads(json.dumps(hf_config))  # JSON-normalised (e.g. int keys of id2label)
        kwargs.update(hf_model_type=model_type, hf_config=verbatim, use_cpu_initialization=True)
        kwargs.update(overrides)
        return _CONFIG_CLASSES[template.config_class](**kwargs)


@dataclass
class McaMLAModelConfig(McaModelConfig, MLATransformerConfig):
    """``McaModelConfig`` of a multi-latent-attention model (DeepSeek-V3): Megatron's MLA fields too (q/kv LoRA
    ranks, the RoPE and non-RoPE head parts, YaRN). Megatron builds MLA from the config's class."""


_CONFIG_CLASSES = {cls.__name__: cls for cls in (McaModelConfig, McaMLAModelConfig)}
"""The config classes a template may name (``Template.config_class``), by the name mca_config.json records."""


def parallel_overrides(megatron: MegatronArguments | None = None, *, bf16: bool = False,
                       fp16: bool = False) -> dict[str, Any]:
    """The McaModelConfig fields a run sets: layout, vocab padding, recompute, MoE, loss, precision.

    ``megatron`` is the run's ``MegatronArguments`` (None: its defaults, TP1 ... on the resolved
    transformer_impl). Its ``sequence_parallel`` must be the value the run's ParallelLayout resolved
    (``MegatronArguments.build_layout`` writes it back). ``bf16``/``fp16`` are the training precision flags.
    """
    from backends.mca.spec import resolve_transformer_impl
    from roll.config.megatron import MegatronArguments

    m = megatron if megatron is not None else MegatronArguments()
    out: dict[str, Any] = {name: getattr(m, name) for name in _PARALLEL_FIELDS}
    impl = resolve_transformer_impl(m.transformer_impl)
    out.update(_fusions(m, impl))
    out.update(transformer_impl=impl,
               make_vocab_size_divisible_by=m.make_vocab_size_divisible_by,
               moe_token_dispatcher_type=m.moe_token_dispatcher_type, moe_grouped_gemm=m.moe_grouped_gemm,
               calculate_per_token_loss=m.calculate_per_token_loss)
    for name in ("recompute_granularity", "recompute_method", "recompute_num_layers", "moe_aux_loss_coeff"):
        if getattr(m, name) is not None:  # None: keep the model config's value
            out[name] = getattr(m, name)
    if m.moe_z_loss_coeff:  # Megatron computes the z-loss whenever its coefficient is not None
        out["moe_z_loss_coeff"] = m.moe_z_loss_coeff
    if bf16:
        out.update(bf16=True, params_dtype=torch.bfloat16)
    elif fp16:
        out.update(fp16=True, params_dtype=torch.float16)
    return out


FUSIONS = ("bias_activation_fusion", "apply_rope_fusion")
"""Megatron's fused kernels a recipe may ask for (LLaMA-Factory's Megatron recipes do): Transformer Engine's."""


def _fusions(m: MegatronArguments, impl: str) -> dict[str, bool]:
    """The fusion flags asked for, where Transformer Engine runs the layers; on the local spec they stay off
    (its layers have no fused kernels to switch on) and one info line says so."""
    asked = {name: True for name in FUSIONS if getattr(m, name)}
    if impl == "transformer_engine" or not asked:
        return asked
    warn_once(logger, f"{', '.join(asked)}: no effect here (Megatron-Core's local layers, no Transformer Engine): "
                      "the same training without the fused kernels.", level=logging.INFO)
    return {}


def _is_json(value: Any) -> bool:
    if value is None or isinstance(value, (bool, int, float, str)):
        return True
    if isinstance(value, (list, tuple)):
        return all(_is_json(v) for v in value)
    if isinstance(value, dict):
        return all(isinstance(k, str) and _is_json(v) for k, v in value.items())
    return False
