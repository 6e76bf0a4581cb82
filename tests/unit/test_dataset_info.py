"""LLaMA-Factory's dataset registry: ``dataset:`` names entries of ``dataset_dir/dataset_info.json`` (default
``data``, relative to the working directory). A registered row trains as the same row written in roll's own
columns does (``columns`` / ``tags`` mapped with LLaMA-Factory's meanings); mistakes are config errors that name
the entry, the key and what would be valid."""

from __future__ import annotations

import json

import pytest

from roll.config.data import DataArguments
from roll.config.parser import parse_args
from roll.data import build_datasets
from roll.data.dataset_info import lookup
from roll.errors import ConfigError, DataError

SFT = ("supervised", ("alpaca", "sharegpt"))
DPO = ("pairwise", ("pairwise",))
PT = ("pretrain", ("text",))


@pytest.fixture(autouse=True)
def datasets_cache(tmp_path, monkeypatch):
    import datasets

    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(tmp_path / "hf_cache"))


def _write(path, rows) -> str:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(rows))
    return str(path)


def _registry(folder, entries: dict) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "dataset_info.json").write_text(json.dumps(entries))


def _build(tokenizer, kind=SFT, stage="sft", **data):
    args = DataArguments(**{"cutoff_len": 256, "shuffle": False, **data})
    return build_datasets(args, tokenizer, stage=stage, processor=kind[0], formats=kind[1], seed=0).train


ALPACA = [{"q": "Add the numbers.", "ctx": "2 and 3", "a": "5.", "sys": "Be brief.", "hist": [["Hi", "Hello."]],
           "system": "Never read: no entry names this column."},
          {"q": "", "ctx": "Only the query.", "a": "Fine.", "sys": "", "hist": [], "system": "unused"}]
SAME_IN_ROLL = [{"instruction": "Add the numbers.", "input": "2 and 3", "output": "5.", "system": "Be brief.",
                 "history": [["Hi", "Hello."]]},
                {"instruction": "Only the query.", "input": "", "output": "Fine."}]
SHAREGPT = [{"dialog": [{"speaker": "boss", "text": "Be brief."}, {"speaker": "me", "text": "What is 2+2?"},
                        {"speaker": "bot", "text": "4."}, {"speaker": "me", "text": "And 3+3?"},
                        {"speaker": "bot", "text": "6."}]}]
SHAREGPT_IN_ROLL = [{"conversations": [{"from": "system", "value": "Be brief."},
                                       {"from": "human", "value": "What is 2+2?"}, {"from": "gpt", "value": "4."},
                                       {"from": "human", "value": "And 3+3?"}, {"from": "gpt", "value": "6."}]}]
ENTRIES = {
    "mapped_alpaca": {"file_name": "alpaca.json",
                      "columns": {"prompt": "q", "query": "ctx", "response": "a", "system": "sys", "history": "hist"}},
    "mapped_chat": {"file_name": "chat.json", "formatting": "sharegpt", "columns": {"messages": "dialog"},
                    "tags": {"role_tag": "speaker", "content_tag": "text", "user_tag": "me", "assistant_tag": "bot",
                             "system_tag": "boss"}},
    "pairs": {"file_name": "pairs.json", "ranking": True,
              "columns": {"prompt": "instruction", "chosen": "good", "rejected": "bad"}},
    "feedback": {"file_name": "fb.json", "formatting": "sharegpt", "columns": {"messages": "m", "kto_tag": "label"},
                 "tags": {"role_tag": "role", "content_tag": "content", "user_tag": "user",
                          "assistant_tag": "assistant"}},
    "corpus": {"file_name": "corpus", "columns": {"prompt": "text"}},
}


@pytest.fixture
def registry(tmp_path, monkeypatch):
    """A registry in ./data of a fresh working directory (LLaMA-Factory's default dataset_dir)."""
    monkeypatch.chdir(tmp_path)
    data = tmp_path / "data"
    _write(data / "alpaca.json", ALPACA)
    _write(data / "chat.json", SHAREGPT)
    _write(data / "pairs.json", [{"instruction": "2+3?", "input": "", "good": "5.", "bad": "6."}])
    _write(data / "fb.json", [{"m": [{"role": "user", "content": "2+3?"}, {"role": "assistant", "content": "5."}],
                               "label": True}])
    (data / "corpus").mkdir()
    (data / "corpus" / "a.jsonl").write_text('{"text": "First document."}\n{"text": "Second one."}\n')
    _registry(data, ENTRIES)
    return tmp_path


