"""Tool lists, function calls and observations with named templates: LLaMA-Factory's layouts (its tool_utils.py
prompts and call formats, its templates' function and observation slots), written out here by hand as the texts
each template documents, tokenized slot by slot by the real Qwen2.5 tokenizer; malformed tool rows name their
file and row. scripts/compare_llamafactory_rows.py checks the same against LLaMA-Factory's own code."""

from __future__ import annotations

import json

import pytest

from roll.config.data import DataArguments
from roll.data.named_templates import encoder_for
from roll.data.processors import SupervisedProcessor
from roll.errors import DataError
from tests.helpers import batch_of
from tests.unit.test_named_templates import BOS, EOS, QWEN_SYSTEM, _expected, _tokenizer

TOOLS = json.dumps([{"name": "get_weather", "description": "Weather of a city.",
                     "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                    "required": ["city"]}}])
CALL = '{"name": "get_weather", "arguments": {"city": "Paris"}}'
ROW = {"conversations": [{"from": "human", "value": "Weather in Paris?"}, {"from": "function_call", "value": CALL},
                         {"from": "observation", "value": "21"}, {"from": "gpt", "value": "21 degrees."}],
       "tools": TOOLS}
TOOL_JSON = ('{"type": "function", "function": {"name": "get_weather", "description": "Weather of a city.", '
             '"parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}')
QWEN_TOOLS = ("\n\n# Tools\n\nYou may call one or more functions to assist with the user query.\n\nYou are provided "
              "with function signatures within <tools></tools> XML tags:\n<tools>\n" + TOOL_JSON + "\n</tools>\n\n"
              "For each function call, return a json object with function name and arguments within "
              "<tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": "
              "<args-json-object>}\n</tool_call>")
QWEN_CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
DEFAULT_TOOLS = ("You have access to the following tools:\n> Tool Name: get_weather\nTool Description: Weather of a "
                 "city.\nTool Args:\n  - city (string, required): \n\nUse the following format if using a tool:\n```\n"
                 "Action: tool name (one of [get_weather])\nAction Input: the input to the tool, in a JSON format "
                 'representing the kwargs (e.g. ```{"input": "hello world", "num_beams": 5}```)\n```\n')
DEFAULT_CALL = 'Action: get_weather\nAction Input: {"city": "Paris"}'
LLAMA3 = "<|start_header_id|>{}<|end_header_id|>\n\n"
LLAMA3_TOOLS = ("Cutting Knowledge Date: December 2023\nToday Date: 02 Jan 2026\n\nYou have access to the following "
                "functions. To call a function, please respond with JSON for a function call. Respond in the format "
                '{"name": function name, "parameters": dictionary of argument name and its value}. Do not use '
                "variables.\n\n" + json.dumps(json.loads(TOOL_JSON), indent=4) + "\n\n")
CHATML_USER = "<|im_start|>user\nWeather in Paris?<|im_end|>\n<|im_start|>assistant\n"
QWEN_OBSERVATION = "<|im_start|>user\n<tool_response>\n21\n</tool_response><|im_end|>\n<|im_start|>assistant\n"

LAYOUTS = {
    "qwen": [([QWEN_SYSTEM.replace("assistant.<|im_end|>", "assistant." + QWEN_TOOLS + "<|im_end|>"), CHATML_USER],
              False), ([QWEN_CALL + "<|im_end|>\n"], True), ([QWEN_OBSERVATION], False),
             (["21 degrees.<|im_end|>\n"], True)],
    "qwen3_nothink": [(["<|im_start|>system\n" + QWEN_TOOLS + "<|im_end|>\n", CHATML_USER], False),
                      ([QWEN_CALL + "<|im_end|>\n"], True), ([QWEN_OBSERVATION], False),
                      (["21 degrees.<|im_end|>\n"], True)],
    "chatml": [(["<|im_start|>system\n" + DEFAULT_TOOLS + "<|im_end|>\n", CHATML_USER], False),
               ([DEFAULT_CALL + "<|im_end|>\n"], True),
               (["<|im_start|>tool\n21<|im_end|>\n<|im_start|>assistant\n"], False), (["21 degrees.<|im_end|>\n"], True)],
    "default": [(["System: " + DEFAULT_TOOLS, EOS, "\n", "Human: Weather in Paris?", EOS, "\nAssistant:"], False),
                ([DEFAULT_CALL, EOS, "\n"], True), (["Human: 21", EOS, "\nAssistant:"], False),
                (["21 degrees.", EOS, "\n"], True)],
    "deepseek3": [([BOS, DEFAULT_TOOLS, "<｜User｜>Weather in Paris?<｜Assistant｜>"], False), ([DEFAULT_CALL, EOS], True),
                  (["<｜User｜>21<｜Assistant｜>"], False), (["21 degrees.", EOS], True)],
    "llama3": [([BOS, LLAMA3.format("system") + LLAMA3_TOOLS + "<|eot_id|>", LLAMA3.format("user")
                 + "Weather in Paris?<|eot_id|>" + LLAMA3.format("assistant")], False),
               (['{"name": "get_weather", "parameters": {"city": "Paris"}}<|eot_id|>'], True),
               ([LLAMA3.format("ipython") + "21<|eot_id|>" + LLAMA3.format("assistant")], False),
               (["21 degrees.<|eot_id|>"], True)],
    "mistral": [([BOS, "[INST] [AVAILABLE_TOOLS] [" + TOOL_JSON + "][/AVAILABLE_TOOLS]\n\nWeather in Paris?[/INST]"],
                 False), (['[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris"}}]', EOS], True),
                (['[TOOL_RESULTS] {"content": 21}[/TOOL_RESULTS]'], False), ([" 21 degrees.", EOS], True)],
}


def _sft(name, row=ROW):
    tokenizer = _tokenizer(name)
    out = SupervisedProcessor(tokenizer, 4096, "sharegpt", "mem.json",
                              encoder=encoder_for(DataArguments(template=name)))(batch_of([row]), [0])
    return tokenizer, (out["input_ids"][0], out["labels"][0])


@pytest.fixture
def fixed_date(monkeypatch):
    """llama3's tool prompt carries today's date (LLaMA-Factory writes datetime.now()): fixed here."""
    import datetime

    class Fixed(datetime.datetime):
        @classmethod
        def now(cls, tz=None):
            return cls(2026, 1, 2)

    monkeypatch.setattr("roll.data.tool_formats.datetime", Fixed)


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_tools_calls_and_observations_in_each_templates_layout(name, fixed_date):
    """The tool list after the system prompt in the system slot (mistral: in the first user message), the call
    in the function slots and the tool format (trained as a reply), the result in the observation slots."""
    tokenizer, got = _sft(name)
    assert got == _expected(tokenizer, LAYOUTS[name])


def test_glm4_calls_in_their_own_slot_and_efficient_eos():
    tokenizer, got = _sft("glm4")
    glm4_tools = ("你是一个名为 ChatGLM 的人工智能助手。你是基于智谱 AI 公司训练的语言模型 GLM-4 模型开发的，你的任务是针对用户"
                  "的问题和要求提供适当的答复和支持。\n\n# 可用工具\n\n## get_weather\n\n"
                  + json.dumps(json.loads(TOOL_JSON)["function"], indent=4) + "\n在调用上述函数时，请使用 Json 格式表示调用的参数。")
    ids, labels = _expected(tokenizer, [
        (["[gMASK]<sop>", "<|system|>\n" + glm4_tools, "<|user|>\nWeather in Paris?<|assistant|>"], False),
        (['get_weather\n{"city": "Paris"}'], True), (["<|observation|>\n21<|assistant|>"], False),
        (["\n21 degrees.", EOS], True)])
    first_reply_end = ids.index(tokenizer.convert_tokens_to_ids("<|observation|>"))
    labels[first_reply_end] = tokenizer.eos_token_id  # efficient_eos: the call's EOS, trained at the next prompt
    assert got == (ids, labels)


def test_qwen3_keeps_the_thought_around_a_tool_call():
    row = {"conversations": [ROW["conversations"][0], {"from": "function_call", "value": (
        "<think>\nlook it up\n</think>\n\n<tool_call>" + CALL + "</tool_call>")}, *ROW["conversations"][2:]]}
    tokenizer, got = _sft("qwen3", row)
    assert got == _expected(tokenizer, [
        ([CHATML_USER], False), (["<think>\nlook it up\n</think>\n\n" + QWEN_CALL + "<|im_end|>\n"], True),
        ([QWEN_OBSERVATION], False), (["<think>\n\n</think>\n\n", "21 degrees.<|im_end|>\n"], True)])


@pytest.mark.parametrize("name, change, message", [
    ("qwen", {"call": '{"name": "get_weather", "arguments": '}, "function_call turn is not valid JSON"),
    ("qwen", {"call": '{"name": "get_weather"}'}, 'must be {"name": ..., "arguments"'),
    ("qwen", {"tools": "[{'name': 1}]"}, "'tools' is not valid JSON"),
    ("qwen", {"tools": [{"name": "x"}]}, "'tools' must be a JSON string"),
    ("default", {"tools": '[{"name": "x"}]'}, "a tool in 'tools' lacks 'parameters'"),
    ("glm4", {"call": json.dumps([json.loads(CALL)] * 2)}, "template glm4 lays out one function call per turn"),
    (None, {}, "only the named templates lay out"),
])
def test_malformed_tool_rows_name_file_and_row(name, change, message):
    row = json.loads(json.dumps(ROW))
    if "call" in change:
        row["conversations"][1]["value"] = change["call"]
    if "tools" in change:
        row["tools"] = change["tools"]
    tokenizer = _tokenizer(name or "qwen")
    processor = SupervisedProcessor(tokenizer, 4096, "sharegpt", "mem.json",
                                    encoder=encoder_for(DataArguments(template=name)))
    with pytest.raises(DataError, match=r"mem.json, row 3 \(0-based\): .*" + message.replace("(", r"\(")
                       .replace("[", r"\[").replace("{", r"\{").replace(".", r"\.")):
        plain = {"conversations": ROW["conversations"]}  # well-formed with or without a template
        processor(batch_of([plain, plain, plain, row]), [0, 1, 2, 3])


def test_tool_format_replaces_the_templates_own():
    """LLaMA-Factory's tool_format: the tool list and calls in that format, a call as the reply then EOS (the
    template's function slots replaced); refused without a template or for a format roll does not write."""
    from roll.errors import ConfigError

    tokenizer = _tokenizer("qwen")
    out = SupervisedProcessor(tokenizer, 4096, "sharegpt", "mem.json", encoder=encoder_for(
        DataArguments(template="qwen", tool_format="default")))(batch_of([ROW]), [0])
    system = QWEN_SYSTEM.replace("assistant.<|im_end|>", "assistant." + DEFAULT_TOOLS + "<|im_end|>")
    assert (out["input_ids"][0], out["labels"][0]) == _expected(tokenizer, [
        ([system, CHATML_USER], False), ([DEFAULT_CALL, EOS], True), ([QWEN_OBSERVATION], False),
        (["21 degrees.<|im_end|>\n"], True)])
    with pytest.raises(ConfigError, match="tool_format='gemma4': choose one of default, glm4, llama3, mistral, qwen"):
        DataArguments(template="qwen", tool_format="gemma4")
    with pytest.raises(ConfigError, match="a tool format is a named template's"):
        DataArguments(tool_format="qwen")


def test_kto_rows_lay_out_the_tools_and_calls_of_their_prompt():
    """A kto row with tools: the whole conversation (tool list, call, result) is the prompt, the last reply slot
    is trained (LLaMA-Factory's kto rows pass the tools to encode_oneturn)."""
    from roll.data.feedback import FeedbackProcessor

    tokenizer = _tokenizer("qwen")
    out = FeedbackProcessor(tokenizer, 4096, "sharegpt", "mem.json", encoder=encoder_for(
        DataArguments(template="qwen")))(batch_of([{**ROW, "kto_tag": True}]), [0])
    layout = [(slots, i == len(LAYOUTS["qwen"]) - 1) for i, (slots, _) in enumerate(LAYOUTS["qwen"])]
    assert (out["input_ids"][0], out["labels"][0]) == _expected(tokenizer, layout)


def test_a_function_call_answer_of_a_pair_is_laid_out_as_a_call():
    """dpo: a chosen (or rejected) answer that is a function_call turn is written in the function slots and the
    tool format, as LLaMA-Factory's pairwise rows are; the prompt carries the tool list."""
    from roll.data.processors import PairwiseProcessor

    tokenizer = _tokenizer("qwen")
    row = {"conversations": ROW["conversations"][:1], "chosen": {"from": "function_call", "value": CALL},
           "rejected": {"from": "gpt", "value": "No idea."}, "tools": TOOLS}
    out = PairwiseProcessor(tokenizer, 4096, "pairwise", "mem.json",
                            encoder=encoder_for(DataArguments(template="qwen")))(batch_of([row]), [0])
    prompt = LAYOUTS["qwen"][0]
    for side, answer in (("chosen", QWEN_CALL), ("rejected", "No idea.")):
        assert (out[f"{side}_input_ids"][0], out[f"{side}_labels"][0]) == _expected(
            tokenizer, [prompt, ([answer + "<|im_end|>\n"], True)])
