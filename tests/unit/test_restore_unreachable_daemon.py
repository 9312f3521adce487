"""A rank whose daemon does not answer makes the restore fail on every rank, never start over.

Before, the silent rank listed nothing, so no committed step was loadable on every rank and the
whole group started again from step 0 while step N was committed (bench: SIGSTOP of one node's
daemon, 0 of 6 recoveries). The collective is simulated: this rank's rows plus the other rank's.
"""

from __future__ import annotations

import pytest

from elasticd.worker.restore import Collective, DaemonUnreachable, restore
from elasticd.worker.sources import Sources
from elasticd.worker.client import DaemonTimeout
from elasticd.worker.transport import Transport


class SilentDaemon(Transport):
    def call(self, op, **fields):
        raise DaemonTimeout(f"elasticd did not answer {op!r} within 10 s")


class HealthyDaemon(Transport):
    """Holds step (0, 7) for this rank; step (0, 7) is committed at world size 2."""

    def call(self, op, **fields):
        if op == "ckpt_list":
            return {"ram": {str(fields["rank"]): [[0, 7]]}, "persisted": [], "progress": [0, 7]}
        if op == "ckpt_committed":
            return {"committed": True, "generation": 0, "step": 7, "ranks": [0, 1]}
        raise AssertionError(f"restore must not get as far as {op!r}")


class TwoRanks(Collective):
    """This rank's collective, with the other rank's rows given; the other rank's flags hold
    (it reached and loaded what this one did)."""

    def __init__(self, other_rows):
        self.other = other_rows

    def all_gather(self, rows):
        return [list(rows), list(self.other)]

    def all_true_each(self, flags):
        return [bool(f) for f in flags]

    def gather_if_all_true(self, flag, rows):
        return [list(rows), list(rows)] if flag else None


HEALTHY_ROWS = [(0, 7), (0, 7), (2, 1), (0, 0), (0, 7)]
SILENT_ROWS = [(-1, -1), (-1, -1), (-1, 1), (1, 0)]


def test_my_silent_daemon_fails_the_restore_instead_of_starting_over():
    sources = Sources(SilentDaemon(), "job", rank=0, world_size=2)
    with pytest.raises(DaemonUnreachable, match=r"rank\(s\) 0 does not answer.*within 10 s"):
        restore({}, sources, TwoRanks(HEALTHY_ROWS), clock=lambda: 0.0)


def test_a_peer_ranks_silent_daemon_fails_mine_too():
    sources = Sources(HealthyDaemon(), "job", rank=0, world_size=2)
    with pytest.raises(DaemonUnreachable, match=r"rank\(s\) 1 does not answer"):
        restore({}, sources, TwoRanks(SILENT_ROWS), clock=lambda: 0.0)


def test_healthy_daemons_agree_on_the_committed_step():
    from elasticd.worker.restore import agree

    sources = Sources(HealthyDaemon(), "job", rank=0, world_size=2)
    agreed = agree(sources, TwoRanks(HEALTHY_ROWS))
    assert agreed.candidates[0] == ((0, 7), 2)


class DaemonSilentOnFetch(HealthyDaemon):
    """Lists step (0, 7) as committed but not in RAM, then does not answer the fetch."""

    def call(self, op, **fields):
        if op == "ckpt_list":
            return {"ram": {}, "persisted": [], "progress": [0, 7]}
        if op == "ckpt_fetch":
            raise DaemonTimeout("elasticd did not answer 'ckpt_fetch' within 10 s")
        return super().call(op, **fields)


def test_a_fetch_the_daemon_does_not_answer_fails_the_restore_instead_of_trying_older():
    sources = Sources(DaemonSilentOnFetch(), "job", rank=0, world_size=2)
    with pytest.raises(DaemonUnreachable, match=r"fetching step \(0, 7\).*ckpt_fetch"):
        restore({}, sources, TwoRanks(HEALTHY_ROWS), clock=lambda: 0.0)


class SlowFetchDaemon(DaemonSilentOnFetch):
    """Answers a fetch only to a caller that waits longer than the client's 10 s default (the
    daemon's own deadlines bound the fetch: a 1 GiB shard at 50 MB/s takes ~20 s)."""

    def __init__(self):
        self.waits = {}

    def call(self, op, **fields):
        self.waits[op] = fields.pop("timeout", None)
        if op == "ckpt_fetch":
            if (self.waits[op] or 10.0) < 600:
                raise DaemonTimeout("elasticd did not answer 'ckpt_fetch' within 10 s")
            return {"lost": True, "reason": "no holder answered within its deadline"}
        return super().call(op, **fields)


def test_a_fetch_waits_for_the_daemons_own_deadlines_not_the_clients_default():
    from elasticd.worker.sources import FETCH_WAIT

    daemon = SlowFetchDaemon()
    sources = Sources(daemon, "job", rank=0, world_size=2)
    result = restore({}, sources, TwoRanks(HEALTHY_ROWS), clock=lambda: 0.0)
    assert daemon.waits["ckpt_fetch"] == FETCH_WAIT >= 600
    assert daemon.waits["ckpt_list"] is None  # quick ops keep the default
    assert any("lost (no holder answered within its deadline)" in r for r in result.refused)
