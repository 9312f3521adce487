"""Ranks of a gloo job spawned by a test, ended without the interpreter's teardown.

A rank that returned from its work still runs the interpreter's finalization, and there
gloo's own threads (its TCP device loop, work objects that hold tensors) can meet C++ static
destructors: now and then the process dies with SIGABRT, "terminate called without an active
exception", after every check passed (seen once in CI, in a 3-rank ZeroRedundancyOptimizer
test). The test is about the ranks' results, not torch's exit, so a rank that finished
flushes its output and leaves with ``os._exit(0)``; a rank that raised goes through
``mp.spawn``'s usual path, which reports the traceback.
"""

from __future__ import annotations

import os
import sys
from typing import Any, Callable


def _run(rank: int, fn: Callable[..., Any], args: tuple) -> None:
    fn(rank, *args)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def spawn(fn: Callable[..., Any], args: tuple, nprocs: int) -> None:
    """``torch.multiprocessing.spawn(fn, args, nprocs)``, each rank ending as said above.

    ``fn`` must be importable by name (a module-level function), as for ``mp.spawn``.
    """
    import torch.multiprocessing as mp

    mp.spawn(_run, args=(fn, args), nprocs=nprocs)
