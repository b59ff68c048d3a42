"""OpenAI Realtime GA on /v1/realtime (docs/server.md, "OpenAI Realtime GA").

The model is full duplex: it listens and speaks on every 80 ms frame and decides itself when to
talk. A turn-based client follows it through this mapping (GaMapper, a pure state machine fed the
session's events, so it is tested without a socket):

* each stretch of the model's speech (first non-silent frame .. the first run of
  `silence_frames` silent frames, whose audio is still sent) is one response with one assistant
  audio item; the frame's text-channel deltas are that item's transcript;
* the user transcript (RNNT) of a turn is one user item; the turn ends after `silence_frames`
  frames without a transcript token, or when the model starts a response;
* transcript activity while no response is open yields `input_audio_buffer.speech_started`
  (and `speech_stopped` when the turn ends), so a client stops the playback it still holds;
* a ToolCall is a `function_call` item (in the open response, or in a response of its own);
  `conversation.item.create {function_call_output}` is the session's submit_tool_result;
* `response.cancel` / `conversation.item.truncate` stop the report of the model's current stretch
  until it ends; a later `response.create` reports it again: the next non-silent frame opens the
  requested response (LiveKit's tool reply: `interrupt()`, then `generate_reply()`).

Audio is PCM16 at 24 kHz both ways (the only `audio/pcm` rate of the GA schema), resampled
with soxr: input -> 16 kHz for the model, the model's 22.05 kHz -> the client's rate. Nothing the
dialect does changes what the model computes; cancel and truncate change what is reported.
"""

from __future__ import annotations

import base64
import json
import logging
import time
import uuid

import numpy as np

from voicechat.events import AssistantTextDelta, Audio, AudioTail, Cancelled, Done, ToolCall, UserTranscriptDelta
from voicechat.server import protocol as P
from voicechat.server.dialects.common import Dialect
from voicechat.server.messages import FrameEvents, SessionParams, SessionRefused, SubmitToolResult, Sync, Synced
from voicechat.server.resample import StreamResampler, pcm16_to_float
from voicechat.tools.channel import normalize_tools

log = logging.getLogger("voicechat.server")

GA_RATES = (24000,)  # GA's audio/pcm is 24 kHz only (its schema); Live also has 16 kHz
FRAME_MS = 80

# Every GA client event (openai.types.realtime.RealtimeClientEvent).
CLIENT_TYPES = (
    "session.update",
    "input_audio_buffer.append",
    "input_audio_buffer.commit",
    "input_audio_buffer.clear",
    "output_audio_buffer.clear",
    "response.create",
    "response.cancel",
    "conversation.item.create",
    "conversation.item.delete",
    "conversation.item.retrieve",
    "conversation.item.truncate",
)


def public_model_name(name: str) -> str:
    """The model a client is told: a name, never a local path."""
    import os

    name = str(name)
    if os.sep in name or name.startswith("."):
        return os.path.basename(name.rstrip(os.sep)) or "voicechat"
    return name


def _id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex[:20]}"


def parse_format(fmt, where: str, rates=GA_RATES) -> int | None:
    """A GA / Live audio format object -> its rate, or ProtocolError naming what is served."""
    if fmt is None:
        return None
    if not isinstance(fmt, dict):
        raise P.ProtocolError(
            "invalid_audio_format",
            f'{where} must be an object like {{"type": "audio/pcm", "rate": 24000}}, got {type(fmt).__name__}',
        )
    t = fmt.get("type", "audio/pcm")
    if t != "audio/pcm":
        raise P.ProtocolError(
            "unsupported_audio_format",
            f"{where}.type {t!r} is not served; this server speaks "
            f'"audio/pcm" (PCM16 little-endian mono) at {_hz(rates)}',
        )
    rate = fmt.get("rate", 24000)
    if isinstance(rate, bool) or rate not in rates:
        raise P.ProtocolError(
            "invalid_sample_rate",
            f"{where}.rate {rate!r} is not served; audio/pcm at {_hz(rates)} "
            "(resampled with soxr to and from the model's rates, never read at another rate)",
        )
    return int(rate)


NO_REQUEST = object()


