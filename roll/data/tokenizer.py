"""Tokenizer loading: the model's tokenizer, an optional built-in chat template, a pad token."""

from __future__ import annotations

import logging

from roll.data.named_templates import TEMPLATES, check_template_options, install
from roll.data.templates import DEFAULT
from roll.errors import ConfigError, ModelError
from roll.logging import warn_once

logger = logging.getLogger(__name__)


def load_tokenizer(model_args, data_args):
    """Load ``tokenizer_name_or_path`` (default ``model_name_or_path``), apply ``template:``, set a pad."""
    from transformers import AutoTokenizer

    path = model_args.tokenizer_name_or_path or model_args.model_name_or_path
    if not path:
        raise ConfigError("no tokenizer: set model_name_or_path (or tokenizer_name_or_path).")
    try:
        tokenizer = AutoTokenizer.from_pretrained(path, trust_remote_code=model_args.trust_remote_code,
                                                  cache_dir=model_args.cache_dir)
    except (OSError, ValueError) as exc:
        raise ModelError(f"cannot load a tokenizer from {path!r}: {exc}") from exc
    apply_template(tokenizer, data_args.template)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
        warn_once(logger, f"tokenizer has no pad token; using eos {tokenizer.eos_token!r} for padding "
                          "(padding is masked out of attention and loss).")
    return tokenizer


def apply_template(tokenizer, name: str | None) -> None:
    """Prepare the tokenizer for the named template ``name`` (roll.data.named_templates.install: its EOS, its
    chat template); None keeps the tokenizer's own chat template (roll's fallback if it has none)."""
    if name is not None:
        problem = check_template_options(name, False, False)
        if problem:
            raise ConfigError(problem)
        install(tokenizer, TEMPLATES[name])
    elif not getattr(tokenizer, "chat_template", None):
        warn_once(logger, "the tokenizer has no chat template; using the built-in 'default' template "
                          "(set `template:` to choose another).")
        tokenizer.chat_template = DEFAULT
