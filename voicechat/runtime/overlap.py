"""Graph building overlapped with evaluation: `mx.async_eval` at layer boundaries.

MLX evaluates lazily. Without this, a frame's Python code builds the graph of a whole layer
stack and only then does an evaluation run it, while Python waits: the two halves take turns.
At the small widths they are of similar size, and on a CPU they can run at once, the stream
threads computing layer i while Python builds layer i+1.

`start(*arrays)` hands a layer's output to `mx.async_eval` when enabled; `ops.after_layer` calls
it after each layer of the conformer, of the Nemotron-H stack and of the EAR-TTS backbone, and
after each MoG pass. Nothing else changes: the same operations run on the same inputs, only
sooner, so every value is the same bit for bit (`parity_tests/test_parallel.py`).

The policy's `overlap` (`ExecutionPolicy`; `Runtime.after_layer` passes it) turns it on: by default
for a CPU device; off on a GPU, where each evaluation commits a command buffer and this has not been measured.
"""

from __future__ import annotations

import mlx.core as mx


def start(*arrays: mx.array, enabled: bool) -> None:
    """Start evaluating `arrays` (a layer's output) without waiting, when `enabled` (the policy's
    `overlap`)."""
    if enabled:
        mx.async_eval(*arrays)


__all__ = ["start"]
