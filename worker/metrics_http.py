"""The worker's metrics over HTTP: ``serve_metrics`` serves a ``WorkerMetrics``
registry with ``prometheus_client``'s WSGI app and threading server, plus
``/snapshot`` (the JSON summary ``kiviq top`` reads from Redis)."""

from __future__ import annotations

import json
import logging
import socket
import threading
from typing import Any, Callable
from wsgiref.simple_server import WSGIRequestHandler, make_server

from prometheus_client import make_wsgi_app
from prometheus_client.exposition import ThreadingWSGIServer

from kiviq.worker.metrics import WorkerMetrics

log = logging.getLogger("kiviq.metrics")


def make_app(metrics: WorkerMetrics) -> Callable:
    """WSGI app: ``/snapshot`` (or ``/snapshot.json``) is ``metrics.snapshot()``
    as JSON; every other path is the library's ``make_wsgi_app`` (Prometheus
    text, OpenMetrics and gzip negotiated from the request headers)."""
    prometheus = make_wsgi_app(metrics.registry)

    def app(environ: dict, start_response: Callable) -> Any:
        if environ.get("PATH_INFO", "").rstrip("/") in ("/snapshot", "/snapshot.json"):
            body = json.dumps(metrics.snapshot()).encode()
            start_response("200 OK", [("Content-Type", "application/json"), ("Content-Length", str(len(body)))])
            return [body]
        return prometheus(environ, start_response)

    return app


class _QuietHandler(WSGIRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002
        log.debug("metrics http: " + format, *args)


def serve_metrics(metrics: WorkerMetrics, port: int, host: str = "127.0.0.1") -> Any:
    """Serve ``make_app(metrics)`` with the library's ``ThreadingWSGIServer``
    from a daemon thread (what ``prometheus_client.start_http_server`` does,
    plus ``/snapshot``): ``/metrics`` is the registry.

    ``port`` 0 picks a free one: read it back from ``server.server_address[1]``.
    Stop with ``server.shutdown(); server.server_close()``.
    """
    server_class = type("KiviqMetricsServer", (ThreadingWSGIServer,),
                        {"address_family": socket.AF_INET6 if ":" in host else socket.AF_INET})
    server = make_server(host, port, make_app(metrics), server_class, handler_class=_QuietHandler)
    threading.Thread(target=server.serve_forever, name="kiviq-metrics-http", daemon=True).start()
    log.info("metrics on http://%s:%d/metrics", host, server.server_address[1])
    return server
