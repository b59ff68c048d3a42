"""The codec's float32 products through numpy's BLAS (voicechat.runtime.host_products) and its rational erf.

The numpy path reorders each product's float32 summation, so it is compared with the
MLX path within rounding bounds, never bit for bit; the streaming-vs-offline codec
agreement is checked with the numpy path on and off.
"""

from __future__ import annotations

import math

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest

from voicechat.model.audio.codec import Codec, erf_rational
from voicechat.runtime import ExecutionPolicy, host_products as host_gemm
from voicechat.synthetic.presets import preset_config

from .runtime_util import bound_policy, default_policy, running

# api.md: streamed and offline audio of the same codes agree within 1e-5 (float32 rounding of
# samples with RMS ~0.1); two summation orders of the same products are held to the same bound.
AUDIO_TOL = 1e-5
EPS32 = float(np.finfo(np.float32).eps)


@pytest.fixture(scope="module")
def small_codec() -> Codec:
    mx.random.seed(0)
    codec = Codec(preset_config("small").codec_config)
    mx.eval(codec.parameters())
    return codec


def _codes(codec: Codec, frames: int, seed: int) -> np.ndarray:
    cfg = codec.config
    return np.random.default_rng(seed).integers(0, cfg.codebook_size, (frames, cfg.num_quantizers)).astype(np.int32)


def _bf16_codec(seed: int) -> Codec:
    """A `small` codec with bf16 weights, as the published checkpoints store them."""
    mx.random.seed(seed)
    codec = Codec(preset_config("small").codec_config)
    codec.update(nn.utils.tree_map(lambda a: a.astype(mx.bfloat16) if a.dtype == mx.float32 else a, codec.parameters()))
    mx.eval(codec.parameters())
    return codec


def test_policy_field_env_var_and_binding(monkeypatch):
    """`host_products` is on by default exactly for a CPU device; `VOICECHAT_HOST_GEMM` overrides it
    when the policy is chosen (a bad value names the variable), a policy's field takes only a
    bool, and the runtime bound on this thread hands its policy's field to the products (off with none)."""
    with pytest.raises(ValueError, match=r"VOICECHAT_HOST_GEMM must be 0 or 1.*got 'on'"):
        ExecutionPolicy.for_device(environ={"VOICECHAT_HOST_GEMM": "on"})
    assert ExecutionPolicy.for_device(environ={"VOICECHAT_HOST_GEMM": "0"}).host_products is False
    assert ExecutionPolicy.for_device(mx.gpu, environ={"VOICECHAT_HOST_GEMM": "1"}).host_products is True
    # Default: on exactly when MLX computes on the CPU.
    assert ExecutionPolicy.for_device(mx.cpu, environ={}).host_products is True
    assert ExecutionPolicy.for_device(mx.gpu, environ={}).host_products is False
    assert default_policy().host_products is (mx.default_device().type == mx.DeviceType.cpu)
    with pytest.raises(TypeError, match=r"ExecutionPolicy\.host_products must be True or False, got 1"):
        default_policy(host_products=1)
    monkeypatch.setenv("VOICECHAT_HOST_GEMM", "0")  # read when a policy is chosen, not while it runs
    with running(host_products=True):
        assert bound_policy().host_products is True
        with running(host_products=False):
            assert bound_policy().host_products is False
        assert bound_policy().host_products is True
    assert bound_policy().host_products is False


