"""The ``--rdzv-endpoint`` and ``--rdzv-conf`` settings of the etcd-v3 rendezvous, parsed once.

torchrun hands every ``--rdzv-conf key=value`` to the handler creator as strings in
``RendezvousParameters.config``. :class:`RendezvousConfig` reads the keys this backend adds to
torch's own, validates them and quotes any bad value:

=====================  ==========================================================  ==========
key                    meaning                                                     default
=====================  ==========================================================  ==========
key_prefix             cluster key prefix in etcd                                  /elasticd
etcd_timeout           seconds one etcd request may take                           2
etcd_grace_period      seconds each call retries while etcd is unreachable         30
max_clock_skew         seconds the nodes' wall clocks may differ                   2
read_timeout           seconds the store's get/wait block (as torch's c10d)         60
ca_cert, cert, key     TLS: CA bundle; client certificate and its key              none
user, password         etcd authentication (password also from the environment     none
                       variable ``ELASTICD_ETCD_PASSWORD``, which ``ps`` won't show)
standby_fix            move wait-listed nodes of a full round to the redundancy    true
                       list (:mod:`.rendezvous_standby`)
lease_liveness         drop a node from the rendezvous once its alive key, bound   true
                       to its agent's etcd lease, is gone (:mod:`.rendezvous_liveness`)
liveness_ttl           that lease's TTL, whole seconds (at least 2)                3
liveness_confirm       seconds an alive key must stay absent before its node is    1
                       dropped
poll_interval          seconds between state reads while a rendezvous waits for    1
                       other nodes (torch's poll; :mod:`.rendezvous_poll`)
close_last_call        end a re-rendezvous' ``last_call_timeout`` at once when     true
                       every live agent (alive key) has joined (needs
                       ``lease_liveness``)
close_on_failure       close the rendezvous when this agent ends with an error     true
                       (torch's behaviour: every other agent then ends too);
                       elasticd's daemons set false, since they restart agents
=====================  ==========================================================  ==========

torch's own keys (``join_timeout``, ``last_call_timeout``, ``keep_alive_interval``, ...) are
read by torch; :mod:`elasticd.coordination.rendezvous` may fill in the keep-alive ones.
"""

from __future__ import annotations

import dataclasses
import datetime
import os

from torch.distributed.elastic.rendezvous.api import RendezvousParameters

from elasticd.coordination.etcd import EtcdSettings, parse_endpoints
from elasticd.coordination.keys import check_name, check_prefix
from elasticd.coordination.rendezvous_grace import DEFAULT_GRACE_PERIOD
from elasticd.coordination.rendezvous_liveness import (
    DEFAULT_LIVENESS_CONFIRM,
    DEFAULT_LIVENESS_TTL,
    MIN_LIVENESS_TTL,
)

