"""The scale simulator (bench/scale_native.py) at N = 100, as a check that a round's cost per
agent stays flat: 100 simulated nodes (each with its daemon's lease, record and node watch, and
elasticd's own rendezvous handler) join one round, then one member and then the closer are
killed and the survivors re-form. Its figures at larger N are the bench's (docs/scale.md)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

pytestmark = [pytest.mark.etcd, pytest.mark.slow]


@pytest.mark.timeout(150)
def test_a_hundred_nodes_join_and_re_form_at_a_flat_cost_per_agent(tmp_path):
    out = tmp_path / "scale.json"
    proc = subprocess.run(
        [sys.executable, "scale_native.py", "--sizes", "100", "--kills", "1", "--window", "1",
         "--procs", "2", "--clients", "2", "--out", str(out)],
        cwd=ROOT / "bench", capture_output=True, text=True, timeout=140,
        env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert proc.returncode == 0, proc.stdout + proc.stderr
    [r] = json.loads(out.read_text())["results"]
    assert r["n"] == 100 and r["join"]["agents_in_round"] == 100 and r["join"]["rounds"] == [0]
    assert r["join"]["ranks_distinct"] and len(r["reform_seconds"]) == 1
    assert all(s is not None and s < r["ttl"] + 3 for s in
               r["reform_seconds"] + r["closer_reform_seconds"]), r
    assert r["requests_per_agent_round"] <= 6 and r["events_per_agent_round"] <= 4, r
    assert r["leases_lost"] == 0
