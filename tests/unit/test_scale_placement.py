"""The scale simulator's placement helpers (bench/scale_placement.py): etcd's core and priority
set on every thread of a process, a pool's threads started before a measured round, the
simulator's CPU grouped by thread kind."""

from __future__ import annotations

import concurrent.futures
import os
import subprocess
import sys
import threading

from tests.bench_modules import load



def _placement():
    return load("scale_placement")


def test_parse_cpus_reads_lists_and_ranges():
    sp = _placement()
    assert sp.parse_cpus("") == []
    assert sp.parse_cpus("1") == [1]
    assert sp.parse_cpus("0,2-3") == [0, 2, 3]


def test_place_sets_every_thread_not_only_the_first():
    """Linux applies affinity and niceness per thread: a process's threads started before
    must be placed too (etcd's Go threads exist when the driver places it)."""
    sp = _placement()
    child = subprocess.Popen(
        [sys.executable, "-c", "import sys, threading; t = threading.Thread("
         "target=sys.stdin.read, daemon=True); t.start(); print(t.native_id, flush=True); "
         "sys.stdin.read()"], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        tid = int(child.stdout.readline())
        cpu = min(os.sched_getaffinity(0))
        nice = os.getpriority(os.PRIO_PROCESS, tid) + 1
        assert sp.place(child.pid, [cpu], nice) == len(sp.tasks(child.pid)) >= 2
        for t in sp.tasks(child.pid):
            assert os.sched_getaffinity(t) == {cpu}
            assert os.getpriority(os.PRIO_PROCESS, t) == nice
    finally:
        child.stdin.close()
        child.wait()


def test_prestart_starts_every_thread_before_the_tasks_come():
    sp = _placement()
    with concurrent.futures.ThreadPoolExecutor(12) as pool:
        assert sp.prestart(pool, 12) == 12
        gate = threading.Barrier(12)  # 12 tasks at once: no thread is started for them
        list(pool.map(lambda _: gate.wait(), range(12)))
        assert len(pool._threads) == 12


def test_thread_cpu_groups_each_nodes_thread_of_one_kind():
    sp = _placement()
    names = {1: "ThreadPoolExecutor-0_1", 2: "ThreadPoolExecutor-0_17", 3: "rendezvous-duty",
             4: "watch_3fa9c2e1"}
    got = sp.thread_cpu([(1, 1.0), (2, 2.0), (3, 0.5), (4, 0.25), (9, 0.125)], names)
    assert got == {"ThreadPoolExecutor-#_#": 3.0, "rendezvous-duty": 0.5, "watch#": 0.25,
                   "(not a Python thread)": 0.125}


def test_compact_timeline_merges_runs_of_samples_into_at_most_most():
    sp = _placement()
    short = [[0.2 * i, 10, 20] for i in range(5)]
    assert sp.compact_timeline(short, 40) is short
    long = [[round(0.2 * i, 1), i, 100 - i] for i in range(300)]
    got = sp.compact_timeline(long, 40)
    assert len(got) <= 40
    assert got[0] == [0.0, round(3.5), round(96.5)]  # the first 8: etcd 0..7, simulator 100..93
    assert got[-1][0] == long[-(300 % 8 or 8)][0]
