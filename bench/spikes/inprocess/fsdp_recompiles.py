"""Issue 31, FSDP2's recompile count: the in-process shrink and rejoin of
tests/chaos/test_in_process_compiled.py (3 real daemons, 2 ranks per node, kill -9 of a node
not rank 0's, then the node back) with ``examples/train_in_process.py --model fsdp --compile
aot_eager`` (each FSDP2 block's inner module compiled; the blocks are made again every round).
Reported per survivor: the graphs dynamo compiled in its process by the end of its first
round at world 6, of its round at world 4 and of its round at world 6 again (the example's
``compiles`` column); the node's 2 new workers' count at world 6 beside them (a fresh
process's, the baseline). Dynamo's own reasons for any recompile (``TORCH_LOGS=recompiles``,
set for the daemons and so for the workers, whose stderr is their agent's log) are kept from
the agents' logs, each with its node.

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


#: A line of dynamo's recompile record (torch/_dynamo/guards.py, TORCH_LOGS=recompiles: the
#: function, then its guard failures, each "- ..."; the log's prefix may begin every line),
#: or its warning that a function hit the recompile limit (then it runs uncompiled).
RECORD = re.compile(r"Recompiling function|guard failure|^\S*.*?\s- |recompile_limit")


def recompile_reasons(workdir: str) -> dict[str, list[str]]:
    """Each agent log's recompile records (node -> records, each its lines joined by |)."""
    found = {}
    for path in sorted(glob.glob(os.path.join(workdir, "cluster", "*", "jobs", "*",
                                              "agent.log"))):
        records: list[list[str]] = []
        with open(path, errors="replace") as fh:
            for line in fh:
                if "Recompiling function" in line or "recompile_limit" in line:
                    records.append([line.strip()])
                elif records and len(records[-1]) < 12 and RECORD.search(line):
                    records[-1].append(line.strip())
        if records:
            node = os.path.relpath(path, os.path.join(workdir, "cluster")).split(os.sep)[0]
            found[node] = [" | ".join(r) for r in records]
    return found


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
        reasons = recompile_reasons(workdir)
        if reasons:
            print(json.dumps({"recompile_reasons": reasons}, indent=1), flush=True)
        shutil.rmtree(workdir, ignore_errors=True)
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
    result = {"command": "bench/spikes/inprocess/fsdp_recompiles.py " + " ".join(sys.argv[1:]),
              "when": time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(started)) + " UTC",
              "scenario": "examples/train_in_process.py --model fsdp --compile "
                          f"{args.backend}, submit --in-process, 3 nodes x 2 ranks, kill -9 of "
                          "a node (not rank 0's), then its daemon back",
              "survivors_compiled_graphs": survivors, "newcomers_compiled_graphs": newcomers,
              "recompile_reasons": reasons}
    text = json.dumps(result, indent=1) + "\n"
    print(text, end="")
    if args.out:
        os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
        with open(args.out, "w") as fh:
            fh.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
