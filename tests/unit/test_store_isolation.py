"""Snapshots under a root daemon, attacked by other local users: the shared-memory roots, the slot
files, the descriptors workers map, and the persistent tier's files, kept out of every reach but
the daemon's and (through what the daemon hands over) the job's own.

Each attack runs as a real second (and third) uid, made for the test with ``setpriv`` (no
account is added to the machine), so these tests need root: CI runs as root and none may skip.
"""

from __future__ import annotations

import glob
import json
import os
import shutil
import stat
import subprocess
import sys
import tempfile
import textwrap
import uuid

import numpy as np
import pytest

from elasticd.snapshot.format import SnapshotHeader, TensorSpec, layout
from elasticd.store.service import CheckpointService
from elasticd.store.shm import SlotStore
from elasticd.testing.transport import InProcessTransport
from elasticd.persistence.tier import Tier, TierError
from elasticd.replication.shm_sink import replica_root

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="CI runs as root: these need root "
                                "to act as a second uid")  # never skipped in CI

ROOT_ONLY = 0o700
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture
def users():
    """Two uids with no account, no group and no file on this machine: two jobs' users (or a
    job's user and another local user)."""
    import pwd

    base = 61000 + os.getpid() % 2000 * 2
    uids = [u for u in range(base, base + 50) if not _exists(pwd.getpwuid, u)][:2]
    assert len(uids) == 2
    return uids


def _exists(lookup, key) -> bool:
    try:
        lookup(key)
        return True
    except KeyError:
        return False


def run_as(uid: int, code: str, *args: str, stdin: bytes = b"") -> dict:
    """Runs ``code`` (Python) as ``uid``; returns the JSON it prints last."""
    proc = subprocess.run(
        ["setpriv", f"--reuid={uid}", f"--regid={uid}", "--clear-groups", sys.executable,
         "-c", textwrap.dedent(code), *args], input=stdin, capture_output=True, cwd="/",
        timeout=120, env={"PATH": "/usr/bin:/bin", "HOME": "/nonexistent",
                          "PYTHONPATH": REPO})
    assert proc.returncode == 0, proc.stderr.decode()
    return json.loads(proc.stdout.decode().splitlines()[-1])


# Tries to open each path (read-write for "rw", read-only for "ro"); prints what happened.
PROBE = """
    import json, os, sys
    out = {}
    for path in sys.argv[1:]:
        for mode, flags in (("ro", os.O_RDONLY), ("rw", os.O_RDWR)):
            try:
                os.close(os.open(path, flags))
                out[path + ":" + mode] = "opened"
            except OSError as exc:
                out[path + ":" + mode] = exc.strerror
    print(json.dumps(out))
"""


def sealed_snapshot(job: str, rank: int, step: int, values: float) -> bytes:
    """The bytes of a complete, checksummed slot file — what anybody can craft, since the
    checksums are not keyed."""
    scratch = f"/dev/shm/elasticd-test-craft-{uuid.uuid4().hex[:12]}"
    store = SlotStore(scratch)
    try:
        arr = np.full(1000, values, np.float32)
        lay = layout([TensorSpec("w", "float32", (1000,))], job=job, meta={})
        header = SnapshotHeader(job, step, 0, rank, 1, lay, {})
        slot = store.reserve(job, rank, lay.total_size)
        e = lay.entries[0]
        slot.buffer[e.offset : e.offset + e.nbytes] = arr.tobytes()
        store.complete(slot, header)
        with open(slot.path, "rb") as f:
            return f.read()
    finally:
        store.close()


PLANT = """
    import json, os, sys
    root, kind = sys.argv[1], sys.argv[2]
    tree = root if kind == "dir" else root + ".mine"
    os.makedirs(os.path.join(tree, "job", "0"))
    for d in (tree, os.path.join(tree, "job"), os.path.join(tree, "job", "0")):
        os.chmod(d, 0o777)
    path = os.path.join(tree, "job", "0", "0.slot")
    with open(path, "wb") as f:
        f.write(sys.stdin.buffer.read())
    os.chmod(path, 0o666)
    if kind == "symlink":
        os.symlink(tree, root)
    print(json.dumps({"planted": path}))
"""


