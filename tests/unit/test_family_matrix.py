"""The family smoke matrix: every causal-LM family of the installed transformers, built tiny with Qwen2.5's
151,936-token vocabulary (embedding and output head at that size), trains 2 sft steps on the standard
backend through roll-train's own entry point (``roll.cli.main``: config, preflight, router, data
pipeline, Trainer, collator, speed callbacks), with a numeric ``mfu`` on every training log; ``--plan`` and ``--dry-run`` run on the same
directory; ``--use-mca`` refuses a family without a Megatron template with exit 2, naming the supported ones.

One pytest process for all families (roll-train as a subprocess costs ~10 s of imports each). The data goes
through the 512-token test tokenizer (roll.demo.tiny_model), whose ids the 151k vocabulary covers: loading Qwen's own
151k-entry tokenizer.json twice per family would cost more than training; the datasets cache tokenizes the
rows once for all families (they share the tokenizer). The families
left out, and why, are ``tests/families.py`` SKIPPED: pytest lists them as skipped with the reason
(``pytest -ra``), and docs/performance.md copies the list.
"""

from __future__ import annotations

import gc
import json
import math
import os
import shutil
import signal

import pytest

from tests.families import SKIPPED, causal_lm_families, tiny_config

FAMILIES = causal_lm_families()
QWEN25_VOCAB = 151936  # Qwen2.5's config.json vocab_size (its tokenizer has 151,665 entries)
SFT_ROWS = [{"instruction": f"What is {a} plus {b}?", "input": "", "output": f"{a} plus {b} equals {a + b}."}
            for a, b in ((1, 2), (3, 4), (5, 1), (2, 2))]


@pytest.fixture(scope="module")
def shared(tmp_path_factory):
    """The test tokenizer saved once, the sft data, and the datasets cache every family shares."""
    from roll.demo.tiny_model import build_bpe_tokenizer

    root = tmp_path_factory.mktemp("families")
    tokenizer = build_bpe_tokenizer(str(root / "tokenizer"))
    data = root / "sft.json"
    data.write_text(json.dumps(SFT_ROWS))
    return {"root": root, "tokenizer": tokenizer, "data": str(data), "cache": str(root / "datasets_cache")}


def _model_dir(family: str, shared: dict) -> str:
    """A tiny random ``family`` model with the shared tokenizer's files, saved as roll-train reads it."""
    import torch
    from transformers import AutoModelForCausalLM

    tok = shared["tokenizer"]
    config = tiny_config(family, QWEN25_VOCAB, pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id)
    with torch.device("meta"):  # a family whose "tiny" model is not tiny fails here, before allocating it
        size = sum(p.numel() for p in AutoModelForCausalLM.from_config(config).parameters())
    assert size < 30e6, f"{family}: {size / 1e6:.0f}M parameters; add an override to tests/families.py"
    torch.manual_seed(0)
    path = shared["root"] / family
    AutoModelForCausalLM.from_config(config).save_pretrained(path)
    for name in os.listdir(shared["root"] / "tokenizer"):
        target = path / name
        shutil.copyfile(shared["root"] / "tokenizer" / name, target)
    return str(path)


def _has_mca_template(model_type: str) -> bool:
    from backends.mca.models.template import get_template
    from roll.errors import ModelError

    try:
        get_template(model_type)
    except ModelError:
        return False
    return True


@pytest.fixture
def cleanup(shared):
    """Removes the families' model directories as the tests end: 160 x 20 MB would stay in pytest's tmp."""
    made: list[str] = []
    yield made
    for path in made:
        shutil.rmtree(path, ignore_errors=True)


@pytest.mark.parametrize("family", FAMILIES)
def test_family_trains_plans_and_dry_runs(family, shared, tmp_path, monkeypatch, capsys, cleanup):
    if family in SKIPPED:
        pytest.skip(f"{family}: {SKIPPED[family]}")
    import datasets

    from roll import router
    from roll.cli import main as roll_train

    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", shared["cache"])
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    # Two family-independent costs, 0.9 s of a family's 1.5 s (profiled): accelerate's gc.collect() after
    # training (it walks every object of a process that has imported 160 model families) and loss.png
    # (tests/unit/test_plot.py covers it). Everything else runs as roll-train runs it.
    monkeypatch.setattr(gc, "collect", lambda generation=2: 0)
    monkeypatch.setattr(router, "_plot_losses", lambda config, world_size: None)
    model = _model_dir(family, shared)
    cleanup.append(model)
    out = tmp_path / "out"
    args = [f"model_name_or_path={model}", "stage=sft", f"dataset={shared['data']}", "cutoff_len=32",
            f"output_dir={out}", "per_device_train_batch_size=2", "max_steps=2", "logging_steps=1",
            "learning_rate=1e-3", "lr_scheduler_type=constant", "save_strategy=no", "save_hf_model=false",
            "report_to=none", "seed=0"]

    assert roll_train([*args, "--plan", "--json"]) == 0, capsys.readouterr().err
    plan = json.loads(capsys.readouterr().out)
    assert plan["total_bytes"] > 0 and plan["fits"], plan

    assert roll_train([*args, "--dry-run", "--json"]) == 0, capsys.readouterr().err
    assert json.loads(capsys.readouterr().out)["num_samples"] == len(SFT_ROWS)

    handlers = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    assert roll_train(args) == 0, capsys.readouterr().err
    # an in-process run hands its caller's signal handlers back (else a later run, or test, is "preempted")
    assert {sig: signal.getsignal(sig) for sig in handlers} == handlers
    records = [json.loads(line) for line in (out / "train_log.jsonl").read_text().splitlines()]
    steps = [r for r in records if "loss" in r]
    assert [r["step"] for r in steps] == [1, 2], records
    for record in steps:
        assert math.isfinite(record["loss"]), record
        assert isinstance(record["mfu"], float) and 0 < record["mfu"] < math.inf, record

    model_type = json.loads((shared["root"] / family / "config.json").read_text())["model_type"]  # gpt-sw3: gpt2
    if not _has_mca_template(model_type):  # with one, --use-mca would train it on Megatron
        capsys.readouterr()
        assert roll_train([*args, "--use-mca"]) == 2
        err = capsys.readouterr().err
        assert f"model_type {model_type!r} has no Megatron conversion template" in err, err
        assert "Supported families: " in err and "llama, mistral, mixtral, qwen2" in err, err
        assert "use_mca: false" in err, err
