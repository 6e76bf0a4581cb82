"""Named templates (``template: qwen``) give LLaMA-Factory's token ids and labels, checked against layouts written
out by hand from each template's documented slots (LLaMA-Factory's src/llamafactory/data/template.py): every text
slot tokenized on its own by the real Qwen2.5 tokenizer here (not by the code under test), the reply slot trained
whole (the newline after <|im_end|> included), the prompt not."""

from __future__ import annotations

import pytest

from roll import IGNORE_INDEX as X
from roll.config.data import DataArguments
from roll.data.named_templates import TEMPLATES, encoder_for, split_lengths
from roll.data.processors import PairwiseProcessor, SupervisedProcessor
from roll.data.tokenizer import apply_template, pretrain_eos_id
from roll.errors import ConfigError
from tests.helpers import batch_of

TWO_TURNS = {"conversations": [{"from": "human", "value": "Hi"}, {"from": "gpt", "value": "Hello."},
                               {"from": "human", "value": "2+2?"}, {"from": "gpt", "value": "4."}]}
IM_START, IM_END, NL, THINK, END_THINK, NL2 = 151644, 151645, 198, 151667, 151668, 271
"""Qwen2.5's ids of <|im_start|>, <|im_end|>, "\\n", <think>, </think>, "\\n\\n"."""
EOS = "<eos>"
BOS = "<bos>"
FAMILY_SPECIALS = {"llama3": ["<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>", "<|eom_id|>",
                              "<|end_of_text|>"],
                   "glm4": ["[gMASK]", "<sop>", "<|system|>", "<|user|>", "<|assistant|>", "<|observation|>"]}
"""The special tokens of the model family's own tokenizer, added to Qwen's for these templates."""


_LOADED: dict[str, object] = {}


def _tokenizer(name: str):
    """The Qwen2.5 tokenizer with ``name`` applied (loaded once; with the family's special tokens added for llama3
    and glm4). Qwen has no BOS: <|endoftext|> stands in for the templates that start with one."""
    import copy

    from roll.demo.tiny_model import load_qwen_tokenizer

    if not _LOADED:
        _LOADED["qwen"] = load_qwen_tokenizer()
        _LOADED["qwen"].bos_token = "<|endoftext|>"
        for family, specials in FAMILY_SPECIALS.items():
            _LOADED[family] = copy.deepcopy(_LOADED["qwen"])
            _LOADED[family].add_special_tokens({"additional_special_tokens": specials})
    tokenizer = _LOADED[name if name in FAMILY_SPECIALS else "qwen"]
    apply_template(tokenizer, name)  # the chat template (and, llama3, the EOS) of this name, every time
    return tokenizer


def _expected(tokenizer, segments: list[tuple[list[str], bool]]) -> tuple[list[int], list[int]]:
    """Hand-written layout -> (ids, labels): each segment is its slots (text tokenized alone, EOS/BOS the
    tokenizer's ids) and whether it is trained; the first label is ignored (nothing predicts it)."""
    ids, labels = [], []
    for slots, trained in segments:
        piece = []
        for slot in slots:
            if slot in (EOS, BOS):
                piece.append(tokenizer.eos_token_id if slot == EOS else tokenizer.bos_token_id)
            else:
                piece += tokenizer(slot, add_special_tokens=False)["input_ids"]
        ids += piece
        labels += piece if trained else [X] * len(piece)
    labels[0] = X
    return ids, labels


def _sft(tokenizer, name, row=TWO_TURNS, cutoff_len=4096, **data):
    data_args = DataArguments(template=name, **data)
    out = SupervisedProcessor(tokenizer, cutoff_len, "sharegpt", "mem.json", encoder=encoder_for(data_args),
                              train_turns="last" if data_args.train_on_last_turn_only else "all",
                              train_on_prompt=data_args.train_on_prompt)(batch_of([row]), [0])
    assert out["_drop"] == [""], out["_drop"]
    return out["input_ids"][0], out["labels"][0]


