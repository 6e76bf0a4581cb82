"""Standard backend, in one process on tiny models: stages train, the loss is the per-token mean of
the global batch, samples are consumed in the pipeline's order, LoRA/freeze train only what they
should, exports reload, and a resumed run reproduces the uninterrupted one."""

from __future__ import annotations

import json
import math
import os

import pytest
import torch

from backends.standard.backend import StandardBackend
from roll.config.parser import resolve
from roll.contract import TrainJob

IGNORE = -100


# ---- tiny data, built by hand so these tests do not depend on roll.data --------------------------

def _tokenizer(model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir)


def _sft_rows(tok, n=32):
    rows = []
    for i in range(n):
        a, b = i % 10, (i * 7 + 3) % 10
        prompt = tok(f"What is {a} plus {b}?")["input_ids"]
        # answers of different lengths, so a mean of micro-batch means differs from the per-token mean
        text = " " + " ".join([f"{a} plus {b} equals {a + b}."] * (1 + i % 3))
        answer = tok(text)["input_ids"] + [tok.eos_token_id]
        ids = prompt + answer
        rows.append({"idx": i, "input_ids": ids, "attention_mask": [1] * len(ids),
                     "labels": [IGNORE] * len(prompt) + answer})
    return rows


def _pt_rows(tok, n=32):
    rows = []
    for i in range(n):
        ids = tok(f"The sum of {i % 10} and {(i * 3) % 10} is {i % 10 + (i * 3) % 10}.")["input_ids"]
        rows.append({"idx": i, "input_ids": ids, "attention_mask": [1] * len(ids),
                     "labels": [IGNORE] + ids[1:]})
    return rows


def _dpo_rows(tok, n=32):
    rows = []
    for r in _sft_rows(tok, n):
        n_prompt = sum(1 for label in r["labels"] if label == IGNORE)
        rejected = r["input_ids"][:n_prompt] + tok(" nine hundred")["input_ids"] + [tok.eos_token_id]
        rows.append({"idx": r["idx"],
                     "chosen_input_ids": r["input_ids"], "chosen_attention_mask": r["attention_mask"],
                     "chosen_labels": r["labels"], "rejected_input_ids": rejected,
                     "rejected_attention_mask": [1] * len(rejected),
                     "rejected_labels": [IGNORE] * n_prompt + rejected[n_prompt:]})
    return rows


def _pad(rows, value):
    width = max(len(r) for r in rows)
    return torch.tensor([r + [value] * (width - len(r)) for r in rows])


class _Collator:
    """Right-pads like roll's SequenceCollator/PairwiseCollator (chosen rows before rejected) and
    records which sample indices it was given, in order."""

    def __init__(self, pad_id, pairwise=False):
        self.pad_id, self.pairwise, self.seen = pad_id, pairwise, []

    def __call__(self, features):
        self.seen.extend(f["idx"] for f in features)
        if self.pairwise:
            features = [{k: f[f"{side}_{k}"] for k in ("input_ids", "attention_mask", "labels")}
                        for side in ("chosen", "rejected") for f in features]
        return {"input_ids": _pad([f["input_ids"] for f in features], self.pad_id),
                "attention_mask": _pad([f["attention_mask"] for f in features], 0),
                "labels": _pad([f["labels"] for f in features], IGNORE)}


def train_in_process(model_dir, out_dir, stage="sft", n=32, save=False, evaluate=False, **recipe):
    """Drive the backend the way roll/router.py does; returns (backend, result, models, collator).

    ``evaluate``: the training rows are also the eval set, evaluated after training into result.metrics."""
    from datasets import Dataset

    tok = _tokenizer(model_dir)
    rows = {"pt": _pt_rows, "sft": _sft_rows, "dpo": _dpo_rows}[stage](tok, n)
    base = dict(model_name_or_path=model_dir, stage=stage, output_dir=str(out_dir),
                per_device_train_batch_size=4, learning_rate=3e-3, max_steps=6, logging_steps=1,
                save_strategy="no", report_to="none", lr_scheduler_type="constant", seed=0, disable_tqdm=True,
                shuffle=False)  # the rows in order: step 1's hand-computed losses read rows 0-3
    if evaluate:  # the config checks that an eval set is declared; the job below carries the rows
        base["val_size"] = 0.1
    config = resolve({**base, **recipe}, {}, None)
    backend = StandardBackend(config)
    collator = _Collator(tok.pad_token_id, pairwise=stage == "dpo")
    job = TrainJob(stage=stage, tokenizer=tok, train_dataset=Dataset.from_list(rows), collator=collator,
                   eval_dataset=Dataset.from_list(rows) if evaluate else None)
    backend.setup_distributed()
    try:
        models = backend.apply_finetuning(backend.load_models(stage, tok))
        result = backend.train(job, models)
        if evaluate:
            result.metrics.update(backend.evaluate(job, models))
        if save:
            result.hf_model_dir = backend.save(models, tok, str(out_dir))
    finally:
        backend.teardown()
    return backend, result, models, collator


