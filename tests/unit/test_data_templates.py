"""Loss masks checked against the rendered chat template (the tokenizer's own: no ``template:``): trained tokens
are exactly the assistant replies plus their end-of-turn token, for alpaca, sharegpt multi-turn and pairwise
rows. Named templates (LLaMA-Factory's layouts): tests/unit/test_named_templates.py."""

from __future__ import annotations

import pytest

from roll import IGNORE_INDEX
from roll.data.processors import PairwiseProcessor, SupervisedProcessor
from roll.data.named_templates import TEMPLATES
from roll.data.tokenizer import apply_template, to_jinja
from tests.helpers import batch_of


@pytest.fixture(scope="module")
def qwen():
    from roll.demo.tiny_model import load_qwen_tokenizer

    return load_qwen_tokenizer()


def trained_runs(tokenizer, input_ids: list[int], labels: list[int]) -> list[str]:
    """Decoded maximal runs of trained positions; also checks trained labels equal their input ids."""
    runs, current = [], []
    for token, label in zip(input_ids, labels):
        if label != IGNORE_INDEX:
            assert label == token
            current.append(token)
        elif current:
            runs.append(tokenizer.decode(current))
            current = []
    if current:
        runs.append(tokenizer.decode(current))
    return runs


def assert_matches_rendering(tokenizer, messages: list[dict], input_ids: list[int]) -> None:
    """The tokens are the rendered conversation (only the untrained whitespace tail is dropped)."""
    rendered = tokenizer.apply_chat_template(messages, tokenize=False)
    text = tokenizer.decode(input_ids)
    assert rendered.startswith(text) and not rendered[len(text):].strip(), (rendered, text)


ALPACA = {"system": "You are a helpful assistant.", "instruction": "What is two plus three?",
          "input": "Answer briefly.", "output": "Two plus three equals five.",
          "history": [["Hello", "Hello world."]]}
ALPACA_MESSAGES = [{"role": "system", "content": "You are a helpful assistant."},
                   {"role": "user", "content": "Hello"}, {"role": "assistant", "content": "Hello world."},
                   {"role": "user", "content": "What is two plus three?\nAnswer briefly."},
                   {"role": "assistant", "content": "Two plus three equals five."}]
SHAREGPT = {"conversations": [{"from": "human", "value": "What is one plus one?"},
                              {"from": "gpt", "value": "One plus one equals two."},
                              {"from": "human", "value": "And two plus two?"},
                              {"from": "gpt", "value": "Two plus two equals four."},
                              {"from": "human", "value": "Thanks!"},
                              {"from": "gpt", "value": "You are welcome."}]}
REPLIES = ["One plus one equals two.", "Two plus two equals four.", "You are welcome."]


def _sft(tokenizer, row, fmt, **kw):
    out = SupervisedProcessor(tokenizer, 4096, fmt, "mem.json", **kw)(batch_of([row]), [0])
    assert out["_drop"] == [""]
    return out["input_ids"][0], out["labels"][0]


@pytest.mark.parametrize("tok_name", ["bpe", "qwen"])
def test_alpaca_with_history_masks_every_reply(tok_name, request):
    tokenizer = request.getfixturevalue(tok_name)
    ids, labels = _sft(tokenizer, ALPACA, "alpaca")
    assert_matches_rendering(tokenizer, ALPACA_MESSAGES, ids)
    assert trained_runs(tokenizer, ids, labels) == ["Hello world.<|im_end|>",
                                                    "Two plus three equals five.<|im_end|>"]
    assert labels[0] == IGNORE_INDEX


@pytest.mark.parametrize("tok_name", ["bpe", "qwen"])
def test_sharegpt_multi_turn_masks_every_reply(tok_name, request):
    tokenizer = request.getfixturevalue(tok_name)
    ids, labels = _sft(tokenizer, SHAREGPT, "sharegpt")
    messages = [{"role": "user" if t["from"] == "human" else "assistant", "content": t["value"]}
                for t in SHAREGPT["conversations"]]
    assert_matches_rendering(tokenizer, messages, ids)
    assert trained_runs(tokenizer, ids, labels) == [r + "<|im_end|>" for r in REPLIES]


def test_train_on_last_turn_only(bpe):
    ids, labels = _sft(bpe, SHAREGPT, "sharegpt", train_turns="last")
    assert trained_runs(bpe, ids, labels) == ["You are welcome.<|im_end|>"]
    full_ids, _ = _sft(bpe, SHAREGPT, "sharegpt")
    assert ids == full_ids  # earlier replies stay in the context, untrained


def test_openai_messages_format(bpe):
    row = {"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
                        {"role": "assistant", "content": "Hello."}]}
    ids, labels = _sft(bpe, row, "sharegpt")
    assert_matches_rendering(bpe, row["messages"], ids)
    assert trained_runs(bpe, ids, labels) == ["Hello.<|im_end|>"]


@pytest.mark.parametrize("tok_name", ["bpe", "qwen"])
def test_pairwise_masks_answers_and_shares_the_prompt(tok_name, request):
    tokenizer = request.getfixturevalue(tok_name)
    row = {"conversations": [{"from": "human", "value": "What is two plus three?"}],
           "chosen": {"from": "gpt", "value": "Two plus three equals five."},
           "rejected": {"from": "gpt", "value": "Two plus three equals six."}}
    out = PairwiseProcessor(tokenizer, 4096, "pairwise", "mem.json")(batch_of([row]), [0])
    prompt = [{"role": "user", "content": "What is two plus three?"}]
    for side in ("chosen", "rejected"):
        ids, labels = out[f"{side}_input_ids"][0], out[f"{side}_labels"][0]
        answer = row[side]["value"]
        assert_matches_rendering(tokenizer, prompt + [{"role": "assistant", "content": answer}], ids)
        assert trained_runs(tokenizer, ids, labels) == [answer + "<|im_end|>"]
        assert out[f"{side}_attention_mask"][0] == [1] * len(ids)
    n_prompt = out["chosen_labels"][0].index(next(t for t in out["chosen_labels"][0] if t != IGNORE_INDEX))
    assert out["chosen_input_ids"][0][:n_prompt] == out["rejected_input_ids"][0][:n_prompt]


