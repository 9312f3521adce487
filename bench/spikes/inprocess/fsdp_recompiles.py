"""Issue 31, FSDP2's recompile count: the in-process shrink and rejoin of
tests/chaos/test_in_process_compiled.py (3 real daemons, 2 ranks per node, kill -9 of a node
not rank 0's, then the node back) with ``examples/train_in_process.py --model fsdp --compile
aot_eager`` (each FSDP2 block's inner module compiled; the blocks are made again every round).
Reported per survivor: the graphs dynamo compiled in its process by the end of its first
round at world 6, of its round at world 4 and of its round at world 6 again (the example's
``compiles`` column); the node's 2 new workers' count at world 6 beside them (a fresh
process's, the baseline). Dynamo's own record of each recompile (``TORCH_LOGS=recompiles``,
set for the daemons and so for the workers, whose stderr is their agent's log) is read from
the agents' logs: per process, its frames, the guards that failed and how many came after
the kill.

    /work/wt/cpulock .venv/bin/python bench/spikes/inprocess/fsdp_recompiles.py \\
        --out bench/results/inprocess_fsdp_recompiles.json
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import re
import shutil
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__))))))
from tests.chaos.test_in_process_compiled import shrink_and_rejoin  # noqa: E402


#: The head of dynamo's recompile record (torch/_dynamo/guards.py, TORCH_LOGS=recompiles) as a
#: worker logs it: its rank, the time of day, its pid, the frame and its new cache entry.
HEAD = re.compile(r"\[rank(\d+)\]:\w(\d{4}) (\d\d):(\d\d):(\d\d\.\d+) (\d+) .*?\[(\d+/\d+)\] "
                  r"\[__recompiles\] Recompiling function (\S+)")
#: One of the record's guard failures ("- 0/3: <guard>"): the cache entry it was tested against.
FAILURE = re.compile(r"\[__recompiles\]\s+- (\d+/\d+): (.*)")


def recompile_records(workdir: str) -> list[dict]:
    """Every recompile record in the agents' logs (the workers' stderr): node, rank, pid, time
    of day (seconds, local), frame, and the guard that failed against the newest cache entry
    (dynamo lists the entries newest first). A line saying a function hit the recompile limit
    (it then runs uncompiled) is kept whole."""
    found = []
    for path in sorted(glob.glob(os.path.join(workdir, "cluster", "*", "jobs", "*",
                                              "agent.log"))):
        node = os.path.relpath(path, os.path.join(workdir, "cluster")).split(os.sep)[0]
        with open(path, errors="replace") as fh:
            for line in fh:
                if (m := HEAD.search(line)):
                    rank, _, hh, mm, ss, pid, frame, fn = m.groups()
                    found.append({"node": node, "rank": int(rank), "pid": int(pid),
                                  "at": int(hh) * 3600 + int(mm) * 60 + float(ss),
                                  "frame": frame, "function": fn, "guard": None})
                elif (f := FAILURE.search(line)) and found and found[-1]["guard"] is None:
                    found[-1]["guard"] = f"{f.group(1)}: {f.group(2).split('. Guard')[0]}"
                elif "recompile_limit" in line:
                    found.append({"node": node, "limit": line.strip()})
    return found


def time_of_day(t: float) -> float:
    """``t`` (wall) as the seconds of the local day the workers' log lines give."""
    lt = time.localtime(t)
    return lt.tm_hour * 3600 + lt.tm_min * 60 + lt.tm_sec + t % 1


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--out", default="")
    ap.add_argument("--backend", default="aot_eager")
    args = ap.parse_args()
    started = time.time()
    workdir = tempfile.mkdtemp(prefix="elasticd-fsdp-recompiles-")
    before = os.environ.get("TORCH_LOGS")
    os.environ["TORCH_LOGS"] = "recompiles"  # the cluster's daemons pass it to their jobs
    try:
        seen = shrink_and_rejoin(workdir, args.backend, model="fsdp")
    finally:
        if before is None:
            del os.environ["TORCH_LOGS"]
        else:
            os.environ["TORCH_LOGS"] = before
        records = recompile_records(workdir)
        shutil.rmtree(workdir, ignore_errors=True)
        print(json.dumps({"recompile_records": records}), flush=True)
    t_kill, t_back = seen["t_kill"], seen["t_back"]

    def last(rows: list[dict], world: int, after: float, before: float) -> int | None:
        got = [r["compiles"] for r in rows if r["world"] == world and after < r["t"] < before]
        return got[-1] if got else None

    survivors = {str(p): {"world 6": last(rows, 6, 0, t_kill),
                          "world 4": last(rows, 4, t_kill, t_back),
                          "world 6 again": last(rows, 6, t_back, seen["t_stop"]),
                          "paths": sorted({r["path"] for r in rows})}
                 for p, rows in seen["survivors"].items()}
    newcomers = {str(p): last(rows, 6, t_back, seen["t_stop"])
                 for p, rows in seen["newcomers"].items()}
    kill = time_of_day(t_kill)
    by_pid = {str(p): {"records": len(mine),
                       "after_the_kill": sum(r["at"] >= kill for r in mine),
                       "frames": [r["frame"] for r in mine],
                       "guards": sorted({r["guard"] for r in mine})}
              for p in [*seen["survivors"], *seen["newcomers"]]
              for mine in [[r for r in records if r.get("pid") == p]]}
    result = {"command": "bench/spikes/inprocess/fsdp_recompiles.py " + " ".join(sys.argv[1:]),
              "when": time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(started)) + " UTC",
              "scenario": "examples/train_in_process.py --model fsdp --compile "
                          f"{args.backend}, submit --in-process, 3 nodes x 2 ranks, kill -9 of "
                          "a node (not rank 0's), then its daemon back",
              "survivors_compiled_graphs": survivors, "newcomers_compiled_graphs": newcomers,
              "survivors_recompiles_across_shrink_and_rejoin": {
                  p: (c["world 6 again"] - c["world 6"]
                      if None not in (c["world 6"], c["world 6 again"]) else None)
                  for p, c in survivors.items()},
              "recompile_records_per_process": by_pid,
              "recompile_limit_hit": [r["limit"] for r in records if "limit" in r],
              "kill_time_of_day": round(kill, 3),
              "back_after_kill_seconds": round(t_back - t_kill, 3)}
    text = json.dumps(result, indent=1) + "\n"
    print(text, end="")
    if args.out:
        os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
        with open(args.out, "w") as fh:
            fh.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
