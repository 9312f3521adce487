"""Warm worker starts: a process that has imported torch already forks each new worker.

After a failure, every surviving node restarts its workers, and a new Python worker spends
seconds importing torch before it runs a line of the script (docs/architecture.md: cold against
warm). The zygote pays that once per job and node, before it is needed:

* The supervisor starts ``elasticd.agent.zygote`` (as ``python -m`` would, without the working
  directory on ``sys.path``) beside the agent, with the agent's user, environment (the job's tag
  included) and working directory. It listens on the abstract Unix socket named by
  ``ELASTICD_ZYGOTE`` *first*, then imports torch and the modules training scripts use, then
  accepts: a worker that connects early waits in the backlog instead of failing.
* torchrun runs :mod:`elasticd.agent.warm_start` as each worker (``--module``): a few
  milliseconds of Python that send the zygote the script, its arguments, the worker's
  environment and working directory, and its stdin/stdout/stderr (``SCM_RIGHTS``).
* The zygote forks. The child starts a session of its own, takes those descriptors, that
  environment and directory, reseeds Python's and numpy's global generators (a fresh
  interpreter would not share its parent's), has a rank > 0 wait for rank 0's TCPStore without
  torch's half-second connect back-off (:mod:`.store_connect`), and runs the script as
  ``__main__``.
* The zygote reports the child's pid, then its exit status, to the waiting ``warm_start``,
  which exits the same way (the same code, or the same signal). Signals sent to ``warm_start``
  (torchrun's SIGTERM) are forwarded to the child. When ``warm_start`` dies without a word
  (SIGKILL: torchrun's or the daemon's proactive abort), its connection closes and the zygote
  SIGKILLs the child's whole process group: no worker outlives the process torchrun watches.

A node's agent asks the zygote whether it is ready (:func:`wait_ready`: a request with no
script, answered once the zygote accepts, which is after its preload) before the node's first
join of a round: a node that joined earlier stopped every other node's workers while it
imported torch.

Only the zygote's own user (or root) may connect (``SO_PEERCRED``): the socket runs code as that
user. Why a worker checks the server before it hands over its argv, environment and stdio, and
why the name is random and travels in the environment only: docs/security.md ("The zygote's
socket cannot be squatted"). If anything fails before the script starts (no zygote, a refused
connection), warm_start falls back to exec-ing the script in a fresh interpreter, so the job
runs either way, cold.

What a forked worker shares with the zygote: the hash seed of ``str`` (``PYTHONHASHSEED`` is
fixed per interpreter) and whatever the preloaded modules did at import. Agent side: the
zygote imports torch; the daemon never imports this module's :func:`serve`.
"""

from __future__ import annotations

import contextlib
import gc
import json
import os
import select
import signal
import socket
import sys
import threading
import traceback
from typing import Any

from elasticd.local import wire
from elasticd.local.worker_link import Untrusted, connect_checked, peer_credentials

#: Environment variable with the zygote's socket name, set for the agent and its workers.
ZYGOTE_ENV = "ELASTICD_ZYGOTE"
#: Environment variable with the zygote's pid, set for the agent and its workers.
ZYGOTE_PID_ENV = "ELASTICD_ZYGOTE_PID"
#: What the zygote imports before it accepts (what a training script is about to import).
#: ``torch._dynamo``: DDP's constructor imports it (``torch.nn.parallel.distributed``, the
#: ``get_optimize_ddp_mode`` check), and a forked worker spent 0.98 s of a 1.15 s recovery
#: start in that import (bench_recovery, TTL 2 s; 0.01 s once preloaded).
PRELOAD = ("torch", "torch._dynamo", "torch.distributed", "torch.nn.parallel",
           "torch.utils.data", "torch.distributed.optim", "numpy", "elasticd.worker.checkpointer",
           "elasticd.worker.sampler", "elasticd.worker")
MAX_REQUEST = 4 << 20  # argv + environment; a bigger request is refused


def address(name: str) -> str:
    """The abstract socket address for ``name`` (no file: nothing to clean up or leak)."""
    return "\0elasticd-zygote-" + name


def send_msg(sock: socket.socket, msg: dict[str, Any], fds: list[int] = ()) -> None:
    # ASCII JSON, not wire.encode's UTF-8: an environment may hold undecodable bytes
    # (surrogate escapes), which this escapes and the zygote's json.loads restores.
    body = json.dumps(msg, separators=(",", ":")).encode()
    data = wire.LENGTH.pack(len(body)) + body
    if fds:
        socket.send_fds(sock, [data], list(fds))
    else:
        sock.sendall(data)


