"""Audio codec (`tts_model.audio_codec`, docs/model.md §9 + clarifications "Codec").

Codes (T, Q) int -> RVQ dequantisation (sum of one codebook row per quantizer)
-> causal ConvNeXt decoder with transposed-conv upsamplers -> magnitude/phase
spectrum -> iSTFT -> T * ratio samples (ratio = `waveform_to_token_ratio`).

Two decode paths:

* `Codec.decode(codes)`: offline, the whole sequence at once (zero causal padding
  in every ConvNeXt block, iSTFT trimmed (n_fft - hop) / 2 at each end).
* `Codec.decode_step(codes, state)`: one code frame -> exactly `ratio` samples,
  with a `CodecState` holding each ConvNeXt block's last k - 1 input frames and
  the last few spectral frames for the iSTFT overlap. `Codec.flush(state)`
  returns the held-back tail.

Streaming geometry (all from the config, see `StreamingGeometry`): the streamed
samples are the offline samples delayed by `lead_in` samples (8 at the real
geometry). The first `warmup_samples` offline samples (6 at the real geometry)
differ, because the streaming iSTFT starts from zero-initialised cached frames
that still count in the window-square normalisation (as in the reference
streaming decoder); everything after them matches the offline decode to float32
rounding. Concatenating every `decode_step` output and `flush`, then dropping
the first `lead_in` samples, gives exactly `decode()`'s length.

Also the encoder (§9.3), used once per session to make silent prompt codes.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from voicechat.model import ops
from voicechat.model.config import CodecConfig
from voicechat.model.derived import derived

# Magnitude = MAX_MAGNITUDE * sigmoid(m - ln MAX_MAGNITUDE) (= 100 exp(-softplus(ln 100 - m))).
MAX_MAGNITUDE = 100.0
# The overlap-added window square is floored here before dividing by it.
WINDOW_SQUARE_FLOOR = 1e-10
LAYER_NORM_EPS = 1e-6
# ConvNeXt inverted-bottleneck expansion (pwconv1 maps C -> 4C).
CONVNEXT_EXPANSION = 4

# erf(x) = x P(x^2) / Q(x^2) on x clamped to [-4, 4] (|erf| rounds to 1 beyond): the float32
# rational approximation of Eigen / XLA, within 8 ulp of the exact erf over the whole line
# (tested). mx.erf is no closer and is slow on MLX's CPU backend (docs/performance.md).
_ERF_P = (
    -2.72614225801306e-10,
    2.77068142495902e-08,
    -2.10102402082508e-06,
    -5.69250639462346e-05,
    -7.34990630326855e-04,
    -2.95459980854025e-03,
    -1.60960333262415e-02,
)
_ERF_Q = (
    -1.45660718464996e-05,
    -2.13374055278905e-04,
    -1.68282697438203e-03,
    -7.37332916720468e-03,
    -1.42647390514189e-02,
)


def erf_rational(x: mx.array) -> mx.array:
    """float32 erf from multiply-adds and one division (see _ERF_P / _ERF_Q)."""
    x = mx.clip(x, -4.0, 4.0)
    x2 = x * x
    p = x2 * _ERF_P[0] + _ERF_P[1]  # Horner, no constant-filled arrays (they raised the peak)
    for c in _ERF_P[2:]:
        p = p * x2 + c
    q = x2 * _ERF_Q[0] + _ERF_Q[1]
    for c in _ERF_Q[2:]:
        q = q * x2 + c
    return x * p / q


def _depthwise_norm_core(
    k: int, padded: mx.array, taps: list, bias: mx.array, norm_w: mx.array, norm_b: mx.array
) -> mx.array:
    """LayerNorm(causal depthwise conv) of the (..., k - 1 + L, C) left-padded frames (leading axes:
    conversations); the conv as k shifted multiply-adds (same result as the grouped Conv1d, without
    its per-channel dispatch)."""
    length = padded.shape[-2] - (k - 1)
    y = padded[..., 0:length, :] * taps[0]
    for j in range(1, k):
        y = y + padded[..., j : j + length, :] * taps[j]
    return ops.layer_norm(y + bias, norm_w, norm_b, LAYER_NORM_EPS)


def _bias_gelu(y: mx.array, b: mx.array) -> mx.array:
    """Exact (erf) GELU of y + b."""
    y = y + b
    return 0.5 * y * (1.0 + erf_rational(y * (1.0 / math.sqrt(2.0))))


def _f32(a: mx.array) -> mx.array:
    return a if a.dtype == mx.float32 else a.astype(mx.float32)


def periodic_hann(n: int) -> mx.array:
    """Periodic Hann window w[i] = 0.5 (1 - cos(2 pi i / n)), float32."""
    i = np.arange(n, dtype=np.float64)
    return mx.array((0.5 * (1.0 - np.cos(2.0 * np.pi * i / n))).astype(np.float32))


# --------------------------------------------------------------------------- geometry


@dataclass(frozen=True)
class StreamingGeometry:
    """Frame/sample bookkeeping of the streaming iSTFT, derived from a `CodecConfig`.

    pad            (n_fft - hop) / 2: samples the offline iSTFT trims at each end.
    cache_frames   P = 2 ceil(pad / hop): spectral frames carried between steps.
    emit_start     s = pad + ceil(pad / hop) hop: first emitted sample of a step,
                   counted from the start of the first cached frame.
    lead_in        d = ceil(pad / hop) hop: the streamed output is the offline
                   output delayed by d samples (8 at the real geometry).
    warmup_samples the first (n_fft - hop) - pad offline samples are covered by the
                   zero-initialised cached frames, which still count in the
                   window-square normalisation of the first step (6 at the real
                   geometry); only these differ from the offline decode.
    """

    samples_per_frame: int
    spectral_frames_per_frame: int
    n_fft: int
    hop: int
    pad: int
    cache_frames: int
    emit_start: int
    lead_in: int
    warmup_samples: int

    @classmethod
    def from_config(cls, cfg: CodecConfig) -> StreamingGeometry:
        n_fft, hop = cfg.n_fft, cfg.hop_length
        if (n_fft - hop) % 2:
            raise ValueError(
                f"codec_config: n_fft - hop_length must be even so the iSTFT trims the same "
                f"number of samples at each end; got n_fft={n_fft}, hop_length={hop}"
            )
        pad = (n_fft - hop) // 2
        steps = -(-pad // hop)  # ceil(pad / hop)
        cache_frames = 2 * steps
        geo = cls(
            samples_per_frame=cfg.waveform_to_token_ratio,
            spectral_frames_per_frame=cfg.spectral_frames_per_token,
            n_fft=n_fft,
            hop=hop,
            pad=pad,
            cache_frames=cache_frames,
            emit_start=pad + steps * hop,
            lead_in=steps * hop,
            warmup_samples=max(0, (n_fft - hop) - pad),
        )
        if geo.spectral_frames_per_frame < cache_frames:
            # Otherwise the zero-initialised cache would still be in the window at flush time.
            raise ValueError(
                f"codec_config: one code frame gives {geo.spectral_frames_per_frame} spectral "
                f"frames; streaming decode needs at least {cache_frames} (2 ceil(pad / hop))"
            )
        return geo


# --------------------------------------------------------------------------- building blocks


class ConvNeXtBlock(nn.Module):
    """Causal ConvNeXt(C): x + pw2(gelu(pw1(LayerNorm(dwconv(left-padded x))))).

    Works on (L, C) float32 frames. `history` holds the k - 1 frames before x
    (zeros offline); the block returns the new history (the last k - 1 input
    frames) so a streaming caller can carry it to the next call.
    """

    def __init__(self, channels: int, kernel_size: int):
        super().__init__()
        self.dwconv = nn.Conv1d(channels, channels, kernel_size, groups=channels)
        self.norm = nn.LayerNorm(channels, eps=LAYER_NORM_EPS)
        self.pwconv1 = nn.Conv1d(channels, CONVNEXT_EXPANSION * channels, 1)
        self.pwconv2 = nn.Conv1d(CONVNEXT_EXPANSION * channels, channels, 1)
        self._kernel_size = kernel_size
        self._channels = channels

    @property
    def history_frames(self) -> int:
        return self._kernel_size - 1

    @property
    def channels(self) -> int:
        return self._channels

    def __call__(self, x: mx.array, history: mx.array | None = None) -> tuple[mx.array, mx.array]:
        """x (L, C) -> (L, C) and the new history (k - 1, C); or C conversations' frames stacked,
        x (C, L, C) with histories (C, k - 1, C): each conversation's rows as alone."""
        k = self._kernel_size
        if history is None:
            history = mx.zeros((*x.shape[:-2], k - 1, x.shape[-1]), dtype=mx.float32)
        padded = mx.concatenate([history, x], axis=-2)
        # Depthwise weight (C, k, 1) as k per-channel taps.
        taps, bias = derived(
            self,
            "dw_taps",
            (self.dwconv.weight, self.dwconv.bias),
            lambda w, b: ([_f32(w)[:, j, 0] for j in range(k)], _f32(b)),
        )
        p = self._float32_params()
        y = ops.fused(("codec_dwconv_norm", k), lambda: functools.partial(_depthwise_norm_core, k))(
            padded, taps, bias, p["norm_w"], p["norm_b"]
        )
        if y.ndim == 2:
            y = ops.rowwise(self._pointwise_part, y)  # the rest is row-wise
        else:  # conversations' frames: the products over all their rows at once
            y = ops.rowwise(self._pointwise_part, y.reshape(-1, y.shape[-1])).reshape(y.shape)
        return x + _f32(y), padded[..., padded.shape[-2] - (k - 1) :, :]

    def _float32_params(self) -> dict[str, mx.array]:
        """The norm's and the biases' parameters in float32, converted once per weights (lazily:
        the first use evaluates them) instead of at every call, and by each of the two row halves."""
        return derived(
            self,
            "float32_params",
            (self.norm.weight, self.norm.bias, self.pwconv1.bias, self.pwconv2.bias),
            lambda nw, nb, b1, b2: {"norm_w": _f32(nw), "norm_b": _f32(nb), "b1": _f32(b1), "b2": _f32(b2)},
        )

    def _pointwise_matrices(self) -> tuple[mx.array, mx.array]:
        """The two 1x1 conv weights (O, 1, I) as (O, I) matrices: views of the weights as the
        runtime's `prepare` stored them (a float32 W.T, or as loaded), no copies."""
        return derived(
            self,
            "pointwise_views",
            (self.pwconv1.weight, self.pwconv2.weight),
            lambda w1, w2: (w1[:, 0, :], w2[:, 0, :]),
        )

    def _pointwise_part(self, y: mx.array) -> mx.array:
        """pw2(gelu(pw1(y))) of the normalised frames."""
        p = self._float32_params()
        w1, w2 = self._pointwise_matrices()
        y = ops.matmul_t(y, w1, self, "w1")
        y = ops.fused(("codec_bias_gelu",), lambda: _bias_gelu)(y, p["b1"])
        return ops.matmul_t(y, w2, self, "w2") + p["b2"]


