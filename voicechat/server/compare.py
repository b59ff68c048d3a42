"""Protocol-level comparison of two servers' event streams for the same input (ours vs mlx-vlm's).

Used by the `-m peers` test and `voicechat parity --against mlx-vlm-server`. Fields that
are per-server by nature (event_id, session ids, timings) are not compared.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import numpy as np

from voicechat.server.protocol import b64_to_int16

# Events only this project sends (api.md: the codec tail at commit, so no sample is lost).
OURS_ONLY = ("response.audio.tail",)


def _frames(events, t, key):
    return [(e["frame_index"], e[key]) for e in events if e["type"] == t]


def compare_streams(ours: list[dict], ref: list[dict]) -> dict:
    """-> figures and verdicts: kinds/order, text and function ids, transcript, codes, PCM16 audio."""
    kinds_a = [e["type"] for e in ours if e["type"] not in OURS_ONLY]
    kinds_b = [e["type"] for e in ref]
    first_kind = next(
        (i for i, (x, y) in enumerate(zip(kinds_a, kinds_b, strict=False)) if x != y),
        None if len(kinds_a) == len(kinds_b) else min(len(kinds_a), len(kinds_b)),
    )
    out = {
        "events_ours": len(ours),
        "events_reference": len(ref),
        "ours_only": sorted({e["type"] for e in ours if e["type"] in OURS_ONLY}),
        "kinds_equal": first_kind is None,
        "first_kind_mismatch": first_kind,
    }
    for name, t, key in (
        ("text_ids", "response.text.delta", "token_id"),
        ("function_ids", "response.function.delta", "token_id"),
        ("transcript", "conversation.item.input_audio_transcription.delta", "transcript"),
    ):
        a, b = _frames(ours, t, key), _frames(ref, t, key)
        out[f"{name}_equal"] = a == b
        out[f"{name}_count"] = len(a)
    ca = [e["audio_codes"] for e in ours if e["type"] == "response.audio.delta"]
    cb = [e["audio_codes"] for e in ref if e["type"] == "response.audio.delta"]
    out["frames_ours"], out["frames_reference"] = len(ca), len(cb)
    n = min(len(ca), len(cb))
    diff = [i for i in range(n) if ca[i] != cb[i]]
    out["codes_equal"] = len(ca) == len(cb) and not diff
    out["code_frames_differing"] = len(diff)
    out["first_code_mismatch"] = diff[0] if diff else None
    pa = [b64_to_int16(e["delta"]) for e in ours if e["type"] == "response.audio.delta"]
    pb = [b64_to_int16(e["delta"]) for e in ref if e["type"] == "response.audio.delta"]
    same = [i for i in range(n) if ca[i] == cb[i]]
    if same:
        d = max(int(np.max(np.abs(pa[i].astype(np.int32) - pb[i].astype(np.int32)))) for i in same)
        out["audio_max_abs_pcm16_on_equal_code_frames"] = d
    return out


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_process(cmd: list[str], health_url: str, log_path, *, timeout: float = 180.0, cwd=None):
    """Start a server subprocess and wait for its health URL; -> Popen (the caller terminates it)."""
    repo = str(Path(__file__).resolve().parents[2])
    env = dict(os.environ, PYTHONPATH=repo + os.pathsep + os.environ.get("PYTHONPATH", ""))
    log = open(log_path, "w")  # noqa: SIM115 - the child process writes it for its whole life
    p = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=cwd or repo)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if p.poll() is not None:
            raise RuntimeError(f"{' '.join(cmd[:4])} exited with {p.returncode}: {Path(log_path).read_text()[-2000:]}")
        try:
            urllib.request.urlopen(health_url, timeout=1)
            return p
        except Exception:
            time.sleep(0.25)
    p.kill()
    raise RuntimeError(f"{' '.join(cmd[:4])} did not become healthy within {timeout} s")


def stop_process(p) -> None:
    if p is None:
        return
    p.terminate()
    try:
        p.wait(15)
    except subprocess.TimeoutExpired:
        p.kill()


class ServerPair:
    """`mlx_vlm.server` and `voicechat serve --numerics NUMERICS` on one checkpoint, as subprocesses."""

    def __init__(self, checkpoint: str, log_dir, *, numerics: str = "reference"):
        self.checkpoint = str(checkpoint)
        self.log_dir = Path(log_dir)
        self.numerics = numerics
        self.procs = []

    def __enter__(self):
        pv, po = free_port(), free_port()
        try:
            self.procs.append(
                start_process(
                    [sys.executable, "-m", "mlx_vlm.server", "--host", "127.0.0.1", "--port", str(pv)],
                    f"http://127.0.0.1:{pv}/health",
                    self.log_dir / "mlx_vlm.log",
                )
            )
            self.procs.append(
                start_process(
                    [
                        sys.executable,
                        "-m",
                        "voicechat.cli",
                        "serve",
                        "-m",
                        self.checkpoint,
                        "--port",
                        str(po),
                        "--warmup-seconds",
                        "0",
                        "--numerics",
                        self.numerics,
                    ],
                    f"http://127.0.0.1:{po}/healthz",
                    self.log_dir / "voicechat.log",
                )
            )
        except BaseException:
            self.__exit__()
            raise
        self.ours_url = f"ws://127.0.0.1:{po}/v1/realtime"
        self.reference_url = f"ws://127.0.0.1:{pv}/v1/realtime"
        return self

    def __exit__(self, *exc):
        for p in reversed(self.procs):
            stop_process(p)
        self.procs = []