@pytest.mark.parametrize("kind", ["dir", "symlink"])
@pytest.mark.parametrize("sibling", ["local", "replicas"])
def test_a_planted_shm_root_is_moved_aside_and_nothing_in_it_is_adopted(users, kind, sibling):
    attacker = users[0]
    base = f"/dev/shm/elasticd-test-plant-{uuid.uuid4().hex[:12]}"
    root = base if sibling == "local" else replica_root(base)
    try:
        run_as(attacker, PLANT, root, kind, stdin=sealed_snapshot("job", 0, 1_000_000, 66.0))
        store = SlotStore(root)
        try:
            found = store.scan()
            assert found.kept == [] and store.holdings() == [] and store.versions("job", 0) == []
            st = os.lstat(root)
            assert stat.S_ISDIR(st.st_mode) and st.st_uid == os.geteuid()
            assert stat.S_IMODE(st.st_mode) == ROOT_ONLY
            slot = store.reserve("job", 0, 4096)
            assert os.path.realpath(slot.path).startswith(root + "/")  # not in the planted tree
            assert os.stat(slot.path).st_uid == os.geteuid()
            assert len(glob.glob(f"{root}.foreign-*")) == 1  # the planted entry, moved aside
            seen = run_as(attacker, PROBE, slot.path)
            assert seen == {slot.path + ":ro": "Permission denied",
                            slot.path + ":rw": "Permission denied"}
        finally:
            store.close()
    finally:
        for path in glob.glob(f"{base}*"):
            if os.path.isdir(path) and not os.path.islink(path):
                shutil.rmtree(path)
            else:
                os.unlink(path)


def test_a_root_owned_by_the_daemon_but_writable_by_others_is_not_trusted():
    root = f"/dev/shm/elasticd-test-open-{uuid.uuid4().hex[:12]}"
    os.makedirs(os.path.join(root, "job", "0"))
    os.chmod(root, 0o777)
    with open(os.path.join(root, "job", "0", "0.slot"), "wb") as f:
        f.write(sealed_snapshot("job", 0, 5, 1.0))
    try:
        store = SlotStore(root)
        try:
            assert store.scan().kept == []
            assert stat.S_IMODE(os.stat(root).st_mode) == ROOT_ONLY
        finally:
            store.close()
    finally:
        for path in glob.glob(f"{root}*"):
            shutil.rmtree(path)


def test_a_restarted_daemon_still_adopts_its_own_slots():
    root = f"/dev/shm/elasticd-test-own-{uuid.uuid4().hex[:12]}"
    store = SlotStore(root)
    try:
        t = InProcessTransport(CheckpointService(store, "n1").handlers())
        reply = t.call("ckpt_reserve", job="job", rank=0, world_size=1, nbytes=5000)
        _drop_fds(reply)
        store.close(unlink=False)
        again = SlotStore(root)
        assert again.scan().kept == [] and again.bytes_held() == 0  # a torn slot goes
        again.close(unlink=False)
        os.makedirs(os.path.join(root, "job", "0"), exist_ok=True)
        with open(os.path.join(root, "job", "0", "7.slot"), "wb") as f:
            f.write(sealed_snapshot("job", 0, 9, 3.0))
        os.chmod(os.path.join(root, "job", "0", "7.slot"), 0o600)
        again = SlotStore(root)
        assert again.scan().kept == [("job", 0, 0, 9)]
        again.close()
    finally:
        shutil.rmtree(root, ignore_errors=True)


