"""Chunked speech output: codes frame by frame -> audio chunks via the codec's streaming decode.

Each pushed frame is decoded once with `Codec.decode_step` (no re-decode of
history; the work is spread evenly over frames). Samples are grouped into one
`AudioChunk` per `chunk_frames` frames. The codec's fixed lead-in (`Codec.lead_in`
samples, 8 at the real geometry) is dropped from the start of the stream and its
held-back tail is flushed by `finish()`, so the concatenated chunks have exactly
the length of `Codec.decode(all codes)` and match it within float32 rounding,
except the first `Codec.warmup_samples` samples (6 at the real geometry) where
the streaming iSTFT's warm-up differs from the offline edge.

Because of the lead-in, the samples of a chunk are shifted `lead_in` samples
earlier than the span of its frames: chunk k (frames [k c, (k+1) c), c =
chunk_frames) holds offline samples [k c r - d, (k+1) c r - d) clipped at 0
(r = samples per frame, d = lead-in); the final chunk also holds the last d.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import ClassVar

import mlx.core as mx
import numpy as np

from voicechat.model.audio.codec import Codec, CodecState


@dataclass(frozen=True, eq=False)
class AudioChunk:
    """Decoded audio of the code frames first_frame..last_frame (inclusive), float32 at the codec rate.

    A chunk emitted by `finish()` when no frame was pending carries only the
    codec's held-back tail; its frame range is then the last frame (whose audio
    it completes).
    """

    samples: np.ndarray
    first_frame: int
    last_frame: int

    def __post_init__(self):
        if not isinstance(self.samples, np.ndarray) or self.samples.dtype != np.float32 or self.samples.ndim != 1:
            raise TypeError("AudioChunk.samples: expected a 1-D float32 numpy array")
        if not 0 <= self.first_frame <= self.last_frame:
            raise ValueError(
                f"AudioChunk: expected 0 <= first_frame <= last_frame, got {self.first_frame}, {self.last_frame}"
            )

    __hash__: ClassVar[None] = None  # type: ignore[assignment]  # equal by value, samples included: not hashable

    def __eq__(self, other: object) -> bool:
        return (
            isinstance(other, AudioChunk)
            and self.first_frame == other.first_frame
            and self.last_frame == other.last_frame
            and np.array_equal(self.samples, other.samples)
        )

    @property
    def num_frames(self) -> int:
        return self.last_frame - self.first_frame + 1


class ChunkedSpeechOutput:
    """Push one frame of codes at a time; get an `AudioChunk` every `chunk_frames` frames.

    frames_pushed   code frames pushed so far.
    lead_in_left    lead-in samples still to drop from the start of the stream.
    pending         decoded samples (numpy float32) not yet emitted, and the
                    index of the first frame they belong to.
    """

    def __init__(self, codec: Codec, chunk_frames: int = 25):
        if not isinstance(codec, Codec):
            raise TypeError(f"ChunkedSpeechOutput: expected a Codec, got {type(codec).__name__}")
        if isinstance(chunk_frames, bool) or not isinstance(chunk_frames, (int, np.integer)):
            raise TypeError(f"ChunkedSpeechOutput: chunk_frames must be an int, got {type(chunk_frames).__name__}")
        if chunk_frames < 1:
            raise ValueError(f"ChunkedSpeechOutput: chunk_frames must be >= 1, got {chunk_frames}")
        self.codec = codec
        self.chunk_frames = int(chunk_frames)
        self.state: CodecState = codec.make_state()
        self.reset()

    def reset(self) -> None:
        """Start a new stream (fresh codec state, no pending samples)."""
        self.state.reset()
        self.frames_pushed = 0
        self.lead_in_left = self.codec.lead_in
        self.finished = False
        self._pending: list[np.ndarray] = []
        self._pending_first_frame = 0

    def _take_pending(self, last_frame: int) -> AudioChunk:
        samples = np.concatenate(self._pending) if self._pending else np.zeros((0,), np.float32)
        chunk = AudioChunk(samples.astype(np.float32, copy=False), self._pending_first_frame, last_frame)
        self._pending = []
        self._pending_first_frame = last_frame + 1
        return chunk

    def _append(self, samples: np.ndarray) -> None:
        if self.lead_in_left:
            dropped = min(self.lead_in_left, samples.shape[0])
            samples = samples[dropped:]
            self.lead_in_left -= dropped
        self._pending.append(samples)

    def push(self, codes) -> list[AudioChunk]:
        """One frame of codes (Q,) -> [] or [the chunk completed by this frame]."""
        if self.finished:
            raise RuntimeError("ChunkedSpeechOutput.push: the stream is finished; call reset() to start another")
        samples = self.codec.decode_step(codes, self.state)
        # Materialise the state with the samples so the graph does not grow across frames.
        mx.eval(samples, *self.state.arrays().values())
        self._append(np.array(samples, dtype=np.float32))
        self.frames_pushed += 1
        if self.frames_pushed - self._pending_first_frame == self.chunk_frames:
            return [self._take_pending(self.frames_pushed - 1)]
        return []

    def finish(self) -> list[AudioChunk]:
        """End of stream: the partial chunk (if any) plus the codec's flushed tail, as one chunk."""
        if self.finished:
            return []
        self.finished = True
        if self.frames_pushed == 0:
            return []
        tail = self.codec.flush(self.state)
        mx.eval(tail)
        self._append(np.array(tail, dtype=np.float32))
        last = self.frames_pushed - 1
        if self._pending_first_frame > last:
            # Nothing pending but the tail: it completes the last frame's audio.
            self._pending_first_frame = last
        return [self._take_pending(last)]


def iter_chunks(codec: Codec, codes_iterable: Iterable, chunk_frames: int = 25) -> Iterator[AudioChunk]:
    """Yield the `AudioChunk`s of a stream of per-frame codes (each (Q,)), ending with `finish()`.

    A (T, Q) array also works: it is iterated frame by frame.
    """
    output = ChunkedSpeechOutput(codec, chunk_frames)
    for codes in codes_iterable:
        yield from output.push(codes)
    yield from output.finish()