def _metadata(value) -> dict | None:
    """`response.metadata` as GA defines it: None, or at most 16 string keys (<= 64 characters) with
    string values (<= 512 characters); anything else is refused (invalid_value) by name."""
    if value is None:
        return None
    if not isinstance(value, dict) or len(value) > 16:
        raise P.ProtocolError("invalid_value", "response.metadata must be an object of at most 16 string pairs")
    for k, v in value.items():
        if not isinstance(k, str) or not isinstance(v, str) or len(k) > 64 or len(v) > 512:
            raise P.ProtocolError(
                "invalid_value",
                "response.metadata: keys must be strings of at most 64 characters and values strings of at "
                f"most 512 characters (key {str(k)[:64]!r})",
            )
    return dict(value)


def _hz(rates) -> str:
    return " or ".join(str(r) for r in rates) + " Hz"


class GaMapper:
    """Session events (voicechat.events) -> GA server events (without event_id), frame by frame."""

    def __init__(self, *, model_rate: int, client_rate: int, silence_codes, options, text_only: bool = False):
        self.model_rate = model_rate
        self.client_rate = client_rate
        self.out = StreamResampler(model_rate, client_rate)
        self.silence_codes = np.asarray(silence_codes, dtype=np.int64).reshape(-1)
        self.opt = options
        self.silence_peak = 10.0 ** (options.silence_dbfs / 20.0)
        self.text_only = text_only
        self.resp: dict | None = None  # the open response
        self.silent_run = 0
        self.suppress = False  # after cancel / truncate: the rest of the model's stretch is not reported
        self.user: dict | None = None  # the open user turn
        self.pending_text = ""  # text-channel deltas while no response is open: the next response's start
        self.requested_at: int | None = None  # response.create while silent: the frame it came at
        self.requested_metadata: dict | None = None  # that request's `response.metadata`, echoed by its response
        self.items: dict[str, dict] = {}  # conversation items by id (retrieve / truncate / delete)
        self.segments: dict[str, list] = {}  # assistant audio items: (ms of audio before the delta, text delta)
        self.last_item_id: str | None = None
        self.last_response_id: str | None = None
        self.frame = 0

    # -- items

    def remember(self, item: dict) -> str | None:
        """Keep `item` as the conversation's last; -> the previous last item's id."""
        prev = self.last_item_id
        self.items[item["id"]] = item
        self.last_item_id = item["id"]
        return prev

    def _part_type(self) -> str:
        return "text" if self.text_only else "audio"

    # -- the user's turn

    def _open_user(self, f: int, out: list) -> None:
        self.user = {"id": _id("item"), "text": "", "start_ms": f * FRAME_MS, "last": f, "started": False}

    def _speech_started(self, out: list) -> None:
        u = self.user
        if u is not None and not u["started"]:
            u["started"] = True
            out.append(
                {"type": "input_audio_buffer.speech_started", "audio_start_ms": u["start_ms"], "item_id": u["id"]}
            )

    def close_user(self, end_ms: int, out: list, *, committed: bool = True) -> str | None:
        u = self.user
        if u is None:
            return None
        self.user = None
        if u["started"]:
            out.append({"type": "input_audio_buffer.speech_stopped", "audio_end_ms": end_ms, "item_id": u["id"]})
        item = {
            "id": u["id"],
            "object": "realtime.item",
            "type": "message",
            "role": "user",
            "status": "completed",
            "content": [{"type": "input_audio", "transcript": u["text"]}],
        }
        prev = self.remember(item)
        if committed:
            out.append({"type": "input_audio_buffer.committed", "item_id": u["id"], "previous_item_id": prev})
        out.append({"type": "conversation.item.added", "item": item, "previous_item_id": prev})
        out.append(
            {
                "type": "conversation.item.input_audio_transcription.completed",
                "item_id": u["id"],
                "content_index": 0,
                "transcript": u["text"],
                "usage": {"type": "duration", "seconds": round(max(end_ms - u["start_ms"], 0) / 1000.0, 3)},
            }
        )
        out.append({"type": "conversation.item.done", "item": item, "previous_item_id": prev})
        return u["id"]

    # -- responses

    def _response_obj(self, r: dict, status: str) -> dict:
        obj = {
            "id": r["id"],
            "object": "realtime.response",
            "status": status,
            "conversation_id": "conv_voicechat",
            "output": list(r["output"]),
            "output_modalities": ["text"] if self.text_only else ["audio"],
            "metadata": r.get("metadata"),
        }
        if status == "cancelled":
            obj["status_details"] = {"type": "cancelled", "reason": r.get("reason", "client_cancelled")}
        return obj

    def open_response(self, out: list, *, audio: bool = True) -> dict:
        r = {
            "id": _id("resp"),
            "output": [],
            "audio_item": None,
            "status": "in_progress",
            "metadata": self.requested_metadata,
        }
        self.resp = r
        self.last_response_id = r["id"]
        self.requested_at = None
        self.requested_metadata = None
        out.append({"type": "response.created", "response": self._response_obj(r, "in_progress")})
        if audio:
            item = {
                "id": _id("item"),
                "object": "realtime.item",
                "type": "message",
                "role": "assistant",
                "status": "in_progress",
                "content": [],
            }
            idx = len(r["output"])
            r["output"].append(item)
            r["audio_item"] = {"item": item, "index": idx, "transcript": "", "segments": [], "samples": 0}
            prev = self.remember(item)
            out.append(
                {
                    "type": "response.output_item.added",
                    "response_id": r["id"],
                    "output_index": idx,
                    "item": dict(item, content=[]),
                }
            )
            out.append({"type": "conversation.item.added", "item": dict(item, content=[]), "previous_item_id": prev})
            out.append(
                {
                    "type": "response.content_part.added",
                    "response_id": r["id"],
                    "item_id": item["id"],
                    "output_index": idx,
                    "content_index": 0,
                    "part": {"type": self._part_type(), "transcript": ""}
                    if not self.text_only
                    else {"type": "text", "text": ""},
                }
            )
        return r

    def _audio_ms(self, a: dict) -> int:
        return int(a["samples"] * 1000 // self.client_rate)

    def _ids(self, r: dict, a: dict) -> dict:
        return {"response_id": r["id"], "item_id": a["item"]["id"], "output_index": a["index"], "content_index": 0}

    def _text(self, r: dict, delta: str, out: list) -> None:
        a = r["audio_item"]
        if a is None or not delta:
            return
        a["segments"].append((self._audio_ms(a), delta))
        a["transcript"] += delta
        t = "response.output_text.delta" if self.text_only else "response.output_audio_transcript.delta"
        out.append({"type": t, **self._ids(r, a), "delta": delta})

    def _audio(self, r: dict, samples: np.ndarray, out: list) -> None:
        a = r["audio_item"]
        if a is None or self.text_only or samples.size == 0:
            return
        a["samples"] += int(samples.size)
        out.append(
            {
                "type": "response.output_audio.delta",
                **self._ids(r, a),
                "delta": base64.b64encode(P.pcm16(samples).tobytes()).decode("ascii"),
            }
        )

    def close_response(self, out: list, status: str = "completed", *, truncate_ms: int | None = None) -> None:
        r = self.resp
        if r is None:
            return
        self.resp = None
        self.silent_run = 0
        a = r["audio_item"]
        if a is not None:
            item = a["item"]
            text = a["transcript"]
            if truncate_ms is not None:  # what the client played: the transcript up to there
                text = "".join(d for ms, d in a["segments"] if ms < truncate_ms)
            item_status = "completed" if status == "completed" else "incomplete"
            ids = self._ids(r, a)
            if self.text_only:
                out.append({"type": "response.output_text.done", **ids, "text": text})
                part = {"type": "text", "text": text}
                item["content"] = [{"type": "output_text", "text": text}]
            else:
                out.append({"type": "response.output_audio.done", **ids})
                out.append({"type": "response.output_audio_transcript.done", **ids, "transcript": text})
                part = {"type": "audio", "transcript": text}
                item["content"] = [{"type": "output_audio", "transcript": text}]
            item["status"] = item_status
            self.segments[item["id"]] = a["segments"]
            out.append({"type": "response.content_part.done", **ids, "part": part})
            out.append(
                {"type": "response.output_item.done", "response_id": r["id"], "output_index": a["index"], "item": item}
            )
            out.append({"type": "conversation.item.done", "item": item})
        out.append({"type": "response.done", "response": self._response_obj(r, status)})

    def tool_call(self, e, out: list) -> None:
        own = self.resp is None
        r = self.resp if not own else self.open_response(out, audio=False)
        args = json.dumps(e.arguments, separators=(",", ":"))
        item = {
            "id": _id("item"),
            "object": "realtime.item",
            "type": "function_call",
            "status": "in_progress",
            "call_id": e.call_id,
            "name": e.name,
            "arguments": "",
        }
        idx = len(r["output"])
        r["output"].append(item)
        prev = self.remember(item)
        ids = {"response_id": r["id"], "item_id": item["id"], "output_index": idx}
        out.append(
            {"type": "response.output_item.added", "response_id": r["id"], "output_index": idx, "item": dict(item)}
        )
        out.append({"type": "conversation.item.added", "item": dict(item), "previous_item_id": prev})
        out.append({"type": "response.function_call_arguments.delta", **ids, "call_id": e.call_id, "delta": args})
        out.append(
            {
                "type": "response.function_call_arguments.done",
                **ids,
                "call_id": e.call_id,
                "name": e.name,
                "arguments": args,
            }
        )
        item.update(status="completed", arguments=args)
        out.append({"type": "response.output_item.done", "response_id": r["id"], "output_index": idx, "item": item})
        out.append({"type": "conversation.item.done", "item": item})
        if own:  # a call while the model is silent is a response of its own, as a turn-based model's would be
            self.close_response(out)

    # -- client requests that change what is reported

    def cancel(self, out: list, reason: str = "client_cancelled") -> None:
        if self.resp is not None:
            self.resp["reason"] = reason
            self.close_response(out, "cancelled")
            self.suppress = True  # the model may still be talking: not reported until its stretch ends

    def truncate(self, item_id: str, audio_end_ms: int, out: list) -> bool:
        r = self.resp
        if r is not None and r["audio_item"] is not None and r["audio_item"]["item"]["id"] == item_id:
            r["reason"] = "turn_detected"
            self.close_response(out, "cancelled", truncate_ms=audio_end_ms)
            self.suppress = True
            return True
        item = self.items.get(item_id)
        if item is None:
            return False
        if item_id in self.segments:  # a finished assistant item: its stored transcript is what was played
            text = "".join(d for ms, d in self.segments[item_id] if ms < audio_end_ms)
            item["content"] = [
                dict(c, transcript=text) if c.get("type") == "output_audio" else c for c in item.get("content", [])
            ]
            item["status"] = "incomplete"
        return True

    def request(self, metadata: dict | None = None) -> bool:
        """response.create: while silent, the model's next speech stretch (or an empty response after
        `response_wait_frames`) is the response, carrying `metadata`; -> False (nothing changes) when a
        response is open: OpenAI's server refuses a second one (module doc).

        After a cancel / truncate the rest of the model's stretch is not reported (`suppress`); a
        response.create ends that: the client asks to hear the model again, so its next non-silent
        frame opens the requested response. LiveKit answers a tool call this way (`interrupt()`,
        then `generate_reply()`), while the model may still be talking."""
        if self.resp is not None:
            return False
        if self.requested_at is None:
            self.requested_at = self.frame
        self.requested_metadata = metadata
        self.suppress = False
        return True

    # -- the session's events

    def events(self, events) -> list:
        out: list = []
        user_deltas, text_deltas = [], []
        for e in events:
            match e:
                case UserTranscriptDelta():
                    user_deltas.append(e)
                case AssistantTextDelta():
                    text_deltas.append(e.delta)
                case ToolCall():
                    self.tool_call(e, out)
                case Audio():
                    self._frame(e, user_deltas, text_deltas, out)
                    user_deltas, text_deltas = [], []
                case AudioTail():
                    if self.resp is not None and not self.suppress:
                        self._audio(self.resp, self.out.push(e.samples), out)
                        self._audio(self.resp, self.out.flush(), out)
                case Done() | Cancelled():
                    self.close_response(out)
                    self.close_user(self.frame * FRAME_MS, out)
        return out

    def _silent(self, e) -> bool:
        codes = np.asarray(e.audio_codes).reshape(-1)
        if codes.size == self.silence_codes.size and np.array_equal(codes, self.silence_codes):
            return True
        return float(np.max(np.abs(e.samples))) < self.silence_peak if np.size(e.samples) else True

    def _frame(self, e, user_deltas, text_deltas, out: list) -> None:
        f = int(e.frame_index)
        self.frame = f + 1
        samples = self.out.push(e.samples)  # always: the output stream stays continuous
        silent = self._silent(e)
        for d in user_deltas:
            if self.user is None:
                self._open_user(f, out)
            self.user["text"] += d.delta
            self.user["last"] = f
            out.append(
                {
                    "type": "conversation.item.input_audio_transcription.delta",
                    "item_id": self.user["id"],
                    "content_index": 0,
                    "delta": d.delta,
                }
            )
        if self.resp is None and self.user is not None:
            self._speech_started(out)
        text = "".join(text_deltas)
        if self.resp is None and not silent and not self.suppress:
            self.close_user(f * FRAME_MS, out)
            r = self.open_response(out)
            if self.pending_text:
                self._text(r, self.pending_text, out)
                self.pending_text = ""
        if self.resp is not None:
            r = self.resp
            self._text(r, text, out)
            self._audio(r, samples, out)
            self.silent_run = self.silent_run + 1 if silent else 0
            if self.silent_run >= self.opt.silence_frames:
                self.close_response(out)
                if self.user is not None:
                    self._speech_started(out)
        else:
            if not self.suppress:
                self.pending_text += text
            self.silent_run = self.silent_run + 1 if silent else 0
            if self.suppress and self.silent_run >= self.opt.silence_frames:
                self.suppress = False
            if self.requested_at is not None and f + 1 - self.requested_at >= self.opt.response_wait_frames:
                self.open_response(out, audio=False)  # the model chose not to speak: an empty answer
                self.close_response(out)
        if self.user is not None and f - self.user["last"] >= self.opt.silence_frames:
            self.close_user((f + 1) * FRAME_MS, out)


class GaDialect(Dialect):
    name = "ga"

    def __init__(self, conn):
        super().__init__(conn)
        self.model_rate = int(conn.model_info["output_sample_rate"])
        self.in_rate = 24000
        self.out_rate = 24000
        self.instructions: str | None = None
        self.tools: list = []
        self.early_request: object = NO_REQUEST  # a response.create's metadata before the session opened
        self.text_only = False
        self.opened = False  # the model session (opened at the first audio, with the session's settings)
        self.failed = False  # the model refused the session: audio is dropped until a session.update
        self.effective: dict | None = None
        self.inp = StreamResampler(self.in_rate, P.INPUT_SAMPLE_RATE)
        self.mapper: GaMapper | None = None
        self.created_at = int(time.time())
        conn.configured = True  # session.update is optional in GA: no session_update_timeout

    # -- the session object

    def session_obj(self) -> dict:
        s = self.effective or {"instructions": self.instructions, "tools": self.tools}
        return {
            "type": "realtime",
            "object": "realtime.session",
            "id": self.conn.session_id,
            "model": public_model_name(self.conn.model_name),
            "output_modalities": ["text"] if self.text_only else ["audio"],
            "instructions": s["instructions"] or "",
            "audio": {
                "input": {
                    "format": {"type": "audio/pcm", "rate": self.in_rate},
                    "turn_detection": {
                        "type": "server_vad",
                        "create_response": True,
                        "interrupt_response": True,
                        "silence_duration_ms": self.options.silence_frames * FRAME_MS,
                    },
                },
                "output": {"format": {"type": "audio/pcm", "rate": self.out_rate}},
            },
            "tools": [dict(t, type="function") for t in s["tools"]],
            "tool_choice": "auto",
            "max_output_tokens": "inf",
            "expires_at": self.created_at + 3600,
        }

    def connected(self) -> None:
        self.send({"type": "session.created", "session": self.session_obj()})

    # -- client events

    def handle(self, msg: dict) -> None:
        t = msg["type"]
        h = getattr(self, "_on_" + t.replace(".", "_"), None) if t in CLIENT_TYPES else None
        if h is None:
            raise P.ProtocolError(
                "unknown_type",
                f"unknown event type {t!r}; OpenAI Realtime GA client events are: " + ", ".join(CLIENT_TYPES),
            )
        return h(msg)  # an awaitable where the handler admits audio

    async def _on_session_update(self, msg):
        s = msg.get("session")
        if not isinstance(s, dict):
            raise P.ProtocolError("invalid_session", "session.update needs a 'session' object")
        audio = s.get("audio") or {}
        if not isinstance(audio, dict):
            raise P.ProtocolError("invalid_session", "session.audio must be an object")
        inp, outp = audio.get("input") or {}, audio.get("output") or {}
        in_rate = parse_format(inp.get("format") if isinstance(inp, dict) else None, "session.audio.input.format")
        out_rate = parse_format(outp.get("format") if isinstance(outp, dict) else None, "session.audio.output.format")
        instructions = s.get("instructions", self.instructions)
        if instructions is not None and not isinstance(instructions, str):
            raise P.ProtocolError("invalid_session", "session.instructions must be a string")
        tools = s.get("tools", self.tools)
        if tools is None:
            tools = []
        if tools:
            try:
                normalize_tools(tools)
            except (TypeError, ValueError) as e:
                raise P.ProtocolError("invalid_session", f"session.tools: {e}") from None
        mods = s.get("output_modalities")
        if mods is not None and (not isinstance(mods, list) or not set(mods) <= {"audio", "text"} or not mods):
            raise P.ProtocolError("invalid_session", 'session.output_modalities must be ["audio"] or ["text"]')
        # All checked: apply.
        if in_rate is not None and in_rate != self.in_rate:
            await self._flush_input()
            self.in_rate = in_rate
            self.inp = StreamResampler(in_rate, P.INPUT_SAMPLE_RATE)
        if out_rate is not None and out_rate != self.out_rate:
            self.out_rate = out_rate
            if self.mapper is not None:
                self.mapper.out = StreamResampler(self.model_rate, out_rate)
                self.mapper.client_rate = out_rate
        if mods is not None:
            self.text_only = "audio" not in mods
            if self.mapper is not None:
                self.mapper.text_only = self.text_only
        self.failed = False
        if not self.opened:
            self.instructions, self.tools = instructions, list(tools)
        elif instructions != self.effective["instructions"] or list(tools) != self.effective["tools"]:
            # The model prefilled its prompt (and tools) when the audio started: later changes cannot reach it.
            log.warning(
                "session %s: instructions / tools changed after the audio started; the session keeps "
                "the ones it opened with",
                self.conn.session_id,
            )
        self.send({"type": "session.updated", "session": self.session_obj()})

    def _open(self) -> None:

        self.opened = True
        self.effective = {"instructions": self.instructions, "tools": list(self.tools)}
        self.mapper = GaMapper(
            model_rate=self.model_rate,
            client_rate=self.out_rate,
            silence_codes=self.conn.model_info.get("silence_codes", []),
            options=self.options,
            text_only=self.text_only,
        )
        if self.early_request is not NO_REQUEST:  # a response.create before the first audio
            self.mapper.request(self.early_request)
            self.early_request = NO_REQUEST
        self.conn.open_session(
            SessionParams(
                system_prompt=self.instructions or None,
                tools=[dict(t, type="function") for t in normalize_tools(self.tools)] or None,
            )
        )

    async def _flush_input(self) -> None:
        held = self.inp.flush()
        if held.size and self.opened:
            await self.conn.admit_audio(held)

    async def _on_input_audio_buffer_append(self, msg):
        pcm = P.decode_pcm(msg)
        if self.failed:
            return  # said once, in the error that refused the session
        if not self.opened:
            self._open()
        x = self.inp.push(pcm16_to_float(pcm))
        # Refused by admission (overflow / audio limit): the client is told it was not accepted.
        await self.conn.admit_audio(x)

    def _on_input_audio_buffer_commit(self, msg):
        # The duplex model does not wait for a commit: it marks the end of the user's turn in the report,
        # answered once the frames of the audio sent before it are computed (as mlx-vlm's commit is).
        self.conn.submit(Sync("commit"))

    def _committed(self) -> list:
        out: list = []
        m = self.mapper
        item_id = m.close_user(m.frame * FRAME_MS, out) if m is not None else None
        if item_id is None:
            out.append(
                {
                    "type": "input_audio_buffer.committed",
                    "item_id": _id("item"),
                    "previous_item_id": m.last_item_id if m else None,
                }
            )
        return out

    def _on_input_audio_buffer_clear(self, msg):
        # Audio already sent is part of the duplex stream; there is no uncommitted buffer to drop.
        self.send({"type": "input_audio_buffer.cleared"})

    def _on_output_audio_buffer_clear(self, msg):
        out: list = []
        rid = (
            self.mapper.resp["id"]
            if self.mapper and self.mapper.resp
            else (self.mapper.last_response_id if self.mapper else None)
        )
        if self.mapper is not None:
            self.mapper.cancel(out, "turn_detected")
        for p in out:
            self.send(p)
        self.send({"type": "output_audio_buffer.cleared", "response_id": rid or _id("resp")})

    def _on_response_create(self, msg):
        response = msg.get("response")
        if response is None:
            response = {}
        if not isinstance(response, dict):
            raise P.ProtocolError("invalid_value", "response.create: 'response' must be an object")
        metadata = _metadata(response.get("metadata"))
        if self.mapper is None:  # no audio yet: the model has not started; the first stretch answers it
            self.early_request = metadata
            return
        if not self.mapper.request(metadata):
            rid = self.mapper.resp["id"] if self.mapper.resp is not None else ""
            self.error(
                "conversation_already_has_active_response",
                f"Conversation already has an active response in progress: {rid}. Wait until the response "
                "is finished before creating a new one (this model decides itself when it speaks; the open "
                "response is its current speech).",
                msg.get("event_id"),
            )

    def _on_response_cancel(self, msg):
        out: list = []
        if self.mapper is not None:
            self.mapper.cancel(out)
            self.mapper.requested_at = None
            self.mapper.requested_metadata = None
        for p in out:
            self.send(p)

    def _on_conversation_item_create(self, msg):
        item = msg.get("item")
        if not isinstance(item, dict) or not isinstance(item.get("type"), str):
            raise P.ProtocolError("invalid_item", "conversation.item.create needs an 'item' object with a 'type'")
        item = dict(item)
        item.setdefault("id", _id("item"))
        item.setdefault("object", "realtime.item")
        item.setdefault("status", "completed")
        if item["type"] == "function_call_output":
            call_id, output = item.get("call_id"), item.get("output")
            if not isinstance(call_id, str) or not isinstance(output, str):
                raise P.ProtocolError("invalid_item", "a function_call_output item needs string 'call_id' and 'output'")
            if not self.opened:
                raise P.ProtocolError(
                    "invalid_tool_result", f"no tool call {call_id!r} is pending: the session has not started"
                )
            self.conn.submit(SubmitToolResult(call_id, output))
        # Other items (text messages) are kept in the conversation; the model hears audio only.
        prev = None
        if self.mapper is not None:
            prev = self.mapper.remember(item)
        self.send({"type": "conversation.item.added", "item": item, "previous_item_id": prev})
        self.send({"type": "conversation.item.done", "item": item, "previous_item_id": prev})

    def _item_id(self, msg) -> str:
        item_id = msg.get("item_id")
        if not isinstance(item_id, str):
            raise P.ProtocolError("invalid_item", f"{msg['type']} needs a string 'item_id'")
        return item_id

    def _on_conversation_item_delete(self, msg):
        item_id = self._item_id(msg)
        if self.mapper is not None:
            self.mapper.items.pop(item_id, None)
        self.send({"type": "conversation.item.deleted", "item_id": item_id})

    def _on_conversation_item_retrieve(self, msg):
        item_id = self._item_id(msg)
        item = self.mapper.items.get(item_id) if self.mapper else None
        if item is None:
            raise P.ProtocolError("item_not_found", f"no conversation item {item_id!r}")
        self.send({"type": "conversation.item.retrieved", "item": item})

    def _on_conversation_item_truncate(self, msg):
        item_id = self._item_id(msg)
        ms = msg.get("audio_end_ms", 0)
        ci = msg.get("content_index", 0)
        if isinstance(ms, bool) or not isinstance(ms, int) or ms < 0:
            raise P.ProtocolError("invalid_item", f"audio_end_ms must be a non-negative integer, got {ms!r}")
        out: list = []
        if self.mapper is None or not self.mapper.truncate(item_id, ms, out):
            raise P.ProtocolError("item_not_found", f"no conversation item {item_id!r} to truncate")
        for p in out:
            self.send(p)
        self.send({"type": "conversation.item.truncated", "item_id": item_id, "content_index": ci, "audio_end_ms": ms})

    # -- worker items

    async def on_output(self, out) -> None:
        match out:
            case FrameEvents(events=events):
                if self.mapper is not None:
                    await self.conn.send_now(self.mapper.events(events))
            case Synced():
                await self.conn.send_now(self._committed())
            case SessionRefused(code=code, message=message):
                self.opened, self.failed = False, True
                self.conn.configured = True
                self.inp = StreamResampler(self.in_rate, P.INPUT_SAMPLE_RATE)
                await self.conn.send_now(
                    [
                        self.error_payload(
                            code,
                            message + "; the audio is dropped until a session.update with settings the model accepts",
                        )
                    ]
                )
                self.conn.count_error(code)
