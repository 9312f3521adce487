"""What the kept logs of ``bench_recovery.py --mode ... --keep DIR`` runs say of each recovery
(issue 31's partition, freeze and fallback points): how each survivor left the old group and
when, the collective timeout its steps had learned, and the path each node took.

    .venv/bin/python bench/results/recovery_inprocess_logs.py DIR [--into RESULT]

Per run directory (``inproc-bench-<mode>-*``, in the order the runs started):

* ``left``: per node, its workers' ``left`` lines of the old round, by reason, counted
  (``timed out N ms``: gloo's collective timeout fired; ``connection closed``: its
  connections were shut down, by its own agent's abort or a peer's);
* ``waited_seconds``: per kept survivor, its ``left`` moment minus its last step logged in the
  old round (the pending collective began ~20 ms after that step: the example's sleep);
* ``after_strike_seconds``: per kept survivor, its agent's ``learned``, its own ``left`` and the
  ``round_closed`` moments after the fault (the last new rank's first step minus the run's
  ``seconds``);
* ``learned_timeout``: per old-round worker, the collective timeout its own steps give by the
  rule of elasticd/worker/collective_timeout.py (``max(5 s floor, 5 x the longest interval
  between its step lines``, the first 2 intervals not learned), and its source (``floor`` or
  ``learned``) and its longest interval, over the steps before the strike;
* ``reformed_in_process``, ``fell_back``, ``not_reforming``: the agents' ``re-formed
  in-process`` lines counted, and the reasons of their ``falling back`` and ``not re-forming``
  lines; ``kept`` / ``restarted``: the new world's ranks in old / new processes;
* ``restored_from``: per new rank (world 4), the old rank whose snapshot of the step saved by 6
  ranks it loaded, as its restore logged it (its own slot, the rank its process was or, in a
  process its agent restarted, the rank it replaced; a handed-over step: the holder's).

``--into``: the result file whose per-mode ``detail`` runs get a ``logs`` key each (matched in
order, mode by mode).
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import re

FLOOR, FACTOR, WARMUP = 5.0, 5.0, 2


def rows(run: str) -> list[dict]:
    out = []
    for path in glob.glob(os.path.join(run, "steps", "steps-*.jsonl")):
        with open(path) as fh:
            for line in fh:
                try:
                    row = json.loads(line)
                except ValueError:
                    continue
                if "step" in row:
                    out.append(row)
    return sorted(out, key=lambda r: r["t"])


def learned(old: list[dict]) -> dict:
    """pid -> [timeout, source] from its old-round step lines."""
    out = {}
    for pid in sorted({r["pid"] for r in old}):
        t = [r["t"] for r in old if r["pid"] == pid]
        gaps = [b - a for a, b in zip(t, t[1:])][WARMUP:]
        if not gaps:
            continue
        value = max(FLOOR, FACTOR * max(gaps))
        out[str(pid)] = [round(value, 3), "learned" if FACTOR * max(gaps) > FLOOR else "floor",
                         round(max(gaps), 3)]
    return out


def agent_lines(run: str, old_round: int) -> dict:
    text, left = "", {}
    for path in sorted(glob.glob(os.path.join(run, "cluster", "*", "jobs", "*", "agent.log"))):
        with open(path, errors="replace") as fh:
            mine = fh.read()
        text += mine
        reasons: dict[str, int] = {}
        # The old round's only: the cluster's stop after the run breaks the new one too.
        for why in re.findall(rf"rank \d+ left round {old_round} \((.*)\)", mine):
            if m := re.search(r"Timed out waiting (\d+)ms", why):
                key = f"timed out {m.group(1)} ms"
            elif "Connection closed" in why or "Connection reset" in why:
                key = "connection closed"
            else:
                key = why[:80]
            reasons[key] = reasons.get(key, 0) + 1
        left[path.split(os.sep)[-4]] = reasons  # the node's name
    return {"left": left,
            "reformed_in_process": len(re.findall(r"re-formed in-process", text)),
            "fell_back": re.findall(r"falling back to a restart into round \d+ \(([^)]*)\)", text),
            "not_reforming": re.findall(r"not re-forming in-process: ([^;]*)", text),
            "restored_from": {str(k): v for k, v in sorted(
                (int(m[0]), int(m[1])) for m in re.findall(
                    r"rank (\d+) restored step \(\d+, \d+\) saved by 6 ranks into a world of "
                    r"4 \(old rank (\d+)'s snapshot", text))}}


def one(run: str, seconds: float | None = None) -> dict:
    rs = rows(run)
    old = [r for r in rs if r["world"] == 6]
    new = [r for r in rs if r["world"] == 4]
    old_pids = {r["pid"] for r in old}
    first_new: dict[int, dict] = {}
    for r in new:
        first_new.setdefault(r["pid"], r)
    # The strike's wall time, when the run's seconds are given: the last new rank's first
    # step minus them.
    struck = max(r["t"] for r in first_new.values()) - seconds if seconds and first_new else None
    waited, since_strike = {}, {}
    for pid, r in sorted(first_new.items()):
        times = r.get("times") or {}
        left = times.get("left")
        if pid in old_pids and left:
            last = max(x["t"] for x in old if x["pid"] == pid)
            waited[str(pid)] = round(left - last, 3)
            if struck is not None:
                since_strike[str(pid)] = {k: round(times[k] - struck, 3) for k in (
                    "learned", "left", "round_closed") if k in times}
    rounds = sorted({(r["round"]) for r in new})
    return {**agent_lines(run, min((r["round"] for r in old), default=0)),
            "waited_seconds": waited,
            "after_strike_seconds": since_strike or None,
            "kept": sum(p in old_pids for p in first_new), "restarted": sum(
                p not in old_pids for p in first_new),
            "old_rounds": sorted({r["round"] for r in old}), "new_rounds": rounds,
            "learned_timeout": learned(old)}


def runs_in(keep: str) -> dict[str, list[str]]:
    out: dict[str, list[tuple[float, str]]] = {}
    for d in glob.glob(os.path.join(keep, "inproc-bench-*")):
        mode = re.match(r"inproc-bench-(.+)-[^-]+$", os.path.basename(d)).group(1)
        rs = rows(d)
        out.setdefault(mode, []).append((rs[0]["t"] if rs else float("inf"), d))
    return {m: [d for _, d in sorted(v)] for m, v in out.items()}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("keep")
    p.add_argument("--into")
    args = p.parse_args()
    result = None
    if args.into:
        with open(args.into) as fh:
            result = json.load(fh)
    found = {}
    for mode, dirs in runs_in(args.keep).items():
        runs = result.get(mode, {}).get("detail", []) if result else []
        found[mode] = [one(d, runs[i].get("seconds") if i < len(runs) else None)
                       for i, d in enumerate(dirs)]
        for run, log in zip(runs, found[mode]):
            run["logs"] = log
    print(json.dumps(found, indent=1))
    if result is not None:
        with open(args.into, "w") as fh:
            json.dump(result, fh, indent=2)


if __name__ == "__main__":
    main()
