"""The standard backend on 2 processes through `roll-train` itself (deepspeed launcher, gloo on CPU):
ZeRO-2, ZeRO-3 (and DDP under torchrun) give the same losses as a 1-process run with the same
global batch.

The 1-process reference runs in the test process through the router (no DeepSpeed), which is the
plain HF Trainer path; the 2-process runs are real `roll-train ... nproc_per_node=2 deepspeed=...`.
"""

from __future__ import annotations

import glob
import json
import os

import pytest

from tests.helpers import REPO, output_of, roll_train


SFT_DATA = os.path.join(REPO, "recipes", "demo", "data", "arithmetic_sft.json")
DPO_DATA = os.path.join(REPO, "recipes", "demo", "data", "arithmetic_dpo.json")
GLOBAL_BATCH = 8


def _recipe(model_dir, out_dir, stage, **extra) -> dict:
    recipe = dict(model_name_or_path=model_dir, stage=stage, dataset=SFT_DATA if stage == "sft" else DPO_DATA,
                  cutoff_len=64, output_dir=str(out_dir), max_steps=2, logging_steps=1, learning_rate=1e-3,
                  lr_scheduler_type="constant", save_strategy="no", report_to="none", seed=0,
                  disable_tqdm=True)
    recipe.update(extra)
    return recipe


def _logged(out_dir) -> list[dict]:
    with open(os.path.join(out_dir, "train_log.jsonl"), encoding="utf-8") as fh:
        return [entry for entry in map(json.loads, fh) if "loss" in entry]


def _one_process(model_dir, out_dir, stage, **extra) -> list[dict]:
    """The reference: 1 process, micro-batch = global batch, through the router in this process."""
    from roll import router
    from roll.config.parser import resolve

    recipe = _recipe(model_dir, out_dir, stage, per_device_train_batch_size=GLOBAL_BATCH, **extra)
    router.run(resolve(recipe, {}, None))
    return _logged(out_dir)


def _shm_buffers() -> set[str]:
    from backends.standard._compat import SHM_BUFFER_PREFIX

    return {name for name in os.listdir("/dev/shm") if name.startswith(SHM_BUFFER_PREFIX)} \
        if os.path.isdir("/dev/shm") else set()


def _leaked_shm_buffers(before: set[str]) -> set[str]:
    """DeepSpeed shared-memory files that appeared since ``before`` and no live process maps (another job's
    run on the same machine still maps its own)."""
    mapped = set()
    for maps in glob.glob("/proc/[0-9]*/maps"):
        try:
            with open(maps, encoding="utf-8", errors="replace") as fh:
                mapped.update(os.path.basename(line.split()[-1]) for line in fh if "/dev/shm/" in line)
        except OSError:  # the process ended meanwhile
            continue
    return _shm_buffers() - before - mapped


def _two_processes(model_dir, out_dir, stage, ds_file, micro_batch, grad_accum, **extra) -> list[dict]:
    """`roll-train ... nproc_per_node=2`: deepspeed launcher with a DeepSpeed file, else torchrun."""
    recipe = _recipe(model_dir, out_dir, stage, per_device_train_batch_size=micro_batch,
                     gradient_accumulation_steps=grad_accum, nproc_per_node=2, **extra)
    if ds_file:
        recipe["deepspeed"] = os.path.join(REPO, "recipes", "deepspeed", ds_file)
    args = [f"{key}={value}" for key, value in recipe.items()]
    shm_before = _shm_buffers()
    proc = roll_train(*args, timeout=420)
    assert proc.returncode == 0, output_of(proc)  # every rank exited cleanly (W2)
    assert not _leaked_shm_buffers(shm_before)  # W8: DeepSpeed's /dev/shm all-reduce files are gone
    launcher = "deepspeed.launcher.runner" if ds_file else "roll.torchrun"
    assert "launching 2 processes" in proc.stderr and launcher in proc.stderr
    return _logged(out_dir)


@pytest.fixture(scope="module")
def sft_case(tiny_model_factory, tmp_path_factory) -> dict:
    """A model and data on which the loss definition shows in the loss itself: answers of 1-4
    sentences (9-40 trainable tokens a sample) and a large init (per-token losses far apart). On the
    first two steps a mean of per-rank or per-micro-batch means differs from the global per-token
    mean by 8e-4 to 3e-3 relative (checked offline), well outside the 1e-4 tolerance; on the demo
    data with the default init the loss differs by as little as 5e-6 (only grad_norm showed it)."""
    with open(SFT_DATA, encoding="utf-8") as fh:
        rows = json.load(fh)
    for i, row in enumerate(rows):
        row["output"] = " ".join([row["output"]] * (1 + i % 4))
    data = tmp_path_factory.mktemp("sft_varied") / "data.json"
    data.write_text(json.dumps(rows), encoding="utf-8")
    return {"model_dir": tiny_model_factory("qwen2", initializer_range=1.0), "dataset": str(data)}


@pytest.fixture(scope="module")
def sft_reference(sft_case, tmp_path_factory):
    return _one_process(sft_case["model_dir"], tmp_path_factory.mktemp("sft_1proc"), "sft",
                        dataset=sft_case["dataset"])


