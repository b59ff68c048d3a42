"""voicechat.runtime.kernels: the CPU quantized matrix-vector kernel must give `mx.quantized_matmul`'s
float32 bits exactly (every output element, every instruction-set path, every bits / group size /
scale dtype / shape / stride the language path can meet), its float32 product `mx.matmul`'s
(every column block, row count and view the conformer / TTS / codebook products meet) and its
norms `mx.fast.rms_norm` / `layer_norm`'s, its RVQ pass the per-codebook MLX ops', route only
the calls they serve, and say so when they cannot be used.

Exact equality is the claim, not a tolerance: the kernels perform MLX's scalar operations
(int -> float, scale * q + bias, x * t, sum + ...; the reference sgemm's c + x * w) in MLX's
order for each output, and each is one IEEE-754 single-precision rounding in a vector lane as
in a scalar register."""

from __future__ import annotations

import os
import re
import warnings
from functools import partial

import mlx.core as mx
import numpy as np
import pytest

from voicechat.runtime import ExecutionPolicy, kernels as cpu_qmv
from voicechat.runtime.kernels import BITS, GROUP_SIZES, ISA_NAMES, platform_served, quantized_matmul

from .runtime_util import bound_policy, default_policy, running

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
    w, scales, biases = mx.quantize(
        mx.array(rng.standard_normal((n, k)).astype(np.float32)), group_size=group, bits=bits
    )
    return w, scales.astype(dtype), biases.astype(dtype)


def _reference(x, w, scales, biases, group, bits):
    return mx.quantized_matmul(x, w, scales=scales, biases=biases, transpose=True, group_size=group, bits=bits)


def _recorded(log: list, name: str, fn, *a, **k):
    """fn(*a, **k), noting `name` in `log` first."""
    log.append(name)
    return fn(*a, **k)


def test_extension_is_used_where_it_should_be():
    """On Linux x86-64 the kernel builds, passes its load-time check and is on by default; where
    CI requires it (VOICECHAT_REQUIRE_CPU_QMV=1) a broken build fails here instead of going slow."""
    m = _module()
    assert cpu_qmv.unavailable_reason() is None
    assert mx.__version__ == m.MLX_VERSION
    policy = default_policy()  # this (CPU) device's, as `voicechat.load` chooses it
    assert policy.cpu_kernels and policy.bf16_transposed
    with running(policy):
        assert bound_policy().cpu_kernels
    assert not bound_policy().cpu_kernels  # no runtime bound: the plain ops


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


@pytest.mark.parametrize("isa", [0, 1, 2], ids=ISA_NAMES)
@pytest.mark.parametrize("bits", BITS)
@pytest.mark.parametrize("group", GROUP_SIZES)
def test_several_rows_are_each_row_alone_bit_for_bit(module, isa, bits, group):
    """M rows of x (a batch's sessions, 1 to 9: each count the kernel takes together and 8 + 1)
    give `mx.quantized_matmul`'s bits and, row by row, the bits of that row computed alone: the
    rows share the weights' reads and dequantization, not their sums. The rows differ (other
    values, magnitudes 1e-3 to 1e4); one case puts inf in one middle row and NaN in another, which
    must stay in theirs (one non-finite source per row: where a chain meets two NaNs, inf * 0's
    and x's, which payload survives depends on the operand order the compiler picked for
    `sum + x * t`, in MLX as here). 93 and 200 output rows: every block width, the 8-lane block
    and single rows; float32, bfloat16 and float16 scales."""
    if isa > module.cpu_isa():
        pytest.skip(f"this CPU has no {ISA_NAMES[isa]}")
    module.set_isa(isa)
    rng = np.random.default_rng(3000 + 10 * bits + group + isa)
    k = 2 * max(group, 64)
    for dtype in (mx.float32, mx.bfloat16, mx.float16):
        for n in (93, 200):
            w, scales, biases = _quantized(rng, n, k, group, bits, dtype)
            for m in (1, 2, 3, 4, 5, 6, 7, 8, 9):
                rows = rng.standard_normal((m, k)) * 10.0 ** rng.integers(-3, 5, size=(m, 1))
                if dtype == mx.float16 and n == 200 and m >= 3:  # one non-finite value per row (docstring)
                    rows[1, 5], rows[2, 100] = np.inf, np.nan
                x = mx.array(rows.astype(np.float32))
                ours = _bits(module.quantized_matvec(x, w, scales, biases, group, bits))
                assert ours.shape == (m, n)
                assert np.array_equal(ours, _bits(_reference(x, w, scales, biases, group, bits))), (dtype, n, m)
                for r in range(m):
                    alone = _bits(module.quantized_matvec(x[r : r + 1], w, scales, biases, group, bits))
                    assert np.array_equal(ours[r : r + 1], alone), (dtype, n, m, r)


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
        (x, w[37:], scales[37:], biases[37:]),  # the second half of a split layer
        (x, w[:37], scales[:37], biases[:37]),
        (x, w[::2], scales[::2], biases[::2]),  # not row-contiguous
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
    assert np.array_equal(
        _bits(module.quantized_matvec(x, w, s, biases, 64, 8)), _bits(_reference(x, w, s, biases, 64, 8))
    )


