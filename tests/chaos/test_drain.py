"""``elasticctl drain NODE``: the node hands its replicas to others (every committed step keeps
m copies without it), then leaves the job cleanly; the standby takes its place, restoring the
drained node's rank from a peer, and the job goes on. Steps lost equal the sync lag when the
workers stopped (1 in the run on ops' drain: the step trained after snapshots were paused).

The drain's own report is checked here too (it was a second cluster of its own in
tests/integration/test_drain.py): its JSON (drained, every planned copy done, none failed),
its progress on stderr, the committed step's holders without the node, the node's /status
(drained, still registered), no step trained on it after the drain, one ``drained`` event,
the standby's ``recovered`` row in ``elasticctl history`` (from a peer, with its recovery
time), and ``elasticctl placement`` without the drained node and with nothing
under-replicated."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.chaos.faults import FaultPlan
from tests.chaos.harness import STEP_RE, ChaosCluster, Shape

pytestmark = [pytest.mark.etcd, pytest.mark.chaos, pytest.mark.timeout(300)]


class _DrainCluster(ChaosCluster):
    """Runs ``elasticctl history`` and ``placement`` once the job has ended, before the nodes
    stop."""

    def at_end(self) -> None:
        self.ctl_after = {name: self.ctl(*args) for name, args in (
            ("history", ("history", "--kind", "recovered", "--format", "json")),
            ("placement", ("placement", "--format", "json")))}

    def ctl(self, *args: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "elasticd.cli.main", *args, "--etcd",
                               self.etcd, "--prefix", self.prefix],
                              capture_output=True, text=True, timeout=60,
                              stdin=subprocess.DEVNULL)


def test_drain_node_standby_takes_over_from_peers(tmp_path, reference):
    # 150 steps: elasticctl drain (a new interpreter) returns seconds after the drain starts;
    # with 50 steps CI once saw the job end before the drained node's workers stopped.
    shape = Shape(steps=150)
    victim, standby = "n2", shape.standby[0]
    cc = _DrainCluster(tmp_path, shape)
    out = cc.run(FaultPlan().drain(victim, at_step=20))
    out.assert_all(sources=[{"local", "peer"}], reference=reference(shape),
                   must={"peer"})
    assert not any(e["kind"] == "failed" and e["node"] == victim for e in out.events), (
        "a drain was recorded as a failure")

    drained = cc.injector.drained[victim]
    doc, progress = drained["doc"], drained["progress"]
    print(progress)
    assert doc["state"] == "drained" and doc["node"] == victim, doc
    assert doc["copies_failed"] == 0 and doc["copies_done"] == doc["copies_planned"] > 0, doc
    # progress was shown while it ran: each phase, then the outcome
    for phase in ("snapshot", "replicas", "stopping"):
        assert f"{victim}: draining / {phase}:" in progress, progress
    assert "handed off" in progress and f"{victim}: drained" in progress, progress
    # the committed step has m copies without the drained node
    assert drained["holders"] is not None, "nothing committed when the drain returned"
    for rank, holders in drained["holders"].items():
        others = [h for h in holders if h != victim]
        assert len(others) >= 2, (rank, drained["holders"])
    # the drained node left the job (its workers stopped) but stays alive, out of jobs
    st = drained["status"]
    assert st["drain"] == "drained" and st["job"]["state"] == "drained", st["job"]
    assert drained["registered"], f"{victim} is not registered after its drain"
    assert not STEP_RE.search(out.log_text(victim), drained["log_offset"]), (
        f"{victim} trained a step after its drain returned")

    # the standby took the free slot and restored the drained node's shard from a peer's RAM,
    # the step every rank restored being no older than the one the drain handed off
    (rec,) = out.recoveries
    handed_off = min(j["version"][1] for j in doc["jobs"].values())
    assert rec.step >= handed_off, (rec.step, handed_off, out.summary())
    on_standby = [r for r, s in rec.attempt.starts.items() if s.node == standby]
    assert on_standby and {rec.sources[r] for r in on_standby} == {"peer"}, out.summary()
    assert [e["node"] for e in out.events if e["kind"] == "drained"] == [victim], out.events

    history = cc.ctl_after["history"]
    assert history.returncode == 0, history.stderr
    rows = [e for e in json.loads(history.stdout) if e["node"] == standby]
    assert rows and rows[-1]["source"] == "peer" and rows[-1]["recovery_seconds"] is not None, (
        rows)
    placement = cc.ctl_after["placement"]
    assert placement.returncode == 0, placement.stderr
    pl = json.loads(placement.stdout)
    assert victim not in pl["nodes"] and standby in pl["nodes"], pl
    assert all(victim not in r["holders"] for r in pl["ranks"])
    assert pl["under_replicated_ranks"] == [], pl
