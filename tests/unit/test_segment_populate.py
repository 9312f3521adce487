"""Populating a slot's or a scratch segment's pages lets the daemon's other threads run.

``mmap.madvise`` holds the GIL for the whole ``MADV_POPULATE_WRITE`` (~0.4 s per GiB of fresh
small pages here), so while one stripe thread of a fetch, or the thread touching set-aside
scratch, populated a range, the threads receiving from the other holders stood still.
:func:`elasticd.snapshot.segment.populate` lets the GIL go around the call.
"""

from __future__ import annotations

import mmap
import sys
import threading

import pytest

from elasticd.snapshot.segment import PAGE, populate


def test_another_thread_runs_python_while_a_range_is_populated():
    mm = mmap.mmap(-1, 64 << 20, flags=mmap.MAP_SHARED)
    inside, seen, started = [False], [0], threading.Event()

    def fill() -> None:
        inside[0] = True
        started.set()
        populate(mm, 0, len(mm))
        inside[0] = False

    # A thread waiting for the GIL asks the holder to drop it only after the switch interval:
    # with it at 2 s, the main thread runs during the populate only if the populate itself
    # lets the GIL go (64 MiB take well under that).
    interval = sys.getswitchinterval()
    sys.setswitchinterval(2.0)
    try:
        filler = threading.Thread(target=fill)
        filler.start()
        started.wait()
        while filler.is_alive():
            if inside[0]:
                seen[0] += 1
        filler.join()
    finally:
        sys.setswitchinterval(interval)
    assert seen[0] > 0
    assert mm[len(mm) - 1] == 0  # populated, zero-filled, still the same mapping
    mm.close()


def test_populate_refuses_a_range_outside_the_mapping():
    mm = mmap.mmap(-1, 4 * PAGE, flags=mmap.MAP_SHARED)
    try:
        for start, length in ((0, 5 * PAGE), (PAGE // 2, PAGE), (-PAGE, PAGE)):
            with pytest.raises(ValueError):
                populate(mm, start, length)
        populate(mm, PAGE, 3 * PAGE)
    finally:
        mm.close()
