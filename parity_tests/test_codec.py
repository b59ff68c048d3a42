"""Codec (docs/model.md §9): streamed decode vs offline decode, iSTFT recipe, encoder, validation.

Tolerances: the streamed and offline paths run the same float32 operations on
the same frames (only the row counts of the matmuls differ), so away from the
documented warm-up they agree to float32 rounding; 1e-5 absolute on samples of
RMS ~0.06 leaves ~100x headroom over single-precision rounding (~1e-7 relative)
accumulated through ~10 layers. The numpy iSTFT reference is computed in
float64 from the same float32 spectrum: 1e-5 covers float32 irfft/OLA rounding.
"""

from __future__ import annotations

import math
import re

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx.utils import tree_flatten, tree_map

from voicechat.model.audio.codec import Codec, CodecState, ConvNeXtBlock, StreamingGeometry
from voicechat.synthetic.presets import preset_config

TOL = 1e-5


def _build(preset: str) -> Codec:
    mx.random.seed(0)
    codec = Codec(preset_config(preset).codec_config)
    mx.eval(codec.parameters())
    return codec


@pytest.fixture(scope="module")
def tiny() -> Codec:
    return _build("tiny")


@pytest.fixture(scope="module")
def real_geometry() -> Codec:
    # preset "small" keeps the real codec geometry (rates 7, 7, 9; n_fft 16, hop 4; 31 x 1024) at 48 base channels.
    return _build("small")


@pytest.fixture(scope="module", params=["tiny", "small"])
def codec(request, tiny, real_geometry) -> Codec:
    return tiny if request.param == "tiny" else real_geometry


def _random_codes(codec: Codec, frames: int, seed: int) -> np.ndarray:
    cfg = codec.config
    rng = np.random.default_rng(seed)
    return rng.integers(0, cfg.codebook_size, size=(frames, cfg.num_quantizers)).astype(np.int32)


def _stream(codec: Codec, codes) -> tuple[list[np.ndarray], np.ndarray]:
    state = codec.make_state()
    steps = []
    for row in codes:
        out = codec.decode_step(row, state)
        mx.eval(out, *state.arrays().values())
        steps.append(np.array(out))
    tail = codec.flush(state)
    return steps, np.array(tail)


# --------------------------------------------------------------------------- layout


def test_parameter_names_and_shapes(codec):
    cfg = codec.config
    b, k, S = cfg.blocks_per_stage, cfg.block_kernel_size, len(cfg.downsample_rates)
    params = dict(tree_flatten(codec.parameters()))
    dec_widths = [cfg.base_channels * m for m in reversed(cfg.channel_multipliers)]
    enc_widths = [cfg.base_channels * m for m in cfg.channel_multipliers]
    expected = {}
    # Decoder: upsamplers at indices divisible by b + 1, final 1x1 conv at S (b + 1).
    in_ch = cfg.latent_dim
    for s, (rate, ch) in enumerate(zip(reversed(cfg.downsample_rates), dec_widths, strict=True)):
        expected[f"decoder.layers.{s * (b + 1)}.weight"] = (ch, rate, in_ch)
        for j in range(1, b + 1):
            n = s * (b + 1) + j
            expected.update(_convnext_shapes(f"decoder.layers.{n}", ch, k))
        in_ch = ch
    expected[f"decoder.layers.{S * (b + 1)}.weight"] = (cfg.stft_channels, 1, in_ch)
    # Encoder: 1x1 conv, then per stage b blocks and a strided conv (last one to latent_dim).
    expected["encoder.layers.0.weight"] = (enc_widths[0], 1, cfg.stft_channels)
    for s, (rate, ch) in enumerate(zip(cfg.downsample_rates, enc_widths, strict=True)):
        for j in range(1, b + 1):
            expected.update(_convnext_shapes(f"encoder.layers.{s * (b + 1) + j}", ch, k))
        out_ch = enc_widths[s + 1] if s + 1 < S else cfg.latent_dim
        expected[f"encoder.layers.{(s + 1) * (b + 1)}.weight"] = (out_ch, rate, ch)
    for q in range(cfg.num_quantizers):
        expected[f"prvq.mus_list.{q}"] = (cfg.codebook_size, cfg.latent_dim)
        expected[f"prvq.variance_list.{q}.variance"] = ()
    assert {n: tuple(v.shape) for n, v in params.items()} == expected