def _matrix_name(conv: nn.Module) -> str:
    """The `derived` name of a conv's weight as a matrix: a view (no bytes of its own) once the
    weight is a stored W.T's view, else a copy (MLX copies to reshape a transposed weight)."""
    return "matrix_views" if ops.stored_transposed(conv) is not None else "matrix"


def _pointwise(conv: nn.Conv1d, x: mx.array) -> mx.array:
    """Bias-free 1x1 Conv1d, weight (O, 1, I), on (L, I) frames."""
    w = derived(conv, _matrix_name(conv), (conv.weight,), lambda a: a[:, 0, :])
    return ops.matmul_t(x, w, conv, "matrix")


def _upsample(conv: nn.ConvTranspose1d, x: mx.array) -> mx.array:
    """ConvTranspose1d with kernel == stride (non-overlapping), no bias, weight (O, K, I).

    out[t K + j, o] = sum_i x[t, i] W[o, j, i]  (MLX's conv_transpose1d, no kernel flip).
    """
    out_ch, kernel, in_ch = conv.weight.shape
    w = derived(
        conv, _matrix_name(conv), (conv.weight,), lambda a: a.transpose(1, 0, 2).reshape(kernel * out_ch, in_ch)
    )
    return ops.matmul_t(x, w, conv, "matrix").reshape(x.shape[0] * kernel, out_ch)


