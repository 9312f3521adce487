"""AgentSupervisor.stop on a fake clock: a tagged process that ignores SIGTERM is SIGKILLed once
the grace has passed on the injected clock (the grace wait used to sleep real time against a
fake deadline that never moved, and hung)."""

from __future__ import annotations

import os
import secrets
import signal
import subprocess
import sys

import pytest

from elasticd.cluster.jobspec import JobSpec
from elasticd.agent.supervisor import TAG_ENV, AgentSupervisor, tagged_pids
from elasticd.testing.clock import FakeClock

# Ignores SIGTERM, says so, then waits to be killed.
STUBBORN = ("import signal, sys, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
            "print('ready', flush=True); time.sleep(120)")


@pytest.mark.timeout(20)
def test_stop_on_a_fake_clock_kills_a_process_that_ignores_sigterm_after_the_grace(tmp_path):
    tag = f"clock-test-{secrets.token_hex(6)}"
    proc = subprocess.Popen([sys.executable, "-c", STUBBORN], stdout=subprocess.PIPE,
                            env={**os.environ, TAG_ENV: tag}, start_new_session=True)
    try:
        assert proc.stdout.readline() == b"ready\n"
        assert tagged_pids(tag) == [proc.pid]
        spec = JobSpec(name="job", nnodes_min=1, nnodes_max=1, nproc_per_node=1,
                       script="/nonexistent/train.py", args=[], script_sha256="", user="nobody",
                       cwd=str(tmp_path))
        clock = FakeClock()
        sup = AgentSupervisor(spec, "n1", tag, "127.0.0.1:1", "/t", str(tmp_path), clock=clock)
        start = clock.monotonic()
        sup.stop(grace=10.0)
        assert proc.wait(timeout=10) == -signal.SIGKILL  # not SIGTERM: it ignored that one
        assert clock.monotonic() - start >= 10.0  # the grace passed on the injected clock
        assert tagged_pids(tag) == []
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        proc.stdout.close()
