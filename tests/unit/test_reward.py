"""Stage rm (roll.reward): the scored token is transformers' own, the loss and metrics of both backends equal an
independent computation on one batch, the config rules, and the reward model's names on Megatron."""

from __future__ import annotations

import math

import pytest
import torch
import yaml

from roll import IGNORE_INDEX
from roll.config import parse_args
from roll.data.collators import PairwiseCollator
from roll.data.reward import RewardProcessor, score_labels, scored_position
from roll.errors import ConfigError
from tests.helpers import batch_of

X = IGNORE_INDEX
PAIRS = [{"instruction": "What is 1 plus 2?", "input": "", "chosen": "1 plus 2 equals 3.", "rejected": "It is 4."},
         {"instruction": "What is 4 plus 4?", "input": "", "chosen": "8.", "rejected": "4 plus 4 equals 9."},
         {"instruction": "What is 0 plus 5?", "input": "", "chosen": "0 plus 5 is 5.", "rejected": "6."}]


def tiny_reward_model(vocab_size: int, pad_token_id: int, seed: int = 0):
    """A 1-layer Qwen2ForSequenceClassification from a config, every weight (the head too) random."""
    from transformers import AutoModelForSequenceClassification, Qwen2Config

    torch.manual_seed(seed)
    config = Qwen2Config(vocab_size=vocab_size, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, num_labels=1, pad_token_id=pad_token_id,
                         initializer_range=0.5)
    return AutoModelForSequenceClassification.from_config(config).train()


def position_scores(model, batch: dict) -> torch.Tensor:
    """The head applied at every position ``[rows, L]`` (what the mca backend's model returns)."""
    hidden = model.model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).last_hidden_state
    return model.score(hidden)[..., 0]


def test_scored_position_examples():
    assert [scored_position(ids, 0) for ids in ([5, 6, 7], [5, 6, 0, 0], [0, 0], [0, 5])] == [2, 1, 0, 1]
    assert scored_position([5, 6], None) == 1
    assert score_labels([5, 6, 7], 0) == [X, X, 7] and score_labels([5, 0], 0) == [5, X] and score_labels([], 0) == []


def test_the_scored_token_is_the_one_transformers_pools(bpe):
    """Rows of real pairs, one ending in the pad id (the pad == eos trap) and one all pad, right-padded: the
    HF model's pooled logit is its head's output at ``scored_position`` of every row."""
    rows = RewardProcessor(bpe, 64, "pairwise", "mem.json")(batch_of(PAIRS), [0, 1, 2])["chosen_input_ids"]
    pad = bpe.pad_token_id
    rows = rows + [rows[0] + [pad, pad], [pad, pad, pad]]
    batch = PairwiseCollator(pad)([{f"{side}_{key}": value for side in ("chosen", "rejected")
                                     for key, value in (("input_ids", ids), ("attention_mask", [1] * len(ids)),
                                                        ("labels", score_labels(ids, pad)))} for ids in rows])
    model = tiny_reward_model(len(bpe), pad)
    with torch.no_grad():
        pooled = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits[:, 0]
        scores = position_scores(model, batch)
    picked = [scores[i, scored_position(ids, pad)] for i, ids in enumerate(rows + rows)]
    assert torch.equal(pooled, torch.stack(picked))
    marked = (batch["labels"] != X).nonzero().tolist()  # the marks the mca backend reads: the same positions
    assert [[i, scored_position(ids, pad)] for i, ids in enumerate(rows + rows)] == marked


