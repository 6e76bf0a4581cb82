"""Tool lists and function calls in LLaMA-Factory's layouts (its ``data/tool_utils.py`` and the
``ToolFormatter`` / ``FunctionFormatter`` of ``data/formatter.py``), for the named templates.

- A row's ``tools`` column is a JSON string: a list of tool descriptions (``{"name", "description",
  "parameters"}`` or OpenAI's ``{"type": "function", "function": {...}}``). ``tools_text`` writes it the
  template's way; the template appends that text to the system prompt (an empty list writes nothing).
- A ``function_call`` turn's content is a JSON call ``{"name": ..., "arguments": {...}}`` or a list of them
  (parallel calls). ``calls_text`` writes it the template's way. A reasoning prefix is kept: a thought block
  (``<think>\\n...\\n</think>\\n\\n``) before the JSON, or any text around a ``<tool_call>...</tool_call>`` that
  holds it, as LLaMA-Factory's FunctionFormatter does (except for mistral's template, which reads the content
  as JSON alone).
- Malformed JSON, a call without ``name`` / ``arguments``, a tool without ``name`` raise RowError (the
  processor names the file and row); LLaMA-Factory stops with a traceback on them.

The formats: ``default`` (ReAct's ``Action:`` / ``Action Input:``, every template without its own), ``qwen``
(``<tool_call>`` JSON, the Qwen family), ``llama3`` (JSON, with today's date in the tool prompt, as LLaMA-Factory
writes it: a run on another day lays tools out with that day's date), ``mistral`` (``[AVAILABLE_TOOLS]``),
``glm4`` (one call per turn: parallel calls are refused, as LLaMA-Factory refuses them).
"""

from __future__ import annotations

import json
import re
from datetime import datetime
from typing import Any, Callable

from roll.data.formats import RowError

Call = tuple[str, str]
"""(name, arguments as JSON text), LLaMA-Factory's FunctionCall."""

DEFAULT_PROMPT = (
    "You have access to the following tools:\n{tool_text}"
    "Use the following format if using a tool:\n```\nAction: tool name (one of [{tool_names}])\n"
    "Action Input: the input to the tool, in a JSON format representing the kwargs "
    """(e.g. ```{{"input": "hello world", "num_beams": 5}}```)\n```\n""")
GLM4_PROMPT = ("你是一个名为 ChatGLM 的人工智能助手。你是基于智谱 AI 公司训练的语言模型 GLM-4 模型开发的，"
               "你的任务是针对用户的问题和要求提供适当的答复和支持。\n\n# 可用工具{tool_text}")
LLAMA3_PROMPT = (
    "Cutting Knowledge Date: December 2023\nToday Date: {date}\n\n"
    "You have access to the following functions. To call a function, please respond with JSON for a function "
    """call. Respond in the format {{"name": function name, "parameters": dictionary of argument name and its """
    """value}}. Do not use variables.\n\n{tool_text}""")
QWEN_PROMPT = (
    "\n\n# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>{tool_text}"
    "\n</tools>\n\nFor each function call, return a json object with function name and arguments within "
    """<tool_call></tool_call> XML tags:\n<tool_call>\n{{"name": <function-name>, """
    """"arguments": <args-json-object>}}\n</tool_call>""")


def _function(tool: dict) -> dict:
    return tool.get("function", "") if tool.get("type") == "function" else tool


def _wrapped(tool: dict) -> dict:
    return tool if tool.get("type") == "function" else {"type": "function", "function": tool}


def _default_tools(tools: list[dict]) -> str:
    tool_text, names = "", []
    for tool in map(_function, tools):
        params = ""
        for name, param in tool["parameters"]["properties"].items():
            required = ", required" if name in tool["parameters"].get("required", []) else ""
            enum = ", should be one of [{}]".format(", ".join(param["enum"])) if param.get("enum") else ""
            items = ", where each item should be {}".format(param["items"].get("type", "")) if param.get(
                "items") else ""
            params += (f"  - {name} ({param.get('type', '')}{required}): {param.get('description', '')}"
                       f"{enum}{items}\n")
        tool_text += f"> Tool Name: {tool['name']}\nTool Description: {tool.get('description', '')}\nTool Args:\n" \
                     f"{params}\n"
        names.append(tool["name"])
    return DEFAULT_PROMPT.format(tool_text=tool_text, tool_names=", ".join(names))


def _glm4_tools(tools: list[dict]) -> str:
    text = "".join("\n\n## {name}\n\n{body}\n在调用上述函数时，请使用 Json 格式表示调用的参数。".format(
        name=tool["name"], body=json.dumps(tool, indent=4, ensure_ascii=False)) for tool in map(_function, tools))
    return GLM4_PROMPT.format(tool_text=text)


def _llama3_tools(tools: list[dict]) -> str:
    text = "".join(json.dumps(_wrapped(tool), indent=4, ensure_ascii=False) + "\n\n" for tool in tools)
    return LLAMA3_PROMPT.format(date=datetime.now().strftime("%d %b %Y"), tool_text=text)


