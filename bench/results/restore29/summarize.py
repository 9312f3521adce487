"""Tables for README.md from this directory's sharded restore results (each figure beside the
verified floor of the same run), and the median and spread of the first rounds per tree."""

import glob
import json
import os
import statistics
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
EL = "elasticd restore from peers' RAM (Checkpointer.restore)"


def floor_of(results):
    return next(v for k, v in results.items() if k.startswith("verified floor"))


def row(path):
    d = json.load(open(path))
    r, name = d["results"], os.path.basename(path)[len("sharded_shm_"):-len(".json")]
    e, f = r[EL], floor_of(r)
    ec, fc = e["cpu_seconds_timed"]["per_restore"], f["cpu_seconds_timed"]["per_restore"]
    workers = [ec[k] for k in sorted(ec) if k.startswith("worker")]
    holders = [ec[k] for k in sorted(ec) if k.startswith("holder")]
    daemons = [ec[k] for k in sorted(ec) if k.startswith("daemon")]
    return name, d["code"], e, f, ec, fc, workers, holders, daemons


def main(paths):
    rows = [row(p) for p in paths]
    print("| run | tree | timed s | floor | ratio | first round s | floor | ratio | CPU s/restore"
          " | floor | ratio | workers | daemons | holders |")
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|---|---|")
    for name, code, e, f, ec, fc, w, h, dm in rows:
        tree = code.get("commit") or os.path.basename(os.path.dirname(code["elasticd"]))
        print(f"| {name} | {str(tree)[:9]} | {e['seconds']:.3f} | {f['seconds']:.3f} | "
              f"{e['seconds'] / f['seconds']:.2f}x | {e['first_round_seconds']:.3f} | "
              f"{f['first_round_seconds']:.3f} | "
              f"{e['first_round_seconds'] / f['first_round_seconds']:.2f}x | "
              f"{ec['total']:.3f} | {fc['total']:.3f} | {ec['total'] / fc['total']:.2f}x | "
              f"{' + '.join(f'{x:.3f}' for x in w)} | {' + '.join(f'{x:.2f}' for x in dm)} | "
              f"{' / '.join(f'{x:.2f}' for x in h)} |")
    for tree in sorted({r[0].rstrip("0123456789") for r in rows}):
        mine = [r for r in rows if r[0].rstrip("0123456789") == tree]
        for what, get in (("first round", lambda r: (r[2]["first_round_seconds"],
                                                     r[3]["first_round_seconds"])),
                          ("timed", lambda r: (r[2]["seconds"], r[3]["seconds"])),
                          ("CPU", lambda r: (r[4]["total"], r[5]["total"]))):
            pairs = [get(r) for r in mine]
            ratios = sorted(a / b for a, b in pairs)
            print(f"{tree} {what}: elasticd median {statistics.median(a for a, _ in pairs):.3f} "
                  f"(range {min(a for a, _ in pairs):.3f}-{max(a for a, _ in pairs):.3f}), "
                  f"floor median {statistics.median(b for _, b in pairs):.3f} "
                  f"(range {min(b for _, b in pairs):.3f}-{max(b for _, b in pairs):.3f}), "
                  f"ratio median {statistics.median(ratios):.2f}x "
                  f"(range {ratios[0]:.2f}-{ratios[-1]:.2f}x, n={len(pairs)})")


if __name__ == "__main__":
    main(sys.argv[1:] or sorted(glob.glob(os.path.join(HERE, "sharded_shm_*.json"))))
