"""The worker's end of the local channel to its node's daemon.

Every training process that elasticd launched (through torchrun) inherits ``ELASTICD_SOCKET``,
the path of its daemon's Unix socket, and talks to it through a :class:`DaemonClient`: one
long-lived connection per process, opened on first use and re-opened once per call when the
daemon was restarted. Two kinds of calls:

* :meth:`DaemonClient.call` — a request and its reply, with a timeout; the daemon's refusal is a
  :class:`DaemonError`, a missing daemon a :class:`DaemonUnavailable`.
  A reply may hand over open file descriptors (a checkpoint slot the daemon verified):
  they arrive as ``SCM_RIGHTS`` with the reply's first bytes and are returned, open, in
  ``reply["_fds"]`` — the caller owns and closes them.
* :meth:`DaemonClient.send` — one-way (``"noreply"``), for the hot path: a single non-blocking
  ``send`` of a few dozen bytes. When the daemon is gone or behind, the message is dropped and
  counted, never raised: a progress report must not stop training.

Standard library only, and nothing imported from elasticd but the framing: this module is loaded
into every worker. A process forked from a connected one (e.g. a DataLoader worker) opens its own
connection rather than writing into its parent's.
"""

from __future__ import annotations

import array
import collections
import contextlib
import dataclasses
import itertools
import logging
import math
import os
import select
import socket
import threading
from typing import Any, Mapping

from elasticd.clock import SYSTEM_CLOCK
from elasticd.errors import LocalProtocolError
from elasticd.worker.transport import Transport
from elasticd.local.wire import (
    DEFAULT_MAX_MESSAGE,
    LENGTH,
    FrameError,
    check_length,
    close_fds,
    decode,
    encode,
)

__all__ = ["DaemonClient", "DaemonClientError", "DaemonError", "DaemonTimeout",
           "DaemonUnavailable", "PendingCall", "SOCKET_ENV", "WorkerIdentity"]

log = logging.getLogger(__name__)

SOCKET_ENV = "ELASTICD_SOCKET"
JOB_ENV = "ELASTICD_JOB"
_SEND_FLAGS = socket.MSG_DONTWAIT | socket.MSG_NOSIGNAL
_RECONNECT_BACKOFF = 1.0  # after a failed connect, one-way sends drop without retrying this long
_CONNECT_TIMEOUT = 1.0
_MAX_FDS = 8  # descriptors one read may carry (a reply carries at most one today)
_ANCILLARY = socket.CMSG_SPACE(_MAX_FDS * array.array("i").itemsize)
_RECV_FLAGS = socket.MSG_DONTWAIT | getattr(socket, "MSG_CMSG_CLOEXEC", 0)


class DaemonClientError(LocalProtocolError):
    """Base class of the errors a :class:`DaemonClient` raises."""


class DaemonError(DaemonClientError):
    """The daemon answered with an error.

    Attributes:
        error: the daemon's message.
    """

    def __init__(self, op: str, error: str) -> None:
        super().__init__(f"elasticd refused {op!r}: {error}")
        self.op, self.error = op, error


class DaemonUnavailable(DaemonClientError):
    """There is no daemon to talk to (``ELASTICD_SOCKET`` unset, or the daemon is gone)."""


class DaemonTimeout(DaemonUnavailable):
    """The daemon did not answer within the call's timeout."""


#: The variables :meth:`WorkerIdentity.from_env` reads, in the order of its fields.
_IDENTITY_VARS = (JOB_ENV, "RANK", "LOCAL_RANK", "WORLD_SIZE", "GROUP_RANK",
                  "TORCHELASTIC_RESTART_COUNT")


@dataclasses.dataclass(frozen=True)
class WorkerIdentity:
    """Who this process is, as elasticd and torchrun told it through the environment.

    Attributes:
        job: ``ELASTICD_JOB``.
        rank, local_rank, world_size, group_rank: torchrun's ``RANK``, ``LOCAL_RANK``,
            ``WORLD_SIZE`` and ``GROUP_RANK`` (the node's rank).
        restart_count: ``TORCHELASTIC_RESTART_COUNT``, how often the agent restarted workers.
    """

    job: str | None = None
    rank: int | None = None
    local_rank: int | None = None
    world_size: int | None = None
    group_rank: int | None = None
    restart_count: int | None = None

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> "WorkerIdentity":
        """Reads the identity; variables that are unset stay None.

        Raises:
            ValueError: a variable is set to something that is not an integer.
        """
        env = os.environ if environ is None else environ

        def number(name: str) -> int | None:
            raw = env.get(name)
            if raw is None or raw == "":
                return None
            try:
                return int(raw)
            except ValueError as exc:
                raise ValueError(f"{name}={raw!r} is not an integer") from exc

        return cls(env.get(JOB_ENV) or None, *map(number, _IDENTITY_VARS[1:]))


