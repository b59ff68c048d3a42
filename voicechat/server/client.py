"""The reference client of `/v1/realtime` (websockets library): stream audio, collect the answer.

`voicechat client` and `voicechat talk` are thin over `RealtimeClient`; the tests drive the
server with it. No MLX here.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import time
from dataclasses import dataclass, field

import numpy as np
from websockets.exceptions import ConnectionClosed

from voicechat.server.protocol import b64_to_int16

INPUT_RATE = 16000


def to_pcm16(samples) -> np.ndarray:
    """Mono audio -> int16. int16 passes through; float is scaled by 32768 and clipped, so a PCM16
    source read as float (k / 32768) comes back exactly."""
    a = np.asarray(samples)
    if a.dtype == np.int16:
        return a
    if not np.issubdtype(a.dtype, np.floating):
        raise TypeError(f"audio must be int16 PCM or float in [-1, 1], got dtype {a.dtype}")
    return np.clip(np.round(a.astype(np.float64) * 32768.0), -32768, 32767).astype(np.int16)


@dataclass
class ClientResult:
    events: list = field(default_factory=list)  # every server event, in arrival order (dicts)
    audio: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int16))  # deltas then tail, PCM16
    output_sample_rate: int = 22050
    text: str = ""
    transcript: str = ""
    function_text: str = ""
    frames: int = 0
    end: str = ""  # response.done | response.cancelled | closed
    close_code: int | None = None
    errors: list = field(default_factory=list)  # error events' {code, message}
    frame_round_trip_ms: list = field(default_factory=list)  # lockstep mode only

    def of_type(self, t: str) -> list:
        return [e for e in self.events if e.get("type") == t]


class RealtimeClient:
    """One connection; `async with RealtimeClient(url) as c: ...`."""

    def __init__(self, url: str, *, api_key: str | None = None, origin: str | None = None, open_timeout: float = 30):
        self.url = url
        self.api_key = api_key
        self.origin = origin
        self.open_timeout = open_timeout
        self.ws = None

    async def __aenter__(self):
        from websockets.asyncio.client import connect

        headers = {}
        if self.api_key:
            headers["Authorization"] = f"Bearer {self.api_key}"
        self.ws = await connect(
            self.url, additional_headers=headers, origin=self.origin, max_size=None, open_timeout=self.open_timeout
        )
        return self

    async def __aexit__(self, *exc):
        await self.ws.close()

    async def send(self, payload: dict) -> None:
        await self.ws.send(json.dumps(payload))

    async def recv(self, timeout: float | None = None) -> dict:
        text = await asyncio.wait_for(self.ws.recv(), timeout)
        return json.loads(text)

    async def append(self, pcm: np.ndarray) -> None:
        await self.send(
            {
                "type": "input_audio_buffer.append",
                "sample_rate": INPUT_RATE,
                "audio": base64.b64encode(to_pcm16(pcm).astype("<i2").tobytes()).decode("ascii"),
            }
        )

    async def update(self, *, system_prompt=None, seed=0, max_streaming_seconds=None, model=None) -> None:
        session = {"system_prompt": system_prompt, "seed": seed, "max_streaming_seconds": max_streaming_seconds}
        if model is not None:
            session["model"] = model
        await self.send({"type": "session.update", "session": session})

    async def wait_for(self, *types: str, timeout: float = 60.0, sink: list | None = None) -> dict:
        """Receive until an event of one of `types` (or `error`) arrives; the others go to `sink`."""
        deadline = time.monotonic() + timeout
        while True:
            e = await self.recv(max(deadline - time.monotonic(), 0.001))
            if sink is not None:
                sink.append(e)
            if e.get("type") in types or e.get("type") == "error":
                return e


def _collect(result: ClientResult, e: dict) -> None:
    result.events.append(e)
    t = e.get("type")
    if t == "response.audio.delta":
        result.frames += 1
    elif t == "response.text.delta":
        result.text = e["text"]
    elif t == "response.function.delta":
        result.function_text = e["text"]
    elif t == "conversation.item.input_audio_transcription.delta":
        result.transcript = e.get("transcript", e.get("text", ""))
    elif t == "session.updated":
        result.output_sample_rate = e["session"]["output_audio_format"]["sample_rate"]
    elif t == "error":
        result.errors.append(e["error"])
    elif t in ("response.done", "response.cancelled"):
        result.end = t


def _finish_audio(result: ClientResult) -> None:
    pieces = [
        b64_to_int16(e["delta"])
        for e in result.events
        if e.get("type") in ("response.audio.delta", "response.audio.tail")
    ]
    result.audio = np.concatenate(pieces) if pieces else np.zeros(0, np.int16)


async def stream_audio(
    url: str,
    audio,
    *,
    fast: bool = False,
    chunk_samples: int = 1280,
    system_prompt: str | None = None,
    seed: int = 0,
    max_streaming_seconds: float | None = None,
    api_key: str | None = None,
    model: str | None = None,
    pad_partial: bool = True,
    cancel_after_frames: int | None = None,
    lockstep: bool = False,
    on_event=None,
    timeout: float = 300.0,
) -> ClientResult:
    """Stream `audio` (16 kHz mono) in `chunk_samples` appends, real time unless `fast`, then commit.

    `lockstep`: send one frame and wait for its audio delta before the next (per-frame
    round trips, for overhead measurements). `cancel_after_frames`: send response.cancel
    once that many audio deltas arrived, instead of committing.
    """
    pcm = to_pcm16(audio)
    result = ClientResult()
    async with RealtimeClient(url, api_key=api_key) as c:
        created = await c.recv(timeout)
        _collect(result, created)
        if created.get("type") == "error":
            result.end = "closed"
            await _drain_close(c, result)
            return result
        sess = created.get("session")
        limits = sess.get("limits") if isinstance(sess, dict) else None
        max_bytes = limits.get("max_message_bytes") if isinstance(limits, dict) else None
        if isinstance(max_bytes, int) and max_bytes > 1024:
            # Appends the server can take: base64 makes 3 bytes 4 characters; leave room for the envelope.
            chunk_samples = max(1, min(chunk_samples, (max_bytes - 256) // 4 * 3 // 2))
        await c.update(system_prompt=system_prompt, seed=seed, max_streaming_seconds=max_streaming_seconds, model=model)
        e = await c.wait_for("session.updated", timeout=timeout, sink=result.events)
        if e.get("type") == "error":
            result.errors.append(e["error"])
            return result
        result.output_sample_rate = e["session"]["output_audio_format"]["sample_rate"]
        cancelled = asyncio.Event()
        frame_arrived = asyncio.Queue()

        async def receiver():
            try:
                async for text in c.ws:
                    ev = json.loads(text)
                    _collect(result, ev)
                    if on_event is not None:
                        on_event(ev)
                    if ev.get("type") == "response.audio.delta":
                        frame_arrived.put_nowait(time.perf_counter())
                        if (
                            cancel_after_frames is not None
                            and result.frames >= cancel_after_frames
                            and not cancelled.is_set()
                        ):
                            cancelled.set()
                            await c.send({"type": "response.cancel"})
            except Exception:  # connection closed: recorded below
                pass

        recv_task = asyncio.create_task(receiver())
        # A closed connection: the server ended the session (cancel, error, limit); the receiver has its last events.
        with contextlib.suppress(ConnectionClosed):
            await _send_all(
                c,
                pcm,
                result,
                recv_task,
                cancelled,
                frame_arrived,
                fast=fast,
                lockstep=lockstep,
                chunk_samples=chunk_samples,
                cancel_after_frames=cancel_after_frames,
                pad_partial=pad_partial,
                timeout=timeout,
            )
        try:
            await asyncio.wait_for(recv_task, timeout)
        except TimeoutError:
            recv_task.cancel()
        result.close_code = c.ws.close_code
        if not result.end:
            result.end = "closed"
    _finish_audio(result)
    return result


async def _send_all(
    c,
    pcm,
    result,
    recv_task,
    cancelled,
    frame_arrived,
    *,
    fast,
    lockstep,
    chunk_samples,
    cancel_after_frames,
    pad_partial,
    timeout,
) -> None:
    step = chunk_samples / INPUT_RATE
    t0 = time.monotonic()
    sent = 0
    for k, i in enumerate(range(0, pcm.size, chunk_samples)):
        if cancelled.is_set() or recv_task.done():
            break
        piece = pcm[i : i + chunk_samples]
        if lockstep:
            before = sent // 1280
            ts = time.perf_counter()
            await c.append(piece)
            sent += piece.size
            for _ in range(sent // 1280 - before):
                tr = await asyncio.wait_for(frame_arrived.get(), timeout)
                result.frame_round_trip_ms.append((tr - ts) * 1000.0)
            continue
        if not fast:
            await asyncio.sleep(max(0.0, t0 + k * step - time.monotonic()))
        await c.append(piece)
        sent += piece.size
    if not cancelled.is_set() and not recv_task.done():
        if cancel_after_frames is not None:
            cancelled.set()
            await c.send({"type": "response.cancel"})
        else:
            await c.send({"type": "input_audio_buffer.commit", "pad_partial": pad_partial})


async def _drain_close(c: RealtimeClient, result: ClientResult) -> None:
    try:
        async for text in c.ws:
            _collect(result, json.loads(text))
    except Exception:
        pass
    result.close_code = c.ws.close_code


def run_stream_audio(*args, **kwargs) -> ClientResult:
    return asyncio.run(stream_audio(*args, **kwargs))
