"""What a training script imports to talk to its node's elasticd.

``elasticd.worker.progress(step)`` once per step is all hang detection needs::

    import elasticd.worker
    for step in range(start, steps):
        train_one_step()
        elasticd.worker.progress(step)

With :class:`elasticd.worker.compute_time.ComputeTimer`, ``progress(step, compute_seconds=...)``
also sends the rank's compute time of the step outside collectives (a slow node's measure).

Without elasticd (``ELASTICD_SOCKET`` unset: plain ``python train.py`` or plain torchrun) it does
nothing, after one warning, so the same script runs anywhere. Importing this package loads
neither torch nor anything heavy: it is loaded into every worker.

The package is the worker side of elasticd, everything that runs in a training process (its
modules, one line each: docs/architecture.md); the checkpoint modules import torch when they
are imported. None of it imports the daemon side (:mod:`elasticd.store`,
:mod:`elasticd.daemon`); the snapshot format both sides share is :mod:`elasticd.snapshot`.
"""

from __future__ import annotations

import logging
import os
import threading

from elasticd.worker.client import (
    SOCKET_ENV,
    DaemonClient,
    DaemonClientError,
    DaemonError,
    DaemonTimeout,
    DaemonUnavailable,
    WorkerIdentity,
)

__all__ = ["DaemonClient", "DaemonClientError", "DaemonError", "DaemonTimeout",
           "DaemonUnavailable", "WorkerIdentity", "default_client", "progress"]

log = logging.getLogger(__name__)

_lock = threading.Lock()
_client: DaemonClient | None = None
_disabled = False  # looked once and found no daemon: stay a no-op


def default_client() -> DaemonClient | None:
    """The process's shared client, created from the environment on first use.

    Returns:
        None when ``ELASTICD_SOCKET`` is unset (or the torchrun variables are malformed); this
        is logged once and remembered.
    """
    global _client, _disabled
    if _client is not None or _disabled:
        return _client
    with _lock:
        if _client is None and not _disabled:
            if not os.environ.get(SOCKET_ENV):
                log.warning("%s is not set: this process is not running under elasticd, so "
                            "elasticd.worker.progress() does nothing", SOCKET_ENV)
                _disabled = True
            else:
                try:
                    _client = DaemonClient.from_env()
                except ValueError as exc:
                    log.warning("cannot talk to elasticd (%s): progress reports are off", exc)
                    _disabled = True
    return _client


def progress(step: int, compute_seconds: float | None = None) -> None:
    """Tells the node's daemon this worker reached ``step`` (one-way, microseconds; a no-op
    without elasticd; never raises because of the daemon).

    Args:
        compute_seconds: this rank's own compute time of the step, its waits in collectives
            left out (:class:`elasticd.worker.compute_time.ComputeTimer`), so that the
            daemons can tell a slow node from the rest.
    """
    client = _client if _client is not None else default_client()
    if client is not None:
        client.progress(step, compute_seconds)
