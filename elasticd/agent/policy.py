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
import stat
import subprocess
import sys

from elasticd.cluster.jobspec import JobSpec, JobSpecError, sha256_file

#: Environment variables a job may not set unless the node allows them by name.
DENIED_ENV = ("LD_*", "PYTHON*", "BASH_ENV", "ENV")

# Run as the job's user: can it execute the interpreter, read the script, enter the directory?
_ACCESS_CHECK = 'test -x "$1" || exit 3; test -r "$2" || exit 4; test -x "$3" || exit 5'
# Run as the job's user after a failed check: the first of the directories given it cannot
# enter (printed), or exit 1 when it can enter them all.
_FIRST_CLOSED = 'for d; do test -x "$d" || { printf %s "$d"; exit 0; }; done; exit 1'
_ACCESS_PROBLEM = {3: ("python", "cannot execute the interpreter {python}"),
                   4: ("script", "cannot read the script {script}"),
                   5: ("cwd", "cannot enter the working directory {cwd}")}
# What to do, by the path the user cannot reach and by the directory that stops it (if any).
_ACCESS_FIX = {
    "python": ("install the environment (torch, elasticd) where {user} can reach it, e.g. "
               "`python3 -m venv /opt/elasticd-venv`, and name it in the daemons' "
               "job_python and in submit --python; or submit with --user set to a user who "
               "can run it"),
    "script": ("put the script where {user} can read it, or make it readable by {user} "
               "(its group, or chmod o+r); or submit with --user set to a user who can"),
    "cwd": ("submit with --cwd set to a directory {user} can enter, or make it enterable "
            "by {user}"),
}


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
    """What the job's user cannot do with its files, checked as that user, and what to do about
    it; or None.

    Root passes every ``os.access`` check, so the check runs in a child that drops to the
    user's uid, gid and groups, the way the agent will run. When it fails, a second child
    finds the first directory on the path that user cannot enter (a private home directory
    holding a virtualenv, typically), which the message names.
    """
    try:
        pw = pwd.getpwnam(user)
    except KeyError:
        return f"--user {user!r}: no such user on this machine"
    paths = {"python": python, "script": script, "cwd": cwd}
    code = _as_user(pw, _ACCESS_CHECK, [python, script, cwd])
    if isinstance(code, str):
        return f"could not check the job's files as {user}: {code}"
    if code == 0:
        return None
    if code not in _ACCESS_PROBLEM:
        return (f"user {user} could not be checked against the job's files (check exit "
                f"{code})")
    what, problem = _ACCESS_PROBLEM[code]
    path = paths[what]
    # The directories above the path (for the working directory, itself too).
    parts = os.path.abspath(path).split(os.sep)[1:]
    dirs = [os.sep + os.path.join(*parts[:i]) if i else os.sep
            for i in range(len(parts) + (what == "cwd"))]
    closed = _as_user(pw, _FIRST_CLOSED, dirs, output=True)
    where = ""
    if isinstance(closed, str) and closed and closed != os.path.abspath(path):
        try:
            mode = f"mode {stat.S_IMODE(os.stat(closed).st_mode):04o}, owner "
            mode += _owner(os.stat(closed).st_uid)
        except OSError:
            mode = "not reachable"
        where = f": it cannot enter {closed} ({mode})"
    fix = _ACCESS_FIX[what].format(user=user)
    return f"user {user} " + problem.format(**paths) + where + "; " + fix


def _owner(uid: int) -> str:
    try:
        return pwd.getpwuid(uid).pw_name
    except KeyError:
        return str(uid)


def _as_user(pw: pwd.struct_passwd, script: str, args: list[str],
             output: bool = False) -> int | str:
    """Runs a ``/bin/sh -c`` script as the user (dropping to its uid, gid and groups unless
    it is this process's own). Returns the exit status, or the error that stopped the check
    (a string); with ``output``, what the script printed if it exited 0, else ""."""
    same = pw.pw_uid == os.geteuid()
    # A check killed by a signal says nothing about the files (one was seen to die of
    # SIGSEGV under a busy daemon once): try again, a few times.
    for _ in range(3):
        try:
            done = subprocess.run(
                ["/bin/sh", "-c", script, "sh", *args],
                user=None if same else pw.pw_uid, group=None if same else pw.pw_gid,
                extra_groups=None if same else os.getgrouplist(pw.pw_name, pw.pw_gid),
                stdin=subprocess.DEVNULL, capture_output=True, cwd="/",
                env={"PATH": "/usr/bin:/bin"}, timeout=10)
        except (OSError, subprocess.SubprocessError) as exc:
            return "" if output else str(exc)
        if done.returncode >= 0:
            break
    if output:
        return done.stdout.decode(errors="replace") if done.returncode == 0 else ""
    return done.returncode
