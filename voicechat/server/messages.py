"""The server's internal messages: what a connection asks of the MLX worker (commands) and what
comes back to the connection's writer (outputs). Frozen dataclasses, dispatched with `match` /
`isinstance`; nothing here touches MLX or the wire (each dialect renders outputs to its own format).

    connection ── submit(channel, Command) ──► ModelWorker (the one MLX thread)
        ▲                                          │
        └──────── Channel.outbox ◄── Output ───────┘  (+ the connection's own Reply / TimedOut / Disconnected)

One outbox shape for every dialect: the session's own events (voicechat.events) travel in
`FrameEvents` with the frame's metadata; mlx-vlm's dialect renders them as its payloads, GA and Live
map them to OpenAI's events.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

# -- the session's settings (every dialect opens its model session with these)


@dataclass(frozen=True)
class SessionParams:
    """What `create_streaming_session` gets: the prompt, seed, clock limit and tools; `model` is what the
    client named (accepted and ignored). `max_prompt_tokens` is the server's limit, set by the connection."""

    system_prompt: str | None = None
    seed: int = 0
    max_streaming_seconds: float | None = None
    model: str | None = None
    tools: list[dict[str, Any]] | None = None
    max_prompt_tokens: int | None = None


# -- commands: connection -> worker (each travels with the connection's Channel, worker.submit)


@dataclass(frozen=True)
class OpenSession:
    """Create the connection's model session (prefill or a cached prompt state)."""

    params: SessionParams


@dataclass(frozen=True, eq=False)
class AppendAudio:
    """16 kHz input samples (int16 or float32), already admitted (audio limit, backpressure)."""

    pcm: np.ndarray


@dataclass(frozen=True)
class Commit:
    """End the turn: the session's flush(pad_partial); answered by Committed, the last events, Finished."""

    pad_partial: bool = True


@dataclass(frozen=True)
class Cancel:
    """Drop queued audio, cancel the session; answered by its Cancelled event and Finished."""


@dataclass(frozen=True)
class Sync:
    """A marker: answered by Synced(tag) once every command before it is done (GA's commit)."""

    tag: str = ""


@dataclass(frozen=True)
class SubmitToolResult:
    """A tool call's result for the session; `by_server`: the server's tool runner answered (`--mcp`)."""

    call_id: str
    output: str
    by_server: bool = False


@dataclass(frozen=True)
class Close:
    """The connection is over: close its session and log its line; answered by Closed."""


@dataclass(frozen=True)
class Stop:
    """Stop the worker thread (no channel)."""


Command = OpenSession | AppendAudio | Commit | Cancel | Sync | SubmitToolResult | Close | Stop


# -- outputs: worker -> connection (Channel.emit)


@dataclass(frozen=True)
class SessionOpened:
    """The model session exists; `info` is the worker's model geometry (ModelWorker.info)."""

    info: dict[str, Any]


@dataclass(frozen=True)
class SessionRefused:
    """The model session was not created (prompt too long, the model refused it); another may be asked."""

    code: str
    message: str


@dataclass(frozen=True, eq=False)
class FrameEvents:
    """The session's events of one frame (a tick of the worker's batch, or a commit's flush) with the
    compute time of that tick (all its sessions' frames, computed together) and the lag (audio
    received but not computed) when the frame completed; 0.0 when no frame was computed."""

    events: tuple[object, ...]
    compute_ms: float = 0.0
    lag_ms: float = 0.0


@dataclass(frozen=True)
class Committed:
    """The session's audio before a Commit is computed (mlx-vlm's input_audio_buffer.committed)."""


@dataclass(frozen=True)
class Synced:
    """The answer to Sync(tag)."""

    tag: str = ""


@dataclass(frozen=True)
class ToolOutputSent:
    """The server's tool runner answered a call and the result went into the session (`--mcp`)."""

    frame_index: int
    call_id: str
    output: str


@dataclass(frozen=True)
class SessionError:
    """An error for the client from the session's side (context_limit, invalid_tool_result, internal_error)."""

    code: str
    message: str


@dataclass(frozen=True)
class Finished:
    """The session is over; `end` is how (done, cancelled, context_limit, internal_error): the socket closes."""

    end: str


@dataclass(frozen=True)
class Closed:
    """The worker closed the session (after Close); `log` is its session_end line (None: it had none)."""

    log: dict[str, Any] | None = None


# -- outputs the connection puts in its own outbox (in order with the worker's)


@dataclass(frozen=True)
class Reply:
    """A server event a dialect rendered (without event_id): sent as is."""

    payload: dict[str, Any] = field(default_factory=dict[str, Any])


@dataclass(frozen=True)
class TimedOut:
    """A deadline passed (session_update_timeout, idle_timeout, session_time_limit): error, then close 1008."""

    code: str
    message: str


@dataclass(frozen=True)
class Disconnected:
    """The client closed the socket."""


Output = (
    SessionOpened
    | SessionRefused
    | FrameEvents
    | Committed
    | Synced
    | ToolOutputSent
    | SessionError
    | Finished
    | Closed
    | Reply
    | TimedOut
    | Disconnected
)

__all__ = [
    "SessionParams",
    "OpenSession",
    "AppendAudio",
    "Commit",
    "Cancel",
    "Sync",
    "SubmitToolResult",
    "Close",
    "Stop",
    "Command",
    "SessionOpened",
    "SessionRefused",
    "FrameEvents",
    "Committed",
    "Synced",
    "ToolOutputSent",
    "SessionError",
    "Finished",
    "Closed",
    "Reply",
    "TimedOut",
    "Disconnected",
    "Output",
]
