"""Riding out short etcd outages inside every rendezvous call.

torch's elastic agent treats any error from its rendezvous backend as fatal: an exception in
``num_nodes_waiting()``, which the agent polls every few seconds while the workers train, ends
the agent and its workers (docs/facts.md). A backend that must not kill healthy training when etcd is
briefly unreachable therefore retries *inside* each call. :class:`OutageGrace` is that retry
loop: it repeats a call that raised :class:`~elasticd.coordination.api.Unavailable`, with
capped exponential backoff, for up to a grace period, and then raises
:class:`EtcdUnavailableError`, a ``RendezvousConnectionError`` (the error torch's own backends
raise for a lost connection). Errors that waiting cannot fix (bad credentials, a rejected
request) are raised at once.

This module imports torch (for the error type); it is only used in the torchrun agent.
"""

from __future__ import annotations

import logging
from typing import Callable, TypeVar

from torch.distributed.elastic.rendezvous.api import RendezvousConnectionError

from elasticd.clock import Clock, SystemClock
from elasticd.coordination.api import AuthError, CoordinationError, Unavailable
from elasticd.errors import ElasticdError

log = logging.getLogger(__name__)

T = TypeVar("T")

#: Default outage grace, seconds (rdzv-conf ``etcd_grace_period``).
DEFAULT_GRACE_PERIOD = 30.0
#: First and longest pause between two attempts, seconds (doubled from one to the other).
INITIAL_BACKOFF, MAX_BACKOFF = 0.05, 1.0


class EtcdUnavailableError(RendezvousConnectionError, ElasticdError):
    """etcd stayed unreachable for longer than the grace period, or refused the request."""


class OutageGrace:
    """Retries coordination calls through an etcd outage of up to ``grace_period`` seconds.

    Args:
        grace_period: how long, in seconds, one call keeps retrying while etcd is unreachable.
            0 means no retry. A call may overrun it by up to one request timeout of the
            coordinator (the attempt in flight when the grace period ends).
        where: the etcd endpoints, quoted in errors.
    """

    def __init__(self, grace_period: float = DEFAULT_GRACE_PERIOD, where: str = "etcd",
                 clock: Clock | None = None) -> None:
        if grace_period < 0:
            raise ValueError(f"grace period {grace_period!r} must be >= 0 seconds")
        self.grace_period = float(grace_period)
        self.where = where
        self.clock = clock or SystemClock()

    def call(self, fn: Callable[[], T], what: str) -> T:
        """Runs ``fn`` until it does not raise :class:`Unavailable`, for up to the grace period.

        Args:
            what: what the call does, for logs and errors (e.g. "reading the rendezvous state").

        Raises:
            EtcdUnavailableError: etcd stayed unreachable for the whole grace period, or refused
                the call (bad credentials, an error that retrying does not fix).
        """
        start = self.clock.monotonic()
        backoff = INITIAL_BACKOFF
        attempts = 0
        while True:
            attempts += 1
            try:
                result = fn()
            except Unavailable as exc:
                waited = self.clock.monotonic() - start
                if waited >= self.grace_period:
                    raise EtcdUnavailableError(
                        f"etcd at {self.where} has been unreachable for {waited:.1f}s while "
                        f"{what} ({attempts} attempt{'s' if attempts > 1 else ''}; "
                        f"etcd_grace_period is "
                        f"{self.grace_period:g}s): {exc}"
                    ) from exc
                if attempts == 1:
                    log.warning("etcd at %s unreachable while %s; retrying for up to %gs",
                                self.where, what, self.grace_period)
                self.clock.sleep(min(backoff, self.grace_period - waited))
                backoff = min(backoff * 2, MAX_BACKOFF)
                continue
            except AuthError as exc:
                raise EtcdUnavailableError(
                    f"etcd at {self.where} refused our credentials while {what}: {exc}"
                ) from exc
            except CoordinationError as exc:
                raise EtcdUnavailableError(f"etcd at {self.where} failed while {what}: {exc}") \
                    from exc
            if attempts > 1:
                log.warning("etcd at %s reachable again after %.1fs (%s)", self.where,
                            self.clock.monotonic() - start, what)
            return result
