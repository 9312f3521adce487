"""An in-process round's collective timeout is learned from the worker's steps by the hang
timeout's rule with a floor of its own, and the agent's fallback deadline follows it (issue 31:
a frozen or partitioned peer's survivors leave at the collective timeout, in-process, before
their agent falls back).

Each fails on the code before it: the group's timeout was the decorator's constant (60 s, 30 s
in the example), the link carried no timeout and the agent waited the job's reform deadline
(10 s) whatever the workers' groups had."""

from __future__ import annotations

import logging
import os
import re
import subprocess
import sys

import pytest

from elasticd.agent import job_rules
from elasticd.agent.worker_link import LinkServer
from elasticd.cluster.learned_timeout import WARMUP_STEPS
from elasticd.local import worker_link as link
from elasticd.worker.collective_timeout import FLOOR, CollectiveTimeout, worth_setting


def _steps(ct: CollectiveTimeout, start: float, intervals: list[float]) -> float:
    now = start  # the last step boundary
    for seconds in intervals:
        now += seconds
        ct.step(now)
    return now


def test_a_rounds_first_steps_get_the_warm_up_then_the_learned_rule_with_its_floor():
    ct = CollectiveTimeout(floor=FLOOR, first=30.0)
    assert ct.seconds() == 30.0 and ct.source() == "first_step"  # nothing learned
    ct.step(0.0)
    now = _steps(ct, 0.0, [9.0] * WARMUP_STEPS)  # long first steps (restore, compile)
    assert ct.seconds() == 30.0 and ct.history.learned == 0  # not learned from
    now = _steps(ct, now, [0.1])
    assert ct.seconds() == FLOOR == 5.0 and ct.source() == "floor"  # 5 x 0.1 < the floor
    _steps(ct, now, [2.0])
    assert ct.seconds() == 10.0 and ct.source() == "learned"  # 5 x the longest step
    # A new round: its first steps are warm-up again (what was learned stays), and the gap
    # since the last round's last step is no step.
    ct.round_started()
    ct.step(1000.0)
    assert ct.seconds() == 30.0 and ct.history.learned == 2
    _steps(ct, 1000.0, [0.1] * (WARMUP_STEPS + 1))
    assert ct.seconds() == 10.0


def test_a_timeout_with_no_member_gone_doubles_it_as_the_hang_rule_does():
    ct = CollectiveTimeout(floor=5.0, first=60.0)
    ct.step(0.0)
    _steps(ct, 0.0, [0.1] * (WARMUP_STEPS + 1))
    ct.fired()
    assert ct.seconds() == 10.0
    for _ in range(10):
        ct.fired()
    assert ct.seconds() == 5.0 * 16  # capped, as the hang timeout


def test_the_group_is_set_again_only_up_or_clearly_down():
    assert worth_setting(5.0, None)
    assert worth_setting(5.01, 5.0)  # a longer step learned: never cut it
    assert not worth_setting(4.8, 5.0) and not worth_setting(5.0, 5.0)
    assert worth_setting(4.4, 5.0)


def test_the_agent_waits_the_collective_timeout_when_shorter_than_the_jobs_deadline():
    assert job_rules.reform_wait(10.0, None) == (10.0, "the job's reform deadline 10 s")
    assert job_rules.reform_wait(10.0, 5.0) == (5.0, "the workers' collective timeout 5 s")
    assert job_rules.reform_wait(4.0, 5.0) == (4.0, "the job's reform deadline 4 s")
    assert job_rules.reform_wait(10.0, 30.0)[0] == 10.0  # the warm-up: the deadline holds
    # The daemon's backstop stays behind the agent's deadline, whichever set it.
    book = job_rules.JobBook()
    book.reform_started(0.0, 10.0)
    assert book.reform_by == 10.0 + job_rules.REFORM_ROUND_ALLOWANCE


