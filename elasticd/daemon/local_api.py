"""The daemon's local endpoint: a Unix-domain socket its node's training workers call.

Workers report progress every step (hang detection), and ask for shared-memory checkpoint slots,
announce finished snapshots and ask what to restore. The calls are tiny and frequent, so the
channel is a Unix stream socket with length-prefixed JSON frames (:mod:`elasticd.local.wire`), one
long-lived connection per worker process, and one thread per connection: a node runs a handful
of workers, and a thread blocked in ``recv`` costs nothing while idle (the daemon must stay under
2% of a core). Requests flagged ``"noreply"`` get no answer, so a progress report costs the
worker one ``send`` and never waits for the daemon.

Security: the socket file is created in a directory only the daemon can write, and every
connection's peer credentials (``SO_PEERCRED``, from the kernel) are checked before a byte is
read: the daemon's own uid only (the socket file then 0o600), or a
:class:`~elasticd.daemon.local_binding.CallerBinding` (the daemon's case: the file 0o666, whom
it admits and how requests are held: :mod:`.local_binding`). Handlers receive the credentials as
``msg["_peer"]`` (with ``"job"``, the job a bound connection belongs to), overwriting anything a
client put there. Linux only (``SO_PEERCRED``).

A reply may carry open file descriptors: a handler puts them in ``"_fds"`` (a list of ints it
hands over), and the reply goes out in one ``sendmsg`` with them as ``SCM_RIGHTS`` ancillary
data and ``"nfds"`` (their count) in the JSON; the daemon closes its copies once sent, or when
the reply cannot be sent. This is how a worker gets the very slot file the daemon verified
(:mod:`elasticd.store.service`) rather than re-opening a path.

A handler's exception becomes an error reply and a log line, never a dead server; oversized or
unparseable frames get an error reply when possible and close that connection only. No torch
here: this is daemon code.
"""

from __future__ import annotations

import array
import errno
import logging
import os
import socket
import stat
import struct
import threading
from typing import Any, Callable, Mapping

from elasticd.admission import shut
from elasticd.clock import Clock, SystemClock
from elasticd.daemon.local_binding import Caller, CallerBinding, CallerRefused
from elasticd.errors import NodeError
from elasticd.hooks import call_hooks
from elasticd.local.wire import (
    DEFAULT_MAX_MESSAGE,
    LENGTH,
    FrameError,
    RequestError,
    check_length,
    close_fds,
    decode,
    encode,
)
from elasticd.local.worker_link import peer_credentials

log = logging.getLogger(__name__)

#: Takes the request's fields (with ``_peer``) and returns the reply's (None for none; ``id``
#: and ``ok`` are the envelope's and get overwritten; ``_fds``: see above). Runs on the
#: connection's thread: handlers must be thread-safe, and quick — a slow handler delays only
#: its own worker's next call.
Handler = Callable[[dict[str, Any]], "dict[str, Any] | None"]

_MAX_UNIX_PATH = 107  # sun_path is 108 bytes including the terminating NUL
_REJECT_LINGER = 1.0
# A worker that does not read its replies for this long is disconnected, so it cannot pin a
# daemon thread forever.
_SEND_TIMEOUT = 10.0
# Refusals explained at once (each lingers up to _REJECT_LINGER on a thread); beyond that,
# refused connections are closed without a word, so that a local user who is refused cannot
# fill the connection cap the job's workers need.
_MAX_REJECTING = 8
# Connections served at once; further ones are refused with an error reply.
MAX_CONNECTIONS = 256


class LocalApiError(NodeError):
    """Base class of the local endpoint's start-up errors."""


class SocketInUse(LocalApiError):
    """A live process already serves the socket path (another daemon for this node?)."""


class UnsafeSocketPath(LocalApiError):
    """The socket path or its directory could let another user replace or plant the socket."""


