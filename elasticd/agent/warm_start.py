"""What torchrun runs as each worker when warm starts are on: hands the script to the zygote.

``python -m elasticd.agent.warm_start SCRIPT ARGS...`` (torchrun's ``--module``) connects to the
job's zygote (:mod:`elasticd.agent.zygote`, named by ``ELASTICD_ZYGOTE``), sends it the script,
the arguments, this process's environment (torchrun's ``RANK``, ``MASTER_ADDR``, ...) and
working directory, and its stdin/stdout/stderr — once the kernel says the server runs as this
worker's user (and is the zygote's pid, ``ELASTICD_ZYGOTE_PID``) — then stands in for the forked
worker: it forwards the signals torchrun sends, and exits with the worker's code or dies of the
worker's signal. If it dies itself (SIGKILL), the zygote kills the worker. Without a reachable
zygote it execs the script in a fresh interpreter (a cold start), so the job runs either way.

Imports nothing heavy: this process starts on the recovery path.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys

from elasticd.agent.zygote import (
    ZYGOTE_ENV,
    ZYGOTE_PID_ENV,
    Untrusted,
    connect,
    recv_msg,
    send_msg,
)

FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2)


def _cold(argv: list[str], why: str) -> None:
    print(f"elasticd warm start: {why}; starting {argv[0]} in a new interpreter",
          file=sys.stderr, flush=True)
    os.execv(sys.executable, [sys.executable, "-u", *argv])


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if not args:
        print("usage: python -m elasticd.agent.warm_start SCRIPT [ARGS...]", file=sys.stderr)
        return 2
    args[0] = os.path.abspath(args[0])
    name = os.environ.get(ZYGOTE_ENV)
    if not name:
        _cold(args, f"{ZYGOTE_ENV} is not set")
    expected = os.environ.get(ZYGOTE_PID_ENV, "")
    try:
        # Before a byte of argv or environment: is this the job's zygote, or a squatter?
        sock = connect(name, int(expected) if expected.isdigit() else None)
        send_msg(sock, {"argv": args, "env": dict(os.environ), "cwd": os.getcwd()}, [0, 1, 2])
        reply, _ = recv_msg(sock)
    except Untrusted as exc:
        _cold(args, f"zygote {name!r} refused: {exc}")
    except (OSError, ValueError) as exc:
        _cold(args, f"zygote {name!r} unreachable ({exc})")
    if reply is None or "pid" not in reply:
        _cold(args, f"zygote {name!r} refused the worker")
    child = int(reply["pid"])

    def forward(sig: int, _frame: object) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(child, sig)

    for sig in FORWARDED:
        signal.signal(sig, forward)
    result, _ = recv_msg(sock)  # a forwarded signal does not interrupt it (PEP 475)
    if result is None:  # the zygote died: the worker's fate is unknown
        print("elasticd warm start: the zygote went away", file=sys.stderr, flush=True)
        return 1
    if "signal" in result:
        sig = int(result["signal"])
        signal.signal(sig, signal.SIG_DFL)
        os.kill(os.getpid(), sig)
        return 128 + sig
    return int(result.get("exit", 1))


if __name__ == "__main__":
    sys.exit(main())
