"""The daemon's HTTP endpoint: ``/metrics`` (Prometheus text), ``/healthz`` and ``/status``.

A plain threaded ``http.server``: a scrape every few seconds and an operator's ``curl`` do not
need more, and it adds no dependency to the daemon.
"""

from __future__ import annotations

import json
import logging
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Callable

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

log = logging.getLogger(__name__)


class StatusServer:
    """Serves metrics, health and status on ``(host, port)``; port 0 picks a free port.

    Args:
        address: where to listen.
        registry: the Prometheus registry to expose.
        status: returns the JSON-able /status document.
        healthy: True when the daemon's loop is cycling.
    """

    def __init__(self, address: tuple[str, int], registry: CollectorRegistry,
                 status: Callable[[], dict[str, Any]], healthy: Callable[[], bool]) -> None:
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 (http.server's naming)
                outer._handle(self)

            def log_message(self, fmt: str, *args: Any) -> None:
                log.debug("http: " + fmt, *args)

        self._registry = registry
        self._status = status
        self._healthy = healthy
        self._server = ThreadingHTTPServer(address, Handler)
        self._server.daemon_threads = True
        self._thread: threading.Thread | None = None

    @property
    def address(self) -> str:
        host, port = self._server.server_address[:2]
        return f"{host}:{port}"

    def start(self) -> None:
        self._thread = threading.Thread(target=self._server.serve_forever, name="http",
                                        daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()

    def _handle(self, req: BaseHTTPRequestHandler) -> None:
        path = req.path.split("?", 1)[0]
        if path == "/metrics":
            body, ctype, code = generate_latest(self._registry), CONTENT_TYPE_LATEST, 200
        elif path == "/healthz":
            ok = self._healthy()
            body = b"ok\n" if ok else b"main loop stalled\n"
            ctype, code = "text/plain; charset=utf-8", 200 if ok else 503
        elif path == "/status":
            body = (json.dumps(self._status(), indent=2, sort_keys=True) + "\n").encode()
            ctype, code = "application/json", 200
        else:
            body, ctype, code = b"not found: try /metrics, /healthz or /status\n", "text/plain", 404
        req.send_response(code)
        req.send_header("Content-Type", ctype)
        req.send_header("Content-Length", str(len(body)))
        req.end_headers()
        req.wfile.write(body)
