"""The persistent tier: safetensors files standard tools read, atomic steps, keep-N, several
writers racing on one step, and the asynchronous persister's skip-when-busy policy."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import threading

import numpy as np
import pytest
import safetensors

from elasticd.snapshot.format import (
    CorruptSnapshot,
    SnapshotHeader,
    TensorSpec,
    TruncatedSnapshot,
    layout,
)
from elasticd.persistence import safetensors_file
from elasticd.persistence.persister import Persister
from elasticd.launcher import reachable
from elasticd.persistence.tier import MANIFEST, Tier
from tests.snapshot_entries import named
from tests.users import temporary_user

ARRAYS = {
    "model/w": np.linspace(-1, 1, 12, dtype=np.float32).reshape(3, 4),
    "model/b16": np.arange(6, dtype=np.uint16),  # bfloat16 bit patterns
    "optim/step": np.array(7, dtype=np.int64),
    "empty": np.zeros((0, 3), dtype=np.float32),
    "odd": np.arange(8, dtype=np.uint8),  # complex32: no safetensors dtype
}
DTYPES = {"model/b16": "bfloat16", "odd": "complex32"}


def snapshot(job="job", rank=0, world=2, step=3, generation=0, arrays=ARRAYS):
    specs = [TensorSpec(k, DTYPES.get(k, str(v.dtype)),
                        (2,) if k == "odd" else v.shape) for k, v in arrays.items()]
    lay = layout(specs, job=job, meta={})
    buf = bytearray(lay.total_size)
    for e in lay.entries:
        buf[e.offset : e.offset + e.nbytes] = arrays[e.name].tobytes()
    meta = {"v": 1, "objects": [["epoch", "value", 3]]}
    return SnapshotHeader(job, step, generation, rank, world, lay, meta), buf


class View:
    """Stands in for a pinned SnapshotView."""

    def __init__(self, header, buf):
        self.header, self.buffer, self.released = header, memoryview(buf), 0

    def release(self):
        self.released += 1


def test_rank_file_roundtrip_and_standard_readers(tmp_path):
    header, buf = snapshot()
    path = str(tmp_path / "rank-0.safetensors")
    nbytes, digest = safetensors_file.write(path, header, buf)
    assert os.path.getsize(path) == nbytes
    snap = safetensors_file.read(path, expect_bytes=nbytes, expect_xxh3=digest)
    assert (snap.job, snap.version(), snap.rank, snap.world_size) == ("job", (0, 3), 0, 2)
    assert snap.meta == header.meta
    assert [e.name for e in snap.layout.entries] == list(ARRAYS)
    for e in snap.layout.entries:
        assert bytes(snap.buffer[e.offset : e.offset + e.nbytes]) == ARRAYS[e.name].tobytes()
    assert named(snap.layout, "odd").dtype == "complex32"

    import safetensors.torch
    import torch

    loaded = safetensors.torch.load_file(path)  # no elasticd involved
    # Keyed as torch.distributed.checkpoint names the same values ("/" read as ".").
    assert loaded["model.b16"].dtype == torch.bfloat16
    assert loaded["model.b16"].view(torch.uint16).tolist() == list(range(6))
    assert torch.equal(loaded["model.w"], torch.from_numpy(ARRAYS["model/w"]))
    assert loaded["optim.step"].item() == 7 and loaded["empty"].shape == (0, 3)
    assert loaded["odd"].dtype == torch.uint8  # stored as bytes, true dtype in our metadata
    with safetensors.safe_open(path, "np") as f:
        info = json.loads(f.metadata()["elasticd"])
        sharding = json.loads(f.metadata()["DCP_SHARDING_INFO"])
    assert info["raw"] == {"odd": ["complex32", [2]]}
    # Whole tensors start at the origin of their global tensor, one offset per dimension.
    assert sharding["model.w"] == {"saved_offsets": [0, 0]}
    assert sharding["optim.step"] == {"saved_offsets": []}


def test_keys_for_dcp_stay_unique_when_dotted_names_clash():
    assert safetensors_file.dcp_keys(["model/a.b", "model/a/b", "x"]) == [
        "model.a.b", "model/a/b", "x"]
    assert safetensors_file.dcp_keys(["a/b", "a.b", "a.b~2"]) == ["a.b", "a.b~2", "a.b~2~2"]
    assert safetensors_file.dcp_keys(["__metadata__"]) == ["__metadata__~2"]


def test_an_optimizers_state_is_keyed_by_its_parameters_names_for_dcp():
    names = ["model/0.weight", "optim/state/0/exp_avg", "optim/state/1/step",
             "optim/state/2/exp_avg", "optim/param_groups/0/params/0", "other/state/0/x"]
    meta = {"param_names": {"optim": ["0.weight", "2.bias"], "other": "junk"}}
    assert safetensors_file.dcp_keys(names, meta) == [
        "model.0.weight", "optim.state.0.weight.exp_avg", "optim.state.2.bias.step",
        "optim.state.2.exp_avg", "optim.param_groups.0.params.0", "other.state.0.x"]
    # The meta is the job's: malformed names are ignored, keys stay unique.
    for junk in ({"param_names": ["a"]}, {"param_names": {"optim": [1, None]}},
                 {"param_names": {"optim": [""]}}, "meta", None):
        assert safetensors_file.dcp_keys(names[:2], junk) == ["model.0.weight",
                                                             "optim.state.0.exp_avg"]
    clash = {"param_names": {"optim": ["x"]}}
    assert safetensors_file.dcp_keys(["optim/state/x/m", "optim/state/0/m"], clash) == [
        "optim.state.x.m", "optim/state/0/m"]


def test_a_sharded_entry_records_its_offsets_for_dcp(tmp_path):
    header, buf = snapshot()
    meta = {"v": 1, "objects": [["model", "module", {"@": "dict", "k": ["w"], "v": [
        {"@": "dtensor", "i": 0, "shape": [9, 4], "offsets": [6, 0], "placements": ["S0"],
         "mesh": [3], "dims": []}]}]]}
    path = str(tmp_path / "rank-2.safetensors")
    safetensors_file.write(path, dataclasses.replace(header, meta=meta), buf)
    with safetensors.safe_open(path, "np") as f:
        sharding = json.loads(f.metadata()["DCP_SHARDING_INFO"])
    assert sharding["model.w"] == {"saved_offsets": [6, 0]}  # rows 6-8 of a (9, 4) tensor
    assert sharding["model.b16"] == {"saved_offsets": [0]}
    # The meta is the worker's: offsets that are not one natural number per dimension are
    # not passed on to DCP.
    meta["objects"][0][2]["v"][0]["offsets"] = ["6", 0]
    safetensors_file.write(path + ".bad", dataclasses.replace(header, meta=meta), buf)
    with safetensors.safe_open(path + ".bad", "np") as f:
        assert json.loads(f.metadata()["DCP_SHARDING_INFO"])["model.w"] == {
            "saved_offsets": [0, 0]}


def test_a_file_of_format_1_is_still_read(tmp_path):
    # Written before keys followed DCP's names: tensors keyed by entry name, no "keys".
    header, buf = snapshot()
    path = str(tmp_path / "r.safetensors")
    safetensors_file.write(path, header, buf)
    data = open(path, "rb").read()
    (hlen,) = safetensors_file._LEN.unpack_from(data)
    head = json.loads(data[8 : 8 + hlen])
    info = json.loads(head["__metadata__"]["elasticd"])
    old = {name: head[key] for name, key in zip(info["names"], info["keys"])}
    del info["keys"]
    info["format"] = 1
    old["__metadata__"] = {"elasticd": json.dumps(info)}
    body = json.dumps(old).encode()
    body += b" " * (-len(body) % 8)
    v1 = safetensors_file._LEN.pack(len(body)) + body + data[8 + hlen :]
    snap = safetensors_file.parse(v1, "v1 file")
    assert [e.name for e in snap.layout.entries] == list(ARRAYS)
    for e in snap.layout.entries:
        assert bytes(v1[e.offset : e.offset + e.nbytes]) == ARRAYS[e.name].tobytes()


def test_numpy_reader_loads_files_without_bfloat16(tmp_path):
    import safetensors.numpy

    arrays = {k: v for k, v in ARRAYS.items() if k not in DTYPES}
    header, buf = snapshot(arrays=arrays)
    path = str(tmp_path / "r.safetensors")
    safetensors_file.write(path, header, buf)
    loaded = safetensors.numpy.load_file(path)
    assert np.array_equal(loaded["model.w"], arrays["model/w"])


def test_altered_or_short_files_are_refused(tmp_path):
    header, buf = snapshot()
    path = str(tmp_path / "r.safetensors")
    nbytes, digest = safetensors_file.write(path, header, buf)
    with open(path, "r+b") as f:
        f.seek(nbytes - 3)
        f.write(b"\xff")
    with pytest.raises(CorruptSnapshot, match="xxh3"):
        safetensors_file.read(path, expect_bytes=nbytes, expect_xxh3=digest)
    os.truncate(path, nbytes - 10)
    with pytest.raises(TruncatedSnapshot):
        safetensors_file.read(path, expect_bytes=nbytes, expect_xxh3=digest)
    with pytest.raises(TruncatedSnapshot):
        safetensors_file.read(path)  # no manifest record: the header itself tells
    with pytest.raises(CorruptSnapshot):
        safetensors_file.parse(b"\x08\x00\x00\x00\x00\x00\x00\x00{}      ")


def write_step(tier, step, ranks, world=2, generation=0):
    for rank in ranks:
        tier.write_rank(*snapshot(rank=rank, world=world, step=step, generation=generation))
    return tier.try_finish("job", (generation, step))


def test_step_is_complete_only_when_every_rank_is_written(tmp_path):
    tier = Tier(str(tmp_path))
    assert write_step(tier, 3, [0]) is False
    assert tier.complete_steps("job") == []
    assert write_step(tier, 3, [1]) is True
    [m] = tier.complete_steps("job")
    assert m.version() == (0, 3) and sorted(m.ranks) == [0, 1]
    assert tier.read("job", (0, 3), 1).rank == 1
    assert tier.try_finish("job", (0, 3)) is False  # created exactly once


def test_crash_between_files_leaves_no_manifest(tmp_path, monkeypatch):
    tier = Tier(str(tmp_path))
    real = safetensors_file.write
    calls = []

    def crash_on_second(path, header, buf, mode=0o600):
        calls.append(header.rank)
        if len(calls) == 2:
            with open(path, "wb") as f:
                f.write(b"half")  # what a crash mid-write leaves
            raise OSError("killed")
        return real(path, header, buf, mode)

    monkeypatch.setattr(safetensors_file, "write", crash_on_second)
    with pytest.raises(OSError):
        write_step(tier, 5, [0, 1])
    directory = tier.step_dir("job", (0, 5))
    names = sorted(os.listdir(directory))
    assert MANIFEST not in names and "rank-1.json" not in names
    assert "rank-1.safetensors" not in names  # only a temporary, never the final name
    assert tier.complete_steps("job") == []
    with pytest.raises(Exception, match="no complete persisted copy"):
        tier.read("job", (0, 5), 0)


def test_keep_n_newest_complete_and_prune_abandoned(tmp_path):
    tier = Tier(str(tmp_path))
    write_step(tier, 1, [0])  # abandoned: rank 1 never came
    for step in (2, 3, 4, 5):
        write_step(tier, step, [0, 1])
    write_step(tier, 6, [0])  # in progress on another node: must survive
    os.makedirs(os.path.join(tier.job_dir("job"), ".trash-dead", "x"))  # a crashed pruner's
    removed = tier.prune("job", keep=2)
    assert sorted(removed) == [(0, 1), (0, 2), (0, 3)]
    assert [m.version() for m in tier.complete_steps("job")] == [(0, 5), (0, 4)]
    assert sorted(os.listdir(tier.job_dir("job"))) == ["step-0-4", "step-0-5", "step-0-6"]


def test_generation_orders_steps(tmp_path):
    tier = Tier(str(tmp_path))
    write_step(tier, 9, [0, 1], generation=0)
    write_step(tier, 4, [0, 1], generation=1)  # a restore fell back; step 9 is abandoned
    assert [m.version() for m in tier.complete_steps("job")] == [(1, 4), (0, 9)]


def test_concurrent_writers_create_one_manifest_per_step(tmp_path):
    """Two nodes (each its own Tier) write their halves of the same steps at the same time."""
    nodes = [Tier(str(tmp_path), node_id=f"n{i}") for i in range(2)]
    steps = range(1, 31)
    created = {n: [] for n in range(2)}
    barrier = threading.Barrier(2)

    def node(i):
        for step in steps:
            barrier.wait()
            for rank in (2 * i, 2 * i + 1):
                nodes[i].write_rank(*snapshot(rank=rank, world=4, step=step))
            if nodes[i].try_finish("job", (0, step)):
                created[i].append(step)

    threads = [threading.Thread(target=node, args=(i,)) for i in range(2)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(60)
    winners = sorted(created[0] + created[1])
    # Each step's manifest was created once; a step both missed would be completed on listing.
    assert len(winners) == len(set(winners))
    complete = nodes[0].complete_steps("job")
    assert sorted(m.step for m in complete) == list(steps)
    assert all(sorted(m.ranks) == [0, 1, 2, 3] for m in complete)
    leftovers = [n for s in steps for n in os.listdir(nodes[0].step_dir("job", (0, s)))
                 if n.endswith(".tmp")]
    assert leftovers == []


def test_listing_repairs_a_step_both_writers_missed(tmp_path):
    tier = Tier(str(tmp_path))
    for rank in (0, 1):  # markers written, but nobody saw both: no manifest yet
        tier.write_rank(*snapshot(rank=rank, step=8))
    assert tier.manifest("job", (0, 8)) is None
    assert [m.version() for m in tier.complete_steps("job")] == [(0, 8)]


@pytest.mark.skipif(os.geteuid() != 0, reason="gives files to another user: needs root (CI is)")
def test_a_step_the_daemon_repairs_stays_readable_by_the_jobs_user(tmp_path):
    """The daemon lists the tier with no job at hand (uid None): the manifest it writes goes to
    the user the markers belong to, or the job's workers never see the step."""
    reachable(str(tmp_path))
    tier = Tier(str(tmp_path))
    with temporary_user("edp") as user:
        for rank in (0, 1):
            tier.write_rank(*snapshot(rank=rank, step=8), uid=user.pw_uid)
        assert [m.version() for m in tier.complete_steps("job")] == [(0, 8)]
        manifest = os.path.join(tier.step_dir("job", (0, 8)), MANIFEST)
        assert os.stat(manifest).st_uid == user.pw_uid
        read = subprocess.run([sys.executable, "-c", f"open({manifest!r}, 'rb').read()"],
                              user=user.pw_uid, group=user.pw_gid, capture_output=True,
                              text=True, timeout=60)
        assert read.returncode == 0, read.stderr