@pytest.mark.parametrize("ds_file,micro_batch,grad_accum",
                         [("ds_z2.json", 4, 1), ("ds_z3.json", 2, 2), (None, 2, 2)])
def test_sft_zero_two_processes_matches_one(sft_case, tmp_path, sft_reference, ds_file, micro_batch,
                                            grad_accum):
    from transformers import AutoModelForCausalLM

    logged = _two_processes(sft_case["model_dir"], tmp_path, "sft", ds_file, micro_batch, grad_accum,
                            dataset=sft_case["dataset"])
    assert [e["step"] for e in logged] == [1, 2]
    assert logged[0]["loss"] == pytest.approx(sft_reference[0]["loss"], rel=1e-4)
    assert logged[0]["grad_norm"] == pytest.approx(sft_reference[0]["grad_norm"], rel=1e-4)
    assert logged[1]["loss"] == pytest.approx(sft_reference[1]["loss"], rel=1e-4)
    assert logged[0]["tokens_per_second"] > 0
    AutoModelForCausalLM.from_pretrained(str(tmp_path))  # under ZeRO-3: the gathered weights


def test_dpo_zero3_two_processes_matches_one(tiny_model_dir, tmp_path):
    reference = _one_process(tiny_model_dir, tmp_path / "one", "dpo")
    logged = _two_processes(tiny_model_dir, tmp_path / "two", "dpo", "ds_z3.json", 4, 1)
    assert logged[0]["loss"] == pytest.approx(reference[0]["loss"], rel=1e-4)  # log(2): policy == reference
    assert logged[0]["grad_norm"] == pytest.approx(reference[0]["grad_norm"], rel=1e-4)
    assert logged[1]["loss"] == pytest.approx(reference[1]["loss"], rel=1e-4)
    for key in ("rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins"):
        assert logged[1][key] == pytest.approx(reference[1][key], rel=1e-3, abs=1e-5), key


def test_rm_zero3_two_processes_matches_one(tiny_model_dir, tmp_path):
    """Stage rm under ZeRO-3 on 2 processes: the head the checkpoint lacks is zeroed whole (gathered; zeroing
    each rank's partition alone would leave the other's), so step 1 is ln 2 as on 1 process; the losses, the rm
    metrics and the eval metrics over 10 held-out pairs in uneven batches of 3 (accelerate repeats rows to even
    them out over the ranks) equal the 1-process run's; the gathered export is a reward model."""
    import math

    from transformers import AutoModelForSequenceClassification

    extra = dict(val_size=10, per_device_eval_batch_size=3)
    reference = _one_process(tiny_model_dir, tmp_path / "one", "rm", **extra)
    logged = _two_processes(tiny_model_dir, tmp_path / "two", "rm", "ds_z3.json", 4, 1, **extra)
    assert reference[0]["loss"] == logged[0]["loss"] == pytest.approx(math.log(2), abs=1e-7)
    for step, (ours, theirs) in enumerate(zip(logged, reference), start=1):
        for key in ("loss", "accuracy", "margin", "rewards/chosen", "rewards/rejected"):
            assert ours[key] == pytest.approx(theirs[key], rel=1e-5, abs=1e-7), (step, key)
    with open(os.path.join(tmp_path / "two", "train_log.jsonl"), encoding="utf-8") as fh:
        two = [entry for entry in map(json.loads, fh) if "eval_loss" in entry][-1]
    with open(os.path.join(tmp_path / "one", "train_log.jsonl"), encoding="utf-8") as fh:
        one = [entry for entry in map(json.loads, fh) if "eval_loss" in entry][-1]
    for key in ("eval_loss", "eval_accuracy", "eval_margin", "eval_rewards/chosen"):
        assert two[key] == pytest.approx(one[key], rel=1e-5, abs=1e-7), key
    model = AutoModelForSequenceClassification.from_pretrained(str(tmp_path / "two"))
    assert model.config.num_labels == 1 and model.score.weight.abs().sum() > 0


def test_lora_zero3_exports_adapter_and_merged_model(tiny_model_dir, tmp_path):
    """ZeRO-3 gathers the adapter for saving; the rank-0-only merge must not hang in ZeRO-3
    collectives (W4)."""
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    recipe = _recipe(tiny_model_dir, tmp_path, "sft", per_device_train_batch_size=4, nproc_per_node=2,
                     finetuning_type="lora", lora_rank=4, learning_rate=1e-2, export_merged=True,
                     deepspeed=os.path.join(REPO, "recipes", "deepspeed", "ds_z3.json"))
    proc = roll_train(*[f"{key}={value}" for key, value in recipe.items()], timeout=420)
    assert proc.returncode == 0, output_of(proc)
    assert len(_logged(tmp_path)) == 2
    ids = torch.tensor([[5, 17, 42, 99, 7, 3]])
    with torch.no_grad():
        base = AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()
        base_logits = base(input_ids=ids).logits
        adapted = PeftModel.from_pretrained(base, str(tmp_path)).eval()(input_ids=ids).logits
        merged = AutoModelForCausalLM.from_pretrained(str(tmp_path / "merged")).eval()(input_ids=ids).logits
    assert torch.allclose(merged, adapted, atol=1e-4)
    assert not torch.allclose(adapted, base_logits, atol=1e-4)  # the gathered adapter is the trained one