def test_erf_rational_within_8_ulp():
    """Against the exact erf (float64 math.erf): within 8 float32 ulp of the exact value anywhere
    (the rational fit's own error plus the float32 rounding of its ~14 Horner steps and one
    division; 7.03 ulp is the largest seen on this grid, mx.erf is no closer in absolute
    terms), odd, and exactly +-1 far out."""
    xs = np.concatenate(
        [np.linspace(-6.0, 6.0, 120001), np.geomspace(1e-30, 1e-2, 2000), -np.geomspace(1e-30, 1e-2, 2000)]
    ).astype(np.float32)
    exact = np.array([math.erf(float(v)) for v in xs])
    got = np.array(erf_rational(mx.array(xs))).astype(np.float64)
    ulp = np.spacing(np.abs(exact).astype(np.float32)).astype(np.float64)
    assert (np.abs(got - exact) / ulp).max() <= 8.0
    assert np.array_equal(np.array(erf_rational(mx.array(-xs))), -np.array(erf_rational(mx.array(xs))))
    assert np.array(erf_rational(mx.array([-50.0, 50.0]))).tolist() == [-1.0, 1.0]


def test_matmul_t_numpy_equals_mlx_within_rounding(small_codec):
    """x @ w.T both ways, shapes of the small codec (K up to 768): each element within the
    float32 GEMM bound gamma_K * sum_k |x_ik| |w_jk| (gamma_K = K eps / (1 - K eps)) of the
    float64 product, on both paths."""
    owner = nn.Module()
    rng = np.random.default_rng(3)
    for rows, k, out in [(441, 48, 192), (441, 192, 48), (9, 768, 192), (1, 64, 1728)]:
        x = rng.standard_normal((rows, k)).astype(np.float32)
        w = mx.array(rng.standard_normal((out, k)).astype(np.float32))
        exact = x.astype(np.float64) @ np.array(w).astype(np.float64).T
        bound = (k * EPS32 / (1 - k * EPS32)) * (np.abs(x).astype(np.float64) @ np.abs(np.array(w)).T)
        for enabled in (True, False):
            with running(host_products=enabled):
                got = host_gemm.matmul_t(mx.array(x), w, owner, "w", enabled=bound_policy().host_products)
            assert got.dtype == mx.float32 and got.shape == (rows, out)
            assert (np.abs(np.array(got) - exact) <= bound).all(), (rows, k, out, enabled)


def _mlx_float32_transposed(a: mx.array) -> np.ndarray:
    return np.ascontiguousarray(np.array(a.astype(mx.float32)).T)


@pytest.mark.parametrize("dtype", [mx.bfloat16, mx.float16, mx.float32])
def test_float32_transposed_is_mlx_conversion_bit_for_bit(dtype):
    """The host copy of w.T holds MLX's own float32 conversion of every value: for bf16 all
    65,536 bit patterns (zeros, subnormals, infinities, NaNs of both signs), on contiguous,
    transposed, reshaped and strided views of the weight."""
    if dtype == mx.bfloat16:
        every = mx.array(np.arange(1 << 16, dtype=np.uint16)).view(mx.bfloat16).reshape(256, 256)
    else:
        every = mx.array(np.random.default_rng(0).standard_normal((256, 256)).astype(np.float32)).astype(dtype)
    views = [every, every.T, every.reshape(128, 512), every[:, ::3], every[7:100, 3:60].T]
    for w in views:
        got, want = host_gemm.float32_transposed(w), _mlx_float32_transposed(w)
        assert got.dtype == np.float32 and got.flags.c_contiguous and got.shape == tuple(w.shape[::-1])
        np.testing.assert_array_equal(got.view(np.uint32), want.view(np.uint32))


def test_matmul_t_sees_a_replaced_weight():
    """The numpy copy of w.T is made per weight array: a new array under the same name is used."""
    owner = nn.Module()
    x = mx.ones((2, 3))
    with running(host_products=True):
        first = np.array(host_gemm.matmul_t(x, mx.ones((4, 3)), owner, "w", enabled=bound_policy().host_products))
        second = np.array(host_gemm.matmul_t(x, 2 * mx.ones((4, 3)), owner, "w", enabled=bound_policy().host_products))
    assert np.array_equal(first, np.full((2, 4), 3.0)) and np.array_equal(second, np.full((2, 4), 6.0))


