"""Events a streaming session emits (api.md). Frozen dataclasses with a `kind` string."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np


@dataclass(frozen=True)
class AssistantTextDelta:
    frame_index: int
    token_id: int
    delta: str
    text: str
    kind: str = field(default="assistant_text_delta", init=False)


@dataclass(frozen=True)
class FunctionDelta:
    frame_index: int
    token_id: int
    delta: str
    text: str
    kind: str = field(default="function_delta", init=False)


@dataclass(frozen=True)
class UserTranscriptDelta:
    frame_index: int
    delta: str
    text: str
    kind: str = field(default="user_transcript_delta", init=False)


@dataclass(frozen=True, eq=False)
class Audio:
    frame_index: int
    samples: np.ndarray  # float32, exactly one output frame (1764 at 22050 Hz)
    audio_codes: np.ndarray  # int32, num_quantizers: the decoded codes (after control-code replacement)
    kind: str = field(default="audio", init=False)

    def __eq__(self, other):
        return (
            isinstance(other, Audio)
            and self.frame_index == other.frame_index
            and np.array_equal(self.samples, other.samples)
            and np.array_equal(self.audio_codes, other.audio_codes)
        )


@dataclass(frozen=True, eq=False)
class AudioTail:
    frame_index: int
    samples: np.ndarray  # float32, the codec's held-back tail
    kind: str = field(default="audio_tail", init=False)

    def __eq__(self, other):
        return (
            isinstance(other, AudioTail)
            and self.frame_index == other.frame_index
            and np.array_equal(self.samples, other.samples)
        )


@dataclass(frozen=True)
class Done:
    frame_index: int
    kind: str = field(default="done", init=False)


@dataclass(frozen=True)
class Cancelled:
    frame_index: int
    kind: str = field(default="cancelled", init=False)


Event = AssistantTextDelta | FunctionDelta | UserTranscriptDelta | Audio | AudioTail | Done | Cancelled