def test_rows_mark_the_last_token_and_the_pad_eos_trap_warns(bpe, roll_warnings):
    out = RewardProcessor(bpe, 64, "pairwise", "mem.json")(batch_of(PAIRS + [{**PAIRS[0], "rejected": PAIRS[0]["chosen"]}]),
                                                           [0, 1, 2, 3])
    assert out["_drop"] == ["", "", "", "chosen_equals_rejected"]
    for side in ("chosen", "rejected"):
        for ids, labels in zip(out[f"{side}_input_ids"][:3], out[f"{side}_labels"][:3]):
            assert labels == [X] * (len(ids) - 1) + [ids[-1]] and ids[-1] == bpe.convert_tokens_to_ids("<|im_end|>")
    assert "pad token" not in roll_warnings.text
    from roll.demo.tiny_model import build_bpe_tokenizer

    trap = build_bpe_tokenizer()
    trap.pad_token = "<|im_end|>"  # a tokenizer without its own pad: roll pads with eos, which ends every answer
    out = RewardProcessor(trap, 64, "pairwise", "mem.json")(batch_of(PAIRS), [0, 1, 2])
    for ids, labels in zip(out["chosen_input_ids"], out["chosen_labels"]):
        assert labels == [X] * (len(ids) - 2) + [ids[-2], X]
    assert "scored at the last token before it" in roll_warnings.text


def test_losses_and_metrics_equal_the_formula_and_trl_on_one_batch(bpe, tmp_path):
    """One batch of three pairs through a random tiny reward model: the mca backend's loss function (scores at
    every position pooled under the marks, then Bradley-Terry) and the standard backend's trainer (TRL's
    RewardTrainer.compute_loss) both give the hand-written loss, accuracy, margin and reward means."""
    from datasets import Dataset
    from trl import RewardConfig

    from backends.mca.trainer.reward import RewardObjective
    from backends.standard.reward import RewardBatch, make_reward_trainer_class

    features = [{k: v[i] for k, v in RewardProcessor(bpe, 64, "pairwise", "m.json")(batch_of(PAIRS), [0, 1, 2]).items()
                 if not k.startswith("_")} for i in range(3)]
    collate = PairwiseCollator(bpe.pad_token_id)
    batch = collate(features)
    model = tiny_reward_model(len(bpe), bpe.pad_token_id)
    with torch.no_grad():
        rewards = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits[:, 0].double()
    chosen, rejected = rewards[:3].tolist(), rewards[3:].tolist()
    hand = {"loss": sum(math.log1p(math.exp(-(c - r))) for c, r in zip(chosen, rejected)) / 3,
            "accuracy": sum(c > r for c, r in zip(chosen, rejected)) / 3,
            "margin": sum(c - r for c, r in zip(chosen, rejected)) / 3,
            "rewards/chosen": sum(chosen) / 3, "rewards/rejected": sum(rejected) / 3}
    assert 0 < hand["accuracy"] < 1  # a batch where accuracy can be wrong either way

    objective = RewardObjective()
    scores = position_scores(model, batch).detach()
    loss_sum, pairs, report = objective.loss_func(batch["labels"], {})(scores.unsqueeze(-1))
    mca = objective.metrics(report["report"].tolist())
    assert int(pairs) == 3 and float(loss_sum) == pytest.approx(3 * hand["loss"], rel=1e-6)

    args = RewardConfig(output_dir=str(tmp_path), report_to="none", use_cpu=True, max_length=64)
    trainer = make_reward_trainer_class()(model=model, args=args, train_dataset=Dataset.from_list(features),
                                          processing_class=bpe, data_collator=RewardBatch(collate))
    trl_loss = trainer.compute_loss(model, RewardBatch(collate)(features))
    trainer.log({})  # what a training log line carries besides the loss
    standard = {"loss": trl_loss.item(), **{k: v for k, v in trainer.state.log_history[-1].items()
                                           if k not in ("step", "epoch")}}
    assert sorted(standard) == sorted(mca) == sorted(hand)
    for name, value in hand.items():
        assert mca[name] == pytest.approx(value, rel=1e-6, abs=1e-7), name
        assert standard[name] == pytest.approx(value, rel=1e-6, abs=1e-7), name

    # the same pairs swapped (chosen <-> rejected): accuracy 1 - accuracy (no ties), margin negated, on both
    swapped = [{key.replace("chosen_", "tmp_").replace("rejected_", "chosen_").replace("tmp_", "rejected_"): value
                for key, value in feature.items()} for feature in features]
    batch = collate(swapped)
    mca = objective.metrics(objective.loss_func(batch["labels"], {})(position_scores(model, batch).detach()
                                                                     .unsqueeze(-1))[2]["report"].tolist())
    trainer.compute_loss(model, RewardBatch(collate)(swapped))
    trainer.log({})
    standard = trainer.state.log_history[-1]
    for metrics in (mca, standard):
        assert metrics["accuracy"] == pytest.approx(1 - hand["accuracy"]), metrics
        assert metrics["margin"] == pytest.approx(-hand["margin"], rel=1e-6), metrics
        assert metrics["rewards/chosen"] == pytest.approx(hand["rewards/rejected"], rel=1e-6), metrics


