"""The server's limits (no web dependencies: `voicechat serve --help` works on the base install)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class ServerLimits:
    """Every limit has a `voicechat serve` flag (docs/server.md)."""

    max_message_bytes: int = 1 << 20
    max_session_audio_seconds: float = 600.0
    session_update_timeout: float = 30.0
    idle_timeout: float = 120.0
    max_queued_audio_seconds: float = 5.0
    max_queued_appends: int = 512  # commands waiting in the worker queue for one session
    busy_grace_seconds: float = 1.0  # a new connection waits this long for a closing session's slot
    # A system prompt's prefill costs about one frame's language + TTS step per token, run before the
    # session's first frame; 512 tokens keep that under ~41 s of audio-clock work (512 x 80 ms).
    max_prompt_tokens: int = 512
    max_session_seconds: float = 3600.0  # wall clock per session, whatever the audio
    send_timeout: float = 10.0  # a client that takes longer to take one event is disconnected (1008)
    max_outbound_events: int = 4096  # events waiting for a slow reader before it is disconnected (1008)
    # An append waits (the server stops reading the socket) while the backlog is full; past this wait the
    # worker is not keeping up at all and the append is dropped with input_overflow.
    backpressure_timeout: float = 30.0
    shutdown_timeout: float = 5.0  # SIGTERM / SIGINT: live sessions get 1001, then the process exits

    def __post_init__(self):
        for name in (
            "max_message_bytes",
            "max_session_audio_seconds",
            "session_update_timeout",
            "idle_timeout",
            "max_queued_audio_seconds",
            "max_queued_appends",
            "busy_grace_seconds",
            "max_prompt_tokens",
            "max_session_seconds",
            "send_timeout",
            "max_outbound_events",
            "backpressure_timeout",
            "shutdown_timeout",
        ):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not v > 0 or v == float("inf"):
                raise ValueError(f"server limit {name} must be a positive number, got {v!r}")

    @property
    def transport_max_bytes(self) -> int:
        """uvicorn's hard cap: above it the transport closes with 1009; between the two we answer an error."""
        return 4 * self.max_message_bytes + 4096