def test_job_users_reach_no_slot_by_path_their_own_or_another_jobs(users):
    a, b = users
    root = f"/dev/shm/elasticd-test-jobs-{uuid.uuid4().hex[:12]}"
    store = SlotStore(root)
    try:
        service = CheckpointService(store, "n1")
        paths = []
        for job, uid in (("ja", a), ("jb", b)):
            t = InProcessTransport(service.handlers(), uid=uid)
            reply = t.call("ckpt_reserve", job=job, rank=0, world_size=1, nbytes=5000)
            _drop_fds(reply)
            paths.append(reply["path"])
        for uid in (a, b):
            seen = run_as(uid, PROBE, *paths)
            assert set(seen.values()) == {"Permission denied"}, seen
        owners = {os.lstat(os.path.join(d, n)).st_uid for d, dirs, names in os.walk(root)
                  for n in dirs + names}
        assert owners == {os.geteuid()}
    finally:
        store.close()


def test_a_worker_maps_the_slot_the_daemon_verified_not_what_the_path_names_later():
    """Whoever can write the slot's directory swaps the file after the daemon verified it and
    before the worker maps it: the worker must still load the verified bytes."""
    torch = pytest.importorskip("torch")  # the worker side; installed in CI
    from elasticd.worker.sources import Sources

    root = f"/dev/shm/elasticd-test-swap-{uuid.uuid4().hex[:12]}"
    store = SlotStore(root)
    try:
        service = CheckpointService(store, "n1")
        handlers = service.handlers()
        t = InProcessTransport(handlers)
        good = sealed_snapshot("job", 0, 3, 1.0)  # the real snapshot: w = 1.0
        forged = sealed_snapshot("job", 0, 3, 666.0)  # same step, checksums recomputed
        reply = t.call("ckpt_reserve", job="job", rank=0, world_size=1, nbytes=len(good))
        _drop_fds(reply)
        slot = service.book.jobs["job"].slots[0]
        slot.buffer[: len(good)] = good
        store.complete(slot, _header_of(good))

        def open_then_swap(msg):
            out = handlers["ckpt_open"](msg)  # verified here
            tmp = out["path"] + ".swap"
            with open(tmp, "wb") as f:
                f.write(forged)
            os.rename(tmp, out["path"])  # ... and replaced before the worker maps it
            return out

        t.handlers["ckpt_open"] = open_then_swap
        sources = Sources(t, "job", 0, 1)
        assert sources.discover() == [(0, 3)]
        refused: list[str] = []
        got = sources.fetch((0, 3), refused)
        assert got is not None, refused
        assert torch.equal(got.tensors[0], torch.full((1000,), 1.0)), "mapped the swapped file"
    finally:
        store.close()


def _drop_fds(reply: dict) -> None:
    for fd in reply.pop("_fds", ()):
        os.close(fd)


def _header_of(raw: bytes) -> SnapshotHeader:
    from elasticd.snapshot.reader import parse_header

    return parse_header(memoryview(raw), job="job", rank=0, where="test")


# -- a job running as its own user, end to end through the daemon's socket --------------------

WORKER = """
    import json, os, sys
    import torch
    from elasticd.worker.checkpointer import Checkpointer
    from elasticd.worker.client import DaemonClient

    def open_fds():
        return len(os.listdir("/proc/self/fd"))

    client = DaemonClient(sys.argv[1])
    state = {"w": torch.zeros(4096)}
    with Checkpointer(transport=client, job="ja", rank=0, world_size=1,
                      local_world_size=1) as ckpt:
        assert ckpt.restore(state) == 0
        fds = []
        for step in range(1, 21):
            state["w"].fill_(float(step))
            assert ckpt.save(step, state)
            ckpt.wait()
            fds.append(open_fds())
        stats = dict(ckpt.stats)
    fresh = {"w": torch.zeros(4096)}
    with Checkpointer(transport=client, job="ja", rank=0, world_size=1,
                      local_world_size=1) as ckpt:
        step = ckpt.restore(fresh)
        source = ckpt.last_restore.source
    print(json.dumps({"uid": os.geteuid(), "step": step, "source": source,
                      "w": float(fresh["w"].min()), "saves": stats["saves"],
                      "failed": stats["failed"], "fds": [fds[1], fds[-1]]}))
"""


