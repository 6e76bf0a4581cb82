"""megatron-core's ``jit_fuser`` compiled on first call, so that importing megatron stays light.

megatron-core (``megatron/core/jit.py``, 0.16.1) sets ``jit_fuser = torch.compile`` on torch >= 2.2, and
decorates ~35 functions with it at import time: the fused bias-GeLU / GeGLU / SwiGLU / dropout kernels,
``quick_gelu``, the squared ReLU, the fused cross entropy, MoE helpers. ``torch.compile(fn)`` compiles
nothing until ``fn`` is called, but it imports ``torch._dynamo`` and inductor's ``compile_fx`` to build its
wrapper: ~3 s of CPU (of ~8.5 s for ``import backends.mca.convert``) in every process that imports
megatron, on every device, whether any decorated function runs or not. roll's templates turn every
``*_fusion`` flag off (``backends/mca/models/templates/_common.py``), so on its paths these functions
mostly never run.

The replacement decorator returns a plain function that calls ``torch.compile(fn)`` on the first call and
the compiled function from then on: the same compiled code whenever a decorated function does run (on
a GPU with Transformer Engine too), the same numerics, no dynamo import when none runs. It is a plain
function, so it binds as a method like the compiled one, and ``functools.wraps`` keeps the name, the
qualified name (pickling by reference) and the identity megatron compares (``activation_func ==
quick_gelu``).

``install()`` (called by ``backends/mca/__init__``, before any megatron module is imported) registers an
import hook that swaps ``megatron.core.jit.jit_fuser`` right after that module executes: its importers
(``from megatron.core.jit import jit_fuser``) then bind the lazy one. Only when ``jit_fuser`` is
``torch.compile`` (torch < 2.2 gets ``torch.jit.script``, untouched). It can go when megatron-core
defers ``torch.compile`` (or its import) to the first call (not as of 0.16.1); ``backends.mca.platform``
lists it with the other compat patches.
"""

from __future__ import annotations

import functools
import importlib.abc
import importlib.machinery
import sys
from typing import Any, Callable

MODULE = "megatron.core.jit"


def compile_on_first_call(fn: Callable | None = None, **options: Any) -> Callable:
    """``torch.compile(fn, **options)``, built when ``fn`` is first called; usable as ``@`` or ``@(...)``."""
    if fn is None:
        return functools.partial(compile_on_first_call, **options)
    compiled: Callable | None = None

    @functools.wraps(fn)
    def compiled_on_first_call(*args: Any, **kwargs: Any) -> Any:
        nonlocal compiled
        if compiled is None:
            import torch

            compiled = torch.compile(fn, **options)
        return compiled(*args, **kwargs)

    return compiled_on_first_call


def _make_lazy(module: Any) -> None:
    import torch

    if getattr(module, "jit_fuser", None) is torch.compile:
        module.jit_fuser = compile_on_first_call
        module.enable_jit_fuser = _lazy_enable(module.enable_jit_fuser, module)


def _lazy_enable(enable: Callable[[], None], module: Any) -> Callable[[], None]:
    """megatron's ``enable_jit_fuser`` (re-)sets ``torch.compile``: keep it lazy there too."""

    @functools.wraps(enable)
    def enable_jit_fuser() -> None:
        enable()
        _make_lazy(module)

    return enable_jit_fuser


class _Loader(importlib.abc.Loader):
    def __init__(self, loader: importlib.abc.Loader) -> None:
        self._loader = loader

    def create_module(self, spec):
        return self._loader.create_module(spec)

    def exec_module(self, module) -> None:
        self._loader.exec_module(module)
        _make_lazy(module)


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname, path, target=None):
        if fullname != MODULE:
            return None
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is not None and spec.loader is not None:
            spec.loader = _Loader(spec.loader)
        return spec


def install() -> None:
    """Make ``jit_fuser`` lazy: by hook before ``megatron.core.jit`` is imported, in place after. Idempotent."""
    if MODULE in sys.modules:  # already imported: its importers hold torch.compile; later ones get the lazy one
        _make_lazy(sys.modules[MODULE])
    elif not any(isinstance(finder, _Finder) for finder in sys.meta_path):
        sys.meta_path.insert(0, _Finder())