@pytest.mark.parametrize("wdtype", [mx.float32, mx.bfloat16], ids=["float32", "bfloat16"])
@pytest.mark.parametrize("isa", [0, 1, 2], ids=ISA_NAMES)
def test_float32_matmul_is_mx_matmul_bit_for_bit(module, isa, wdtype):
    """Column counts through every block (64 / 16 columns on AVX-512, 32 / 8 on AVX2, single
    columns), row counts through the 4 / 2 / 1-row blocks, batch axes, K from 1 up, inputs up
    to ~1e4 so that the sums carry rounding; float32 and bf16 weights (MLX converts a bf16 one
    to float32 before the same sgemm; the kernel widens it in its registers)."""
    if isa > module.cpu_isa():
        pytest.skip(f"this CPU has no {ISA_NAMES[isa]}")
    module.set_isa(isa)
    rng = np.random.default_rng(200 + isa)
    for k in (1, 7, 72, 257):
        for n in (1, 7, 8, 9, 16, 17, 33, 64, 65, 72, 100, 288):
            wt = mx.array(rng.standard_normal((k, n)).astype(np.float32)).astype(wdtype)
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
    # bf16 weights: a transposed view (copied to rows by the kernel), the same inf / NaN, and
    # every bf16 bit pattern once (subnormals, both zeros, inf, NaN payloads) against x of ones
    cases += [
        (x, mx.array(rng.standard_normal((100, 32)).astype(np.float32)).astype(mx.bfloat16).T),
        (mx.array(xn), mx.array(wn).astype(mx.bfloat16)),
        (mx.ones((2, 64)), mx.array(np.arange(65536, dtype=np.uint16).reshape(64, 1024)).view(mx.bfloat16)),
    ]
    for xs, wt in cases:
        assert np.array_equal(_bits(module.float32_matmul(xs, wt)), _bits(mx.matmul(xs, wt)))


def test_float32_matmul_router(module, monkeypatch):
    """`cpu_qmv.float32_matmul` takes the kernel for float32 products with a 2-D weight on a CPU
    stream while the bound policy has them on, MLX's matmul otherwise; the same values either way."""
    rng = np.random.default_rng(12)
    calls = []
    real = module.float32_matmul
    monkeypatch.setattr(module, "float32_matmul", lambda *a, **k: calls.append(1) or real(*a, **k))
    x = mx.array(rng.standard_normal((2, 24)).astype(np.float32))
    wt = mx.array(rng.standard_normal((24, 40)).astype(np.float32))
    with running(cpu_kernels=True):
        assert np.array_equal(
            _bits(cpu_qmv.float32_matmul(x, wt, enabled=bound_policy().cpu_kernels)), _bits(mx.matmul(x, wt))
        )
        assert calls == [1]
        assert np.array_equal(
            _bits(cpu_qmv.float32_matmul(x, wt.astype(mx.bfloat16), enabled=bound_policy().cpu_kernels)),
            _bits(mx.matmul(x, wt.astype(mx.bfloat16))),
        )  # a bf16 weight: served
        assert calls == [1, 1]
        cpu_qmv.float32_matmul(
            x.astype(mx.bfloat16), wt.astype(mx.bfloat16), enabled=bound_policy().cpu_kernels
        )  # not a float32 x
        cpu_qmv.float32_matmul(x, wt.astype(mx.float16), enabled=bound_policy().cpu_kernels)  # a float16 weight
        cpu_qmv.float32_matmul(x, mx.stack([wt, wt]), enabled=bound_policy().cpu_kernels)  # a batched weight
        assert calls == [1, 1]
    with running(cpu_kernels=False):
        cpu_qmv.float32_matmul(x, wt, enabled=bound_policy().cpu_kernels)
        assert calls == [1, 1]


