"""The stall A/B's table (hold.sh): per tree, each run's training-visible stall per snapshot
(overlapped mode), the same copy done inside save (sync mode) and the step with no snapshot.

    python bench/results/structure_bracket36/stall/summarize.py
"""

import glob
import json
import os
import statistics

here = os.path.dirname(os.path.abspath(__file__))
print("| tree | stall ms per snapshot, each run | median | the copy inside save (sync) ms | step, no snapshot ms |")
print("|---|---|---:|---:|---:|")
for tree in ("base", "pre", "split", "head"):
    runs = [json.load(open(p)) for p in sorted(glob.glob(os.path.join(here, f"{tree}_*.json")))]
    stalls = [r["modes"]["overlap"]["stall_seconds_per_snapshot"] * 1e3 for r in runs]
    syncs = [r["modes"]["sync"]["stall_seconds_per_snapshot"] * 1e3 for r in runs]
    offs = [r["modes"]["off"]["step_seconds_median"] * 1e3 for r in runs]
    print(f"| {tree} | {', '.join(f'{s:.2f}' for s in stalls)} | {statistics.median(stalls):.2f} | "
          f"{statistics.median(syncs):.2f} | {statistics.median(offs):.1f} |")
