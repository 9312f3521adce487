"""How often torch's rendezvous re-reads the shared state while it waits for other nodes.

torch's dynamic rendezvous polls: while a node waits (for a dead participant to be dropped, for
more nodes to join, for ``last_call_timeout`` to run out, for the round to be marked complete),
its op executor sleeps one second between state reads (``_delay(seconds=1)``), and the state
holder serves a cached state for one second (``cache_duration=1``). Each of those waits costs up
to a second of recovery, and a re-rendezvous after a failure goes through three or four of them
(measured here: the dead node dropped ~1 s after its alive key was gone, the round complete
2.1 s after the drop with ``last_call_timeout=1``).

:func:`set_poll_interval` shortens both to ``poll_interval`` seconds for this agent's handler:
the rdzv-conf key ``poll_interval`` (default 1, torch's behaviour; the daemon passes 0.25).
The price is etcd reads: one state read (plus one alive-key read with lease liveness) per
waiting node every ``poll_interval`` seconds, *only while a rendezvous is in progress* (a
training node's handler does not poll: it heartbeats every ``keep_alive_interval``). With N
nodes re-rendezvousing that is ``N / poll_interval`` reads/s of a state that grows with N
(docs/scale.md): keep 1 s beyond a few hundred nodes.

The executor's delay is a module-level function of torch's ``dynamic_rendezvous``; it is
replaced there (only in the agent process that built an etcd-v3 handler, which has no other
rendezvous) by one that sleeps ``poll_interval`` instead of torch's one-second poll and passes
every other delay through unchanged. If torch changes shape, nothing is patched and one warning
says so: the rendezvous still works, at torch's pace. Agent side: imports torch.
"""

from __future__ import annotations

import logging
import time
from typing import Any, Callable

log = logging.getLogger(__name__)

#: torch's poll: the executor's ``_delay(seconds=1)`` and the state cache of one second.
TORCH_POLL = 1.0


class _PollDelay:
    """Replaces torch's ``_delay``: its one-second poll becomes ``interval`` seconds."""

    def __init__(self, original: Callable[..., None], interval: float,
                 sleep: Callable[[float], None] = time.sleep) -> None:
        self.original, self.interval, self._sleep = original, interval, sleep

    def __call__(self, seconds: Any) -> None:
        if not isinstance(seconds, tuple) and seconds == TORCH_POLL:
            self._sleep(self.interval)
        else:  # the random start-up skew and anything else: torch's own
            self.original(seconds)


def set_poll_interval(handler: Any, interval: float) -> bool:
    """Makes ``handler`` (torch's DynamicRendezvousHandler) poll every ``interval`` seconds.

    Returns:
        True when applied; False (after one warning) when torch's internals differ, or when
        ``interval`` is torch's own one second.
    """
    if interval >= TORCH_POLL:
        return False
    from torch.distributed.elastic.rendezvous import dynamic_rendezvous as dr

    holder = getattr(handler, "_state_holder", None)
    delay = getattr(dr, "_delay", None)
    if holder is None or not hasattr(holder, "_cache_duration") or not callable(delay):
        log.warning("torch's rendezvous has changed shape; poll_interval=%g is ignored and the "
                    "rendezvous polls every %g s", interval, TORCH_POLL)
        return False
    holder._cache_duration = min(holder._cache_duration, interval)
    if isinstance(delay, _PollDelay):
        delay.interval = interval
    else:
        dr._delay = _PollDelay(delay, interval)
    return True