def test_codec_decode_numpy_vs_mlx_products(small_codec):
    """Offline decode of the small codec (9 ConvNeXt blocks, K up to 768) with the products in
    numpy vs in MLX: within the streaming-vs-offline audio bound."""
    codes = _codes(small_codec, 4, seed=1)
    with running(host_products=True):
        a = np.array(small_codec.decode(codes))
    with running(host_products=False):
        b = np.array(small_codec.decode(codes))
    assert a.shape == b.shape == (4 * small_codec.samples_per_frame,)
    assert np.abs(a).max() > 1e-3  # not a silent decode
    assert np.abs(a - b).max() <= AUDIO_TOL


@pytest.mark.parametrize("enabled", [True, False])
def test_codec_streaming_matches_offline_either_way(small_codec, enabled):
    """decode_step x T + flush == decode (after lead-in and warm-up samples), within the audio
    bound, with the products in numpy and in MLX."""
    codes = _codes(small_codec, 5, seed=2)
    with running(host_products=enabled):
        offline = np.array(small_codec.decode(codes))
        state = small_codec.make_state()
        parts = [np.array(small_codec.decode_step(codes[t], state)) for t in range(codes.shape[0])]
        parts.append(np.array(small_codec.flush(state)))
    streamed = np.concatenate(parts)[small_codec.lead_in :]
    assert streamed.shape == offline.shape
    w = small_codec.warmup_samples
    assert np.abs(streamed[w:] - offline[w:]).max() <= AUDIO_TOL


def test_one_blas_thread_limits_and_restores():
    """Inside the block numpy's BLAS runs on one thread (its spinning workers would take the cores
    of MLX's streams); the user's setting is back after, and nothing changes with the path off."""
    from threadpoolctl import threadpool_info

    def blas_threads():
        return [lib["num_threads"] for lib in threadpool_info() if lib["user_api"] == "blas"]

    before = blas_threads()
    assert before, "numpy's BLAS should be visible to threadpoolctl"
    with running(host_products=True), host_gemm.one_blas_thread(bound_policy().host_products):
        assert blas_threads() == [1] * len(before)
    assert blas_threads() == before
    with running(host_products=False), host_gemm.one_blas_thread(bound_policy().host_products):
        assert blas_threads() == before


def test_conversations_products_on_threads_are_each_ones_own(monkeypatch):
    """Under `conversation_rows(n, workers)` x is n conversations' rows: each group's product is that
    group's alone, bit for bit (numpy's BLAS rounds a row differently in a taller product), whether
    the groups run one after the other or on the workers' threads; with workers > 1 they do run on
    the pool (a tick's conversations' codec products at once). Bad counts are refused."""
    import threading

    rng = np.random.default_rng(5)
    # One row per conversation (the codec's latent projection): numpy's BLAS takes a single row
    # through another kernel than a taller product, which rounds differently.
    w = mx.array(rng.standard_normal((100, 300)).astype(np.float32))
    owner = nn.Module()
    x = mx.array(rng.standard_normal((4, 300)).astype(np.float32))
    wt = np.ascontiguousarray(np.asarray(w).T)
    with host_gemm.one_blas_thread(True):
        want = np.concatenate([p @ wt for p in np.split(np.asarray(x), 4)])
        tall = np.asarray(x) @ wt
    threads = set()
    real_pool = host_gemm._pool

    class Spy:
        def __init__(self, pool):
            self.pool = pool

        def map(self, fn, parts):
            return self.pool.map(lambda p: threads.add(threading.current_thread().name) or fn(p), parts)

    monkeypatch.setattr(host_gemm, "_pool", lambda workers: Spy(real_pool(workers)))
    monkeypatch.setattr(host_gemm, "PARALLEL_MIN_MACS", 1)  # this small product too
    with host_gemm.one_blas_thread(True):
        for workers in (1, 2, 3):
            with host_gemm.conversation_rows(4, workers=workers):
                got = np.array(host_gemm.matmul_t(x, w, owner, "w", enabled=True))
            assert np.array_equal(got.view(np.uint32), want.view(np.uint32)), workers
            assert bool(threads) == (workers > 1)
            assert all(t.startswith("voicechat-host-products") for t in threads)
            threads.clear()
    assert not np.array_equal(tall.view(np.uint32), want.view(np.uint32)), "groups must not be one tall product"
    for n, workers in ((0, 1), (2, 0)):
        with (
            pytest.raises(ValueError, match="n and workers must be at least 1"),
            host_gemm.conversation_rows(n, workers=workers),
        ):
            pass


