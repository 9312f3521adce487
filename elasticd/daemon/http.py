"""The daemon's HTTP endpoint: ``/metrics`` (Prometheus text), ``/healthz`` and ``/status``.

A small threaded ``http.server``: a scrape every few seconds and an operator's ``curl`` do not
need more, and it adds no dependency to the daemon. Anyone who reaches the port is untrusted,
so it is bounded like the replica server's handshakes (:mod:`elasticd.admission`): at most 16
connections (one thread each) at once, each closed 5 seconds after it was accepted whatever it
sends, every read and write bounded by 2 seconds, one request per connection, and a flood from
one address displaces only its own connections.

``/status`` over the network leaves out what only helps someone already attacking the node:
the etcd lease id, the agent's pid and its log path. They stay in etcd (``elasticctl nodes``
shows pids and leases, ``elasticctl logs`` the log paths), whose readers are trusted already.
"""

from __future__ import annotations

import json
import logging
import socket
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Callable

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

from elasticd.admission import Admission, shut

log = logging.getLogger(__name__)

#: Left out of /status served over HTTP (top level, and in its "job" section).
PRIVATE_STATUS = ("lease",)
PRIVATE_JOB_STATUS = ("agent_pid", "log")


def public_status(doc: dict[str, Any]) -> dict[str, Any]:
    """``doc`` without the fields :data:`PRIVATE_STATUS` and :data:`PRIVATE_JOB_STATUS` name."""
    out = {k: v for k, v in doc.items() if k not in PRIVATE_STATUS}
    if isinstance(out.get("job"), dict):
        out["job"] = {k: v for k, v in out["job"].items() if k not in PRIVATE_JOB_STATUS}
    return out


class _BoundedHTTPServer(ThreadingHTTPServer):
    """A threaded HTTP server whose connections are admitted by an :class:`Admission`."""

    daemon_threads = True
    block_on_close = False
    request_queue_size = 128  # a burst of connects waits in the kernel, not in SYN retries

    def __init__(self, address: tuple[str, int], handler: type, admission: Admission) -> None:
        self.admission = admission
        self._lock = threading.Lock()
        self._open: dict[threading.Thread, socket.socket] = {}
        super().__init__(address, handler)

    def process_request(self, request: Any, client_address: Any) -> None:
        thread = threading.Thread(target=self._serve_one, args=(request, client_address),
                                  name=f"http-conn-{client_address[0]}:{client_address[1]}",
                                  daemon=True)
        with self._lock:
            displaced = self.admission.admit(thread, client_address[0])
            victim = self._open.get(displaced) if displaced is not None else None
            self._open[thread] = request
        if victim is not None:
            shut(victim)
        thread.start()

    def _serve_one(self, request: Any, client_address: Any) -> None:
        me = threading.current_thread()
        try:
            self.finish_request(request, client_address)
        except Exception:  # noqa: BLE001 — a broken client must not reach the log as a crash
            log.debug("http: request from %s failed", client_address[0], exc_info=True)
        finally:
            self.admission.release(me)
            with self._lock:
                self._open.pop(me, None)
            self.shutdown_request(request)

    def service_actions(self) -> None:
        """Runs between polls of ``serve_forever``: ends connections past their deadline."""
        expired, _ = self.admission.expire()
        with self._lock:
            socks = [self._open[t] for t in expired if t in self._open]
        for sock in socks:
            shut(sock)


class StatusServer:
    """Serves metrics, health and status on ``(host, port)``; port 0 picks a free port.

    Args:
        status: returns the JSON-able /status document (private fields are removed here).
    """

    def __init__(self, address: tuple[str, int], registry: CollectorRegistry,
                 status: Callable[[], dict[str, Any]], healthy: Callable[[], bool]) -> None:
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 (http.server's naming)
                outer._handle(self)

            def log_message(self, fmt: str, *args: Any) -> None:
                log.debug("http: " + fmt, *args)

        Handler.timeout = 2.0  # StreamRequestHandler sets it on the socket (each read or write)
        self._registry = registry
        self._status = status
        self._healthy = healthy
        self._server = _BoundedHTTPServer(address, Handler, Admission(16, 5.0))
        self._thread: threading.Thread | None = None

    @property
    def address(self) -> str:
        host, port = self._server.server_address[:2]
        return f"{host}:{port}"

    def start(self) -> None:
        # Polls every 0.2 s so that deadlines are enforced within that.
        self._thread = threading.Thread(target=self._server.serve_forever, args=(0.2,),
                                        name="http", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        with self._server._lock:
            socks = list(self._server._open.values())
        for sock in socks:
            shut(sock)

    def _handle(self, req: BaseHTTPRequestHandler) -> None:
        path = req.path.split("?", 1)[0]
        if path == "/metrics":
            body, ctype, code = generate_latest(self._registry), CONTENT_TYPE_LATEST, 200
        elif path == "/healthz":
            ok = self._healthy()
            body = b"ok\n" if ok else b"main loop stalled\n"
            ctype, code = "text/plain; charset=utf-8", 200 if ok else 503
        elif path == "/status":
            doc = public_status(self._status())
            body = (json.dumps(doc, indent=2, sort_keys=True) + "\n").encode()
            ctype, code = "application/json", 200
        else:
            body, ctype, code = b"not found: try /metrics, /healthz or /status\n", "text/plain", 404
        req.send_response(code)
        req.send_header("Content-Type", ctype)
        req.send_header("Content-Length", str(len(body)))
        req.end_headers()
        req.wfile.write(body)

