"""The checkpoint service's read pins alone (:mod:`elasticd.store.read_pins`): each releases what
it holds once, by the worker, by its job leaving or past its ttl; a caller's earlier partial copy
goes when it asks again; a descriptor that cannot be made releases at once, in one line."""

from __future__ import annotations

import pytest

from elasticd.local.wire import RequestError
from elasticd.store.read_pins import ReadPins
from elasticd.testing.clock import FakeClock


def test_a_pin_releases_once_by_the_worker_by_its_job_or_past_its_ttl():
    clock, released = FakeClock(), []
    pins = ReadPins(clock, ttl=600)
    a, fd = pins.hold(lambda: 7, lambda: released.append("a"), "j", "a")
    b, _ = pins.hold(lambda: 8, lambda: released.append("b"), "j", "b")
    c, _ = pins.hold(lambda: 9, lambda: released.append("c"), "k", "c")
    assert fd == 7 and len({a, b, c}) == 3 and len(pins._pins) == 3
    pins.release(a)
    pins.release(a)  # twice: nothing more
    assert released == ["a"]
    pins.sweep("j")  # j left the node
    assert released == ["a", "b"]
    clock.advance(599)
    pins.sweep()
    assert released == ["a", "b"]
    clock.advance(2)
    pins.sweep()  # its worker died without a word
    assert released == ["a", "b", "c"] and len(pins._pins) == 0
    pins.release(c)
    assert released == ["a", "b", "c"]


def test_asking_again_gives_the_earlier_partial_copy_back():
    released = []
    pins = ReadPins(FakeClock(), ttl=600)
    caller = ("j", 1, 42)
    pins.hold(lambda: 3, lambda: released.append("first"), "j", "a copy", caller)
    pins.release_scratch(("j", 1, 43))  # another caller's: none
    assert released == []
    pins.release_scratch(caller)
    assert released == ["first"]
    pins.release_scratch(caller)
    assert released == ["first"]


def test_a_descriptor_that_fails_releases_at_once():
    released = []
    pins = ReadPins(FakeClock(), ttl=600)

    def fail() -> int:
        raise OSError("too many open files")

    with pytest.raises(RequestError, match="cannot hand over a copy: too many open files"):
        pins.hold(fail, lambda: released.append(1), "j", "a copy")
    assert released == [1]
