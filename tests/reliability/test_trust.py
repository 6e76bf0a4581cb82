"""Safe by default: no file roll reads runs code unless the user opts in, and no secret is written or logged.

A payload pickle (``tests/reliability/payloads.py``: unpickling it only creates a marker file) is planted in
each pickle-based file of a DeepSpeed checkpoint, a Megatron (mca) checkpoint and a Megatron-format model
folder, all written by real runs of this module; every way roll reads them (resume, model_name_or_path,
ref_model, ``roll-convert mca2hf``) must end with exit code 2, one ``error:`` line naming the file and the
opt-in key, and no marker. Refusals found before anything starts (``roll.preflight``) run roll-train's
``main`` in-process (milliseconds each); the payload inside ``.distcp`` bytes is only met while ranks load, so
that case is a real run, and the loads behind the pre-flight scan (DeepSpeed's, PyTorch DCP's, megatron's)
are checked on their own in one subprocess. The two training runs carry a ``hub_token`` that must appear in no
file and no log line.
"""

from __future__ import annotations

import datetime
import glob
import json
import os
import shutil
import sys

import pytest
import torch

from roll import redact
from tests.helpers import output_of, roll_train, run
from tests.reliability import payloads

pytestmark = pytest.mark.distributed

SECRET = "hf_s3cr3tTOKENvalue42"
TIMEOUT = 300


def _base(model: str, out: str, *extra: str) -> list[str]:
    return [f"model_name_or_path={model}", "stage=sft", "dataset=recipes/demo/data/arithmetic_sft.json",
            "cutoff_len=64", f"output_dir={out}", "per_device_train_batch_size=2", "learning_rate=1e-3",
            "logging_steps=1", "save_steps=2", "max_steps=2", "report_to=none", "disable_tqdm=true", *extra]


@pytest.fixture(scope="module")
def runs(tmp_path_factory, tiny_model_dir) -> dict[str, str]:
    """Two real runs, each saving checkpoint-2: DeepSpeed ZeRO-2 on 2 processes (the launcher logs its
    command line) and mca on 1; both get the secret, once as ``--hub_token V`` and once as ``hub_token=V``."""
    root = str(tmp_path_factory.mktemp("trust"))
    out = {"root": root, "model": tiny_model_dir}
    for name, extra in (("ds", ["deepspeed=recipes/deepspeed/ds_z2.json", "nproc_per_node=2", "--hub_token",
                                SECRET]),
                        ("mca", ["use_mca=true", f"hub_token={SECRET}"])):
        out[name] = os.path.join(root, name)
        proc = roll_train(*_base(tiny_model_dir, out[name], *extra), timeout=TIMEOUT)
        assert proc.returncode == 0, output_of(proc)
        out[f"{name}_log"] = proc.stdout + proc.stderr
    return out


# ---- secrets -------------------------------------------------------------------------------------

@pytest.mark.parametrize("backend", ["ds", "mca"])
def test_the_secret_is_in_no_file_and_no_log(runs, backend):
    out, log = runs[backend], runs[f"{backend}_log"]
    if backend == "ds":
        assert "launching 2 processes" in log, log[-3000:]
    assert SECRET not in log
    files = [path for path in glob.glob(os.path.join(out, "**"), recursive=True) if os.path.isfile(path)]
    assert len(files) > 10, files
    for path in files:
        with open(path, "rb") as fh:
            assert SECRET.encode() not in fh.read(), path
    assert not glob.glob(os.path.join(out, "**", "training_args.bin"), recursive=True)  # no pickle
    saved = sorted(glob.glob(os.path.join(out, "**", redact.ARGUMENTS_FILE), recursive=True))
    assert saved == [os.path.join(out, "checkpoint-2", redact.ARGUMENTS_FILE),
                     os.path.join(out, redact.ARGUMENTS_FILE)]
    for path in saved:
        with open(path, encoding="utf-8") as fh:
            arguments = json.load(fh)
        # the ranks received the secret (through the launcher's environment), and saved it redacted
        assert arguments["training"]["hub_token"] == redact.REDACTED
        assert arguments["training"]["max_steps"] == 2


# ---- planted payloads, refused before anything starts --------------------------------------------

