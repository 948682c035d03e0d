"""The HTTP server of a role's ``/metrics`` (cluster/metrics.py): prometheus_client's WSGI app
on a threading server that never looks its own address up in DNS.

``prometheus_client.start_http_server`` binds through ``http.server.HTTPServer.server_bind``,
which calls ``socket.getfqdn(address)``: a reverse DNS lookup of the role's own IP. On a host
whose DNS server does not answer (a private network without a resolver, the namespace hosts
of issue 39) the lookup waits out the resolver's timeouts (5 s x 2 attempts with glibc's
defaults) before the role can register, so every role start, and every Ray restart of a role,
took 10 s longer there (measured: a drafter's restart 16-24 s across namespaces, 6 s on the
loopback). The server name is only used for WSGI's ``SERVER_NAME``, which the metrics app does
not read; the address itself serves as the name.
"""

from __future__ import annotations

import socket
import socketserver
import threading
from wsgiref.simple_server import WSGIRequestHandler, make_server

from prometheus_client import CollectorRegistry, make_wsgi_app
from prometheus_client.exposition import ThreadingWSGIServer


class _QuietHandler(WSGIRequestHandler):
    """No access log line per scrape on the role's stderr."""

    def log_message(self, format: str, *args) -> None:  # noqa: A002 - the base's name
        pass


class MetricsServer(ThreadingWSGIServer):
    """A threading WSGI server whose bind skips the reverse lookup (see the module
    docstring); its address family follows the address (IPv6 for an IPv6 literal)."""

    def server_bind(self) -> None:
        socketserver.TCPServer.server_bind(self)
        host, port = self.server_address[:2]
        self.server_name, self.server_port = str(host), port
        self.setup_environ()


def start_metrics_server(registry: CollectorRegistry, addr: str,
                         port: int = 0) -> MetricsServer:
    """Serve ``registry`` at ``http://addr:port/metrics`` (every path answers the same, as
    prometheus_client's own server does) from a daemon thread; ``port`` 0 picks a free one,
    read back from ``server.server_port``.

    Raises:
        OSError: the address cannot be bound (not this host's, or the port is taken).
        socket.gaierror: ``addr`` is a name that does not resolve.
    """
    family = socket.getaddrinfo(addr, port, type=socket.SOCK_STREAM)[0][0]
    server_class = type("MetricsServer", (MetricsServer,), {"address_family": family})
    server = make_server(addr, port, make_wsgi_app(registry), server_class,
                         handler_class=_QuietHandler)
    threading.Thread(target=server.serve_forever, name=f"metrics-{server.server_port}",
                     daemon=True).start()
    return server