QWEN_SYSTEM = "<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\n"
CHATML_TURNS = [(["<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"], False), (["Hello.<|im_end|>\n"], True),
                (["<|im_start|>user\n2+2?<|im_end|>\n<|im_start|>assistant\n"], False), (["4.<|im_end|>\n"], True)]
LLAMA3 = "<|start_header_id|>{}<|end_header_id|>\n\n"
LAYOUTS = {
    "default": [(["Human: Hi", EOS, "\nAssistant:"], False), (["Hello.", EOS, "\n"], True),
                (["Human: 2+2?", EOS, "\nAssistant:"], False), (["4.", EOS, "\n"], True)],
    "empty": [(["Hi"], False), (["Hello."], True), (["2+2?"], False), (["4."], True)],
    "chatml": CHATML_TURNS,
    "qwen": [([QWEN_SYSTEM], False)] + CHATML_TURNS,
    "qwen2_vl": [(["<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"], False)] + CHATML_TURNS,
    "qwen3_nothink": CHATML_TURNS,
    "qwen3": [CHATML_TURNS[0], (["<think>\n\n</think>\n\n", "Hello.<|im_end|>\n"], True),
              CHATML_TURNS[2], (["<think>\n\n</think>\n\n", "4.<|im_end|>\n"], True)],
    "llama3": [([BOS, LLAMA3.format("user") + "Hi<|eot_id|>" + LLAMA3.format("assistant")], False),
               (["Hello.<|eot_id|>"], True),
               ([LLAMA3.format("user") + "2+2?<|eot_id|>" + LLAMA3.format("assistant")], False),
               (["4.<|eot_id|>"], True)],
    "mistral": [([BOS, "[INST] Hi[/INST]"], False), ([" Hello.", EOS], True), (["[INST] 2+2?[/INST]"], False),
                ([" 4.", EOS], True)],
    "deepseek3": [([BOS, "<｜User｜>Hi<｜Assistant｜>"], False), (["Hello.", EOS], True),
                  (["<｜User｜>2+2?<｜Assistant｜>"], False), (["4.", EOS], True)],
}


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_each_name_lays_out_llamafactorys_text_and_labels(name):
    tokenizer = _tokenizer(name)
    assert _sft(tokenizer, name) == _expected(tokenizer, LAYOUTS[name])
    # The installed chat template renders the same text (what the saved model is prompted with).
    messages = [{"role": "user" if t["from"] == "human" else "assistant", "content": t["value"]}
                for t in TWO_TURNS["conversations"]]
    if name != "qwen3":  # the empty thought is the training layout's, not the chat template's
        rendered = tokenizer.apply_chat_template(messages, tokenize=False)
        assert rendered == tokenizer.decode(_expected(tokenizer, LAYOUTS[name])[0])


def test_every_template_name_is_checked():
    assert set(LAYOUTS) | {"glm4"} == set(TEMPLATES)


def test_qwen_ids_written_out():
    """The ChatML ids themselves: the reply is trained with <|im_end|> and the newline after it."""
    tokenizer = _tokenizer("qwen3_nothink")
    ids, labels = _sft(tokenizer, "qwen3_nothink", {"conversations": TWO_TURNS["conversations"][:2]})
    hi, hello = tokenizer("Hi")["input_ids"], tokenizer("Hello.")["input_ids"]
    prompt = [IM_START, 872, NL, *hi, IM_END, NL, IM_START, 77091, NL]  # 872 "user", 77091 "assistant"
    assert ids == prompt + hello + [IM_END, NL]
    assert labels == [X] * len(prompt) + hello + [IM_END, NL]
    assert tokenizer.eos_token_id == IM_END and tokenizer.convert_ids_to_tokens(8948) == "system"


