"""Hooks that must not take their caller down: each one called, a failure logged."""

from __future__ import annotations

import logging
from typing import Any, Callable, Iterable


def call_hooks(hooks: Iterable[Callable[..., Any]], *args: Any, log: logging.Logger,
               failed: str) -> None:
    """Calls each of ``hooks`` (a copy of the list: a hook may add one) with ``args``; one that
    raises is logged on ``log`` as ``failed``, with its traceback, and the next one runs."""
    for hook in list(hooks):
        try:
            hook(*args)
        except Exception:  # noqa: BLE001 — see above
            log.exception(failed)
