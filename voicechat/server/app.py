"""The ASGI app: `/v1/realtime` and `/v1/live/sessions` (WebSocket), `/healthz`, `/metrics`, and the
browser page at `/`.

Starlette under uvicorn. The asyncio side parses, validates and admits messages and
forwards them to the MLX worker thread (`worker.ModelWorker`) as commands
(voicechat.server.messages); it never touches MLX. `--max-sessions N` session slots per process
(default 1): the connection after the N-th gets `server_busy` and close 1013. A connection
(`RealtimeConnection`) keeps the lifecycle; its dialect (voicechat.server.dialects) speaks the wire
through its public surface.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import threading
import time
import uuid
from dataclasses import dataclass, field, replace
from importlib import resources

from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.responses import JSONResponse, Response
from starlette.routing import Route, WebSocketRoute
from starlette.websockets import WebSocket, WebSocketDisconnect

from voicechat.server import protocol as P
from voicechat.server.dialects import make_dialect
from voicechat.server.dialects.common import Dialect, DialectOptions, dialect_for_query
from voicechat.server.limits import ServerLimits
from voicechat.server.messages import (
    AppendAudio,
    Cancel,
    Close,
    Closed,
    Command,
    Disconnected,
    Finished,
    OpenSession,
    Reply,
    SessionError,
    SessionParams,
    TimedOut,
)
from voicechat.server.metrics import ServerMetrics
from voicechat.server.security import SecurityMiddleware, ServerSecurity
from voicechat.server.validation import MessageRefused, check_size
from voicechat.server.worker import Channel, ModelWorker

log = logging.getLogger("voicechat.server")

# WebSocket close codes (RFC 6455 / IANA registry).
CLOSE_NORMAL = 1000
CLOSE_GOING_AWAY = 1001  # the server shuts down (SIGTERM / SIGINT)
CLOSE_POLICY = 1008  # timeouts, the session's wall-clock cap, a client that does not read
CLOSE_INTERNAL = 1011  # the server failed while computing the session
CLOSE_TRY_AGAIN = 1013  # server_busy
# Closing frames to a client that may not read: past this, the socket is left to uvicorn.
CLOSE_WAIT_SECONDS = 1.0

# The page's own assets, by URL path; nothing else on disk is ever served.
ASSETS = {
    "/": ("index.html", "text/html; charset=utf-8"),
    "/index.html": ("index.html", "text/html; charset=utf-8"),
    "/static/app.js": ("app.js", "text/javascript; charset=utf-8"),
    "/static/worklets.js": ("worklets.js", "text/javascript; charset=utf-8"),
    "/static/style.css": ("style.css", "text/css; charset=utf-8"),
}


@dataclass
class ServerState:
    worker: ModelWorker
    limits: ServerLimits = field(default_factory=ServerLimits)
    security: ServerSecurity = field(default_factory=ServerSecurity)
    model_name: str = ""
    metrics: ServerMetrics = field(default_factory=ServerMetrics)
    # The OpenAI dialects' serving options (voicechat.server.dialects.common.DialectOptions).
    dialect_options: DialectOptions = field(default_factory=DialectOptions)
    _slots: dict = field(default_factory=dict)  # session id -> None, in the order the slots were taken
    _slot_lock: threading.Lock = field(default_factory=threading.Lock)
    connections: set = field(default_factory=set)  # live RealtimeConnections (closed with 1001 at shutdown)

    async def close_sessions(self, timeout: float) -> None:
        """Close every live session with 1001 and wait (at most `timeout`) until they are gone."""
        for c in list(self.connections):
            c.stop(
                "shutdown",
                CLOSE_GOING_AWAY,
                "server_shutdown",
                "the server is shutting down; the session ended (reconnect when it is back)",
            )
        deadline = time.monotonic() + timeout
        while self.connections and time.monotonic() < deadline:
            await asyncio.sleep(0.02)

    @property
    def max_sessions(self) -> int:
        """Session slots: the worker's batch (`voicechat serve --max-sessions`)."""
        return int(getattr(self.worker, "max_sessions", 1))

    def try_acquire(self, session_id: str) -> bool:
        with self._slot_lock:
            if len(self._slots) >= self.max_sessions:
                return False
            self._slots[session_id] = None
            return True

    def release(self, session_id: str) -> None:
        with self._slot_lock:
            self._slots.pop(session_id, None)

    @property
    def active_sessions(self) -> int:
        return len(self._slots)

    @property
    def active_session(self) -> str | None:
        """The oldest session holding a slot (None: every slot is free)."""
        return next(iter(list(self._slots)), None)


