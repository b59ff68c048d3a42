"""Streaming resampling for the OpenAI dialects (soxr, the same library `voicechat generate` uses for files).

`soxr.ResampleStream` gives the same samples as a one-shot `soxr.resample` of the whole signal,
whatever the chunking (tested), so a client's audio equals the in-process session's output for
the same input after one-shot resampling: the tests compare them exactly.
"""

from __future__ import annotations

import numpy as np


class StreamResampler:
    """float32 mono at `in_rate` -> float32 mono at `out_rate`, chunk by chunk; equal rates pass through."""

    def __init__(self, in_rate: int, out_rate: int):
        self.in_rate, self.out_rate = int(in_rate), int(out_rate)
        self._stream = None
        if self.in_rate != self.out_rate:
            import soxr

            self._stream = soxr.ResampleStream(self.in_rate, self.out_rate, 1, dtype="float32")

    def push(self, samples: np.ndarray) -> np.ndarray:
        x = np.ascontiguousarray(samples, dtype=np.float32).reshape(-1)
        if self._stream is None:
            return x
        return self._stream.resample_chunk(x)

    def flush(self) -> np.ndarray:
        """The samples the filter still holds (end of the stream)."""
        if self._stream is None:
            return np.zeros(0, np.float32)
        return self._stream.resample_chunk(np.zeros(0, np.float32), last=True)


def pcm16_to_float(pcm: np.ndarray) -> np.ndarray:
    """int16 -> float32 as the session reads PCM16 (k / 32768)."""
    return np.asarray(pcm, dtype=np.float32) / 32768.0
