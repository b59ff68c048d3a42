"""The ASGI app: `/v1/realtime` (WebSocket), `/healthz`, `/metrics`, and the browser page at `/`.

Starlette under uvicorn. The asyncio side parses, validates and admits messages and
forwards them to the MLX worker thread (`worker.ModelWorker`); it never touches MLX.
One active session per process: a second connection gets `server_busy` and close 1013.
"""

from __future__ import annotations

import asyncio
import json
import logging
import threading
import time
import uuid
from dataclasses import dataclass, field
from importlib import resources

from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.responses import JSONResponse, Response
from starlette.routing import Route, WebSocketRoute
from starlette.websockets import WebSocket, WebSocketDisconnect

from voicechat.server import protocol as P
from voicechat.server.dialects import make_dialect
from voicechat.server.dialects.common import DialectOptions, dialect_for_query, openai_error, wants_ga
from voicechat.server.limits import ServerLimits
from voicechat.server.metrics import ServerMetrics
from voicechat.server.security import SecurityMiddleware, ServerSecurity, excerpt
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
    _slot: str | None = None
    _slot_lock: threading.Lock = field(default_factory=threading.Lock)
    connections: set = field(default_factory=set)  # live RealtimeConnections (closed with 1001 at shutdown)

    async def close_sessions(self, timeout: float) -> None:
        """Close every live session with 1001 and wait (at most `timeout`) until they are gone."""
        for c in list(self.connections):
            c.stop("shutdown", CLOSE_GOING_AWAY, "server_shutdown", "the server is shutting down; the session "
                                                                      "ended (reconnect when it is back)")
        deadline = time.monotonic() + timeout
        while self.connections and time.monotonic() < deadline:
            await asyncio.sleep(0.02)

    def try_acquire(self, session_id: str) -> bool:
        with self._slot_lock:
            if self._slot is not None:
                return False
            self._slot = session_id
            return True

    def release(self, session_id: str) -> None:
        with self._slot_lock:
            if self._slot == session_id:
                self._slot = None

    @property
    def active_session(self) -> str | None:
        return self._slot


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
        # ok / busy / unavailable only: the model's path and the queue are for /metrics (behind the key).
        w = state.worker
        ok = w.ready.is_set() and w.load_error is None and w.alive
        status = ("busy" if state.active_session is not None else "ok") if ok else "unavailable"
        return JSONResponse({"status": status}, status_code=200 if ok else 503)

    async def metrics(request):
        # The key (when set) is checked by SecurityMiddleware, as for every upgrade.
        state.metrics.queue_depth.set(state.worker.queue_depth())
        return Response(state.metrics.render(), media_type=ServerMetrics.content_type)

    async def realtime(ws: WebSocket):
        # mlx-vlm's dialect unless the URL or the first session.update asks for OpenAI's (dialect.py).
        await RealtimeConnection(state, ws, dialect=dialect_for_query(ws.query_params)).run()

    async def live(ws: WebSocket):
        await RealtimeConnection(state, ws, dialect="live").run()

    routes = [Route(p, page) for p in ASSETS]
    routes += [Route("/healthz", healthz), Route("/metrics", metrics), WebSocketRoute("/v1/realtime", realtime),
               WebSocketRoute("/v1/live/sessions", live)]
    app = Starlette(routes=routes, middleware=[Middleware(SecurityMiddleware, security=state.security,
                                                          metrics=state.metrics)])
    app.state.server = state
    return app


