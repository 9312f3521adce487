"""torchrun's agent for a job in in-process mode (issue 31): it keeps its live workers through
a rendezvous round instead of restarting them.

:func:`install` (called by :mod:`elasticd.agent.torchrun` when the daemon runs an in-process
job: ``ELASTICD_IN_PROCESS``) opens the worker link (:mod:`.worker_link`), makes torch's
launcher build :class:`InProcessAgent` instead of ``LocalElasticAgent``, and changes what the
node does when a member of its round is gone: instead of killing its workers (the restart
path's proactive abort), it reports the change as a node waiting, so that the agent's monitor
calls ``_restart_workers``. It does the same as soon as every local worker has left its group
on its own (:func:`job_rules.all_left`: a peer's process died and the collective raised), as
a restarted node's agent would rejoin at once: the round then closes when the dead member's
record goes. ``_restart_workers`` here re-forms:

1. ``abort`` to every local worker: leave the old group now (a worker whose collective raised
   has already left, and said so);
2. the new round (torch's ``_rendezvous``: next_rendezvous and rank assignment);
3. each local worker must say ``left`` cleanly within the job's ``reform_deadline`` of the
   round, or within the collective timeout its workers' groups have when shorter
   (:func:`job_rules.reform_wait`, :func:`job_rules.reform_step`); if all do, each gets
   ``assign``: the environment torchrun gives a fresh worker of its local rank in that
   round; else (a worker stuck, died, or could not leave) the node restarts its workers into
   the same round, as today.

A node whose workers are not all alive and linked takes today's path at once
(:func:`job_rules.can_reform`). Either way the agent tells its daemon which path it took
(``reformed``), which ends the daemon's own deadline (:meth:`job_rules.JobBook.reform_started`).
Newcomers are **staged** (:meth:`InProcessAgent._initialize_workers`; what and why:
docs/jobs.md, "staged newcomers"): a node's first workers start before its agent joins a round,
with torch's placeholder place (rank -1) and :data:`~elasticd.local.worker_link.STAGED_ENV`,
and the agent joins once every one has linked. A staged worker makes no group before its
``assign``, so it never joins an old one; if the join itself fails the agent ends and torch
stops them. Replacement workers (a node's fallback) start fresh, and get their round through the
environment; they also learn where the node's old workers were
(:data:`~elasticd.local.worker_link.PREVIOUS_ENV`): their snapshots are in its RAM, and each new
worker's restore offers its predecessor's as a survivor offers its own.
"""

from __future__ import annotations

import functools
import logging
import os
import threading
from typing import Any

from torch.distributed.elastic.agent.server.api import WorkerState
from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent

from elasticd.agent import job_rules, torchrun
from elasticd.agent.job_rules import Reform
from elasticd.agent.signals import SignalRelay
from elasticd.agent.supervisor import REFORM_DEADLINE_ENV
from elasticd.cluster.jobspec import DEFAULT_REFORM_DEADLINE, MAX_REFORM_DEADLINE
from elasticd.agent.worker_link import LinkServer
from elasticd.clock import Clock, SystemClock
from elasticd.local.worker_link import (LINK_ENV, LINK_PID_ENV, PREVIOUS_ENV, ROUND_ENV,
                                        STAGED_ENV, places_env)

log = logging.getLogger(__name__)


class _Node:
    """What the installed agent and the rendezvous handler's hook share in this process."""

    def __init__(self, clock: Clock) -> None:
        self.clock = clock
        self.link = LinkServer()
        self.broken = False  # a member of the round is gone (set by the handler's hook)
        self.local_world = 0  # the node's local workers (set when the agent starts them)
        #: Wall time the hook last learned that a member is gone (a moment of the per-path
        #: timeline the workers report: :attr:`elasticd.worker.in_process.Round.times`).
        self.broken_at: float | None = None
        #: Set when something the monitor reads may have changed (a worker's message or
        #: hang-up, the rendezvous state): the monitor looks at once, not at its next poll.
        self.news = threading.Event()
        self.link.on_news = self.news.set
        self.poll = 0.02  # the monitor's interval (the agent's spec says: InProcessAgent)
        #: Whether ``_restart_workers`` runs, and when it last ended (monotonic): a daemon's
        #: word of a failure this re-formation already answers is not another failure.
        self.reforming = False
        self.reformed_at = float("-inf")

    def peer_failed(self) -> None:
        """The daemon recorded a peer of this job failed (:data:`job_rules.PEER_FAILED_SIGNAL`,
        from :func:`_hear_daemon`'s thread). A member is gone: re-form now, unless this agent
        is re-forming already or just did (its workers' group broke first, or the round
        closed without the peer before the daemon's record: the daemon then says
        LEFT_RUNNING, but its word may cross the round)."""
        if self.reforming or self.clock.monotonic() - self.reformed_at < RECENT:
            return
        if not self.broken:
            self.broken_at = self.clock.wall()
            self.broken = True
        self.news.set()

    def pause(self) -> None:
        """Between two looks of the agent's monitor: until news, or :attr:`poll` seconds (a
        worker's exit, which nothing announces, is seen at the poll). torch's monitor slept
        its whole interval: a failure learned just after a look waited up to 20 ms, on each
        agent, and the new round closes only once the last agent joins it."""
        self.news.wait(self.poll)
        self.news.clear()  # what the news said is read right after, by the look itself


