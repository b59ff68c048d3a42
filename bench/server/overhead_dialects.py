"""Per-frame overhead of each wire dialect over the in-process session, side by side in one run.

    python -m bench.server.overhead_dialects [-m synthetic:small] [--rounds 2] [--audio long_question]

One `voicechat serve` process; round by round, interleaved: (a) the in-process session pushed one
frame at a time (wall time of each `push_audio`), (b) mlx-vlm's dialect in lock-step (one frame
sent, wait for its `response.audio.delta`), (c) OpenAI Realtime GA at 24 kHz (80 ms appended, wait
for its first `response.output_audio.delta`), (d) OpenAI Live at 16 kHz (one frame appended, wait
for its `session.output_audio.delta`).
The GA step is timed against the in-process push of the same 16 kHz samples the server's
resampler produced, so both sides compute the same frames. Also: the error of the resampling
itself (the model's 22.05 kHz output -> 24 kHz -> back, soxr HQ). Writes
reports/server/overhead_dialects.json.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import json
import sys
import time
from pathlib import Path

import numpy as np

from . import frame_stats, push_times_ms, sample_pcm16


def _b64(pcm) -> str:
    return base64.b64encode(np.asarray(pcm, "<i2").tobytes()).decode()


async def _ga(url, pcm24, chunk):
    """80 ms appends at 24 kHz; the step's time is to its first `response.output_audio.delta` (an append that
    completes no frame, the resampler's blocks, is not timed)."""
    from websockets.asyncio.client import connect

    times = []
    async with connect(url + "?model=overhead", max_size=None) as ws:
        json.loads(await ws.recv())
        for i in range(0, pcm24.size - chunk + 1, chunk):
            t0 = time.perf_counter()
            await ws.send(json.dumps({"type": "input_audio_buffer.append", "audio": _b64(pcm24[i : i + chunk])}))
            got = None
            deadline = t0 + 1.0
            while True:
                left = deadline - time.perf_counter() if got is None else 0.003
                try:
                    e = json.loads(await asyncio.wait_for(ws.recv(), max(left, 0.0)))
                except TimeoutError:
                    break
                if e["type"] == "error":
                    raise RuntimeError(e)
                if e["type"] == "response.output_audio.delta" and got is None:
                    got = (time.perf_counter() - t0) * 1000.0
            if got is not None:
                times.append(got)
    return times


async def _live(url, pcm16, n):
    from websockets.asyncio.client import connect

    times = []
    async with connect(url, max_size=None) as ws:
        await ws.send(
            json.dumps(
                {
                    "type": "session.start",
                    "session": {"model": "overhead", "audio": {"format": {"type": "audio/pcm", "rate": 16000}}},
                }
            )
        )
        while json.loads(await ws.recv())["type"] != "session.started":
            pass
        for i in range(0, pcm16.size - n + 1, n):
            t0 = time.perf_counter()
            await ws.send(json.dumps({"type": "session.input_audio.append", "audio": _b64(pcm16[i : i + n])}))
            while True:
                try:
                    e = json.loads(await asyncio.wait_for(ws.recv(), 10))
                except TimeoutError:  # soxr emitted nothing for this frame: not timed
                    t0 = None
                    break
                if e["type"] == "session.output_audio.delta":
                    break
            if t0 is not None:
                times.append((time.perf_counter() - t0) * 1000.0)
    return times


