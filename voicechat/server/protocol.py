"""The /v1/realtime wire protocol: parse client messages, serialize session events.

One JSON object per WebSocket text message. Names follow mlx-vlm's and mlxcel's
servers (and OpenAI Realtime where it has a name): a client written for those
works unchanged. Nothing here touches MLX: the network side imports this module,
the worker thread calls `event_payload` on the numpy arrays the session returns.
"""

from __future__ import annotations

import base64
import binascii
import json
from dataclasses import dataclass

import numpy as np

INPUT_SAMPLE_RATE = 16000

# Client -> server message types.
SESSION_UPDATE = "session.update"
APPEND = "input_audio_buffer.append"
COMMIT = "input_audio_buffer.commit"
CANCEL_TYPES = ("session.cancel", "response.cancel")
PING = "session.ping"
CLIENT_TYPES = (SESSION_UPDATE, APPEND, COMMIT, *CANCEL_TYPES, PING)

# Server -> client event type per session event kind (voicechat.events).
EVENT_TYPES = {
    "user_transcript_delta": "conversation.item.input_audio_transcription.delta",
    "assistant_text_delta": "response.text.delta",
    "function_delta": "response.function.delta",
    "audio": "response.audio.delta",
    "audio_tail": "response.audio.tail",
    "done": "response.done",
    "cancelled": "response.cancelled",
    # Tool events (only with `voicechat serve --mcp`, which runs the tools in the server).
    "tool_call": "response.function_call_arguments.done",
    "tool_call_error": "response.function_call.error",
    "tool_result_done": "response.function_call.result_done",
}


class ProtocolError(ValueError):
    """A client message the server refuses; `code` goes into the `error` event, the connection stays usable."""

    def __init__(self, code: str, message: str):
        super().__init__(message)
        self.code = code


def error_event(code: str, message: str) -> dict:
    # Nested like mlx-vlm's and OpenAI Realtime's error events.
    return {"type": "error", "error": {"code": code, "message": message}}


def parse_message(text) -> dict:
    """A client text message -> its JSON object with a known `type`, or ProtocolError."""
    if isinstance(text, bytes):
        raise ProtocolError("invalid_message", "binary WebSocket messages are not accepted; send JSON text messages "
                                               "(audio goes base64-encoded in input_audio_buffer.append)")
    try:
        msg = json.loads(text)
    except (json.JSONDecodeError, RecursionError) as e:
        raise ProtocolError("invalid_json", f"message is not valid JSON ({e}); expected one JSON object "
                                            "per text message") from None
    if not isinstance(msg, dict):
        raise ProtocolError("invalid_json", f"message must be a JSON object, got {type(msg).__name__}")
    t = msg.get("type")
    if not isinstance(t, str):
        raise ProtocolError("invalid_message", "message has no string 'type'; expected one of " + ", ".join(CLIENT_TYPES))
    if t not in CLIENT_TYPES:
        raise ProtocolError("unknown_type", f"unknown message type {t!r}; expected one of " + ", ".join(CLIENT_TYPES))
    return msg


def decode_append(msg: dict) -> np.ndarray:
    """input_audio_buffer.append -> int16 samples (16 kHz mono PCM16 little-endian, base64)."""
    rate = msg.get("sample_rate", INPUT_SAMPLE_RATE)
    if isinstance(rate, bool) or not isinstance(rate, (int, float)) or rate != INPUT_SAMPLE_RATE:
        raise ProtocolError("invalid_sample_rate", f"sample_rate must be {INPUT_SAMPLE_RATE} (16 kHz mono PCM16; "
                                                   f"the server does not resample), got {rate!r}")
    audio = msg.get("audio")
    if not isinstance(audio, str):
        raise ProtocolError("invalid_audio", "'audio' must be a base64 string of PCM16 little-endian samples, "
                                             f"got {type(audio).__name__}")
    try:
        raw = base64.b64decode(audio, validate=True)
    except (binascii.Error, ValueError) as e:
        raise ProtocolError("invalid_audio", f"'audio' is not valid base64 ({e}); expected base64 of PCM16 "
                                             "little-endian samples") from None
    if len(raw) % 2:
        raise ProtocolError("invalid_audio", f"'audio' decodes to {len(raw)} bytes, an odd number; PCM16 needs "
                                             "2 bytes per sample")
    return np.frombuffer(raw, dtype="<i2")


def decode_session_update(msg: dict) -> dict:
    """session.update -> {system_prompt, seed, max_streaming_seconds, model} (validated)."""
    s = msg.get("session", {})
    if s is None:
        s = {}
    if not isinstance(s, dict):
        raise ProtocolError("invalid_session", f"'session' must be an object, got {type(s).__name__}")
    prompt = s.get("system_prompt", s.get("instructions"))
    if prompt is not None and not isinstance(prompt, str):
        raise ProtocolError("invalid_session", f"session.system_prompt must be a string, got {type(prompt).__name__}")
    seed = s.get("seed", 0)
    if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < 2**63:
        raise ProtocolError("invalid_session", f"session.seed must be a non-negative integer, got {seed!r}")
    mss = s.get("max_streaming_seconds")
    if mss is not None and (isinstance(mss, bool) or not isinstance(mss, (int, float)) or not mss > 0):
        raise ProtocolError("invalid_session", f"session.max_streaming_seconds must be a positive number or null, "
                                               f"got {mss!r}")
    model = s.get("model")
    if model is not None and not isinstance(model, str):
        raise ProtocolError("invalid_session", f"session.model must be a string, got {type(model).__name__}")
    return {"system_prompt": prompt or None, "seed": seed,
            "max_streaming_seconds": float(mss) if mss is not None else None, "model": model}


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
    """A session event (voicechat.events) -> its server event (without event_id)."""
    t = EVENT_TYPES[e.kind]
    out = {"type": t, "frame_index": int(e.frame_index)}
    if e.kind in ("assistant_text_delta", "function_delta"):
        out.update(token_id=int(e.token_id), delta=e.delta, text=e.text)
    elif e.kind == "user_transcript_delta":
        # mlx-vlm names the cumulative text `transcript`; `text` as in the session event.
        out.update(delta=e.delta, transcript=e.text, text=e.text)
    elif e.kind == "tool_call":
        out.update(call_id=e.call_id, name=e.name, arguments=json.dumps(e.arguments))
    elif e.kind == "tool_call_error":
        out.update(message=e.message, raw=e.raw)
    elif e.kind == "tool_result_done":
        out.update(call_id=e.call_id)
    elif e.kind in ("audio", "audio_tail"):
        out.update(delta=b64_pcm16(e.samples), format="pcm16", sample_rate=output_sample_rate, channels=1,
                   samples=int(np.asarray(e.samples).size))
        if e.kind == "audio":
            out["audio_codes"] = [int(c) for c in np.asarray(e.audio_codes).reshape(-1)]
            if compute_ms is not None:
                out["compute_ms"] = round(compute_ms, 3)
            if lag_ms is not None:
                out["lag_ms"] = round(lag_ms, 3)
    return out
