"""torchrun as an elasticd daemon starts it: the agent plus a node's duties under a daemon.

``python -m elasticd.agent.torchrun ARGS`` runs ``python -m torch.distributed.run ARGS`` after
adding, to every ``etcd-v3`` rendezvous handler the agent creates
(:mod:`elasticd.coordination.rendezvous`), what a node's agent owes its daemon:

* **Restart into a new round.** When a member of this node's round is gone (its lease expired),
  kill this node's workers so that torch restarts them into a new round at once, as the
  daemon's proactive abort does, instead of waiting for a collective to time out.
* **Fencing for a silent daemon.** When the node's record is gone from etcd and the daemon does
  not answer locally, kill the workers, revoke the agent's rendezvous lease and exit: a frozen
  daemon cannot fence for itself (:mod:`.daemon_watch`). The same rule is checked before the
  agent joins a round (the join gate), so a node about to fence does not enter a new round.
* **In-process mode.** For a job that asks for it, the agent keeps its live workers through a
  round instead of the restart above (:mod:`.in_process_agent`).
* **Its daemon, named.** Each join record names the daemon's node and lease, so that the
  daemons' ``failed`` record of that lease drops this member from the round at once
  (:mod:`elasticd.rendezvous.failures`).
* **Commit gate.** Under the ``interval:MIN`` grow policy, tell the handler whether the job is
  at a committed step (:mod:`.commit_watch`): a newcomer enters only then.

The rendezvous plugin knows nothing of daemons (the coordination layer imports no agent code);
plain torchrun runs it without any of this.
"""

from __future__ import annotations

import atexit
import functools
import logging
import os
import runpy
import sys
import threading
from typing import TYPE_CHECKING

from elasticd.agent.commit_watch import CommitWatch
from elasticd.agent.daemon_watch import DaemonWatch, fence_agent, ping_daemon
from elasticd.agent.supervisor import IN_PROCESS_ENV, TAG_ENV, children, kill_workers
from elasticd.agent.zygote import ZYGOTE_ENV, ZYGOTE_PID_ENV, exit_status, wait_ready
from elasticd.coordination import rendezvous
from elasticd.coordination.keys import Keyspace

if TYPE_CHECKING:
    from elasticd.rendezvous.handler import EtcdNativeRendezvousHandler

log = logging.getLogger(__name__)

#: How long a node's first join waits for its zygote's preload (seconds).
ZYGOTE_WAIT = 60.0
#: How long a ping of the daemon waits for its answer (seconds): a live daemon answers in about
#: a millisecond, ~14 ms while it records a failure. Half the watch's ``silent_for`` (1 s), so
#: that the join gate need not ping a daemon that answered the pinger within the last 0.5 s
#: (:meth:`.DaemonWatch.settle`); a ping that times out is followed by the next within
#: ``interval``, and the daemon is silent only after ``silent_for`` without any answer.
PING_TIMEOUT = 0.5


def restart_own_workers(dead: list[str], sock: str = "") -> None:
    """A member of this agent's round is gone: kill this agent's workers (its children), and
    tell the daemon at ``sock`` when (the abort is a moment of the recovery's timeline)."""
    pids = children(os.getpid())
    log.warning("member(s) %s of this round are gone: restarting this node's workers %s",
                ", ".join(dead), pids)
    kill_workers(pids)
    if pids:
        tell_daemon(sock, "workers_aborted", workers=len(pids), gone=dead[:16])


def tell_daemon(sock: str, op: str, **fields: object) -> None:
    """A one-way note to the node's daemon at ``sock`` (it may be the one that is gone)."""
    if not sock:
        return
    from elasticd.worker.client import DaemonClient, WorkerIdentity

    client = DaemonClient(sock, WorkerIdentity(), timeout=1.0)
    try:
        client.send(op, **fields)
    finally:
        client.close()