_node: list[_Node] = []  # the one per agent process, once installed
_NO_STORE = object()  # a staged start's store: torch's start asserts one, before the round
#: Seconds a newcomer's staged workers have to reach their function, before the node joins its
#: round (then it joins anyway) and again after it (then they are replaced by fresh ones).
STAGE_WAIT = 120.0
#: Seconds after a re-formation ended during which a daemon's word of a failure is taken as
#: the one it answered (a failure that new is left to the rendezvous, as before the word).
RECENT = 1.0


def install(clock: Clock | None = None) -> None:
    """Makes this agent process in-process: the link, the agent class, the handler hook."""
    import torch.distributed.launcher.api as launcher_api

    from elasticd.coordination import rendezvous

    node = _Node(clock or SystemClock())
    _node[:] = [node]
    os.environ[LINK_ENV] = node.link.name  # torchrun and the zygote pass these to workers
    os.environ[LINK_PID_ENV] = str(os.getpid())
    rendezvous.on_handler_created.append(_hook)
    _hear_daemon(node)
    launcher_api.LocalElasticAgent = InProcessAgent  # type: ignore[misc]
    log.info("in-process mode: the agent keeps its live workers through a round")


def _hear_daemon(node: _Node) -> SignalRelay:
    """Takes the daemon's signal (:data:`job_rules.PEER_FAILED_SIGNAL`) to
    :meth:`_Node.peer_failed` on a thread of its own: the handler may run while the monitor
    holds the news event's lock (:mod:`elasticd.agent.signals`). From the main thread."""
    return SignalRelay({job_rules.PEER_FAILED_SIGNAL: node.peer_failed})


def _hook(handler: Any) -> None:
    """After :func:`elasticd.agent.torchrun.attach`: a gone member is reported to the agent's
    monitor as a node waiting (it then calls ``_restart_workers``), not answered by a kill."""
    if not os.environ.get("ELASTICD_SOCKET") or not _node:
        return
    node = _node[0]

    def broken(dead: list[str]) -> None:
        log.warning("member(s) %s of this round are gone: re-forming in-process",
                    ", ".join(dead))
        node.broken_at = node.clock.wall()
        node.broken = True

    inner = handler.num_nodes_waiting

    def num_nodes_waiting() -> int:
        n = inner()
        rounds = getattr(handler, "rounds", None)
        if not node.broken and rounds and job_rules.all_left(
                node.local_world, rounds[-1][0], node.link.left_rounds()):
            log.warning("every local worker left round %d (its group broke): re-forming "
                        "in-process", rounds[-1][0])
            node.broken_at = node.clock.wall()
            node.broken = True
        return max(n, 1) if node.broken else n

    handler.on_round_broken = broken
    handler.num_nodes_waiting = num_nodes_waiting
    handler.on_change(node.news.set)  # a member's death confirmed: the monitor looks at once


def reform_deadline(environ: Any = None) -> float:
    """The job's ``reform_deadline`` (seconds after the round closes), from the environment
    its daemon gave this agent; the default when absent (a daemon before the field) or bad
    (the spec was checked where it was written and read: it cannot be, but never crash)."""
    text = (os.environ if environ is None else environ).get(REFORM_DEADLINE_ENV, "")
    try:
        value = float(text)
    except ValueError:
        return DEFAULT_REFORM_DEADLINE
    return value if 0 < value <= MAX_REFORM_DEADLINE else DEFAULT_REFORM_DEADLINE


