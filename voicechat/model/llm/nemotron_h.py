"""Nemotron-H hybrid language model backbone (docs/model.md §7).

A stack of pre-norm residual blocks, h = x + mixer(RMSNorm(x)), whose mixer
is a Mamba-2 SSM ("M"), a squared-ReLU MLP ("-") or a GQA attention layer
without positional encoding ("*"), as `hybrid_override_pattern` says, then a
final RMSNorm `norm_f`. The caller supplies the input embeddings (1, L, hidden)
and receives the normalised final hidden states (1, L, hidden); the token
embedding and the output heads live one level up.

Two evaluation paths share the same weights and the same `NemotronHState`:

* a sequence pass (any L, optionally continuing from a state): the Mamba
  recurrence is evaluated exactly with the chunked SSD formulation;
* a single-step update (L == 1 with a state): the plain recurrence.

Activations are float32 whatever the weight dtype (bf16 or quantized weights
promote to float32 in MLX); the SSM state is always float32.

`reference_rounding` (default True; `voicechat.load(..., numerics="float32")`
turns it off) rounds where the reference (mlx-vlm) does: the decay rate
A = -exp(A_log) is evaluated in A_log's stored dtype (bf16 in the published
layout) before it is widened, and a system prompt is prefilled one position at
a time as the reference steps it. Off: A in float32 and the prompt in one
sequence pass (same mathematics, another float32 summation order).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from voicechat.model import ops
from voicechat.model.config import TextConfig
from voicechat.model.derived import derived
from voicechat.model.ops import rows_of, stack_rows
from voicechat.model.rows import BlockRow, block_with_room, gather_rows, members_with, padded_to, spread_rows

SSD_CHUNK_SIZE = 256  # steps per chunk of the SSD scan (§7.2)
KV_ALLOC_STEP = 256  # attention K/V buffers grow in multiples of this many positions (§7.3)


def _capacity_for(length: int) -> int:
    """The capacity a K/V buffer grows to for `length` positions (solo and in a block alike)."""
    return -(-length // KV_ALLOC_STEP) * KV_ALLOC_STEP


# --------------------------------------------------------------------------- helpers


class RMSNorm(nn.Module):
    """y = weight ⊙ x / sqrt(mean(x²) + eps), computed in the activation dtype."""

    def __init__(self, dims: int, eps: float):
        super().__init__()
        self.weight = mx.ones((dims,))
        self.eps = eps

    def __call__(self, x: mx.array) -> mx.array:
        return ops.fused_rms_norm(x, self.weight_as(x.dtype), self.eps)

    def weight_as(self, dtype) -> mx.array:
        """The weight in the activation dtype, made once per weight."""
        return derived(self, f"weight_{dtype}", (self.weight,), lambda w: w.astype(dtype))


class DepthwiseCausalConv1d(nn.Module):
    """Per-channel causal conv over time; weight in MLX Conv1d layout (C, K, 1).

    Evaluated explicitly as a K-tap weighted sum over [state, inputs] so the
    sequence pass and the single step perform the same arithmetic.
    """

    def __init__(self, channels: int, kernel_size: int, bias: bool):
        super().__init__()
        bound = 1.0 / math.sqrt(kernel_size)  # fan-in of a depthwise tap is K
        self.weight = mx.random.uniform(-bound, bound, (channels, kernel_size, 1))
        if bias:
            self.bias = mx.random.uniform(-bound, bound, (channels,))
        self.kernel_size = kernel_size

    def __call__(self, padded: mx.array) -> mx.array:
        """padded: (1, K-1+L, C) = previous K-1 inputs followed by L new ones -> (1, L, C)."""
        taps, bias = self.taps(padded.dtype)
        return _tap_sum(padded, taps, bias, padded.shape[1] - (self.kernel_size - 1))

    def taps(self, dtype) -> tuple[list[mx.array], mx.array | None]:
        """Per-tap weight columns (C,) and the bias (or None) in `dtype`, made once per weights."""

        def make(weight, bias=None):
            w = weight[:, :, 0].astype(dtype)  # (C, K)
            return [w[:, j] for j in range(self.kernel_size)], None if bias is None else bias.astype(dtype)

        params = (self.weight, self.bias) if "bias" in self else (self.weight,)
        return derived(self, f"taps_{dtype}", params, make)


def _tap_sum(padded: mx.array, taps: list[mx.array], bias: mx.array | None, length: int) -> mx.array:
    """The K-tap causal sum over padded (1, K-1+L, C) -> (1, L, C), taps in a fixed order."""
    return _tap_sum_of([padded[:, j : j + length, :] for j in range(len(taps))], taps, bias)


def _tap_sum_of(inputs: list[mx.array], taps: list[mx.array], bias: mx.array | None) -> mx.array:
    """Σ_j inputs[j] · taps[j] (+ bias), in tap order: the causal conv over its K shifted inputs."""
    out = inputs[0] * taps[0]
    for j in range(1, len(taps)):
        out = out + inputs[j] * taps[j]
    return out + bias if bias is not None else out


def _split_projection(zxbcdt: mx.array, pad: int, d_inner: int, conv_dim: int):
    """in_proj output -> (z, xBC, dt), skipping `pad` leading padding columns (§7.2)."""
    z = zxbcdt[..., pad : pad + d_inner]
    xbc = zxbcdt[..., pad + d_inner : pad + d_inner + conv_dim]
    return z, xbc, zxbcdt[..., pad + d_inner + conv_dim :]


def _append_conv_state(conv_state: mx.array, xbc: mx.array, k: int) -> tuple[mx.array, mx.array]:
    """-> (the K-1 cached inputs followed by xbc, the new conv state: its last K-1 rows)."""
    padded = mx.concatenate([conv_state.astype(xbc.dtype), xbc], axis=1)
    return padded, padded[:, -(k - 1) :, :].astype(conv_state.dtype)


def _time_steps(dt: mx.array, dt_bias: mx.array, dt_min: float, dt_max: float) -> mx.array:
    return mx.clip(nn.softplus(dt + dt_bias), dt_min, dt_max)


def _gated_norm(y: mx.array, z: mx.array, groups: int, eps: float, norm_w: mx.array) -> mx.array:
    """norm.weight ⊙ groupRMS(y ⊙ SiLU(z)) over `groups` contiguous channel groups; y, z (B, L, d)."""
    rows, length, d = y.shape
    u = (y * nn.silu(z)).reshape(rows, length, groups, d // groups)
    return ops.rms_norm(u, None, eps).reshape(rows, length, d) * norm_w


def _segment_sums(log_decay: mx.array) -> mx.array:
    """(..., T) -> (..., T, T) with [t, s] = sum(log_decay[s+1..t]) for t >= s, -inf above.

    Built as a masked cumulative sum (not cum[t] - cum[s]) so long chunks do
    not lose precision to cancellation.
    """
    t = log_decay.shape[-1]
    rows = mx.repeat(log_decay[..., :, None], t, axis=-1)  # [t, s] = log_decay[t]
    strictly_lower = mx.tril(mx.ones((t, t), dtype=mx.bool_), k=-1)
    sums = mx.cumsum(mx.where(strictly_lower, rows, 0.0), axis=-2)
    lower = mx.tril(mx.ones((t, t), dtype=mx.bool_), k=0)
    return mx.where(lower, sums, -mx.inf)


# --------------------------------------------------------------------------- state


class MambaRows:
    """The Mamba states of several conversations as one stacked block: the conv rows (each
    (C, 1, conv_dim)) and SSM states (C, heads, head_dim, state) a batched step produced. While the
    next step takes the same conversations in the same order, each still row i of the block, it
    reads the block as it is: no stacking and no per-row slices between steps."""

    def __init__(self, rows: list[mx.array], ssm: mx.array, size: int):
        self.rows, self.ssm, self.size = rows, ssm, size


class MambaLayerState(BlockRow[MambaRows]):
    """Cache of one Mamba-2 layer: conv inputs of the last K-1 steps and the SSM state."""

    def __init__(self, conv: mx.array, ssm: mx.array):
        self._block: tuple[MambaRows, int] | None = None
        self.conv = conv  # (1, K-1, conv_dim), activation dtype
        self.ssm = ssm  # (1, heads, head_dim, state), float32

    # The single step reads and writes the conv state as its K-1 rows (1, 1, conv_dim): no
    # concatenate and slices per step. `conv` and `conv_rows` are two views of one state; each
    # is made from the other only when asked for (inspection, the sequence pass). After a batched
    # step the state is row i of a `MambaRows` block; its own arrays are cut from it when asked for.

    def _own(self) -> None:
        if self._block is not None:
            block, i = self._block
            self._block = None
            self._conv, self._rows = None, [r[i : i + 1] for r in block.rows]
            self._ssm = block.ssm[i : i + 1]

    def in_block(self, block: MambaRows, index: int) -> None:
        """This state is now row `index` of `block` (a batched step's result)."""
        self._block = (block, index)
        self._conv = self._rows = self._ssm = None

    @property
    def ssm(self) -> mx.array:
        self._own()
        return self._ssm

    @ssm.setter
    def ssm(self, value: mx.array) -> None:
        self._own()
        self._ssm = value

    @property
    def conv(self) -> mx.array:
        self._own()
        if self._conv is None:
            self._conv = mx.concatenate(self._rows, axis=1)
        return self._conv

    @conv.setter
    def conv(self, value: mx.array) -> None:
        self._own()
        self._conv, self._rows = value, None

    @property
    def conv_rows(self) -> list[mx.array]:
        self._own()
        if self._rows is None:
            self._rows = [self._conv[:, j : j + 1] for j in range(self._conv.shape[1])]
        return self._rows

    @conv_rows.setter
    def conv_rows(self, rows: list[mx.array]) -> None:
        self._own()
        self._conv, self._rows = None, list(rows)

    def copy(self) -> MambaLayerState:
        return MambaLayerState(mx.array(self.conv), mx.array(self.ssm))

    def reset(self) -> None:
        self.conv = mx.zeros_like(self.conv)
        self.ssm = mx.zeros_like(self.ssm)

    def arrays(self) -> dict[str, mx.array]:
        return {"conv": self.conv, "ssm": self.ssm}

    # -- as arrays + metadata (voicechat/io/states.py)

    @property
    def state(self) -> dict[str, mx.array]:
        """{"conv": (1, K-1, conv_dim), "ssm": (1, heads, head_dim, state)}."""
        return {"conv": self.conv, "ssm": self.ssm}

    @property
    def meta_state(self) -> str:
        return "mamba"

    @classmethod
    def from_state(cls, state: dict, meta_state, like: MambaLayerState) -> MambaLayerState:
        """The layer's state from `state` / `meta_state`, of the shapes of `like` (a fresh one)."""
        conv, ssm = state["conv"], state["ssm"]
        if meta_state != "mamba" or conv.shape != like.conv.shape or ssm.shape != like.ssm.shape:
            raise ValueError(
                f"Mamba state of shapes {conv.shape} / {ssm.shape}, the model "
                f"needs {like.conv.shape} / {like.ssm.shape}"
            )
        return cls(conv, ssm)

    @property
    def nbytes(self) -> int:
        return self.conv.nbytes + self.ssm.nbytes


_NO_BUFFER = mx.zeros((0,))


class AttentionRows:
    """The K/V caches of one attention layer for several conversations as one block: `keys`,
    `values` (C, kv_heads, capacity, head_dim), member c's at row c, its positions where its own
    buffer holds them; the last index is a scratch column no member sees. A single step of any
    subset of the members writes each stepping row's K/V with one scatter (the others write zeros
    into the scratch column) and attends with one masked pass (each row sees its own valid
    positions); the block stays across steps, whichever members take them, and is made anew only
    when a conversation not in it steps. A member's own buffers are cut from it when it is read
    alone. `members[c]`: the state at row c, None once released."""

    def __init__(self, keys: mx.array, values: mx.array, members: list):
        self.keys, self.values, self.members = keys, values, members

    @property
    def size(self) -> int:
        return len(self.members)


class AttentionLayerState(BlockRow[AttentionRows]):
    """K/V cache of one attention layer: buffers (1, kv_heads, capacity, head_dim).

    Positions [0, length) are valid; capacity grows in steps of KV_ALLOC_STEP. After a batched
    step the buffers are row i of an `AttentionRows` block (capacity: this state's own)."""

    def __init__(self, keys: mx.array, values: mx.array, length: int = 0):
        self._block: tuple[AttentionRows, int] | None = None
        self._cap = 0
        self._keys, self._values = keys, values
        self._kv_heads, self._head_dim, self._dtype = keys.shape[1], keys.shape[3], keys.dtype
        self.length = length

    def _cut(self) -> tuple[mx.array, mx.array]:
        block, i = self._block  # type: ignore[misc]
        return block.keys[i : i + 1, :, : self._cap], block.values[i : i + 1, :, : self._cap]

    def _buffers(self) -> tuple[mx.array, mx.array]:
        """Its own K/V buffers: cut from its block (which it stays in), or its own arrays."""
        return self._cut() if self._block is not None else (self._keys, self._values)

    def _own(self) -> None:
        if self._block is not None:
            block, i = self._block
            self._keys, self._values = self._cut()
            self._block = None
            block.members[i] = None  # its row is free: a new block leaves it out

    def in_block(self, block: AttentionRows, index: int, capacity: int) -> None:
        """This state's buffers are now row `index` of `block`, its own capacity `capacity`."""
        self._block, self._cap = (block, index), capacity
        self._keys = self._values = _NO_BUFFER  # its own buffers are dropped: the block holds them

    def release(self) -> None:
        """Leave the block for good (the session closed): own copies of its buffers, made now so
        they do not hold the block's memory, and its row becomes a free row of the block."""
        if self._block is not None:
            block, i = self._block
            keys, values = (mx.array(a) for a in self._cut())
            mx.eval(keys, values)
            self._keys, self._values, self._block = keys, values, None
            block.members[i] = None

    @property
    def keys(self) -> mx.array:
        self._own()
        return self._keys

    @keys.setter
    def keys(self, value: mx.array) -> None:
        self._own()
        self._keys = value

    @property
    def values(self) -> mx.array:
        self._own()
        return self._values

    @values.setter
    def values(self, value: mx.array) -> None:
        self._own()
        self._values = value

    @property
    def kv_heads(self) -> int:
        return self._kv_heads

    @property
    def head_dim(self) -> int:
        return self._head_dim

    @property
    def dtype(self) -> mx.Dtype:
        return self._dtype

    @property
    def capacity(self) -> int:
        return self._cap if self._block is not None else self._keys.shape[2]

    def append(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        """Write `keys`/`values` (1, kv_heads, L, head_dim) after the valid positions;
        return all valid keys and values."""
        new_len = self.length + keys.shape[2]
        if new_len > self.capacity:
            new_capacity = _capacity_for(new_len)
            pad_shape = (1, self.keys.shape[1], new_capacity - self.length, self.keys.shape[3])
            self.keys = mx.concatenate([self.keys[:, :, : self.length], mx.zeros(pad_shape, self.keys.dtype)], axis=2)
            self.values = mx.concatenate(
                [self.values[:, :, : self.length], mx.zeros(pad_shape, self.values.dtype)], axis=2
            )
        self.keys[:, :, self.length : new_len, :] = keys.astype(self.keys.dtype)
        self.values[:, :, self.length : new_len, :] = values.astype(self.values.dtype)
        self.length = new_len
        return self.keys[:, :, :new_len], self.values[:, :, :new_len]

    def copy(self) -> AttentionLayerState:
        # New array objects: slice assignment rebinds the object it is applied to,
        # so sharing objects would let one copy's update leak into the other. A state in a block
        # stays there; the copy gets its own cut.
        keys, values = self._buffers()
        return AttentionLayerState(mx.array(keys), mx.array(values), self.length)

    def reset(self) -> None:
        """Forget every position; the allocated capacity is kept for reuse."""
        self.length = 0

    def arrays(self) -> dict[str, mx.array]:
        return {"keys": self.keys[:, :, : self.length], "values": self.values[:, :, : self.length]}

    # -- as arrays + metadata (voicechat/io/states.py)

    @property
    def state(self) -> dict[str, mx.array]:
        """{"keys", "values"}: the whole buffers (1, kv_heads, capacity, head_dim), spare capacity
        included, so a rebuilt state grows (and counts its bytes) as this one does."""
        return {"keys": self.keys, "values": self.values}

    @property
    def meta_state(self) -> list:
        """["attention", length]."""
        return ["attention", self.length]

    @classmethod
    def from_state(cls, state: dict, meta_state, like: AttentionLayerState) -> AttentionLayerState:
        """The layer's cache from `state` / `meta_state`, with `like`'s heads and head size."""
        k, v = state["keys"], state["values"]
        kind, length = meta_state
        if (
            kind != "attention"
            or k.shape[:2] != like.keys.shape[:2]
            or k.shape[3] != like.keys.shape[3]
            or v.shape != k.shape
            or not 0 <= length <= k.shape[2]
        ):
            raise ValueError(
                f"K/V of shape {k.shape}, length {length}; the model needs "
                f"(1, {like.keys.shape[1]}, n, {like.keys.shape[3]})"
            )
        return cls(k, v, int(length))

    @property
    def nbytes(self) -> int:
        return 2 * self._kv_heads * self.capacity * self._head_dim * self._dtype.size


class NemotronHState:
    """Recurrent / KV state of the whole stack, one entry per layer (None for MLP layers).

    `offset` counts the positions consumed so far.
    """

    def __init__(self, layers: list, offset: int = 0):
        self.layers = layers
        self.offset = offset

    def copy(self) -> NemotronHState:
        return NemotronHState([None if s is None else s.copy() for s in self.layers], self.offset)

    def reset(self) -> None:
        """Back to the fresh state (zero conv/SSM states, no K/V positions, offset 0)."""
        for s in self.layers:
            if s is not None:
                s.reset()
        self.offset = 0

    def arrays(self) -> dict[str, mx.array]:
        """`layers.{i}.conv` (1, K-1, conv_dim), `layers.{i}.ssm` (1, heads, head_dim, state)
        for Mamba layers; `layers.{i}.keys` / `layers.{i}.values` (1, kv_heads, offset,
        head_dim), the valid positions only, for attention layers."""
        out = {}
        for i, layer_state in enumerate(self.layers):
            if layer_state is not None:
                for name, arr in layer_state.arrays().items():
                    out[f"layers.{i}.{name}"] = arr
        return out

    # -- as arrays + metadata (voicechat/io/states.py)

    @property
    def state(self) -> dict[str, mx.array]:
        """Each layer's `state` under its index: `{i}.conv` / `{i}.ssm` (Mamba), `{i}.keys` /
        `{i}.values` (attention, whole buffers); MLP layers hold none."""
        out = {}
        for i, layer_state in enumerate(self.layers):
            if layer_state is not None:
                for name, arr in layer_state.state.items():
                    out[f"{i}.{name}"] = arr
        return out

    @property
    def meta_state(self) -> dict:
        """{"offset": positions consumed, "layers": per layer None (MLP), "mamba" or ["attention", length]}."""
        return {"offset": self.offset, "layers": [None if s is None else s.meta_state for s in self.layers]}

    @classmethod
    def from_state(cls, state: dict, meta_state: dict, like: NemotronHState) -> NemotronHState:
        """The stack's state from `state` / `meta_state`; `like` (the model's fresh state) gives
        each layer's kind and shapes."""
        kinds = meta_state["layers"]
        if len(kinds) != len(like.layers):
            raise ValueError(f"{len(kinds)} language layers stored, the model has {len(like.layers)}")
        layers = []
        for i, (kind, ref) in enumerate(zip(kinds, like.layers, strict=True)):
            if ref is None:
                if kind is not None:
                    raise ValueError(f"language layer {i}: state stored for a layer without one")
                layers.append(None)
                continue
            mine = {k[len(f"{i}.") :]: v for k, v in state.items() if k.startswith(f"{i}.")}
            try:
                layers.append(type(ref).from_state(mine, kind, ref))
            except ValueError as e:
                raise ValueError(f"language layer {i}: {e}") from None
        return cls(layers, int(meta_state["offset"]))

    @property
    def nbytes(self) -> int:
        """Bytes held, including the preallocated (not yet valid) K/V capacity."""
        return sum(s.nbytes for s in self.layers if s is not None)

    @property
    def kv_bytes_per_position(self) -> int:
        """Bytes the attention caches grow by per consumed position (K and V, all layers)."""
        total = 0
        for s in self.layers:
            if isinstance(s, AttentionLayerState):
                total += 2 * s.kv_heads * s.head_dim * s.dtype.size
        return total

    def __repr__(self) -> str:
        return f"NemotronHState(offset={self.offset}, layers={len(self.layers)}, nbytes={self.nbytes})"


# --------------------------------------------------------------------------- mixers


@dataclass(frozen=True)
class MambaStepShape:
    """The fixed dimensions and constants of one Mamba-2 step (part of its fused piece's key)."""

    padding_columns: int  # leading in_proj columns to skip (§7.2)
    d_inner: int
    conv_dim: int
    conv_kernel: int
    heads: int
    head_dim: int
    groups: int
    state_size: int
    eps: float
    dt_min: float
    dt_max: float
    conv_bias: bool


def _mamba_step_core(dims: MambaStepShape, zxbcdt, conv_rows, ssm_state, dt_bias, a, d_skip, norm_w, *taps_and_bias):
    """One Mamba-2 position between in_proj and out_proj: split, causal conv + SiLU, dt, the
    recurrence, the gated grouped RMSNorm. -> (u, new conv rows, new SSM state).

    The recurrence is evaluated as the chunked formulation evaluates one position (the
    reference does so on a CPU), not as y = S_new·C: the output is built from the *old*
    state, y = (C·B)·Δx + exp(ΔA)·(S_old·C) + D·x, with C·B one dot product per group and
    the same product shapes, so both round alike (mathematically the two are equal).

    The heads are laid out as (groups, heads per group) so a group's C·B and B broadcast over
    its heads without a repeat; the conv state is its K-1 rows; `a` and `d_skip` arrive shaped
    (G, rep, 1). The arithmetic is `_project` / `_gated_norm_out`'s, element for element."""
    d_inner, heads, head_dim, groups, state_size = dims.d_inner, dims.heads, dims.head_dim, dims.groups, dims.state_size
    taps = taps_and_bias[: dims.conv_kernel]
    conv_bias = taps_and_bias[dims.conv_kernel] if dims.conv_bias else None
    n = zxbcdt.shape[0]  # conversations: every operation below is row-wise
    rep = heads // groups
    gs = groups * state_size
    z, xbc, dt = _split_projection(zxbcdt, dims.padding_columns, d_inner, dims.conv_dim)
    xbc_act = nn.silu(_tap_sum_of([*conv_rows, xbc], taps, conv_bias))
    x_h = xbc_act[..., :d_inner].reshape(n, groups, rep, head_dim)
    b = xbc_act[..., d_inner : d_inner + gs]
    c = xbc_act[..., d_inner + gs :]
    dt = _time_steps(dt, dt_bias, dims.dt_min, dims.dt_max).reshape(n, groups, rep, 1)
    dtx = dt * x_h  # (n, G, rep, P)
    decay = mx.exp(dt * a)  # (n, G, rep, 1)
    # C·B per group (n, G, 1, 1) and S_old·C per head, each a batch of matrix-vector products.
    cb = ops.batched_matvec(c.reshape(n, groups, 1, state_size), b.reshape(n, groups, state_size, 1))
    ssm5 = ssm_state.reshape(n, groups, rep, head_dim, state_size)
    y_state = ops.batched_matvec(ssm5, c.reshape(n, groups, 1, state_size, 1)).reshape(n, groups, rep, head_dim)
    y = cb * dtx + decay * y_state
    y = y + d_skip * x_h
    ssm = (
        dtx.reshape(n, groups, rep, head_dim, 1) * b.reshape(n, groups, 1, 1, state_size)
        + decay.reshape(n, groups, rep, 1, 1) * ssm5
    )
    u = _gated_norm(y.reshape(n, 1, d_inner), z, groups, dims.eps, norm_w)  # a group's channels = its heads
    # The newest row in the state's dtype (a no-op for float32 states).
    rows = [*conv_rows[1:], xbc.astype(conv_rows[0].dtype)] if conv_rows else []
    return u, *rows, ssm.reshape(n, heads, head_dim, state_size)


class Mamba2Mixer(nn.Module):
    """Mamba-2 selective SSM mixer (§7.2)."""

    def __init__(self, cfg: TextConfig, *, reference_rounding: bool = True):
        super().__init__()
        self.reference_rounding = bool(reference_rounding)
        self.num_heads = cfg.mamba_num_heads
        self.head_dim = cfg.mamba_head_dim
        self.state_size = cfg.ssm_state_size
        self.n_groups = cfg.n_groups
        self.d_inner = cfg.mamba_d_inner
        self.conv_dim = cfg.mamba_conv_dim
        self.conv_kernel = cfg.conv_kernel
        self.proj_width = cfg.mamba_in_proj_dim
        self.eps = cfg.layer_norm_epsilon
        self.dt_min, self.dt_max = cfg.time_step_limit

        self.in_proj = nn.Linear(cfg.hidden_size, self.proj_width, bias=cfg.mamba_proj_bias)
        self.conv1d = DepthwiseCausalConv1d(self.conv_dim, cfg.conv_kernel, bias=cfg.use_conv_bias)
        # Mamba-2 style init: A in [-16, -1], softplus(dt_bias) log-uniform in
        # [1e-3, 1e-1], so each step decays the state by exp(dt·A) ∈ [0.2, 0.999].
        dt = mx.exp(mx.random.uniform(math.log(1e-3), math.log(1e-1), (self.num_heads,)))
        self.dt_bias = dt + mx.log(-mx.expm1(-dt))  # inverse softplus
        self.A_log = mx.log(mx.random.uniform(1.0, 16.0, (self.num_heads,)))
        self.D = mx.ones((self.num_heads,))
        self.norm = RMSNorm(self.d_inner, self.eps)  # gated, grouped; see _gated_norm_out
        self.out_proj = nn.Linear(self.d_inner, cfg.hidden_size, bias=cfg.mamba_proj_bias)

    def make_state(self, dtype) -> MambaLayerState:
        return MambaLayerState(
            mx.zeros((1, self.conv_kernel - 1, self.conv_dim), dtype=dtype),
            mx.zeros((1, self.num_heads, self.head_dim, self.state_size), dtype=mx.float32),
        )

    # -- shared pieces

    def _project(self, x: mx.array, state: MambaLayerState):
        """in_proj, split, causal conv + SiLU, dt. Updates the conv state."""
        zxbcdt = self.in_proj(x).astype(mx.float32)
        z, xbc, dt = _split_projection(zxbcdt, self._padding_columns(zxbcdt), self.d_inner, self.conv_dim)
        padded, state.conv = _append_conv_state(state.conv, xbc, self.conv_kernel)
        xbc = nn.silu(self.conv1d(padded))

        length = x.shape[1]
        gs = self.n_groups * self.state_size
        x_ssm = xbc[..., : self.d_inner].reshape(1, length, self.num_heads, self.head_dim)
        b = xbc[..., self.d_inner : self.d_inner + gs].reshape(1, length, self.n_groups, self.state_size)
        c = xbc[..., self.d_inner + gs :].reshape(1, length, self.n_groups, self.state_size)

        dt_bias, a = self._dt_bias_and_a()
        return z, x_ssm, b, c, _time_steps(dt, dt_bias, self.dt_min, self.dt_max), a

    def _padding_columns(self, zxbcdt: mx.array) -> int:
        """Checkpoints may carry leading padding columns in in_proj (§7.2): how many to skip."""
        pad = zxbcdt.shape[-1] - self.proj_width
        if pad < 0:
            raise ValueError(
                f"Mamba in_proj gives {zxbcdt.shape[-1]} columns; expected at least {self.proj_width} "
                "(2·d_inner + 2·n_groups·ssm_state_size + mamba_num_heads)"
            )
        return pad

    def _dt_bias_and_a(self) -> tuple[mx.array, mx.array]:
        """dt_bias in float32 and a = -exp(A_log) (heads,), made once per weights: exp in A_log's
        stored dtype as the reference computes it (bf16 in the published layout), or in float32
        without `reference_rounding`."""
        if self.reference_rounding:
            return derived(
                self,
                "dt_bias_a_reference",
                (self.dt_bias, self.A_log),
                lambda d, a_log: (d.astype(mx.float32), -mx.exp(a_log).astype(mx.float32)),
            )
        return derived(
            self,
            "dt_bias_a_float32",
            (self.dt_bias, self.A_log),
            lambda d, a_log: (d.astype(mx.float32), -mx.exp(a_log.astype(mx.float32))),
        )

    def _norm_weight(self) -> mx.array:
        return derived(self, "norm_weight", (self.norm.weight,), lambda w: w.astype(mx.float32))

    def _heads_of_groups(self, t: mx.array, axis: int) -> mx.array:
        """Group g serves the contiguous heads [g·H/G, (g+1)·H/G) (clarifications)."""
        return mx.repeat(t, self.num_heads // self.n_groups, axis=axis)

    def _gated_norm_out(self, y: mx.array, z: mx.array) -> mx.array:
        """out_proj(norm.weight ⊙ groupRMS(y ⊙ SiLU(z))), n_groups contiguous channel groups."""
        u = _gated_norm(y, z, self.n_groups, self.eps, self._norm_weight())
        return self.out_proj(u).astype(mx.float32)

    # -- the two paths

    def step(self, x: mx.array, states: list[MambaLayerState]) -> mx.array:
        """One position of each conversation, x (B, 1, hidden) row b with `states[b]`, through the
        plain recurrence; -> (B, 1, hidden).

        The products (in_proj, out_proj) take the B rows together (each row's arithmetic is its
        own: the weights are read once for all of them). Everything between them is `_step_core`,
        one fixed-shape function (a fused piece, `ops.fused`) of row-wise operations over the
        stacked states: a row computes exactly what it computes alone."""
        zxbcdt = self.in_proj(x).astype(mx.float32)
        taps, conv_bias = self.conv1d.taps(zxbcdt.dtype)
        dt_bias, a = self._dt_bias_and_a()
        shape = (self.n_groups, self.num_heads // self.n_groups, 1)
        a_g, d_g = derived(
            self, "a_D_grouped", (a, self.D), lambda a, d: (a.reshape(shape), d.astype(mx.float32).reshape(shape))
        )
        dims = MambaStepShape(
            self._padding_columns(zxbcdt),
            self.d_inner,
            self.conv_dim,
            self.conv_kernel,
            self.num_heads,
            self.head_dim,
            self.n_groups,
            self.state_size,
            self.eps,
            self.dt_min,
            self.dt_max,
            conv_bias is not None,
        )
        core = ops.fused(("mamba_step", dims), lambda: functools.partial(_mamba_step_core, dims))
        extra = (conv_bias,) if conv_bias is not None else ()
        # The conversations' states stacked along the batch axis for the step (fixed-size states:
        # the stack costs the same at any conversation length); when the previous step took the same
        # conversations in the same order, its result block is read as it is.
        block = states[0].block
        if (
            len(states) > 1
            and block is not None
            and block.size == len(states)
            and all(st.row_of(block) == i for i, st in enumerate(states))
        ):
            conv_rows, ssm = block.rows, block.ssm
        else:
            conv_rows = [stack_rows(list(r)) for r in zip(*(st.conv_rows for st in states), strict=True)]
            ssm = stack_rows([st.ssm for st in states])
        u, *new_rows, new_ssm = core(zxbcdt, conv_rows, ssm, dt_bias, a_g, d_g, self._norm_weight(), *taps, *extra)
        if len(states) == 1:
            states[0].conv_rows, states[0].ssm = new_rows, new_ssm
        else:
            new_block = MambaRows(new_rows, new_ssm, len(states))
            for i, state in enumerate(states):
                state.in_block(new_block, i)
        return self.out_proj(u).astype(mx.float32)

    def sequence(self, x: mx.array, state: MambaLayerState, chunk_size: int) -> mx.array:
        """L positions (1, L, hidden) through the chunked SSD scan, continuing from `state`."""
        z, x_ssm, b, c, dt, a = self._project(x, state)
        length = x.shape[1]
        d_skip = self.D.astype(mx.float32)[:, None, None]  # broadcasts over (1, H, T, P)
        ssm = state.ssm
        outputs = []
        for start in range(0, length, chunk_size):
            stop = min(start + chunk_size, length)
            x_h = x_ssm[:, start:stop].transpose(0, 2, 1, 3)  # (1, H, T, P)
            b_g = b[:, start:stop].transpose(0, 2, 1, 3)  # (1, G, T, N)
            c_g = c[:, start:stop].transpose(0, 2, 1, 3)
            b_h, c_h = self._heads_of_groups(b_g, axis=1), self._heads_of_groups(c_g, axis=1)  # (1, H, T, N)
            dt_c = dt[:, start:stop].transpose(0, 2, 1)  # (1, H, T)
            log_decay = dt_c * a[:, None]  # (1, H, T)

            # Within the chunk: y_t += Σ_{s≤t} (C_t·B_s) exp(Σ_{r=s+1..t} dA_r) dt_s x_s.
            decay_ts = mx.exp(_segment_sums(log_decay))  # (1, H, T, T)
            scores = self._heads_of_groups(c_g @ b_g.transpose(0, 1, 3, 2), axis=1)  # C·B once per group
            mix = scores * decay_ts * dt_c[:, :, None, :]
            y = mix @ x_h  # (1, H, T, P)

            # Carried state: y_t += exp(Σ_{r≤t} dA_r) C_t·S_0.
            decay_from_start = mx.exp(mx.cumsum(log_decay, axis=-1))  # (1, H, T)
            y = y + (c_h @ ssm.transpose(0, 1, 3, 2)) * decay_from_start[..., None]
            y = y + d_skip * x_h

            # State after the chunk: S_T = exp(Σ dA) S_0 + Σ_s exp(Σ_{r>s} dA_r) dt_s x_s B_sᵀ.
            decay_to_end = decay_ts[:, :, -1, :]  # (1, H, T)
            weighted_x = x_h * (dt_c * decay_to_end)[..., None]
            ssm = decay_from_start[:, :, -1, None, None] * ssm + weighted_x.transpose(0, 1, 3, 2) @ b_h
            outputs.append(y.transpose(0, 2, 1, 3))
        state.ssm = ssm
        y = outputs[0] if len(outputs) == 1 else mx.concatenate(outputs, axis=1)
        return self._gated_norm_out(y.reshape(1, length, self.d_inner), z)


class Attention(nn.Module):
    """Causal GQA attention, no positional encoding (§7.3)."""

    def __init__(self, cfg: TextConfig):
        super().__init__()
        self.num_heads = cfg.num_attention_heads
        self.num_kv_heads = cfg.num_key_value_heads
        self.head_dim = cfg.head_dim
        self.scale = cfg.head_dim**-0.5
        bias = cfg.attention_bias
        self.q_proj = nn.Linear(cfg.hidden_size, self.num_heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(cfg.hidden_size, self.num_kv_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(cfg.hidden_size, self.num_kv_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, cfg.hidden_size, bias=bias)

    def make_state(self, dtype) -> AttentionLayerState:
        empty = mx.zeros((1, self.num_kv_heads, 0, self.head_dim), dtype=dtype)
        return AttentionLayerState(empty, mx.array(empty))

    def __call__(self, x: mx.array, states: list[AttentionLayerState]) -> mx.array:
        """x (B, L, hidden), row b continuing `states[b]` (each its own length of cached K/V) ->
        (B, L, hidden). The projections take the B rows together; each row attends over its own
        cache alone, so a row computes exactly what it computes alone."""
        batch, length = x.shape[0], x.shape[1]
        q = self.q_proj(x).astype(mx.float32).reshape(batch, length, self.num_heads, self.head_dim)
        k = self.k_proj(x).astype(mx.float32).reshape(batch, length, self.num_kv_heads, self.head_dim)
        v = self.v_proj(x).astype(mx.float32).reshape(batch, length, self.num_kv_heads, self.head_dim)
        if length == 1 and (batch > 1 or states[0].block is not None):
            out = self._attend_rows(q, k, v, states)
            return self.o_proj(out.reshape(batch, 1, self.num_heads * self.head_dim)).astype(mx.float32)
        rows = [
            self._attend(qb, kb, vb, state)
            for qb, kb, vb, state in zip(rows_of(q, batch), rows_of(k, batch), rows_of(v, batch), states, strict=True)
        ]
        out = stack_rows(rows)
        return self.o_proj(out.reshape(batch, length, self.num_heads * self.head_dim)).astype(mx.float32)

    def _attend_rows(self, q: mx.array, k: mx.array, v: mx.array, states: list[AttentionLayerState]) -> mx.array:
        """One position of S conversations over their `AttentionRows` block: q (S, 1, heads, D),
        k / v (S, 1, kv_heads, D) -> (S, 1, heads, D). Each row's new K/V go where its own buffer
        takes them; each row's softmax sees its own valid positions (the masked ones weigh exactly
        0, so the sums are those of `_attend` over the valid positions alone). Members of the block
        not stepping are padding rows (zero queries, zeros written to the scratch column)."""
        block = self._rows_block_for(states)
        members = block.members
        rows: list[int] = [st.row_of(block) for st in states]  # type: ignore[misc]
        for st in states:  # as `append` grows a buffer
            if st.length + 1 > st._cap:
                st._cap = _capacity_for(st.length + 1)
        need = max(m._cap for m in members if m is not None) + 1  # + the scratch column
        block.keys, block.values = padded_to(block.keys, need), padded_to(block.values, need)
        cap = block.keys.shape[2]
        at = np.full(len(members), cap - 1, dtype=np.int32)
        seen = np.array([0 if m is None else m.length for m in members])
        for st, r in zip(states, rows, strict=True):
            at[r] = st.length
            seen[r] = st.length + 1
        q, k, v = (spread_rows(a, rows, len(members)) for a in (q, k, v))
        dtype = block.keys.dtype
        put = mx.broadcast_to(mx.array(at)[:, None, None, None], (len(members), self.num_kv_heads, 1, self.head_dim))
        block.keys = mx.put_along_axis(block.keys, put, k.transpose(0, 2, 1, 3).astype(dtype), axis=2)
        block.values = mx.put_along_axis(block.values, put, v.transpose(0, 2, 1, 3).astype(dtype), axis=2)
        rep = self.num_heads // self.num_kv_heads
        qh = q.transpose(0, 2, 1, 3).reshape(len(members), self.num_kv_heads, rep, 1, self.head_dim)
        # Only the positions some stepping row sees: the block's capacity can be far beyond them.
        span = max(seen[r] for r in rows)
        keys, values = block.keys[:, :, :span], block.values[:, :, :span]
        scores = (qh * self.scale) @ keys[:, :, None].swapaxes(-1, -2)  # (C, KV, rep, 1, T)
        visible = np.arange(span)[None, :] < seen[:, None]
        scores = mx.where(mx.array(visible)[:, None, None, None, :], scores, -mx.inf)
        weights = mx.softmax(scores, axis=-1, precise=True)
        out = weights @ values[:, :, None]  # (C, KV, rep, 1, D)
        for st in states:
            st.length += 1
        out = out.reshape(len(members), self.num_heads, 1, self.head_dim).transpose(0, 2, 1, 3)
        return gather_rows(out, rows, len(members))

    def _rows_block_for(self, states: list[AttentionLayerState]) -> AttentionRows:
        """The block of the first stepping state that has one, conversations not in it placed in its
        free rows (a copy of their own buffers only); a new block when there are not enough."""
        return block_with_room(states, self._new_rows_block, self._place)

    def _place(self, block: AttentionRows, st: AttentionLayerState, c: int) -> None:
        """Put `st`'s own buffers in the free row `c` of `block` (zero-padded to its capacity)."""
        cap = st.capacity
        keys, values = st._buffers()
        if st._block is not None:  # leaves another block: its row there is free
            old, i = st._block
            old.members[i] = None
        block.keys, block.values = padded_to(block.keys, cap + 1), padded_to(block.values, cap + 1)
        have = block.keys.shape[2]
        block.keys[c : c + 1] = padded_to(keys, have)
        block.values[c : c + 1] = padded_to(values, have)
        block.members[c] = st
        st.in_block(block, c, cap)

    def _new_rows_block(self, states: list[AttentionLayerState]) -> AttentionRows:
        """A block of `states` and the other live members of their blocks (a copy of each one's
        buffers, zero-padded to the largest capacity plus the scratch column)."""
        members = members_with(states)
        caps = [m.capacity for m in members]
        owned = [m._buffers() for m in members]
        need = max(caps) + 1
        block = AttentionRows(
            mx.concatenate([padded_to(k, need) for k, _ in owned]),
            mx.concatenate([padded_to(v, need) for _, v in owned]),
            members,
        )
        for c, (m, cap) in enumerate(zip(members, caps, strict=True)):
            m.in_block(block, c, cap)
        return block

    def _attend(self, q: mx.array, k: mx.array, v: mx.array, state: AttentionLayerState) -> mx.array:
        """One conversation's attention: q (1, L, heads, D), k / v (1, L, kv_heads, D) appended to
        its cache -> (1, L, heads, D)."""
        length = q.shape[1]
        past = state.length
        keys, values = state.append(k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3))
        # Query head h reads KV head h // (heads / kv_heads): view the query heads as
        # (kv_heads, heads per KV head) so each KV head meets its contiguous block.
        rep = self.num_heads // self.num_kv_heads
        q = q.transpose(0, 2, 1, 3).reshape(1, self.num_kv_heads, rep, length, self.head_dim)
        scores = (q * self.scale) @ keys[:, :, None].swapaxes(-1, -2)  # (1, KV, rep, L, T)
        if length > 1:
            # Query i sits at absolute position past + i and sees keys 0..past + i.
            total = keys.shape[2]
            visible = mx.arange(total)[None, :] <= (mx.arange(length)[:, None] + past)
            scores = mx.where(visible, scores, -mx.inf)
        weights = mx.softmax(scores, axis=-1, precise=True)
        out = weights @ values[:, :, None]  # (1, KV, rep, L, D)
        return out.reshape(1, self.num_heads, length, self.head_dim).transpose(0, 2, 1, 3)


class SquaredReluMLP(nn.Module):
    """down_proj(relu(up_proj(x))²), no gate (§7.4)."""

    def __init__(self, cfg: TextConfig):
        super().__init__()
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=cfg.mlp_bias)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=cfg.mlp_bias)

    def __call__(self, x: mx.array) -> mx.array:
        h = ops.fused(("relu_squared",), lambda: _relu_squared)(self.up_proj(x).astype(mx.float32))
        return self.down_proj(h).astype(mx.float32)


def _relu_squared(y: mx.array) -> mx.array:
    h = nn.relu(y)
    return h * h


class NemotronHBlock(nn.Module):
    """x + mixer(RMSNorm(x))."""

    def __init__(self, cfg: TextConfig, layer_type: str, *, reference_rounding: bool = True):
        super().__init__()
        self.layer_type = layer_type
        self.norm = RMSNorm(cfg.hidden_size, cfg.layer_norm_epsilon)
        if layer_type == "mamba":
            self.mixer = Mamba2Mixer(cfg, reference_rounding=reference_rounding)
        elif layer_type == "attention":
            self.mixer = Attention(cfg)
        elif layer_type == "mlp":
            self.mixer = SquaredReluMLP(cfg)
        else:
            raise ValueError(f"unknown Nemotron-H layer type {layer_type!r}; expected mamba, attention or mlp")

    def __call__(self, x: mx.array, layer_states: list, single_step: bool, chunk_size: int) -> mx.array:
        return x + self.mix(self.norm(x), layer_states, single_step, chunk_size)

    def mix(self, h: mx.array, layer_states: list, single_step: bool, chunk_size: int) -> mx.array:
        """The mixer on the normed input h (B, L, hidden), row b with `layer_states[b]`: what the
        block adds to its input. The sequence pass takes one conversation (B == 1)."""
        if self.layer_type == "mamba":
            if single_step:
                return self.mixer.step(h, layer_states)
            (state,) = layer_states
            return self.mixer.sequence(h, state, chunk_size)
        if self.layer_type == "attention":
            return self.mixer(h, layer_states)
        return self.mixer(h)


def _add_rms_norm(eps: float, x: mx.array, h: mx.array, weight: mx.array) -> tuple[mx.array, mx.array]:
    y = x + h
    return y, ops.rms_norm(y, weight, eps)


def add_rms_norm(x: mx.array, h: mx.array, norm: RMSNorm) -> tuple[mx.array, mx.array]:
    """(x + h, norm(x + h)) as one fused piece: a block's residual add and the next norm."""
    return ops.fused(("add_rms_norm", norm.eps), lambda: functools.partial(_add_rms_norm, norm.eps))(
        x, h, norm.weight_as(x.dtype)
    )


# --------------------------------------------------------------------------- model


class NemotronH(nn.Module):
    """The `llm.` subtree: `layers.{i}.norm`, `layers.{i}.mixer.*`, `norm_f`.

    `model(x, state=None)`: x (1, L, hidden) input embeddings -> (1, L, hidden)
    final normalised hidden states. With a state the pass continues from it and
    updates it in place; L == 1 with a state takes the single-step recurrence,
    anything else the chunked sequence pass. Without a state the pass starts
    from a fresh state that is then discarded.
    """

    def __init__(self, text_cfg: TextConfig, *, ssd_chunk_size: int = SSD_CHUNK_SIZE, reference_rounding: bool = True):
        super().__init__()
        if not isinstance(text_cfg, TextConfig):
            raise TypeError(f"NemotronH expects a TextConfig, got {type(text_cfg).__name__}")
        if not isinstance(ssd_chunk_size, int) or ssd_chunk_size < 1:
            raise ValueError(f"ssd_chunk_size must be a positive int, got {ssd_chunk_size!r}")
        self.config = text_cfg
        self.hidden_size = text_cfg.hidden_size
        self.ssd_chunk_size = ssd_chunk_size
        self.reference_rounding = bool(reference_rounding)
        self.layers = [
            NemotronHBlock(text_cfg, t, reference_rounding=self.reference_rounding) for t in text_cfg.layer_types
        ]
        self.norm_f = RMSNorm(text_cfg.hidden_size, text_cfg.layer_norm_epsilon)

    @property
    def layer_types(self) -> list[str]:
        return [block.layer_type for block in self.layers]

    def make_state(self, dtype=mx.float32) -> NemotronHState:
        """Fresh state: zero conv/SSM states, empty K/V caches, offset 0.

        `dtype` is the activation dtype of the conv state and K/V (the SSM state
        is float32 regardless)."""
        layers = []
        for block in self.layers:
            layers.append(None if block.layer_type == "mlp" else block.mixer.make_state(dtype))
        return NemotronHState(layers)

    def __call__(self, x: mx.array, state: NemotronHState | None = None) -> mx.array:
        """x (1, L, hidden) -> (1, L, hidden); L == 1 with a state takes the single step."""
        return self._run(x, state, single_step=state is not None and _length(x) == 1)

    def step(self, x: mx.array, state: NemotronHState) -> mx.array:
        """One position (1, 1, hidden) through the single-step recurrence; updates `state`."""
        if state is None:
            raise TypeError("step needs a NemotronHState (from make_state())")
        if isinstance(x, mx.array) and x.ndim == 3 and x.shape[1] != 1:
            raise ValueError(f"step expects one position (1, 1, {self.hidden_size}), got {tuple(x.shape)}")
        return self._run(x, state, single_step=True)

    def step_batch(self, x: mx.array, states: list[NemotronHState]) -> mx.array:
        """One position of each of B conversations: x (B, 1, hidden), row b continuing `states[b]`
        (each at its own offset and K/V length) -> (B, 1, hidden); updates the states. Row b equals
        `step(x[b:b+1], states[b])` bit for bit where the products compute each row alone
        (docs/voicechat.md, "Many sessions in one process"); `step` is this with B == 1."""
        if not isinstance(states, (list, tuple)) or not states:
            raise TypeError("step_batch needs a non-empty list of NemotronHState, one per row of x")
        x = self._check_input(x, rows=len(states))
        if x.shape[1] != 1:
            raise ValueError(
                f"step_batch expects one position per row ({len(states)}, 1, {self.hidden_size}), got {tuple(x.shape)}"
            )
        for state in states:
            self._check_state(state)
        return self._blocks(x, list(states), single_step=True)

    def sequence(self, x: mx.array, state: NemotronHState | None = None) -> mx.array:
        """L >= 1 positions through the chunked sequence pass, continuing from `state` if given."""
        return self._run(x, state, single_step=False)

    def prefill(self, x: mx.array, state: NemotronHState) -> mx.array:
        """Positions whose inputs are known in advance (a system prompt) into `state`: one single
        step per position as the reference takes them (`reference_rounding`), else one sequence
        pass. -> final hidden states (1, L, hidden)."""
        if not self.reference_rounding:
            return self.sequence(x, state)
        x = self._check_input(x)
        return mx.concatenate([self.step(x[:, t : t + 1], state) for t in range(x.shape[1])], axis=1)

    def forward_uncached(self, x_all: mx.array) -> mx.array:
        """Recompute the whole history (1, T, hidden) from a fresh state ("no cache" mode)."""
        return self._run(x_all, None, single_step=False)

    # -- internals

    def _run(self, x, state, single_step: bool) -> mx.array:
        x = self._check_input(x)
        if state is None:
            state = self.make_state()
        else:
            self._check_state(state)
        return self._blocks(x, [state], single_step)

    def _blocks(self, x: mx.array, states: list[NemotronHState], single_step: bool) -> mx.array:
        # Each block's residual add runs with the next norm (and the last with norm_f) as one
        # piece: x + mixer(norm(x)) per block, as the blocks compute it. Norms and adds are
        # row-wise; the mixers keep each row's state its own.
        added = None
        for i, block in enumerate(self.layers):
            if added is None:
                h = block.norm(x)
            else:
                x, h = add_rms_norm(x, added, block.norm)
            added = block.mix(h, [state.layers[i] for state in states], single_step, self.ssd_chunk_size)
            ops.after_layer(added)  # this block may run while the next one is built
        for state in states:
            state.offset += x.shape[1]
        if added is None:
            return self.norm_f(x)
        return add_rms_norm(x, added, self.norm_f)[1]

    def _check_input(self, x, rows: int = 1) -> mx.array:
        if not isinstance(x, mx.array):
            raise TypeError(f"NemotronH input must be an mx.array of embeddings, got {type(x).__name__}")
        if not mx.issubdtype(x.dtype, mx.floating):
            raise TypeError(
                f"NemotronH input must be floating-point embeddings ({rows}, L, {self.hidden_size}), "
                f"got dtype {x.dtype} (token ids are embedded by the caller)"
            )
        if x.ndim != 3 or x.shape[0] != rows or x.shape[2] != self.hidden_size or x.shape[1] < 1:
            raise ValueError(
                f"NemotronH input must have shape ({rows}, L, {self.hidden_size}) with L >= 1, got {tuple(x.shape)}"
            )
        return x.astype(mx.float32)

    def _check_state(self, state) -> None:
        if not isinstance(state, NemotronHState):
            raise TypeError(f"state must be a NemotronHState (from make_state()), got {type(state).__name__}")
        kinds = [
            "mlp" if s is None else "mamba" if isinstance(s, MambaLayerState) else "attention" for s in state.layers
        ]
        if kinds != self.layer_types:
            raise ValueError(
                f"state has layers {kinds}; this model's layers are {self.layer_types}: "
                "use the state made by this model's make_state()"
            )


def _length(x) -> int | None:
    return x.shape[1] if isinstance(x, mx.array) and x.ndim == 3 else None
