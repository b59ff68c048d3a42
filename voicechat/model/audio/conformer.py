"""Cache-aware causal FastConformer encoder and the perception projection
(docs/model.md §5, §6.1). Owns the subtree `perception.`.

Paths:

* offline: `FastConformer.__call__(mel (T, F)) -> (T_enc, d)`: subsampling of
  the whole input, chunked-limited relative-position attention (query i sees
  keys i-left .. i), causal depthwise convolution.
* streaming: `ConformerStream(encoder)` with an explicit `ConformerState`:
  `push(mel (n, F)) -> (n_out, d)`. Encoder frame k is produced once mel frame
  8k has been pushed. Per layer the state keeps the projected K and V of the
  last `left` frames and the last kernel-1 GLU outputs; the subsampling keeps
  the mel frames it still needs (at most 16). Nothing grows with stream length.
* `PerceptionFallback`: the non-cached approximation of §5.2 (re-encode a
  window of recent audio every frame).

Streamed frames equal the offline frames up to float32 rounding: the two paths
do the same arithmetic, but on differently shaped operands (one query row
against <= left+1 keys instead of a T x T score matrix whose masked entries
are exact zeros after the softmax, 1-row instead of T-row matmuls), so BLAS
blocking and reduction orders differ at the ~1e-7 level per operation.
"""

from __future__ import annotations

import functools
import math

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from voicechat.model import ops
from voicechat.model.audio.mel import as_waveform, log_mel
from voicechat.model.config import AudioConfig, EncoderConfig, PreprocessorConfig
from voicechat.model.derived import derived
from voicechat.model.ops import norm_params, structure
from voicechat.model.rows import BlockRow

_MASK_VALUE = -1e30  # additive mask on the position term (docs/model.md §5.1)


# --------------------------------------------------------------------------- helpers


def _as_mel(mel, feat_in: int, what: str) -> mx.array:
    if isinstance(mel, np.ndarray):
        mel = mx.array(mel)
    if not isinstance(mel, mx.array):
        raise TypeError(f"{what}: expected an mx or numpy array (T, {feat_in}), got {type(mel).__name__}")
    x = mel
    if x.ndim != 2 or x.shape[1] != feat_in:
        raise ValueError(f"{what}: expected mel frames of shape (T, {feat_in}), got {tuple(x.shape)}")
    if not mx.issubdtype(x.dtype, mx.floating):
        raise TypeError(f"{what}: expected floating mel frames, got dtype {x.dtype}")
    return x.astype(mx.float32)


def subsampled_length(n_mel: int, stages: int = 3) -> int:
    """Frames after `stages` causal stride-2 convolutions: L -> L // 2 + 1 each."""
    if n_mel <= 0:
        return 0
    for _ in range(stages):
        n_mel = n_mel // 2 + 1
    return n_mel


def relative_positional_encoding(positions: mx.array, d_model: int) -> mx.array:
    """Transformer-XL sinusoids (n, d_model) for the given relative positions (float32).

    pe[p, 2i] = sin(p * 10000^(-2i/d)), pe[p, 2i+1] = cos(...). The reference
    reads rows of a (2 * pos_emb_max_len - 1)-row table built with the same
    formula; computing the needed rows directly gives the same values.
    """
    inv_freq = mx.exp(mx.arange(0, d_model, 2, dtype=mx.float32) * (-math.log(10000.0) / d_model))
    angles = positions.astype(mx.float32)[:, None] * inv_freq[None, :]
    return mx.stack([mx.sin(angles), mx.cos(angles)], axis=-1).reshape(positions.size, d_model)


def rel_shift(x: mx.array) -> mx.array:
    """(H, T, 2T-1) scores over relative positions T-1 .. -(T-1) -> (H, T, T) with
    out[h, i, j] = x[h, i, T-1-i+j] (position i-j), by the pad/reshape trick."""
    h, t, p = x.shape
    x = mx.pad(x, [(0, 0), (0, 0), (1, 0)])  # (H, T, 2T)
    x = x.reshape(h, p + 1, t)[:, 1:]  # (H, 2T-1, T)
    return x.reshape(h, t, p)[:, :, :t]


# --------------------------------------------------------------------------- subsampling


class ConvSubsampling(nn.Module):
    """Causal dw_striding 8x subsampling: (T, F) -> (T_enc, d_model).

    conv.0: Conv2d 1->C 3x3/2; conv.2 + conv.3: depthwise 3x3/2 + pointwise 1x1
    (twice, conv.5/conv.6); ReLU after each stage (items 1, 4, 7 have no
    parameters). Causal padding 2 before / 1 after on time and frequency.
    """

    def __init__(self, cfg: EncoderConfig):
        super().__init__()
        c = cfg.subsampling_conv_channels
        self.conv = [
            nn.Conv2d(1, c, 3, stride=2),
            nn.ReLU(),
            nn.Conv2d(c, c, 3, stride=2, groups=c),
            nn.Conv2d(c, c, 1),
            nn.ReLU(),
            nn.Conv2d(c, c, 3, stride=2, groups=c),
            nn.Conv2d(c, c, 1),
            nn.ReLU(),
        ]
        # MLX's default init ignores groups (scale 1/sqrt(C*9)); give the
        # depthwise kernels a fan-in of 9 so random models keep their scale.
        for i in (2, 5):
            self.conv[i].weight = mx.random.uniform(-1 / 3, 1 / 3, self.conv[i].weight.shape)
        f = cfg.feat_in
        for _ in range(3):
            f = f // 2 + 1
        self.out_freq = f
        self.out = nn.Linear(c * f, cfg.d_model)

    @staticmethod
    def _causal_conv(conv: nn.Conv2d, x: mx.array) -> mx.array:
        x = mx.pad(x, [(0, 0), (2, 1), (2, 1), (0, 0)])
        return conv(x)

    def __call__(self, mel: mx.array) -> mx.array:
        x = mel.astype(mx.float32)[None, :, :, None]  # (1, T, F, 1): time x freq image
        x = nn.relu(self._causal_conv(self.conv[0], x))
        x = nn.relu(self.conv[3](self._causal_conv(self.conv[2], x)))
        x = nn.relu(self.conv[6](self._causal_conv(self.conv[5], x)))
        t, f, c = x.shape[1:]
        x = x[0].transpose(0, 2, 1).reshape(t, c * f)  # channel-major flatten: c * F' + f
        return self.out(x)


