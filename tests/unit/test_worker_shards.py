"""Sharded training state (FSDP2: DTensor parameters and Adam state) snapshotted without
gathering, restored bitwise at the same world size, and resharded 3 → 2 → 3 against
``torch.distributed.checkpoint``.

Real torch everywhere: ranks are processes spawned here (``torch.multiprocessing``, gloo on
127.0.0.1) running ``fully_shard`` on layers whose sizes 3 and 2 do not divide (uneven shards,
a rank holding no rows); the daemons are two real :class:`CheckpointService` behind real
:class:`LocalServer` sockets in this process, node n1 with the in-process replicator of
``test_store_peer_restore`` fetching from node n2's store (a peer's RAM). The reference a
resharded restore must equal is what ``dcp.load`` gives at the new world size from a
``dcp.save(get_state_dict(...))`` the old world wrote at the same step: never elasticd's own
bytes, so the check can fail.
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
import uuid

import pytest
import torch

from elasticd.worker.checkpointer import Checkpointer
from elasticd.store.service import CheckpointService
from elasticd.store.shm import SlotStore
from elasticd.worker.state import UnsupportedValue
from elasticd.coordination.embedded import free_port
from elasticd.testing.transport import InProcessTransport
from tests.ranks import spawn
from tests.unit.test_store_peer_restore import FakeReplicator, commit

DIMS = (7, 5, 11, 4, 3)  # Linear(7, 5), Linear(5, 11), ...: rows 5, 11, 4, 3 over 2 and 3 ranks


class Replicator(FakeReplicator):
    """The fake replicator, with the status the service's protection check reads."""

    def status(self):
        return {"jobs": {}}


def _build():
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    layers = []
    for a, b in zip(DIMS, DIMS[1:]):
        layers += [torch.nn.Linear(a, b), torch.nn.Tanh()]
    model = torch.nn.Sequential(*layers[:-1])
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer)
    fully_shard(model)
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    return model, opt


def _train(model, opt, step, rank):
    g = torch.Generator().manual_seed(1000 * step + rank)
    model(torch.randn(4, DIMS[0], generator=g)).pow(2).sum().backward()
    opt.step()
    opt.zero_grad()


def _local(model, opt):
    """Every local shard (and Adam's step) by name, cloned."""
    from torch.distributed.checkpoint.state_dict import get_state_dict

    msd, osd = get_state_dict(model, opt)
    out = {f"model/{k}": v.to_local().clone() for k, v in msd.items()}
    for fqn, st in osd["state"].items():
        for k, v in st.items():
            out[f"optim/{fqn}/{k}"] = (v.to_local() if hasattr(v, "to_local") else v).clone()
    return out


def _assert_bitwise(got, want, what):
    assert got.keys() == want.keys(), what
    for name, t in want.items():
        g = got[name]
        assert g.dtype == t.dtype and g.shape == t.shape, f"{what}: {name} {g.shape} {t.shape}"
        assert torch.equal(g.reshape(-1).view(torch.uint8), t.reshape(-1).view(torch.uint8)), \
            f"{what}: {name} differs"