def _downsample(conv: nn.Conv1d, x: mx.array) -> mx.array:
    """Conv1d with kernel == stride, no padding, no bias, weight (O, K, I); L divisible by K."""
    out_ch, kernel, in_ch = conv.weight.shape
    frames = x.shape[0] // kernel
    w = derived(conv, _matrix_name(conv), (conv.weight,), lambda a: a.reshape(out_ch, kernel * in_ch))
    return ops.matmul_t(x.reshape(frames, kernel * in_ch), w, conv, "matrix")


class CodecDecoder(nn.Module):
    """`decoder.layers.{n}`: per stage s (b = blocks_per_stage) layer s(b+1) is the
    upsampler (rate reversed(downsample_rates)[s]), then b ConvNeXt blocks; layer
    S(b+1) is the final 1x1 conv to the stft_channels."""

    def __init__(self, cfg: CodecConfig):
        super().__init__()
        b = cfg.blocks_per_stage
        rates = list(reversed(cfg.downsample_rates))
        widths = [cfg.base_channels * m for m in reversed(cfg.channel_multipliers)]
        layers: list[nn.Module] = []
        in_ch = cfg.latent_dim
        for rate, ch in zip(rates, widths, strict=True):
            layers.append(nn.ConvTranspose1d(in_ch, ch, rate, stride=rate, bias=False))
            layers.extend(ConvNeXtBlock(ch, cfg.block_kernel_size) for _ in range(b))
            in_ch = ch
        layers.append(nn.Conv1d(in_ch, cfg.stft_channels, 1, bias=False))
        self.layers = layers
        self._blocks_per_stage = b

    def is_upsampler(self, index: int) -> bool:
        return index < len(self.layers) - 1 and index % (self._blocks_per_stage + 1) == 0

    @property
    def block_indices(self) -> list[int]:
        return [n for n, layer in enumerate(self.layers) if isinstance(layer, ConvNeXtBlock)]

    def __call__(
        self, latent: mx.array, histories: dict[int, mx.array] | None = None, conversations: int = 0
    ) -> tuple[mx.array, dict[int, mx.array]]:
        """latent (T, latent_dim) -> spectrum (T * ratio / hop, stft_channels) and new block histories.
        With `conversations` = C > 0: latent (C T, latent_dim), C conversations' rows one after the
        other, histories (C, k - 1, channels) -> (C F, stft_channels) and (C, k - 1, channels)."""
        x = latent
        new_histories: dict[int, mx.array] = {}
        last = len(self.layers) - 1
        for n, layer in enumerate(self.layers):
            if n == last:
                x = _pointwise(layer, x)
            elif self.is_upsampler(n):
                x = _upsample(layer, x)
            elif conversations:
                # the depthwise conv runs over each conversation's own frames and history
                y, new_histories[n] = layer(x.reshape(conversations, -1, x.shape[-1]), histories[n])
                x = y.reshape(-1, y.shape[-1])
            else:
                x, new_histories[n] = layer(x, None if histories is None else histories[n])
        return x, new_histories


