"""The CPU products of a frame on MLX's x86-64 CPU backend, bit for bit MLX's, several times
faster: the quantized language path's matrix-vector products and the float32 products with the
weight copies of the conformer, TTS and codebooks.

MLX's Linux x86-64 wheels have no SIMD for float in their CPU backend, so `mx.quantized_matmul`
runs one scalar multiply-add chain per output row: 0.7 GB/s of 4-bit weights on the benchmark
machine, the largest part of a frame's language stage. `csrc/cpu_qmv.cpp` is an MLX primitive
that does the same operations in the same order for each row (so every output is MLX's bit for
bit), with 16 rows in the lanes of an AVX-512 register (8 with AVX2). With several rows of x (a
batch's sessions) it reads and dequantizes each block of weights once for up to 8 rows of x;
each row keeps its own chain (the same dequantized values, its own products and sums, in the
same order), so each row's output is the bits of that row computed alone. MLX's float32
`mx.matmul` calls the Netlib reference sgemm, one sequential chain `c = c + x[m, k] * w[k, n]`
per output (k ascending, no FMA); the extension's float32 product runs the same chains for 16
(8) columns in a vector's lanes and reads each weight row once per 4 rows of x. Two more
primitives save dispatches rather than time per operation: `rms_norm` / `layer_norm` (MLX runs
`mx.fast`'s norms as their compositions on a CPU, 3 / 5 dispatches; its sums there are one
sequential chain per row) and `rvq_pass` (EAR-TTS's greedy RVQ over a pass's codebooks, 5
dispatches per codebook on MLX), each the same operations in the same order in one dispatch.

It is a C++ extension built on first use, not at install: it links MLX's C++ library and passes
`mx.array` through nanobind, so it must be built against the exact MLX it runs with. The build
(CMake + the C++ compiler, ~15 s, one line on stderr) goes to `$VOICECHAT_CACHE/cpu_qmv/<key>`,
the key covering the sources and the MLX, nanobind and Python versions; later processes import it.
Before first use the module is checked against `mx.quantized_matmul` and `mx.matmul` on random
inputs (every bits / group size, 1 to 9 rows of x, every instruction set); any difference and it
is not used.

`quantized_matmul(..., enabled=...)` takes the extension when `enabled` (the policy's
`cpu_kernels`, passed by the runtime that calls it) and the call is one it serves (float32
activations, affine 4 / 8-bit, group 32 / 64 / 128, 2-D weights, a CPU stream), else
`mx.quantized_matmul`; `float32_matmul(x, wt)` likewise (float32 x and a 2-D float32 or bf16
wt), else `mx.matmul`; `rms_norm` / `layer_norm` (float32 x, 1-D float weight / bias) else
`mx.fast`'s; `rvq_pass` returns None where not served (the caller runs MLX's ops); the
same bits either way. `ExecutionPolicy.for_device` turns them on for a CPU device on Linux x86-64
(on macOS MLX's CPU kernels sum 8 lanes at a time and its BLAS is Accelerate: other orders, and
Metal is the fast path there); where the build fails, a warning says why (and names the build
log) and MLX's kernels are used: same results, slower.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

import mlx.core as mx
import numpy as np

from voicechat.environment import cache_home

MODULE_NAME = "_voicechat_cpu_qmv"
SOURCE_DIR = Path(__file__).parent / "csrc"
SOURCES = ("CMakeLists.txt", "cpu_qmv.cpp", "qmv_avx2.cpp", "qmv_avx512.cpp", "qmv_kernel.h", "qmv_rows.h")
BITS = (4, 8)
GROUP_SIZES = (32, 64, 128)
ISA_NAMES = ("scalar", "AVX2", "AVX-512")  # the extension's isa() / set_isa() levels
SELF_CHECK_ROWS = tuple(range(1, 10))  # input rows: each count the kernel takes together, and 8 + 1

_lock = threading.Lock()
_state: dict = {}  # "module" (or None) and "reason" once `_load` has run


def platform_served() -> bool:
    """Linux x86-64: where MLX's CPU quantized product is the scalar per-row chain this replaces."""
    return sys.platform.startswith("linux") and platform.machine() in ("x86_64", "AMD64")


def _build_key() -> str:
    import nanobind

    h = hashlib.sha256()
    for name in SOURCES:
        h.update((SOURCE_DIR / name).read_bytes())
    h.update(f"mlx {mx.__version__} nanobind {nanobind.__version__} python {sys.version}".encode())
    return h.hexdigest()[:16]


