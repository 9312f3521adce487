"""A local node's kill -9 (:meth:`elasticd.launcher.NodeProcess.kill`), what the recovery
benchmarks time from: the fault's moment comes after the scan for the node's processes, and
its jobs' processes die with the daemon, not after a second scan (each 75-160 ms on a loaded
machine, which bench/recovery_inprocess.py's ``seconds`` counted as recovery)."""

from __future__ import annotations

import os
import subprocess
import time

from elasticd.launcher import NodeProcess


def test_the_kill_returns_its_moment_after_the_scan_and_the_jobs_die_with_the_daemon(
        tmp_path, monkeypatch):
    node = NodeProcess("n1", ["sleep", "600"], str(tmp_path / "log"), dict(os.environ))
    worker = subprocess.Popen(["sleep", "600"], start_new_session=True)  # a job's process
    node.start()
    events: list[tuple[str, float]] = []  # ("scan", when it ended) / ("killed", the worker)
    kill = os.kill

    def tagged() -> list[int]:
        events.append(("scan", time.time()))
        return [worker.pid] if len(events) == 1 else []

    def recorded(pid: int, sig: int) -> None:
        if pid == worker.pid:
            events.append(("killed", time.time()))
        kill(pid, sig)

    node.tagged = tagged  # type: ignore[method-assign]
    monkeypatch.setattr(os, "kill", recorded)
    try:
        killed_at = node.kill()
        worker.wait(timeout=10)
    finally:
        if worker.poll() is None:
            worker.kill()
            worker.wait()
    assert killed_at is not None and killed_at >= events[0][1]
    assert node.proc.poll() is not None
    # The worker's SIGKILL right after the first scan (it came after a second one).
    assert [what for what, _ in events[:3]] == ["scan", "killed", "scan"]
