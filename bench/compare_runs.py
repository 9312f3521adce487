"""Compares run_all.py reports figure by figure: each run's value and its ratio to the
baseline measured in the same run, and the change of the last report against the median of
the others (a before/after of a change, with the before run on both sides of the after).

    python bench/compare_runs.py before1.json after.json before2.json --after after.json

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
    p.add_argument("--after", required=True, help="which of them is the change")
    a = p.parse_args()
    runs = [(path, *_figures(path)) for path in a.reports]
    after = next(r for r in runs if os.path.samefile(r[0], a.after))
    before = [r for r in runs if r is not after]
    heads = [f"{os.path.basename(path)} ({commit})" for path, commit, _ in runs]
    print("| figure | unit | better | " + " | ".join(heads) + " | after / median before |")
    print("| --- | --- | --- | " + " | ".join("---:" for _ in runs) + " | ---: |")
    for name, fig in after[2].items():
        cells = []
        for _, _, figs in runs:
            f = figs.get(name)
            base = f and f["baselines"] and f["baselines"][0]
            cells.append("—" if f is None else f"{f['value']:.3g}" + (
                f" ({base['ratio']:.2f} x base)" if base and base.get("ratio") else ""))
        olds = [figs[name]["value"] for _, _, figs in before if name in figs]
        change = (f"{fig['value'] / statistics.median(olds):.2f}"
                  if olds and statistics.median(olds) else "—")
        print(f"| {name} | {fig['unit']} | {fig['better']} | " + " | ".join(cells)
              + f" | {change} |")


if __name__ == "__main__":
    main()