def _asset(name: str) -> bytes:
    return resources.files("voicechat.server").joinpath("static", name).read_bytes()


def create_app(state: ServerState) -> Starlette:
    page_headers = {
        "X-Content-Type-Options": "nosniff",
        "Content-Security-Policy": "default-src 'self'; connect-src 'self' ws: wss:; media-src 'self' blob:",
        "Cache-Control": "no-store",
    }

    async def page(request):
        name, ctype = ASSETS[request.url.path]
        return Response(_asset(name), media_type=ctype, headers=page_headers)

    async def healthz(request):
        # ok / busy / unavailable, the slots and a slot's memory at the session length limit; the model's
        # path and the queue are for /metrics (behind the key).
        w = state.worker
        ok = w.ready.is_set() and w.load_error is None and w.alive
        active, slots = state.active_sessions, state.max_sessions
        status = ("busy" if active >= slots else "ok") if ok else "unavailable"
        body = {"status": status, "active_sessions": active, "max_sessions": slots}
        if ok and w.memory:
            body["slot_bytes_at_limit"] = int(w.memory["slot_bytes"])
        return JSONResponse(body, status_code=200 if ok else 503)

    async def metrics(request):
        # The key (when set) is checked by SecurityMiddleware, as for every upgrade.
        state.metrics.queue_depth.set(state.worker.queue_depth())
        return Response(state.metrics.render(), media_type=ServerMetrics.content_type)

    async def realtime(ws: WebSocket):
        # mlx-vlm's dialect unless the URL or the first session.update asks for OpenAI's (dialects/common.py).
        await RealtimeConnection(state, ws, dialect=dialect_for_query(ws.query_params)).run()

    async def live(ws: WebSocket):
        await RealtimeConnection(state, ws, dialect="live").run()

    routes = [Route(p, page) for p in ASSETS]
    routes += [
        Route("/healthz", healthz),
        Route("/metrics", metrics),
        WebSocketRoute("/v1/realtime", realtime),
        WebSocketRoute("/v1/live/sessions", live),
    ]
    app = Starlette(
        routes=routes, middleware=[Middleware(SecurityMiddleware, security=state.security, metrics=state.metrics)]
    )
    app.state.server = state
    return app


