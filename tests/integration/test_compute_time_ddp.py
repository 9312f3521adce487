"""Each rank's compute time outside collectives, measured for real: two DDP ranks over gloo,
one slowed in its forward. Both step at the slow rank's pace; only the slow one's compute time
says so (the straggler detection's measuring side)."""

from __future__ import annotations

import json
import os
import socket
import statistics
import subprocess
import sys

import pytest

WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "workers", "ddp_compute.py")
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.timeout(120)
def test_only_the_slow_rank_measures_a_long_compute_time():
    port, slow = free_port(), 0.15
    env = {**os.environ, "PYTHONPATH": REPO, "OMP_NUM_THREADS": "1"}
    procs = [subprocess.Popen([sys.executable, WORKER, str(rank), "2", str(port), "1",
                               str(slow), "12"], stdout=subprocess.PIPE, text=True, env=env)
             for rank in range(2)]
    try:
        out = {}
        for p in procs:
            stdout, _ = p.communicate(timeout=100)
            assert p.returncode == 0
            doc = json.loads(stdout.strip().splitlines()[-1])
            out[doc["rank"]] = doc
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    # Leave out the first steps (DDP builds its buckets, gloo connects).
    fast, slowed = (statistics.median(out[r]["compute"][2:]) for r in (0, 1))
    steps = [statistics.median(out[r]["step"][2:]) for r in (0, 1)]
    print(f"compute per step: rank 0 {fast:.3f} s, rank 1 (slowed {slow} s) {slowed:.3f} s; "
          f"step times {steps[0]:.3f} s, {steps[1]:.3f} s")
    assert min(steps) >= slow  # the step time names nobody: both wait for the slow rank
    assert slowed >= slow
    assert fast < slow / 2
