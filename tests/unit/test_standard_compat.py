"""The standard backend's workarounds (backends/standard/_compat.py) that a unit test can hold."""

from __future__ import annotations

import sys

import pytest

from tests.helpers import run

_AFTER_A_RUN = """
from backends.standard._compat import install_clean_exit
install_clean_exit()  # what teardown does after a successful run
{then}
"""


@pytest.mark.parametrize("then,code", [("pass", 0), ("raise RuntimeError('later step failed')", 1)])
def test_clean_exit_keeps_a_later_failure(then, code):
    """W2: a launched worker ends with os._exit after the run, but an exception after it still exits 1."""
    proc = run([sys.executable, "-c", _AFTER_A_RUN.format(then=then)], timeout=120, ROLL_LAUNCHED="1")
    assert proc.returncode == code, proc.stderr[-2000:]
    if code:
        assert "later step failed" in proc.stderr


_OPEN_WANDB_RUN = """
import sys, types
from backends.standard._compat import install_clean_exit
wandb = types.ModuleType("wandb")  # a stand-in: the real wandb finishes a run in an atexit handler of its own
wandb.run = object()
wandb.finish = lambda exit_code=0: print("wandb finished", exit_code)
sys.modules["wandb"] = wandb
install_clean_exit()
"""


@pytest.mark.parametrize("launcher_env,installed", [
    ({"ROLL_LAUNCHED": "1"}, True),  # roll-train's own launch
    ({"LOCAL_RANK": "0", "WORLD_SIZE": "1"}, True),  # deepspeed --module roll.cli by hand sets only these
    ({}, False),  # plain python: the interpreter exits as usual
])
def test_clean_exit_finishes_an_open_wandb_run(launcher_env, installed):
    """W2: os._exit skips wandb's own atexit handler, so the hook finishes the run itself."""
    proc = run([sys.executable, "-c", _OPEN_WANDB_RUN], timeout=120, **launcher_env)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert ("wandb finished 0" in proc.stdout) == installed


def test_workarounds_warn_once_outside_their_verified_versions(monkeypatch, roll_warnings):
    import importlib.metadata

    from backends.standard import _compat

    installed = {"accelerate": "1.15.0", "deepspeed": "0.21.0"}
    monkeypatch.setattr(importlib.metadata, "version", lambda name: installed[name])
    _compat._verified("W6", "accelerate", "deepspeed")
    _compat._verified("W6", "accelerate", "deepspeed")
    assert roll_warnings.text.count("deepspeed 0.21.0 is outside the versions") == 1
    assert "[0.19, 0.20)" in roll_warnings.text and "W6" in roll_warnings.text
    assert "accelerate" not in roll_warnings.text  # 1.15.0 is the verified version
    assert set(_compat.VERIFIED_VERSIONS) == {"torch", "transformers", "accelerate", "deepspeed", "trl"}