def _answer_logp(model, ids: list[int], labels: list[int]) -> float:
    """Summed log-probability of the trained (label != -100) tokens of one unpadded row."""
    logits = model(input_ids=torch.tensor([ids])).logits[0, :-1]
    targets = torch.tensor(labels[1:])
    logps = torch.log_softmax(logits.double(), -1).gather(1, targets.clamp(min=0)[:, None])[:, 0]
    return float(logps[targets != IGNORE].sum())


def _dpo_loss(policy, ref, pairs, beta=0.1) -> float:
    """The sigmoid DPO loss of ``pairs`` computed by hand from HF models (directories or modules): mean
    over pairs of ``-log sigmoid(beta ((pc - rc) - (pr - rr)))``; no ``ref``: reference log-probs are 0."""
    from transformers import AutoModelForCausalLM

    models = [AutoModelForCausalLM.from_pretrained(m) if isinstance(m, str) else m
              for m in (policy, ref) if m]
    losses = []
    with torch.no_grad():
        for pair in pairs:
            margins = [_answer_logp(m.eval(), pair["chosen_input_ids"], pair["chosen_labels"])
                       - _answer_logp(m, pair["rejected_input_ids"], pair["rejected_labels"]) for m in models]
            margin = margins[0] - (margins[1] if ref else 0.0)
            losses.append(-torch.nn.functional.logsigmoid(torch.tensor(beta * margin)).item())
    return sum(losses) / len(losses)


def _losses(result):
    return [entry["loss"] for entry in result.log_history if "loss" in entry]


# ---- stages -------------------------------------------------------------------------------------

@pytest.mark.parametrize("stage,lr", [("pt", 3e-3), ("sft", 3e-3), ("dpo", 1e-3)])
def test_stage_trains_and_loss_falls(tiny_model_dir, tmp_path, stage, lr):
    from transformers import AutoModelForCausalLM

    start = AutoModelForCausalLM.from_pretrained(tiny_model_dir).state_dict()
    _, result, models, _ = train_in_process(tiny_model_dir, tmp_path, stage=stage, learning_rate=lr)
    losses = _losses(result)
    assert len(losses) == 6
    assert sum(losses[-2:]) < sum(losses[:2]), losses
    changed = [k for k, v in models.policy.state_dict().items() if not torch.equal(v, start[k])]
    assert changed, "no parameter changed"
    records = [json.loads(line) for line in open(tmp_path / "train_log.jsonl")]
    logged = records[0]
    assert {"loss", "grad_norm", "learning_rate", "tokens_per_second"} <= set(logged)
    for record in (r for r in records if "loss" in r):  # roll.perf's speed fields on every training log
        assert record["step_time"] > 0 and record["tokens_per_second"] > 0, record
        assert 0 < record["mfu"] < math.inf and record["peak_memory_gb"] > 0, record
    if stage == "dpo":
        assert {"rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins"} <= set(logged)
        # policy == reference at step 1
        assert result.log_history[0]["loss"] == pytest.approx(0.6931, abs=1e-3)


@pytest.mark.parametrize("loss", ["ipo", "hinge"])
def test_dpo_loss_types(tiny_model_dir, tmp_path, loss):
    _, result, _, _ = train_in_process(tiny_model_dir, tmp_path, stage="dpo", learning_rate=1e-3, max_steps=2,
                                       pref_loss=loss, pref_beta=0.2)
    # policy == reference at step 1: ipo loss = (0 - 1/(2 beta))^2, hinge loss = relu(1 - 0) = 1
    expected = (1 / (2 * 0.2)) ** 2 if loss == "ipo" else 1.0
    assert result.log_history[0]["loss"] == pytest.approx(expected, rel=1e-4)


