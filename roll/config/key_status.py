"""The statuses of roll/config/coverage.py's table: what a recipe key does on a backend (honoured, refused, or no
effect on training), a row of them, and the test node id both of the table's parts name.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Union

BACKENDS = ("standard", "mca")


@dataclass(frozen=True)
class Honoured:
    test: str | None
    """The test node id (``tests/...py::name``) that proves the key's effect."""
    note: str = ""
    gap: str = ""
    """Why no test covers it yet (only with ``test=None``)."""
    parity: str = ""
    """The case of the parity sweep (tests/parity/) that runs the key on both backends."""


@dataclass(frozen=True)
class Refused:
    use: str
    """What to use instead (the end of the error message)."""
    example: object
    """A value the backend refuses (the coverage test sets it and expects exit 2)."""
    examples: dict | None = None
    """Per-key examples where the row's keys take different types."""
    allowed: tuple = ()
    """Values accepted besides the key's default."""
    by: str = ""
    """Where an existing check refuses it; empty: ``refuse_unhonoured`` does, for any value not allowed."""


@dataclass(frozen=True)
class NoEffect:
    reason: str


Status = Union[Honoured, Refused, NoEffect]


@dataclass(frozen=True)
class Row:
    keys: str
    """Space-separated key names or glob patterns."""
    standard: Status
    mca: Status

    def status(self, backend: str) -> Status:
        return getattr(self, backend)


def both(status: Status) -> dict[str, Status]:
    return {"standard": status, "mca": status}


def row(keys: str, standard: Status | None = None, mca: Status | None = None, **shared: Status) -> Row:
    statuses = shared.get("both") and both(shared["both"]) or {"standard": standard, "mca": mca}
    return Row(keys, **statuses)


PARITY = "tests/distributed/test_mca_train.py::test_backend_parity_sft_and_pt"
"""The test both parts of the table name most: the same losses on both backends."""
