"""This node's straggler verdict on the job it runs, and what follows from it.

The verdict is :class:`elasticd.agent.straggler.StragglerJudge`'s (pure), from the compute times
per step the nodes publish; it goes into the node's job status and the ``elasticd_straggler``
metric. A node newly named records a ``straggler`` event, and asks for its own drain when the
job wants that and would keep its minimum of nodes (:func:`elasticd.agent.job_rules
.drain_straggler`).
"""

from __future__ import annotations

import logging
from typing import Any, Callable

from elasticd.agent import job_rules
from elasticd.agent.job_status import JobStatusBoard
from elasticd.agent.straggler import StragglerJudge
from elasticd.cluster.jobspec import JobSpec, JobState, NodeJobStatus
from elasticd.coordination.api import CoordinationError
from elasticd.metrics import Metrics

log = logging.getLogger(__name__)


class StragglerWatch:
    """Judges this node against its job's other nodes, once a cycle (owned by the worker group).

    Args:
        board: the node's job status (its ``straggler`` field).
        drain: asks for this node's drain, as ``elasticctl drain`` would (raises
            CoordinationError when etcd does not take it).
        record_event: records a cluster event (kind, detail, data).
        note: adds a line to the cycle's notes.
    """

    def __init__(self, board: JobStatusBoard, metrics: Metrics, drain: Callable[[], Any],
                 record_event: Callable[[str, str, dict[str, Any]], None],
                 note: Callable[[str], None]) -> None:
        self._board = board
        self._metrics = metrics
        self._drain = drain
        self._record_event = record_event
        self._note = note
        self._judge: tuple[str, StragglerJudge] | None = None  # (job, its judge here)

    def observe(self, job: str | None, spec: JobSpec | None, compute: float | None,
                peers: dict[str, NodeJobStatus]) -> None:
        """This cycle's verdict on ``job`` (None: no agent runs here), given this node's
        ``compute`` time per step and ``peers``' statuses (every node's: this one is left
        out)."""
        me = self._board.node_id
        if job is None or spec is None:
            self._judge = None
            self._metrics.jobs.straggler.set(1 if self._board.status.straggler else 0)
            return
        if self._judge is None or self._judge[0] != job:
            self._judge = (job, StragglerJudge(spec.straggler_factor, spec.straggler_steps))
        running = {n: st for n, st in peers.items()
                   if n != me and st.state == JobState.RUNNING}
        step = self._board.status.last_step
        verdict = self._judge[1].observe(step if step >= 0 else None, compute,
                                         {n: st.compute_seconds for n, st in running.items()})
        self._metrics.jobs.straggler.set(1 if verdict.named else 0)
        before = self._board.edit(lambda st: {"straggler": verdict.text}
                                  if verdict.text != st.straggler else {})
        if not verdict.named or before.straggler:
            return
        log.warning("job %s: this node is a straggler: %s", job, verdict.text)
        self._note(f"{job}: {verdict.text}")
        drain = job_rules.drain_straggler(spec.straggler_drain, len(running), spec.nnodes_min)
        if spec.straggler_drain and not drain:
            log.warning("job %s: not draining straggler %s: %d other nodes run the job, its "
                        "minimum is %d", job, me, len(running), spec.nnodes_min)
        if drain:
            try:
                self._drain()
            except CoordinationError as exc:
                log.warning("job %s: could not ask for straggler %s's drain: %s", job, me, exc)
                drain = False
        self._record_event("straggler", f"{job}: {me} {verdict.text}"
                           f"{'; draining it' if drain else ''}",
                           {"job": job, "ratio": verdict.ratio, "compute_seconds": compute,
                            "step": step, "drain": drain})


def show_seconds(seconds: float) -> float:
    """``seconds`` to two significant digits (what the node publishes: a learned timeout or a
    compute time that drifts by a few percent is no etcd write; /status and the metrics carry
    the exact value)."""
    return float(f"{seconds:.2g}") if seconds > 0 else 0.0
