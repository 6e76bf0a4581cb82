"""roll.gc_pause: the start-up's objects out of the garbage collector's passes while training, and back after."""

from __future__ import annotations

import gc
import weakref

import pytest

from roll.gc_pause import start_up_objects_frozen


class _Node:
    def __init__(self) -> None:
        self.me = self  # a reference cycle: only the collector frees it


def test_the_start_ups_objects_are_frozen_and_handed_back():
    """Garbage at the start is collected first; an object alive at the start is frozen (a cycle dropped while
    training stays until the end) and handed back (collected after it); one made while training is collected as
    ever; a nested use and an exception leave the outer freeze and the unfreeze as they are."""
    leftover = _Node()
    leftover_ref = weakref.ref(leftover)
    del leftover  # garbage before the start: collected by the start's collection
    before = _Node()
    before_ref = weakref.ref(before)
    with start_up_objects_frozen():
        assert leftover_ref() is None
        frozen = gc.get_freeze_count()
        assert frozen > 1000
        del before
        made = _Node()
        made_ref = weakref.ref(made)
        del made
        with start_up_objects_frozen():
            assert gc.get_freeze_count() == frozen
        gc.collect()
        assert made_ref() is None and before_ref() is not None and gc.get_freeze_count() == frozen
    assert gc.get_freeze_count() == 0
    gc.collect()
    assert before_ref() is None
    with pytest.raises(RuntimeError), start_up_objects_frozen():
        raise RuntimeError("a failed step")
    assert gc.get_freeze_count() == 0