def test_glm4_efficient_eos_labels_the_next_prompt_and_ends_with_eos():
    tokenizer = _tokenizer("glm4")
    ids, labels = _sft(tokenizer, "glm4")
    prompt1 = tokenizer("[gMASK]<sop>")["input_ids"] + tokenizer("<|user|>\nHi<|assistant|>")["input_ids"]
    reply1, prompt2 = tokenizer("\nHello.")["input_ids"], tokenizer("<|user|>\n2+2?<|assistant|>")["input_ids"]
    reply2, eos = tokenizer("\n4.")["input_ids"], tokenizer.eos_token_id
    assert ids == prompt1 + reply1 + prompt2 + reply2 + [eos]
    # the first reply's EOS is trained at the next prompt's first position, the last one at the end
    assert labels == [X] * len(prompt1) + reply1 + [eos] + [X] * (len(prompt2) - 1) + reply2 + [eos]
    with pytest.raises(ConfigError, match="efficient_eos"):
        DataArguments(template="glm4", train_on_prompt=True)


def test_default_system_replaces_the_templates_and_the_rows_own_wins():
    tokenizer = _tokenizer("qwen")
    one_turn = {"conversations": TWO_TURNS["conversations"][:2]}
    ids, _ = _sft(tokenizer, "qwen", one_turn, default_system="Be brief.")
    assert tokenizer.decode(ids).startswith("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi")
    own = {"conversations": [{"from": "system", "value": "Row system."}, *one_turn["conversations"]]}
    ids, _ = _sft(tokenizer, "qwen", own, default_system="Be brief.")
    assert tokenizer.decode(ids).startswith("<|im_start|>system\nRow system.<|im_end|>\n")
    # mistral puts the system text inside the first user message
    tokenizer = _tokenizer("mistral")
    ids, _ = _sft(tokenizer, "mistral", own)
    assert tokenizer.decode(ids) == "<|endoftext|>[INST] Row system.\n\nHi[/INST] Hello.<|im_end|>"
    # a template without a system slot writes the system text alone (not in its user slot)
    tokenizer = _tokenizer("deepseek3")
    assert _sft(tokenizer, "deepseek3", own) == _expected(tokenizer, [
        ([BOS, "Row system.", "<｜User｜>Hi<｜Assistant｜>"], False), (["Hello.", EOS], True)])


THOUGHT = "<think>\nadd them\n</think>\n\n"


@pytest.mark.parametrize("enable, preserve, last_only, first_reply, last_reply", [
    # thinking on: an empty thought is trained before a reply without one, a real one is kept
    (True, False, False, (["<think>\n\n</think>\n\n", "Hello.<|im_end|>\n"], True), ([THOUGHT + "4.<|im_end|>\n"], True)),
    # thinking off: thoughts removed, the empty one is part of the prompt
    (False, False, False, (["Hello.<|im_end|>\n"], True), (["4.<|im_end|>\n"], True)),
    # mask_history: the history's thought removed, only the last turn's reply trained
    (True, False, True, (["Hello.<|im_end|>\n"], False), ([THOUGHT + "4.<|im_end|>\n"], True)),
    # ... unless preserve_thinking
    (True, True, True, ([THOUGHT + "Hello.<|im_end|>\n"], False), ([THOUGHT + "4.<|im_end|>\n"], True)),
])
def test_qwen3_thinking_is_trained_or_prompt(enable, preserve, last_only, first_reply, last_reply):
    row = {"conversations": [{"from": "human", "value": "Hi"}, {"from": "gpt", "value": "Hello."},
                             {"from": "human", "value": "2+2?"}, {"from": "gpt", "value": THOUGHT + "4."}]}
    if preserve:
        row["conversations"][1]["value"] = THOUGHT + "Hello."
    tokenizer = _tokenizer("qwen3")
    empty = ["<think>\n\n</think>\n\n"] if not enable else []
    prompt1, prompt2 = CHATML_TURNS[0][0] + empty, CHATML_TURNS[2][0] + empty
    got = _sft(tokenizer, "qwen3", row, enable_thinking=enable, preserve_thinking=preserve,
               train_on_last_turn_only=last_only)
    assert got == _expected(tokenizer, [(prompt1, False), first_reply, (prompt2, False), last_reply])


