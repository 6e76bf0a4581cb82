"""The demo recipes (recipes/demo/tiny_*.yaml) trained a few steps on each backend, for the regression
tests (tests/recipes/test_recipe_goldens.py) and for regenerating their goldens (scripts/update_goldens.py).

Each recipe runs as written except for what makes it a short, fast, deterministic CPU run: the tiny
BPE model built by ``roll.demo.tiny_model.make_tiny_model`` (the same one the tests' ``tiny_model_factory`` builds;
tiny_dpo's and tiny_rm's model_name_or_path, the SFT demo's output, is replaced too), ``STEPS`` steps, a log line every
step, nothing saved. The standard backend runs in this process (roll.router.run, the production path);
the mca backend in one 1-process torchrun job that trains every recipe (one interpreter, one Megatron import).
"""

from __future__ import annotations

import json
import os
import sys

from tests.helpers import REPO, output_of, torchrun

RECIPES = ("tiny_pt", "tiny_sft", "tiny_dpo", "tiny_kto", "tiny_lora", "tiny_orpo", "tiny_simpo", "tiny_rm")
VL_RECIPES = ("tiny_vl_sft",)
"""Vision-language demo recipes: the tiny Qwen2.5-VL and the generated shapes data (roll.demo.tiny_vl,
roll.demo.vl_data; ``make_vl_demo``) instead of the tiny text model and the recipe's dataset (docs/vl.md)."""
BACKENDS = ("standard", "mca")
STEPS = 5
GOLDENS = os.path.join(REPO, "tests", "recipes", "goldens.json")
WORKER = os.path.join(REPO, "tests", "distributed", "_mca_workers", "train_runs.py")


def recipe_path(name: str) -> str:
    return os.path.join(REPO, "recipes", "demo", f"{name}.yaml")


def recipe_args(name: str, model_dir: str, output_dir: str, dataset: str | None = None) -> list[str]:
    """roll-train's command line for one short run of the recipe (without --use-mca); ``dataset`` replaces the
    recipe's."""
    import yaml

    if dataset is None:
        with open(recipe_path(name), encoding="utf-8") as fh:
            dataset = os.path.join(REPO, yaml.safe_load(fh)["dataset"])
    return [recipe_path(name), f"model_name_or_path={model_dir}", f"output_dir={output_dir}",
            f"dataset={dataset}", f"max_steps={STEPS}", "logging_steps=1",
            "save_strategy=no", "save_hf_model=false", "report_to=none", "disable_tqdm=true"]


def losses_of(log_history: list[dict]) -> list[float]:
    return [entry["loss"] for entry in log_history if "loss" in entry]


def run_standard(name: str, model_dir: str, output_dir: str) -> list[float]:
    """The recipe on the standard backend, in this process; its per-step losses."""
    from roll import router
    from roll.config.parser import parse_args

    _, config = parse_args(recipe_args(name, model_dir, output_dir))
    return losses_of(router.run(config).log_history)


def make_vl_demo(root: str) -> tuple[str, str]:
    """(model dir, dataset file) of the VL demo, built under ``root`` (as scripts/make_tiny_vl_demo.py does)."""
    from roll.demo.tiny_vl import make_tiny_vl_model
    from roll.demo.vl_data import make_shapes_dataset

    return (make_tiny_vl_model(os.path.join(root, "tiny_vl_model")),
            make_shapes_dataset(os.path.join(root, "tiny_vl_data")))


def run_vl_standard(name: str, model_dir: str, dataset: str, output_dir: str) -> list[float]:
    """A VL recipe on the standard backend, in this process, on the generated dataset; its per-step losses."""
    from roll import router
    from roll.config.parser import parse_args

    _, config = parse_args(recipe_args(name, model_dir, output_dir, dataset))
    return losses_of(router.run(config).log_history)


def run_mca(names: tuple[str, ...], model_dir: str, root: str, vl_demo: tuple[str, str] | None = None,
            timeout: float = 600) -> dict[str, list[float]]:
    """Every recipe in ``names`` with --use-mca, in one 1-process torchrun job; {name: losses}.
    Run ``name`` writes to ROOT/name/mca; a VL recipe trains ``vl_demo`` (model dir, dataset: make_vl_demo)."""
    spec, result = os.path.join(root, "mca_spec.json"), os.path.join(root, "mca_result.json")
    runs = []
    for name in names:
        model, dataset = vl_demo if name in VL_RECIPES else (model_dir, None)
        runs.append({"name": name,
                     "args": recipe_args(name, model, os.path.join(root, name, "mca"), dataset) + ["--use-mca"]})
    with open(spec, "w", encoding="utf-8") as fh:
        json.dump({"runs": runs}, fh)
    proc = torchrun(WORKER, spec, result, nproc=1, timeout=timeout)
    if proc.returncode != 0:
        raise RuntimeError("the mca recipe runs failed:\n" + output_of(proc))
    with open(result, encoding="utf-8") as fh:
        return {name: run["losses"] for name, run in json.load(fh).items()}


def run_all(model_dir: str, root: str) -> dict[str, dict[str, list[float]]]:
    """{recipe: {backend: losses}} for every demo recipe (RECIPES and VL_RECIPES) on both backends."""
    losses = {name: {"standard": run_standard(name, model_dir, os.path.join(root, name, "standard"))}
              for name in RECIPES}
    vl_demo = make_vl_demo(root)
    for name in VL_RECIPES:
        losses[name] = {"standard": run_vl_standard(name, *vl_demo, os.path.join(root, name, "standard"))}
    for name, values in run_mca(RECIPES + VL_RECIPES, model_dir, root, vl_demo).items():
        losses[name]["mca"] = values
    return losses


def read_goldens() -> dict:
    with open(GOLDENS, encoding="utf-8") as fh:
        return json.load(fh)


def describe_environment() -> dict[str, str]:
    """What produced a set of goldens (stored next to them, shown when they do not match): library versions,
    the commit (``-dirty`` with uncommitted changes), the date."""
    import datetime
    import platform
    import subprocess
    from importlib.metadata import PackageNotFoundError, version

    import torch

    def installed(package: str) -> str:
        try:
            return version(package)
        except PackageNotFoundError:
            return "not installed"

    def git(*args: str) -> str:
        return subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True, timeout=30).stdout.strip()

    commit = git("rev-parse", "--short", "HEAD") + ("-dirty" if git("status", "--porcelain", "--untracked-files=no")
                                                    else "")
    return {"torch": torch.__version__, **{name: installed(name) for name in ("transformers", "trl", "peft",
                                                                            "megatron-core")},
            "python": sys.version.split()[0], "machine": platform.machine(),
            "torch_threads": str(torch.get_num_threads()), "commit": commit,
            "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d")}
