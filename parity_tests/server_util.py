"""Helpers of the server tests: a server on 127.0.0.1 in a background thread, a raw client."""

from __future__ import annotations

import asyncio
import base64
import json

import numpy as np
import pytest


def start_server(checkpoint, *, max_sessions=1, **limits):
    from voicechat.server.app import ServerLimits, ServerSecurity
    from voicechat.server.runner import ServerThread, make_state

    security = ServerSecurity(
        api_key=limits.pop("api_key", None),
        allowed_origins=tuple(limits.pop("origins", ())),
        allowed_hosts=tuple(limits.pop("hosts", ())),
    )
    state = make_state(
        str(checkpoint),
        limits=ServerLimits(**limits),
        security=security,
        warmup_seconds=0.0,
        max_sessions=max_sessions,
    )
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
        _e, _ = await self.until("session.pong")
        return True


def run(coro):
    return asyncio.run(coro)


def wait_released(srv, timeout=10.0, active=0) -> bool:
    """The slot frees a moment after the client sees the close (the worker closes the session first):
    wait until at most `active` sessions hold a slot."""
    import time

    deadline = time.monotonic() + timeout
    while srv.state.active_sessions > active:
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


# -- raw sockets: forged headers, crafted frames, a client that does not read (127.0.0.1 only)


def http_raw(
    port: int, path: str = "/healthz", headers: dict | None = None, *, upgrade: bool = False, timeout: float = 10.0
) -> tuple[int, bytes]:
    """One HTTP/1.1 request with exactly these headers (Host included) -> (status, body)."""
    import socket

    lines = [f"GET {path} HTTP/1.1"]
    hdrs = dict(headers or {})
    if upgrade:
        hdrs.setdefault("Upgrade", "websocket")
        hdrs.setdefault("Connection", "Upgrade")
        hdrs.setdefault("Sec-WebSocket-Key", "dGhlIHNhbXBsZSBub25jZQ==")
        hdrs.setdefault("Sec-WebSocket-Version", "13")
    else:
        hdrs.setdefault("Connection", "close")
    for k, v in hdrs.items():
        lines.append(f"{k}: {v}")
    req = ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as s:
        s.sendall(req)
        data = b""
        while b"\r\n\r\n" not in data:
            chunk = s.recv(65536)
            if not chunk:
                break
            data += chunk
        head, _, body = data.partition(b"\r\n\r\n")
        status = int(head.split(b" ", 2)[1])
        if status == 101:
            return status, b""
        length = next(
            (int(x.split(b":")[1]) for x in head.split(b"\r\n") if x.lower().startswith(b"content-length")), None
        )
        while length is not None and len(body) < length:
            chunk = s.recv(65536)
            if not chunk:
                break
            body += chunk
        return status, body


class RawSocketWS:
    """A hand-rolled WebSocket client on a plain socket: sends masked frames of any content, reads only when
    asked (with a small receive buffer it stops the server's sends: a client that does not read)."""

    def __init__(self, port: int, *, rcvbuf: int | None = None, headers: dict | None = None, timeout: float = 10.0):
        import socket

        s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        if rcvbuf is not None:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
        s.settimeout(timeout)
        s.connect(("127.0.0.1", port))
        hdrs = {
            "Host": f"127.0.0.1:{port}",
            "Upgrade": "websocket",
            "Connection": "Upgrade",
            "Sec-WebSocket-Key": "dGhlIHNhbXBsZSBub25jZQ==",
            "Sec-WebSocket-Version": "13",
            **(headers or {}),
        }
        req = "GET /v1/realtime HTTP/1.1\r\n" + "".join(f"{k}: {v}\r\n" for k, v in hdrs.items()) + "\r\n"
        s.sendall(req.encode("latin-1"))
        data = b""
        while b"\r\n\r\n" not in data:
            data += s.recv(1)  # byte by byte: nothing of the first frame is consumed here
        assert data.startswith(b"HTTP/1.1 101"), data
        self.sock = s
        self._buf = b""

    def send_frame(self, payload: bytes, opcode: int = 1) -> None:
        import os
        import struct

        n = len(payload)
        head = bytes([0x80 | opcode])
        if n < 126:
            head += bytes([0x80 | n])
        elif n < 1 << 16:
            head += bytes([0x80 | 126]) + struct.pack(">H", n)
        else:
            head += bytes([0x80 | 127]) + struct.pack(">Q", n)
        mask = os.urandom(4)
        masked = (
            bytes(b ^ mask[i % 4] for i, b in enumerate(payload))
            if n < 4096
            else (np.frombuffer(payload, np.uint8) ^ np.resize(np.frombuffer(mask, np.uint8), n)).tobytes()
        )
        self.sock.sendall(head + mask + masked)

    def send_json(self, obj) -> None:
        self.send_frame(json.dumps(obj).encode())

    def _read(self, n: int) -> bytes:
        while len(self._buf) < n:
            chunk = self.sock.recv(65536)
            if not chunk:
                raise ConnectionError("closed")
            self._buf += chunk
        out, self._buf = self._buf[:n], self._buf[n:]
        return out

    def recv_frame(self) -> tuple[int, bytes]:
        import struct

        b0, b1 = self._read(2)
        n = b1 & 0x7F
        if n == 126:
            n = struct.unpack(">H", self._read(2))[0]
        elif n == 127:
            n = struct.unpack(">Q", self._read(8))[0]
        return b0 & 0x0F, self._read(n)

    def read_until_close(self, timeout: float = 10.0) -> tuple[int | None, list]:
        """-> (close code or None if the connection ended without a close frame, text events)."""
        import struct
        import time

        self.sock.settimeout(timeout)
        deadline = time.monotonic() + timeout
        events = []
        try:
            while time.monotonic() < deadline:
                op, data = self.recv_frame()
                if op == 8:
                    return (struct.unpack(">H", data[:2])[0] if len(data) >= 2 else None), events
                if op == 1:
                    events.append(json.loads(data))
        except (ConnectionError, OSError):
            pass
        return None, events

    def close(self) -> None:
        self.sock.close()


