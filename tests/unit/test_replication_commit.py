"""The commit records (committed: small whatever the job's size, holders derived from the
placement; fences; the ahead record) and their transactions on the in-memory coordinator (the
same transactions run against a real etcd in tests/integration)."""

from __future__ import annotations

import dataclasses
import random
import threading
import time

import pytest

from elasticd.coordination import records
from elasticd.coordination.keys import Keyspace
from elasticd.testing.coordination import MemoryCoordinator
from elasticd.replication.commit import (
    COMMITTED_SCHEMA,
    GRID_RELAX,
    MAX_GRID,
    Committed,
    Grid,
    commit_of,
    decode_ahead,
    decode_committed,
    decode_grid,
    encode_ahead,
    encode_committed,
    encode_grid,
    read_committed,
    record_commit,
    relax_grid,
    update_holders,
    widen_grid,
)
from elasticd.replication.fences import decode_fence, encode_fence, read_fence, read_fences
from elasticd.replication.placement import compute_placement, encode_placement

KEYS = Keyspace("/t")
PLACEMENT = compute_placement(["a", "b", "c"], {"a": [0, 1], "b": [2], "c": [3]}, 2, round=4)


def test_a_commit_record_derives_its_holders_from_the_placement():
    c = commit_of((0, 5), PLACEMENT, "a", 12.0)
    assert c.version == (0, 5) and c.ranks == (0, 1, 2, 3) and c.round == 4 and c.by == "a"
    assert c.holders == {0: ("a", "b"), 1: ("a", "b"), 2: ("b", "c"), 3: ("c", "a")}
    raw = encode_committed(c)
    assert b'"holders":{}' in raw and b'"world":4' in raw
    bare = decode_committed(raw)
    assert not bare.resolved and bare.holders == {}  # the placement is not at hand
    assert decode_committed(raw, placements=[None, PLACEMENT]) == c
    other = compute_placement(["a", "b", "c"], {"a": [0], "b": [1, 2], "c": [3]}, 2, round=4)
    assert not decode_committed(raw, placements=[other]).resolved


def test_a_resolved_record_keeps_every_field_of_the_record_read():
    # resolve builds the resolved record field by field (every node, every commit): a field
    # added to Committed and not passed on fails here.
    c = dataclasses.replace(commit_of((2, 7), PLACEMENT, "b", 3.5), overrides={2: ("c", "a")})
    bare = decode_committed(encode_committed(c))
    resolved = decode_committed(encode_committed(c), placements=[PLACEMENT])
    assert resolved == dataclasses.replace(bare, holders={**c.holders, 2: ("c", "a")},
                                           resolved=True)
    assert {f.name for f in dataclasses.fields(Committed)} == {
        "generation", "step", "ranks", "holders", "m", "round", "at", "placement",
        "overrides", "by", "resolved"}


def test_the_committed_record_stays_small_whatever_the_job_size():
    nodes = [f"node-{i:04d}" for i in range(2000)]
    big = compute_placement(nodes, {n: range(8 * i, 8 * i + 8) for i, n in enumerate(nodes)}, 2)
    c = commit_of((3, 123456789), big, nodes[0], 1.7e9)
    assert len(encode_committed(c)) < 300
    assert decode_committed(encode_committed(c), placements=[big]).holders[15999] == (
        nodes[1999], nodes[1998])
    # a drain's or re-replication's changed holders are listed, the rest still derived
    moved = dataclasses.replace(c, overrides={7: (nodes[0], nodes[5])})
    got = decode_committed(encode_committed(moved), placements=[big])
    assert got.holders[7] == (nodes[0], nodes[5]) and got.holders[8] == (nodes[1], nodes[0])


def test_old_nodes_cannot_read_the_new_committed_record():
    raw = encode_committed(commit_of((0, 5), PLACEMENT, "a", 1.0))
    assert f'"schema":{COMMITTED_SCHEMA}'.encode() in raw
    with pytest.raises(records.UnsupportedRecordVersion, match="upgrade elasticd"):
        records.decode(raw, "ckpt_committed")  # what an elasticd of the old protocol runs


