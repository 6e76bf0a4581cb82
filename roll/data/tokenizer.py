"""Tokenizer loading: the model's tokenizer, a named template installed into it (its stop words and EOS, its
chat template written as Jinja) or roll's built-in chat template, a pad token.

A named template's layout (roll.data.named_templates) decides the training rows; what it does to the tokenizer
is here: the tokenizer saved with the model prompts it the way it was trained.
"""

from __future__ import annotations

import json
import logging

from roll.data.named_templates import CONTENT, TEMPLATES, NamedTemplate, Slot, Special, check_template_options
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
    """Prepare the tokenizer for the named template ``name`` (``install``: its EOS, its
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


def _literal(text: str) -> str:
    return json.dumps(text)  # a Jinja string literal: Jinja reads \n and \uXXXX escapes as Python does


def _expression(slots: tuple[Slot, ...], content: str = "content") -> str:
    parts = []
    for slot in slots:
        if isinstance(slot, Special):
            parts.append(f"({slot.name}_token or '')")
            continue
        before, found, after = slot.partition(CONTENT)
        parts += ([_literal(before)] if before else []) + ([content] if found else []) + (
            [_literal(after)] if after else [])
    return " + ".join(parts) or "''"


def to_jinja(template: NamedTemplate) -> str:
    """A chat template (Jinja) that renders what the template trains on, to install in the tokenizer that is
    saved with the model, so that it is prompted the way it was trained (the reasoning templates' empty
    thought aside). The user slot ends with the assistant header: no generation prompt is needed."""
    t = template
    system = (f"{{% set system_message = {_literal(t.default_system)} %}}" if t.default_system else "")
    system += ("{% if messages and messages[0]['role'] == 'system' %}{% set loop_messages = messages[1:] %}"
               "{% set system_message = messages[0]['content'] %}{% else %}{% set loop_messages = messages %}"
               "{% endif %}")
    first = ""
    if t.system_in_first_user:
        text = next(s for s in t.system if isinstance(s, str))
        first = (f"{{% if loop.first and system_message %}}{{% set content = {_expression((text,), 'system_message')}"
                 " + content %}{% endif %}")
    else:
        system += f"{{% if system_message %}}{{{{ {_expression(t.system, 'system_message')} }}}}{{% endif %}}"
    prefix = f"{{{{ {_expression(t.prefix)} }}}}" if t.prefix else ""
    return (prefix + system + "{% for message in loop_messages %}{% set content = message['content'] %}" + first
            + f"{{% if message['role'] == 'user' %}}{{{{ {_expression(t.user)} }}}}"
            + f"{{% elif message['role'] == 'assistant' %}}{{{{ {_expression(t.assistant)} }}}}"
            + f"{{% elif message['role'] == 'tool' %}}{{{{ {_expression(t.observation)} }}}}"
            + "{% endif %}{% endfor %}")


def _is_token(tokenizer, text: str) -> bool:
    found = tokenizer.convert_tokens_to_ids(text)
    return found is not None and (found != tokenizer.unk_token_id or tokenizer.unk_token == text)


def install(tokenizer, template: NamedTemplate) -> None:
    """Make ``tokenizer`` what training with ``template`` needs, as LLaMA-Factory does: its stop words are
    special tokens (tokenized whole), the first one the EOS token with replace_eos (stage pt ends documents
    with it, generation stops at it); and ``to_jinja``'s chat template. A stop word that is no token of the
    tokenizer, where the template writes it or makes it the EOS, is refused: LLaMA-Factory would add it as a
    new token, which the model has no embedding row for (the model family's own tokenizer has them)."""
    t = template
    written = "".join(s for slots in (t.prefix, t.system, t.user, t.assistant, t.observation) for s in slots
                      if isinstance(s, str))
    needed = [w for i, w in enumerate(t.stop_words) if w in written or (i == 0 and t.replace_eos)]
    missing = [w for w in needed if not _is_token(tokenizer, w)]
    if missing:
        raise ConfigError(f"template {t.name} ends turns with {', '.join(map(repr, missing))}, which is no token "
                          "of this tokenizer (the model would need a new embedding row): choose the template of "
                          "the model's family, or leave `template:` unset to use the tokenizer's own.")
    special = set(tokenizer.all_special_tokens)
    extra = [w for w in t.stop_words if _is_token(tokenizer, w) and w not in special]
    if extra:
        tokenizer.add_special_tokens({"additional_special_tokens": extra}, replace_extra_special_tokens=False)
    if t.replace_eos:
        tokenizer.eos_token = t.stop_words[0]
    tokenizer.chat_template = to_jinja(t)


def pretrain_eos_id(tokenizer, template: NamedTemplate | None) -> int:
    """The token stage pt ends each document with: the template's own (llama3's <|end_of_text|>) when the
    tokenizer has it, else the tokenizer's EOS (after ``install``)."""
    if template is not None and template.pretrain_eos and _is_token(tokenizer, template.pretrain_eos):
        return tokenizer.convert_tokens_to_ids(template.pretrain_eos)
    return tokenizer.eos_token_id
