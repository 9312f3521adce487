"""A warm worker of rank > 0 meets rank 0's TCPStore without torch's half-second back-off.

``init_process_group`` (``env://``) has the rank-0 worker host a TCPStore and every other rank
connect to it. A client that finds nothing listening yet sleeps torch's connect back-off before
it tries again: ``ExponentialBackoffWithJitter``, 500 ms ± 50 % at first
(``torch/csrc/distributed/c10d/Backoff.hpp``). Workers forked by the zygote reach that call
within milliseconds of each other, so whether rank 0 listens first is a coin toss, and the
loser's 0.25-0.75 s lands on every recovery that loses it.

:func:`install`, called in each worker the zygote forks (:func:`elasticd.agent.zygote.run_script`),
wraps ``torch.distributed.rendezvous._create_c10d_store``: a client first waits until the
store's port accepts a TCP connection (:func:`elasticd.listening.wait_listening`) within the
store's own timeout, then creates the store as before with the time left (at least a second).
If the port never opens, the original call runs and fails as it would have. Rank 0's own call
(it hosts the server) is untouched. A torch without that private function keeps its
behaviour: the wrapper is then not installed.

Cold workers (new interpreters) are not covered: they spend seconds importing torch, which
dwarfs the back-off.
"""

from __future__ import annotations

import datetime
import functools
import importlib
import logging
import os
from typing import Callable

from elasticd.clock import Clock, SystemClock
from elasticd.listening import wait_listening

log = logging.getLogger(__name__)


def _wrap(create: Callable, clock: Clock | None = None) -> Callable:
    clock = clock or SystemClock()

    @functools.wraps(create)
    def create_c10d_store(hostname, port, rank, world_size, timeout, *args, **kwargs):
        # With torch's _torchelastic_use_agent_store() every rank, 0 too, is a client.
        agent_store = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == str(True)
        if (rank != 0 or agent_store) and isinstance(timeout, datetime.timedelta):
            started = clock.monotonic()
            wait_listening(hostname, int(port), timeout.total_seconds(), clock)
            # The store's own connect gets what is left (at least a second), so a port that
            # never opens fails within about the timeout asked for, not twice it.
            left = timeout.total_seconds() - (clock.monotonic() - started)
            timeout = datetime.timedelta(seconds=max(1.0, left))
        return create(hostname, port, rank, world_size, timeout, *args, **kwargs)

    create_c10d_store.elasticd_wrapped = True  # type: ignore[attr-defined]
    return create_c10d_store


def install(clock: Clock | None = None) -> None:
    """Wraps torch's store creation in this process, once (see the module docstring)."""
    # Not ``import torch.distributed.rendezvous as rdzv``: that name resolves to the function
    # torch.distributed re-exports, which shadows the module.
    rdzv = importlib.import_module("torch.distributed.rendezvous")
    create = getattr(rdzv, "_create_c10d_store", None)
    if create is None:
        log.debug("torch.distributed.rendezvous has no _create_c10d_store: not wrapped")
    elif not getattr(create, "elasticd_wrapped", False):
        rdzv._create_c10d_store = _wrap(create, clock)