def test_a_job_running_as_another_uid_snapshots_and_restores_through_descriptors(users):
    from elasticd.daemon.local_api import LocalServer
    from elasticd.daemon.local_binding import CallerBinding
    from elasticd.local.job_scope import JobScope, start_time

    uid = users[0]
    root = f"/dev/shm/elasticd-test-e2e-{uuid.uuid4().hex[:12]}"
    sockdir = tempfile.mkdtemp(prefix="elasticd-test-sock-")
    os.chmod(sockdir, 0o711)
    store = SlotStore(root)
    # The job's processes descend from this test's process, as a job's from its agent.
    scope = JobScope("ja", uid, {os.getpid(): start_time(os.getpid())})
    server = LocalServer(os.path.join(sockdir, "d.sock"), CheckpointService(store, "n1")
                         .handlers(), binding=CallerBinding(lambda: scope))
    server.start()
    try:
        out = run_as(uid, WORKER, server.path)
        assert out["uid"] == uid
        assert (out["saves"], out["failed"]) == (20, 0)
        assert (out["step"], out["source"], out["w"]) == (20, "local", 20.0)
        assert out["fds"][0] == out["fds"][1], "descriptors leak per save"
        assert store.versions("ja", 0)[0] == (0, 20)
        owners = {os.lstat(os.path.join(d, n)).st_uid for d, dirs, names in os.walk(root)
                  for n in dirs + names}
        assert owners == {os.geteuid()}  # nothing handed to the job's user but descriptors
        assert stat.S_IMODE(os.stat(root).st_mode) == ROOT_ONLY
    finally:
        server.stop()
        store.close()
        shutil.rmtree(sockdir, ignore_errors=True)


def test_a_reservation_sends_no_descriptor_for_a_slot_the_worker_still_maps():
    root = f"/dev/shm/elasticd-test-mapped-{uuid.uuid4().hex[:12]}"
    store = SlotStore(root)
    try:
        t = InProcessTransport(CheckpointService(store, "n1").handlers())
        seen = []
        for _ in range(4):  # nothing completes: the same slot each time
            reply = t.call("ckpt_reserve", job="j", rank=0, world_size=1, nbytes=5000,
                           mapped=seen)
            for fd in reply.pop("_fds", ()):
                st = os.fstat(fd)
                os.close(fd)
                assert [st.st_dev, st.st_ino] == reply["file"]
                seen.append(reply["file"])
            assert reply["file"] in seen
        assert len(seen) == 1  # one descriptor for the file, none after
        again = t.call("ckpt_reserve", job="j", rank=0, world_size=1, nbytes=5000,
                       mapped=[[0, 1], "junk"])
        assert len(again["_fds"]) == 1  # a worker that maps nothing gets one again
        _drop_fds(again)
    finally:
        store.close()


def _open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def test_descriptors_of_late_and_one_way_replies_are_closed_on_both_sides(tmp_path):
    import threading

    from elasticd.daemon.local_api import LocalServer
    from elasticd.worker.client import DaemonClient, DaemonTimeout

    target = tmp_path / "file"
    target.write_bytes(b"payload")
    gate = threading.Event()

    def give(msg):
        if msg.get("wait"):
            gate.wait(10)
        return {"n": msg.get("n", 0), "_fds": [os.open(target, os.O_RDONLY)]}

    before = _open_fds()
    server = LocalServer(str(tmp_path / "s.sock"), {"give": give})
    server.start()
    client = DaemonClient(server.path)
    try:
        with pytest.raises(DaemonTimeout):
            client.call("give", wait=True, timeout=0.2)
        gate.set()
        reply = client.call("give", n=2)  # the late reply, with its descriptor, comes first
        assert reply["n"] == 2 and len(reply["_fds"]) == 1
        assert os.pread(reply["_fds"][0], 7, 0) == b"payload"
        os.close(reply["_fds"][0])
        assert client.send("give", n=3)  # one-way: the daemon has nobody to hand it to
        last = client.call("give", n=4)
        assert last["n"] == 4
        os.close(last["_fds"][0])
    finally:
        client.close()
        server.stop()
    assert _open_fds() == before


