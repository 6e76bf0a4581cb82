"""Row formats (alpaca, sharegpt/OpenAI messages, pairwise, text) -> one canonical shape.

Canonical shapes:
- conversation: ``[{"role": "system"|"user"|"assistant"|"tool", "content": str}, ...]``
- pair: ``(prompt_messages, chosen: str, rejected: str)``
- text: ``str``

A structurally broken row (wrong type, missing field) raises :class:`RowError`, which the
processor turns into a DataError naming the file and row. A row that is well-formed but cannot be
trained on raises :class:`Skip` with a reason from ``stats.DROP_REASONS``; it is counted.
"""

from __future__ import annotations

from typing import Any

FORMATS = ("alpaca", "sharegpt", "pairwise", "text")

SHAREGPT_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant",
                  "system": "system", "function_call": "assistant", "observation": "tool", "tool": "tool",
                  "function": "tool"}
"""sharegpt ``from`` tags and OpenAI ``role`` names -> canonical role."""


class RowError(ValueError):
    """A row does not have the expected structure (the message says what was expected)."""


class Skip(Exception):
    """A row is skipped for a counted reason."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


def detect(columns: list[str]) -> str | None:
    """The format implied by a dataset's columns, or None."""
    cols = set(columns)
    if {"chosen", "rejected"} <= cols:
        return "pairwise"
    if cols & {"conversations", "messages"}:
        return "sharegpt"
    if "instruction" in cols:
        return "alpaca"
    if "text" in cols:
        return "text"
    return None


REQUIRED = {
    "alpaca": ("instruction", "output"),
    "sharegpt": (),  # conversations or messages, checked in detect/required_missing
    "pairwise": ("chosen", "rejected"),
    "text": ("text",),
}


def missing_columns(fmt: str, columns: list[str]) -> list[str]:
    missing = [c for c in REQUIRED[fmt] if c not in columns]
    if fmt == "sharegpt" and not {"conversations", "messages"} & set(columns):
        missing.append("conversations (or messages)")
    return missing


def _text(value: Any, what: str, optional: bool = False) -> str:
    if value is None and optional:
        return ""
    if not isinstance(value, str):
        raise RowError(f"{what} must be a string, got {type(value).__name__} ({str(value)[:60]!r})")
    return value


def alpaca_messages(row: dict) -> list[dict]:
    """instruction/input/output (+ system, history) -> conversation."""
    messages = []
    system = _text(row.get("system"), "'system'", optional=True)
    if system:
        messages.append({"role": "system", "content": system})
    history = row.get("history") or []
    if not isinstance(history, list):
        raise RowError(f"'history' must be a list of [instruction, response] pairs, "
                       f"got {type(history).__name__}")
    for i, pair in enumerate(history):
        if not (isinstance(pair, (list, tuple)) and len(pair) == 2):
            raise RowError(f"'history'[{i}] must be an [instruction, response] pair")
        messages.append({"role": "user", "content": _text(pair[0], f"'history'[{i}][0]")})
        messages.append({"role": "assistant", "content": _text(pair[1], f"'history'[{i}][1]")})
    prompt = _text(row.get("instruction"), "'instruction'")
    extra = _text(row.get("input"), "'input'", optional=True)
    messages.append({"role": "user", "content": f"{prompt}\n{extra}" if extra else prompt})
    messages.append({"role": "assistant", "content": _text(row.get("output"), "'output'")})
    return messages


def turns_to_messages(turns: Any, column: str) -> list[dict]:
    """sharegpt ``{from, value}`` or OpenAI ``{role, content}`` turns -> conversation."""
    if isinstance(turns, dict):
        turns = [turns]
    if not isinstance(turns, list):
        raise RowError(f"'{column}' must be a list of turns, got {type(turns).__name__}")
    messages = []
    for i, turn in enumerate(turns):
        if not isinstance(turn, dict):
            raise RowError(f"'{column}'[{i}] must be an object with from/value or role/content")
        if "from" in turn:
            tag, content = turn.get("from"), turn.get("value")
        else:
            tag, content = turn.get("role"), turn.get("content")
        if tag not in SHAREGPT_ROLES:
            raise RowError(f"'{column}'[{i}] has role {tag!r}; expected one of {sorted(SHAREGPT_ROLES)}")
        message = {"role": SHAREGPT_ROLES[tag], "content": _text(content, f"'{column}'[{i}] content")}
        if tag == "function_call":  # an assistant turn that calls a tool (a named template lays it out apart)
            message["function_call"] = True
        messages.append(message)
    return messages


