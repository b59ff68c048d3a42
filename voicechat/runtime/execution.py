"""`Runtime`: one model's execution policy, as the implementation of the op seam it binds.

`voicechat.model.ops` names the operations a component computes with; a `Runtime` says how each runs
under its `ExecutionPolicy` (compiled pieces, the CPU kernels, two CPU streams, numpy's BLAS,
evaluation ahead of graph building). It is made once per model by `prepare` and bound around
each frame (`runtime.frame()`) and each offline run, on the thread that runs it: nothing about
execution is process-wide, so two models with different policies can share a process. It hands
its policy (or the one field they need) to the runtime's functions it calls: none of them looks
a policy up.
"""

from __future__ import annotations

import contextlib

import mlx.core as mx

from voicechat.model import ops
from voicechat.model.derived import derived
from voicechat.runtime import compiled, host_products, kernels, linear, overlap
from voicechat.runtime.policy import ExecutionPolicy


class Runtime(ops.PlainOps):
    """The op seam under `policy` (see `voicechat.model.ops` for each operation's meaning)."""

    def __init__(self, policy: ExecutionPolicy):
        if not isinstance(policy, ExecutionPolicy):
            raise TypeError(f"Runtime expects an ExecutionPolicy, got {type(policy).__name__}")
        self.policy = policy

    def __repr__(self) -> str:
        return f"Runtime({self.policy.describe()})"

    def frame(self):
        """A with-block in which this thread's components run under this runtime."""
        return ops.bound(self)

    def fused(self, key, make):
        return compiled.piece(key, make, self.policy)

    def fused_linear(self, name, fn, static, layers, x, *arrays):
        return compiled.linear_piece(self.policy, name, fn, static, layers, x, *arrays)

    def linear_weights(self, x, w):
        return linear.linear(x, w, cpu_kernels=self.policy.cpu_kernels)

    def prepared_linear(self, layer, x):
        return layer.forward(x, self.policy)

    def rms_norm(self, x, weight, eps):
        return kernels.rms_norm(x, weight, eps, enabled=self.policy.cpu_kernels)

    def layer_norm(self, x, weight, bias, eps):
        return kernels.layer_norm(x, weight, bias, eps, enabled=self.policy.cpu_kernels)

    def fused_rms_norm(self, x, weight, eps):
        return compiled.rms_norm(x, weight, eps, self.policy)

    def fused_layer_norm(self, x, weight, bias, eps):
        params = {k: v for k, v in (("weight", weight), ("bias", bias)) if v is not None}
        return compiled.compiled_layer_norm(x, params, eps, self.policy)

    def float32_matmul(self, x, wt):
        return kernels.float32_matmul(x, wt, enabled=self.policy.cpu_kernels)

    def batched_matvec(self, a, x):
        return kernels.batched_matvec(a, x, enabled=self.policy.cpu_kernels)

    def float32_matmul_t(self, x, w, owner, name):
        # The CPU kernel reads a contiguous W.T (made once per weights, in the stored dtype: the
        # kernel widens bf16 exactly); without the kernels MLX's own product takes w.T as it is.
        if not self.policy.cpu_kernels or w.dtype not in (mx.float32, mx.bfloat16):
            return x @ w.T
        wt = derived(owner, "transposed_" + name, (w,), lambda a: mx.contiguous(a.T))
        return kernels.float32_matmul(x, wt, enabled=True)

    def rvq_pass(self, residual, books_t, norms):
        return kernels.rvq_pass(residual, books_t, norms, enabled=self.policy.cpu_kernels)

    def after_layer(self, *arrays):
        overlap.start(*arrays, enabled=self.policy.overlap)

    def rowwise(self, fn, x):
        # With the products on the host (numpy's BLAS), the halves would not run at once.
        return fn(x) if self.policy.host_products else linear.split_rows(fn, x, self.policy)

    def host_products(self) -> bool:
        return self.policy.host_products

    def matmul_t(self, x, w, owner, name):
        return host_products.matmul_t(x, w, owner, name, enabled=self.policy.host_products)

    def products_scope(self, conversations: int = 1):
        if conversations == 1 or not self.policy.host_products:
            return host_products.one_blas_thread(self.policy.host_products)
        scope = contextlib.ExitStack()
        scope.enter_context(host_products.one_blas_thread(True))
        scope.enter_context(host_products.conversation_rows(conversations, workers=self.policy.cpu_streams))
        return scope


__all__ = ["Runtime"]