def recv_msg(sock: socket.socket, max_fds: int = 0) -> tuple[dict[str, Any] | None, list[int]]:
    """One frame of :mod:`elasticd.local.wire` (None at EOF) and the descriptors sent with its
    first bytes."""
    head, fds = b"", []
    if max_fds:
        head, fds, _flags, _addr = socket.recv_fds(sock, wire.LENGTH.size, max_fds)
        if not head:
            return None, fds
    return wire.recv_frame(sock, MAX_REQUEST, head), fds


def peer_allowed(peer_uid: int, my_uid: int) -> bool:
    """Only this zygote's user, or root, may have code run as that user."""
    return peer_uid in (my_uid, 0)


def connect(name: str, expected_pid: int | None, timeout: float | None = None) -> socket.socket:
    """A connection to the zygote ``name``, checked before a byte is sent
    (:func:`elasticd.local.worker_link.connect_checked`): the zygote runs as the job's user, as
    the worker does, so a server of any other uid (root included: the daemon never runs a
    zygote as root for a non-root job) is someone who bound the name first.
    """
    return connect_checked(address(name), expected_pid, timeout, "its server", "the job's zygote")


def wait_ready(name: str, expected_pid: int | None, timeout: float) -> str:
    """Waits until the zygote ``name`` has preloaded (it accepts only then); "" once it has,
    else why not (a squatter on the name, or ``timeout`` seconds passed). Why the agent asks
    before a join: the module docstring (a rejoin stopped the others for 3.0 s, 2.7 s of them
    this wait). No argv, environment or descriptor is sent.
    """
    from elasticd.clock import SYSTEM_CLOCK as clock  # light: warm_start imports this module

    deadline = clock.monotonic() + timeout
    why = f"zygote {name!r} did not answer within {timeout:.0f} s"
    while True:
        left = deadline - clock.monotonic()
        if left <= 0:
            return why
        if expected_pid is not None and not os.path.exists(f"/proc/{expected_pid}"):
            return f"zygote {name!r} (pid {expected_pid}) is gone"
        try:
            with connect(name, expected_pid, left) as sock:
                send_msg(sock, {"ready": True})
                reply, _ = recv_msg(sock)
            if reply is not None and reply.get("ready") is True:
                return ""
            why = f"zygote {name!r} gave no answer"
        except Untrusted as exc:
            return f"zygote {name!r} refused: {exc}"
        except socket.timeout:
            return why
        except (OSError, ValueError) as exc:  # not bound yet (refused), or gone
            why = f"zygote {name!r} unreachable ({exc})"
        clock.sleep(min(0.1, max(0.0, deadline - clock.monotonic())))


# -- the zygote --------------------------------------------------------------------------


def serve(name: str) -> int:
    """Listens on ``name``, preloads, then forks a worker for every request until killed."""
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(address(name))
    server.listen(64)
    for module in PRELOAD:
        try:
            __import__(module)
        except Exception as exc:  # noqa: BLE001 — a module the script may not need
            print(f"elasticd zygote: preloading {module} failed: {exc}", file=sys.stderr)
    # The preloaded objects (~285,000 with torch._dynamo) are never garbage: freezing them
    # keeps a worker's collections from walking them, each walk a 0.3 s pause that also
    # copies every page it touches (measured in a forked worker: full collection 0.30-0.37 s
    # unfrozen, under 1 ms frozen).
    gc.collect()
    gc.freeze()
    print(f"elasticd zygote {name}: ready (pid {os.getpid()})", file=sys.stderr, flush=True)
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    while True:
        conn, _ = server.accept()
        try:
            _start(conn)
        except Exception as exc:  # noqa: BLE001 — one bad request must not end the zygote
            print(f"elasticd zygote: request refused: {exc}", file=sys.stderr, flush=True)
            conn.close()