def test_float32_matmul_bad_arguments(module):
    x = mx.ones((2, 8))
    with pytest.raises(ValueError, match="a float32 x and a float32 or bfloat16 wt"):
        module.float32_matmul(x.astype(mx.float16), mx.ones((8, 4)))
    with pytest.raises(ValueError, match="a float32 x and a float32 or bfloat16 wt"):
        module.float32_matmul(x, mx.ones((8, 4), dtype=mx.float16))
    with pytest.raises(ValueError, match="wt must be 2-D"):
        module.float32_matmul(x, mx.ones((1, 8, 4)))
    with pytest.raises(ValueError, match=r"last axis must be wt.shape\[0\] = 6"):
        module.float32_matmul(x, mx.ones((6, 4)))


def _norm_emulated(x: np.ndarray, w, b, eps: float, layer: bool) -> np.ndarray:
    """mx.fast.rms_norm / layer_norm as MLX's CPU composition computes them, written out in
    numpy float32: every operation rounded, 1 / d rounded from double, each sum the sequential
    chain s = 0; s = s + v[k] (k ascending) of MLX's x86 reduction. Independent of both the
    kernel and MLX, so a kernel summing in another order (pairwise, 8 lanes) fails here."""
    f32 = np.float32
    d = x.shape[-1]
    inv_d = f32(1.0 / d)

    def chain(v):
        s = np.zeros(v.shape[:-1], f32)
        for k in range(d):
            s = (s + v[..., k]).astype(f32)
        return s[..., None]

    with np.errstate(all="ignore"):  # overflow / 0 * inf / NaN are part of what is compared
        return _norm_chain(x, w, b, eps, layer, chain, inv_d)


def _norm_chain(x, w, b, eps, layer, chain, inv_d):
    f32 = np.float32
    c = x
    if layer:
        c = (x - (chain(x) * inv_d).astype(f32)).astype(f32)
    scale = (f32(1) / np.sqrt(((chain((c * c).astype(f32)) * inv_d).astype(f32) + f32(eps)).astype(f32))).astype(f32)
    y = (c * scale).astype(f32)
    if w is not None:
        y = (y * w.astype(f32)).astype(f32)
    if b is not None:
        y = (y + b.astype(f32)).astype(f32)
    return y


def test_batched_matvec_is_mx_matmul_bit_for_bit(module):
    """A batch of matrix-vector products (a Mamba-2 step's state times C per head, C·B per group):
    row counts through the 8-chain blocks and the single rows, K from 1 up, x per entry and x
    broadcast over the innermost batch axis (a group's C shared by its heads), inputs up to ~1e4
    so that the sums carry rounding, a transposed (non-contiguous) a; MLX's bits."""
    rng = np.random.default_rng(31)
    for k in (1, 16, 33, 128):
        for p in (1, 7, 8, 9, 80):
            for lead, broadcast in (((3,), False), ((2, 4), False), ((2, 3, 4), True), ((1, 8, 16), True)):
                a = mx.array((rng.standard_normal((*lead, p, k)) * 10.0 ** rng.integers(-3, 5)).astype(np.float32))
                xs = (*lead[:-1], 1, k, 1) if broadcast else (*lead, k, 1)
                x = mx.array(rng.standard_normal(xs).astype(np.float32))
                ours = module.batched_matvec(a, x)
                want = mx.matmul(a, x)
                assert ours.shape == want.shape and ours.dtype == mx.float32
                assert np.array_equal(_bits(ours), _bits(want)), (lead, p, k, broadcast)
    at = mx.array(rng.standard_normal((4, 24, 40)).astype(np.float32)).transpose(0, 2, 1)  # (4, 40, 24), strided
    x = mx.array(rng.standard_normal((4, 24, 1)).astype(np.float32))
    assert np.array_equal(_bits(module.batched_matvec(at, x)), _bits(mx.matmul(at, x)))
    xt = mx.array(rng.standard_normal((4, 1, 24)).astype(np.float32)).swapaxes(1, 2)  # x a view too
    assert np.array_equal(_bits(module.batched_matvec(at, xt)), _bits(mx.matmul(at, xt)))
    an = rng.standard_normal((2, 9, 16)).astype(np.float32)
    an[0, 3, 4], an[1, 8, 0] = np.inf, np.nan
    xn = rng.standard_normal((2, 16, 1)).astype(np.float32)
    xn[0, 4], xn[1, 2] = 0.0, -np.inf  # 0 * inf: NaN, as MLX (no zero skipping)
    ours = module.batched_matvec(mx.array(an), mx.array(xn))
    assert np.array_equal(_bits(ours), _bits(mx.matmul(mx.array(an), mx.array(xn))))


