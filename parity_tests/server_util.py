"""Helpers of the server tests: a server on 127.0.0.1 in a background thread, a raw client."""

from __future__ import annotations

import asyncio
import base64
import json

import numpy as np


def start_server(checkpoint, **limits):
    from voicechat.server.app import ServerLimits, ServerSecurity
    from voicechat.server.runner import ServerThread, make_state

    security = ServerSecurity(api_key=limits.pop("api_key", None), allowed_origins=tuple(limits.pop("origins", ())),
                              allowed_hosts=tuple(limits.pop("hosts", ())))
    state = make_state(str(checkpoint), limits=ServerLimits(**limits), security=security, warmup_seconds=0.0)
    return ServerThread(state).start()


def stop_server(srv) -> None:
    srv.stop()
    srv.state.worker.stop()


def pcm16_b64(pcm: np.ndarray) -> str:
    return base64.b64encode(np.asarray(pcm, "<i2").tobytes()).decode()


def append_msg(pcm, sample_rate=16000) -> str:
    return json.dumps({"type": "input_audio_buffer.append", "audio": pcm16_b64(pcm), "sample_rate": sample_rate})


class Raw:
    """A bare websockets connection with JSON helpers (tests send malformed messages too)."""

    def __init__(self, url, **kw):
        self.url, self.kw = url, kw

    async def __aenter__(self):
        from websockets.asyncio.client import connect

        self.ws = await connect(self.url, max_size=None, **self.kw)
        return self

    async def __aexit__(self, *a):
        await self.ws.close()

    async def send(self, obj) -> None:
        await self.ws.send(obj if isinstance(obj, (str, bytes)) else json.dumps(obj))

    async def recv(self, timeout=30.0) -> dict:
        return json.loads(await asyncio.wait_for(self.ws.recv(), timeout))

    async def configure(self) -> None:
        """The opening handshake: session.created, then session.update -> session.updated."""
        assert (await self.recv())["type"] == "session.created"
        await self.send({"type": "session.update"})
        assert (await self.recv())["type"] == "session.updated"

    async def until(self, *types, timeout=30.0) -> tuple[dict, list]:
        seen = []
        while True:
            e = await self.recv(timeout)
            seen.append(e)
            if e["type"] in types:
                return e, seen

    async def closed(self, timeout=30.0) -> tuple[int, list]:
        """Read to the end; -> (close code, events read)."""
        seen = []
        try:
            while True:
                seen.append(json.loads(await asyncio.wait_for(self.ws.recv(), timeout)))
        except Exception:
            pass
        return self.ws.close_code, seen

    async def ping_ok(self) -> bool:
        await self.send({"type": "session.ping"})
        e, _ = await self.until("session.pong")
        return True


def run(coro):
    return asyncio.run(coro)


def wait_released(srv, timeout=10.0) -> bool:
    """The slot frees a moment after the client sees the close (the worker closes the session first)."""
    import time

    deadline = time.monotonic() + timeout
    while srv.state.active_session is not None:
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True