def tools(row: dict) -> str:
    """A row's ``tools`` column: a JSON list of tool descriptions as text ('' when the row has none); a named
    template writes it into the system prompt (roll.data.tool_formats)."""
    value = row.get("tools")
    if value is None or value == "":
        return ""
    if not isinstance(value, str):
        raise RowError(f"'tools' must be a JSON string (a list of tool descriptions, as in LLaMA-Factory's "
                       f"datasets), got {type(value).__name__}")
    return value


def refuse_tools(row: dict, names) -> None:
    """The tokenizer's own chat template does not lay a row's tool list out: RowError when the row has one."""
    if tools(row):
        raise RowError(f"the row has a 'tools' list, which only the named templates lay out (LLaMA-Factory's tool "
                       f"formats): set template: to one of {', '.join(names)} (the model family's), or drop the "
                       "column")


def sharegpt_messages(row: dict) -> list[dict]:
    column = "conversations" if row.get("conversations") is not None else "messages"
    messages = turns_to_messages(row.get(column), column)
    system = _text(row.get("system"), "'system'", optional=True)
    if system and not (messages and messages[0]["role"] == "system"):
        messages.insert(0, {"role": "system", "content": system})
    return messages


def check_turn_order(messages: list[dict], *, needs_reply: bool = True) -> None:
    """Raise Skip unless: optional system first, then a user turn, replies only after user/tool turns."""
    body = messages[1:] if messages and messages[0]["role"] == "system" else messages
    if not body:
        raise Skip("empty_conversation")
    if body[0]["role"] != "user" or any(m["role"] == "system" for m in body):
        raise Skip("bad_turn_order")
    for prev, cur in zip(body, body[1:]):
        if cur["role"] == "assistant" and prev["role"] == "assistant":
            raise Skip("bad_turn_order")
        if cur["role"] == "user" and prev["role"] == "user":
            raise Skip("bad_turn_order")
    if needs_reply and body[-1]["role"] != "assistant":
        raise Skip("no_assistant_reply")


def conversation(row: dict, fmt: str) -> list[dict]:
    """A validated sft conversation ending with an assistant turn."""
    messages = alpaca_messages(row) if fmt == "alpaca" else sharegpt_messages(row)
    check_turn_order(messages)
    if any(m["role"] == "assistant" and not m["content"].strip() for m in messages):
        raise Skip("empty_reply")
    return messages


def _answer(value: Any, column: str) -> tuple[list[dict] | None, str]:
    """chosen/rejected as a string, one turn, or a full conversation -> (its own prompt or None, answer)."""
    if isinstance(value, str):
        return None, value
    messages = turns_to_messages(value, column)
    if not messages or messages[-1]["role"] != "assistant":
        raise RowError(f"'{column}' must end with an assistant turn")
    return (messages[:-1] or None), messages[-1]["content"]


def _pair_prompt(row: dict) -> list[dict] | None:
    if row.get("prompt") is not None:
        prompt = row["prompt"]
        if isinstance(prompt, str):
            return [{"role": "user", "content": prompt}]
        return turns_to_messages(prompt, "prompt")
    if row.get("conversations") is not None or row.get("messages") is not None:
        return sharegpt_messages(row)
    if row.get("instruction") is not None:
        return alpaca_messages({**row, "output": ""})[:-1]
    return None


def pair(row: dict) -> tuple[list[dict], str, str]:
    """A validated preference pair: the shared prompt and the two answers."""
    chosen_prompt, chosen = _answer(row.get("chosen"), "chosen")
    rejected_prompt, rejected = _answer(row.get("rejected"), "rejected")
    prompt = _pair_prompt(row)
    if prompt is None:
        if chosen_prompt is None:
            raise RowError("no prompt: expected a 'prompt', 'instruction', 'conversations' or 'messages' "
                           "column, "
                           "or chosen/rejected given as full conversations")
        if chosen_prompt != rejected_prompt:
            raise RowError("chosen and rejected conversations start with different prompts")
        prompt = chosen_prompt
    check_turn_order(prompt, needs_reply=False)
    if prompt[-1]["role"] == "assistant":
        raise Skip("bad_turn_order")
    if not chosen.strip() or not rejected.strip():
        raise Skip("empty_reply")
    if chosen == rejected:
        raise Skip("chosen_equals_rejected")
    return prompt, chosen, rejected


def text(row: dict) -> str:
    value = _text(row.get("text"), "'text'")
    if not value.strip():
        raise Skip("empty_text")
    return value
