"""`voicechat serve` against the reference's server (`mlx_vlm.server`, -m peers).

Both servers run as subprocesses on 127.0.0.1 on the same synthetic tiny checkpoint and are
driven by the same client (voicechat.server.client) with the same audio, seed and prompt.
The event kinds and their order agree (our `response.audio.tail` aside: the codec tail mlx-vlm
drops), and so do the text / function ids, the transcript and the decoded codes. Figures go to
reports/server/vs_mlx_vlm_server.json.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

pytest.importorskip("mlx_vlm", reason="needs the `peers` extra")
from voicechat.server.client import run_stream_audio, to_pcm16  # noqa: E402
from voicechat.server.compare import compare_streams  # noqa: E402

REPO = Path(__file__).resolve().parents[1]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start(cmd, health_url, log_path, timeout=180.0):
    env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    log = open(log_path, "w")
    p = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=str(REPO))
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if p.poll() is not None:
            raise RuntimeError(f"{cmd[:3]} exited with {p.returncode}: {Path(log_path).read_text()[-2000:]}")
        try:
            urllib.request.urlopen(health_url, timeout=1)
            return p
        except Exception:
            time.sleep(0.25)
    p.kill()
    raise RuntimeError(f"{cmd[:3]} did not become healthy in {timeout} s")


@pytest.fixture(scope="module")
def servers(tiny_ckpt, tmp_path_factory):
    logs = tmp_path_factory.mktemp("server_logs")
    pv, po = _free_port(), _free_port()
    vlm = _start([sys.executable, "-m", "mlx_vlm.server", "--host", "127.0.0.1", "--port", str(pv)],
                 f"http://127.0.0.1:{pv}/health", logs / "mlx_vlm.log")
    ours = None
    try:
        ours = _start([sys.executable, "-m", "voicechat.cli", "serve", "-m", str(tiny_ckpt), "--port", str(po),
                       "--reference-numerics", "--warmup-seconds", "0"],
                      f"http://127.0.0.1:{po}/healthz", logs / "voicechat.log")
        yield f"ws://127.0.0.1:{po}/v1/realtime", f"ws://127.0.0.1:{pv}/v1/realtime"
    finally:
        for p in (ours, vlm):
            if p is not None:
                p.terminate()
                try:
                    p.wait(15)
                except subprocess.TimeoutExpired:
                    p.kill()


def _decoded(events, tiny_model):
    """Codes after control-code replacement (what the codec decodes; mlx-vlm's events carry these)."""
    from voicechat.tts.ear_tts import replace_control_codes

    tts = tiny_model.tts_model
    out = []
    for e in events:
        if e["type"] == "response.audio.delta":
            c = replace_control_codes(mx.array(np.array(e["audio_codes"], np.int32)), tts.control_codes,
                                      tts.codec_silence_tokens)
            e = dict(e, audio_codes=np.array(c).tolist())
        out.append(e)
    return out


@pytest.mark.peers
@pytest.mark.parametrize("prompt", [None, "You are a helpful assistant."])
def test_same_client_same_events_as_mlx_vlm_server(servers, tiny_ckpt, tiny_model, question_wav, prompt):
    ours_url, vlm_url = servers
    pcm = to_pcm16(question_wav)
    kw = dict(fast=True, chunk_samples=1280, seed=0, system_prompt=prompt, model=str(tiny_ckpt))
    ours = run_stream_audio(ours_url, pcm, **kw)
    ref = run_stream_audio(vlm_url, pcm, **kw)
    assert ours.end == ref.end == "response.done" and not ours.errors and not ref.errors
    c = compare_streams(_decoded(ours.events, tiny_model), _decoded(ref.events, tiny_model))
    out = REPO / "reports" / "server"
    out.mkdir(parents=True, exist_ok=True)
    name = "vs_mlx_vlm_server" + ("_prompt" if prompt else "") + ".json"
    (out / name).write_text(json.dumps({"prompt": prompt, "close_code_ours": ours.close_code,
                                        "close_code_reference": ref.close_code, **c}, indent=1) + "\n")
    assert c["ours_only"] == ["response.audio.tail"]
    assert c["kinds_equal"], c  # session.created .. session.updated, per-frame events, committed, done
    assert c["frames_ours"] == c["frames_reference"] == -(-pcm.size // 1280)
    assert c["text_ids_equal"] and c["function_ids_equal"] and c["transcript_equal"], c
    assert c["codes_equal"], c
    assert ours.close_code == 1000  # mlx-vlm's server ends without a close frame (1006)
