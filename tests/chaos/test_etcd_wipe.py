"""etcd restarted on an empty data directory during training (an operator restoring etcd from
nothing, or a disk lost with its member): every key is gone, revisions restart near 1, and the
cluster id may stay the same. The daemons must recognise it, re-publish what they hold (their
records, the job spec) and keep the job going: nobody declared failed or fenced for it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest

from tests.chaos.faults import FaultPlan
from tests.chaos.harness import ChaosCluster, Shape

pytestmark = [pytest.mark.etcd, pytest.mark.chaos, pytest.mark.timeout(300)]

LOST_LINE = "etcd lost its data"


class _WatchedCluster(ChaosCluster):
    """Records, after the wipe, when every daemon first saw every peer registered again in its
    /status, and when ``elasticctl jobs`` first showed the job again.

    A daemon's /status keeps listing its peers through the outage until it sees that etcd lost
    its data (then it lists them again from the new etcd), so its peers count as seen again
    only once its log says it saw the loss. The fault's record is written once etcd is healthy
    again (empty): :attr:`back` is that moment."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.all_seen_at: dict[str, float] = {}
        self.jobs_after: list[dict] | None = None
        self.jobs_seen_at: float | None = None
        self.back: float | None = None
        self._next_look = 0.0

    def _tick(self) -> bool:
        super()._tick()
        if time.monotonic() < self._next_look:
            return True
        self._next_look = time.monotonic() + 0.1
        faults = self.injector.records if self.injector is not None else []
        if not faults:
            return True
        if self.back is None:
            self.back = time.time()
        statuses = self.scrape("/status")
        nodes = set(self.nodes)
        for node, status in statuses.items():
            peers = {p["node"] for p in status.get("peers", [])}
            if (node not in self.all_seen_at and peers >= nodes - {node}
                    and LOST_LINE in self._log(node)):
                self.all_seen_at[node] = time.time()
        if self.jobs_seen_at is None and len(self.all_seen_at) == len(nodes):
            out = subprocess.run(
                [sys.executable, "-m", "elasticd.cli.main", "jobs", "--format", "json",
                 "--etcd", self.etcd, "--prefix", self.prefix],
                capture_output=True, text=True, timeout=30)
            if out.returncode == 0:
                self.jobs_after = json.loads(out.stdout)
                if any(j["job"] == self.job for j in self.jobs_after):
                    self.jobs_seen_at = time.time()
        return True

    def _log(self, node: str) -> str:
        with open(os.path.join(self.workdir, f"{node}.log"), errors="replace") as fh:
            return fh.read()


def test_etcd_wiped_during_training_the_job_goes_on(tmp_path):
    shape = Shape(nodes=("n1", "n2", "n3"), standby=(), nnodes="2:3", steps=150,
                  step_time=0.1, etcd_members=1)
    cc = _WatchedCluster(tmp_path, shape)
    out = cc.run(FaultPlan().wipe_etcd(at_step=80), timeout=200)
    assert out.faults and cc.back is not None, "the wipe never fired"
    back = cc.back  # etcd healthy again, and empty
    print(f"etcd back at {back:.2f}; every peer seen at "
          f"{ {n: round(t - back, 2) for n, t in cc.all_seen_at.items()} }; the job in "
          f"elasticctl jobs at {None if cc.jobs_seen_at is None else round(cc.jobs_seen_at - back, 2)}")

    out.assert_finished()
    out.assert_samples_exactly_once()
    out.assert_nothing_left()
    # 0 worker restarts: one worker group, each rank started once and ran every step in it.
    assert len(out.attempts) == 1, [(a.id, a.world) for a in out.attempts]
    assert sorted(s.rank for s in out.starts) == [0, 1, 2], out.starts
    only = out.attempts[0]
    assert all(steps == list(range(1, shape.steps + 1)) for steps in only.steps.values()), \
        {rank: (steps[0], steps[-1], len(steps)) for rank, steps in only.steps.items()}
    # Every daemon sees every peer again within a lease TTL (plus the fault's own end).
    assert set(cc.all_seen_at) == set(shape.nodes), cc.all_seen_at
    slow = {n: t - back for n, t in cc.all_seen_at.items()
            if t - back > shape.lease_ttl + 3.0}
    assert not slow, f"daemons that saw every peer only late after etcd's return: {slow}"
    # The job survived the loss of its keys: elasticctl shows it, still wanted.
    assert cc.jobs_seen_at is not None, f"elasticctl jobs never showed the job: {cc.jobs_after}"
    mine = [j for j in cc.jobs_after if j["job"] == cc.job]
    assert mine[0]["desired"] == "running", cc.jobs_after
    assert cc.jobs_seen_at - back <= shape.lease_ttl + 3.0, cc.jobs_seen_at - back
    # Nobody declared failed, nobody fenced, and the loss said once by each daemon, once as
    # an event.
    assert not [e for e in out.events if e["kind"] in ("failed", "fenced")], out.events
    lost_events = [e for e in out.events if e["kind"] == "etcd_data_lost"]
    assert len(lost_events) == 1, out.events
    for node in shape.nodes:
        with open(tmp_path / f"{node}.log", errors="replace") as fh:
            text = fh.read()
        assert text.count(LOST_LINE) == 1, f"{node}: {text.count(LOST_LINE)} '{LOST_LINE}' lines"
        assert "fencing:" not in text, f"{node} fenced itself"
