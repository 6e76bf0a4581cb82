"""McaBackend: the Megatron padding policy, model loading at a layout, HF export, and its honest limits."""

from __future__ import annotations

import json
import os

import pytest

from tests.helpers import output_of, roll_train, torchrun

WORKER = os.path.join(os.path.dirname(__file__), "_mca_workers", "backend_roundtrip.py")


@pytest.mark.mca
def test_load_at_tp2_and_export_is_bit_exact_also_from_ddp_wrapped_chunks(tiny_model_factory, tmp_path):
    pytest.importorskip("megatron.core")  # the only test here that builds a Megatron model
    import torch
    from transformers import AutoModelForCausalLM

    model_dir = tiny_model_factory("qwen2", tie_word_embeddings=False)
    out = str(tmp_path / "hf")
    proc = torchrun(WORKER, model_dir, out, "tensor_model_parallel_size=2", timeout=300)
    assert proc.returncode == 0, output_of(proc)
    original = AutoModelForCausalLM.from_pretrained(model_dir).state_dict()
    for exported_dir in (out, out + "_ddp"):
        exported = AutoModelForCausalLM.from_pretrained(exported_dir).state_dict()
        assert original.keys() == exported.keys(), exported_dir
        for name, tensor in original.items():
            assert torch.equal(tensor, exported[name]), (exported_dir, name)
        assert os.path.isfile(os.path.join(exported_dir, "tokenizer_config.json"))


def test_dry_run_shows_megatron_batch(tiny_model_dir, tmp_path):
    recipe = tmp_path / "r.yaml"
    recipe.write_text(f"model_name_or_path: {tiny_model_dir}\nstage: sft\n"
                      "dataset: recipes/demo/data/arithmetic_sft.json\ncutoff_len: 64\n")
    std = roll_train(str(recipe), "--dry-run", "--json", timeout=300)
    mca = roll_train(str(recipe), "--dry-run", "--json", "--use-mca", "nproc_per_node=2",
                     "tensor_model_parallel_size=2", "sequence_parallel=true", timeout=300)
    assert std.returncode == 0 and mca.returncode == 0, output_of(mca)
    std_summary, mca_summary = json.loads(std.stdout), json.loads(mca.stdout)
    # Same samples and trainable tokens on both backends: only the collator's shape differs.
    for key in ("num_samples", "num_tokens", "num_trainable_tokens"):
        assert std_summary[key] == mca_summary[key], key
    # The Megatron batch is shifted (one position shorter than the longest row) and padded to a
    # multiple of TP for sequence parallelism; every key keeps the same shape.
    std_len = std_summary["batch_shapes"]["input_ids"][1]
    mca_shapes = mca_summary["batch_shapes"]
    assert mca_shapes["input_ids"] == [2, -(-(std_len - 1) // 2) * 2], mca_shapes
    assert mca_shapes["labels"] == mca_shapes["input_ids"], mca_shapes


@pytest.mark.mca
@pytest.mark.distributed
@pytest.mark.mca
def test_demo_recipe_trains_at_tp2_from_the_command_line(tiny_model_factory, tmp_path):
    """As a new user would: the demo recipe with --use-mca on 2 processes at TP2 trains (loss falls) and
    ends in an HF model directory that transformers loads (the real 151k-token Qwen2.5 tokenizer); with an
    eval split the router evaluates after training, and report_to: tensorboard writes event files."""
    pytest.importorskip("megatron.core")
    import torch
    from transformers import AutoModelForCausalLM

    model_dir = tiny_model_factory("qwen2", tokenizer="qwen")
    out = tmp_path / "out"
    proc = roll_train("recipes/demo/tiny_sft.yaml", "--use-mca", "nproc_per_node=2", "tensor_model_parallel_size=2",
                      f"model_name_or_path={model_dir}", f"output_dir={out}", "max_steps=20", "val_size=0.1",
                      "report_to=tensorboard", timeout=600)
    assert proc.returncode == 0, output_of(proc)
    with open(out / "train_log.jsonl", encoding="utf-8") as fh:
        log = [json.loads(line) for line in fh]
    losses = [entry["loss"] for entry in log if "loss" in entry]
    assert len(losses) == 4 and losses[-1] < losses[0] - 3, losses  # logging_steps 5 over 20 steps
    assert {"grad_norm", "learning_rate", "tokens_per_second", "epoch"} <= set(log[0])
    for record in (entry for entry in log if "loss" in entry):  # roll.perf's speed fields, every training log
        assert record["step_time"] > 0 and record["tokens_per_second"] > 0, record
        assert 0 < record["mfu"] < float("inf") and record["peak_memory_gb"] > 0, record
    assert log[-1]["step"] == 20 and 0 < log[-1]["eval_loss"] < losses[0], log[-1]
    assert any(name.startswith("events.out.tfevents") for _, _, files in os.walk(out / "runs") for name in files)
    model = AutoModelForCausalLM.from_pretrained(out)
    with torch.no_grad():
        logits = model(torch.tensor([[1, 2, 3]])).logits
    assert logits.shape[-1] == model.config.vocab_size and torch.isfinite(logits).all()


def test_freeze_is_refused_at_config_time(tmp_path):
    recipe = tmp_path / "r.yaml"
    recipe.write_text("stage: sft\nfinetuning_type: freeze\nuse_mca: true\n")
    proc = roll_train(str(recipe), "--print-config", timeout=120)
    assert proc.returncode == 2 and "'freeze' is not supported by the mca backend" in proc.stderr


@pytest.mark.parametrize("layout, expected", [
    (dict(tensor_model_parallel_size=2, sequence_parallel=True), dict(pad_to="longest", pad_to_multiple_of=2)),
    (dict(context_parallel_size=2), dict(pad_to="longest", pad_to_multiple_of=4)),
    (dict(expert_model_parallel_size=2, moe_token_dispatcher_type="allgather"), dict(pad_to="max_length")),
    (dict(expert_model_parallel_size=2), dict(pad_to="longest")),  # the recipe default: alltoall
])
def test_padding_policy_follows_the_layout(tmp_path, layout, expected):
    from backends.mca.backend import McaBackend
    from roll.config.parser import resolve

    cli = {k: str(v) for k, v in layout.items()}
    config = resolve({"stage": "sft", "use_mca": True, "nproc_per_node": 2, "cutoff_len": 64}, cli, None)
    policy = McaBackend(config).padding_policy("sft")
    assert policy.shift_labels is True
    for key, value in expected.items():
        assert getattr(policy, key) == value