def _identity_raw(environ: Mapping[str, str] | None) -> tuple[str | None, ...] | None:
    """The identity's variables as set in ``environ`` (None without one): compared before
    parsing, so a progress report costs a few lookups while nothing changed."""
    return None if environ is None else tuple(environ.get(n) for n in _IDENTITY_VARS)


class DaemonClient(Transport):
    """A connection to the node's daemon, shared by every thread of one worker process.

    Args:
        identity: who this worker is (sent with progress reports).
        timeout: default seconds a :meth:`call` waits for its reply.
        max_message: the largest reply accepted, in bytes.
        environ: where ``identity`` came from (:meth:`from_env`): read again at each
            progress report, since under ``@elasticd.in_process`` a re-formed round gives
            the same process another rank and world size (the worker's environment is
            updated with the round's); None: ``identity`` stays as given.

    Attributes:
        dropped: one-way messages dropped because the daemon was gone or behind.
    """

    def __init__(self, path: str, identity: WorkerIdentity = WorkerIdentity(),
                 timeout: float = 10.0, max_message: int = DEFAULT_MAX_MESSAGE,
                 environ: Mapping[str, str] | None = None) -> None:
        if timeout <= 0:
            raise ValueError(f"timeout must be positive, got {timeout!r}")
        self.path, self.identity, self.timeout, self.max_message = (
            path, identity, timeout, max_message)
        self._environ = environ
        self._identity_raw = _identity_raw(environ)
        self.dropped = 0
        self._ids = itertools.count(1)
        self._init_process_state()

    def _init_process_state(self) -> None:
        # Per process: a forked child must neither share its parent's connection nor inherit
        # a lock some other parent thread held at the fork.
        self._pid = os.getpid()
        self._call_lock = threading.Lock()  # one call waits for its reply at a time
        self._write_lock = threading.Lock()  # whole frames, and the connection's replacement
        self._sock: socket.socket | None = None
        self._poll: Any = None
        self._rbuf = bytearray()
        self._fds: collections.deque[int] = collections.deque()  # received, not yet claimed
        self._retry_at = 0.0
        self._dropping = False

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None,
                 timeout: float = 10.0) -> "DaemonClient":
        """A client for the daemon named by ``ELASTICD_SOCKET``, with the worker's identity.

        Raises:
            DaemonUnavailable: ``ELASTICD_SOCKET`` is not set.
            ValueError: a torchrun variable (``RANK``…) is not an integer.
        """
        env = os.environ if environ is None else environ
        path = env.get(SOCKET_ENV)
        if not path:
            raise DaemonUnavailable(
                f"{SOCKET_ENV} is not set: this process was not started by elasticd (run the "
                f"job through elasticd, or point {SOCKET_ENV} at the node daemon's socket)")
        return cls(path, WorkerIdentity.from_env(env), timeout=timeout, environ=env)

    # -- calls ----------------------------------------------------------------------------

    def call(self, op: str, *, timeout: float | None = None, **fields: Any) -> dict[str, Any]:
        """Sends a request and returns the reply's fields (without ``id`` and ``ok``); file
        descriptors the daemon handed over are in ``"_fds"`` (open: the caller closes them).

        A connection found broken while sending (the daemon restarted) is re-opened once and
        the request sent again; one that breaks after the request went out is not, since the
        daemon may have acted on it.

        Args:
            timeout: seconds to wait for the reply (default: the client's); not sent.

        Raises:
            DaemonError: the daemon answered with an error.
            DaemonTimeout: no reply in time.
            DaemonUnavailable: no daemon at the socket, or it went away mid-call.
            ValueError: ``fields`` cannot be encoded as JSON, or include ``noreply``.
        """
        return self.start(op, timeout=timeout, **fields).result()

    def start(self, op: str, *, timeout: float | None = None,
              **fields: Any) -> "PendingCall":
        """Sends a request now and returns at once; :meth:`PendingCall.result` waits for the
        reply, as :meth:`call` does (same errors). The daemon works on the request while this
        thread does something else (the Checkpointer asks for its slot while it flattens).

        The connection takes one call at a time: until ``result()`` another thread's call
        waits, so take the result, or :meth:`PendingCall.close` it, on every path.

        Raises:
            DaemonUnavailable, DaemonTimeout: the request could not be sent.
            ValueError: as for :meth:`call`.
        """
        if "noreply" in fields:
            raise ValueError("call() waits for a reply; use send() for one-way messages")
        wait = self.timeout if timeout is None else timeout
        deadline = SYSTEM_CLOCK.monotonic() + wait
        rid = next(self._ids)
        frame = encode({**fields, "op": op, "id": rid})
        self._check_fork()
        self._call_lock.acquire()
        try:
            sock = self._send_request(op, frame, deadline, wait)
        except BaseException:
            self._call_lock.release()
            raise
        return PendingCall(self, sock, op, rid, deadline, wait)

    def send(self, op: str, **fields: Any) -> bool:
        """Sends a one-way message; never waits for the daemon and never raises if it is gone.

        Returns:
            True if the message was handed to the kernel, False if it was dropped (counted in
            :attr:`dropped`).

        Raises:
            ValueError: ``fields`` cannot be encoded as JSON (a bug in the caller).
        """
        frame = encode({**fields, "op": op, "noreply": True})
        self._check_fork()
        # The write lock is held for one non-blocking write, so this usually waits
        # microseconds; but a call() pushing a request into a full socket (a stuck daemon)
        # holds it until its own timeout, and a progress report must not wait for that.
        if not self._write_lock.acquire(timeout=0.05):
            return self._dropped("another thread is stuck writing to the daemon")
        try:
            for attempt in (0, 1):
                sock = self._sock
                if sock is None:
                    if SYSTEM_CLOCK.monotonic() < self._retry_at:
                        return self._dropped("the daemon was unreachable a moment ago")
                    try:
                        sock = self._connect(_CONNECT_TIMEOUT)
                    except DaemonUnavailable as exc:
                        self._retry_at = SYSTEM_CLOCK.monotonic() + _RECONNECT_BACKOFF
                        return self._dropped(str(exc))
                try:
                    sent = sock.send(frame, _SEND_FLAGS)
                except BlockingIOError:
                    return self._dropped("the daemon is not keeping up (socket buffer full)")
                except OSError as exc:
                    self._disconnect()
                    if attempt == 0:
                        continue  # the daemon restarted: one reconnect
                    return self._dropped(f"connection to the daemon broke: {exc}")
                if sent < len(frame) and not self._finish_write(sock, frame, sent,
                                                                SYSTEM_CLOCK.monotonic() + 1.0):
                    self._disconnect()  # half a frame is out: this stream is unusable
                    return self._dropped("the daemon stopped reading mid-message")
                if self._dropping:
                    self._dropping = False
                    log.info("elasticd reachable again at %s (%d messages dropped so far)",
                             self.path, self.dropped)
                return True
            return False  # not reached: the loop returns
        finally:
            self._write_lock.release()

    def progress(self, step: int, compute_seconds: float | None = None) -> bool:
        """Reports that this worker reached ``step`` (one-way; see :meth:`send`), with the
        step's compute time outside collectives when measured."""
        ident = self._current_identity()
        extra = {}
        if compute_seconds is not None and math.isfinite(compute_seconds):
            extra["compute_seconds"] = float(compute_seconds)
        return self.send("progress", step=int(step), rank=ident.rank,
                         local_rank=ident.local_rank, pid=os.getpid(), job=ident.job,
                         world_size=ident.world_size, restart=ident.restart_count, **extra)

    def _current_identity(self) -> WorkerIdentity:
        """:attr:`identity`, read again from the environment when it changed there (a
        re-formed round). A new rank also gets a new connection: the daemon binds a
        connection's writes to the first rank it wrote for (``daemon/local_binding.py``), and
        every connection of one process to one rank, so the old one is closed first."""
        raw = _identity_raw(self._environ)
        if raw == self._identity_raw:
            return self.identity
        self._identity_raw = raw
        try:
            now = WorkerIdentity.from_env(self._environ)
        except ValueError as exc:
            log.warning("elasticd: keeping this worker's identity (rank %s): %s",
                        self.identity.rank, exc)
            return self.identity
        moved, self.identity = now.rank != self.identity.rank, now
        if moved:
            self.close()
        return now

    def close(self) -> None:
        """Closes the connection (the next call opens a new one)."""
        with self._write_lock:
            self._disconnect()

    def __enter__(self) -> "DaemonClient":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- internals ------------------------------------------------------------------------

    def _check_fork(self) -> None:
        if os.getpid() != self._pid:
            inherited = self._sock
            self._init_process_state()
            if inherited is not None:
                inherited.close()  # only this process's copy: the parent keeps its connection

    def _connect(self, timeout: float) -> socket.socket:
        """Opens the connection (caller holds the write lock)."""
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(max(timeout, 1e-3))
        try:
            sock.connect(self.path)
        except OSError as exc:
            sock.close()
            why = {FileNotFoundError: f"no elasticd socket at {self.path} ({SOCKET_ENV}): the "
                                      "daemon is gone or has not started",
                   ConnectionRefusedError: f"nobody listens on {self.path} ({SOCKET_ENV}): the "
                                           "elasticd daemon is gone",
                   PermissionError: f"permission denied on {self.path}: uid {os.geteuid()} "
                                    "may not use this elasticd's socket"}
            raise DaemonUnavailable(why.get(type(exc), f"cannot reach elasticd at {self.path}: "
                                            f"{exc}")) from exc
        # Blocking mode from here on: one-way sends pass MSG_DONTWAIT and cost one syscall;
        # calls wait in poll() with their own deadline.
        sock.settimeout(None)
        self._sock = sock
        self._poll = select.poll()
        self._poll.register(sock, select.POLLIN)
        self._rbuf = bytearray()
        return sock

    def _disconnect(self) -> None:
        if self._sock is not None:
            self._sock.close()
        self._sock, self._poll, self._rbuf = None, None, bytearray()
        close_fds(self._fds)
        self._fds.clear()

    def _dropped(self, reason: str) -> bool:
        self.dropped += 1
        if not self._dropping:
            self._dropping = True
            log.warning("dropping one-way messages to elasticd (%s); training goes on, "
                        "but the daemon cannot see this worker's progress", reason)
        return False

    def _send_request(self, op: str, frame: bytes, deadline: float,
                      wait: float) -> socket.socket:
        with self._write_lock:
            for attempt in (0, 1):
                sock = self._sock or self._connect(deadline - SYSTEM_CLOCK.monotonic())
                try:
                    if self._finish_write(sock, frame, 0, deadline):
                        return sock
                except OSError as exc:
                    self._disconnect()
                    if attempt == 0:
                        continue  # broken before the request went out: reconnect once
                    raise DaemonUnavailable(f"connection to elasticd at {self.path} broke "
                                            f"while sending {op!r}: {exc}") from exc
                self._disconnect()  # part of the frame may be out: the stream is unusable
                raise DaemonTimeout(f"elasticd at {self.path} did not take {op!r} within "
                                    f"{wait:g} s")
        raise AssertionError("unreachable")

    def _finish_write(self, sock: socket.socket, frame: bytes, sent: int,
                      deadline: float) -> bool:
        """Writes ``frame[sent:]``; False when the deadline passes first. OSError propagates."""
        view = memoryview(frame)
        while sent < len(frame):
            try:
                sent += sock.send(view[sent:], _SEND_FLAGS)
            except BlockingIOError:
                left = deadline - SYSTEM_CLOCK.monotonic()
                if left <= 0:
                    return False
                select.select([], [sock], [], left)
        return True

    def _await_reply(self, sock: socket.socket, op: str, rid: int, deadline: float,
                     wait: float) -> dict[str, Any]:
        while True:
            msg = self._read_frame(sock, op, deadline, wait)
            got = msg.get("id")
            if got == rid:
                return msg
            close_fds(msg.pop("_fds", ()))
            if got is None:
                # About the connection, not a request (refused, or a frame it could not read);
                # the daemon closes it.
                self._lost(sock)
                raise DaemonError(op, str(msg.get("error", "connection refused")))
            # Otherwise the late reply of an earlier call that timed out: skip it.

    def _read_frame(self, sock: socket.socket, op: str, deadline: float,
                    wait: float) -> dict[str, Any]:
        buf = self._rbuf
        while True:
            if len(buf) >= LENGTH.size:
                (length,) = LENGTH.unpack_from(buf)
                try:
                    check_length(length, self.max_message)
                    end = LENGTH.size + length
                    if len(buf) >= end:
                        body = bytes(buf[LENGTH.size:end])
                        del buf[:end]
                        return self._claim_fds(decode(body))
                except FrameError as exc:
                    self._lost(sock)
                    raise DaemonUnavailable(f"elasticd sent a bad frame: {exc}") from exc
            left = deadline - SYSTEM_CLOCK.monotonic()
            if left <= 0:
                # The connection stays: the late reply is recognised by its id and skipped.
                raise DaemonTimeout(f"elasticd at {self.path} did not answer {op!r} within "
                                    f"{wait:g} s")
            poller = self._poll
            if poller is None:  # another thread found the connection broken
                raise DaemonUnavailable(f"connection to elasticd at {self.path} was closed "
                                        f"while waiting for {op!r}")
            if not poller.poll(int(left * 1000) + 1):
                continue
            try:
                chunk, ancillary, flags, _ = sock.recvmsg(65536, _ANCILLARY, _RECV_FLAGS)
            except BlockingIOError:
                continue
            except OSError as exc:
                self._lost(sock)
                raise DaemonUnavailable(f"connection to elasticd at {self.path} broke while "
                                        f"waiting for {op!r}: {exc}") from exc
            for level, kind, data in ancillary:
                if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                    fds = array.array("i")
                    fds.frombytes(data[: len(data) - len(data) % fds.itemsize])
                    self._fds.extend(fds)
            if flags & socket.MSG_CTRUNC:
                self._lost(sock)  # some descriptors were dropped: replies cannot be matched
                raise DaemonUnavailable(f"elasticd at {self.path} sent more descriptors than "
                                        "one read takes")
            if not chunk:
                self._lost(sock)
                raise DaemonUnavailable(
                    f"elasticd at {self.path} closed the connection before answering {op!r} "
                    "(it may or may not have acted on it)")
            buf += chunk

    def _claim_fds(self, msg: dict[str, Any]) -> dict[str, Any]:
        """Moves the descriptors a frame announces (``nfds``) from the received queue into
        ``msg["_fds"]``: they arrived with the frame's first bytes, so they are first in line.

        Raises:
            FrameError: the frame announces descriptors that did not arrive.
        """
        count = msg.pop("nfds", 0)
        if not count:
            return msg
        if type(count) is not int or not 0 < count <= len(self._fds):
            raise FrameError(f"the reply announces {count!r} descriptors; "
                             f"{len(self._fds)} arrived")
        msg["_fds"] = [self._fds.popleft() for _ in range(count)]
        return msg

    def _lost(self, sock: socket.socket) -> None:
        with self._write_lock:
            if self._sock is sock:
                self._disconnect()