def test_train_on_prompt_and_mask_history():
    tokenizer = _tokenizer("qwen")
    ids, labels = _sft(tokenizer, "qwen", train_on_prompt=True)
    assert labels == [X] + ids[1:]
    ids, labels = _sft(tokenizer, "qwen", train_on_last_turn_only=True)
    expected = [(slots, trained and i == len(LAYOUTS["qwen"]) - 1) for i, (slots, trained) in
                enumerate(LAYOUTS["qwen"])]
    assert (ids, labels) == _expected(tokenizer, expected)
    with pytest.raises(ConfigError, match="contradict"):
        DataArguments(template="qwen", train_on_prompt=True, train_on_last_turn_only=True)


@pytest.mark.parametrize("prompt, reply, budget, kept", [
    (10, 3, 8, (5, 3)),  # a reply under half the budget is whole, the prompt takes the rest
    (3, 10, 8, (3, 5)),  # a prompt under half is whole, the reply takes the rest
    (10, 10, 8, (4, 4)),  # both long: int(8 * 10/20) for the reply
    (7, 9, 10, (5, 5)),  # int(10 * 9/16) = 5
    (2, 2, 8, (2, 2)),
])
def test_split_lengths_is_llamafactorys_infer_seqlen(prompt, reply, budget, kept):
    assert split_lengths(prompt, reply, budget) == kept


def test_truncation_keeps_the_start_of_prompt_and_reply_and_mask_history_keeps_the_last_turn():
    tokenizer = _tokenizer("qwen3_nothink")
    long = {"conversations": [{"from": "human", "value": "one two three four five six seven eight"},
                              {"from": "gpt", "value": "alpha beta gamma delta epsilon zeta eta theta"},
                              {"from": "human", "value": "2+2?"}, {"from": "gpt", "value": "4."}]}
    enc = [tokenizer(t, add_special_tokens=False)["input_ids"] for t in (
        "<|im_start|>user\none two three four five six seven eight<|im_end|>\n<|im_start|>assistant\n",
        "alpha beta gamma delta epsilon zeta eta theta<|im_end|>\n",
        "<|im_start|>user\n2+2?<|im_end|>\n<|im_start|>assistant\n", "4.<|im_end|>\n")]
    cutoff = 20
    ids, labels = _sft(tokenizer, "qwen3_nothink", long, cutoff_len=cutoff)
    p, r = split_lengths(len(enc[0]), len(enc[1]), cutoff)
    assert ids == enc[0][:p] + enc[1][:r]  # the first turn fills the budget; the second is dropped
    assert labels == [X] * p + enc[1][:r]
    ids, labels = _sft(tokenizer, "qwen3_nothink", long, cutoff_len=cutoff, train_on_last_turn_only=True)
    rest = cutoff - len(enc[2]) - len(enc[3])
    p, r = split_lengths(len(enc[0]), len(enc[1]), rest)
    assert ids == enc[0][:p] + enc[1][:r] + enc[2] + enc[3]  # the last turn first, whole
    assert labels == [X] * (p + r + len(enc[2])) + enc[3]


def test_pairwise_named_template_keeps_the_prompt_start_and_trains_each_reply_slot():
    tokenizer = _tokenizer("qwen")
    row = {"conversations": [{"from": "human", "value": "What is two plus three?"}],
           "chosen": {"from": "gpt", "value": "Five."}, "rejected": {"from": "gpt", "value": "Six, I think."}}
    out = PairwiseProcessor(tokenizer, 4096, "pairwise", "mem.json",
                            encoder=encoder_for(DataArguments(template="qwen")))(batch_of([row]), [0])
    prompt, _ = _expected(tokenizer, [([QWEN_SYSTEM, "<|im_start|>user\nWhat is two plus three?<|im_end|>\n"
                                       "<|im_start|>assistant\n"], False)])
    for side, text in (("chosen", "Five."), ("rejected", "Six, I think.")):
        answer = tokenizer(text + "<|im_end|>\n")["input_ids"]
        assert out[f"{side}_input_ids"][0] == prompt + answer
        assert out[f"{side}_labels"][0] == [X] * len(prompt) + answer
    cutoff = 12  # LLaMA-Factory's split from the longer answer; the prompt keeps its start
    out = PairwiseProcessor(tokenizer, cutoff, "pairwise", "mem.json",
                            encoder=encoder_for(DataArguments(template="qwen")))(batch_of([row]), [0])
    longest = len(tokenizer("Six, I think.<|im_end|>\n")["input_ids"])
    p, a = split_lengths(len(prompt), longest, cutoff)
    assert out["rejected_input_ids"][0] == prompt[:p] + tokenizer("Six, I think.<|im_end|>\n")["input_ids"][:a]


