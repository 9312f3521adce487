"""Holds every optimizer of a training state back until the snapshot copy in flight is done.

A save returns before the background copy of parameters and optimizer state has finished; only
``optimizer.step`` changes those, so a step pre-hook on every optimizer in the state waits for
the copy (on the GPU: the compute stream waits on the copy's event, not the host) before the
optimizer mutates anything. Worker side.
"""

from __future__ import annotations

import logging
import weakref
from typing import Any, Callable, Mapping

import torch

from elasticd.clock import SYSTEM_CLOCK

__all__ = ["OptimizerFence"]

log = logging.getLogger("elasticd.checkpoint")


class OptimizerFence:
    """Step pre-hooks that wait for :attr:`copy`.

    Args:
        timeout: seconds a hook waits for the copy before letting the step go.
        on_wait: called with the seconds each hook waited (the host waited, not a GPU fence).
    """

    def __init__(self, timeout: float, on_wait: Callable[[float], None]) -> None:
        self._timeout, self._on_wait = timeout, on_wait
        #: id(optimizer) -> (a weak reference to it, its hook's handle)
        self._hooks: dict[int, tuple[Any, Any]] = {}
        self._stall = 0.0
        #: The copy in flight (a CopyHandle), or None.
        self.copy: Any = None
        #: Optimizer steps taken so far, by every hooked optimizer (held_state: whether the
        #: live state is still the step last snapshotted).
        self.steps = 0

    def watch(self, state: Mapping[str, Any]) -> None:
        """Hooks every optimizer in ``state`` not hooked yet.

        By identity, checked through a weak reference: an optimizer made for each round
        (``@elasticd.in_process``: ZeRO, FSDP2's) may take the id of the last round's, gone
        since, and would otherwise go unhooked, its step free to change parameters the copy
        is still reading."""
        for value in state.values():
            if not isinstance(value, torch.optim.Optimizer):
                continue
            held = self._hooks.get(id(value))
            if held is not None and held[0]() is value:
                continue
            if held is not None:
                held[1].remove()  # the hook of a gone optimizer whose id this one took
            self._hooks[id(value)] = (weakref.ref(value),
                                      value.register_step_pre_hook(self._before_step))

    def take_stall(self) -> float:
        """Seconds the hooks held the training loop since the last call."""
        stall, self._stall = self._stall, 0.0
        return stall

    def close(self) -> None:
        """Removes every hook."""
        for _, handle in self._hooks.values():
            handle.remove()
        self._hooks.clear()

    def _before_step(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        self.steps += 1
        copy = self.copy
        if copy is None or copy.done():
            return
        fence = getattr(copy, "before_mutation", None)
        if fence is not None:  # GPU: the compute stream waits on the copy's event, not the host
            fence()
            return
        start = SYSTEM_CLOCK.perf_counter()
        try:
            copy.wait(self._timeout)
        except Exception as exc:  # noqa: BLE001 — the seal thread reports it
            log.debug("elasticd: snapshot copy failed: %s", exc)
        waited = SYSTEM_CLOCK.perf_counter() - start
        self._stall += waited
        self._on_wait(waited)
