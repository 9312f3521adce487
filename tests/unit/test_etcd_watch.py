"""The etcd watch refuses events outside its own range (pyetcd's mis-bound "created" answer,
docs/facts.md); the real-etcd reproduction is in tests/integration/test_coordination_contract.py.
"""

from __future__ import annotations

from types import SimpleNamespace

from pyetcd import events
from pyetcd.etcdrpc import kv_pb2

from elasticd.coordination.api import CoordinationError
from elasticd.coordination.etcd_watch import ResilientWatch


def _response(*keys: bytes, revision: int = 5) -> SimpleNamespace:
    evs = [events.new_event(kv_pb2.Event(type=kv_pb2.Event.PUT, kv=kv_pb2.KeyValue(
        key=k, value=b"v", create_revision=revision, mod_revision=revision, version=1)))
        for k in keys]
    return SimpleNamespace(events=evs)


def _watch(watched: bytes, exact: bool = False) -> tuple[ResilientWatch, list]:
    got: list = []
    return ResilientWatch(SimpleNamespace(), watched, got.append, 1, exact=exact), got


def test_events_inside_the_prefix_are_delivered():
    w, got = _watch(b"/j/nodes/")
    w._on_response(0, _response(b"/j/nodes/a", b"/j/nodes/b"))
    assert [[e.kv.key for e in batch] for batch in got] == [[b"/j/nodes/a", b"/j/nodes/b"]]
    assert not w._wake.is_set()


def test_a_key_outside_the_prefix_breaks_the_watch_and_nothing_of_it_is_delivered():
    w, got = _watch(b"/j/nodes/")
    w._on_response(0, _response(b"/j/nodes/a", b"/j/ckpt/committed"))
    assert len(got) == 1 and isinstance(got[0], CoordinationError)
    assert b"/j/ckpt/committed" in str(got[0]).encode()
    assert w._wake.is_set()  # re-created by the watch's own thread
    # The rest of that stream is ignored, even keys that look like ours.
    w._on_response(0, _response(b"/j/nodes/c"))
    w._on_response(0, _response(b"/j/ckpt/other"))
    assert len(got) == 1
    assert w._next_revision == 1  # the foreign revision did not move the resume point


def test_an_exact_key_watch_refuses_its_siblings():
    w, got = _watch(b"/j/key", exact=True)
    w._on_response(0, _response(b"/j/key"))
    w._on_response(0, _response(b"/j/key2"))
    assert [type(x) for x in got] == [list, CoordinationError]


def test_the_refusal_is_logged_once_per_watch(caplog):
    w, got = _watch(b"/j/nodes/")
    for generation in range(3):
        w._on_response(generation, _response(b"/other/k"))
    assert len(got) == 3
    warnings = [r for r in caplog.records if r.levelname == "WARNING"]
    assert len(warnings) == 1 and "outside it" in warnings[0].getMessage()