def test_batched_matvec_router_and_bad_arguments(module, monkeypatch):
    """`cpu_qmv.batched_matvec` takes the kernel for float32 batches whose x is (..., K, 1) with a's
    batch axes (or its innermost one 1) while the policy has the kernels on; MLX's matmul for every
    other call (the same values); the module's errors say what it takes."""
    rng = np.random.default_rng(32)
    calls = []
    real = module.batched_matvec
    monkeypatch.setattr(module, "batched_matvec", lambda *a, **k: calls.append(1) or real(*a, **k))
    a = mx.array(rng.standard_normal((2, 4, 10, 6)).astype(np.float32))
    x = mx.array(rng.standard_normal((2, 1, 6, 1)).astype(np.float32))
    want = mx.matmul(a, x)
    got = cpu_qmv.batched_matvec(a, x, enabled=True)
    assert calls == [1] and got.shape == want.shape and np.array_equal(_bits(got), _bits(want))
    xf = mx.array(rng.standard_normal((2, 4, 6, 1)).astype(np.float32))
    assert np.array_equal(_bits(cpu_qmv.batched_matvec(a, xf, enabled=True)), _bits(mx.matmul(a, xf)))
    assert calls == [1, 1]
    for aa, xx in (
        (a, x),  # disabled below
        (a.astype(mx.bfloat16), x.astype(mx.bfloat16)),  # not float32
        (a, mx.ones((2, 4, 6, 2))),  # x not a column
        (a, mx.ones((1, 4, 6, 1))),  # broadcast over another axis than the innermost batch one
        (a[0, 0], mx.ones((6, 1))),  # no batch axis
    ):
        cpu_qmv.batched_matvec(aa, xx, enabled=aa is not a or xx is not x)
    assert calls == [1, 1]
    with pytest.raises(ValueError, match="float32 a and x"):
        module.batched_matvec(mx.ones((2, 3, 4), dtype=mx.float16), mx.ones((2, 4, 1)))
    with pytest.raises(ValueError, match=r"a \(\.\.\., P, K\) and x \(\.\.\., K, 1\) with as many axes"):
        module.batched_matvec(mx.ones((3, 4)), mx.ones((4, 1)))  # no batch axis
    with pytest.raises(ValueError, match="with as many axes"):
        module.batched_matvec(mx.ones((2, 3, 4)), mx.ones((2, 5, 1)))  # K differs
    with pytest.raises(ValueError, match="with as many axes"):
        module.batched_matvec(mx.ones((2, 3, 4)), mx.ones((2, 4, 2)))  # x not a column
    with pytest.raises(ValueError, match="the innermost one 1"):
        module.batched_matvec(mx.ones((2, 3, 5, 4)), mx.ones((1, 3, 4, 1)))  # broadcast over an outer axis


def test_norms_are_mlx_fast_norms_bit_for_bit(module):
    """`rms_norm` / `layer_norm` against `mx.fast`'s and an independent numpy emulation of MLX's
    order: widths 1 to 1000 (the conformer's, TTS's and language widths at the small presets,
    odd ones), 1-3 leading axes, float32 / bfloat16 / float16 weights, with and without weight and
    bias, epsilons 1e-5 / 1e-6 / 0, inputs over 40 decades, all zeros, inf and NaN. Exact."""
    rng = np.random.default_rng(13)
    for trial in range(60):
        d = int(rng.choice([1, 2, 7, 64, 72, 280, 1000]))
        shape = tuple(int(v) for v in rng.integers(1, 4, size=trial % 3)) + (d,)
        x = (rng.standard_normal(shape) * 10.0 ** rng.uniform(-20, 20)).astype(np.float32)
        if trial % 10 == 3:
            x[...] = 0
        if trial % 10 == 7:
            x.flat[rng.integers(x.size)] = rng.choice([np.inf, -np.inf, np.nan])
        dtype = (mx.float32, mx.bfloat16, mx.float16)[trial % 3]
        w = mx.array(rng.standard_normal(d).astype(np.float32)).astype(dtype)
        b = mx.array(rng.standard_normal(d).astype(np.float32)).astype(dtype)
        eps = (1e-5, 1e-6, 0.0)[trial % 3]
        for wi, bi in ((w, b), (w, None), (None, b), (None, None)):
            ours = module.layer_norm(mx.array(x), wi, bi, eps)
            assert np.array_equal(_bits(ours), _bits(mx.fast.layer_norm(mx.array(x), wi, bi, eps))), (shape, dtype)
            np_w = None if wi is None else np.array(wi.astype(mx.float32))
            np_b = None if bi is None else np.array(bi.astype(mx.float32))
            assert np.array_equal(_bits(ours), _norm_emulated(x, np_w, np_b, eps, True).view(np.uint32))
        for wi in (w, None):
            ours = module.rms_norm(mx.array(x), wi, eps)
            assert np.array_equal(_bits(ours), _bits(mx.fast.rms_norm(mx.array(x), wi, eps))), (shape, dtype)
            np_w = None if wi is None else np.array(wi.astype(mx.float32))
            assert np.array_equal(_bits(ours), _norm_emulated(x, np_w, None, eps, False).view(np.uint32))