def resampling_error(y: np.ndarray) -> dict:
    """The resampling's own error on the model's output: 22.05 kHz -> 24 kHz -> 22.05 kHz (soxr HQ), full band
    and in the speech band (the output first band-limited to 8 kHz). soxr HQ passes up to ~91 % of the lower
    Nyquist, so full-band noise (the synthetic models' output) loses its top; speech does not."""
    import soxr

    def err(x):
        back = soxr.resample(soxr.resample(x, 22050, 24000), 24000, 22050)[: x.size]
        e, ref = (back - x)[2000:-2000], x[2000:-2000]  # the ends see the filters' edges
        return {
            "max_abs": float(np.abs(e).max()),
            "rms": float(np.sqrt(np.mean(e**2))),
            "snr_db": round(float(10 * np.log10(np.mean(ref**2) / np.mean(e**2))), 1),
        }

    band = soxr.resample(soxr.resample(y, 22050, 16000), 16000, 22050)[: y.size]
    return {"full_band": err(np.asarray(y, np.float32)), "speech_band_8khz": err(band)}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("-m", "--model", default="synthetic:small", help="default synthetic:small (the real frame geometry)")
    p.add_argument("--audio", default="long_question")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--drop-first", type=int, default=5)
    p.add_argument("--out", default="reports/server/overhead_dialects.json")
    args = p.parse_args(argv)

    import soxr

    import voicechat
    from voicechat.server.client import run_stream_audio, to_pcm16
    from voicechat.server.compare import free_port, start_process
    from voicechat.server.resample import StreamResampler
    from voicechat.synthetic.checkpoint import resolve_model_arg

    pcm = sample_pcm16(args.audio)
    ckpt = resolve_model_arg(args.model)
    model = voicechat.load(ckpt)
    n = model.config.frame_samples
    pcm = pcm[: pcm.size - pcm.size % n]
    pcm24 = to_pcm16(soxr.resample(pcm.astype(np.float32) / 32768.0, 16000, 24000))
    chunk24 = n * 3 // 2
    port = free_port()
    log = Path(args.out).with_suffix(".serve.log")
    log.parent.mkdir(parents=True, exist_ok=True)
    proc = start_process(
        [sys.executable, "-m", "voicechat.cli", "serve", "-m", ckpt, "--port", str(port), "--log-level", "warning"],
        f"http://127.0.0.1:{port}/healthz",
        log,
        timeout=600,
    )
    url = f"ws://127.0.0.1:{port}"
    res = {k: [] for k in ("in_process", "in_process_ga_steps", "mlx_vlm", "ga", "live")}
    try:
        warm = model.create_streaming_session()
        warm.push_audio(pcm[: n * 10])
        for _ in range(args.rounds):
            res["in_process"] += push_times_ms(model, pcm, n)[args.drop_first :]
            # The GA steps: the same 16 kHz pieces the server's resampler makes of each 80 ms append.
            s, r, t = model.create_streaming_session(), StreamResampler(24000, 16000), []
            for i in range(0, pcm24.size - chunk24 + 1, chunk24):
                x = r.push(pcm24[i : i + chunk24].astype(np.float32) / 32768.0)
                t0 = time.perf_counter()
                s.push_audio(x)
                t.append((time.perf_counter() - t0) * 1000.0)
            res["in_process_ga_steps"] += t[args.drop_first :]
            rs = run_stream_audio(url + "/v1/realtime", pcm, lockstep=True, chunk_samples=n)
            res["mlx_vlm"] += rs.frame_round_trip_ms[args.drop_first :]
            res["ga"] += asyncio.run(_ga(url + "/v1/realtime", pcm24, chunk24))[args.drop_first :]
            res["live"] += asyncio.run(_live(url + "/v1/live/sessions", pcm, n))[args.drop_first :]
    finally:
        proc.terminate()
        proc.wait(15)
    out = {"model": args.model, "audio": Path(args.audio).name, "rounds": args.rounds, "drop_first": args.drop_first}
    base = frame_stats(res["in_process"])
    base_ga = frame_stats(res["in_process_ga_steps"])
    out["in_process_push_ms"] = base
    out["in_process_push_ga_steps_ms"] = base_ga
    for name, ref in (("mlx_vlm", base), ("ga", base_ga), ("live", base)):
        st = frame_stats(res[name])
        out[name] = {
            "round_trip_ms": st,
            "overhead_mean_ms": round(st["mean_ms"] - ref["mean_ms"], 3),
            "overhead_p95_ms": round(st["p95_ms"] - ref["p95_ms"], 3),
        }
    s = model.create_streaming_session()
    y = np.concatenate([e.samples for e in s.push_audio(pcm) + s.flush() if e.kind in ("audio", "audio_tail")])
    out["resampling_round_trip_22050_24000_22050"] = resampling_error(y)
    Path(args.out).write_text(json.dumps(out, indent=1) + "\n")
    print(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
