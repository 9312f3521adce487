"""The ``--rdzv-endpoint`` and ``--rdzv-conf`` settings of the etcd-v3 rendezvous, parsed once.

torchrun hands every ``--rdzv-conf key=value`` to the handler creator as strings in
``RendezvousParameters.config``. :class:`RendezvousConfig` reads the keys elasticd's rendezvous
handler (:mod:`.handler`) understands, validates them and quotes any bad value:

=====================  ==========================================================  ==========
key                    meaning                                                     default
=====================  ==========================================================  ==========
key_prefix             cluster key prefix in etcd                                  /elasticd
etcd_timeout           seconds one etcd request may take                           2
etcd_grace_period      seconds each call retries while etcd is unreachable         30
read_timeout           seconds the store's get/wait block (as torch's c10d)         60
ca_cert, cert, key     TLS: CA bundle; client certificate and its key              none
user, password         etcd authentication (password also from the environment     none
                       variable ``ELASTICD_ETCD_PASSWORD``, which ``ps`` won't show)
liveness_ttl           TTL of the agent's etcd lease, whole seconds (at least 2):  3
                       a node's join record lives as long as that lease
liveness_confirm       seconds a round member's record must stay absent before     1
                       it counts as gone (at once when its daemon's lease is
                       recorded ``failed``: :mod:`.failures`)
join_timeout           seconds ``next_rendezvous`` waits to be admitted (torch's)  600
last_call_timeout      seconds a job's first round stays open after ``min`` nodes  30
                       joined, for late starters (torch's)
grow                   when a node that returns or is added enters a running       immediate
                       round: ``immediate`` (everybody stops once for it),
                       ``at-failure`` (it waits as a spare until the next round
                       that forms anyway, e.g. after a failure) or
                       ``interval:MIN`` (as at-failure, and at most once every
                       MIN minutes, at a committed step, it enters at once)
close_on_failure       close the rendezvous when this agent ends with an error     true
                       (torch's behaviour: every other agent then ends too);
                       elasticd's daemons set false, since they restart agents
=====================  ==========================================================  ==========

The keys of torch's dynamic rendezvous and of the fixes elasticd once applied to it
(:data:`IGNORED_KEYS`) are accepted and ignored, so that an older command line still runs.
"""

from __future__ import annotations

import dataclasses
import datetime
import os

from torch.distributed.elastic.rendezvous.api import RendezvousParameters

from elasticd.coordination.agent_credentials import PASSWORD_ENV
from elasticd.coordination.etcd import EtcdSettings, parse_endpoints
from elasticd.coordination.keys import check_name, check_prefix
from elasticd.rendezvous.grace import DEFAULT_GRACE_PERIOD
from elasticd.rendezvous.rounds import check_grow, grow_interval

DEFAULT_ETCD_TIMEOUT = 2.0
DEFAULT_READ_TIMEOUT = 60
#: The agent lease's TTL (rdzv-conf ``liveness_ttl``), and etcd's minimum.
DEFAULT_LIVENESS_TTL = 3
MIN_LIVENESS_TTL = 2
DEFAULT_LIVENESS_CONFIRM = 1.0
#: torch's defaults for the same rdzv-conf keys (dynamic_rendezvous.RendezvousTimeout).
DEFAULT_JOIN_TIMEOUT = 600.0
DEFAULT_LAST_CALL_TIMEOUT = 30.0
#: Keys of torch's dynamic rendezvous (heartbeats in a shared state) and of elasticd's former
#: fixes to it; the lease-based handler has no use for them.
IGNORED_KEYS = ("keep_alive_interval", "keep_alive_max_attempt", "close_timeout",
                "heartbeat", "max_clock_skew", "standby_fix", "lease_liveness",
                "close_last_call", "poll_interval")


def _seconds(params: RendezvousParameters, key: str, default: float,
             allow_zero: bool = True) -> float:
    raw = params.get(key)
    if raw is None or raw == "":
        return default
    try:
        value = float(raw)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"rdzv-conf {key}={raw!r} is not a number of seconds") from exc
    if not (value > 0 or (value == 0 and allow_zero)):  # also refuses NaN
        kind = "non-negative" if allow_zero else "positive"
        raise ValueError(f"rdzv-conf {key}={raw!r} must be a {kind} number of seconds")
    return value


@dataclasses.dataclass(frozen=True)
class HandlerSettings:
    """What one agent's rendezvous handler is told: its run, sizes and rules.

    Attributes:
        run_id: ``--rdzv-id``.
        min_nodes, max_nodes: ``--nnodes MIN:MAX``.
        backend: what ``get_backend`` returns (the entry point's name).
        liveness_ttl, liveness_confirm, join_timeout, grow, close_on_failure: the rdzv-conf
            keys of those names (the module docstring's table); last_call and store_timeout:
            its ``last_call_timeout`` and ``read_timeout`` (None: the store's default).
    """

    run_id: str
    min_nodes: int
    max_nodes: int
    backend: str = "etcd-v3"
    liveness_ttl: int = DEFAULT_LIVENESS_TTL
    liveness_confirm: float = DEFAULT_LIVENESS_CONFIRM
    join_timeout: float = DEFAULT_JOIN_TIMEOUT
    last_call: float = DEFAULT_LAST_CALL_TIMEOUT
    store_timeout: datetime.timedelta | None = None
    grow: str = "immediate"
    close_on_failure: bool = True

    def __post_init__(self) -> None:
        if not 1 <= self.min_nodes <= self.max_nodes:
            raise ValueError(f"--nnodes {self.min_nodes}:{self.max_nodes}: need 1 <= MIN <= MAX")
        check_grow(self.grow)

    @property
    def grow_interval(self) -> float | None:
        """Seconds of an ``interval:MIN`` grow policy; None for the others."""
        return grow_interval(self.grow)


