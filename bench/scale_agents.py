"""The scale simulator's torchrun agents: each simulated node's rendezvous handler driven as
torchrun's elastic agent drives it, including the restart that ``num_nodes_waiting`` asks for.

torchrun's agent calls ``next_rendezvous``, starts its workers, and then, every monitor interval
while they are healthy, asks ``num_nodes_waiting()``; when it says a node waits outside the
round, the agent restarts its workers, which calls ``next_rendezvous`` again
(``torch/distributed/elastic/agent/server/api.py``, ``_invoke_run``). Until 2026-11-30 the
simulator called ``next_rendezvous`` once per agent and waited for all of them: an N = 1,000
kill round closed with 997 members while 3 agents, whose leases had lapsed and whose records
were rewritten, waited outside it for a next round nobody started, until the run's timeout.

:class:`AgentRuns` runs one such loop per simulated node of a process. Each node's own thread
blocks in ``next_rendezvous`` (elasticd's code); one monitor thread per process asks each
returned node's ``num_nodes_waiting`` (elasticd's code) and, when it answers more than 0,
wakes that node's thread to join again. The decision is the handler's; the simulator only
relays it. The driver reads :meth:`AgentRuns.latest` until every live node returned into the
same round, then calls :meth:`AgentRuns.settle` (the workers train: no more monitoring).

Cheaper than torchrun's agent, not different: the handler's answer depends only on its control
copy (the round and waiting records it holds), its trust and the clock. The monitor asks a node
at once when the round or waiting record it holds is a new object (its watch applied an event)
and otherwise every :data:`ASK_EVERY` seconds (the trust's and the clock's changes: later by
at most that), not every 0.1 s: a call costs tens of microseconds at N = 1,000 (two sets of
the round's members), 1,000 of them every 0.1 s about half a core of this 2-core machine, what
a real node, asking only for itself, does not notice.
"""

from __future__ import annotations

import threading
import time
from typing import Any, Callable, Iterable

#: elasticd's torchrun monitor interval (``agent/supervisor.py``: ``--monitor-interval 0.1``).
MONITOR_INTERVAL = 0.1
#: Seconds between two questions to a node whose control copy did not change.
ASK_EVERY = 1.0


class AgentRuns:
    """Every simulated agent of a process, driven as torchrun's agent (module docstring).

    Args:
        join: runs one node's ``next_rendezvous`` and returns what the driver records (a tuple
            whose second item is the round number).
        waiting: the node's ``num_nodes_waiting()``.
        inputs: what that answer is computed from, compared by identity (the node's control
            copy of the round and waiting records).
        submit: starts a callable on a thread of the process's pool (returns a future).
        interval: the monitor interval.
        ask_every: see :data:`ASK_EVERY`.
        clock: monotonic seconds.
    """

    def __init__(self, join: Callable[[Any], tuple], waiting: Callable[[Any], int],
                 inputs: Callable[[Any], tuple], submit: Callable[..., Any],
                 interval: float = MONITOR_INTERVAL, ask_every: float = ASK_EVERY,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._join, self._waiting, self._inputs, self._submit = join, waiting, inputs, submit
        self._interval, self._ask_every, self._clock = interval, ask_every, clock
        self._lock = threading.Lock()
        self._settled = threading.Event()
        self._wake: dict[Any, threading.Event] = {}
        self._training: dict[Any, list[Any]] = {}  # node -> [last inputs, last asked at]
        self._latest: dict[Any, Any] = {}  # node -> last result, None while in a rendezvous
        self._restarts: dict[Any, int] = {}
        self._futures: list[tuple[Any, Any]] = []
        self._monitor: threading.Thread | None = None

    def start(self, nodes: Iterable[Any]) -> None:
        """Every node joins (``next_rendezvous``), then trains until :meth:`settle`."""
        for node in nodes:
            self._wake[node] = threading.Event()
            self._latest[node] = None
            self._restarts[node] = 0
            self._futures.append((node, self._submit(self._run, node)))
        self._monitor = threading.Thread(target=self._watch, daemon=True)
        self._monitor.start()

    def _run(self, node: Any) -> tuple:
        while True:
            try:
                result = self._join(node)
            except Exception as exc:  # noqa: BLE001 - reported by the driver, not fatal
                with self._lock:
                    self._latest[node] = repr(exc)
                return repr(exc)
            with self._lock:
                self._latest[node] = result
                self._training[node] = [None, float("-inf")]
            self._wake[node].wait()
            if self._settled.is_set():
                return result
            self._wake[node].clear()  # num_nodes_waiting > 0: torchrun restarts the workers
            if self._settled.is_set():
                return result

    def _watch(self) -> None:
        """torchrun's monitor loop, for every node whose workers train."""
        while not self._settled.wait(self._interval):
            now = self._clock()
            with self._lock:
                training = list(self._training.items())
            for node, seen in training:
                inputs = self._inputs(node)
                if seen[0] is not None and now - seen[1] < self._ask_every and all(
                        a is b for a, b in zip(inputs, seen[0])):
                    continue
                seen[0], seen[1] = inputs, now
                try:
                    waiting = self._waiting(node)
                except Exception:  # noqa: BLE001 - as torchrun's agent: it ends that agent
                    waiting = 0
                if waiting > 0:
                    with self._lock:  # in a rendezvous from now, for the driver
                        self._training.pop(node, None)
                        self._latest[node] = None
                        self._restarts[node] += 1
                    self._wake[node].set()

    def latest(self) -> dict[Any, Any]:
        """Each node's last result (None: in a rendezvous now)."""
        with self._lock:
            return dict(self._latest)

    def restarts(self) -> int:
        """Times an agent joined again because ``num_nodes_waiting`` asked it to."""
        with self._lock:
            return sum(self._restarts.values())

    def settle(self, timeout: float | None = None) -> list[Any]:
        """Stops the monitoring; returns each node's last result (a ``repr`` of what it
        raised, for a node whose rendezvous failed or still runs ``timeout`` seconds from
        now)."""
        self._settled.set()
        for event in self._wake.values():
            event.set()
        out = []
        end = None if timeout is None else self._clock() + timeout  # for them all
        for _node, future in self._futures:
            try:
                out.append(future.result(None if end is None else max(0.0, end - self._clock())))
            except Exception as exc:  # noqa: BLE001 - reported, not fatal
                out.append(repr(exc))
        if self._monitor is not None:
            self._monitor.join()
        return out
