"""Whether this node can run a job: its spec against the node's policy, and its files, checked
off the main loop with a deadline.

A job spec is written by whoever may write to etcd, and names files (the script, the working
directory) that the daemon, as root, must check before it starts the job: the user exists and
is allowed, the interpreter is the node's, the job's user can run it, read the script and enter
the directory, and the script is the one submitted (its SHA-256). Nothing such a spec names may
hold the daemon (docs/security.md), so:

* the files are opened as the job's user by a helper process (:mod:`elasticd.agent.open_as`)
  and checked and read through the descriptor it passes back (:mod:`elasticd.agent.safe_open`:
  no procfs, sysfs, devtmpfs or FUSE file, a regular file of root's or the job user's, of size
  1 to :data:`~elasticd.agent.safe_open.MAX_SCRIPT_BYTES`, at most its size read);
* :func:`check_job` runs on a thread of its own (:class:`JobChecks`); the main loop waits for
  it at most :data:`LOOP_WAIT` seconds and otherwise asks again at its next cycle;
* a check that takes longer than :data:`CHECK_DEADLINE` is *hung*: the job is refused with the
  reason, and the refusal is written to the daemon's state directory so that a restarted daemon
  does not run the same check again; a changed spec or control (``elasticctl retry``) is
  checked afresh;
* a script or working directory missing on this node is *waiting*, not refused: it may not be
  deployed yet; the manager checks again every :data:`WAIT_RETRY` seconds.
"""

from __future__ import annotations

import dataclasses
import errno
import hashlib
import json
import logging
import os
import pwd
import stat
import subprocess
import threading
from typing import Any, Callable

from elasticd.agent import safe_open
from elasticd.agent.open_as import HelperFailed, open_as
from elasticd.cluster.job_policy import JobPolicy
from elasticd.clock import Clock
from elasticd.cluster.jobspec import JobControl, JobSpec, JobSpecError

log = logging.getLogger(__name__)

#: Seconds a job's check may take before it counts as hung.
CHECK_DEADLINE = 10.0
#: Seconds the main loop waits for a check before it goes on with its cycle (a check answers in
#: tens of milliseconds when the files do).
LOOP_WAIT = 0.5
#: Seconds between two checks of a job whose script or directory is not on this node yet.
WAIT_RETRY = 5.0
#: The daemon's record of hung checks, in its state directory.
HUNG_FILE = "job-checks-hung.json"
_HUNG_KEEP = 100  # entries kept


@dataclasses.dataclass(frozen=True)
class Verdict:
    """A check's answer.

    Attributes:
        problem: why this node does not run the job, on one line; "" when it can.
        waiting: the problem may go away by itself (a file not deployed yet): check again.
        hung: the check did not finish within its deadline.
    """

    problem: str = ""
    waiting: bool = False
    hung: bool = False


def fingerprint(spec: JobSpec, control: JobControl | None) -> str:
    """What a refusal is tied to: the spec and the control as they are now (a new spec, or a
    control an operator rewrote, ``elasticctl retry``, is another check)."""
    h = hashlib.sha256(spec.encode())
    h.update(b"\0" + (control.encode() if control is not None else b""))
    return h.hexdigest()[:32]


def check_job(spec: JobSpec, policy: JobPolicy, deadline: float = CHECK_DEADLINE) -> Verdict:
    """Everything that stops this node from running ``spec``, checked as its user (module
    docstring). Blocks for up to ``deadline`` seconds: call it off the main loop."""
    try:
        spec.check_fields()
    except JobSpecError as exc:
        return Verdict(str(exc))
    problem = policy.check(spec)
    if problem is not None:
        return Verdict(problem)
    try:
        pw = pwd.getpwnam(spec.user)
    except KeyError:
        return Verdict(f"--user {spec.user!r}: no such user on this machine")
    me = pw.pw_uid == os.geteuid()
    user = pw.pw_name
    try:
        script, cwd = open_as(policy.python, None if me else pw.pw_uid, pw.pw_gid,
                              [] if me else os.getgrouplist(user, pw.pw_gid),
                              [("r", spec.script), ("x", spec.cwd)], deadline)
    except PermissionError:
        return Verdict(f"user {user} cannot execute the interpreter {policy.python}"
                       + access_hint(pw, "python", policy.python))
    except FileNotFoundError:
        return Verdict(f"the interpreter {policy.python} is not on this node")
    except HelperFailed as exc:
        return Verdict(f"could not check the job's files as {user}: {exc}", hung=exc.hung)
    try:
        return (_script_problem(spec, script, pw.pw_uid, user)
                or _cwd_problem(spec, cwd, user) or Verdict())
    finally:
        if script.fd >= 0:
            os.close(script.fd)


