"""stage kto: the definition (roll.kto) against a hand formula and against TRL 1.16's own KTO loss, the kto_tag
rows (alpaca, sharegpt), the mismatched rows of the reference point, and the recipe keys."""

from __future__ import annotations

import json
import math
import os

import pytest
import torch

from roll import IGNORE_INDEX
from roll import kto as roll_kto
from roll.config.data import DataArguments
from roll.errors import ConfigError, DataError

KTO = ("feedback", ("alpaca", "sharegpt"))


def _sigmoid(x: float) -> float:
    return 1.0 / (1.0 + math.exp(-x))


# ---- the definition --------------------------------------------------------------------------------------

def test_kto_loss_reference_point_and_metrics_by_hand():
    """TRL's KTO by hand in Python floats: z = max(0, mean over a micro-batch's real rows of the mismatched
    rows' policy - reference log-probs, averaged over ranks), a desirable row's loss w_D (1 - s(beta (rho -
    z))), an undesirable row's w_U (1 - s(beta (z - rho))); a filler row counts nothing; the metrics are
    means over each class's rows."""
    settings = roll_kto.KTOSettings(beta=0.5, desirable_weight=1.3, undesirable_weight=0.7)
    kl = torch.tensor([[-10.0, -12.0, -3.0, 0.0], [-5.0, -6.0, -7.0, -8.0]], dtype=torch.float64)
    ref_kl = torch.tensor([[-11.0, -11.5, -9.0, 0.0], [-4.0, -5.0, -6.0, -9.0]], dtype=torch.float64)
    valid = torch.tensor([[True, True, False, False], [True, True, True, True]])  # two fillers in the first
    z = roll_kto.kl_reference_points(kl, ref_kl, valid)
    assert z.tolist() == [pytest.approx((1.0 - 0.5) / 2, abs=1e-15), 0.0]  # the second, -0.5, clamped
    assert not z.requires_grad

    logps = torch.tensor([-20.0, -30.0, -25.0, -1.0], dtype=torch.float64, requires_grad=True)
    ref = torch.tensor([-21.0, -28.0, -25.5, -1.0], dtype=torch.float64)
    desirable = torch.tensor([True, False, True, False])
    real = torch.tensor([True, True, True, False])
    losses, report = roll_kto.kto_losses(logps, ref, desirable, real, z[0], settings)
    zz = 0.25
    expected = [1.3 * (1 - _sigmoid(0.5 * (1.0 - zz))), 0.7 * (1 - _sigmoid(0.5 * (zz - (-2.0)))),
                1.3 * (1 - _sigmoid(0.5 * (0.5 - zz))), 0.0]
    assert losses.tolist() == pytest.approx(expected, rel=1e-14)
    losses.sum().backward()
    assert logps.grad[3] == 0 and logps.grad[0] < 0 < logps.grad[1]  # desirable up, undesirable down

    metrics = roll_kto.metrics(report.tolist())
    assert metrics == pytest.approx({
        "loss": sum(expected) / 3, "kl": zz, "rewards/chosen": 0.5 * (1.0 + 0.5) / 2, "rewards/rejected": -1.0,
        "rewards/margins": 0.5 * 1.5 / 2 + 1.0, "logps/chosen": -22.5, "logps/rejected": -30.0}, rel=1e-14)
    # a step without undesirable rows logs no */rejected and no margin (as TRL)
    _, only_good = roll_kto.kto_losses(logps.detach(), ref, torch.tensor([True] * 4), real, z[0], settings)
    assert set(roll_kto.metrics(only_good.tolist())) == {"loss", "kl", "rewards/chosen", "logps/chosen"}


