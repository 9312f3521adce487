"""The ``etcd-v3`` torchrun rendezvous: ``torchrun --rdzv-backend=etcd-v3 --rdzv-endpoint=H:P``.

torch ships no rendezvous on the etcd v3 API (its ``etcd`` and ``etcd-v2`` backends need the v2
API, gone in etcd 3.6). This module plugs one in through the ``torchrun.handlers`` entry point:
torch calls :func:`handler_creator` with no arguments and registers the creator it returns under
the entry point's name. The creator builds an :class:`~elasticd.coordination.etcd.EtcdCoordinator`
from ``--rdzv-endpoint`` and ``--rdzv-conf`` (see :mod:`.rendezvous_config`), the state backend
(:mod:`.rendezvous_backend`) and the cross-node store (:mod:`.rendezvous_store`), and hands them
to torch's own ``dynamic_rendezvous.create_handler``: the rendezvous algorithm is torch's; only
where the state lives is ours. Both live under ``<prefix>/jobs/<run_id>/rdzv/``.

Decisions, and why (numbers from docs/facts.md):

* **Outage grace.** Every backend and store call retries on an unreachable etcd for
  ``etcd_grace_period`` seconds (default 30) before raising ``RendezvousConnectionError``,
  because torch's agent ends the job on any backend error, even from the ``num_nodes_waiting()``
  poll it runs while workers are healthy.
* **Keep-alive window.** torch drops a node whose last heartbeat (stamped with that node's wall
  clock) is older than ``keep_alive_interval * keep_alive_max_attempt`` on the observer's clock.
  After an outage of g seconds the freshest stored heartbeat can be g + one interval old, and
  clocks disagree by up to ``max_clock_skew``; a shorter window would evict healthy nodes when
  etcd comes back (and, with a standby present, restart everybody). So, unless the user set
  ``keep_alive_max_attempt``, it is ``max(3, floor((grace + skew) / interval) + 2)``: with torch's
  5 s interval and the defaults (30 s, 2 s) that is 8 attempts, a 40 s window. Never fewer
  than 3 attempts: with 2, a healthy participant's heartbeat is already ~2 s old when a round
  completes and standby nodes make the agents restart forever (measured; keep the window at
  3 s or more). A user value shorter than the outage needs is kept, with a warning. On its own,
  the long window would make recovery slow: torch notices a dead node only when its heartbeat
  expires, so after a node loss the round re-forms about one window later (40+ s measured).
* **Liveness by lease.** So dead nodes are found another way (:mod:`.rendezvous_liveness`):
  every agent binds an alive key to an etcd lease of its own (``liveness_ttl``, default 3 s)
  and the backend drops a node from the state torch sees once its key is gone, guarded against
  the mass expiry an etcd outage causes. Survivors re-form the round seconds after a kill
  instead of a window later. ``lease_liveness=false`` turns it off (then lower
  ``etcd_grace_period`` and ``keep_alive_interval`` for faster recovery, at the cost of outage
  tolerance).
* **No shared agent TCPStore.** The creator sets ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`` (unless
  already set). It is read in the agent process, where this runs. By default, restarted workers
  reuse the rank-0 agent's TCPStore across restarts and can read the gloo addresses of dead
  workers ("Gloo connectFullMesh failed"): 5 of 9 recoveries failed that way, 4 of 4 worked with
  the switch. (Reading torch's code, sharing also makes non-zero ranks keep the first round's
  store address, which points at a dead node once the rank-0 node is gone; not measured.)
* **Standby livelock.** torch 2.13 restarts forever when a node is left waiting on a full round;
  the backend hands torch a state where such nodes wait in the redundancy list instead
  (:mod:`.rendezvous_standby`; ``standby_fix=false`` turns it off).
* **No needless last call.** A re-rendezvous whose participants already include every agent
  with an alive key ends its ``last_call_timeout`` at once: after a failure the survivors are
  all there is (``close_last_call=false`` turns it off; :mod:`.rendezvous_liveness`).
* **Fencing for a silent daemon.** Under a daemon, the agent fences its own node when the
  node's record is gone from etcd and the daemon does not answer locally (a frozen daemon
  cannot fence for itself; :mod:`elasticd.agent.daemon_watch`).
* **Restartable agents.** torch closes the rendezvous for good when an agent ends, also with
  an error. elasticd's daemons pass ``close_on_failure=false``: an agent that fails leaves the
  rendezvous open, so the agent its daemon restarts (and every other node's) can join again.

Security: torch unpickles the rendezvous state read from etcd, so whoever can write
``<prefix>/jobs/*/rdzv/`` runs code in every agent. Run etcd with authentication: TLS client
certificates (``ca_cert``, ``cert``, ``key``) or etcd users (``user``, and the password in
``ELASTICD_ETCD_PASSWORD`` rather than on the command line).

This module runs in the torchrun agent, never in the daemon. It imports torch only when a handler
is created (see the note on imports below); ``EtcdV3RendezvousBackend`` and ``EtcdV3Store`` are
re-exported from here lazily.
"""

