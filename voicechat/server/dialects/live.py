"""OpenAI Live on /v1/live/sessions (docs/server.md, "OpenAI Live").

Live is full duplex like the model: after `session.start` the model's audio is one continuous
`session.output_audio.delta` stream (one delta per 80 ms frame, silence included), and the two
transcripts are `session.input_transcript.delta` / `session.output_transcript.delta` with the
frame's place on the session timeline (`start_ms`, `end_ms`). `session.close` runs the last
partial frame, sends the codec's held-back samples, `session.closed`, and closes with 1000.
Audio is `audio/pcm` at 16 or 24 kHz both ways (soxr to and from the model's 16 / 22.05 kHz).

Function calls go the way of Live's Responses delegation (`session.delegation = {type: "responses",
responses: {model, tools}}`): the model is its own backend, so a `ToolCall` is a
`session.delegation.created` (target `responses`) and the delegated response's events wrapped in
`response.event` (`response.created`, `response.output_item.done` with the `function_call` item,
`response.completed`); the client's `response.item.create {function_call_output}` is the session's
`submit_tool_result`, and `response.create` (Live's "continue") is accepted: the model goes on by itself.
The tools are fixed at `session.start` (the model's prompt): a `session.update` asking for others is
echoed with the session as it runs, and logged.
"""

from __future__ import annotations

import base64
import json
import logging
import time

import numpy as np

from voicechat.events import AssistantTextDelta, Audio, AudioTail, ToolCall, UserTranscriptDelta
from voicechat.server import protocol as P
from voicechat.server.dialects.common import Dialect, openai_error
from voicechat.server.dialects.ga import FRAME_MS, parse_format, public_model_name
from voicechat.server.messages import (
    Commit,
    FrameEvents,
    SessionOpened,
    SessionParams,
    SessionRefused,
    SubmitToolResult,
)
from voicechat.server.resample import StreamResampler, pcm16_to_float
from voicechat.tools.channel import normalize_tools

log = logging.getLogger("voicechat.server")

LIVE_RATES = (16000, 24000)
SUPPORTED = (
    "session.start",
    "session.update",
    "session.input_audio.append",
    "session.input_audio.mute",
    "session.input_audio.unmute",
    "session.close",
    "response.item.create",
    "response.create",
)