class CodecEncoder(nn.Module):
    """`encoder.layers.{n}`: layer 0 is a 1x1 conv stft_channels -> base; per stage s,
    b ConvNeXt blocks then a strided conv (kernel = stride = downsample_rates[s]); the
    last strided conv maps to latent_dim."""

    def __init__(self, cfg: CodecConfig):
        super().__init__()
        widths = [cfg.base_channels * m for m in cfg.channel_multipliers]
        layers: list[nn.Module] = [nn.Conv1d(cfg.stft_channels, widths[0], 1, bias=False)]
        for s, (rate, ch) in enumerate(zip(cfg.downsample_rates, widths, strict=True)):
            layers.extend(ConvNeXtBlock(ch, cfg.block_kernel_size) for _ in range(cfg.blocks_per_stage))
            out_ch = widths[s + 1] if s + 1 < len(widths) else cfg.latent_dim
            layers.append(nn.Conv1d(ch, out_ch, rate, stride=rate, bias=False))
        self.layers = layers

    def __call__(self, features: mx.array) -> mx.array:
        """features (F, stft_channels), F divisible by prod(downsample_rates) -> latents (T, latent_dim)."""
        x = _pointwise(self.layers[0], features)
        for layer in self.layers[1:]:
            if isinstance(layer, ConvNeXtBlock):
                x, _ = layer(x)
            else:
                x = _downsample(layer, x)
        return x


class _Variance(nn.Module):
    """Holds `prvq.variance_list.{q}.variance` (shape ()); stored in checkpoints, unused by decoding."""

    def __init__(self):
        super().__init__()
        self.variance = mx.ones(())


def _host_views(*books: mx.array) -> list[tuple[str, np.ndarray]]:
    """(kind, numpy view) per stored codebook: bf16 as its uint16 bits (numpy has no bf16),
    float16 / float32 as they are; no copy of the weights."""
    out = []
    for b in books:
        if b.dtype == mx.bfloat16:
            bits = b.view(mx.uint16)
            mx.eval(bits)
            out.append(("bf16", np.asarray(bits)))
        elif b.dtype in (mx.float16, mx.float32):
            mx.eval(b)
            out.append(("float", np.asarray(b)))
        else:
            raise TypeError(f"codec codebook dtype {b.dtype}: expected bfloat16, float16 or float32")
    return out


def _rows_f32(book: tuple[str, np.ndarray], index: np.ndarray) -> np.ndarray:
    """Rows `index` of a `_host_views` codebook as float32 (bf16 widened exactly)."""
    kind, view = book
    rows = view[index]
    if kind == "bf16":
        return ops.widen_bf16_bits(rows)
    return rows.astype(np.float32, copy=False)


