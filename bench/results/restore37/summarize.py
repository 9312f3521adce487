"""Tables for README.md from a directory of sharded restore results (sharded_<pages>_<tree>_<k>
.json; tree ``new`` = this branch, ``old`` = main 3d70f93; run k in the hold's order): each run
beside the verified floor of the same run (timed rounds, first round, CPU per restore as the
bench's ratio of medians and, where the bench pairs them, the median of the per-round ratios),
the CPU beyond the floor's by side (the fetching daemons against the floor's receivers, the
holders against the floor's senders, the workers' load, which the floor does not have), the
scratch counters; then per arm how many runs are at or under 1.5x. Writes summary.json there.

    python bench/results/restore37/summarize.py [DIR]    # default: rule/ beside this file
"""

import glob
import json
import os
import statistics
import sys

here = os.path.abspath(sys.argv[1]) if len(sys.argv) > 1 else os.path.join(
    os.path.dirname(os.path.abspath(__file__)), "rule")
EL = "elasticd restore from peers' RAM (Checkpointer.restore)"


def role(cpu: dict, prefix: str) -> float:
    return sum(v for n, v in cpu.items() if n.startswith(prefix))


def run_of(path: str) -> dict:
    """One result file as a row: its name gives the page kind, the tree and the run."""
    _, pages, tree, k = os.path.basename(path)[:-len(".json")].split("_")
    with open(path) as fh:
        d = json.load(fh)
    e = d["results"][EL]
    f = next(v for n, v in d["results"].items() if n.startswith("verified floor"))
    ec, fc = e["cpu_seconds_timed"]["per_restore"], f["cpu_seconds_timed"]["per_restore"]
    paired = d.get("cpu_per_restore_paired_by_round") or {}
    fetch = d.get("elasticd_fetch") or []
    return {
        "run": int(k), "pages": pages, "tree": tree, "code": d["code"]["elasticd"],
        "timed": e["seconds"] / f["seconds"],
        "first": e["first_round_seconds"] / f["first_round_seconds"],
        "cpu": ec["total"] / fc["total"], "floor_cpu": fc["total"], "cpu_s": ec["total"],
        "cpu_first": e["cpu_seconds_first_round"]["per_restore"]["total"]
        / f["cpu_seconds_first_round"]["per_restore"]["total"],
        "paired": paired.get("ratios", []), "paired_median": paired.get("median_ratio"),
        "over_daemons": role(ec, "daemon") - role(fc, "worker"),
        "over_holders": role(ec, "holder") - role(fc, "holder"),
        "workers": role(ec, "worker"),
        "handed": [x.get("timed_rounds_scratch_handed") for x in fetch],
        "maps": [x.get("timed_rounds_scratch_maps_made_reused") for x in fetch]}


rows = [run_of(p) for p in sorted(glob.glob(os.path.join(here, "sharded_*_*_*.json")))]
print("| run | pages | tree | timed | first | CPU timed (medians) | CPU per round (paired) | "
      "floor's CPU s | over: daemons / holders / workers' load, s | scratch same/other/new; "
      "maps made/reused (ranks 0, 1) |")
print("|---:|---|---|---:|---:|---:|---|---:|---|---|")
for x in sorted(rows, key=lambda x: x["run"]):
    scratch = "; ".join(
        f"{h['same']}/{h['other']}/{h['new']}, {m[0]}/{m[1]}" if h and m else "-"
        for h, m in zip(x["handed"], x["maps"])) or "-"
    print(f"| {x['run']} | {x['pages']} | {x['tree']} | {x['timed']:.2f}x | {x['first']:.2f}x | "
          f"**{x['cpu']:.2f}x** | {', '.join(f'{p:.2f}' for p in x['paired']) or '-'} | "
          f"{x['floor_cpu']:.3f} | {x['over_daemons']:+.3f} / {x['over_holders']:+.3f} / "
          f"{x['workers']:.3f} | {scratch} |")
summary = {"dir": os.path.relpath(here), "codes": sorted({x["code"] for x in rows})}
for pages in ("shm", "huge"):
    for tree in sorted({x["tree"] for x in rows}):  # new, old (or the one tree held)
        mine = [x for x in rows if (x["pages"], x["tree"]) == (pages, tree)]
        if not mine:
            continue
        out = summary.setdefault(f"{pages} {tree}", {"runs": [x["run"] for x in mine]})
        for what in ("timed", "first", "cpu", "cpu_first"):
            out[f"{what}_runs_at_or_under_1.5x"] = f"{sum(x[what] <= 1.5 for x in mine)} of {len(mine)}"
            out[f"{what}_ratio_median"] = round(statistics.median(x[what] for x in mine), 3)
        rounds = [p for x in mine for p in x["paired"]]
        if rounds:
            out["cpu_rounds_at_or_under_1.5x"] = f"{sum(p <= 1.5 for p in rounds)} of {len(rounds)}"
            out["cpu_round_ratio_median"] = round(statistics.median(rounds), 3)
        for what in ("floor_cpu", "cpu_s", "over_daemons", "over_holders", "workers"):
            out[f"{what}_median_s"] = round(statistics.median(x[what] for x in mine), 3)
        print(f"{pages} {tree}:", json.dumps(out))
with open(os.path.join(here, "summary.json"), "w") as fh:
    json.dump(summary, fh, indent=1)
