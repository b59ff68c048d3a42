"""Chunked speech output: chunks decoded with the codec's streaming state vs one offline decode.

Every chunk size decodes the same frames with the same `decode_step` calls, so
the concatenations must be bit-identical across chunk sizes. Against
`Codec.decode` the tolerance is 1e-5 absolute (float32 rounding of two
evaluation orders of the same operations, samples of RMS ~0.06), except the
codec's documented `warmup_samples` at the very start.
"""

from __future__ import annotations

import dataclasses

import mlx.core as mx
import numpy as np
import pytest

from voicechat.model.audio.codec import Codec
from voicechat.streaming.speech_output import AudioChunk, ChunkedSpeechOutput, iter_chunks
from voicechat.synthetic.presets import preset_config

TOL = 1e-5


def _build(preset: str) -> Codec:
    mx.random.seed(0)
    codec = Codec(preset_config(preset).codec_config)
    mx.eval(codec.parameters())
    return codec


@pytest.fixture(scope="module", params=["tiny", "small"])
def codec(request) -> Codec:
    return _build(request.param)


def _codes(codec: Codec, frames: int, seed: int = 0) -> np.ndarray:
    cfg = codec.config
    rng = np.random.default_rng(seed)
    return rng.integers(0, cfg.codebook_size, size=(frames, cfg.num_quantizers)).astype(np.int32)


def _check_bookkeeping(chunks: list[AudioChunk], frames: int, chunk_frames: int, r: int, d: int) -> None:
    # Pushed frames are partitioned in order; only the last chunk may be short or tail-only.
    full, rest = divmod(frames, chunk_frames)
    expected_ranges = [(k * chunk_frames, (k + 1) * chunk_frames - 1) for k in range(full)]
    expected_ranges.append((full * chunk_frames, frames - 1) if rest else (frames - 1, frames - 1))
    assert [(c.first_frame, c.last_frame) for c in chunks] == expected_ranges
    # Samples: lead-in d trimmed from the first chunk, tail d added to the last one.
    expected_sizes = [chunk_frames * r] * full + [rest * r]
    expected_sizes[0] -= d
    expected_sizes[-1] += d
    assert [c.samples.shape[0] for c in chunks] == expected_sizes
    assert all(c.samples.dtype == np.float32 for c in chunks)


@pytest.mark.parametrize("frames", [30])
def test_chunk_sizes_identical_and_equal_decode(codec, frames):
    codes = _codes(codec, frames)
    offline = np.array(codec.decode(codes))
    r, d, w = codec.samples_per_frame, codec.lead_in, codec.warmup_samples
    concatenations = {}
    for chunk_frames in (1, 6, 25, frames + 7):
        out = ChunkedSpeechOutput(codec, chunk_frames=chunk_frames)
        chunks = []
        for k, row in enumerate(codes):
            emitted = out.push(row)
            # A chunk comes out exactly when its last frame is pushed, never later.
            assert len(emitted) == (1 if (k + 1) % chunk_frames == 0 else 0)
            chunks += emitted
        chunks += out.finish()
        _check_bookkeeping(chunks, frames, chunk_frames, r, d)
        concatenations[chunk_frames] = np.concatenate([c.samples for c in chunks])

    reference = concatenations[1]
    for chunk_frames, audio in concatenations.items():
        assert np.array_equal(audio, reference), f"chunk_frames={chunk_frames} differs from chunk_frames=1"
    assert reference.shape == offline.shape == (frames * r,)
    diff = np.abs(reference - offline)
    assert diff[w:].max() <= TOL, f"max diff after the {w} warm-up samples: {diff[w:].max():.3g}"


def test_iter_chunks_matches_push_finish():
    codec = _build("tiny")
    codes = _codes(codec, 13, seed=1)
    via_iter = list(iter_chunks(codec, mx.array(codes), chunk_frames=5))
    out = ChunkedSpeechOutput(codec, chunk_frames=5)
    manual = [c for row in codes for c in out.push(row)] + out.finish()
    assert via_iter == manual
    assert [(c.first_frame, c.last_frame) for c in via_iter] == [(0, 4), (5, 9), (10, 12)]


def test_exact_multiple_gives_tail_only_chunk():
    codec = _build("tiny")
    codes = _codes(codec, 6, seed=2)
    chunks = list(iter_chunks(codec, codes, chunk_frames=3))
    assert [(c.first_frame, c.last_frame) for c in chunks] == [(0, 2), (3, 5), (5, 5)]
    assert chunks[-1].samples.shape == (codec.lead_in,)
    offline = np.array(codec.decode(codes))
    np.testing.assert_allclose(chunks[-1].samples, offline[-codec.lead_in :], rtol=0, atol=TOL)


def test_lifecycle_and_validation():
    codec = _build("tiny")
    codes = _codes(codec, 4, seed=3)
    out = ChunkedSpeechOutput(codec, chunk_frames=2)
    assert out.finish() == []  # nothing pushed: nothing to flush
    out.reset()
    first = [c for row in codes for c in out.push(row)] + out.finish()
    assert out.finish() == []
    with pytest.raises(RuntimeError, match="finished"):
        out.push(codes[0])
    out.reset()
    second = [c for row in codes for c in out.push(row)] + out.finish()
    assert first == second

    with pytest.raises(ValueError, match="chunk_frames"):
        ChunkedSpeechOutput(codec, chunk_frames=0)
    with pytest.raises(TypeError, match="chunk_frames"):
        ChunkedSpeechOutput(codec, chunk_frames=2.0)
    with pytest.raises(TypeError, match="Codec"):
        ChunkedSpeechOutput(object())
    bad = codes[0].copy()
    bad[0] = codec.config.codebook_size
    fresh = ChunkedSpeechOutput(codec, chunk_frames=2)
    with pytest.raises(ValueError, match="codebook_size"):
        fresh.push(bad)
    assert fresh.frames_pushed == 0

    chunk = first[0]
    with pytest.raises(dataclasses.FrozenInstanceError):
        chunk.first_frame = 3
    with pytest.raises(TypeError, match="float32"):
        AudioChunk(np.zeros(4, np.float64), 0, 0)
    with pytest.raises(ValueError, match="first_frame"):
        AudioChunk(np.zeros(4, np.float32), 2, 1)
