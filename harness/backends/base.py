"""The adapter interface between the harness / benchmark runner and one implementation.

A backend loads one checkpoint and runs the offline path and the streamed path
on the same input, returning plain numpy data so results of different
implementations can be diffed. Fields a backend cannot provide are None and the
harness reports the family as "not available" for it (never as passed).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np


@dataclass
class OfflineRun:
    text_ids: np.ndarray  # int32 (T,) per audio frame (prompt positions dropped)
    function_ids: np.ndarray  # int32 (T,)
    codes: np.ndarray  # int32 (T, Q): generated (raw) codes, before control-code replacement
    audio: np.ndarray  # float32 (T * samples_per_frame,)
    text: str
    transcript: str
    transcript_tokens: list[int] | None = None
    mel: np.ndarray | None = None  # (n_mel, F) offline log-mel of the input
    encoder: np.ndarray | None = None  # (T, d) offline encoder frames
    text_logits: np.ndarray | None = None  # (T, V) optional, for argmax margins
    function_logits: np.ndarray | None = None
    wall_s: float = 0.0
    transcript_frame_tokens: list[list[int]] | None = None  # RNNT tokens emitted per encoder frame
    decoded_codes: np.ndarray | None = None  # int32 (T, Q): the codes decoded (control codes replaced)


@dataclass
class StreamRun:
    text_ids: np.ndarray  # int32 (K,) per streamed frame
    function_ids: np.ndarray
    codes: np.ndarray  # int32 (K, Q): generated (raw) codes, before control-code replacement
    audio: np.ndarray  # float32 concatenated Audio events (K * samples_per_frame,)
    tail: np.ndarray  # float32 codec tail emitted at flush (empty if the backend emits none)
    text: str
    transcript: str
    transcript_tokens: list[int] | None = None
    events: list[dict[str, Any]] = field(default_factory=list[dict[str, Any]])  # kind + scalar fields, in order
    mel: np.ndarray | None = None  # streamed log-mel frames
    encoder: np.ndarray | None = None  # streamed encoder frames (K, d)
    text_logits: np.ndarray | None = None
    function_logits: np.ndarray | None = None
    frame_timings: list[dict[str, Any]] | None = None  # per frame, ms per stage (profile=True)
    profile_summary: dict[str, Any] | None = None
    create_s: float = 0.0  # session creation time (incl. TTS warm-up)
    first_audio_s: float | None = None  # from the first push to the first Audio event
    first_text_s: float | None = None
    wall_s: float = 0.0
    transcript_frame_tokens: list[list[int]] | None = None  # RNNT tokens emitted per streamed frame
    decoded_codes: np.ndarray | None = None  # int32 (K, Q): the Audio events' codes (control codes replaced)


class Backend:
    """Base class; subclasses implement load / offline / stream."""

    name = "base"

    def load(self, checkpoint: str) -> Any:
        raise NotImplementedError

    def offline(
        self,
        audio: np.ndarray,
        *,
        system_prompt: str | None = None,
        seed: int = 0,
        extra_decoding_seconds: float = 0.0,
        with_logits: bool = False,
    ) -> OfflineRun:
        raise NotImplementedError

    def stream(
        self,
        audio: np.ndarray,
        *,
        system_prompt: str | None = None,
        seed: int = 0,
        chunk_samples: int = 1280,
        profile: bool = False,
        with_logits: bool = False,
    ) -> StreamRun:
        raise NotImplementedError

    @property
    def samples_per_frame(self) -> int:
        raise NotImplementedError

    @property
    def lead_in(self) -> int:
        """Samples of the codec's fixed streaming lead-in (before the streamed audio lines up)."""
        raise NotImplementedError

    def close(self) -> None:
        """Release the model (benchmarks load several)."""
