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
  script and enter the working directory), not as root;
* the script's SHA-256 (:meth:`JobPolicy.check_on_node`) as before.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import os
import pwd
import subprocess
import sys

from elasticd.cluster.jobspec import JobSpec, JobSpecError, sha256_file

#: Environment variables a job may not set unless the node allows them by name.
DENIED_ENV = ("LD_*", "PYTHON*", "BASH_ENV", "ENV")

# Run as the job's user: can it execute the interpreter, read the script, enter the directory?
_ACCESS_CHECK = 'test -x "$1" || exit 3; test -r "$2" || exit 4; test -x "$3" || exit 5'
_ACCESS_PROBLEM = {3: "cannot execute the interpreter {python}",
                   4: "cannot read the script {script}",
                   5: "cannot enter the working directory {cwd}"}


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

    def check_on_node(self, spec: JobSpec) -> str | None:
        """What stops this node from running ``spec``, or None (called by every daemon)."""
        try:
            spec.validate()
        except JobSpecError as exc:
            return str(exc)
        problem = self.check(spec) or check_access_as(spec.user, spec.python, spec.script, spec.cwd)
        if problem is not None:
            return problem
        try:
            actual = sha256_file(spec.script)
        except OSError as exc:
            return f"script {spec.script}: cannot read it ({exc.strerror})"
        if actual != spec.script_sha256:
            return (f"script {spec.script} differs on this node (sha256 {actual[:12]}…, "
                    f"submitted {spec.script_sha256[:12]}…): deploy the same file everywhere")
        return None


def _is_root(user: str) -> bool:
    try:
        return pwd.getpwnam(user).pw_uid == 0
    except KeyError:
        return user == "root"


def check_access_as(user: str, python: str, script: str, cwd: str) -> str | None:
    """What the job's user cannot do with its files, checked as that user; or None.

    Root passes every ``os.access`` check, so the check runs in a child that drops to the
    user's uid, gid and groups, the way the agent will run.
    """
    try:
        pw = pwd.getpwnam(user)
    except KeyError:
        return f"--user {user!r}: no such user on this machine"
    paths = {"python": python, "script": script, "cwd": cwd}
    if pw.pw_uid == os.geteuid():
        checks = ((3, os.access(python, os.X_OK)), (4, os.access(script, os.R_OK)),
                  (5, os.access(cwd, os.X_OK)))
        code = next((c for c, ok in checks if not ok), 0)
    else:
        code = -1
        # A check killed by a signal says nothing about the files (one was seen to die of
        # SIGSEGV under a busy daemon once): try again, a few times.
        for _ in range(3):
            try:
                code = subprocess.run(
                    ["/bin/sh", "-c", _ACCESS_CHECK, "sh", python, script, cwd],
                    user=pw.pw_uid, group=pw.pw_gid,
                    extra_groups=os.getgrouplist(pw.pw_name, pw.pw_gid),
                    stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                    stderr=subprocess.DEVNULL, cwd="/", env={"PATH": "/usr/bin:/bin"},
                    timeout=10).returncode
            except (OSError, subprocess.SubprocessError) as exc:
                return f"could not check the job's files as {user}: {exc}"
            if code >= 0:
                break
    if code == 0:
        return None
    why = _ACCESS_PROBLEM.get(code, "could not be checked against the job's files (check exit "
                              "{code})")
    return f"user {user} " + why.format(code=code, **paths)
