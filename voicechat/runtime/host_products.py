"""Float32 products with a fixed weight through numpy's BLAS, on MLX's CPU backend.

MLX's Linux CPU wheels link the Netlib reference BLAS, while numpy bundles OpenBLAS, many times
faster for the same product (docs/performance.md). The codec decoder's 1x1 convolutions and
upsamplers are the frame's compute-bound products (each weight reused by hundreds of rows), so
on the CPU backend they go through numpy.

`matmul_t(x, w, owner, name, enabled=...)` is x @ w.T either way: numpy when
`enabled` (the policy's `host_products`, passed by `Runtime`), else MLX. The numpy path evaluates `x` (a host round
trip) and returns a new array; the two paths differ only by float32 summation
order (tested), and the offline and streaming decodes use the same path, so
their agreement is unchanged.

numpy's OpenBLAS worker threads spin for a while after each product and take
the cores MLX's streams need: callers wrap their products in `one_blas_thread()`,
which runs BLAS on the calling thread and restores the user's setting after
(threadpoolctl).

The policy's `host_products` (`ExecutionPolicy`) turns it on: by default for a CPU device
(on Apple silicon MLX's own kernels are the fast path).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import contextvars
import functools
import threading

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from voicechat.model.derived import derived
from voicechat.model.ops import widen_bf16_bits

_controller_lock = threading.Lock()
# Inside `conversation_rows(n, workers)`: x holds n conversations' rows one after the other, and each
# one's product runs on its own rows (the BLAS rounds a row differently in a taller product), on up
# to `workers` threads.
_conversations: contextvars.ContextVar[tuple[int, int]] = contextvars.ContextVar(
    "voicechat_host_conversations", default=(1, 1)
)
_pools: dict[int, concurrent.futures.ThreadPoolExecutor] = {}
# A conversation's product takes the pool from this many multiply-adds on: below it, handing the
# products to threads costs more than it saves (the small presets' codec).
PARALLEL_MIN_MACS = 1 << 22


@contextlib.contextmanager
def conversation_rows(n: int, workers: int = 1):
    """The products inside take x as `n` equal groups of rows, one conversation's each: one host
    round trip for all, then each group's product exactly as that conversation's alone. With
    `workers` > 1 the groups' products (from `PARALLEL_MIN_MACS` each) run on that many threads at
    once, each on one BLAS thread, so each group's bits are the same whichever thread runs it
    (while the codec's products run, MLX's streams wait for them: the cores are free)."""
    if n < 1 or workers < 1:
        raise ValueError(f"conversation_rows: n and workers must be at least 1, got n={n}, workers={workers}")
    token = _conversations.set((n, workers))
    try:
        yield
    finally:
        _conversations.reset(token)


def _pool(workers: int) -> concurrent.futures.ThreadPoolExecutor:
    with _controller_lock:
        pool = _pools.get(workers)
        if pool is None:
            pool = _pools[workers] = concurrent.futures.ThreadPoolExecutor(
                workers, thread_name_prefix="voicechat-host-products"
            )
        return pool


@functools.cache
def _blas_controller():
    """threadpoolctl's controller: it scans the loaded BLAS libraries, so it is made once."""
    from threadpoolctl import ThreadpoolController

    return ThreadpoolController()


@contextlib.contextmanager
def one_blas_thread(enabled: bool):
    """numpy's BLAS on one thread inside the block (when the numpy path is `enabled`), as before after."""
    if not enabled:
        yield
        return
    with _controller_lock:  # one scan, even when two threads ask first at once
        controller = _blas_controller()
    with controller.limit(limits=1, user_api="blas"):
        yield


def float32_transposed(a: mx.array) -> np.ndarray:
    """a.T as a C-contiguous float32 numpy array, each value exactly MLX's `a.astype(float32)`;
    a view of a's own buffer when a is float32 and a.T is contiguous there, else a copy.

    A bf16 weight is transposed as uint16 and widened by `widen_bf16_bits`: one pass over half
    the bytes instead of MLX's conversion, a copy to numpy and a float32 transpose, and no MLX
    float32 temporary."""
    if a.dtype == mx.bfloat16:
        return widen_bf16_bits(np.asarray(a.view(mx.uint16)).T, order="C")
    if a.dtype == mx.float32:
        # np.asarray views MLX's buffer: when a.T is contiguous there (a weight replaced by
        # its float32 W.T, voicechat.runtime.linear.replace_weight_transposed) nothing is copied.
        t = np.asarray(a).T
        return t if t.flags.c_contiguous else np.ascontiguousarray(t)
    return np.ascontiguousarray(np.array(a.astype(mx.float32)).T)


def matmul_t(x: mx.array, w: mx.array, owner: nn.Module, name: str, *, enabled: bool) -> mx.array:
    """x (L, I) @ w (O, I).T as float32 (L, O), through numpy when `enabled`.

    `owner` / `name` key the numpy copy of w.T, made once per weight array (`derived`)."""
    if not enabled:
        out = x @ w.T
        return out if out.dtype == mx.float32 else out.astype(mx.float32)
    w_t = derived(owner, "host_gemm_" + name, (w,), float32_transposed)
    if x.dtype != mx.float32:
        x = x.astype(mx.float32)
    host = np.asarray(x)
    n, workers = _conversations.get()
    if n > 1:
        parts = np.split(host, n)
        if workers > 1 and parts[0].shape[0] * w_t.size >= PARALLEL_MIN_MACS:
            return mx.array(np.concatenate(list(_pool(workers).map(w_t.__rmatmul__, parts))))
        return mx.array(np.concatenate([part @ w_t for part in parts]))
    return mx.array(host @ w_t)


__all__ = ["one_blas_thread", "conversation_rows", "float32_transposed", "matmul_t"]
