"""Measurement tools for `voicechat serve` (run as `python -m bench.server.<tool>`): the per-frame
overhead over an in-process session (`overhead`, `overhead_dialects`) and memory / handles over
many sessions (`soak`). Their shared pieces are here."""

from __future__ import annotations

import os

import numpy as np


def frame_stats(xs) -> dict:
    """mean / p95 / p50 in ms of per-frame times, and how many frames."""
    from voicechat.streaming.profiler import percentile

    xs = list(xs)
    return {
        "mean_ms": round(float(np.mean(xs)), 3),
        "p95_ms": round(percentile(xs, 0.95), 3),
        "p50_ms": round(percentile(xs, 0.5), 3),
        "frames": len(xs),
    }


def sample_pcm16(audio: str) -> np.ndarray:
    """A bundled sample's name or a WAV path -> mono int16 PCM (16 kHz samples as stored)."""
    import soundfile as sf

    from voicechat.samples import sample_path
    from voicechat.server.client import to_pcm16

    path = audio if os.path.exists(audio) else str(sample_path(audio))
    data, _ = sf.read(path, dtype="float32")
    return to_pcm16(data)


def push_times_ms(model, pcm: np.ndarray, chunk: int) -> list[float]:
    """Wall time (ms) of each `push_audio` of `chunk` samples of `pcm` into a new in-process
    session of `model` (flushed at the end): what a server's frame is compared with."""
    import time

    session, times = model.create_streaming_session(), []
    for i in range(0, pcm.size, chunk):
        t0 = time.perf_counter()
        session.push_audio(pcm[i : i + chunk])
        times.append((time.perf_counter() - t0) * 1000.0)
    session.flush()
    return times


__all__ = ["frame_stats", "push_times_ms", "sample_pcm16"]
