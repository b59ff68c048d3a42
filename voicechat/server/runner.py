"""Start a server: the MLX worker first (model loaded, warmed up), then uvicorn on the app."""

from __future__ import annotations

import logging
import socket
import threading

from .app import ServerLimits, ServerSecurity, ServerState, create_app
from .metrics import ServerMetrics
from .worker import ModelWorker


def make_state(model: str, *, limits: ServerLimits | None = None, security: ServerSecurity | None = None,
               warmup_seconds: float = 0.5, stage_metrics_every: int = 10, load_timeout: float = 600.0,
               load_kwargs: dict | None = None, tool_runner=None, dialect_options=None) -> ServerState:
    """Load `model` (folder, repo id or synthetic:PRESET) on a new worker thread and wait for it."""

    def load():
        import voicechat
        from voicechat.synthetic import resolve_model_arg

        return voicechat.load(resolve_model_arg(model), **(load_kwargs or {}))

    metrics = ServerMetrics()
    worker = ModelWorker(load, metrics=metrics, stage_metrics_every=stage_metrics_every,
                         warmup_seconds=warmup_seconds, tool_runner=tool_runner).start()
    worker.wait_ready(load_timeout)
    state = ServerState(worker=worker, limits=limits or ServerLimits(), security=security or ServerSecurity(),
                        model_name=str(model), metrics=metrics)
    if dialect_options is not None:
        state.dialect_options = dialect_options
    return state


def uvicorn_config(app, state: ServerState, *, host: str, port: int, log_level: str = "info"):
    import uvicorn

    return uvicorn.Config(app, host=host, port=port, log_level=log_level, ws_max_size=state.limits.transport_max_bytes,
                          ws_ping_interval=20.0, ws_ping_timeout=20.0, lifespan="off", access_log=False)


class ServerThread:
    """uvicorn serving `state` on a background thread (tests, `voicechat talk` in-process)."""

    def __init__(self, state: ServerState, host: str = "127.0.0.1", port: int = 0, log_level: str = "warning"):
        import uvicorn

        self.state = state
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind((host, port))
        self.host, self.port = self.sock.getsockname()[:2]
        self.app = create_app(state)
        self.server = uvicorn.Server(uvicorn_config(self.app, state, host=host, port=self.port, log_level=log_level))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]},
                                       name="voicechat-server", daemon=True)

    @property
    def url(self) -> str:
        return f"ws://{self.host}:{self.port}/v1/realtime"

    @property
    def http(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self) -> "ServerThread":
        self.thread.start()
        import time

        for _ in range(500):
            if self.server.started:
                return self
            time.sleep(0.01)
        raise RuntimeError("uvicorn did not start within 5 s")

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(10)
        self.sock.close()


def configure_logging(level: str = "info") -> None:
    logging.basicConfig(level=getattr(logging, level.upper(), logging.INFO), format="%(asctime)s %(name)s %(message)s")
