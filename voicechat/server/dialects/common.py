"""Which wire dialect a connection speaks, and the interface every dialect implements.

One server, three dialects, chosen per connection (docs/server.md, "Dialects"):

* `/v1/live/sessions`: OpenAI Live (dialects/live.py).
* `/v1/realtime` with `?dialect=openai` or a `?model=` query (the openai SDK, pipecat and LiveKit
  always add one): OpenAI Realtime GA (dialects/ga.py) from the first event (`session.created`).
* `/v1/realtime` without either: mlx-vlm's dialect (dialects/mlx_vlm.py), unless the first
  `session.update` is a GA one (`session.type == "realtime"`, or GA-only fields: `audio`,
  `output_modalities`, `tools`); then the connection switches to GA at that message.
* `?dialect=mlx-vlm` forces mlx-vlm's dialect whatever else the URL has.

The connection (app.RealtimeConnection) keeps the lifecycle (auth, Origin, the session slot, limits,
timeouts, metrics, the worker channel); a dialect parses the client's text messages, acts through
the connection's public surface (`send`, `send_now`, `admit_audio`, `open_session`, `submit`,
`cancel`, `count_error`, `switch_dialect`, `configured`, `ending`, `session_params`, ...) and renders
the worker's outputs (voicechat.server.messages) as its own server events.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass

from voicechat.server.validation import MessageRefused, parse_json_object

# session.update fields only a GA client sends (mlx-vlm's session has system_prompt / seed / model).
GA_ONLY_FIELDS = ("audio", "output_modalities", "tools", "tool_choice", "tracing", "truncation", "prompt")


@dataclass
class DialectOptions:
    """Serving choices of the OpenAI dialects (`voicechat serve` flags)."""

    # A response ends at the first run of this many silent frames (8 x 80 ms = 640 ms); a user turn
    # ends after as many frames without a transcript token.
    silence_frames: int = 8
    # A response.create while the model is silent waits this many frames for speech, then completes empty.
    response_wait_frames: int = 38
    # Silent frame: its codes are the codec's silence codes, or its peak is below this (dBFS).
    silence_dbfs: float = -50.0


def dialect_for_query(query) -> str:
    """The dialect a /v1/realtime URL asks for: "ga", or "mlx-vlm" (forced, or the default, which a first
    GA session.update still switches to GA)."""
    forced = query.get("dialect")
    if forced in ("mlx-vlm", "mlxcel"):
        return "mlx-vlm"
    if forced in ("openai", "ga") or query.get("model"):
        return "ga"
    return "mlx-vlm"


def wants_ga(msg: dict) -> bool:
    """A first session.update written for OpenAI Realtime GA."""
    s = msg.get("session")
    if not isinstance(s, dict):
        return False
    return s.get("type") in ("realtime", "transcription") or any(k in s for k in GA_ONLY_FIELDS)


def openai_error(code: str, message: str, client_event_id=None, key: str = "event_id") -> dict:
    """OpenAI's error event: `error {type, code, message}` (+ the client event's id when it had one)."""
    err = {
        "type": "server_error" if code in ("internal_error", "server_busy") else "invalid_request_error",
        "code": code,
        "message": message,
    }
    if isinstance(client_event_id, str):
        err[key] = client_event_id
    return {"type": "error", "error": err}


class Dialect:
    """Base of the dialects. `conn` is the app.RealtimeConnection that owns the socket; a dialect uses
    only its public surface (docs/server.md, "Internals")."""

    name = ""

    def __init__(self, conn):
        self.conn = conn
        self.options: DialectOptions = conn.dialect_options

    # -- called by the connection

    def connected(self) -> None:
        """The socket is accepted: queue the first events."""

    async def handle_text(self, text) -> None:
        """One client text message (size already checked by the connection): parsed with the guarded
        parser (validation.py), then `handle`; a refusal is answered in this dialect's error format."""
        try:
            msg = parse_json_object(text)
        except MessageRefused as e:
            return self.error(e.code, str(e))
        if not isinstance(msg.get("type"), str):
            return self.error("invalid_message", "expected a JSON object with a string 'type'")
        await self.handle_msg(msg)

    async def handle_msg(self, msg: dict) -> None:
        """`handle` one parsed message; its refusal (MessageRefused) becomes an error event."""
        try:
            result = self.handle(msg)
            if inspect.isawaitable(result):  # handlers that admit audio wait for room (backpressure)
                await result
        except MessageRefused as e:
            self.error(e.code, str(e), client_event_id=msg.get("event_id"))

    def handle(self, msg: dict):
        """Handle one client event; may return an awaitable (audio admission waits for room)."""
        raise NotImplementedError

    async def on_output(self, out) -> None:
        """One of the worker's outputs for this dialect to render (from the writer task, so it may
        `conn.send_now`): SessionOpened, SessionRefused, FrameEvents, Committed, Synced, ToolOutputSent.
        The connection handles the lifecycle ones (Reply, SessionError, Finished, TimedOut, Disconnected)."""

    async def finishing(self, end: str) -> None:
        """The session is over (`end`: done, cancelled, ...); the socket closes after this returns."""

    def timeout_message(self, code: str, message: str) -> str:
        """The message of a timeout error (`code`), in this dialect's words."""
        return message

    def error_payload(self, code: str, message: str, client_event_id=None) -> dict:
        return openai_error(code, message, client_event_id)

    # -- helpers

    def error(self, code: str, message: str, client_event_id=None) -> None:
        self.conn.count_error(code)
        self.conn.send(self.error_payload(code, message, client_event_id))

    def send(self, payload: dict) -> None:
        self.conn.send(payload)
