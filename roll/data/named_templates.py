"""Chat templates by name (``template: qwen``), laid out token for token as LLaMA-Factory lays them out.

A recipe without ``template:`` keeps the tokenizer's own chat template (roll.data.templates). A name from
``TEMPLATES`` selects a template defined here by its slots, the way LLaMA-Factory's
``src/llamafactory/data/template.py`` defines the template of that name, so that a LLaMA-Factory recipe
trains on the same token ids with the same labels:

- Each message is a list of *slots*: text (``{{content}}`` stands for the message) or the tokenizer's
  ``BOS`` / ``EOS``. Every text slot is tokenized on its own (``add_special_tokens=False``) and the pieces
  are concatenated, so token boundaries fall where LLaMA-Factory's do.
- The first message carries the prefix and the system prompt (the row's own, else ``default_system``).
- Turn *i* pairs its prompt (user or tool message, whose slot ends with the assistant header) with its
  reply, whose slot includes what follows the end-of-turn token (``<|im_end|>\\n`` for ChatML): the whole
  reply slot is trained, newline included.
- ``efficient_eos`` templates (glm4) close a reply with no token: the label of the next prompt's first
  position is EOS instead, and one EOS ends the sequence.
- Reasoning templates (qwen3) put an empty ``<think>\\n\\n</think>\\n\\n`` before a reply that has none:
  trained with ``enable_thinking``, else part of the prompt.
- Tools (roll.data.tool_formats): a row's ``tools`` list is written in the template's tool format after the
  system prompt, inside its system slot; a ``function_call`` turn is a reply in the template's function
  slots (its calls in the tool format), trained as a reply; an ``observation`` turn is a prompt in the
  observation slots.

Truncation to ``cutoff_len`` (``split_lengths``) is LLaMA-Factory's: turns are taken in order (the last
first with ``train_on_last_turn_only`` / LLaMA-Factory's ``mask_history``) while the budget lasts; a turn
that does not fit keeps the start of its prompt and of its reply, in proportions that favour the reply.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace
from typing import Union

from roll import IGNORE_INDEX
from roll.data.formats import Skip
from roll.data.tool_formats import FORMATS as TOOL_FORMATS, calls_text, tools_text


@dataclass(frozen=True)
class Special:
    """A slot that is one of the tokenizer's own special tokens (left out when the tokenizer has none)."""

    name: str  # 'bos' or 'eos'


BOS, EOS = Special("bos"), Special("eos")
CONTENT = "{{content}}"
Slot = Union[str, Special]
Piece = Union[str, int]
"""A message as it is tokenized: text pieces (each tokenized on its own) and token ids."""

THOUGHT = ("<think>\n", "\n</think>\n\n")
"""The empty thought a reasoning template puts before a reply without one: THOUGHT[0] + THOUGHT[1]."""
TOOL_CALL = ("<tool_call>", "</tool_call>")
"""The words a function_call turn may put around its JSON (LLaMA-Factory's tool_call_words)."""


@dataclass(frozen=True)
class NamedTemplate:
    """One template's slots (the fields LLaMA-Factory's ``register_template`` takes, with its defaults)."""

    name: str
    user: tuple[Slot, ...] = (CONTENT,)
    assistant: tuple[Slot, ...] | None = None
    """Default: the reply then EOS (the reply alone with efficient_eos)."""
    system: tuple[Slot, ...] | None = None
    """Default: the system text alone (``{{content}}``), not the user slots."""
    observation: tuple[Slot, ...] | None = None
    """A tool result's slots; default: the user slots."""
    function: tuple[Slot, ...] | None = None
    """A function_call turn's slots; default: the assistant slots."""
    tool_format: str = "default"
    """How tool lists and calls are written (roll.data.tool_formats.FORMATS)."""
    prefix: tuple[Slot, ...] = ()
    default_system: str = ""
    stop_words: tuple[str, ...] = ()
    """End-of-turn tokens; with replace_eos the first becomes the tokenizer's EOS."""
    replace_eos: bool = False
    efficient_eos: bool = False
    reasoning: bool = False
    """Adds the empty thought (THOUGHT) to replies without one (LLaMA-Factory's ReasoningTemplate)."""
    system_in_first_user: bool = False
    """The system text goes inside the first user message (LLaMA-Factory's Llama2Template: mistral)."""
    pretrain_eos: str | None = None
    """The token stage pt ends each document with, when not the tokenizer's EOS (llama3)."""

    def __post_init__(self) -> None:
        if self.assistant is None:
            object.__setattr__(self, "assistant", (CONTENT,) if self.efficient_eos else (CONTENT, EOS))
        object.__setattr__(self, "system", self.system or (CONTENT,))
        object.__setattr__(self, "observation", self.observation or self.user)
        object.__setattr__(self, "function", self.function or self.assistant)


