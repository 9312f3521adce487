"""Table of restore42's sharded runs (elasticd's path is the worker's direct fetch): each
run's ratios over the verified floor, the spike's beside them, and each process kind's CPU
per restore. Run: python bench/results/restore42/summarize.py bench/results/restore42/direct_final"""

import glob
import json
import sys


def main(where: str) -> None:
    print("| run | pages | timed | first | CPU per restore (paired median; rounds) | spike CPU "
          "| CPU s: daemons / holders / workers (floor: senders / receivers) | direct fetch: "
          "restores, wire MB, in place MB |")
    print("|---|---|---:|---:|---|---:|---|---|")
    for f in sorted(glob.glob(f"{where}/*.json"), key=lambda p: int(p.rsplit("_", 1)[1][:-5])):
        r = json.load(open(f))
        over, paired = r["elasticd_over_verified_floor"], r["cpu_per_restore_paired_by_round"]
        spike = r.get("spike_worker_fetch", {}).get("over_verified_floor", {})
        el = next(v for k, v in r["results"].items() if k.startswith("elasticd"))
        fl = next(v for k, v in r["results"].items() if k.startswith("verified floor"))
        e, c = el["cpu_seconds_timed"]["per_restore"], fl["cpu_seconds_timed"]["per_restore"]

        def kind(d: dict, prefix: str) -> float:
            return round(sum(v for k, v in d.items() if k.startswith(prefix)), 3)

        d = (r.get("elasticd_fetch") or [{}])[0].get("direct_fetch")
        direct = (f"{d['restores']}/{d['of']}, {d['wire_bytes'] / 1e6:.0f}, "
                  f"{d['routed_bytes'] / 1e6:.0f}" if d else "(not recorded by this tree)")
        run = f.rsplit("_", 1)[1][:-5]
        pages = "huge" if "huge" in f else "shm"
        print(f"| {run} | {pages} | {over['timed_rounds_seconds']}x | "
              f"{over['first_round_seconds']}x | **{paired['median_ratio']}x**; "
              f"{', '.join(map(str, paired['ratios']))} | "
              f"{spike.get('cpu_seconds_per_restore_timed_paired_median', '-')}x | "
              f"{kind(e, 'daemon')} / {kind(e, 'holder')} / {kind(e, 'worker')} "
              f"({kind(c, 'holder')} / {kind(c, 'worker')}) | {direct} |")


if __name__ == "__main__":
    main(sys.argv[1])