def _mistral_tools(tools: list[dict]) -> str:
    return "[AVAILABLE_TOOLS] " + json.dumps([_wrapped(t) for t in tools], ensure_ascii=False) + "[/AVAILABLE_TOOLS]"


def _qwen_tools(tools: list[dict]) -> str:
    return QWEN_PROMPT.format(tool_text="".join("\n" + json.dumps(_wrapped(t), ensure_ascii=False) for t in tools))


def _default_calls(calls: list[Call]) -> str:
    return "\n".join(f"Action: {name}\nAction Input: {arguments}" for name, arguments in calls)


def _glm4_calls(calls: list[Call]) -> str:
    if len(calls) > 1:
        raise RowError("template glm4 lays out one function call per turn (GLM-4 has no parallel calls), got "
                       f"{len(calls)} in one function_call turn")
    return f"{calls[0][0]}\n{calls[0][1]}"


def _llama3_calls(calls: list[Call]) -> str:
    objects = [{"name": name, "parameters": json.loads(arguments)} for name, arguments in calls]
    return json.dumps(objects[0] if len(objects) == 1 else objects, ensure_ascii=False)


def _mistral_calls(calls: list[Call]) -> str:
    return json.dumps([{"name": name, "arguments": json.loads(arguments)} for name, arguments in calls],
                      ensure_ascii=False)


def _qwen_calls(calls: list[Call]) -> str:
    texts = [json.dumps({"name": name, "arguments": json.loads(arguments)}, ensure_ascii=False)
             for name, arguments in calls]
    return "\n".join(f"<tool_call>\n{text}\n</tool_call>" for text in texts)


FORMATS: dict[str, tuple[Callable[[list[dict]], str], Callable[[list[Call]], str]]] = {
    "default": (_default_tools, _default_calls), "glm4": (_glm4_tools, _glm4_calls),
    "llama3": (_llama3_tools, _llama3_calls), "mistral": (_mistral_tools, _mistral_calls),
    "qwen": (_qwen_tools, _qwen_calls)}
"""LLaMA-Factory's tool formats that roll writes: (tool list -> text, calls -> text)."""


def tools_text(fmt: str, tools: str) -> str:
    """The ``tools`` column (JSON text) written in format ``fmt`` ('' for an empty list)."""
    try:
        parsed = json.loads(tools)
    except json.JSONDecodeError as exc:
        raise RowError(f"'tools' is not valid JSON ({exc}): {tools[:80]!r}") from None
    if not isinstance(parsed, list) or not all(isinstance(t, dict) for t in parsed):
        raise RowError(f"'tools' must be a JSON list of tool objects, got {tools[:80]!r}")
    if not parsed:
        return ""
    try:
        return FORMATS[fmt][0](parsed)
    except (KeyError, TypeError, AttributeError) as exc:
        raise RowError(f"a tool in 'tools' lacks {exc} (each needs a name and parameters with properties, as "
                       f"LLaMA-Factory's {fmt} tool format reads them): {tools[:80]!r}") from None


def _calls(text: str, content: str) -> list[Call]:
    """LLaMA-Factory's parse of a function_call turn's JSON (FunctionFormatter._parse_functions)."""
    try:
        calls: Any = json.loads(text)
    except json.JSONDecodeError as exc:
        raise RowError(f"a function_call turn is not valid JSON ({exc}): {content[:80]!r}; it must be "
                       '{"name": ..., "arguments": {...}} or a list of such calls') from None
    calls = calls if isinstance(calls, list) else [calls]
    if not calls or not all(isinstance(c, dict) and "name" in c and "arguments" in c for c in calls):
        raise RowError(f'a function_call turn must be {{"name": ..., "arguments": {{...}}}} or a non-empty list of '
                       f"such calls, got {content[:80]!r}")
    return [(c["name"], json.dumps(c["arguments"], ensure_ascii=False)) for c in calls]


def calls_text(fmt: str, content: str, thought_words: tuple[str, str] | None,
               tool_call_words: tuple[str, str] | None) -> str:
    """A function_call turn's content written in format ``fmt`` (LLaMA-Factory's FunctionFormatter.apply):
    the text around a ``tool_call_words`` block, else a thought block, is kept before the calls."""
    format_calls = FORMATS[fmt][1]
    match = re.search(f"{re.escape(tool_call_words[0])}(.*?){re.escape(tool_call_words[1])}", content,
                      re.DOTALL) if tool_call_words else None
    if match is not None:
        return content.replace(match.group(0), "") + format_calls(_calls(match.group(1), content))
    thought = re.search(f"{re.escape(thought_words[0])}(.*?){re.escape(thought_words[1])}", content,
                        re.DOTALL) if thought_words else None
    if thought is None:
        return format_calls(_calls(content, content))
    return thought.group(0) + format_calls(_calls(content.replace(thought.group(0), ""), content))