def test_norms_on_views_and_inside_compiled_pieces(module):
    """Transposed, strided and offset inputs, and the norm inside `mx.compile` between fused
    elementwise operations (how the frame's pieces run it): MLX's bits."""
    rng = np.random.default_rng(14)
    base = mx.array(rng.standard_normal((4, 72, 6)).astype(np.float32))
    w = mx.array(rng.standard_normal(72).astype(np.float32))
    b = mx.array(rng.standard_normal(72).astype(np.float32))
    for x in (base.transpose(0, 2, 1), base[1:3, :, 2], base[:, ::2, 0].T[None]):
        d = x.shape[-1]
        wd, bd = w[:d], b[:d]
        assert np.array_equal(_bits(module.rms_norm(x, wd, 1e-6)), _bits(mx.fast.rms_norm(x, wd, 1e-6)))
        assert np.array_equal(_bits(module.layer_norm(x, wd, bd, 1e-5)), _bits(mx.fast.layer_norm(x, wd, bd, 1e-5)))
    x = base[0].T

    def piece(norm):
        return mx.compile(lambda a, c, e: norm(a * 2.0 + 1.0, c, e) * 0.5 + a)

    ours = piece(lambda a, c, e: module.layer_norm(a, c, e, 1e-5))(x, w, b)
    theirs = piece(lambda a, c, e: mx.fast.layer_norm(a, c, e, 1e-5))(x, w, b)
    assert np.array_equal(_bits(ours), _bits(theirs))
    ours = piece(lambda a, c, e: module.rms_norm(a, c, 1e-6) + e)(x, w, b)
    theirs = piece(lambda a, c, e: mx.fast.rms_norm(a, c, 1e-6) + e)(x, w, b)
    assert np.array_equal(_bits(ours), _bits(theirs))


def test_norm_router_and_bad_arguments(module, monkeypatch):
    """`cpu_qmv.rms_norm` / `layer_norm` take the kernel for float32 x with 1-D float params on a
    CPU stream while the bound policy has them on, `mx.fast`'s otherwise; the kernel's errors name what it takes."""
    calls = []
    for name in ("rms_norm", "layer_norm"):
        real = getattr(module, name)
        monkeypatch.setattr(module, name, lambda *a, _r=real, **k: calls.append(1) or _r(*a, **k))
    x, w = mx.ones((2, 8)), mx.ones((8,))
    with running(cpu_kernels=True):
        cpu_qmv.rms_norm(x, w, 1e-6, enabled=bound_policy().cpu_kernels)
        cpu_qmv.layer_norm(x, w, None, 1e-5, enabled=bound_policy().cpu_kernels)
        assert calls == [1, 1]
        cpu_qmv.rms_norm(x.astype(mx.bfloat16), w, 1e-6, enabled=bound_policy().cpu_kernels)  # not float32
        cpu_qmv.layer_norm(x, w.astype(mx.int32), None, 1e-5, enabled=bound_policy().cpu_kernels)  # not a float weight
        assert calls == [1, 1]
        cpu_qmv.rms_norm(x, w, 1e-6, served=False, enabled=bound_policy().cpu_kernels)  # the caller's own check says no
        assert calls == [1, 1]
        cpu_qmv.layer_norm(
            x, w, None, 1e-5, served=True, enabled=bound_policy().cpu_kernels
        )  # ... or yes, not checked again
        assert calls == [1, 1, 1]
    with running(cpu_kernels=False):
        cpu_qmv.rms_norm(x, w, 1e-6, enabled=bound_policy().cpu_kernels)
        assert calls == [1, 1, 1]
    monkeypatch.undo()
    with pytest.raises(ValueError, match="takes float32 x"):
        module.rms_norm(x.astype(mx.float16), w, 1e-6)
    with pytest.raises(ValueError, match=r"1-D of x's last axis \(8\)"):
        module.layer_norm(x, mx.ones((4,)), None, 1e-5)
    with pytest.raises(ValueError, match="non-empty last axis"):
        module.rms_norm(mx.ones((2, 0)), None, 1e-6)
    with pytest.raises(ValueError, match="float32, bfloat16 or float16"):
        module.layer_norm(x, None, mx.ones((8,), dtype=mx.int32), 1e-5)


