"""The snapshot rate of a soak block (``bench/soak.py --modes``): how much snapshotting each
mode's job did, so that its goodput can be read beside the work it paid for.

The same training script asks for a snapshot every step in both modes; the daemon decides
which are taken (docs/replication.md): the restart path's commit slots refuse a snapshot while
a commit is pending (``commit_pending``) or off the job's snapshot grid (``grid``), and it is
skipped; an in-process job takes each of those into its newest pair instead (``newest_only``,
this node's own copy for an in-process restore). Two sources, each checked against the other:

* the workers' step rows (``saved``: whether the step's snapshot was taken), per rank-step, and
  the median step with and without a snapshot (rank 0, consecutive steps of one attempt);
* the daemons' counters (``elasticd_snapshots_total``, ``elasticd_snapshots_skipped_total``
  and ``elasticd_snapshots_newest_only_total`` by reason), read from each daemon's /metrics
  just before it is killed and from every daemon at the block's end, and summed over the
  daemons' lives (a restarted daemon counts from 0).
"""

from __future__ import annotations

import collections
import re
import statistics
from typing import Any, Iterable

_LINE = re.compile(r'^elasticd_snapshots(_skipped|_newest_only)?_total(?:\{reason="(\w+)"\})?'
                   r"\s+([0-9.e+]+)$")


def counts(text: str) -> collections.Counter:
    """The snapshot counters of one daemon's /metrics text: ``snapshots``,
    ``skipped:<reason>`` and ``newest_only:<reason>``."""
    out: collections.Counter = collections.Counter()
    for line in text.splitlines():
        m = _LINE.match(line.strip())
        if m:
            kind, reason, value = m.groups()
            key = "snapshots" if kind is None else f"{kind[1:]}:{reason}"
            if float(value):
                out[key] += int(float(value))
    return out


def _step_seconds(rows: list[dict]) -> dict[bool, list[float]]:
    """Rank 0's step durations (since its step before in the same attempt), by ``saved``."""
    at = {(r["pid"], r["round"], r["step"]): r["t"] for r in rows if r["rank"] == 0}
    out: dict[bool, list[float]] = {True: [], False: []}
    for r in rows:
        before = at.get((r["pid"], r["round"], r["step"] - 1))
        if r["rank"] == 0 and before is not None and "saved" in r:
            out[bool(r["saved"])].append(r["t"] - before)
    return out


def block(rows: list[dict], daemons: collections.Counter,
          until: float = float("inf")) -> dict[str, Any]:
    """A block's snapshot rate, from its step rows and its daemons' summed counters, read at
    ``until`` (the rows after it are left out: the job trains on while the cluster stops, ~7 s
    of steps the counters never saw, which made 9 % of the rows' snapshots look missing)."""
    rows = [r for r in rows if r["t"] <= until]
    seconds = _step_seconds(rows)
    return {**_rate(len(rows), sum(1 for r in rows if r.get("saved")), daemons),
            "median_step_s_saved": _median(seconds[True]),
            "median_step_s_not_saved": _median(seconds[False])}


def mode(blocks: Iterable[dict[str, Any]]) -> dict[str, Any]:
    """A mode's snapshot rate over its blocks (sums; each block's median steps listed); the
    blocks' reports without one (made by :func:`bench.soak_inprocess.analyse` alone) left out."""
    blocks = [b["snapshots"] for b in blocks if "snapshots" in b]
    daemons: collections.Counter = collections.Counter()
    for b in blocks:
        daemons.update(b["daemon_counts"])
    return {**_rate(sum(b["rank_steps"] for b in blocks), sum(b["saved"] for b in blocks),
                    daemons),
            "median_step_s_saved": [b["median_step_s_saved"] for b in blocks],
            "median_step_s_not_saved": [b["median_step_s_not_saved"] for b in blocks]}


def _rate(rank_steps: int, saved: int, daemons: collections.Counter) -> dict[str, Any]:
    def per_step(n: int) -> float | None:
        return round(n / rank_steps, 4) if rank_steps else None

    by = {kind: {k.split(":", 1)[1]: v for k, v in sorted(daemons.items())
                 if k.startswith(kind + ":") and v}
          for kind in ("skipped", "newest_only")}
    taken, newest = daemons["snapshots"], sum(by["newest_only"].values())
    return {
        "rank_steps": rank_steps, "saved": saved, "saved_per_step": per_step(saved),
        "daemon_counts": dict(sorted(daemons.items())),
        "daemon_snapshots_per_step": per_step(taken),
        # The commit slots' snapshots: replicated and committable, the same kind in both modes.
        "committable_per_step": per_step(taken - newest),
        "newest_only_per_step": per_step(newest),
        "skipped_per_step": per_step(sum(by["skipped"].values())),
        "skipped_by_reason": by["skipped"],
        "newest_only_by_reason": by["newest_only"],
    }


def _median(values: list[float]) -> float | None:
    return round(statistics.median(values), 4) if values else None
