"""Chat templates and the rendering that places loss masks.

Without ``template:`` conversations are laid out by the tokenizer's own chat template
(``apply_chat_template``); a named template (``template: qwen``) is laid out by roll.data.named_templates
instead. Masks are found on the rendered text, not by searching tokens afterwards: for each
assistant turn i, ``render(messages[:i], add_generation_prompt=True)`` must be a prefix of the full
rendering, and the reply's content follows it. The trainable span is the reply plus the end-of-turn
token right after it (the special token the template closes the turn with), so the model learns
to stop. Everything else (system, user turns, role headers) is prompt.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from roll.data.formats import RowError, Skip
from roll.data.named_templates import TEMPLATES
from roll.logging import warn_once

logger = logging.getLogger(__name__)

DEFAULT = (
    "{%- for message in messages %}"
    "{%- if message['role'] == 'system' %}{{ message['content'] + '\\n\\n' }}"
    "{%- elif message['role'] == 'user' %}{{ 'Human: ' + message['content'] + '\\n' }}"
    "{%- elif message['role'] == 'tool' %}{{ 'Observation: ' + message['content'] + '\\n' }}"
    "{%- else %}{{ 'Assistant: ' + message['content'] + (eos_token or '') + '\\n' }}{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{ 'Assistant: ' }}{%- endif %}"
)
"""The chat template installed in a tokenizer that has none when ``template:`` is unset (with a warning;
roll-train refuses such a run for sft and dpo, roll.preflight.check_chat_template)."""


@dataclass(frozen=True)
class Renderer:
    """Renders conversations with a tokenizer's chat template into (text, trainable) segments."""

    tokenizer: object
    end_of_turn: tuple[str, ...]
    """Candidate end-of-turn strings (special tokens), longest first."""
    chat_kwargs: tuple[tuple[str, object], ...] = ()
    """Extra variables for the chat template (``enable_thinking=False``)."""

    @classmethod
    def for_tokenizer(cls, tokenizer, enable_thinking: bool = True) -> "Renderer":
        specials = set(getattr(tokenizer, "all_special_tokens", []) or [])
        decoder = getattr(tokenizer, "added_tokens_decoder", {}) or {}
        specials |= {tok.content for tok in decoder.values() if getattr(tok, "special", False)}
        return cls(tokenizer, tuple(sorted((s for s in specials if s), key=len, reverse=True)),
                   () if enable_thinking else (("enable_thinking", False),))

    def render(self, messages: list[dict], add_generation_prompt: bool = False) -> str:
        """The template's text; a template that refuses the conversation (raise_exception) skips the row."""
        import jinja2

        try:
            return self.tokenizer.apply_chat_template(messages, tokenize=False,
                                                      add_generation_prompt=add_generation_prompt,
                                                      **dict(self.chat_kwargs))
        except jinja2.TemplateSyntaxError as exc:
            raise RowError(f"the chat template has a syntax error: {exc}") from None
        except jinja2.TemplateError:
            raise Skip("unrenderable") from None

    def turns(self, messages: list[dict], train_turns: str = "all") -> list[tuple[str, str, bool]]:
        """Split the rendered conversation into [(prompt_text, reply_text, trainable)], one per reply.

        prompt_text is everything between the previous reply and this one (role headers included);
        reply_text is the reply plus its end-of-turn token. The untrained tail after the last reply
        (e.g. ChatML's final newline) is dropped. train_turns: 'all' trains every assistant reply,
        'last' only the final one (earlier replies stay in the sequence, untrained).
        """
        full = self.render(messages)
        replies = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
        turns: list[tuple[str, str, bool]] = []
        cursor = 0
        for i in replies:
            start, end = self._reply_span(full, messages, i, cursor)
            turns.append((full[cursor:start], full[start:end], train_turns == "all" or i == replies[-1]))
            cursor = end
        return turns

    def _reply_span(self, full: str, messages: list[dict], i: int, cursor: int) -> tuple[int, int]:
        prefix = self.render(messages[:i], add_generation_prompt=True)
        if not full.startswith(prefix) or len(prefix) < cursor:
            raise RowError(f"the chat template does not render turn {i} incrementally (the rendering of "
                           f"the first {i} turns is not a prefix of the whole conversation), so the loss "
                           f"mask cannot be "
                           f"placed; set `template:` to one of {', '.join(TEMPLATES)}")
        content = messages[i]["content"].strip()
        start = full.find(content, len(prefix))
        if start < 0:
            raise RowError(f"the chat template does not render assistant turn {i} verbatim; "
                           f"set `template:` to one of {', '.join(TEMPLATES)}")
        end = start + len(content)
        end_of_turn = next((tok for tok in self.end_of_turn if full.startswith(tok, end)), "")
        if not end_of_turn:
            warn_once(logger, "the chat template closes assistant replies with no special token of this "
                              f"tokenizer (after the reply comes {full[end:end + 20]!r}), so the model is "
                              "not trained to stop; "
                              "use a template whose end-of-turn marker is a special token of the tokenizer.")
        return start, end + len(end_of_turn)
