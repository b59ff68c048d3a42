"""voicechat.cpu_qmv: the CPU quantized matrix-vector kernel must give `mx.quantized_matmul`'s
float32 bits exactly (every output element, every instruction-set path, every bits / group size /
scale dtype / shape / stride the language path can meet), and its float32 product `mx.matmul`'s
(every column block, row count and view the conformer / TTS / codebook products meet), route
only the calls they serve, and say so when they cannot be used.

Exact equality is the claim, not a tolerance: the kernels perform MLX's scalar operations
(int -> float, scale * q + bias, x * t, sum + ...; the reference sgemm's c + x * w) in MLX's
order for each output, and each is one IEEE-754 single-precision rounding in a vector lane as
in a scalar register."""

from __future__ import annotations

import os
import warnings

import mlx.core as mx
import numpy as np
import pytest

from voicechat import cpu_qmv
from voicechat.cpu_qmv import BITS, GROUP_SIZES, ISA_NAMES, cpu_qmv_set, platform_served, quantized_matmul

REQUIRE_ENV = "VOICECHAT_REQUIRE_CPU_QMV"


def _module():
    if not platform_served():
        pytest.skip("cpu_qmv serves Linux x86-64 only")
    module = cpu_qmv.extension()
    if module is None:
        if os.environ.get(REQUIRE_ENV) == "1":
            pytest.fail(f"cpu_qmv cannot be used here ({REQUIRE_ENV}=1): {cpu_qmv.unavailable_reason()}")
        pytest.skip(f"cpu_qmv not built here: {cpu_qmv.unavailable_reason()}")
    return module


@pytest.fixture
def module():
    m = _module()
    top = m.isa()
    yield m
    m.set_isa(top)


def _bits(a: mx.array) -> np.ndarray:
    return np.array(a.astype(mx.float32)).view(np.uint32)


def _quantized(rng, n, k, group, bits, dtype):
    w, scales, biases = mx.quantize(mx.array(rng.standard_normal((n, k)).astype(np.float32)),
                                    group_size=group, bits=bits)
    return w, scales.astype(dtype), biases.astype(dtype)


def _reference(x, w, scales, biases, group, bits):
    return mx.quantized_matmul(x, w, scales=scales, biases=biases, transpose=True, group_size=group, bits=bits)


def test_extension_is_used_where_it_should_be():
    """On Linux x86-64 the kernel builds, passes its load-time check and is on by default; where
    CI requires it (VOICECHAT_REQUIRE_CPU_QMV=1) a broken build fails here instead of going slow."""
    m = _module()
    assert cpu_qmv.unavailable_reason() is None
    assert m.MLX_VERSION == mx.__version__
    assert cpu_qmv.default_cpu_qmv() and cpu_qmv.cpu_qmv_enabled()


@pytest.mark.parametrize("isa", [0, 1, 2], ids=ISA_NAMES)
@pytest.mark.parametrize("bits", BITS)
@pytest.mark.parametrize("group", GROUP_SIZES)
def test_bit_for_bit_mx_quantized_matmul(module, isa, bits, group):
    """Row counts that exercise each kernel: whole 64-row (AVX-512) / 32-row (AVX2) blocks, 16 / 8-row
    blocks, single leftover rows; 1, 3 and (2, 2) input rows; float32, bfloat16 and float16 scales;
    inputs up to ~1e4 so that the sums carry rounding."""
    if isa > module.cpu_isa():
        pytest.skip(f"this CPU has no {ISA_NAMES[isa]}")
    module.set_isa(isa)
    rng = np.random.default_rng(1000 * bits + group + isa)
    k = 3 * max(group, 64)
    for dtype in (mx.float32, mx.bfloat16, mx.float16):
        for n in (1, 7, 8, 9, 16, 17, 31, 32, 33, 63, 64, 65, 100, 200):
            w, scales, biases = _quantized(rng, n, k, group, bits, dtype)
            for shape in ((1, k), (3, k), (2, 2, k)):
                x = mx.array((rng.standard_normal(shape) * 10.0 ** rng.integers(-3, 5)).astype(np.float32))
                ours = module.quantized_matvec(x, w, scales, biases, group, bits)
                assert ours.shape == shape[:-1] + (n,) and ours.dtype == mx.float32
                ref = _reference(x, w, scales, biases, group, bits)
                assert np.array_equal(_bits(ours), _bits(ref)), (dtype, n, shape)


