"""The HTTP endpoint ``GuardMetrics.serve`` starts: a threaded WSGI server of one
registry, quiet (no line per scrape), on ``DEFAULT_PORT + LOCAL_RANK`` by default.

Kept apart from ``metrics.py`` (what is exported) because it is how it is served: sockets
and threads, which a reader of the metric definitions never needs.
"""

from __future__ import annotations

import os
import socket
import socketserver
import threading
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from prometheus_client import CollectorRegistry, make_wsgi_app

#: Port of ``serve()`` for local rank 0; local rank ``r`` gets ``DEFAULT_PORT + r``.
DEFAULT_PORT = 9464


def default_port() -> int:
    """``DEFAULT_PORT + LOCAL_RANK`` (the environment variable torchrun and Lightning
    set), so the processes of one node never compete for a port.

    >>> default_port() == DEFAULT_PORT + int(os.environ.get("LOCAL_RANK", "0"))
    True
    """
    local = os.environ.get("LOCAL_RANK", "0")
    try:
        return DEFAULT_PORT + int(local)
    except ValueError:
        raise ValueError(f"LOCAL_RANK: expected an int in the environment, got {local!r}") from None


class _ThreadingServer(socketserver.ThreadingMixIn, WSGIServer):
    daemon_threads = True  # a scrape in flight never holds the process open


class _QuietHandler(WSGIRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:  # no line per scrape on stderr
        pass


def start_http_server(address: str, port: int, registry: CollectorRegistry) -> WSGIServer:
    """``prometheus_client.start_http_server`` made here: that returns the server (to read
    its port and shut it down) only from prometheus-client 0.20 on, and None before."""
    family, _, _, _, sockaddr = socket.getaddrinfo(address, port, type=socket.SOCK_STREAM,
                                                   flags=socket.AI_PASSIVE)[0]
    server_class = type("_Server", (_ThreadingServer,), {"address_family": family})
    server = make_server(sockaddr[0], port, make_wsgi_app(registry), server_class, handler_class=_QuietHandler)
    threading.Thread(target=server.serve_forever, name="sdc_guard-metrics", daemon=True).start()
    return server
