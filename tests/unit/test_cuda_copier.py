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

from elasticd.worker.checkpointer import Checkpointer
from elasticd.worker.cuda_copier import CudaCopier, _runs
from elasticd.snapshot.format import Layout, TensorSpec, layout
from elasticd.store.service import CheckpointService
from elasticd.store.shm import SlotStore
from elasticd.testing.transport import InProcessTransport


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
    def __init__(self, can_register=True):
        self.can_register = can_register
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

    def register(self, buffer):
        # As cudaHostRegister: pins the memory in place; the tensor is over the same bytes.
        if not self.can_register:
            raise RuntimeError("cudaHostRegister of the slot failed (cudaError 1)")
        host = torch.frombuffer(buffer, dtype=torch.uint8)
        self.log.append(("register", host.data_ptr(), host.numel()))
        return host

    def unregister(self, host):
        self.log.append(("unregister", host.data_ptr()))

    def copy(self, dst, src, stream):
        self.log.append(("copy", self.current.name, stream.name))
        dst.copy_(src)


def tensors():
    return [torch.arange(10, dtype=torch.float32), torch.ones(3, 4, dtype=torch.bfloat16),
            torch.arange(6, dtype=torch.int64).reshape(2, 3).t()]  # non-contiguous


def check_slot(buf, ts, lay):
    for t, e in zip(ts, lay.entries):
        got = torch.frombuffer(buf, dtype=torch.uint8)[e.offset : e.offset + e.nbytes]
        assert torch.equal(got.view(t.dtype).view(t.shape), t)


def test_copies_go_on_the_side_stream_straight_into_the_pinned_slot():
    api = FakeApi()
    ts = tensors()
    lay = layout([TensorSpec(f"t{i}", str(t.dtype)[6:], tuple(t.shape)) for i, t in
                  enumerate(ts)], job="j")
    buf = bytearray(lay.total_size)
    address = torch.frombuffer(buf, dtype=torch.uint8).data_ptr()
    copier = CudaCopier(api)
    try:
        handle = copier.start(ts, buf, lay)
        handle.wait(10)
        ops = [op for op in api.log if op[0] != "synchronize"]
        # The slot itself is registered (no staging buffer is ever allocated) ...
        assert ops[:3] == [("register", address, lay.total_size),
                           ("wait_stream", "side", "compute"), ("enter", "side")]
        assert ops[3:6] == [("copy", "side", "side")] * 3
        assert ops[6:] == [("record", 1, "side"), ("exit", "side")]
        assert ("synchronize", 1, "elasticd-d2h_0") in api.log  # off the training thread
        handle.before_mutation()
        assert api.log[-1] == ("wait_event", "compute", 1)
        check_slot(buf, ts, lay)  # ... and the copies wrote the slot, no host copy after
        ts2 = [t + 1 for t in tensors()]
        copier.start(ts2, buf, lay).wait(10)
        check_slot(buf, ts2, lay)
        assert sum(op[0] == "register" for op in api.log) == 1  # once per mapping
        assert not any(op[0] == "pinned" for op in api.log)
        other = bytearray(lay.total_size)
        copier.start(ts, other, lay).wait(10)
        check_slot(other, ts, lay)
        copier.forget(buf)  # the worker unmaps the old slot: unpinned first
        assert api.log[-1] == ("unregister", address)
    finally:
        copier.close()
    assert api.log[-1][0] == "unregister"  # close unpins what is left
    assert sum(op[0] == "unregister" for op in api.log) == 2


def test_a_slot_that_cannot_be_pinned_goes_through_a_pinned_staging_buffer(caplog):
    api = FakeApi(can_register=False)
    ts = tensors()
    lay = layout([TensorSpec(f"t{i}", str(t.dtype)[6:], tuple(t.shape)) for i, t in
                  enumerate(ts)], job="j")
    buf = bytearray(lay.total_size)
    copier = CudaCopier(api)
    try:
        with caplog.at_level("WARNING"):
            copier.start(ts, buf, lay).wait(10)
        assert "staging buffer" in caplog.text  # said once, with the reason
        assert "cudaError 1" in caplog.text
        check_slot(buf, ts, lay)
        copier.start(ts, buf, lay).wait(10)
        assert sum(op[0] == "pinned" for op in api.log) == 1  # the staging buffer is reused
        assert caplog.text.count("staging buffer") == 1
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


@pytest.fixture
def one_rank_group():
    import torch.distributed as dist

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def test_sharded_state_takes_the_direct_path_and_restores(transport, one_rank_group):
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(7, 5), torch.nn.Linear(5, 3))
    fully_shard(model)
    assert isinstance(model[0].weight, DTensor)
    opt = torch.optim.Adam(model.parameters(), lr=0.1)
    model(torch.randn(4, 7)).sum().backward()
    opt.step()
    api = FakeApi()
    with Checkpointer(transport=transport, job="j", rank=0, world_size=1,
                      copier=CudaCopier(api)) as ckpt:
        assert ckpt.save(1, {"model": model, "optim": opt})
        ckpt.wait()
        assert ckpt.stats["saves"] == 1
    # The local shards were copied on the side stream into the registered slot, unpinned at
    # close; no staging buffer.
    assert [op[0] for op in api.log].count("register") == 1
    assert [op[0] for op in api.log].count("unregister") == 1
    assert any(op == ("copy", "side", "side") for op in api.log)
    assert not any(op[0] == "pinned" for op in api.log)
    saved = {k: v.to_local().clone() for k, v in model.state_dict().items()}
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    with Checkpointer(transport=transport, job="j", rank=0, world_size=1) as ckpt:
        assert ckpt.restore({"model": model, "optim": opt}) == 1
    for k, v in model.state_dict().items():
        assert torch.equal(v.to_local(), saved[k]), k