# --------------------------------------------------------------------------- blocks


@functools.lru_cache(maxsize=512)
def _step_index_and_mask(n_heads: int, n: int, lc: int, left: int) -> tuple[mx.array, mx.array]:
    """Streaming attention constants for n new frames after lc cached ones (a window of `left`):
    the index of each (query, key) distance in the positional table, clipped to 0..left,
    (H, n, lc+n) int32, and the additive mask (n, lc+n) float32 (0 inside the window).
    Built on the host once per shape: they are the same for every layer and every steady frame."""
    dist = (np.arange(n)[:, None] + lc) - np.arange(lc + n)[None, :]  # query - key
    allowed = (dist >= 0) & (dist <= left)
    idx = np.broadcast_to(np.clip(dist, 0, left)[None], (n_heads, n, lc + n)).astype(np.int32)
    mask = np.where(allowed, np.float32(0.0), np.float32(_MASK_VALUE)).astype(np.float32)
    return mx.array(idx), mx.array(mask)


def _depthwise(din, taps, bias):
    n = din.shape[0] - len(taps) + 1
    out = din[0:n] * taps[0]
    for j in range(1, len(taps)):
        out = out + din[j : j + n] * taps[j]
    return out + bias if bias is not None else out


def _layer_norm(x, p, eps):
    """LayerNorm with an nn.LayerNorm's params `p` (`norm_params`)."""
    return ops.layer_norm(x, p.get("weight"), p.get("bias"), eps)


def _pointwise(x, p):
    """1x1 conv as a product; p = {"weight_t": (I, O) matrix, "bias"?} (ConvModule.pointwise_weights)."""
    y = ops.float32_matmul(x, p["weight_t"])
    return y + p["bias"] if "bias" in p else y


def _glu(x, p1):
    """GLU(pointwise_conv1(x)): the depthwise conv's input."""
    a, b = mx.split(_pointwise(x, p1), 2, axis=-1)
    return a * mx.sigmoid(b)


def _glu_core(eps, x, norms, p1):
    """The streaming piece before the conv cache: GLU(pointwise_conv1(norm_conv(x)))."""
    return _glu(_layer_norm(x, norms[0], eps[0]), p1)


def _conv_out_core(eps, x, din, taps, bias, norms, p2):
    """The streaming piece after the conv cache: x + pointwise_conv2(silu(norm(depthwise(din))))."""
    dw = _depthwise(din, taps, bias[0] if bias else None)
    return x + _pointwise(nn.silu(_layer_norm(dw, norms[1], eps[1])), p2)


def _conv_out_rows_core(eps, x, din, taps, bias, norms, p2):
    """`_conv_out_core` of C conversations, one new frame each: din (C, K, d) their windows."""
    dw = din[:, 0] * taps[0]
    for j in range(1, len(taps)):
        dw = dw + din[:, j] * taps[j]
    if bias:
        dw = dw + bias[0]
    return x + _pointwise(nn.silu(_layer_norm(dw, norms[1], eps[1])), p2)


def _feed_forward_core(static, x, norms, ff):
    """x + 0.5 linear2(silu(linear1(norm(x)))), then the output norm if `norms` has two entries;
    static = (norm eps, output norm eps, norm structure)."""
    eps = static
    h = nn.silu(ops.apply(_layer_norm(x, norms[0], eps[0]), ff[0]))
    y = x + 0.5 * ops.apply(h, ff[1])
    return _layer_norm(y, norms[1], eps[1]) if len(norms) > 1 else y


class FeedForward(nn.Module):
    def __init__(self, d: int, hidden: int, bias: bool):
        super().__init__()
        self.linear1 = nn.Linear(d, hidden, bias=bias)
        self.linear2 = nn.Linear(hidden, d, bias=bias)

    def __call__(self, x: mx.array) -> mx.array:
        return self.linear2(nn.silu(self.linear1(x)))


