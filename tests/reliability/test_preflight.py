"""The pre-flight checks in-process (milliseconds each); test_bad_inputs.py runs them through roll-train."""

from __future__ import annotations

import json
import os
import struct
from types import SimpleNamespace

import pytest

from roll import preflight
from roll.checkpoints import check_output_dir, prepare_output_dir, wants_resume
from roll.errors import ConfigError, ModelError


def _training(out, **keys):
    return SimpleNamespace(output_dir=str(out), overwrite_output_dir=keys.get("overwrite", False),
                           resume_from_checkpoint=keys.get("resume"), nproc_per_node=keys.get("nproc", 1))


@pytest.mark.parametrize("value, resumes", [(None, False), ("", False), ("none", False), ("false", False),
                                            (False, False), ("true", True), (True, True),
                                            ("out/checkpoint-3", True)])
def test_wants_resume(value, resumes):
    assert wants_resume(value) is resumes


def test_a_log_of_a_run_that_saved_nothing_does_not_block(tmp_path):
    for name in ("train_log.jsonl", "loss.png", "notes.txt"):
        (tmp_path / name).write_text("x")
    (tmp_path / "runs").mkdir()
    (tmp_path / "checkpoint-3.tmp").mkdir()  # an unfinished save is not a checkpoint
    check_output_dir(_training(tmp_path))
    check_output_dir(_training(tmp_path / "does_not_exist_yet"))


@pytest.mark.parametrize("made", ["config.json", "model.safetensors", "adapter_config.json",
                                  "mca_config.json", "checkpoint-2"])
def test_a_trained_model_or_checkpoint_blocks_a_fresh_run(tmp_path, made):
    if made.startswith("checkpoint-"):
        (tmp_path / made).mkdir()
    else:
        (tmp_path / made).write_text("{}")
    with pytest.raises(ConfigError) as info:
        check_output_dir(_training(tmp_path, resume="false"))
    message = str(info.value)
    assert made in message and "overwrite_output_dir: true" in message
    assert "resume_from_checkpoint: true" in message
    check_output_dir(_training(tmp_path, overwrite=True))
    check_output_dir(_training(tmp_path, resume="true"))


def test_overwrite_deletes_old_checkpoints_on_rank0_only_and_never_when_resuming(tmp_path):
    for step in (2, 4):
        (tmp_path / f"checkpoint-{step}").mkdir()
    (tmp_path / "model.safetensors").write_text("old")
    assert prepare_output_dir(_training(tmp_path, overwrite=True), is_rank0=False) == []
    assert prepare_output_dir(_training(tmp_path, overwrite=True, resume="true"), is_rank0=True) == []
    assert sorted(os.listdir(tmp_path)) == ["checkpoint-2", "checkpoint-4", "model.safetensors"]
    deleted = prepare_output_dir(_training(tmp_path, overwrite=True), is_rank0=True)
    assert sorted(os.path.basename(p) for p in deleted) == ["checkpoint-2", "checkpoint-4"]
    assert os.listdir(tmp_path) == ["model.safetensors"]  # replaced when the new run saves


def _safetensors(path, data_len=16, actual_len=None):
    entry = {"dtype": "F32", "shape": [data_len // 4], "data_offsets": [0, data_len]}
    header = json.dumps({"w": entry}).encode()
    payload = b"\0" * (data_len if actual_len is None else actual_len)
    path.write_bytes(struct.pack("<Q", len(header)) + header + payload)
    return str(path)


def test_safetensors_length_is_checked_against_its_header(tmp_path):
    preflight.check_safetensors_file(_safetensors(tmp_path / "ok.safetensors"))
    with pytest.raises(ModelError, match="is truncated: .* its header describes"):
        preflight.check_safetensors_file(_safetensors(tmp_path / "cut.safetensors", actual_len=15))
    (tmp_path / "tiny.safetensors").write_bytes(b"abc")
    with pytest.raises(ModelError, match="not a safetensors file"):
        preflight.check_safetensors_file(str(tmp_path / "tiny.safetensors"))
    (tmp_path / "bad.safetensors").write_bytes(struct.pack("<Q", 4) + b"{{{{")
    with pytest.raises(ModelError, match="corrupt safetensors header"):
        preflight.check_safetensors_file(str(tmp_path / "bad.safetensors"))


def test_a_model_without_weights_and_pickled_weights_per_backend(tmp_path):
    with pytest.raises(ModelError, match="has no model.safetensors"):
        preflight.check_weight_files(str(tmp_path), use_mca=False)
    (tmp_path / "pytorch_model.bin").write_bytes(b"")
    preflight.check_weight_files(str(tmp_path), use_mca=False)  # transformers loads it weights_only
    with pytest.raises(ModelError, match="pickled .bin weights"):
        preflight.check_weight_files(str(tmp_path), use_mca=True)


def test_remote_code_needs_trust_and_says_so():
    custom = {"model_type": "acme_lm", "auto_map": {"AutoConfig": "configuration_acme.AcmeConfig"}}
    with pytest.raises(ModelError, match="set trust_remote_code: true if you trust this code"):
        preflight.check_remote_code(custom, "config.json", trust_remote_code=False)
    preflight.check_remote_code(custom, "config.json", trust_remote_code=True)
    preflight.check_remote_code({"model_type": "qwen2"}, "config.json", trust_remote_code=False)
    with pytest.raises(ModelError, match="does not know") as info:
        preflight.check_remote_code({"model_type": "acme_lm"}, "config.json", trust_remote_code=True)
    assert "trust_remote_code" not in str(info.value)  # already set: no advice to set it


def test_more_processes_than_cpu_cores(monkeypatch):
    monkeypatch.setattr(os, "sched_getaffinity", lambda _pid: {0, 1}, raising=False)
    from roll.platform import current_platform

    if current_platform().is_accelerator:
        pytest.skip("compares with the GPU count on this machine")
    preflight.check_machine(_training("out", nproc=2))
    with pytest.raises(ConfigError, match="2 CPU core.*Set nproc_per_node to at most 2"):
        preflight.check_machine(_training("out", nproc=3))


def test_the_standard_backends_own_model_check_finds_remote_code_and_truncated_weights(tmp_path):
    """Library use (roll.router.run without roll-train) gets the same messages from the backend's check."""
    from backends.standard.models import check_causal_lm

    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen2",
                                                      "architectures": ["Qwen2ForCausalLM"]}))
    _safetensors(tmp_path / "model.safetensors", actual_len=8)
    with pytest.raises(ModelError, match="model.safetensors is truncated"):
        check_causal_lm(str(tmp_path))
    _safetensors(tmp_path / "model.safetensors")
    check_causal_lm(str(tmp_path))
    remote = {"model_type": "acme_lm", "auto_map": {"AutoConfig": "configuration_acme.AcmeConfig"}}
    (tmp_path / "config.json").write_text(json.dumps(remote))
    with pytest.raises(ModelError, match="set trust_remote_code: true if you trust this code"):
        check_causal_lm(str(tmp_path), what="ref_model")


