"""End a finished command without CPython's interpreter finalization.

A process that imported torch spends most of a second after its last line (0.66 s for ``import torch`` alone,
0.9-1.2 s once Megatron-Core is imported too, on the 2-core dev VM): freeing every module's objects and
running the libraries' static destructors, none of which a command that has written and closed its files
needs. ``roll-convert`` converts the ledger model in about 0.4 s, so this teardown was the larger part of what
a user waited for after the imports. ``end_process`` runs what an orderly exit must still do (the ``atexit``
handlers: logging's flush and close, multiprocessing's children, wandb's finish), flushes stdout and stderr,
and leaves with ``os._exit``.

Only a command's own entry point calls it, once its result is decided: never code a caller goes on after (a
test calling ``main(argv)`` in-process gets ``SystemExit`` as before).
"""

from __future__ import annotations

import atexit
import os
import sys
import threading
from typing import NoReturn


def end_process(code: int) -> NoReturn:
    """Exit with ``code`` now: ``atexit`` handlers run, stdio flushed, no interpreter finalization. While a
    non-daemon thread still runs it exits as ``sys.exit`` does (Python waits for that thread first)."""
    main = threading.main_thread()
    if any(thread is not main and not thread.daemon and thread.is_alive() for thread in threading.enumerate()):
        sys.exit(code)
    atexit._run_exitfuncs()  # noqa: SLF001 - what Py_FinalizeEx runs first; the public API has no other way
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (AttributeError, OSError, ValueError):  # closed or replaced by the caller
            pass
    os._exit(code)
