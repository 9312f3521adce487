"""The job's worker-group restarts on this node, as the crash-loop rule counts them.

Two kinds of restart are seen: torchrun's agent restarting its worker group (a new
``attempt_<n>`` in its run directory) and the daemon restarting an agent that died. Each is
counted with the failure the agent's log shows since the last one (or the reason the daemon
itself gave, a hang), and the job's newest committed step at that moment: the pure rule in
:mod:`elasticd.agent.crashloop` decides from these whether the job crash-loops.
"""

from __future__ import annotations

from typing import Callable

from elasticd.agent import crashloop
from elasticd.clock import Clock


class RestartWatch:
    """Counts the restarts of the job this node runs (owned by the job manager).

    Attributes:
        loop: the crash-loop rule's state for the job.
        cause: why the daemon itself restarted the workers last, if it did (a hang), until
            that restart is counted.
        runs_known: torchrun run directories of the agents before the current one.
    """

    def __init__(self, clock: Clock) -> None:
        self._clock = clock
        self.loop = crashloop.LoopState()
        self._job: str | None = None
        self._best_step = -1  # the newest step reported for the job (fallback watermark)
        self.runs_known: set[str] = set()
        self._attempt = 0  # the agent's worker group attempt (torchrun's restart count)
        self._log_mark = 0  # agent log size at the last restart seen
        self._attempt_at = 0.0  # when the current worker group attempt started (monotonic)
        self.cause = ""

    def agent_starting(self, job: str, run_dir: str) -> None:
        """An agent of ``job`` is about to start, its torchrun runs under ``run_dir``: a new job
        starts counting afresh; the same job keeps its count (an agent restarted after dying)."""
        if self._job != job:
            self.loop, self._job, self._best_step = crashloop.LoopState(), job, -1
        self.runs_known = crashloop.runs(run_dir)
        self._attempt = 0

    def agent_started(self, log_size: int) -> None:
        self._log_mark = log_size
        self._attempt_at = self._clock.monotonic()

    def progress(self, step: int) -> None:
        """A worker reported ``step`` (the watermark when nothing is committed)."""
        self._best_step = max(self._best_step, step)

    def new_attempts(self, run_dir: str) -> int:
        """How many worker group restarts torchrun made since the last look."""
        attempt = crashloop.attempts(run_dir, self.runs_known)
        new, self._attempt = max(0, attempt - self._attempt), max(attempt, self._attempt)
        return new

    def restarted(self, log_size: int, log_tail: Callable[[int], str],
                  committed: crashloop.Version | None, fallback: str = "", times: int = 1) -> None:
        """A worker group restart, or ``times`` of them seen at once: counts them. Restarts
        seen together share the failure the log shows since the last look: read for the first
        alone, the others counted as showing no traceback, and a job whose restarts came faster
        than the daemon's cycle was failed with that reason instead of its exception (CI: the
        crash-loop test, one run in two)."""
        text = log_tail(self._log_mark) if log_size > self._log_mark else ""
        self._log_mark = log_size
        failure = (self.cause or crashloop.failure_summary(text) or fallback
                   or crashloop.NO_TRACEBACK)
        self.cause = ""
        if committed is None and self._best_step >= 0:
            committed = (0, self._best_step)
        now = self._clock.monotonic()
        for _ in range(times):
            self.loop = crashloop.after_restart(self.loop, committed, failure,
                                                now - self._attempt_at)
        self._attempt_at = now

    def verdict(self, limit: int) -> str | None:
        """Why the job crash-loops (``limit`` restarts in a row without progress), or None."""
        return crashloop.verdict(self.loop, limit)