class RelPositionAttention(nn.Module):
    """Transformer-XL relative-position multi-head self-attention."""

    def __init__(self, d: int, n_heads: int, bias: bool):
        super().__init__()
        self.n_heads = n_heads
        self.head_dim = d // n_heads
        self.linear_q = nn.Linear(d, d, bias=bias)
        self.linear_k = nn.Linear(d, d, bias=bias)
        self.linear_v = nn.Linear(d, d, bias=bias)
        self.linear_out = nn.Linear(d, d, bias=bias)
        self.linear_pos = nn.Linear(d, d, bias=False)
        # NeMo initialises these to zero; small random values keep the u/v
        # terms exercised in random-weight tests (a checkpoint overwrites them).
        self.pos_bias_u = 0.1 * mx.random.normal((n_heads, self.head_dim))
        self.pos_bias_v = 0.1 * mx.random.normal((n_heads, self.head_dim))

    def _heads(self, x: mx.array) -> mx.array:
        return x.reshape(x.shape[0], self.n_heads, self.head_dim).transpose(1, 0, 2)

    def _merge(self, x: mx.array) -> mx.array:
        return x.transpose(1, 0, 2).reshape(x.shape[1], self.n_heads * self.head_dim)

    def positional_projection(self, pe: mx.array) -> mx.array:
        """Wpos . pe per head: (n, d) -> (H, n, head_dim)."""
        return self._heads(self.linear_pos(pe))

    def _attend(self, q, keys, values, bd, mask) -> mx.array:
        return self.linear_out(self._weighted(q, keys, values, bd, mask))

    def _weighted(self, q, keys, values, bd, mask) -> mx.array:
        """The heads' attention output, merged (n, d), before linear_out."""
        u = derived(self, "pos_bias_u", (self.pos_bias_u,), lambda b: b.astype(mx.float32)[:, None, :])
        ac = (q + u) @ keys.transpose(0, 2, 1)
        scores = (ac + (bd + mask)) * (1.0 / math.sqrt(self.head_dim))
        weights = mx.softmax(scores, axis=-1)
        return self._merge(weights @ values)

    def __call__(self, x: mx.array, left: int) -> mx.array:
        """Offline: x (T, d); query i attends keys i-left .. i (all j <= i if left < 0)."""
        t = x.shape[0]
        q, k, v = (self._heads(f(x)) for f in (self.linear_q, self.linear_k, self.linear_v))
        pos = mx.arange(t - 1, -t, -1, dtype=mx.float32)  # positions T-1 .. -(T-1)
        p = self.positional_projection(relative_positional_encoding(pos, x.shape[-1]))
        bd = rel_shift((q + self.pos_bias_v.astype(mx.float32)[:, None, :]) @ p.transpose(0, 2, 1))
        dist = mx.arange(t)[:, None] - mx.arange(t)[None, :]  # i - j
        allowed = dist >= 0
        if left >= 0:
            allowed = allowed & (dist <= left)
        mask = mx.where(allowed, 0.0, _MASK_VALUE).astype(mx.float32)
        return self._attend(q, k, v, bd, mask)

    def step(self, x, k_cache, v_cache, pos_proj, left):
        """Streaming: x (n, d) new frames after the cached ones.

        k_cache / v_cache: projected K / V (Lc, d) of the Lc frames just before
        x; pos_proj: Wpos . pe for distances 0..left, (H, left+1, head_dim).
        Returns (out (n, d), keys (Lc+n, d), values (Lc+n, d)).
        """
        n, lc = x.shape[0], k_cache.shape[0]
        if pos_proj is None:
            # Reference-style (uncached) mode: k_cache holds the LayerNorm-ed inputs; K, V and the
            # positional table are re-projected for the whole window every frame. Same values,
            # ~13x the FLOPs (docs/model.md §11.2); kept to measure what the caching saves.
            rows = mx.concatenate([k_cache, x])
            keys, values = self.linear_k(rows), self.linear_v(rows)
            pe = relative_positional_encoding(mx.arange(left + 1, dtype=mx.float32), x.shape[-1])
            pos_proj = self.positional_projection(pe)
            cache_rows = (rows, mx.zeros((0, x.shape[-1]), dtype=mx.float32))
        else:
            keys = mx.concatenate([k_cache, self.linear_k(x)])
            values = mx.concatenate([v_cache, self.linear_v(x)])
            cache_rows = (keys, values)
        q = self._heads(self.linear_q(x))
        pos_bias_v = derived(self, "pos_bias_v", (self.pos_bias_v,), lambda b: b.astype(mx.float32)[:, None, :])
        bd_dist = (q + pos_bias_v) @ pos_proj.transpose(0, 2, 1)
        idx, mask = _step_index_and_mask(self.n_heads, n, lc, left)
        bd = mx.take_along_axis(bd_dist, idx, axis=-1)
        out = self._attend(q, self._heads(keys), self._heads(values), bd, mask)
        return out, cache_rows[0], cache_rows[1]

    def step_rows(self, x, caches: list, pos_proj, left):
        """`step` of C conversations with one new frame each: x (C, d), row c after `caches[c]` =
        (k_cache, v_cache) of its own length. The projections take every row together; each
        conversation attends over its own window. -> (out (C, d), [(keys, values)] per conversation)."""
        q_all, k_all, v_all = self.linear_q(x), self.linear_k(x), self.linear_v(x)
        pos_bias_v = derived(self, "pos_bias_v", (self.pos_bias_v,), lambda b: b.astype(mx.float32)[:, None, :])
        merged, kept = [], []
        for c, (k_cache, v_cache) in enumerate(caches):
            keys = mx.concatenate([k_cache, k_all[c : c + 1]])
            values = mx.concatenate([v_cache, v_all[c : c + 1]])
            q = self._heads(q_all[c : c + 1])
            idx, mask = _step_index_and_mask(self.n_heads, 1, k_cache.shape[0], left)
            bd = mx.take_along_axis((q + pos_bias_v) @ pos_proj.transpose(0, 2, 1), idx, axis=-1)
            merged.append(self._weighted(q, self._heads(keys), self._heads(values), bd, mask))
            kept.append((keys, values))
        return self.linear_out(mx.concatenate(merged)), kept

    def step_block(self, x, k_cache, v_cache, pos_proj, left):
        """`step` of C conversations whose windows have the same length, one new frame each: x (C, d),
        k_cache / v_cache (C, lc, d) -> (out (C, d), keys, values (C, lc+1, d)). Every operation is
        `step`'s for each conversation, batched over the leading axis."""
        c, lc = x.shape[0], k_cache.shape[1]
        h, hd = self.n_heads, self.head_dim
        keys = mx.concatenate([k_cache, self.linear_k(x)[:, None]], axis=1)
        values = mx.concatenate([v_cache, self.linear_v(x)[:, None]], axis=1)
        q = self.linear_q(x).reshape(c, 1, h, hd).transpose(0, 2, 1, 3)  # (C, H, 1, hd)
        kh = keys.reshape(c, lc + 1, h, hd).transpose(0, 2, 1, 3)
        vh = values.reshape(c, lc + 1, h, hd).transpose(0, 2, 1, 3)
        pos_bias_v = derived(self, "pos_bias_v", (self.pos_bias_v,), lambda b: b.astype(mx.float32)[:, None, :])
        idx, mask = _step_index_and_mask(h, 1, lc, left)
        bd = mx.take_along_axis(
            (q + pos_bias_v) @ pos_proj.transpose(0, 2, 1), mx.broadcast_to(idx, (c, *idx.shape)), axis=-1
        )
        u = derived(self, "pos_bias_u", (self.pos_bias_u,), lambda b: b.astype(mx.float32)[:, None, :])
        ac = (q + u) @ kh.transpose(0, 1, 3, 2)
        scores = (ac + (bd + mask)) * (1.0 / math.sqrt(hd))
        weights = mx.softmax(scores, axis=-1)
        merged = (weights @ vh).transpose(0, 2, 1, 3).reshape(c, h * hd)
        return self.linear_out(merged), keys, values


