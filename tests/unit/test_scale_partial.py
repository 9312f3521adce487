"""A scale-simulator run stopped by SIGTERM writes what it measured (bench/scale_native.py
``write_partial``): a commit-only run too, whose commit phase fills its entry as it goes
(bench/scale_commit.py ``so_far``). It wrote nothing before: the N = 1,000 commit attempt
stopped 202 s into its window left only its log."""

from __future__ import annotations

import argparse
import json

from tests.bench_modules import load


def _args(tmp_path, commit_only: bool) -> argparse.Namespace:
    return argparse.Namespace(commit_only=commit_only, commit_seconds=420.0, kills=10,
                              members=1, etcd_compaction="periodic:1m",
                              out=str(tmp_path / "scale.json"))


def test_a_commit_only_run_stopped_in_its_window_writes_the_window_so_far(tmp_path):
    native, commit = load("scale_native"), load("scale_commit")
    a, doc = _args(tmp_path, commit_only=True), {"results": []}
    progress = {"nodes": 1000, "etcd_cpu_pct_without_commits": 39.2, "build_seconds": 11.0}
    progress.update(commit.so_far({"cpu": 10.0, "leases_lost": 2},
                                  {"cpu": 410.0, "leases_lost": 118},
                                  100.0, 140.0, 200.0, 1000, 9, (0, 10)))
    r = {"n": 1000, "join": {"seconds": 6.9}, "join_seconds": 6.9, "commit": progress}
    assert native.write_partial(doc, r, 1000, a, 0.0, (1.0, 1.0, 1.0))
    entry = json.load(open(a.out))["results"][0]
    c = entry["commit"]
    assert entry["n"] == 1000 and c["incomplete"] == \
        "stopped by SIGTERM 200.0 s into the 420 s window"
    assert (c["committed_steps"], c["committed_step_last"], c["leases_lost"]) == (9, [0, 10], 116)
    assert (c["etcd_cpu_pct"], c["simulator_cpu_pct"], c["simulator_cpu_ms_per_node_second"]) \
        == (20.0, 200.0, 2.0)


def test_a_commit_only_run_keeps_the_sizes_other_figures_and_writes_nothing_before_its_phase(
        tmp_path):
    native = load("scale_native")
    a = _args(tmp_path, commit_only=True)
    doc = {"results": [{"n": 300, "join_seconds": 1.5, "reform_seconds": [2.3], "commit": None}]}
    assert not native.write_partial(doc, {"n": 300}, 300, a, 0.0, (0.0,) * 3)  # before the join
    r = {"n": 300, "join": {}, "join_seconds": 1.4, "commit": {}}
    assert not native.write_partial(doc, r, 300, a, 0.0, (0.0,) * 3)  # the phase not begun
    r["commit"] = {"nodes": 300, "build_seconds": 2.0}
    assert native.write_partial(doc, r, 300, a, 0.0, (0.0,) * 3)
    entry = json.load(open(a.out))["results"][0]
    assert entry["reform_seconds"] == [2.3] and entry["join_seconds"] == 1.5
    assert entry["commit"]["incomplete"] == "stopped by SIGTERM before the window"
