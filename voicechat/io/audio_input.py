"""Validation of user audio: one set of rules for push_audio, generate, the ASR session and the CLI.

Arrays (push_audio, the ASR `step`, generate(array)) are strict: they are the real-time
path, and silently resampling there would hide a caller's bug. Accepted (docs/voicechat.md):
* 1-D mono arrays (numpy, MLX, or a list of numbers) at 16 kHz;
* float32 as is; float64 / float16 converted to float32 (values kept, not clipped);
* int16 PCM scaled by 1/32768 and int32 PCM by 1/2147483648 (full scale -> [-1, 1)).

Refused with a message saying what was wrong and what is expected:
* other sample rates (nothing is resampled silently), a non-integer `sample_rate`;
* anything that is not 1-D (stereo, (n, 2), (n, 1), scalars);
* NaN or infinite samples (never silently replaced);
* other dtypes (bool, uint8, int8, int64, complex, strings).

Files (the CLI, generate(path), `voicechat parity --audio`, the bench) are taken as people
have them: WAV / FLAC / OGG at any sample rate and channel count are mixed down to mono (the
mean of the channels) and then resampled with soxr (HQ) to the model's rate; one line on
stderr says what was done. soxr's output length is round(n * target / rate), halves up.
"""

from __future__ import annotations

import numbers
from pathlib import Path

import numpy as np

from voicechat.samples import NAMES, sample_path

_INT_SCALE = {np.dtype(np.int16): 1.0 / 32768.0, np.dtype(np.int32): 1.0 / 2147483648.0}


def check_sample_rate(sample_rate, expected: int) -> None:
    if isinstance(sample_rate, bool) or not isinstance(sample_rate, numbers.Real):
        raise TypeError(f"sample_rate must be a number (Hz), got {type(sample_rate).__name__} {sample_rate!r}")
    if sample_rate != expected:
        raise ValueError(
            f"audio must be sampled at {expected} Hz, got sample_rate={sample_rate}; "
            f"resample it to {expected} Hz first (nothing is resampled implicitly)"
        )


def as_mono_float32(samples, *, allow_empty: bool = True) -> np.ndarray:
    """Validate and convert user audio to a 1-D float32 numpy array (see module docstring)."""
    if isinstance(samples, (str, bytes, Path)):
        raise TypeError(f"expected an array of samples, got {type(samples).__name__}; use a file reader for paths")
    try:
        import mlx.core as mx

        if isinstance(samples, mx.array):
            samples = np.array(samples)
    except ImportError:  # pragma: no cover
        pass
    if isinstance(samples, (list, tuple)):
        try:
            samples = np.asarray(samples, dtype=np.float64)
        except (TypeError, ValueError):
            raise TypeError("expected a list of numbers (audio samples)") from None
    if not isinstance(samples, np.ndarray):
        raise TypeError(f"expected a 1-D numpy/MLX array or list of samples, got {type(samples).__name__}")
    a = samples
    if a.ndim != 1:
        raise ValueError(
            f"expected mono audio as a 1-D array of samples, got shape {a.shape}; "
            "mix multi-channel audio down to mono first (e.g. x.mean(axis=1))"
        )
    if a.dtype in _INT_SCALE:
        a = a.astype(np.float32) * np.float32(_INT_SCALE[a.dtype])
    elif a.dtype in (np.float32, np.float64, np.float16):
        a = a.astype(np.float32, copy=False)
    else:
        raise TypeError(f"unsupported sample dtype {a.dtype}; expected float32/float64 in [-1, 1] or int16/int32 PCM")
    if not allow_empty and a.size == 0:
        raise ValueError("audio is empty (0 samples); expected at least one sample")
    finite = np.isfinite(a)
    if not finite.all():
        i = int(np.argmin(finite))
        raise ValueError(f"audio contains NaN or infinite samples (first at index {i}); expected finite values")
    return a


def describe_channels(n: int) -> str:
    return {1: "mono", 2: "stereo"}.get(n, f"{n}-channel")


def to_mono_at_rate(data: np.ndarray, rate: int, target_rate: int) -> tuple[np.ndarray, list[str]]:
    """(frames, channels) float32 at `rate` -> 1-D float32 at `target_rate`, and the steps taken.

    Downmix first (mean of the channels: a centred source keeps its level), then one
    resampling pass with soxr's HQ quality (the mono signal is resampled once, not each channel).
    """
    steps = []
    if data.ndim == 1:
        data = data[:, None]
    if data.shape[1] == 1:
        mono = data[:, 0]
    else:
        mono = data.mean(axis=1, dtype=np.float32)
        steps.append(f"mean of {data.shape[1]} channels")
    if rate != target_rate:
        import soxr

        if mono.size:
            mono = soxr.resample(np.ascontiguousarray(mono), rate, target_rate, quality="HQ")
        steps.append("soxr HQ")
    return np.ascontiguousarray(mono, dtype=np.float32), steps


def read_audio_file(path, target_rate: int, *, report=True) -> np.ndarray:
    """Read an audio file (WAV, FLAC, OGG; any rate and channel count) as mono float32 at `target_rate`.

    When the file had to be mixed down or resampled, one line saying so goes to stderr
    (`report=False` silences it; a file object may be passed as `report` instead).
    """
    import sys

    import soundfile as sf

    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"{path}: no such audio file")
    if path.is_dir():
        raise ValueError(f"{path}: is a folder; expected an audio file (WAV/FLAC/OGG)")
    try:
        data, sr = sf.read(str(path), dtype="float32", always_2d=True)
    except Exception as e:
        raise ValueError(f"{path}: not a readable audio file ({e}); expected a WAV/FLAC/OGG file") from None
    if data.shape[1] == 0:
        raise ValueError(f"{path}: has no audio channels; expected a WAV/FLAC/OGG file with at least one")
    mono, steps = to_mono_at_rate(data, int(sr), target_rate)
    if steps and report:
        stream = sys.stderr if report is True else report
        print(
            f"{path.name}: {sr} Hz {describe_channels(data.shape[1])} -> {target_rate} Hz mono ({', '.join(steps)})",
            file=stream,
            flush=True,
        )
    return as_mono_float32(mono)


def resolve_input_path(name) -> Path:
    """A CLI `--audio` value: an existing file, else a bundled sample name (`question.wav`,
    `long_question.wav`, with or without `.wav`); a missing file that is not a sample name is
    returned as is, so that reading it fails with "no such audio file"."""

    p = Path(name)
    if p.exists():
        return p
    stem = p.name[:-4] if p.name.endswith(".wav") else p.name
    if p.parent == Path(".") and stem in NAMES:
        return sample_path(stem)
    return p


def load_audio(audio, expected_rate: int, *, allow_empty: bool = False) -> np.ndarray:
    """A path (any rate and channel count: converted, see read_audio_file) or an array
    (strict: 1-D at `expected_rate`) -> validated 1-D float32 samples."""
    if isinstance(audio, (str, Path)):
        a = read_audio_file(audio, expected_rate)
        if not allow_empty and a.size == 0:
            raise ValueError(f"{audio}: audio file is empty")
        return a
    return as_mono_float32(audio, allow_empty=allow_empty)