@dataclasses.dataclass(frozen=True)
class RendezvousConfig:
    """Validated settings of one etcd-v3 rendezvous (``ignored``: the :data:`IGNORED_KEYS`
    that were given)."""

    etcd: EtcdSettings
    handler: HandlerSettings
    key_prefix: str = "/elasticd"
    grace_period: float = DEFAULT_GRACE_PERIOD
    ignored: tuple[str, ...] = ()

    @classmethod
    def from_params(cls, params: RendezvousParameters,
                    backend: str | None = None) -> "RendezvousConfig":
        """Parses torchrun's rendezvous parameters (``backend``: the entry point's name, by
        default ``params.backend``).

        Raises:
            ValueError: a missing endpoint or a bad value, quoted.
        """
        if not params.endpoint:
            raise ValueError(
                "the etcd-v3 rendezvous needs --rdzv-endpoint HOST:PORT[,HOST:PORT...] "
                "(the etcd client URLs)"
            )
        try:
            endpoints = parse_endpoints(params.endpoint)
        except ValueError as exc:
            raise ValueError(f"--rdzv-endpoint {params.endpoint!r}: {exc}") from exc
        check_name("--rdzv-id", params.run_id)

        ca_cert, cert, key = params.get("ca_cert"), params.get("cert"), params.get("key")
        if (cert is None) != (key is None):
            raise ValueError("rdzv-conf cert and key go together: give both or neither")
        if cert is not None and ca_cert is None:
            raise ValueError("rdzv-conf cert/key need ca_cert too (TLS client authentication)")
        for name, path in (("ca_cert", ca_cert), ("cert", cert), ("key", key)):
            if path is not None and not os.path.isfile(path):
                raise ValueError(f"rdzv-conf {name}={path!r}: no such file")
        user = params.get("user") or None
        password = params.get("password") or os.environ.get(PASSWORD_ENV) or None
        if (user is None) != (password is None):
            raise ValueError(
                f"etcd authentication needs both rdzv-conf user and a password (rdzv-conf "
                f"password, or the environment variable {PASSWORD_ENV})"
            )

        read_timeout = params.get_as_int("read_timeout", DEFAULT_READ_TIMEOUT)
        if read_timeout is None or read_timeout <= 0:
            raise ValueError(f"rdzv-conf read_timeout={params.get('read_timeout')!r} must be "
                             "a positive integer")
        try:
            close_on_failure = params.get_as_bool("close_on_failure", True)
        except ValueError as exc:
            raise ValueError(f"rdzv-conf close_on_failure={params.get('close_on_failure')!r} "
                             "is not a boolean (true/false)") from exc
        try:
            grow = check_grow(params.get("grow") or "immediate")
        except ValueError as exc:
            raise ValueError(f"rdzv-conf {exc}") from exc
        raw_ttl = params.get("liveness_ttl")
        try:
            liveness_ttl = DEFAULT_LIVENESS_TTL if raw_ttl in (None, "") else int(raw_ttl)
        except (TypeError, ValueError):
            liveness_ttl = 0
        if liveness_ttl < MIN_LIVENESS_TTL:
            raise ValueError(f"rdzv-conf liveness_ttl={raw_ttl!r} must be a whole number of "
                             f"seconds, at least {MIN_LIVENESS_TTL} (etcd's minimum lease TTL)")
        return cls(
            etcd=EtcdSettings(
                endpoints=endpoints,
                timeout=_seconds(params, "etcd_timeout", DEFAULT_ETCD_TIMEOUT, allow_zero=False),
                user=user, password=password, ca_cert=ca_cert, cert=cert, key=key,
            ),
            handler=HandlerSettings(
                params.run_id, params.min_nodes, params.max_nodes, backend or params.backend,
                liveness_ttl=liveness_ttl,
                liveness_confirm=_seconds(params, "liveness_confirm", DEFAULT_LIVENESS_CONFIRM),
                join_timeout=_seconds(params, "join_timeout", DEFAULT_JOIN_TIMEOUT,
                                      allow_zero=False),
                last_call=_seconds(params, "last_call_timeout", DEFAULT_LAST_CALL_TIMEOUT),
                store_timeout=datetime.timedelta(seconds=read_timeout),
                grow=grow, close_on_failure=bool(close_on_failure)),
            key_prefix=check_prefix(params.get("key_prefix", "/elasticd")),
            grace_period=_seconds(params, "etcd_grace_period", DEFAULT_GRACE_PERIOD),
            ignored=tuple(k for k in IGNORED_KEYS if params.get(k) not in (None, "")),
        )