class InProcessAgent(LocalElasticAgent):
    """torch's agent, with ``_restart_workers`` re-forming live workers in-process."""

    def _invoke_run(self, role: str = "default") -> Any:
        # torch's monitor loop sleeps ``monitor_interval`` before each look; here the look
        # waits on the node's news instead (_monitor_workers), bounded by that interval.
        spec = self._worker_group.spec
        _node[0].poll, spec.monitor_interval = spec.monitor_interval, 0.0
        return super()._invoke_run(role)

    def _monitor_workers(self, wg: Any) -> Any:
        _node[0].pause()
        return super()._monitor_workers(wg)

    def _round(self, wg: Any) -> int:
        rounds = getattr(wg.spec.rdzv_handler, "rounds", None)
        return rounds[-1][0] if rounds else 0

    #: Where this node's workers were before the last rendezvous moved them
    #: (:data:`PREVIOUS_ENV`'s value; None before their first round).
    _was: str | None = None

    def _rendezvous(self, wg: Any) -> None:
        # The places the round is about to replace: workers restarted into it (a fallback)
        # offer their old ranks' snapshots, which this node's RAM holds (_start_workers).
        self._was = places_env(wg.workers)
        super()._rendezvous(wg)

    _staged_once = False  # the node's first workers were started (staged or not)

    def _initialize_workers(self, wg: Any) -> None:
        """The node's first workers are staged (the module doc): started before the round,
        joined once ready, assigned their places after it. Later calls (torch's restart of
        this node's workers) start fresh workers after the round, as torch does."""
        if self._staged_once:
            return super()._initialize_workers(wg)
        self._staged_once = True
        node, n = _node[0], wg.spec.local_world_size
        t0 = node.clock.monotonic()
        self._stage(wg, node, n)
        self._rendezvous(wg)
        why = self._wait_staged(node, n, node.clock.monotonic() + STAGE_WAIT)
        if why:
            log.warning("staged workers not taken into round %d (%s): starting fresh ones",
                        self._round(wg), why)
            self._start_fresh(wg)
            return
        ids = self._pcontext.pids()
        for w in wg.workers:
            w.id = ids[w.local_rank]
            node.link.send(w.local_rank, {"op": "assign", "env": self._env_for(wg, w),
                                          "times": {}})
        log.info("staged workers %s assigned round %d, %.3f s after they started",
                 sorted(ids.values()), self._round(wg), node.clock.monotonic() - t0)
        wg.state = WorkerState.HEALTHY

    def _start_fresh(self, wg: Any) -> None:
        self._stop_workers(wg)
        wg.state = WorkerState.STOPPED
        for local, wid in self._start_workers(wg).items():
            wg.workers[local].id = wid
        wg.state = WorkerState.HEALTHY

    def _stage(self, wg: Any, node: _Node, n: int) -> None:
        """Starts the node's workers before its first round and waits up to
        :data:`STAGE_WAIT` for each to link (its script reached the function)."""
        node.local_world = n
        os.environ.update({STAGED_ENV: "1", ROUND_ENV: "-1"})
        os.environ.pop(PREVIOUS_ENV, None)  # a newcomer's workers offer no old place
        # torch's start asserts a store (none is used) and puts the group's place in the
        # environment as is (None before a round): placeholders until the round gives them,
        # integers where the worker's daemon client parses them (-1, as torch's workers').
        before = wg.store, wg.master_addr, wg.group_rank, wg.group_world_size
        wg.store, wg.master_addr = wg.store or _NO_STORE, wg.master_addr or ""
        wg.group_rank = -1 if wg.group_rank is None else wg.group_rank
        wg.group_world_size = -1 if wg.group_world_size is None else wg.group_world_size
        try:
            LocalElasticAgent._start_workers(self, wg)
        finally:
            wg.store, wg.master_addr, wg.group_rank, wg.group_world_size = before
            os.environ.pop(STAGED_ENV, None)  # later starts (a restart) are not staged
        t0 = node.clock.monotonic()
        why = self._wait_staged(node, n, t0 + STAGE_WAIT)
        log.info("staged %d workers %s %s after %.3f s: joining the round", n,
                 sorted(self._pcontext.pids().values()), why or "ready",
                 node.clock.monotonic() - t0)

    def _wait_staged(self, node: _Node, n: int, deadline: float) -> str:
        """Waits until every staged worker linked; returns why not ("" when all did)."""
        while len(node.link.linked() & set(range(n))) < n:
            if not self._all_alive():
                return "a staged worker exited before it reached @elasticd.in_process"
            if node.clock.monotonic() >= deadline:
                return f"not all reached @elasticd.in_process within {STAGE_WAIT:g} s"
            node.link.wait(0.05)
        return ""

    def _start_workers(self, wg: Any) -> dict[int, Any]:
        # Fresh workers learn their round from the environment torchrun copies from ours, and
        # when they replace this node's workers of the round before, where those were.
        os.environ[ROUND_ENV] = str(self._round(wg))
        if self._was is None:
            os.environ.pop(PREVIOUS_ENV, None)
        else:
            os.environ[PREVIOUS_ENV] = self._was
        _node[0].local_world = wg.spec.local_world_size
        return super()._start_workers(wg)

    def _env_for(self, wg: Any, w: Any) -> dict[str, str]:
        """What ``LocalElasticAgent._start_workers`` gives a fresh worker of ``w``'s local
        rank in this round (the variables that change between rounds)."""
        spec = wg.spec
        return {
            "RANK": str(w.global_rank), "GROUP_RANK": str(wg.group_rank),
            "ROLE_RANK": str(w.role_rank), "ROLE_NAME": spec.role,
            "LOCAL_WORLD_SIZE": str(spec.local_world_size), "WORLD_SIZE": str(w.world_size),
            "GROUP_WORLD_SIZE": str(wg.group_world_size),
            "ROLE_WORLD_SIZE": str(w.role_world_size), "MASTER_ADDR": wg.master_addr,
            "MASTER_PORT": str(wg.master_port),
            "TORCHELASTIC_RESTART_COUNT": str(spec.max_restarts - self._remaining_restarts),
            "LOCAL_RANK": str(w.local_rank), ROUND_ENV: str(self._round(wg)),
        }

    def _all_alive(self) -> bool:
        handlers = getattr(self._pcontext, "subprocess_handlers", None)
        return bool(handlers) and all(h.proc.poll() is None for h in handlers.values())

    def _restart_workers(self, wg: Any) -> None:
        node = _node[0]
        node.reforming = True
        try:
            self._reform(wg, node)
        finally:
            node.reforming, node.reformed_at = False, node.clock.monotonic()

    def _reform(self, wg: Any, node: _Node) -> None:
        tell_daemon = functools.partial(torchrun.tell_daemon, os.environ.get("ELASTICD_SOCKET", ""))
        n = wg.spec.local_world_size
        why = job_rules.can_reform(n, self._all_alive(), node.link.linked())
        if why:
            log.warning("not re-forming in-process: %s; restarting this node's workers", why)
            node.broken = False
            super()._restart_workers(wg)
            tell_daemon("reformed", path="restart", why=why)
            return
        clock = node.clock
        t0 = clock.monotonic()
        # The in-process path's moments, wall time, sent with each assignment (the worker
        # adds its own: :attr:`elasticd.worker.in_process.Round.times`).
        times = {"learned": node.broken_at if node.broken_at is not None else clock.wall(),
                 "reform_started": clock.wall()}
        old_round = self._round(wg)
        node.broken = False
        node.link.forget_left(keep_round=old_round)
        node.link.broadcast({"op": "abort", "round": old_round}, n)
        tell_daemon("workers_aborted", workers=n, gone=[])
        self._rendezvous(wg)
        t_round = clock.monotonic()
        times["round_closed"] = clock.wall()  # and torch's rank assignment done
        # next_rendezvous's moments: called, the join gate passed, the join record written,
        # returned (where the round's time went; the daemon's timeline keeps none of them).
        moments = getattr(wg.spec.rdzv_handler, "moments", None)
        for name, key in (("called", "rendezvous_called"), ("gated", "join_gate_passed"),
                          ("joined", "join_written"), ("returned", "rendezvous_returned")):
            at = moments.get(name) if isinstance(moments, dict) else None
            if isinstance(at, float) and at:
                times[key] = times["round_closed"] - (t_round - at)
        allowed, what = job_rules.reform_wait(reform_deadline(),
                                              node.link.collective_timeout(n))
        deadline = t_round + allowed
        while True:
            verdict, why = job_rules.reform_step(n, old_round, node.link.left_rounds(),
                                                 self._all_alive(), clock.monotonic(),
                                                 deadline)
            if verdict is not Reform.WAIT:
                break
            node.link.wait(0.05)
        if verdict is Reform.RESTART:
            log.warning("falling back to a restart into round %d (%s): %s", self._round(wg),
                        what, why)
            self._start_fresh(wg)
            tell_daemon("reformed", path="restart", why=why)
            return
        pids = self._pcontext.pids()
        times["all_left"] = clock.wall()
        for w in wg.workers:
            w.id = pids[w.local_rank]
            node.link.send(w.local_rank, {"op": "assign", "env": self._env_for(wg, w),
                                          "times": times})
        wg.state = WorkerState.HEALTHY
        took = clock.monotonic() - t0
        log.warning("re-formed in-process, round %d -> %d: round %.3f s, all %d left and "
                    "assigned %.3f s after the start; workers %s kept", old_round,
                    self._round(wg), t_round - t0, n, took, sorted(pids.values()))
        tell_daemon("reformed", path="in_process", seconds=round(took, 4), times=times)