class ConvModule(nn.Module):
    """pointwise (d -> 2d) -> GLU -> causal depthwise (k) -> LayerNorm -> SiLU -> pointwise."""

    def __init__(self, d: int, kernel: int, bias: bool):
        super().__init__()
        self.kernel = kernel
        self.pointwise_conv1 = nn.Conv1d(d, 2 * d, 1, bias=bias)
        self.depthwise_conv = nn.Conv1d(d, d, kernel, groups=d, bias=bias)
        self.depthwise_conv.weight = mx.random.uniform(-1 / math.sqrt(kernel), 1 / math.sqrt(kernel), (d, kernel, 1))
        self.batch_norm = nn.LayerNorm(d)  # a LayerNorm despite the name (conv_norm_type)
        self.pointwise_conv2 = nn.Conv1d(d, d, 1, bias=bias)

    def pointwise_weights(self) -> tuple[dict, dict]:
        """{"weight_t": (I, O) matrix, "bias"?} of the two 1x1 convs, made once per weights:
        x @ W.T runs twice as fast on a contiguous W.T, and the
        stored (O, 1, I) weight is 16-bit in the checkpoints, which MLX would convert at every
        call: the W.T the runtime's `prepare` stored as the weight's only copy (float32, or bf16
        where the product widens it), else a float32 copy beside the weight."""

        def weights(conv):
            def make(w, *b):
                stored = ops.stored_transposed(conv)
                if stored is not None:
                    out = {"weight_t": stored}
                else:  # not prepared, or weights set after load: a derived copy beside them
                    out = {"weight_t": mx.contiguous(w[:, 0, :].astype(mx.float32).T)}
                if b:
                    out["bias"] = b[0] if b[0].dtype == mx.float32 else b[0].astype(mx.float32)
                mx.eval(out)
                return out

            return derived(conv, "pointwise", (conv.weight,) + ((conv.bias,) if "bias" in conv else ()), make)

        return weights(self.pointwise_conv1), weights(self.pointwise_conv2)

    def taps(self) -> tuple[list, mx.array | None]:
        """The depthwise taps (kernel x (d,) float32) and the bias (or None)."""
        w = derived(
            self,
            "depthwise_taps",
            (self.depthwise_conv.weight,),
            lambda t: list(t[:, :, 0].T.astype(mx.float32)),
        )
        return w, (self.depthwise_conv.bias if "bias" in self.depthwise_conv else None)

    def glu_input(self, xn: mx.array) -> mx.array:
        """GLU(pointwise_conv1(xn)): the depthwise conv's input, (n, d)."""
        return _glu(xn, self.pointwise_weights()[0])

    def depthwise(self, din: mx.array) -> mx.array:
        """Valid depthwise conv over time: (L, d) -> (L - kernel + 1, d), fixed tap order."""
        w, bias = self.taps()
        return _depthwise(din, w, bias)

    def finish(self, dw: mx.array) -> mx.array:
        return _pointwise(nn.silu(self.batch_norm(dw)), self.pointwise_weights()[1])

    def __call__(self, xn: mx.array) -> mx.array:
        g = self.glu_input(xn)
        din = mx.concatenate([mx.zeros((self.kernel - 1, g.shape[1]), dtype=g.dtype), g])  # causal pad
        return self.finish(self.depthwise(din))