def _case_dir(runs, name: str, source: str) -> str:
    """A copy of a run's checkpoint-2 as ``<case>/checkpoint-2`` (each case tampers with its own copy)."""
    return payloads.copy_tree(os.path.join(runs[source], "checkpoint-2"),
                              os.path.join(runs["root"], name, "checkpoint-2"))


def _model_folder(runs, name: str) -> str:
    """A Megatron-format model folder: the mca checkpoint with the run's tokenizer files beside it."""
    folder = payloads.copy_tree(os.path.join(runs["mca"], "checkpoint-2"), os.path.join(runs["root"], name))
    for tokenizer_file in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        shutil.copy(os.path.join(runs["mca"], tokenizer_file), folder)
    return folder


def _refused_in_process(argv: list[str], capsys, path: str, marker: str, tool: str = "roll-train") -> None:
    from roll.cli import main

    if tool == "roll-train":
        code = main(argv)
    else:
        from backends.mca import convert_cli

        with pytest.raises(SystemExit) as stop:
            convert_cli.main(argv)
        code = stop.value.code
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith(f"{tool}: error:")]
    assert code == 2, err
    assert len(lines) == 1 and "Traceback" not in err, err
    assert f"refusing to load {path}" in lines[0] and "trust_checkpoint_pickles: true" in lines[0], lines[0]
    assert not os.path.exists(marker), "the payload ran"


# optimizer.pt: HF's (written without DeepSpeed), planted beside DeepSpeed's files: the scan reads every pickle.
CHECKPOINT_FILES = [("ds", "global_step2/mp_rank_00_model_states.pt"),
                    ("ds", "global_step2/zero_pp_rank_1_mp_rank_00_optim_states.pt"),
                    ("ds", "rng_state_1.pth"), ("ds", "scheduler.pt"), ("ds", "optimizer.pt"),
                    ("mca", ".metadata"), ("mca", "common.pt"), ("mca", "rng/rank_0.pt")]


@pytest.mark.parametrize("source, name", CHECKPOINT_FILES)
def test_a_payload_in_a_checkpoint_is_refused_on_resume(runs, capsys, source, name):
    case = f"resume_{source}_{name.replace('/', '_')}"
    ckpt, marker = _case_dir(runs, case, source), os.path.join(runs["root"], case + ".ran")
    plant = payloads.plant_pickle if name == ".metadata" else payloads.plant_torch
    plant(os.path.join(ckpt, name), marker)
    backend = ["deepspeed=recipes/deepspeed/ds_z2.json", "nproc_per_node=2"] if source == "ds" else [
        "use_mca=true"]
    argv = _base(runs["model"], os.path.dirname(ckpt), *backend, "max_steps=3",
                 f"resume_from_checkpoint={ckpt}")
    _refused_in_process(argv, capsys, os.path.join(ckpt, name), marker)


@pytest.mark.parametrize("use", ["model_name_or_path", "ref_model", "roll-convert"])
@pytest.mark.parametrize("name", [".metadata", "common.pt"])
def test_a_payload_in_a_megatron_model_folder_is_refused(runs, capsys, use, name):
    case = f"folder_{use}_{name}"
    folder, marker = _model_folder(runs, case), os.path.join(runs["root"], case + ".ran")
    plant = payloads.plant_pickle if name == ".metadata" else payloads.plant_torch
    plant(os.path.join(folder, name), marker)
    out = os.path.join(runs["root"], case + "_out")
    if use == "roll-convert":
        argv, tool = ["mca2hf", "--input", folder, "--output", out], "roll-convert"
    elif use == "ref_model":
        argv, tool = [f"model_name_or_path={runs['model']}", "stage=dpo", f"ref_model={folder}",
                      "use_mca=true", "dataset=recipes/demo/data/arithmetic_dpo.json", f"output_dir={out}",
                      "report_to=none"], "roll-train"
    else:
        argv, tool = _base(folder, out, "use_mca=true"), "roll-train"
    _refused_in_process(argv, capsys, os.path.join(folder, name), marker, tool)


# ---- refused while ranks load; the opt-in -----------------------------------------------------