_CHATML_USER = "<|im_start|>user\n{{content}}<|im_end|>\n<|im_start|>assistant\n"
_QWEN = dict(user=(_CHATML_USER,), assistant=("{{content}}<|im_end|>\n",),
             system=("<|im_start|>system\n{{content}}<|im_end|>\n",),
             observation=("<|im_start|>user\n<tool_response>\n{{content}}\n</tool_response><|im_end|>\n"
                          "<|im_start|>assistant\n",),
             stop_words=("<|im_end|>",), replace_eos=True, tool_format="qwen")
_LLAMA3_HEADER = "<|start_header_id|>{role}<|end_header_id|>\n\n"

TEMPLATES: dict[str, NamedTemplate] = {t.name: t for t in (
    NamedTemplate("default", user=("Human: {{content}}", EOS, "\nAssistant:"), assistant=(CONTENT, EOS, "\n"),
                  system=("System: {{content}}", EOS, "\n")),
    NamedTemplate("empty", assistant=(CONTENT,)),
    NamedTemplate("chatml", user=(_CHATML_USER,), assistant=("{{content}}<|im_end|>\n",),
                  system=("<|im_start|>system\n{{content}}<|im_end|>\n",),
                  observation=("<|im_start|>tool\n{{content}}<|im_end|>\n<|im_start|>assistant\n",),
                  stop_words=("<|im_end|>", "<|im_start|>"), replace_eos=True),
    NamedTemplate("qwen", **_QWEN, default_system="You are Qwen, created by Alibaba Cloud. You are a helpful "
                                                  "assistant."),
    NamedTemplate("qwen3", **_QWEN, reasoning=True),
    NamedTemplate("qwen3_nothink", **_QWEN),
    NamedTemplate("qwen2_vl", **_QWEN, default_system="You are a helpful assistant."),
    NamedTemplate("llama3", user=(_LLAMA3_HEADER.format(role="user") + "{{content}}<|eot_id|>"
                                  + _LLAMA3_HEADER.format(role="assistant"),),
                  assistant=("{{content}}<|eot_id|>",),
                  system=(_LLAMA3_HEADER.format(role="system") + "{{content}}<|eot_id|>",),
                  observation=(_LLAMA3_HEADER.format(role="ipython") + "{{content}}<|eot_id|>"
                               + _LLAMA3_HEADER.format(role="assistant"),),
                  prefix=(BOS,), stop_words=("<|eot_id|>", "<|eom_id|>"), replace_eos=True,
                  pretrain_eos="<|end_of_text|>", tool_format="llama3"),
    NamedTemplate("mistral", user=("[INST] {{content}}[/INST]",), assistant=(" {{content}}", EOS),
                  system=("{{content}}\n\n",),
                  observation=('[TOOL_RESULTS] {"content": {{content}}}[/TOOL_RESULTS]',), prefix=(BOS,),
                  system_in_first_user=True, function=("[TOOL_CALLS] {{content}}", EOS), tool_format="mistral"),
    NamedTemplate("deepseek3", user=("<｜User｜>{{content}}<｜Assistant｜>",), prefix=(BOS,)),
    NamedTemplate("glm4", user=("<|user|>\n{{content}}<|assistant|>",), assistant=("\n{{content}}",),
                  system=("<|system|>\n{{content}}",), observation=("<|observation|>\n{{content}}<|assistant|>",),
                  prefix=("[gMASK]<sop>",), stop_words=("<|user|>", "<|observation|>"), efficient_eos=True,
                  function=("{{content}}",), tool_format="glm4"),
)}
"""The names ``template:`` accepts (LLaMA-Factory's layouts of the same names)."""


def _fill(slots: tuple[Slot, ...], content: str) -> list[Slot]:
    return [slot.replace(CONTENT, content, 1) if isinstance(slot, str) else slot for slot in slots]


def remove_thought(content: str) -> str:
    """The reply without its thought block(s) (and the newlines that led it)."""
    pattern = re.compile(f"{re.escape(THOUGHT[0])}(.*?){re.escape(THOUGHT[1])}", re.DOTALL)
    return pattern.sub("", content).lstrip("\n")


def _has_thought(content: str) -> bool:
    return THOUGHT[0].strip() in content or THOUGHT[1].strip() in content