def _script_problem(spec: JobSpec, got: Any, uid: int, user: str) -> Verdict | None:
    where = f"script {spec.script!r}"
    if not got.ok:
        if got.errno in (errno.ENOENT, errno.ENOTDIR):
            return Verdict(f"{where} is not on this node (not deployed yet?): checked again "
                           f"every {WAIT_RETRY:g} s", waiting=True)
        if got.errno in (errno.EACCES, errno.EPERM):
            return Verdict(f"user {user} cannot read the {where}"
                           + access_hint(pwd.getpwuid(uid), "script", spec.script))
        if got.errno == errno.ELOOP:  # made a symlink between the helper's lstat and open
            return Verdict(f"{where} is a symbolic link, not a regular file")
        return Verdict(f"{where}: cannot open it as {user} ({got.error})")
    if got.fd < 0:
        return Verdict(f"{where} is {safe_open.kind_of(got.mode)}, not a regular file")
    try:
        st = safe_open.check_file(got.fd, where, safe_open.MAX_SCRIPT_BYTES,
                                  owners={0, uid, os.geteuid()})
        actual = safe_open.sha256_of(got.fd, st.st_size)
    except safe_open.UnsafeFile as exc:
        return Verdict(str(exc))
    except OSError as exc:
        return Verdict(f"{where}: cannot read it ({exc.strerror})")
    if actual != spec.script_sha256:
        return Verdict(f"{where} differs on this node (sha256 {actual[:12]}…, submitted "
                       f"{spec.script_sha256[:12]}…): deploy the same file everywhere")
    return None


def _cwd_problem(spec: JobSpec, got: Any, user: str) -> Verdict | None:
    if got.ok:
        return None
    if got.errno in (errno.ENOENT, errno.ENOTDIR):
        return Verdict(f"--cwd {spec.cwd!r} is not on this node (not deployed yet?): checked "
                       f"again every {WAIT_RETRY:g} s", waiting=True)
    return Verdict(f"user {user} cannot enter the working directory {spec.cwd!r}"
                   + access_hint(pwd.getpwnam(user), "cwd", spec.cwd))


# What to do, by the path the job's user cannot reach.
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
# Run as the job's user: the first of the directories given it cannot enter (printed), or
# exit 1 when it can enter them all.
_FIRST_CLOSED = 'for d; do test -x "$d" || { printf %s "$d"; exit 0; }; done; exit 1'


def access_hint(pw: pwd.struct_passwd, what: str, path: str) -> str:
    """``": it cannot enter <dir> (mode, owner); <fix>"`` for a ``path`` (``what``: python,
    script or cwd) the job's user cannot reach: the first directory above it that user cannot
    enter (a private home holding a virtualenv, typically), found as that user, and the fix.
    Runs a child process: call it off the main loop, as :func:`check_job` is."""
    parts = os.path.abspath(path).split(os.sep)[1:]
    dirs = [os.sep + os.path.join(*parts[:i]) if i else os.sep
            for i in range(len(parts) + (what == "cwd"))]
    closed = _first_closed(pw, dirs)
    where = ""
    if closed and closed != os.path.abspath(path):
        try:
            st = os.stat(closed)
            where = f": it cannot enter {closed} (mode {stat.S_IMODE(st.st_mode):04o}, owner "
            where += _owner(st.st_uid) + ")"
        except OSError:
            where = f": it cannot enter {closed} (not reachable)"
    return where + "; " + _ACCESS_FIX[what].format(user=pw.pw_name)


def _owner(uid: int) -> str:
    try:
        return pwd.getpwuid(uid).pw_name
    except KeyError:
        return str(uid)


def _first_closed(pw: pwd.struct_passwd, dirs: list[str]) -> str:
    """The first of ``dirs`` the user cannot enter, checked as that user ("" if none, or if
    the check itself failed)."""
    same = pw.pw_uid == os.geteuid()
    try:
        done = subprocess.run(
            ["/bin/sh", "-c", _FIRST_CLOSED, "sh", *dirs],
            user=None if same else pw.pw_uid, group=None if same else pw.pw_gid,
            extra_groups=None if same else os.getgrouplist(pw.pw_name, pw.pw_gid),
            stdin=subprocess.DEVNULL, capture_output=True, cwd="/",
            env={"PATH": "/usr/bin:/bin"}, timeout=5)
    except (OSError, subprocess.SubprocessError):
        return ""
    return done.stdout.decode(errors="replace") if done.returncode == 0 else ""