def test_registered_names_load_with_their_columns_and_tags(bpe, registry):
    same = _write(registry / "roll" / "same.json", SAME_IN_ROLL)
    assert _build(bpe, dataset="mapped_alpaca")["input_ids"] == _build(bpe, dataset=same)["input_ids"]
    same = _write(registry / "roll" / "chat.json", SHAREGPT_IN_ROLL)
    assert _build(bpe, dataset="mapped_chat")["labels"] == _build(bpe, dataset=same)["labels"]
    same = _write(registry / "roll" / "pairs.json", [{"prompt": "2+3?", "chosen": "5.", "rejected": "6."}])
    assert _build(bpe, DPO, "dpo", dataset="pairs")["chosen_labels"] == \
        _build(bpe, DPO, "dpo", dataset=same)["chosen_labels"]
    # stage pt trains the prompt column ("text" here); a folder's files are its rows
    same = _write(registry / "roll" / "corpus.json", [{"text": "First document."}, {"text": "Second one."}])
    assert _build(bpe, PT, "pt", dataset="corpus", cutoff_len=4)["input_ids"] == \
        _build(bpe, PT, "pt", dataset=same, cutoff_len=4)["input_ids"]
    # kto_tag is carried into the row for stage kto
    entry = lookup("feedback", "data")
    assert entry.canonical({"m": [], "label": False}, "sharegpt")["kto_tag"] is False
    # a tools column is read when the entry names it (LLaMA-Factory's columns.tools), else not
    from roll.data.dataset_info import parse_entry

    tools = parse_entry("t", {"file_name": "x.json", "formatting": "sharegpt", "columns": {"messages": "m", "tools": "fn"}},
                        "r", "data")
    assert tools.canonical({"m": [], "fn": "[]"}, "sharegpt")["tools"] == "[]"
    assert "tools" not in entry.canonical({"m": [], "label": False, "tools": "[]"}, "sharegpt")
    # another dataset_dir
    moved = registry / "elsewhere"
    (registry / "data").rename(moved)
    assert len(_build(bpe, dataset="mapped_alpaca", dataset_dir=str(moved))) == 2


def test_names_mix_with_paths_and_interleave(bpe, registry):
    path = _write(registry / "plain.json", SAME_IN_ROLL[1:] * 3)
    mixed = _build(bpe, dataset=f"mapped_alpaca,{path}", mix_strategy="interleave_under")
    named, plain = _build(bpe, dataset="mapped_alpaca"), _build(bpe, dataset=path)
    assert mixed["input_ids"] == [named["input_ids"][0], plain["input_ids"][0], named["input_ids"][1],
                                  plain["input_ids"][1]]
    _, config = parse_args([f"dataset=mapped_alpaca,{path}", "mix_strategy=interleave_over",
                            "interleave_probs=0.5,0.5", "eval_dataset=mapped_chat"])
    assert config.data.interleave_probs == [0.5, 0.5]


def test_unknown_name_lists_the_registered_ones(registry):
    with pytest.raises(ConfigError, match=r"dataset 'mapped_alpac': not a file or directory, nor a name registered "
                                          r"in data/dataset_info.json \(did you mean 'mapped_alpaca'\?\); its names: "
                                          r"corpus, feedback, mapped_alpaca, mapped_chat, pairs\."):
        parse_args(["dataset=mapped_alpac"])
    with pytest.raises(ConfigError, match="eval_dataset|dataset 'nope'"):
        parse_args(["dataset=mapped_alpaca", "eval_dataset=nope"])


def test_ranking_entries_only_for_pairwise_stages(bpe, registry):
    with pytest.raises(ConfigError, match="'pairs'.*holds preference pairs.*stage sft"):
        _build(bpe, dataset="pairs")
    with pytest.raises(ConfigError, match="'mapped_alpaca'.*no preference pairs.*stage dpo"):
        _build(bpe, DPO, "dpo", dataset="mapped_alpaca")