@dataclass(frozen=True)
class TemplateEncoder:
    """A named template with the run's settings: conversations -> pieces -> (input_ids, labels)."""

    template: NamedTemplate
    default_system: str | None = None
    """Overrides the template's default system prompt (LLaMA-Factory's ``default_system``)."""
    enable_thinking: bool = True
    preserve_thinking: bool = False

    @property
    def system_default(self) -> str:
        return self.template.default_system if self.default_system is None else self.default_system

    def _messages(self, messages: list[dict]) -> tuple[str, list[dict]]:
        """(system text, the alternating user/assistant messages) of a validated conversation."""
        system = ""
        if messages and messages[0]["role"] == "system":
            system, messages = messages[0]["content"], messages[1:]
        for i, message in enumerate(messages):
            expected = ("user", "tool") if i % 2 == 0 else ("assistant",)
            if message["role"] not in expected:
                raise Skip("bad_turn_order")
        return system or self.system_default, [dict(m) for m in messages]

    def _encode(self, system: str, messages: list[dict], tools: str = "") -> list[list[Slot]]:
        """Each message's slots, in order (the first carries the prefix, the system prompt and the tools)."""
        t, encoded = self.template, []
        # LLaMA-Factory's Llama2Template (mistral) reads a call's content as JSON alone
        words = (None, None) if t.system_in_first_user else (THOUGHT, TOOL_CALL)
        for i, message in enumerate(messages):
            slots: list[Slot] = []
            content = message["content"]
            if i == 0:
                slots += list(t.prefix)
                if system or tools:
                    system = system + (tools_text(t.tool_format, tools) if tools else "")
                    if t.system_in_first_user:
                        content = next(s for s in _fill(t.system, system) if isinstance(s, str)) + content
                    else:
                        slots += _fill(t.system, system)
            if message.get("function_call"):
                role_slots, content = t.function, calls_text(t.tool_format, content, *words)
            else:
                role_slots = {"user": t.user, "tool": t.observation, "assistant": t.assistant}[message["role"]]
            encoded.append(slots + _fill(role_slots, content))
        return encoded

    def turns(self, messages: list[dict], last_turn_only: bool = False,
              tools: str = "") -> list[tuple[list[Slot], list[Slot]]]:
        """[(prompt slots, reply slots)] of every turn of a conversation (LLaMA-Factory's encode_multiturn);
        ``tools``: the row's tool list (JSON text, '' for none)."""
        system, messages = self._messages(messages)
        thinking = self.template.reasoning
        discard_history = thinking and last_turn_only and not self.preserve_thinking
        if thinking:
            for i in range(1, len(messages), 2):
                if not self.enable_thinking or (discard_history and i < len(messages) - 2):
                    messages[i]["content"] = remove_thought(messages[i]["content"])
        encoded = self._encode(system, messages, tools)
        if thinking:
            for i in ([len(messages) - 2] if discard_history else range(0, len(messages), 2)):
                self._add_thought(encoded, i, messages[i + 1]["content"])
        return [(encoded[i], encoded[i + 1]) for i in range(0, len(encoded), 2)]

    def _add_thought(self, encoded: list[list[Slot]], prompt: int, reply: str) -> None:
        if _has_thought(reply):
            return
        if self.enable_thinking:  # the empty thought is trained, as a part of the reply
            encoded[prompt + 1] = [THOUGHT[0] + THOUGHT[1]] + encoded[prompt + 1]
        else:
            encoded[prompt] = encoded[prompt] + [THOUGHT[0] + THOUGHT[1]]

    def one_turn(self, messages: list[dict], tools: str = "") -> tuple[list[Slot], list[Slot]]:
        """(everything before the last reply, the last reply): a preference pair's side
        (LLaMA-Factory's encode_oneturn)."""
        system, messages = self._messages(messages)
        if self.template.reasoning:
            if not self.preserve_thinking:
                for i in range(1, len(messages) - 2, 2):
                    messages[i]["content"] = remove_thought(messages[i]["content"])
            if not self.enable_thinking:
                messages[-1]["content"] = remove_thought(messages[-1]["content"])
        encoded = self._encode(system, messages, tools)
        if self.template.reasoning:
            self._add_thought(encoded, len(encoded) - 2, messages[-1]["content"])
        return [slot for slots in encoded[:-1] for slot in slots], encoded[-1]


def tokenize_slots(tokenizer, groups: list[list[Slot]]) -> list[list[int]]:
    """Token ids of each group of slots: every text slot tokenized on its own, BOS/EOS as the tokenizer's ids
    (nothing when it has none). One tokenizer call for all the texts."""
    texts = [slot for group in groups for slot in group if isinstance(slot, str) and slot]
    ids = iter(tokenizer(texts, add_special_tokens=False)["input_ids"] if texts else [])
    special = {"bos": tokenizer.bos_token_id, "eos": tokenizer.eos_token_id}
    out = []
    for group in groups:
        tokens: list[int] = []
        for slot in group:
            if isinstance(slot, Special):
                tokens += [special[slot.name]] if special[slot.name] is not None else []
            elif slot:
                tokens += next(ids)
        out.append(tokens)
    return out


