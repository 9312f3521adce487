"""A reshard's rows fetched by the worker itself (elasticd/worker/direct.py), over sessions its
daemon's real ``ckpt_sessions`` hands over, from real holders over loopback.

Real torch: the checks run in a spawned gloo rank (a world of 1, so the state is FSDP2's
DTensors), whose live state is a step ahead of the snapshot the holders keep. The plan-only
pass leaves the state as it is and names the very copies the load makes; the direct fetch
lands the rows in the live tensors, every block checked against its owner's tag, and the load
after it gives the snapshot's state bit for bit, as the daemon's path would. A relay that
alters a block of a routed row range makes the fetch fail its tag: the worker refuses it,
says so in ``refused`` (which the daemon counts), and marks the state tainted; a holder that
dies after the sessions were handed over is gone for that restore (a handed session cannot
reconnect) and the other holder serves every block.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import time

import pytest
import torch

from elasticd.coordination.embedded import free_port
from elasticd.replication.deadline import DEFAULT_FLOOR
from tests.ranks import spawn

DIMS = (96, 160, 48)  # Linear(96, 160), Linear(160, 48): 60 KiB and 30 KiB of weight rows
BLOCK = 16 << 10  # so that rows span several checksum blocks


def _build():
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(DIMS[0], DIMS[1]), torch.nn.Tanh(),
                                torch.nn.Linear(DIMS[1], DIMS[2]))
    for layer in (model[0], model[2]):
        fully_shard(layer)
    fully_shard(model)
    return model, torch.optim.Adam(model.parameters(), lr=0.01)


def _train(model, opt, step):
    g = torch.Generator().manual_seed(step)
    model(torch.randn(4, DIMS[0], generator=g)).pow(2).sum().backward()
    opt.step()
    opt.zero_grad()


def _local(state):
    """Every local tensor of the state (parameters, Adam's moments and step), cloned."""
    model, opt = state["model"], state["optim"]
    out = {f"p{i}": p._local_tensor.clone() for i, p in enumerate(model.parameters())}
    for i, st in enumerate(opt.state.values()):
        for k, v in st.items():
            out[f"s{i}/{k}"] = (v._local_tensor if hasattr(v, "_local_tensor") else v).clone()
    return out


def _equal(a, b) -> bool:
    return a.keys() == b.keys() and all(
        torch.equal(a[k].reshape(-1).view(torch.uint8), b[k].reshape(-1).view(torch.uint8))
        for k in a)


def _snapshot(state, step):
    """(header bytes, payload bytes) of the state sealed as old rank 0 of a world of 1."""
    from elasticd.snapshot.format import SnapshotHeader, seal
    from elasticd.worker.copier import copy_into
    from elasticd.worker.state import flatten

    flat = flatten(state)
    lay = flat.layout("job", block_size=BLOCK)
    buf = bytearray(lay.total_size)
    copy_into(flat.tensors, buf, lay)
    seal(buf, SnapshotHeader("job", step, 0, 0, 1, lay, flat.meta))
    return lay, buf


def _push(address, lay, buf, step) -> None:
    from elasticd.replication.seal import BlockTagger
    from elasticd.replication.transport import ReplicaClient
    from elasticd.replication.api import Descriptor
    from tests.unit.test_replication_attacks import SECRET

    blocks = [lay.block_range(i) for i in range(lay.num_blocks)]
    d = Descriptor("job", 0, 0, step, lay.total_size, lay.data_offset)
    with ReplicaClient.connect(*address, SECRET, "node-a", timeout=10.0) as client:
        client.push(d, bytes(buf[:lay.data_offset]), bytes(buf[lay.data_offset:]),
                    chunk_size=BLOCK, tags=BlockTagger(SECRET).tag(bytes(buf), blocks))


class _Blackhole:
    """A TCP relay to ``target`` that, once :attr:`dead` is set, forwards nothing more either
    way and resets nothing (every byte dropped, as from a black-holed port); stopped by
    :meth:`close`."""

    def __init__(self, target) -> None:
        import socket
        import threading

        self.target, self.dead = target, threading.Event()
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.address = self.listener.getsockname()[:2]
        self.socks: list = []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        import socket
        import threading

        with contextlib.suppress(OSError):
            while True:
                client, _ = self.listener.accept()
                upstream = socket.create_connection(self.target)
                self.socks += [client, upstream]
                for a, b in ((client, upstream), (upstream, client)):
                    threading.Thread(target=self._pump, args=(a, b), daemon=True).start()

    def _pump(self, a, b) -> None:
        with contextlib.suppress(OSError):
            while data := a.recv(1 << 16):
                if not self.dead.is_set():
                    b.sendall(data)

    def close(self) -> None:
        self.listener.close()
        for s in self.socks:
            s.close()


class _Daemon:
    """The worker's transport to a real daemon service (its ``ckpt_sessions``), in-process:
    the descriptors a reply carries are this process's, as the local socket would pass them."""

    def __init__(self, service) -> None:
        self.handlers = service.handlers()
        self.calls: list[str] = []
        self.holders: list[list[str]] = []  # of each ckpt_sessions reply

    def call(self, op, **kw):
        self.calls.append(op)
        reply = self.handlers[op](dict(kw))
        if op == "ckpt_sessions":
            self.holders.append(sorted(s["holder"] for s in reply["sessions"]))
        return reply


@contextlib.contextmanager
def _daemon(tmp, holders: dict):
    """A daemon "node-c" whose job's committed step 1 names ``holders`` (node id -> address)
    for old rank 0."""
    from elasticd.coordination.keys import Keyspace
    from elasticd.recovery.replicator import Replicator
    from elasticd.replication.commit import Committed, record_commit
    from elasticd.store.service import CheckpointService
    from elasticd.store.shm import SlotStore
    from elasticd.testing.coordination import MemoryCoordinator
    from tests.unit.test_replication_attacks import SECRET

    coord, keys = MemoryCoordinator(), Keyspace("/t")
    record_commit(coord, keys, "job", Committed(0, 1, (0,), {0: tuple(holders)}))
    store = SlotStore(os.path.join(tmp, "store"))
    replicator = Replicator("node-c", coord, keys, store, SECRET, m=len(holders),
                            timeout=10.0, peers_address=holders.get)
    service = CheckpointService(store, "node-c", replicator=replicator)
    try:
        yield service
    finally:
        service.restores.handed.cut_off_job("job")
        replicator.close()
        store.close()


@contextlib.contextmanager
def _holder(node: str):
    """A holder ``node`` (a real replication server over loopback, in memory)."""
    from elasticd.replication.server import ReplicaServer
    from elasticd.testing.replication import MemorySink
    from tests.unit.test_replication_attacks import SECRET

    srv = ReplicaServer("127.0.0.1", 0, SECRET, node, MemorySink(), idle_timeout=10.0,
                        chunk_size=BLOCK).start()
    try:
        yield srv
    finally:
        srv.stop()


def _direct(service, state, staging):
    from elasticd.worker import shards
    from elasticd.worker.direct import DirectFetch

    direct = DirectFetch(_Daemon(service), "job", 0, lambda q: None, staging=staging)
    refused: list[str] = []
    got = direct.fetch((0, 1), 1, 0, state, shards.local_boxes(state), refused)
    return direct, got, refused


def _load(state, got) -> None:
    from elasticd.worker.state import load_into

    load_into(state, got.tensors, got.meta, names=got.names,
              others=[(o.names, o.tensors, o.meta) for o in got.others], base_views=True,
              files=got.slot_files())
    got.close()


def _plan_only(state, lay, buf, saved) -> None:
    """plan_rows changes nothing and names the copies load_into makes."""
    import mmap

    from elasticd.worker.copier import tensor_views
    from elasticd.worker.slot_rows import Landed, SlotFiles, mapping_address
    from elasticd.worker.state import load_into, plan_rows

    fd = os.memfd_create("plan-test", os.MFD_CLOEXEC)
    os.write(fd, bytes(buf))
    mm = mmap.mmap(fd, len(buf))
    try:
        views = tensor_views(mm, lay)
        names = [e.name for e in lay.entries]
        files = SlotFiles([(mapping_address(mm), fd, len(mm))])
        before = _local(state)
        copies = plan_rows(state, views, _meta(buf), files, names=names)
        assert _equal(_local(state), before), "the plan changed the live state"
        live = [(p._local_tensor.data_ptr(), p._local_tensor.nbytes)
                for p in state["model"].parameters()]
        assert {c.into for c in copies} >= {a for a, _ in live}, "a parameter was not planned"
        for c in copies:  # made by hand here, then skipped by the load
            ctypes.memmove(c.into, c.mapping + c.at, c.nbytes)
        made = []

        class Counting(Landed):
            def read(self, out, dst, t, src):
                made.extend(c for c in [self.locate(out, dst, t, src)] if c is not None)
                return super().read(out, dst, t, src)

        counting = Counting([(mapping_address(mm), fd, len(mm))], copies)
        others = {k: v for k, v in zip(names, views)}
        plain = [v if k in _sharded(buf, names) else v.clone() for k, v in others.items()]
        load_into(state, plain, _meta(buf), names=names, base_views=True, files=counting)
        assert sorted(made) == sorted(copies), "the load's copies are not the plan's"
        assert _equal(_local(state), saved)
        del views, plain, others
    finally:
        with contextlib.suppress(BufferError):
            mm.close()
        os.close(fd)


def _meta(buf):
    from elasticd.snapshot.reader import parse_header

    return parse_header(buf).meta


def _sharded(buf, names):
    from elasticd.snapshot.format import dtensor_nodes

    return {names[n["i"]] for n in dtensor_nodes(_meta(buf))}


def _rank(rank, port, tmp):
    import torch.distributed as dist

    from elasticd.replication.wire import BlockTagMismatch
    from elasticd.worker.direct import StagingMaps
    from tests.unit.test_replication_attacks import RewritingRelay

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0,
                            world_size=1)
    staging = StagingMaps()
    try:
        model, opt = _build()
        state = {"model": model, "optim": opt, "epoch": 3}
        _train(model, opt, 1)
        saved = _local(state)
        lay, buf = _snapshot(state, 1)

        def ahead():  # the live state a step further on than the snapshot
            _train(model, opt, 2)
            assert not _equal(_local(state), saved)

        ahead()
        _plan_only(state, lay, buf, saved)

        # Two holders; the first dies once the sessions are handed over.
        with _holder("node-a") as a, _holder("node-b") as b:
            _push(a.address, lay, buf, 1)
            _push(b.address, lay, buf, 1)
            with _daemon(tmp, {"node-a": a.address, "node-b": b.address}) as service:
                ahead()
                from elasticd.worker import direct as direct_mod

                real = direct_mod.DirectFetch._land

                def land_after_a_dies(self, *args):
                    a.stop()
                    return real(self, *args)

                direct_mod.DirectFetch._land = land_after_a_dies
                try:
                    direct, got, refused = _direct(service, state, staging)
                finally:
                    direct_mod.DirectFetch._land = real
                assert got is not None and not refused, refused
                assert direct.transport.holders == [["node-a", "node-b"]]  # both handed over
                assert got.figures["routed_bytes"] >= sum(t.nbytes for t in saved.values()
                                                         if t.dim() > 0) // 2, got.figures
                assert got.source == "peer" and got.figures["remote_ranks"] == 1
                _load(state, got)
                assert _equal(_local(state), saved), "the direct fetch restored other bytes"
                assert state["epoch"] == 3
                # Its fetch over, the worker ended the set it was handed (not at the deadline).
                assert direct.transport.calls[-1] == "ckpt_sessions_done"
                assert service.restores.handed.live() == 0

        # Two holders; the first is black-holed once the sessions are handed over: the fetch
        # drops it at its deadline (no session to reconnect) and takes every block from the
        # other.
        with _holder("node-a") as a, _holder("node-b") as b:
            _push(a.address, lay, buf, 1)
            _push(b.address, lay, buf, 1)
            hole = _Blackhole(a.address)
            try:
                with _daemon(tmp, {"node-a": hole.address, "node-b": b.address}) as service:
                    ahead()
                    from elasticd.worker import direct as direct_mod

                    real = direct_mod.DirectFetch._land

                    def land_after_a_goes_silent(self, *args):
                        hole.dead.set()
                        return real(self, *args)

                    direct_mod.DirectFetch._land = land_after_a_goes_silent
                    started = time.monotonic()
                    try:
                        direct, got, refused = _direct(service, state, staging)
                    finally:
                        direct_mod.DirectFetch._land = real
                    took = time.monotonic() - started
            finally:
                hole.close()
            assert got is not None and not refused, refused
            assert direct.transport.holders == [["node-a", "node-b"]]
            assert took < 4 * DEFAULT_FLOOR, took  # a deadline or two, not the session's 600 s
            assert got.figures["remote_ranks"] == 1
            _load(state, got)
            assert _equal(_local(state), saved), "the direct fetch restored other bytes"

        # A relay alters a byte of a routed row range's block: its tag fails.
        flips = []

        def flip(seen, payload):
            if flips or len(payload) < BLOCK:  # the handshake, describe and header frames
                return False
            payload[len(payload) // 2] ^= 0x01
            flips.append(seen)
            return True

        with _holder("node-d") as c:
            _push(c.address, lay, buf, 1)
            relay = RewritingRelay(c.address, downstream=True, rewrite=flip)
            try:
                with _daemon(tmp, {"node-d": relay.address}) as service:
                    ahead()
                    direct, got, refused = _direct(service, state, staging)
            finally:
                relay.close()
            assert got is None and flips, (got, flips, refused)
            assert len(refused) == 1 and refused[0].startswith("direct fetch of step"), refused
            assert BlockTagMismatch.__name__ in refused[0] or "tag" in refused[0], refused
            assert direct.tainted  # rows may have landed: a restore must load a step
    finally:
        staging.close()
        dist.destroy_process_group()


def test_the_worker_fetches_a_reshards_rows_itself_into_its_live_tensors(tmp_path):
    spawn(_rank, args=(free_port(), str(tmp_path)), nprocs=1)


class _Recording:
    """A daemon transport that records every call and answers none."""

    def __init__(self) -> None:
        self.calls: list[str] = []

    def call(self, op, **kw):
        self.calls.append(op)
        raise AssertionError(f"{op} should not be asked")


def test_a_state_without_dtensors_never_asks_for_sessions():
    """A replicated state at another world size (DDP's) is fetched whole through the daemon:
    no session is asked for, no fallback is reported."""
    from elasticd.worker.sources import Sources

    transport = _Recording()
    sources = Sources(transport, "job", 0, 2)
    refused: list[str] = []
    state = {"model": torch.nn.Linear(3, 2), "optim": None}
    assert sources._direct((0, 1), 3, 0, state, refused) is None
    assert transport.calls == [] and refused == [] and not sources.tainted


class _Answering:
    """A daemon transport whose ``ckpt_sessions`` gives ``reply``."""

    def __init__(self, reply: dict) -> None:
        self.reply, self.calls = reply, []

    def call(self, op, **kw):
        self.calls.append(op)
        return dict(self.reply)


@pytest.mark.parametrize("replication", ["tls", "none"])
def test_a_node_that_hands_no_sessions_over_is_the_daemons_path_not_a_fallback(tmp_path,
                                                                              replication):
    """Over TLS, or without peer replication, the daemon says so (unsupported) and the worker
    takes the daemon's path without a refusal: nothing is counted as a fallback. A reply with
    no session for another reason still is one."""
    from elasticd.worker.direct import DirectFetch

    with _holder("node-a") as a, _daemon(str(tmp_path), {"node-a": a.address}) as service:
        if replication == "tls":
            service.restores.replicator.connections.ssl_context = object()
        else:
            service.restores.replicator = None
        reply = service.handlers()["ckpt_sessions"](
            {"job": "job", "rank": 0, "old_rank": 0, "generation": 0, "step": 1})
        assert reply["unsupported"] is True and reply["sessions"] == [], reply
        assert ("TLS" in reply["reason"]) == (replication == "tls"), reply
        assert service.restores.handed.live() == 0
    refused: list[str] = []
    direct = DirectFetch(_Answering(reply), "job", 0, lambda q: None)
    assert direct.fetch((0, 1), 2, 0, None, [["boxes"]], refused) is None
    assert refused == [] and not direct.tainted
    failing = DirectFetch(_Answering({"sessions": [], "reason": "no holder"}), "job", 0,
                          lambda q: None)
    assert failing.fetch((0, 1), 2, 0, None, [["boxes"]], refused) is None
    assert len(refused) == 1 and refused[0].startswith("direct fetch of step"), refused