from __future__ import annotations

import logging
import math
import os
import sys
from typing import TYPE_CHECKING, Callable

if TYPE_CHECKING:
    from torch.distributed.elastic.rendezvous.api import RendezvousHandler, RendezvousParameters

    from elasticd.coordination.rendezvous_liveness import LeaseLiveness

# torch and the modules that import it are imported inside create_rdzv_handler, not here:
# importing torch's rendezvous package loads every torchrun.handlers entry point, this module
# included, so a torch import at the top would be circular whenever this module is imported
# first (torch then logs a warning and leaves etcd-v3 unregistered).

log = logging.getLogger(__name__)

__all__ = [
    "BACKEND_NAME", "EtcdV3RendezvousBackend", "EtcdV3Store", "create_rdzv_handler",
    "handler_creator", "keep_alive_settings",
]

#: Backend name: the entry point's name, and what the handler's get_backend() returns.
BACKEND_NAME = "etcd-v3"

#: torch's defaults (dynamic_rendezvous.create_handler).
TORCH_KEEP_ALIVE_INTERVAL = 5
MIN_KEEP_ALIVE_ATTEMPTS = 3


def keep_alive_settings(params: RendezvousParameters, grace_period: float,
                        max_clock_skew: float) -> tuple[int, int]:
    """Chooses torch's ``keep_alive_interval`` and ``keep_alive_max_attempt``.

    The interval is the user's or torch's default; the attempts are the user's, or the fewest
    (at least 3) whose window outlasts an outage of ``grace_period`` plus one interval plus
    ``max_clock_skew`` (see the module docstring).

    Returns:
        (interval in seconds, max attempts).

    Raises:
        ValueError: a non-positive value given by the user.
    """
    interval = params.get_as_int("keep_alive_interval", TORCH_KEEP_ALIVE_INTERVAL)
    if interval is None or interval <= 0:
        raise ValueError(f"rdzv-conf keep_alive_interval={params.get('keep_alive_interval')!r} "
                         "must be a positive integer")
    needed = grace_period + max_clock_skew
    given = params.get_as_int("keep_alive_max_attempt")
    if given is None:
        attempts = max(MIN_KEEP_ALIVE_ATTEMPTS, math.floor(needed / interval) + 2)
    elif given <= 0:
        raise ValueError(f"rdzv-conf keep_alive_max_attempt={given!r} must be positive")
    else:
        attempts = given
    window = interval * attempts
    if window <= needed + interval:
        log.warning(
            "keep-alive window %ds (keep_alive_interval=%d x keep_alive_max_attempt=%d) is not "
            "longer than etcd_grace_period (%gs) + max_clock_skew (%gs) + one interval: an etcd "
            "outage inside the grace period can make agents drop healthy nodes",
            window, interval, attempts, grace_period, max_clock_skew)
    if attempts < MIN_KEEP_ALIVE_ATTEMPTS:
        log.warning("keep_alive_max_attempt=%d: below 3, rounds with a standby node restart "
                    "forever (healthy heartbeats look expired right after a round completes)",
                    attempts)
    return interval, attempts


def _with_config(params: RendezvousParameters, **extra: object) -> RendezvousParameters:
    """A copy of ``params`` with some config keys set (torch reads them as strings)."""
    from torch.distributed.elastic.rendezvous.api import RendezvousParameters

    config = dict(params.config)
    config.update({k: str(v) for k, v in extra.items()})
    return RendezvousParameters(
        backend=params.backend, endpoint=params.endpoint, run_id=params.run_id,
        min_nodes=params.min_nodes, max_nodes=params.max_nodes, local_addr=params.local_addr,
        **config,
    )