def _rank_main(rank, world, port, sockets, out_dir, phase):
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    from elasticd.worker.client import DaemonClient

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world)
    try:
        model, opt = _build()
        state = {"model": model, "optim": opt, "epoch": 1}
        client = DaemonClient(sockets[rank])
        if phase == "first":  # a Partial DTensor (values awaiting a sum) has no bytes to store
            from torch.distributed.tensor import DTensor, Partial

            mesh = next(model.parameters()).device_mesh
            bad = DTensor.from_local(torch.ones(2), mesh, [Partial()], run_check=False)
            with Checkpointer(transport=client, job="bad", rank=rank, world_size=world) as c:
                with pytest.raises(UnsupportedValue, match="x: a DTensor placed Partial"):
                    c.save(1, {"x": bad})
        ckpt = Checkpointer(transport=client, job="j", rank=rank, world_size=world)
        start = 0
        if phase != "first":  # a new world restores the old one's committed step
            from elasticd.worker import shards

            assembled = []  # (into the state's own tensor?) of each new shard
            real = shards.Resharder._assemble
            shards.Resharder._assemble = staticmethod(
                lambda *a, into=None, **kw: (assembled.append(into is not None),
                                             real(*a, into=into, **kw))[1])
            step = ckpt.restore(state)
            shards.Resharder._assemble = staticmethod(real)
            # Each parameter's new shard went straight into its own local tensor (the
            # optimizer of these fresh processes has no moments yet: those are new tensors).
            assert sum(assembled) == len(list(model.parameters())), assembled
            assert step == {"shrink": 3, "grow": 6}[phase]
            assert ckpt.last_restore.saved_world_size != world
            assert ckpt.last_restore.steps_lost >= 0
            ref_model, ref_opt = _build()
            ref = get_state_dict(ref_model, ref_opt)
            dcp.load({"model": ref[0], "optim": ref[1]},
                     checkpoint_id=os.path.join(out_dir, f"dcp-{phase}"))
            set_state_dict(ref_model, ref_opt, model_state_dict=ref[0],
                           optim_state_dict=ref[1])
            _assert_bitwise(_local(model, opt), _local(ref_model, ref_opt),
                            f"{phase} rank {rank} against dcp.load")
            # The other old ranks' pieces were read in place (views of the slots): none of
            # the restored tensors may be one, or its slot would still be mapped here. The
            # restore scratch kept mapped for the next restore is let go first (a view of it
            # would keep it mapped).
            from elasticd.worker.scratch_maps import SCRATCH_MAPS

            SCRATCH_MAPS.close()
            mapped = [line for line in open("/proc/self/maps") if "/elasticd-test-" in line]
            assert not mapped, mapped
            with open(os.path.join(out_dir, f"{phase}-{rank}.source"), "w") as f:
                f.write(f"{ckpt.last_restore.source} {ckpt.generation}")
            start = step
        for step in range(start + 1, start + 4):
            _train(model, opt, step, rank)
            assert ckpt.save(step, state)
            ckpt.wait()
        msd, osd = get_state_dict(model, opt)
        nxt = "shrink" if phase == "first" else "grow"
        dcp.save({"model": msd, "optim": osd}, checkpoint_id=os.path.join(out_dir, f"dcp-{nxt}"))
        want = _local(model, opt)
        _train(model, opt, start + 4, rank)  # a step whose snapshot is lost
        assert not torch.equal(_local(model, opt)["model/0.weight"], want["model/0.weight"])
        assert ckpt.restore(state) == start + 3  # the same world, from this node's RAM
        assert ckpt.last_restore.source == "local"
        _assert_bitwise(_local(model, opt), want, f"{phase} rank {rank} same-world restore")
        ckpt.close()
    finally:
        dist.destroy_process_group()


@pytest.fixture
def daemons():
    """Two nodes' checkpoint services on real sockets; n1 fetches from n2's store."""
    from elasticd.daemon.local_api import LocalServer

    roots = [f"/dev/shm/elasticd-test-{uuid.uuid4().hex[:12]}" for _ in range(2)]
    sockdir = tempfile.mkdtemp(prefix="elasticd-shard-")
    stores = [SlotStore(r) for r in roots]
    rep = Replicator(stores[0], stores[1])
    services = [CheckpointService(stores[0], "n1", replicator=rep),
                CheckpointService(stores[1], "n2",
                                  replicator=Replicator(stores[1], stores[0]))]
    servers = [LocalServer(os.path.join(sockdir, f"n{i + 1}.sock"), s.handlers())
               for i, s in enumerate(services)]
    for server in servers:
        server.start()
    try:
        yield services, [s.path for s in servers], sockdir
    finally:
        for server in servers:
            server.stop()
        for store in stores:
            store.close()
        for root in roots:
            shutil.rmtree(root, ignore_errors=True)
        shutil.rmtree(sockdir, ignore_errors=True)


