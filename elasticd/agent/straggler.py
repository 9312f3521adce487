"""Naming a straggler: a node whose own compute time per step stays above the others'.

In synchronous data parallelism every rank's step takes as long as the slowest one's, so the
step time names nobody. What does is each node's compute time outside collectives
(:class:`elasticd.worker.compute_time.ComputeTimer`, reported with progress): every node
publishes its own (the median over its ranks of each rank's median of its last 50 steps,
:meth:`elasticd.agent.progress.ProgressTracker.compute_seconds`) in its job status, and every node
judges *itself* against the median of the other nodes' published figures.

* **Slower**: its own figure is more than ``factor`` times the others' median (and more than
  ``min_gap`` seconds above it: a 2 ms step that takes 3 ms is nobody's problem).
* **Named** once it has been slower for ``steps`` of its own training steps in a row. Steps, not
  seconds: a slow job is judged in as many steps as a fast one, and a node whose workers are
  restarting is not judged at all (no step moves).
* **Cleared** once it has been within the factor for ``steps`` steps in a row (no flapping
  around the line).

A node judges only itself because only it knows its own steps, and its verdict is what it
publishes (its job status's ``straggler`` field): every other surface, ``/status`` on any node
and ``elasticctl jobs``, reads the published verdicts, so they all say the same. Pure decisions
on plain numbers; tested alone (``tests/unit/test_straggler.py``).
"""

from __future__ import annotations

import dataclasses
import statistics
from typing import Mapping


@dataclasses.dataclass(frozen=True)
class Verdict:
    """What the judge says after an observation.

    Attributes:
        named: this node is a straggler.
        ratio: its compute time over the others' median (None: nothing to compare).
        text: "" when not named, else one sentence for ``/status`` and ``elasticctl jobs``.
    """

    named: bool
    ratio: float | None = None
    text: str = ""


class StragglerJudge:
    """This node's straggler verdict for one job, from observation to observation (``factor``,
    ``steps`` and ``min_gap``: the module docstring's; a ``factor`` of 0 never judges)."""

    def __init__(self, factor: float = 1.5, steps: int = 20, min_gap: float = 0.005) -> None:
        self.factor, self.steps, self.min_gap = factor, steps, min_gap
        self._named = False
        self._since: int | None = None  # first step of the current run on the other side
        self._text = ""

    def observe(self, step: int | None, mine: float | None,
                others: Mapping[str, float]) -> Verdict:
        """One look: ``step`` this node's last training step, ``mine`` its compute time per
        step, ``others`` the other nodes' published ones (node -> seconds)."""
        peers = {n: s for n, s in others.items() if s > 0}
        if self.factor <= 0 or step is None or mine is None or not peers:
            return self._keep(None)
        median = statistics.median(peers.values())  # > 0: every peer's is
        ratio = mine / median
        slower = ratio > self.factor and mine - median > self.min_gap
        if slower == self._named:
            self._since = None  # on the side of the verdict: nothing to count
        elif self._since is None:
            self._since = step
        elif step - self._since >= self.steps:
            self._named, self._since = slower, None
        if self._named:
            self._text = (f"STRAGGLER: compute {mine:.3g} s/step, {ratio:.2g}x the median "
                          f"{median:.3g} s of {', '.join(sorted(peers))}")
        return self._keep(ratio)

    def _keep(self, ratio: float | None) -> Verdict:
        return Verdict(self._named, ratio, self._text if self._named else "")
