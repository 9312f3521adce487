"""Where the scale simulator's processes run on the host, and the simulator's own thread costs.

On this 2-core machine the simulator and etcd share the CPU. etcd below a core is starvation,
not spare capacity: etcd 3.4 answers a lease renewal only once its single apply loop has caught
up, and at N = 1,000 the simulator's hundreds of threads waking at once (a round record
arriving) kept that loop waiting for a CPU long enough for renewals to fail and leases to be
lost in cascade (docs/scale.md). A real cluster's etcd has machines of its own. So the driver
can give etcd a core of its own (``--etcd-cpus``, the simulator then on ``--sim-cpus``) and/or a
higher priority (``--etcd-nice``): what :func:`place` does, to every thread of a process (Linux
applies both per thread; a thread started later inherits its creator's).

:func:`prestart` starts a thread pool's threads before a measured phase: the simulator runs
each agent's ``next_rendezvous`` on a pool thread, and starting 125 threads per process inside
the join round cost ~11 % of the simulator's CPU there (a py-spy profile, 2026-11-30), a cost a
real node, whose agent thread exists already, does not pay.

:func:`thread_cpu` groups a process's CPU by thread name (per simulated node threads are one
group): the cheap profile each round records.
"""

from __future__ import annotations

import collections
import os
import re
import threading
from typing import Any, Iterable


def tasks(pid: int) -> list[int]:
    """The thread ids of process ``pid`` (Linux)."""
    try:
        return [int(t) for t in os.listdir(f"/proc/{pid}/task")]
    except OSError:
        return []


def place(pid: int, cpus: Iterable[int] | None = None, nice: int | None = None) -> int:
    """Pins every thread of ``pid`` to ``cpus`` and/or sets its niceness; returns the threads
    changed (a thread that ended meanwhile is skipped)."""
    cpus = set(cpus) if cpus else None
    done = 0
    for tid in tasks(pid):
        try:
            if cpus is not None:
                os.sched_setaffinity(tid, cpus)
            if nice is not None:
                os.setpriority(os.PRIO_PROCESS, tid, nice)
            done += 1
        except (ProcessLookupError, PermissionError):
            continue
    return done


def parse_cpus(text: str) -> list[int]:
    """``"0"``, ``"0,1"`` or ``"0-3"`` -> the CPU numbers; ``""`` -> []."""
    out: list[int] = []
    for part in filter(None, (p.strip() for p in text.split(","))):
        lo, _, hi = part.partition("-")
        out.extend(range(int(lo), int(hi or lo) + 1))
    return out


def prestart(pool: Any, count: int) -> int:
    """Starts ``count`` threads of ``pool`` (a ThreadPoolExecutor) now, rather than one per
    task submitted in a measured phase: ``count`` tasks that wait for each other keep every
    thread busy until all exist. Returns the pool's threads."""
    here = threading.Barrier(count + 1)
    futures = [pool.submit(here.wait) for _ in range(count)]
    here.wait()
    for f in futures:
        f.result()
    return len(pool._threads)


def thread_cpu(threads: Iterable[tuple[int, float]], names: dict[int, str]) -> dict[str, float]:
    """CPU seconds by thread group: ``threads`` as (native id, CPU seconds), ``names`` the
    Python threads' names by native id; digits and hex ids dropped from a name, so that every
    node's thread of one kind is one group."""
    out: collections.Counter[str] = collections.Counter()
    for tid, cpu in threads:
        name = names.get(tid)
        out[re.sub(r"_[0-9a-f]{6,}$|\d+", "#", name) if name else "(not a Python thread)"] += cpu
    return dict(out)


def own_thread_cpu() -> dict[str, float]:
    """:func:`thread_cpu` of this process (threads that ended are not counted)."""
    import psutil

    names = {t.native_id: t.name for t in threading.enumerate() if t.native_id}
    return thread_cpu(((t.id, t.user_time + t.system_time) for t in psutil.Process().threads()),
                      names)


def compact_timeline(samples: list[list[float]], most: int = 40) -> list[list[float]]:
    """``[t, etcd %, simulator %]`` samples merged in runs of k (each run: its first time and
    its mean percentages), k the smallest that leaves at most ``most``: a 60 s round sampled
    every 0.2 s is 300 samples, which made the results file grow by tens of KB per entry."""
    if len(samples) <= most:
        return samples
    k = -(-len(samples) // most)
    out = []
    for i in range(0, len(samples), k):
        run = samples[i:i + k]
        out.append([run[0][0]] + [round(sum(x[j] for x in run) / len(run))
                                  for j in range(1, len(run[0]))])
    return out
