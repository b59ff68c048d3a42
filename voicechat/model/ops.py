"""The op seam: the few operations whose execution a runtime may choose.

Model components (mel, conformer, rnnt, nemotron_h, ear_tts, codec) compute with `mlx` and with
the functions below. Each has a plain meaning, and its default is that meaning written with
`mx` / `mx.fast`: `fused(key, make)` is `make()`, `rms_norm` is `mx.fast.rms_norm`,
`after_layer` does nothing. A runtime (`voicechat.runtime`) binds its own implementation for a
frame with `bound(impl)`; inside that block the same calls may run compiled, on the CPU kernels,
split across two CPU streams, through numpy's BLAS or evaluated ahead. Every implementation
computes the same values (bit for bit, except `matmul_t` on the host: float32 rounding).

Nothing here imports the runtime; the binding is per thread, so two models with different
execution policies can run in one process.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable

import mlx.core as mx
import mlx.nn as nn
import numpy as np


class PlainOps:
    """The seam's meaning, with `mx` / `mx.fast` only: what runs when no runtime is bound."""

    policy = None

    def fused(self, key: tuple, make: Callable[[], Callable]) -> Callable:
        return make()

    def fused_linear(self, name: str, fn: Callable, static: tuple, layers, x, *arrays):
        return fn(static, x, *arrays, list(layers))

    def linear_weights(self, x: mx.array, w: dict) -> mx.array:
        raise TypeError("a weights dict reaches `ops.apply` only from a runtime's fused_linear")

    def prepared_linear(self, layer, x: mx.array) -> mx.array:
        return layer.forward(x, None)

    def rms_norm(self, x, weight, eps):
        return mx.fast.rms_norm(x, weight, eps)

    def layer_norm(self, x, weight, bias, eps):
        return mx.fast.layer_norm(x, weight, bias, eps)

    def fused_rms_norm(self, x, weight, eps):
        return mx.fast.rms_norm(x, weight, eps)

    def fused_layer_norm(self, x, weight, bias, eps):
        return mx.fast.layer_norm(x, weight, bias, eps)

    def float32_matmul(self, x, wt):
        return mx.matmul(x, wt)

    def batched_matvec(self, a, x):
        return mx.matmul(a, x)

    def float32_matmul_t(self, x, w, owner, name):
        return x @ w.T

    def rvq_pass(self, residual, books_t, norms):
        return None

    def after_layer(self, *arrays) -> None:
        return None

    def rowwise(self, fn, x):
        return fn(x)

    def host_products(self) -> bool:
        return False

    def matmul_t(self, x, w, owner, name):
        out = x @ w.T
        return out if out.dtype == mx.float32 else out.astype(mx.float32)

    def products_scope(self, conversations: int = 1):
        return contextlib.nullcontext()


PLAIN = PlainOps()


class _Bound(threading.local):
    ops = PLAIN


_bound = _Bound()


def current():
    """The implementation bound on this thread (`PLAIN` outside a runtime's frame)."""
    return _bound.ops


@contextlib.contextmanager
def bound(impl):
    """Run the block with `impl` as this thread's implementation of the seam; the previous one
    after. A runtime binds its own around each frame (and around offline runs)."""
    saved = _bound.ops
    _bound.ops = impl
    try:
        yield impl
    finally:
        _bound.ops = saved


# -- the seam, as components call it


def fused(key: tuple, make: Callable[[], Callable]) -> Callable:
    """The pure function `make()` builds for the static dimensions `key` (parameters are passed
    in, never captured); a runtime may return it compiled, shared by every call with `key`."""
    return _bound.ops.fused(key, make)


def fused_linear(name: str, fn: Callable, static: tuple, layers, x: mx.array, *arrays):
    """fn(static, x, *arrays, ws) for a piece around linear `layers`: `ws[i]` is layer i, or the
    weights a runtime passes in its place; fn applies each with `apply`."""
    return _bound.ops.fused_linear(name, fn, static, layers, x, *arrays)


def apply(x: mx.array, w) -> mx.array:
    """A linear layer on x: `w` is the layer, or the weights a runtime's `fused_linear` gave."""
    return w(x) if isinstance(w, nn.Module) else _bound.ops.linear_weights(x, w)


def prepared_linear(layer, x: mx.array) -> mx.array:
    """A linear layer a runtime's `prepare` gave its own class (`voicechat.runtime.linear`) calls
    this from `__call__`: `layer.forward(x, policy)` with the bound runtime's policy (None
    unbound: MLX's kernels on one stream, the same values)."""
    return _bound.ops.prepared_linear(layer, x)


def rms_norm(x, weight, eps):
    """`mx.fast.rms_norm` (inside a fused piece)."""
    return _bound.ops.rms_norm(x, weight, eps)


def layer_norm(x, weight, bias, eps):
    """`mx.fast.layer_norm` (inside a fused piece)."""
    return _bound.ops.layer_norm(x, weight, bias, eps)


def fused_rms_norm(x, weight, eps):
    """`mx.fast.rms_norm` as a piece of its own (a runtime may fuse its composition)."""
    return _bound.ops.fused_rms_norm(x, weight, eps)