class LocalServer:
    """Serves ``handlers`` on a Unix stream socket at ``path``.

    Args:
        path: where to create the socket. Its directory must be owned by the daemon's user and
            writable by nobody else; it is created (mode 0o711: others may traverse it to reach
            the socket, not list or write it) when missing.
        binding: admits and binds callers; without one only the daemon's own uid may connect.
        clock: injected time (how long a refused caller is given to read why).

    Raises:
        ValueError: ``path`` is longer than a Unix socket address holds.
    """

    def __init__(self, path: str, handlers: Mapping[str, Handler],
                 binding: CallerBinding | None = None, clock: Clock | None = None) -> None:
        path = os.path.abspath(path)
        if len(os.fsencode(path)) > _MAX_UNIX_PATH:
            raise ValueError(f"socket path {path!r} is longer than the {_MAX_UNIX_PATH} bytes "
                             "a Unix socket address holds; choose a shorter directory")
        self.path = path  # absolute: what workers get as ELASTICD_SOCKET
        self._handlers = dict(handlers)
        self._binding = binding
        self._callers: dict[socket.socket, Caller] = {}
        self._rejecting = 0
        #: Called with ``{"pid", "job"}`` when a connection ends (its process closed it or
        #: died): a worker's death is a moment of a recovery (daemon/recovery_timeline.py).
        self.on_close: list[Callable[[dict[str, Any]], None]] = []
        #: Called with ``(op, reply)`` when a reply could not be sent (its caller went away
        #: while the request ran, e.g. a worker killed during a long fetch): what the reply
        #: handed over (a read pin) must be given back, nobody else will.
        self.on_undelivered: list[Callable[[str, dict[str, Any]], None]] = []
        self.clock = clock or SystemClock()
        self._listener: socket.socket | None = None
        self._inode: tuple[int, int] | None = None
        self._accept_thread: threading.Thread | None = None
        self._lock = threading.Lock()
        self._conns: dict[socket.socket, threading.Thread] = {}
        self._stopping = False
        self._failures_logged: set[str] = set()

    # -- lifecycle ------------------------------------------------------------------------

    def start(self) -> None:
        """Creates the socket and starts accepting connections.

        Raises:
            SocketInUse: a live process serves ``path``.
            UnsafeSocketPath: ``path`` exists and is not a socket, or its directory is not
                the daemon's own.
            LocalApiError: the socket cannot be created.
        """
        if self._listener is not None:
            raise LocalApiError("LocalServer.start() called twice")
        self._prepare_directory()
        self._remove_stale()
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            # On Linux the socket file takes the socket inode's mode (minus the umask) at bind:
            # set it first, so there is no moment where the file is more open than 0o600.
            mode = 0o600 if self._binding is None else 0o666
            os.fchmod(listener.fileno(), mode)
            listener.bind(self.path)
            os.chmod(self.path, mode)
            listener.listen(64)
            st = os.stat(self.path)
        except OSError as exc:
            listener.close()
            raise LocalApiError(f"cannot create the local socket at {self.path}: {exc}") from exc
        self._inode = (st.st_dev, st.st_ino)
        self._listener = listener
        self._accept_thread = threading.Thread(target=self._accept_loop, name="local-api-accept",
                                               daemon=True)
        self._accept_thread.start()
        log.info("local API listening on %s (the daemon's uid%s)", self.path,
                 " and the running job's processes" if self._binding else " only")

    def stop(self, timeout: float = 2.0) -> None:
        """Closes the listener and every connection, waits for their threads, unlinks the file.

        Args:
            timeout: how long to wait for each thread (a handler still running is not
                interrupted; it is logged and left to finish on its own).
        """
        with self._lock:
            if self._stopping or self._listener is None:
                return
            self._stopping = True
            conns = list(self._conns)
        # shutdown, not close: it wakes the threads blocked in accept()/recv() on Linux, and
        # their file descriptors stay valid until the owning thread closes them.
        shut(self._listener)
        for conn in conns:
            shut(conn)
        if self._accept_thread is not None:
            self._accept_thread.join(timeout)
        self._listener.close()
        with self._lock:
            threads = list(self._conns.values())
        for thread in threads:
            thread.join(timeout)
            if thread.is_alive():
                log.warning("local API: %s still busy in a handler after stop()", thread.name)
        self._unlink_own_socket()
        log.info("local API on %s stopped", self.path)

    # -- start-up checks ------------------------------------------------------------------

    def _prepare_directory(self) -> None:
        directory = os.path.dirname(self.path)
        try:
            os.makedirs(directory, mode=0o711, exist_ok=True)
            st = os.stat(directory)
        except OSError as exc:
            raise LocalApiError(f"cannot create the socket directory {directory}: {exc}") from exc
        me = os.geteuid()
        if st.st_uid != me:
            raise UnsafeSocketPath(
                f"the socket directory {directory} belongs to uid {st.st_uid}, not to the "
                f"daemon (uid {me}): its owner could replace the socket; use a directory of "
                "the daemon's own, e.g. /run/elasticd")
        if st.st_mode & 0o022:
            raise UnsafeSocketPath(
                f"the socket directory {directory} is writable by others (mode "
                f"{stat.S_IMODE(st.st_mode):#o}): anyone could replace the socket; use a "
                "directory only the daemon can write, e.g. /run/elasticd")
        if self._binding is not None and not st.st_mode & 0o001:
            log.warning("socket directory %s (mode %#o) cannot be traversed by uids other than "
                        "the daemon's; their workers will get 'permission denied'", directory,
                        stat.S_IMODE(st.st_mode))

    def _remove_stale(self) -> None:
        try:
            st = os.lstat(self.path)
        except FileNotFoundError:
            return
        if not stat.S_ISSOCK(st.st_mode):
            raise UnsafeSocketPath(f"{self.path} exists and is not a socket; refusing to "
                                   "replace it")
        probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        probe.settimeout(1.0)
        try:
            probe.connect(self.path)
        except ConnectionRefusedError:
            log.info("removing stale socket %s (nobody listens on it)", self.path)
            os.unlink(self.path)
            return
        except FileNotFoundError:
            return
        except (BlockingIOError, TimeoutError) as exc:
            # A full backlog: someone listens but does not accept fast enough — still live.
            raise SocketInUse(f"{self.path} is served by a live process (its queue is full): "
                              "is another elasticd running for this node?") from exc
        except OSError as exc:
            raise LocalApiError(f"cannot check the existing socket {self.path}: {exc}") from exc
        else:
            pid, uid, _gid = peer_credentials(probe)
            raise SocketInUse(f"{self.path} is served by a live process (pid {pid}, uid "
                              f"{uid}): is another elasticd running for this node? Stop it, "
                              "or give this daemon another socket path")
        finally:
            probe.close()

    def _unlink_own_socket(self) -> None:
        # Only our own file: a successor daemon may already have replaced it.
        try:
            st = os.stat(self.path)
            if (st.st_dev, st.st_ino) == self._inode:
                os.unlink(self.path)
        except FileNotFoundError:
            pass
        except OSError as exc:
            log.warning("could not remove socket %s: %s", self.path, exc)

    # -- connections ----------------------------------------------------------------------

    def _accept_loop(self) -> None:
        assert self._listener is not None
        while True:
            try:
                conn, _addr = self._listener.accept()
            except OSError as exc:
                if self._stopping:
                    return
                log.warning("local API: accept failed: %s", exc)
                if exc.errno in (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM):
                    threading.Event().wait(0.1)  # out of descriptors: don't spin
                continue
            self._admit(conn)

    def _admit(self, conn: socket.socket) -> None:
        try:
            pid, uid, gid = peer_credentials(conn)
        except OSError as exc:
            log.warning("local API: cannot read peer credentials (%s); closing", exc)
            conn.close()
            return
        peer = {"pid": pid, "uid": uid, "gid": gid}
        caller, reason = None, ""
        if self._binding is not None:
            try:
                caller = self._binding.admit(pid, uid)
            except CallerRefused as exc:
                reason = str(exc)
        elif uid != os.geteuid():
            reason = f"uid {uid} may not use this elasticd (only uid {os.geteuid()} may)"
        with self._lock:
            if self._stopping or (reason and self._rejecting >= _MAX_REJECTING):
                conn.close()
                return
            if not reason and len(self._conns) >= MAX_CONNECTIONS:
                reason = f"too many connections to this elasticd ({MAX_CONNECTIONS})"
            if reason:
                self._rejecting += 1  # until _reject() is done with it
                target, args, name = self._reject, (conn, peer, reason), f"local-api-reject-{pid}"
            else:
                target, args, name = self._serve, (conn, peer), f"local-api-pid{pid}"
                if caller is not None:
                    self._callers[conn] = caller
                    peer["job"] = caller.job
            thread = threading.Thread(target=target, args=args, name=name, daemon=True)
            self._conns[conn] = thread
        if reason:
            log.warning("local API: refused a connection from pid %d: %s", pid, reason)
        thread.start()

    def _reject(self, conn: socket.socket, peer: dict[str, int], reason: str) -> None:
        try:
            conn.settimeout(_REJECT_LINGER)
            conn.sendall(encode({"id": None, "ok": False, "error": reason}))
            # Linger until the client hangs up or a second passes: closing at once could make
            # its pending write fail with EPIPE before it reads why it was refused.
            conn.shutdown(socket.SHUT_WR)
            deadline = self.clock.monotonic() + _REJECT_LINGER
            while self.clock.monotonic() < deadline and conn.recv(4096):
                pass
        except OSError:
            pass
        finally:
            with self._lock:
                self._rejecting -= 1
            self._forget(conn)

    def _serve(self, conn: socket.socket, peer: dict[str, int]) -> None:
        conn.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO,
                        struct.pack("ll", int(_SEND_TIMEOUT), int(_SEND_TIMEOUT % 1 * 1e6)))
        rfile = conn.makefile("rb")
        try:
            while self._serve_one(conn, rfile, peer):
                pass
        except OSError as exc:
            if not self._stopping:
                log.info("local API: connection from pid %d lost: %s", peer["pid"], exc)
        finally:
            rfile.close()
            with self._lock:
                caller = self._callers.get(conn)
            self._forget(conn)
            if caller is not None and self._binding is not None:
                self._binding.closed(caller)
            call_hooks(self.on_close, {"pid": peer.get("pid"), "job": caller and caller.job},
                       log=log, failed="local API: a connection-close hook failed")

    def _forget(self, conn: socket.socket) -> None:
        with self._lock:
            self._conns.pop(conn, None)
            self._callers.pop(conn, None)
        conn.close()

    def _serve_one(self, conn: socket.socket, rfile: Any, peer: dict[str, int]) -> bool:
        """Reads and answers one request; False when the connection must close."""
        head = rfile.read(LENGTH.size)
        if len(head) < LENGTH.size:
            if head:
                self._protocol_error(conn, peer, "connection closed in a frame's length", False)
            return False
        (length,) = LENGTH.unpack(head)
        try:
            check_length(length, DEFAULT_MAX_MESSAGE)  # before reading or allocating the body
        except FrameError as exc:
            return self._protocol_error(conn, peer, str(exc), True)
        body = rfile.read(length)
        if len(body) < length:
            return self._protocol_error(conn, peer, f"connection closed after {len(body)} of "
                                        f"{length} bytes of a frame", False)
        try:
            msg = decode(body)
        except FrameError as exc:
            return self._protocol_error(conn, peer, str(exc), True)
        return self._dispatch(conn, msg, peer)

    def _protocol_error(self, conn: socket.socket, peer: dict[str, int], what: str,
                        reply: bool) -> bool:
        log.warning("local API: closing the connection from pid %d: %s", peer["pid"], what)
        if reply:
            self._send(conn, {"id": None, "ok": False,
                              "error": f"{what}; closing the connection"})
        return False

    def _dispatch(self, conn: socket.socket, msg: dict[str, Any], peer: dict[str, int]) -> bool:
        op, rid, noreply = msg.get("op"), msg.get("id"), msg.get("noreply", False)
        rid_ok = isinstance(rid, int) and not isinstance(rid, bool)
        if not isinstance(op, str) or not isinstance(noreply, bool) or not (rid_ok or noreply):
            return self._protocol_error(
                conn, peer, 'a request needs "op" (a string), "id" (an integer) and, if '
                f'present, "noreply" (a boolean); got op={op!r} id={rid!r} '
                f"noreply={noreply!r}", True)
        msg["_peer"] = dict(peer)  # from the kernel: whatever the client claimed is replaced
        reply = self._bound_call(conn, op, msg, peer, noreply)
        if not noreply:
            reply["id"] = rid
            if self._send(conn, reply):
                return True
            call_hooks(self.on_undelivered, op, reply, log=log,
                       failed="local API: an undelivered-reply hook failed")
            return False
        return True

    def _bound_call(self, conn: socket.socket, op: str, msg: dict[str, Any],
                    peer: dict[str, Any], noreply: bool) -> dict[str, Any]:
        """:meth:`_call`, once the connection's binding allows the request."""
        with self._lock:
            caller = self._callers.get(conn)
        if caller is None or self._binding is None:
            return self._call(op, msg, peer, noreply)
        try:
            self._binding.check(caller, op, msg)
        except CallerRefused as exc:
            caller.refusals += 1
            if caller.refusals == 1:  # one line per connection: a loop must not flood the log
                log.warning("local API: refused %r from pid %d (uid %d): %s", op, caller.pid,
                            caller.uid, exc)
            return self._failed(op, peer, noreply, str(exc))
        reply = self._call(op, msg, peer, noreply)
        self._binding.replied(caller, op, reply)
        return reply

    def _call(self, op: str, msg: dict[str, Any], peer: dict[str, int],
              noreply: bool) -> dict[str, Any]:
        handler = self._handlers.get(op)
        if handler is None:
            return self._failed(op, peer, noreply, f"unknown op {op!r}; this daemon serves "
                                f"{', '.join(sorted(self._handlers)) or 'nothing'}")
        try:
            result = handler(msg)
        except RequestError as exc:
            return self._failed(op, peer, noreply, str(exc) or type(exc).__name__)
        except Exception as exc:  # noqa: BLE001 — a handler's bug must not kill the server
            return self._failed(op, peer, noreply,
                                f"{op} failed in the daemon: {type(exc).__name__}: {exc}",
                                bug=True)
        if result is None:
            result = {}
        if isinstance(result, dict) and noreply:
            close_fds(result.pop("_fds", ()))  # nobody to hand them to
        if not isinstance(result, dict):
            log.error("local API: handler for %r returned %s, not a dict", op,
                      type(result).__name__)
            return self._failed(op, peer, noreply, f"{op} failed in the daemon: its handler "
                                f"returned a {type(result).__name__}")
        return {**result, "ok": True}

    def _failed(self, op: str, peer: dict[str, int], noreply: bool, error: str,
                bug: bool = False) -> dict[str, Any]:
        """Logs a failed request; returns its error reply.

        A handler's bug is logged with its traceback. One-way requests (progress, every step)
        are logged once per op at warning level and at debug level after that.
        """
        with self._lock:
            first = op not in self._failures_logged
            self._failures_logged.add(op)
        kind = "one-way " if noreply else ""
        if noreply and not first:
            log.debug("local API: one-way %r from pid %d failed: %s", op, peer["pid"], error,
                      exc_info=bug)
        elif bug:
            log.error("local API: %s%r from pid %d failed: %s", kind, op, peer["pid"], error,
                      exc_info=True)
        elif noreply:
            log.warning("local API: one-way %r from pid %d failed: %s (further failures of "
                        "one-way %r are logged at debug level)", op, peer["pid"], error, op)
        else:
            log.debug("local API: %r from pid %d refused: %s", op, peer["pid"], error)
        return {"ok": False, "error": error}

    def _send(self, conn: socket.socket, reply: dict[str, Any]) -> bool:
        fds = list(reply.pop("_fds", ()))
        try:
            if fds:
                reply["nfds"] = len(fds)
            try:
                frame = encode(reply)
            except FrameError as exc:
                log.error("local API: reply %r is not JSON: %s", reply.get("id"), exc)
                fds = close_fds(fds)
                frame = encode({"id": reply.get("id"), "ok": False,
                                "error": f"the daemon's reply could not be encoded: {exc}"})
            try:
                sent = 0
                if fds:  # the descriptors travel with the frame's first bytes
                    sent = conn.sendmsg([frame], [(socket.SOL_SOCKET, socket.SCM_RIGHTS,
                                                   array.array("i", fds).tobytes())])
                conn.sendall(memoryview(frame)[sent:])
            except OSError as exc:
                # Includes SO_SNDTIMEO expiring: a worker that stopped reading its replies.
                if not self._stopping:
                    log.info("local API: cannot reply (%s); closing the connection", exc)
                return False
            return True
        finally:
            close_fds(fds)
