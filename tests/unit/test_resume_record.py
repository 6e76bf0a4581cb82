"""The record a checkpoint keeps of the run's position and training set, and the resume check built on it
(roll.resume_record, roll.data.fingerprint); no training."""

from __future__ import annotations

import json

import datasets
import pytest

from roll import resume_record
from roll.data.fingerprint import dataset_fingerprint
from roll.errors import ConfigError
from roll.reliability import global_batch_samples


def _rows(*lengths: int, start: int = 0) -> datasets.Dataset:
    ids = [list(range(start + i, start + i + n)) for i, n in enumerate(lengths)]
    return datasets.Dataset.from_dict({"input_ids": ids, "labels": ids})


def test_the_fingerprint_follows_the_rows_in_order_not_how_they_are_stored():
    data = _rows(3, 2, 4)
    same = datasets.concatenate_datasets([data.select([0]), data.select([1, 2])])  # other chunks and offsets
    assert dataset_fingerprint(same) == dataset_fingerprint(data)
    assert dataset_fingerprint(data.select([1, 0, 2])) != dataset_fingerprint(data)  # order
    assert dataset_fingerprint(_rows(3, 2, 4, start=1)) != dataset_fingerprint(data)  # a token
    split = [datasets.Dataset.from_dict({"input_ids": ids}) for ids in ([[0, 1, 2], [3, 4]], [[0, 1], [2, 3, 4]])]
    assert dataset_fingerprint(split[0]) != dataset_fingerprint(split[1])  # the same tokens, other rows


@pytest.mark.parametrize("steps, batch, rows", [(0, 4, 10), (2, 4, 10), (3, 4, 10), (7, 4, 10), (5, 3, 3)])
def test_consumed_samples_is_what_the_global_batches_read(steps, batch, rows):
    expected = sum(len(global_batch_samples(step, batch, rows)) for step in range(steps))
    assert resume_record.consumed_samples(steps, batch, rows) == expected


def _checkpoint(tmp_path, data, **overrides) -> str:
    resume_record.write(str(tmp_path), data, dataset_spec="train.json", global_step=3, global_batch_size=4,
                        skipped_steps=2)
    if overrides:
        path = tmp_path / resume_record.RECORD
        path.write_text(json.dumps({**json.loads(path.read_text()), **overrides}))
    return str(tmp_path)


def test_the_record_holds_position_counter_and_training_set(tmp_path):
    data = _rows(*[2] * 10)
    record = resume_record.read(_checkpoint(tmp_path, data))
    assert record == {"global_step": 3, "global_batch_size": 4, "consumed_samples": 10, "skipped_steps": 2,
                      "dataset": "train.json", "num_samples": 10, "dataset_fingerprint": dataset_fingerprint(data)}
    resume_record.check_same_data(str(tmp_path), data, dataset_spec="train.json", global_batch_size=4)


@pytest.mark.parametrize("now, spec, overrides, fragment", [
    ("fewer", "train.json", {}, "10 training samples then, 9 now"),
    ("edited", "train.json", {}, "the same number of samples (10) with other contents or order"),
    ("same", "other.json", {}, "dataset was 'train.json', now 'other.json'"),
    ("same", "train.json", {"consumed_samples": 12}, "its 3 steps consumed 12 samples, on this training set "
                                                      "they consume 10"),
])
def test_a_changed_training_set_is_refused_naming_what_changed_and_the_way_out(tmp_path, now, spec, overrides,
                                                                               fragment):
    data = _rows(*[2] * 10)
    ckpt = _checkpoint(tmp_path, data, **overrides)
    current = {"fewer": data.select(range(9)), "edited": _rows(*[2] * 9, 3), "same": data}[now]
    with pytest.raises(ConfigError) as raised:
        resume_record.check_same_data(ckpt, current, dataset_spec=spec, global_batch_size=4)
    message = str(raised.value)
    assert fragment in message and f"resume_from_checkpoint={ckpt!r}" in message
    assert "overwrite_output_dir: true" in message and "another output_dir" in message


def test_a_checkpoint_without_a_record_resumes_with_a_warning(tmp_path, roll_warnings):
    resume_record.check_same_data(str(tmp_path), _rows(2), dataset_spec="x.json", global_batch_size=1)
    assert "resuming without checking that the dataset is the same" in roll_warnings.text
