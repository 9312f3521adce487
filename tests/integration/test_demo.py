"""The README's first command ends in ``python -m elasticd.demo``: run it as a newcomer would
(its own embedded etcd, three daemons, the example job, a kill -9) and check that it shows the
failure and the recovery, exits 0 and leaves nothing behind."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys

import pytest

pytestmark = [pytest.mark.etcd, pytest.mark.timeout(240)]


def _shm() -> set[str]:
    return {n for n in os.listdir("/dev/shm") if n.startswith("elasticd")}


def test_demo_shows_a_failure_and_its_recovery_then_cleans_up():
    shm_before = _shm()
    proc = subprocess.Popen([sys.executable, "-m", "elasticd.demo", "--kill-at-step", "25"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=200)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert proc.returncode == 0, out
    assert re.search(r"kill -9 n2: .* training was at step \d+", out), out
    assert re.search(r"failure of n2 recorded [\d.]+ s after the kill", out), out
    restored = re.findall(r"(n[13]): rank restored step (\d+) from (\w+) RAM", out)
    assert {n for n, _, _ in restored} == {"n1", "n3"}, out
    assert len({s for _, s, _ in restored}) == 1 and int(restored[0][1]) > 0, out
    assert {src for _, _, src in restored} <= {"local", "peer"}, out
    assert len(re.findall(r"n[13]: training again at world size 2", out)) == 2, out
    assert "timeline (kill at 0.00 s):" in out and "done: every daemon" in out, out
    logs = re.search(r"logs in (\S+)", out).group(1)
    assert not os.path.exists(logs), f"the demo left {logs}"
    assert _shm() <= shm_before, f"the demo left {_shm() - shm_before} in /dev/shm"
