"""Compiled graphs across an in-process shrink and rejoin, with a real compiler backend.

The scenario is tests/chaos/test_in_process_compiled.py's (3 daemons on a real etcd, an
in-process DDP job of 2 ranks per node, the inner module compiled once per process by
``examples/train_in_process.py --compile``, kill -9 of a node, then the node back), run with the
backend given (``inductor``: the C++ code generation the test's ``aot_eager`` skips). Reported
per survivor: dynamo's compiled-graph counter on every step (it must not move), and what the
survivors did not pay again: each newcomer's start (its daemon started) to its first step,
against the survivors' rejoin (node started → their first step at world 6).

Not in CI (an inductor compile per process, minutes on 2 cores). The committed result:

    /work/wt/cpulock .venv/bin/python bench/inprocess_compiled.py --backend inductor \\
        --out bench/results/inprocess_compiled_inductor.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from tests.chaos.test_in_process_compiled import shrink_and_rejoin  # noqa: E402


def summarize(seen: dict) -> dict:
    """The figures of one run (see the module doc)."""
    t_back = seen["t_back"]
    surv = {str(p): {"compiles": sorted({r["compiles"] for r in rows}),
                     "worlds": sorted({r["world"] for r in rows}),
                     "first_step_at_6_after_back_s": min(
                         r["t"] for r in rows if r["world"] == 6 and r["t"] > t_back) - t_back}
            for p, rows in seen["survivors"].items()}
    new = {str(p): {"compiles": sorted({r["compiles"] for r in rows}),
                    "first_step_after_back_s": rows[0]["t"] - t_back}
           for p, rows in seen["newcomers"].items()}
    return {"survivors": surv, "newcomers": new,
            "survivor_recompiles": max(len(s["compiles"]) - 1 for s in surv.values()),
            "survivors_rejoined_after_s": max(s["first_step_at_6_after_back_s"]
                                              for s in surv.values()),
            "newcomers_first_step_after_s": max(n["first_step_after_back_s"]
                                                for n in new.values())}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--backend", default="inductor")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="elasticd-compiled-") as tmp:
        started = time.time()
        seen = shrink_and_rejoin(tmp, args.backend)
        result = {"command": " ".join(["bench/inprocess_compiled.py", *sys.argv[1:]]),
                  "backend": args.backend, "host": platform.node(),
                  "cpus": os.cpu_count(), "seconds": time.time() - started,
                  **summarize(seen)}
    with open(args.out, "w") as fh:
        json.dump(result, fh, indent=1)
    print(json.dumps({k: v for k, v in result.items()
                      if k not in ("survivors", "newcomers")}, indent=1))


if __name__ == "__main__":
    main()