def test_dpo_reference_free(tiny_model_dir, tmp_path):
    _, result, models, _ = train_in_process(tiny_model_dir, tmp_path, stage="dpo", max_steps=2, ref_free=True,
                                            evaluate=True)
    assert models.ref is None
    # the reference log-probs are 0, not the policy's: step 1's loss is -log sigmoid(beta (pc - pr))
    expected = _dpo_loss(tiny_model_dir, None, _dpo_rows(_tokenizer(tiny_model_dir), 4))
    assert result.log_history[0]["loss"] == pytest.approx(expected, rel=1e-5)
    # evaluating after training works too (TRL would not precompute reference log-probs again): the
    # trained policy's loss over the 32 pairs (4 eval batches of 8: the mean of batch means is the mean)
    trained = _dpo_loss(models.policy, None, _dpo_rows(_tokenizer(tiny_model_dir), 32))
    assert result.metrics["eval_loss"] == pytest.approx(trained, rel=1e-5)


# ---- loss definition and sample order -----------------------------------------------------------

def test_loss_is_per_token_mean_over_global_batch(tiny_model_dir, tmp_path):
    """GAS=1 x MBS=8 == GAS=8 x MBS=1 == a hand-computed per-token mean over the 8 samples."""
    from transformers import AutoModelForCausalLM

    runs = {}
    for mbs, gas in ((8, 1), (1, 8)):
        _, result, _, _ = train_in_process(tiny_model_dir, tmp_path / f"m{mbs}", max_steps=1,
                                           per_device_train_batch_size=mbs, gradient_accumulation_steps=gas)
        runs[(mbs, gas)] = result.log_history[0]
    a, b = runs[(8, 1)], runs[(1, 8)]
    assert a["loss"] == pytest.approx(b["loss"], rel=1e-5)
    assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-4)

    tok = _tokenizer(tiny_model_dir)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()
    total, count, micro_means = 0.0, 0, []
    with torch.no_grad():
        for row in _sft_rows(tok)[:8]:
            logits = model(input_ids=torch.tensor([row["input_ids"]])).logits[0, :-1]
            labels = torch.tensor(row["labels"][1:])
            token_losses = torch.nn.functional.cross_entropy(logits, labels, ignore_index=IGNORE,
                                                             reduction="sum")
            n = int((labels != IGNORE).sum())
            total, count = total + token_losses.item(), count + n
            micro_means.append(token_losses.item() / n)
    assert a["loss"] == pytest.approx(total / count, rel=1e-5)
    assert abs(sum(micro_means) / 8 - total / count) > 1e-3  # the data would expose a mean of means


def test_dpo_loss_is_the_mean_over_pairs_of_the_global_batch(tiny_model_dir, tmp_path):
    """GAS=1 x MBS=8 == GAS=8 x MBS=1 for DPO too: TRL's per-pair mean of a micro-batch is divided by
    the accumulation steps, so a step's gradient is that of the mean over its 8 pairs (not 8x it)."""
    runs = {}
    for mbs, gas in ((8, 1), (1, 8)):
        _, result, _, _ = train_in_process(tiny_model_dir, tmp_path / f"m{mbs}", stage="dpo", max_steps=2,
                                           learning_rate=1e-3, per_device_train_batch_size=mbs,
                                           gradient_accumulation_steps=gas)
        runs[(mbs, gas)] = [entry for entry in result.log_history if "loss" in entry]
    a, b = runs[(8, 1)], runs[(1, 8)]
    assert a[0]["grad_norm"] == pytest.approx(b[0]["grad_norm"], rel=1e-4)
    assert a[1]["loss"] == pytest.approx(b[1]["loss"], rel=1e-5)  # step 1 is log(2) whatever the split
    assert a[1]["rewards/margins"] == pytest.approx(b[1]["rewards/margins"], rel=1e-3)


