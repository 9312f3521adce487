"""Reads hold 1's recovery blocks (recovery_block*_{head,base}.json) into bracket.json: per tree,
the runs' seconds from the first SIGKILL, steps lost, when the probe revoked the victim's lease,
and what the clock before this branch (from the return of kill) would have read."""

import glob
import json
import os
import statistics

HERE = os.path.dirname(os.path.abspath(__file__))
out = {"command": "bench/results/restore29/hold1.sh (see README.md)", "trees": {}}
for tree, commit in (("head", "376703c"), ("base", "3f48c4f")):
    runs = [r for f in sorted(glob.glob(os.path.join(HERE, f"recovery_block*_{tree}.json")))
            for r in json.load(open(f))["elasticd"]["detail"]]
    secs = [r["seconds"] for r in runs if r["recovered"] and not r.get("invalid")]
    probe = [r["revoked_by_probe"]["after"] for r in runs if r.get("revoked_by_probe")]
    out["trees"][tree] = {
        "commit": commit, "runs": len(runs), "recovered": len(secs),
        "invalid": sum(1 for r in runs if r.get("invalid")),
        "median_seconds": round(statistics.median(secs), 3),
        "best_seconds": round(min(secs), 3), "worst_seconds": round(max(secs), 3),
        "seconds": [round(s, 3) for s in secs],
        "steps_lost": [r["steps_lost"] for r in runs],
        "revoked_by_probe": len(probe),
        "probe_seconds": [round(p, 3) for p in probe],
        "kill_returned_after_median": round(statistics.median(
            r["strike_returned_after"] for r in runs), 3),
        "median_seconds_from_the_return_of_kill": round(statistics.median(
            r["seconds"] - r["strike_returned_after"] for r in runs), 3),
        "fault_moment": sorted({r["fault_moment"] for r in runs}),
    }
with open(os.path.join(HERE, "bracket.json"), "w") as fh:
    json.dump(out, fh, indent=2)
print(json.dumps({t: {k: v for k, v in d.items() if k not in ("seconds", "steps_lost",
                  "probe_seconds")} for t, d in out["trees"].items()}, indent=1))