def test_read_committed_reads_the_placement_stored_beside_it():
    coord = MemoryCoordinator()
    record_commit(coord, KEYS, "j", commit_of((0, 5), PLACEMENT, "a", 1.0))
    assert not read_committed(coord, KEYS, "j").resolved  # not stored: overrides only
    coord.put(KEYS.replication("j").commit_placement, encode_placement(PLACEMENT))
    assert read_committed(coord, KEYS, "j").holders[3] == ("c", "a")


def test_records_round_trip_and_reject_garbage():
    c = Committed(1, 7, (0, 1), {0: ("a", "b"), 1: ("a", "b")}, 2, 3, 99.5)
    assert decode_committed(encode_committed(c)) == c
    assert decode_ahead(encode_ahead((2, 9))) == (2, 9)
    assert decode_fence(encode_fence("a", [(0, 1), (0, 3)])) == ("a", ((0, 3), (0, 1)))
    with pytest.raises(records.CorruptRecord):
        decode_committed(b'{"schema":1,"record":"ckpt_committed","step":-1}')
    with pytest.raises(records.RecordError):
        decode_ahead(encode_committed(c))
    for bad in (b'{"schema":1,"record":"ckpt_fence","node":1}',
                b'{"schema":1,"record":"ckpt_fence","node":"a","withdrawn":[[0,-1]]}'):
        with pytest.raises(records.CorruptRecord):
            decode_fence(bad)


def test_fences_are_listed_with_the_epoch_and_hostile_names_ignored():
    coord = MemoryCoordinator()
    assert read_fences(coord, KEYS, "j") == (0, {})
    assert read_fence(coord, KEYS, "j", "a") == (0, ())
    coord.put(KEYS.replication("j").fence("a"), encode_fence("a", [(0, 4)]))
    coord.put(KEYS.replication("j").fence_epoch, b"{}")
    coord.put(KEYS.replication("j").fence("../x"), b"junk")
    epoch, fences = read_fences(coord, KEYS, "j")
    assert epoch == coord.get(KEYS.replication("j").fence_epoch).mod_revision
    assert fences == {"a": coord.get(KEYS.replication("j").fence("a")).mod_revision}
    coord.put(KEYS.replication("j").fence("b"), b"junk")  # unreadable: lists nothing
    assert read_fence(coord, KEYS, "j", "b")[1] == ()


def committed(gen, step, at=0.0):
    return Committed(gen, step, (0,), {0: ("a", "b")}, 2, 0, at)


def test_record_commit_never_moves_backwards():
    coord = MemoryCoordinator()
    assert record_commit(coord, KEYS, "j", committed(0, 5)) == (True, committed(0, 5))
    assert record_commit(coord, KEYS, "j", committed(0, 4))[0] is False
    assert record_commit(coord, KEYS, "j", committed(0, 5, at=1.0))[0] is False
    assert read_committed(coord, KEYS, "j").version == (0, 5)
    assert record_commit(coord, KEYS, "j", committed(1, 1))[0] is True
    assert read_committed(coord, KEYS, "j").version == (1, 1)
    coord.put(KEYS.replication("j").committed, b"garbage")
    assert record_commit(coord, KEYS, "j", committed(1, 1))[0] is True


def test_racing_writers_leave_the_newest_and_never_go_back():
    race(MemoryCoordinator())


