"""The server's life: uvicorn on a socket bound before it starts (so `--port 0` can say which port it got),
the engine's thread beside it, and a clean stop.

SIGTERM or Ctrl-C stops taking connections, gives the requests in flight `grace` seconds to finish (those
left then end: a stream with an error event, others with 503), and returns, so the command exits 0; a second
Ctrl-C ends the process at once (exit 130).
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import socket
import sys
import threading
from collections.abc import Callable, Iterator
from types import FrameType
from typing import Any

import uvicorn

from minigpt.inference.engine import Engine

log = logging.getLogger("minigpt.serve")


def bind(host: str, port: int) -> socket.socket:
    """A listening socket on host:port (port 0: any free port), IPv6 when the host is an IPv6 address."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(2048)
    sock.set_inheritable(True)
    return sock


def url(sock: socket.socket) -> str:
    host, port = sock.getsockname()[:2]
    return f"http://{f'[{host}]' if ':' in host else host}:{port}"


class Server(uvicorn.Server):
    """uvicorn's server with minigpt's signals: a stop closes the engine (after `grace`) too."""

    def __init__(self, config: uvicorn.Config, engine: Engine, grace: float, on_ready: Callable[[], None]):
        super().__init__(config)
        self.engine, self.grace, self.on_ready = engine, grace, on_ready

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        await super().startup(sockets)
        if not self.should_exit:
            self.on_ready()

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        old = {s: signal.signal(s, self.stop) for s in (signal.SIGINT, signal.SIGTERM)}
        try:
            yield
        finally:
            for s, handler in old.items():
                signal.signal(s, handler)

    def stop(self, signum: int = signal.SIGTERM, frame: FrameType | None = None) -> None:
        """The first signal: stop accepting, let the requests in flight finish within `grace`; a second
        Ctrl-C: leave now."""
        if self.should_exit:
            if signum == signal.SIGINT:
                print("minigpt: interrupted", file=sys.stderr, flush=True)
                os._exit(130)
            return
        self.should_exit = True
        load = self.engine.load()
        in_flight = load["busy"] + load["waiting"]
        print(f"minigpt serve: stopping; {in_flight} request(s) in flight get up to {self.grace:g} s to finish "
              "(Ctrl-C again to quit at once)", file=sys.stderr, flush=True)  # fmt: skip
        threading.Thread(target=self.engine.close, args=(self.grace,), daemon=True).start()


def serve(app: Any, engine: Engine, sock: socket.socket, grace: float, access_log: bool = False) -> None:
    """Serve `app` on `sock` until a signal stops it; the engine is closed on the way out."""
    config = uvicorn.Config(
        app, log_level="warning", access_log=access_log, lifespan="off",
        timeout_graceful_shutdown=grace + 3, timeout_keep_alive=5,
    )  # fmt: skip
    ready = lambda: print(
        f"minigpt serve: ready on {url(sock)} (chat page at /, OpenAI API at /v1)", flush=True
    )
    server = Server(config, engine, grace, ready)
    try:
        server.run(sockets=[sock])
    finally:
        engine.close(0)
        sock.close()