def test_replace_eos_and_pretrain_eos():
    tokenizer = _tokenizer("llama3")
    assert tokenizer.eos_token == "<|eot_id|>"  # LLaMA-Factory's replace_eos
    assert pretrain_eos_id(tokenizer, TEMPLATES["llama3"]) == tokenizer.convert_tokens_to_ids("<|end_of_text|>")
    assert pretrain_eos_id(tokenizer, None) == tokenizer.eos_token_id
    with pytest.raises(ConfigError, match="<\\|eot_id\\|>.*no token of this tokenizer"):
        apply_template(_tokenizer("qwen"), "llama3")
    with pytest.raises(ConfigError, match="'<\\|user\\|>', '<\\|observation\\|>', which is no token"):
        apply_template(_tokenizer("qwen"), "glm4")  # LLaMA-Factory would add them as new tokens
    with pytest.raises(ConfigError, match="did you mean 'qwen3_nothink'"):
        DataArguments(template="qwen3_nothnk")


# ---- stage kto (LLaMA-Factory's kto rows: encode_oneturn, infer_seqlen; the KL rows from the collator) ----

def _kto(tokenizer, name, rows, cutoff_len=4096, **data):
    from roll.data.feedback import FeedbackProcessor

    out = FeedbackProcessor(tokenizer, cutoff_len, "sharegpt", "mem.json",
                            encoder=encoder_for(DataArguments(template=name, **data)))(batch_of(rows), [0, 1][:len(rows)])
    assert out["_drop"] == [""] * len(rows), out["_drop"]
    return [{k: out[k][i] for k in ("input_ids", "attention_mask", "labels", "kto_tag")} for i in range(len(rows))]


KTO_ROWS = [{"conversations": TWO_TURNS["conversations"], "kto_tag": False},
            {"conversations": [{"from": "human", "value": "3+3?"}, {"from": "gpt", "value": "Six."}], "kto_tag": True}]


def test_kto_rows_with_a_named_template_train_the_last_reply_slot_and_the_kl_rows_swap_it():
    """A kto row is LLaMA-Factory's encode_oneturn: every earlier turn (its reply too) is the prompt, the last
    reply slot is trained with the newline after <|im_end|>; the mismatched row is the row's prompt with the
    previous row's reply slot, as LLaMA-Factory builds its KL row from prompt + [other response]."""
    from roll.data.feedback import FeedbackCollator

    tokenizer = _tokenizer("qwen")
    rows = _kto(tokenizer, "qwen", KTO_ROWS)
    prompt0 = [QWEN_SYSTEM] + [slot for slots, _ in CHATML_TURNS[:3] for slot in slots]
    prompt1 = [QWEN_SYSTEM, "<|im_start|>user\n3+3?<|im_end|>\n<|im_start|>assistant\n"]
    assert (rows[0]["input_ids"], rows[0]["labels"]) == _expected(tokenizer, [(prompt0, False), (["4.<|im_end|>\n"], True)])
    assert (rows[1]["input_ids"], rows[1]["labels"]) == _expected(tokenizer, [(prompt1, False), (["Six.<|im_end|>\n"], True)])
    assert [r["kto_tag"] for r in rows] == [False, True]
    batch = FeedbackCollator(tokenizer.pad_token_id, cutoff_len=4096, named_template=True)(rows)
    kl0 = _expected(tokenizer, [(prompt0, False), (["Six.<|im_end|>\n"], True)])
    kl1 = _expected(tokenizer, [(prompt1, False), (["4.<|im_end|>\n"], True)])
    for row, (ids, labels) in zip((2, 3), (kl0, kl1)):
        n = len(ids)
        assert batch["input_ids"][row, :n].tolist() == ids and batch["labels"][row, :n].tolist() == labels
        assert batch["attention_mask"][row].sum() == n


