"""Sample speech that ships with the package (16 kHz mono WAV), so the CLI default, the
tests, the bench and the docs need nothing outside the clone or the installed wheel.

* `question.wav`: 2.16 s, one spoken question (not a whole number of 80 ms frames).
* `long_question.wav`: a longer question, past the conformer's attention window.
"""

from __future__ import annotations

from pathlib import Path

SAMPLES_DIR = Path(__file__).resolve().parent
NAMES = ("question", "long_question")


def sample_path(name: str = "question") -> Path:
    """Path of a bundled sample: `"question"` or `"long_question"` (".wav" optional)."""
    stem = name[:-4] if name.endswith(".wav") else name
    if stem not in NAMES:
        raise ValueError(f"unknown sample {name!r}; the bundled samples are {', '.join(NAMES)}")
    return SAMPLES_DIR / f"{stem}.wav"


__all__ = ["SAMPLES_DIR", "NAMES", "sample_path"]