# -- the persistent tier -------------------------------------------------------------------


def _persisted(job: str, step: int, fill: float, world: int = 1):
    lay = layout([TensorSpec("w", "float32", (8,))], job=job, meta={})
    buf = bytearray(lay.total_size)
    e = lay.entries[0]
    buf[e.offset : e.offset + e.nbytes] = np.full(8, fill, np.float32).tobytes()
    return SnapshotHeader(job, step, 0, 0, world, lay, {}), buf


@pytest.fixture
def shared_tier():
    """A tier root every local user can reach (as on a shared filesystem)."""
    path = tempfile.mkdtemp(prefix="elasticd-test-tier-")
    os.chmod(path, 0o755)
    try:
        yield path
    finally:
        shutil.rmtree(path)


PLANT_STEP = """
    import json, os, sys
    mine, theirs, their_file = sys.argv[1:4]
    out = {}
    try:
        os.symlink(theirs, mine)
        out["plant"] = "planted"
    except OSError as exc:
        out["plant"] = exc.strerror
    try:
        open(their_file, "rb").read()
        out["read"] = "read"
    except OSError as exc:
        out["read"] = exc.strerror
    print(json.dumps(out))
"""

WRITE_INTO = """
    import json, os, sys
    out = {}
    for path in sys.argv[1:]:
        try:
            with open(path, "wb") as f:
                f.write(b"x")
            out[path] = "written"
        except OSError as exc:
            out[path] = exc.strerror
    print(json.dumps(out))
"""


def test_one_jobs_persisted_files_are_out_of_another_jobs_reach(users, shared_tier):
    a, b = users
    tier = Tier(shared_tier)
    for job, uid in (("ja", a), ("jb", b)):
        tier.write_rank(*_persisted(job, 1, 1.0), uid=uid)
        assert tier.try_finish(job, (0, 1), uid=uid)
    theirs = tier.step_dir("jb", (0, 1))
    their_file = os.path.join(theirs, "rank-0.safetensors")
    # Job A's user points its next step at job B's step, then waits for the root daemon.
    seen = run_as(a, PLANT_STEP, tier.step_dir("ja", (0, 2)), theirs, their_file)
    assert seen["read"] == "Permission denied"
    try:
        tier.write_rank(*_persisted("ja", 2, 2.0), uid=a)
    except TierError:
        pass  # refusing to write through the planted link is fine too
    st = os.lstat(theirs)
    assert st.st_uid in (b, os.geteuid()) and not st.st_mode & 0o022
    assert st.st_uid != a, "the daemon gave job B's step to job A's user"
    new_file = os.path.join(theirs, "intruder")
    seen = run_as(a, WRITE_INTO, their_file, new_file)
    assert seen == {their_file: "Permission denied", new_file: "Permission denied"}
    # ... while each job's user reads its own files back, as a restore does.
    own = os.path.join(tier.step_dir("ja", (0, 1)), "rank-0.safetensors")
    assert run_as(a, PLANT_STEP, "/nonexistent/x", "/", own)["read"] == "read"


def test_a_job_dir_left_to_the_job_user_is_not_written_through(users, shared_tier):
    """A job directory owned by the job's user (as older versions left it) may hold a planted
    link: the daemon refuses to write there rather than follow it."""
    a, b = users
    tier = Tier(shared_tier)
    tier.write_rank(*_persisted("jb", 1, 1.0), uid=b)
    os.makedirs(tier.job_dir("ja"))
    os.chown(tier.job_dir("ja"), a, a)
    target = tier.step_dir("jb", (0, 1))
    seen = run_as(a, PLANT_STEP, tier.step_dir("ja", (0, 2)), target, "/nonexistent")
    assert seen["plant"] == "planted"
    with pytest.raises(TierError, match="belongs to uid"):
        tier.write_rank(*_persisted("ja", 2, 2.0), uid=a)
    assert os.lstat(target).st_uid == os.geteuid()
    assert sorted(os.listdir(target)) == ["rank-0.json", "rank-0.safetensors"]
