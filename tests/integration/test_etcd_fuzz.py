"""An etcd fuzz in CI: about a thousand malformed writes over every key kind the daemons read,
while three daemons run a real training job (bench/fuzz_etcd.py runs ten thousand). No daemon
exits, /healthz stays 200, the job keeps training, and a bad record costs at most one warning
(records read every cycle log nothing more in a quiet period after; the resync that re-reads
every node record is covered in tests/unit/test_hostile_records.py). Then specs whose script is
no job's script (pseudo files, devices, FIFOs, symlinks, a path swapped while it is checked):
every daemon refuses every one, /healthz answers 200 within 2 s throughout, and a new job runs
(bench/fuzz_etcd.py --hostile writes 500)."""

from __future__ import annotations

import importlib.util
import json
import os

import pytest

from elasticd.launcher import LocalCluster

pytestmark = [pytest.mark.etcd]

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def load_fuzz():
    spec = importlib.util.spec_from_file_location("fuzz_etcd",
                                                  os.path.join(REPO, "bench", "fuzz_etcd.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.timeout(420)
def test_daemons_survive_a_thousand_malformed_records(tmp_path):
    fuzz = load_fuzz()
    cluster = LocalCluster(["n1", "n2", "n3"], workdir=str(tmp_path), replication=True)
    try:
        cluster.start()
        fuzz.submit(cluster)
        result = fuzz.run(cluster, count=1000, seed=13)
        hostile = fuzz.run_hostile(cluster, count=30, base=str(tmp_path / "hostile"), seed=13,
                                   timeout=180)
    finally:
        cluster.stop()
    print(json.dumps(hostile, indent=1))
    assert result["count"] == 1000
    assert result["daemons_exited"] == []
    assert result["healthz_not_200"] == [] and result["healthz_polls"] > 0
    assert result["step_at_end"] > result["step_after_fuzz"] >= result["step_before"]
    for node, lines in result["bad_record_warnings"].items():
        assert 0 < lines <= result["count"], (node, lines)
    assert result["logged_in_quiet"] == {}  # nothing read every cycle is logged again
    assert result["healthz_over_2s"] == []
    assert hostile["daemons_exited"] == [] and hostile["swaps"] > 100
    assert hostile["healthz_not_200"] == [] and hostile["healthz_over_2s"] == []
    assert hostile["refused_per_node"] == {n: 30 for n in ("n1", "n2", "n3")}, hostile
    assert all("\n" not in why for why in hostile["reasons"])
    assert hostile["new_job_trained"]
