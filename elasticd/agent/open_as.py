"""Opening a job's files as the job's user, in a helper process that passes the descriptors back.

Root passes every permission check, and Python has no ``setfsuid``: to open a file with the
job user's rights (and no more), a short-lived helper runs as that user (uid, gid and groups,
as the agent will), opens each path once (``O_NOFOLLOW | O_NONBLOCK``, after an ``lstat`` that
leaves FIFOs, devices and symlinks unopened) and sends the descriptor back over a socket pair
(``SCM_RIGHTS``). It also answers whether the user may execute the interpreter and enter the
working directory (``access(X_OK)`` under the user's own uid). The daemon then checks and reads
the descriptor it was given (:mod:`elasticd.agent.safe_open`), never the path again: a path
swapped after the helper's open changes nothing.

The helper is the node's pinned job interpreter (which the job's user must be able to run
anyway), started with ``-I -S`` (no environment, no site, no working directory on ``sys.path``)
and an empty environment, and the whole exchange has a deadline: a file system that does not
answer costs the helper (killed), never the caller.
"""

from __future__ import annotations

import dataclasses
import json
import os
import socket
import subprocess

from elasticd.clock import SYSTEM_CLOCK
from elasticd.errors import NodeError

# Run as the job's user: argv[1] is the socket's descriptor, then "r:<path>" (open for reading)
# or "x:<path>" (may the user execute / enter it?). One message per item, a descriptor with it
# when one was opened. stdlib only (-S).
_HELPER = r"""
import json, os, socket, stat, sys
sock = socket.socket(fileno=int(sys.argv[1]))
for item in sys.argv[2:]:
    mode, path = item[0], item[2:]
    reply, fds = {}, []
    try:
        if mode == "x":
            reply["ok"] = os.access(path, os.X_OK)
            if not reply["ok"] and not os.path.exists(path):
                raise FileNotFoundError(2, "No such file or directory")
        else:
            st = os.lstat(path)
            reply["ok"] = True
            if stat.S_ISREG(st.st_mode):
                fds = [os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_NOCTTY
                               | os.O_CLOEXEC)]
            else:
                reply["mode"] = st.st_mode
    except OSError as exc:
        reply = {"ok": False, "errno": exc.errno or 0, "error": exc.strerror or str(exc)}
    socket.send_fds(sock, [json.dumps(reply).encode()], fds)
"""


class HelperFailed(NodeError):
    """The helper could not be run, or did not answer within its deadline (``hung``)."""

    def __init__(self, message: str, hung: bool = False) -> None:
        super().__init__(message)
        self.hung = hung


@dataclasses.dataclass
class Opened:
    """What the helper found for one item.

    Attributes:
        ok: "r": the path was there (``fd`` or ``mode`` says what it is); "x": the user may
            execute or enter it.
        fd: the descriptor opened as the user (the caller closes it), or -1.
        mode: the path's ``lstat`` mode when it was not a regular file (left unopened), or 0.
        errno: why it failed (0 when ``ok`` or when "x" was merely denied).
    """

    ok: bool
    fd: int = -1
    mode: int = 0
    errno: int = 0
    error: str = ""


def open_as(python: str, uid: int | None, gid: int, groups: list[int],
            items: list[tuple[str, str]], deadline: float) -> list[Opened]:
    """Opens or checks ``items`` as a user, in a helper process.

    Args:
        python: the interpreter that runs the helper (the node's pinned job interpreter).
        uid, gid, groups: the user; ``uid`` None: the caller's own (no switch).
        items: ("r", path) to open for reading, ("x", path) to ask for execute/search access.
        deadline: seconds the whole exchange may take.

    Returns:
        one :class:`Opened` per item, in order.

    Raises:
        PermissionError: the user may not execute ``python``.
        HelperFailed: the helper did not start, died, or did not answer in time (``hung``).
    """
    for mode, path in items:
        if mode not in ("r", "x") or "\0" in path:
            raise ValueError(f"bad item {(mode, path)!r}")
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    got: list[Opened] = []
    proc = None
    try:
        try:
            proc = subprocess.Popen(
                [python, "-I", "-S", "-c", _HELPER, str(theirs.fileno()),
                 *(f"{m}:{p}" for m, p in items)],
                pass_fds=(theirs.fileno(),), stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd="/", env={},
                start_new_session=True, user=uid, group=gid if uid is not None else None,
                extra_groups=groups if uid is not None else None)
        except PermissionError:
            raise
        except (OSError, subprocess.SubprocessError) as exc:
            raise HelperFailed(f"could not start the file check: {exc}") from exc
        finally:
            theirs.close()
        end = SYSTEM_CLOCK.monotonic() + deadline
        while len(got) < len(items):
            left = end - SYSTEM_CLOCK.monotonic()
            if left <= 0:
                raise HelperFailed(f"the file check did not answer within {deadline:g} s (a "
                                   "file system that does not answer?)", hung=True)
            ours.settimeout(left)
            try:
                data, fds, _, _ = socket.recv_fds(ours, 65536, 2)
            except TimeoutError:
                continue
            if not data:
                raise HelperFailed("the file check ended without answering (exit status "
                                   f"{proc.poll()})")
            for extra in fds[1:]:
                os.close(extra)
            reply = json.loads(data)
            got.append(Opened(ok=bool(reply.get("ok")), fd=fds[0] if fds else -1,
                              mode=int(reply.get("mode", 0)), errno=int(reply.get("errno", 0)),
                              error=str(reply.get("error", ""))))
        return got
    except BaseException:
        for o in got:
            if o.fd >= 0:
                os.close(o.fd)
        raise
    finally:
        ours.close()
        if proc is not None:
            if proc.poll() is None:
                proc.kill()
            try:
                proc.wait(timeout=1.0)  # one stuck in the kernel is left to the reaper
            except subprocess.TimeoutExpired:
                pass