class ConformerLayer(nn.Module):
    def __init__(self, cfg: EncoderConfig):
        super().__init__()
        d, bias = cfg.d_model, cfg.use_bias
        hidden = d * cfg.ff_expansion_factor
        self.norm_feed_forward1 = nn.LayerNorm(d)
        self.feed_forward1 = FeedForward(d, hidden, bias)
        self.norm_self_att = nn.LayerNorm(d)
        self.self_attn = RelPositionAttention(d, cfg.n_heads, bias)
        self.norm_conv = nn.LayerNorm(d)
        self.conv = ConvModule(d, cfg.conv_kernel_size, bias)
        self.norm_feed_forward2 = nn.LayerNorm(d)
        self.feed_forward2 = FeedForward(d, hidden, bias)
        self.norm_out = nn.LayerNorm(d)

    def __call__(self, x: mx.array, left: int) -> mx.array:
        x = x + 0.5 * self.feed_forward1(self.norm_feed_forward1(x))
        x = x + self.self_attn(self.norm_self_att(x), left)
        x = x + self.conv(self.norm_conv(x))
        x = x + 0.5 * self.feed_forward2(self.norm_feed_forward2(x))
        return self.norm_out(x)

    def step(self, x, k_cache, v_cache, conv_cache, pos_proj, left):
        """Streaming block; returns (out, new_k_cache, new_v_cache, new_conv_cache).

        The two feed-forward halves (with their norms, residuals and the output norm) have
        fixed shapes and run as fused pieces (`ops.fused`) when their layers do not
        split across streams; same operations either way."""
        x = self._feed_forward(x, self.norm_feed_forward1, self.feed_forward1, None)
        p = norm_params(self.norm_self_att)
        xn = ops.fused_layer_norm(x, p.get("weight"), p.get("bias"), self.norm_self_att.eps)
        att, keys, values = self.self_attn.step(xn, k_cache, v_cache, pos_proj, left)
        x = x + att
        glu, finish, (taps, bias, norms, p1, p2) = self._conv_pieces(rows=False)
        din = mx.concatenate([conv_cache, glu(x, norms, p1)])
        x = finish(x, din, taps, bias, norms, p2)
        x = self._feed_forward(x, self.norm_feed_forward2, self.feed_forward2, self.norm_out)
        keep = keys.shape[0] - min(left, keys.shape[0])
        return x, keys[keep:], values[max(0, values.shape[0] - left) :], din[din.shape[0] - (self.conv.kernel - 1) :]

    def step_rows(self, x, caches: list, pos_proj, left):
        """`step` of C conversations, one new frame each: x (C, d), caches[c] = (k_cache, v_cache,
        conv_cache) of conversation c -> (out (C, d), new caches). Norms, feed-forwards and 1x1
        convs run over every row together; attention and the depthwise conv read each conversation's
        own caches. With C == 1 it is `step`."""
        if len(caches) == 1:
            out, *new = self.step(x, *caches[0], pos_proj, left)
            return out, [tuple(new)]
        x = self._feed_forward(x, self.norm_feed_forward1, self.feed_forward1, None)
        p = norm_params(self.norm_self_att)
        xn = ops.fused_layer_norm(x, p.get("weight"), p.get("bias"), self.norm_self_att.eps)
        att, kept = self.self_attn.step_rows(xn, [c[:2] for c in caches], pos_proj, left)
        x = x + att
        glu, finish, (taps, bias, norms, p1, p2) = self._conv_pieces(rows=True)
        glu_rows = glu(x, norms, p1)
        dins = [mx.concatenate([c[2], glu_rows[i : i + 1]]) for i, c in enumerate(caches)]
        x = finish(x, mx.stack(dins), taps, bias, norms, p2)
        x = self._feed_forward(x, self.norm_feed_forward2, self.feed_forward2, self.norm_out)
        new = []
        for (keys, values), din in zip(kept, dins, strict=True):
            keep = keys.shape[0] - min(left, keys.shape[0])
            new.append(
                (keys[keep:], values[max(0, values.shape[0] - left) :], din[din.shape[0] - (self.conv.kernel - 1) :])
            )
        return x, new

    def step_block(self, x, k_cache, v_cache, conv_cache, pos_proj, left):
        """`step` of C conversations with windows of one length, one new frame each: x (C, d),
        k_cache / v_cache (C, lc, d), conv_cache (C, K-1, d) -> (out (C, d), new k, v, conv caches
        stacked the same way)."""
        x = self._feed_forward(x, self.norm_feed_forward1, self.feed_forward1, None)
        p = norm_params(self.norm_self_att)
        xn = ops.fused_layer_norm(x, p.get("weight"), p.get("bias"), self.norm_self_att.eps)
        att, keys, values = self.self_attn.step_block(xn, k_cache, v_cache, pos_proj, left)
        x = x + att
        glu, finish, (taps, bias, norms, p1, p2) = self._conv_pieces(rows=True)
        din = mx.concatenate([conv_cache, glu(x, norms, p1)[:, None]], axis=1)
        x = finish(x, din, taps, bias, norms, p2)
        x = self._feed_forward(x, self.norm_feed_forward2, self.feed_forward2, self.norm_out)
        n = keys.shape[1]
        return (
            x,
            keys[:, n - min(left, n) :],
            values[:, max(0, n - left) :],
            din[:, din.shape[1] - (self.conv.kernel - 1) :],
        )

    def _conv_pieces(self, *, rows: bool):
        """The conv module's two fused pieces around its cache (GLU in; depthwise, norm, SiLU and 1x1
        out, over one conversation's window or, `rows`, over C stacked windows) and their arrays."""
        conv = self.conv
        p1, p2 = conv.pointwise_weights()
        norms = (norm_params(self.norm_conv), norm_params(conv.batch_norm))
        eps = (self.norm_conv.eps, conv.batch_norm.eps)
        key = (eps, structure(norms), structure((p1, p2)))
        glu = ops.fused(("conformer_glu",) + key, lambda: functools.partial(_glu_core, eps))
        taps, bias = conv.taps()
        core = _conv_out_rows_core if rows else _conv_out_core
        finish = ops.fused(
            ("conformer_conv_out_rows" if rows else "conformer_conv_out", conv.kernel, bias is not None) + key,
            lambda: functools.partial(core, eps),
        )
        return glu, finish, (taps, [] if bias is None else [bias], norms, p1, p2)

    @staticmethod
    def _feed_forward(x, norm, ff, out_norm):
        """x + 0.5 ff(norm(x)), then out_norm if given (one fused piece)."""
        norms = [norm_params(norm)] + ([norm_params(out_norm)] if out_norm is not None else [])
        static = (norm.eps, out_norm.eps if out_norm is not None else None, structure(norms))
        return ops.fused_linear("conformer_ff", _feed_forward_core, static, (ff.linear1, ff.linear2), x, norms)


# --------------------------------------------------------------------------- encoder


