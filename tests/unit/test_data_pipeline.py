"""build_datasets end to end on small files in tmp dirs: sources, formats, splits, order, errors, cache."""

from __future__ import annotations

import json
import os

import pytest

from roll.config.data import DataArguments
from roll.data import build_datasets
from roll.data.processors import SupervisedProcessor
from roll.errors import ConfigError, DataError

SFT = ("supervised", ("alpaca", "sharegpt"))
ROWS = [{"instruction": f"What is {a} plus {b}?", "input": "", "output": f"{a} plus {b} equals {a + b}."}
        for a in range(4) for b in range(5)]


@pytest.fixture(autouse=True)
def datasets_cache(tmp_path, monkeypatch):
    """Each test gets its own HF datasets cache, so nothing leaks between tests (or into ~/.cache)."""
    import datasets

    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(tmp_path / "hf_cache"))


def write_json(path, rows, lines: bool = False) -> str:
    with open(path, "w", encoding="utf-8") as handle:
        if lines:
            handle.writelines(json.dumps(r) + "\n" for r in rows)
        else:
            json.dump(rows, handle)
    return str(path)


def build(tokenizer, stage="sft", processor_formats=SFT, seed=0, **data):
    args = DataArguments(**{"cutoff_len": 64, **data})
    return build_datasets(args, tokenizer, stage=stage, processor=processor_formats[0],
                          formats=processor_formats[1], seed=seed)


def test_file_types_give_the_same_rows(bpe, tmp_path):
    import datasets

    frame = datasets.Dataset.from_list(ROWS)
    frame.to_csv(tmp_path / "a.csv")
    frame.to_parquet(tmp_path / "a.parquet")
    paths = [write_json(tmp_path / "a.json", ROWS), write_json(tmp_path / "a.jsonl", ROWS, lines=True),
             str(tmp_path / "a.csv"), str(tmp_path / "a.parquet")]
    results = [build(bpe, dataset=p, shuffle=False) for p in paths]
    assert {len(r.train) for r in results} == {len(ROWS)}
    assert all(r.train["input_ids"] == results[0].train["input_ids"] for r in results)
    stats = results[0].stats
    assert (stats.num_samples_in, stats.num_samples, stats.num_dropped) == (len(ROWS), len(ROWS), 0)
    assert stats.num_tokens == sum(len(x) for x in results[0].train["input_ids"])
    assert stats.num_trainable_tokens == sum(sum(t != -100 for t in x) for x in results[0].train["labels"])


def test_directory_saved_dataset_and_several_sources(bpe, tmp_path):
    import datasets

    folder = tmp_path / "dir"
    folder.mkdir()
    write_json(folder / "one.json", ROWS[:5])
    write_json(folder / "two.jsonl", ROWS[5:12], lines=True)
    saved = str(tmp_path / "saved")
    datasets.Dataset.from_list(ROWS[12:]).save_to_disk(saved)
    bundle = build(bpe, dataset=f"{folder}, {saved}", shuffle=False)
    assert len(bundle.train) == len(ROWS)
    first = build(bpe, dataset=write_json(tmp_path / "all.json", ROWS), shuffle=False).train["input_ids"]
    assert bundle.train["input_ids"] == first


def test_text_files_for_pt(bpe, tmp_path):
    path = tmp_path / "corpus.txt"
    path.write_text("the cat sees the dog\n\none two three\n", encoding="utf-8")
    bundle = build(bpe, stage="pt", processor_formats=("pretrain", ("text",)), dataset=str(path), packing=True)
    assert bundle.stats.num_samples == 2 and bundle.stats.dropped == {"empty_text": 1}
    # concatenated, the two texts fill no cutoff_len row, and the short remainder is dropped (LLaMA-Factory's)
    with pytest.raises(DataError, match=r"no training row: .* fewer than cutoff_len=64 .* packing: true"):
        build(bpe, stage="pt", processor_formats=("pretrain", ("text",)), dataset=str(path))


