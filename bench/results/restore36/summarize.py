"""Tables for README.md from this directory's sharded restore results (sharded_<pages>_<tree>_<k>
.json, tree ``new`` = this branch, ``old`` = main 07203cd, run k in the hold's order): restore31's
summarize.py pointed at this directory (each run beside the verified floor of the same run, CPU
by process, medians per arm), then per arm the first round's CPU against the floor's first
round and how many runs are at or under 1.5x; writes summary.json here.

    python bench/results/restore36/summarize.py [DIR]   # DIR: another set of runs (rule/)
"""

import glob
import json
import os
import runpy
import statistics
import sys

here = os.path.abspath(sys.argv[1]) if len(sys.argv) > 1 else os.path.dirname(os.path.abspath(__file__))
tables = runpy.run_path(os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "restore31",
                                     "summarize.py"))
tables["main"].__globals__["HERE"] = here
tables["main"]()
EL = tables["EL"]
summary = json.load(open(os.path.join(here, "summary.json")))
rows = []
for path in sorted(glob.glob(os.path.join(here, "sharded_*_*_*.json"))):
    d = json.load(open(path))
    _, pages, tree, k = os.path.basename(path)[:-len(".json")].split("_")
    r = d["results"]
    e, f = r[EL], next(v for n, v in r.items() if n.startswith("verified floor"))
    rows.append({"run": int(k), "pages": pages, "tree": tree, "code": d["code"]["elasticd"],
                 "timed": e["seconds"] / f["seconds"],
                 "first": e["first_round_seconds"] / f["first_round_seconds"],
                 "cpu": e["cpu_seconds_timed"]["per_restore"]["total"]
                 / f["cpu_seconds_timed"]["per_restore"]["total"],
                 "cpu_first": e["cpu_seconds_first_round"]["per_restore"]["total"]
                 / f["cpu_seconds_first_round"]["per_restore"]["total"],
                 "workers": sum(v for n, v in e["cpu_seconds_timed"]["per_restore"].items()
                                if n.startswith("worker"))})
print("| run | pages | tree | code | timed | first | CPU timed | CPU first round | workers' CPU s |")
print("|---:|---|---|---|---:|---:|---:|---:|---:|")
for x in sorted(rows, key=lambda x: x["run"]):
    print(f"| {x['run']} | {x['pages']} | {x['tree']} | {x['code']} | {x['timed']:.2f}x | "
          f"{x['first']:.2f}x | **{x['cpu']:.2f}x** | {x['cpu_first']:.2f}x | "
          f"{x['workers']:.3f} |")
for pages in ("shm", "huge"):
    for tree in ("new", "old"):
        mine = [x for x in rows if (x["pages"], x["tree"]) == (pages, tree)]
        if not mine:
            continue
        out = summary.setdefault(f"{pages} {tree}", {})
        for what in ("timed", "first", "cpu", "cpu_first"):
            out[f"{what}_runs_at_or_under_1.5x"] = f"{sum(x[what] <= 1.5 for x in mine)} of {len(mine)}"
        out["cpu_first_ratio_median"] = round(statistics.median(x["cpu_first"] for x in mine), 3)
        out["workers_cpu_median_s"] = round(statistics.median(x["workers"] for x in mine), 3)
        print(f"{pages} {tree}:", json.dumps(out))
peer = os.path.join(here, "peer_restore.json")
if os.path.exists(peer):
    d = json.load(open(peer))
    summary["peer restore"] = {k: d.get(k) for k in (
        "elasticd_speed_over_verified_floor", "receiver_cpu_seconds_per_gib_over_verified_floor",
        "targets", "code")}
    print("peer:", json.dumps(summary["peer restore"]))
with open(os.path.join(here, "summary.json"), "w") as fh:
    json.dump(summary, fh, indent=1)