def _long_kto(tokenizer) -> tuple[list[dict], list[list[int]]]:
    """Two kto rows, one longer than a cutoff_len of 16, and qwen3_nothink's token ids of their pieces: row 0's
    prompt and reply, row 1's reply and prompt."""
    rows = [{"conversations": [{"from": "human", "value": "one two three four five six seven eight nine ten"},
                               {"from": "gpt", "value": "alpha beta gamma delta epsilon zeta eta theta"}],
             "kto_tag": True},
            {"conversations": [{"from": "human", "value": "Hi"}, {"from": "gpt", "value": "Hello."}], "kto_tag": False}]
    return rows, [tokenizer(t, add_special_tokens=False)["input_ids"] for t in (
        "<|im_start|>user\none two three four five six seven eight nine ten<|im_end|>\n<|im_start|>assistant\n",
        "alpha beta gamma delta epsilon zeta eta theta<|im_end|>\n", "Hello.<|im_end|>\n",
        "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")]


def test_kto_named_template_truncation_is_llamafactorys_for_rows_and_kl_rows():
    """infer_seqlen on each row and on each mismatched row: both keep their start (the tokenizer-template
    rule would keep the prompt's end)."""
    from roll.data.feedback import FeedbackCollator

    tokenizer = _tokenizer("qwen3_nothink")
    long, enc = _long_kto(tokenizer)
    enc = enc[:3]
    cutoff = 16
    rows = _kto(tokenizer, "qwen3_nothink", long, cutoff_len=cutoff)
    assert [len(e) for e in enc] == [18, 11, 4]
    p, r = 10, 6  # both past half the budget: the reply int(16 * 11 / 29) = 6, the prompt the rest
    assert rows[0]["input_ids"] == enc[0][:p] + enc[1][:r] and rows[0]["labels"] == [X] * p + enc[1][:r]
    kl = FeedbackCollator(tokenizer.pad_token_id, cutoff_len=cutoff, named_template=True)(rows)
    # the kept prompt (10) with the second row's reply (4 < 16 / 2: whole); its start is kept
    assert kl["input_ids"][2, :14].tolist() == enc[0][:10] + enc[2]
    assert kl["labels"][2, :14].tolist() == [X] * 10 + enc[2]
    # the second row's prompt with the first row's kept reply (6)
    prompt1 = rows[1]["input_ids"][:-len(enc[2])]
    assert kl["input_ids"][3, :len(prompt1) + 6].tolist() == prompt1 + enc[1][:6]


def test_kto_rows_paired_in_the_tokenization_batch_as_llamafactory():
    """kto_mismatched_rows: llamafactory: each row's mismatched row is formed when tokenized, as LLaMA-Factory
    0.9.5's FeedbackDatasetProcessor forms its KL rows: the row's prompt with the reply of the batch's previous
    row (the first row: the batch's last), cut by infer_seqlen from their full lengths (the collator's rotation
    cuts the kept reply instead); the collator takes them, so a micro-batch of one row works, and a filler row
    stays a filler."""
    from roll.data.feedback import FeedbackCollator, FeedbackProcessor

    tokenizer = _tokenizer("qwen3_nothink")
    long, enc = _long_kto(tokenizer)
    assert [len(e) for e in enc] == [18, 11, 4, 9]
    processor = FeedbackProcessor(tokenizer, 16, "sharegpt", "mem.json", pair_in_batch=True,
                                  encoder=encoder_for(DataArguments(template="qwen3_nothink")))
    out = processor(batch_of(long), [0, 1])
    assert out["input_ids"] == [enc[0][:10] + enc[1][:6], enc[3] + enc[2]]  # the rows as without pairing
    # row 0: its prompt (18) with row 1's reply (4 < 16 / 2: whole), the prompt's start kept
    assert (out["kl_input_ids"][0], out["kl_labels"][0]) == (enc[0][:12] + enc[2], [X] * 12 + enc[2])
    # row 1: its prompt (9) with row 0's whole reply (11): int(16 * 11 / 20) = 8 of it, 8 of the prompt
    assert (out["kl_input_ids"][1], out["kl_labels"][1]) == (enc[3][:8] + enc[1][:8], [X] * 8 + enc[1][:8])
    rows = [{k: out[k][i] for k in out if not k.startswith("_")} for i in range(2)]
    filler = {**rows[0], "input_ids": [0, 0], "attention_mask": [0, 0], "labels": [X, X]}  # mca's filler_row
    batch = FeedbackCollator(tokenizer.pad_token_id, cutoff_len=16, named_template=True)([rows[1], filler])
    assert batch["input_ids"][2, :16].tolist() == enc[3][:8] + enc[1][:8]
    assert batch["attention_mask"][2].sum() == 16 and batch["attention_mask"][3].sum() == 0
    assert batch["labels"][3].tolist() == [X] * batch["labels"].shape[1]


