"""backends.mca.lazy_jit: megatron's ``jit_fuser`` builds ``torch.compile`` on a decorated function's first call.

The compiled code must be the one megatron would have run (``torch.compile`` of the same function, once),
and importing megatron must no longer load inductor. A fake ``torch.compile`` records what is compiled:
the real one would take seconds of CPU per function and is torch's to test.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import torch

from backends.mca.lazy_jit import compile_on_first_call

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_compiles_once_on_the_first_call_with_the_options_and_binds_as_a_method(monkeypatch):
    compiled = []

    def fake_compile(fn, **options):
        compiled.append((fn, options))
        return lambda *args, **kwargs: ("compiled", fn(*args, **kwargs))

    monkeypatch.setattr(torch, "compile", fake_compile)

    def double(x):
        return 2 * x

    lazy = compile_on_first_call(double)
    assert compiled == [] and lazy.__name__ == "double" and lazy.__wrapped__ is double
    assert lazy(3) == ("compiled", 6) and lazy(4) == ("compiled", 8)
    assert compiled == [(double, {})]  # once, the undecorated function

    class Norm:
        scale = 10

        @compile_on_first_call(dynamic=False)
        def apply(self, x):
            return self.scale * x

    assert Norm().apply(2) == ("compiled", 20)
    assert compiled[-1][1] == {"dynamic": False} and compiled[-1][0].__qualname__.endswith("Norm.apply")


_PROBE = """
import json, sys, torch
import backends.mca.convert  # imports megatron-core, as every mca process does
import megatron.core.jit as jit
from megatron.core.transformer.utils import gelu_impl
light = {name: name in sys.modules for name in ("torch._dynamo", "torch._inductor.compile_fx")}
seen = []
torch.compile = lambda fn, **options: seen.append(fn) or fn
x = torch.linspace(-3, 3, 7)
out = gelu_impl(x)
expected = 0.5 * x * (1.0 + torch.tanh(0.7978845608028654 * x * (1.0 + 0.044715 * x * x)))
print(json.dumps({"light": light, "lazy": jit.jit_fuser.__name__, "compiled": [fn.__qualname__ for fn in seen],
                  "equal": bool(torch.equal(out, expected))}))
"""


def test_importing_megatron_loads_no_inductor_and_a_fused_function_is_compiled_when_called():
    env = {**os.environ, "PYTHONPATH": REPO + os.pathsep + os.environ.get("PYTHONPATH", "")}
    proc = subprocess.run([sys.executable, "-c", _PROBE], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["light"] == {"torch._dynamo": False, "torch._inductor.compile_fx": False}
    assert result["lazy"] == "compile_on_first_call"
    assert result["compiled"] == ["gelu_impl"] and result["equal"]