def attach(handler: EtcdNativeRendezvousHandler) -> None:
    """Gives a rendezvous handler this node's duties, when a daemon runs the agent (it sets
    ``ELASTICD_NODE``, ``ELASTICD_SOCKET`` and ``ELASTICD_TAG``)."""
    node, sock, tag = (os.environ.get(k) for k in ("ELASTICD_NODE", "ELASTICD_SOCKET", TAG_ENV))
    if not (node and sock and tag):
        return
    handler.on_round_broken = functools.partial(restart_own_workers, sock=sock)
    prefix = os.environ.get("ELASTICD_PREFIX", "/elasticd")
    watch = DaemonWatch(handler.coordinator, Keyspace(prefix).node(node),
                        ping=ping_daemon(sock, timeout=PING_TIMEOUT),
                        fence=fence_agent(tag, handler.stop), ping_timeout=PING_TIMEOUT)
    zygote = os.environ.get(ZYGOTE_ENV, "")
    warm = [not zygote]

    def join_gate() -> object:
        # The first join waits for this node's zygote (warm worker starts): joining earlier
        # would stop every other node's workers while it imports torch.
        if not warm[0]:
            pid = os.environ.get(ZYGOTE_PID_ENV, "")
            why = wait_ready(zygote, int(pid) if pid.isdigit() else None, ZYGOTE_WAIT)
            if why:
                log.warning("joining the round without a warm zygote: %s", why)
            warm[0] = True
        # Silent daemon: settle before joining, for up to a lease TTL and a second (its record
        # is gone by then if it is frozen, and the rule holds).
        return watch.settle(handler.settings.liveness_ttl + 1.0)

    def daemon_of() -> tuple[str, int] | None:
        # The lease the daemon's record is bound to: the one its peers record ``failed`` when
        # it expires. As the watch on that record last saw it: the join's write compares it
        # with the record's own (daemon_key) and reads it only when they differ. Read here
        # when the watch has not seen it (this agent may read that key).
        lease = watch.lease_seen()
        if lease is None:
            kv = handler.coordinator.get(watch.node_key)
            lease = kv.lease if kv is not None else 0
        return (node, lease) if lease else None

    handler.join_gate = join_gate
    handler.daemon_of = daemon_of
    handler.daemon_key = watch.node_key
    watch.start()
    if handler.settings.grow_interval is not None:  # interval:MIN
        # Lazy: it watches etcd only while the handler asks it (a newcomer waiting).
        handler.commit_gate = CommitWatch(handler.coordinator, Keyspace(prefix),
                                          handler.get_run_id())
    log.info("watching daemon of node %s (record %s, socket %s)", node,
             watch.node_key.decode(errors="replace"), sock)


def report_failed_workers(agent_cls: type, sock: str) -> None:
    """Makes ``agent_cls``'s monitor tell the daemon at ``sock`` when it finds a worker failed
    (``group_broke``: a peer's death resets the collectives, and the worker dies of it; its
    daemon then probes the job's peers, :mod:`elasticd.daemon.peer_probe`), whatever the
    training script; once per failure seen, before torch restarts the workers."""
    from torch.distributed.elastic.agent.server.api import WorkerState

    inner = agent_cls._monitor_workers  # type: ignore[attr-defined]

    def monitor(self: object, wg: object) -> object:
        result = inner(self, wg)
        if getattr(result, "state", None) is WorkerState.FAILED:
            tell_daemon(sock, "group_broke", why="the agent found a worker failed")
        return result

    agent_cls._monitor_workers = monitor  # type: ignore[attr-defined]


def main() -> None:
    rendezvous.on_handler_created.append(attach)
    if os.environ.get(IN_PROCESS_ENV) == "1":  # the daemon runs an in-process job
        from elasticd.agent import in_process_agent

        in_process_agent.install()  # after attach: its hook replaces the kill on a gone member
    elif os.environ.get("ELASTICD_SOCKET"):
        # The restart path: a worker that died of a peer's death tells the daemon through its
        # agent (the in-process path's workers all run the wrapper, which tells it itself).
        from torch.distributed.elastic.agent.server.local_elastic_agent import (
            LocalElasticAgent)

        report_failed_workers(LocalElasticAgent, os.environ["ELASTICD_SOCKET"])
    try:
        runpy.run_module("torch.distributed.run", run_name="__main__", alter_sys=True)
    except SystemExit as exc:
        leave(exc.code)
    leave(0)


def leave(code: object) -> None:
    """Exits as the interpreter would after ``sys.exit(code)``, without its finalization.

    With torch loaded, tearing the interpreter down takes 0.7-1.5 s after the last ``atexit``
    handler on these machines (module and C++ teardown, no Python frame), and a daemon waits
    for its agent's exit at the end of every job and every stop. What the exit owes anyone is
    done first, in the interpreter's order: non-daemon threads joined (with the executors'
    exit hooks), ``atexit`` handlers (logging's flush among them), the standard streams
    flushed. A failure other than ``SystemExit`` still takes the interpreter's own way out.
    """
    status = exit_status(code)
    shutdown = getattr(threading, "_shutdown", None)  # what Py_FinalizeEx calls first
    if shutdown is not None:
        shutdown()
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # closed or broken: nothing more to give it
            pass
    os._exit(status)


if __name__ == "__main__":
    main()
