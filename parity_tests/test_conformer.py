"""FastConformer: cache-aware streaming vs offline, attention window, push rules, bounded caches."""

from __future__ import annotations

import copy
import dataclasses
import os

import mlx.core as mx
import numpy as np
import pytest
from mlx.utils import tree_flatten, tree_map as nn_tree_map

from voicechat.model.audio.conformer import (
    ConformerStream,
    FastConformer,
    Perception,
    PerceptionFallback,
    subsampled_length,
)
from voicechat.model.audio.mel import StreamingLogMel, log_mel
from voicechat.synthetic.presets import preset_config

AUDIO = preset_config("tiny").audio_config
ENC = AUDIO.encoder
LEFT = ENC.left_context  # 8 in the tiny preset
N_FRAMES = 104  # encoder frames in the long tests: > LEFT + 1

# Stream vs offline tolerance: both paths do the same float32 arithmetic on
# differently shaped operands (1 query row vs a T x T masked score matrix,
# 1-row vs T-row matmuls), so reductions may round differently (~1e-7 per op,
# a few ulps after 2 layers of O(1) activations). 1e-3 is the brief's bound;
# we also report the measured value.
STREAM_TOL = 1e-3


def _encoder(cfg=ENC, seed=0) -> FastConformer:
    mx.random.seed(seed)
    return FastConformer(cfg)


def _mel(n_enc_frames: int, seed: int = 1) -> mx.array:
    """Log-mel-like input (8 K + 1 frames -> K + 1 encoder frames)."""
    rng = np.random.default_rng(seed)
    t = 8 * (n_enc_frames - 1) + 1
    m = -8.0 + 3.0 * rng.standard_normal((t, ENC.feat_in)) + 2.0 * np.sin(np.arange(t) / 5.0)[:, None]
    return mx.array(m.astype(np.float32))


def _stream_session_style(enc: FastConformer, mel: mx.array) -> mx.array:
    s = ConformerStream(enc)
    outs = [s.push_one(mel[:1])]
    for i in range(1, mel.shape[0], 8):
        outs.append(s.push_one(mel[i : i + 8]))
    return mx.stack(outs)


