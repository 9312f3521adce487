"""The lead's rule hold (hold.sh): each run beside the verified floor of the same run, and how
many runs are at or under 1.5x (timed rounds, first round, CPU per restore), per page kind;
writes summary.json here.

    python bench/results/restore36/rule/summarize.py
"""

import glob
import json
import os
import statistics

here = os.path.dirname(os.path.abspath(__file__))
EL = "elasticd restore from peers' RAM (Checkpointer.restore)"
rows = []
for path in sorted(glob.glob(os.path.join(here, "sharded_*_new_*.json"))):
    d = json.load(open(path))
    _, pages, tree, k = os.path.basename(path)[:-len(".json")].split("_")
    r = d["results"]
    e, f = r[EL], next(v for n, v in r.items() if n.startswith("verified floor"))
    rows.append({"run": int(k), "pages": pages, "code": d["code"]["elasticd"],
                 "timed": e["seconds"] / f["seconds"],
                 "first": e["first_round_seconds"] / f["first_round_seconds"],
                 "cpu": e["cpu_seconds_timed"]["per_restore"]["total"]
                 / f["cpu_seconds_timed"]["per_restore"]["total"],
                 "cpu_first": e["cpu_seconds_first_round"]["per_restore"]["total"]
                 / f["cpu_seconds_first_round"]["per_restore"]["total"],
                 "floor_cpu": f["cpu_seconds_timed"]["per_restore"]["total"]})
print("| run | pages | code | timed | first round | CPU timed | CPU first round | floor's CPU s |")
print("|---:|---|---|---:|---:|---:|---:|---:|")
for x in sorted(rows, key=lambda x: x["run"]):
    print(f"| {x['run']} | {x['pages']} | {x['code']} | {x['timed']:.2f}x | {x['first']:.2f}x | "
          f"**{x['cpu']:.2f}x** | {x['cpu_first']:.2f}x | {x['floor_cpu']:.3f} |")
summary = {}
for pages in ("shm", "huge"):
    mine = [x for x in rows if x["pages"] == pages]
    if not mine:
        continue
    out = summary[pages] = {"runs": len(mine)}
    for what in ("timed", "first", "cpu", "cpu_first"):
        out[f"{what}_median"] = round(statistics.median(x[what] for x in mine), 3)
        out[f"{what}_max"] = round(max(x[what] for x in mine), 3)
        out[f"{what}_runs_at_or_under_1.5x"] = f"{sum(x[what] <= 1.5 for x in mine)} of {len(mine)}"
    print(f"{pages}:", json.dumps(out))
with open(os.path.join(here, "summary.json"), "w") as f:
    json.dump(summary, f, indent=1)
