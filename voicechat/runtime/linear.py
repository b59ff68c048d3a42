"""Two CPU streams per frame: split the large matrix products of a frame across cores.

MLX's CPU backend runs the operations of one stream on one thread, so a frame
evaluated on the default stream keeps one core busy however many the machine
has. A second CPU stream gets a thread of its own. This module splits the
frame's large products in two halves, one per stream, and joins them:

* `ParallelQuantizedLinear` / `FastLinear`: the output rows of a weight in
  two halves (views of the stored weight, no copy), `concatenate` of the two
  products. Each output element is the same dot product over the same inputs
  in the same order, so the result is bit-identical to the unsplit layer
  (tested); only layers with at least `MIN_SPLIT_MACS` multiply-adds per input
  row are split, because each split costs one cross-stream hand-over.
* `split_rows(fn, x)`: a row-wise function (LayerNorm, 1x1 convs, GELU) over
  the two halves of its input rows; used by the codec's ConvNeXt blocks.

The number of streams is the policy's `cpu_streams` (`ExecutionPolicy`): by default 2
on a CPU device with at least two cores, else 1 (on a GPU one device serves both streams).
With 1 stream every layer runs unsplit. The policy is passed in: a layer's `__call__` goes through
the op seam (`ops.prepared_linear`), whose runtime calls `forward(x, policy)` with its own (the
plain ops, unbound, with None: `UNBOUND`, one stream, MLX's kernels).

`prepare_linears(module, policy)` gives the dense and quantized layers these classes and the
weight layout the policy asks for; it is called by `voicechat.runtime.prepare` only.
"""

from __future__ import annotations

import threading

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from voicechat.model import ops
from voicechat.model.derived import derived
from voicechat.model.ops import stored_transposed
from voicechat.runtime.kernels import float32_matmul, quantized_matmul, weights_served
from voicechat.runtime.policy import UNBOUND, ExecutionPolicy

# A split pays when the product is long compared with one cross-stream hand-over; the
# threshold was chosen by interleaved runs at the small preset (docs/performance.md).
MIN_SPLIT_MACS = 1 << 18
# The second stream's thread sleeps between parts and starts its part about one wake-up after the
# default stream starts its own, so equal halves leave the default stream waiting. The default
# stream takes the first `split_point` rows: half, plus half of that lag expressed as the
# multiply-adds it could do meanwhile (`STREAM_LAG_MACS`), at most `MAX_MAIN_SHARE`; at the
# published shapes (tens of M multiply-adds) the lag is noise and the split stays at half.
STREAM_LAG_MACS = 240_000
MAX_MAIN_SHARE = 0.6
# The CPU kernels' quantized products run about this many times faster than MLX's CPU kernel,
# so a quantized layer is split, and its split point placed, as if it had 1 / QMV_SPEEDUP of its
# multiply-adds (docs/performance.md).
QMV_SPEEDUP = 4

_local = threading.local()


def secondary_stream(policy: ExecutionPolicy):
    """The second CPU stream of the calling thread, or None when `policy` runs on one stream."""
    if policy.cpu_streams < 2:
        return None
    stream = getattr(_local, "stream", None)
    if stream is None:
        stream = mx.new_stream(mx.cpu)
        _local.stream = stream
    return stream


def linear(x: mx.array, w: dict, stream=None, *, cpu_kernels: bool) -> mx.array:
    """x @ W.T (+ b) for a weights dict {"weight" (O, I) or "weight_t" (I, O), "bias"?}, or
    {"parts": [dict, ...]} (the output columns in pieces, concatenated): what `FastLinear` runs.

    "weight_t" is W.T stored contiguous: MLX's CPU BLAS runs x @ W_t about twice as fast as
    x @ W.T on a transposed view, with the same float32 result (same dot products in the same
    order; tested), and x @ W_t + b equals addmm(b, x, W.T) bit for bit. x @ W_t goes through
    `cpu_qmv.float32_matmul` (the same bits, faster on Linux x86-64, where `cpu_kernels`)."""
    if "parts" in w:
        return mx.concatenate([linear(x, part, stream, cpu_kernels=cpu_kernels) for part in w["parts"]], axis=-1)
    if "weight_t" in w:
        y = float32_matmul(x, w["weight_t"], stream=stream, enabled=cpu_kernels)
        return mx.add(y, w["bias"], stream=stream) if "bias" in w else y
    if "bias" in w:
        return mx.addmm(w["bias"], x, w["weight"].T, stream=stream)
    return mx.matmul(x, w["weight"].T, stream=stream)