class FastConformer(nn.Module):
    """Causal FastConformer: pre_encode (8x) + n_layers blocks."""

    def __init__(self, cfg: EncoderConfig):
        super().__init__()
        if cfg.att_context_style != "chunked_limited":
            raise ValueError(
                f"FastConformer: att_context_style {cfg.att_context_style!r} is not supported; "
                "expected 'chunked_limited'"
            )
        self.cfg = cfg
        self.pre_encode = ConvSubsampling(cfg)
        self.layers = [ConformerLayer(cfg) for _ in range(cfg.n_layers)]

    @property
    def left_context(self) -> int:
        """Attention look-back in encoder frames; -1 means unlimited (NeMo convention)."""
        return self.cfg.left_context

    def embed(self, mel: mx.array) -> mx.array:
        """Subsampling + optional xscaling (sqrt(d_model)), applied in both paths."""
        x = self.pre_encode(mel)
        if self.cfg.xscaling:
            x = x * math.sqrt(self.cfg.d_model)
        return x

    def __call__(self, mel, *, left_context: int | None = None) -> mx.array:
        """Offline encoder: mel (T, F) -> (T_enc, d_model), T_enc = subsampled_length(T).

        `left_context` overrides the configured attention look-back (-1 = unlimited).
        """
        mel = _as_mel(mel, self.cfg.feat_in, "FastConformer")
        if mel.shape[0] == 0:
            raise ValueError("FastConformer: needs at least one mel frame")
        left = self.left_context if left_context is None else int(left_context)
        x = self.embed(mel)
        for layer in self.layers:
            x = layer(x, left)
        return x


class ConformerRows:
    """The conformer caches of C conversations at the same window length, stacked: per layer K and V
    (C, lc, d) and the conv tail (C, K-1, d), as a batched step left them. The next step over the
    same conversations in the same order reads them as they are."""

    def __init__(self, k: list[mx.array], v: list[mx.array], conv: list[mx.array], size: int):
        self.k, self.v, self.conv, self.size = k, v, conv, size


class ConformerState(BlockRow[ConformerRows]):
    """Streaming state of a FastConformer (bounded for any stream length).

    * `mel_cache` (m, F): mel frames mel_consumed - m .. mel_consumed - 1 that the
      subsampling still needs (m <= 16 between pushes).
    * `mel_consumed`, `frames_emitted`: counters (mel frames in, encoder frames out).
    * per layer l: `k_cache[l]`, `v_cache[l]` (<= left, d) projected keys / values
      of the newest frames; `conv_cache[l]` (kernel - 1, d) newest GLU outputs
      (zeros at the start = the offline causal padding).
    """

    def __init__(self, cfg: EncoderConfig):
        self.cfg = cfg
        self.reset()

    def reset(self) -> None:
        d, c = self.cfg.d_model, self.cfg.conv_kernel_size - 1
        self._block: tuple[ConformerRows, int] | None = None
        self.mel_cache = mx.zeros((0, self.cfg.feat_in), dtype=mx.float32)
        self.mel_consumed = 0
        self.frames_emitted = 0
        self._k = [mx.zeros((0, d), dtype=mx.float32) for _ in range(self.cfg.n_layers)]
        self._v = [mx.zeros((0, d), dtype=mx.float32) for _ in range(self.cfg.n_layers)]
        self._conv = [mx.zeros((c, d), dtype=mx.float32) for _ in range(self.cfg.n_layers)]

    # After a batched step the per-layer caches are row i of a `ConformerRows` block; the state's own
    # lists are cut from it when read.

    def _own(self) -> None:
        if self._block is not None:
            block, i = self._block
            self._block = None
            self._k = [k[i] for k in block.k]
            self._v = [v[i] for v in block.v]
            self._conv = [c[i] for c in block.conv]

    def in_block(self, block: ConformerRows, index: int) -> None:
        self._block = (block, index)

    @property
    def k_cache(self) -> list[mx.array]:
        self._own()
        return self._k

    @property
    def v_cache(self) -> list[mx.array]:
        self._own()
        return self._v

    @property
    def conv_cache(self) -> list[mx.array]:
        self._own()
        return self._conv

    def copy(self) -> ConformerState:
        other = object.__new__(ConformerState)
        other.cfg = self.cfg
        other._block = None
        other.mel_cache = self.mel_cache
        other.mel_consumed = self.mel_consumed
        other.frames_emitted = self.frames_emitted
        other._k = list(self.k_cache)
        other._v = list(self.v_cache)
        other._conv = list(self.conv_cache)
        return other

    def arrays(self) -> dict[str, mx.array]:
        out = {"mel_cache": self.mel_cache}
        for i in range(len(self.k_cache)):
            out[f"layers.{i}.k_cache"] = self.k_cache[i]
            out[f"layers.{i}.v_cache"] = self.v_cache[i]
            out[f"layers.{i}.conv_cache"] = self.conv_cache[i]
        return out

    @property
    def mel_cache_start(self) -> int:
        return self.mel_consumed - self.mel_cache.shape[0]

    def frames_available(self, mel_consumed: int) -> int:
        """Encoder frames producible once `mel_consumed` mel frames arrived (frame k needs mel 8k)."""
        return 0 if mel_consumed <= 0 else (mel_consumed - 1) // 8 + 1