def test_standard_kto_equals_trls_own_kto_loss_on_one_batch(tiny_model_dir, tmp_path, monkeypatch):
    """The standard backend's trainer (roll's collator, roll.kto on roll.loss's log-probs) and TRL 1.16's own
    text path (its +1 rotation, its collator, its ``KTOTrainer._compute_loss``: fused-head log-probs, loss and
    metric code) on one micro-batch of roll's demo kto data, both classes in it, a reference that differs from
    the policy (so the rewards and the reference point are not 0) and unequal class weights: the same
    mismatched rows, and the loss, the reference point and every reward / log-prob mean agree. Measured gaps
    (TRL sums its fused kernel's fp32 log-probs in fp32, roll in float64): loss 6.8e-7 relative, kl 2e-7,
    rewards 1.8e-6, log-probs 4e-8; the margin (-0.22, a difference of two rewards near 1) 2.9e-6 absolute."""
    import datasets
    from trl import KTOTrainer

    from backends.standard.backend import StandardBackend
    from roll.config.parser import resolve
    from roll.router import build_job

    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(tmp_path / "hf_cache"))
    recipe = dict(model_name_or_path=tiny_model_dir, stage="kto", dataset="recipes/demo/data/arithmetic_kto.json",
                  cutoff_len=64, per_device_train_batch_size=6, output_dir=str(tmp_path / "out"), report_to="none",
                  save_strategy="no", pref_beta=0.5, kto_chosen_weight=1.3, kto_undesirable_weight=0.7, seed=0)
    backend = StandardBackend(resolve(recipe, {}, None))
    backend.setup_distributed()
    try:
        job, _ = build_job(backend.config, backend.padding_policy("kto"))
        trainer = backend._make_trainer(job, backend.apply_finetuning(backend.load_models("kto", job.tokenizer)))
        with torch.no_grad():
            generator = torch.Generator().manual_seed(2)  # seed 2: the reference point is 2.06 (seed 0's is 0)
            for param in trainer.ref_model.parameters():
                param.add_(torch.randn(param.shape, generator=generator) * 0.05)
        rows = [job.train_dataset[i] for i in range(6)]
        assert {row["kto_tag"] for row in rows} == {True, False}
        batch = job.collator(rows)
        trl_batch = _trl_batch(rows, job.tokenizer.pad_token_id)
        for j in range(6):  # TRL's own mismatched rows are roll's
            length = int(trl_batch["KL_attention_mask"][j].sum())
            assert trl_batch["KL_input_ids"][j, :length].tolist() == batch["input_ids"][6 + j, :length].tolist()
            assert batch["attention_mask"][6 + j].sum() == length
        trainer.model.train()
        loss = trainer._compute_loss(trainer.model, batch, False)
        ours = roll_kto.metrics(trainer._roll_reports["train"][0].tolist())
        theirs = KTOTrainer._compute_loss(trainer, trainer.model, trl_batch, False)
    finally:
        backend.teardown()
    trl = {name: values[-1] for name, values in trainer._metrics["train"].items()}
    assert ours["kl"] > 0.5  # the reference point is in play
    assert loss.item() == pytest.approx(theirs.item(), rel=5e-6)
    assert ours["loss"] == pytest.approx(theirs.item(), rel=5e-6)
    for name in roll_kto.METRICS:  # the margin (a difference of two rewards near 2) compared absolutely
        assert ours[name] == pytest.approx(trl[name], rel=1e-5, abs=1e-5), (name, ours, trl)


def _trl_batch(rows: list[dict], pad_token_id: int) -> dict:
    """The rows as TRL 1.16's text path batches them: prompt / completion ids (the completion is what roll
    trains), ``KL_completion_ids`` rotated by +1 as its ``_prepare_dataset`` does ([y_B, y_1, ..., y_{B-1}]),
    collated by its ``DataCollatorForUnpairedPreference``."""
    from trl.trainer.kto_trainer import DataCollatorForUnpairedPreference

    examples = []
    for row in rows:
        first = next(i for i, label in enumerate(row["labels"]) if label != IGNORE_INDEX)
        examples.append({"prompt_ids": row["input_ids"][:first], "completion_ids": row["input_ids"][first:],
                         "label": row["kto_tag"]})
    completions = [example["completion_ids"] for example in examples]
    for example, kl in zip(examples, [completions[-1]] + completions[:-1]):
        example["KL_completion_ids"] = kl
    return DataCollatorForUnpairedPreference(pad_token_id=pad_token_id, max_length=64)(examples)


# ---- rows and batches ------------------------------------------------------------------------------------

@pytest.fixture
def datasets_cache(tmp_path, monkeypatch):
    import datasets

    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(tmp_path / "hf_cache"))


def _write(path, rows) -> str:
    with open(path, "w", encoding="utf-8") as handle:
        json.dump(rows, handle)
    return str(path)


def _build(tokenizer, **data):
    from roll.data import build_datasets

    return build_datasets(DataArguments(**{"cutoff_len": 64, "shuffle": False, **data}), tokenizer, stage="kto",
                          processor=KTO[0], formats=KTO[1], seed=0)


ALPACA = [{"instruction": "What is 2 plus 3?", "output": "5.", "kto_tag": True},
          {"instruction": "What is 1 plus 1?", "output": "3.", "kto_tag": False}]
SHAREGPT = [{"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello there."},
                          {"role": "user", "content": "What is 2 plus 3?"}, {"role": "assistant", "content": "6."}],
             "label": False},
            {"conversations": [{"from": "human", "value": "What is 4 plus 4?"}, {"from": "gpt", "value": "8."}],
             "label": True}]