def test_parameter_names():
    mx.random.seed(0)
    p = Perception(AUDIO)
    names = {k for k, _ in tree_flatten(p.parameters())}
    expected = {f"encoder.pre_encode.conv.{i}.{w}" for i in (0, 2, 3, 5, 6) for w in ("weight", "bias")}
    expected |= {"encoder.pre_encode.out.weight", "encoder.pre_encode.out.bias", "proj.weight", "proj.bias"}
    for i in range(ENC.n_layers):
        pre = f"encoder.layers.{i}."
        for n in (
            "norm_feed_forward1",
            "norm_self_att",
            "norm_conv",
            "norm_feed_forward2",
            "norm_out",
            "conv.batch_norm",
        ):
            expected |= {pre + n + ".weight", pre + n + ".bias"}
        for ff in ("feed_forward1", "feed_forward2"):
            expected |= {pre + f"{ff}.linear1.weight", pre + f"{ff}.linear2.weight"}
        for lin in ("linear_q", "linear_k", "linear_v", "linear_out", "linear_pos"):
            expected.add(pre + f"self_attn.{lin}.weight")
        expected |= {pre + "self_attn.pos_bias_u", pre + "self_attn.pos_bias_v"}
        expected |= {pre + f"conv.{c}.weight" for c in ("pointwise_conv1", "depthwise_conv", "pointwise_conv2")}
    assert names == expected
    d, c = ENC.d_model, ENC.subsampling_conv_channels
    shapes = dict(tree_flatten(p.parameters()))
    assert shapes["encoder.pre_encode.conv.0.weight"].shape == (c, 3, 3, 1)
    assert shapes["encoder.pre_encode.conv.3.weight"].shape == (c, 1, 1, c)
    assert shapes["encoder.layers.0.conv.pointwise_conv1.weight"].shape == (2 * d, 1, d)
    assert shapes["encoder.layers.0.conv.depthwise_conv.weight"].shape == (d, ENC.conv_kernel_size, 1)
    assert shapes["encoder.layers.0.self_attn.pos_bias_u"].shape == (ENC.n_heads, d // ENC.n_heads)


def test_stream_matches_offline_long():
    enc = _encoder()
    mel = _mel(N_FRAMES)
    offline = enc(mel)
    assert offline.shape == (N_FRAMES, ENC.d_model) == (subsampled_length(mel.shape[0]), ENC.d_model)
    streamed = _stream_session_style(enc, mel)
    diff = mx.abs(streamed - offline).max().item()
    assert diff <= STREAM_TOL, diff
    assert mx.abs(offline).max().item() > 0.1  # not a degenerate all-zero encoder


def test_stream_irregular_pushes_match_offline():
    enc = _encoder(seed=2)
    mel = _mel(60, seed=3)
    offline = enc(mel)
    s = ConformerStream(enc)
    outs, i = [], 0
    for n in [3, 5, 13, 0, 50, 7, 1, 9, 200, mel.shape[0]]:
        n = min(n, mel.shape[0] - i)
        outs.append(s.push(mel[i : i + n]))
        i += n
        assert s.state.frames_emitted == (0 if i == 0 else (i - 1) // 8 + 1)
    streamed = mx.concatenate(outs)
    assert streamed.shape == offline.shape
    assert mx.abs(streamed - offline).max().item() <= STREAM_TOL


def test_limited_attention_differs_after_window():
    enc = _encoder()
    mel = _mel(N_FRAMES)
    limited = enc(mel)
    unlimited = enc(mel, left_context=-1)
    # Frames 0..LEFT see their whole past either way: identical math.
    assert mx.abs(limited[: LEFT + 1] - unlimited[: LEFT + 1]).max().item() <= 1e-5
    # Later frames lose context beyond the window: the mask must matter.
    assert mx.abs(limited[LEFT + 1 :] - unlimited[LEFT + 1 :]).max().item() > 1e-2


def test_push_counts_and_push_one():
    enc = _encoder()
    mel = _mel(10)
    s = ConformerStream(enc)
    assert s.push(mel[:1]).shape == (1, ENC.d_model)  # frame 0 needs mel frame 0 only
    assert s.push(mel[1:9]).shape == (1, ENC.d_model)  # 8 more -> frame 1
    assert s.push(mel[9:16]).shape == (0, ENC.d_model)  # 7 -> nothing yet
    before = {k: np.array(v) for k, v in s.state.arrays().items()}
    counters = (s.state.mel_consumed, s.state.frames_emitted)
    with pytest.raises(ValueError, match="exactly 1"):
        s.push_one(mel[16:26])  # would complete 2 frames
    with pytest.raises(ValueError, match="exactly 1"):
        ConformerStream(enc).push_one(mel[:0])
    assert (s.state.mel_consumed, s.state.frames_emitted) == counters
    for k, v in s.state.arrays().items():
        np.testing.assert_array_equal(np.array(v), before[k])
    assert s.push_one(mel[16:17]).shape == (ENC.d_model,)
    s2 = ConformerStream(enc)
    s2.push(mel[:1])
    with pytest.raises(ValueError, match="exactly 1"):
        s2.push_one(mel[1:8])  # 7 mel frames -> 0 encoder frames
    with pytest.raises(ValueError, match=r"\(T, 32\)"):
        s2.push(mx.zeros((8, 31)))


def test_caches_bounded():
    enc = _encoder()
    s = ConformerStream(enc)
    mel = _mel(2)
    s.push(mel[:1])
    snapshots = []
    for k in range(300):
        s.push(mel[1:9] * (1.0 + 0.001 * k))
        snapshots.append({n: tuple(a.shape) for n, a in s.state.arrays().items()})
    # the K/V window fills during the first LEFT frames, then nothing grows
    assert all(snap == snapshots[-1] for snap in snapshots[LEFT:])
    last = snapshots[-1]
    assert last["mel_cache"] == (9, ENC.feat_in)
    for i in range(ENC.n_layers):
        assert last[f"layers.{i}.k_cache"] == (LEFT, ENC.d_model)
        assert last[f"layers.{i}.v_cache"] == (LEFT, ENC.d_model)
        assert last[f"layers.{i}.conv_cache"] == (ENC.conv_kernel_size - 1, ENC.d_model)
    # 7 pending mel frames on top of the 9 kept: the 16-frame maximum
    s.push(mel[1:8])
    assert s.state.mel_cache.shape[0] == 16


def test_xscaling_stream_matches_offline():
    cfg = dataclasses.replace(copy.deepcopy(ENC), xscaling=True)
    enc = _encoder(cfg)
    plain = _encoder()  # same seed -> same weights, xscaling off
    mel = _mel(40, seed=4)
    offline = enc(mel)
    assert mx.abs(offline - plain(mel)).max().item() > 1e-2  # the scale is applied
    streamed = _stream_session_style(enc, mel)
    assert mx.abs(streamed - offline).max().item() <= STREAM_TOL


def test_state_copy_reset():
    enc = _encoder()
    mel = _mel(30)
    s = ConformerStream(enc)
    s.push(mel[:41])
    saved = s.state.copy()
    a = s.push(mel[41:])
    s.state = saved
    b = s.push(mel[41:])
    assert mx.array_equal(a, b)
    s.reset()
    assert s.state.mel_consumed == 0 and s.state.frames_emitted == 0
    assert s.state.k_cache[0].shape == (0, ENC.d_model)


def test_end_to_end_streaming_audio_and_fallback():
    mx.random.seed(0)
    p = Perception(AUDIO)
    pre = AUDIO.preprocessor
    rng = np.random.default_rng(9)
    k_frames = 14
    audio = (0.1 * rng.standard_normal(1280 * k_frames)).astype(np.float32)
    offline = p.encoder(log_mel(audio, pre))  # K + 1 frames
    mel_stream = StreamingLogMel(pre, lookahead_samples=1280)
    conf = ConformerStream(p.encoder)
    fallback = PerceptionFallback(p.encoder, pre)
    assert fallback.window_frames == max(2, LEFT + 1)
    for k in range(k_frames):
        chunk = audio[1280 * k : 1280 * (k + 1)]
        cached = conf.push_one(mel_stream.push(chunk))
        approx = fallback.push_frame(chunk)
        assert cached.shape == approx.shape == (ENC.d_model,)
        assert mx.abs(cached - offline[k]).max().item() <= STREAM_TOL
        if k < fallback.window_frames:
            # the window still holds the whole past: same inputs as the cached path
            assert mx.abs(approx - cached).max().item() <= STREAM_TOL
        assert bool(mx.all(mx.isfinite(approx)).item())
        assert fallback.audio.size <= fallback.window_frames * 1280
    emb = p.project(cached)
    assert emb.shape == (AUDIO.output_dim,)
    with pytest.raises(ValueError, match="1280"):
        fallback.push_frame(audio[:1000])


def test_uncached_projection_mode_matches_offline_and_flush():
    # The reference's cost model (cache LayerNorm outputs, re-project K/V and positions every
    # frame) gives the same frames; flush() emits the offline encoder's extra right-edge frame.
    enc = _encoder()
    mel = _mel(N_FRAMES)[:-3]  # not 8k + 1 mel frames: offline has one frame beyond the last complete one
    offline = enc(mel)
    for cache_projections in (True, False):
        s = ConformerStream(enc, cache_projections=cache_projections)
        outs = [s.push(mel[i : i + 5]) for i in range(0, mel.shape[0], 5)]
        assert s.state.frames_emitted == offline.shape[0] - 1
        outs.append(s.flush())
        streamed = mx.concatenate(outs)
        assert streamed.shape == offline.shape
        assert mx.abs(streamed - offline).max().item() <= STREAM_TOL
        held = s.state.arrays()["layers.0.k_cache"].shape[0]
        assert held == ENC.att_context_size[0][0]


def _active_after(fn) -> int:
    """MLX active bytes after fn() and a cache release (what the process keeps)."""
    fn()
    mx.clear_cache()
    return mx.get_active_memory()


@pytest.mark.parametrize("transposed", ["bf16", "float32"])
@pytest.mark.parametrize("bias", [True, False])
def test_transposed_pointwise_weights_replace_the_16_bit_ones(bias, transposed):
    """`transpose_pointwise_convs(conv_module, policy)` then `pointwise_weights()` (what the
    runtime's `prepare` does at load) keeps one copy of each 1x1 conv weight, as W.T: bf16 (the
    CPU policy with the kernels on) or float32 (a policy asking for float32 copies,
    `VOICECHAT_FLOAT32_COPIES=1`). MLX's active memory grows by the W.T minus the bf16 bytes
    (0 for bf16, the bf16 bytes for float32; a copy kept beside the original would grow it by
    all of W.T's bytes), plus the biases' widening; `resident_bytes` counts the weight once, the
    parameter holds the stored values in the stored shape, and the module's output is the one
    it gave before, bit for bit (the products read the same values)."""
    from voicechat.model.audio.conformer import ConvModule
    from voicechat.runtime import kernels
    from voicechat.runtime.linear import resident_bytes
    from voicechat.runtime.prepare import transpose_pointwise_convs

    from .runtime_util import default_policy, running

    policy = default_policy(float32_copies=transposed == "float32")
    if transposed == "bf16" and not policy.bf16_transposed:
        # bf16 W.T is the default only where the extension's product reads it (a CPU device)
        if os.environ.get("VOICECHAT_REQUIRE_CPU_QMV") == "1":
            pytest.fail(f"cpu_qmv cannot be used here: {kernels.unavailable_reason()}")
        pytest.skip(
            f"bf16 W.T is not the default here (device {mx.default_device()}, "
            f"cpu_qmv: {kernels.unavailable_reason() or 'on'})"
        )
    d, kernel = 256, 9
    mx.random.seed(4)
    conv = ConvModule(d, kernel, bias)
    conv.update(nn_tree_map(lambda a: a.astype(mx.bfloat16), conv.parameters()))
    mx.eval(conv.parameters())
    stored = {k: np.array(v.astype(mx.float32)) for k, v in tree_flatten(conv.parameters())}
    x = mx.random.normal((5, d))
    with running(policy):
        want = conv(x)
    mx.eval(want)
    conv.__dict__.pop("_derived", None)  # start from the stored weights alone
    for c in (conv.pointwise_conv1, conv.pointwise_conv2):
        c.__dict__.pop("_derived", None)
    before = _active_after(lambda: None)
    after = _active_after(lambda: (transpose_pointwise_convs(conv, policy), conv.pointwise_weights()))
    bf16_bytes = 2 * (2 * d * d + d * d)
    # float32: 2 bytes more per weight element (bf16 -> float32); bf16: none; plus the biases'
    # 2 bytes each; slack: one 16 KB page per array for the allocator's rounding.
    grown = (bf16_bytes if transposed == "float32" else 0) + (2 * (2 * d + d) if bias else 0)
    assert abs((after - before) - grown) <= 4 * 16384, (after - before, grown)
    dtype = mx.float32 if transposed == "float32" else mx.bfloat16
    for c in (conv.pointwise_conv1, conv.pointwise_conv2):
        assert c.weight.dtype == dtype and c.weight.shape[1] == 1
        assert c.__dict__["_weight_t"].dtype == dtype
    params = dict(tree_flatten(conv.parameters()))
    for k, v in stored.items():
        assert np.array_equal(np.array(params[k].astype(mx.float32)), v), k
    taps = sum(t.nbytes for t in conv.taps()[0])
    float_params = sum(a.nbytes for a in params.values())
    assert resident_bytes(conv) == float_params + taps
    with running(policy):
        got = conv(x)
    assert np.array_equal(np.array(got), np.array(want))
