"""Tables for README.md from this directory's sharded restore results of hold 2
(sharded_<pages>_<tree>_<k>.json, tree ``1m`` = d467747, ``512k`` = the same with 512 KiB
checksum blocks, run k in the hold's order): each run beside the verified floor of the same
run, CPU by process, and per (pages, tree) the medians of the three ratios; then the per-request
cost of piece_cost.json. Writes summary.json beside it.

    python bench/results/restore32/summarize.py
"""

import glob
import json
import os
import statistics

HERE = os.path.dirname(os.path.abspath(__file__))
EL = "elasticd restore from peers' RAM (Checkpointer.restore)"


def run(path):
    d = json.load(open(path))
    _, pages, tree, k = os.path.basename(path)[:-len(".json")].split("_")
    r = d["results"]
    e = r[EL]
    f = next(v for n, v in r.items() if n.startswith("verified floor"))
    ec, fc = e["cpu_seconds_timed"]["per_restore"], f["cpu_seconds_timed"]["per_restore"]
    return {"run": int(k), "pages": pages, "tree": tree, "elasticd": d["code"]["elasticd"],
            "timed": e["seconds"], "timed_floor": f["seconds"],
            "first": e["first_round_seconds"], "first_floor": f["first_round_seconds"],
            "cpu": ec["total"], "cpu_floor": fc["total"],
            "workers": [ec[n] for n in sorted(ec) if n.startswith("worker")],
            "daemons": [ec[n] for n in sorted(ec) if n.startswith("daemon")],
            "holders": [ec[n] for n in sorted(ec) if n.startswith("holder")],
            "floor_receivers": [fc[n] for n in sorted(fc) if n.startswith("worker")],
            "floor_senders": [fc[n] for n in sorted(fc) if n.startswith("holder")],
            "wire_bytes": [x["wire_bytes_per_restore"] for x in d["elasticd_fetch"]]}


def main():
    rows = sorted((run(p) for p in glob.glob(os.path.join(HERE, "sharded_*_*_*.json"))),
                  key=lambda x: x["run"])
    print("| run | pages | tree | timed s | floor | ratio | first s | floor | ratio | CPU s | floor"
          " | ratio | workers | daemons | holders | floor receivers / senders | MB fetched |")
    print("|---:|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|---|---|---|---|")
    for x in rows:
        print(f"| {x['run']} | {x['pages']} | {x['tree']} | {x['timed']:.3f} | "
              f"{x['timed_floor']:.3f} | {x['timed'] / x['timed_floor']:.2f}x | "
              f"{x['first']:.3f} | {x['first_floor']:.3f} | "
              f"{x['first'] / x['first_floor']:.2f}x | {x['cpu']:.3f} | {x['cpu_floor']:.3f} | "
              f"**{x['cpu'] / x['cpu_floor']:.2f}x** | "
              f"{' + '.join(f'{v:.3f}' for v in x['workers'])} | "
              f"{' + '.join(f'{v:.2f}' for v in x['daemons'])} | "
              f"{' / '.join(f'{v:.2f}' for v in x['holders'])} | "
              f"{' + '.join(f'{v:.2f}' for v in x['floor_receivers'])} / "
              f"{' / '.join(f'{v:.2f}' for v in x['floor_senders'])} | "
              f"{' + '.join(str(round(v / 1e6)) for v in x['wire_bytes'])} |")
    summary = {}
    for pages in ("shm", "huge"):
        for tree in sorted({x["tree"] for x in rows}):
            mine = [x for x in rows if x["pages"] == pages and x["tree"] == tree]
            if not mine:
                continue
            out = {"runs": [x["run"] for x in mine]}
            for what, a, b in (("timed", "timed", "timed_floor"), ("first", "first", "first_floor"),
                               ("cpu", "cpu", "cpu_floor")):
                ratios = [x[a] / x[b] for x in mine]
                out[f"{what}_ratio_median"] = round(statistics.median(ratios), 3)
                out[f"{what}_ratios"] = [round(v, 3) for v in ratios]
            out["cpu_median_s"] = round(statistics.median(x["cpu"] for x in mine), 3)
            out["cpu_floor_median_s"] = round(statistics.median(x["cpu_floor"] for x in mine), 3)
            out["cpu_over_floor_median_s"] = round(statistics.median(
                x["cpu"] - x["cpu_floor"] for x in mine), 3)
            summary[f"{pages} {tree}"] = out
            print(f"{pages} {tree}: " + ", ".join(f"{k} {v}" for k, v in out.items()))
    piece = os.path.join(HERE, "piece_cost.json")
    if os.path.exists(piece) and os.path.getsize(piece):
        summary["piece_cost"] = json.load(open(piece)).get("per_request_ms")
        print("per request, ms:", summary["piece_cost"])
    with open(os.path.join(HERE, "summary.json"), "w") as fh:
        json.dump(summary, fh, indent=1)
        fh.write("\n")


if __name__ == "__main__":
    main()