def _start(conn: socket.socket) -> None:
    _pid, uid, _gid = peer_credentials(conn)
    if not peer_allowed(uid, os.getuid()):
        raise PermissionError(f"uid {uid} may not start workers as uid {os.getuid()}")
    request, fds = recv_msg(conn, max_fds=3)
    if request is not None and request.get("ready") is True and not fds:
        # The agent asks before it joins a round (wait_ready): accepting at all means the
        # preload is done.
        send_msg(conn, {"ready": True})
        conn.close()
        return
    try:  # the parent keeps none of the worker's descriptors
        if request is None or len(fds) != 3:
            raise ValueError("incomplete request (need argv, env, cwd and 3 descriptors)")
        if _hung_up(conn):
            # The request waited in the backlog while this zygote preloaded, and its warm_start
            # is gone (torchrun stopped a worker group that had not started yet: a bigger round
            # came). Forking it would run a worker of a group that no longer exists, beside the
            # new one (seen in CI: a world-2 and a world-3 group trained side by side).
            raise ConnectionAbortedError("its warm_start went away before the worker started")
        pid = os.fork()
        if pid == 0:  # the worker; never returns
            conn.close()
            _run_child(request, fds)
    finally:
        for fd in fds:
            os.close(fd)
    try:
        send_msg(conn, {"pid": pid})
    except OSError:
        # warm_start went away between the check and the fork: nobody watches this worker.
        kill_group(pid)
        os.waitpid(pid, 0)
        raise
    threading.Thread(target=_watch, args=(conn, pid), daemon=True,
                     name=f"zygote-watch-{pid}").start()


def _hung_up(conn: socket.socket) -> bool:
    """Whether the client closed its end (warm_start sends nothing after its request)."""
    try:
        return conn.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT) == b""
    except BlockingIOError:
        return False
    except OSError:
        return True


def _watch(conn: socket.socket, pid: int) -> None:
    """Reports the child's exit; kills the child if its warm_start goes away first."""
    orphaned = False
    while True:
        ready, _, _ = select.select([conn], [], [], 0.05)
        if ready and not orphaned:
            try:
                data = conn.recv(4096)
            except OSError:
                data = b""
            if not data:  # warm_start died (SIGKILL): its worker must not outlive it
                orphaned = True
                kill_group(pid)
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            break
    if not orphaned:
        result = ({"signal": os.WTERMSIG(status)} if os.WIFSIGNALED(status)
                  else {"exit": os.waitstatus_to_exitcode(status)})
        with contextlib.suppress(OSError):
            send_msg(conn, result)
    conn.close()


def kill_group(pid: int) -> None:
    """SIGKILLs the process group ``pid`` leads (it and what it started), else ``pid`` alone."""
    try:
        os.killpg(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signal.SIGKILL)


def _run_child(request: dict[str, Any], fds: list[int]) -> None:
    code = 1
    try:
        os.setsid()  # the child's group holds whatever it starts; killed as one
        for target, fd in enumerate(fds):
            os.dup2(fd, target)
            os.close(fd)
        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGCHLD):
            signal.signal(sig, signal.SIG_DFL)
        if "torch" in sys.modules:  # imported here: warm_start imports this module too
            from elasticd.agent import store_connect

            store_connect.install()
        code = run_script(request["argv"], request["env"], request["cwd"])
    except BaseException:  # noqa: BLE001 — report anything, then leave without cleanup
        traceback.print_exc()
    finally:
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):  # noqa: BLE001
                stream.flush()
        os._exit(code)


def run_script(argv: list[str], env: dict[str, str], cwd: str) -> int:
    """Runs ``argv[0]`` as ``__main__`` in this process, as ``python -u`` would; returns the
    exit code."""
    import random
    import runpy

    os.chdir(cwd)
    os.environ.clear()
    os.environ.update(env)
    sys.argv = list(argv)
    # As ``python script.py`` would: the script's directory first on sys.path. The zygote runs
    # without the working directory on sys.path (supervisor.safe_module): nothing to replace.
    sys.path.insert(0, os.path.dirname(os.path.abspath(argv[0])))
    random.seed()
    numpy = sys.modules.get("numpy")
    if numpy is not None:
        numpy.random.seed()
    sys.stdout.reconfigure(line_buffering=True)
    sys.stderr.reconfigure(line_buffering=True)
    try:
        runpy.run_path(argv[0], run_name="__main__")
    except SystemExit as exc:
        return exit_status(exc.code)
    except BaseException:  # noqa: BLE001 — as the interpreter does: traceback, exit 1
        traceback.print_exc()
        return 1
    return 0


def exit_status(code: object) -> int:
    """The status the interpreter exits with after ``sys.exit(code)`` (another object than an
    int or None is printed, status 1)."""
    if code is None or isinstance(code, int):
        return (code or 0) & 0xFF
    print(code, file=sys.stderr)
    return 1


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    name = os.environ.get(ZYGOTE_ENV, "")
    if args or not name:
        # Not in argv: ps shows argv to every local user, who could bind the name first.
        print(f"usage: {ZYGOTE_ENV}=NAME python -m elasticd.agent.zygote", file=sys.stderr)
        return 2
    return serve(name)


if __name__ == "__main__":
    sys.exit(main())