class ResidualVectorQuantizer(nn.Module):
    """`prvq`: `mus_list.{q}` (codebook_size, latent_dim) codebooks and their unused variances.

    `norms_in_weight_dtype`: the squared norms ‖m_j‖² of the greedy search formed in the
    codebooks' stored dtype (the reference's rounding: bf16 in the published checkpoints, which
    decides near-ties in late codebooks), else in float32 (`Numerics.rvq_norms_in_weight_dtype`)."""

    def __init__(self, cfg: CodecConfig, norms_in_weight_dtype: bool = True):
        super().__init__()
        self._norms_in_weight_dtype = bool(norms_in_weight_dtype)
        # Scaled so the sum over Q codebooks has about unit variance per channel.
        scale = 1.0 / math.sqrt(cfg.num_quantizers)
        self.mus_list = [
            scale * mx.random.normal((cfg.codebook_size, cfg.latent_dim)) for _ in range(cfg.num_quantizers)
        ]
        self.variance_list = [_Variance() for _ in range(cfg.num_quantizers)]

    def dequantize(self, codes: mx.array) -> mx.array:
        """codes (T, Q) int32 (already validated) -> latent (T, latent_dim) = sum_q mus[q][codes[:, q]]."""
        latent = _f32(self.mus_list[0][codes[:, 0]])
        for q in range(1, len(self.mus_list)):
            latent = latent + _f32(self.mus_list[q][codes[:, q]])
        return latent

    def dequantize_host(self, codes: np.ndarray) -> np.ndarray:
        """`dequantize` on the host for validated numpy codes (T, Q): the same float32 additions
        in the same order (bit-identical, tested), without ~5 dispatches per codebook. The
        codebooks are read through zero-copy numpy views of the stored arrays."""
        books = derived(self, "host_book_views", tuple(self.mus_list), _host_views)
        latent = _rows_f32(books[0], codes[:, 0])
        for q in range(1, len(books)):
            latent = latent + _rows_f32(books[q], codes[:, q])
        return latent

    def quantize(self, latent: mx.array) -> mx.array:
        """Greedy RVQ: latent (T, latent_dim) -> codes (T, Q) int32 (nearest row per residual)."""
        residual = _f32(latent)
        codes = []
        for mus in self.mus_list:
            m = _f32(mus)
            src = mus if self._norms_in_weight_dtype else m
            norms = _f32(mx.sum(src * src, axis=1))
            dist = mx.sum(residual * residual, axis=1, keepdims=True) - 2.0 * (residual @ m.T) + norms[None, :]
            idx = mx.argmin(dist, axis=1).astype(mx.int32)
            codes.append(idx)
            residual = residual - m[idx]
        return mx.stack(codes, axis=1)


# --------------------------------------------------------------------------- streaming state


class CodecState:
    """Streaming decode state of one `Codec`.

    block_histories  {decoder layer index n: (k - 1, C_n)}: the last k - 1 input
                     frames of each decoder ConvNeXt block (zeros at the start,
                     which equals the offline zero padding).
    istft_real/imag  (P, n_fft/2 + 1): real and imaginary parts of the last P
                     spectral frames (P = StreamingGeometry.cache_frames, 4 at
                     the real geometry), zeros at the start.
    frames_decoded   code frames consumed; samples_emitted: samples returned
                     by decode_step + flush; flushed: True after `flush`.
    """

    def __init__(
        self,
        block_histories: dict[int, mx.array],
        istft_real: mx.array,
        istft_imag: mx.array,
        frames_decoded: int = 0,
        samples_emitted: int = 0,
        flushed: bool = False,
    ):
        self.block_histories = dict(block_histories)
        self.istft_real = istft_real
        self.istft_imag = istft_imag
        self.frames_decoded = frames_decoded
        self.samples_emitted = samples_emitted
        self.flushed = flushed

    def copy(self) -> CodecState:
        # mx.arrays are immutable values: sharing them between copies is safe.
        return CodecState(
            self.block_histories,
            self.istft_real,
            self.istft_imag,
            self.frames_decoded,
            self.samples_emitted,
            self.flushed,
        )

    def reset(self) -> None:
        self.block_histories = {n: mx.zeros_like(h) for n, h in self.block_histories.items()}
        self.istft_real = mx.zeros_like(self.istft_real)
        self.istft_imag = mx.zeros_like(self.istft_imag)
        self.frames_decoded = 0
        self.samples_emitted = 0
        self.flushed = False

    def arrays(self) -> dict[str, mx.array]:
        """{"decoder.layers.{n}.history": (k-1, C), "istft_real": (P, bins), "istft_imag": (P, bins)}."""
        out = {f"decoder.layers.{n}.history": h for n, h in sorted(self.block_histories.items())}
        out["istft_real"] = self.istft_real
        out["istft_imag"] = self.istft_imag
        return out

    def __repr__(self) -> str:
        return (
            f"CodecState(frames_decoded={self.frames_decoded}, samples_emitted={self.samples_emitted}, "
            f"flushed={self.flushed}, blocks={sorted(self.block_histories)})"
        )


# --------------------------------------------------------------------------- codec


