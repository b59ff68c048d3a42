"""Building blocks shared by the EAR-TTS modules (docs/model.md §8)."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from voicechat.model import ops
from voicechat.model.derived import derived
from voicechat.model.ops import apply


def one_plus_scale(weight: mx.array, one_plus_in_weight_dtype: bool = False) -> mx.array:
    """The float32 scale 1 + w of `one_plus_rms_norm` (see there for the rounding flag)."""
    if one_plus_in_weight_dtype:
        return (1 + weight).astype(mx.float32)
    return 1.0 + weight.astype(mx.float32)


def one_plus_rms_norm(
    x: mx.array, weight: mx.array, eps: float, *, one_plus_in_weight_dtype: bool = False, scale: mx.array | None = None
) -> mx.array:
    """Gemma RMSNorm: x / sqrt(mean(x²) + eps) · (1 + w).

    `one_plus_in_weight_dtype` rounds 1 + w to the weight dtype first (what the
    reference backbone does with bf16 weights, §12.2 item 6); otherwise 1 + w is
    formed in float32. The norm itself runs in float32 and the result has x's
    dtype (a no-op for the float32 activations used everywhere by default; the
    reference-compatible bf16 text path relies on it).
    """
    if scale is None:  # callers with a module pass the scale made once (voicechat.model.derived)
        scale = one_plus_scale(weight, one_plus_in_weight_dtype)
    return ops.fused_rms_norm(x.astype(mx.float32), scale, eps).astype(x.dtype)


class OnePlusRMSNorm(nn.Module):
    """RMSNorm with "1 + w" in float32 (the char encoder, MoG head and fusion norms); output in x's dtype."""

    def __init__(self, dims: int, eps: float):
        super().__init__()
        self.weight = mx.zeros((dims,))  # 1 + 0: identity scale at init
        self.eps = eps

    def scale(self) -> mx.array:
        """The float32 1 + w, made once per weight."""
        return derived(self, "scale", (self.weight,), one_plus_scale)

    def __call__(self, x: mx.array) -> mx.array:
        return one_plus_rms_norm(x, self.weight, self.eps, scale=self.scale())


class GeluGatedMLP(nn.Module):
    """down(gelu_tanh(gate(x)) ⊙ up(x)), no biases."""

    def __init__(self, hidden: int, intermediate: int):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, intermediate, bias=False)
        self.up_proj = nn.Linear(hidden, intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)

    def __call__(self, x: mx.array) -> mx.array:
        return gated_mlp(x, self.gate_proj, self.up_proj, self.down_proj)


def gated_mlp(u: mx.array, gate, up, down) -> mx.array:
    """down(gelu_tanh(gate(u)) ⊙ up(u)); each of gate, up, down a linear layer or the weights
    weights a fused piece received for it (`ops.apply`)."""
    # nn.gelu_approx is the tanh form 0.5u(1 + tanh(√(2/π)(u + 0.044715u³))).
    return apply(nn.gelu_approx(apply(u, gate)) * apply(u, up), down)


def repeat_kv_heads(x: mx.array, num_heads: int) -> mx.array:
    """(B, KV, T, D) -> (B, H, T, D): KV head j serves query heads [j·H/KV, (j+1)·H/KV)."""
    kv = x.shape[1]
    return x if kv == num_heads else mx.repeat(x, num_heads // kv, axis=1)


# ----------------------------------------------------------------- input checks


def is_integer_dtype(dtype) -> bool:
    return mx.issubdtype(dtype, mx.integer)


def as_int_array(value, name: str) -> mx.array:
    """An integer mx.array from an mx.array / numpy array / list; TypeError for anything else."""
    if isinstance(value, mx.array):
        arr = value
    elif isinstance(value, (np.ndarray, list, tuple)):
        np_arr = np.asarray(value)
        if np_arr.dtype == object:
            raise TypeError(f"{name}: expected an integer array, got an object array")
        if not np.issubdtype(np_arr.dtype, np.integer):
            raise TypeError(f"{name}: expected an integer array, got dtype {np_arr.dtype}")
        arr = mx.array(np_arr)
    else:
        raise TypeError(f"{name}: expected an integer mx.array or numpy array, got {type(value).__name__}")
    if not is_integer_dtype(arr.dtype):
        raise TypeError(f"{name}: expected an integer array, got dtype {arr.dtype}")
    return arr


def check_value_range(arr: mx.array, name: str, low: int, high: int) -> None:
    """Raise ValueError unless low <= arr <= high everywhere (one small host sync)."""
    if arr.size == 0:
        return
    lo, hi = int(arr.min().item()), int(arr.max().item())
    if lo < low or hi > high:
        raise ValueError(f"{name}: values must lie in [{low}, {high}], got min {lo}, max {hi}")