@pytest.mark.slow
def test_fsdp2_state_restores_bitwise_and_reshards_3_to_2_to_3_like_dcp(daemons):
    services, (n1, n2), out_dir = daemons
    # World 3: ranks 0 and 1 on n1, rank 2 on n2 (its shard is only in n2's RAM).
    spawn(_rank_main, args=(3, free_port(), [n1, n1, n2], out_dir, "first"), nprocs=3)
    assert {j for j, *_ in services[1].store.holdings()} == {"j"}
    assert all(s.status()["bad"]["unprotected_kind"] == "snapshots_failing" for s in services)
    # n2 died; the step saved by all 3 ranks was committed. Two ranks on n1 reshard it.
    services[0].replicator.record = commit(0, 3, 3)
    spawn(_rank_main, args=(2, free_port(), [n1, n1], out_dir, "shrink"), nprocs=2)
    assert not services[0].pins._pins  # every slot a restore read was handed back
    # New rank 1 asked for old rank 2's rows with its new boxes: one per (global shape,
    # placements), its half of the rows of each FSDP2 parameter.
    (job, rank, need), = services[0].replicator.needs
    assert (job, rank) == ("j", 2) and need
    for shape, placements, offsets, local in need:  # the tail rows, every column
        assert placements == ["S0"] and 0 < offsets[0] and offsets[0] + local[0] == shape[0]
        assert offsets[1:] == [0] * (len(shape) - 1) and local[1:] == shape[1:]
    sources = [open(os.path.join(out_dir, f"shrink-{r}.source")).read().split()
               for r in range(2)]
    assert [s for s, _ in sources] == ["local", "peer"]  # new rank 1 needed old rank 2's rows
    assert ("j", 2, (0, 3)) in services[0].replicator.fetches  # ... held by n2 only
    # n2 rejoined: 3 ranks reshard the step the 2 committed; the new rank 2, on n2, fetches
    # old ranks 0 and 1's snapshots from n1.
    generation = int(sources[0][1])
    for s in services:
        s.replicator.record = commit(generation, 6, 2)
    spawn(_rank_main, args=(3, free_port(), [n1, n1, n2], out_dir, "grow"), nprocs=3)
    assert not services[0].pins._pins and not services[1].pins._pins
    sources = [open(os.path.join(out_dir, f"grow-{r}.source")).read().split()[0]
               for r in range(3)]
    assert sources == ["local", "local", "peer"]
    assert {f[1] for f in services[1].replicator.fetches} == {0, 1}


def _tier_rank_main(rank, world, port, sock, persist_dir, out_dir, phase):
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    from elasticd.worker.client import DaemonClient

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world)
    try:
        model, opt = _build()
        state = {"model": model, "optim": opt}
        if phase == "save":  # world 3 on one node, whose daemon persists every step
            with Checkpointer(transport=DaemonClient(sock), job="j", rank=rank,
                              world_size=world, local_world_size=world) as ckpt:
                for step in (1, 2, 3):
                    _train(model, opt, step, rank)
                    assert ckpt.save(step, state)
                    ckpt.wait()
            msd, osd = get_state_dict(model, opt)
            dcp.save({"model": msd, "optim": osd}, checkpoint_id=os.path.join(out_dir, "dcp"))
            return
        # World 2, every node's RAM gone and no daemon: only the tier (saved by 3) is left.
        with Checkpointer(transport=None, job="j", rank=rank, world_size=world,
                          persist_dir=persist_dir) as ckpt:
            assert ckpt.restore(state) == 3
            res = ckpt.last_restore
            assert (res.source, res.saved_world_size) == ("persistent", 3)
        ref_model, ref_opt = _build()
        ref = get_state_dict(ref_model, ref_opt)
        dcp.load({"model": ref[0], "optim": ref[1]}, checkpoint_id=os.path.join(out_dir, "dcp"))
        set_state_dict(ref_model, ref_opt, model_state_dict=ref[0], optim_state_dict=ref[1])
        _assert_bitwise(_local(model, opt), _local(ref_model, ref_opt),
                        f"rank {rank} resharded from the persistent tier against dcp.load")
        # The tier's step read by torch's own reader of safetensors checkpoints, at world 2:
        # what standard tools get without elasticd, the model and the optimizer's state by
        # the names get_state_dict gives them. The param groups (no tensors) are not in the
        # files, hence allow_partial_load; comparing every tensor with the reference shows
        # nothing else was left out (a fresh Adam's state is zeros).
        # The documented snippet itself, as a stranger would paste it (only the directory
        # filled in), on a fresh model and optimizer.
        from elasticd.persistence.tier import Tier

        hf_model, hf_opt = _build()
        snippet = _readme_dcp_snippet().replace(
            '"<persist-dir>/<job>/step-<generation>-<step>"',
            repr(Tier(persist_dir).step_dir("j", (0, 3))))
        exec(compile(snippet, "docs/worker-api.md", "exec"), {"model": hf_model, "optimizer": hf_opt})
        assert not _local(hf_model, hf_opt)["optim/0.weight/exp_avg"].eq(0).all()
        want = _local(ref_model, ref_opt)
        assert want and all(v.numel() for k, v in want.items() if "/step" not in k), want.keys()
        _assert_bitwise(_local(hf_model, hf_opt), want,
                        f"rank {rank}: dcp.load of the tier's files at world 2")
    finally:
        dist.destroy_process_group()


