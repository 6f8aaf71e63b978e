"""A real uvicorn server for HTTP tests: 127.0.0.1, a free port, its own thread."""
from __future__ import annotations

import socket
import threading
import time

import httpx
import uvicorn

from strata_jax.serve import create_app


class RunningServer:
  """`create_app(engine, ...)` served by uvicorn on a socket bound before the thread starts
  (no port race). `url` is the base (no trailing slash); `stop()` shuts it down."""

  def __init__(self, engine, *, model_name: str = "demo", **app_kw):
    self.engine = engine
    self.model_name = model_name
    self.app = create_app(engine, model_name=model_name, **app_kw)
    self._sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    self._sock.bind(("127.0.0.1", 0))
    self.port = self._sock.getsockname()[1]
    self.url = f"http://127.0.0.1:{self.port}"
    config = uvicorn.Config(self.app, log_level="warning", lifespan="on",
                            timeout_graceful_shutdown=30)
    self._server = uvicorn.Server(config)
    self._thread = threading.Thread(target=self._server.run, kwargs={"sockets": [self._sock]},
                                    name=f"uvicorn-{self.port}", daemon=True)

  def start(self, timeout: float = 30.0) -> RunningServer:
    self._thread.start()
    t0 = time.monotonic()
    while not self._server.started:
      if not self._thread.is_alive() or time.monotonic() - t0 > timeout:
        raise RuntimeError(f"uvicorn did not start on {self.url}")
      time.sleep(0.02)
    assert httpx.get(f"{self.url}/health", timeout=10).status_code == 200
    return self

  def stop(self, timeout: float = 60.0):
    self._server.should_exit = True
    self._thread.join(timeout)
    self._sock.close()
    assert not self._thread.is_alive(), "uvicorn did not stop"

  def __enter__(self):
    return self if self._thread.is_alive() else self.start()

  def __exit__(self, *exc):
    self.stop()


def start_server(engine, **kw) -> RunningServer:
  return RunningServer(engine, **kw).start()
