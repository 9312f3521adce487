"""Where a scale-simulator process's CPU goes, function by function (``SCALE_PROFILE=<dir>``).

py-spy is not on this machine, and the simulator's per-thread-group CPU (``thread_cpu``) says
which thread spent it, not in what. With ``SCALE_PROFILE`` set, every Python thread of a
simulator process (and the keep-alive process's loop) runs under its own ``cProfile`` timed by
that thread's CPU clock (``time.thread_time``: a thread waiting for the GIL spends nothing), and
:func:`dump` writes the merged table (function, calls, own CPU, cumulative CPU) as JSON; two
dumps subtracted give a window (:func:`diff`). cProfile roughly doubles the CPU of
call-heavy Python: read the shares, not the totals, and never time a figure with it on.

    SCALE_PROFILE=/tmp/prof python bench/scale_native.py --sizes 300 --commit-only ...
    python bench/scale_profile.py /tmp/prof/worker-*-start.json /tmp/prof/worker-*-end.json
"""

from __future__ import annotations

import cProfile
import json
import os
import sys
import threading
import time
from typing import Any

_profiles: list[cProfile.Profile] = []
_lock = threading.Lock()


def directory() -> str:
    """Where dumps go ('' when profiling is off)."""
    return os.environ.get("SCALE_PROFILE", "")


def install() -> None:
    """Profiles the calling thread and every Python thread started from now on."""
    original = threading.Thread.run

    def run(self: threading.Thread) -> None:
        prof = cProfile.Profile(time.thread_time)
        with _lock:
            _profiles.append(prof)
        prof.enable()
        try:
            original(self)
        finally:
            prof.disable()

    threading.Thread.run = run  # type: ignore[method-assign]
    main = cProfile.Profile(time.thread_time)
    _profiles.append(main)
    main.enable()


def dump(path: str) -> None:
    """The merged table of every profiled thread so far (its own threads keep running)."""
    merged: dict[str, list[float]] = {}
    with _lock:
        profiles = list(_profiles)
    for prof in profiles:
        prof.snapshot_stats()  # reads the tables; does not disable the thread's profiler
        for (file, line, name), (_cc, nc, tt, ct, _callers) in prof.stats.items():  # type: ignore[attr-defined]
            key = f"{os.path.basename(file)}:{line}:{name}"
            row = merged.setdefault(key, [0, 0.0, 0.0])
            row[0] += nc
            row[1] += tt
            row[2] += ct
    with open(path, "w") as f:
        json.dump({"at": time.time(), "rows": merged}, f)


def diff(start: str, end: str) -> dict[str, list[float]]:
    """``end``'s table minus ``start``'s: the window between the two dumps."""
    with open(start) as f:
        a = json.load(f)["rows"]
    with open(end) as f:
        b = json.load(f)["rows"]
    out = {}
    for key, (nc, tt, ct) in b.items():
        n0, t0, c0 = a.get(key, (0, 0.0, 0.0))
        if tt - t0 > 0 or ct - c0 > 0:
            out[key] = [nc - n0, tt - t0, ct - c0]
    return out


def main() -> None:
    """``scale_profile.py START... END...``: each start paired with its end, summed; the
    top functions by own CPU."""
    files = sys.argv[1:]
    half = len(files) // 2
    total: dict[str, list[float]] = {}
    for s, e in zip(files[:half], files[half:]):
        for key, row in diff(s, e).items():
            t = total.setdefault(key, [0, 0.0, 0.0])
            for i in range(3):
                t[i] += row[i]
    own = sum(r[1] for r in total.values())
    print(f"own CPU in profiled Python threads: {own:.2f} s")
    for key, (nc, tt, ct) in sorted(total.items(), key=lambda kv: -kv[1][1])[:45]:
        print(f"{tt:8.3f} {100 * tt / own:5.1f}% {ct:8.3f} {int(nc):9d}  {key}")
    print("-- by cumulative --")
    for key, (nc, tt, ct) in sorted(total.items(), key=lambda kv: -kv[1][2])[:40]:
        print(f"{ct:8.3f} {100 * ct / own:5.1f}% {int(nc):9d}  {key}")


if __name__ == "__main__":
    main()
