"""Gray failures of a holder in the middle of a fetch (issue 16): the holder is alive to every
lease check but its replication port answers nothing, or the whole node is frozen.

3 nodes, ``--nnodes 2:3``, m = 2, ~27 MB of state per rank. n1 is killed (its RAM gone): n2
and n3 go on at world 2, each holding both ranks' snapshots. n1's daemon starts again with
empty memory and the job grows back to 3; n1's restore fetches the committed step striped
from n2 and n3. Once n2's replication port has sent a few MB of it (counted in the kernel, so
the fault lands mid-piece however fast the fetch runs), n2 is

* black-holed: every packet of its replication port dropped, both ways, no reset, while its
  lease, etcd and rendezvous traffic flow (so nothing that reacts to a lost lease can rescue
  the fetch): the fetch must drop n2 at its deadline and take n2's pieces from n3;
* frozen whole: its replication port cut in the kernel at that byte (what its sockets hold
  goes nowhere, as from a frozen machine), then SIGSTOP of its daemon, agent and workers: its
  lease expires, the job goes on
  at world 2 without it, and n1's fetch from it must end within its deadline all the same (at
  the deadline, or earlier when n1's daemon drops the connection of a peer that left).

Each time: the fetch from n2 is abandoned within its deadline (the log names it), training is back
within TTL + 1 s + that deadline of the fault's landing, the job finishes with every sample
once and the committed step restored; after the fault ends (unblock / SIGCONT) no fetch of a
superseded step lands anywhere, no daemon has a fetch or a served transfer still waiting, and
nothing holds commits back (a restore after the fault's end loses at most the sync lag).
"""

from __future__ import annotations

import os
import re
import time

import pytest

from elasticd.replication.deadline import LinkRates
from elasticd.recovery.fetch import STRIPE_BYTES
from tests.chaos.faults import FaultPlan, FaultRecord
from tests.chaos.harness import ChaosCluster, Outcome, Shape
from tests.chaos.partition import available

pytestmark = [pytest.mark.etcd, pytest.mark.chaos, pytest.mark.timeout(300)]

WHY_NOT = available()

#: ``--hidden`` of examples/train.py: 34 * HIDDEN parameters plus as many momentum values
#: (float32, no ZeRO: every rank holds both) make ~27 MB per rank: two pieces of a striped
#: fetch (16 MiB and ~11 MiB), one from each holder. (At ~40 MB replication fell behind the
#: steps on 2 cores: nothing was committed by step 10 in one run of two.)
HIDDEN = 100_000
#: n2's replication port must have sent this much (of its piece) before the fault lands.
LAND_AFTER = 2 << 20
#: n1 is killed at step 20; the fault is armed once n2 and n3 train on at world 2 (a step
#: past 20), so that it lands in n1's fetch after the grow, not in the shrink's restore (where
#: a survivor may fetch from the other: frozen then, n1's only other copy is gone with it).
#: The first such step: at 23, a fast host had n1 back and its fetch done before the arming
#: (CI: "armed, never landed").
ARM_AT = 21
#: How long the fault lasts: beyond the fetch deadline (so that it is the deadline, not the
#: fault's end, that frees the fetch) and beyond the lease TTL (the freeze expires n2's lease).
FAULT_SECONDS = 8.0

#: Steps a restore after the fault's end may lose (the sync lag: 0 to 2 in the runs).
MAX_LAG = 5

#: 110 steps: after the fault ends the frozen node rejoins (fenced, a new agent whose zygote
#: imports torch first: 7-9 s on 2 busy cores) and the job grows back with steps left to run
#: (at 90 the others had finished by then in a CI run).
SHAPE = Shape(nodes=("n1", "n2", "n3"), standby=(), nnodes="2:3", zero=False, steps=110,
              step_time=0.15, etcd_members=1)

_STAMP = r"(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3})"
ABANDONED_RE = re.compile(_STAMP + r" \w+ (\w+) \S+: (\S+) rank (\d+): (\w+) failed after serving "
                          r"(\d+) bytes \(unreachable: (.*?)\); its ranges")
DEADLINE_RE = re.compile(r"the call's deadline of ([\d.]+) s passed")
#: The deadline of a whole piece from a holder not measured yet (the restarted n1 has measured
#: nothing): what a fetch abandoned for another reason is held to.
PIECE_DEADLINE = LinkRates().deadline("n1", STRIPE_BYTES)
GRID_RE = re.compile(_STAMP + r" \w+ \w+ \S+: \S+: snapshot grid \d+ -> (\d+) steps")
FETCHED_RE = re.compile(_STAMP + r" \w+ (\w+) \S+: (\S+) rank (\d+) (?:step )?\((\d+), (\d+)\) "
                        r"fetched from ([\w, ]+?) (?:into node|after)")