def test_rvq_pass_is_the_per_codebook_ops_bit_for_bit(module):
    """`rvq_pass` against `_rvq_core` (MLX's product, distance, argmin, gather, subtract per
    codebook), compiled and not: codes and the remaining residual, over codebook counts, widths
    and sizes (C = 1 to 1024), codebook slices at an offset, ties (a duplicated code: the first
    wins), and inf / NaN in a codebook (argmin takes the first NaN, as MLX's)."""
    import functools

    from voicechat.model.tts.ear_tts import _rvq_core

    rng = np.random.default_rng(15)
    for trial in range(40):
        q_all, latent, c = int(rng.integers(1, 7)), int(rng.choice([1, 5, 32])), int(rng.choice([1, 3, 17, 256, 1024]))
        stored = (rng.standard_normal((q_all, c, latent)) * rng.uniform(0.1, 3)).astype(np.float32)
        if trial % 5 == 1 and c > 1:
            stored[:, c - 1] = stored[:, 0]  # ties
        if trial % 5 == 2:
            stored[rng.integers(q_all), rng.integers(c), rng.integers(latent)] = rng.choice([np.inf, np.nan])
        books = mx.array(stored)
        books_t, norms = mx.contiguous(books.transpose(0, 2, 1)), (books * books).sum(-1)
        residual = mx.array((rng.standard_normal((1, latent)) * 2).astype(np.float32))
        first = int(rng.integers(0, q_all))
        count = int(rng.integers(1, q_all - first + 1))
        per_book = [books_t[q] for q in range(first, first + count)]
        ops = functools.partial(_rvq_core, count)
        codes, rest = module.rvq_pass(residual, books_t[first : first + count], norms[first : first + count])
        assert codes.dtype == mx.int32 and codes.shape == (count,) and rest.shape == (1, latent)
        for run in (ops, mx.compile(ops)):
            want_codes, want_rest = run(
                residual, per_book, [b.T for b in per_book], [norms[q : q + 1] for q in range(first, first + count)]
            )
            assert codes.tolist() == want_codes.tolist(), (trial, q_all, latent, c)
            assert np.array_equal(_bits(rest), _bits(want_rest))


def test_rvq_pass_router_and_bad_arguments(module):
    books_t, norms, residual = mx.ones((2, 4, 8)), mx.ones((2, 8)), mx.ones((1, 4))
    with running(cpu_kernels=False):
        assert cpu_qmv.rvq_pass(residual, books_t, norms, enabled=bound_policy().cpu_kernels) is None
    with running(cpu_kernels=True):
        assert (
            cpu_qmv.rvq_pass(residual.astype(mx.bfloat16), books_t, norms, enabled=bound_policy().cpu_kernels) is None
        )
        assert cpu_qmv.rvq_pass(residual, books_t, norms, enabled=bound_policy().cpu_kernels) is not None
    with pytest.raises(ValueError, match="float32 residual, books_t and norms"):
        module.rvq_pass(residual, books_t.astype(mx.float16), norms)
    with pytest.raises(ValueError, match=r"one row of books_t.shape\[1\] = 4"):
        module.rvq_pass(mx.ones((1, 5)), books_t, norms)
    with pytest.raises(ValueError, match=r"norms must be \(count, C\) = \(2, 8\)"):
        module.rvq_pass(residual, books_t, mx.ones((8,)))
    with pytest.raises(ValueError, match=r"\(count >= 1, latent >= 1, C >= 1\)"):
        module.rvq_pass(residual, mx.ones((4, 8)), norms)


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
    with running(cpu_kernels=True):
        assert np.array_equal(
            _bits(quantized_matmul(x, w, scales, biases, group_size=64, bits=4, enabled=bound_policy().cpu_kernels)),
            _bits(ref),
        )
        assert calls == [(64, 4)]
        # Not served: bfloat16 activations, no biases (other modes), 3-bit, a GPU stream absent here.
        quantized_matmul(
            x.astype(mx.bfloat16), w, scales, biases, group_size=64, bits=4, enabled=bound_policy().cpu_kernels
        )
        w3, s3, b3 = mx.quantize(mx.array(rng.standard_normal((40, 128)).astype(np.float32)), group_size=64, bits=3)
        quantized_matmul(x, w3, s3, b3, group_size=64, bits=3, enabled=bound_policy().cpu_kernels)
        assert calls == [(64, 4)]
    with running(cpu_kernels=False):
        assert np.array_equal(
            _bits(quantized_matmul(x, w, scales, biases, group_size=64, bits=4, enabled=bound_policy().cpu_kernels)),
            _bits(ref),
        )
        assert calls == [(64, 4)]


