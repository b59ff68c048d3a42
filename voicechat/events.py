"""Events a streaming session emits (api.md). Frozen dataclasses with a `kind` string."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar

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
    __hash__: ClassVar[None] = None  # type: ignore[assignment]  # equal by value, arrays included: not hashable

    def __eq__(self, other: object) -> bool:
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
    __hash__: ClassVar[None] = None  # type: ignore[assignment]  # equal by value, arrays included: not hashable

    def __eq__(self, other: object) -> bool:
        return (
            isinstance(other, AudioTail)
            and self.frame_index == other.frame_index
            and np.array_equal(self.samples, other.samples)
        )


@dataclass(frozen=True)
class ToolCall:
    """The model called a tool: emitted at the frame whose function token is EOTC, one per call in its list."""

    frame_index: int
    call_id: str  # call_{frame_index}_{position}
    name: str
    arguments: dict[str, Any]
    raw: str  # the decoded call text between SOTC and EOTC
    kind: str = field(default="tool_call", init=False)


@dataclass(frozen=True)
class ToolCallError:
    """A malformed call or marker sequence on the function channel; the session goes on."""

    frame_index: int
    message: str
    raw: str
    kind: str = field(default="tool_call_error", init=False)


@dataclass(frozen=True)
class ToolResultDone:
    """The model closed an injected tool response with its own EOTR."""

    frame_index: int
    call_id: str
    kind: str = field(default="tool_result_done", init=False)


@dataclass(frozen=True)
class Done:
    frame_index: int
    kind: str = field(default="done", init=False)


@dataclass(frozen=True)
class Cancelled:
    frame_index: int
    kind: str = field(default="cancelled", init=False)


Event = (
    AssistantTextDelta
    | FunctionDelta
    | UserTranscriptDelta
    | Audio
    | AudioTail
    | ToolCall
    | ToolCallError
    | ToolResultDone
    | Done
    | Cancelled
)