def _wall(stamp: str) -> float:
    return time.mktime(time.strptime(stamp[:19], "%Y-%m-%d %H:%M:%S")) + int(stamp[20:]) / 1e3


def daemon_log(out: Outcome, node: str) -> str:
    with open(os.path.join(out.cc.workdir, f"{node}.log"), errors="replace") as fh:
        return fh.read()


def run(tmp_path, plan: FaultPlan) -> tuple[Outcome, FaultRecord]:
    cc = ChaosCluster(tmp_path, SHAPE, partitions=True, train_args=("--hidden", str(HIDDEN)))
    out = cc.run(plan, timeout=200)
    fault = out.faults[-1]
    assert fault.landed is not None and fault.undone_at is not None, out.summary()
    return out, fault


def check(out: Outcome, fault: FaultRecord, by_deadline: bool) -> None:
    """What both faults must show (see the module); ``by_deadline``: the fetch from the
    holder must end at its deadline (its lease is alive: nothing else can end it)."""
    out.assert_finished()
    holder = fault.fault.node
    logs = {n: daemon_log(out, n) for n in out.cc.nodes}
    grids = sorted((_wall(m.group(1)), int(m.group(2))) for text in logs.values()
                   for m in GRID_RE.finditer(text))

    def grid_at(t: float) -> int:
        """The snapshot grid in force at ``t`` (steps between snapshots; 1 until widened)."""
        return max([g for at, g in grids if at <= t][-1:] or [1])

    # Steps lost against the committed step, for the restores from the fault's landing on. (The
    # shrink's restore before it, at step 19 after the kill at 20, is left out: the harness's
    # reconstruction of the step committed in force then says None in most runs of this shape
    # although the injector read (0, 19) in etcd at the kill; a question for the harness.)
    everything = out.recoveries
    out.recoveries = [r for r in everything
                      if min(s.seen for s in r.attempt.starts.values()) > fault.landed]
    try:
        assert out.recoveries, f"no restore after the fault landed\n{out.summary()}"
        # Each rank reports the steps it really lost, and no more than a sync lag. (Not the
        # harness's "restored == committed in force": with the survivors re-formed before
        # the daemons saw the lease expire, its reconstruction of the step in force then lags
        # the commits that the restore itself used: "restored 36, committed 20, lost 0".)
        # And it goes back no further than a sync lag before the fault landed. (Not "loses at
        # most a sync lag": while the holder's port is black-holed or the holder frozen, no
        # commit can count the copies it should receive, so the steps trained during the
        # fault are at risk by design; CI once: 6 steps lost, the commit held at 32 while the
        # survivors trained to 38 in the fetch deadline's 3 s. After the fault's end, the
        # sync-lag bound holds again: checked below.)
        at_landing = max((rec["step"] for a in out.attempts for rec in a.records
                          if rec["t"] <= fault.landed), default=-1)
        # The sync lag counts in the snapshot grid in force when the fault landed (below).
        assert at_landing >= ARM_AT, f"no step before the fault landed?\n{out.summary()}"
        lag = MAX_LAG + grid_at(fault.landed) - 1
        for r in out.recoveries:
            reported = set(r.reported_lost.values())  # a step in flight may be unknown
            assert len(reported) == 1 and reported <= r.knowable_lost, f"{r}\n{out.summary()}"
            assert r.step >= at_landing - lag, (
                f"a restore during the fault went back to step {r.step}, more than {lag} "
                f"steps (a sync lag of {MAX_LAG} on a snapshot grid of "
                f"{grid_at(fault.landed)}) before step {at_landing}, reached when the fault "
                f"landed: {r}\n{out.summary()}")
    finally:
        out.recoveries = everything
    out.assert_samples_exactly_once()
    out.assert_nothing_left()

    # The fetch from the faulted holder was abandoned, at its deadline or (frozen: its lease
    # expires) when it left the membership, within the deadline of the landing.
    abandoned = [(n, m) for n, text in logs.items() for m in ABANDONED_RE.finditer(text)
                 if m.group(5) == holder and _wall(m.group(1)) >= fault.landed - 0.1]
    assert abandoned, (f"no daemon abandoned its fetch from {holder} after the fault landed"
                       f"\n{out.summary()}")
    node, first = min(abandoned, key=lambda a: _wall(a[1].group(1)))
    why = DEADLINE_RE.search(first.group(7))
    assert why or not by_deadline, (f"{node} abandoned its fetch from {holder}, whose lease "
                                    f"is alive, for another reason than its deadline: "
                                    f"{first.group(7)}")
    deadline = float(why.group(1)) if why else PIECE_DEADLINE
    gave_up = _wall(first.group(1)) - fault.landed
    assert gave_up <= deadline + 0.5, (
        f"{node} gave up on {holder} {gave_up:.2f} s after the fault landed, beyond the "
        f"{deadline} s deadline")

    # Training is back (a step run after the landing) within TTL + 1 s + the deadline.
    after = sorted(r["t"] for a in out.attempts for r in a.records if r["t"] > fault.landed)
    assert after, f"no step ran after the fault landed\n{out.summary()}"
    back = after[0] - fault.landed
    bound = SHAPE.lease_ttl + 1.0 + deadline
    print(f"gray failure {fault.fault.kind} of {holder}: {node} abandoned its fetch "
          f"{gave_up:.2f} s after the landing ({first.group(7)}; deadline {deadline:.2f} s); "
          f"training back "
          f"{back:.2f} s after it (bound {bound:.2f} s)", flush=True)
    assert back <= bound, (f"training came back {back:.2f} s after the fault landed, beyond "
                           f"TTL + 1 s + the fetch deadline = {bound:.2f} s\n{out.summary()}")

    # No daemon is still waiting on a fetch, or still serving one, once the job has ended
    # (its /status then, after the agents' exit).
    assert set(out.statuses) == set(out.cc.nodes), f"/status of {sorted(out.statuses)} only"
    for n, status in out.statuses.items():
        rep = status["replication"]
        assert not rep["fetching"] and not rep["serving"], (
            f"{n} still fetching {rep['fetching']} / serving {rep['serving']} after the job's "
            f"end\n{out.summary()}")

    # Nothing the fault left behind holds commits back afterwards: a restore after its end
    # loses no more than a normal sync lag. (A read pin of a reply that the aborted round's
    # worker never read used to stay until pin_ttl: the rank's free slot stayed busy, every
    # other snapshot was skipped, and the grow after the thaw lost 29 steps.) The sync lag
    # counts in the snapshot grid in force: while the frozen node held the commit election,
    # nothing was committed, each snapshot was withdrawn after its wait and the grid widened
    # (CI: 1 -> 8 steps in a second; the restore 3 s after the thaw lost 6 steps).
    for r in out.recoveries:
        began = min(s.seen for s in r.attempt.starts.values())
        if began > fault.undone_at:
            grid = grid_at(began)
            assert r.true_lost <= MAX_LAG + grid - 1, (
                f"a restore after the fault's end lost {r.true_lost} steps, more than a sync "
                f"lag of {MAX_LAG} steps on a snapshot grid of {grid}: {r}\n{out.summary()}")

    # After the fault ended, nothing older than the committed step was fetched anywhere.
    for n, text in logs.items():
        for m in FETCHED_RE.finditer(text):
            at = _wall(m.group(1))
            if at < fault.undone_at:
                continue
            version = (int(m.group(5)), int(m.group(6)))
            committed = max(((c["generation"], c["step"]) for c in out.commits if c["at"] < at),
                            default=None)
            assert committed is None or version >= committed, (
                f"{n} stored {m.group(3)} rank {m.group(4)} {version} fetched from "
                f"{m.group(7)} at {m.group(1)}, after the fault ended, when {committed} was "
                f"committed: a superseded fetch landed late")