def split_point(rows: int, macs: int) -> int:
    """Rows [0, split) of a layer of `macs` multiply-adds per input row go to the default
    stream, [split, rows) to the second one (both non-empty). Each output row is the same dot
    product whichever stream computes it, so the split point changes no value (tested)."""
    share = min(0.5 + STREAM_LAG_MACS / (2 * max(macs, 1)), MAX_MAIN_SHARE)
    return min(max(int(round(rows * share)), 1), rows - 1)


def _row_halves(layer: nn.Module, weights: dict, policy: ExecutionPolicy) -> tuple[dict, dict]:
    """Row views of `weights` split at `split_point` (the first part for the default stream),
    made once per weight arrays (under the policy of the first call)."""
    names = tuple(weights)

    def halves(*arrays):
        split = split_point(arrays[0].shape[0], _split_cost(layer, policy))
        return (
            {n: a[:split] for n, a in zip(names, arrays, strict=True)},
            {n: a[split:] for n, a in zip(names, arrays, strict=True)},
        )

    return derived(layer, "row_halves_" + "_".join(names), tuple(weights.values()), halves)


class FastQuantizedLinear(nn.QuantizedLinear):
    """`nn.QuantizedLinear` whose product goes through `cpu_qmv.quantized_matmul` (MLX's bits, its
    faster CPU kernel where that serves the call)."""

    _names = ("weight", "scales", "biases", "bias")

    def _weights(self) -> tuple[dict, bool]:
        """The layer's arrays by name, and whether `cpu_qmv` serves them (checked once per arrays:
        a product is a few microseconds of Python, the check another two)."""
        weights = {n: self[n] for n in self._names if n in self}
        served = derived(
            self,
            "qmv_served",
            tuple(weights.values()),
            lambda *_: weights_served(
                weights["weight"],
                weights["scales"],
                weights.get("biases"),
                group_size=self.group_size,
                bits=self.bits,
                mode=self.mode,
            ),
        )
        return weights, served

    def _half(self, x, part, stream, served, policy):
        y = quantized_matmul(
            x,
            part["weight"],
            part["scales"],
            part.get("biases"),
            group_size=self.group_size,
            bits=self.bits,
            mode=self.mode,
            stream=stream,
            served=served,
            enabled=policy.cpu_kernels,
        )
        return y + part["bias"] if "bias" in part else y

    def __call__(self, x):
        return ops.prepared_linear(self, x)

    def forward(self, x, policy: ExecutionPolicy | None):
        """The product under `policy` (None: `UNBOUND`)."""
        weights, served = self._weights()
        return self._half(x, weights, None, served, UNBOUND if policy is None else policy)


class ParallelQuantizedLinear(FastQuantizedLinear):
    """`FastQuantizedLinear` whose output rows are computed in two halves on two CPU streams."""

    def forward(self, x, policy: ExecutionPolicy | None):
        policy = UNBOUND if policy is None else policy
        stream = secondary_stream(policy)
        if stream is None:
            return super().forward(x, policy)
        weights, served = self._weights()  # a row half of served weights is served too
        lo, hi = _row_halves(self, weights, policy)
        return mx.concatenate(
            [self._half(x, lo, None, served, policy), self._half(x, hi, stream, served, policy)], axis=-1
        )


def _float32_transposed(weight: mx.array, bias: mx.array | None = None) -> dict:
    """{"weight_t": W.T float32 contiguous, "bias"?: float32} (see `linear`)."""
    out = {"weight_t": mx.contiguous(weight.astype(mx.float32).T)}
    if bias is not None:
        out["bias"] = bias.astype(mx.float32)
    return out


def _float32_transposed_halves(weight: mx.array, bias: mx.array | None = None) -> dict:
    """{"parts": [lo, hi]}: `_float32_transposed` of W's output rows split as `_row_halves` splits them, each
    contiguous, so a split layer runs the fast layout on both streams."""
    split = split_point(weight.shape[0], weight.shape[0] * weight.shape[1])
    lo = _float32_transposed(weight[:split], None if bias is None else bias[:split])
    hi = _float32_transposed(weight[split:], None if bias is None else bias[split:])
    return {"parts": [lo, hi]}


