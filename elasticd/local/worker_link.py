"""The worker link: a torchrun agent's channel to its own workers in in-process mode (issue 31).

The agent (:mod:`elasticd.agent.worker_link`, the server) listens on an abstract Unix socket
named by a random token it puts in its environment (:data:`LINK_ENV`, with its pid in
:data:`LINK_PID_ENV`); torchrun and the zygote pass both on to every worker, which connects
(:func:`connect`, from :mod:`elasticd.worker.in_process`). Frames are the daemon channel's
(:mod:`elasticd.local.wire`: length-prefixed JSON objects). Both ends check the other's kernel
credentials (``SO_PEERCRED``): the worker talks only to a server of its own uid and of the
agent's pid, the agent admits only its own uid (or root), so no other local user can steer a
job's workers or learn their ranks.

Messages::

    worker -> agent  {"op": "hello", "local_rank": int, "pid": int}
                     {"op": "left", "round": int, "clean": bool, "why": str}
                     {"op": "timeout", "seconds": float, "source": str}
                                                         its group's collective timeout now
    agent -> worker  {"op": "abort", "round": int}       leave the group of round ``round``
                     {"op": "assign", "env": {str: str}} the new round's torchrun environment

Both ends import this module, so it uses the standard library only.
"""

from __future__ import annotations

import json
import os
import socket
import struct
from typing import Any, Mapping

from elasticd.errors import LocalProtocolError
from elasticd.local import wire

LINK_ENV = "ELASTICD_LINK"
LINK_PID_ENV = "ELASTICD_LINK_PID"
#: The round number the agent gives its workers (fresh ones through the environment).
ROUND_ENV = "ELASTICD_ROUND"
#: Where the workers an agent restarts on its node (a fallback) were in the round before: JSON
#: ``{"ranks": [rank of local rank 0, ...], "world_size": n}`` (:func:`places_env`). Each
#: worker offers its old rank's snapshots, which its node's RAM still holds, to the restore's
#: agreement as a survivor does (:func:`previous_place`); a new node's workers get none.
PREVIOUS_ENV = "ELASTICD_PREVIOUS_PLACES"
#: Set ("1") for a worker its agent started before the node's first round (a staged newcomer):
#: it has no place yet (torch's placeholders, rank -1), waits at its training function's entry
#: for its first ``assign`` and makes no group and writes nothing for a rank before it
#: (:func:`staged`; the agent: :mod:`elasticd.agent.in_process_agent`).
STAGED_ENV = "ELASTICD_STAGED"
#: A link message is a few hundred bytes (an ``assign`` carries a dozen variables).
MAX_MESSAGE = 64 << 10


class Untrusted(LocalProtocolError):
    """The server of a link's or a zygote's name is not the one expected (someone bound it
    first)."""


def staged(environ: Mapping[str, str]) -> bool:
    """Whether this process is a staged worker still waiting for its first round
    (:data:`STAGED_ENV`)."""
    return environ.get(STAGED_ENV) == "1"


def address(name: str) -> str:
    """The abstract socket address for the link ``name`` (no file to clean up or leak)."""
    return "\0elasticd-link-" + name


def places_env(places: Any) -> str | None:
    """:data:`PREVIOUS_ENV`'s value for workers of ``places`` (torch's ``Worker`` objects of
    one round: ``local_rank``, ``global_rank``, ``world_size``), or None when they had no
    round (a first start: torch's placeholders have rank -1)."""
    ranks = {w.local_rank: w.global_rank for w in places}
    worlds = {w.world_size for w in places}
    if (not ranks or sorted(ranks) != list(range(len(ranks))) or len(worlds) != 1
            or min(ranks.values()) < 0 or min(worlds) < 1):
        return None
    return json.dumps({"ranks": [ranks[i] for i in range(len(ranks))],
                       "world_size": worlds.pop()})


def previous_place(environ: Mapping[str, str]) -> tuple[int, int] | None:
    """(rank, world size) this worker's local rank had in the round before its agent restarted
    it (:data:`PREVIOUS_ENV`), or None: not restarted so, or a value that does not parse (then
    the worker restores as a fresh one: nothing of its own offered is always safe)."""
    text = environ.get(PREVIOUS_ENV, "")
    if not text:
        return None
    try:
        value = json.loads(text)
        ranks, world = value["ranks"], value["world_size"]
        local = int(environ.get("LOCAL_RANK", ""))
        rank = ranks[local] if local >= 0 else None
    except (ValueError, TypeError, KeyError, IndexError):
        return None
    if type(rank) is not int or type(world) is not int or not 0 <= rank < world:
        return None
    return rank, world


def peer_credentials(sock: socket.socket) -> tuple[int, int, int]:
    """(pid, uid, gid) of the other end, from the kernel (``SO_PEERCRED``)."""
    creds = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    return struct.unpack("3i", creds)


def send(sock: socket.socket, msg: dict[str, Any]) -> None:
    """Sends one message. Raises: OSError (the other end is gone), wire.FrameError."""
    sock.sendall(wire.encode(msg))


def recv(sock: socket.socket) -> dict[str, Any] | None:
    """One message, or None at the end of the stream.

    Raises:
        wire.FrameError: a frame over :data:`MAX_MESSAGE` or not a JSON object.
        OSError: the connection failed.
    """
    return wire.recv_frame(sock, MAX_MESSAGE)


def connect(name: str, expected_pid: int | None) -> socket.socket:
    """The worker's connection to its agent's link ``name``, checked before a byte is sent
    (:func:`connect_checked`)."""
    return connect_checked(address(name), expected_pid, None, "link server", "the agent")


def connect_checked(addr: str, expected_pid: int | None, timeout: float | None, server: str,
                    expected: str) -> socket.socket:
    """A connection to the abstract socket ``addr``, checked before a byte is sent: the kernel
    must say its ``server`` runs as this process's user (and is ``expected_pid``, when given):
    abstract names are host-wide, and any local user may bind a free one first.

    Raises:
        Untrusted: the server runs as another uid, or is not ``expected_pid`` (``expected``
            names what that pid is).
        OSError: nobody listens on the name, or ``timeout`` passed.
    """
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.settimeout(timeout)
        sock.connect(addr)
        pid, uid, _gid = peer_credentials(sock)
        if uid != os.getuid():
            raise Untrusted(f"{server} runs as uid {uid}, not as this worker's uid {os.getuid()}")
        if expected_pid is not None and pid != expected_pid:
            raise Untrusted(f"{server} is pid {pid}, not {expected} (pid {expected_pid})")
        return sock
    except BaseException:
        sock.close()
        raise