@pytest.mark.parametrize("name, enable", [("glm4", True), ("qwen3", True), ("qwen3", False)])
def test_kto_efficient_eos_and_thinking(name, enable):
    """glm4: the reply slot then EOS (LLaMA-Factory appends it to a kto response); qwen3: the empty thought
    before the reply, trained with enable_thinking, else the end of the prompt."""
    tokenizer = _tokenizer(name)
    row = {"conversations": [{"from": "human", "value": "Hi"}, {"from": "gpt", "value": "Hello."}], "kto_tag": True}
    got = _kto(tokenizer, name, [row], enable_thinking=enable)[0]
    if name == "glm4":
        expected = [(["[gMASK]<sop>", "<|user|>\nHi<|assistant|>"], False), (["\nHello.", EOS], True)]
    elif enable:
        expected = [CHATML_TURNS[0], (["<think>\n\n</think>\n\n", "Hello.<|im_end|>\n"], True)]
    else:
        expected = [(CHATML_TURNS[0][0] + ["<think>\n\n</think>\n\n"], False), (["Hello.<|im_end|>\n"], True)]
    assert (got["input_ids"], got["labels"]) == _expected(tokenizer, expected)


def test_kto_mismatched_rows_of_a_named_template_keep_the_prompt_start():
    from roll.data.feedback import mismatched_rows

    rows = [{"input_ids": [1, 2, 3, 4, 5, 6], "labels": [X, X, X, X, 5, 6]},
            {"input_ids": [7, 8, 9, 10, 11, 12], "labels": [X, X, 9, 10, 11, 12]}]
    # prompt 4 + completion 4 in 6: both past half, the completion int(6 * 4 / 8) = 3, the prompt's first 3
    assert mismatched_rows(rows, 6, named_template=True)[0]["input_ids"] == [1, 2, 3, 9, 10, 11]
    assert mismatched_rows(rows, 6)[0]["input_ids"] == [2, 3, 4, 9, 10, 11]  # the tokenizer template's rule


@pytest.mark.parametrize("processor, fmt", [("reward", "pairwise"), ("feedback", "sharegpt"), ("pairwise", "pairwise")])
def test_every_conversation_stage_gets_the_named_template(processor, fmt):
    """make_processor hands the named template to rm's, kto's and dpo's processors (rm's was left out: its rows
    were laid out with the tokenizer's template whatever template: said)."""
    import datasets

    from roll.data.loading import Source
    from roll.data.pipeline import make_processor

    row = {"prompt": "2+3?", "chosen": "5.", "rejected": "6."} if fmt == "pairwise" else \
        {"conversations": TWO_TURNS["conversations"], "kto_tag": True}
    fn = make_processor(Source("mem.json", datasets.Dataset.from_list([row])), data_args=DataArguments(
        template="qwen", formatting=fmt), tokenizer=_tokenizer("qwen"), stage="x", processor=processor,
        allowed=(fmt,))
    assert fn.encoder is not None and fn.encoder.template.name == "qwen"