class ConformerStream:
    """Cache-aware streaming driver: `push(mel (n, F)) -> (n_out, d)`.

    Create it after the weights are loaded: it precomputes, per layer, the
    positional projection Wpos . pe for distances 0..left (a constant); call
    `refresh_constants()` if the weights change afterwards.
    """

    def __init__(self, encoder: FastConformer, state: ConformerState | None = None, *, cache_projections: bool = True):
        if encoder.left_context < 0:
            raise ValueError(
                "ConformerStream: unlimited left attention context (-1) cannot stream with a "
                "bounded cache; expected att_context_size [[left >= 0, 0]]"
            )
        self.encoder = encoder
        self.cfg = encoder.cfg
        self.state = state if state is not None else ConformerState(encoder.cfg)
        # False: the reference's cost model (cache LayerNorm outputs, re-project every frame).
        self.cache_projections = cache_projections
        self.refresh_constants()

    def refresh_constants(self) -> None:
        """Per layer Wpos . pe for distances 0..left: made once per weights and shared by every
        stream of the model (voicechat.model.derived), so creating a session does not project again."""
        left, d = self.encoder.left_context, self.cfg.d_model

        def projection(attn):
            def make(_weight):
                pe = relative_positional_encoding(mx.arange(left + 1, dtype=mx.float32), d)
                return attn.positional_projection(pe)

            return derived(attn, f"pos_proj_{left}", (attn.linear_pos.weight,), make)

        self.pos_proj = [projection(layer.self_attn) for layer in self.encoder.layers]
        mx.eval(self.pos_proj)

    def reset(self) -> None:
        self.state.reset()

    def frames_for(self, n_mel: int) -> int:
        """Encoder frames a push of `n_mel` mel frames would produce now."""
        st = self.state
        return st.frames_available(st.mel_consumed + n_mel) - st.frames_emitted

    def flush(self) -> mx.array:
        """End of stream: emit the frames the offline encoder has beyond the last complete one.

        Offline, an input whose mel count is not 8k+1 yields one more encoder frame,
        computed with the subsampling's right-edge zero padding; this reproduces it,
        so a flushed stream has exactly the offline frame count.
        """
        return self.push(mx.zeros((0, self.cfg.feat_in), dtype=mx.float32), final=True)

    def push(self, mel, *, final: bool = False) -> mx.array:
        """Consume mel frames (n, F); return the newly available encoder frames (n_out, d).

        With `final=True` the stream is treated as ended (see `flush`).
        """
        return self.advance(_as_mel(mel, self.cfg.feat_in, "ConformerStream.push"), final=final)

    def advance(self, mel: mx.array, *, final: bool = False) -> mx.array:
        """`push` of float32 mel frames (n, F) checked by the caller (the streaming perception's own
        log-mel output): the same computation without converting or checking its input again."""
        window = self._window(mel, final)
        if window is None:
            return mx.zeros((0, self.cfg.d_model), dtype=mx.float32)
        x, after = window
        st = self.state
        left = self.encoder.left_context
        for i, layer in enumerate(self.encoder.layers):
            x, st.k_cache[i], st.v_cache[i], st.conv_cache[i] = layer.step(
                x,
                st.k_cache[i],
                st.v_cache[i],
                st.conv_cache[i],
                self.pos_proj[i] if self.cache_projections else None,
                left,
            )
            ops.after_layer(x)  # layer i may run while the next one is built
        after()
        mx.async_eval(x, st.arrays())  # the frame's state, cut from its history; no wait
        return x

    def _window(self, mel: mx.array, final: bool):
        """The subsampled new frames of `mel` (n_new, d) and the call that moves the mel cache and
        counters past them once the layers ran; None (state moved) when no frame completes."""
        st = self.state
        if final:
            n_new = subsampled_length(st.mel_consumed + mel.shape[0]) - st.frames_emitted
        else:
            n_new = self.frames_for(mel.shape[0])
        cache = mx.concatenate([st.mel_cache, mel]) if mel.shape[0] else st.mel_cache
        consumed = st.mel_consumed + mel.shape[0]
        cache_start = consumed - cache.shape[0]
        n0 = st.frames_emitted
        n1 = n0 + n_new
        if n_new == 0:
            st.mel_cache, st.mel_consumed = cache, consumed
            return None

        # Subsample a window aligned to the 8-frame grid starting two encoder
        # frames early: its first two outputs see the window's own zero padding
        # instead of earlier mel frames and are dropped (exact from the third on).
        start = max(0, 8 * (n0 - 2))
        # A final window runs to the end of the data so the right-edge padding matches offline.
        stop = consumed if final else 8 * (n1 - 1) + 1
        window = cache[start - cache_start : stop - cache_start]
        x = self.encoder.embed(window)[n0 - start // 8 :]

        def after():
            keep_from = max(0, 8 * (n1 - 2))  # first mel frame the next window needs
            st.mel_cache = cache[keep_from - cache_start :]
            st.mel_consumed = consumed
            st.frames_emitted = n1

        return x, after

    def push_one(self, mel) -> mx.array:
        """Push mel frames that must complete exactly one encoder frame; returns (d,).

        Raises ValueError (state unchanged) if they would yield 0 or > 1 frames.
        """
        return self.advance_one(_as_mel(mel, self.cfg.feat_in, "ConformerStream.push_one"))

    def advance_one(self, mel: mx.array) -> mx.array:
        """`push_one` of float32 mel frames (n, F) checked by the caller."""
        n = self.frames_for(mel.shape[0])
        if n != 1:
            raise ValueError(
                f"ConformerStream.push_one: {mel.shape[0]} mel frames after {self.state.mel_consumed} "
                f"would complete {n} encoder frames, expected exactly 1 (1 mel frame first, then 8 per frame)"
            )
        return self.advance(mel)[0]


def advance_rows(streams: list[ConformerStream], mels: list[mx.array]) -> list[mx.array]:
    """`advance_one` of several conversations' streams of one encoder (each its own caches, at its
    own frame): -> each one's encoder frame (d,). The layers run once over every conversation's new
    frame (`ConformerLayer.step_rows`); each computes exactly what it computes alone. One stream:
    its `advance_one`."""
    if len(streams) == 1 or not all(s.cache_projections for s in streams):
        return [s.advance_one(m) for s, m in zip(streams, mels, strict=True)]
    windows = []
    for s, mel in zip(streams, mels, strict=True):
        n = s.frames_for(mel.shape[0])
        if n != 1:
            raise ValueError(f"advance_rows: {mel.shape[0]} mel frames would complete {n} encoder frames, expected 1")
        window = s._window(mel, final=False)
        assert window is not None  # one frame completes
        windows.append(window)
    x = mx.concatenate([w[0] for w in windows])
    encoder = streams[0].encoder
    states = [s.state for s in streams]
    block = states[0].block
    if block is not None and block.size == len(states) and all(st.row_of(block) == c for c, st in enumerate(states)):
        k, v, conv = block.k, block.v, block.conv  # as the previous step left them
    elif len({st.k_cache[0].shape[0] for st in states}) == 1:  # windows of one length: stack them
        n_layers = len(encoder.layers)
        k = [mx.stack([st.k_cache[i] for st in states]) for i in range(n_layers)]
        v = [mx.stack([st.v_cache[i] for st in states]) for i in range(n_layers)]
        conv = [mx.stack([st.conv_cache[i] for st in states]) for i in range(n_layers)]
    else:  # windows still filling at different lengths: each attends over its own
        k = v = conv = None
    if k is not None and v is not None and conv is not None:
        new_k, new_v, new_conv = [], [], []
        for i, layer in enumerate(encoder.layers):
            x, ki, vi, ci = layer.step_block(x, k[i], v[i], conv[i], streams[0].pos_proj[i], encoder.left_context)
            new_k.append(ki)
            new_v.append(vi)
            new_conv.append(ci)
            ops.after_layer(x)
        rows = ConformerRows(new_k, new_v, new_conv, len(states))
        for c, st in enumerate(states):
            st.in_block(rows, c)
    else:
        for i, layer in enumerate(encoder.layers):
            caches = [(s.state.k_cache[i], s.state.v_cache[i], s.state.conv_cache[i]) for s in streams]
            x, new = layer.step_rows(x, caches, streams[0].pos_proj[i], encoder.left_context)
            for s, (ki, vi, ci) in zip(streams, new, strict=True):
                s.state.k_cache[i], s.state.v_cache[i], s.state.conv_cache[i] = ki, vi, ci
            ops.after_layer(x)
    for _, after in windows:
        after()
    block = states[0].block  # the frame's state, cut from its history; no wait
    caches = [block.k, block.v, block.conv] if block is not None else [st.arrays() for st in states]
    mx.async_eval(x, caches, [st.mel_cache for st in states])
    return [x[c] for c in range(len(streams))]


# --------------------------------------------------------------------------- perception


class Perception(nn.Module):
    """`perception.`: FastConformer encoder + Linear d_model -> output_dim."""

    def __init__(self, audio_cfg: AudioConfig):
        super().__init__()
        self.audio_cfg = audio_cfg
        self.encoder = FastConformer(audio_cfg.encoder)
        self.proj = nn.Linear(audio_cfg.encoder.d_model, audio_cfg.output_dim)

    def project(self, enc: mx.array) -> mx.array:
        """audio_emb = W_p . enc + b_p for (d,) or (T, d) encoder frames."""
        return self.proj(enc.astype(mx.float32))

    def __call__(self, mel) -> tuple[mx.array, mx.array]:
        """Offline: mel (T, F) -> (enc (T_enc, d), audio_emb (T_enc, output_dim))."""
        enc = self.encoder(mel)
        return enc, self.project(enc)


class PerceptionFallback:
    """Non-cached perception (`use_perception_cache=False`, docs/model.md §5.2 end).

    Keeps the last max(2, left+1) input frames of audio; each `push_frame`
    recomputes the offline log-mel and encoder over that window and returns the
    second-to-last encoder frame (the last one is centred on the right-edge
    padding), which lines up with the cached path's frame for the same push.
    An approximation: the window's start sees reflect padding and zero
    attention/conv history instead of the true past, and the stacked layers'
    receptive field is longer than the window.
    """

    def __init__(self, encoder: FastConformer, preprocessor: PreprocessorConfig, frame_samples: int | None = None):
        if encoder.left_context < 0:
            raise ValueError("PerceptionFallback: needs a finite left attention context")
        self.encoder = encoder
        self.preprocessor = preprocessor
        self.frame_samples = frame_samples if frame_samples is not None else 8 * preprocessor.hop_length
        self.window_frames = max(2, encoder.left_context + 1)
        self.reset()

    def reset(self) -> None:
        self.audio = mx.zeros((0,), dtype=mx.float32)
        self.frames_pushed = 0

    def copy(self) -> PerceptionFallback:
        other = object.__new__(PerceptionFallback)
        other.__dict__.update(self.__dict__)
        return other

    def arrays(self) -> dict[str, mx.array]:
        return {"audio": self.audio}

    def push_frame(self, samples) -> mx.array:
        """One frame of audio (frame_samples,) -> one encoder frame (d,)."""
        return self.advance(as_waveform(samples, "PerceptionFallback.push_frame samples"))

    def advance(self, x: mx.array) -> mx.array:
        """`push_frame` of float32 samples (frame_samples,) checked by the caller."""
        if x.size != self.frame_samples:
            raise ValueError(
                f"PerceptionFallback.push_frame: expected exactly {self.frame_samples} samples, got {x.size}"
            )
        audio = mx.concatenate([self.audio, x])
        audio = audio[max(0, audio.size - self.window_frames * self.frame_samples) :]
        enc = self.encoder(log_mel(audio, self.preprocessor))
        out = enc[-2]
        mx.eval(out, audio)
        self.audio = audio
        self.frames_pushed += 1
        return out


__all__ = [
    "ConvSubsampling",
    "ConformerLayer",
    "FastConformer",
    "ConformerState",
    "ConformerStream",
    "Perception",
    "PerceptionFallback",
    "relative_positional_encoding",
    "rel_shift",
    "subsampled_length",
]