def _convnext_shapes(prefix: str, c: int, k: int) -> dict:
    return {
        f"{prefix}.dwconv.weight": (c, k, 1),
        f"{prefix}.dwconv.bias": (c,),
        f"{prefix}.norm.weight": (c,),
        f"{prefix}.norm.bias": (c,),
        f"{prefix}.pwconv1.weight": (4 * c, 1, c),
        f"{prefix}.pwconv1.bias": (4 * c,),
        f"{prefix}.pwconv2.weight": (c, 1, 4 * c),
        f"{prefix}.pwconv2.bias": (c,),
    }


def test_real_geometry_constants(real_geometry):
    geo = real_geometry.geometry
    assert real_geometry.samples_per_frame == 1764
    assert geo.spectral_frames_per_frame == 441
    assert real_geometry.lead_in == 8
    assert geo.cache_frames == 4
    assert real_geometry.warmup_samples == 6
    # The full (published) config has the same streaming geometry.
    assert StreamingGeometry.from_config(preset_config("full").codec_config) == geo


# --------------------------------------------------------------------------- streaming vs offline


@pytest.mark.parametrize("frames", [1, 6, 40])
def test_stream_matches_offline(codec, frames):
    codes = _random_codes(codec, frames, seed=frames)
    offline = np.array(codec.decode(mx.array(codes)))
    steps, tail = _stream(codec, codes)
    r, d, w = codec.samples_per_frame, codec.lead_in, codec.warmup_samples

    # Sample accounting: r per step, d in the tail; dropping the d lead-in gives decode()'s length.
    assert offline.shape == (frames * r,) and offline.dtype == np.float32
    assert all(s.shape == (r,) for s in steps)
    assert tail.shape == (d,)
    streamed = np.concatenate(steps + [tail])[d:]
    assert streamed.shape == offline.shape
    assert np.all(np.isfinite(offline)) and np.std(offline) > 1e-3

    diff = np.abs(streamed - offline)
    assert diff[w:].max() <= TOL, f"max diff after the {w} warm-up samples: {diff[w:].max():.3g}"
    # The warm-up really differs (else the stated count would be too large) ...
    assert diff[:w].max() > TOL
    # ... and exactly as explained: the first step's window-square normalisation also counts the
    # P zero-initialised cached frames. Undo both normalisations and compare the numerators.
    geo = codec.geometry
    env_offline, env_stream = _envelopes(geo, first=0), _envelopes(geo, first=-geo.cache_frames)
    positions = np.arange(w) + geo.pad
    np.testing.assert_allclose(
        streamed[:w] * env_stream[positions], offline[:w] * env_offline[positions], rtol=0, atol=TOL
    )


