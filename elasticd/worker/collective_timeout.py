"""The collective timeout of an in-process round's group, learned from the worker's own steps.

A frozen or partitioned peer sends nothing, not even a reset, and a gloo collective waiting on
it cannot be interrupted in-process: ``abort()`` and ``shutdown()`` on torch 2.13's gloo
backend return at once and the pending operation still ends at the group's timeout (pytorch
#130345; measured: bench/results/spikes/inprocess/gloo_timeout.json). The timeout is thus
what frees a survivor. It is learned by the hang timeout's rule
(:mod:`elasticd.cluster.learned_timeout`) over the intervals between this worker's
:meth:`elasticd.Round.check` calls, with a floor of its own (:data:`FLOOR`), set on the live
group and told to the agent: the rule, why the floor is not the hang timeout's and what was
measured are in docs/jobs.md, "A frozen or partitioned peer".

Pure: the caller gives the times.
"""

from __future__ import annotations

from elasticd.cluster.learned_timeout import WARMUP_STEPS, LearnedTimeout, StepHistory

#: The lowest collective timeout once steps are learned, seconds: above a slow collective after
#: a peer's short stall (a commit, a snapshot under memory pressure: seconds at most here) and
#: below the default reform deadline (10 s), so that a survivor stuck on a frozen peer leaves
#: its group before its agent falls back to a restart.
FLOOR = 5.0


class CollectiveTimeout:
    """One worker process's collective timeout, across its rounds.

    Args:
        floor: the lowest learned timeout, seconds (:data:`FLOOR`).
        first: the timeout of a round's first steps and of any step before one is learned
            (the group's making, the restore, DDP's first step): the decorator's ``timeout``.
    """

    def __init__(self, floor: float = FLOOR, first: float = 60.0) -> None:
        self.rule = LearnedTimeout(floor=floor, first_step=first)
        self.history = StepHistory()
        self._last: float | None = None  # the last step boundary of this round
        self._steps = 0  # step intervals ended in this round

    def round_started(self) -> None:
        """A new round (the group made again): its first steps are warm-up again, and the time
        since the last round's last step is no step."""
        self._last, self._steps = None, 0

    def step(self, now: float) -> None:
        """A step boundary at monotonic ``now`` (each :meth:`elasticd.Round.check`)."""
        if self._last is not None:
            self._steps += 1
            if self._steps > WARMUP_STEPS:
                self.history.observe(0, now - self._last)
        self._last = now

    def seconds(self) -> float:
        """The timeout in force now."""
        if self._steps <= WARMUP_STEPS or not self.history.learned:
            return self.rule.warmup_timeout(self.history)
        return self.rule.timeout(self.history)

    def fired(self) -> None:
        """A collective timed out and no member of the round was gone (a long step the window
        had not seen, not a silent peer): the next timeouts are doubled, as the hang rule's."""
        self.rule.fired(self.history)

    def source(self) -> str:
        """``first_step`` (warm-up), ``learned`` or ``floor``, as the hang timeout's."""
        if self._steps <= WARMUP_STEPS or not self.history.learned:
            return "first_step"
        return self.rule.source(self.history)


def worth_setting(new: float, applied: float | None) -> bool:
    """Whether the group's timeout should change from ``applied`` to ``new``: always up (a
    longer step was learned: a lower timeout could cut it), down only by more than a tenth (the
    window's maximum drifts a little with every long step that leaves it)."""
    return applied is None or new > applied or new < 0.9 * applied