def test_streams_are_identical_with_and_without_the_kernel(module, tiny_ckpt_4bit, question_wav, monkeypatch):
    """A 4-bit tiny model loaded with the kernels and with MLX's (as `VOICECHAT_CPU_QMV=0` gives
    it, and with the kernels' weight layout, bf16 W.T, read by MLX's matmul), streamed: the same
    text, function ids, codes and audio samples, bit for bit; the kernels (quantized, float32,
    both norms, the RVQ pass) did run in the stream with them on, and not at all (load included)
    with them off."""
    import voicechat

    calls = {"quantized_matvec": [], "float32_matmul": [], "norms": []}
    real, real_f32 = module.quantized_matvec, module.float32_matmul
    monkeypatch.setattr(
        module, "quantized_matvec", lambda *a, **k: calls["quantized_matvec"].append(1) or real(*a, **k)
    )
    monkeypatch.setattr(
        module, "float32_matmul", lambda *a, **k: calls["float32_matmul"].append(1) or real_f32(*a, **k)
    )
    for name in ("rms_norm", "layer_norm", "rvq_pass"):
        monkeypatch.setattr(module, name, partial(_recorded, calls["norms"], name, getattr(module, name)))
    policies = {
        "kernels": default_policy(),
        "mlx": ExecutionPolicy.for_device(environ={"VOICECHAT_CPU_QMV": "0"}),
        "mlx, the kernels' layout": default_policy(cpu_kernels=False),
    }
    assert policies["kernels"].cpu_kernels and policies["kernels"].bf16_transposed
    assert not policies["mlx"].cpu_kernels and not policies["mlx"].bf16_transposed
    wave = question_wav[: 1280 * 12]
    runs = {}
    for name, policy in policies.items():
        for c in calls.values():
            c.clear()
        model = voicechat.load(tiny_ckpt_4bit, policy=policy)
        assert model.policy == policy
        loaded = {k: len(c) for k, c in calls.items()}
        session = model.create_streaming_session(seed=0)
        events = []
        for start in range(0, wave.size, 1280):
            events += session.push_audio(wave[start : start + 1280])
        audio = [e.samples for e in events if e.kind == "audio"]
        runs[name] = (
            list(session.text_ids),
            list(session.function_ids),
            np.stack(session.raw_audio_codes),
            np.concatenate(audio).view(np.uint32),
        )
        if policy.cpu_kernels:
            assert all(len(c) > loaded[k] for k, c in calls.items()), (loaded, {k: len(c) for k, c in calls.items()})
            assert {"rms_norm", "layer_norm", "rvq_pass"} <= set(calls["norms"][loaded["norms"] :])
        else:
            assert all(c == [] for c in calls.values()), name  # none with them off
    want = runs["kernels"]
    for name, got in runs.items():
        assert got[0] == want[0] and got[1] == want[1], name
        assert np.array_equal(got[2], want[2]) and np.array_equal(got[3], want[3]), name


def test_the_policy_decides_and_is_fixed_once_chosen(module, monkeypatch):
    """The kernels are on by default for a CPU device on Linux x86-64 (where they load) and off for
    a GPU one; `VOICECHAT_CPU_QMV` overrides that when the policy is chosen (`for_device`), and
    only then: the runtime bound on this thread hands its policy's `cpu_kernels` to the kernels, whatever the
    environment says afterwards, and is the previous binding's again after a nested one."""
    assert ExecutionPolicy.for_device(mx.cpu, environ={}).cpu_kernels is True
    assert ExecutionPolicy.for_device(mx.cpu, environ={"VOICECHAT_CPU_QMV": "0"}).cpu_kernels is False
    assert ExecutionPolicy.for_device(mx.cpu, environ={"VOICECHAT_CPU_QMV": "1"}).cpu_kernels is True
    assert ExecutionPolicy.for_device(mx.gpu, environ={}).cpu_kernels is False
    monkeypatch.setenv("VOICECHAT_CPU_QMV", "0")
    assert ExecutionPolicy.for_device(mx.cpu).cpu_kernels is False  # environ defaults to os.environ
    with running(cpu_kernels=True):
        assert bound_policy().cpu_kernels is True  # chosen: the environment is not read again
        with running(cpu_kernels=False):
            assert bound_policy().cpu_kernels is False
        assert bound_policy().cpu_kernels is True
    assert bound_policy().cpu_kernels is False  # nothing bound
    policy = default_policy(cpu_kernels=False)
    monkeypatch.setattr(cpu_qmv, "_state", {"module": None, "reason": "substituted"})
    with pytest.raises(RuntimeError, match="substituted"):  # no policy with them on where they cannot load
        policy.replace(cpu_kernels=True)


