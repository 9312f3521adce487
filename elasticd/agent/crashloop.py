"""Crash-loop detection: a job whose worker groups keep failing without committing anything new
is stopped as ``failed``, with the last failure as the reason, instead of spending its restart
budgets (torchrun's ``--max-restarts`` and the daemon's ``agent_restarts``, about a thousand
attempts together) on the same exception.

Two kinds of restart are counted, whatever the failure (an exception, a crash during set-up, a
hang the daemon aborted): torchrun's agent restarting its worker group (each failed attempt
leaves ``attempt_<n>`` in the agent's log directory, :func:`attempts`), and the daemon
restarting an agent that died. :func:`after_restart` and :func:`verdict` are pure decisions;
:func:`failure_summary` reads the last exception line a worker wrote to the agent's log.
"""

from __future__ import annotations

import dataclasses
import re

from elasticd.agent import safe_open

Version = tuple[int, int]  # (generation, step)

#: A job that neither checkpoints nor reports progress gives no step to judge by: an attempt
#: that ran this long before failing is not counted as part of a loop.
BLIND_ATTEMPT_SECONDS = 600.0


@dataclasses.dataclass(frozen=True)
class LoopState:
    """Restarts of one job on this node since its committed step last moved.

    Attributes:
        best: the newest committed (generation, step) seen at a restart, or None.
        restarts: restarts in a row after which no newer step had been committed.
        failure: the last failure's summary.
    """

    best: Version | None = None
    restarts: int = 0
    failure: str = ""


def after_restart(state: LoopState, committed: Version | None, failure: str,
                  seconds: float = 0.0) -> LoopState:
    """The worker group restarted (``failure`` says why) after its attempt ran ``seconds``;
    ``committed`` is the newest committed step now (None: none known). An attempt that
    committed a newer step than any before resets the count, and so does a long one of a job
    that gives no step at all (:data:`BLIND_ATTEMPT_SECONDS`)."""
    if committed is not None and (state.best is None or committed > state.best):
        return LoopState(committed, 0, failure)
    if committed is None and state.best is None and seconds >= BLIND_ATTEMPT_SECONDS:
        return LoopState(None, 0, failure)
    return LoopState(state.best, state.restarts + 1, failure)


#: The failure of an attempt whose log here shows no Python traceback.
NO_TRACEBACK = "a worker exited without a Python traceback (see elasticctl logs)"


def verdict(state: LoopState, limit: int) -> str | None:
    """The reason to stop the job as failed, or None to let it restart (``limit`` 0: never).

    A node whose own workers showed no traceback (killed when a peer's worker raised) waits
    one restart more, so that the node whose worker raised, which counts the same restarts,
    decides first and the job's reason carries the exception line.
    """
    if limit <= 0 or state.restarts < limit:
        return None
    if state.failure == NO_TRACEBACK and state.restarts < limit + 1:
        return None
    at = f"step {state.best[1]}" if state.best is not None else "nothing"
    why = state.failure or "the workers failed"
    return (f"crash loop: {state.restarts} worker group restarts in a row with no new "
            f"committed step (last committed: {at}); last failure: {why}")


_ATTEMPT = re.compile(r"^attempt_(\d+)$")


def attempts(torchrun_dir: str, known: set[str]) -> int:
    """The highest attempt number torchrun's agent reached in the run directories under
    ``torchrun_dir`` that are not in ``known`` (those of earlier agents), or -1 before any.

    torchrun makes ``<run id>_<random>/attempt_<restart count>`` for each worker group it
    starts; the count goes up only when a group failed (not when nodes joined). The directories
    are the job user's: read as :func:`~elasticd.agent.safe_open.list_dir` reads them.
    """
    best = -1
    with safe_open.open_dir(torchrun_dir) as fd:
        if fd < 0:
            return -1
        for run in set(safe_open.list_dir(fd)) - known:
            with safe_open.open_dir(run, fd) as run_fd:
                names = safe_open.list_dir(run_fd)
            best = max([best] + [int(m.group(1)) for n in names if (m := _ATTEMPT.match(n))])
    return best


def runs(torchrun_dir: str) -> set[str]:
    """The run directories torchrun agents made so far under ``torchrun_dir``."""
    with safe_open.open_dir(torchrun_dir) as fd:
        return set(safe_open.list_dir(fd))


_EXCEPTION = re.compile(r"^(?:\[[^\]]*\]:?\s*)?([A-Za-z_][\w.]*(?:Error|Exception|Interrupt|"
                        r"Exit|Failure|Warning)?(?::\s.*)?)$")
_IGNORED = ("torch.distributed.elastic", "ChildFailedError")


def failure_summary(text: str, limit: int = 300) -> str:
    """The last exception line of a Python traceback in ``text`` (a worker's, not torchrun's
    own ``ChildFailedError``), or "" if there is none.

    Args:
        text: the tail of the agent's log (the workers' stderr goes there).
    """
    found = ""
    in_traceback = False
    for line in text.splitlines():
        bare = re.sub(r"^\[[^\]]*\]: ?", "", line)  # torchrun's rank prefix (--tee)
        if bare.startswith("Traceback (most recent call last):"):
            in_traceback = True
            continue
        if not in_traceback or bare.startswith((" ", "\t")) or not bare.strip():
            continue
        in_traceback = False
        m = _EXCEPTION.match(bare.strip())
        if m and not any(s in bare for s in _IGNORED):
            found = m.group(1)
    return found[:limit]
