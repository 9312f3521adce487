"""Issue 31, FSDP2's recompile count: the in-process shrink and rejoin of
tests/chaos/test_in_process_compiled.py (3 real daemons, 2 ranks per node, kill -9 of a node
not rank 0's, then the node back) with ``examples/train_in_process.py --model fsdp --compile
aot_eager`` (each FSDP2 block's inner module compiled; the blocks are made again every round).
Reported per survivor: the graphs dynamo compiled in its process by the end of its first
round at world 6, of its round at world 4 and of its round at world 6 again (the example's
``compiles`` column); the node's 2 new workers' count at world 6 beside them (a fresh
process's, the baseline).

    /work/wt/cpulock .venv/bin/python bench/spikes/inprocess/fsdp_recompiles.py \\
        --out bench/results/spikes/inprocess/fsdp_recompiles.json
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__))))))
from tests.chaos.test_in_process_compiled import shrink_and_rejoin  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--out", default="")
    ap.add_argument("--backend", default="aot_eager")
    args = ap.parse_args()
    started = time.time()
    workdir = tempfile.mkdtemp(prefix="elasticd-fsdp-recompiles-")
    try:
        seen = shrink_and_rejoin(workdir, args.backend, model="fsdp")
    finally:
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
              "survivors_compiled_graphs": survivors, "newcomers_compiled_graphs": newcomers}
    text = json.dumps(result, indent=1) + "\n"
    print(text, end="")
    if args.out:
        with open(args.out, "w") as fh:
            fh.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
