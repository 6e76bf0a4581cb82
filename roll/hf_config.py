"""A model directory's Hugging Face ``config.json``, read as JSON (never ``AutoConfig``, which may reach the
network or run a model's own code): the one reader for roll's checks, tools and both backends."""

from __future__ import annotations

import os

from roll.errors import ModelError, RollError

HF_CONFIG_FILE = "config.json"
EXPERT_COUNT_KEYS = ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts")
"""The config.json names families give their routed experts' count (Qwen-MoE, Mixtral, DeepSeek / GLM, others):
the first one set wins."""


def hf_config_path(model_dir: str) -> str:
    return os.path.join(model_dir, HF_CONFIG_FILE)


def has_hf_config(model_dir: str | None) -> bool:
    return bool(model_dir) and os.path.isfile(hf_config_path(model_dir))


def read_hf_config(model_dir: str, what: str | None = None, error: type[RollError] = ModelError) -> dict:
    """``model_dir``'s config.json (it must exist: see ``has_hf_config``) as a dict; ``error`` naming ``what``
    (default: the file's path) when it is not a JSON object."""
    from roll.config.training import read_json_object  # lazily: roll.config's own checks read config.json

    path = hf_config_path(model_dir)
    return read_json_object(path, what or path, error)


def text_config(hf_config: dict) -> dict:
    """The text model's fields: a multimodal config's ``text_config``, else the config itself."""
    return hf_config.get("text_config") or hf_config