def test_persister_flushes_in_background_and_skips_when_busy(tmp_path, monkeypatch):
    flushed = []
    persister = Persister(str(tmp_path), keep=2, on_flushed=flushed.append)
    gate = threading.Event()
    real = persister.tier.write_rank

    def slow(header, buf, uid=None):
        gate.wait(10)
        return real(header, buf, uid)

    monkeypatch.setattr(persister.tier, "write_rank", slow)
    try:
        first = [View(*snapshot(rank=r, step=2)) for r in (0, 1)]
        assert persister.submit("job", first) is True
        busy = [View(*snapshot(rank=r, step=3)) for r in (0, 1)]
        assert persister.submit("job", busy) is False
        assert [v.released for v in busy] == [1, 1]  # released at once when skipped
        gate.set()
        assert persister.flush(10)
        assert all(v.released for v in first)
        assert persister.persisted("job") == (0, 2)
        assert flushed[0].nbytes > 0 and not flushed[0].error
    finally:
        gate.set()
        persister.close()


def test_persister_policy(tmp_path):
    from elasticd.testing.clock import FakeClock

    clock = FakeClock()
    p = Persister(str(tmp_path), every_steps=5, every_seconds=60, clock=clock)
    try:
        assert p.due("job", 10)
        assert p.due("job", 3)  # nothing flushed yet: the time rule says go
        assert p.submit("job", [View(*snapshot(rank=r, step=3)) for r in (0, 1)])
        p.flush(10)
        assert not p.due("job", 4) and p.due("job", 5)
        clock.advance(61)
        assert p.due("job", 6)
    finally:
        p.close()
    with pytest.raises(ValueError, match="keep"):
        Persister(str(tmp_path), keep=0)