def test_trainer_consumes_the_shared_order(tiny_model_dir, tmp_path):
    """Epoch e in torch.randperm's order seeded seed + e (accelerate's seedable sampler, as HF's Trainer draws
    for LLaMA-Factory; roll.data.order), the epoch's uneven end (10 rows, 4 a step) trained as it is; with
    shuffle: false the rows' own order."""
    def randperm(seed):
        return torch.randperm(10, generator=torch.Generator().manual_seed(seed)).tolist()

    _, _, _, collator = train_in_process(tiny_model_dir, tmp_path / "seeded", n=10, max_steps=4, seed=3, shuffle=True,
                                         per_device_train_batch_size=2, gradient_accumulation_steps=2,
                                         learning_rate=0.0)
    # the data loader prefetches one batch beyond the last step; what was trained on is the prefix
    assert collator.seen[:14] == randperm(3) + randperm(4)[:4]
    _, _, _, collator = train_in_process(tiny_model_dir, tmp_path / "data_seed", n=10, max_steps=1, seed=3,
                                         data_seed=8, shuffle=True, per_device_train_batch_size=4, learning_rate=0.0)
    assert collator.seen[:4] == randperm(8)[:4]
    _, _, _, collator = train_in_process(tiny_model_dir, tmp_path / "in_order", max_steps=3, shuffle=False,
                                         per_device_train_batch_size=2, gradient_accumulation_steps=2,
                                         learning_rate=0.0)
    assert collator.seen[:12] == list(range(12)) and collator.seen[12:] in ([], [12, 13])


# ---- fine-tuning types and exports --------------------------------------------------------------

def test_lora_trains_only_adapters_and_exports_reload(tiny_model_dir, tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    start = AutoModelForCausalLM.from_pretrained(tiny_model_dir).state_dict()
    _, result, models, _ = train_in_process(tiny_model_dir, tmp_path, finetuning_type="lora", lora_rank=4,
                                            export_merged=True, save=True)
    policy = models.policy.eval()
    for name, param in policy.named_parameters():
        if "lora_" in name:
            assert param.requires_grad and param.dtype == torch.float32
        else:
            assert not param.requires_grad, name
            base_name = name.replace("base_model.model.", "").replace(".base_layer", "")
            assert torch.equal(param.detach(), start[base_name]), f"base weight {name} changed"

    ids = torch.tensor([[5, 17, 42, 99, 7, 3]])
    with torch.no_grad():
        trained = policy(input_ids=ids).logits
        reloaded = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny_model_dir),
                                             result.hf_model_dir).eval()(input_ids=ids).logits
        merged = AutoModelForCausalLM.from_pretrained(os.path.join(result.hf_model_dir, "merged")).eval()
        merged_logits = merged(input_ids=ids).logits
        base_logits = AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()(input_ids=ids).logits
    assert torch.allclose(trained, reloaded, atol=1e-5)
    assert torch.allclose(merged_logits, trained, atol=1e-4)
    assert not torch.allclose(trained, base_logits, atol=1e-3)  # the adapter did learn something
    assert os.path.isfile(os.path.join(result.hf_model_dir, "adapter_model.safetensors"))


def test_dpo_lora_reference_is_a_frozen_adapter_copy_left_out_of_the_export(tiny_model_dir, tmp_path):
    _, result, models, _ = train_in_process(tiny_model_dir, tmp_path, stage="dpo", max_steps=2,
                                            finetuning_type="lora", lora_rank=4, save=True)
    assert models.ref is None and set(models.policy.peft_config) == {"default", "ref"}
    assert not any(p.requires_grad for name, p in models.policy.named_parameters() if ".ref." in name)
    assert result.log_history[0]["loss"] == pytest.approx(0.6931, abs=1e-3)  # reference == initial policy
    # ...and it stays fixed: step 2's loss is that of the policy after step 1 against the initial model
    # (a reference that followed the policy would give log 2 again)
    _, _, after_one, _ = train_in_process(tiny_model_dir, tmp_path / "one", stage="dpo", max_steps=1,
                                          finetuning_type="lora", lora_rank=4)
    pairs = _dpo_rows(_tokenizer(tiny_model_dir), 8)[4:]
    expected = _dpo_loss(after_one.policy, tiny_model_dir, pairs)
    assert result.log_history[1]["loss"] == pytest.approx(expected, rel=1e-5)
    assert os.path.isfile(os.path.join(result.hf_model_dir, "adapter_model.safetensors"))
    assert not os.path.exists(os.path.join(result.hf_model_dir, "ref"))


