"""Graph building overlapped with evaluation: `mx.async_eval` at layer boundaries.

MLX evaluates lazily. Without this, a frame's Python code builds the graph of a whole layer
stack (about a microsecond per operation, plus each layer's own Python) and only then does an
evaluation run it, while Python waits: the two halves take turns. At the small widths they are
of similar size (`small16`: ~11 ms of graph building and ~35 ms of evaluation per frame), and on
a CPU they can run at once, the stream threads computing layer i while Python builds layer i+1.

`start(*arrays)` hands a layer's output to `mx.async_eval` when enabled; it is called after each
layer of the conformer, of the Nemotron-H stack and of the EAR-TTS backbone, and after each MoG
pass. Nothing else changes: the same operations run on the same inputs, only sooner, so every
value is the same bit for bit (`parity_tests/test_overlap.py`).

`VOICECHAT_OVERLAP=0|1`, `set_overlap(b)` (or `with overlap_set(b):`). Default on for a CPU
default device; off on a GPU, where each evaluation commits a command buffer and this has not
been measured (Metal is not available here).
"""

from __future__ import annotations

import mlx.core as mx

from .switch import Override, bool_check, env_flag, held

ENV_VAR = "VOICECHAT_OVERLAP"

_override = Override(bool_check("set_overlap"))


def default_overlap() -> bool:
    """On for a CPU default device, off otherwise (or as `VOICECHAT_OVERLAP` says)."""
    env = env_flag(ENV_VAR, "evaluation overlapped with graph building")
    return mx.default_device().type == mx.DeviceType.cpu if env is None else env


def overlap_enabled() -> bool:
    """Whether `start` evaluates ahead now; decided once per frame (`switch.decisions_held`)."""
    return held("overlap", lambda: _override.value if _override.value is not None else default_overlap())


def set_overlap(enabled: bool | None) -> None:
    """Force overlapped evaluation on (True) or off (False) for this process; None restores the default."""
    _override.set(enabled)


def overlap_set(enabled: bool | None):
    """`set_overlap(enabled)` inside a with-block; the previous setting (default or forced) after."""
    return _override.scoped(enabled)


def start(*arrays: mx.array) -> None:
    """Start evaluating `arrays` (a layer's output) without waiting, when enabled."""
    if overlap_enabled():
        mx.async_eval(*arrays)


__all__ = ["ENV_VAR", "default_overlap", "overlap_enabled", "overlap_set", "set_overlap", "start"]
