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
import shutil
import sys
import tempfile
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

    # The ranks' temporary files in a directory of the call's own, removed after it: a rank
    # that leaves by os._exit skips multiprocessing's clean-up, and its pymp-* directory (made
    # when a rank shares a descriptor or tensor through multiprocessing) stayed in /tmp.
    tmp = tempfile.mkdtemp(prefix="ranks-")
    before = os.environ.get("TMPDIR")
    os.environ["TMPDIR"] = tmp  # the spawned ranks read it; this process's tempdir is cached
    try:
        mp.spawn(_run, args=(fn, args), nprocs=nprocs)
    finally:
        if before is None:
            os.environ.pop("TMPDIR", None)
        else:
            os.environ["TMPDIR"] = before
        shutil.rmtree(tmp, ignore_errors=True)
