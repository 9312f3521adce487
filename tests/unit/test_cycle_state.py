"""The daemon loop's own state, alone: notes, sentences, pacing."""

from __future__ import annotations

import threading
import time

from elasticd.daemon.cycle_state import CycleState


def test_finish_counts_cycles_and_says_when_the_sentence_changed():
    s = CycleState(now=5.0)
    assert (s.sentence, s.cycles, s.last_cycle) == ("starting", 0, 5.0)
    s.note(None)
    s.note("")
    s.note("n2 failed")
    assert s.notes == ["n2 failed"]
    assert s.finish("a", now=6.0)
    assert not s.finish("a", now=7.0)
    assert s.finish("b", now=8.0)
    assert (s.sentence, s.cycles, s.last_cycle) == ("b", 3, 8.0)


def test_wait_returns_at_a_wake_up_and_not_at_all_when_busy():
    s = CycleState(now=0.0)
    t0 = time.monotonic()
    s.wait(30.0, idle=lambda: False)  # something waits to be handled: no wait
    threading.Timer(0.05, s.wake).start()
    s.wait(30.0, idle=lambda: True)
    assert time.monotonic() - t0 < 10.0
    assert not s.stopping
    s.stop()
    s.wait(30.0, idle=lambda: True)  # a stop wakes the wait too
    assert s.stopping and time.monotonic() - t0 < 10.0