# Fixtures shared by the server test modules (imported into parity_tests/conftest.py): one tiny
# server per module, and servers made with given limits, stopped after the test.
@pytest.fixture(scope="module")
def server(tiny_ckpt):
    srv = start_server(tiny_ckpt)
    yield srv
    stop_server(srv)


@pytest.fixture
def make_server(tiny_ckpt):
    made = []

    def make(**limits):
        srv = start_server(tiny_ckpt, **limits)
        made.append(srv)
        return srv

    yield make
    for s in made:
        stop_server(s)


def slow_frames(delay):
    """A frame hook (WrappedServer): every frame takes `delay` s longer, a model that cannot keep up."""

    def hook(record):
        import time

        time.sleep(delay)

    return hook


def failing_frame(at):
    """A frame hook (WrappedServer): the session's frame `at` fails after the tick's shared pass (as a
    bug in turning one session's outputs into events would)."""

    def hook(record):
        if record.frame_index == at:
            raise RuntimeError("injected fault /secret/path/model.safetensors")

    return hook


class WrappedServer:
    """A server (ServerThread) on a worker whose model lets a test make frames slow or faulty;
    `.srv`, `.worker`, `.metrics`; stopped on exit.

    `frame_hook(open_kwargs) -> on_frame or None`: asked as each session opens (its keyword arguments:
    system_prompt, seed, ...); the returned callable is the session's `on_frame`, run in each tick after
    the shared pass, with the session's FrameRecord (`slow_frames`, `failing_frame`).
    `engine_hook(states)`: run before every pass of the frame engine (a tick, or a commit's frame) with
    the conversation states it is about to compute; raise to fail the shared pass."""

    def __init__(self, checkpoint, frame_hook=None, limits=None, *, max_sessions=1, engine_hook=None):
        self.checkpoint, self.frame_hook, self.limits = checkpoint, frame_hook, limits
        self.max_sessions, self.engine_hook = max_sessions, engine_hook

    def __enter__(self):
        import voicechat
        from voicechat.server.app import ServerState
        from voicechat.server.limits import ServerLimits
        from voicechat.server.metrics import ServerMetrics
        from voicechat.server.runner import ServerThread
        from voicechat.server.worker import ModelWorker

        frame_hook, engine_hook = self.frame_hook, self.engine_hook

        class Model:
            def __init__(self, model):
                self._m = model

            def __getattr__(self, name):
                return getattr(self._m, name)

            def create_session_batch(self, max_sessions):
                batch = self._m.create_session_batch(max_sessions)
                opener = batch.open

                def open_(**kw):
                    hook = frame_hook(kw) if frame_hook is not None else None
                    if hook is not None:
                        kw["on_frame"] = hook
                    return opener(**kw)

                batch.open = open_
                if engine_hook is not None:
                    step_batch = batch.engine.step_batch

                    def hooked(states, *a, **k):
                        engine_hook(states)
                        return step_batch(states, *a, **k)

                    batch.engine.step_batch = hooked
                return batch

        self.metrics = ServerMetrics()
        self.worker = ModelWorker(
            lambda: Model(voicechat.load(self.checkpoint)), metrics=self.metrics, max_sessions=self.max_sessions
        ).start()
        self.worker.wait_ready(60)
        self.srv = ServerThread(
            ServerState(worker=self.worker, metrics=self.metrics, limits=self.limits or ServerLimits())
        ).start()
        return self

    def __exit__(self, *exc):
        self.srv.stop()
        self.worker.stop()


FRAME = 1280  # input samples per model frame (16 kHz)


def pcm16(x) -> np.ndarray:
    """float samples -> little-endian PCM16 (clipped)."""
    return np.round(np.clip(np.asarray(x, np.float32), -1, 1) * 32767).astype("<i2")


def b64(pcm) -> str:
    return base64.b64encode(np.asarray(pcm, "<i2").tobytes()).decode()


def unb64(s) -> np.ndarray:
    return np.frombuffer(base64.b64decode(s), "<i2")