@pytest.mark.parametrize("isa", [1, 2], ids=ISA_NAMES[1:])
def test_strided_and_offset_arrays(module, isa):
    """Views as the language path makes them (row halves at an offset) and stranger ones (every
    other row, a transposed input) give MLX's bits too."""
    if isa > module.cpu_isa():
        pytest.skip(f"this CPU has no {ISA_NAMES[isa]}")
    module.set_isa(isa)
    rng = np.random.default_rng(5)
    w, scales, biases = _quantized(rng, 150, 256, 64, 4, mx.float32)
    x = mx.array(rng.standard_normal((4, 256)).astype(np.float32))
    cases = [
        (x, w[37:], scales[37:], biases[37:]),          # the second half of a split layer
        (x, w[:37], scales[:37], biases[:37]),
        (x, w[::2], scales[::2], biases[::2]),          # not row-contiguous
        (x[::2], w, scales, biases),
        (mx.array(rng.standard_normal((256, 3)).astype(np.float32)).T, w, scales, biases),
    ]
    for xs, ws, ss, bs in cases:
        ours = module.quantized_matvec(xs, ws, ss, bs, 64, 4)
        assert np.array_equal(_bits(ours), _bits(_reference(xs, ws, ss, bs, 64, 4)))


def test_non_finite_values_propagate_as_mlx_does(module):
    """inf / NaN inputs and scales: the same bits, NaN payloads included."""
    rng = np.random.default_rng(6)
    w, scales, biases = _quantized(rng, 80, 128, 64, 8, mx.float32)
    xn = rng.standard_normal((2, 128)).astype(np.float32)
    xn[0, 5], xn[1, 70] = np.inf, np.nan
    sn = np.array(scales)
    sn[3, 1], sn[50, 0] = -np.inf, np.nan
    x, s = mx.array(xn), mx.array(sn)
    assert np.array_equal(_bits(module.quantized_matvec(x, w, s, biases, 64, 8)),
                          _bits(_reference(x, w, s, biases, 64, 8)))


@pytest.mark.parametrize("isa", [0, 1, 2], ids=ISA_NAMES)
def test_float32_matmul_is_mx_matmul_bit_for_bit(module, isa):
    """Column counts through every block (64 / 16 columns on AVX-512, 32 / 8 on AVX2, single
    columns), row counts through the 4 / 2 / 1-row blocks, batch axes, K from 1 up, inputs up
    to ~1e4 so that the sums carry rounding."""
    if isa > module.cpu_isa():
        pytest.skip(f"this CPU has no {ISA_NAMES[isa]}")
    module.set_isa(isa)
    rng = np.random.default_rng(200 + isa)
    for k in (1, 7, 72, 257):
        for n in (1, 7, 8, 9, 16, 17, 33, 64, 65, 72, 100, 288):
            wt = mx.array(rng.standard_normal((k, n)).astype(np.float32))
            for shape in ((k,), (1, k), (2, k), (3, k), (7, k), (2, 1, k)):
                x = mx.array((rng.standard_normal(shape) * 10.0 ** rng.integers(-3, 5)).astype(np.float32))
                ours = module.float32_matmul(x, wt)
                assert ours.shape == shape[:-1] + (n,) and ours.dtype == mx.float32
                assert np.array_equal(_bits(ours), _bits(mx.matmul(x, wt))), (k, n, shape)


