"""Run the gateway app with uvicorn in a background thread (tests, ``specmesh serve``)."""

from __future__ import annotations

import threading
import time

import uvicorn


class GatewayServer:
    """A uvicorn server running in a daemon thread; ``stop()`` shuts it down."""

    def __init__(self, server: uvicorn.Server, thread: threading.Thread, port: int) -> None:
        self.server = server
        self.thread = thread
        self.port = port

    def stop(self, timeout_s: float = 10.0) -> None:
        """Ask uvicorn to exit and wait for the thread (forcing it after ``timeout_s / 2``)."""
        self.server.should_exit = True
        self.thread.join(timeout_s / 2)
        if self.thread.is_alive():
            self.server.force_exit = True
            self.thread.join(timeout_s / 2)


def _bound_port(server: uvicorn.Server) -> int:
    for srv in getattr(server, "servers", []) or []:
        for sock in srv.sockets:
            return int(sock.getsockname()[1])
    raise RuntimeError("uvicorn started without a listening socket")


def serve_gateway(app, host: str = "127.0.0.1", port: int = 0, log_level: str = "warning",
                  startup_timeout_s: float = 30.0):
    """Start ``app`` on ``host:port`` in a background thread; return once it listens.

    Returns:
        ``(server, thread, bound_port)``: the ``uvicorn.Server`` (with a ``stop()`` method
        attached), its thread, and the real port (read back when ``port=0``).
    """
    config = uvicorn.Config(app, host=host, port=port, log_level=log_level, lifespan="off",
                            access_log=False, timeout_graceful_shutdown=2)
    server = uvicorn.Server(config)
    errors: list[BaseException] = []

    def run() -> None:
        try:
            server.run()
        except BaseException as err:  # noqa: BLE001 - reported to the caller below
            errors.append(err)

    thread = threading.Thread(target=run, name=f"gateway-uvicorn-{port}", daemon=True)
    thread.start()
    deadline = time.monotonic() + startup_timeout_s
    while not server.started:
        if errors or not thread.is_alive():
            raise RuntimeError(f"gateway server failed to start: {errors[:1] or 'exited'}")
        if time.monotonic() > deadline:
            server.should_exit = True
            raise TimeoutError(f"gateway server not listening after {startup_timeout_s}s")
        time.sleep(0.01)
    bound = _bound_port(server)
    handle = GatewayServer(server, thread, bound)
    server.stop = handle.stop  # type: ignore[attr-defined]
    return server, thread, bound


def stop(server: uvicorn.Server, thread: threading.Thread | None = None,
         timeout_s: float = 10.0) -> None:
    """Stop a server started by :func:`serve_gateway`."""
    server.should_exit = True
    if thread is not None:
        thread.join(timeout_s / 2)
        if thread.is_alive():
            server.force_exit = True
            thread.join(timeout_s / 2)