@dataclasses.dataclass
class _Run:
    fingerprint: str
    started: float
    done: threading.Event
    verdict: Verdict | None = None
    finished: float = 0.0


class JobChecks:
    """Runs :func:`check_job` off the main loop, one thread per check, and remembers the
    checks that hung (module docstring) in ``state_dir``'s :data:`HUNG_FILE`."""

    def __init__(self, state_dir: str, clock: Clock,
                 check: Callable[[JobSpec, JobPolicy, float], Verdict] = check_job,
                 deadline: float = CHECK_DEADLINE) -> None:
        self._path = os.path.join(state_dir, HUNG_FILE)
        self._clock = clock
        self._check = check
        self.deadline = deadline
        #: Called when a check finishes (the daemon wakes its loop).
        self.wake: Callable[[], None] = lambda: None
        self._runs: dict[str, _Run] = {}
        self._hung: dict[str, dict[str, Any]] = self._load()

    def verdict(self, job: str, spec: JobSpec, control: JobControl | None, policy: JobPolicy,
                wait: float = LOOP_WAIT) -> Verdict | None:
        """The verdict on ``job`` as ``spec`` and ``control`` say now, or None while its check
        runs (the caller asks again at its next cycle; ``wait``: seconds to wait here first)."""
        fp = fingerprint(spec, control)
        hung = self._hung.get(job)
        if hung is not None and hung.get("fingerprint") == fp:
            return Verdict(str(hung.get("reason", "its check hung")), hung=True)
        run = self._runs.get(job)
        now = self._clock.monotonic()
        if (run is None or run.fingerprint != fp
                or run.done.is_set() and now - run.finished > self.deadline):
            # None yet, an older spec's (left running), or an answer nobody took in time
            run = self._runs[job] = self._start(spec, policy, fp)
        if run.done.wait(wait):
            del self._runs[job]
            verdict = run.verdict or Verdict("the check of its files failed")
        elif self._clock.monotonic() - run.started > self.deadline + 2.0:
            del self._runs[job]  # its thread is left where it is stuck
            verdict = Verdict(f"checking its files took more than {self.deadline:g} s (a file "
                              "system that does not answer?)", hung=True)
        else:
            return None
        if verdict.hung:
            verdict = dataclasses.replace(verdict, problem=(
                f"{verdict.problem}; not checked again on this node until its spec changes or "
                f"an operator retries (elasticctl retry {job})"))
            self._remember(job, fp, verdict.problem)
        return verdict

    def _start(self, spec: JobSpec, policy: JobPolicy, fp: str) -> _Run:
        run = _Run(fp, self._clock.monotonic(), threading.Event())

        def target() -> None:
            try:
                run.verdict = self._check(spec, policy, self.deadline)
            except Exception as exc:  # noqa: BLE001 — whatever the spec holds: refuse it
                run.verdict = Verdict(f"cannot check the job on this node: {exc}")
            run.finished = self._clock.monotonic()
            run.done.set()
            self.wake()

        threading.Thread(target=target, name=f"job-check-{spec.name}", daemon=True).start()
        return run

    # -- hung checks, kept across restarts ------------------------------------------------

    def _load(self) -> dict[str, dict[str, Any]]:
        try:
            with open(self._path, "rb") as fh:
                data = json.loads(fh.read(1 << 20))
        except FileNotFoundError:
            return {}
        except (OSError, ValueError) as exc:
            log.warning("ignoring %s: %s", self._path, exc)
            return {}
        return {job: e for job, e in data.items() if isinstance(e, dict)} \
            if isinstance(data, dict) else {}

    def _remember(self, job: str, fp: str, reason: str) -> None:
        log.error("job %s: %s", job, reason)
        self._hung[job] = {"fingerprint": fp, "reason": reason, "at": self._clock.wall()}
        keep = sorted(self._hung.items(), key=lambda kv: kv[1].get("at", 0))[-_HUNG_KEEP:]
        self._hung = dict(keep)
        tmp = f"{self._path}.{os.getpid()}.tmp"
        try:
            os.makedirs(os.path.dirname(self._path), exist_ok=True)
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW
                         | os.O_CLOEXEC, 0o600)
            with os.fdopen(fd, "w") as fh:
                json.dump(self._hung, fh)
            os.replace(tmp, self._path)
        except OSError as exc:
            log.warning("could not record the hung check in %s: %s", self._path, exc)