def test_nodes_that_flushed_different_steps_once_meet_again_by_time(tmp_path):
    """``every_seconds`` on two nodes: B starts flushing one commit later than A (joined late,
    or its writer was busy). T after each node's own last flush kept them a commit apart for
    good (A 1, 11, 21, 31; B 2, 12, 22, 32: no step ever complete); periods of the wall clock
    bring them back to the same steps."""
    from elasticd.testing.clock import FakeClock

    flushed: dict[str, list[int]] = {"a": [], "b": []}
    for name, first, late in (("a", 1, 0.0), ("b", 2, 0.01)):
        clock = FakeClock()
        p = Persister(str(tmp_path / name), every_seconds=10, clock=clock)
        try:
            for step in range(first, 40):  # a commit a second, B learns each 10 ms later
                clock.advance(step + 0.5 + late - clock.monotonic() + 1_000)
                if p.due("job", step):
                    assert p.submit("job", [View(*snapshot(rank=0, world=1, step=step))])
                    assert p.flush(10)
                    flushed[name].append(step)
        finally:
            p.close()
    assert flushed["a"][0] == 1 and flushed["b"][0] == 2
    assert flushed["a"][1:] == flushed["b"][1:] and len(flushed["a"]) >= 4


def test_a_skipped_multiple_moves_the_flush_to_the_next_step_offered(tmp_path):
    p = Persister(str(tmp_path), every_steps=5)
    try:
        # Steps 5 and 10 were never offered (their snapshots were skipped): 6 and 12 go instead.
        assert [s for s in (1, 2, 3, 6, 7, 8, 12, 13, 15, 16) if p.due("job", s)] == [6, 12, 15]
        # A new generation restarts from an older step: 10 is due, and 16 stands in for 15.
        assert [s for s in (9, 10, 11, 14, 16) if p.due("job", s)] == [10, 16]
        assert [s for s in (4, 6) if p.due("other", s)] == [6]  # per job
    finally:
        p.close()