def test_numpy_path_keeps_one_float32_copy_of_the_pointwise_weights():
    """With the products in numpy, a ConvNeXt block's 1x1 weights exist as the stored (bf16)
    parameters plus numpy's float32 copies, not also as MLX float32 copies (a third copy);
    with the products in MLX, as MLX float32 copies and no numpy ones."""
    from voicechat.model.audio.codec import ConvNeXtBlock
    from voicechat.runtime.linear import resident_bytes

    codec = _bf16_codec(seed=1)
    codes = _codes(codec, 2, seed=3)
    blocks = [m for _, m in codec.named_modules() if isinstance(m, ConvNeXtBlock)]
    assert blocks

    def float32_copies(block, kind):
        out = []
        for _, value in block.__dict__.get("_derived", {}).values():
            leaves = (
                value
                if isinstance(value, (tuple, list))
                else list(value.values())
                if isinstance(value, dict)
                else [value]
            )
            out += [
                a
                for a in leaves
                if isinstance(a, kind) and a.dtype in (mx.float32, np.float32) and a.size == block.pwconv1.weight.size
            ]
        return out

    with running(host_products=True):
        mx.eval(codec.decode(codes))
    used = [b for b in blocks if "_derived" in b.__dict__]
    assert used
    for b in used:
        assert float32_copies(b, mx.array) == [], "an MLX float32 copy beside numpy's"
        assert len(float32_copies(b, np.ndarray)) == 2  # w1 and w2
    params = sum(a.nbytes for _, a in nn.utils.tree_flatten(codec.parameters()))
    numpy_all = sum(
        v.nbytes
        for _, m in codec.named_modules()
        for _, v in m.__dict__.get("_derived", {}).values()
        if isinstance(v, np.ndarray)
    )
    pointwise_f32 = sum(a.nbytes for b in used for a in float32_copies(b, np.ndarray))
    # What MLX keeps beyond the parameters (float32 norms, biases, taps, the upsamplers'
    # reshaped matrices) is well under another float32 copy of the pointwise weights.
    assert resident_bytes(codec) - params - numpy_all < pointwise_f32 // 2

    mx.random.seed(1)
    fresh = Codec(preset_config("small").codec_config)
    fresh.update(codec.parameters())
    with running(host_products=False):
        mx.eval(fresh.decode(codes))
    fresh_used = [m for _, m in fresh.named_modules() if isinstance(m, ConvNeXtBlock) and "_derived" in m.__dict__]
    assert fresh_used
    for b in fresh_used:  # MLX's products read the weights as stored (prepare decides any copy): none here
        assert float32_copies(b, mx.array) == [] and float32_copies(b, np.ndarray) == []


@pytest.mark.parametrize("numpy_products", [True, False])
def test_load_makes_the_codec_weights_a_decode_needs(tiny_ckpt, numpy_products):
    """`load` makes the decoder's derived weights (numpy's float32 copies with the products in
    numpy, MLX float32 norms / biases / taps either way), so the memory the model keeps is
    taken, and counted by `resident_bytes` and the bench's resident column, at load: decoding
    afterwards adds no resident byte."""
    import voicechat
    from voicechat.runtime.linear import resident_arrays, resident_bytes

    model = voicechat.load(tiny_ckpt, warmup=False, policy=default_policy(host_products=numpy_products))
    assert model.policy.host_products is numpy_products
    codec = model.tts_model.audio_codec
    with model.executing():
        host_copies = [
            v
            for _, m in codec.named_modules()
            for _, v in m.__dict__.get("_derived", {}).values()
            if isinstance(v, np.ndarray)
        ]
        assert bool(host_copies) == numpy_products
        # numpy's W.T are views of the float32 parameters (one copy), so not counted again
        params = [np.asarray(a) for _, a in nn.utils.tree_flatten(codec.parameters()) if a.dtype == mx.float32]
        for v in host_copies:
            assert any(np.shares_memory(v, p) for p in params)
        assert not any(isinstance(a, np.ndarray) for _, a in resident_arrays(codec))
        at_load = resident_bytes(codec)
        state = codec.make_state()
        for codes in _codes(codec, 2, seed=5):
            mx.eval(codec.decode_step(codes, state))
        assert resident_bytes(codec) == at_load