@pytest.mark.usefixtures("datasets_cache")
def test_kto_rows_from_alpaca_and_sharegpt_train_only_the_last_reply(bpe, tmp_path):
    """LLaMA-Factory's kto rows (alpaca + kto_tag; sharegpt with a label column, as its kto_en_demo.json):
    the tag is kept, only the last reply and its end-of-turn are trained (an earlier reply is prompt)."""
    alpaca = _build(bpe, dataset=_write(tmp_path / "a.json", ALPACA)).train
    sharegpt = _build(bpe, dataset=_write(tmp_path / "s.json", SHAREGPT)).train
    assert alpaca["kto_tag"] == [True, False] and sharegpt["kto_tag"] == [False, True]
    for row in (*alpaca, *sharegpt):
        trained = [t for t in row["labels"] if t != IGNORE_INDEX]
        first = next(i for i, t in enumerate(row["labels"]) if t != IGNORE_INDEX)
        assert row["input_ids"][first:] == trained  # one trained span, to the end of the row
    multi = bpe.decode([t for t in sharegpt[0]["labels"] if t != IGNORE_INDEX])
    assert multi.startswith("6.") and "Hello there" in bpe.decode(sharegpt[0]["input_ids"])


@pytest.mark.usefixtures("datasets_cache")
@pytest.mark.parametrize("rows, row, message", [
    ([ALPACA[0], {**ALPACA[1], "kto_tag": None}], 1, "no kto_tag"),
    ([{**ALPACA[0], "kto_tag": "true"}, {**ALPACA[1], "kto_tag": "false"}], 0, "'kto_tag' must be a JSON boolean"),
    ([{k: v for k, v in ALPACA[0].items() if k != "kto_tag"}] * 2, 0, "no kto_tag"),
])
def test_a_malformed_kto_row_names_its_file_and_row(bpe, tmp_path, rows, row, message):
    path = _write(tmp_path / "bad.json", rows)
    with pytest.raises(DataError, match=f"bad.json, row {row} .*{message}"):
        _build(bpe, dataset=path)


@pytest.mark.usefixtures("datasets_cache")
def test_integer_tags_and_one_label_class_are_refused(bpe, tmp_path):
    """LLaMA-Factory drops 0/1 tags silently (every row then invalid); roll names the row. A set of one class
    is refused with its counts."""
    with pytest.raises(DataError, match=r"row 0 .*'kto_tag' must be a JSON boolean .*got int"):
        _build(bpe, dataset=_write(tmp_path / "ints.json", [{**r, "kto_tag": int(r["kto_tag"])} for r in ALPACA]))
    with pytest.raises(DataError, match="all 2 training rows are desirable .* none is undesirable"):
        _build(bpe, dataset=_write(tmp_path / "good.json", [{**r, "kto_tag": True} for r in ALPACA]))
    with pytest.raises(ConfigError, match="packing is not supported for stage kto"):
        _build(bpe, dataset=_write(tmp_path / "p.json", ALPACA), packing=True)


def test_feedback_collator_docstring_example():
    from roll.data.feedback import FeedbackCollator

    batch = FeedbackCollator(pad_token_id=0, cutoff_len=8)(
        [{"input_ids": [5, 6, 7], "attention_mask": [1, 1, 1], "labels": [-100, 6, 7], "kto_tag": True},
         {"input_ids": [8, 9], "attention_mask": [1, 1], "labels": [-100, 9], "kto_tag": False}])
    assert {key: value.tolist() for key, value in batch.items()} == {
        "input_ids": [[5, 6, 7], [8, 9, 0], [5, 9, 0], [8, 6, 7]],
        "labels": [[-100, 6, 7], [-100, 9, -100], [-100, 9, -100], [-100, 6, 7]],
        "attention_mask": [[1, 1, 1], [1, 1, 0], [1, 1, 0], [1, 1, 1]],
        "kto_tags": [True, False]}


def test_mismatched_rows_rotate_by_one_over_real_rows_and_keep_cutoff_len():
    """Row j takes the completion of the previous real row (row 0 the last's: TRL's +1 rotation, no row its
    own); a filler row stays a filler and is skipped; a row longer than cutoff_len is cut as every row is
    (the prompt from the left, the completion from the right)."""
    from roll.data.feedback import mismatched_rows

    rows = [{"input_ids": [1, 2, 10, 11], "labels": [-100, -100, 10, 11]},
            {"input_ids": [3, 20], "labels": [-100, 20]},
            {"input_ids": [0, 0], "labels": [-100, -100]},  # a filler (the end of an epoch, mca)
            {"input_ids": [4, 5, 6, 30, 31, 32, 33], "labels": [-100, -100, -100, 30, 31, 32, 33]}]
    out = mismatched_rows(rows, cutoff_len=5)
    assert [row["input_ids"] for row in out] == [[1, 2, 30, 31, 32], [3, 10, 11], [0, 0], [4, 5, 6, 20]]
    assert [row["labels"] for row in out] == [[-100, -100, 30, 31, 32], [-100, 10, 11], [-100, -100],
                                              [-100, -100, -100, 20]]
    assert out[2]["attention_mask"] == [0, 0]


# ---- recipe keys -----------------------------------------------------------------------------------------