def test_lora_target_all_is_every_linear_but_the_head(tiny_model_dir):
    from transformers import AutoModelForCausalLM

    from backends.standard.models import resolve_lora_targets

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    assert resolve_lora_targets(model, "all") == sorted(
        ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"])
    assert resolve_lora_targets(model, ["q_proj", "v_proj"]) == ["q_proj", "v_proj"]


def test_freeze_trains_only_the_last_layers(tiny_model_dir, tmp_path):
    from transformers import AutoModelForCausalLM

    start = AutoModelForCausalLM.from_pretrained(tiny_model_dir).state_dict()
    _, _, models, _ = train_in_process(tiny_model_dir, tmp_path, finetuning_type="freeze",
                                       freeze_trainable_layers=1)
    changed = {k for k, v in models.policy.state_dict().items() if not torch.equal(v, start[k])}
    assert changed and all(".layers.1." in k for k in changed), sorted(changed)


def test_full_model_export_loads_with_tokenizer_and_template(tiny_model_dir, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    _, result, models, _ = train_in_process(tiny_model_dir, tmp_path, max_steps=2, save=True)
    out = result.hf_model_dir
    assert os.path.isfile(os.path.join(out, "model.safetensors"))
    reloaded = AutoModelForCausalLM.from_pretrained(out).eval()
    ids = torch.tensor([[5, 17, 42, 99]])
    with torch.no_grad():
        trained = models.policy.eval()(input_ids=ids).logits
        assert torch.allclose(reloaded(input_ids=ids).logits, trained, atol=1e-5)
    assert AutoTokenizer.from_pretrained(out).chat_template


# ---- resume ---------------------------------------------------------------------------------------

def test_resume_reproduces_the_uninterrupted_run(tiny_model_dir, tmp_path):
    common = dict(max_steps=6, save_strategy="steps", save_steps=3, lr_scheduler_type="linear")
    _, full, _, _ = train_in_process(tiny_model_dir, tmp_path / "full", **common)
    checkpoint = tmp_path / "full" / "checkpoint-3"
    assert checkpoint.is_dir()
    _, resumed, _, _ = train_in_process(tiny_model_dir, tmp_path / "resumed",
                                        resume_from_checkpoint=str(checkpoint), **common)
    # log_history carries the checkpoint's steps 1-3; the run's own log file has only what it trained
    logged = [json.loads(line) for line in open(tmp_path / "resumed" / "train_log.jsonl")]
    steps = [(e["step"], e["loss"]) for e in logged if "loss" in e]
    assert [step for step, _ in steps] == [4, 5, 6]
    assert [loss for _, loss in steps] == pytest.approx(_losses(full)[3:], rel=1e-6)
    assert _losses(resumed) == pytest.approx(_losses(full), rel=1e-6)
    # the checkpoint records the batch sizes (roll.preflight refuses another global batch); the same global
    # batch split differently reads the same samples per step: the same losses (measured noise ~1e-7)
    with open(checkpoint / "roll_batch.json", encoding="utf-8") as fh:
        assert json.load(fh) == {"global_batch_size": 4, "per_device_train_batch_size": 4,
                                 "gradient_accumulation_steps": 1, "world_size": 1}
    _, split, _, _ = train_in_process(tiny_model_dir, tmp_path / "split", resume_from_checkpoint=str(checkpoint),
                                      per_device_train_batch_size=2, gradient_accumulation_steps=2, **common)
    assert _losses(split) == pytest.approx(_losses(full), rel=1e-5)


def test_dpo_with_a_separate_reference_model(tiny_model_factory, tmp_path):
    policy_dir, ref_dir = tiny_model_factory("qwen2"), tiny_model_factory("qwen2", seed=1)
    _, result, models, _ = train_in_process(policy_dir, tmp_path, stage="dpo", max_steps=1, ref_model=ref_dir)
    assert models.ref is not None and not any(p.requires_grad for p in models.ref.parameters())
    # step 1's loss with the reference's own log-probs (not the policy's: that would give log 2)
    expected = _dpo_loss(policy_dir, ref_dir, _dpo_rows(_tokenizer(policy_dir), 4))
    assert result.log_history[0]["loss"] == pytest.approx(expected, rel=1e-5)


def test_demo_recipe_learns(tiny_model_dir, tmp_path):
    """The `make demo` recipe, on the fast BPE tiny model: the loss goes down and a model is written."""
    from transformers import AutoModelForCausalLM

    from roll import router
    from roll.config.parser import parse_args
    from tests.helpers import REPO

    recipe = os.path.join(REPO, "recipes", "demo", "tiny_sft.yaml")
    data = os.path.join(REPO, "recipes", "demo", "data", "arithmetic_sft.json")
    _, config = parse_args([recipe, f"model_name_or_path={tiny_model_dir}", f"output_dir={tmp_path}",
                            "max_steps=20", "disable_tqdm=true", f"dataset={data}", "val_size=0.1"])
    result = router.run(config)
    losses = _losses(result)
    assert losses[-1] < 0.7 * losses[0], losses
    # the router evaluates the held-out rows after training, with the training loss definition
    assert math.isfinite(result.metrics["eval_loss"]) and result.metrics["eval_loss"] < losses[0]
    AutoModelForCausalLM.from_pretrained(result.hf_model_dir)




def test_preference_batch_docstring_example():
    from backends.standard.trainers import PreferenceBatch
    from roll.data.collators import PairwiseCollator

    features = [{"chosen_input_ids": [5, 6, 7], "chosen_attention_mask": [1, 1, 1],
                 "chosen_labels": [IGNORE, 6, 7], "rejected_input_ids": [5, 8],
                 "rejected_attention_mask": [1, 1], "rejected_labels": [IGNORE, 8],
                 "ref_chosen_logps": -1.5, "ref_rejected_logps": -2.0}]
    batch = PreferenceBatch(PairwiseCollator(pad_token_id=0))(features)
    assert {key: value.tolist() for key, value in batch.items()} == {
        "input_ids": [[5, 6, 7], [5, 8, 0]], "attention_mask": [[1, 1, 1], [1, 1, 0]],
        "completion_mask": [[0, 1, 1], [0, 1, 0]], "ref_chosen_logps": [-1.5], "ref_rejected_logps": [-2.0]}


def test_packed_rows_give_the_same_loss_as_padded_ones(tiny_model_dir, tmp_path):
    """4 samples as one packed row (position_ids restart, no attention mask) == the same 4 padded:
    attention does not cross samples and the token count is the same."""
    from datasets import Dataset

    from roll.data.collators import SequenceCollator
    from roll.data.policy import PaddingPolicy

    tok = _tokenizer(tiny_model_dir)
    rows = _sft_rows(tok, 4)
    packed = {"idx": 0, "input_ids": [], "labels": [], "position_ids": []}
    for row in rows:
        packed["input_ids"] += row["input_ids"]
        packed["labels"] += row["labels"]
        packed["position_ids"] += list(range(len(row["input_ids"])))
    losses = {}
    for name, data, policy, mbs in (("padded", rows, PaddingPolicy(), 4),
                                    ("packed", [packed], PaddingPolicy(packing=True), 1)):
        config = resolve(dict(model_name_or_path=tiny_model_dir, stage="sft", output_dir=str(tmp_path / name),
                              per_device_train_batch_size=mbs, max_steps=1, logging_steps=1,
                              save_strategy="no", report_to="none", disable_tqdm=True,
                              packing=policy.packing), {}, None)
        backend = StandardBackend(config)
        job = TrainJob(stage="sft", tokenizer=tok, train_dataset=Dataset.from_list(data),
                       collator=SequenceCollator(tok.pad_token_id, policy))
        backend.setup_distributed()
        try:
            result = backend.train(job, backend.apply_finetuning(backend.load_models("sft", tok)))
        finally:
            backend.teardown()
        losses[name] = result.log_history[0]["loss"]
    assert losses["packed"] == pytest.approx(losses["padded"], rel=1e-5)


def _evaluate(model_dir, out_dir, stage, rows, batch):
    """``backend.evaluate`` on ``rows`` (also the train set), untrained, ``batch`` rows per eval batch."""
    from datasets import Dataset

    tok = _tokenizer(model_dir)
    config = resolve(dict(model_name_or_path=model_dir, stage=stage, output_dir=str(out_dir),
                          per_device_eval_batch_size=batch, report_to="none", disable_tqdm=True), {}, None)
    backend = StandardBackend(config)
    job = TrainJob(stage=stage, tokenizer=tok, train_dataset=Dataset.from_list(rows),
                   eval_dataset=Dataset.from_list(rows), collator=_Collator(tok.pad_token_id, stage == "dpo"))
    backend.setup_distributed()
    try:
        return backend.evaluate(job, backend.apply_finetuning(backend.load_models(stage, tok)))
    finally:
        backend.teardown()


def _token_loss_sums(model_dir, rows) -> list[tuple[float, int]]:
    """(summed loss, trained tokens) of each row: the HF model on the unpadded row, labels shifted once,
    prompt tokens (label -100) not counted. Independent of the backend and of HF's loss function."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    sums = []
    with torch.no_grad():
        for row in rows:
            logits = model(input_ids=torch.tensor([row["input_ids"]])).logits[0, :-1]
            labels = torch.tensor(row["labels"][1:])
            loss = torch.nn.functional.cross_entropy(logits, labels, ignore_index=IGNORE, reduction="sum")
            sums.append((loss.item(), int((labels != IGNORE).sum())))
    return sums


@pytest.mark.parametrize("stage", ["sft", "dpo"])
def test_evaluate_reports_the_loss_on_the_eval_set(tiny_model_dir, tmp_path, stage):
    """One eval batch of 8 rows: sft's eval_loss is the per-token mean over the answers of the set."""
    rows = {"sft": _sft_rows, "dpo": _dpo_rows}[stage](_tokenizer(tiny_model_dir), 8)
    metrics = _evaluate(tiny_model_dir, tmp_path, stage, rows, batch=8)
    if stage == "dpo":
        assert metrics["eval_loss"] == pytest.approx(math.log(2), abs=1e-6)  # policy == reference
    else:
        sums = _token_loss_sums(tiny_model_dir, rows)
        per_token = sum(s for s, _ in sums) / sum(n for _, n in sums)
        # With the prompt tokens counted too (the label mask dropped) it is 6.2662 instead of 6.2378.
        assert metrics["eval_loss"] == pytest.approx(per_token, rel=1e-5)


def test_eval_loss_is_the_per_token_mean_whatever_the_eval_batch_size(tiny_model_dir, tmp_path):
    """Two eval batches of 4 rows with different numbers of answer tokens: still the per-token mean of the
    whole set, the definition the mca backend uses (and the train loss: per token over the global batch)."""
    rows = _sft_rows(_tokenizer(tiny_model_dir), 8)
    sums = _token_loss_sums(tiny_model_dir, rows)
    per_token = sum(s for s, _ in sums) / sum(n for _, n in sums)
    batch_means = [sum(s for s, _ in sums[i:i + 4]) / sum(n for _, n in sums[i:i + 4]) for i in (0, 4)]
    assert abs(sum(batch_means) / 2 - per_token) > 1e-4  # the data tells the two definitions apart
    metrics = _evaluate(tiny_model_dir, tmp_path, "sft", rows, batch=4)
    assert metrics["eval_loss"] == pytest.approx(per_token, rel=1e-5)


def test_the_final_eval_is_logged_once_when_eval_strategy_already_ran_it(tiny_model_dir, tmp_path):
    """eval_steps 3 of 6 steps: HF evaluates at 3 and 6; the router's end-of-run eval reuses step 6's."""
    _, result, _, _ = train_in_process(tiny_model_dir, tmp_path, n=8, evaluate=True, eval_strategy="steps",
                                       eval_steps=3)
    records = [json.loads(line) for line in open(tmp_path / "train_log.jsonl")]
    assert [r["step"] for r in records if "eval_loss" in r] == [3, 6], records
    assert result.metrics["eval_loss"] == [r for r in records if "eval_loss" in r][-1]["eval_loss"]