def test_the_link_keeps_each_workers_collective_timeout_until_all_said(caplog):
    caplog.set_level(logging.INFO, logger="elasticd.agent.worker_link")
    server = LinkServer()
    socks = [link.connect(server.name, os.getpid()) for _ in range(2)]
    try:
        for local, sock in enumerate(socks):
            link.send(sock, {"op": "hello", "local_rank": local, "pid": 1})
        link.send(socks[0], {"op": "timeout", "seconds": 5.0, "source": "floor"})
        link.send(socks[0], {"op": "timeout", "seconds": "x"})  # malformed: ignored
        _wait(lambda: server.timeouts.get(0) == 5.0)
        assert server.collective_timeout(2) is None  # local rank 1 has not said
        link.send(socks[1], {"op": "timeout", "seconds": 7.5, "source": "learned"})
        _wait(lambda: server.timeouts.get(1) == 7.5)
        assert server.collective_timeout(2) == 7.5
        # Each value the agent takes is in its log with the rule that set it (a source the
        # worker did not give, or not one of the rule's, is not repeated).
        link.send(socks[1], {"op": "timeout", "seconds": 7.5, "source": "learned"})  # again
        link.send(socks[1], {"op": "timeout", "seconds": 9.0, "source": "x\nforged line"})
        last = {"local rank 0: collective timeout 5 s (floor)",
                "local rank 1: collective timeout 9 s (source not given)"}
        _wait(lambda: last <= {r.getMessage() for r in caplog.records})  # logged after the lock
        said = [r.getMessage() for r in caplog.records]
        assert "local rank 0: collective timeout 5 s (floor)" in said
        assert said.count("local rank 1: collective timeout 7.5 s (learned)") == 1
        assert "local rank 1: collective timeout 9 s (source not given)" in said
    finally:
        for sock in socks:
            sock.close()


def _wait(cond, timeout: float = 5.0) -> None:
    import time

    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            pytest.fail("timed out")
        time.sleep(0.01)


SLOW_STEPS = """
import os, time
import torch, torch.distributed as dist
import elasticd

rank = int(os.environ["RANK"])


@elasticd.in_process(timeout=20)
def train(r):
    t = torch.ones(1)
    for _ in range(5):  # steps of ~1.2 s: 5 x that, the learned timeout, is above the floor
        r.check()
        dist.all_reduce(t)
        time.sleep(1.2)
    r.check()
    print("learned", r.collective_timeout, flush=True)
    if rank == 1:
        time.sleep(3600)  # silent, its sockets open: a frozen or cut-off peer
    dist.all_reduce(t)  # rank 0: its peer never joins


train()
"""


def test_a_silent_peers_collective_ends_at_the_timeout_learned_from_real_steps(tmp_path):
    """Two real linked gloo workers (world 2) learn their collective timeout from real steps of
    ~1.2 s (5 x the longest: ~6 s, above the 5 s floor and below the decorator's 20 s), set it
    on their group and tell their agent; then rank 1 goes silent (a frozen or partitioned
    node's worker: no reset, nothing sent) and rank 0's pending all_reduce ends at that learned
    timeout, which gloo's error names, and rank 0 leaves its round. With the timeout a constant
    (the decorator's 20 s, or the floor) the value told and the one gloo names are that."""
    from tests.unit.test_in_process_worker import _free_port, _worker_env

    script = tmp_path / "slow.py"
    script.write_text(SLOW_STEPS)
    port = _free_port()
    servers = [LinkServer(), LinkServer()]
    procs = []
    try:
        for rank, server in enumerate(servers):
            env = {**_worker_env(port, ELASTICD_LINK=server.name,
                                 ELASTICD_LINK_PID=str(os.getpid()), ELASTICD_ROUND="3"),
                   "RANK": str(rank), "WORLD_SIZE": "2"}
            procs.append(subprocess.Popen([sys.executable, str(script)], env=env,
                                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                          text=True))
        _wait(lambda: 0 in servers[0].left_rounds(), 60)
        told = servers[0].timeouts[0]
        round_, _, why = servers[0].left_rounds()[0]
        waited = re.search(r"Timed out waiting (\d+)ms", why)
        assert round_ == 3 and waited, why
        assert FLOOR < told < 20.0, told  # learned, above the floor: not a constant
        assert abs(int(waited.group(1)) - told * 1000) <= 1, (why, told)  # told in ms, 3 places
        assert 1 not in servers[1].left_rounds()  # the silent one had nothing pending
    finally:
        for proc in procs:
            proc.kill()
            proc.wait()