def test_max_samples_val_size_and_eval_dataset(bpe, tmp_path):
    path = write_json(tmp_path / "a.json", ROWS)
    assert len(build(bpe, dataset=f"{path},{path}", max_samples=3).train) == 6
    split = build(bpe, dataset=path, val_size=0.25)
    assert (len(split.train), len(split.eval), split.stats.num_eval_samples) == (15, 5, 5)
    assert len(build(bpe, dataset=path, val_size=4).eval) == 4
    other = build(bpe, dataset=path, eval_dataset=write_json(tmp_path / "b.json", ROWS[:3]))
    assert (len(other.train), len(other.eval)) == (20, 3)
    with pytest.raises(ConfigError, match="val_size"):
        build(bpe, dataset=path, val_size=20)
    # a fraction that would leave no training row is the same clear error (not datasets' ValueError)
    with pytest.raises(ConfigError, match="val_size=0.99 leaves no training"):
        build(bpe, dataset=path, val_size=0.99)
    assert len(build(bpe, dataset=path, val_size=0.01).eval) == 1  # rounds up, like datasets


def test_max_samples_takes_each_entrys_first_rows_in_the_files_order(bpe, tmp_path):
    """LLaMA-Factory's max_samples: the first rows of each dataset entry (a folder's files in name order),
    before mixing; the pipeline keeps the rows in that order whatever shuffle says (the backends draw each
    epoch's order: roll.data.order)."""
    def ids(rows, name):
        return build(bpe, dataset=write_json(tmp_path / name, rows), shuffle=False).train["input_ids"]

    path = write_json(tmp_path / "a.json", ROWS)
    assert build(bpe, dataset=path, max_samples=5).train["input_ids"] == ids(ROWS[:5], "first5.json")
    assert build(bpe, dataset=path, shuffle=False).train["input_ids"] == build(bpe, dataset=path).train["input_ids"]
    assert build(bpe, dataset=f"{path},{path}", max_samples=3).train["input_ids"] == ids(ROWS[:3] * 2, "twice.json")
    folder = tmp_path / "folder"
    folder.mkdir()
    write_json(folder / "1.json", ROWS[10:13])
    write_json(folder / "2.json", ROWS[:10])
    write_json(folder / "3.json", ROWS[13:])
    mixed = build(bpe, dataset=f"{folder},{path}", max_samples=5, mix_strategy="interleave_under")
    first = ROWS[10:13] + ROWS[:2]  # the folder's 5: file 1's 3 rows, then file 2's first 2; file 3 left out
    assert mixed.train["input_ids"] == ids([r for pair in zip(first, ROWS[:5]) for r in pair], "rr.json")


def test_skipped_rows_are_counted(bpe, tmp_path):
    rows = ROWS[:4] + [{"instruction": "Hi", "input": "", "output": ""}]
    bundle = build(bpe, dataset=write_json(tmp_path / "a.json", rows))
    assert (bundle.stats.num_samples_in, bundle.stats.num_samples) == (5, 4)
    assert bundle.stats.dropped == {"empty_reply": 1} and bundle.stats.num_dropped == 1
    assert "_drop" not in bundle.train.column_names


def test_everything_dropped_is_an_error(bpe, tmp_path):
    rows = [{"instruction": "Hi", "input": "", "output": ""}] * 3
    with pytest.raises(DataError, match=r"no samples left.*empty_reply=3"):
        build(bpe, dataset=write_json(tmp_path / "a.json", rows))


def test_format_errors_name_the_file(bpe, tmp_path):
    path = write_json(tmp_path / "pairs.json", [{"prompt": "a", "chosen": "b", "rejected": "c"}])
    with pytest.raises(DataError, match=r"pairs\.json: pairwise rows .* cannot be used for stage sft"):
        build(bpe, dataset=path)
    path = write_json(tmp_path / "noout.json", [{"instruction": "a", "input": ""}])
    with pytest.raises(DataError, match=r"noout\.json: alpaca rows need the column\(s\) output"):
        build(bpe, dataset=path)
    path = write_json(tmp_path / "odd.json", [{"question": "a", "answer": "b"}])
    with pytest.raises(DataError, match=r"odd\.json: cannot tell the row format .*'question'"):
        build(bpe, dataset=path)


def test_wrong_type_in_a_row_names_file_and_row(bpe, tmp_path):
    rows = ROWS[:3] + [{"instruction": "Hi", "input": "", "output": 42}]
    with pytest.raises(DataError, match=r"bad\.json, row 3 \(0-based\): column 'output' holds a int"):
        build(bpe, dataset=write_json(tmp_path / "bad.json", rows))
    # a column of one wrong type throughout reaches the processor, which names the first row
    rows = [{"instruction": "Hi", "input": "", "output": [1]}] * 2
    expected = r"bad2\.json, row 0 \(0-based\): 'output' must be a string, got list"
    with pytest.raises(DataError, match=expected):
        build(bpe, dataset=write_json(tmp_path / "bad2.json", rows))


