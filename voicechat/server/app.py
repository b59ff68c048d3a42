"""The ASGI app: `/v1/realtime` (WebSocket), `/healthz`, `/metrics`, and the browser page at `/`.

Starlette under uvicorn. The asyncio side parses, validates and admits messages and
forwards them to the MLX worker thread (`worker.ModelWorker`); it never touches MLX.
One active session per process: a second connection gets `server_busy` and close 1013.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import threading
import time
import uuid
from dataclasses import dataclass, field
from importlib import resources
from urllib.parse import urlsplit

from starlette.applications import Starlette
from starlette.responses import JSONResponse, PlainTextResponse, Response
from starlette.routing import Route, WebSocketRoute
from starlette.websockets import WebSocket, WebSocketDisconnect

from . import protocol as P
from .dialect import DialectOptions, dialect_for_query, make_dialect, openai_error, wants_ga
from .limits import ServerLimits
from .metrics import ServerMetrics
from .worker import Channel, ModelWorker

log = logging.getLogger("voicechat.server")

# WebSocket close codes (RFC 6455 / IANA registry).
CLOSE_NORMAL = 1000
CLOSE_POLICY = 1008  # idle or session.update timeout
CLOSE_TRY_AGAIN = 1013  # server_busy

# The page's own assets, by URL path; nothing else on disk is ever served.
ASSETS = {
    "/": ("index.html", "text/html; charset=utf-8"),
    "/index.html": ("index.html", "text/html; charset=utf-8"),
    "/static/app.js": ("app.js", "text/javascript; charset=utf-8"),
    "/static/worklets.js": ("worklets.js", "text/javascript; charset=utf-8"),
    "/static/style.css": ("style.css", "text/css; charset=utf-8"),
}


@dataclass
class ServerSecurity:
    api_key: str | None = None
    allowed_origins: tuple = ()  # exact "scheme://host[:port]" strings; "*" allows any

    def origin_ok(self, origin: str | None, host: str | None) -> bool:
        if origin is None:  # non-browser clients send no Origin
            return True
        if "*" in self.allowed_origins or origin in self.allowed_origins:
            return True
        # Same origin as the page this server serves.
        try:
            return host is not None and urlsplit(origin).netloc == host
        except ValueError:
            return False

    def key_ok(self, headers) -> bool:
        if self.api_key is None:
            return True
        given = None
        auth = headers.get("authorization", "")
        if auth[:7].lower() == "bearer ":
            given = auth[7:].strip()
        else:  # browsers cannot set headers on a WebSocket: the key may ride as a subprotocol
            for proto in headers.get("sec-websocket-protocol", "").split(","):
                proto = proto.strip()
                if proto.startswith("voicechat.bearer."):
                    given = proto[len("voicechat.bearer."):]
        return given is not None and hmac.compare_digest(given.encode(), self.api_key.encode())


@dataclass
class ServerState:
    worker: ModelWorker
    limits: ServerLimits = field(default_factory=ServerLimits)
    security: ServerSecurity = field(default_factory=ServerSecurity)
    model_name: str = ""
    metrics: ServerMetrics = field(default_factory=ServerMetrics)
    # The OpenAI dialects' serving options (voicechat.server.dialect.DialectOptions).
    dialect_options: DialectOptions = field(default_factory=DialectOptions)
    _slot: str | None = None
    _slot_lock: threading.Lock = field(default_factory=threading.Lock)

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
        w = state.worker
        ok = w.ready.is_set() and w.load_error is None and w.alive
        body = {"status": "ok" if ok else "unavailable", "model": state.model_name,
                "session_active": state.active_session is not None, "worker_queue": w.queue_depth()}
        return JSONResponse(body, status_code=200 if ok else 503)

    async def metrics(request):
        if not state.security.key_ok(request.headers):
            return PlainTextResponse("missing or wrong bearer token\n", status_code=401)
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
    app = Starlette(routes=routes)
    app.state.server = state
    return app


class RealtimeConnection:
    """One WebSocket connection = at most one streaming session."""

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

    async def _refuse(self, status: int, reason: str, message: str) -> None:
        self.m.sessions_refused.labels(reason=reason).inc()
        await self.ws.send_denial_response(JSONResponse(P.error_event(reason, message), status_code=status))

    # -- lifecycle

    async def run(self) -> None:
        ws, st = self.ws, self.state
        headers = ws.headers
        if not st.security.key_ok(headers):
            return await self._refuse(401, "unauthorized", "missing or wrong API key: send 'Authorization: Bearer KEY'")
        if not st.security.origin_ok(headers.get("origin"), headers.get("host")):
            return await self._refuse(403, "origin", f"Origin {headers.get('origin')!r} is not allowed "
                                                     "(see voicechat serve --allow-origin)")
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
        self.channel = Channel(self.session_id, loop, asyncio.Queue(), peer=peer)
        if self._dialect_name:
            self.dialect = make_dialect(self._dialect_name, self)
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
                               "session_update_timeout": self.limits.session_update_timeout,
                               "idle_timeout": self.limits.idle_timeout,
                               "max_queued_audio_seconds": self.limits.max_queued_audio_seconds}}})
            reader = asyncio.create_task(self._reader())
            writer = asyncio.create_task(self._writer())
            done, pending = await asyncio.wait({reader, writer}, return_when=asyncio.FIRST_COMPLETED)
            for t in pending:
                t.cancel()
            for t in pending:
                try:
                    await t
                except (asyncio.CancelledError, Exception):
                    pass
            for t in done:
                if not t.cancelled() and t.exception() is not None and \
                        not isinstance(t.exception(), WebSocketDisconnect):
                    log.error("connection %s failed: %r", self.session_id, t.exception())
                    self.channel.end = "internal_error"
        finally:
            ch = self.channel
            ch.gone.set()
            if self.configured:
                st.worker.submit("close", ch)
                # Wait for the worker's log line, so the slot is free only when the session is gone.
                await self._wait_closed(timeout=30.0)
            if ch.end not in ("done", "cancelled", "disconnect"):
                self.m.sessions_errored.labels(reason=ch.end).inc()
            st.release(self.session_id)
            self.m.sessions_active.set(0 if st.active_session is None else 1)

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
            await self.ws.close(code=code)
        except Exception:  # already closed by the peer
            pass

    # -- the writer: worker results and our own replies, in order

    async def _writer(self) -> None:
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
                await self.ws.send_text(self._envelope(item[1]))
            elif kind == "events":
                for payload in item[1]:
                    await self.ws.send_text(self._envelope(payload))
            elif kind == "opened":
                self.info = item[1]
                s = self._session_params
                await self.ws.send_text(self._envelope({"type": "session.updated", "session": {
                    "id": self.session_id, "state": "ready", "model": self.state.model_name,
                    "system_prompt": s["system_prompt"], "seed": s["seed"],
                    "max_streaming_seconds": s["max_streaming_seconds"],
                    "frame_samples": self.info["frame_samples"],
                    "output_frame_samples": self.info["output_frame_samples"],
                    "num_codebooks": self.info["num_codebooks"],
                    "input_audio_format": P.AudioFormat(self.info["input_sample_rate"]).as_dict(),
                    "output_audio_format": P.AudioFormat(self.info["output_sample_rate"]).as_dict()}}))
            elif kind == "open_failed":
                self.configured = False  # the client may try another session.update
                self.m.client_errors.labels(code=item[1]).inc()
                ch.errors += 1
                await self.ws.send_text(self._envelope(self._error_event(item[1], item[2])))
            elif kind == "error":
                self.m.client_errors.labels(code=item[1]).inc()
                ch.errors += 1
                await self.ws.send_text(self._envelope(self._error_event(item[1], item[2])))
            elif kind == "finished":
                # Session over (done / cancelled / context limit / internal error): close normally.
                await self._close(CLOSE_NORMAL, item[1])
                return
            elif kind == "timeout":
                code, message = item[1], item[2]
                self.m.client_errors.labels(code=code).inc()
                await self.ws.send_text(self._envelope(self._error_event(code, message)))
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
            # The nearer deadline names the timeout. (Not a clock re-read after the wait: event-loop
            # timers may fire up to their resolution early, e.g. uvloop's 1 ms.)
            deadline, reason = last_message + lim.idle_timeout, "idle_timeout"
            if not self.configured and connected_at + lim.session_update_timeout <= deadline:
                deadline, reason = connected_at + lim.session_update_timeout, "session_update_timeout"
            try:
                msg = await asyncio.wait_for(self.ws.receive(), max(deadline - time.monotonic(), 0.0))
            except asyncio.TimeoutError:
                if reason == "session_update_timeout":
                    ch.outbox.put_nowait(("timeout", "session_update_timeout",
                                          f"no session.update within {lim.session_update_timeout:g} s of connecting; "
                                          "closing"))
                else:
                    ch.outbox.put_nowait(("timeout", "idle_timeout",
                                          f"no message for {lim.idle_timeout:g} s; closing"))
                await asyncio.Event().wait()  # the writer closes the socket and ends the connection
            if msg["type"] == "websocket.disconnect":
                ch.outbox.put_nowait(("disconnect",))
                return
            last_message = time.monotonic()
            text = msg.get("text")
            if text is None:
                text = msg.get("bytes")
            size = len(text) if text is not None else 0
            if size > lim.max_message_bytes:
                self._error("message_too_large", f"message of {size} bytes exceeds the limit of "
                                                 f"{lim.max_message_bytes} bytes; send audio in smaller appends")
                continue
            if self.ending:
                continue  # commit / cancel already sent; the session's last events are on their way
            if self.dialect is not None:
                self.dialect.handle_text(text)
                continue
            try:
                self._dispatch(P.parse_message(text))
            except P.ProtocolError as e:
                self._error(e.code, str(e))

    def _dispatch(self, msg: dict) -> None:
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
                self.dialect.handle(msg)
                return
            self._session_params = P.decode_session_update(msg)
            self.configured = True
            st.worker.submit("open", ch, self._session_params)
            return
        if not self.configured:
            raise P.ProtocolError("session_not_configured", f"send session.update before {t}")
        if t == P.APPEND:
            self._admit_audio(P.decode_append(msg))
            return
        if t == P.COMMIT:
            pad = msg.get("pad_partial", True)
            if not isinstance(pad, bool):
                raise P.ProtocolError("invalid_message", f"pad_partial must be true or false, got {pad!r}")
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

    def _admit_audio(self, pcm) -> None:
        """Admission of 16 kHz input samples (every dialect's appends): the session's audio limit and the
        queue bound, then to the worker. ProtocolError when refused (nothing was accepted)."""
        ch, st, lim = self.channel, self.state, self.limits
        rate = P.INPUT_SAMPLE_RATE
        if ch.received_samples + pcm.size > lim.max_session_audio_seconds * rate:
            raise P.ProtocolError("session_audio_limit", f"this append ({pcm.size} samples) would take the "
                                  f"session past {lim.max_session_audio_seconds:g} s of audio; it was not accepted. "
                                  "Commit the turn and start a new session")
        if ch.queued_samples + pcm.size > lim.max_queued_audio_seconds * rate or \
                st.worker.queue_depth() >= lim.max_queued_appends:
            ch.overflows += 1
            raise P.ProtocolError("input_overflow", f"the server is {ch.queued_samples / rate:.2f} s of audio "
                                  f"behind (limit {lim.max_queued_audio_seconds:g} s); this append of {pcm.size} "
                                  "samples was NOT accepted. Send slower (real time) or resend it later")
        if pcm.size == 0:
            return
        ch.received_samples += int(pcm.size)
        self.m.audio_in_seconds.inc(pcm.size / rate)
        st.worker.submit("append", ch, pcm)