class RealtimeConnection:
    """One WebSocket connection = at most one streaming session, spoken in one dialect at a time.

    Host, Origin and key were checked by SecurityMiddleware before this runs. The connection keeps the
    lifecycle: the slot, the limits and timeouts, the metrics, the worker channel, the reader (every
    client message bounded, then handed to the dialect; no exception from one reaches the reader's top
    level) and the writer (the outbox's outputs, in order: the lifecycle ones here, the rest rendered
    by the dialect).

    The dialect's surface (nothing else of this class is for dialects):

    * `session_id`, `limits`, `model_name`, `model_info` (the worker's geometry), `dialect_options`,
      `received_samples`, `session_params` (what `open_session` opened, or None);
    * `configured` (a session was asked for: audio is accepted, no session_update_timeout) and
      `ending` (commit / cancel sent: the rest of the input is ignored), read and written;
    * `send(payload)`: queue a server event (without event_id) behind everything already queued;
      `await send_now(payloads)`: send now, in order (from the writer task: `Dialect.on_output`);
    * `count_error(code)`: an error event the dialect sends itself, counted (metrics, the session's log);
    * `await admit_audio(pcm)`: 16 kHz input through the audio limit and backpressure to the worker;
    * `open_session(params)`, `submit(command)`, `cancel()`: the worker's commands for this session;
    * `switch_dialect(name)`: another dialect from the next message on (mlx-vlm -> GA); `stop(...)`.
    """

    def __init__(self, state: ServerState, ws: WebSocket, dialect: str = "mlx-vlm"):
        self.state = state
        self.ws = ws
        self.metrics = state.metrics
        self.limits = state.limits
        self.session_id = f"sess_{uuid.uuid4().hex[:16]}"
        self._event_seq = 0
        self.channel: Channel | None = None
        self.configured = False
        self.ending = False  # commit / cancel sent: the rest of the input is ignored
        self._session_params: SessionParams | None = None
        # stop(): end the connection from outside the reader / writer (shutdown, slow reader).
        self._stop_event = asyncio.Event()
        self._stop_reason: tuple | None = None  # (end, close code, error code or None, message)
        self.dialect: Dialect = make_dialect(dialect, self)

    # -- the dialect's surface

    @property
    def model_name(self) -> str:
        return self.state.model_name

    @property
    def model_info(self) -> dict:
        """The loaded model's geometry (ModelWorker.info: rates, frame samples, codebooks, silence codes)."""
        return self.state.worker.info

    @property
    def dialect_options(self) -> DialectOptions:
        return self.state.dialect_options

    @property
    def session_params(self) -> SessionParams | None:
        return self._session_params

    @property
    def received_samples(self) -> int:
        """16 kHz input samples accepted in this session."""
        return self.channel.received_samples if self.channel is not None else 0

    def send(self, payload: dict) -> None:
        """Queue a server event for the writer (in order with everything else; only the writer sends)."""
        self.channel.outbox.put_nowait(Reply(payload))

    async def send_now(self, payloads) -> None:
        """Send these server events now, in order, each with its event_id (only from the writer task). A client
        that does not take one within send_timeout is a slow reader (closed with 1008)."""
        send, timeout = self.ws.send_text, self.limits.send_timeout
        for p in payloads:
            # A client that does not read fills the socket buffers and send blocks: bounded by send_timeout.
            try:
                await asyncio.wait_for(send(self._envelope(p)), timeout)
            except TimeoutError:
                raise _SlowReader() from None

    def count_error(self, code: str) -> None:
        """An error event sent to the client: the metric and the session's count."""
        self.metrics.client_errors.labels(code=code).inc()
        if self.channel is not None:
            self.channel.errors += 1

    def open_session(self, params: SessionParams) -> None:
        """Ask the worker for the model session (the server's prompt limit applied); answered in the outbox by
        SessionOpened or SessionRefused."""
        params = replace(params, max_prompt_tokens=self.limits.max_prompt_tokens)
        self._session_params = params
        self.configured = True
        self.submit(OpenSession(params))

    def submit(self, command: Command) -> None:
        """A command (voicechat.server.messages) for this connection's session, behind the ones before it."""
        self.state.worker.submit(self.channel, command)

    def cancel(self) -> None:
        """Cancel the session: queued audio is dropped; answered by the session's Cancelled event and Finished."""
        self.ending = True
        self.channel.cancel_requested.set()  # the worker skips audio still queued
        self.submit(Cancel())

    def switch_dialect(self, name: str) -> Dialect:
        """Speak `name` from now on (mlx-vlm's first session.update written for GA); -> the new dialect."""
        self.dialect = make_dialect(name, self)
        return self.dialect

    def stop(self, end: str, code: int, error_code: str | None, message: str) -> None:
        """End the connection: the reader and writer are cancelled, then `error_code` (if any) and close `code`."""
        if self._stop_reason is None:
            self._stop_reason = (end, code, error_code, message)
        self._stop_event.set()

    async def admit_audio(self, pcm) -> None:
        """Admission of 16 kHz input samples (every dialect's appends): the session's audio limit, then
        backpressure (`_room_for`), then to the worker. ProtocolError when refused (nothing was accepted,
        or what was dropped is said)."""
        ch, lim = self.channel, self.limits
        rate = P.INPUT_SAMPLE_RATE
        if ch.received_samples + pcm.size > lim.max_session_audio_seconds * rate:
            raise P.ProtocolError(
                "session_audio_limit",
                f"this append ({pcm.size} samples) would take the "
                f"session past {lim.max_session_audio_seconds:g} s of audio; it was not accepted. "
                "Commit the turn and start a new session",
            )
        if pcm.size == 0:
            return
        if not await self._room_for(pcm.size):
            ch.overflows += 1
            ch.dropped_samples += int(pcm.size)
            raise P.ProtocolError(
                "input_overflow",
                f"the model made no room in {lim.backpressure_timeout:g} s "
                f"(it is {ch.queued_samples / rate:.2f} s of audio behind); this append of "
                f"{pcm.size} samples ({pcm.size / rate:.3f} s) was dropped, "
                f"{ch.dropped_samples} samples dropped in this session so far",
            )
        ch.received_samples += int(pcm.size)
        self.metrics.audio_in_seconds.inc(pcm.size / rate)
        self.submit(AppendAudio(pcm))

    # -- sending (only the writer task sends on the socket; everyone else goes through the outbox)

    def _envelope(self, payload: dict) -> str:
        self._event_seq += 1
        return json.dumps({"event_id": f"evt_{self._event_seq:06d}", **payload}, separators=(",", ":"))

    # -- lifecycle

    async def run(self) -> None:
        ws, st = self.ws, self.state
        headers = ws.headers
        subprotocol = None
        offered = [p.strip() for p in headers.get("sec-websocket-protocol", "").split(",") if p.strip()]
        if offered:
            subprotocol = offered[0]
        if not await self._acquire():
            self.metrics.sessions_refused.labels(reason="busy").inc()
            await ws.accept(subprotocol=subprotocol)
            n = st.max_sessions
            busy = (
                "another session is active on this server (one session per process); retry later"
                if n == 1
                else f"all {n} session slots of this server are taken (--max-sessions {n}); retry later"
            )
            await ws.send_text(self._envelope(self.dialect.error_payload("server_busy", busy)))
            await ws.close(code=CLOSE_TRY_AGAIN)
            return
        self.metrics.sessions_opened.inc()
        self.metrics.sessions_active.set(st.active_sessions)
        loop = asyncio.get_running_loop()
        peer = f"{ws.client.host}:{ws.client.port}" if ws.client else ""
        self.channel = Channel(
            self.session_id,
            loop,
            asyncio.Queue(),
            peer=peer,
            max_outbox=self.limits.max_outbound_events,
            on_overfull=lambda: self.stop(
                "slow_consumer",
                CLOSE_POLICY,
                None,
                f"more than {self.limits.max_outbound_events} events wait for this client",
            ),
        )
        st.connections.add(self)
        try:
            await ws.accept(subprotocol=subprotocol)
            self.dialect.connected()
            reader = asyncio.create_task(self._reader())
            writer = asyncio.create_task(self._writer())
            stopper = asyncio.create_task(self._stop_event.wait())
            done, pending = await asyncio.wait({reader, writer, stopper}, return_when=asyncio.FIRST_COMPLETED)
            for t in pending:
                t.cancel()
            for t in pending:
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await t
            for t in done:
                if (
                    t is not stopper
                    and not t.cancelled()
                    and t.exception() is not None
                    and not isinstance(t.exception(), WebSocketDisconnect)
                ):
                    # A bug on the network side: the traceback to the log, a code without internals to the client.
                    log.error("connection %s failed", self.session_id, exc_info=t.exception())
                    self.stop(
                        "internal_error",
                        CLOSE_INTERNAL,
                        "internal_error",
                        "the server failed while handling this session; it was ended",
                    )
            if self._stop_reason is not None:
                await self._final_close()
        finally:
            ch = self.channel
            ch.gone.set()
            st.connections.discard(self)
            if self.configured:
                self.submit(Close())
                # Wait for the worker's log line, so the slot is free only when the session is gone.
                await self._wait_closed(timeout=30.0)
            if ch.end not in ("done", "cancelled", "disconnect"):
                self.metrics.sessions_errored.labels(reason=ch.end).inc()
            st.release(self.session_id)
            self.metrics.sessions_active.set(st.active_sessions)

    async def _final_close(self) -> None:
        end, code, error_code, message = self._stop_reason
        self.channel.end = end
        if error_code is not None:
            self.metrics.client_errors.labels(code=error_code).inc()
            with contextlib.suppress(
                Exception
            ):  # the client is gone or does not read: the close below still frees the slot
                await asyncio.wait_for(
                    self.ws.send_text(self._envelope(P.error_event(error_code, message))), CLOSE_WAIT_SECONDS
                )
        else:
            log.warning("session %s: %s; closing with %d", self.session_id, message, code)
        with contextlib.suppress(Exception):
            await asyncio.wait_for(self.ws.close(code=code), CLOSE_WAIT_SECONDS)

    async def _acquire(self) -> bool:
        """Take a slot; a session that is just closing (its client reconnects at once) gets a short grace."""
        deadline = time.monotonic() + self.limits.busy_grace_seconds
        while not self.state.try_acquire(self.session_id):
            if time.monotonic() >= deadline:
                return False
            await asyncio.sleep(0.02)
        return True

    async def _wait_closed(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while (left := deadline - time.monotonic()) > 0:
            try:
                out = await asyncio.wait_for(self.channel.outbox.get(), left)
            except TimeoutError:
                break
            if isinstance(out, Closed):
                return
        log.error("session %s: the worker did not close the session within %.0f s", self.session_id, timeout)

    async def _close(self, code: int, end: str) -> None:
        self.channel.end = end
        with contextlib.suppress(Exception):  # already closed by the peer, or it does not read
            await asyncio.wait_for(self.ws.close(code=code), CLOSE_WAIT_SECONDS)

    # -- the writer: worker outputs and our own replies, in order

    async def _writer(self) -> None:
        try:
            await self._write_loop()
        except _SlowReader:
            self.stop(
                "slow_consumer",
                CLOSE_POLICY,
                None,
                f"the client took more than {self.limits.send_timeout:g} s to take one event (--send-timeout)",
            )

    async def _write_loop(self) -> None:
        outbox = self.channel.outbox
        while True:
            out = await outbox.get()
            match out:
                case Reply(payload=payload):
                    await self.send_now((payload,))
                case SessionError(code=code, message=message):
                    self.count_error(code)
                    await self.send_now((self.dialect.error_payload(code, message),))
                case Finished(end=end):
                    # Session over: done / cancelled / context limit close normally; a worker failure with 1011.
                    await self.dialect.finishing(end)
                    await self._close(CLOSE_INTERNAL if end == "internal_error" else CLOSE_NORMAL, end)
                    return
                case TimedOut(code=code, message=message):
                    self.metrics.client_errors.labels(code=code).inc()
                    message = self.dialect.timeout_message(code, message)
                    await self.send_now((self.dialect.error_payload(code, message),))
                    await self._close(CLOSE_POLICY, code)
                    return
                case Disconnected():
                    return
                case _:  # the session's outputs (frames, opened / refused, markers): the dialect renders them
                    await self.dialect.on_output(out)

    # -- the reader: client messages, bounded, then the dialect's

    async def _reader(self) -> None:
        ch, lim = self.channel, self.limits
        connected_at = time.monotonic()
        last_message = connected_at
        while True:
            # The nearest deadline names the timeout. (Not a clock re-read after the wait: event-loop
            # timers may fire up to their resolution early, e.g. uvloop's 1 ms.)
            deadline, reason = last_message + lim.idle_timeout, "idle_timeout"
            if not self.configured and connected_at + lim.session_update_timeout <= deadline:
                deadline, reason = connected_at + lim.session_update_timeout, "session_update_timeout"
            if connected_at + lim.max_session_seconds <= deadline:
                deadline, reason = connected_at + lim.max_session_seconds, "session_time_limit"
            try:
                msg = await asyncio.wait_for(self.ws.receive(), max(deadline - time.monotonic(), 0.0))
            except TimeoutError:
                ch.outbox.put_nowait(
                    TimedOut(
                        reason,
                        {
                            "session_update_timeout": f"no session.update within {lim.session_update_timeout:g} s of "
                            "connecting; closing",
                            "idle_timeout": f"no message for {lim.idle_timeout:g} s; closing",
                            "session_time_limit": f"the session reached {lim.max_session_seconds:g} s of "
                            "wall-clock time (--max-session-seconds); closing. Start a new session",
                        }[reason],
                    )
                )
                await asyncio.Event().wait()  # the writer closes the socket and ends the connection
            if msg["type"] == "websocket.disconnect":
                ch.outbox.put_nowait(Disconnected())
                return
            text = msg.get("text")
            if text is None:
                text = msg.get("bytes")
            if self.ending:
                last_message = time.monotonic()
                continue  # commit / cancel already sent; the session's last events are on their way
            try:
                check_size(text if text is not None else "", lim.max_message_bytes)
                await self.dialect.handle_text(text)  # parses, validates and answers in its own format
            except MessageRefused as e:
                self.dialect.error(e.code, str(e))
            except Exception:  # a bug, not the client's fault: the session goes on, the log has it
                log.exception("session %s: a client message could not be handled", self.session_id)
                self.dialect.error(
                    "internal_error",
                    "this message could not be handled (the server log has the details); the session goes on",
                )
            # After the message is handled: time spent waiting for room (backpressure) is not idleness.
            last_message = time.monotonic()

    async def _room_for(self, n: int) -> bool:
        """Backpressure: wait (not reading the socket, so TCP slows the client) until the backlog has room for
        `n` samples; an idle session takes any size. False when no room came within backpressure_timeout."""
        ch, lim, w = self.channel, self.limits, self.state.worker
        bound = lim.max_queued_audio_seconds * P.INPUT_SAMPLE_RATE
        deadline = time.monotonic() + lim.backpressure_timeout
        while ch.queued_samples > 0 and (ch.queued_samples + n > bound or w.queue_depth() >= lim.max_queued_appends):
            if time.monotonic() >= deadline:
                return False
            await asyncio.sleep(0.005)
        return True


class _SlowReader(Exception):
    """The client did not take an event within send_timeout."""
