"""A peer whose daemon's port refuses connections after a worker's collective broke has its
lease revoked at once (elasticd/daemon/peer_probe.py, issue 31), on real sockets: a port nobody
listens on refuses; a listening socket nobody accepts on (a frozen daemon) answers; a port that
answers after a restart is never taken for a death; nor is an address that gives no answer."""

from __future__ import annotations

import socket
import threading
import types

from elasticd.cluster.membership import NodeRecord
from elasticd.coordination.api import CoordinationError
from elasticd.daemon.local_api import LocalServer
from elasticd.daemon.peer_probe import Answer, PeerProbe, knock, suspects
from elasticd.daemon.worker_channel import WorkerChannel
from elasticd.testing.clock import FakeClock
from elasticd.worker import in_process


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]  # nothing listens once closed


def _listening() -> socket.socket:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    s.listen(8)  # never accepted: the kernel completes the handshake (a stopped daemon)
    return s


def _rec(node: str, address: str, lease: int, state: str = "up") -> NodeRecord:
    return NodeRecord(node, state, address, "h", 1, "i", 0.0, 0.0, "v", lease)


def test_knock_tells_a_refusal_from_an_answer_and_from_no_answer():
    with _listening() as s:
        assert knock(f"127.0.0.1:{s.getsockname()[1]}") is Answer.ANSWERED
    assert knock(f"127.0.0.1:{_closed_port()}") is Answer.REFUSED
    # An address that proves nothing: unparsable, or no route / no answer in time.
    assert knock("nonsense") is Answer.SILENT
    assert knock("[::1", timeout=0.05) is Answer.SILENT


def test_only_a_refusing_peer_of_the_job_loses_its_lease():
    revoked: list[int] = []
    with _listening() as alive:
        dead = f"127.0.0.1:{_closed_port()}"
        peers = [_rec("me", dead, 1), _rec("n2", dead, 2),
                 _rec("n3", f"127.0.0.1:{alive.getsockname()[1]}", 3),
                 _rec("n4", dead, 4, state="leaving"), _rec("n5", dead, 5),
                 _rec("n6", "", 6), _rec("n7", f"127.0.0.1:{_closed_port()}", 7)]
        ran = {"n2", "n3", "n4", "n6", "n7"}  # n5 ran no worker of the job (a spare)
        probe = PeerProbe("me", lambda: suspects(peers, "me", ran.__contains__),
                          revoked.append, FakeClock(), timeout=0.05)
        # The baseline: every port answered once (n7's never did: a refusal from a port this
        # node never reached proves nothing, as a firewall's reject).
        ports = {r.node: r.address for r in peers}
        probe.knock = lambda address, timeout: (
            Answer.ANSWERED if address != ports["n7"] else Answer.REFUSED)
        probe.knock_all(peers)
        probe.knock = knock
        assert ("n7", 7) not in probe.answered and ("n2", 2) in probe.answered
        probe.probe_series("DistError: Connection reset by peer")
    assert revoked == [2]


def test_a_daemon_back_on_the_same_port_is_not_declared_dead():
    # The port refuses until a new daemon binds it: a refusal seen before is acted on once
    # (the old lease); once it answers, no probe of that series revokes anything.
    port = _closed_port()
    revoked: list[int] = []
    server = socket.socket()
    server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    server.bind(("127.0.0.1", port))
    server.listen(8)
    try:
        probe = PeerProbe("me", lambda: [_rec("n2", f"127.0.0.1:{port}", 2)], revoked.append,
                          FakeClock())
        probe.answered.add(("n2", 2))
        probe.probe_series()
        assert revoked == []
    finally:
        server.close()


def test_a_break_reported_on_the_local_socket_starts_one_series(tmp_path, monkeypatch):
    # The worker's note (elasticd.worker.in_process.group_broke) over a real local socket
    # reaches the probe; a second note while the series runs starts none.
    class Jobs:
        job = "job"

    started: list[str] = []
    gate = threading.Event()

    def slow_peers():
        gate.wait(10)
        return []

    probe = PeerProbe("me", slow_peers, lambda lease: None, FakeClock())
    timeline = types.SimpleNamespace(on_reform_moments=lambda msg: None)  # not reached here
    channel = WorkerChannel("me", "/p", Jobs(), timeline, None, lambda *a: None)  # type: ignore
    channel.on_group_broke = lambda why: started.append(why) or probe.suspect(why)
    server = LocalServer(str(tmp_path / "d.sock"), channel.handlers())
    server.start()
    try:
        monkeypatch.setenv("ELASTICD_SOCKET", server.path)  # and back to what it was after
        assert in_process.group_broke(RuntimeError("Connection reset by peer"))
        assert not in_process.group_broke(in_process.Reformation("asked"))
        for _ in range(500):
            if started:
                break
            threading.Event().wait(0.01)
        assert started == ["RuntimeError: Connection reset by peer"]
        assert not probe.suspect("again")  # the first series still runs
        gate.set()
    finally:
        server.stop()