@pytest.mark.parametrize("shuffle", [True, False])
def test_row_named_in_the_file_after_max_samples(bpe, tmp_path, shuffle):
    """max_samples selects rows; an error still names the row of the file."""
    rows = [dict(r) for r in ROWS]
    rows[5] = {"instruction": "Hi", "input": ""}  # no output: reaches the processor as None
    path = write_json(tmp_path / "a.jsonl", rows, lines=True)
    with pytest.raises(DataError, match=r"a\.jsonl, row 5 \(0-based\): 'output' must be a string"):
        build(bpe, dataset=path, max_samples=19, shuffle=shuffle)


@pytest.mark.parametrize("bad_value", [{"x": 1}, 7])
@pytest.mark.parametrize("lines", [False, True])
def test_mixed_types_in_a_column_name_the_row(bpe, tmp_path, bad_value, lines):
    """datasets would decode such a column as JSON (the string "3" becomes 3): the faulty row is named."""
    rows = [dict(r) for r in ROWS]
    rows[0]["output"] = "3"
    rows[9]["output"] = bad_value
    path = write_json(tmp_path / ("m.jsonl" if lines else "m.json"), rows, lines=lines)
    with pytest.raises(DataError, match=r"m\.jsonl?, row 9 \(0-based\): column 'output' holds a"):
        build(bpe, dataset=path)


def test_undecodable_files(bpe, tmp_path):
    broken = tmp_path / "broken.jsonl"
    broken.write_text(json.dumps(ROWS[0]) + "\n" + '{"instruction": "x", \n', encoding="utf-8")
    with pytest.raises(DataError, match=r"broken\.jsonl: invalid JSON on line 2 \(row 1\)"):
        build(bpe, dataset=str(broken))
    latin = tmp_path / "latin.json"
    latin.write_bytes(b'[{"instruction": "caf\xe9", "input": "", "output": "x"}]')
    with pytest.raises(DataError, match=r"latin\.json: not valid UTF-8"):
        build(bpe, dataset=str(latin))


def test_missing_and_unsupported_sources(bpe, tmp_path):
    with pytest.raises(DataError, match="not found"):
        build(bpe, dataset=str(tmp_path / "nope.json"))
    (tmp_path / "a.xml").write_text("<a/>")
    with pytest.raises(DataError, match="unsupported file type '.xml'"):
        build(bpe, dataset=str(tmp_path / "a.xml"))
    with pytest.raises(DataError, match="no dataset given"):
        build(bpe, dataset=" , ")


def test_second_run_reuses_the_tokenization_cache(bpe, tmp_path, monkeypatch):
    path = write_json(tmp_path / "a.json", ROWS)
    first = build(bpe, dataset=path)

    def must_not_run(self, batch, indices):
        raise AssertionError("tokenized again instead of loading the cache")

    monkeypatch.setattr(SupervisedProcessor, "__call__", must_not_run)
    second = build(bpe, dataset=path)
    assert second.train["input_ids"] == first.train["input_ids"]
    with pytest.raises(AssertionError, match="tokenized again"):
        build(bpe, dataset=path, overwrite_cache=True)
    assert any(os.sep + "hf_cache" + os.sep in f["filename"] for f in second.train.cache_files)


def test_dpo_with_packing_is_refused(bpe, tmp_path):
    path = write_json(tmp_path / "p.json", [{"prompt": "a", "chosen": "b", "rejected": "c"}])
    with pytest.raises(ConfigError, match="packing"):
        build(bpe, stage="dpo", processor_formats=("pairwise", ("pairwise",)), dataset=path, packing=True)


@pytest.mark.parametrize("env, offline", [({}, False), ({"HF_HUB_OFFLINE": "1"}, True), ({"HF_HUB_OFFLINE": "0"}, False),
                                          ({"HF_DATASETS_OFFLINE": "yes"}, True), ({"TRANSFORMERS_OFFLINE": "ON"}, True),
                                          ({"HF_HUB_OFFLINE": "false"}, False)])
def test_hub_offline_reads_the_hf_switches_like_hf(monkeypatch, env, offline):
    from roll.data.loading import OFFLINE_ENV, hub_offline

    for name in OFFLINE_ENV:
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    assert hub_offline() is offline