class RealtimeConnection:
    """One WebSocket connection = at most one streaming session.

    Host, Origin and key were checked by SecurityMiddleware before this runs. Every client message
    is bounded and validated (validation.py); no exception from one reaches the reader's top level.
    """

    def __init__(self, state: ServerState, ws: WebSocket, dialect: str | None = None):
        self.state = state
        self.ws = ws
        self.m = state.metrics
        self.limits = state.limits
        self.session_id = f"sess_{uuid.uuid4().hex[:16]}"
        self._event_seq = 0
        self.channel: Channel | None = None
        self.configured = False
        self.ending = False  # commit / cancel sent: the rest of the input is ignored
        self.info: dict = {}
        self._session_params: dict = {}
        # stop(): end the connection from outside the reader / writer (shutdown, slow reader).
        self._stop_event = asyncio.Event()
        self._stop_reason: tuple | None = None  # (end, close code, error code or None, message)
        # None: mlx-vlm's dialect (this class); else the OpenAI dialect that translates both ways
        # (made once the channel exists).
        self._dialect_name = dialect
        self.dialect = None

    # -- sending (only the writer task sends on the socket; everyone else goes through the outbox)

    def _envelope(self, payload: dict) -> str:
        self._event_seq += 1
        return json.dumps({"event_id": f"evt_{self._event_seq:06d}", **payload}, separators=(",", ":"))

    def _queue(self, payload: dict) -> None:
        self.channel.outbox.put_nowait(("send", payload))

    def _error_event(self, code: str, message: str) -> dict:
        if self.dialect is not None:
            return self.dialect.error_payload(code, message)
        return openai_error(code, message) if self._dialect_name else P.error_event(code, message)

    def _error(self, code: str, message: str) -> None:
        self.m.client_errors.labels(code=code).inc()
        if self.channel is not None:
            self.channel.errors += 1
        self._queue(self._error_event(code, message))

    async def _send(self, payload: dict) -> None:
        # A client that does not read fills the socket buffers and send blocks: bounded by send_timeout.
        try:
            await asyncio.wait_for(self.ws.send_text(self._envelope(payload)), self.limits.send_timeout)
        except asyncio.TimeoutError:
            raise _SlowReader() from None

    def stop(self, end: str, code: int, error_code: str | None, message: str) -> None:
        """End the connection: the reader and writer are cancelled, then `error_code` (if any) and close `code`."""
        if self._stop_reason is None:
            self._stop_reason = (end, code, error_code, message)
        self._stop_event.set()

    # -- lifecycle

    async def run(self) -> None:
        ws, st = self.ws, self.state
        headers = ws.headers
        subprotocol = None
        offered = [p.strip() for p in headers.get("sec-websocket-protocol", "").split(",") if p.strip()]
        if offered:
            subprotocol = offered[0]
        if not await self._acquire():
            self.m.sessions_refused.labels(reason="busy").inc()
            await ws.accept(subprotocol=subprotocol)
            await ws.send_text(self._envelope(self._error_event(
                "server_busy", "another session is active on this server (one session per process); retry later")))
            await ws.close(code=CLOSE_TRY_AGAIN)
            return
        self.m.sessions_opened.inc()
        self.m.sessions_active.set(1)
        loop = asyncio.get_running_loop()
        peer = f"{ws.client.host}:{ws.client.port}" if ws.client else ""
        self.channel = Channel(self.session_id, loop, asyncio.Queue(), peer=peer,
                               max_outbox=self.limits.max_outbound_events,
                               on_overfull=lambda: self.stop(
                                   "slow_consumer", CLOSE_POLICY, None,
                                   f"more than {self.limits.max_outbound_events} events wait for this client"))
        if self._dialect_name:
            self.dialect = make_dialect(self._dialect_name, self)
        st.connections.add(self)
        try:
            await ws.accept(subprotocol=subprotocol)
            info = st.worker.info
            if self.dialect is not None:
                self.dialect.connected()
            else:
                self._queue({"type": "session.created", "session": {
                    "id": self.session_id, "state": "configuring", "model": st.model_name,
                    "input_audio_format": P.AudioFormat(info["input_sample_rate"]).as_dict(),
                    "output_audio_format": P.AudioFormat(info["output_sample_rate"]).as_dict(),
                    "limits": {"max_message_bytes": self.limits.max_message_bytes,
                               "max_session_audio_seconds": self.limits.max_session_audio_seconds,
                               "max_session_seconds": self.limits.max_session_seconds,
                               "max_prompt_tokens": self.limits.max_prompt_tokens,
                               "session_update_timeout": self.limits.session_update_timeout,
                               "idle_timeout": self.limits.idle_timeout,
                               "max_queued_audio_seconds": self.limits.max_queued_audio_seconds}}})
            reader = asyncio.create_task(self._reader())
            writer = asyncio.create_task(self._writer())
            stopper = asyncio.create_task(self._stop_event.wait())
            done, pending = await asyncio.wait({reader, writer, stopper}, return_when=asyncio.FIRST_COMPLETED)
            for t in pending:
                t.cancel()
            for t in pending:
                try:
                    await t
                except (asyncio.CancelledError, Exception):
                    pass
            for t in done:
                if t is not stopper and not t.cancelled() and t.exception() is not None and \
                        not isinstance(t.exception(), WebSocketDisconnect):
                    # A bug on the network side: the traceback to the log, a code without internals to the client.
                    log.error("connection %s failed", self.session_id, exc_info=t.exception())
                    self.stop("internal_error", CLOSE_INTERNAL, "internal_error",
                              "the server failed while handling this session; it was ended")
            if self._stop_reason is not None:
                await self._final_close()
        finally:
            ch = self.channel
            ch.gone.set()
            st.connections.discard(self)
            if self.configured:
                st.worker.submit("close", ch)
                # Wait for the worker's log line, so the slot is free only when the session is gone.
                await self._wait_closed(timeout=30.0)
            if ch.end not in ("done", "cancelled", "disconnect"):
                self.m.sessions_errored.labels(reason=ch.end).inc()
            st.release(self.session_id)
            self.m.sessions_active.set(0 if st.active_session is None else 1)

    async def _final_close(self) -> None:
        end, code, error_code, message = self._stop_reason
        self.channel.end = end
        if error_code is not None:
            self.m.client_errors.labels(code=error_code).inc()
            try:
                await asyncio.wait_for(self.ws.send_text(self._envelope(P.error_event(error_code, message))),
                                       CLOSE_WAIT_SECONDS)
            except Exception:  # the client is gone or does not read: the close below still frees the slot
                pass
        else:
            log.warning("session %s: %s; closing with %d", self.session_id, message, code)
        try:
            await asyncio.wait_for(self.ws.close(code=code), CLOSE_WAIT_SECONDS)
        except Exception:
            pass

    async def _acquire(self) -> bool:
        """Take the slot; a session that is just closing (its client reconnects at once) gets a short grace."""
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
                item = await asyncio.wait_for(self.channel.outbox.get(), left)
            except asyncio.TimeoutError:
                break
            if item[0] == "closed":
                return
        log.error("session %s: the worker did not close the session within %.0f s", self.session_id, timeout)

    async def _close(self, code: int, end: str) -> None:
        self.channel.end = end
        try:
            await asyncio.wait_for(self.ws.close(code=code), CLOSE_WAIT_SECONDS)
        except Exception:  # already closed by the peer, or it does not read
            pass

    # -- the writer: worker results and our own replies, in order

    async def _writer(self) -> None:
        try:
            await self._write_loop()
        except _SlowReader:
            self.stop("slow_consumer", CLOSE_POLICY, None,
                      f"the client took more than {self.limits.send_timeout:g} s to take one event "
                      "(--send-timeout)")

    async def _write_loop(self) -> None:
        ch = self.channel
        while True:
            item = await ch.outbox.get()
            kind = item[0]
            if self.dialect is not None:  # True: handled by the dialect; a tuple: the item it should be
                handled = await self.dialect.on_item(item)
                if handled is True:
                    continue
                if isinstance(handled, tuple):
                    item, kind = handled, handled[0]
            if kind == "send":
                await self._send(item[1])
            elif kind == "events":
                for payload in item[1]:
                    await self._send(payload)
            elif kind == "opened":
                self.info = item[1]
                s = self._session_params
                await self._send({"type": "session.updated", "session": {
                    "id": self.session_id, "state": "ready", "model": self.state.model_name,
                    "system_prompt": s["system_prompt"], "seed": s["seed"],
                    "max_streaming_seconds": s["max_streaming_seconds"],
                    "frame_samples": self.info["frame_samples"],
                    "output_frame_samples": self.info["output_frame_samples"],
                    "num_codebooks": self.info["num_codebooks"],
                    "input_audio_format": P.AudioFormat(self.info["input_sample_rate"]).as_dict(),
                    "output_audio_format": P.AudioFormat(self.info["output_sample_rate"]).as_dict()}})
            elif kind == "open_failed":
                self.configured = False  # the client may try another session.update
                self.m.client_errors.labels(code=item[1]).inc()
                ch.errors += 1
                await self._send(self._error_event(item[1], item[2]))
            elif kind == "error":
                self.m.client_errors.labels(code=item[1]).inc()
                ch.errors += 1
                await self._send(self._error_event(item[1], item[2]))
            elif kind == "finished":
                # Session over: done / cancelled / context limit close normally; a worker failure with 1011.
                await self._close(CLOSE_INTERNAL if item[1] == "internal_error" else CLOSE_NORMAL, item[1])
                return
            elif kind == "timeout":
                code, message = item[1], item[2]
                self.m.client_errors.labels(code=code).inc()
                await self._send(self._error_event(code, message))
                await self._close(CLOSE_POLICY, code)
                return
            elif kind == "disconnect":
                return

    # -- the reader: client messages, validated and admitted

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
            except asyncio.TimeoutError:
                ch.outbox.put_nowait(("timeout", reason, {
                    "session_update_timeout": f"no session.update within {lim.session_update_timeout:g} s of "
                                              "connecting; closing",
                    "idle_timeout": f"no message for {lim.idle_timeout:g} s; closing",
                    "session_time_limit": f"the session reached {lim.max_session_seconds:g} s of wall-clock time "
                                          "(--max-session-seconds); closing. Start a new session"}[reason]))
                await asyncio.Event().wait()  # the writer closes the socket and ends the connection
            if msg["type"] == "websocket.disconnect":
                ch.outbox.put_nowait(("disconnect",))
                return
            text = msg.get("text")
            if text is None:
                text = msg.get("bytes")
            if self.ending:
                last_message = time.monotonic()
                continue  # commit / cancel already sent; the session's last events are on their way
            try:
                check_size(text if text is not None else "", lim.max_message_bytes)
                if self.dialect is not None:  # parses, validates and answers in its own format
                    await self.dialect.handle_text(text)
                else:
                    await self._dispatch(P.parse_message(text))
            except MessageRefused as e:
                self._error(e.code, str(e))
            except Exception:  # a bug, not the client's fault: the session goes on, the log has it
                log.exception("session %s: a client message could not be handled", self.session_id)
                self._error("internal_error", "this message could not be handled (the server log has the details); "
                                              "the session goes on")
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

    async def _dispatch(self, msg: dict) -> None:
        t, ch, st, lim = msg["type"], self.channel, self.state, self.limits
        if t == P.PING:
            self._queue({"type": "session.pong"})
            return
        if t == P.SESSION_UPDATE:
            if self.configured:
                raise P.ProtocolError("session_already_configured",
                                      "session.update may be sent once, before audio; this session is configured")
            if wants_ga(msg):  # an OpenAI Realtime GA client that did not name a model in the URL
                self.dialect = make_dialect("ga", self)
                await self.dialect.handle_msg(msg)
                return
            params = P.decode_session_update(msg, max_streaming_seconds=lim.max_session_audio_seconds)
            self._session_params = params
            self.configured = True
            st.worker.submit("open", ch, {**params, "max_prompt_tokens": lim.max_prompt_tokens})
            return
        if not self.configured:
            raise P.ProtocolError("session_not_configured", f"send session.update before {t}")
        if t == P.APPEND:
            await self._admit_audio(P.decode_append(msg))
            return
        if t == P.COMMIT:
            pad = msg.get("pad_partial", True)
            if not isinstance(pad, bool):
                raise P.ProtocolError("invalid_message", f"pad_partial must be true or false, got {excerpt(pad)}")
            self.ending = True
            # `input_audio_buffer.committed` comes from the worker, after the frames of the audio before it
            # (the order mlx-vlm's server gives).
            st.worker.submit("commit", ch, pad)
            return
        if t in P.CANCEL_TYPES:
            self.ending = True
            ch.cancel_requested.set()  # the worker skips audio still queued
            st.worker.submit("cancel", ch)
            return

    async def _admit_audio(self, pcm) -> None:
        """Admission of 16 kHz input samples (every dialect's appends): the session's audio limit, then
        backpressure (`_room_for`), then to the worker. ProtocolError when refused (nothing was accepted,
        or what was dropped is said)."""
        ch, st, lim = self.channel, self.state, self.limits
        rate = P.INPUT_SAMPLE_RATE
        if ch.received_samples + pcm.size > lim.max_session_audio_seconds * rate:
            raise P.ProtocolError("session_audio_limit", f"this append ({pcm.size} samples) would take the "
                                  f"session past {lim.max_session_audio_seconds:g} s of audio; it was not accepted. "
                                  "Commit the turn and start a new session")
        if pcm.size == 0:
            return
        if not await self._room_for(pcm.size):
            ch.overflows += 1
            ch.dropped_samples += int(pcm.size)
            raise P.ProtocolError("input_overflow", f"the model made no room in {lim.backpressure_timeout:g} s "
                                  f"(it is {ch.queued_samples / rate:.2f} s of audio behind); this append of "
                                  f"{pcm.size} samples ({pcm.size / rate:.3f} s) was dropped, "
                                  f"{ch.dropped_samples} samples dropped in this session so far")
        ch.received_samples += int(pcm.size)
        self.m.audio_in_seconds.inc(pcm.size / rate)
        st.worker.submit("append", ch, pcm)


class _SlowReader(Exception):
    """The client did not take an event within send_timeout."""
