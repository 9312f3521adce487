"""CPU seconds another process has used, to the nanosecond: for the benches' CPU per restore.

``/proc/PID/stat``'s utime and stime count whole clock ticks (10 ms here): a difference of two
reads is off by up to a tick per process, ~±35 ms on the sum of the sharded restore's seven
processes in one round, ±4 % of it (restore38's A/B hold read rounds 1.14-1.44x apart in one
run). The process's CPU clock (``clock_getcpuclockid(3)``: the scheduler's runtime of every
thread it has had, exited ones included) reads the same quantity in nanoseconds.
"""

from __future__ import annotations

import os
import time


def _clock_of(pid: int) -> int:
    # What glibc's clock_getcpuclockid(pid) returns: CPUCLOCK_SCHED (2) of the whole process
    # (not one thread: bit 2 clear), the pid's complement shifted past the flag bits.
    return ((~pid) << 3) | 2


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds the process ``pid`` (all its threads, exited ones too) has
    used; from ``/proc`` in whole ticks where the kernel refuses the clock."""
    try:
        return time.clock_gettime_ns(_clock_of(pid)) / 1e9
    except OSError:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
