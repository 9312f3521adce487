"""Commit decisions (pure) and the commit record's transaction on the in-memory coordinator
(the same transaction runs against a real etcd in tests/integration)."""

from __future__ import annotations

import random
import threading
import time

import pytest

from elasticd.coordination import records
from elasticd.coordination.keys import Keyspace
from elasticd.coordination.memory import MemoryCoordinator
from elasticd.replication.commit import (
    GRID_RELAX,
    MAX_GRID,
    Committed,
    Grid,
    decode_grid,
    encode_grid,
    relax_grid,
    widen_grid,
    Replicated,
    decide,
    decode_committed,
    decode_replicated,
    encode_committed,
    encode_replicated,
    read_committed,
    record_commit,
    update_holders,
)
from elasticd.replication.placement import compute_placement

KEYS = Keyspace("/t")
PLACEMENT = compute_placement(["a", "b", "c"], {"a": [0, 1], "b": [2], "c": [3]}, 2, round=4)


def progress(**versions):
    """node=[(gen, step), ...] for every rank the node owns in PLACEMENT."""
    out = {}
    for node, vs in versions.items():
        ranks = PLACEMENT.ranks[node]
        out[node] = Replicated(node, 4, {r: tuple(vs) for r in ranks},
                               {r: PLACEMENT.holders[node] for r in ranks})
    return out


def test_decide_commits_the_newest_version_every_rank_has():
    got = decide(PLACEMENT, progress(a=[(0, 5), (0, 4)], b=[(0, 5), (0, 3)], c=[(0, 6), (0, 5)]),
                 now=12.0)
    assert got.version == (0, 5) and got.ranks == (0, 1, 2, 3) and got.round == 4
    assert got.holders == {0: ("a", "b"), 1: ("a", "b"), 2: ("b", "c"), 3: ("c", "a")}
    assert got.at == 12.0


def test_decide_needs_every_rank():
    assert decide(PLACEMENT, progress(a=[(0, 5)], b=[(0, 5)])) is None
    assert decide(PLACEMENT, progress(a=[(0, 5)], b=[(0, 4)], c=[(0, 5)])) is None


def test_decide_ignores_abandoned_generations_and_records_about_others_ranks():
    p = progress(a=[(1, 2), (0, 9)], b=[(1, 2), (0, 9)], c=[(1, 2), (0, 9)])
    assert decide(PLACEMENT, p).version == (1, 2)
    p = progress(a=[(0, 9)], b=[(0, 9)], c=[(0, 9)])
    assert decide(PLACEMENT, p, floor=1) is None
    # c claims rank 0 (it owned it in an older round): only the owner's word counts.
    p = progress(a=[(0, 3)], b=[(0, 7)], c=[(0, 7)])
    p["c"] = Replicated("c", 4, {0: ((0, 7),), 1: ((0, 7),), 3: ((0, 7),)}, {})
    assert decide(PLACEMENT, p) is None


def test_records_round_trip_and_reject_garbage():
    c = Committed(1, 7, (0, 1), {0: ("a", "b"), 1: ("a", "b")}, 2, 3, 99.5)
    assert decode_committed(encode_committed(c)) == c
    r = Replicated("a", 3, {0: ((1, 7), (1, 6))}, {0: ("a", "b")}, 5.0)
    assert decode_replicated(encode_replicated(r)) == r
    with pytest.raises(records.CorruptRecord):
        decode_committed(b'{"schema":1,"record":"ckpt_committed","step":-1}')
    with pytest.raises(records.CorruptRecord):
        decode_replicated(encode_committed(c))


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
    coord.put(KEYS.job_committed("j"), b"garbage")
    assert record_commit(coord, KEYS, "j", committed(1, 1))[0] is True


def test_racing_writers_leave_the_newest_and_never_go_back():
    race(MemoryCoordinator())


def race(coord, keys: Keyspace = KEYS, job: str = "j") -> None:
    """Eight writers record random versions at once; every write the watch sees is newer than
    the one before, and the last is the newest offered."""
    seen: list[tuple[int, int]] = []
    key = keys.job_committed(job)
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
        kv = coord.get(keys.job_commit_grid("j"))
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
    coord.put(keys.job_commit_grid("j"), b"junk")
    assert widen_grid(coord, keys, "j", (2, 1)) == Grid(2, (2, 1))