def test_a_malformed_row_names_file_and_row(bpe):
    from roll.errors import DataError

    with pytest.raises(DataError, match=r"data/rm\.json, row 4 \(0-based\)"):
        RewardProcessor(bpe, 64, "pairwise", "data/rm.json")(batch_of([PAIRS[0], {**PAIRS[1], "chosen": 5}]), [3, 4])


def test_filler_pairs_count_for_nothing():
    """A pair without a mark (the mca backend's filler past the end of the data) adds no loss and no pair."""
    from backends.mca.trainer.reward import pooled_rewards, reward_losses

    labels = torch.tensor([[X, 7, X], [X, X, X], [X, X, 9], [X, X, X]])  # chosen: rows 0-1, rejected: 2-3
    scores = torch.tensor([[5.0, 0.5, 3.0], [9.0, 9.0, 9.0], [1.0, 2.0, -0.5], [4.0, 4.0, 4.0]])
    rewards, marks = pooled_rewards(scores, labels)
    assert rewards.tolist() == [0.5, 0.0, -0.5, 0.0] and marks.tolist() == [1, 0, 1, 0]
    losses, stats, pairs = reward_losses(rewards, marks)
    assert losses.tolist() == pytest.approx([math.log1p(math.exp(-1.0)), 0.0]) and float(pairs) == 1
    assert stats.tolist() == [1.0, 1.0, 0.5, -0.5]


def test_step_one_is_ln2_with_a_zero_head():
    from backends.mca.trainer.reward import reward_losses

    losses, stats, pairs = reward_losses(torch.zeros(8, dtype=torch.float64), torch.ones(8, dtype=torch.long))
    assert float(losses.sum() / pairs) == math.log(2) and stats.tolist() == [0.0, 0.0, 0.0, 0.0]


@pytest.fixture
def recipe(tmp_path, tiny_model_dir):
    def write(**values) -> str:
        path = tmp_path / "recipe.yaml"
        path.write_text(yaml.safe_dump({"model_name_or_path": tiny_model_dir, "stage": "rm",
                                        "dataset": "recipes/demo/data/arithmetic_rm.json", **values}))
        return str(path)

    return write


def test_config_rules(recipe, roll_warnings):
    for argv in ([], ["--use-mca"]):
        parse_args([recipe(), *argv])
        with pytest.raises(ConfigError, match="packing is not supported for stage rm"):
            parse_args([recipe(packing=True), *argv])
        with pytest.raises(ConfigError, match="export_merged is not available for stage rm"):
            parse_args([recipe(finetuning_type="lora", export_merged=True), *argv])
        with pytest.raises(ConfigError, match="pref_ftx"):
            parse_args([recipe(pref_ftx=0.5), *argv])
    parse_args([recipe(pref_beta=0.5)])
    assert "pref_beta: dpo keys, not read by stage rm" in roll_warnings.text


def test_the_mca_backend_does_not_shift_rm_labels(recipe):
    from backends.mca.backend import McaBackend

    for stage, shifted in (("rm", False), ("dpo", True)):
        _, config = parse_args([recipe(stage=stage, tensor_model_parallel_size=2, sequence_parallel=True,
                                       nproc_per_node=2), "--use-mca"])
        policy = McaBackend(config).padding_policy(stage)
        assert policy.shift_labels is shifted and policy.pad_to_multiple_of == 2


