"""Own shard first (issue 31, docs/in-process-design.md §4.5): survivors of an in-process
re-formation resume from the newest step every one of them holds in its own slot, not only
from the committed step.

A real CheckpointService (one node's RAM) through the in-process transport; ranks are threads
with a barrier collective. Three ranks save at world 3, one of them "dies" (stops saving), and
the two others' Checkpointers follow their process into a round of world 2, as under
``@elasticd.in_process``: each restore reads the place the round gave (here set on the
Checkpointer, as the re-formed group would say). Nothing is committed (no replicator), so
before own offers the survivors found no step loadable at world 2 and started over from 0.
"""

from __future__ import annotations

import contextlib
import json

import pytest

import elasticd.worker.handover as handover_module
import elasticd.worker.sources as sources_module
from elasticd.local.worker_link import PREVIOUS_ENV
from elasticd.testing.transport import InProcessTransport
from elasticd.worker.checkpointer import Checkpointer
from elasticd.worker.transport import Transport
from tests.unit.test_worker_checkpointer import (  # noqa: F401 — service: a fixture
    ThreadRanks, capture, make_state, run_ranks, service, train_step)

JOB = "j"


@contextlib.contextmanager
def _world3(service, last):
    """Ranks 0-2 of world 3 save steps 1..last[r]; yields their Checkpointers, states and
    each rank's captured state per step, and the transport; closes the Checkpointers."""
    t = InProcessTransport(service.handlers())
    ckpts, states, refs = [], [], {}
    try:
        for r in range(3):
            ckpt = Checkpointer(transport=t, job=JOB, rank=r, world_size=3)
            ckpts.append(ckpt)
            state = make_state(seed=r, world=3, rank=r)
            for step in range(1, last[r] + 1):
                train_step(state)
                ckpt.save(step, state)
                ckpt.wait()
                refs[(r, step)] = capture(state)
            states.append(state)
        yield ckpts, states, refs, t
    finally:
        for ckpt in ckpts:
            ckpt.close()


def _reform(ckpts, states, world):
    """Every Checkpointer in ``ckpts`` restores as rank i of ``world`` (its round's place)."""
    ranks = ThreadRanks(world)
    for i, ckpt in enumerate(ckpts):
        ckpt._given = (i, world, None, ranks.rank(i))  # what the re-formed group says

    def restore(i):
        return ckpts[i].restore(states[i]), ckpts[i].last_restore

    return run_ranks(world, restore)


def _same_model(state, ref):
    got = capture(state)
    return all(v.equal(got["model"][k]) for k, v in ref["model"].items()) and all(
        all(a[k].equal(b[k]) for k in b) for a, b in zip(got["optim"], ref["optim"]))


def test_survivors_resume_from_the_newest_step_all_of_them_hold_in_their_own_slots(service):
    with _world3(service, last=[5, 3, 5]) as (ckpts, states, refs, _):  # rank 1 died after 3
        survivors = [ckpts[0], ckpts[2]]  # rank 0 stays 0, rank 2 becomes 1
        results = _reform(survivors, [states[0], states[2]], world=2)
        assert [step for step, _ in results] == [5, 5]  # was [0, 0]: nothing committed
        assert all(res.source == "local" and res.saved_world_size == 3 and res.steps_lost == 0
                   for _, res in results), results
        # Each loaded the shard of the rank it was, bitwise.
        assert _same_model(states[0], refs[(0, 5)]) and _same_model(states[2], refs[(2, 5)])
        # New snapshots carry a new generation, as after any restore.
        assert {ckpt.generation for ckpt in survivors} == {1}


def test_a_step_some_survivors_completed_is_handed_to_the_others(service):
    # Rank 2 failed its collective of step 5 (it completed on rank 0: a ring all_reduce the
    # dead rank broke): rank 2 holds 4 at most. Rank 0 hands its snapshot of 5 over; before,
    # both resumed at 4 (one step lost).
    with _world3(service, last=[5, 3, 4]) as (ckpts, states, refs, _):
        results = _reform([ckpts[0], ckpts[2]], [states[0], states[2]], world=2)
        assert [step for step, _ in results] == [5, 5]
        assert [res.source for _, res in results] == ["local", "peer"]
        assert all(res.steps_lost == 0 and res.saved_world_size == 3 for _, res in results)
        # Both hold what rank 0 completed (replicated state: one survivor's step is whole).
        assert _same_model(states[0], refs[(0, 5)]) and _same_model(states[2], refs[(0, 5)])