def test_a_column_the_file_lacks_names_the_entry(bpe, registry):
    _registry(registry / "data", {**ENTRIES, "typo": {"file_name": "alpaca.json", "columns": {"prompt": "question"}}})
    with pytest.raises(DataError, match=r"dataset 'typo' .*column 'question' \(columns.prompt\) is not in the file"):
        _build(bpe, dataset="typo")
    _registry(registry / "data", {**ENTRIES, "no_reply": {"file_name": "alpaca.json", "columns": {"prompt": "q"}}})
    with pytest.raises(DataError, match="'no_reply' .*: it names no column for response"):
        _build(bpe, dataset="no_reply")


def test_with_columns_only_the_named_columns_are_read(bpe, registry, roll_warnings):
    """LLaMA-Factory's meaning: an entry with ``columns`` reads only the parts it names (``input`` here is not
    read), and one warning names the default column left unread."""
    plain = [{"instruction": "Add.", "input": "2 and 3", "output": "5."}]
    _write(registry / "data" / "plain.json", plain)
    _registry(registry / "data", {**ENTRIES, "partial": {"file_name": "plain.json",
                                                         "columns": {"prompt": "instruction", "response": "output"}}})
    same = _write(registry / "roll" / "same.json", [{"instruction": "Add.", "output": "5."}])
    assert _build(bpe, dataset="partial")["input_ids"] == _build(bpe, dataset=same)["input_ids"]
    assert "the file's column(s) 'input' (columns.query) are not read" in roll_warnings.text


@pytest.mark.parametrize("entry, message", [
    ("alpaca.json", "must be an object"),
    ({"file_name": "alpaca.json", "colums": {}}, "unknown key\\(s\\) colums \\(did you mean 'columns'\\?\\)"),
    ({"formatting": "alpaca"}, "exactly one of file_name or hf_hub_url"),
    ({"ms_hub_url": "x/y"}, "ModelScope"),
    ({"file_name": "alpaca.json", "formatting": "openai"}, "formatting must be alpaca or sharegpt"),
    ({"file_name": "alpaca.json", "columns": {"videos": "vid"}}, "columns.videos: multimodal rows"),
    ({"file_name": "alpaca.json", "columns": {"promt": "q"}}, "columns.promt .*did you mean 'prompt'"),
    ({"file_name": "alpaca.json", "tags": ["from"]}, "tags must be an object"),
    ({"file_name": "alpaca.json", "num_samples": 10}, "num_samples is not supported yet; use max_samples"),
    ({"file_name": "alpaca.json", "split": "dev"}, "split 'dev' cannot be read"),
    ({"file_name": "alpaca.json", "ranking": "yes"}, "ranking must be true or false"),
    ({"file_name": "missing.json"}, "file_name 'data/missing.json' does not exist"),
])
def test_malformed_entries_are_clear_config_errors(registry, entry, message):
    _registry(registry / "data", {**ENTRIES, "bad": entry})
    with pytest.raises(ConfigError, match=rf"dataset 'bad'.*{message}"):
        parse_args(["dataset=bad"])


def test_a_registry_that_is_not_json_is_named(registry):
    (registry / "data" / "dataset_info.json").write_text("{not json")
    with pytest.raises(ConfigError, match="the dataset registry data/dataset_info.json is not valid JSON"):
        parse_args(["dataset=mapped_alpaca"])


def test_a_registered_name_streams_the_rows_it_gives_in_memory(bpe, registry):
    from roll.data.streaming import set_stream_length

    memory = _build(bpe, dataset="mapped_chat,mapped_alpaca")
    bundle = build_datasets(DataArguments(dataset="mapped_chat,mapped_alpaca", cutoff_len=256, shuffle=False,
                                          streaming=True), bpe, stage="sft", processor=SFT[0], formats=SFT[1],
                            seed=0)
    set_stream_length(bundle.train, len(memory), 1)
    assert [bundle.train[i]["labels"] for i in range(len(memory))] == memory["labels"]