def _resume_config(ckpt, model_dir, *, use_mca, finetuning_type="full", per_device=4, dp=2):
    training = SimpleNamespace(resume_from_checkpoint=str(ckpt), output_dir=str(ckpt.parent), use_mca=use_mca,
                               per_device_train_batch_size=per_device, gradient_accumulation_steps=1,
                               world_size_from_launch=dp)
    return SimpleNamespace(training=training, layout=SimpleNamespace(dp=dp) if use_mca else None,
                           backend_name="mca" if use_mca else "standard",
                           finetuning=SimpleNamespace(finetuning_type=finetuning_type),
                           model=SimpleNamespace(model_name_or_path=str(model_dir)))


def test_a_megatron_checkpoint_is_checked_against_the_run(tmp_path):
    """The files a --use-mca checkpoint holds (backends/mca/trainer/checkpointing.py): trainer_state.json with
    the global batch, mca_config.json with the HF config, adapter_config.json for LoRA."""
    hf = {"model_type": "qwen2", "hidden_size": 64, "num_hidden_layers": 2}
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(hf))
    ckpt = tmp_path / "out" / "checkpoint-3"
    ckpt.mkdir(parents=True)
    (ckpt / "trainer_state.json").write_text(json.dumps({"global_step": 3, "global_batch_size": 8}))
    (ckpt / "mca_config.json").write_text(json.dumps({"hf_config": hf}))
    preflight.check_resume(_resume_config(ckpt, model, use_mca=True))  # 4 * 1 * dp 2 = 8
    with pytest.raises(ConfigError, match="global batch of 8 samples .* this run uses 16"):
        preflight.check_resume(_resume_config(ckpt, model, use_mca=True, per_device=8))
    with pytest.raises(ConfigError, match="written by a --use-mca"):
        preflight.check_resume(_resume_config(ckpt, model, use_mca=False))
    with pytest.raises(ConfigError, match="full-model checkpoint but this run has finetuning_type=lora"):
        preflight.check_resume(_resume_config(ckpt, model, use_mca=True, finetuning_type="lora"))
    (model / "config.json").write_text(json.dumps({**hf, "hidden_size": 128}))
    with pytest.raises(ConfigError, match=r"another model .*\(hidden_size 64 there, 128 here\)"):
        preflight.check_resume(_resume_config(ckpt, model, use_mca=True))


def _data(**keys):
    values = {"dataset": None, "eval_dataset": None, "dataset_dir": "data", "tokenized_path": None,
              "overwrite_cache": False, **keys}
    return SimpleNamespace(data=SimpleNamespace(**values))


def test_data_files_are_checked_unless_prepared_rows_are_loaded(tmp_path):
    """A missing or unreadable data file is found before any import; rows prepared into tokenized_path
    (on another machine, docs/data.md) need no raw files, unless overwrite_cache prepares them again."""
    from roll.errors import DataError

    rows = tmp_path / "rows.json"
    rows.write_text("[]")
    preflight.check_data_files(_data(dataset=f"{rows}, {rows}", eval_dataset=""))
    for keys, message in ((dict(dataset=None), "no dataset given"),
                          (dict(dataset=str(tmp_path / "row.json")), "not found"),
                          (dict(dataset=str(rows), eval_dataset=str(tmp_path / "evals.json")), "not found"),
                          (dict(dataset=str(tmp_path / "rows.xml")), "not found")):
        with pytest.raises(DataError, match=message):
            preflight.check_data_files(_data(**keys))
    (tmp_path / "rows.xml").write_text("<rows/>")
    with pytest.raises(DataError, match="unsupported file type"):
        preflight.check_data_files(_data(dataset=str(tmp_path / "rows.xml")))
    prepared = tmp_path / "prepared"
    prepared.mkdir()
    (prepared / "manifest.json").write_text("{}")
    preflight.check_data_files(_data(dataset=str(tmp_path / "gone.json"), tokenized_path=str(prepared)))
    with pytest.raises(DataError, match="not found"):
        preflight.check_data_files(_data(dataset=str(tmp_path / "gone.json"), tokenized_path=str(prepared),
                                         overwrite_cache=True))
    with pytest.raises(DataError, match="not found"):  # an empty tokenized_path is where to prepare
        preflight.check_data_files(_data(dataset=str(tmp_path / "gone.json"), tokenized_path=str(tmp_path / "new")))
