"""A catalogue of user mistakes: each case is a real ``roll-train`` process that must end with exit code 2
(``EXIT_USAGE``), one ``roll-train: error:`` line holding a phrase that says what to change, no traceback, and
the files that were already in output_dir unchanged.

The cases cover the recipe, the command line, the data, the model directory, a checkpoint to resume from, the
parallel layout and output_dir. Most fail in roll-train's own process before anything is launched (config
validation, ``roll.preflight``); the data cases fail while the data is prepared; three more fail inside
launched ranks (torchrun, the DeepSpeed launcher, Megatron at TP2), so the ranks' report path is covered too.
The tiny models, data and one real trained run are built once per module; the cases then run two at a time.
Most cost about 0.3 s of CPU: what the recipe and the files it names can tell is found before roll-train imports
transformers or torch (``roll.preflight``; tests/unit/test_startup.py checks the imports); those found while the
data is prepared, the weights loaded or by Megatron's templates pay those imports (2 to 7 s each).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Callable

import pytest

from roll import lock
from tests.helpers import output_of, roll_train

SFT_ROWS = [{"instruction": f"What is {a} plus {b}?", "input": "", "output": f"{a} plus {b} equals {a + b}."}
            for a in range(4) for b in range(4)]
PAIR_ROWS = [{"prompt": "What is 1 plus 1?", "chosen": "Two.", "rejected": "Three."}] * 4


@dataclass
class World:
    """Everything the cases point at, built once."""

    root: str
    model: str
    moe: str
    trained: str
    """output_dir of a finished standard run: final model, checkpoint-1 and -2 (per-device batch 2)."""

    def path(self, *parts: str) -> str:
        return os.path.join(self.root, *parts)

    def base(self, out: str, *extra: str) -> list[str]:
        """A valid sft run of one step (every case changes one thing)."""
        return [f"model_name_or_path={self.model}", "stage=sft", f"dataset={self.path('sft.json')}",
                f"output_dir={out}", "max_steps=1", "cutoff_len=64", "per_device_train_batch_size=2",
                "report_to=none", "save_strategy=no", *extra]


def _write(path: str, text: str) -> str:
    with open(path, "w", encoding="utf-8") as fh:
        fh.write(text)
    return path


def _model_copy(world_root: str, model: str, name: str, edit: Callable[[str], None]) -> str:
    out = os.path.join(world_root, name)
    shutil.copytree(model, out)
    edit(out)
    return out


def _edit_json(path: str, **changes) -> None:
    with open(path, encoding="utf-8") as fh:
        data = json.load(fh)
    for key, value in changes.items():
        if value is None:
            data.pop(key, None)
        else:
            data[key] = value
    _write(path, json.dumps(data))


def _truncate(model_dir: str) -> None:
    weights = os.path.join(model_dir, "model.safetensors")
    with open(weights, "r+b") as fh:
        fh.truncate(os.path.getsize(weights) // 2)


def _drop_tokenizer(model_dir: str) -> None:
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        os.remove(os.path.join(model_dir, name))


def _make_adapter_dir(out: str, base: str) -> None:
    """What a LoRA run leaves in output_dir: adapter config and weights, tokenizer files, no model."""
    import torch
    from safetensors.torch import save_file

    os.makedirs(out)
    _write(os.path.join(out, "adapter_config.json"), json.dumps(
        {"peft_type": "LORA", "base_model_name_or_path": base, "r": 4, "target_modules": ["q_proj"]}))
    save_file({"base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight": torch.zeros(4, 64)},
              os.path.join(out, "adapter_model.safetensors"))
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        shutil.copy(os.path.join(base, name), out)


def _drop_chat_template(model_dir: str) -> None:
    os.remove(os.path.join(model_dir, "chat_template.jinja"))
    _edit_json(os.path.join(model_dir, "tokenizer_config.json"), chat_template=None)


@pytest.fixture(scope="module")
def world(tmp_path_factory, tiny_model_factory) -> World:
    root = str(tmp_path_factory.mktemp("bad_inputs"))
    model = tiny_model_factory("qwen2")
    w = World(root=root, model=model, moe=tiny_model_factory("qwen2_moe"),
              trained=os.path.join(root, "trained"))
    _write(w.path("sft.json"), json.dumps(SFT_ROWS))
    _write(w.path("pairs.json"), json.dumps(PAIR_ROWS))
    _write(w.path("bad.jsonl"), json.dumps(SFT_ROWS[0]) + '\n{"instruction": "What is 1 plus 2?", "output\n')
    _write(w.path("empty.jsonl"), "")
    deep = "[" * 10**5 + "]" * 10**5  # Python's json: RecursionError; pyarrow's reader: a segfault
    _write(w.path("deep.jsonl"), '{"instruction": "Hi", "output": "Yo.", "x": ' + deep + "}\n")
    _write(w.path("no_answers.json"), json.dumps([{**row, "output": ""} for row in SFT_ROWS]))
    _write(w.path("rows.xml"), "<rows/>")
    _write(w.path("list.yaml"), "- stage: sft\n")
    _write(w.path("broken.yaml"), "stage: sft\n  learning_rate: [1e-4\n")
    _write(w.path("typo.yaml"), "stage: sft\nlearning_rat: 1.0e-4\n")
    os.makedirs(w.path("weights_only"))
    shutil.copy(os.path.join(model, "model.safetensors"), w.path("weights_only"))
    _model_copy(root, model, "truncated", _truncate)
    _model_copy(root, model, "remote_code", lambda d: _edit_json(
        os.path.join(d, "config.json"), model_type="acme_lm", architectures=["AcmeForCausalLM"],
        auto_map={"AutoConfig": "configuration_acme.AcmeConfig",
                  "AutoModelForCausalLM": "modeling_acme.AcmeForCausalLM"}))
    _model_copy(root, model, "unknown_arch", lambda d: _edit_json(
        os.path.join(d, "config.json"), model_type="acme_lm", architectures=["AcmeForCausalLM"]))
    _model_copy(root, model, "gpt2_arch", lambda d: _edit_json(
        os.path.join(d, "config.json"), model_type="gpt2", architectures=["GPT2LMHeadModel"]))
    _model_copy(root, model, "no_template", _drop_chat_template)
    _model_copy(root, model, "deep_config",
                lambda d: _write(os.path.join(d, "config.json"), '{"x": ' + deep + "}"))
    _model_copy(root, model, "bert_config", lambda d: _edit_json(os.path.join(d, "config.json"), model_type="bert"))
    _model_copy(root, model, "qwen3_config", lambda d: _edit_json(  # qwen2 weights: q/k/v biases, no q/k norms
        os.path.join(d, "config.json"), model_type="qwen3", architectures=["Qwen3ForCausalLM"], head_dim=16))
    _model_copy(root, model, "other_vocab", lambda d: _edit_json(os.path.join(d, "config.json"), vocab_size=640))
    _model_copy(root, model, "no_tokenizer", _drop_tokenizer)
    _make_adapter_dir(w.path("adapter"), base=model)
    _write(w.path("a_file"), "not a directory\n")
    # One real run, so the checkpoint cases resume from what roll writes (not a hand-made imitation).
    proc = roll_train(*w.base(w.trained, "max_steps=2", "save_strategy=steps", "save_steps=1"), timeout=300)
    assert proc.returncode == 0, output_of(proc)
    assert os.path.isdir(os.path.join(w.trained, "checkpoint-2")), os.listdir(w.trained)
    return w


def _cpu_count() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def _machine_size() -> int:
    """What roll.preflight.check_machine compares nproc_per_node with on this machine."""
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else _cpu_count()


# id -> (argv builder(world, output_dir), phrase the error line must hold). Phrases are what a user must read
# to fix the mistake: the key to change, or the file and row at fault.
Build = Callable[[World, str], list[str]]


def _with(*extra: str) -> Build:
    """The base run with ``extra`` appended (a ``{name}`` in a value is the world's file or directory)."""
    return lambda w, o: w.base(o, *[arg.format(**_places(w)) for arg in extra])


def _places(w: World) -> dict[str, str]:
    names = ("typo.yaml", "list.yaml", "broken.yaml", "bad.jsonl", "empty.jsonl", "deep.jsonl", "rows.xml",
             "pairs.json", "no_answers.json", "weights_only", "truncated", "remote_code", "unknown_arch",
             "gpt2_arch", "no_template", "deep_config", "bert_config", "qwen3_config", "other_vocab",
             "no_tokenizer", "adapter", "a_file")
    places = {name.replace(".", "_"): w.path(name) for name in names}
    return {**places, "moe": w.moe, "model": w.model, "root": w.root,
            "ckpt": os.path.join(w.trained, "checkpoint-2"),
            "missing": w.path("no_such_thing")}


def _recipe(name: str) -> Build:
    return lambda w, o: [w.path(name), *w.base(o)]


RESUME = "resume_from_checkpoint={ckpt}"
MCA = "--use-mca"
CASES: dict[str, tuple[Build, str]] = {
    # ---- recipe ----
    "recipe-unknown-key": (_recipe("typo.yaml"), "did you mean 'learning_rate'"),
    "recipe-missing-file": (_recipe("nope.yaml"), "does not exist"),
    "recipe-invalid-yaml": (_recipe("broken.yaml"), "is not valid YAML"),
    "recipe-not-a-mapping": (_recipe("list.yaml"), "must be a mapping of key: value"),
    "recipe-wrong-type": (_with("per_device_train_batch_size=two"), "'per_device_train_batch_size' takes"),
    "recipe-bad-choice": (_with("stage=rlhf"),
                          "'stage' (from the command line): 'rlhf' is not one of pt, sft, dpo"),
    "recipe-missing-dataset": (lambda w, o: [a for a in w.base(o) if not a.startswith("dataset=")],
                               "set `dataset:`"),
    "recipe-two-precisions": (_with("bf16=true", "fp16=true"), "choose one precision"),
    "recipe-deepspeed-file-missing": (_with("deepspeed=ds_nope.json"), "drop the 'deepspeed' key"),
    "recipe-max-steps-zero": (_with("max_steps=0"), "max_steps must be a positive step count"),
    "recipe-zero-epochs": (_with("max_steps=-1", "num_train_epochs=0"), "num_train_epochs must be > 0"),
    "recipe-negative-learning-rate": (_with("learning_rate=-1e-4"), "learning_rate must be >= 0"),
    "recipe-zero-logging-steps": (_with("logging_steps=0"), "logging_steps must be > 0"),
    "recipe-zero-save-steps": (_with("save_strategy=steps", "save_steps=0"), "save_steps must be > 0"),
    "recipe-unknown-lr-scheduler": (_with("lr_scheduler_type=bogus"), "is not a learning-rate schedule"),
    "recipe-evaluation-without-an-eval-set": (_with("eval_strategy=steps", "eval_steps=1"),
                                              "needs an evaluation set"),
    "recipe-dtype-contradicts-precision": (_with("dtype=float16", "bf16=true"),
                                           "dtype=float16 contradicts bf16=true"),
    # ---- command line ----
    "cli-unknown-key": (_with("--lerning_rate", "1e-4"), "did you mean 'learning_rate'"),
    "cli-unknown-switch": (_with("--frobnicate"), "unknown key 'frobnicate'"),
    "cli-option-without-value": (_with("--output_dir"), "needs a value"),
    "cli-two-recipes": (lambda w, o: [w.path("typo.yaml"), w.path("list.yaml"), *w.base(o)], "pass one"),
    "cli-node-rank-out-of-range": (_with("nnodes=2", "node_rank=2", "master_addr=127.0.0.1"),
                                   "node_rank must be in 0..nnodes-1"),
    # ---- data ----
    "data-missing-file": (_with("dataset={missing}"), "not found"),
    "data-malformed-row": (_with("dataset={bad_jsonl}"), "bad.jsonl: invalid JSON on line 2"),
    "data-empty-file": (_with("dataset={empty_jsonl}"), "empty.jsonl is empty"),
    "data-nested-too-deep": (_with("dataset={deep_jsonl}"), "deep.jsonl: JSON nested more than 64 levels"),
    "data-global-batch-larger-than-dataset": (_with("per_device_train_batch_size=1000000"),
                                              "has 16 rows: not one full step"),
    "data-global-batch-larger-than-dataset-mca": (_with("per_device_train_batch_size=1000000", MCA),
                                                  "per_device_train_batch_size 1000000"),
    "data-empty-after-filtering": (_with("dataset={no_answers_json}"), "empty_reply=16); fix the rows"),
    "data-unsupported-file-type": (_with("dataset={rows_xml}"), "unsupported file type"),
    "data-wrong-format-for-stage": (_with("dataset={pairs_json}"), "cannot be used for stage sft"),
    "data-cutoff-shorter-than-every-prompt": (_with("cutoff_len=4"), "raise cutoff_len"),
    "data-val-size-larger-than-dataset": (_with("val_size=100"), "val_size=100.0 leaves no training"),
    # ---- model directory ----
    "model-missing": (_with("model_name_or_path={missing}"), "does not exist"),
    "model-no-config-json": (_with("model_name_or_path={weights_only}"), "has no config.json"),
    "model-truncated-safetensors": (_with("model_name_or_path={truncated}"),
                                    "model.safetensors is truncated"),
    "model-needs-remote-code": (_with("model_name_or_path={remote_code}"),
                                "set trust_remote_code: true if you trust this code"),
    "model-unknown-architecture": (_with("model_name_or_path={unknown_arch}"), "model_type 'acme_lm'"),
    "model-no-mca-template": (_with("model_name_or_path={gpt2_arch}", MCA),
                              "'gpt2' has no Megatron conversion template"),
    "model-dpo-reference-missing": (_with("stage=dpo", "dataset={pairs_json}", "ref_model={missing}"),
                                    "ref_model="),
    "model-config-nested-too-deep": (_with("model_name_or_path={deep_config}"),
                                     "config.json nests arrays/objects too deep to read"),
    "model-tokenizer-without-chat-template": (_with("model_name_or_path={no_template}"),
                                              "Set template: to one of"),
    "model-without-tokenizer-files": (_with("model_name_or_path={no_tokenizer}"), "has no tokenizer files"),
    "model-adapter-directory-as-model": (_with("model_name_or_path={adapter}"),
                                         "is a LoRA adapter directory"),
    "model-dpo-reference-with-another-vocabulary": (
        _with("stage=dpo", "dataset={pairs_json}", "ref_model={other_vocab}"), "has vocab_size 640"),
    # a Qwen2 checkpoint whose config.json names another architecture: weights do not load, on both backends
    "model-config-of-another-architecture": (_with("model_name_or_path={bert_config}"),
                                             "none of the checkpoint's tensors is used"),
    "model-config-of-another-architecture-mca": (_with("model_name_or_path={bert_config}", MCA),
                                                 "config.json's model_type is wrong"),
    "model-config-of-another-family": (_with("model_name_or_path={qwen3_config}"),
                                       "6 checkpoint tensor(s) are not used by the model"),
    "model-config-of-another-family-mca": (_with("model_name_or_path={qwen3_config}", MCA),
                                           "4 weight(s) of the model are not in the checkpoint"),
    # ---- checkpoint ----
    "resume-path-missing": (_with("resume_from_checkpoint={missing}"), "is not a checkpoint directory"),
    "resume-true-without-checkpoint": (_with("resume_from_checkpoint=true"), "holds no checkpoint-N"),
    "resume-from-another-model": (_with("model_name_or_path={moe}", RESUME), "is of another model"),
    "resume-changed-global-batch": (_with("per_device_train_batch_size=4", RESUME),
                                    "global batch of 2 samples"),
    "resume-changed-gradient-accumulation": (_with("gradient_accumulation_steps=2", RESUME),
                                             "global batch of 2 samples per step (or micro-step), this run "
                                             "uses 4"),
    "resume-full-checkpoint-as-lora": (_with("finetuning_type=lora", RESUME),
                                       "resume with the finetuning_type it was saved with"),
    "resume-standard-checkpoint-with-mca": (_with(MCA, RESUME), "Resume with the backend that wrote it"),
    # ---- parallel layout ----
    "layout-product-not-world-size": (_with(MCA, "nproc_per_node=2", "tensor_model_parallel_size=4"),
                                      "tp(4) * pp(1) * cp(1) * dp(?) != world_size(2)"),
    "layout-heads-not-divisible-by-tp": (_with(MCA, "nproc_per_node=3", "tensor_model_parallel_size=3"),
                                         "Set tensor_model_parallel_size to one of 1, 2, 4"),
    "layout-layers-not-divisible-by-pp-vpp": (
        _with(MCA, "nproc_per_node=2", "pipeline_model_parallel_size=2",
              "virtual_pipeline_model_parallel_size=2", "gradient_accumulation_steps=2"),
        "num_layers(2) is not divisible by pp(2) * vpp(2)"),
    "layout-ep-not-dividing-experts": (
        _with("model_name_or_path={moe}", MCA, "nproc_per_node=3", "expert_model_parallel_size=3"),
        "Set expert_model_parallel_size to one of 1, 2, 4"),
    "layout-more-pipeline-stages-than-layers": (_with(MCA, "nproc_per_node=4", "pipeline_model_parallel_size=4"),
                                                "num_layers(2) is not divisible by pp(4)"),
    "layout-ep-larger-than-the-experts": (
        _with("model_name_or_path={moe}", MCA, "nproc_per_node=8", "expert_model_parallel_size=8"),
        "expert_model_parallel_size"),
    "layout-more-processes-than-the-machine": (_with(f"nproc_per_node={_machine_size() + 1}"),
                                               f"Set nproc_per_node to at most {_machine_size()}"),
    # ---- output_dir ----
    "output-dir-holds-a-trained-model": (_with(), "overwrite_output_dir: true"),
    "output-dir-holds-checkpoints": (_with(), "resume_from_checkpoint: true"),
    "output-dir-empty": (_with("output_dir="), "output_dir is empty or null"),
    "output-dir-tilde-alone": (_with("output_dir=~"), "a lone ~ as null"),
    "output-dir-home": (_with("output_dir=~/"), "is your home directory itself"),
    "output-dir-root": (_with("output_dir=/"), "is a system directory (/)"),
    "output-dir-system": (_with("output_dir=/usr/lib"), "is a system directory (/usr/lib)"),
    "output-dir-is-the-model-folder": (_with("output_dir={model}"), "is the folder of model_name_or_path"),
    "output-dir-is-the-dataset-folder": (_with("output_dir={root}"), "is the folder of dataset"),
    "output-dir-holds-other-files": (_with(), "no roll run wrote it (notes.txt)"),
    "output-dir-holds-another-recipe": (_with(), "holds a run of another recipe (model_name_or_path"),
    "output-dir-linked-checkpoint": (_with("resume_from_checkpoint=true"), "checkpoint-2 is a symbolic link"),
    "output-dir-is-a-file": (_with("output_dir={a_file}"), "is a file, not a directory"),
    "output-dir-under-a-file": (_with("output_dir={a_file}/out"), "cannot be created"),
    "output-dir-in-use-by-a-live-run": (_with(), f"is in use by another run: PID {os.getpid()}"),
}

_FILLED_OUTPUT_DIRS = {"output-dir-holds-a-trained-model": None,
                       "output-dir-holds-checkpoints": "checkpoint-1"}
"""Cases whose output_dir starts as a copy of the trained run (all of it, or only this checkpoint)."""


def _prepare_output_dir(world: World, case: str, out: str) -> None:
    if case not in _FILLED_OUTPUT_DIRS:
        os.makedirs(out)
        _write(os.path.join(out, "train_log.jsonl"), '{"step": 1, "loss": 5.0}\n')  # a crashed run's log
        if case == "output-dir-holds-other-files":
            _write(os.path.join(out, "notes.txt"), "the user's notes\n")
        if case == "output-dir-holds-another-recipe":  # what roll.outputs.write_marker writes
            identity = {"stage": "sft", "finetuning_type": "full", "model_name_or_path": world.moe}
            _write(os.path.join(out, ".roll_run.json"), json.dumps({"written_by": "roll-train",
                                                                    "identity": identity}))
        if case == "output-dir-linked-checkpoint":
            os.symlink(os.path.join(world.trained, "checkpoint-2"), os.path.join(out, "checkpoint-2"))
        return
    only = _FILLED_OUTPUT_DIRS[case]
    if only is None:
        shutil.copytree(world.trained, out)
    else:
        os.makedirs(out)
        shutil.copytree(os.path.join(world.trained, only), os.path.join(out, only))


def _snapshot(folder: str) -> dict[str, str]:
    found = {}
    for dirpath, _, files in os.walk(folder):
        for name in files:
            path = os.path.join(dirpath, name)
            with open(path, "rb") as fh:
                found[os.path.relpath(path, folder)] = hashlib.sha256(fh.read()).hexdigest()
    return found


def _assert_clean_mistake(proc, phrase: str, code: int = 2) -> None:
    out = output_of(proc)
    assert proc.returncode == code, out
    assert "Traceback" not in proc.stderr and "Traceback" not in proc.stdout, out
    errors = [line for line in proc.stderr.splitlines() if line.startswith("roll-train: error: ")]
    assert len(errors) == 1, out
    assert phrase.lower() in errors[0].lower(), f"expected {phrase!r} in: {errors[0]}"


def test_the_catalogue_has_at_least_30_distinct_mistakes():
    assert len(CASES) >= 30
    assert len({phrase for _, phrase in CASES.values()}) >= 25  # not one message for everything


@dataclass
class Outcome:
    proc: subprocess.CompletedProcess
    before: dict[str, str]
    """output_dir's files (path -> sha256) before the run."""
    after: dict[str, str]


_CASE_TEST = "test_bad_input_exits_2_with_a_message_and_loses_nothing"
_LOCKED = "output-dir-in-use-by-a-live-run"
_WORKERS = 2


@pytest.fixture(scope="module")
def outcomes(world, request, tmp_path_factory) -> dict[str, Outcome]:
    """Every selected case's run, two at a time (each is one mostly single-threaded process)."""
    selected = sorted({item.callspec.params["case"] for item in request.session.items
                       if getattr(item, "originalname", "") == _CASE_TEST and hasattr(item, "callspec")})
    root = str(tmp_path_factory.mktemp("cases"))

    def run(case: str) -> Outcome:
        out = os.path.join(root, case, "out")
        _prepare_output_dir(world, case, out)
        held = lock.acquire(out) if case == _LOCKED else None  # this test process plays the live run
        try:
            before = _snapshot(out)
            proc = roll_train(*CASES[case][0](world, out), timeout=180)
            return Outcome(proc, before, _snapshot(out))
        finally:
            if held is not None:
                held.release()

    with ThreadPoolExecutor(max_workers=_WORKERS) as pool:
        return dict(zip(selected, pool.map(run, selected)))


@pytest.mark.parametrize("case", sorted(CASES))
def test_bad_input_exits_2_with_a_message_and_loses_nothing(case, outcomes):
    outcome = outcomes[case]
    _assert_clean_mistake(outcome.proc, CASES[case][1])
    assert outcome.after == outcome.before, "output_dir changed"


@pytest.mark.parametrize("launcher", [
    pytest.param([], id="torchrun"),
    pytest.param(["deepspeed=recipes/deepspeed/ds_z2.json"], id="deepspeed-launcher"),
    pytest.param([MCA, "tensor_model_parallel_size=2"], id="torchrun-megatron-tp2"),
])
def test_a_mistake_found_inside_launched_ranks_is_reported_once(world, tmp_path, launcher):
    """A data row that only the ranks read (after Megatron's set-up on the mca backend): the ranks fail,
    roll-train shows their message once, with exit code 2 and no launcher traceback."""
    out = str(tmp_path / "out")
    _prepare_output_dir(world, "launched", out)
    before = _snapshot(out)
    args = world.base(out, f"dataset={world.path('bad.jsonl')}", "nproc_per_node=2", *launcher)
    proc = roll_train(*args, timeout=240)
    _assert_clean_mistake(proc, "bad.jsonl: invalid JSON on line 2")
    assert _snapshot(out) == before, "output_dir changed"


def test_overwrite_output_dir_replaces_a_trained_run(world, tmp_path):
    """The way out the message names works: overwrite_output_dir trains afresh and deletes old checkpoints
    (so resume_from_checkpoint: true cannot later pick the earlier run's)."""
    out = str(tmp_path / "out")
    shutil.copytree(world.trained, out)
    proc = roll_train(*world.base(out, "overwrite_output_dir=true"), timeout=300)
    assert proc.returncode == 0, output_of(proc)
    assert not [name for name in os.listdir(out) if name.startswith("checkpoint-")], os.listdir(out)
    assert os.path.isfile(os.path.join(out, "model.safetensors"))
