"""Log-mel frontend (docs/model.md §4): offline function and a streaming twin.

Both paths run the same framing code (`_log_mel_frames`) on the same
pre-emphasised samples, so a streamed frame is the offline frame computed from
identical inputs; they differ only if the backend's FFT / matmul rounds a row
differently for a different number of rows.

Input waveforms: 1-D numpy or mx arrays of a floating dtype (float16, bfloat16,
float32, float64; computed in float32). Integer PCM (e.g. int16) is refused
with a TypeError rather than guessed-scaled: divide by 32768 first. NaN or
infinite samples raise ValueError.
"""

from __future__ import annotations

import math

import mlx.core as mx
import numpy as np

from voicechat.model.config import PreprocessorConfig

# Slaney mel scale constants (docs/model.md §4.1).
_F_SP = 200.0 / 3.0  # Hz per mel below the break
_MIN_LOG_HZ = 1000.0
_MIN_LOG_MEL = 15.0  # = _MIN_LOG_HZ / _F_SP
_LOGSTEP = math.log(6.4) / 27.0


def _hz_to_mel(f: float) -> float:
    if f < _MIN_LOG_HZ:
        return f / _F_SP
    return _MIN_LOG_MEL + math.log(f / _MIN_LOG_HZ) / _LOGSTEP


def mel_filterbank(cfg: PreprocessorConfig) -> mx.array:
    """Slaney-scale, area-normalised triangular filters (n_mels, n_fft//2 + 1), float32.

    Built in float32 with MLX exactly as docs/model.md §4.1 prescribes (the
    rounding moves the triangle edges by ~1e-4 relative to a float64 build,
    which shows in the log-mel at ~2e-4); f_max is sample_rate / 2.
    """
    n_mels, n_fft, sr = cfg.features, cfg.n_fft, cfg.sample_rate
    if n_mels <= 0 or n_fft <= 0:
        raise ValueError(f"mel_filterbank: features and n_fft must be positive, got {n_mels}, {n_fft}")
    n_bins = n_fft // 2 + 1
    mel_max = _hz_to_mel(sr / 2.0)
    mels = mx.linspace(0.0, mel_max, n_mels + 2, dtype=mx.float32)
    f_sp = mx.array(_F_SP, dtype=mx.float32)
    logstep = mx.array(_LOGSTEP, dtype=mx.float32)
    hz_linear = f_sp * mels
    hz_log = _MIN_LOG_HZ * mx.exp(logstep * (mels - _MIN_LOG_MEL))
    mel_hz = mx.where(mels >= _MIN_LOG_MEL, hz_log, hz_linear)  # (n_mels + 2,)

    fft_hz = mx.arange(n_bins, dtype=mx.float32) * (sr / n_fft)  # exact for 16k / 512
    fdiff = mel_hz[1:] - mel_hz[:-1]  # (n_mels + 1,)
    ramps = mel_hz[:, None] - fft_hz[None, :]  # (n_mels + 2, n_bins)
    lower = -ramps[:n_mels] / fdiff[:n_mels, None]
    upper = ramps[2 : n_mels + 2] / fdiff[1 : n_mels + 1, None]
    weights = mx.maximum(0.0, mx.minimum(lower, upper))
    enorm = 2.0 / (mel_hz[2 : n_mels + 2] - mel_hz[:n_mels])
    return (weights * enorm[:, None]).astype(mx.float32)


def hann_window(cfg: PreprocessorConfig) -> mx.array:
    """Symmetric Hann of win_length, zero-padded (centred) to n_fft, float32."""
    win, n_fft = cfg.win_length, cfg.n_fft
    if not 1 < win <= n_fft:
        raise ValueError(f"win_length {win} must be in (1, n_fft={n_fft}]")
    n = np.arange(win, dtype=np.float64)
    w = 0.5 * (1.0 - np.cos(2.0 * np.pi * n / (win - 1)))
    left = (n_fft - win) // 2
    full = np.zeros(n_fft, dtype=np.float64)
    full[left : left + win] = w
    return mx.array(full.astype(np.float32))


