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

    def __post_init__(self):
        for name in ("max_message_bytes", "max_session_audio_seconds", "session_update_timeout", "idle_timeout",
                     "max_queued_audio_seconds", "max_queued_appends", "busy_grace_seconds"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not v > 0:
                raise ValueError(f"server limit {name} must be a positive number, got {v!r}")

    @property
    def transport_max_bytes(self) -> int:
        """uvicorn's hard cap: above it the transport closes with 1009; between the two we answer an error."""
        return 4 * self.max_message_bytes + 4096