def test_handed_bytes_that_fail_their_check_are_refused_for_the_step_all_hold(
        service, monkeypatch):
    exchange = handover_module.exchange

    def flipped(plan, rank, payload, collective):
        data = exchange(plan, rank, payload, collective)
        if data is not None and plan.holder_of(rank) is not None:
            data[-1] ^= 0xFF  # a payload byte: its block's checksum no longer matches
        return data

    monkeypatch.setattr(handover_module, "exchange", flipped)
    with _world3(service, last=[5, 3, 4]) as (ckpts, states, refs, _):
        results = _reform([ckpts[0], ckpts[2]], [states[0], states[2]], world=2)
        assert [step for step, _ in results] == [4, 4]
        assert any("handed step (0, 5)" in why for why in results[1][1].refused)
        assert _same_model(states[0], refs[(0, 4)]) and _same_model(states[2], refs[(2, 4)])


@pytest.mark.parametrize("offers, common, expected", [
    ([[(0, 5), (0, 4)], [(0, 4), (0, 3)], [(0, 5), (0, 4)]], {(0, 4)},
     ((0, 5), ((0, 1),))),  # rank 1 takes 5 from rank 0
    ([[(0, 5), (0, 4)], [(0, 4)], [(0, 4)]], {(0, 4)}, ((0, 5), ((0, 1), (0, 2)))),
    ([[(0, 5), (0, 4)], [(0, 5), (0, 4)]], {(0, 5), (0, 4)}, None),  # all hold it
    ([[(1, 2), (0, 4)], [(0, 4)]], {(0, 4)}, None),  # another generation: not this timeline
    ([[(0, 5)], [(0, 4)]], set(), None),  # nothing in common: no timeline to follow
])
def test_the_handover_plan(offers, common, expected):
    got = handover_module.plan(offers, common)
    assert (None if got is None else (got.version, got.pairs)) == expected
def test_a_fresh_rank_in_the_round_means_no_own_offer_is_taken(service):
    # A new worker (a new node: its agent names no rank it replaces) has no slot of its own:
    # a step nobody committed may be held nowhere for its rank, so the round takes what it
    # would take after a restart (here: nothing committed, a fresh start), whatever the
    # survivors hold.
    with _world3(service, last=[5, 3, 5]) as (ckpts, states, _, t):
        with Checkpointer(transport=t, job=JOB, rank=1, world_size=2) as fresh:
            results = _reform([ckpts[0], fresh],
                              [states[0], make_state(seed=7, world=2, rank=1)], world=2)
        assert [step for step, _ in results] == [0, 0]


@pytest.mark.parametrize("last, was, expected", [
    ([5, 3, 5], 2, 5),  # it completed what the survivor did: 0 steps lost (before: 0, fresh)
    ([5, 5, 4], 2, 5),  # one step behind the survivor: handed over, as between survivors
])
def test_a_worker_restarted_on_its_node_offers_the_rank_it_was(service, monkeypatch, last,
                                                                 was, expected):
    # The fallback: a survivor stuck in its re-formation, so its agent restarted the node's
    # workers into the round. The fresh process's agent says which rank its worker was
    # (PREVIOUS_ENV), and that rank's slots in the node's RAM hold the steps it completed:
    # the round resumes at the newest step every rank holds, as if all were survivors.
    # Before, it offered nothing and the round took the committed step (none here: step 0).
    with _world3(service, last) as (ckpts, states, refs, t):
        monkeypatch.setenv(PREVIOUS_ENV, json.dumps({"ranks": [was], "world_size": 3}))
        monkeypatch.setenv("LOCAL_RANK", "0")
        state = make_state(seed=7, world=2, rank=1)
        with Checkpointer(transport=t, job=JOB, rank=1, world_size=2) as restarted:
            results = _reform([ckpts[0], restarted], [states[0], state], world=2)
        assert [step for step, _ in results] == [expected, expected]
        assert all(res.saved_world_size == 3 and res.steps_lost == 0 for _, res in results)
        holder = was if last[was] >= expected else 0  # handed over: the survivor's bytes
        assert _same_model(state, refs[(holder, expected)])
        assert _same_model(states[0], refs[(0, expected)])


def test_a_restarted_workers_offer_follows_the_rules_of_a_survivors(service, monkeypatch):
    # What it offers is its old rank's own slots at the old world size, under the same rules:
    # sharded state is refused (a dead rank's part of an uncommitted step may be held
    # nowhere), so the round takes the committed step (none here: a fresh start).
    with _world3(service, last=[5, 3, 5]) as (ckpts, states, _, t):
        monkeypatch.setenv(PREVIOUS_ENV, json.dumps({"ranks": [2], "world_size": 3}))
        monkeypatch.setenv("LOCAL_RANK", "0")
        monkeypatch.setattr(sources_module, "dtensor_nodes", lambda meta: iter([{"i": 0}]))
        with Checkpointer(transport=t, job=JOB, rank=1, world_size=2) as restarted:
            results = _reform([ckpts[0], restarted],
                              [states[0], make_state(seed=7, world=2, rank=1)], world=2)
        assert [step for step, _ in results] == [0, 0]
        assert any("sharded state needs every old rank's shard" in why
                   for why in results[1][1].refused), results[1][1].refused