@pytest.mark.parametrize("keys, message", [
    ({"per_device_train_batch_size": 1, "kto_mismatched_rows": "micro_batch"},
     "kto_mismatched_rows: micro_batch needs per_device_train_batch_size >= 2, got 1"),
    ({"val_size": 0.1, "per_device_eval_batch_size": 1, "kto_mismatched_rows": "micro_batch"},
     "kto_mismatched_rows: micro_batch needs per_device_eval_batch_size >= 2"),
    ({"stage": "dpo", "kto_mismatched_rows": "llamafactory"}, "kto_mismatched_rows=llamafactory only applies to "
                                                              "stage: kto"),
    ({"kto_mismatched_rows": "tokenization"}, "'tokenization' is not one of auto, micro_batch, llamafactory"),
    ({"kto_chosen_weight": 2.0, "kto_desirable_weight": 3.0}, "are the same key"),
    ({"kto_undesirable_weight": 0}, "kto_undesirable_weight must be a finite number > 0"),
    ({"pref_loss": "ipo"}, "pref_loss=ipo does not apply to stage kto"),
    ({"ref_free": True}, "ref_free=True does not apply to stage kto"),
    ({"pref_ftx": 0.1}, "pref_ftx=0.1 only applies to stage: dpo"),
    ({"packing": True}, "packing is not supported for stage kto"),
    ({"stage": "dpo", "kto_desirable_weight": 2.0}, "kto_desirable_weight=2.0 only applies to stage: kto"),
])
def test_kto_keys_are_checked_at_config_time(tmp_path, keys, message):
    from roll.config.parser import resolve

    recipe = {"model_name_or_path": str(tmp_path), "stage": "kto", "dataset": "x.json",
              "per_device_train_batch_size": 2, **keys}
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        resolve(recipe, {}, None)


@pytest.mark.parametrize("sizes, rows", [({"per_device_train_batch_size": 1}, "llamafactory"),
                                         ({"val_size": 0.1, "per_device_eval_batch_size": 1}, "llamafactory"),
                                         ({}, "micro_batch")])
def test_kto_mismatched_rows_auto_pairs_at_tokenization_for_one_row_micro_batches(tmp_path, sizes, rows):
    """LLaMA-Factory's kto example trains 1 row a micro-batch: auto pairs its rows when tokenized, as there."""
    from roll.config.parser import resolve

    config = resolve({"model_name_or_path": str(tmp_path), "stage": "kto", "dataset": "x.json",
                      "per_device_train_batch_size": 2, **sizes}, {}, None)
    assert config.data.kto_mismatched_rows == rows


def test_llamafactory_weight_spellings_are_the_same_keys(tmp_path):
    from roll.config.parser import resolve

    config = resolve({"model_name_or_path": str(tmp_path), "stage": "kto", "dataset": "x.json",
                      "per_device_train_batch_size": 2, "kto_chosen_weight": 1.5, "kto_rejected_weight": 0.5},
                     {}, None)
    ft = config.finetuning
    assert (ft.kto_desirable_weight, ft.kto_undesirable_weight) == (1.5, 0.5)
    assert ft.kto_chosen_weight is None and ft.kto_rejected_weight is None
    assert os.path.basename(config.data.dataset) == "x.json"


def test_dry_run_shows_the_class_counts_a_row_and_its_mismatched_row(tiny_model_dir, tmp_path, monkeypatch):
    """--dry-run for stage kto (in-process: roll.router.run with dry_run): the desirable / undesirable counts,
    the collated [2B, L] batch with kto_tags, the first row with its label and trained reply marked, and its
    mismatched row: its own prompt, the second row's reply."""
    import datasets

    from roll import router
    from roll.config import parse_args

    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(tmp_path / "hf_cache"))
    _, config = parse_args(["recipes/demo/tiny_kto.yaml", f"model_name_or_path={tiny_model_dir}",
                            f"output_dir={tmp_path / 'out'}"])
    text = []
    router.run(config, dry_run=True, out=text.append)
    text = "".join(text)
    with open("recipes/demo/data/arithmetic_kto.json", encoding="utf-8") as fh:
        desirable = sum(row["kto_tag"] for row in json.load(fh))
    assert f"kto_tag: {desirable} desirable (true), {64 - desirable} undesirable (false)" in text, text
    assert "input_ids [4, " in text and "kto_tags [2]" in text, text
    first, mismatched = text.split("--- first training row (kto_tag: ")[1].split("--- its mismatched row")
    question = first.split("What is ")[1].split("?")[0]
    reply = first.split("[TRAIN>")[1].split("<TRAIN]")[0]
    assert first.startswith(("false, undesirable", "true, desirable")) and reply.startswith(question.split()[0])
    assert f"What is {question}?" in mismatched and f"[TRAIN>{reply}<TRAIN]" not in mismatched