def _readme_dcp_snippet() -> str:
    """docs/worker-api.md's snippet loading the persistent tier with torch's own reader."""
    import re

    doc = open(os.path.join(os.path.dirname(__file__), "..", "..", "docs",
                            "worker-api.md")).read()
    blocks = [b for b in re.findall(r"```python\n(.*?)```", doc, re.S)
              if "HuggingFaceStorageReader" in b]
    assert len(blocks) == 1, "docs/worker-api.md has one snippet loading the tier with DCP"
    return blocks[0]


@pytest.mark.slow
def test_fsdp2_state_reshards_3_to_2_from_the_persistent_tier_like_dcp(tmp_path):
    from elasticd.daemon.local_api import LocalServer
    from elasticd.persistence.persister import Persister
    from elasticd.persistence.tier import Tier

    root = f"/dev/shm/elasticd-test-{uuid.uuid4().hex[:12]}"
    store = SlotStore(root)
    persister = Persister(str(tmp_path / "persist"), keep=3)
    server = LocalServer(str(tmp_path / "n1.sock"), CheckpointService(store, "n1",
                                                                       persister).handlers())
    server.start()
    try:
        spawn(_tier_rank_main, args=(3, free_port(), server.path, persister.root,
                                        str(tmp_path), "save"), nprocs=3)
        persister.flush(10)
    finally:
        server.stop()
        store.close()
        shutil.rmtree(root, ignore_errors=True)
    assert max((m.version(), m.world_size) for m in Tier(persister.root).complete_steps("j")) \
        == ((0, 3), 3)
    persister.close()
    spawn(_tier_rank_main, args=(2, free_port(), None, persister.root, str(tmp_path),
                                    "reshard"), nprocs=2)


def test_an_unsnapshottable_state_is_an_error_at_the_first_save_and_unprotects_the_job(
        tmp_path, caplog):
    root = f"/dev/shm/elasticd-test-{uuid.uuid4().hex[:12]}"
    store = SlotStore(root)
    svc = CheckpointService(store, "n1")
    try:
        t = InProcessTransport(svc.handlers())
        lazy = torch.nn.LazyLinear(3)  # its weight is an UninitializedParameter
        state = {"model": lazy, "optim": torch.optim.SGD(lazy.parameters(), lr=0.1)}
        with Checkpointer(every=10, transport=t, job="j", rank=0, world_size=1) as ckpt:
            with caplog.at_level(logging.ERROR, logger="elasticd.checkpoint"):
                with pytest.raises(UnsupportedValue, match="model/weight.*UninitializedParameter"):
                    ckpt.save(1, state)  # not a step to snapshot: checked all the same
        assert "cannot be snapshotted" in caplog.text
        status = svc.status()["j"]
        assert status["unprotected"] and status["unprotected_kind"] == "snapshots_failing"
        assert "UninitializedParameter" in status["unprotected_reason"]
        assert svc.stats().unprotected_jobs["snapshots_failing"] == 1
        assert "cannot be snapshotted" in svc.book.unprotected("j")
        assert store.versions("j", 0) == []
    finally:
        store.close()
        shutil.rmtree(root, ignore_errors=True)


def test_a_piece_read_in_place_is_copied_even_when_it_is_the_whole_target():
    """The pieces after the first may be views of a slot the daemon reuses after the load:
    the assembled shard never aliases one (the base piece is this rank's own copy)."""
    from elasticd.worker.shards import Resharder

    base = torch.zeros(2, 4)
    slot = torch.arange(8.0).reshape(2, 4)  # stands for a view of another rank's slot
    target = ((2, 0), (2, 4))
    got = Resharder._assemble("w", target, [(((0, 0), (2, 4)), base), (target, slot)],
                              torch.float32)
    assert torch.equal(got, slot) and got.data_ptr() != slot.data_ptr()
    mine = Resharder._assemble("w", target, [(target, base)], torch.float32)
    assert mine is base  # the same rows as saved: this rank's copy as it is


def test_a_new_shard_is_assembled_into_the_given_tensor():
    from elasticd.worker.shards import Resharder

    full = torch.arange(35.0).view(5, 7)
    chunks = [(((0, 0), (3, 7)), full[:3]), (((3, 0), (2, 7)), full[3:])]
    into = torch.zeros(3, 7)
    got = Resharder._assemble("w", ((2, 0), (3, 7)), chunks, torch.float32, into=into)
    assert got is into and torch.equal(into, full[2:5])
    whole = torch.zeros(3, 7)  # the same rows as saved: copied in too, not handed over
    assert Resharder._assemble("w", ((0, 0), (3, 7)), chunks, torch.float32,
                               into=whole) is whole and torch.equal(whole, full[:3])