def test_a_layer_rechecks_its_weights_when_they_are_replaced(module, monkeypatch):
    """`FastQuantizedLinear` checks once per weight arrays whether the kernel serves them: a
    4-bit layer given 3-bit weights (not served) goes to MLX's kernel, with MLX's result."""
    from voicechat.runtime.linear import FastQuantizedLinear

    rng = np.random.default_rng(9)
    calls = []
    real = module.quantized_matvec
    monkeypatch.setattr(module, "quantized_matvec", lambda *a, **k: calls.append(a[5]) or real(*a, **k))
    layer = FastQuantizedLinear(128, 40, bias=False, group_size=64, bits=4)
    layer.weight, layer.scales, layer.biases = _quantized(rng, 40, 128, 64, 4, mx.float32)
    x = mx.array(rng.standard_normal((1, 128)).astype(np.float32))
    with running(cpu_kernels=True):
        assert np.array_equal(_bits(layer(x)), _bits(_reference(x, layer.weight, layer.scales, layer.biases, 64, 4)))
        assert calls == [4]
        layer.bits = 3
        layer.weight, layer.scales, layer.biases = mx.quantize(
            mx.array(rng.standard_normal((40, 128)).astype(np.float32)), group_size=64, bits=3
        )
        assert np.array_equal(_bits(layer(x)), _bits(_reference(x, layer.weight, layer.scales, layer.biases, 64, 3)))
        assert calls == [4]


def test_unavailable_kernel_warns_by_default_and_raises_when_forced(monkeypatch):
    """Where the kernels would be on but cannot load, the device's policy has them off, with one
    warning saying why (and how to silence it), and runs on MLX's kernels without another;
    forcing them on (`VOICECHAT_CPU_QMV=1`, or a policy with `cpu_kernels=True`) raises."""
    monkeypatch.setattr(cpu_qmv, "_state", {"module": None, "reason": "no compiler here"})
    monkeypatch.setattr(cpu_qmv, "platform_served", lambda: True)  # where they are on by default
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        policy = ExecutionPolicy.for_device(mx.cpu, environ={})
    assert [w.category for w in seen] == [RuntimeWarning]
    assert re.search(r"not used \(no compiler here\).*same results.*VOICECHAT_CPU_QMV=0", str(seen[0].message))
    assert policy.cpu_kernels is False and policy.bf16_transposed is False
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # said once, when the policy was chosen
        with running(policy):
            assert bound_policy().cpu_kernels is False
            x = mx.ones((1, 64))
            w, s, b = mx.quantize(mx.ones((8, 64)), group_size=64, bits=4)
            assert quantized_matmul(x, w, s, b, group_size=64, bits=4, enabled=bound_policy().cpu_kernels).shape == (
                1,
                8,
            )  # MLX's kernel
        assert ExecutionPolicy.for_device(mx.cpu, environ={"VOICECHAT_CPU_QMV": "0"}).cpu_kernels is False  # silent
    with pytest.raises(RuntimeError, match="cannot be used here: no compiler here"):
        ExecutionPolicy(name="forced", cpu_kernels=True)
    with pytest.raises(RuntimeError, match=r"VOICECHAT_CPU_QMV=1.*cannot be used: no compiler here"):
        ExecutionPolicy.for_device(mx.cpu, environ={"VOICECHAT_CPU_QMV": "1"})
    with pytest.raises(ValueError, match=r"VOICECHAT_CPU_QMV must be 0 or 1.*'yes'"):
        ExecutionPolicy.for_device(mx.cpu, environ={"VOICECHAT_CPU_QMV": "yes"})


@pytest.mark.skipif(not platform_served(), reason="cpu_qmv serves Linux x86-64 only")
def test_a_failed_build_names_its_cause(monkeypatch, tmp_path):
    monkeypatch.setattr(cpu_qmv, "_state", {})
    monkeypatch.setenv("VOICECHAT_CACHE", str(tmp_path))
    monkeypatch.setattr(cpu_qmv, "_cmake", lambda: None)
    assert cpu_qmv.extension() is None
    assert "no `cmake` found" in cpu_qmv.unavailable_reason()
    assert not any(p.suffix == ".so" for p in tmp_path.rglob("*"))  # nothing half-built left behind