def test_reward_template_names_and_config(tiny_model_factory):
    """The reward model's head: ``score.weight`` <-> ``output_layer.score.weight`` (Megatron's
    ``output_layer.weight``), whole on every TP rank, never vocab-padded; the HF config of a
    ...ForSequenceClassification; the family's other rows unchanged."""
    pytest.importorskip("megatron.core")
    import json
    import os

    from backends.mca.models import layout, sharding
    from backends.mca.models.config import McaModelConfig
    from backends.mca.models.template import get_template, template_for

    model_dir = tiny_model_factory("qwen2", tie_word_embeddings=False)
    with open(os.path.join(model_dir, "config.json"), encoding="utf-8") as fh:
        hf = json.load(fh)
    plain, config = McaModelConfig.from_hf(hf), McaModelConfig.from_hf(hf, reward_head=True,
                                                                       tensor_model_parallel_size=2)
    template = template_for(config)
    assert template_for(plain) is get_template("qwen2") and template is template_for(config)
    head = torch.randn(1, hf["hidden_size"])
    assert template.hf_to_mca({"score.weight": head}, config)["output_layer.score.weight"] is head
    assert torch.equal(template.mca_to_hf({"output_layer.score.weight": head}, config)["score.weight"], head)
    with pytest.raises(Exception, match="no mapping"):
        template.match_hf("lm_head.weight")
    assert (template.optional, template.ignored) == (("score.weight",), ("lm_head.weight",))
    assert sorted(m.mca for m in template.weights if m.mca != "output_layer.score.weight") == sorted(
        m.mca for m in get_template("qwen2").weights if m.mca != "output_layer.weight")
    assert layout.from_impl_name("output_layer.weight", config) == "output_layer.score.weight"
    assert layout.to_impl_name("output_layer.score.weight", config) == "output_layer.weight"
    assert layout.from_impl_name("output_layer.weight", plain) == "output_layer.weight"
    assert sharding.tp_kind("output_layer.score.weight", config) == "replicated"
    assert sharding.shard_for_rank("output_layer.score.weight", head, config, (2, 1), (2, 1)) is head
    exported = template.hf_config_dict(config)
    assert exported["architectures"] == ["Qwen2ForSequenceClassification"]
    assert (exported["id2label"], exported["pad_token_id"]) == ({"0": "LABEL_0"}, hf["pad_token_id"])
    from transformers import AutoConfig

    assert AutoConfig.for_model(**exported).num_labels == 1


@pytest.mark.parametrize("data", ["arithmetic_rm.json", "arithmetic_dpo.json"])  # alpaca and sharegpt pairs
def test_dry_run_shows_an_rm_pair_with_its_scored_token(recipe, data):
    from roll import router

    out: list[str] = []
    _, config = parse_args([recipe(dataset=f"recipes/demo/data/{data}")])
    router.run(config, dry_run=True, out=out.append)
    text = "".join(out)
    assert "stage rm: data summary" in text and "the token each side is scored at" in text, text
    assert text.count("[TRAIN><|im_end|><TRAIN]") == 2, text  # the chosen and the rejected side


def test_a_short_run_raises_accuracy_on_its_training_pairs(recipe, tmp_path):
    """The standard backend trains 8 pairs and evaluates on the same 8: before the first step every reward is 0
    (the zero head: accuracy 0, all ties, loss ln 2); after 30 steps every pair is ranked right (measured: loss
    0.139; 1 in 256 by chance, and a reversed margin would rank every pair wrong)."""
    from roll import router

    data = "recipes/demo/data/arithmetic_rm.json"
    _, config = parse_args([recipe(max_samples=8, eval_dataset=data, eval_strategy="steps", eval_steps=30,
                                   eval_on_start=True, per_device_train_batch_size=8, learning_rate=3e-3,
                                   max_steps=30, logging_steps=10, save_strategy="no", save_hf_model=False,
                                   report_to="none", output_dir=str(tmp_path / "out"))])
    history = router.run(config).log_history
    evals = [entry for entry in history if "eval_accuracy" in entry]
    assert [entry["step"] for entry in evals] == [0, 30], evals
    assert evals[0]["eval_accuracy"] == 0 and evals[0]["eval_loss"] == pytest.approx(math.log(2), abs=1e-7)
    assert evals[1]["eval_accuracy"] == 1 and evals[1]["eval_loss"] < 0.3, evals
