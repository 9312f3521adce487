"""Issue 31's soak reports from what the workers wrote (bench/soak_inprocess.py): step rows of a
kill and a rejoin, made here, give the kept time, the samples, the steps lost, each kill's
downtime, each rejoin's stop of the survivors and whether their processes were kept (the
soak itself runs by hand: 20 minutes and more)."""

from __future__ import annotations

from bench.soak_inprocess import analyse, summarize, verdict
from tests.chaos.faults import Fault, FaultRecord


def _rows(pids: list[int], world: int, steps: range, t0: float, round_: int) -> list[dict]:
    """Every rank's row of each step, 0.1 s apart from ``t0``."""
    return [{"pid": pid, "round": round_, "rank": rank, "world": world, "step": step,
             "path": "first" if round_ == 0 else "in-process", "t": t0 + i * 0.1}
            for i, step in enumerate(steps) for rank, pid in enumerate(pids)]


def _soak(rejoined: list[int]) -> dict:
    """Six ranks train steps 1-100; node n3 (pids 5, 6) is killed at 10.05 s; four ranks resume
    from step 99 (step 100 is trained again: 1 lost); n3 starts again at 15 s and the six
    ranks ``rejoined`` resume from step 200 at world 6."""
    rows = (_rows([1, 2, 3, 4, 5, 6], 6, range(1, 101), 0.1, 0)
            + _rows([1, 2, 3, 4], 4, range(100, 201), 10.5, 1)
            + _rows(rejoined, 6, range(201, 301), 20.65, 2))
    kills = [{"node": "n3", "pids": {5, 6, 50}, "at": 10.05}]
    back = FaultRecord(Fault("restart_node", "n3"), 15.0, 0, None, ["n3"])
    return analyse(rows, kills, [back], in_process=True)


def test_the_soak_reports_kept_time_losses_downtime_and_each_rejoins_stop_from_the_rows():
    block = _soak([1, 2, 3, 4, 7, 8])
    # Kept: steps 1-300 once each; step 100 on its second run. A step's time is since its
    # attempt's step before (an attempt's first step, after a restore, counts nothing).
    assert block["steps_kept"] == 300 and block["checks"]["kept_steps_contiguous"]
    assert block["kept_step_seconds"] == round(297 * 0.1, 3)
    assert block["effective_ratio"] == round(29.7 / (20.65 + 9.9 - 0.1), 4)
    assert block["kept_samples"] == 8 * (99 * 6 + 101 * 4 + 100 * 6)
    assert block["baseline_samples_per_s_failure_free"] == 480.0  # 6 ranks x 8 per 0.1 s
    kill, = block["kills"]
    assert (kill["downtime_s"], kill["steps_lost"], kill["kept_pids"]) == (0.45, 1, 4)
    rejoin, = block["rejoins"]
    # The first survivor's last step at world 4 (20.5 s) -> every rank's first at 6 (20.65 s).
    assert (rejoin["pause_seconds"], rejoin["steps_lost"], rejoin["kept_pids"]) == (0.15, 0, 4)
    assert block["checks"]["survivor_pids_kept"] and block["steps_lost"] == 1
    mode = summarize([block])
    assert mode["rejoin_stop_s"] == [0.15] and mode["rejoins_at_most_0.3_s"] == 1
    worse = {**mode, "effective_ratio": mode["effective_ratio"] + 0.01}
    assert verdict({"in-process": mode, "restart": worse}) == {
        "effective_ratio_above_restart": False, "goodput_samples_not_lower": True,
        "every_rejoin_stop_at_most_0.3_s": True}


def test_a_survivor_restarted_at_a_rejoin_fails_the_in_process_check():
    block = _soak([9, 2, 3, 4, 7, 8])  # rank 0 of world 6 is a new process
    assert block["rejoins"][0]["kept_pids"] == 3
    assert not block["checks"]["survivor_pids_kept"]


def test_the_soak_reads_each_modes_snapshot_rate_from_the_rows_and_the_daemons_metrics():
    from prometheus_client import generate_latest

    from bench import soak_snapshots
    from elasticd.metrics import CheckpointSink, Metrics

    # Two daemon lives, read as the soak reads them (/metrics text): a restart job's daemon
    # (2 taken, 1 skipped off the grid, 1 commit pending) and an in-process job's (4 taken,
    # 2 of them into the newest pair only).
    texts = []
    for taken, skipped, newest in ((2, ["grid", "commit_pending"], []),
                                   (4, [], ["grid", "commit_pending"])):
        metrics = Metrics()
        sink = CheckpointSink(metrics)
        for _ in range(taken):
            sink.snapshot_completed("job", 0, 1, 10, 0.001)
        for reason in skipped:
            sink.snapshot_skipped("job", reason)
        for reason in newest:
            sink.snapshot_newest_only("job", reason)
        texts.append(generate_latest(metrics.registry).decode())
    restart, in_process = (soak_snapshots.counts(t) for t in texts)
    assert restart == {"snapshots": 2, "skipped:grid": 1, "skipped:commit_pending": 1}
    assert in_process == {"snapshots": 4, "newest_only:grid": 1,
                          "newest_only:commit_pending": 1}
    rows = [{**r, "saved": r["step"] % 2 == 0} for r in _rows([1, 2], 2, range(1, 3), 0.0, 0)]
    block = soak_snapshots.block(rows, restart)
    assert (block["rank_steps"], block["saved_per_step"], block["skipped_per_step"]) == (4, 0.5,
                                                                                         0.5)
    assert block["skipped_by_reason"] == {"commit_pending": 1, "grid": 1}
    assert block["median_step_s_saved"] == 0.1 and block["median_step_s_not_saved"] is None
    both = soak_snapshots.mode([{"snapshots": block},
                                {"snapshots": soak_snapshots.block(rows, in_process)}])
    assert (both["rank_steps"], both["daemon_snapshots_per_step"],
            both["newest_only_per_step"], both["committable_per_step"]) == (8, 0.75, 0.25, 0.5)


def test_a_step_only_a_later_rank_logged_at_the_end_is_not_a_gap():
    # The cluster stops rank 0 before its row of step 301, which rank 1 logged.
    rows = (_rows([1, 2, 3, 4, 5, 6], 6, range(1, 301), 0.1, 0)
            + [{"pid": 2, "round": 0, "rank": 1, "world": 6, "step": 301, "path": "first",
                "t": 30.15}])
    assert analyse(rows, [], [], in_process=False)["checks"]["kept_steps_contiguous"]