class Codec(nn.Module):
    """The codec subtree `tts_model.audio_codec.` (encoder, decoder, prvq)."""

    def __init__(self, codec_cfg: CodecConfig, *, rvq_norms_in_weight_dtype: bool = True):
        super().__init__()
        if not isinstance(codec_cfg, CodecConfig):
            raise TypeError(f"Codec: expected a CodecConfig, got {type(codec_cfg).__name__}")
        self._cfg = codec_cfg
        self._geometry = StreamingGeometry.from_config(codec_cfg)
        self.encoder = CodecEncoder(codec_cfg)
        self.decoder = CodecDecoder(codec_cfg)
        self.prvq = ResidualVectorQuantizer(codec_cfg, rvq_norms_in_weight_dtype)
        self._window = periodic_hann(codec_cfg.n_fft)

    # -- geometry

    @property
    def config(self) -> CodecConfig:
        return self._cfg

    @property
    def geometry(self) -> StreamingGeometry:
        return self._geometry

    @property
    def samples_per_frame(self) -> int:
        """Output samples per code frame (waveform_to_token_ratio; 1764 at the real geometry)."""
        return self._geometry.samples_per_frame

    @property
    def lead_in(self) -> int:
        """d: streamed output = offline output delayed by d samples (8 at the real geometry)."""
        return self._geometry.lead_in

    @property
    def warmup_samples(self) -> int:
        """Offline samples at the very start that the streamed output does not reproduce (6 at the real geometry)."""
        return self._geometry.warmup_samples

    # -- validation

    def _check_codes(self, codes, where: str) -> np.ndarray:
        """Validated codes (T, Q) as host int32: one host round trip for an mx.array."""
        cfg = self._cfg
        if isinstance(codes, np.ndarray):
            if not np.issubdtype(codes.dtype, np.integer):
                raise TypeError(f"{where}: codes must have an integer dtype, got {codes.dtype}")
        elif isinstance(codes, mx.array):
            if not mx.issubdtype(codes.dtype, mx.integer):
                raise TypeError(f"{where}: codes must have an integer dtype, got {codes.dtype}")
        else:
            raise TypeError(f"{where}: codes must be an mx.array or numpy array, got {type(codes).__name__}")
        if codes.ndim != 2 or codes.shape[1] != cfg.num_quantizers:
            raise ValueError(
                f"{where}: codes must have shape (frames, {cfg.num_quantizers}) "
                f"(num_quantizers = {cfg.num_quantizers}), got {tuple(codes.shape)}"
            )
        if codes.shape[0] == 0:
            raise ValueError(f"{where}: codes must hold at least one frame, got shape {tuple(codes.shape)}")
        host = np.asarray(codes)
        lo, hi = int(host.min()), int(host.max())
        if lo < 0 or hi >= cfg.codebook_size:
            raise ValueError(
                f"{where}: codes must lie in [0, {cfg.codebook_size}) (codebook_size), got values from {lo} to {hi}"
            )
        return host.astype(np.int32)

    def _latent(self, codes: np.ndarray) -> mx.array:
        """Validated host codes (T, Q) -> latent (T, latent_dim), summed on the host: the codes are
        there already, and the same float32 additions as `dequantize` (bit for bit) cost no
        device operations (~5 per codebook on the device)."""
        return mx.array(self.prvq.dequantize_host(codes))

    # -- spectral head and iSTFT pieces

    def _spectrum(self, spec: mx.array) -> tuple[mx.array, mx.array]:
        """Head output (F, 2 bins): magnitude logits then phases -> (real, imag), each (F, bins)."""
        bins = self._cfg.n_fft // 2 + 1
        logits, phase = spec[:, :bins], spec[:, bins:]
        magnitude = MAX_MAGNITUDE * mx.sigmoid(logits - math.log(MAX_MAGNITUDE))
        real = magnitude * mx.cos(phase)
        imag = magnitude * mx.sin(phase)
        # DC and Nyquist bins carry no imaginary part.
        keep = np.ones((bins,), dtype=np.float32)
        keep[0] = keep[-1] = 0.0
        return real, imag * mx.array(keep)

    def _overlap_add(self, real: mx.array, imag: mx.array) -> tuple[mx.array, mx.array]:
        """(F, bins) spectra -> (numerator, window-square envelope), each ((F - 1) hop + n_fft,); with
        leading axes (conversations) (..., F, bins) -> numerator (..., length), envelope (length,)."""
        n_fft, hop = self._cfg.n_fft, self._cfg.hop_length
        lead, frames = real.shape[:-2], real.shape[-2]
        window = self._window
        signal = mx.fft.irfft(real + 1j * imag, n=n_fft, axis=-1)  # 1/n_fft normalisation
        # "Constrain value range": clip to +-window, then apply the synthesis window.
        signal = mx.clip(signal, -window, window) * window
        parts = n_fft // hop
        pieces = signal.reshape(*lead, frames, parts, hop)
        w2 = (window * window).reshape(parts, hop)
        numerator = None
        envelope = None
        for r in range(parts):
            padding = [(r, parts - 1 - r), (0, 0)]
            num_r = mx.pad(pieces[..., r, :], [(0, 0)] * len(lead) + padding)
            env_r = mx.pad(mx.broadcast_to(w2[r], (frames, hop)), padding)
            numerator = num_r if numerator is None else numerator + num_r
            envelope = env_r if envelope is None else envelope + env_r
        length = (frames + parts - 1) * hop
        return numerator.reshape(*lead, length), envelope.reshape(length)

    def _istft(self, real: mx.array, imag: mx.array) -> mx.array:
        numerator, envelope = self._overlap_add(real, imag)
        return numerator / mx.maximum(envelope, WINDOW_SQUARE_FLOOR)

    # -- public API

    def dequantize(self, codes) -> mx.array:
        """codes (T, Q) int -> latent (T, latent_dim) float32."""
        return self.prvq.dequantize(mx.array(self._check_codes(codes, "Codec.dequantize")))

    def decode(self, codes) -> mx.array:
        """Offline decode: codes (T, Q) int -> waveform (T * samples_per_frame,) float32."""
        codes = self._check_codes(codes, "Codec.decode")
        with ops.products_scope():
            spec, _ = self.decoder(self._latent(codes))
        real, imag = self._spectrum(spec)
        audio = self._istft(real, imag)
        geo = self._geometry
        return audio[geo.pad : geo.pad + real.shape[0] * geo.hop]

    def prepare_decoder(self) -> None:
        """Make the decoder's derived values (float32 norms, biases, taps, product matrices) now
        rather than at the first decode, so what the model keeps is taken, and counted, at load:
        decode one frame of code 0 on a scratch state and keep nothing else."""
        codes = np.zeros((1, self._cfg.num_quantizers), dtype=np.int32)
        mx.eval(self.decode_step(codes, self.make_state()))

    def make_state(self) -> CodecState:
        geo = self._geometry
        histories = {
            n: mx.zeros((self.decoder.layers[n].history_frames, self.decoder.layers[n].channels), dtype=mx.float32)
            for n in self.decoder.block_indices
        }
        bins = self._cfg.n_fft // 2 + 1
        zeros = mx.zeros((geo.cache_frames, bins), dtype=mx.float32)
        return CodecState(histories, zeros, zeros)

    def _check_state(self, state, where: str) -> None:
        if not isinstance(state, CodecState):
            raise TypeError(f"{where}: expected a CodecState (from Codec.make_state()), got {type(state).__name__}")
        if state.flushed:
            raise ValueError(f"{where}: this CodecState was flushed; call state.reset() or make_state() first")
        if (
            set(state.block_histories) != set(self.decoder.block_indices)
            or any(
                tuple(h.shape) != (self.decoder.layers[n].history_frames, self.decoder.layers[n].channels)
                for n, h in state.block_histories.items()
            )
            or state.istft_real.shape[0] != self._geometry.cache_frames
        ):
            raise ValueError(f"{where}: this CodecState was made by a codec of a different geometry")

    def decode_step(self, codes, state: CodecState) -> mx.array:
        """One code frame (Q,) or (1, Q) -> exactly samples_per_frame samples; updates `state` in place.

        Lazy: the caller evaluates the result (and the state) when it needs them.
        """
        self._check_state(state, "Codec.decode_step")
        if (isinstance(codes, (mx.array, np.ndarray))) and codes.ndim == 1:
            codes = codes[None]
        if isinstance(codes, (mx.array, np.ndarray)) and codes.ndim == 2 and codes.shape[0] != 1:
            raise ValueError(
                f"Codec.decode_step: expected one frame of codes, shape ({self._cfg.num_quantizers},) or "
                f"(1, {self._cfg.num_quantizers}), got {tuple(codes.shape)}"
            )
        codes = self._check_codes(codes, "Codec.decode_step")
        geo = self._geometry

        with ops.products_scope():
            spec, histories = self.decoder(self._latent(codes), state.block_histories)
        real, imag = self._spectrum(spec)
        real = mx.concatenate([state.istft_real, real], axis=0)
        imag = mx.concatenate([state.istft_imag, imag], axis=0)
        audio = self._istft(real, imag)
        new_frames = real.shape[0] - geo.cache_frames
        out = audio[geo.emit_start : geo.emit_start + new_frames * geo.hop]
        if out.shape != (geo.samples_per_frame,):
            raise RuntimeError(f"Codec.decode_step: produced {out.shape} samples, expected ({geo.samples_per_frame},)")

        state.block_histories = histories
        state.istft_real = real[real.shape[0] - geo.cache_frames :]
        state.istft_imag = imag[imag.shape[0] - geo.cache_frames :]
        state.frames_decoded += 1
        state.samples_emitted += geo.samples_per_frame
        return out

    def decode_step_rows(self, codes: list, states: list[CodecState]) -> list[mx.array]:
        """`decode_step` of C conversations (each one code frame and its own state) over their rows
        together: one read of all the codes, the decoder's products over all rows (on the host: one
        round trip, then each conversation's rows as its own product, since the BLAS rounds a row
        differently in a taller one), each block's depthwise conv and each iSTFT over each
        conversation's own frames. Each conversation's samples and state are what `decode_step`
        gives it. One conversation: `decode_step`."""
        if len(codes) != len(states) or not states:
            raise ValueError("Codec.decode_step_rows: one code frame per state, at least one")
        if len(states) == 1:
            return [self.decode_step(codes[0], states[0])]
        q = self._cfg.num_quantizers
        for c, st in zip(codes, states, strict=True):
            self._check_state(st, "Codec.decode_step_rows")
            if not isinstance(c, (mx.array, np.ndarray)) or tuple(c.shape) not in ((q,), (1, q)):
                raise ValueError(f"Codec.decode_step_rows: each code frame must have shape ({q},) or (1, {q})")
        stacked = [c.reshape(1, q) for c in codes]
        host = self._check_codes(
            mx.concatenate(stacked) if isinstance(stacked[0], mx.array) else np.concatenate(stacked),
            "Codec.decode_step_rows",
        )
        geo = self._geometry
        n = len(states)
        histories = {b: mx.stack([st.block_histories[b] for st in states]) for b in self.decoder.block_indices}
        with ops.products_scope(conversations=n):
            spec, new = self.decoder(self._latent(host), histories, conversations=n)
        real, imag = self._spectrum(spec)
        real = mx.concatenate([mx.stack([st.istft_real for st in states]), real.reshape(n, -1, real.shape[-1])], 1)
        imag = mx.concatenate([mx.stack([st.istft_imag for st in states]), imag.reshape(n, -1, imag.shape[-1])], 1)
        audio = self._istft(real, imag)
        new_frames = real.shape[1] - geo.cache_frames
        out = audio[:, geo.emit_start : geo.emit_start + new_frames * geo.hop]
        if out.shape != (n, geo.samples_per_frame):
            raise RuntimeError(
                f"Codec.decode_step_rows: produced {out.shape} samples, expected {n} x {geo.samples_per_frame}"
            )
        for r, st in enumerate(states):
            st.block_histories = {b: h[r] for b, h in new.items()}
            st.istft_real = real[r, real.shape[1] - geo.cache_frames :]
            st.istft_imag = imag[r, imag.shape[1] - geo.cache_frames :]
            st.frames_decoded += 1
            st.samples_emitted += geo.samples_per_frame
        return [out[r] for r in range(n)]

    def flush(self, state: CodecState) -> mx.array:
        """The held-back tail (lead_in samples): the end of the offline decode after the last step.

        Marks the state flushed (decode_step then refuses it until `reset()`).
        """
        self._check_state(state, "Codec.flush")
        geo = self._geometry
        # Only the cached (real) frames cover the tail, exactly as at the offline end.
        audio = self._istft(state.istft_real, state.istft_imag)
        start = geo.cache_frames * geo.hop + geo.pad - geo.lead_in
        tail = audio[start : start + geo.lead_in]
        state.flushed = True
        state.samples_emitted += geo.lead_in
        return tail

    def stft_features(self, waveform: mx.array) -> mx.array:
        """Waveform (N,) -> (N / hop, stft_channels): [real bins, imag bins] of a periodic-Hann
        STFT, not centred, with (n_fft - hop) / 2 zeros padded at each end."""
        n_fft, hop = self._cfg.n_fft, self._cfg.hop_length
        pad = self._geometry.pad
        padded = mx.pad(waveform, [(pad, pad)])
        frames = 1 + (padded.shape[0] - n_fft) // hop
        index = mx.arange(frames)[:, None] * hop + mx.arange(n_fft)[None, :]
        spectrum = mx.fft.rfft(padded[index] * self._window, n=n_fft, axis=-1)
        return mx.concatenate([mx.real(spectrum), mx.imag(spectrum)], axis=1).astype(mx.float32)

    def encode(self, waveform) -> mx.array:
        """Waveform (N,) float, N a positive multiple of samples_per_frame -> codes (N / ratio, Q) int32."""
        if isinstance(waveform, np.ndarray):
            if not np.issubdtype(waveform.dtype, np.floating):
                raise TypeError(f"Codec.encode: waveform must be floating point, got {waveform.dtype}")
            waveform = mx.array(waveform.astype(np.float32, copy=False))
        elif isinstance(waveform, mx.array):
            if not mx.issubdtype(waveform.dtype, mx.floating):
                raise TypeError(f"Codec.encode: waveform must be floating point, got {waveform.dtype}")
        else:
            raise TypeError(f"Codec.encode: waveform must be an mx.array or numpy array, got {type(waveform).__name__}")
        ratio = self.samples_per_frame
        if waveform.ndim != 1 or waveform.shape[0] == 0 or waveform.shape[0] % ratio:
            raise ValueError(
                f"Codec.encode: waveform must be 1-D with a positive multiple of {ratio} samples "
                f"(samples_per_frame), got shape {tuple(waveform.shape)}"
            )
        waveform = _f32(waveform)
        if not mx.all(mx.isfinite(waveform)).item():
            raise ValueError("Codec.encode: waveform contains NaN or infinite samples")
        with ops.products_scope():
            latents = self.encoder(self.stft_features(waveform))
        return self.prvq.quantize(latents)
