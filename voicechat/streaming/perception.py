"""Streaming perception: 1280 validated samples -> one encoder frame and its audio embedding.

The cached path runs the streaming log-mel and the cache-aware FastConformer; the uncached
fallback re-encodes a window of recent audio each frame (a diagnostic path). Input comes checked
by the session (float32, 1-D, finite), so the components' own checks are not run again.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from voicechat.model.audio.conformer import ConformerStream, PerceptionFallback, advance_rows
from voicechat.model.audio.mel import StreamingLogMel


class StreamingPerception:
    """Streaming log-mel + cache-aware FastConformer + projection: one frame at a time."""

    def __init__(self, model, *, use_cache: bool = True):
        cfg = model.config
        per = model.stt_model.perception
        self.perception = per
        self.use_cache = use_cache
        if use_cache:
            self.mel = StreamingLogMel(
                cfg.audio_config.preprocessor,
                lookahead_samples=cfg.frame_samples,
                reference_edge=model.numerics.streaming_mel_edge_as_reference,
            )
            self.conformer = ConformerStream(per.encoder)
            self.fallback = None
        else:
            self.mel = self.conformer = None
            self.fallback = PerceptionFallback(per.encoder, cfg.audio_config.preprocessor, cfg.frame_samples)
        self.last_mel = None  # the log-mel frames of the last frame (cached path)

    def push_frame(self, samples: np.ndarray) -> tuple[mx.array, mx.array]:
        """float32 samples (frame_samples,), already checked -> (encoder frame (d,), audio embedding (H,))."""
        x = mx.array(samples)
        if self.fallback is not None:
            enc = self.fallback.advance(x)
        else:
            mel, conformer = self._cached()
            self.last_mel = mel.advance(x)
            enc = conformer.advance_one(self.last_mel)
        return enc, self.perception.project(enc)

    def _cached(self) -> tuple[StreamingLogMel, ConformerStream]:
        if self.mel is None or self.conformer is None:
            raise RuntimeError("StreamingPerception: built without the perception cache")
        return self.mel, self.conformer

    def arrays(self) -> dict[str, mx.array]:
        if self.fallback is not None:
            return {f"fallback.{k}": v for k, v in self.fallback.arrays().items()}
        mel, conformer = self._cached()
        out = {f"mel.{k}": v for k, v in mel.arrays().items()}
        out.update({f"conformer.{k}": v for k, v in conformer.state.arrays().items()})
        return out


def perceive(perceptions: list[StreamingPerception], samples: list[np.ndarray]) -> list[tuple[mx.array, mx.array]]:
    """`push_frame` of several conversations of one model: -> (encoder frame, audio embedding) each.
    The log-mel runs per conversation (each its own edge state); the conformer layers and the
    projection take every conversation's frame together (`conformer.advance_rows`), each computing
    exactly what it computes alone. The uncached fallback (a diagnostic) runs per conversation."""
    if len(perceptions) == 1 or any(p.fallback is not None for p in perceptions):
        return [p.push_frame(x) for p, x in zip(perceptions, samples, strict=True)]
    streams, mels = [], []
    for p, x in zip(perceptions, samples, strict=True):
        mel, conformer = p._cached()
        p.last_mel = mel.advance(mx.array(x))
        streams.append(conformer)
        mels.append(p.last_mel)
    encs = advance_rows(streams, mels)
    embs = perceptions[0].perception.project(mx.stack(encs))
    return [(enc, embs[c]) for c, enc in enumerate(encs)]


__all__ = ["StreamingPerception", "perceive"]