def fused_layer_norm(x, weight, bias, eps):
    """`mx.fast.layer_norm` as a piece of its own."""
    return _bound.ops.fused_layer_norm(x, weight, bias, eps)


def float32_matmul(x, wt):
    """x @ wt for float32 x and a 2-D wt (K, N) stored as the product reads it."""
    return _bound.ops.float32_matmul(x, wt)


def batched_matvec(a: mx.array, x: mx.array) -> mx.array:
    """a @ x for float32 a (..., P, K) and x (..., K, 1) (x's innermost batch axis may be 1): a batch of
    matrix-vector products with mx.matmul's bits; a runtime may run the batch as one task."""
    return _bound.ops.batched_matvec(a, x)


def float32_matmul_t(x: mx.array, w: mx.array, owner: nn.Module, name: str) -> mx.array:
    """x @ w.T for float32 x and a 2-D w (O, I), the bits of `mx.matmul`; a runtime may run it on a
    contiguous w.T kept once per weights (`owner` / `name` key it)."""
    return _bound.ops.float32_matmul_t(x, w, owner, name)


def rvq_pass(residual, books_t, norms):
    """Greedy RVQ of one float32 row over `books_t` (count, latent, C) with squared norms `norms`
    (count, C) in one operation -> (codes, residual), or None: the caller then runs the search
    codebook by codebook (the same values)."""
    return _bound.ops.rvq_pass(residual, books_t, norms)


def after_layer(*arrays) -> None:
    """A layer's output is complete: a runtime may start evaluating it while the next layer is built."""
    _bound.ops.after_layer(*arrays)


def rowwise(fn: Callable, x: mx.array) -> mx.array:
    """fn over the rows of x, fn row-wise (a runtime may run the two halves at once)."""
    return _bound.ops.rowwise(fn, x)


def host_products() -> bool:
    """Whether the runtime runs the codec's float32 products on the host (`matmul_t`), where
    numpy-side data preparation is then the cheaper path."""
    return _bound.ops.host_products()


def matmul_t(x: mx.array, w: mx.array, owner: nn.Module, name: str) -> mx.array:
    """x (L, I) @ w (O, I).T as float32; `owner` / `name` key any copy of w a runtime keeps."""
    return _bound.ops.matmul_t(x, w, owner, name)


def products_scope(conversations: int = 1):
    """A with-block around a run of `matmul_t` products (a runtime may set its BLAS up there). With
    `conversations` = n, x holds n conversations' rows one after the other, in equal groups: a
    runtime whose products would round a row differently in a taller product (numpy's BLAS)
    computes each group alone."""
    return _bound.ops.products_scope(conversations)


# -- helpers shared by components and the runtime (pure; no execution choice)


def rows_of(x: mx.array, count: int) -> list[mx.array]:
    """x's `count` rows along axis 0, each keeping that axis (x itself for one row: a conversation
    computed alone runs the same operations as before batches existed)."""
    if x.shape[0] != count:
        raise ValueError(f"expected {count} rows along axis 0, got shape {tuple(x.shape)}")
    return [x] if count == 1 else [x[b : b + 1] for b in range(count)]


def stack_rows(rows: list[mx.array]) -> mx.array:
    """The inverse of `rows_of`."""
    return rows[0] if len(rows) == 1 else mx.concatenate(rows, axis=0)


def structure(trees) -> tuple:
    """The key sets of a list of dicts (e.g. which layers have a bias): part of a fused piece's
    key, since the traced function depends on them."""
    return tuple(tuple(sorted(t)) for t in trees)


def norm_params(norm) -> dict:
    """weight / bias of an nn.LayerNorm as `mx.fast.layer_norm` receives them."""
    return {k: norm[k] for k in ("weight", "bias") if k in norm}


def stored_transposed(module: nn.Module) -> mx.array | None:
    """The contiguous W.T that `module.weight` is a view of, when the runtime's `prepare` stored
    the weight that way (and it has not been replaced since); else None."""
    view = module.__dict__.get("_weight_view")
    if view is not None and "weight" in module and view is module["weight"]:
        return module.__dict__["_weight_t"]
    return None


def widen_bf16_bits(bits: np.ndarray, order: str = "K") -> np.ndarray:
    """float32 values of bfloat16 `bits` (uint16; numpy has no bf16): a bf16 value is the upper
    half of its float32, so the widening is a 16-bit shift, MLX's own conversion bit for bit."""
    return np.left_shift(bits, 16, dtype=np.uint32, order=order).view(np.float32)


__all__ = [
    "PLAIN",
    "PlainOps",
    "after_layer",
    "apply",
    "bound",
    "current",
    "float32_matmul",
    "fused",
    "fused_layer_norm",
    "fused_linear",
    "fused_rms_norm",
    "host_products",
    "layer_norm",
    "matmul_t",
    "norm_params",
    "prepared_linear",
    "products_scope",
    "rms_norm",
    "rowwise",
    "rvq_pass",
    "stored_transposed",
    "structure",
    "widen_bf16_bits",
]