class LiveDialect(Dialect):
    name = "live"

    def __init__(self, conn):
        super().__init__(conn)
        self.model_rate = int(conn.model_info["output_sample_rate"])
        self.rate = 24000
        self.started = False
        self.muted = False
        self.model = ""
        self.instructions = ""
        self.inp: StreamResampler | None = None
        self.out: StreamResampler | None = None
        self.started_at = time.time()
        self.closing = False
        self._cid = None  # the session.start's event_id (echoed in session.started)
        self.delegation: dict | None = None  # session.delegation as in effect: {type: "responses", ...} or None

    def error_payload(self, code: str, message: str, client_event_id=None) -> dict:
        return openai_error(code, message, client_event_id, key="client_event_id")

    def resource(self) -> dict:
        return {
            "id": self.conn.session_id,
            "expires_at": int(self.started_at) + 3600,
            "model": self.model,
            "status": "active",
            "instructions": self.instructions,
            "audio": {"format": {"type": "audio/pcm", "rate": self.rate}},
            **({"delegation": self.delegation} if self.delegation else {}),
        }

    # -- client events

    async def handle(self, msg: dict) -> None:
        t = msg["type"]
        cid = msg.get("event_id") if isinstance(msg.get("event_id"), str) else None
        if t == "session.start":
            return self._start(msg, cid)
        if t not in SUPPORTED:
            raise P.ProtocolError(
                "unsupported_event",
                f"{t!r} is not supported by this server (a full-duplex speech "
                "model without delegation); supported: " + ", ".join(SUPPORTED),
            )
        if not self.conn.configured:  # after session.start the commands queue behind the session's opening
            raise P.ProtocolError("session_not_started", f"send session.start before {t}")
        if t == "session.input_audio.append":
            pcm = P.decode_pcm(msg)
            x = pcm16_to_float(pcm)
            if self.muted:  # muted input: the model hears silence, its timeline goes on
                x = np.zeros_like(x)
            await self.conn.admit_audio(self.inp.push(x))
        elif t == "session.input_audio.mute":
            self.muted = True
            self.send(self._with_cid({"type": "session.input_audio.muted"}, cid))
        elif t == "session.input_audio.unmute":
            self.muted = False
            self.send(self._with_cid({"type": "session.input_audio.unmuted"}, cid))
        elif t == "session.update":
            # Instructions and audio are immutable after startup (as in Live); the resolved session is echoed.
            # Live lets the delegation's Responses settings change (LiveKit's update_tools / tool_choice send
            # a sparse session.update), but the tools are in the model's prompt, prefilled at session.start:
            # the session keeps them, the echo says so, and the log says a change was asked for.
            self._note_ignored_update(msg.get("session"))
            self.send(self._with_cid({"type": "session.updated", "session": self.resource()}, cid))
        elif t == "response.item.create":
            self._response_item(msg)
        elif t == "response.create":
            if self.delegation is None:
                raise P.ProtocolError("unsupported_event", self._NEEDS_RESPONSES.format(t))
            # Live's "continue the delegated response": the model takes the result in and goes on by itself.
        elif t == "session.close":
            self.closing = True
            self.conn.ending = True
            held = self.inp.flush()  # the resampler's last samples belong to the input
            if held.size:
                await self.conn.admit_audio(held)
            self.conn.submit(Commit(True))

    _NEEDS_RESPONSES = (
        "{} needs a session started with delegation {{type: 'responses', responses: {{tools}}}} "
        "(the model's function calls)"
    )

    def _response_item(self, msg: dict) -> None:
        if self.delegation is None:
            raise P.ProtocolError("unsupported_event", self._NEEDS_RESPONSES.format("response.item.create"))
        item = msg.get("item")
        if not isinstance(item, dict) or item.get("type") != "function_call_output":
            raise P.ProtocolError(
                "invalid_item", "response.item.create takes a function_call_output item (the model hears audio)"
            )
        call_id, output = item.get("call_id"), item.get("output")
        if not isinstance(call_id, str) or not isinstance(output, str):
            raise P.ProtocolError("invalid_item", "a function_call_output item needs string 'call_id' and 'output'")
        self.conn.submit(SubmitToolResult(call_id, output))

    def _note_ignored_update(self, s) -> None:
        if not isinstance(s, dict):
            return
        asked = []
        if "instructions" in s and s["instructions"] != self.instructions:
            asked.append("instructions")
        d = s.get("delegation")
        if isinstance(d, dict):
            now = self.delegation or {"type": "client"}
            r = d.get("responses") if isinstance(d.get("responses"), dict) else {}
            if d.get("type", now["type"]) != now["type"]:
                asked.append("delegation.type")
            if "tools" in r and (r["tools"] or []) != now.get("responses", {}).get("tools", []):
                asked.append("delegation.responses.tools")
            if r.get("tool_choice") not in (None, "auto"):  # the model decides for itself when to call
                asked.append("delegation.responses.tool_choice")
        if asked:
            log.warning(
                "session %s: session.update asks to change %s after session.start; the session keeps "
                "the ones it started with",
                self.conn.session_id,
                ", ".join(asked),
            )

    @staticmethod
    def _with_cid(p: dict, cid) -> dict:
        if cid:
            p["client_event_id"] = cid
        return p

    def _start(self, msg: dict, cid) -> None:
        if self.started or self.conn.configured:
            raise P.ProtocolError("session_already_started", "session.start may be sent once per connection")
        s = msg.get("session")
        if not isinstance(s, dict):
            raise P.ProtocolError("invalid_session", "session.start needs a 'session' object with 'model'")
        model = s.get("model", "")
        if not isinstance(model, str):
            raise P.ProtocolError("invalid_session", "session.model must be a string")
        instructions = s.get("instructions")
        if instructions is not None and not isinstance(instructions, str):
            raise P.ProtocolError("invalid_session", "session.instructions must be a string")
        audio = s.get("audio") or {}
        if not isinstance(audio, dict):
            raise P.ProtocolError("invalid_session", "session.audio must be an object")
        rate = parse_format(audio.get("format"), "session.audio.format", LIVE_RATES)
        tools, delegation = self._parse_delegation(s.get("delegation"), model)
        self.rate = rate or 24000
        # The client's model name is accepted whatever it is; the server reports its own.
        self.model = public_model_name(self.conn.model_name)
        self.instructions = instructions or ""
        self.inp = StreamResampler(self.rate, P.INPUT_SAMPLE_RATE)
        self.out = StreamResampler(self.model_rate, self.rate)
        self._cid = cid
        self.delegation = delegation
        self.conn.open_session(SessionParams(system_prompt=instructions or None, tools=tools))

    @staticmethod
    def _parse_delegation(d, model: str) -> tuple[list | None, dict | None]:
        """session.delegation -> (the session's tools, the delegation echoed in the session resource).
        Client delegation (or none): no tools. Responses delegation: its function tools are the model's."""
        if d is None:
            return None, None
        if not isinstance(d, dict) or d.get("type") not in ("client", "responses"):
            raise P.ProtocolError("invalid_session", "session.delegation.type must be 'client' or 'responses'")
        if d["type"] == "client":
            return None, None
        r = d.get("responses")
        if not isinstance(r, dict):
            raise P.ProtocolError("invalid_session", "session.delegation.responses must be an object")
        tools = r.get("tools") or []
        try:
            normalize_tools(tools)
        except (TypeError, ValueError) as e:
            raise P.ProtocolError("invalid_session", f"session.delegation.responses.tools: {e}") from None
        backend = r.get("model") if isinstance(r.get("model"), str) else model
        echo = {"type": "responses", "responses": {"model": backend, "tools": list(tools)}}
        return [dict(t, type="function") for t in normalize_tools(tools)] or None, echo

    # -- worker items

    def _audio_delta(self, samples: np.ndarray) -> dict | None:
        if samples.size == 0:
            return None
        return {
            "type": "session.output_audio.delta",
            "delta": base64.b64encode(P.pcm16(samples).tobytes()).decode("ascii"),
        }

    def map_events(self, events) -> list:
        out: list = []
        for e in events:
            match e:
                case UserTranscriptDelta() | AssistantTextDelta() if e.delta:
                    f = int(e.frame_index)
                    t = (
                        "session.input_transcript.delta"
                        if isinstance(e, UserTranscriptDelta)
                        else "session.output_transcript.delta"
                    )
                    out.append({"type": t, "delta": e.delta, "start_ms": f * FRAME_MS, "end_ms": (f + 1) * FRAME_MS})
                case ToolCall() if self.delegation is not None:
                    out += self._delegated_call(e)
                case Audio():
                    d = self._audio_delta(self.out.push(e.samples))
                    if d:
                        out.append(d)
                case AudioTail():
                    for x in (self.out.push(e.samples), self.out.flush()):
                        d = self._audio_delta(x)
                        if d:
                            out.append(d)
        return out

    @staticmethod
    def _delegated_call(e) -> list:
        """A ToolCall as a Responses delegation whose response is the one function call."""
        delegation_id, response_id = f"deleg_{e.call_id}", f"resp_{e.call_id}"
        item = {
            "id": f"fc_{e.call_id}",
            "type": "function_call",
            "status": "completed",
            "call_id": e.call_id,
            "name": e.name,
            "arguments": json.dumps(e.arguments, separators=(",", ":")),
        }

        def wrapped(event: dict) -> dict:
            return {"type": "response.event", "delegation_id": delegation_id, "event": event}

        def response(status: str) -> dict:
            return {"id": response_id, "object": "response", "status": status, "output": []}

        return [
            {
                "type": "session.delegation.created",
                "offset_ms": int(e.frame_index) * FRAME_MS,
                "delegation": {
                    "id": delegation_id,
                    "type": "delegation",
                    "target": "responses",
                    "response_id": response_id,
                },
            },
            wrapped({"type": "response.created", "response": response("in_progress")}),
            wrapped({"type": "response.output_item.added", "output_index": 0, "item": dict(item, arguments="")}),
            wrapped({"type": "response.output_item.done", "output_index": 0, "item": item}),
            wrapped({"type": "response.completed", "response": response("completed")}),
        ]

    async def on_output(self, out) -> None:
        # Committed (mlx-vlm's input_audio_buffer.committed marker) has no Live event: not sent.
        match out:
            case FrameEvents(events=events):
                await self.conn.send_now(self.map_events(events))
            case SessionOpened():
                self.started = True
                await self.conn.send_now(
                    [self._with_cid({"type": "session.started", "session": self.resource()}, self._cid)]
                )
            case SessionRefused(code=code, message=message):
                self.conn.configured = False  # another session.start may follow
                self.conn.count_error(code)
                await self.conn.send_now([self.error_payload(code, message)])

    async def finishing(self, end: str) -> None:
        if self.closing:
            usage = {"seconds": float(round(self.conn.received_samples / P.INPUT_SAMPLE_RATE))}
            await self.conn.send_now(
                [{"type": "session.closed", "reason": "close_requested", "session": self.resource(), "usage": usage}]
            )

    def timeout_message(self, code: str, message: str) -> str:
        if code == "session_update_timeout":
            return f"no session.start within {self.conn.limits.session_update_timeout:g} s of connecting; closing"
        return message