@pytest.mark.parametrize("numpy_products", [True, False])
def test_decoder_weights_become_one_float32_copy(numpy_products):
    """`voicechat.runtime.prepare.float32_codec_weights` (what `load` calls): each product weight of which a
    float32 copy would be kept (all of them with the products in numpy, the ConvNeXt 1x1 convs
    in MLX) is replaced by float32 as its only copy. MLX's active memory grows by the float32
    minus the bf16 bytes of those weights (keeping the originals too would grow it by the
    float32 bytes, 2x that), numpy's W.T share the parameters' memory, `resident_bytes` counts
    each once, the parameters hold the stored values, and a decode gives the samples it gave
    before the replacement, bit for bit (the products read the same float32 values in the same
    layout)."""
    from voicechat.model.audio.codec import ConvNeXtBlock
    from voicechat.runtime.linear import resident_arrays, resident_bytes
    from voicechat.runtime.prepare import float32_codec_weights

    codec = _bf16_codec(seed=2)
    codes = _codes(codec, 2, seed=7)
    decoder = codec.decoder
    policy = default_policy(host_products=numpy_products)
    with running(policy):
        want = np.array(codec.decode(codes))
        stored = {k: np.array(v.astype(mx.float32)) for k, v in nn.utils.tree_flatten(decoder.parameters())}
        for _, m in decoder.named_modules():
            m.__dict__.pop("_derived", None)
        targets = [b.pwconv1 for b in decoder.layers if isinstance(b, ConvNeXtBlock)] + [
            b.pwconv2 for b in decoder.layers if isinstance(b, ConvNeXtBlock)
        ]
        if numpy_products:
            targets += [layer for layer in decoder.layers if not isinstance(layer, ConvNeXtBlock)]
        mx.clear_cache()
        before = mx.get_active_memory()
        float32_codec_weights(decoder, policy)
        mx.clear_cache()
        grown = mx.get_active_memory() - before
        want_grown = sum(2 * t.weight.size for t in targets)  # bf16 -> float32: 2 bytes more each
        # slack: one 16 KB allocator page per replaced weight
        assert abs(grown - want_grown) <= 16384 * len(targets), (grown, want_grown)
        got = np.array(codec.decode(codes))
        assert np.array_equal(got, want)
        for t in targets:
            assert t.weight.dtype == mx.float32
        for k, v in nn.utils.tree_flatten(decoder.parameters()):
            assert np.array_equal(np.array(v.astype(mx.float32)), stored[k]), k
        host = [
            v
            for _, m in decoder.named_modules()
            for _, v in m.__dict__.get("_derived", {}).values()
            if isinstance(v, np.ndarray)
        ]
        assert len(host) == (len(targets) if numpy_products else 0)
        weights = [np.asarray(t.weight) for t in targets]
        for v in host:
            assert any(np.shares_memory(v, w) for w in weights)
        assert not any(isinstance(a, np.ndarray) for _, a in resident_arrays(decoder))
        params = sum(a.nbytes for _, a in nn.utils.tree_flatten(decoder.parameters()))
        extra = resident_bytes(decoder) - params  # the float32 norms, biases and taps only
        assert extra < sum(t.weight.nbytes for t in targets) // 4
