"""What this node agrees to run, whatever a job spec in etcd asks for.

A job spec is written by whoever may write to etcd, and the daemon that runs it is root: so the
spec is a request, and the node decides (docs/security.md). The policy lives in the daemon's own
settings (``job_users``, ``job_python``, ``job_env_allow``), never in etcd:

* the user: only the users the node allows (by default any user but root);
* the interpreter: the one the node pins (by default the daemon's own), so a spec cannot name
  ``/bin/sh`` or a virtualenv of its own choosing as the program root starts;
* the environment: variables that make an interpreter or the loader run code of the writer's
  choosing (``LD_*``, ``PYTHON*``, ``BASH_ENV``, ``ENV``) are refused unless allowed by name;
* the files: checked as the job's user (who must be able to run the interpreter, read the
  script and enter the working directory), not as root, with the script's SHA-256, off the main
  loop (:mod:`elasticd.agent.job_check`).
"""

from __future__ import annotations

import dataclasses
import fnmatch
import os
import pwd
import sys

from elasticd.cluster.jobspec import JobSpec

#: Environment variables a job may not set unless the node allows them by name.
DENIED_ENV = ("LD_*", "PYTHON*", "BASH_ENV", "ENV")


def split_list(text: str) -> tuple[str, ...]:
    """``"a, b,c"`` as ``("a", "b", "c")``."""
    return tuple(p.strip() for p in text.split(",") if p.strip())


@dataclasses.dataclass(frozen=True)
class JobPolicy:
    """The node-side job policy.

    Attributes:
        users: users jobs may run as; empty: any user but root; ``*``: any user, root too.
        python: the only interpreter a job may name (absolute path).
        env_allow: names (or ``fnmatch`` patterns) allowed despite :data:`DENIED_ENV`.
    """

    users: tuple[str, ...] = ()
    python: str = sys.executable
    env_allow: tuple[str, ...] = ()

    def check(self, spec: JobSpec) -> str | None:
        """Why this node refuses ``spec``, or None. Reads no file."""
        if self.users and "*" not in self.users and spec.user not in self.users:
            return (f"user {spec.user!r} is not allowed on this node (job_users: "
                    f"{', '.join(self.users)})")
        if not self.users and _is_root(spec.user):
            return ("runs as root, which this node refuses: submit with --user NAME, or list "
                    "root in the daemons' job_users setting")
        if os.path.normpath(spec.python) != os.path.normpath(self.python):
            return (f"interpreter {spec.python!r} is not the one this node runs jobs with "
                    f"({self.python}): submit with --python {self.python}, or set job_python")
        for name in sorted(spec.env):
            if (any(fnmatch.fnmatchcase(name, p) for p in DENIED_ENV)
                    and not any(fnmatch.fnmatchcase(name, p) for p in self.env_allow)):
                return (f"--env {name} is refused on this node (it can make the interpreter "
                        "run other code); the daemons' job_env_allow setting may allow it")
        return None


def _is_root(user: str) -> bool:
    try:
        return pwd.getpwnam(user).pw_uid == 0
    except KeyError:
        return user == "root"