def test_the_restart_path_agent_reports_a_failed_worker(tmp_path):
    # Under the restart path a script without the wrapper dies of the broken collective: the
    # agent's monitor, finding the worker failed, tells the daemon (a real local socket).
    from torch.distributed.elastic.agent.server.api import RunResult, WorkerState

    from elasticd.agent.torchrun import report_failed_workers

    class Agent:
        state = WorkerState.HEALTHY

        def _monitor_workers(self, wg):
            return RunResult(state=self.state)

    notes: list[str] = []
    server = LocalServer(str(tmp_path / "d.sock"), {"group_broke": notes.append})
    server.start()
    try:
        report_failed_workers(Agent, server.path)
        agent = Agent()
        agent._monitor_workers(None)  # healthy: nothing told
        agent.state = WorkerState.FAILED
        assert agent._monitor_workers(None).state is WorkerState.FAILED
        for _ in range(500):
            if notes:
                break
            threading.Event().wait(0.01)
        assert [n["why"] for n in notes] == ["the agent found a worker failed"]
    finally:
        server.stop()


def test_the_baseline_knocks_a_lease_once_and_forgets_older_leases():
    knocked: list[str] = []
    probe = PeerProbe("me", lambda: [], lambda lease: None, FakeClock(),
                      knock=lambda address, timeout: knocked.append(address) or Answer.ANSWERED)
    probe.knock_all([_rec("n2", "a:1", 2), _rec("n3", "b:1", 3)])
    probe.knock_all([_rec("n2", "a:1", 2), _rec("n3", "b:1", 3)])
    assert knocked == ["a:1", "b:1"]  # the second round knocks nobody it knows
    probe.knock_all([_rec("n2", "a:1", 2), _rec("n3", "b:2", 30)])  # n3 came back
    assert probe.answered == {("n2", 2), ("n3", 30)}  # its old lease is never probed again


def test_a_revoked_lease_is_recorded_as_revoked_with_the_refusal_not_as_expired():
    # The failure the probe causes is described as what happened (the failed event's detail
    # is this description): before, "lease 2 expired: silent for at most 2.0 s".
    from elasticd.cluster.membership import Membership, ObservationKind

    membership = Membership("me", 5.0, lease_ttl=2.0)
    dead = f"127.0.0.1:{_closed_port()}"
    rec = _rec("n2", dead, 2)
    membership.on_put(_rec("n3", dead, 3))
    membership.on_put(rec)
    order: list[str] = []
    probe = PeerProbe("me", lambda: [rec], lambda lease: order.append("revoke"), FakeClock(),
                      timeout=0.05,
                      revoking=lambda r, why: (order.append("told"),
                                               membership.revoked(r.lease, why)))
    probe.answered.add(("n2", 2))
    probe.probe_series("DistError: Connection reset by peer")
    assert order == ["told", "revoke"]  # known before the deletion can arrive
    (ob,) = membership.on_delete("n2", 10.0, 10.0, cut_off=False)
    assert ob.kind is ObservationKind.FAILED
    assert ob.describe() == (f"n2 failed (its daemon refused connections at {dead} after a "
                             "collective broke, found by me's probe: lease 2 revoked)")
    (other,) = membership.on_delete("n3", 10.0, 10.0, cut_off=False)  # an expiry: as before
    assert other.describe() == "n3 failed (lease 3 expired: silent for at most 2.0 s)"


def test_a_revocation_that_failed_leaves_the_failure_described_as_an_expiry():
    # The probe says "revoked" before it revokes (the deletion may arrive first); when etcd
    # refuses the revocation the lease expires as usual, and the failure must say so.
    from elasticd.cluster.membership import Membership

    membership = Membership("me", 5.0, lease_ttl=2.0)
    dead = f"127.0.0.1:{_closed_port()}"
    rec = _rec("n2", dead, 2)
    membership.on_put(rec)

    def refuse(lease: int) -> None:
        raise CoordinationError("etcd unreachable")

    probe = PeerProbe("me", lambda: [rec], refuse, FakeClock(), timeout=0.05,
                      revoking=lambda r, why: membership.revoked(r.lease, why))
    probe.answered.add(("n2", 2))
    probe.probe_series("DistError: Connection reset by peer")
    assert membership.causes == {}
    (ob,) = membership.on_delete("n2", 10.0, 10.0, cut_off=False)
    assert ob.describe() == "n2 failed (lease 2 expired: silent for at most 2.0 s)"