def create_rdzv_handler(params: RendezvousParameters) -> RendezvousHandler:
    """Builds torch's dynamic rendezvous handler on etcd v3.

    Raises:
        ValueError: bad endpoint or ``--rdzv-conf`` values (quoted).
    """
    from torch.distributed.elastic.rendezvous.dynamic_rendezvous import create_handler

    from elasticd.coordination.etcd import EtcdCoordinator
    from elasticd.coordination.keys import Keyspace
    from elasticd.coordination.rendezvous_backend import EtcdV3RendezvousBackend
    from elasticd.coordination.rendezvous_config import RendezvousConfig
    from elasticd.coordination.rendezvous_grace import OutageGrace
    from elasticd.coordination.rendezvous_liveness import LeaseLiveness
    from elasticd.coordination.rendezvous_poll import set_poll_interval
    from elasticd.coordination.rendezvous_standby import ParkWaitingNodesWhenFull
    from elasticd.coordination.rendezvous_store import EtcdV3Store

    # Read by the agent (this process) whenever it starts workers; see the module docstring.
    os.environ.setdefault("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")
    cfg = RendezvousConfig.from_params(params)
    interval, attempts = keep_alive_settings(params, cfg.grace_period, cfg.max_clock_skew)

    coordinator = EtcdCoordinator(cfg.etcd)
    grace = OutageGrace(cfg.grace_period, where=cfg.etcd.describe())
    keyspace = Keyspace(cfg.key_prefix)
    state_filter = ParkWaitingNodesWhenFull(params.max_nodes) if cfg.standby_fix else None
    liveness = None
    if cfg.lease_liveness:
        liveness = LeaseLiveness(coordinator, keyspace.job_rdzv(cfg.run_id) + b"alive/",
                                 ttl=cfg.liveness_ttl, confirm=cfg.liveness_confirm,
                                 grace=grace, close_last_call=cfg.close_last_call)
    backend = EtcdV3RendezvousBackend(coordinator, cfg.run_id, keyspace, grace, state_filter,
                                      liveness)
    store = EtcdV3Store(coordinator, keyspace.job_rdzv(cfg.run_id) + b"store/",
                        timeout=cfg.store_timeout, grace=grace)
    log.info("etcd-v3 rendezvous %r at %s%s: grace %gs, keep-alive %ds x %d, lease liveness %s",
             cfg.run_id, cfg.etcd.describe(), cfg.key_prefix, cfg.grace_period, interval,
             attempts, f"TTL {cfg.liveness_ttl}s" if liveness else "off", cfg.poll_interval)
    handler = create_handler(store, backend, _with_config(
        params, keep_alive_interval=interval, keep_alive_max_attempt=attempts))
    if liveness is not None and not _bind_liveness(handler, liveness):
        liveness = None
    _wrap_shutdown(handler, liveness, cfg.close_on_failure)
    set_poll_interval(handler, cfg.poll_interval)
    _watch_daemon(coordinator, keyspace, liveness)
    return handler


def _restart_own_workers(dead: list[str]) -> None:
    """A participant of this agent's complete round died after the round formed: kill this
    agent's workers (its children) so that torch restarts them into a new round, as the
    daemon's proactive abort does when a node's lease expires (see
    ``LeaseLiveness._broken_round``)."""
    from elasticd.agent.supervisor import children, kill_workers

    pids = children(os.getpid())
    log.warning("participant(s) %s of this round are dead: restarting this node's workers %s",
                ", ".join(dead), pids)
    kill_workers(pids)


def _watch_daemon(coordinator: object, keyspace: object,
                  liveness: LeaseLiveness | None) -> None:
    """Under an elasticd daemon (it sets ``ELASTICD_NODE``, ``ELASTICD_SOCKET`` and
    ``ELASTICD_TAG``), starts the watch that fences this node for a daemon that was declared
    dead and is silent (:mod:`elasticd.agent.daemon_watch`), and restarts this node's workers
    when a participant of their round dies after it formed. Plain torchrun: nothing."""
    from elasticd.agent.daemon_watch import DaemonWatch, fence_agent, ping_daemon
    from elasticd.agent.supervisor import TAG_ENV

    node, sock, tag = (os.environ.get(k) for k in ("ELASTICD_NODE", "ELASTICD_SOCKET", TAG_ENV))
    if not (node and sock and tag):
        return
    if liveness is not None:
        liveness.on_round_broken = _restart_own_workers
    revoke = (lambda: liveness.stop(revoke=True)) if liveness is not None else (lambda: None)
    watch = DaemonWatch(coordinator, keyspace.node(node),  # type: ignore[attr-defined]
                        ping=ping_daemon(sock, timeout=1.0), fence=fence_agent(tag, revoke),
                        absent_for=0.0, interval=0.25, silent_for=1.0, ping_interval=0.25)
    watch.start()
    log.info("watching daemon of node %s (record %s, socket %s)", node,
             watch.node_key.decode(errors="replace"), sock)


def _bind_liveness(handler: RendezvousHandler, liveness: LeaseLiveness) -> bool:
    """Names the alive key after the handler's node (the key is written lazily, by the
    backend's first call, so building a handler does not talk to etcd).

    Returns False when torch's handler has changed shape (liveness is then off).
    """
    try:
        liveness.bind(handler._this_node)  # type: ignore[attr-defined]
    except AttributeError as exc:
        log.warning("torch's rendezvous handler has changed shape (%s); lease liveness is off, "
                    "dead nodes leave after torch's heartbeat window", exc)
        liveness.stop(revoke=False)
        return False
    return True


