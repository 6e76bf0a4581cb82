"""Stage processors: skipped rows are counted by reason, broken rows name the row, truncation rules."""

from __future__ import annotations

import pytest

from roll import IGNORE_INDEX
from roll.data.processors import (PairwiseProcessor, PretrainProcessor, SupervisedProcessor, split_budget,
                                  truncate_turns)
from roll.errors import DataError
from tests.helpers import batch_of

X = IGNORE_INDEX


def turn(role: str, text: str) -> dict:
    return {"from": role, "value": text}


@pytest.mark.parametrize("conversation,reason", [
    ([], "empty_conversation"),
    ([turn("gpt", "Hi."), turn("human", "Hello")], "bad_turn_order"),
    ([turn("human", "Hi"), turn("human", "Hello"), turn("gpt", "Yes.")], "bad_turn_order"),
    ([turn("human", "Hi"), turn("gpt", "Hello."), turn("human", "And?")], "no_assistant_reply"),
    ([turn("human", "Hi"), turn("gpt", "  ")], "empty_reply"),
    ([turn("human", "Hi"), turn("gpt", "Hello."), turn("system", "late system")], "bad_turn_order"),
])
def test_sft_rows_skipped_with_a_reason(bpe, conversation, reason):
    rows = [{"conversations": [turn("human", "Hi"), turn("gpt", "Hello.")]}, {"conversations": conversation}]
    out = SupervisedProcessor(bpe, 64, "sharegpt", "mem.json")(batch_of(rows), [0, 1])
    assert out["_drop"] == ["", reason]
    assert out["input_ids"][1] == [] and len(out["input_ids"][0]) > 0


def test_pair_with_equal_answers_is_skipped(bpe):
    rows = [{"prompt": "Hi", "chosen": "Same.", "rejected": "Same."}]
    out = PairwiseProcessor(bpe, 64, "pairwise", "mem.json")(batch_of(rows), [0])
    assert out["_drop"] == ["chosen_equals_rejected"]


@pytest.mark.parametrize("row,expected", [
    ({"instruction": "Hi", "input": "", "output": 5}, "'output' must be a string"),
    ({"instruction": ["Hi"], "input": "", "output": "Yo."}, "'instruction' must be a string"),
])
def test_wrong_type_names_file_and_row(bpe, row, expected):
    good = {"instruction": "Hi", "input": "", "output": "Hello."}
    with pytest.raises(DataError, match=rf"data/x\.json, row 7 \(0-based\): {expected}"):
        SupervisedProcessor(bpe, 64, "alpaca", "data/x.json")(batch_of([good, row]), [6, 7])


def test_unknown_role_names_the_turn(bpe):
    with pytest.raises(DataError, match=r"row 0.*'conversations'\[1\] has role 'bot'"):
        SupervisedProcessor(bpe, 64, "sharegpt", "x.json")(
            batch_of([{"conversations": [turn("human", "Hi"), turn("bot", "Yo")]}]), [0])


@pytest.mark.parametrize("prompt,answer,budget,expected", [
    (10, 10, 30, (10, 10)),      # fits
    (100, 10, 64, (54, 10)),     # long prompt: trimmed first, answer kept
    (10, 100, 64, (10, 54)),     # long answer: prompt kept, answer cut
    (100, 100, 64, (32, 32)),    # both long: prompt keeps half
])
def test_split_budget(prompt, answer, budget, expected):
    assert split_budget(prompt, answer, budget) == expected


def test_truncate_turns_trims_prompt_from_the_left_and_answer_from_the_right():
    prompt, reply = list(range(100, 110)), list(range(200, 210))
    ids, labels, truncated = truncate_turns([(prompt, reply, True)], 8)
    assert truncated
    assert ids == [106, 107, 108, 109, 200, 201, 202, 203]
    assert labels == [X, X, X, X, 200, 201, 202, 203]


def test_truncate_turns_drops_later_turns_and_masks_first_label():
    turns = [([1, 2], [3, 4], True), ([5, 6], [7, 8], True), ([9], [10], True)]
    assert truncate_turns(turns, 6) == ([1, 2, 3, 4, 6, 7], [X, X, 3, 4, X, 7], True)
    # a reply with no prompt still never trains position 0
    assert truncate_turns([([], [3, 4], True)], 6) == ([3, 4], [X, 4], False)


def test_sft_row_with_nothing_trainable_after_cutoff_is_dropped(bpe):
    """Training only the last turn, when the first turn already fills cutoff_len."""
    row = {"conversations": [turn("human", "the cat sees the dog " * 10),
                             turn("gpt", "the dog sees the cat " * 10),
                             turn("human", "Hi"), turn("gpt", "Hello.")]}
    out = SupervisedProcessor(bpe, 16, "sharegpt", "x.json", train_turns="last")(batch_of([row]), [0])
    assert out["_drop"] == ["no_trainable_tokens"]