def test_float32_matmul_views_and_non_finite_values(module):
    """A codebook slice of a (Q, K, N) array (row-contiguous at an offset), a transposed and a
    strided input, a transposed weight; inf / NaN in inputs and weights: MLX's bits."""
    rng = np.random.default_rng(11)
    books = mx.array(rng.standard_normal((5, 32, 100)).astype(np.float32))
    x = mx.array(rng.standard_normal((4, 32)).astype(np.float32))
    cases = [
        (x[:1], books[3]),
        (mx.array(rng.standard_normal((32, 3)).astype(np.float32)).T, books[1]),
        (x[::2], books[0]),
        (x, mx.array(rng.standard_normal((100, 32)).astype(np.float32)).T),
    ]
    xn = rng.standard_normal((3, 32)).astype(np.float32)
    xn[0, 4], xn[1, 9], xn[2, 0] = np.inf, np.nan, 0.0
    wn = rng.standard_normal((32, 40)).astype(np.float32)
    wn[0, 3], wn[10, 20] = np.inf, -np.inf  # 0 * inf: NaN, as MLX (no zero skipping)
    cases.append((mx.array(xn), mx.array(wn)))
    for xs, wt in cases:
        assert np.array_equal(_bits(module.float32_matmul(xs, wt)), _bits(mx.matmul(xs, wt)))


def test_float32_matmul_router(module, monkeypatch):
    """`cpu_qmv.float32_matmul` takes the kernel for float32 products with a 2-D weight on a CPU
    stream while the switch is on, MLX's matmul otherwise; the same values either way."""
    rng = np.random.default_rng(12)
    calls = []
    real = module.float32_matmul
    monkeypatch.setattr(module, "float32_matmul", lambda *a, **k: calls.append(1) or real(*a, **k))
    x = mx.array(rng.standard_normal((2, 24)).astype(np.float32))
    wt = mx.array(rng.standard_normal((24, 40)).astype(np.float32))
    with cpu_qmv_set(True):
        assert np.array_equal(_bits(cpu_qmv.float32_matmul(x, wt)), _bits(mx.matmul(x, wt)))
        assert calls == [1]
        cpu_qmv.float32_matmul(x.astype(mx.bfloat16), wt.astype(mx.bfloat16))  # not float32
        cpu_qmv.float32_matmul(x, mx.stack([wt, wt]))  # a batched weight
        assert calls == [1]
    with cpu_qmv_set(False):
        cpu_qmv.float32_matmul(x, wt)
        assert calls == [1]


def test_float32_matmul_bad_arguments(module):
    x = mx.ones((2, 8))
    with pytest.raises(ValueError, match="float32 x and wt"):
        module.float32_matmul(x.astype(mx.float16), mx.ones((8, 4)))
    with pytest.raises(ValueError, match="wt must be 2-D"):
        module.float32_matmul(x, mx.ones((1, 8, 4)))
    with pytest.raises(ValueError, match=r"last axis must be wt.shape\[0\] = 6"):
        module.float32_matmul(x, mx.ones((6, 4)))


def test_bad_arguments_say_what_is_expected(module):
    rng = np.random.default_rng(7)
    w, scales, biases = _quantized(rng, 16, 128, 64, 4, mx.float32)
    x = mx.array(rng.standard_normal((1, 128)).astype(np.float32))
    with pytest.raises(ValueError, match="bits must be 4 or 8"):
        module.quantized_matvec(x, w, scales, biases, 64, 3)
    with pytest.raises(ValueError, match="group_size must be 32, 64 or 128"):
        module.quantized_matvec(x, w, scales, biases, 16, 4)
    with pytest.raises(ValueError, match="x must be float32"):
        module.quantized_matvec(x.astype(mx.bfloat16), w, scales, biases, 64, 4)
    with pytest.raises(ValueError, match="last axis must be"):
        module.quantized_matvec(x[:, :64], w, scales, biases, 64, 4)
    with pytest.raises(ValueError, match=r"scales and biases must be \(N, K / group_size\)"):
        module.quantized_matvec(x, w, scales[:8], biases, 64, 4)
    with pytest.raises(ValueError, match="at most cpu_isa"):
        module.set_isa(module.cpu_isa() + 1)


