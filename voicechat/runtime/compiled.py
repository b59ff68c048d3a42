"""Fixed-shape pieces of a frame compiled with `mx.compile` (fused elementwise kernels).

On MLX's CPU backend every operation is dispatched on its own, and the "fast"
ops (rms_norm, rope, attention) run as their compositions of primitive ops, so
a frame at small widths costs thousands of dispatches. `mx.compile` fuses
chains of elementwise operations into one generated kernel each. The pieces
compiled here are pure functions of arrays (parameters are passed in, never
captured, so replaced weights are always seen), their results are bit-identical
to the uncompiled functions (tested: fusion does not change the float32 operation
sequence), and one compiled function serves every layer with the same static
dimensions.

The policy's `compiled` (`ExecutionPolicy`), passed by the `Runtime` that calls these functions,
decides whether they run compiled; its `cpu_kernels` whether the norms take the CPU kernels.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import mlx.core as mx

from voicechat.model.ops import structure
from voicechat.runtime import kernels as cpu_qmv
from voicechat.runtime.policy import ExecutionPolicy

_compiled: dict = {}


def piece(key: tuple, make: Callable[[], Callable], policy: ExecutionPolicy) -> Callable:
    """The function `make()` builds for `key` (static dimensions), compiled when `policy.compiled`.

    Both versions are cached per key, so a layer stack shares one trace. A trace records which
    products it runs (`voicechat.runtime.kernels`'s or MLX's, decided when traced), so the kernels' switch
    is part of the key too."""
    compiled = policy.compiled
    full = (key, compiled, policy.cpu_kernels)
    entry = _compiled.get(full)
    if entry is None:
        fn = make()
        entry = mx.compile(fn) if compiled else fn
        _compiled[full] = entry
    return entry


def layer_weights(layers, x: mx.array, policy: ExecutionPolicy) -> list[dict] | None:
    """Each FastLinear's weights for input `x`, or None if any of them would split across
    streams now under `policy` (or is not a FastLinear): the caller then runs its uncompiled path."""
    out = []
    for layer in layers:
        get = getattr(layer, "unsplit_weights", None)
        w = get(x, policy) if get is not None else None
        if w is None:
            return None
        out.append(w)
    return out


def linear_piece(policy: ExecutionPolicy, name: str, fn: Callable, static: tuple, layers, x: mx.array, *arrays):
    """fn(static, x, *arrays, ws) for a piece around linear layers (`ws[i]` is applied with
    `voicechat.model.ops.apply`): compiled over the layers' weight dicts, or, when one of them
    would split across streams now, run uncompiled over the layers themselves. One definition
    of the piece serves both; `static` (hashable) holds its dimensions and epsilons."""
    weights = layer_weights(layers, x, policy)
    if weights is None:
        return fn(static, x, *arrays, list(layers))
    core = piece((name, static, structure(weights)), lambda: functools.partial(fn, static), policy)
    return core(x, *arrays, weights)


def _rms_norm_core(eps: float, kernels: bool, x: mx.array, weight: mx.array | None) -> mx.array:
    return cpu_qmv.rms_norm(x, weight, eps, enabled=kernels)


def rms_norm(x: mx.array, weight: mx.array | None, eps: float, policy: ExecutionPolicy) -> mx.array:
    """`mx.fast.rms_norm`, one dispatch where the CPU kernels serve it (`cpu_qmv.rms_norm`),
    else as a compiled piece: on a CPU the op runs as its composition, whose elementwise tail
    fuses (3 dispatches instead of ~11, the same float32 operations)."""
    kernels = policy.cpu_kernels
    if cpu_qmv.norm_served(x, weight, enabled=kernels):
        return cpu_qmv.rms_norm(x, weight, eps, served=True, enabled=kernels)
    key = ("rms_norm", eps, weight is None)
    if weight is None:
        return piece(key, lambda: lambda x: _rms_norm_core(eps, kernels, x, None), policy)(x)
    return piece(key, lambda: functools.partial(_rms_norm_core, eps, kernels), policy)(x, weight)


def _layer_norm_core(eps: float, kernels: bool, x: mx.array, p: dict) -> mx.array:
    return layer_norm(x, p, eps, kernels)


def compiled_layer_norm(x: mx.array, p: dict, eps: float, policy: ExecutionPolicy) -> mx.array:
    """`mx.fast.layer_norm` (`p` from `norm_params`), as `rms_norm`: one dispatch or a compiled piece."""
    kernels = policy.cpu_kernels
    if cpu_qmv.norm_served(x, p.get("weight"), p.get("bias"), enabled=kernels):
        return cpu_qmv.layer_norm(x, p.get("weight"), p.get("bias"), eps, served=True, enabled=kernels)
    return piece(
        ("layer_norm", eps, tuple(sorted(p))), lambda: functools.partial(_layer_norm_core, eps, kernels), policy
    )(x, p)


def layer_norm(x: mx.array, p: dict, eps: float, kernels: bool) -> mx.array:
    """`mx.fast.layer_norm` with an nn.LayerNorm's params; the CPU kernels' where they serve it
    (`kernels`: the policy's `cpu_kernels`)."""
    return cpu_qmv.layer_norm(x, p.get("weight"), p.get("bias"), eps, enabled=kernels)


__all__ = ["piece", "layer_weights", "linear_piece", "layer_norm", "rms_norm", "compiled_layer_norm"]