def test_sft_truncation_keeps_the_answer_and_the_assistant_header(bpe):
    long_prompt = " ".join(["the cat sees the dog"] * 40)
    out = SupervisedProcessor(bpe, 48, "alpaca", "x.json")(
        batch_of([{"instruction": long_prompt, "input": "", "output": "Yes, the cat sees the dog."}]), [0])
    ids, labels = out["input_ids"][0], out["labels"][0]
    assert out["_truncated"] == [True] and len(ids) == 48
    assert bpe.decode([t for t in labels if t != X]) == "Yes, the cat sees the dog.<|im_end|>"
    assert "<|im_start|>assistant\n" in bpe.decode(ids)


def test_pair_truncation_keeps_the_same_prompt_on_both_sides(bpe):
    row = {"prompt": " ".join(["the cat sees the dog"] * 40), "chosen": "Yes, the cat runs. " * 10,
           "rejected": "No."}
    out = PairwiseProcessor(bpe, 64, "pairwise", "x.json")(batch_of([row]), [0])
    chosen, rejected = out["chosen_input_ids"][0], out["rejected_input_ids"][0]
    n_prompt = out["rejected_labels"][0].count(X)
    assert out["_truncated"] == [True] and len(chosen) <= 64 and len(rejected) <= 64
    assert chosen[:n_prompt] == rejected[:n_prompt]
    assert out["chosen_labels"][0][:n_prompt] == [X] * n_prompt


def test_pretrain_concatenates_appends_eos_and_chunks(bpe):
    texts = ["the cat sees the dog", "", "one two three four five six seven eight nine ten"]
    out = PretrainProcessor(bpe, 8, "text", "x.jsonl")(batch_of([{"text": t} for t in texts]), [0, 1, 2])
    kept = [i for i, d in enumerate(out["_drop"]) if not d]
    assert out["_drop"].count("empty_text") == 1 and out["input_ids"][out["_drop"].index("empty_text")] == []
    flat = [t for i in kept for t in out["input_ids"][i]]
    docs = [bpe(text)["input_ids"] + [bpe.eos_token_id] for text in (texts[0], texts[2])]
    expected = [t for doc in docs for t in doc]
    whole = len(expected) // 8 * 8
    assert 0 < whole < len(expected)  # the short remainder is dropped, as LLaMA-Factory drops it
    assert flat == expected[:whole]
    assert all(len(out["input_ids"][i]) == 8 for i in kept)
    assert all(out["labels"][i] == [X] + out["input_ids"][i][1:] for i in kept)
    assert sum(out["_docs"]) == sum(end <= whole for end in (len(docs[0]), len(expected)))


def test_pretrain_packing_splits_only_long_documents(bpe):
    texts = ["the cat", "one two three four five six seven eight nine ten eleven"]
    processor = PretrainProcessor(bpe, 6, "text", "x.jsonl", packing=True)
    out = processor(batch_of([{"text": t} for t in texts]), [0, 1])
    first = bpe("the cat")["input_ids"] + [bpe.eos_token_id]
    assert out["input_ids"][0] == first and out["_truncated"][0] is False
    assert all(out["_truncated"][1:]) and sum(out["_docs"]) == 2


def test_segmentation_check_warns_for_a_prefix_space_tokenizer(roll_warnings):
    from roll.data.processors import check_segmentation

    class PrefixSpace:  # like legacy SentencePiece: every call starts a new word
        def __call__(self, texts, add_special_tokens=False):
            return {"input_ids": [[0] + [ord(c) for c in text] for text in texts]}

    turns = [("Q:", "A.", True)]
    tokenized = [(PrefixSpace()(["Q:"])["input_ids"][0], PrefixSpace()(["A."])["input_ids"][0], True)]
    check_segmentation(PrefixSpace(), turns, tokenized)
    assert "different tokens than the whole conversation" in roll_warnings.text


def test_pair_truncated_only_in_the_prompt_is_counted(bpe):
    row = {"prompt": " ".join(["the cat sees the dog"] * 40), "chosen": "Yes.", "rejected": "No."}
    out = PairwiseProcessor(bpe, 64, "pairwise", "x.json")(batch_of([row]), [0])
    assert out["_truncated"] == [True]
    assert bpe.decode([t for t in out["chosen_labels"][0] if t != X]) == "Yes.<|im_end|>"