def test_chunks_follow_torch_chunk_and_assembly_covers_every_element():
    from elasticd.worker.shards import Resharder, ShardMismatch, _chunk_1d, old_box

    for size in range(0, 13):
        for parts in range(1, 5):
            want = [(int(c[0]), len(c)) if len(c) else None
                    for c in torch.arange(size).chunk(parts)]
            got = [_chunk_1d(size, parts, i) for i in range(parts)]
            assert [g for g in got if g[1]] == [w for w in want if w], (size, parts)
    node = {"shape": [5, 7], "placements": ["S0"], "mesh": [3]}
    assert [old_box(node, q) for q in range(3)] == [((0, 0), (2, 7)), ((2, 0), (2, 7)),
                                                    ((4, 0), (1, 7))]
    assert old_box({**node, "mesh": [2, 2]}, 0) is None  # several mesh dims: ask each rank
    full = torch.arange(35.0).view(5, 7)
    chunks = [(old_box(node, q), full[old_box(node, q)[0][0]:][:old_box(node, q)[1][0]])
              for q in range(3)]
    got = Resharder._assemble("w", ((3, 0), (2, 7)), chunks, torch.float32)
    assert torch.equal(got, full[3:5])
    with pytest.raises(ShardMismatch, match="hold 7 of the 14"):
        Resharder._assemble("w", ((3, 0), (2, 7)), chunks[2:], torch.float32)


def _worker_api_snippet(heading: str) -> str:
    """The first python block under ``heading`` in docs/worker-api.md."""
    import re

    doc = open(os.path.join(os.path.dirname(__file__), "..", "..", "docs",
                            "worker-api.md")).read()
    section = doc.split(heading, 1)[1]
    return re.search(r"```python\n(.*?)```", section, re.S).group(1)


class _MetaModel(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = torch.nn.ModuleList(torch.nn.Linear(a, b) for a, b in zip(DIMS, DIMS[1:]))

    def forward(self, x):
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return x


def _meta_rank_main(rank, world, port, sock, out_dir, phase):
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    import elasticd
    from elasticd.worker.client import DaemonClient

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world)
    try:
        torch.manual_seed(0 if phase == "first" else 99)  # another init: restore must win
        ckpt = Checkpointer(transport=DaemonClient(sock), job="meta", rank=rank,
                            world_size=world)
        scope = {"torch": torch, "fully_shard": fully_shard, "elasticd": elasticd,
                 "build_model": _MetaModel, "device": "cpu", "ckpt": ckpt,
                 "sampler": elasticd.ElasticSampler(64)}
        if phase == "first":  # a model left on the meta device is refused, with the fix
            with torch.device("meta"):
                bare = _MetaModel()
            with pytest.raises(UnsupportedValue, match="meta device.*to_empty"):
                ckpt.save(1, {"model": bare})
        exec(compile(_worker_api_snippet("### FSDP2 with meta-device initialisation"),
                     "docs/worker-api.md", "exec"), scope)
        model, optim, state, step = (scope[k] for k in ("model", "optim", "state", "step"))
        assert all(not p.is_meta for p in model.parameters())
        if phase == "first":
            assert step == 0
            for step in range(1, 4):
                _train(model, optim, step, rank)
                assert ckpt.save(step, state)
                ckpt.wait()
            torch.save(_local(model, optim), os.path.join(out_dir, f"meta-{rank}.pt"))
        else:
            assert step == 3 and ckpt.last_restore.source == "local"
            _assert_bitwise(_local(model, optim),
                            torch.load(os.path.join(out_dir, f"meta-{rank}.pt")),
                            f"meta-device init, rank {rank}")
        ckpt.close()
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_the_documented_fsdp2_meta_device_init_restores_bitwise(daemons):
    """docs/worker-api.md's meta-device recipe, run as written: materialise, initialise, build
    the optimizer, restore; the second start initialises differently and restore wins."""
    services, (n1, _), out_dir = daemons
    spawn(_meta_rank_main, args=(2, free_port(), n1, out_dir, "first"), nprocs=2)
    spawn(_meta_rank_main, args=(2, free_port(), n1, out_dir, "again"), nprocs=2)