def as_waveform(samples, what: str = "waveform") -> mx.array:
    """Validate a 1-D floating waveform and return it as float32 mx.array."""
    if isinstance(samples, np.ndarray):
        if samples.ndim != 1:
            raise ValueError(f"{what}: expected a 1-D array of samples, got shape {samples.shape}")
        if not np.issubdtype(samples.dtype, np.floating):
            raise TypeError(
                f"{what}: expected floating samples in [-1, 1], got dtype {samples.dtype}; "
                "convert integer PCM first (e.g. int16 / 32768.0)"
            )
        samples = samples.astype(np.float32, copy=False)
        if samples.size and not np.isfinite(samples).all():  # on the host: no device round trip
            raise ValueError(f"{what}: contains NaN or infinite samples")
        return mx.array(samples)
    elif isinstance(samples, mx.array):
        if samples.ndim != 1:
            raise ValueError(f"{what}: expected a 1-D array of samples, got shape {tuple(samples.shape)}")
        if not mx.issubdtype(samples.dtype, mx.floating):
            raise TypeError(
                f"{what}: expected floating samples in [-1, 1], got dtype {samples.dtype}; "
                "convert integer PCM first (e.g. int16 / 32768.0)"
            )
        x = samples.astype(mx.float32)
    else:
        raise TypeError(f"{what}: expected a 1-D numpy or mlx float array, got {type(samples).__name__}")
    if x.size and not mx.all(mx.isfinite(x)).item():
        raise ValueError(f"{what}: contains NaN or infinite samples")
    return x


def _preemphasis(x: mx.array, previous: mx.array | None, coeff: float) -> mx.array:
    """y[n] = x[n] - coeff * x[n-1]; `previous` is x[-1] (shape (1,)) or None at stream start."""
    if not coeff or x.size == 0:
        return x
    if previous is None:
        head = x[:1]  # y[0] = x[0]
        return mx.concatenate([head, x[1:] - coeff * x[:-1]])
    shifted = mx.concatenate([previous, x[:-1]])
    return x - coeff * shifted


def _log_mel_frames(
    y: mx.array,
    y_start: int,
    total: int,
    first: int,
    end: int,
    final: bool,
    cfg: PreprocessorConfig,
    window: mx.array,
    fbank: mx.array,
    shift: int = 0,
    limit: int | None = None,
) -> mx.array:
    """Log-mel frames [first, end) of a signal whose pre-emphasised samples
    y_start .. y_start + len(y) - 1 are in `y` (total samples received so far).

    Frame i covers samples i*hop - n_fft/2 .. i*hop + n_fft/2 - 1 of the
    centred STFT; positions before 0 (and, when `final`, from `total` on) are
    filled by the pad mode: reflect (excluding the edge sample) or zeros.

    `shift` / `limit` (reflect only) reproduce the reference's streamed edge frames: every position
    reads `shift` samples later, and positions that then reach `limit` or beyond read zeros
    (`StreamingLogMel(reference_edge=True)`).
    """
    hop, n_fft = cfg.hop_length, cfg.n_fft
    half = n_fft // 2
    n = end - first
    pos = (
        (first * hop - half + shift)
        + hop * mx.arange(n, dtype=mx.int32)[:, None]
        + mx.arange(n_fft, dtype=mx.int32)[None, :]
    )
    if cfg.pad_mode == "reflect":
        src = mx.where(pos < 0, -pos, pos)
        if final:
            src = mx.where(src >= total, 2 * (total - 1) - src, src)
        if limit is not None:
            frames = mx.where(pos < limit, y[mx.minimum(src, limit - 1) - y_start], 0.0)
        else:
            frames = y[src - y_start]
    else:  # constant: zeros outside the signal
        valid = pos >= 0
        if final:
            valid = valid & (pos < total)
        src = mx.clip(pos, y_start, y_start + y.size - 1)
        frames = mx.where(valid, y[src - y_start], 0.0)
    spec = mx.fft.rfft(frames * window, axis=-1)
    # |X|² as the reference rounds it: the magnitude first, then its square (re² + im²
    # rounds differently in ~half the bins, ~1 ulp)
    power = mx.square(mx.abs(spec))
    mel = power.astype(mx.float32) @ fbank.T
    return mx.log(mel + cfg.log_zero_guard_value)