def _wrap_shutdown(handler: RendezvousHandler, liveness: LeaseLiveness | None,
                   close_on_failure: bool) -> None:
    """Makes ``handler.shutdown()`` stop the liveness lease, and close the rendezvous only
    when the agent succeeded unless ``close_on_failure``.

    torchrun calls ``shutdown()`` from a ``finally`` when the agent finishes (not after a
    signal; ``atexit`` covers the other exits, kill -9 leaves the alive key to its lease's
    TTL), whether its run succeeded or raised. torch then closes the rendezvous for good: every
    agent that joins it later, under the same run id, gets ``RendezvousClosedError``. For
    plain torchrun that ends a failed job everywhere, as intended; under elasticd's daemons,
    which restart an agent that died, one agent's error (an etcd call that failed during a
    leader election, say) closed the rendezvous and every restarted agent of every node
    failed on it until the daemons gave up (CI: the etcd-leader chaos scenario). The agent is
    failing when ``shutdown()`` runs while an exception propagates: in that ``finally``,
    ``sys.exc_info()`` holds it (a success returns through the same ``finally`` with none).
    """
    shutdown = handler.shutdown

    def shutdown_unless_restartable() -> bool:
        try:
            failing = sys.exc_info()[0] is not None
            if failing and not close_on_failure:
                stop = getattr(handler, "_stop_heartbeats", None)
                if stop is not None:
                    stop()
                log.info("agent ends with an error: leaving rendezvous %r open for its restart "
                         "(close_on_failure=false)", handler.get_run_id())
                return True
            return shutdown()
        finally:
            if liveness is not None:
                liveness.stop(revoke=True)

    handler.shutdown = shutdown_unless_restartable  # type: ignore[method-assign]


def handler_creator() -> Callable[[RendezvousParameters], RendezvousHandler]:
    """The ``torchrun.handlers`` entry point: returns the creator torch registers as etcd-v3."""
    return create_rdzv_handler


_LAZY = {
    "EtcdV3RendezvousBackend": "elasticd.coordination.rendezvous_backend",
    "EtcdV3Store": "elasticd.coordination.rendezvous_store",
}


def __getattr__(name: str) -> object:
    # PEP 562: `from elasticd.coordination.rendezvous import EtcdV3Store` without importing
    # torch when this module is loaded as an entry point.
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


#: The etcd-native handler's entry point name, beside etcd-v3 until it replaces it.
NATIVE_BACKEND_NAME = "etcd-v3-native"


def native_handler_creator(name: str = NATIVE_BACKEND_NAME
                           ) -> Callable[[RendezvousParameters], RendezvousHandler]:
    """The ``torchrun.handlers`` entry point of elasticd's own handler
    (:mod:`.rendezvous_handler`: per-node keys, no pickle), registered as etcd-v3-native.

    Args:
        name: what the handler's ``get_backend()`` returns: the entry point's name.
    """

    def create(params: RendezvousParameters) -> RendezvousHandler:
        # Imported here, not at the top: see the note on imports above.
        from elasticd.coordination.rendezvous_handler import create_handler

        handler = create_handler(params, name)
        _watch_daemon_native(handler)
        return handler

    return create


def _watch_daemon_native(handler: object) -> None:
    """Under a daemon, as :func:`_watch_daemon` for torch's handler: restart this node's
    workers when a member of their round is gone, and fence the node for a silent daemon."""
    from elasticd.agent.daemon_watch import DaemonWatch, fence_agent, ping_daemon
    from elasticd.agent.supervisor import TAG_ENV
    from elasticd.coordination.keys import Keyspace

    node, sock, tag = (os.environ.get(k) for k in ("ELASTICD_NODE", "ELASTICD_SOCKET", TAG_ENV))
    if not (node and sock and tag):
        return
    handler.on_round_broken = _restart_own_workers  # type: ignore[attr-defined]
    prefix = os.environ.get("ELASTICD_PREFIX", "/elasticd")
    watch = DaemonWatch(handler._coord, Keyspace(prefix).node(node),  # type: ignore[attr-defined]
                        ping=ping_daemon(sock, timeout=1.0),
                        fence=fence_agent(tag, handler.stop),  # type: ignore[attr-defined]
                        absent_for=0.0, interval=0.25, silent_for=1.0, ping_interval=0.25)
    watch.start()
    log.info("watching daemon of node %s (record %s, socket %s)", node,
             watch.node_key.decode(errors="replace"), sock)