PASSWORD_ENV = "ELASTICD_ETCD_PASSWORD"
DEFAULT_ETCD_TIMEOUT = 2.0
DEFAULT_CLOCK_SKEW = 2.0
DEFAULT_READ_TIMEOUT = 60
#: Below this, waiting agents would read the whole rendezvous state from etcd in a busy loop.
MIN_POLL_INTERVAL = 0.05


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
class RendezvousConfig:
    """Validated settings of one etcd-v3 rendezvous.

    Attributes:
        run_id: the rendezvous id (``--rdzv-id``); it names the job in the keyspace.
        etcd: how to reach and authenticate to etcd.
        key_prefix: cluster key prefix.
        grace_period: seconds each backend/store call rides out an etcd outage.
        max_clock_skew: seconds the nodes' clocks may disagree.
        store_timeout: how long the store's ``get``/``wait`` block.
        standby_fix: whether to apply :class:`.rendezvous_standby.ParkWaitingNodesWhenFull`.
        lease_liveness: whether to drop nodes whose alive key is gone
            (:mod:`.rendezvous_liveness`).
        liveness_ttl: TTL of the alive key's lease, whole seconds.
        liveness_confirm: seconds an alive key must stay absent before its node is dropped.
        poll_interval: seconds between state reads while a rendezvous waits.
        close_last_call: end a re-rendezvous' last call once every live agent joined.
        close_on_failure: close the rendezvous when the agent ends with an error.
    """

    run_id: str
    etcd: EtcdSettings
    key_prefix: str = "/elasticd"
    grace_period: float = DEFAULT_GRACE_PERIOD
    max_clock_skew: float = DEFAULT_CLOCK_SKEW
    store_timeout: datetime.timedelta = datetime.timedelta(seconds=DEFAULT_READ_TIMEOUT)
    standby_fix: bool = True
    lease_liveness: bool = True
    liveness_ttl: int = DEFAULT_LIVENESS_TTL
    liveness_confirm: float = DEFAULT_LIVENESS_CONFIRM
    poll_interval: float = 1.0
    close_last_call: bool = True
    close_on_failure: bool = True

    @classmethod
    def from_params(cls, params: RendezvousParameters) -> "RendezvousConfig":
        """Parses torchrun's rendezvous parameters.

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
        standby_fix = params.get_as_bool("standby_fix", True)
        try:
            lease_liveness = params.get_as_bool("lease_liveness", True)
        except ValueError as exc:
            raise ValueError(f"rdzv-conf lease_liveness={params.get('lease_liveness')!r} is not "
                             "a boolean (true/false)") from exc
        try:
            close_last_call = params.get_as_bool("close_last_call", True)
        except ValueError as exc:
            raise ValueError(f"rdzv-conf close_last_call={params.get('close_last_call')!r} is "
                             "not a boolean (true/false)") from exc
        try:
            close_on_failure = params.get_as_bool("close_on_failure", True)
        except ValueError as exc:
            raise ValueError(f"rdzv-conf close_on_failure={params.get('close_on_failure')!r} "
                             "is not a boolean (true/false)") from exc
        raw_ttl = params.get("liveness_ttl")
        try:
            liveness_ttl = DEFAULT_LIVENESS_TTL if raw_ttl in (None, "") else int(raw_ttl)
        except (TypeError, ValueError):
            liveness_ttl = 0
        if liveness_ttl < MIN_LIVENESS_TTL:
            raise ValueError(f"rdzv-conf liveness_ttl={raw_ttl!r} must be a whole number of "
                             f"seconds, at least {MIN_LIVENESS_TTL} (etcd's minimum lease TTL)")
        poll_interval = _seconds(params, "poll_interval", 1.0, allow_zero=False)
        if not MIN_POLL_INTERVAL <= poll_interval <= 1.0:
            raise ValueError(f"rdzv-conf poll_interval={params.get('poll_interval')!r} must be "
                             f"between {MIN_POLL_INTERVAL} and 1 second (torch's own poll)")
        return cls(
            run_id=params.run_id,
            etcd=EtcdSettings(
                endpoints=endpoints,
                timeout=_seconds(params, "etcd_timeout", DEFAULT_ETCD_TIMEOUT, allow_zero=False),
                user=user, password=password, ca_cert=ca_cert, cert=cert, key=key,
            ),
            key_prefix=check_prefix(params.get("key_prefix", "/elasticd")),
            grace_period=_seconds(params, "etcd_grace_period", DEFAULT_GRACE_PERIOD),
            max_clock_skew=_seconds(params, "max_clock_skew", DEFAULT_CLOCK_SKEW),
            store_timeout=datetime.timedelta(seconds=read_timeout),
            standby_fix=bool(standby_fix),
            lease_liveness=bool(lease_liveness),
            liveness_ttl=liveness_ttl,
            liveness_confirm=_seconds(params, "liveness_confirm", DEFAULT_LIVENESS_CONFIRM),
            poll_interval=poll_interval,
            close_last_call=bool(close_last_call),
            close_on_failure=bool(close_on_failure),
        )