def _check_reflect_length(cfg: PreprocessorConfig, n: int, what: str) -> None:
    half = cfg.n_fft // 2
    if cfg.pad_mode == "reflect" and n <= half:
        raise ValueError(
            f"{what}: reflect padding needs more than n_fft/2 = {half} samples, got {n} "
            "(use pad_mode 'constant' or a longer input)"
        )


def log_mel(waveform, cfg: PreprocessorConfig) -> mx.array:
    """Offline log-mel (T, n_mels), float32, T = 1 + N // hop (docs/model.md §4.2).

    Dither is never applied; normalisation must be "NA" (the config enforces it).
    """
    x = as_waveform(waveform)
    n = x.size
    _check_reflect_length(cfg, n, "log_mel")
    y = _preemphasis(x, None, cfg.preemph)
    return _log_mel_frames(y, 0, n, 0, 1 + n // cfg.hop_length, True, cfg, hann_window(cfg), mel_filterbank(cfg))


class StreamingLogMel:
    """Incremental log-mel with the offline frame grid (docs/model.md §4.3).

    Frame i (centred at sample i*hop) is emitted once samples up to
    i*hop + lookahead_samples have arrived: with lookahead 1280 and 1280-sample
    pushes, push 1 emits frame 0 and every later push exactly 8 frames.
    `flush()` emits the remaining frames up to N // hop with end-of-stream
    padding and closes the stream (further pushes raise RuntimeError; `reset()`
    reopens it).

    Retained state (bounded for any stream length): the pre-emphasised samples
    from hop * (next_frame - lookbehind) on (lookbehind = ceil((n_fft/2 + 1)/hop),
    2 frames at the default geometry) and the last raw sample, which the next
    chunk's pre-emphasis needs.

    `reference_edge=True` builds a push's frames as the reference's streaming
    frontend (mlx-audio) does near the start: it reflects only the samples up to
    the end of the push's last frame, so when the reflection needs one more (the
    first push emitting frame 0 alone: samples 1..n_fft/2 reflected, sample n_fft/2
    not yet in its window) its reflected half comes out shifted by the shortfall
    and the frame ends in zeros. With a reflection this moves the log-mel by
    float rounding only (~1e-6), which the conformer's attention cache carries on.
    """

    def __init__(self, cfg: PreprocessorConfig, lookahead_samples: int = 1280, *, reference_edge: bool = False):
        half = cfg.n_fft // 2
        self.reference_edge = bool(reference_edge)
        if not isinstance(lookahead_samples, int) or lookahead_samples < half:
            raise ValueError(f"lookahead_samples must be an int >= n_fft/2 = {half}, got {lookahead_samples!r}")
        self.cfg = cfg
        self.lookahead_samples = lookahead_samples
        self.lookbehind_frames = -(-(half + 1) // cfg.hop_length)
        self._window = hann_window(cfg)
        self._fbank = mel_filterbank(cfg)
        self.reset()

    # -- state
    def reset(self) -> None:
        self.buffer = mx.zeros((0,), dtype=mx.float32)  # pre-emphasised samples
        self.buffer_start = 0  # absolute index of buffer[0]
        self.last_sample = None  # raw x[samples_seen - 1], shape (1,)
        self.samples_seen = 0
        self.frames_emitted = 0
        self.closed = False

    def copy(self) -> StreamingLogMel:
        other = object.__new__(StreamingLogMel)
        other.__dict__.update(self.__dict__)  # mx arrays are immutable: sharing is safe
        return other

    def arrays(self) -> dict[str, mx.array]:
        out = {"buffer": self.buffer}
        if self.last_sample is not None:
            out["last_sample"] = self.last_sample
        return out

    @property
    def buffer_length(self) -> int:
        return int(self.buffer.size)

    @property
    def n_mels(self) -> int:
        return self.cfg.features

    # -- streaming
    def _empty(self) -> mx.array:
        return mx.zeros((0, self.cfg.features), dtype=mx.float32)

    def _frame_end(self) -> int:
        """One past the last frame whose lookahead has arrived."""
        available = self.samples_seen - self.lookahead_samples
        end = available // self.cfg.hop_length + 1 if available >= 0 else 0
        half = self.cfg.n_fft // 2
        if self.cfg.pad_mode == "reflect" and self.samples_seen <= half:
            # reflecting the start reads sample n_fft/2 (only reachable when lookahead == n_fft/2)
            end = min(end, 0)
        return end

    def _emit(self, end: int, final: bool) -> mx.array:
        if end <= self.frames_emitted:
            return self._empty()
        out = _log_mel_frames(
            self.buffer,
            self.buffer_start,
            self.samples_seen,
            self.frames_emitted,
            end,
            final,
            self.cfg,
            self._window,
            self._fbank,
            *self._reference_edge(end, final),
        )
        self.frames_emitted = end
        keep_from = self.cfg.hop_length * max(end - self.lookbehind_frames, 0)
        if keep_from > self.buffer_start:
            self.buffer = self.buffer[keep_from - self.buffer_start :]
            self.buffer_start = keep_from
        mx.async_eval(out, self.buffer)  # cut the graph (the retained tail must not pin history); no wait
        return out

    def _reference_edge(self, end: int, final: bool) -> tuple[int, int | None]:
        """(shift, limit) of the reference's construction for frames [frames_emitted, end), or (0, None)."""
        cfg = self.cfg
        if not self.reference_edge or final or cfg.pad_mode != "reflect":
            return 0, None
        half, hop = cfg.n_fft // 2, cfg.hop_length
        left = half - self.frames_emitted * hop  # reflected samples the first frame needs
        if left <= 0:
            return 0, None
        available = min((end - 1) * hop - half + cfg.n_fft, self.samples_seen)  # its window's samples
        short = left - (available - 1)
        return (short, available) if short > 0 else (0, None)

    def push(self, samples) -> mx.array:
        """Append samples; return the newly complete frames (n, n_mels)."""
        if self.closed:
            raise RuntimeError("StreamingLogMel: stream is closed (flush() was called); call reset() first")
        return self.advance(as_waveform(samples, "StreamingLogMel.push samples"))

    def advance(self, x: mx.array) -> mx.array:
        """`push` of float32 samples (1-D) checked by the caller (the session validates its input
        once, where it comes in): the same computation without converting or checking it again."""
        if self.closed:
            raise RuntimeError("StreamingLogMel: stream is closed (flush() was called); call reset() first")
        if x.size == 0:
            return self._empty()
        y = _preemphasis(x, self.last_sample, self.cfg.preemph)
        self.buffer = mx.concatenate([self.buffer, y]) if self.buffer.size else y
        self.last_sample = x[-1:]
        self.samples_seen += int(x.size)
        return self._emit(self._frame_end(), final=False)

    def flush(self) -> mx.array:
        """Emit the frames up to N // hop with end-of-stream padding; close the stream."""
        if self.closed:
            return self._empty()
        if self.samples_seen == 0:
            self.closed = True
            return self._empty()
        _check_reflect_length(self.cfg, self.samples_seen, "StreamingLogMel.flush")
        out = self._emit(self.samples_seen // self.cfg.hop_length + 1, final=True)
        self.closed = True
        return out


__all__ = ["mel_filterbank", "hann_window", "log_mel", "StreamingLogMel", "as_waveform"]
