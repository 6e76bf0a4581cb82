"""Weights that do not fit the model are an error, on both backends: one rule, one message.

A model directory whose ``config.json`` describes another architecture than its weights (a wrong
``model_type``, another family's config, an adapter directory given as a model) still "loads" in
transformers: every checkpoint tensor is reported UNEXPECTED, every model weight MISSING and initialised at
random, and training goes on from noise. Each backend compares what its loader wanted with what the
checkpoint holds and calls ``check_weights_match``; anything outside ``ALLOWED_MISSING`` /
``ALLOWED_UNEXPECTED`` stops the run with a ``ModelError`` that names a few keys and the likely cause.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterable

from roll.errors import ModelError

ALLOWED_MISSING = (
    (re.compile(r"(^|\.)rotary_emb\.inv_freq$"), "a rotary-embedding buffer (computed from the config)"),
    (re.compile(r"^(score|v_head|reward_head|value_head)\."), "a new reward / value head"),
)
"""Model weights a checkpoint may lack. A tied ``lm_head`` (``tie_word_embeddings: true``) is allowed too:
it is the embedding matrix. transformers' own per-model ignore lists are applied before we see the keys."""

ALLOWED_UNEXPECTED = (
    (re.compile(r"(^|\.)rotary_emb\.inv_freq$"), "rotary buffers that older checkpoints saved"),
    (re.compile(r"(^|\.)attn\.(bias|masked_bias)$"), "GPT-2-style causal-mask buffers"),
)
"""Checkpoint tensors a model may ignore."""

SHOWN = 3
"""How many keys of each kind a message names."""


def unexplained(keys: Iterable[str], allowed, *, tied: bool = False) -> list[str]:
    """``keys`` minus those an allowlist entry (or, with ``tied``, the tied ``lm_head``) explains; sorted."""
    left = []
    for key in keys:
        if tied and key.endswith("lm_head.weight"):
            continue
        if not any(pattern.search(key) for pattern, _ in allowed):
            left.append(key)
    return sorted(left)


def check_weights_match(model_dir: str, *, missing: Iterable[str], unexpected: Iterable[str],
                        mismatched: Iterable[str] = (), model_type: str | None = None, tied: bool = False,
                        checkpoint_size: int | None = None, key: str = "model_name_or_path") -> None:
    """ModelError naming the model weights the checkpoint in ``model_dir`` does not provide (``missing``),
    the checkpoint tensors the model does not use (``unexpected``) and those of another shape
    (``mismatched``, as 'name: checkpoint shape vs model shape'), beyond the allowlists.

    ``checkpoint_size``: how many tensors the checkpoint holds (to tell "none used" from "a few").
    """
    missing = unexplained(missing, ALLOWED_MISSING, tied=tied)
    unexpected = unexplained(unexpected, ALLOWED_UNEXPECTED)
    mismatched = sorted(mismatched)
    if not (missing or unexpected or mismatched):
        return
    parts = []
    if missing:
        parts.append(f"{len(missing)} weight(s) of the model are not in the checkpoint ({_some(missing)})")
    if unexpected:
        parts.append(f"{len(unexpected)} checkpoint tensor(s) are not used by the model "
                     f"({_some(unexpected)})")
    if mismatched:
        parts.append(f"{len(mismatched)} tensor(s) have another shape than config.json gives "
                     f"({_some(mismatched)})")
    cause = likely_cause(model_dir, missing, unexpected, mismatched, model_type, checkpoint_size)
    raise ModelError(f"{key}={model_dir!r}: the weights do not fit the model config.json describes "
                     f"(model_type {model_type!r}): {'; '.join(parts)}. Training would start from random "
                     f"weights. {cause}")


def likely_cause(model_dir: str, missing: list[str], unexpected: list[str], mismatched: list[str],
                 model_type: str | None, checkpoint_size: int | None) -> str:
    """One sentence on what the user most likely got wrong, from the shape of the mismatch."""
    if os.path.isfile(os.path.join(model_dir, "adapter_config.json")):
        return ("Likely cause: this is an adapter directory (adapter_config.json), not a model: set "
                "model_name_or_path to the base model it was trained from.")
    if mismatched and not (missing or unexpected):
        return ("Likely cause: config.json's sizes (hidden_size, intermediate_size, vocab_size, num heads) "
                "are not those of these weights: use the config.json that came with them.")
    if unexpected and checkpoint_size is not None and len(unexpected) >= checkpoint_size:
        return (f"Likely cause: config.json's model_type {model_type!r} (or architectures) is wrong: none of "
                "the checkpoint's tensors is used, so the weights belong to another family. Use the "
                "config.json that came with the weights.")
    if missing == ["lm_head.weight"] or (missing and all(k.endswith("lm_head.weight") for k in missing)):
        return ("Likely cause: the checkpoint has no output head but config.json says tie_word_embeddings: "
                "false; use the config.json that came with the weights.")
    return (f"Likely cause: config.json is of another family or variant than the weights (model_type "
            f"{model_type!r}; e.g. qwen2 vs qwen3 differ in attention biases and q/k norms), or the "
            "checkpoint is incomplete. Use the config.json and all weight files that came with the model.")


def _some(keys: list[str]) -> str:
    shown = ", ".join(keys[:SHOWN])
    return shown + (f" and {len(keys) - SHOWN} more" if len(keys) > SHOWN else "")
