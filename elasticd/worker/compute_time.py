"""Each rank's own compute time per step, apart from its waits in collectives.

In synchronous data parallelism every rank's step takes as long as the slowest rank's: the
others wait in the gradient all-reduce. The step time therefore names nobody; a rank's time
*outside* the collectives does. :class:`ComputeTimer` measures it with a DDP communication hook
(the default all-reduce, timed): a bucket's hook is called when backward has produced its
gradients, so the last bucket's call marks the end of this rank's backward, and the all-reduce
futures' completion marks the end of the wait for the others. A step's compute time is

    (last bucket ready - step start) + (step end - all-reduce done)

— forward, backward and data loading before the wait; the optimizer step after it. Without
DDP (explicit collectives) the script brackets each collective with :meth:`ComputeTimer.waiting`
and the time inside is left out instead. The value goes to the daemon with the step's progress
report (:func:`elasticd.worker.progress`), where nodes can be compared.

This module imports torch only inside :meth:`ComputeTimer.ddp_hook` (the worker package must
stay light).
"""

from __future__ import annotations

import contextlib
import threading
from typing import Any, Callable, Iterator

from elasticd.clock import SYSTEM_CLOCK, Clock

__all__ = ["ComputeTimer"]


class ComputeTimer:
    """Times one rank's compute per step (see the module's docstring).

    Usage with DDP::

        timer = ComputeTimer()
        model.register_comm_hook(None, timer.ddp_hook())
        for step, batch in ...:
            timer.start()
            loss = model(batch).sum(); loss.backward(); opt.step()
            elasticd.worker.progress(step, compute_seconds=timer.stop())

    Args:
        clock: injected time (only ``monotonic`` is used).
    """

    def __init__(self, clock: Clock = SYSTEM_CLOCK) -> None:
        self._clock = clock.monotonic
        self._lock = threading.Lock()  # all-reduce futures complete on the backend's threads
        self._start: float | None = None
        self._last_ready: float | None = None
        self._last_done: float | None = None
        self._waited = 0.0

    def start(self) -> None:
        """The step begins (before its data is loaded)."""
        with self._lock:
            self._start = self._clock()
            self._last_ready = self._last_done = None
            self._waited = 0.0

    def stop(self) -> float | None:
        """The step ends; returns its compute time in seconds, or None without :meth:`start`."""
        now = self._clock()
        with self._lock:
            start, ready, done, waited = (self._start, self._last_ready, self._last_done,
                                          self._waited)
            self._start = None
        if start is None:
            return None
        if ready is not None and done is not None:
            compute = (ready - start) + max(0.0, now - max(done, ready))
        else:
            compute = now - start
        return max(0.0, compute - waited)

    @contextlib.contextmanager
    def waiting(self) -> Iterator[None]:
        """Brackets a collective the script calls itself: its time is not compute."""
        began = self._clock()
        try:
            yield
        finally:
            spent = self._clock() - began
            with self._lock:
                self._waited += spent

    def bucket_ready(self) -> None:
        """A gradient bucket is ready (called by the hook)."""
        with self._lock:
            self._last_ready = self._clock()

    def reduced(self) -> None:
        """A bucket's all-reduce completed (called from its future)."""
        now = self._clock()
        with self._lock:
            if self._last_done is None or now > self._last_done:
                self._last_done = now

    def ddp_hook(self) -> Callable[[Any, Any], Any]:
        """A DDP communication hook: the default all-reduce (of the default process group,
        or of the group passed as the hook's state), timed."""
        from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

        # No annotations: DDP accepts a hook whose ``bucket`` is unannotated or annotated
        # with the GradBucket class itself, and this module's annotations are strings.
        def hook(state, bucket):  # type: ignore[no-untyped-def]
            self.bucket_ready()
            fut = allreduce_hook(state, bucket)

            def done(f):  # type: ignore[no-untyped-def]
                self.reduced()
                return f.value()

            return fut.then(done)

        return hook