def split_lengths(prompt_len: int, reply_len: int, budget: int) -> tuple[int, int]:
    """(prompt tokens kept, reply tokens kept) for a turn in ``budget`` tokens, each kept from its start.

    A reply shorter than half the budget is kept whole; else a prompt shorter than half is kept whole and
    the reply gets the rest; else both are cut in proportion to their lengths (LLaMA-Factory's
    ``infer_seqlen``, the same floating-point arithmetic)."""
    if reply_len * 2 < budget:
        reply_max = budget
    elif prompt_len * 2 < budget:
        reply_max = budget - prompt_len
    else:
        reply_max = int(budget * (reply_len / (prompt_len + reply_len)))
    reply = min(reply_max, reply_len)
    return min(max(budget - reply, 0), prompt_len), reply


def assemble(turns: list[tuple[list[int], list[int]]], cutoff_len: int, *, eos_id: int | None,
             efficient_eos: bool, train_on_prompt: bool, last_turn_only: bool):
    """[(prompt ids, reply ids)] -> (input_ids, labels, truncated), truncated to ``cutoff_len`` as
    LLaMA-Factory's supervised processor does (the module docstring)."""
    total = 1 if efficient_eos else 0
    order = list(reversed(turns)) if last_turn_only else turns
    kept: list[tuple[list[int], list[int]]] = []
    truncated = False
    for k, (prompt, reply) in enumerate(order):
        if total >= cutoff_len:
            truncated = True
            break
        p_keep, r_keep = split_lengths(len(prompt), len(reply), cutoff_len - total)
        truncated = truncated or (p_keep, r_keep) != (len(prompt), len(reply))
        prompt, reply = prompt[:p_keep], reply[:r_keep]
        total += p_keep + r_keep
        if train_on_prompt:
            prompt_labels = list(prompt)
        elif efficient_eos and k != 0 and p_keep:  # the previous reply's EOS, trained here
            prompt_labels = [eos_id] + [IGNORE_INDEX] * (p_keep - 1)
        else:
            prompt_labels = [IGNORE_INDEX] * p_keep
        reply_labels = [IGNORE_INDEX] * r_keep if last_turn_only and k != 0 else list(reply)
        kept.append((prompt + reply, prompt_labels + reply_labels))
    if last_turn_only:
        kept.reverse()
    input_ids = [tok for ids, _ in kept for tok in ids]
    labels = [lab for _, labs in kept for lab in labs]
    if efficient_eos:
        input_ids.append(eos_id)
        labels.append(eos_id)
    return input_ids, labels, truncated


def encoder_for(data_args) -> TemplateEncoder | None:
    """The run's TemplateEncoder, or None when ``template:`` is unset (the tokenizer's own template)."""
    if data_args.template is None:
        return None
    template = TEMPLATES[data_args.template]
    if getattr(data_args, "tool_format", None) is not None:  # LLaMA-Factory: calls as the reply then EOS
        template = replace(template, tool_format=data_args.tool_format,
                           function=(CONTENT,) if template.efficient_eos else (CONTENT, EOS))
    return TemplateEncoder(template, default_system=data_args.default_system,
                           enable_thinking=data_args.enable_thinking, preserve_thinking=data_args.preserve_thinking)


def check_template_options(name: str | None, train_on_prompt: bool, last_turn_only: bool,
                           tool_format: str | None = None) -> str | None:
    """What is wrong with these settings, or None (checked at config time)."""
    if tool_format is not None and (name is None or tool_format not in TOOL_FORMATS):
        return (f"tool_format={tool_format!r}: " + (f"choose one of {', '.join(TOOL_FORMATS)} (LLaMA-Factory's tool "
                "formats roll writes), or leave it unset for the template's own" if name is not None else
                "a tool format is a named template's (set template:); the tokenizer's own chat template lays "
                "tools out its own way") + ".")
    if name is not None and name not in TEMPLATES:
        from roll.config.coerce import closest  # late: roll.config imports this module

        hint = closest(name, TEMPLATES)
        return (f"unknown template {name!r}" + (f" (did you mean {hint!r}?)" if hint else "") + f"; choose one "
                f"of {', '.join(TEMPLATES)} (LLaMA-Factory's layouts of those names), or leave it unset to use "
                "the tokenizer's own chat template.")
    if train_on_prompt and last_turn_only:
        return ("train_on_prompt and train_on_last_turn_only (LLaMA-Factory's mask_history) contradict each "
                "other: one trains the prompts too, the other only the last reply; drop one.")
    if train_on_prompt and name is not None and TEMPLATES[name].efficient_eos:
        return (f"template {name} closes replies with no token of its own (efficient_eos), so its prompts "
                "carry the previous reply's EOS label and cannot be trained: drop train_on_prompt, as "
                "LLaMA-Factory requires.")
    return None