def test_a_payload_in_distcp_bytes_is_refused_while_loading(runs):
    """``.metadata`` is clean, so the pre-flight scan passes; the ``_extra_state`` bytes inside ``.distcp``
    are unpickled only by the ranks, through the mca compat patch."""
    ckpt = _case_dir(runs, "distcp", "mca")
    marker = os.path.join(runs["root"], "distcp.ran")
    entry = payloads.plant_distcp_bytes(ckpt, marker)
    proc = roll_train(*_base(runs["model"], os.path.dirname(ckpt), "use_mca=true", "max_steps=3",
                             f"resume_from_checkpoint={ckpt}"), timeout=TIMEOUT)
    lines = [line for line in proc.stderr.splitlines() if line.startswith("roll-train: error:")]
    assert proc.returncode == 2, output_of(proc)
    assert len(lines) == 1 and "Traceback" not in proc.stderr, output_of(proc)
    assert f"refusing to load {ckpt}/__0_" in lines[0] and entry in lines[0], lines[0]
    assert "trust_checkpoint_pickles" in lines[0]
    assert not os.path.exists(marker), "the payload ran"


def test_the_loads_behind_the_preflight_are_restricted_too(runs):
    """Without roll-train's pre-flight scan (a library user, a file swapped after it): DeepSpeed's
    checkpoint engine (W7), PyTorch DCP's metadata reader and megatron's common.pt reader refuse it
    themselves."""
    root = os.path.join(runs["root"], "runtime")
    ds_file = os.path.join(_case_dir(runs, "runtime", "ds"), "global_step2", "mp_rank_00_model_states.pt")
    meta_dir = _case_dir(runs, "runtime_meta", "mca")
    common_dir = _case_dir(runs, "runtime_common", "mca")
    payloads.plant_torch(ds_file, root + ".ds")
    payloads.plant_pickle(os.path.join(meta_dir, ".metadata"), root + ".meta")
    payloads.plant_torch(os.path.join(common_dir, "common.pt"), root + ".common")
    script = f"""
from backends.mca.checkpoint_reads import patch_restricted_checkpoint_reads
from backends.standard._compat import restrict_deepspeed_loads
from roll.unpickle import UntrustedPickle
restrict_deepspeed_loads()
patch_restricted_checkpoint_reads()
from deepspeed.runtime.checkpoint_engine.torch_checkpoint_engine import TorchCheckpointEngine
from megatron.core.dist_checkpointing.strategies.common import TorchCommonLoadStrategy
from torch.distributed.checkpoint import FileSystemReader
for name, load in [("ds", lambda: TorchCheckpointEngine().load({ds_file!r})),
                   ("meta", lambda: FileSystemReader({meta_dir!r}).read_metadata()),
                   ("common", lambda: TorchCommonLoadStrategy().load_common({common_dir!r}))]:
    try:
        load()
        print("LOADED", name)
    except UntrustedPickle as exc:
        print("REFUSED", name, exc)
"""
    proc = run([sys.executable, "-c", script], timeout=TIMEOUT)
    assert proc.returncode == 0, output_of(proc)
    refused = [line.split()[1] for line in proc.stdout.splitlines() if line.startswith("REFUSED")]
    assert refused == ["ds", "meta", "common"], output_of(proc)
    assert not glob.glob(root + ".*"), "a payload ran"


def test_the_opt_in_loads_a_trusted_file(runs, capsys):
    """A harmless object beyond the allow-list (a date) in DeepSpeed's model states: refused by default,
    naming what it holds; with trust_checkpoint_pickles: true the run resumes from it and trains on."""
    ckpt = _case_dir(runs, "opt_in", "ds")
    path = os.path.join(ckpt, "global_step2", "mp_rank_00_model_states.pt")
    state = torch.load(path, weights_only=False)
    state["saved_on"] = datetime.date(2026, 1, 1)
    torch.save(state, path)
    argv = _base(runs["model"], os.path.dirname(ckpt), "deepspeed=recipes/deepspeed/ds_z2.json",
                 "nproc_per_node=2", "max_steps=3", f"resume_from_checkpoint={ckpt}")
    from roll.cli import main

    assert main(argv) == 2
    assert "names datetime.date" in capsys.readouterr().err
    proc = roll_train(*argv, "trust_checkpoint_pickles=true", timeout=TIMEOUT)
    assert proc.returncode == 0, output_of(proc)
    with open(os.path.join(os.path.dirname(ckpt), "train_log.jsonl"), encoding="utf-8") as fh:
        steps = [json.loads(line)["step"] for line in fh if '"loss"' in line]
    assert steps == [3], steps  # resumed at step 2: only step 3 trained
