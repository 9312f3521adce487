"""The agent's watch over its daemon: fence only when the node's record is gone from etcd for a
while *and* the daemon does not answer; never judge from a failed etcd read."""

from __future__ import annotations

import socket

import pytest

from elasticd.agent.daemon_watch import DaemonWatch, ping_daemon
from elasticd.clock import FakeClock
from elasticd.coordination.api import Unavailable
from elasticd.coordination.memory import MemoryCoordinator

KEY = b"/t/nodes/n1"


class Env:
    def __init__(self):
        self.coord = MemoryCoordinator()
        self.clock = FakeClock()
        self.answers = True
        self.pings = 0
        self.watch = DaemonWatch(self.coord, KEY, ping=self.ping, fence=lambda r: None,
                                 absent_for=1.0, clock=self.clock)

    def ping(self) -> bool:
        self.pings += 1
        return self.answers

    def tick(self, after: float = 0.5):
        self.clock.sleep(after)
        return self.watch.tick()


@pytest.fixture
def env():
    return Env()


def test_a_present_record_never_fences(env):
    env.coord.put(KEY, b"{}")
    env.answers = False
    assert all(env.tick() is None for _ in range(10))
    assert env.pings == 0


def test_a_gone_record_and_a_silent_daemon_fence_after_the_delay(env):
    env.answers = False
    assert env.tick() is None  # absence starts
    assert env.tick() is None and env.pings == 0  # 0.5 s: too short to ask
    reason = env.tick()  # 1.0 s
    assert reason is not None and "declared dead" in reason and "does not answer" in reason


def test_a_daemon_that_answers_is_left_in_charge(env):
    for _ in range(10):
        assert env.tick() is None
    assert env.pings > 0


def test_the_record_coming_back_resets_the_absence(env):
    env.answers = False
    env.tick()
    env.tick()
    env.coord.put(KEY, b"{}")
    assert env.tick() is None
    env.coord.delete(KEY)
    assert env.tick() is None and env.tick() is None  # 0.5 s of absence only
    assert env.tick() is not None


def test_a_failed_read_forgets_the_absence(env, monkeypatch):
    env.answers = False
    env.tick()
    env.tick()
    real_get = env.coord.get

    def unreachable(key):
        raise Unavailable("etcd is unreachable")

    monkeypatch.setattr(env.coord, "get", unreachable)
    assert env.tick() is None
    monkeypatch.setattr(env.coord, "get", real_get)
    assert env.tick() is None and env.tick() is None  # counted afresh
    assert env.tick() is not None


def test_ping_tells_a_silent_socket_from_a_live_one(tmp_path):
    path = str(tmp_path / "d.sock")
    srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    srv.bind(path)
    srv.listen(4)  # accepts connections in the kernel, never answers: a frozen daemon
    try:
        assert ping_daemon(path, timeout=0.2)() is False
    finally:
        srv.close()
    assert ping_daemon(str(tmp_path / "none.sock"), timeout=0.2)() is False


def test_ping_of_a_real_daemon_api(tmp_path):
    from elasticd.daemon.local_api import LocalServer

    path = str(tmp_path / "d.sock")
    server = LocalServer(path, {"ping": lambda msg: {"node": "n1"}})
    server.start()
    try:
        assert ping_daemon(path, timeout=2.0)() is True
    finally:
        server.stop()
