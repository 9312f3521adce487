"""Compares run_all.py reports figure by figure: each run's value and its ratio to the
baseline measured in the same run, and the change of the median of the "after" reports against
the median of the others (a before/after of a change, with before runs on both sides of the
after ones), and whether that change is within 5 % or better; the same for each figure's ratio
to the first baseline measured in its own run (what a host whose speed drifts between blocks
leaves comparable).

    python bench/compare_runs.py before1.json after.json before2.json --after after.json
    python bench/compare_runs.py b1.json a1.json a2.json b2.json --after a1.json --after a2.json

Writes a Markdown table to stdout.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics


def _figures(path: str) -> tuple[str, dict[str, dict]]:
    with open(path) as f:
        report = json.load(f)
    commit = str((report.get("git") or {}).get("commit", ""))[:8]
    # A figure is known by its words outside parentheses: those hold details (worst run,
    # protocol version) that change between versions of the same benchmark.
    return commit, {f"{f['benchmark']}: " + re.sub(r"\s*\([^()]*\)", "", f["figure"]).strip(): f
                    for f in report["figures"]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("reports", nargs="+", help="run_all.py latest.json files, in run order")
    p.add_argument("--after", required=True, action="append",
                   help="which of them is the change (repeat for several runs of it)")
    a = p.parse_args()
    runs = [(path, *_figures(path)) for path in a.reports]
    after = [r for r in runs if any(os.path.samefile(r[0], x) for x in a.after)]
    before = [r for r in runs if r not in after]
    heads = [f"{os.path.basename(path)} ({commit})" for path, commit, _ in runs]
    print("| figure | unit | better | " + " | ".join(heads)
          + " | median after / median before | within 5 % or better"
          + " | the same, of the ratios to the run's baseline | within 5 % or better |")
    print("| --- | --- | --- | " + " | ".join("---:" for _ in runs) + " | ---: | --- | ---: | --- |")
    # Every figure some "after" run has (a run of --only has fewer), in order of first sight.
    for name in dict.fromkeys(name for _, _, figs in after for name in figs):
        fig = next(figs[name] for _, _, figs in after if name in figs)
        cells = []
        for _, _, figs in runs:
            f = figs.get(name)
            base = f and f["baselines"] and f["baselines"][0]
            cells.append("—" if f is None else f"{f['value']:.3g}" + (
                f" ({base['ratio']:.2f} x base)" if base and base.get("ratio") else ""))

        def change(key) -> tuple[str, str]:
            olds = [v for _, _, figs in before if (v := key(figs.get(name))) is not None]
            news = [v for _, _, figs in after if (v := key(figs.get(name))) is not None]
            if not olds or not news:
                return "—", "—"
            old, new = statistics.median(olds), statistics.median(news)
            if not old:  # nothing to divide by (0 steps lost): only the direction counts
                better = new == 0 or fig["better"] == "higher"
                return "—", "yes" if better else "**no**"
            ratio = new / old
            worse = ratio - 1 if fig["better"] == "lower" else 1 - ratio
            return f"{ratio:.3f}", "yes" if worse <= 0.05 else "**no**"

        def value(f):
            return None if f is None else f["value"]

        def to_base(f):  # a host that drifts moves the figure and its same-run baseline alike
            return f["baselines"][0].get("ratio") if f and f["baselines"] else None

        print(f"| {name} | {fig['unit']} | {fig['better']} | " + " | ".join(cells)
              + " | %s | %s | %s | %s |" % (*change(value), *change(to_base)))


if __name__ == "__main__":
    main()
