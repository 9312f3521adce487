"""The GPU copy path's ordering, checked on CPU with fake streams and events.

The fake device API logs every stream and event operation; copies really happen (CPU tensors),
so the bytes that reach the slot are checked too. What must hold: the side stream waits for the
compute stream before any copy; every copy is enqueued on the side stream; the event is recorded
on the side stream after the last copy; the optimizer's pre-hook makes the compute stream wait
on that event (the host does not block); only the background thread synchronizes the event; and
nothing ever synchronizes the whole device.
"""

from __future__ import annotations

import contextlib
import shutil
import threading
import uuid

import numpy as np
import pytest
import torch

from elasticd.checkpoint.client import Checkpointer
from elasticd.checkpoint.cuda_copier import CudaCopier, _runs
from elasticd.checkpoint.format import Layout, TensorSpec, layout
from elasticd.checkpoint.service import CheckpointService
from elasticd.checkpoint.shm import SlotStore
from elasticd.local.transport import InProcessTransport


class FakeStream:
    def __init__(self, name, log):
        self.name, self.log = name, log

    def wait_stream(self, other):
        self.log.append(("wait_stream", self.name, other.name))

    def wait_event(self, event):
        self.log.append(("wait_event", self.name, event.id))


class FakeEvent:
    def __init__(self, id_, log):
        self.id, self.log, self.recorded = id_, log, threading.Event()

    def record(self, stream):
        self.log.append(("record", self.id, stream.name))
        self.recorded.set()

    def synchronize(self):
        self.log.append(("synchronize", self.id, threading.current_thread().name))


class FakeApi:
    def __init__(self):
        self.log = []
        self.compute = FakeStream("compute", self.log)
        self.current = self.compute
        self.events = 0

    def current_stream(self):
        return self.current

    def new_stream(self):
        return FakeStream("side", self.log)

    def new_event(self):
        self.events += 1
        return FakeEvent(self.events, self.log)

    @contextlib.contextmanager
    def use_stream(self, stream):
        previous, self.current = self.current, stream
        self.log.append(("enter", stream.name))
        try:
            yield
        finally:
            self.current = previous
            self.log.append(("exit", stream.name))

    def pinned(self, nbytes):
        self.log.append(("pinned", nbytes))
        return torch.empty(nbytes, dtype=torch.uint8)

    def copy(self, dst, src, stream):
        self.log.append(("copy", self.current.name, stream.name))
        dst.copy_(src)


def tensors():
    return [torch.arange(10, dtype=torch.float32), torch.ones(3, 4, dtype=torch.bfloat16),
            torch.arange(6, dtype=torch.int64).reshape(2, 3).t()]  # non-contiguous


def test_copies_go_on_the_side_stream_after_the_compute_stream():
    api = FakeApi()
    ts = tensors()
    lay = layout([TensorSpec(f"t{i}", str(t.dtype)[6:], tuple(t.shape)) for i, t in
                  enumerate(ts)], job="j")
    buf = bytearray(lay.total_size)
    copier = CudaCopier(api)
    try:
        handle = copier.start(ts, buf, lay)
        handle.wait(10)
        ops = [op for op in api.log if op[0] != "synchronize"]
        assert ops[:3] == [("pinned", lay.total_size), ("wait_stream", "side", "compute"),
                           ("enter", "side")]
        assert ops[3:6] == [("copy", "side", "side")] * 3
        assert ops[6:] == [("record", 1, "side"), ("exit", "side")]
        assert ("synchronize", 1, "elasticd-d2h_0") in api.log  # off the training thread
        handle.before_mutation()
        assert api.log[-1] == ("wait_event", "compute", 1)
        for t, e in zip(ts, lay.entries):
            got = torch.frombuffer(buf, dtype=torch.uint8)[e.offset : e.offset + e.nbytes]
            assert torch.equal(got.view(t.dtype).view(t.shape), t)
        handle2 = copier.start(ts, buf, lay)
        handle2.wait(10)
        assert sum(op[0] == "pinned" for op in api.log) == 1  # the pinned buffer is reused
    finally:
        copier.close()


def test_only_the_given_entries_reach_the_slot():
    lay = layout([TensorSpec("a", "float32", (3,)), TensorSpec("b", "float32", (5,)),
                  TensorSpec("c", "float32", (2,))], job="j")
    rest = Layout((lay.entries[0], lay.entries[2]), lay.data_offset, lay.total_size)
    assert list(_runs(rest)) == [(lay.entries[0].offset, lay.entries[0].offset + 12),
                                 (lay.entries[2].offset, lay.entries[2].offset + 8)]
    assert list(_runs(lay)) == [(lay.entries[0].offset, lay.entries[2].offset + 8)]
    buf = bytearray(b"\xee" * lay.total_size)
    copier = CudaCopier(FakeApi())
    try:
        copier.start([torch.zeros(3), torch.zeros(2)], buf, rest).wait(10)
    finally:
        copier.close()
    b = lay.entries[1]
    assert bytes(buf[b.offset : b.offset + b.nbytes]) == b"\xee" * 20  # "b" left alone
    assert np.frombuffer(bytes(buf[lay.entries[2].offset :][:8]), np.float32).tolist() == [0, 0]


@pytest.fixture
def transport():
    root = f"/dev/shm/elasticd-test-{uuid.uuid4().hex[:12]}"
    store = SlotStore(root)
    try:
        yield InProcessTransport(CheckpointService(store, "n1").handlers())
    finally:
        store.close()
        shutil.rmtree(root, ignore_errors=True)


def test_optimizer_pre_hook_waits_on_the_event_not_the_host(transport):
    api = FakeApi()
    model = torch.nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    state = {"model": model, "optim": opt}
    gate = threading.Event()

    copier = CudaCopier(api)
    # The background host copy is held back, so the snapshot is still in flight below.
    real_submit = copier._pool.submit
    copier._pool.submit = lambda fn: real_submit(lambda: (gate.wait(10), fn()))
    with Checkpointer(transport=transport, job="j", rank=0, world_size=1,
                      copier=copier) as ckpt:
        model(torch.randn(3, 4)).sum().backward()
        opt.step()
        assert ckpt.save(1, state)
        model(torch.randn(3, 4)).sum().backward()
        opt.step()  # the pre-hook runs while the copy is in flight
        wait_at = api.log.index(("wait_event", "compute", 1))
        assert api.log.index(("record", 1, "side")) < wait_at
        assert not any(op[0] == "synchronize" for op in api.log)  # the host never waited
        gate.set()
        ckpt.wait()
        assert ckpt.stats["saves"] == 1
