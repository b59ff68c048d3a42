"""`voicechat talk`: microphone in, speaker out, over /v1/realtime (thin over `client.RealtimeClient`).

Needs the `mic` extra (sounddevice + PortAudio). Without --url a server runs in this process
on a free local port. Ctrl-C ends the turn (commit) and waits for the answer's tail.
"""

from __future__ import annotations

import asyncio
import collections
import json
import sys
import threading

import numpy as np

from voicechat.server.client import RealtimeClient
from voicechat.server.protocol import b64_to_int16
from voicechat.server.runner import ServerThread, make_state


class JitterBuffer:
    """PCM16 FIFO for the speaker callback: starts playing once `prefill` samples are queued."""

    def __init__(self, prefill: int):
        self.prefill = prefill
        self.chunks: collections.deque = collections.deque()
        self.size = 0
        self.playing = False
        self.lock = threading.Lock()
        self.underruns = 0

    def push(self, pcm: np.ndarray) -> None:
        with self.lock:
            self.chunks.append(pcm)
            self.size += pcm.size
            if self.size >= self.prefill:
                self.playing = True

    def pull(self, n: int) -> np.ndarray:
        out = np.zeros(n, np.int16)
        with self.lock:
            if not self.playing:
                return out
            i = 0
            while i < n and self.chunks:
                c = self.chunks[0]
                k = min(n - i, c.size)
                out[i : i + k] = c[:k]
                i += k
                self.size -= k
                if k == c.size:
                    self.chunks.popleft()
                else:
                    self.chunks[0] = c[k:]
            if i < n:
                self.underruns += 1
                self.playing = False  # refill before playing again
        return out


async def _talk(url: str, args) -> int:
    import sounddevice as sd

    loop = asyncio.get_running_loop()
    mic: asyncio.Queue = asyncio.Queue()
    async with RealtimeClient(url, api_key=args.api_key) as c:
        created = await c.recv(30)
        if created["type"] == "error":
            print(f"server: {created['error']['message']}", file=sys.stderr)
            return 1
        await c.update(system_prompt=args.prompt, seed=args.seed)
        upd = await c.wait_for("session.updated")
        if upd["type"] == "error":
            print(f"server: {upd['error']['message']}", file=sys.stderr)
            return 1
        rate = upd["session"]["output_audio_format"]["sample_rate"]
        jitter = JitterBuffer(prefill=int(rate * 0.12))

        def on_mic(indata, frames, t, status):
            loop.call_soon_threadsafe(mic.put_nowait, indata[:, 0].copy())

        def on_speaker(outdata, frames, t, status):
            outdata[:, 0] = jitter.pull(frames)

        async def receive():
            async for text in c.ws:
                e = json.loads(text)
                t = e["type"]
                if t in ("response.audio.delta", "response.audio.tail"):
                    jitter.push(b64_to_int16(e["delta"]))
                elif t == "response.text.delta":
                    print(e["delta"], end="", flush=True)
                elif t == "conversation.item.input_audio_transcription.delta":
                    print(f"[{e['delta']}]", end="", flush=True)
                elif t == "error":
                    print(f"\n[error {e['error']['code']}: {e['error']['message']}]", file=sys.stderr)
                elif t in ("response.done", "response.cancelled"):
                    return

        rx = asyncio.create_task(receive())
        with (
            sd.InputStream(samplerate=16000, channels=1, dtype="int16", blocksize=1280, callback=on_mic),
            sd.OutputStream(samplerate=rate, channels=1, dtype="int16", callback=on_speaker),
        ):
            print("listening; Ctrl-C to end the turn", file=sys.stderr)
            try:
                while not rx.done():
                    await c.append(await mic.get())
            except (KeyboardInterrupt, asyncio.CancelledError):
                pass
            if not rx.done():
                await c.send({"type": "input_audio_buffer.commit"})
            await rx
            while jitter.size:  # let the tail play out
                await asyncio.sleep(0.05)
    print()
    return 0


def talk(args) -> int:
    try:
        import sounddevice  # noqa: F401
    except (ImportError, OSError) as e:
        print(
            f"voicechat talk: needs the `mic` extra and PortAudio (pip install 'voicechat-mlx[mic]'): {e}",
            file=sys.stderr,
        )
        return 2
    srv = None
    url = args.url
    if url is None:
        srv = ServerThread(make_state(args.model)).start()
        url = srv.url
    try:
        return asyncio.run(_talk(url, args))
    except KeyboardInterrupt:
        return 0
    finally:
        if srv is not None:
            srv.stop()
            srv.state.worker.stop()
