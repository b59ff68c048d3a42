"""Exceptions raised by the project (all subclass the builtin a caller expects)."""

from typing import Any


class VoiceChatError(Exception):
    """Base class of this project's own errors."""


class ConfigError(VoiceChatError, ValueError):
    """config.json cannot describe a working model; the message names the key."""


class CheckpointError(VoiceChatError, ValueError):
    """A checkpoint folder is incomplete, inconsistent or corrupt; the message lists every culprit."""


class ContextLimitError(VoiceChatError, RuntimeError):
    """The streaming session reached `max_streaming_seconds`; `events`: those of the frames the call
    completed before it (a `push_audio` that raises loses none of them). From a `SessionBatch`'s
    `push` / `step`: `events` is {session: events} of the call and `sessions` the sessions that closed."""

    def __init__(
        self,
        message: str,
        events: list[object] | dict[Any, list[Any]] | None = None,
        sessions: list[Any] | None = None,
    ):
        super().__init__(message)
        self.events: list[object] | dict[Any, list[Any]] = [] if events is None else events
        self.sessions: list[Any] = [] if sessions is None else sessions


class SessionClosedError(VoiceChatError, RuntimeError):
    """`push_audio` on a session after `flush()` / `cancel()`."""


class PrefillStoppedError(VoiceChatError, RuntimeError):
    """A session's system-prompt prefill was stopped by its `should_stop` callback (its client left)."""


class WrongThreadError(VoiceChatError, RuntimeError):
    """A session was used from a thread other than the one that created it."""


class PromptStateError(VoiceChatError, ValueError):
    """A prompt state (voicechat.streaming.prompt_state) that cannot be used with this model: another checkpoint,
    numerics setting or format version, or a truncated or corrupt file; the message names which."""


class BatchFullError(VoiceChatError, RuntimeError):
    """`SessionBatch.open` with every slot taken; nothing changed."""