def test_router_takes_the_kernel_only_for_the_calls_it_serves(module, monkeypatch):
    rng = np.random.default_rng(8)
    calls = []
    real = module.quantized_matvec
    monkeypatch.setattr(module, "quantized_matvec", lambda *a, **k: calls.append(a[4:6]) or real(*a, **k))
    w, scales, biases = _quantized(rng, 40, 128, 64, 4, mx.float32)
    x = mx.array(rng.standard_normal((1, 128)).astype(np.float32))
    ref = _reference(x, w, scales, biases, 64, 4)
    with cpu_qmv_set(True):
        assert np.array_equal(_bits(quantized_matmul(x, w, scales, biases, group_size=64, bits=4)), _bits(ref))
        assert calls == [(64, 4)]
        # Not served: bfloat16 activations, no biases (other modes), 3-bit, a GPU stream absent here.
        quantized_matmul(x.astype(mx.bfloat16), w, scales, biases, group_size=64, bits=4)
        w3, s3, b3 = mx.quantize(mx.array(rng.standard_normal((40, 128)).astype(np.float32)), group_size=64, bits=3)
        quantized_matmul(x, w3, s3, b3, group_size=64, bits=3)
        assert calls == [(64, 4)]
    with cpu_qmv_set(False):
        assert np.array_equal(_bits(quantized_matmul(x, w, scales, biases, group_size=64, bits=4)), _bits(ref))
        assert calls == [(64, 4)]


def test_streams_are_identical_with_and_without_the_kernel(module, tiny_model_4bit, question_wav, monkeypatch):
    """A 4-bit tiny model streamed with the kernels and with MLX's: the same text, function ids,
    codes and audio samples, bit for bit, and both kernels (quantized, float32) did run."""
    calls, f32_calls = [], []
    real, real_f32 = module.quantized_matvec, module.float32_matmul
    monkeypatch.setattr(module, "quantized_matvec", lambda *a, **k: calls.append(1) or real(*a, **k))
    monkeypatch.setattr(module, "float32_matmul", lambda *a, **k: f32_calls.append(1) or real_f32(*a, **k))
    wave = question_wav[: 1280 * 12]
    runs = {}
    for on in (True, False):
        with cpu_qmv_set(on):
            session = tiny_model_4bit.create_streaming_session(seed=0)
            events = []
            for start in range(0, wave.size, 1280):
                events += session.push_audio(wave[start:start + 1280])
            audio = [e.samples for e in events if e.kind == "audio"]
            runs[on] = (list(session.text_ids), list(session.function_ids),
                        np.stack(session.raw_audio_codes), np.concatenate(audio).view(np.uint32))
        if on:
            assert len(calls) > 0 and len(f32_calls) > 0
            n_on, n_f32 = len(calls), len(f32_calls)
    assert len(calls) == n_on and len(f32_calls) == n_f32  # none with the kernels off
    assert runs[True][0] == runs[False][0] and runs[True][1] == runs[False][1]
    assert np.array_equal(runs[True][2], runs[False][2]) and np.array_equal(runs[True][3], runs[False][3])


def test_the_kept_decision_follows_what_it_depends_on(module, monkeypatch):
    """`cpu_qmv_enabled()` is kept between calls; a change of the environment, of the forced
    value or of the loaded module is seen at the next call."""
    monkeypatch.setenv(cpu_qmv.ENV_VAR, "0")
    assert cpu_qmv.cpu_qmv_enabled() is False and cpu_qmv.cpu_qmv_enabled() is False
    monkeypatch.setenv(cpu_qmv.ENV_VAR, "1")
    assert cpu_qmv.cpu_qmv_enabled() is True
    with cpu_qmv_set(False):
        assert cpu_qmv.cpu_qmv_enabled() is False
    assert cpu_qmv.cpu_qmv_enabled() is True
    monkeypatch.delenv(cpu_qmv.ENV_VAR)
    assert cpu_qmv.cpu_qmv_enabled() is True  # the default on a Linux x86-64 CPU device
    monkeypatch.setattr(cpu_qmv, "_state", {"module": None, "reason": "substituted"})
    with cpu_qmv_set(True), pytest.raises(RuntimeError, match="substituted"):
        cpu_qmv.cpu_qmv_enabled()


