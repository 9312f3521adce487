"""A helper thread that runs a stream's authentication pass beside its socket copy.

Tagging a 4 MiB DATA frame (ChaCha20-Poly1305, :mod:`elasticd.replication.seal`) costs a pass
over its bytes at ~5.5 GB/s on one core here, while a loopback socket moves ~2.4 GB/s. Done on
the thread that sends or receives, the two add up (docs/replication.md, "Authenticated
throughput"). The helper runs the pass on its own thread so that the sender could tag frame
``n + 1`` while frame ``n`` is being sent, and the receiver check frame ``n`` while frame
``n + 1`` arrives. That overlaps only if the tagging call releases the GIL: protocol v2's
AES-GMAC did, but ``cryptography``'s Poly1305 (protocol v3) holds it, so today the helper runs
in turn with the copy rather than beside it.

Switched off by default (``channel.OVERLAP``): even with GMAC, on the 2-core machine measured,
both cores were already busy with the two ends' copies, and the helper made pushes 8-20% slower
for 0.1-0.3 CPU s/GiB more (thread hand-offs, cross-core cache traffic).
``bench/bench_replication.py`` runs both ways in one run.

Nothing about what is checked changes, only where: the sender still seals every frame, in
order, under its sequence number before sending it; the receiver still checks every frame, in
order, under its sequence number, stops the stream at the next frame boundary once a check
fails, and accepts PUT_END (so commits) only after every check has run. Each stream starts its
own helper and joins it before it returns or raises, so no thread outlives the transfer it
served or touches a buffer after it.
"""

from __future__ import annotations

import queue
import threading
from typing import Any, Callable

_STOP = object()


class Helper:
    """Runs submitted calls one at a time, in submission order, on one background thread.

    Use as a context manager: the thread starts on entry and is stopped and joined on exit.
    :meth:`wait` is the barrier: it returns once every call submitted so far has run, and
    raises the first exception any of them raised (later calls are skipped after one fails).
    """

    def __init__(self, name: str) -> None:
        self._calls: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._done = threading.Semaphore(0)
        self._submitted = self._waited = 0
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)

    def __enter__(self) -> "Helper":
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._calls.put(_STOP)
        self._thread.join()

    def submit(self, fn: Callable[..., Any], *args: Any) -> None:
        """Queues ``fn(*args)`` behind everything submitted before it."""
        self._submitted += 1
        self._calls.put((fn, args))

    def wait(self) -> None:
        """Blocks until every submitted call has run; re-raises the first failure."""
        while self._waited < self._submitted:
            self._done.acquire()
            self._waited += 1
        if self._error is not None:
            raise self._error

    def raise_failure(self) -> None:
        """Re-raises the failure of a call that has already run, if any (does not wait)."""
        if self._error is not None:
            raise self._error

    def _run(self) -> None:
        while True:
            call = self._calls.get()
            if call is _STOP:
                return
            fn, args = call
            if self._error is None:
                try:
                    fn(*args)
                except BaseException as exc:  # handed to the stream's thread by wait()
                    self._error = exc
            self._done.release()