def race(coord, keys: Keyspace = KEYS, job: str = "j") -> None:
    """Eight writers record random versions at once; every write the watch sees is newer than
    the one before, and the last is the newest offered."""
    seen: list[tuple[int, int]] = []
    key = keys.replication(job).committed
    _, revision = coord.get_prefix(key)
    lock = threading.Lock()

    def on_events(events):
        if isinstance(events, Exception):
            return
        with lock:
            seen.extend(decode_committed(e.kv.value).version for e in events)

    watch = coord.watch_prefix(key, on_events, revision + 1)
    offered = [(random.randint(0, 2), random.randint(0, 50)) for _ in range(80)]
    chunks = [offered[i::8] for i in range(8)]

    def write(versions):
        for gen, step in versions:
            record_commit(coord, keys, job, committed(gen, step))

    threads = [threading.Thread(target=write, args=(c,)) for c in chunks]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert read_committed(coord, keys, job).version == max(offered)
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        with lock:
            if seen and seen[-1] == max(offered):
                break
        time.sleep(0.01)
    watch.cancel()
    assert seen == sorted(set(seen)), f"the committed record went backwards: {seen}"


def test_update_holders_only_while_the_version_is_current():
    coord = MemoryCoordinator()
    record_commit(coord, KEYS, "j", committed(0, 5))
    got = update_holders(coord, KEYS, "j", (0, 5), {0: ["b", "c"]}, now=3.0)
    assert got.holders[0] == ("b", "c") and got.at == 3.0
    record_commit(coord, KEYS, "j", committed(0, 6))
    got = update_holders(coord, KEYS, "j", (0, 5), {0: ["x"]}, now=4.0)
    assert got.version == (0, 6) and got.holders[0] == ("a", "b")


def test_the_snapshot_grid_widens_once_per_divergence_and_relaxes_when_commits_keep_up():
    coord, keys = MemoryCoordinator(), Keyspace("/t")

    def stored():
        kv = coord.get(keys.replication("j").commit_grid)
        return decode_grid(kv.value) if kv else Grid()

    assert stored() == Grid(1, (0, 0))  # none stored: every step
    assert widen_grid(coord, keys, "j", (0, 12)) == Grid(2, (0, 12))
    # the other nodes' withdrawals of the same divergence (versions up to 12) change nothing
    assert widen_grid(coord, keys, "j", (0, 12)) is None
    assert widen_grid(coord, keys, "j", (0, 11)) is None and stored().grid == 2
    assert widen_grid(coord, keys, "j", (0, 16)) == Grid(4, (0, 16))  # diverged again
    assert relax_grid(coord, keys, "j", (0, 16 + GRID_RELAX * 4 - 4)) is None  # too soon
    assert relax_grid(coord, keys, "j", (0, 16 + GRID_RELAX * 4)) == Grid(2, (0, 48))
    assert relax_grid(coord, keys, "j", (1, 3)) == Grid(1, (1, 3))  # a new generation
    assert relax_grid(coord, keys, "j", (1, 500)) is None  # every step already
    for step in range(100, 100 + 10 * MAX_GRID, MAX_GRID):
        widen_grid(coord, keys, "j", (1, step))
    assert stored().grid == MAX_GRID
    # a hostile or corrupt record is refused on read and replaced on the next change
    for bad in (encode_grid(Grid(3, (0, 1))), encode_grid(Grid(MAX_GRID * 2, (0, 1))),
                b"junk"):
        with pytest.raises(records.CorruptRecord):
            decode_grid(bad)
    coord.put(keys.replication("j").commit_grid, b"junk")
    assert widen_grid(coord, keys, "j", (2, 1)) == Grid(2, (2, 1))


def test_decoding_a_committed_record_does_not_rebuild_its_ranks_each_step():
    """Every node decodes the committed record once per step: a world's ranks are one shared
    tuple, not 8,000 ints built anew per decode (~70 us of ~100 at 1,000 nodes)."""
    names = [f"n{i}" for i in range(4)]
    placement = compute_placement(names, {n: range(k * 8, (k + 1) * 8)
                                          for k, n in enumerate(names)}, 2, round=1)
    one = decode_committed(encode_committed(commit_of((0, 1), placement, "n0", 1.0)))
    two = decode_committed(encode_committed(commit_of((0, 2), placement, "n0", 2.0)))
    assert one.ranks == tuple(range(32)) and two.ranks is one.ranks
