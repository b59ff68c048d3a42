"""Start a server: the MLX worker first (model loaded, warmed up), then uvicorn on the app."""

from __future__ import annotations

import logging
import socket
import threading

from voicechat.server.app import ServerLimits, ServerSecurity, ServerState, create_app
from voicechat.server.metrics import ServerMetrics
from voicechat.server.worker import ModelWorker
from voicechat.streaming.model import load
from voicechat.synthetic.checkpoint import resolve_model_arg


def make_state(
    model: str,
    *,
    limits: ServerLimits | None = None,
    security: ServerSecurity | None = None,
    warmup_seconds: float = 0.5,
    stage_metrics_every: int = 10,
    load_timeout: float = 600.0,
    load_kwargs: dict | None = None,
    prompt_states=None,
    metrics=None,
    tool_runner=None,
    dialect_options=None,
    max_sessions: int = 1,
    memory_check: bool = True,
) -> ServerState:
    """Load `model` (folder, repo id or synthetic:PRESET) on a new worker thread and wait for it;
    `max_sessions` slots (the worker's session batch), checked against the machine's memory at the
    session length limit (`memory_check`; voicechat.server.memory)."""

    def load_model():
        return load(resolve_model_arg(model), **(load_kwargs or {}))

    limits = limits or ServerLimits()
    metrics = metrics or ServerMetrics()
    worker = ModelWorker(
        load_model,
        metrics=metrics,
        stage_metrics_every=stage_metrics_every,
        warmup_seconds=warmup_seconds,
        prompt_states=prompt_states,
        tool_runner=tool_runner,
        max_sessions=max_sessions,
        session_seconds=limits.max_session_audio_seconds,
        prompt_tokens=limits.max_prompt_tokens,
        memory_check=memory_check,
    ).start()
    worker.wait_ready(load_timeout)
    state = ServerState(
        worker=worker,
        limits=limits,
        security=security or ServerSecurity(),
        model_name=str(model),
        metrics=metrics,
    )
    if dialect_options is not None:
        state.dialect_options = dialect_options
    return state


def uvicorn_config(
    app,
    state: ServerState,
    *,
    host: str,
    port: int,
    log_level: str = "info",
    tls_cert: str | None = None,
    tls_key: str | None = None,
):
    import uvicorn

    return uvicorn.Config(
        app,
        host=host,
        port=port,
        log_level=log_level,
        ws_max_size=state.limits.transport_max_bytes,
        ws_ping_interval=20.0,
        ws_ping_timeout=20.0,
        lifespan="off",
        access_log=False,
        timeout_graceful_shutdown=max(1, int(round(state.limits.shutdown_timeout))),
        ssl_certfile=tls_cert,
        ssl_keyfile=tls_key,
    )


def make_server(config, state: ServerState):
    """uvicorn.Server whose shutdown first closes live sessions with 1001 (uvicorn's own would send 1012), and
    which exits normally on SIGTERM as on SIGINT."""
    import uvicorn

    class GracefulServer(uvicorn.Server):
        def handle_exit(self, sig, frame):
            super().handle_exit(sig, frame)
            # uvicorn re-raises captured signals after its shutdown (SIGTERM would then kill the process
            # with status -15); the shutdown below is the whole handling, so the process exits 0.
            if hasattr(self, "_captured_signals"):
                self._captured_signals.clear()

        async def shutdown(self, sockets=None):
            for server in getattr(self, "servers", []):
                server.close()  # no new connections while the live ones are told to go
            await state.close_sessions(state.limits.shutdown_timeout)
            await super().shutdown(sockets=sockets)

    return GracefulServer(config)


class ServerThread:
    """uvicorn serving `state` on a background thread (tests, `voicechat talk` in-process)."""

    def __init__(
        self,
        state: ServerState,
        host: str = "127.0.0.1",
        port: int = 0,
        log_level: str = "warning",
        *,
        tls_cert: str | None = None,
        tls_key: str | None = None,
    ):
        self.tls = tls_cert is not None
        self.state = state
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind((host, port))
        self.host, self.port = self.sock.getsockname()[:2]
        self.app = create_app(state)
        self.server = make_server(
            uvicorn_config(
                self.app, state, host=host, port=self.port, log_level=log_level, tls_cert=tls_cert, tls_key=tls_key
            ),
            state,
        )
        self.thread = threading.Thread(
            target=self.server.run, kwargs={"sockets": [self.sock]}, name="voicechat-server", daemon=True
        )

    @property
    def url(self) -> str:
        return f"ws{'s' if self.tls else ''}://{self.host}:{self.port}/v1/realtime"

    @property
    def http(self) -> str:
        return f"http{'s' if self.tls else ''}://{self.host}:{self.port}"

    def start(self) -> ServerThread:
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