# The language path (embed, heads, every Linear of the LLM) keeps its stored dtype: it is
# quantized in the published 4/8-bit checkpoints, and at the published shapes a float32
# copy of the bf16 checkpoint's would take 38 GB.
NO_COPY_PREFIXES = ("stt_model.llm", "stt_model.embed_tokens", "stt_model.lm_head", "stt_model.function_head")


def _language_path(path: str) -> bool:
    return any(path == p or path.startswith(p + ".") for p in NO_COPY_PREFIXES)


# The CPU default makes float32 copies (of the 16-bit weights bf16 W.T does not serve: float16,
# or bf16 with the extension off) only while they add at most this many bytes (2 per copied
# element): at the small presets they pay; at the published shapes they would raise the peak
# memory by gigabytes for little speed (docs/performance.md, "Float32 copies").
FLOAT32_COPY_BUDGET_BYTES = 1 << 30


def float32_copies_within_budget(policy: ExecutionPolicy, extra_bytes: int) -> bool:
    """Whether `prepare_linears` replaces 16-bit dense weights that bf16 W.T does not serve by
    float32 copies, given the bytes the copies would add: as the policy says, or, where it leaves
    it to the budget (None), while that is at most `FLOAT32_COPY_BUDGET_BYTES` (MLX's CPU
    backend converts a bf16 weight fed float32 inputs on every call; the copy removes that)."""
    if policy.float32_copies is not None:
        return policy.float32_copies
    return extra_bytes <= FLOAT32_COPY_BUDGET_BYTES


def _copy_candidates(module: nn.Module, prefix: str) -> list:
    """Dense layers whose 16-bit weight a float32 copy would replace."""
    return [
        layer
        for path, layer in module.named_modules()
        if isinstance(layer, nn.Linear)
        and not isinstance(layer, nn.QuantizedLinear)
        and layer["weight"].dtype in (mx.bfloat16, mx.float16)
        and not _language_path(prefix + path)
    ]


class FastLinear(nn.Linear):
    """`nn.Linear` for float32 activations against 16-bit weights, and for large products.

    * Float32 copy (`prepare_linears(..., float32_copies=True)`): a bf16 / f16 weight fed
      float32 inputs is converted to float32 by MLX on every call; instead the layer's
      weight is replaced, once, by its float32 copy (the same values: the conversion is
      exact), stored as W.T contiguous (twice as fast in MLX's CPU BLAS) and exposed as the
      parameter `weight` = that array's transposed view, so the layer holds one copy. A
      16-bit input gets the weight converted back to its stored dtype (exact), so its
      product and result dtype are what the stored weight gives. Such a layer does not split
      across streams (its two halves would need a second copy in two contiguous pieces).
    * bf16 W.T (`prepare_linears(..., bf16_transposed=True)`, the CPU default with the
      extension on): the same, but W.T keeps the stored bf16 bytes and
      `cpu_qmv.float32_matmul` widens them in its registers; half a float32 copy's bytes.
    * Large products of the other layers are split across two CPU streams like
      `ParallelQuantizedLinear`.
    """

    _names = ("weight", "bias")

    def _replaced(self) -> bool:
        """True while `weight` is the W.T view `prepare_linears` put in place (not since replaced)."""
        return stored_transposed(self) is not None

    def _weights(self, x) -> dict:
        stored = {n: self[n] for n in self._names if n in self}
        if self._replaced():
            if x.dtype == mx.float32:
                out = {"weight_t": self.__dict__["_weight_t"]}
                if "bias" in stored:
                    out["bias"] = stored["bias"]
                return out
            # Converted per call, not cached: a cached 16-bit copy would be a second resident copy.
            dtype = self.__dict__["_stored_dtype"]
            return {n: v.astype(dtype) for n, v in stored.items()}
        if (
            x.dtype == mx.float32
            and self.__dict__.get("_float32_copies")
            and stored["weight"].dtype in (mx.bfloat16, mx.float16)
        ):
            # Weights replaced after `prepare_linears`: a derived float32 copy (second copy)
            # until `prepare_linears` is called again.
            if self.__dict__.get("_split", False):
                return derived(self, "float32_t_halves", tuple(stored.values()), _float32_transposed_halves)
            return derived(self, "float32_t", tuple(stored.values()), _float32_transposed)
        return stored

    def _splits(self) -> bool:
        return self.__dict__.get("_split", False) and not self._replaced()

    def unsplit_weights(self, x, policy: ExecutionPolicy) -> dict | None:
        """The weights a call on `x` under `policy` would use, or None when the call would split
        across streams (callers that fuse the product into a compiled piece must then call the layer)."""
        if self._splits() and secondary_stream(policy) is not None:
            return None
        return self._weights(x)

    def __call__(self, x):
        return ops.prepared_linear(self, x)

    def forward(self, x, policy: ExecutionPolicy | None):
        """The product under `policy` (None: `UNBOUND`)."""
        policy = UNBOUND if policy is None else policy
        kernels = policy.cpu_kernels
        weights = self._weights(x)
        stream = secondary_stream(policy) if self._splits() else None
        if stream is None:
            return linear(x, weights, cpu_kernels=kernels)
        lo, hi = weights["parts"] if "parts" in weights else _row_halves(self, weights, policy)
        return mx.concatenate([linear(x, lo, cpu_kernels=kernels), linear(x, hi, stream, cpu_kernels=kernels)], axis=-1)


