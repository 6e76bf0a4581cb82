"""The router drives a backend through the Backend interface (a fake backend, tests only)."""

from __future__ import annotations

import gc
import sys

import pytest
import yaml

from backends.base import Backend
from roll import registry, router
from roll.config import parse_args
from roll.contract import DistributedInfo, ModelBundle, TrainJob, TrainResult
from roll.data.policy import PaddingPolicy
from tests.helpers import REPO, output_of, run


class FakeBackend(Backend):
    supported_stages = frozenset({"pt", "sft", "dpo", "kto"})
    supported_finetuning_types = frozenset({"full"})

    def __init__(self, config):
        super().__init__(config)
        self.calls: list[str] = []
        FakeBackend.last = self

    def setup_distributed(self):
        self.calls.append("setup_distributed")
        return DistributedInfo()

    def padding_policy(self, stage):
        self.calls.append(f"padding_policy:{stage}")
        return PaddingPolicy(pad_to_multiple_of=4)

    def load_models(self, stage, tokenizer):
        self.calls.append("load_models")
        return ModelBundle(policy="model")

    def apply_finetuning(self, models):
        self.calls.append("apply_finetuning")
        return models

    def train(self, job, models):
        self.calls.append(f"train:{job.stage}")
        self.frozen_while_training = gc.get_freeze_count()
        return TrainResult(log_history=[{"loss": 1.0}])

    def evaluate(self, job, models):
        self.calls.append("evaluate")
        return {"eval_loss": 0.5}

    def save(self, models, tokenizer, output_dir):
        self.calls.append("save")
        return output_dir

    def teardown(self):
        self.calls.append("teardown")


@pytest.fixture
def fake_backend(monkeypatch):
    seen = {}

    def fake_build_job(config, policy):
        seen["policy"] = policy
        spec = router.STAGES[config.finetuning.stage]
        seen["spec"] = spec
        return TrainJob(stage=config.finetuning.stage, tokenizer=None, train_dataset=[{}] * 64, collator=list,
                        eval_dataset=seen.get("eval_dataset")), None

    monkeypatch.setattr(router, "build_job", fake_build_job)
    monkeypatch.setattr(router, "get_backend_class", lambda name: FakeBackend)
    return seen


def test_the_backend_trains_with_the_start_ups_objects_frozen(tmp_path, fake_backend):
    """roll.gc_pause around Backend.train: the objects alive at its start (imports, the model) are out of the
    garbage collector's passes while it trains, and handed back after it (freeze count 0)."""
    recipe = tmp_path / "r.yaml"
    recipe.write_text(yaml.safe_dump({"stage": "sft", "output_dir": str(tmp_path / "out")}))
    router.run(parse_args([str(recipe)])[1])
    assert FakeBackend.last.frozen_while_training > 1000 and gc.get_freeze_count() == 0


@pytest.mark.parametrize("stage", ["pt", "sft", "dpo", "kto"])
def test_router_calls_backend_in_order(tmp_path, fake_backend, stage):
    recipe = tmp_path / "r.yaml"
    recipe.write_text(yaml.safe_dump({"stage": stage, "output_dir": str(tmp_path / "out")}))
    _, config = parse_args([str(recipe)])
    result = router.run(config)
    assert FakeBackend.last.calls == [f"padding_policy:{stage}", "setup_distributed", "load_models",
                                      "apply_finetuning", f"train:{stage}", "save", "teardown"]
    assert result.hf_model_dir == str(tmp_path / "out")
    assert fake_backend["policy"].pad_to_multiple_of == 4  # the backend's policy reaches the data side
    assert fake_backend["spec"] is router.STAGES[stage]


def test_router_evaluates_when_there_is_an_eval_set(tmp_path, fake_backend):
    fake_backend["eval_dataset"] = [{"input_ids": [1, 2]}]
    recipe = tmp_path / "r.yaml"
    recipe.write_text(yaml.safe_dump({"stage": "sft", "output_dir": str(tmp_path / "out")}))
    _, config = parse_args([str(recipe)])
    result = router.run(config)
    assert FakeBackend.last.calls == ["padding_policy:sft", "setup_distributed", "load_models", "apply_finetuning",
                                      "train:sft", "evaluate", "save", "teardown"]
    assert result.metrics == {"eval_loss": 0.5}


def test_teardown_runs_when_setup_fails(tmp_path, fake_backend, monkeypatch):
    def fail(self):
        self.calls.append("setup_distributed")
        raise RuntimeError("no process group")

    monkeypatch.setattr(FakeBackend, "setup_distributed", fail)
    recipe = tmp_path / "r.yaml"
    recipe.write_text("stage: sft\n")
    _, config = parse_args([str(recipe)])
    with pytest.raises(RuntimeError, match="no process group"):
        router.run(config)
    assert FakeBackend.last.calls[-2:] == ["setup_distributed", "teardown"]


def test_teardown_runs_when_training_fails(tmp_path, fake_backend, monkeypatch):
    monkeypatch.setattr(FakeBackend, "train", lambda self, job, models: (_ for _ in ()).throw(RuntimeError("boom")))
    recipe = tmp_path / "r.yaml"
    recipe.write_text("stage: sft\n")
    _, config = parse_args([str(recipe)])
    with pytest.raises(RuntimeError, match="boom"):
        router.run(config)
    assert FakeBackend.last.calls[-1] == "teardown"


def test_stage_table_covers_every_stage():
    from roll.config.finetuning import FinetuningArguments
    import typing

    stages = typing.get_args(typing.get_type_hints(FinetuningArguments)["stage"])
    assert set(router.STAGES) == set(stages)


def test_registry_refuses_duplicates_and_finds_backends_lazily():
    registry.get_backend_class("standard")
    decorator = registry.register_backend("standard")
    with pytest.raises(ValueError, match="already registered"):
        decorator(type("Other", (), {}))
    with pytest.raises(ValueError, match="already registered"):  # same class name, another module
        decorator(type("StandardBackend", (), {"__module__": "someone_elses.plugin"}))
    assert {"standard", "mca"} <= set(registry.available_backends())
    assert registry.get_backend_class("mca").name == "mca"
    # lazily: resolving a standard-backend recipe imports that backend only, never the Megatron one
    probe = ("import sys; from roll.config import parse_args; parse_args(['recipes/qwen_sft.yaml']); "
             "print(sorted(m for m in sys.modules if m.startswith(('backends.mca', 'megatron'))))")
    proc = run([sys.executable, "-c", probe], timeout=120)
    assert proc.returncode == 0 and proc.stdout.strip() == "[]", output_of(proc)


def test_unknown_backend_is_a_config_error():
    from roll.errors import ConfigError

    with pytest.raises(ConfigError, match="unknown backend 'nope'"):
        registry.get_backend_class("nope")


def test_roll_never_imports_backends():
    import ast
    import pathlib

    paths = list(pathlib.Path(REPO, "roll").rglob("*.py"))  # the repo's, whatever the working directory
    assert len(paths) > 20, paths
    for path in paths:
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            names = []
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module]
            assert not any(n == "backends" or n.startswith("backends.") for n in names), f"{path} imports backends"
