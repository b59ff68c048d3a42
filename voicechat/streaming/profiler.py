"""Per-frame stage timings of a streaming session (`profile=True`) and their summary (api.md)."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

from voicechat.runtime.policy import describe_fields
from voicechat.streaming.engine import STAGES as FRAME_STAGES

STAGES = (*FRAME_STAGES, "total")


@dataclass(frozen=True)
class FrameTiming:
    """Milliseconds per stage for one audio frame; each stage ends with its outputs evaluated."""

    frame_index: int
    perception_ms: float
    rnnt_ms: float
    language_ms: float
    tts_ms: float
    codec_ms: float
    total_ms: float

    def as_dict(self) -> dict:
        return asdict(self)


def percentile(values, p: float) -> float:
    """Linear interpolation at position (n - 1) * p, as numpy's default and the reference do."""
    xs = sorted(values)
    if not xs:
        return math.nan
    pos = (len(xs) - 1) * p
    lo = math.floor(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def stage_stats(values) -> dict:
    values = list(values)
    if not values:
        return {"mean_ms": math.nan, "p50_ms": math.nan, "p95_ms": math.nan, "max_ms": math.nan}
    return {
        "mean_ms": sum(values) / len(values),
        "p50_ms": percentile(values, 0.50),
        "p95_ms": percentile(values, 0.95),
        "max_ms": max(values),
    }


class Profile:
    """Collected `FrameTiming`s of one session."""

    def __init__(self, frame_duration_ms: float = 80.0, policy: dict | None = None):
        self.frame_duration_ms = frame_duration_ms
        self.policy = policy  # the model's ExecutionPolicy fields (`as_dict`) the frames ran under
        self.frames: list[FrameTiming] = []

    def add(self, timing: FrameTiming) -> None:
        self.frames.append(timing)

    def summary(self, drop_first: int = 0) -> dict:
        if drop_first < 0:
            raise ValueError(f"drop_first must be >= 0, got {drop_first}")
        kept = self.frames[drop_first:]
        out = {
            "frames": len(kept),
            "dropped_cold_frames": min(drop_first, len(self.frames)),
            "frame_duration_ms": self.frame_duration_ms,
            "execution_policy": self.policy,
        }
        for stage in STAGES:
            out[stage] = stage_stats(getattr(f, f"{stage}_ms") for f in kept)
        mean_total = out["total"]["mean_ms"]
        out["processing_frames_per_second"] = 1000.0 / mean_total if kept and mean_total > 0 else math.nan
        out["realtime_factor"] = mean_total / self.frame_duration_ms if kept else math.nan
        return out

    def table(self, drop_first: int = 0) -> str:
        """A plain-text table of the summary (printed by `voicechat generate --profile`)."""
        s = self.summary(drop_first)
        lines = [
            (
                f"{'stage':<11}{'mean':>9}{'p50':>9}{'p95':>9}{'max':>9}   (ms, {s['frames']} frames, "
                f"first {s['dropped_cold_frames']} dropped)"
            )
        ]
        for stage in STAGES:
            st = s[stage]
            lines.append(
                f"{stage:<11}{st['mean_ms']:>9.2f}{st['p50_ms']:>9.2f}{st['p95_ms']:>9.2f}{st['max_ms']:>9.2f}"
            )
        lines.append(
            f"real-time factor {s['realtime_factor']:.3f} (mean total / {self.frame_duration_ms:g} ms), "
            f"{s['processing_frames_per_second']:.2f} frames/s"
        )
        if self.policy is not None:
            lines.append(f"execution policy {describe_fields(self.policy)}")
        return "\n".join(lines)