def _replace_by_float32(layer: FastLinear) -> None:
    """The layer's 16-bit weight (and bias) -> its float32 copy, as the only resident copy."""
    replace_weight_transposed(layer)
    if "bias" in layer:
        layer["bias"] = layer["bias"].astype(mx.float32)


def replaced_transposed(module: nn.Module) -> bool:
    """True while `module`'s `weight` is the view of a stored W.T that `replace_weight_transposed`
    put in place (not since replaced by something else)."""
    return stored_transposed(module) is not None


# Rows per piece of `contiguous_transpose` (a few MB per piece stay in cache).
TRANSPOSE_BLOCK_ROWS = 256


def contiguous_transpose(a: mx.array) -> mx.array:
    """a.T of a 2-D array, stored row-contiguous, bit for bit (a copy). MLX's copy of a whole
    transposed view (`mx.contiguous(a.T)`) is slow on a CPU (it strides over the whole matrix);
    concatenating the transposes of blocks of `TRANSPOSE_BLOCK_ROWS` rows reads each block from
    cache. (An elementwise op over `a.T` would keep the column-major layout.)"""
    rows = a.shape[0]
    if rows <= TRANSPOSE_BLOCK_ROWS:
        return mx.contiguous(a.T)
    return mx.concatenate([a[r : r + TRANSPOSE_BLOCK_ROWS].T for r in range(0, rows, TRANSPOSE_BLOCK_ROWS)], axis=1)


def replace_weight_transposed(module: nn.Module, to_matrix=None, from_matrix_t=None, dtype=mx.float32) -> mx.array:
    """Replace `module`'s `weight` by W.T stored contiguous in `dtype`, as its only resident
    copy; returns W.T.

    The products use the weight as a matrix W = to_matrix(weight) (O', I') in x @ W.T; that
    runs fastest, in MLX's CPU BLAS, numpy's and `cpu_qmv.float32_matmul`, on W.T stored
    contiguous (I', O'). So W.T is made once, contiguous, in `dtype` (float32: exact for 16-bit
    weights; or the stored dtype, a transposed copy of the same bytes), kept as
    `module._weight_t`, and the parameter `weight` becomes from_matrix_t(W.T): a view of that
    buffer in the stored shape (MLX transposes and reshapes of it are views; no bytes of its
    own). The stored dtype is kept in `_stored_dtype` (`voicechat.save` writes it back). Lazy:
    the caller evaluates `_weight_t`, which releases the original. Defaults: W = weight (a
    Linear)."""
    to_matrix = to_matrix or (lambda w: w)
    from_matrix_t = from_matrix_t or (lambda w_t: w_t.T)
    w = module["weight"]
    w_t = contiguous_transpose(to_matrix(w).astype(dtype))
    view = from_matrix_t(w_t)
    if tuple(view.shape) != tuple(w.shape):
        raise ValueError(
            f"replace_weight_transposed: from_matrix_t gave shape {tuple(view.shape)}, the weight is {tuple(w.shape)}"
        )
    module.__dict__["_stored_dtype"] = w.dtype
    module["weight"] = view
    module.__dict__.pop("_derived", None)  # nothing cached may keep the original alive
    module.__dict__["_weight_t"] = w_t
    module.__dict__["_weight_view"] = view
    return w_t


