"""Table of restore41's spike runs (``spike.sh``): per run, elasticd's path and the worker-fetch
spike each against the verified floor of the same run, and where the CPU went.

    python bench/results/restore41/summarize_spike.py bench/results/restore41/spike > bench/results/restore41/spike/table.md
"""

from __future__ import annotations

import glob
import json
import os
import statistics
import sys


def per_process(cpu: dict, prefix: str) -> float:
    return round(sum(v for k, v in cpu.items() if k.startswith(prefix)), 3)


def main() -> None:
    directory = sys.argv[1]
    rows, spike_ratios, el_ratios = [], [], []
    for path in sorted(glob.glob(os.path.join(directory, "sharded_*_spike_*.json")),
                       key=lambda p: int(p.rsplit("_", 1)[1].split(".")[0])):
        d = json.load(open(path))
        res = d["results"]
        el, fl, sp = (next(v for k, v in res.items() if k.startswith(p))
                      for p in ("elasticd", "verified floor", "spike"))
        s = d["spike_worker_fetch"]
        cpu = {n: x["cpu_seconds_timed"]["per_restore"] for n, x in
               (("el", el), ("fl", fl), ("sp", sp))}
        spike_ratios.append(s["over_verified_floor"]["cpu_seconds_per_restore_timed_paired_median"])
        el_ratios.append(d["elasticd_over_verified_floor"]
                         ["cpu_seconds_per_restore_timed_paired_median"])
        rows.append(
            f"| {path.rsplit('_', 1)[1].split('.')[0]} | {path.split('sharded_')[1].split('_')[0]} "
            f"| {el_ratios[-1]}x | **{spike_ratios[-1]}x** "
            f"| {s['over_elasticd']['cpu_seconds_per_restore_timed_paired_median']}x "
            f"| {d['elasticd_over_verified_floor']['timed_rounds_seconds']}x "
            f"| {s['over_verified_floor']['timed_rounds_seconds']}x "
            f"| {s['over_verified_floor']['first_round_seconds']}x "
            f"| {cpu['fl']['total']} / {cpu['el']['total']} / {cpu['sp']['total']} "
            f"| {per_process(cpu['fl'], 'holder')} / {per_process(cpu['el'], 'holder')} / "
            f"{per_process(cpu['sp'], 'holder')} "
            f"| {per_process(cpu['fl'], 'worker')} / "
            f"{round(per_process(cpu['el'], 'worker') + per_process(cpu['el'], 'daemon'), 3)} / "
            f"{round(per_process(cpu['sp'], 'worker') + per_process(cpu['sp'], 'daemon'), 3)} |")
    print("| run | pages | elasticd CPU / floor (paired median) | spike CPU / floor (paired median) "
          "| spike / elasticd | elasticd timed / floor | spike timed / floor "
          "| spike first round / floor's | CPU s per restore: floor / elasticd / spike "
          "| holders: floor / elasticd / spike | receivers (workers + daemons): floor / elasticd "
          "/ spike |")
    print("|---:|---|---:|---:|---:|---:|---:|---:|---|---|---|")
    print("\n".join(rows))
    print()
    print(f"medians over {len(rows)} runs: elasticd {statistics.median(el_ratios)}x, spike "
          f"{statistics.median(spike_ratios)}x the floor's CPU per restore; runs <= 1.5x: "
          f"elasticd {sum(r <= 1.5 for r in el_ratios)} of {len(rows)}, spike "
          f"{sum(r <= 1.5 for r in spike_ratios)} of {len(rows)}")


if __name__ == "__main__":
    main()