def test_a_layer_rechecks_its_weights_when_they_are_replaced(module, monkeypatch):
    """`FastQuantizedLinear` checks once per weight arrays whether the kernel serves them: a
    4-bit layer given 3-bit weights (not served) goes to MLX's kernel, with MLX's result."""
    from voicechat.parallel import FastQuantizedLinear

    rng = np.random.default_rng(9)
    calls = []
    real = module.quantized_matvec
    monkeypatch.setattr(module, "quantized_matvec", lambda *a, **k: calls.append(a[5]) or real(*a, **k))
    layer = FastQuantizedLinear(128, 40, bias=False, group_size=64, bits=4)
    layer.weight, layer.scales, layer.biases = _quantized(rng, 40, 128, 64, 4, mx.float32)
    x = mx.array(rng.standard_normal((1, 128)).astype(np.float32))
    with cpu_qmv_set(True):
        assert np.array_equal(_bits(layer(x)), _bits(_reference(x, layer.weight, layer.scales, layer.biases, 64, 4)))
        assert calls == [4]
        layer.bits = 3
        layer.weight, layer.scales, layer.biases = mx.quantize(
            mx.array(rng.standard_normal((40, 128)).astype(np.float32)), group_size=64, bits=3)
        assert np.array_equal(_bits(layer(x)), _bits(_reference(x, layer.weight, layer.scales, layer.biases, 64, 3)))
        assert calls == [4]


def test_unavailable_kernel_warns_by_default_and_raises_when_forced(monkeypatch):
    monkeypatch.setattr(cpu_qmv, "_state", {"module": None, "reason": "no compiler here"})
    monkeypatch.delenv(cpu_qmv.ENV_VAR, raising=False)
    monkeypatch.setattr(cpu_qmv, "default_cpu_qmv", lambda: True)
    with pytest.warns(RuntimeWarning, match="not used \\(no compiler here\\).*same results"):
        assert cpu_qmv.cpu_qmv_enabled() is False
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once per process
        assert cpu_qmv.cpu_qmv_enabled() is False
        x = mx.ones((1, 64))
        w, s, b = mx.quantize(mx.ones((8, 64)), group_size=64, bits=4)
        assert quantized_matmul(x, w, s, b, group_size=64, bits=4).shape == (1, 8)  # MLX's kernel
    with cpu_qmv_set(True), pytest.raises(RuntimeError, match="cannot be used: no compiler here"):
        cpu_qmv.cpu_qmv_enabled()
    monkeypatch.setenv(cpu_qmv.ENV_VAR, "1")
    with pytest.raises(RuntimeError, match="VOICECHAT_CPU_QMV=1"):
        cpu_qmv.cpu_qmv_enabled()
    monkeypatch.setenv(cpu_qmv.ENV_VAR, "yes")
    with pytest.raises(ValueError, match="VOICECHAT_CPU_QMV must be 0 or 1"):
        cpu_qmv.cpu_qmv_enabled()


@pytest.mark.skipif(not platform_served(), reason="cpu_qmv serves Linux x86-64 only")
def test_a_failed_build_names_its_cause(monkeypatch, tmp_path):
    monkeypatch.setattr(cpu_qmv, "_state", {})
    monkeypatch.setenv("VOICECHAT_CACHE", str(tmp_path))
    monkeypatch.setattr(cpu_qmv, "_cmake", lambda: None)
    assert cpu_qmv.extension() is None
    assert "no `cmake` found" in cpu_qmv.unavailable_reason()
    assert not any(p.suffix == ".so" for p in tmp_path.rglob("*"))  # nothing half-built left behind