def test_failed_flush_is_reported_not_raised(tmp_path, monkeypatch):
    flushed = []
    p = Persister(str(tmp_path), on_flushed=flushed.append)
    monkeypatch.setattr(p.tier, "write_rank", lambda *a: (_ for _ in ()).throw(OSError("full")))
    try:
        views = [View(*snapshot(rank=0, step=1))]
        assert p.submit("job", views)
        p.flush(10)
        assert "full" in flushed[0].error and p.persisted("job") is None
        assert views[0].released
    finally:
        p.close()


@pytest.mark.parametrize("field,value", [("bytes", "lots"), ("xxh3_64", 12),
                                         ("xxh3_64", "not-hex-at-all!!"), ("file", None)])
def test_a_malformed_manifest_makes_the_restore_fall_back_not_crash(tmp_path, field, value):
    pytest.importorskip("torch")  # the worker's restore; installed in CI
    from elasticd.worker.sources import Sources

    tier = Tier(str(tmp_path))
    header, buf = snapshot(world=1)
    tier.write_rank(header, buf)
    assert tier.try_finish("job", header.version())
    path = os.path.join(tier.step_dir("job", header.version()), MANIFEST)
    with open(path) as f:
        raw = json.load(f)
    raw["ranks"][0][field] = value
    os.unlink(path)
    with open(path, "w") as f:
        json.dump(raw, f)
    sources = Sources(None, "job", 0, 1, str(tmp_path))
    sources.persisted = {header.version()}  # listed just before the manifest went bad
    refused: list[str] = []
    assert sources.fetch(header.version(), refused) is None  # raised on the worker before
    assert len(refused) == 1 and refused[0].startswith("persistent step (0, 3)")
    assert tier.manifest("job", header.version()) is None  # nor listed as complete


def test_new_job_and_step_directories_are_fsynced_into_their_parents(tmp_path, monkeypatch):
    synced: list[str] = []
    real = os.fsync

    def spy(fd):
        synced.append(os.readlink(f"/proc/self/fd/{fd}"))
        real(fd)

    monkeypatch.setattr(os, "fsync", spy)
    tier = Tier(str(tmp_path / "tier"))
    header, buf = snapshot(world=1)
    tier.write_rank(header, buf)
    for directory in (str(tmp_path / "tier"), tier.job_dir("job"),
                      tier.step_dir("job", header.version())):
        assert directory in synced, synced
    assert synced.index(str(tmp_path / "tier")) < synced.index(tier.job_dir("job"))