# The copies are evaluated in batches of about this many bytes: fewer evaluations than one per
# layer, while a batch keeps at most this much of 16-bit originals alive beside their copies.
COPY_EVAL_BYTES = 64 * 1024**2


def _evaluate_copies(pending: list) -> None:
    """Evaluate the float32 copies of `pending` layers (releasing their 16-bit originals); empties it."""
    if pending:
        mx.eval([(m.parameters(), m.__dict__["_weight_t"]) for m in pending])
        pending.clear()


def _macs(layer: nn.Module) -> int:
    w = layer["weight"]
    if isinstance(layer, nn.QuantizedLinear):
        return w.shape[0] * (w.shape[1] * 32 // layer.bits)
    return w.shape[0] * w.shape[1]


def _split_cost(layer: nn.Module, policy: ExecutionPolicy) -> int:
    """The layer's multiply-adds per input row in the units `MIN_SPLIT_MACS` / `STREAM_LAG_MACS`
    are measured in (MLX's CPU kernels): a quantized product through `policy`'s CPU kernels
    counts 1 / `QMV_SPEEDUP` of its multiply-adds."""
    macs = _macs(layer)
    if isinstance(layer, nn.QuantizedLinear) and layer.mode == "affine" and layer.bits in (4, 8) and policy.cpu_kernels:
        return macs // QMV_SPEEDUP
    return macs


def prepare_linears(
    module: nn.Module, policy: ExecutionPolicy, *, min_split_macs: int = MIN_SPLIT_MACS, prefix: str = ""
) -> dict[str, list[str]]:
    """Make the Linear / QuantizedLinear layers of `module` their fast versions (same parameters
    up to the exact float32 conversion, bit-identical results) with the weight layout `policy`
    asks for; returns the paths that split, that got float32 copies and that got bf16 W.T.

    bf16 transposed (`policy.bf16_transposed`): dense layers with a bf16 weight, the language
    path's included, except where float32 copies are asked for explicitly
    (`policy.float32_copies` True), get it stored as bf16 W.T (the same bytes, the parameter a
    view of it), whose products the CPU kernels' `float32_matmul` runs without a per-call
    float32 conversion, as fast as on a float32 copy at half its bytes. Float32 copies
    (`float32_copies_within_budget`): the other dense layers with a 16-bit weight, outside the
    language path (`NO_COPY_PREFIXES`, paths taken as `prefix + path`), get their weight
    replaced by its float32 copy (made and evaluated here, so the memory is taken at load; the
    16-bit original is released). Neither kind splits. Split: the other layers with >=
    `min_split_macs` multiply-adds per input row and >= 2 output rows, when the policy has two
    CPU streams. Calling it again re-decides splitting for every layer."""
    bf16_transposed = policy.bf16_transposed
    asked = policy.float32_copies
    extra = sum(
        2 * (m["weight"].size + (m["bias"].size if "bias" in m else 0))
        for m in _copy_candidates(module, prefix)
        if asked or not (bf16_transposed and m["weight"].dtype == mx.bfloat16)
    )
    float32_copies = float32_copies_within_budget(policy, extra)
    split, copied, transposed, pending, pending_bytes = [], [], [], [], 0
    for path, layer in module.named_modules():
        if not isinstance(layer, (nn.Linear, nn.QuantizedLinear)):
            continue
        big = policy.cpu_streams > 1 and layer["weight"].shape[0] >= 2 and _split_cost(layer, policy) >= min_split_macs
        if isinstance(layer, nn.QuantizedLinear):
            layer.__class__ = ParallelQuantizedLinear if big else FastQuantizedLinear
            if big:
                split.append(path)
            continue
        layer.__class__ = FastLinear
        layer.__dict__["_split"] = big
        copies = float32_copies and not _language_path(prefix + path)
        layer.__dict__["_float32_copies"] = copies
        dtype = layer["weight"].dtype
        if not layer._replaced() and (
            (copies and dtype in (mx.bfloat16, mx.float16)) or (bf16_transposed and dtype == mx.bfloat16)
        ):
            # Every other layer's copy on the second CPU stream: the two run at once when
            # evaluated (load at the published shapes: ~3.2 GB of bf16 W.T's).
            second = _load_stream(policy) if len(pending) % 2 else None
            with mx.stream(second if second is not None else mx.default_stream(mx.default_device())):
                if bf16_transposed and dtype == mx.bfloat16 and not (copies and asked):
                    # the same bytes transposed; float32_matmul widens them in its registers
                    replace_weight_transposed(layer, dtype=dtype)
                else:
                    _replace_by_float32(layer)
            pending.append(layer)
            pending_bytes += layer.__dict__["_weight_t"].nbytes
            if pending_bytes >= COPY_EVAL_BYTES:
                _evaluate_copies(pending)
                pending_bytes = 0
        if layer._replaced():
            (copied if layer.__dict__["_weight_t"].dtype == mx.float32 else transposed).append(path)
        elif big:
            split.append(path)
    _evaluate_copies(pending)
    return {"split": split, "float32": copied, "bf16_transposed": transposed}


def _load_stream(policy: ExecutionPolicy):
    """The second CPU stream for `prepare_linears`' copies (None on one stream)."""
    if policy.cpu_streams < 2 or mx.default_device().type != mx.DeviceType.cpu:
        return None
    stream = getattr(_local, "stream", None)
    if stream is None:
        stream = _local.stream = mx.new_stream(mx.cpu)
    return stream


def transposed_dtype(stored_dtype, policy: ExecutionPolicy) -> mx.Dtype:
    """The dtype in which a 16-bit weight's W.T is stored when it is made the only copy:
    bf16 itself where the policy stores bf16 W.T and does not ask for float32 copies, else
    float32 (exact)."""
    bf16 = stored_dtype == mx.bfloat16 and policy.float32_copies is not True and policy.bf16_transposed
    return mx.bfloat16 if bf16 else mx.float32


def derived_views(name: str) -> bool:
    """Whether the `derived` value `name` holds views of arrays counted elsewhere (row halves
    of a weight, per-codebook views, numpy views of stored codebooks): no bytes of its own."""
    return name.startswith("row_halves_") or name.endswith("_views")


def resident_arrays(module: nn.Module):
    """(path, array) for each array `module` keeps, each once: its parameters (path = the
    parameter's), then the derived arrays cached on its modules (voicechat.model.derived.derived,
    path = the module's: MLX arrays, and the numpy float32 copies of voicechat.runtime.host_products);
    derived views of the parameters (`derived_views`) are skipped. What `resident_bytes` and the
    bench's per-stage resident column count."""
    from mlx.utils import tree_flatten

    seen = set()
    for _, m in module.named_modules():
        if replaced_transposed(m):
            seen.add(id(m.__dict__["_weight_t"]))  # same buffer as the `weight` view
    for path, a in tree_flatten(module.parameters()):
        if id(a) not in seen:
            seen.add(id(a))
            yield path, a
    for path, m in module.named_modules():
        for name, (_, value) in m.__dict__.get("_derived", {}).items():
            if derived_views(name):
                continue
            for _, a in tree_flatten(value):
                if isinstance(a, np.ndarray) and _views_mlx_buffer(a):
                    continue  # numpy's view of an MLX array counted above (host_gemm.float32_transposed)
                if isinstance(a, (mx.array, np.ndarray)) and id(a) not in seen:
                    seen.add(id(a))
                    yield path, a


def _views_mlx_buffer(a: np.ndarray) -> bool:
    """Whether numpy array `a` is a view of memory it got through the buffer protocol (MLX's
    arrays export theirs: np.asarray(mx_array) copies nothing), not memory numpy owns."""
    while isinstance(a, np.ndarray):
        a = a.base
    return isinstance(a, memoryview)


def resident_bytes(module: nn.Module) -> int:
    """Bytes of the arrays `module` keeps (`resident_arrays`), each buffer counted once."""
    return sum(a.nbytes for _, a in resident_arrays(module))


def split_rows(fn, x: mx.array, policy: ExecutionPolicy) -> mx.array:
    """fn over the rows of x (axis 0), the second half on `policy`'s second stream; fn must be row-wise."""
    stream = secondary_stream(policy)
    rows = x.shape[0]
    if stream is None or rows < 2:
        return fn(x)
    half = rows // 2
    lo = fn(x[:half])
    with mx.stream(stream):
        hi = fn(x[half:])
    return mx.concatenate([lo, hi], axis=0)
