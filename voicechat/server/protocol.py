"""The /v1/realtime wire protocol: parse client messages, serialize session events.

One JSON object per WebSocket text message. Names follow mlx-vlm's and mlxcel's
servers (and OpenAI Realtime where it has a name): a client written for those
works unchanged. Nothing here touches MLX: the mlx-vlm dialect (dialects/mlx_vlm.py) calls
`event_payload` on the numpy arrays of the session's events.
"""

from __future__ import annotations

import base64
import binascii
import json
from dataclasses import dataclass

import numpy as np

from voicechat.events import (
    AssistantTextDelta,
    Audio,
    AudioTail,
    Cancelled,
    Done,
    FunctionDelta,
    ToolCall,
    ToolCallError,
    ToolResultDone,
    UserTranscriptDelta,
)
from voicechat.server import validation as V
from voicechat.server.security import excerpt
from voicechat.server.validation import MessageRefused

INPUT_SAMPLE_RATE = 16000

# Client -> server message types.
SESSION_UPDATE = "session.update"
APPEND = "input_audio_buffer.append"
COMMIT = "input_audio_buffer.commit"
CANCEL_TYPES = ("session.cancel", "response.cancel")
PING = "session.ping"
CLIENT_TYPES = (SESSION_UPDATE, APPEND, COMMIT, *CANCEL_TYPES, PING)

# Server -> client event type per session event class (voicechat.events).
EVENT_TYPES = {
    UserTranscriptDelta: "conversation.item.input_audio_transcription.delta",
    AssistantTextDelta: "response.text.delta",
    FunctionDelta: "response.function.delta",
    Audio: "response.audio.delta",
    AudioTail: "response.audio.tail",
    Done: "response.done",
    Cancelled: "response.cancelled",
    # Tool events (only with `voicechat serve --mcp`, which runs the tools in the server).
    ToolCall: "response.function_call_arguments.done",
    ToolCallError: "response.function_call.error",
    ToolResultDone: "response.function_call.result_done",
}


# Every refusal is a validation.MessageRefused (code + message); the old name stays for callers.
ProtocolError = MessageRefused


def error_event(code: str, message: str) -> dict:
    # Nested like mlx-vlm's and OpenAI Realtime's error events.
    return {"type": "error", "error": {"code": code, "message": message}}


def parse_message(text) -> dict:
    """A client text message -> its JSON object with a known `type`, or ProtocolError (bounded, guarded parsing:
    validation.parse_json_object)."""
    msg = V.parse_json_object(text)
    V.message_type(msg, CLIENT_TYPES)
    return msg


MAX_SEED = 2**63 - 1
MAX_TEXT_CHARS = 100_000  # a system prompt in characters; its token count is bounded by --max-prompt-tokens


def decode_append(msg: dict) -> np.ndarray:
    """input_audio_buffer.append -> int16 samples (16 kHz mono PCM16 little-endian, base64)."""
    rate = msg.get("sample_rate", INPUT_SAMPLE_RATE)
    if isinstance(rate, bool) or not isinstance(rate, (int, float)) or rate != INPUT_SAMPLE_RATE:
        raise ProtocolError(
            "invalid_sample_rate",
            f"sample_rate must be {INPUT_SAMPLE_RATE} (16 kHz mono PCM16; "
            f"the server does not resample), got {excerpt(rate)}",
        )
    return decode_pcm(msg)


def decode_pcm(msg: dict, key: str = "audio") -> np.ndarray:
    """The base64 PCM16 little-endian samples in `msg[key]` -> int16 samples (every dialect's audio)."""
    audio = msg.get(key)
    if not isinstance(audio, str):
        raise ProtocolError(
            "invalid_audio", f"'{key}' must be a base64 string of PCM16 little-endian samples, got {V._kind(audio)}"
        )
    try:
        raw = base64.b64decode(audio, validate=True)
    except (binascii.Error, ValueError) as e:
        raise ProtocolError(
            "invalid_audio", f"'{key}' is not valid base64 ({e}); expected base64 of PCM16 little-endian samples"
        ) from None
    if len(raw) % 2:
        raise ProtocolError(
            "invalid_audio", f"'{key}' decodes to {len(raw)} bytes, an odd number; PCM16 needs 2 bytes per sample"
        )
    return np.frombuffer(raw, dtype="<i2")


def decode_session_update(msg: dict, *, max_streaming_seconds: float = 86400.0) -> dict:
    """session.update -> {system_prompt, seed, max_streaming_seconds, model} (validated: type and range)."""
    code = "invalid_session"
    s = V.field_object(msg, "session", "session", code)
    key = "system_prompt" if "system_prompt" in s else "instructions"
    prompt = V.field_str(s, key, f"session.{key}", MAX_TEXT_CHARS, None, code)
    seed = V.field_int(s, "seed", "session.seed", 0, MAX_SEED, 0, code)
    mss = V.field_number(
        s,
        "max_streaming_seconds",
        "session.max_streaming_seconds",
        0.0,
        max_streaming_seconds,
        None,
        code,
        lo_open=True,
        allow_null=True,
    )
    model = V.field_str(s, "model", "session.model", 256, None, code)
    return {
        "system_prompt": prompt or None,
        "seed": seed,
        "max_streaming_seconds": float(mss) if mss is not None else None,
        "model": model,
    }


def pcm16(samples: np.ndarray) -> np.ndarray:
    """float32 [-1, 1] -> int16 as mlx-vlm's server rounds: clip, x 32767, round half to even."""
    return np.round(np.clip(np.asarray(samples, np.float32), -1.0, 1.0) * 32767.0).astype("<i2")


def b64_pcm16(samples: np.ndarray) -> str:
    return base64.b64encode(pcm16(samples).tobytes()).decode("ascii")


def b64_to_int16(text: str) -> np.ndarray:
    return np.frombuffer(base64.b64decode(text), dtype="<i2")


@dataclass
class AudioFormat:
    sample_rate: int

    def as_dict(self) -> dict:
        return {"type": "pcm16", "sample_rate": self.sample_rate, "channels": 1}


def event_payload(e, output_sample_rate: int, *, compute_ms: float | None = None, lag_ms: float | None = None) -> dict:
    """A session event (voicechat.events) -> its mlx-vlm server event (without event_id)."""
    out = {"type": EVENT_TYPES[type(e)], "frame_index": int(e.frame_index)}
    match e:
        case AssistantTextDelta() | FunctionDelta():
            out.update(token_id=int(e.token_id), delta=e.delta, text=e.text)
        case UserTranscriptDelta():
            # mlx-vlm names the cumulative text `transcript`; `text` as in the session event.
            out.update(delta=e.delta, transcript=e.text, text=e.text)
        case ToolCall():
            out.update(call_id=e.call_id, name=e.name, arguments=json.dumps(e.arguments))
        case ToolCallError():
            out.update(message=e.message, raw=e.raw)
        case ToolResultDone():
            out.update(call_id=e.call_id)
        case Audio() | AudioTail():
            out.update(
                delta=b64_pcm16(e.samples),
                format="pcm16",
                sample_rate=output_sample_rate,
                channels=1,
                samples=int(np.asarray(e.samples).size),
            )
            if isinstance(e, Audio):
                out["audio_codes"] = [int(c) for c in np.asarray(e.audio_codes).reshape(-1)]
                if compute_ms is not None:
                    out["compute_ms"] = round(compute_ms, 3)
                if lag_ms is not None:
                    out["lag_ms"] = round(lag_ms, 3)
    return out
