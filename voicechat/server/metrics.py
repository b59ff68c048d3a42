"""Prometheus metrics of one server (its own registry, so several apps can live in one process)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

STAGES = ("perception", "rnnt", "language", "tts", "codec")
# Seconds; the frame budget is 80 ms, so resolve well below and well above it.
LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.4, 0.8, 1.6, 5.0)
TICK_BUCKETS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 64)
LAG_BUCKETS = (0.0, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.56, 5.12, 10.24, 20.48)


class ServerMetrics:
    content_type = CONTENT_TYPE_LATEST

    def __init__(self):
        r = self.registry = CollectorRegistry()
        self.frames = Counter("voicechat_frames", "audio frames computed (80 ms each)", registry=r)
        self.frame_seconds = Histogram(
            "voicechat_frame_compute_seconds",
            "compute time of one frame on the MLX worker",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.stage_seconds = Histogram(
            "voicechat_stage_seconds",
            "per-stage compute time of one frame",
            ["stage"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.lag_seconds = Histogram(
            "voicechat_lag_seconds",
            "audio received but not yet computed, when a frame completes",
            buckets=LAG_BUCKETS,
            registry=r,
        )
        self.lag_current = Gauge("voicechat_lag_current_seconds", "lag at the last completed frame", registry=r)
        self.audio_in_seconds = Counter("voicechat_audio_received_seconds", "accepted input audio", registry=r)
        self.sessions_opened = Counter("voicechat_sessions_opened", "sessions that got a slot", registry=r)
        self.sessions_refused = Counter("voicechat_sessions_refused", "connections refused", ["reason"], registry=r)
        self.sessions_errored = Counter(
            "voicechat_sessions_errored",
            "sessions ended by an error (timeout, internal, context limit)",
            ["reason"],
            registry=r,
        )
        self.sessions_active = Gauge("voicechat_sessions_active", "sessions holding a slot", registry=r)
        self.sessions_max = Gauge("voicechat_sessions_max", "session slots (--max-sessions)", registry=r)
        self.slot_bytes = Gauge(
            "voicechat_slot_bytes_at_limit",
            "bytes one session slot can reach at the session length limit (voicechat.server.memory)",
            registry=r,
        )
        # A tick: the next frame of every session with one ready, as one pass per stage (worker.py).
        self.tick_seconds = Histogram(
            "voicechat_tick_seconds",
            "compute time of one tick (the frames of every ready session, computed together)",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.tick_frames = Histogram(
            "voicechat_tick_frames", "frames computed in one tick (sessions in it)", buckets=TICK_BUCKETS, registry=r
        )
        self.frames_missed = Counter(
            "voicechat_frames_missed_deadline",
            "frames of ticks that took longer than one frame (80 ms): every frame of such a tick counts",
            registry=r,
        )
        self.client_errors = Counter("voicechat_client_errors", "error events sent to clients", ["code"], registry=r)
        self.queue_depth = Gauge("voicechat_worker_queue_commands", "commands waiting for the MLX worker", registry=r)
        for s in STAGES:
            self.stage_seconds.labels(stage=s)
        for reason in ("busy", "unauthorized", "origin", "host"):
            self.sessions_refused.labels(reason=reason)

    def render(self) -> bytes:
        return generate_latest(self.registry)