def _cmake() -> str | None:
    try:  # the `cmake` wheel (a dependency on Linux x86-64) first, then the system's
        import cmake

        path = Path(cmake.CMAKE_BIN_DIR) / "cmake"
        if path.exists():
            return str(path)
    except ImportError:
        pass
    return shutil.which("cmake")


def _built_module(folder: Path) -> Path | None:
    found = sorted(folder.glob(MODULE_NAME + "*.so"))
    return found[0] if found else None


def _build(folder: Path) -> None:
    """CMake-build the module into `folder` (made atomically: a finished build or nothing)."""
    import nanobind

    cmake = _cmake()
    if cmake is None:
        raise RuntimeError("no `cmake` found (pip install cmake, or the system package)")
    mlx_root = Path(mx.__file__).parent
    folder.parent.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix=folder.name + ".", dir=folder.parent))
    log = folder.parent / f"{folder.name}.build.log"
    print(
        f"voicechat: building the CPU quantized matrix-vector kernel (once per MLX version, ~15 s) in {folder}",
        file=sys.stderr,
        flush=True,
    )
    try:
        configure = [
            cmake,
            "-S",
            str(SOURCE_DIR),
            "-B",
            str(work / "build"),
            "-DCMAKE_BUILD_TYPE=Release",
            f"-DPython_EXECUTABLE={sys.executable}",
            f"-Dnanobind_DIR={nanobind.cmake_dir()}",
            f"-DMLX_DIR={mlx_root / 'share' / 'cmake' / 'MLX'}",
            f"-DVOICECHAT_MLX_VERSION={mx.__version__}",
            f"-DCMAKE_LIBRARY_OUTPUT_DIRECTORY={work / 'out'}",
        ]
        with open(log, "w") as out:
            for cmd in (configure, [cmake, "--build", str(work / "build"), "-j", str(min(os.cpu_count() or 1, 4))]):
                out.write("$ " + " ".join(cmd) + "\n")
                out.flush()
                done = subprocess.run(cmd, stdout=out, stderr=subprocess.STDOUT, check=False)
                if done.returncode != 0:
                    raise RuntimeError(f"the build failed (exit {done.returncode}); its log: {log}")
        built = _built_module(work / "out")
        if built is None:
            raise RuntimeError(f"the build wrote no {MODULE_NAME} module; its log: {log}")
        final = work / "final"
        final.mkdir()
        shutil.copy2(built, final / built.name)
        try:
            os.replace(final, folder)  # another process may have finished first: keep theirs
        except OSError:
            if _built_module(folder) is None:
                raise
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _import(path: Path):
    spec = importlib.util.spec_from_file_location(MODULE_NAME, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def self_check(module) -> str | None:
    """None when `module.quantized_matvec` equals `mx.quantized_matmul` bit for bit on random
    weights (every bits / group size served; float32, bfloat16 and float16 scales; 1 to 9 input
    rows, so every group of rows the kernel takes together and a remainder; 93 output rows: the
    widest blocks, 16-lane, 8-lane and single-row kernels) and `module.float32_matmul` equals
    `mx.matmul` (three shapes covering its column blocks and single columns; float32 and bfloat16
    weights), with each instruction set this CPU runs, its `batched_matvec` equals `mx.matmul`
    over a batch, its `rms_norm` / `layer_norm` equal `mx.fast`'s (float32 and bfloat16 weights)
    and its `rvq_pass` MLX's per-codebook ops, else what differed."""
    rng = np.random.default_rng(20261202)
    top = module.isa()
    try:
        for isa in range(module.cpu_isa() + 1):
            module.set_isa(isa)
            for bits in BITS:
                for group in GROUP_SIZES:
                    for dtype in (mx.float32, mx.bfloat16, mx.float16):
                        n, k = 93, 2 * max(GROUP_SIZES)
                        w, scales, biases = mx.quantize(
                            mx.array(rng.standard_normal((n, k)).astype(np.float32)), group_size=group, bits=bits
                        )
                        scales, biases = scales.astype(dtype), biases.astype(dtype)
                        for m in SELF_CHECK_ROWS:
                            x = mx.array(rng.standard_normal((m, k)).astype(np.float32) * 4)
                            ours = module.quantized_matvec(x, w, scales, biases, group, bits, stream=mx.cpu)
                            theirs = mx.quantized_matmul(
                                x,
                                w,
                                scales=scales,
                                biases=biases,
                                transpose=True,
                                group_size=group,
                                bits=bits,
                                stream=mx.cpu,
                            )
                            if not np.array_equal(np.array(ours).view(np.uint32), np.array(theirs).view(np.uint32)):
                                return (
                                    f"differs from mx.quantized_matmul at bits={bits}, group_size={group}, "
                                    f"scales {dtype}, {m} input rows, instruction set {ISA_NAMES[isa]}"
                                )
            for m, k, n in ((1, 72, 72), (2, 40, 100), (5, 33, 17)):  # 64-, 16-, 8-lane, single columns
                x = mx.array(rng.standard_normal((m, k)).astype(np.float32) * 4)
                for wdtype in (mx.float32, mx.bfloat16):
                    wt = mx.array(rng.standard_normal((k, n)).astype(np.float32)).astype(wdtype)
                    ours = module.float32_matmul(x, wt, stream=mx.cpu)
                    theirs = mx.matmul(x, wt, stream=mx.cpu)
                    if not np.array_equal(np.array(ours).view(np.uint32), np.array(theirs).view(np.uint32)):
                        return (
                            f"float32_matmul differs from mx.matmul at {(m, k, n)}, weight {wdtype}, "
                            f"instruction set {ISA_NAMES[isa]}"
                        )
        for lead, p, k, rep in (((2, 3), 80, 16, 1), ((1, 2, 4), 13, 33, 4), ((3,), 1, 7, 1)):  # batched matvec
            a = mx.array(rng.standard_normal((*lead, p, k)).astype(np.float32) * 3)
            xs = (*lead[:-1], 1 if rep > 1 else lead[-1], k, 1)
            x = mx.array(rng.standard_normal(xs).astype(np.float32) * 3)
            ours = module.batched_matvec(a, x, stream=mx.cpu)
            theirs = mx.matmul(a, x, stream=mx.cpu)
            if not np.array_equal(np.array(ours).view(np.uint32), np.array(theirs).view(np.uint32)):
                return f"batched_matvec differs from mx.matmul at a {(*lead, p, k)}, x {xs}"
        for rows, d, wdtype in ((3, 72, mx.float32), (2, 1000, mx.bfloat16)):  # norms (no ISA paths)
            x = mx.array(rng.standard_normal((rows, d)).astype(np.float32) * 7)
            w, b = (mx.array(rng.standard_normal(d).astype(np.float32)).astype(wdtype) for _ in range(2))
            for name, ours, theirs in (
                ("rms_norm", module.rms_norm(x, w, 1e-6, stream=mx.cpu), mx.fast.rms_norm(x, w, 1e-6, stream=mx.cpu)),
                (
                    "layer_norm",
                    module.layer_norm(x, w, b, 1e-5, stream=mx.cpu),
                    mx.fast.layer_norm(x, w, b, 1e-5, stream=mx.cpu),
                ),
            ):
                if not np.array_equal(np.array(ours).view(np.uint32), np.array(theirs).view(np.uint32)):
                    return f"{name} differs from mx.fast.{name} at {(rows, d)}, weight {wdtype}"
        books_t = mx.array(rng.standard_normal((3, 16, 100)).astype(np.float32))  # an RVQ pass
        norms = (books_t * books_t).sum(axis=1)
        residual = mx.array(rng.standard_normal((1, 16)).astype(np.float32))
        codes, rest = module.rvq_pass(residual, books_t, norms, stream=mx.cpu)
        want = []
        for q in range(3):
            j = mx.argmin(norms[q] - 2.0 * mx.matmul(residual, books_t[q]), axis=-1)
            residual = residual - books_t[q][:, j].T
            want.append(j.item())
        if codes.tolist() != want or not np.array_equal(
            np.array(rest).view(np.uint32), np.array(residual).view(np.uint32)
        ):
            return "rvq_pass differs from MLX's per-codebook product, argmin and subtraction"
    finally:
        module.set_isa(top)
    return None


def _load():
    """The built and checked module, or None; `_state["reason"]` says why not."""
    with _lock:
        if "module" in _state:
            return _state["module"]
        module, reason = None, None
        if not platform_served():
            reason = (
                f"not built on {sys.platform} {platform.machine()}: MLX's CPU kernel there sums in "
                "another order, so only MLX's own gives its bits"
            )
        else:
            try:
                folder = cache_home() / "cpu_qmv" / _build_key()
                if _built_module(folder) is None:
                    _build(folder)
                module = _import(_built_module(folder))
                if mx.__version__ != module.MLX_VERSION:
                    raise RuntimeError(f"built for MLX {module.MLX_VERSION}, running {mx.__version__}")
                reason = self_check(module)
                if reason is not None:
                    module = None
            except Exception as e:
                module, reason = None, f"{type(e).__name__}: {e}"
        _state["module"], _state["reason"] = module, reason
        return module


def extension():
    """The built and checked extension module (None where it cannot be used)."""
    return _load()


def unavailable_reason() -> str | None:
    """Why the extension cannot be used here (None: it can). Builds it if needed."""
    _load()
    return _state["reason"]


def weights_served(w, scales, biases, *, group_size: int, bits: int, mode: str = "affine") -> bool:
    """Whether the extension serves products with these weights (affine 4 / 8-bit, group 32 / 64 /
    128, 2-D packed uint32 weights, float scales and biases of one dtype and matching shape). A
    layer checks its weights once (`parallel.FastQuantizedLinear`); each call checks its input."""
    return (
        mode == "affine"
        and biases is not None
        and bits in BITS
        and group_size in GROUP_SIZES
        and w.ndim == 2
        and w.dtype == mx.uint32
        and scales.ndim == 2
        and scales.dtype in (mx.float32, mx.bfloat16, mx.float16)
        and biases.dtype == scales.dtype
        and scales.shape == biases.shape == (w.shape[0], w.shape[1] * 32 // bits // group_size)
    )


_CPU = mx.Device(mx.cpu)  # MLX has one CPU device; comparing devices is 4x cheaper than their types


def _stream_served(stream) -> bool:
    if stream is None:
        return mx.default_device() == _CPU
    return isinstance(stream, mx.Stream) and stream.device == _CPU


def _input_served(x, w, bits, stream) -> bool:
    return _stream_served(stream) and x.dtype == mx.float32 and x.ndim >= 1 and x.shape[-1] == w.shape[1] * 32 // bits


def quantized_matmul(
    x: mx.array,
    w: mx.array,
    scales: mx.array,
    biases: mx.array | None,
    *,
    group_size: int,
    bits: int,
    mode: str = "affine",
    stream=None,
    served: bool | None = None,
    enabled: bool,
) -> mx.array:
    """`mx.quantized_matmul(x, w, scales, biases, transpose=True, ...)`, through the extension when
    `enabled` (`ExecutionPolicy.cpu_kernels`: a policy with it on is only made where the module
    loaded) and the call is one it serves (same bits either way). `served`: the caller's
    `weights_served(...)` for these weights, checked here when None (the extension rejects,
    with a clear error, weights it cannot take whatever a caller passes)."""
    if served is None:
        served = weights_served(w, scales, biases, group_size=group_size, bits=bits, mode=mode)
    if enabled and served and _input_served(x, w, bits, stream):
        return _state["module"].quantized_matvec(x, w, scales, biases, group_size, bits, stream=stream)
    return mx.quantized_matmul(
        x, w, scales=scales, biases=biases, transpose=True, group_size=group_size, bits=bits, mode=mode, stream=stream
    )


def float32_matmul(x: mx.array, wt: mx.array, *, stream=None, enabled: bool) -> mx.array:
    """`mx.matmul(x, wt)` for x (..., K) and a 2-D wt (K, N), through the extension's float32
    product when enabled, x is float32 and wt float32 or bfloat16, on a CPU stream (same bits
    either way: MLX's CPU matmul converts a bf16 operand to float32, exactly, then runs the
    Netlib reference sgemm, one sequential chain per output, which the extension runs 8 / 16
    columns per vector, widening bf16 weights in its registers). Used for the float32 weight
    copies of the conformer, TTS and codebook products and for bf16 weights stored transposed
    (`voicechat.runtime.linear.linear`)."""
    if (
        x.dtype == mx.float32
        and wt.dtype in (mx.float32, mx.bfloat16)
        and wt.ndim == 2
        and x.ndim >= 1
        and x.shape[-1] == wt.shape[0] > 0
        and _stream_served(stream)
        and enabled
    ):
        return _state["module"].float32_matmul(x, wt, stream=stream)
    return mx.matmul(x, wt, stream=stream)


def batched_matvec(a: mx.array, x: mx.array, *, stream=None, enabled: bool) -> mx.array:
    """`a @ x` for a batch of matrix-vector products, a (..., P, K) and x (..., K, 1) with x's batch
    axes a's, or a's with the innermost one 1 (x broadcast over it) -> (..., P, 1). MLX's CPU
    matmul runs one Netlib sgemm call per batch entry (each output the sequential chain over k); the
    extension runs the whole batch as one task, the same chains (same bits). Served when enabled,
    float32 a and x, such shapes and a CPU stream; else `mx.matmul`."""
    lead = a.shape[:-2]
    served = (
        enabled
        and a.dtype == x.dtype == mx.float32
        and a.ndim >= 3
        and x.ndim == a.ndim
        and x.shape[-1] == 1
        and x.shape[-2] == a.shape[-1] > 0
        and a.shape[-2] > 0
        and a.size > 0
        and (x.shape[:-2] == lead or (x.shape[:-3] == lead[:-1] and x.shape[-3] == 1))
        and _stream_served(stream)
    )
    if not served:
        return mx.matmul(a, x, stream=stream)
    return _state["module"].batched_matvec(a, x, stream=stream)


def norm_served(x: mx.array, *params, stream=None, enabled: bool) -> bool:
    """Whether `rms_norm` / `layer_norm` take the extension for x with these weight / bias (or
    None) params: enabled, float32 x, 1-D float params of x's last axis, a CPU stream."""
    return (
        enabled
        and x.dtype == mx.float32
        and x.ndim >= 1
        and x.shape[-1] > 0
        and _stream_served(stream)
        and all(p is None or (p.ndim == 1 and p.shape[0] == x.shape[-1] and p.dtype in _NORM_DTYPES) for p in params)
    )


_NORM_DTYPES = (mx.float32, mx.bfloat16, mx.float16)


def rms_norm(
    x: mx.array, weight: mx.array | None, eps: float, *, stream=None, served: bool | None = None, enabled: bool
) -> mx.array:
    """`mx.fast.rms_norm(x, weight, eps)`, through the extension's norm when enabled and served
    (float32 x, a 1-D float weight or None, a CPU stream): one dispatch instead of MLX's three
    (square, sum, the fused tail), the same bits (MLX's CPU sum is one sequential chain per row
    on x86-64, which the extension runs). `served`: the caller's `norm_served(...)` for these
    arguments, checked here when None."""
    if norm_served(x, weight, stream=stream, enabled=enabled) if served is None else served:
        return _state["module"].rms_norm(x, weight, eps, stream=stream)
    return mx.fast.rms_norm(x, weight, eps, stream=stream)


def layer_norm(
    x: mx.array,
    weight: mx.array | None,
    bias: mx.array | None,
    eps: float,
    *,
    stream=None,
    served: bool | None = None,
    enabled: bool,
) -> mx.array:
    """`mx.fast.layer_norm(x, weight, bias, eps)`, as `rms_norm`: one dispatch instead of five."""
    if norm_served(x, weight, bias, stream=stream, enabled=enabled) if served is None else served:
        return _state["module"].layer_norm(x, weight, bias, eps, stream=stream)
    return mx.fast.layer_norm(x, weight, bias, eps, stream=stream)


def rvq_pass(residual: mx.array, books_t: mx.array, norms: mx.array, *, stream=None, enabled: bool):
    """Greedy residual vector quantization of one float32 row over `books_t` (count, latent, C)
    with squared norms `norms` (count, C): -> (codes (count,) int32, the remaining residual), in
    one dispatch instead of five per codebook; the bits of MLX's ops in `tts.ear_tts._rvq_core`.
    None when the extension does not serve the call (disabled, not float32, not a CPU stream):
    the caller then runs those ops."""
    if (
        residual.dtype == books_t.dtype == norms.dtype == mx.float32
        and books_t.ndim == 3
        and residual.size == books_t.shape[1]
        and _stream_served(stream)
        and enabled
    ):
        return tuple(_state["module"].rvq_pass(residual, books_t, norms, stream=stream))
    return None


__all__ = [
    "batched_matvec",
    "extension",
    "float32_matmul",
    "layer_norm",
    "norm_served",
    "platform_served",
    "rms_norm",
    "rvq_pass",
    "quantized_matmul",
    "self_check",
    "unavailable_reason",
    "weights_served",
]