def _envelopes(geo: StreamingGeometry, first: int) -> np.ndarray:
    """Overlap-added periodic-Hann squares at positions 0..n_fft of frames first..n_fft/hop."""
    n = np.arange(geo.n_fft)
    w2 = (0.5 * (1 - np.cos(2 * np.pi * n / geo.n_fft))) ** 2
    env = np.zeros(2 * geo.n_fft)
    for f in range(first, geo.n_fft // geo.hop + 1):
        for i in range(geo.n_fft):
            p = f * geo.hop + i
            if 0 <= p < env.shape[0]:
                env[p] += w2[i]
    return env


def test_flush_tail_uses_no_future_frames(tiny):
    """The tail depends only on frames already decoded: two streams that share a prefix agree."""
    codes = _random_codes(tiny, 7, seed=3)
    _, tail_a = _stream(tiny, codes)
    steps_b, _ = _stream(tiny, np.concatenate([codes, _random_codes(tiny, 2, seed=4)]))
    steps_a, _ = _stream(tiny, codes)
    assert all(np.array_equal(a, b) for a, b in zip(steps_a, steps_b[: len(steps_a)], strict=True))
    full = np.array(tiny.decode(codes))
    np.testing.assert_allclose(tail_a, full[-tiny.lead_in :], rtol=0, atol=TOL)


def test_state_copy_reset_arrays(tiny):
    codes = _random_codes(tiny, 6, seed=5)
    state = tiny.make_state()
    assert isinstance(state, CodecState)
    keys = set(state.arrays())
    assert {k for k in keys if k.startswith("decoder.layers.")} == {
        f"decoder.layers.{n}.history" for n in tiny.decoder.block_indices
    }
    assert state.arrays()["istft_real"].shape == (tiny.geometry.cache_frames, tiny.config.n_fft // 2 + 1)
    for row in codes[:3]:
        tiny.decode_step(row, state)
    branch = state.copy()
    a = [np.array(tiny.decode_step(row, state)) for row in codes[3:]]
    b = [np.array(tiny.decode_step(row, branch)) for row in codes[3:]]
    assert all(np.array_equal(x, y) for x, y in zip(a, b, strict=True))
    assert state.frames_decoded == branch.frames_decoded == 6
    for name, arr in state.arrays().items():
        assert np.array_equal(np.array(arr), np.array(branch.arrays()[name])), name
    state.reset()
    assert state.frames_decoded == 0 and not state.flushed
    fresh_out = np.array(tiny.decode_step(codes[0], tiny.make_state()))
    assert np.array_equal(np.array(tiny.decode_step(codes[0], state)), fresh_out)


def test_bfloat16_weights_decode_float32(tiny):
    codec = _build("tiny")
    codec.update(tree_map(lambda p: p.astype(mx.bfloat16), codec.parameters()))
    codes = _random_codes(codec, 5, seed=6)
    offline = codec.decode(codes)
    assert offline.dtype == mx.float32
    steps, tail = _stream(codec, codes)
    streamed = np.concatenate(steps + [tail])[codec.lead_in :]
    w = codec.warmup_samples
    assert np.abs(streamed[w:] - np.array(offline)[w:]).max() <= TOL


# --------------------------------------------------------------------------- independent recomputations


def test_istft_against_numpy(codec):
    """decode() == numpy float64 head + iSTFT applied to the decoder's spectrum output."""
    codes = _random_codes(codec, 3, seed=7)
    spec, _ = codec.decoder(codec.dequantize(codes))
    spec = np.array(spec).astype(np.float64)
    cfg = codec.config
    n_fft, hop, bins = cfg.n_fft, cfg.hop_length, cfg.n_fft // 2 + 1
    mag = 100.0 / (1.0 + np.exp(-(spec[:, :bins] - math.log(100.0))))
    phase = spec[:, bins:]
    stft = mag * np.cos(phase) + 1j * mag * np.sin(phase)
    stft[:, 0] = stft[:, 0].real
    stft[:, -1] = stft[:, -1].real
    window = 0.5 * (1 - np.cos(2 * np.pi * np.arange(n_fft) / n_fft))
    frames = np.fft.irfft(stft, n=n_fft, axis=1)
    frames = np.clip(frames, -window, window) * window
    length = (spec.shape[0] - 1) * hop + n_fft
    num, env = np.zeros(length), np.zeros(length)
    for f in range(spec.shape[0]):
        num[f * hop : f * hop + n_fft] += frames[f]
        env[f * hop : f * hop + n_fft] += window**2
    pad = (n_fft - hop) // 2
    expected = (num / np.maximum(env, 1e-10))[pad : length - pad]
    got = np.array(codec.decode(codes))
    assert got.shape == expected.shape == (3 * codec.samples_per_frame,)
    np.testing.assert_allclose(got, expected, rtol=0, atol=TOL)


def test_fast_convs_match_mlx_convs(tiny):
    """The matmul/shift forms of the convolutions equal MLX's conv ops on the same weights."""
    from voicechat.model.audio.codec import _downsample, _upsample

    cfg = tiny.config
    mx.random.seed(1)
    up = tiny.decoder.layers[0]
    x = mx.random.normal((5, cfg.latent_dim))
    np.testing.assert_allclose(np.array(_upsample(up, x)), np.array(up(x[None])[0]), rtol=0, atol=1e-5)
    down = tiny.encoder.layers[cfg.blocks_per_stage + 1]
    rate = cfg.downsample_rates[0]
    xd = mx.random.normal((4 * rate, down.weight.shape[2]))
    np.testing.assert_allclose(np.array(_downsample(down, xd)), np.array(down(xd[None])[0]), rtol=0, atol=1e-5)
    block: ConvNeXtBlock = tiny.decoder.layers[1]
    xb = mx.random.normal((9, block.channels))
    k = cfg.block_kernel_size
    ref = block.dwconv(mx.pad(xb, [(k - 1, 0), (0, 0)])[None])[0]
    ref = block.norm(ref)
    ref = xb + block.pwconv2(nn.gelu(block.pwconv1(ref[None])))[0]
    got, history = block(xb)
    np.testing.assert_allclose(np.array(got), np.array(ref), rtol=0, atol=1e-5)
    assert np.array_equal(np.array(history), np.array(xb[-(k - 1) :]))


def test_rvq_quantize_against_numpy(codec):
    mx.random.seed(2)
    latent = mx.random.normal((4, codec.config.latent_dim))
    codes = np.array(codec.prvq.quantize(latent))
    residual = np.array(latent).astype(np.float64)
    for q, mus in enumerate(codec.prvq.mus_list):
        m = np.array(mus).astype(np.float64)
        j = np.argmin(((residual[:, None, :] - m[None]) ** 2).sum(-1), axis=1)
        assert np.array_equal(codes[:, q], j), q
        residual = residual - m[j]
    # dequantize(quantize(x)) is the part of x the codebooks explain: the residual shrank.
    recon = np.array(codec.dequantize(codes))
    assert np.linalg.norm(recon - np.array(latent)) < np.linalg.norm(np.array(latent))


def test_encode_silence_constant_codes(codec):
    frames = 6
    ratio = codec.samples_per_frame
    codes = codec.encode(mx.zeros(((frames + 1) * ratio,)))
    assert codes.dtype == mx.int32 and codes.shape == (frames + 1, codec.config.num_quantizers)
    codes = np.array(codes)
    # Away from the causal start edge (the first frame) every frame holds the same codes.
    assert all(np.array_equal(row, codes[1]) for row in codes[1:])
    assert codes.min() >= 0 and codes.max() < codec.config.codebook_size
    # Silence is encoded frame-locally: a longer silence gives the same codes on the shared frames.
    longer = np.array(codec.encode(np.zeros((frames + 3) * ratio, np.float32)))
    assert np.array_equal(longer[: frames + 1], codes)


def test_stft_features_against_numpy(tiny):
    cfg = tiny.config
    rng = np.random.default_rng(8)
    wave = rng.standard_normal(2 * tiny.samples_per_frame).astype(np.float32)
    feats = np.array(tiny.stft_features(mx.array(wave)))
    pad = (cfg.n_fft - cfg.hop_length) // 2
    padded = np.pad(wave.astype(np.float64), (pad, pad))
    window = 0.5 * (1 - np.cos(2 * np.pi * np.arange(cfg.n_fft) / cfg.n_fft))
    n_frames = 1 + (padded.shape[0] - cfg.n_fft) // cfg.hop_length
    assert n_frames == wave.shape[0] // cfg.hop_length
    spec = np.stack(
        [np.fft.rfft(padded[f * cfg.hop_length : f * cfg.hop_length + cfg.n_fft] * window) for f in range(n_frames)]
    )
    np.testing.assert_allclose(feats, np.concatenate([spec.real, spec.imag], axis=1), rtol=0, atol=1e-5)


# --------------------------------------------------------------------------- validation


def test_bad_codes_raise(tiny):
    cfg = tiny.config
    good = _random_codes(tiny, 2, seed=9)
    too_big = good.copy()
    too_big[1, 3] = cfg.codebook_size
    negative = good.copy()
    negative[0, 0] = -1
    with pytest.raises(ValueError, match=r"\[0, 32\)"):
        tiny.decode(too_big)
    with pytest.raises(ValueError, match="codebook_size"):
        tiny.decode(mx.array(negative))
    with pytest.raises(ValueError, match="num_quantizers"):
        tiny.decode(good[:, :-1])
    with pytest.raises(TypeError, match="integer dtype"):
        tiny.decode(good.astype(np.float32))
    with pytest.raises(TypeError, match="integer dtype"):
        tiny.decode(mx.array(good).astype(mx.float32))
    with pytest.raises(ValueError, match="shape"):
        tiny.decode(good[None])
    with pytest.raises(ValueError, match="at least one frame"):
        tiny.decode(good[:0])
    with pytest.raises(TypeError, match=r"mx\.array or numpy"):
        tiny.decode(good.tolist())

    state = tiny.make_state()
    with pytest.raises(ValueError, match="one frame"):
        tiny.decode_step(good, state)
    with pytest.raises(ValueError, match=re.escape(f"[0, {cfg.codebook_size})")):
        tiny.decode_step(too_big[1], state)
    assert state.frames_decoded == 0  # a refused frame changes nothing
    tiny.decode_step(good[0], state)
    tiny.decode_step(good[1:2], state)  # (1, Q) is accepted too
    tiny.flush(state)
    with pytest.raises(ValueError, match="flushed"):
        tiny.decode_step(good[0], state)
    with pytest.raises(TypeError, match="CodecState"):
        tiny.decode_step(good[0], object())


def test_bad_waveform_raises(tiny):
    r = tiny.samples_per_frame
    with pytest.raises(ValueError, match=f"multiple of {r}"):
        tiny.encode(np.zeros(r + 1, np.float32))
    with pytest.raises(ValueError, match="1-D"):
        tiny.encode(np.zeros((1, r), np.float32))
    with pytest.raises(TypeError, match="floating point"):
        tiny.encode(np.zeros(r, np.int16))
    bad = np.zeros(r, np.float32)
    bad[3] = np.nan
    with pytest.raises(ValueError, match="NaN"):
        tiny.encode(bad)


@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16, mx.float16])
def test_host_dequantize_equals_mlx(tiny, dtype):
    """The streaming decode's host-side codebook lookup (zero-copy views, bf16 widened by its
    bits) gives MLX's dequantize bit for bit: the same float32 additions in the same order."""
    prvq = tiny.prvq
    saved = list(prvq.mus_list)
    try:
        prvq.mus_list = [m.astype(dtype) for m in saved]
        mx.eval(prvq.mus_list)
        codes = _random_codes(tiny, 5, seed=4)
        want = prvq.dequantize(mx.array(codes))
        got = prvq.dequantize_host(codes)
        assert got.dtype == np.float32 and got.shape == tuple(want.shape)
        assert np.array_equal(got, np.array(want))
    finally:
        prvq.mus_list = saved


def test_codes_are_checked_on_the_host(tiny):
    """decode_step validates codes with one host read; bad values leave the state untouched."""
    state = tiny.make_state()
    bad = np.full((1, tiny.config.num_quantizers), tiny.config.codebook_size, dtype=np.int32)
    with pytest.raises(ValueError, match=r"codes must lie in \[0, "):
        tiny.decode_step(mx.array(bad), state)
    with pytest.raises(ValueError, match="got values from -1"):
        tiny.decode_step(np.full_like(bad, -1), state)
    assert state.frames_decoded == 0 and state.samples_emitted == 0
    ok = _random_codes(tiny, 1, seed=5)
    a = np.array(tiny.decode_step(mx.array(ok), state))
    b = np.array(tiny.decode_step(mx.array(ok), tiny.make_state()))
    assert np.array_equal(a, b) and state.frames_decoded == 1
