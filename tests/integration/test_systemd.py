"""The systemd integration: the unit passes `systemd-analyze verify`, and the notify protocol
(READY, WATCHDOG, RELOADING, STOPPING) is seen on a NOTIFY_SOCKET the test owns — including
the watchdog pings stopping when the main loop stalls."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time

import pytest

from elasticd.clock import SystemClock
from elasticd.config import Settings
from elasticd.testing.coordination import MemoryCoordinator, MemoryStore
from elasticd.daemon.daemon import Daemon
from elasticd.daemon.main import Notifier

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
UNIT = os.path.join(REPO, "systemd", "elasticd.service")


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="needs systemd-analyze")
def test_unit_verifies(tmp_path):
    elasticd_bin = os.path.join(os.path.dirname(sys.executable), "elasticd")
    assert os.access(elasticd_bin, os.X_OK)
    text = open(UNIT).read().replace("/usr/local/bin/elasticd", elasticd_bin)
    unit = tmp_path / "elasticd.service"
    unit.write_text(text)
    res = subprocess.run(["systemd-analyze", "verify", str(unit)], capture_output=True,
                         text=True, timeout=60)
    assert res.returncode == 0, res.stderr
    problems = [line for line in res.stderr.splitlines() if "elasticd.service" in line]
    assert not problems, problems
    for must in ("Type=notify", "WatchdogSec=", "ExecReload=", "Restart=on-failure",
                 "KillMode=mixed", "TimeoutStopSec=", "LimitMEMLOCK=infinity",
                 "EnvironmentFile="):
        assert must in text


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="needs systemd-analyze")
def test_the_huge_page_mount_unit_verifies_and_the_example_config_uses_it(tmp_path):
    name = "run-elasticd-shm.mount"
    text = open(os.path.join(REPO, "systemd", name)).read()
    unit = tmp_path / name
    unit.write_text(text)
    res = subprocess.run(["systemd-analyze", "verify", str(unit)], capture_output=True,
                         text=True, timeout=60)
    assert res.returncode == 0, res.stderr
    assert not [line for line in res.stderr.splitlines() if name in line]
    fields = dict(line.split("=", 1) for line in text.splitlines()
                  if "=" in line and not line.startswith("#"))
    # systemd requires a mount unit to be named after its mount point.
    escaped = subprocess.run(["systemd-escape", "--path", "--suffix=mount", fields["Where"]],
                             capture_output=True, text=True, check=True).stdout.strip()
    assert escaped == name
    assert fields["Type"] == "tmpfs" and "huge=within_size" in fields["Options"].split(",")
    config = open(os.path.join(REPO, "systemd", "elasticd.toml.example")).read()
    shm_dir = next(line.split("=", 1)[1].strip().strip('"') for line in config.splitlines()
                   if line.startswith("shm_dir"))
    assert shm_dir.startswith(fields["Where"] + "/")
    assert "After=run-elasticd-shm.mount" in open(UNIT).read()


class NotifyListener:
    def __init__(self, path):
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind(path)
        self.sock.settimeout(0.2)
        self.messages: list[tuple[float, str]] = []
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._run, daemon=True)
        self._t.start()

    def _run(self):
        while not self._stop.is_set():
            try:
                data = self.sock.recv(4096)
            except socket.timeout:
                continue
            except OSError:
                return
            self.messages.append((time.monotonic(), data.decode()))

    def seen(self, needle):
        return [t for t, m in self.messages if needle in m.split("\n")]

    def wait(self, needle, timeout=15, after=0.0):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            hits = [t for t in self.seen(needle) if t > after]
            if hits:
                return hits[0]
            time.sleep(0.05)
        raise AssertionError(f"no {needle} within {timeout} s; got {self.messages}")

    def close(self):
        self._stop.set()
        self._t.join()
        self.sock.close()


@pytest.mark.etcd
@pytest.mark.timeout(90)
def test_notify_ready_watchdog_reload_stopping(etcd, prefix, tmp_path):
    listener = NotifyListener(str(tmp_path / "notify.sock"))
    cfg = tmp_path / "elasticd.toml"
    cfg.write_text("log_level = \"INFO\"\n")
    proc = subprocess.Popen(
        [sys.executable, "-m", "elasticd.daemon.main", "--node-id", "sd1", "--etcd",
         etcd.endpoints, "--prefix", prefix, "--listen", "127.0.0.1:0", "--lease-ttl", "2",
         "--loop-interval", "0.2", "--state-dir", str(tmp_path / "state"),
         "--shm-dir", str(tmp_path / "shm"),
         "--config", str(cfg)],
        env={**os.environ, "NOTIFY_SOCKET": str(tmp_path / "notify.sock")},
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        ready = listener.wait("READY=1")
        listener.wait("WATCHDOG=1", after=ready)
        time.sleep(1.0)
        assert len([t for t in listener.seen("WATCHDOG=1") if t > ready]) >= 3
        cfg.write_text("log_level = \"DEBUG\"\n")
        hup = time.monotonic()
        proc.send_signal(signal.SIGHUP)
        reloading = listener.wait("RELOADING=1", after=hup)
        listener.wait("READY=1", after=reloading)
        time.sleep(0.6)  # a few cycles at the new log level
        term = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        listener.wait("STOPPING=1", after=term)
        assert proc.wait(30) == 0
        out = proc.stdout.read().decode()
        assert "reloaded settings" in out
        assert "DEBUG" in out.split("reloaded settings", 1)[1]  # the new log level applies
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        listener.close()


class StallableCoordinator(MemoryCoordinator):
    """A coordinator whose writes block while ``stall`` is set: a hung client call."""

    def __init__(self, store):
        super().__init__(store)
        self.stall = threading.Event()
        self.release = threading.Event()

    def put(self, key, value, lease=0):
        if self.stall.is_set():
            self.release.wait()
        return super().put(key, value, lease)


@pytest.mark.timeout(60)
def test_watchdog_pings_stop_when_the_loop_stalls(tmp_path):
    listener = NotifyListener(str(tmp_path / "notify.sock"))
    coord = StallableCoordinator(MemoryStore(SystemClock()))
    s = Settings(node_id="w1", etcd="mem:1", lease_ttl=5, loop_interval=0.1,
                 heartbeat_interval=0.2, state_dir=str(tmp_path / "state"))
    d = Daemon(s, coord)
    d.join()
    notifier = Notifier(str(tmp_path / "notify.sock"))
    t = threading.Thread(target=d.run, args=(lambda _d: notifier.watchdog(),), daemon=True)
    t.start()
    try:
        listener.wait("WATCHDOG=1")
        coord.stall.set()
        time.sleep(1.0)  # the loop blocks on its next heartbeat write
        stalled_at = time.monotonic()
        time.sleep(2.5)  # /healthz tolerates 2 x etcd_timeout + 1 s = 3 s without a cycle
        assert not [x for x in listener.seen("WATCHDOG=1") if x > stalled_at]
        assert t.is_alive()
        assert not d.healthy()  # /healthz says 503 too
        coord.stall.clear()
        coord.release.set()
        listener.wait("WATCHDOG=1", after=time.monotonic())
        assert d.healthy()
    finally:
        coord.stall.clear()
        coord.release.set()
        d.loop.stop()
        t.join(10)
        d.close()
        notifier.close()
        listener.close()
