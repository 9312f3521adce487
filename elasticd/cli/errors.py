"""What ``elasticctl`` commands raise, the exit status each maps to, and the ``--force`` rule.

Exit status (documented in docs/elasticctl.md; scripts rely on it):

* 0 — done;
* 1 — the operation failed (not found, already exists, a drain that failed or timed out);
* 2 — bad usage or input (including a destructive command without ``--force`` in a script);
* 3 — etcd unreachable.
"""

from __future__ import annotations

import sys

from elasticd.errors import ElasticdError, InputError

EXIT_OK, EXIT_FAILED, EXIT_USAGE, EXIT_ETCD = 0, 1, 2, 3


class CommandFailed(ElasticdError):
    """The command could not do what was asked (exit 1)."""


class UsageError(InputError):
    """Bad usage or input (exit 2)."""


def confirm(question: str, consequence: str, force: bool) -> None:
    """The rule for destructive commands: ``--force`` goes ahead; on a terminal, ask;
    in a script, refuse and say how to confirm.

    Raises:
        UsageError: not confirmed in a script (no terminal on stdin).
        CommandFailed: the person at the terminal said no.
    """
    if force:
        return
    if not sys.stdin.isatty():
        raise UsageError(f"{consequence}: add --force to confirm")
    if input(f"{question} [y/N] ").strip().lower() != "y":
        raise CommandFailed("not confirmed; nothing done")