@pytest.mark.parametrize("chosen,rejected,prompt_key", [
    ("Five.", "Six.", "prompt"),
    ([{"role": "user", "content": "Two plus three?"}, {"role": "assistant", "content": "Five."}],
     [{"role": "user", "content": "Two plus three?"}, {"role": "assistant", "content": "Six."}], None),
    ([{"role": "assistant", "content": "Five."}], [{"role": "assistant", "content": "Six."}], "instruction"),
])
def test_pairwise_prompt_and_answer_shapes(bpe, chosen, rejected, prompt_key):
    row = {"chosen": chosen, "rejected": rejected}
    if prompt_key:
        row[prompt_key] = "Two plus three?"
    out = PairwiseProcessor(bpe, 4096, "pairwise", "mem.json")(batch_of([row]), [0])
    assert out["_drop"] == [""]
    assert trained_runs(bpe, out["chosen_input_ids"][0], out["chosen_labels"][0]) == ["Five.<|im_end|>"]
    assert trained_runs(bpe, out["rejected_input_ids"][0], out["rejected_labels"][0]) == ["Six.<|im_end|>"]
    assert "Two plus three?" in bpe.decode(out["rejected_input_ids"][0])


def test_unknown_template_is_a_config_error(bpe):
    from roll.errors import ConfigError

    with pytest.raises(ConfigError, match="llama3"):
        apply_template(bpe, "vicuna")


@pytest.mark.parametrize("tok_name", ["bpe", "qwen"])
def test_pieces_tokenize_like_the_whole_conversation(tok_name, request):
    """Masks come from tokenizing prompt/reply pieces separately; for these tokenizers that must equal
    tokenizing the rendered conversation in one go (what inference sees)."""
    tokenizer = request.getfixturevalue(tok_name)
    messages = [{"role": "user" if t["from"] == "human" else "assistant", "content": t["value"]}
                for t in SHAREGPT["conversations"]]
    ids, _ = _sft(tokenizer, SHAREGPT, "sharegpt")
    rendered = tokenizer.apply_chat_template(messages, tokenize=False).rstrip("\n")
    assert ids == tokenizer(rendered, add_special_tokens=False)["input_ids"]


@pytest.mark.parametrize("tok_name", ["bpe", "qwen"])
def test_function_call_and_observation_turns(tok_name, request):
    tokenizer = request.getfixturevalue(tok_name)
    call = '{"name": "weather", "arguments": {"city": "Paris"}}'
    row = {"conversations": [{"from": "human", "value": "Weather in Paris?"},
                             {"from": "function_call", "value": call},
                             {"from": "observation", "value": '{"temp": 21}'},
                             {"from": "gpt", "value": "It is 21 degrees in Paris."}]}
    ids, labels = _sft(tokenizer, row, "sharegpt")
    assert trained_runs(tokenizer, ids, labels) == [
        call + "<|im_end|>", "It is 21 degrees in Paris.<|im_end|>"]
    assert '{"temp": 21}' in tokenizer.decode(ids)


def test_warns_when_replies_end_without_a_special_token(roll_warnings):
    from roll.demo.tiny_model import build_bpe_tokenizer

    tokenizer = build_bpe_tokenizer()
    tokenizer.chat_template = to_jinja(TEMPLATES["llama3"])  # <|eot_id|> is not a token of this tokenizer
    ids, labels = _sft(tokenizer, SHAREGPT, "sharegpt")
    assert "not trained to stop" in roll_warnings.text
    assert trained_runs(tokenizer, ids, labels) == REPLIES


def test_template_that_refuses_a_conversation_skips_the_row():
    from roll.demo.tiny_model import build_bpe_tokenizer

    tokenizer = build_bpe_tokenizer()
    tokenizer.chat_template = ("{% if messages | length > 2 %}{{ raise_exception('only one turn') }}"
                               "{% endif %}"
                               + tokenizer.chat_template)
    short = {"conversations": [{"from": "human", "value": "Hi"}, {"from": "gpt", "value": "Hello."}]}
    rows = [short, SHAREGPT]
    out = SupervisedProcessor(tokenizer, 4096, "sharegpt", "mem.json")(batch_of(rows), [0, 1])
    assert out["_drop"] == ["", "unrenderable"]
    pair = {"conversations": SHAREGPT["conversations"][:3], "chosen": "A.", "rejected": "B."}
    out = PairwiseProcessor(tokenizer, 4096, "pairwise", "mem.json")(batch_of([pair]), [0])
    assert out["_drop"] == ["unrenderable"]


def test_train_on_prompt_and_default_system_with_the_tokenizers_template(bpe):
    """Without ``template:``: train_on_prompt trains every token the template renders (the first aside),
    default_system is the system prompt of a conversation without one."""
    ids, labels = _sft(bpe, SHAREGPT, "sharegpt", train_on_prompt=True)
    assert labels == [IGNORE_INDEX] + ids[1:]
    ids, _ = _sft(bpe, SHAREGPT, "sharegpt", default_system="Be brief.")
    messages = [{"role": "system", "content": "Be brief."}] + [
        {"role": "user" if t["from"] == "human" else "assistant", "content": t["value"]}
        for t in SHAREGPT["conversations"]]
    assert_matches_rendering(bpe, messages, ids)
