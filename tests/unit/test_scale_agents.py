"""The scale simulator's agents (bench/scale_agents.py) restart into the next round when
``num_nodes_waiting`` says a node waits outside theirs, as torchrun's agents do.

The rendezvous here is a stand-in beside the simulator's loop (the loop is what is tested; the
simulator drives elasticd's own handler, on real etcd, in bench/scale_native.py): round 0 closes
with two of three nodes, the third joins late and waits; only the members' restart, asked by
``num_nodes_waiting``, forms a round with all three. The simulator before this change called
``next_rendezvous`` once per agent and waited for every one: an N = 1,000 run hung so."""

from __future__ import annotations

import concurrent.futures
import threading
import time

from tests.bench_modules import load



def _agent_runs():
    return load("scale_agents").AgentRuns


class TwoThenAll:
    """Round 0 closes once ``first`` joined; every later round once every node joined.
    ``num_nodes_waiting`` counts the nodes joined and not members of the last round."""

    def __init__(self, first: set[str], every: set[str]) -> None:
        self.cond = threading.Condition()
        self.round, self.members, self.joined = -1, set(), set()
        self.first, self.every = first, every
        self.asked = 0

    def next_rendezvous(self, node: str) -> tuple[str, int]:
        with self.cond:
            target = self.round + 1
            self.joined.add(node)
            if self.joined >= (self.first if self.round < 0 else self.every):
                self.round, self.members, self.joined = self.round + 1, set(self.joined), set()
                self.cond.notify_all()
            while not (self.round >= target and node in self.members):
                if self.round >= target:  # closed without this node: the next one
                    target = self.round + 1
                self.cond.wait(0.05)
            return node, self.round

    def num_nodes_waiting(self, node: str) -> int:
        with self.cond:
            self.asked += 1
            return len(self.joined - self.members)


def _wait_for(cond, limit: float = 20.0) -> bool:
    deadline = time.monotonic() + limit
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(0.01)
    return False


def test_a_node_left_outside_a_closed_round_is_taken_in_by_the_members_restart():
    AgentRuns = _agent_runs()
    rdzv = TwoThenAll({"a", "b"}, {"a", "b", "c"})
    round0 = threading.Event()

    def join(node: str) -> tuple[str, int]:
        if node == "c" and not round0.is_set():  # late: round 0 closes without it
            assert _wait_for(lambda: rdzv.round >= 0)
            round0.set()
        return rdzv.next_rendezvous(node)

    with concurrent.futures.ThreadPoolExecutor(3) as pool:
        runs = AgentRuns(join, rdzv.num_nodes_waiting, lambda node: (rdzv.round,), pool.submit,
                         interval=0.01, ask_every=0.05)
        runs.start(["a", "b", "c"])
        together = _wait_for(lambda: set(runs.latest().values()) == {
            ("a", 1), ("b", 1), ("c", 1)})
        results = runs.settle(timeout=10)
    assert together, runs.latest()
    assert sorted(results) == [("a", 1), ("b", 1), ("c", 1)]
    assert runs.restarts() == 2  # a and b, once each


def test_members_of_a_whole_round_are_asked_and_keep_training():
    AgentRuns = _agent_runs()
    rdzv = TwoThenAll({"a", "b"}, {"a", "b"})
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        runs = AgentRuns(rdzv.next_rendezvous, rdzv.num_nodes_waiting,
                         lambda node: (rdzv.round,), pool.submit, interval=0.01, ask_every=0.02)
        runs.start(["a", "b"])
        assert _wait_for(lambda: rdzv.asked >= 6)  # asked again and again: nobody waits
        results = runs.settle(timeout=10)
    assert sorted(results) == [("a", 0), ("b", 0)] and runs.restarts() == 0


def test_an_agent_whose_rendezvous_raises_is_reported_not_waited_for():
    AgentRuns = _agent_runs()

    def join(node: str) -> tuple[str, int]:
        raise RuntimeError("etcd gone")

    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        runs = AgentRuns(join, lambda node: 0, lambda node: (), pool.submit, interval=0.01)
        runs.start(["a"])
        assert _wait_for(lambda: runs.latest()["a"] is not None)
        assert runs.settle(timeout=10) == ["RuntimeError('etcd gone')"]