@pytest.mark.skipif(bool(WHY_NOT), reason=f"no cgroup BPF on this machine: {WHY_NOT}")
def test_holder_blackholed_mid_fetch_is_dropped_at_the_deadline(tmp_path):
    plan = (FaultPlan().kill_node("n1", at_step=20).restart_node("n1", after=1.0)
            .blackhole_port("n2", seconds=FAULT_SECONDS, at_step=ARM_AT, after_bytes=LAND_AFTER))
    out, fault = run(tmp_path, plan)
    check(out, fault, by_deadline=True)
    # n2 stayed alive to every lease check the whole time: nothing declared it failed.
    assert not [e for e in out.events if e["node"] == "n2" and e["kind"] == "failed"], (
        out.events)


@pytest.mark.skipif(bool(WHY_NOT), reason=f"no cgroup BPF on this machine: {WHY_NOT}")
def test_holder_frozen_mid_fetch_is_dropped_at_the_deadline(tmp_path):
    plan = (FaultPlan().kill_node("n1", at_step=20).restart_node("n1", after=1.0)
            .freeze_node("n2", seconds=FAULT_SECONDS, at_step=ARM_AT, after_bytes=LAND_AFTER))
    out, fault = run(tmp_path, plan)
    check(out, fault, by_deadline=False)
    assert any(e["node"] == "n2" and e["kind"] == "failed" for e in out.events), out.events
