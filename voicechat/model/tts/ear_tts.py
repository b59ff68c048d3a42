"""EAR-TTS speech-token generator, `tts_model.tts_model` (docs/model.md §8).

Per timeline step: previous frame's codes + this frame's text token ->
gated fusion -> Gemma-3 style backbone (batch 2: conditional / unconditional
text, for guidance) -> iterative Mixture-of-Gaussians head -> num_quantizers
RVQ codes.

Paths:

* `EarTts.warmup(state, ...)` + `EarTts.step(state, ...)`: cached streaming
  path over an `EarTtsState` (per-layer K/V of the guidance pair).
* `EarTts.new_history(...)` + `EarTts.step_uncached(history, ...)`: the
  recompute path for parity checks; every call reruns the backbone over all
  positions from scratch (`EarTtsBackbone` without a state, causal + sliding
  masks) and uses the last position.

Precision: activations are float32 whatever the weight dtype, apart from the
places where the reference (mlx-vlm) rounds to the weight dtype: the model's
`Numerics` (voicechat/model/tts/numerics.py), fixed when the model is built, says
which of them are reproduced ("reference", the default: all, so the codes equal
the reference's; "float32": none). Every module reads the setting of its own
model; nothing is process-wide.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from voicechat.model import ops
from voicechat.model.config import TtsConfig
from voicechat.model.derived import derived
from voicechat.model.ops import apply, stack_rows
from voicechat.model.rows import BlockRow, block_with_room, gather_rows, members_with, padded_to, spread_rows
from voicechat.model.tts.char_encoder import CharAwareSubwordEncoder, CharTable
from voicechat.model.tts.layers import (
    GeluGatedMLP,
    OnePlusRMSNorm,
    as_int_array,
    check_value_range,
    gated_mlp,
    is_integer_dtype,
    one_plus_rms_norm,
    one_plus_scale,
)
from voicechat.model.tts.numerics import DEFAULT_NUMERICS, Numerics, numerics_from
from voicechat.model.tts.rng import SessionRandom

KV_ALLOC_STEP = 256  # K/V buffers grow in multiples of this many positions
GUMBEL_EPS = 1e-8  # the reference's guards: -log(-log(U + eps) + eps)


def top_p_keep(probs: mx.array, top_p: float) -> mx.array:
    """Top-p mask over the last axis (§8.6 e): keep a component iff the total probability of
    the components ranked above it is < top_p.

    Ranking: descending probability; among equal probabilities the higher index
    ranks first (the reference's ascending sort read from the top). The masses
    are summed from the top down in ranking order.
    """
    order = mx.argsort(probs, axis=-1)[..., ::-1]
    mass_above = mx.cumsum(mx.take_along_axis(probs, order, axis=-1), axis=-1, inclusive=False)
    return mx.take_along_axis(mass_above < top_p, mx.argsort(order, axis=-1), axis=-1)


def mog_pass_schedule(num_quantizers: int, num_iterations: int, exponent: float) -> list[int]:
    """Codebooks assigned by each refinement iteration (§8.6); 0 = pass skipped.

    masked_i = ceil((1 - (i/N)^e)^(1/e) · Q), count_i = masked_i - masked_{i+1},
    masked_N = 0. Iterations assign codebooks from 0 upwards.
    """
    if num_quantizers < 1 or num_iterations < 1 or exponent <= 0:
        raise ValueError(
            "mog_pass_schedule: need num_quantizers >= 1, num_iterations >= 1, exponent > 0; got "
            f"{num_quantizers}, {num_iterations}, {exponent}"
        )
    masked = [
        math.ceil((1.0 - (i / num_iterations) ** exponent) ** (1.0 / exponent) * num_quantizers)
        for i in range(num_iterations)
    ] + [0]
    return [masked[i] - masked[i + 1] for i in range(num_iterations)]


def replace_control_codes(codes, control_codes, silence_codes) -> mx.array:
    """Every code equal to any control code -> the silence code of its codebook (§9.4).

    codes (..., Q), control_codes (C,), silence_codes (Q,), all integer; device-side, int32 out.
    """
    codes = as_int_array(codes, "codes")
    control_codes = as_int_array(control_codes, "control_codes")
    silence_codes = as_int_array(silence_codes, "silence_codes")
    if control_codes.ndim != 1:
        raise ValueError(f"control_codes: expected shape (C,), got {control_codes.shape}")
    if silence_codes.ndim != 1:
        raise ValueError(f"silence_codes: expected shape (Q,), got {silence_codes.shape}")
    if codes.ndim < 1 or codes.shape[-1] != silence_codes.shape[0]:
        raise ValueError(
            f"codes: expected shape (..., {silence_codes.shape[0]}) (one code per silence codebook), got {codes.shape}"
        )
    is_control = (codes[..., None] == control_codes).any(axis=-1)
    return mx.where(is_control, silence_codes, codes).astype(mx.int32)


# --------------------------------------------------------------------------- state


class TextEmbeddingCache:
    """The character encoder's row (1, hidden) per host token id, for one session's TTS steps.

    The row is a pure function of the id and the weights, and a conversation repeats few ids
    (mostly PAD), so a step looks it up instead of running the encoder again (~250 dispatches
    per step at the small widths). Least recently used ids leave first beyond `max_entries`.
    Made per session (a session's weights do not change under it)."""

    def __init__(self, max_entries: int = 1024):
        if isinstance(max_entries, bool) or not isinstance(max_entries, int) or max_entries < 1:
            raise ValueError(f"max_entries: expected an int >= 1, got {max_entries!r}")
        self.max_entries = max_entries
        self._rows: dict[int, mx.array] = {}

    def get(self, token: int) -> mx.array | None:
        row = self._rows.pop(token, None)
        if row is not None:
            self._rows[token] = row  # most recently used last
        return row

    def put(self, token: int, row: mx.array) -> None:
        self._rows[token] = row
        while len(self._rows) > self.max_entries:
            del self._rows[next(iter(self._rows))]

    def __len__(self) -> int:
        return len(self._rows)

    # -- as arrays + metadata (voicechat/io/states.py)

    @property
    def state(self) -> dict[str, mx.array]:
        """{str(token): row (1, hidden)}, least recently used first."""
        return {str(token): row for token, row in self._rows.items()}

    @property
    def meta_state(self) -> list[int]:
        """The token ids, least recently used first."""
        return [int(t) for t in self._rows]

    @classmethod
    def from_state(cls, state: dict, meta_state: list, like: TextEmbeddingCache | None = None) -> TextEmbeddingCache:
        """A cache of `state`'s rows in `meta_state`'s order (`like`'s capacity, default 1024)."""
        cache = cls() if like is None else cls(like.max_entries)
        for token in meta_state:
            cache.put(int(token), state[str(token)])
        return cache


class TtsKvRows:
    """The TTS K/V of several conversations as one block per layer: `keys[l]`, `values[l]`
    (2C, kv_heads, capacity_l, head_dim), member c's guidance pair at rows 2c, 2c + 1, each at the
    indices its own buffer would use (zeros beyond what it wrote); the last index of every layer is
    a scratch column no member sees. A single step of any subset of the members writes each
    stepping pair's new K/V with one scatter (the others write zeros into the scratch column) and
    attends over the block with one masked attention (each row sees its own valid entries, in its
    own order); the block stays as it is across steps, whichever members take them, and is made
    anew only when a conversation not in it steps. A member's own buffers are cut from it when it is
    read alone. `members[c]`: the state at pair c, None once released."""

    def __init__(self, keys: list[mx.array], values: list[mx.array], members: list):
        self.keys, self.values, self.members = keys, values, members

    @property
    def size(self) -> int:
        return len(self.members)


class EarTtsState(BlockRow[TtsKvRows]):
    """Streaming state of the TTS backbone for the guidance pair (batch 2).

    Per layer K/V buffers (2, kv_heads, capacity, head_dim) holding post-RoPE
    keys. Global layers keep every position (capacity grows in steps of
    KV_ALLOC_STEP). Sliding layers keep the last `window` positions in a ring:
    position p lives at index (p - ring_origin[layer]) % window, capacity never
    exceeds `window`. ring_origin is 0 until a multi-position pass ends at or
    beyond the window; such a pass re-lays the ring in position order from index
    0 (ring_origin = end % window). Attention does not depend on the key order
    mathematically, but its float32 sums do: this is the order the reference's
    rotating cache uses, so single steps reduce over the keys in the same order
    (bit-identical hidden states at the tiny preset, whose window is shorter than
    the warm-up).
    `offset` = TTS positions consumed (drives RoPE); `previous_codes` (1, Q)
    int32 = the codes the next step embeds.
    """

    def __init__(
        self, windows: list[int | None], num_kv_heads: int, head_dim: int, num_quantizers: int, mask_code: int
    ):
        self.windows = list(windows)
        self.num_kv_heads, self.head_dim = num_kv_heads, head_dim
        self.num_quantizers, self.mask_code = num_quantizers, mask_code
        self.reset()

    def reset(self) -> None:
        self._block: tuple[TtsKvRows, int] | None = None
        self._caps: list[int] | None = None  # own capacities while in a block
        empty = mx.zeros((2, self.num_kv_heads, 0, self.head_dim), dtype=mx.float32)
        self.keys = [empty for _ in self.windows]
        self.values = [empty for _ in self.windows]
        self.ring_origin = [0 for _ in self.windows]
        self.offset = 0
        self.previous_codes = mx.full((1, self.num_quantizers), self.mask_code, dtype=mx.int32)

    def copy(self) -> EarTtsState:
        # Buffers are only ever replaced (mx.slice_update returns new arrays), so sharing is safe;
        # a copy of a state in a block gets its own cut buffers (the block moves on), this one stays.
        other = EarTtsState.__new__(EarTtsState)
        other.__dict__.update(self.__dict__)
        other.windows = list(self.windows)
        other._keys, other._values = self._own_buffers()
        other._block, other._caps = None, None
        other.ring_origin = list(self.ring_origin)
        return other

    # -- residence: own buffers, or a row pair of a `TtsKvRows` block

    def _own_buffers(self) -> tuple[list[mx.array], list[mx.array]]:
        if self._block is None:
            return list(self._keys), list(self._values)
        block, i = self._block
        caps = self._caps or []
        keys = [k[2 * i : 2 * i + 2, :, :cap] for k, cap in zip(block.keys, caps, strict=True)]
        values = [v[2 * i : 2 * i + 2, :, :cap] for v, cap in zip(block.values, caps, strict=True)]
        return keys, values

    def _own(self) -> None:
        if self._block is not None:
            block, i = self._block
            self._keys, self._values = self._own_buffers()
            self._block, self._caps = None, None
            block.members[i] = None  # its pair is free: a new block leaves it out

    def in_block(self, block: TtsKvRows, index: int, capacities: list[int]) -> None:
        """This state's K/V are now row pair `index` of `block`, its own buffers' capacities `capacities`."""
        self._block, self._caps = (block, index), list(capacities)
        self._keys = self._values = []

    def release(self) -> None:
        """Leave the block for good (the session closed): own copies of its buffers, made now so
        they do not hold the block's memory, and its pair becomes a free row of the block."""
        if self._block is not None:
            block, i = self._block
            keys, values = self._own_buffers()
            keys, values = [mx.array(k) for k in keys], [mx.array(v) for v in values]
            mx.eval(keys, values)
            self._keys, self._values = keys, values
            self._block, self._caps = None, None
            block.members[i] = None

    @property
    def keys(self) -> list[mx.array]:
        self._own()
        return self._keys

    @keys.setter
    def keys(self, value: list[mx.array]) -> None:
        self._own()
        self._keys = list(value)

    @property
    def values(self) -> list[mx.array]:
        self._own()
        return self._values

    @values.setter
    def values(self, value: list[mx.array]) -> None:
        self._own()
        self._values = list(value)

    # -- bookkeeping

    @property
    def num_layers(self) -> int:
        return len(self.windows)

    def stored_length(self, layer: int, offset: int | None = None) -> int:
        """Valid cached positions of `layer` after `offset` positions."""
        offset = self.offset if offset is None else offset
        w = self.windows[layer]
        return offset if w is None else min(offset, w)

    def capacity(self, layer: int) -> int:
        if self._block is not None and self._caps is not None:
            return self._caps[layer]
        return self.keys[layer].shape[2]

    def ordered_kv(self, layer: int) -> tuple[mx.array, mx.array]:
        """Cached K, V of `layer` in position order (oldest first), valid entries only."""
        k, v, n = self.keys[layer], self.values[layer], self.stored_length(layer)
        w = self.windows[layer]
        if w is None or self.offset <= w:
            return k[:, :, :n], v[:, :, :n]
        start = (self.offset - self.ring_origin[layer]) % w  # index of the oldest kept position
        return (
            mx.concatenate([k[:, :, start:], k[:, :, :start]], axis=2),
            mx.concatenate([v[:, :, start:], v[:, :, :start]], axis=2),
        )

    def grown_capacity(self, layer: int, needed: int) -> int:
        """The capacity of `layer`'s buffer once it holds index needed - 1 (solo and in a block
        alike): unchanged when it has room, else the next multiple of KV_ALLOC_STEP, at most the
        window."""
        cap = self.capacity(layer)
        if needed <= cap:
            return cap
        new_cap = -(-needed // KV_ALLOC_STEP) * KV_ALLOC_STEP
        w = self.windows[layer]
        return new_cap if w is None else min(new_cap, w)

    def _ensure_capacity(self, layer: int, needed: int) -> None:
        cap = self.grown_capacity(layer, needed)
        self.keys[layer] = padded_to(self.keys[layer], cap)
        self.values[layer] = padded_to(self.values[layer], cap)

    def _write(self, layer: int, index: int, k: mx.array, v: mx.array) -> None:
        start = mx.array([index])
        self.keys[layer] = mx.slice_update(self.keys[layer], k, start, axes=(2,))
        self.values[layer] = mx.slice_update(self.values[layer], v, start, axes=(2,))

    def update_and_fetch(self, layer: int, k: mx.array, v: mx.array):
        """Store new K/V (2, kv, n, D) at positions offset..offset+n-1 of `layer`.

        Returns (keys, values, mask) to attend with: for n == 1 the buffer's
        valid entries (exactly the visible ones, in ring order: attention does
        not depend on key order) and no mask; for n > 1 the old entries in
        position order followed by the new ones, with a causal (+ sliding) mask.
        """
        n, offset, w = k.shape[2], self.offset, self.windows[layer]
        if n == 1:
            index = offset if w is None else (offset - self.ring_origin[layer]) % w
            self._ensure_capacity(layer, index + 1)
            self._write(layer, index, k, v)
            valid = self.stored_length(layer, offset + 1)
            return self.keys[layer][:, :, :valid], self.values[layer][:, :, :valid], None
        old_k, old_v = self.ordered_kv(layer)
        n_old = old_k.shape[2]
        keys = mx.concatenate([old_k, k], axis=2)
        values = mx.concatenate([old_v, v], axis=2)
        mask = attention_mask(offset, n, offset - n_old, w)
        # Keep what the layer must remember: all of it (global) or the last w positions.
        if w is None:
            self._ensure_capacity(layer, offset + n)
            self._write(layer, offset, k, v)
        else:
            # Re-lay the ring in position order from index 0 (see the class docstring).
            end = offset + n
            keep = min(end, w)
            self.keys[layer], self.values[layer] = keys[:, :, -keep:], values[:, :, -keep:]
            self.ring_origin[layer] = end % w if end >= w else 0
        return keys, values, mask

    # -- inspection

    def arrays(self) -> dict[str, mx.array]:
        """{"layers.{i}.keys"/"layers.{i}.values": valid K/V (2, kv, n_i, D) oldest first,
        "offset": int32 scalar, "previous_codes": (1, Q) int32}."""
        out = {}
        for i in range(self.num_layers):
            out[f"layers.{i}.keys"], out[f"layers.{i}.values"] = self.ordered_kv(i)
        out["offset"] = mx.array(self.offset, dtype=mx.int32)
        out["previous_codes"] = self.previous_codes
        return out

    # -- as arrays + metadata (voicechat/io/states.py)

    @property
    def state(self) -> dict[str, mx.array]:
        """`{i}.keys` / `{i}.values`: each layer's whole buffer (2, kv, capacity, D), in ring order as
        stored; `previous_codes` (1, Q) int32."""
        out = {}
        for i in range(self.num_layers):
            out[f"{i}.keys"], out[f"{i}.values"] = self.keys[i], self.values[i]
        out["previous_codes"] = self.previous_codes
        return out

    @property
    def meta_state(self) -> dict:
        """{"offset", "ring_origin" (per layer), "windows" (per layer, None: global)}."""
        return {"offset": self.offset, "ring_origin": list(self.ring_origin), "windows": list(self.windows)}

    @classmethod
    def from_state(cls, state: dict, meta_state: dict, like: EarTtsState) -> EarTtsState:
        """The state from `state` / `meta_state`, checked against `like` (the model's fresh state:
        its windows, heads, head size and codebooks)."""
        if list(meta_state["windows"]) != list(like.windows):
            raise ValueError(f"TTS windows {meta_state['windows']}, the model has {like.windows}")
        out = cls(like.windows, like.num_kv_heads, like.head_dim, like.num_quantizers, like.mask_code)
        keys = [state[f"{i}.keys"] for i in range(out.num_layers)]
        values = [state[f"{i}.values"] for i in range(out.num_layers)]
        for a in keys + values:
            if (
                a.ndim != 4
                or a.shape[:2] != (2, out.num_kv_heads)
                or a.shape[3] != out.head_dim
                or a.dtype != mx.float32
            ):
                raise ValueError(
                    f"a TTS K/V buffer has shape {a.shape} {a.dtype}; the model needs "
                    f"(2, {out.num_kv_heads}, n, {out.head_dim}) float32"
                )
        ring_origin = [int(r) for r in meta_state["ring_origin"]]
        if len(ring_origin) != out.num_layers:
            raise ValueError(f"{len(ring_origin)} ring origins, the model has {out.num_layers} TTS layers")
        previous = state["previous_codes"]
        if previous.shape != (1, out.num_quantizers):
            raise ValueError(f"previous codes of shape {previous.shape}, the model has {out.num_quantizers} codebooks")
        out.keys, out.values = keys, values
        out.ring_origin, out.offset = ring_origin, int(meta_state["offset"])
        out.previous_codes = previous
        return out

    @property
    def nbytes(self) -> int:
        """Bytes held, allocated buffer capacity included (in a block: its own rows' share)."""
        if self._block is not None and self._caps is not None:
            row_pair = 2 * 2 * self.num_kv_heads * self.head_dim * 4  # K and V of the pair, float32
            return sum(cap * row_pair for cap in self._caps) + self.previous_codes.nbytes
        return sum(a.nbytes for a in self.keys) + sum(a.nbytes for a in self.values) + self.previous_codes.nbytes

    def __repr__(self) -> str:
        caps = [self.capacity(i) for i in range(self.num_layers)]
        return f"EarTtsState(offset={self.offset}, capacities={caps}, nbytes={self.nbytes})"


def attention_mask(q_start: int, n_q: int, k_start: int, window: int | None) -> mx.array:
    """Boolean (n_q, n_k) mask: queries at q_start.., keys at k_start..q_start+n_q-1.

    A key is visible iff it is not in the future and, for sliding layers, among
    the last `window` positions including the query's own.
    """
    q_pos = mx.arange(q_start, q_start + n_q)[:, None]
    k_pos = mx.arange(k_start, q_start + n_q)[None, :]
    visible = k_pos <= q_pos
    if window is not None:
        visible = visible & (k_pos > q_pos - window)
    return visible


@dataclass
class EarTtsHistory:
    """Everything the recompute path needs: warm-up inputs and the inputs of every step so far."""

    prompt_codes: mx.array
    speaker_latent: mx.array
    pad_id: int
    previous_codes: mx.array  # (1, Q) int32: what the next step embeds
    steps: list = field(default_factory=list)  # (previous_codes, text_token, eos_id, silence_codes) per step

    def copy(self) -> EarTtsHistory:
        return EarTtsHistory(self.prompt_codes, self.speaker_latent, self.pad_id, self.previous_codes, list(self.steps))


# --------------------------------------------------------------------------- backbone


class BackboneRMSNorm(nn.Module):
    """Backbone norm: "1 + w", formed in float32, or in the weight dtype with
    `one_plus_in_weight_dtype` (the reference's rounding, §12.2 item 6)."""

    def __init__(self, dims: int, eps: float, one_plus_in_weight_dtype: bool = False):
        super().__init__()
        self.weight = mx.zeros((dims,))
        self.eps = eps
        self.one_plus_in_weight_dtype = bool(one_plus_in_weight_dtype)

    def scale(self) -> mx.array:
        """The float32 1 + w, made once per weight."""
        flag = self.one_plus_in_weight_dtype
        return derived(self, "scale", (self.weight,), lambda w: one_plus_scale(w, flag))

    def __call__(self, x: mx.array) -> mx.array:
        return one_plus_rms_norm(x, self.weight, self.eps, scale=self.scale())


def _norm(v: mx.array, scale: mx.array, eps: float) -> mx.array:
    return one_plus_rms_norm(v, None, eps, scale=scale)


ROPE_BLOCK = 256  # positions per cached RoPE table of the single-step path


def rope_table(n: int, head_dim: int, base: float, offset: mx.array) -> tuple[mx.array, mx.array]:
    """cos and sin (1, 1, n, head_dim / 2) of RoPE at positions offset..offset+n-1, taken from
    `mx.fast.rope` itself: rotating [1, ..., 1, 0, ..., 0] gives 1·cos − 0·sin = cos and
    1·sin + 0·cos = sin exactly, so the table holds the very values the fused op uses, however
    it computes them. One table per base serves every layer of a step (on a CPU the op
    otherwise rebuilds its angles, cos and sin in each of them, ~20 dispatches per call)."""
    half = head_dim // 2
    probe = mx.concatenate([mx.ones((1, 1, n, half)), mx.zeros((1, 1, n, head_dim - half))], axis=-1)
    table = mx.fast.rope(probe, head_dim, traditional=False, base=base, scale=1.0, offset=offset)
    return table[..., :half], table[..., half:]


def _apply_rope(x: mx.array, cos: mx.array, sin: mx.array) -> mx.array:
    """Non-traditional RoPE over the whole last axis with a `rope_table`: the same float32
    operations, in the same order, as `mx.fast.rope` (x1·cos − x2·sin, x1·sin + x2·cos)."""
    half = cos.shape[-1]
    x1, x2 = x[..., :half], x[..., half:]
    return mx.concatenate([x1 * cos - x2 * sin, x1 * sin + x2 * cos], axis=-1)


def _qkv_core(dims, x, scales, rope, proj):
    """BackboneLayer up to the cache: the input norm, q / k / v projections, the q / k norms
    ("1 + w"), RoPE with the step's `rope_table` (cos, sin): inputs, so a compiled trace serves
    every step. scales = [input norm, q norm, k norm]."""
    heads, kv_heads, head_dim, in_eps, q_eps, k_eps = dims
    b, n, _ = x.shape
    cos, sin = rope
    in_scale, q_scale, k_scale = scales
    q_proj, k_proj, v_proj = proj
    x = _norm(x, in_scale, in_eps)
    q = _norm(apply(x, q_proj).reshape(b, n, heads, head_dim), q_scale, q_eps).transpose(0, 2, 1, 3)
    k = _norm(apply(x, k_proj).reshape(b, n, kv_heads, head_dim), k_scale, k_eps).transpose(0, 2, 1, 3)
    v = apply(x, v_proj).reshape(b, n, kv_heads, head_dim).transpose(0, 2, 1, 3)
    return _apply_rope(q, cos, sin), _apply_rope(k, cos, sin), v


def _in_groups(items, size: int) -> list[tuple]:
    """[a, b, c, d, ...] -> [(a, b), (c, d), ...] for size 2."""
    return list(zip(*[iter(items)] * size, strict=True))


def _mog_trunk_core(eps, x, scales, mlps):
    """MogHead.trunk: per block x + post_norm(mlp(pre_norm(x))), then the final norm. `scales` /
    `eps` list each block's (pre, post) norms, then the final norm's; `mlps` each block's
    (gate, up, down) layers."""
    norms = _in_groups(zip(scales[:-1], eps[:-1], strict=True), 2)
    for ((pre_scale, pre_eps), (post_scale, post_eps)), (gate, up, down) in zip(
        norms, _in_groups(mlps, 3), strict=True
    ):
        x = x + _norm(gated_mlp(_norm(x, pre_scale, pre_eps), gate, up, down), post_scale, post_eps)
    return _norm(x, scales[-1], eps[-1])


def _mus_rows(mus, k, num_predictions: int, low_rank: int, hidden: int, quant) -> mx.array:
    """The low_rank rows of component k of `proj_mus` (R, hidden). `mus` = (weight,) dense, or
    (weight, scales, biases) packed with `quant` = (group_size, bits, mode): only the chosen rows
    are dequantized (a checkpoint may store proj_mus quantized; docs/model.md §3.3). The
    floating-point modes (mxfp4, ...) have no biases (None)."""
    if quant is None:
        return mx.take(mus[0].reshape(num_predictions, low_rank, hidden), k, axis=0)
    group_size, bits, mode = quant
    rows = [None if a is None else mx.take(a.reshape(num_predictions, low_rank, -1), k, axis=0) for a in mus]
    return mx.dequantize(*rows, group_size=group_size, bits=bits, mode=mode)  # biases None: scale-only modes


@dataclass(frozen=True)
class MogSampling:
    """The fixed settings of one `MogHead.sample_residual` (part of its fused piece's key)."""

    top_p: float
    noise_scale: float
    min_log_std: float
    num_predictions: int
    low_rank: int
    log_of_softmax: bool
    mus_quant: tuple | None  # (group_size, bits, mode) when proj_mus is stored quantized


def _mog_sample_core(static: MogSampling, x, u, eps, mus, low_mat, proj):
    """MogHead.sample_residual after the draws (u: the Gumbel uniforms, eps: the noise):
    top-p filtered component log-probabilities, Gumbel-max choice k, then the latent
    mu_k * std + proj_else(x) + std * eps * noise_scale. `proj` holds proj_logits,
    proj_logs, proj_else."""
    top_p, noise_scale, min_log_std = static.top_p, static.noise_scale, static.min_log_std
    num_predictions, low_rank, log_of_softmax, mus_quant = (
        static.num_predictions,
        static.low_rank,
        static.log_of_softmax,
        static.mus_quant,
    )
    proj_logits, proj_logs, proj_else = proj
    n = x.shape[0]  # conversations (one row each); every operation below is row-wise
    logits = apply(x, proj_logits)[:, None].astype(mx.float32)  # (n, 1, P)
    filtered = mx.where(top_p_keep(mx.softmax(logits, axis=-1), top_p), logits, -mx.inf)
    if log_of_softmax:
        log_probs = mx.log(mx.softmax(filtered, axis=-1))  # the reference's rounding
    else:
        log_probs = filtered - mx.logsumexp(filtered, axis=-1, keepdims=True)
    # Gumbel-max with the reference's guards.
    gumbel = -mx.log(-mx.log(u + GUMBEL_EPS) + GUMBEL_EPS)
    k = mx.argmax(log_probs + gumbel, axis=-1).reshape(() if n == 1 else (n,))
    # Only the chosen component's low_rank rows of proj_mus are needed.
    hidden = x.shape[-1]
    mus_rows = _mus_rows(mus, k, num_predictions, low_rank, hidden, mus_quant)
    low = mx.take(low_mat, k, axis=0).astype(mx.float32)  # (latent, R) per row
    if n == 1:
        mu = (low @ (mus_rows.astype(mx.float32) @ x[0]))[None]  # (1, latent)
    else:
        mu = (low @ (mus_rows.astype(mx.float32) @ x[:, :, None]))[..., 0]  # (n, latent)
    log_std = mx.maximum(apply(x, proj_logs), min_log_std)  # (1, 1)
    std = mx.exp(log_std)
    mean = mu * std + apply(x, proj_else)
    return mean + std * eps * noise_scale


def _rvq_core(count, residual, books_t, books, norms):
    """EarTts.quantize_residual over `count` codebooks (one compiled piece per pass length)."""
    codes = []
    for book_t, book, norm in zip(books_t, books, norms, strict=True):
        dist = norm - 2.0 * ops.float32_matmul(residual, book_t)
        j = mx.argmin(dist, axis=-1)  # (1,) uint32
        residual = residual - mx.take(book, j, axis=0)  # row j* (1, latent)
        codes.append(j)
    return mx.concatenate(codes).astype(mx.int32), residual


def _rvq_rows_core(count, residual, books_t, books, norms):
    """`_rvq_core` of n conversations' residuals (n, latent) -> (codes (n, count) int32, residuals)."""
    codes = []
    for book_t, book, norm in zip(books_t, books, norms, strict=True):
        dist = norm - 2.0 * ops.float32_matmul(residual, book_t)
        j = mx.argmin(dist, axis=-1)  # (n,) uint32
        residual = residual - mx.take(book, j, axis=0)  # row j* of each
        codes.append(j)
    return mx.stack(codes, axis=-1).astype(mx.int32), residual


def _depth_sum(books: mx.array, index: mx.array, codes: mx.array, mask_code: int) -> mx.array:
    """Σ_q books[q, code_q] in float32 over the last axis of codes (..., Q); index = arange(Q);
    the mask code contributes a zero row."""
    rows = books[index, mx.minimum(codes, mask_code - 1)]
    return mx.where((codes < mask_code)[..., None], rows.astype(mx.float32), 0.0).sum(axis=-2)


def _embed_codes_core(static, codes, arrays, proj):
    """EarTts.embed_codes: the depth sum, then embed_code."""
    (mask_code,), (embed_code,) = static, proj
    return apply(_depth_sum(*arrays, codes, mask_code), embed_code)


def _post_attention_core(eps, x, merged, scales, proj):
    """BackboneLayer after the attention: attn = o_proj(merged heads); h = x + norm(attn);
    h + norm(mlp(norm(h))). proj = o_proj, gate, up, down."""
    o_proj, gate, up, down = proj
    (attn_scale, mlp_in_scale, mlp_out_scale), (attn_eps, mlp_in_eps, mlp_out_eps) = scales, eps
    h = x + _norm(apply(merged, o_proj), attn_scale, attn_eps)
    return h + _norm(gated_mlp(_norm(h, mlp_in_scale, mlp_in_eps), gate, up, down), mlp_out_scale, mlp_out_eps)


class BackboneAttention(nn.Module):
    def __init__(self, cfg: TtsConfig, layer_index: int, numerics: Numerics):
        super().__init__()
        h, kv, d = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        if h % kv:
            raise ValueError(f"tts_config.num_key_value_heads ({kv}) must divide num_attention_heads ({h})")
        self.q_proj = nn.Linear(cfg.hidden_size, h * d, bias=False)
        self.k_proj = nn.Linear(cfg.hidden_size, kv * d, bias=False)
        self.v_proj = nn.Linear(cfg.hidden_size, kv * d, bias=False)
        self.o_proj = nn.Linear(h * d, cfg.hidden_size, bias=False)
        in_weight_dtype = numerics.backbone_norm_one_plus_w_in_weight_dtype
        self.q_norm = BackboneRMSNorm(d, cfg.rms_norm_eps, in_weight_dtype)
        self.k_norm = BackboneRMSNorm(d, cfg.rms_norm_eps, in_weight_dtype)
        self.num_heads, self.num_kv_heads, self.head_dim = h, kv, d
        self.layer_index = layer_index
        is_global = cfg.is_global_layer(layer_index)
        self.window = None if is_global else cfg.sliding_window
        self.rope_base = float(cfg.rope_global_base_freq if is_global else cfg.rope_local_base_freq)
        self.scale = float(cfg.query_pre_attn_scalar) ** -0.5

    def __call__(
        self,
        x: mx.array,
        states: list,
        rope: tuple[mx.array, mx.array],
        input_norm: BackboneRMSNorm,
        step: BlockStep | None = None,
    ) -> mx.array:
        """x (2C, n, hidden) before the layer's `input_norm`: the guidance pairs of C conversations,
        pair c continuing `states[c]` (a list of one None: no cache); `rope` = the cos / sin of each
        row's positions (`rope_table`; one table broadcast over the rows when C == 1). -> the heads'
        output (2C, n, H·D) before o_proj. The projections take every row together; each pair
        attends over its own cache."""
        b, n, _ = x.shape
        dims = (self.num_heads, self.num_kv_heads, self.head_dim, input_norm.eps, self.q_norm.eps, self.k_norm.eps)
        q, k, v = ops.fused_linear(
            "tts_qkv",
            _qkv_core,
            dims,
            (self.q_proj, self.k_proj, self.v_proj),
            x,
            [input_norm.scale(), self.q_norm.scale(), self.k_norm.scale()],
            rope,
        )
        if step is not None:  # one position of the stepping pairs, over their K/V block
            return step.attend(self, q, k, v)
        if len(states) == 1:
            return self.attend(q, k, v, states[0], b, n)
        pairs = [
            self.attend(q[2 * c : 2 * c + 2], k[2 * c : 2 * c + 2], v[2 * c : 2 * c + 2], state, 2, n)
            for c, state in enumerate(states)
        ]
        return mx.concatenate(pairs, axis=0)

    def attend(self, q, k, v, state, b: int, n: int) -> mx.array:
        """Cache update and attention for roped q (B, H, n, D), k, v (B, KV, n, D) -> the heads'
        output (B, n, H·D); o_proj runs in the layer's post-attention piece."""
        if state is None:
            keys, values = k, v
            mask = attention_mask(0, n, 0, self.window) if n > 1 else None
        else:
            keys, values, mask = state.update_and_fetch(self.layer_index, k, v)
        out = mx.fast.scaled_dot_product_attention(q, keys, values, scale=self.scale, mask=mask)
        return out.transpose(0, 2, 1, 3).reshape(b, n, self.num_heads * self.head_dim)


class BackboneLayer(nn.Module):
    def __init__(self, cfg: TtsConfig, layer_index: int, numerics: Numerics):
        super().__init__()
        eps, w = cfg.rms_norm_eps, numerics.backbone_norm_one_plus_w_in_weight_dtype
        self.self_attn = BackboneAttention(cfg, layer_index, numerics)
        self.mlp = GeluGatedMLP(cfg.hidden_size, cfg.intermediate_size)
        self.input_layernorm = BackboneRMSNorm(cfg.hidden_size, eps, w)
        self.post_attention_layernorm = BackboneRMSNorm(cfg.hidden_size, eps, w)
        self.pre_feedforward_layernorm = BackboneRMSNorm(cfg.hidden_size, eps, w)
        self.post_feedforward_layernorm = BackboneRMSNorm(cfg.hidden_size, eps, w)

    def __call__(
        self, x: mx.array, states: list, rope: tuple[mx.array, mx.array], step: BlockStep | None = None
    ) -> mx.array:
        merged = self.self_attn(x, states, rope, self.input_layernorm, step)
        # Fixed shapes from here on: one fused piece.
        norms = (self.post_attention_layernorm, self.pre_feedforward_layernorm, self.post_feedforward_layernorm)
        mlp = self.mlp
        return ops.fused_linear(
            "tts_post_attention",
            _post_attention_core,
            tuple(n.eps for n in norms),
            (self.self_attn.o_proj, mlp.gate_proj, mlp.up_proj, mlp.down_proj),
            x,
            merged,
            [n.scale() for n in norms],
        )


class EarTtsBackbone(nn.Module):
    """Gemma-3 text stack without token embedding (§8.1)."""

    def __init__(self, cfg: TtsConfig, numerics: Numerics):
        super().__init__()
        self.layers = [BackboneLayer(cfg, i, numerics) for i in range(cfg.num_hidden_layers)]
        self.norm = BackboneRMSNorm(
            cfg.hidden_size, cfg.rms_norm_eps, numerics.backbone_norm_one_plus_w_in_weight_dtype
        )

    def __call__(self, x: mx.array, state: EarTtsState | None = None) -> mx.array:
        """x (2, n, hidden) -> (2, n, hidden). Without a state: positions 0..n-1 from scratch
        (offline function); with a state: positions state.offset.. (state advanced by n)."""
        return self._layers(x, [state], [0 if state is None else state.offset])

    def step_batch(self, x: mx.array, states: list[EarTtsState]) -> mx.array:
        """One position of C conversations: x (2C, 1, hidden), pair c continuing `states[c]` (each
        at its own offset, so its own RoPE angles and cache lengths) -> (2C, 1, hidden); advances the
        states. Pair c equals `self(x[2c:2c+2], states[c])` bit for bit where the products compute
        each row alone; with C == 1 it is that call."""
        states = list(states)
        batched = len(states) > 1 or states[0].block is not None
        step = BlockStep(states) if batched and x.shape[1] == 1 else None
        return self._layers(x, states, [st.offset for st in states], step)

    def _layers(self, x: mx.array, states: list, starts: list[int], step: BlockStep | None = None) -> mx.array:
        x = x.astype(mx.float32)
        n = x.shape[1]
        tables = {}  # one RoPE table per base (global / local layers) for the whole stack
        for layer in self.layers:
            attn = layer.self_attn
            rope = tables.get(attn.rope_base)
            if rope is None:
                per_pair = [self._rope(n, attn.head_dim, attn.rope_base, start) for start in starts]
                rope = tables[attn.rope_base] = per_pair[0] if len(per_pair) == 1 else _pair_rows(per_pair)
            x = layer(x, states, rope, step)
            ops.after_layer(x)  # this layer may run while the next one is built
        for state in states:
            if state is not None:
                state.offset += x.shape[1]
        return self.norm(x)

    def _rope(self, n: int, head_dim: int, base: float, start: int) -> tuple[mx.array, mx.array]:
        """`rope_table` for positions start..start+n-1. A single step slices it from a table of
        ROPE_BLOCK positions made once per block (the fallback's positions are exact integers in
        float32, so position p gets the same angle either way; tested): 2 dispatches per step
        instead of ~36."""
        if n != 1:
            return rope_table(n, head_dim, base, mx.array(start, dtype=mx.int32))
        first = start - start % ROPE_BLOCK
        blocks = self.__dict__.setdefault("_rope_blocks", {})
        key = (head_dim, base, first)
        block = blocks.get(key)
        if block is None:
            block = rope_table(ROPE_BLOCK, head_dim, base, mx.array(first, dtype=mx.int32))
            mx.eval(block)
            if len(blocks) >= 8:  # a session moves forward: keep the newest few blocks
                del blocks[next(iter(blocks))]
            blocks[key] = block
        i = start - first
        return block[0][:, :, i : i + 1], block[1][:, :, i : i + 1]


class BlockStep:
    """One single-position step of some conversations' backbones over a `TtsKvRows` block: the
    block they are all members of, else a new one of them and the other live members of their
    blocks (a copy once per change of who is in it). For each layer the host works out where each
    stepping pair writes (its buffer index, as alone) and how many entries each row sees; the block
    grows as its members' own buffers would (`KV_ALLOC_STEP`, at most the window) plus the
    scratch column. Members not stepping are padding rows: zero queries, zeros written to the
    scratch column, outputs dropped."""

    def __init__(self, states: list[EarTtsState]):
        block = self._block_for(states)
        self.block = block
        members = block.members
        self.rows: list[int] = [st.row_of(block) for st in states]  # type: ignore[misc]
        layers = states[0].num_layers
        index = [[-1] * layers for _ in members]  # -1: the scratch column
        valid = [[0] * layers for _ in members]
        stepping = set(self.rows)
        for c, st in enumerate(members):
            if st is None:
                continue
            for layer, w in enumerate(st.windows):
                if c in stepping:
                    i = st.offset if w is None else (st.offset - st.ring_origin[layer]) % w
                    st._caps[layer] = st.grown_capacity(layer, i + 1)  # as `_ensure_capacity`
                    index[c][layer] = i
                    valid[c][layer] = st.stored_length(layer, st.offset + 1)
                else:
                    valid[c][layer] = st.stored_length(layer)
        self.index, self.valid = index, valid
        for layer in range(layers):
            need = max(m._caps[layer] for m in members if m is not None) + 1  # + the scratch column
            block.keys[layer] = padded_to(block.keys[layer], need)
            block.values[layer] = padded_to(block.values[layer], need)
        self._masks: dict[tuple, mx.array] = {}

    @staticmethod
    def _block_for(states: list[EarTtsState]) -> TtsKvRows:
        """The block of the first stepping state that has one, conversations not in it placed in its
        free pairs (a copy of their own buffers only); a new block when there are not enough."""
        return block_with_room(states, BlockStep._new_block, BlockStep._place)

    @staticmethod
    def _place(block: TtsKvRows, st: EarTtsState, c: int) -> None:
        """Put `st`'s own buffers in the free pair `c` of `block` (zero-padded to its capacity)."""
        caps = [st.capacity(layer) for layer in range(st.num_layers)]
        keys, values = st._own_buffers()
        if st._block is not None:  # leaves another block: its row there is free
            old, i = st._block
            old.members[i] = None
        for layer in range(st.num_layers):
            block.keys[layer] = padded_to(block.keys[layer], caps[layer] + 1)
            block.values[layer] = padded_to(block.values[layer], caps[layer] + 1)
            have = block.keys[layer].shape[2]
            block.keys[layer][2 * c : 2 * c + 2] = padded_to(keys[layer], have)
            block.values[layer][2 * c : 2 * c + 2] = padded_to(values[layer], have)
        block.members[c] = st
        st.in_block(block, c, caps)

    @staticmethod
    def _new_block(states: list[EarTtsState]) -> TtsKvRows:
        members = members_with(states)
        layers = states[0].num_layers
        caps = [[m.capacity(layer) for layer in range(layers)] for m in members]
        owned = [m._own_buffers() for m in members]
        need = [max(c[layer] for c in caps) + 1 for layer in range(layers)]
        block = TtsKvRows(
            [mx.concatenate([padded_to(o[0][layer], need[layer]) for o in owned]) for layer in range(layers)],
            [mx.concatenate([padded_to(o[1][layer], need[layer]) for o in owned]) for layer in range(layers)],
            members,
        )
        for c, m in enumerate(members):
            m.in_block(block, c, caps[c])
        return block

    def attend(self, attn: BackboneAttention, q: mx.array, k: mx.array, v: mx.array) -> mx.array:
        """Write the stepping pairs' new K/V (2S, kv, 1, D) at their indices, attend over the block."""
        layer, block = attn.layer_index, self.block
        cap = block.keys[layer].shape[2]
        q, k, v = (spread_rows(a, self.rows, block.size, per=2) for a in (q, k, v))
        at = np.repeat(np.array([i[layer] if i[layer] >= 0 else cap - 1 for i in self.index], dtype=np.int32), 2)
        where = mx.broadcast_to(mx.array(at)[:, None, None, None], k.shape)
        block.keys[layer] = mx.put_along_axis(block.keys[layer], where, k, axis=2)
        block.values[layer] = mx.put_along_axis(block.values[layer], where, v, axis=2)
        valid = tuple(int(vc[layer]) for vc in self.valid)
        # Only the positions some stepping pair sees: the block's capacity can be far beyond them.
        span = max(valid[c] for c in self.rows)
        mask = self._masks.get((span, valid))
        if mask is None:
            seen = np.arange(span)[None, :] < np.repeat(np.array(valid), 2)[:, None]
            mask = self._masks[(span, valid)] = mx.array(seen[:, None, None, :])
        keys, values = block.keys[layer][:, :, :span], block.values[layer][:, :, :span]
        out = mx.fast.scaled_dot_product_attention(q, keys, values, scale=attn.scale, mask=mask)
        out = out.transpose(0, 2, 1, 3).reshape(out.shape[0], 1, attn.num_heads * attn.head_dim)
        return gather_rows(out, self.rows, block.size, per=2)


def _pair_rows(tables: list[tuple[mx.array, mx.array]]) -> tuple[mx.array, mx.array]:
    """Per-conversation RoPE tables (1, 1, n, D/2) -> (2C, 1, n, D/2): each conversation's angles on
    both rows of its guidance pair (what broadcasting gives a pair alone; the same values)."""
    cos = mx.concatenate([c for c, _ in tables for _ in range(2)], axis=0)
    sin = mx.concatenate([s for _, s in tables for _ in range(2)], axis=0)
    return cos, sin


# --------------------------------------------------------------------------- fusion, MoG


class GatedFusion(nn.Module):
    """fused = norm(σ(r)·(σ(g)⊙audio_proj(audio/Q) + (1 − σ(g))⊙text_proj(text))) (§8.4).

    Float32 throughout, unless `text_in_weight_dtype`: then the text is projected
    in its own dtype and σ(g), σ(r) are computed in the stored parameters' dtype
    (the reference's rounding); the sum and the norm are float32 either way.
    """

    def __init__(self, hidden: int, eps: float):
        super().__init__()
        self.audio_proj = nn.Linear(hidden, hidden, bias=True)
        self.text_proj = nn.Linear(hidden, hidden, bias=True)
        self.gate = mx.zeros((hidden,))
        self.residual_scale = mx.zeros(())
        self.final_norm = OnePlusRMSNorm(hidden, eps)

    def __call__(
        self, audio: mx.array, text: mx.array, num_quantizers: int, *, text_in_weight_dtype: bool = False
    ) -> mx.array:
        if text_in_weight_dtype:
            g = mx.sigmoid(self.gate).astype(mx.float32)
            r = mx.sigmoid(self.residual_scale).astype(mx.float32)
            t = self.text_proj(text)
        else:
            g = mx.sigmoid(self.gate.astype(mx.float32))
            r = mx.sigmoid(self.residual_scale.astype(mx.float32))
            t = self.text_proj(text.astype(mx.float32))
        a = self.audio_proj(audio.astype(mx.float32) / num_quantizers)
        return self.final_norm(r * (g * a + (1.0 - g) * t.astype(mx.float32)))


class MogBlock(nn.Module):
    """x + post_norm(mlp(pre_norm(x))): the weights of one trunk block (MogHead.trunk runs it)."""

    def __init__(self, hidden: int, intermediate: int, eps: float):
        super().__init__()
        self.pre_norm = OnePlusRMSNorm(hidden, eps)
        self.mlp = GeluGatedMLP(hidden, intermediate)
        self.post_norm = OnePlusRMSNorm(hidden, eps)


class MogHead(nn.Module):
    """Mixture-of-Gaussians head (§8.6 c–i): trunk, component choice, residual latent."""

    def __init__(self, cfg: TtsConfig):
        super().__init__()
        m, hidden = cfg.mog_head, cfg.hidden_size
        self.mlp_stack = [MogBlock(hidden, m.intermediate_size, m.eps) for _ in range(m.num_layers)]
        self.mlp_stack.append(OnePlusRMSNorm(hidden, m.eps))  # final norm = mlp_stack.{num_layers}
        self.proj_logits = nn.Linear(hidden, m.num_predictions, bias=False)
        self.proj_mus = nn.Linear(hidden, m.num_predictions * m.low_rank, bias=False)
        self.proj_logs = nn.Linear(hidden, 1, bias=False)
        self.proj_else = nn.Linear(hidden, cfg.latent_size, bias=False)
        self.low_mat = mx.random.normal((m.num_predictions, cfg.latent_size, m.low_rank)) * (m.low_rank**-0.5)
        self.num_predictions, self.low_rank = m.num_predictions, m.low_rank
        self.min_log_std = float(m.min_log_std)

    def trunk(self, x: mx.array) -> mx.array:
        blocks, final = self.mlp_stack[:-1], self.mlp_stack[-1]
        norms = [n for b in blocks for n in (b.pre_norm, b.post_norm)] + [final]
        mlps = [lin for b in blocks for lin in (b.mlp.gate_proj, b.mlp.up_proj, b.mlp.down_proj)]
        return ops.fused_linear(
            "mog_trunk", _mog_trunk_core, tuple(n.eps for n in norms), mlps, x, [n.scale() for n in norms]
        )

    def sample_residual(
        self, x: mx.array, rng: SessionRandom, *, top_p: float, noise_scale: float, log_of_softmax: bool = False
    ) -> mx.array:
        """Guided features x (1, hidden) -> sampled latent (1, latent). Draws one uniform
        (1, 1, num_predictions) then one normal (1, 1, latent) from `rng`. `log_of_softmax`: the
        component log-probabilities as log(softmax(·)) (the reference's rounding) instead of
        logits - logsumexp."""
        return self.sample_residual_rows(x, [rng], top_p=top_p, noise_scale=noise_scale, log_of_softmax=log_of_softmax)

    def sample_residual_rows(
        self, x: mx.array, rngs: list[SessionRandom], *, top_p: float, noise_scale: float, log_of_softmax: bool = False
    ) -> mx.array:
        """`sample_residual` of n conversations: x (n, hidden), row r drawing from `rngs[r]` (its own
        draws, in its own order) -> (n, latent). The component choice and the latent are row-wise."""
        draws = [rng.uniform_then_normal((1, 1, self.num_predictions), (1, 1, self.low_mat.shape[1])) for rng in rngs]
        if len(draws) == 1:
            u, eps = draws[0][0], draws[0][1][0]
        else:
            u = mx.concatenate([d[0] for d in draws], axis=0)  # (n, 1, P)
            eps = mx.concatenate([d[1][0] for d in draws], axis=0)  # (n, latent)
        mus = self.proj_mus
        quantized = isinstance(mus, nn.QuantizedLinear)
        mus_quant = (mus.group_size, mus.bits, mus.mode) if quantized else None
        mus_arrays = (mus.weight, mus.scales, mus.biases) if quantized else (mus.weight,)
        static = MogSampling(
            float(top_p),
            float(noise_scale),
            self.min_log_std,
            self.num_predictions,
            self.low_rank,
            bool(log_of_softmax),
            mus_quant,
        )
        return ops.fused_linear(
            "mog_sample",
            _mog_sample_core,
            static,
            (self.proj_logits, self.proj_logs, self.proj_else),
            x,
            u,
            eps,
            mus_arrays,
            self.low_mat,
        )


# --------------------------------------------------------------------------- model


class EarTts(nn.Module):
    """`tts_model.tts_model`: parameter names as docs/model.md §2.3 (relative to that prefix)."""

    def __init__(
        self, tts_cfg: TtsConfig, char_table: CharTable | None = None, *, numerics: Numerics | str = DEFAULT_NUMERICS
    ):
        super().__init__()
        cfg = tts_cfg
        numerics = numerics_from(numerics)
        if cfg.character_encoder.hidden_size != cfg.hidden_size:
            raise ValueError(
                "tts_config.character_encoder.hidden_size must equal tts_config.hidden_size "
                f"({cfg.character_encoder.hidden_size} != {cfg.hidden_size})"
            )
        self.cfg = cfg
        hidden, latent, q, c = cfg.hidden_size, cfg.latent_size, cfg.num_quantizers, cfg.codebook_size
        # Fixed for the module's life: its norms, caches and compiled pieces are built for it.
        self._numerics = numerics
        self.backbone = EarTtsBackbone(cfg, numerics)
        self.bos_emb = mx.random.normal((hidden,))
        self.null_emb = mx.random.normal((hidden,))
        self.embed_code = nn.Linear(latent, hidden, bias=False)
        # Loaded, never used at inference (the speaker latent is given directly).
        self.audio_prompt_projection_W = mx.random.normal((hidden, hidden)) * hidden**-0.5
        self.rvq_embs = mx.random.normal((q, c, latent))
        self.gated_fusion_audio_text = GatedFusion(hidden, cfg.rms_norm_eps)
        self.embed_subword = CharAwareSubwordEncoder(cfg.character_encoder)
        self.mog_head = MogHead(cfg)
        self._pass_counts = mog_pass_schedule(q, cfg.num_iterations, cfg.exponent)
        self._char_table = None
        self._checked_silence = None  # last silence_codes array whose values were checked
        if char_table is not None:
            self.set_char_table(char_table)

    # -- configuration

    @property
    def numerics(self) -> Numerics:
        """Where this model rounds as the reference does (voicechat/model/tts/numerics.py)."""
        return self._numerics

    @property
    def num_quantizers(self) -> int:
        return self.cfg.num_quantizers

    @property
    def mask_code(self) -> int:
        """The "empty" code: index codebook_size, a zero row of the padded codebooks."""
        return self.cfg.codebook_size

    @property
    def pass_counts(self) -> list[int]:
        return list(self._pass_counts)

    @property
    def char_table(self) -> CharTable | None:
        return self._char_table

    def set_char_table(self, table: CharTable) -> None:
        if not isinstance(table, CharTable):
            raise TypeError(f"char_table: expected a CharTable, got {type(table).__name__}")
        want = self.cfg.character_encoder.char_vocab_size
        if table.char_vocab_size != want:
            raise ValueError(f"char_table: built for char_vocab_size {table.char_vocab_size}, the model has {want}")
        self._char_table = table

    def _table(self) -> CharTable:
        if self._char_table is None:
            raise ValueError("EarTts has no char table: call set_char_table(CharTable.from_vocab(...)) first")
        return self._char_table

    def make_state(self) -> EarTtsState:
        cfg = self.cfg
        windows = [None if cfg.is_global_layer(i) else cfg.sliding_window for i in range(cfg.num_hidden_layers)]
        return EarTtsState(windows, cfg.num_key_value_heads, cfg.head_dim, cfg.num_quantizers, self.mask_code)

    # -- input checks

    def _check_codes(self, codes, name: str, *, allow_mask: bool, check_values: bool = True) -> mx.array:
        codes = as_int_array(codes, name)
        if codes.ndim == 0 or codes.shape[-1] != self.num_quantizers:
            raise ValueError(
                f"{name}: expected {self.num_quantizers} codes per frame (last axis), got shape {codes.shape}"
            )
        if check_values:
            check_value_range(codes, name, 0, self.mask_code if allow_mask else self.mask_code - 1)
        return codes.astype(mx.int32)

    def _check_silence(self, silence_codes) -> mx.array:
        fresh = not isinstance(silence_codes, mx.array) or silence_codes is not self._checked_silence
        codes = self._check_codes(silence_codes, "silence_codes", allow_mask=False, check_values=fresh)
        if codes.ndim != 1:
            raise ValueError(f"silence_codes: expected shape ({self.num_quantizers},), got {codes.shape}")
        if isinstance(silence_codes, mx.array):
            # Sessions pass the same buffer every step: check its values (a host sync) once.
            self._checked_silence = silence_codes
        return codes

    @staticmethod
    def _check_token(text_token) -> int | mx.array:
        if isinstance(text_token, (bool, np.bool_)):
            raise TypeError("text_token: expected an int token id or an integer mx.array, got a bool")
        if isinstance(text_token, (int, np.integer)):
            if text_token < 0:
                raise ValueError(f"text_token: expected a token id >= 0, got {text_token}")
            return int(text_token)
        if isinstance(text_token, mx.array):
            if not is_integer_dtype(text_token.dtype) or text_token.size != 1:
                raise TypeError(
                    f"text_token: expected one integer token id, got an mx.array of shape {text_token.shape} "
                    f"and dtype {text_token.dtype}"
                )
            return text_token.reshape(()).astype(mx.int32)
        raise TypeError(f"text_token: expected an int or an integer mx.array, got {type(text_token).__name__}")

    @staticmethod
    def _check_id(value, name: str) -> int:
        if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)) or value < 0:
            raise TypeError(f"{name}: expected an int token id >= 0, got {value!r}")
        return int(value)

    # -- embeddings

    def depthsum(self, codes: mx.array) -> mx.array:
        """codes (..., Q) in 0..codebook_size -> (..., latent) float32: Σ_q rvq_embs[q, code_q],
        the mask code (codebook_size) contributing a zero row."""
        return _depth_sum(*self._depth_sum_arrays(), codes, self.mask_code)

    def _depth_sum_arrays(self) -> list[mx.array]:
        """[rvq_embs, arange(Q)]: the codebooks and the codebook index `_depth_sum` reads."""
        index = derived(self, "codebook_index", (self.rvq_embs,), lambda e: mx.arange(e.shape[0]))
        return [self.rvq_embs, index]

    def embed_codes(self, codes: mx.array) -> mx.array:
        """embed_code(depthsum(codes)): (..., Q) -> (..., hidden); one compiled piece."""
        return ops.fused_linear(
            "embed_codes", _embed_codes_core, (self.mask_code,), (self.embed_code,), codes, self._depth_sum_arrays()
        )

    def _fuse(self, audio: mx.array, cond: mx.array) -> mx.array:
        """Audio side (n, hidden) and conditional text (n, hidden) -> fused backbone input
        (2, n, hidden) for the guidance pair [conditional text, null_emb]."""
        in_weight_dtype = self.numerics.text_side_in_weight_dtype
        null = self.null_emb if in_weight_dtype else self.null_emb.astype(mx.float32)
        text = mx.stack([cond, mx.broadcast_to(null, cond.shape)])  # dtypes promote, as in the reference
        return self.gated_fusion_audio_text(
            audio[None], text, self.num_quantizers, text_in_weight_dtype=in_weight_dtype
        )

    def warmup_inputs(self, prompt_codes, speaker_latent, pad_id: int) -> mx.array:
        """Fused backbone inputs (2, F, hidden) of the speaker-prompt warm-up (§8.5 steps 2–6)."""
        codes, latent, pad_id = self._check_warmup_args(prompt_codes, speaker_latent, pad_id)
        f = codes.shape[0]
        shifted = mx.concatenate([mx.zeros((1, self.num_quantizers), dtype=mx.int32), codes[:-1]], axis=0)
        code_emb = self.embed_codes(shifted)
        # Positions before the first bos (F-1) take the speaker latent; bos_emb is added at F-1.
        audio = mx.concatenate([latent[0, : f - 1], code_emb[f - 1 :] + self.bos_emb.astype(mx.float32)], axis=0)
        mask = [False] * (f - 2) + [True, True]
        text = self.embed_subword.embed_host(
            [pad_id] * f, mask, self._table(), in_weight_dtype=self.numerics.text_side_in_weight_dtype
        )
        return self._fuse(audio, text)

    def step_inputs(
        self,
        previous_codes: mx.array,
        text_token,
        *,
        eos_id: int,
        silence_codes,
        text_cache: TextEmbeddingCache | None = None,
    ) -> mx.array:
        """Fused backbone input (2, 1, hidden) of one step (§8.6 steps 1–3). `text_cache` keeps
        the character encoder's row of each host token id seen (a pure function of the id)."""
        token = self._check_token(text_token)
        eos_id = self._check_id(eos_id, "eos_id")
        silence = self._check_silence(silence_codes)
        if isinstance(token, int):
            previous = silence[None] if token == eos_id else previous_codes  # the EOS rule on the host id
        else:
            previous = mx.where(token == eos_id, silence[None], previous_codes)  # device-side, no sync
        audio = self.embed_codes(previous)  # (1, hidden)
        in_weight_dtype = self.numerics.text_side_in_weight_dtype
        if isinstance(token, int):
            text = text_cache.get(token) if text_cache is not None else None
            if text is None:
                text = self.embed_subword.embed_host([token], [True], self._table(), in_weight_dtype=in_weight_dtype)
                if text_cache is not None:
                    text_cache.put(token, text)
        else:
            text = self.embed_subword.embed_device(token, self._table(), in_weight_dtype=in_weight_dtype)
        return self._fuse(audio, text)

    def _check_warmup_args(self, prompt_codes, speaker_latent, pad_id):
        codes = self._check_codes(prompt_codes, "prompt_codes", allow_mask=True)
        if codes.ndim != 2 or codes.shape[0] < 2:
            raise ValueError(
                f"prompt_codes: expected shape (F, {self.num_quantizers}) with F >= 2 frames, got {codes.shape}"
            )
        if not isinstance(speaker_latent, mx.array):
            raise TypeError(f"speaker_latent: expected an mx.array, got {type(speaker_latent).__name__}")
        if not mx.issubdtype(speaker_latent.dtype, mx.floating):
            raise TypeError(f"speaker_latent: expected a float array, got dtype {speaker_latent.dtype}")
        want = (1, codes.shape[0], self.cfg.hidden_size)
        if tuple(speaker_latent.shape) != want:
            raise ValueError(
                f"speaker_latent: expected shape {want} (one row per prompt frame), got {speaker_latent.shape}"
            )
        return codes, speaker_latent.astype(mx.float32), self._check_id(pad_id, "pad_id")

    # -- code generation

    def generate_codes(self, hidden: mx.array, rng: SessionRandom) -> mx.array:
        """Backbone output (2, hidden) [conditional, unconditional] -> codes (Q,) int32 (§8.6 step 5).

        Two draws per effective pass (uniform then normal), in pass order.
        """
        return self.generate_codes_batch(hidden, [rng])[0]

    def generate_codes_batch(self, hidden: mx.array, rngs: list[SessionRandom]) -> list[mx.array]:
        """`generate_codes` of C conversations: hidden (2C, hidden), pair c [conditional,
        unconditional] of conversation c, which draws from `rngs[c]` -> C code vectors (Q,).

        Per pass, the code embedding and the MoG trunk take every row together; each conversation's
        sampling (its own draws, in its own order) and RVQ run on its own row."""
        cfg = self.cfg
        count_c = len(rngs)
        assigned: list[list[mx.array]] = [[] for _ in rngs]  # the (count,) int32 codes of each pass, codebook 0 first
        done = 0
        for count in self._pass_counts:
            if count == 0:
                continue
            rest = self.num_quantizers - done
            mask = mx.full((rest,), self.mask_code, dtype=mx.int32)
            codes = stack_rows([mx.concatenate([*a, mask])[None] for a in assigned])  # (C, Q)
            e = self.embed_codes(codes)  # (C, hidden)
            # Both guidance rows of every conversation as one batch: [e + cond, e + uncond] per pair.
            if count_c == 1:
                rows = [e + hidden[0:1], e + hidden[1:2]]
            else:
                rows = [e[c : c + 1] + hidden[2 * c + g : 2 * c + g + 1] for c in range(count_c) for g in (0, 1)]
            feats = self.mog_head.trunk(mx.concatenate(rows, axis=0))
            if count_c == 1:
                cond, uncond = feats[0:1], feats[1:2]
            else:
                cond, uncond = feats[0::2], feats[1::2]
            guided = cond + cfg.guidance_scale * (cond - uncond)
            residual = self.mog_head.sample_residual_rows(
                guided,
                rngs,
                top_p=cfg.top_p,
                noise_scale=cfg.noise_scale,
                log_of_softmax=self.numerics.mog_log_probs_as_log_of_softmax,
            )
            if count_c == 1:
                pass_codes = [self.quantize_pass(residual, done, count)[0]]
            else:
                pass_codes = self.quantize_pass_rows(residual, done, count)
            ops.after_layer(*pass_codes)  # this pass may run while the next one is built
            for a, c in zip(assigned, pass_codes, strict=True):
                a.append(c)
            done += count
        return [mx.concatenate(a) for a in assigned]

    def quantize_residual(self, residual: mx.array, first: int, count: int) -> tuple[list[mx.array], mx.array]:
        """Greedy RVQ of `residual` (1, latent) over codebooks first..first+count-1 (§8.6 j):
        j* = argmin_j ‖e_j‖² − 2·residual·e_j, then residual −= e_j*.
        Returns ([(1,) int32 code per codebook], the remaining residual (1, latent))."""
        codes, residual = self.quantize_pass(residual, first, count)
        return [codes[i : i + 1] for i in range(count)], residual

    def quantize_pass(self, residual: mx.array, first: int, count: int) -> tuple[mx.array, mx.array]:
        """`quantize_residual` with the codes as one (count,) int32 array: what a MoG pass runs.
        One compiled piece per pass length; per codebook one product, the distance, argmin and
        one row gather (~7 dispatches: the codebooks are per-codebook arrays made once); where the
        CPU kernels serve it, the whole pass as one dispatch (`ops.rvq_pass`, the same bits)."""
        books_all, norms_all = self.rvq_books()
        fused = ops.rvq_pass(residual, books_all[first : first + count], norms_all[first : first + count])
        if fused is not None:
            return fused
        books_t, books, all_norms = self.rvq_book_list()
        core = ops.fused(("rvq", count), lambda: functools.partial(_rvq_core, count))
        part = slice(first, first + count)
        return core(residual, books_t[part], books[part], all_norms[part])

    def quantize_pass_rows(self, residual: mx.array, first: int, count: int) -> list[mx.array]:
        """`quantize_pass` of n conversations' residuals (n, latent) -> each one's (count,) codes. Where
        the CPU kernel serves the pass (one row per dispatch) each row takes it; otherwise the pass's
        operations run over all rows at once (each row's own products, distances and argmin)."""
        books_all, norms_all = self.rvq_books()
        books_t_all, norms = books_all[first : first + count], norms_all[first : first + count]
        rows = [ops.rvq_pass(residual[r : r + 1], books_t_all, norms) for r in range(residual.shape[0])]
        if all(r is not None for r in rows):
            return [r[0] for r in rows]  # type: ignore[index]
        books_t, books, all_norms = self.rvq_book_list()
        core = ops.fused(("rvq_rows", count), lambda: functools.partial(_rvq_rows_core, count))
        part = slice(first, first + count)
        codes, _ = core(residual, books_t[part], books[part], all_norms[part])
        return [codes[r] for r in range(residual.shape[0])]

    def rvq_book_list(self) -> tuple[list[mx.array], list[mx.array], list[mx.array]]:
        """`rvq_books` per codebook: the (latent, C) codebook, its transpose (C, latent) for the
        row gather and the (1, C) norms; views of those arrays (no copy), made once per weights."""
        books_t, norms = self.rvq_books()

        def make(books_t, norms):
            per_book = [books_t[q] for q in range(books_t.shape[0])]
            out = per_book, [b.T for b in per_book], [norms[q : q + 1] for q in range(norms.shape[0])]
            mx.eval(out)
            return out

        return derived(self, "rvq_book_views", (books_t, norms), make)

    def rvq_books(self) -> tuple[mx.array, mx.array]:
        """(float32 codebooks transposed, (Q, latent, C) contiguous; squared norms ‖e_j‖² (Q, C)
        float32, from the stored dtype with numerics.rvq_norms_in_weight_dtype), made once per weights:
        they are constants, and a TTS step would otherwise convert and square every codebook again (31 x C x latent
        per step). Transposed because MLX's CPU BLAS runs residual @ E.T twice as fast on a
        contiguous E.T, with the same result (voicechat.runtime.linear.linear)."""
        in_weight_dtype = self.numerics.rvq_norms_in_weight_dtype

        def make(stored):
            books = stored.astype(mx.float32)
            src = stored if in_weight_dtype else books
            norms = (src * src).sum(axis=-1).astype(mx.float32)
            books_t = mx.contiguous(books.transpose(0, 2, 1))
            mx.eval(books_t, norms)
            return books_t, norms

        return derived(self, "rvq_books", (self.rvq_embs,), make)

    # -- cached path

    def warmup(self, state: EarTtsState, prompt_codes, speaker_latent, pad_id: int) -> None:
        """Speaker-prompt warm-up (§8.5): fresh caches, run all F prompt positions, keep the caches;
        previous_codes := the last prompt code frame (the all-mask frame)."""
        self._check_state(state)
        x = self.warmup_inputs(prompt_codes, speaker_latent, pad_id)
        state.reset()
        self.backbone(x, state)  # outputs unused: only the caches matter
        state.previous_codes = self._check_codes(prompt_codes, "prompt_codes", allow_mask=True, check_values=False)[-1:]

    def step_hidden(
        self,
        state: EarTtsState,
        text_token,
        *,
        eos_id: int,
        silence_codes,
        text_cache: TextEmbeddingCache | None = None,
    ) -> mx.array:
        """One backbone step over `state` -> (2, hidden) [conditional, unconditional].
        Advances the caches; does not touch state.previous_codes."""
        self._check_state(state)
        x = self.step_inputs(
            state.previous_codes, text_token, eos_id=eos_id, silence_codes=silence_codes, text_cache=text_cache
        )
        return self.backbone(x, state)[:, -1]

    def step(
        self,
        state: EarTtsState,
        text_token,
        rng: SessionRandom,
        *,
        eos_id: int,
        silence_codes,
        text_cache: TextEmbeddingCache | None = None,
    ) -> mx.array:
        """One TTS step (§8.6) -> codes (Q,) int32, lazy: no host sync except a one-time value
        check of a silence_codes array not seen before. The new codes become state.previous_codes."""
        return self.step_batch(
            [state], [text_token], [rng], eos_id=eos_id, silence_codes=silence_codes, text_caches=[text_cache]
        )[0]

    def step_batch(
        self,
        states: list[EarTtsState],
        text_tokens: list,
        rngs: list[SessionRandom],
        *,
        eos_id: int,
        silence_codes,
        text_caches: list[TextEmbeddingCache | None],
    ) -> list[mx.array]:
        """`step` of C conversations at once (each its own state, token, random stream and text
        cache) -> their codes. The backbone and the MoG trunk take every conversation's rows
        together; each computes exactly what `step` computes for it alone."""
        if not (len(states) == len(text_tokens) == len(rngs) == len(text_caches)) or not states:
            raise ValueError("step_batch needs one state, text token, random stream and text cache per conversation")
        for rng in rngs:
            if not isinstance(rng, SessionRandom):
                raise TypeError(f"rng: expected a SessionRandom, got {type(rng).__name__}")
        for state in states:
            self._check_state(state)
        inputs = [
            self.step_inputs(st.previous_codes, tok, eos_id=eos_id, silence_codes=silence_codes, text_cache=tc)
            for st, tok, tc in zip(states, text_tokens, text_caches, strict=True)
        ]
        if len(states) == 1 and states[0].block is None:
            hidden = self.backbone(inputs[0], states[0])[:, -1]
        else:
            hidden = self.backbone.step_batch(mx.concatenate(inputs, axis=0), states)[:, -1]
        codes = self.generate_codes_batch(hidden, rngs)
        for state, c in zip(states, codes, strict=True):
            state.previous_codes = c[None]
        return codes

    def _check_state(self, state) -> None:
        if not isinstance(state, EarTtsState):
            raise TypeError(f"state: expected an EarTtsState (EarTts.make_state()), got {type(state).__name__}")
        if state.num_layers != self.cfg.num_hidden_layers or state.num_quantizers != self.num_quantizers:
            raise ValueError(
                f"state: made for {state.num_layers} layers / {state.num_quantizers} quantizers, the model has "
                f"{self.cfg.num_hidden_layers} / {self.num_quantizers}"
            )

    # -- recompute path (parity)

    def new_history(self, prompt_codes, speaker_latent, pad_id: int) -> EarTtsHistory:
        codes, latent, pad_id = self._check_warmup_args(prompt_codes, speaker_latent, pad_id)
        return EarTtsHistory(codes, latent, pad_id, previous_codes=codes[-1:])

    def uncached_hidden(self, history: EarTtsHistory, text_token, *, eos_id: int, silence_codes) -> mx.array:
        """(2, hidden) of the next step, recomputed over every position from scratch."""
        rows = [self.warmup_inputs(history.prompt_codes, history.speaker_latent, history.pad_id)]
        for prev, tok, eos, sil in history.steps:
            rows.append(self.step_inputs(prev, tok, eos_id=eos, silence_codes=sil))
        rows.append(self.step_inputs(history.previous_codes, text_token, eos_id=eos_id, silence_codes=silence_codes))
        return self.backbone(mx.concatenate(rows, axis=1), None)[:, -1]

    def step_uncached(
        self, history: EarTtsHistory, text_token, rng: SessionRandom, *, eos_id: int, silence_codes
    ) -> mx.array:
        """Same contract as `step`, recomputing the backbone over the whole history; appends to it."""
        if not isinstance(rng, SessionRandom):
            raise TypeError(f"rng: expected a SessionRandom, got {type(rng).__name__}")
        hidden = self.uncached_hidden(history, text_token, eos_id=eos_id, silence_codes=silence_codes)
        codes = self.generate_codes(hidden, rng)
        history.steps.append((history.previous_codes, text_token, eos_id, silence_codes))
        history.previous_codes = codes[None]
        return codes