class PendingCall:
    """A request :meth:`DaemonClient.start` sent, whose reply is not read yet."""

    def __init__(self, client: DaemonClient, sock: socket.socket, op: str, rid: int,
                 deadline: float, wait: float) -> None:
        self._client, self._sock, self.op = client, sock, op
        self._rid, self._deadline, self._wait = rid, deadline, wait
        self._done = False

    def result(self) -> dict[str, Any]:
        """The reply's fields, as :meth:`DaemonClient.call` returns them (once).

        Raises:
            DaemonError, DaemonTimeout, DaemonUnavailable: as for :meth:`DaemonClient.call`.
        """
        if self._done:
            raise RuntimeError(f"the reply to {self.op!r} was already taken")
        self._done = True
        try:
            reply = self._client._await_reply(self._sock, self.op, self._rid, self._deadline,
                                              self._wait)
        finally:
            self._client._call_lock.release()
        if reply.get("ok") is not True:
            raise DaemonError(self.op, str(reply.get("error", "no reason given")))
        reply.pop("id", None)
        reply.pop("ok", None)
        return reply

    def close(self) -> None:
        """Reads and drops the reply if nobody took it (its descriptors closed), so the
        connection is free again; errors are not raised."""
        if not self._done:
            with contextlib.suppress(Exception):  # nobody wants this reply
                close_fds(self.result().get("_fds", ()))