@pytest.mark.parametrize("value, local, expected", [
    ('{"ranks": [4, 5], "world_size": 6}', "1", (5, 6)),
    ('{"ranks": [4, 5], "world_size": 6}', "2", None),  # no such local rank
    ('{"ranks": [4, 5], "world_size": 6}', "-1", None),
    ('{"ranks": [7], "world_size": 6}', "0", None),  # not a rank of that world
    ('{"ranks": [1]}', "0", None),
    ("not json", "0", None),
    ("", "0", None),  # a first start, a new node: nothing of its own
])
def test_the_previous_place_a_worker_reads(value, local, expected):
    from elasticd.local.worker_link import previous_place

    assert previous_place({PREVIOUS_ENV: value, "LOCAL_RANK": local}) == expected


def test_a_sharded_own_snapshot_is_refused_for_the_committed_step(service, monkeypatch):
    # Sharded state (DTensors, ZeRO): a survivor's slot holds only its part, and the dead
    # rank's part of a step nobody committed may be held nowhere.
    with _world3(service, last=[5, 3, 5]) as (ckpts, states, _, _t):
        monkeypatch.setattr(sources_module, "dtensor_nodes", lambda meta: iter([{"i": 0}]))
        results = _reform([ckpts[0], ckpts[2]], [states[0], states[2]], world=2)
        assert [step for step, _ in results] == [0, 0]
        assert any("sharded state needs every old rank's shard" in why
                   for why in results[0][1].refused), results[0][1].refused


def test_the_same_place_restores_as_before(service):
    # No move (a re-formation that kept every rank in place): the usual common step.
    with _world3(service, last=[5, 5, 4]) as (ckpts, states, refs, _):
        results = _reform(ckpts, states, world=3)
        assert [step for step, _ in results] == [4, 4, 4]
        assert all(_same_model(states[r], refs[(r, 4)]) for r in range(3))


class _Lost(Transport):
    """A daemon that holds no copy of anything: records which old ranks were asked for."""

    def __init__(self) -> None:
        self.asked: list[int] = []

    def call(self, op, **fields):
        self.asked.append(fields["rank"])
        return {"lost": True, "reason": "test"}


def test_a_survivor_reshards_the_committed_step_from_the_snapshot_it_wrote_first():
    # Sharded state (FSDP2, ZeRO) takes the committed step at the old world size: a survivor
    # (old rank 4 of 6, now rank 2 of 4) starts from its own snapshot, in its node's RAM, and
    # fetches only the rows it lacks; before, it fetched old rank 2's (a peer's) first.
    version = (1, 5)
    survivor = sources_module.Sources(_Lost(), JOB, 2, 4, previous=(4, 6))
    survivor.fetchable = {version}
    assert survivor.fetch(version, [], world=6) is None
    assert survivor.transport.asked[0] == 4
    fresh = sources_module.Sources(_Lost(), JOB, 2, 4)  # a fresh process: its new rank's
    fresh.fetchable = {version}
    fresh.fetch(version, [], world=6)
    assert fresh.transport.asked[0] == 2



@pytest.mark.parametrize("daemon", ["today", "older"])
def test_a_survivors_discovery_is_one_call_to_its_daemon_and_an_older_daemon_still_works(
        service, daemon):
    """The daemon is busy with the failure when survivors restore: their listing, their
    previous rank's own snapshots and the committed step come in one ``ckpt_list`` (it was
    three calls in a row: ckpt_list, ckpt_committed, ckpt_list again). A daemon before those
    fields ignores them, and the rank asks the rest as it did."""
    with _world3(service, last=[5, 3, 5]) as (ckpts, states, _, t):
        asked = []
        call, listing = t.call, t.handlers["ckpt_list"]

        def counted(op, **fields):
            if op in ("ckpt_list", "ckpt_committed"):
                asked.append(op)
            return call(op, **fields)

        t.call = counted
        if daemon == "older":
            t.handlers = {**t.handlers, "ckpt_list": lambda msg: listing(
                {k: v for k, v in msg.items()
                 if k not in ("previous_rank", "previous_world_size", "committed")})}
        results = _reform([ckpts[0], ckpts[2]], [states[0], states[2]], world=2)
        assert [step for step, _ in results] == [5, 5]
        assert sorted(asked) == (["ckpt_list"] * 2 if daemon == "today" else
                                 sorted(["ckpt_list", "ckpt_committed", "ckpt_list"] * 2))
