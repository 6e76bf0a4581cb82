"""Training with the start-up's objects left out of the garbage collector's passes.

A process that has imported torch, Megatron-Core and transformers and built a model holds millions of long-lived
Python objects (modules, classes, functions, the model's modules and parameters). CPython's full collection (its
generation 2) walks every one of them, on the thread that allocates, at a moment set by allocation counts: in a
``roll-train --use-mca`` run of the bench model such a pass took 0.24 s, and the first checkpoint save set one off
inside its planning (0.24 of the save's 0.27 s on the training thread; later saves took 0.02 s there): over the
ledger's two saves, about half of what an asynchronous save cost the step after it (docs/performance.md,
*Checkpoint saves, session 45*).

:func:`start_up_objects_frozen` collects once, then ``gc.freeze()`` moves every object alive at that point to the
permanent generation that collections skip; objects made while training are collected as before. At the end
``gc.unfreeze()`` hands the frozen ones back, so a process that trains several times (tests, sweeps) still frees
each run's garbage; a nested use (an outer loop froze already) changes nothing.
"""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Iterator


@contextlib.contextmanager
def start_up_objects_frozen() -> Iterator[None]:
    if gc.get_freeze_count():
        yield
        return
    gc.collect()
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()
