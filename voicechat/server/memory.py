"""What a session slot of `voicechat serve` can hold at the session length limit, and whether
`--max-sessions` slots of it fit beside the loaded model (docs/server.md, "Many sessions").

A session's caches (docs/voicechat.md, "Memory over long sessions") are bounded except three
families that gain one position per 80 ms frame (and one per system-prompt token):

* the language model's attention K/V (`NemotronHState.kv_bytes_per_position`);
* the EAR-TTS global layers' K/V (2 guidance rows x K, V x kv heads x head dim, float32), from the
  speaker warm-up's positions on;
* the EAR-TTS sliding layers' K/V, which stop at their window.

Buffers grow in steps of 256 positions (`KV_ALLOC_STEP`), so each is counted at its capacity
rounded up. The bounded caches (Mamba conv + SSM states, the mel look-behind, the RNNT, the codec,
the EAR-TTS state's other arrays) are measured on a throwaway session a few frames in; the
conformer's K/V window is counted at its bound (layers x K, V x left context x d_model, float32).

The session length limit of the server is `--max-session-audio-seconds` (a session cannot compute
more frames than the audio it was given, plus the zero-padded last frame at commit; a client's
`max_streaming_seconds` is at most that); the prompt is counted at `--max-prompt-tokens` or the
default prompt's positions, whichever is more.
"""

from __future__ import annotations

import math
import os
import sys
from dataclasses import dataclass

import numpy as np

from voicechat.errors import VoiceChatError

KV_STEP = 256  # KV_ALLOC_STEP of nemotron_h.py and ear_tts.py
PROBE_FRAMES = 3  # frames after which the bounded caches other than the conformer window are at their size


class MemoryBudgetError(VoiceChatError, RuntimeError):
    """`voicechat serve --max-sessions N`: N slots at the session length limit and the loaded model
    do not fit in the machine's memory."""


def _cap(n: int) -> int:
    return -(-max(int(n), 0) // KV_STEP) * KV_STEP


@dataclass(frozen=True)
class SlotMemory:
    """Bytes one session slot can reach at the limit, by cache family."""

    session_seconds: float
    frames: int
    prompt_positions: int
    language_kv: int
    tts_global_kv: int
    tts_sliding_kv: int
    bounded: int

    @property
    def total(self) -> int:
        return self.language_kv + self.tts_global_kv + self.tts_sliding_kv + self.bounded

    def as_dict(self) -> dict:
        return {
            "session_seconds": self.session_seconds,
            "frames": self.frames,
            "prompt_positions": self.prompt_positions,
            "language_kv_bytes": self.language_kv,
            "tts_global_kv_bytes": self.tts_global_kv,
            "tts_sliding_kv_bytes": self.tts_sliding_kv,
            "bounded_bytes": self.bounded,
            "slot_bytes": self.total,
        }


def slot_memory(model, *, session_seconds: float, prompt_positions: int) -> SlotMemory:
    """The bytes one session of `model` can reach after `session_seconds` of audio and a prompt of
    `prompt_positions` positions: the growing caches from the loaded model's shapes, the bounded ones
    measured on a throwaway session of a few frames. Run on the thread that owns the model's MLX work."""
    cfg = model.config
    frames = math.ceil(session_seconds * cfg.input_sample_rate / cfg.frame_samples)
    # A throwaway session without a prompt, a few frames in: the bounded caches are made (the mel
    # look-behind, the RNNT and codec states, ...); the growing ones are counted below from the shapes.
    probe = model.create_streaming_session(system_prompt="")
    tl = probe.timeline.state
    warm = tl.tts.offset  # EAR-TTS positions of the speaker warm-up
    probe.push_audio(np.zeros(PROBE_FRAMES * cfg.frame_samples, np.float32))
    # The language model's attention K/V: one position per prompt token and per frame.
    language = tl.llm.kv_bytes_per_position * _cap(prompt_positions + frames) if tl.llm is not None else 0
    # EAR-TTS: every layer keeps K and V of the guidance pair (2 rows) in float32.
    tts = tl.tts
    per_position = 2 * 2 * tts.num_kv_heads * tts.head_dim * 4
    tts_positions = warm + prompt_positions + frames  # from the speaker warm-up on
    glob = sum(w is None for w in tts.windows)
    sliding = [w for w in tts.windows if w is not None]
    tts_global = glob * per_position * _cap(tts_positions)
    tts_sliding = sum(per_position * min(w, _cap(tts_positions)) for w in sliding)
    # Everything else of the state is bounded: measured, the conformer's K/V window at its bound.
    growing = (".keys", ".values")
    bounded = 0
    for name, a in probe.states().items():
        if name.startswith(("llm.", "tts.layers.")) and name.endswith(growing):
            continue
        if name.startswith("perception.conformer.layers.") and name.endswith((".k_cache", ".v_cache")):
            continue  # counted at their bound below
        bounded += int(a.nbytes)
    conformer = _conformer_window_bytes(model.stt_model.perception.encoder)
    probe.cancel()
    return SlotMemory(
        session_seconds=float(session_seconds),
        frames=int(frames),
        prompt_positions=int(prompt_positions),
        language_kv=int(language),
        tts_global_kv=int(tts_global),
        tts_sliding_kv=int(tts_sliding),
        bounded=int(bounded + conformer),
    )


def _conformer_window_bytes(encoder) -> int:
    """The conformer's per-layer K and V caches at their bound (left context x d_model, float32)."""
    left = encoder.left_context
    if left < 0:  # unbounded look-back cannot stream (ConformerStream refuses it)
        return 0
    return int(encoder.cfg.n_layers) * 2 * int(left) * int(encoder.cfg.d_model) * 4


def model_bytes(model) -> int:
    """The loaded model's footprint: its weights' bytes, or the process's resident memory when that
    is more (runtime copies of weights, the interpreter and its libraries)."""
    from mlx.utils import tree_flatten

    weights = sum(int(v.nbytes) for _, v in tree_flatten(model.parameters()))
    return max(weights, process_rss_bytes() or 0)


def process_rss_bytes() -> int | None:
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        pass
    try:
        import resource

        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # bytes on macOS, KiB on Linux
        return int(peak if sys.platform == "darwin" else peak * 1024)
    except (ImportError, OSError):
        return None


def machine_memory_bytes() -> int | None:
    """Physical memory (`sysctl hw.memsize` on macOS, MemTotal on Linux), lowered to the cgroup's limit
    when the process runs under one (a container); None when it cannot be read."""
    total = None
    if sys.platform == "darwin":
        import subprocess

        try:
            total = int(
                subprocess.run(["sysctl", "-n", "hw.memsize"], capture_output=True, text=True, check=False).stdout
            )
        except (OSError, ValueError):
            total = None
    if total is None:
        try:
            with open("/proc/meminfo") as f:
                for line in f:
                    if line.startswith("MemTotal:"):
                        total = int(line.split()[1]) * 1024
                        break
        except (OSError, ValueError):
            pass
    if total is None:
        try:
            total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        except (OSError, ValueError, AttributeError):
            total = None
    for path in ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"):
        try:
            with open(path) as f:
                text = f.read().strip()
        except OSError:
            continue
        if text.isdigit() and (total is None or int(text) < total):
            total = int(text)
    return total


def gib(n: int | float) -> str:
    """Bytes for a log line: GiB from 1 GiB up, MiB below."""
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"


@dataclass(frozen=True)
class MemoryPlan:
    """N slots at the limit beside the loaded model, against the machine's memory."""

    slots: int
    slot: SlotMemory
    model_bytes: int
    machine_bytes: int | None

    @property
    def needed(self) -> int:
        return self.model_bytes + self.slots * self.slot.total

    @property
    def fits(self) -> bool:
        return self.machine_bytes is None or self.needed <= self.machine_bytes

    def as_dict(self) -> dict:
        return {
            **self.slot.as_dict(),
            "slots": self.slots,
            "model_bytes": self.model_bytes,
            "needed_bytes": self.needed,
            "machine_bytes": self.machine_bytes,
        }

    def describe(self) -> str:
        s = self.slot
        machine = gib(self.machine_bytes) if self.machine_bytes is not None else "unknown"
        return (
            f"{self.slots} session slot(s), each up to {gib(s.total)} at the session length limit "
            f"({s.session_seconds:g} s = {s.frames} frames, prompt {s.prompt_positions} positions: language K/V "
            f"{gib(s.language_kv)}, EAR-TTS global K/V {gib(s.tts_global_kv)}, sliding K/V {gib(s.tts_sliding_kv)}, "
            f"bounded caches {gib(s.bounded)}); with the loaded model ({gib(self.model_bytes)}) "
            f"{gib(self.needed)} of {machine}"
        )

    def refusal(self) -> str:
        return (
            f"--max-sessions {self.slots} does not fit in this machine's memory: {self.describe()}. "
            "Lower --max-sessions or --max-session-audio-seconds (the session length limit), or start "
            "anyway with --no-memory-check"
        )


def plan(model, *, slots: int, session_seconds: float, prompt_positions: int) -> MemoryPlan:
    return MemoryPlan(
        slots=int(slots),
        slot=slot_memory(model, session_seconds=session_seconds, prompt_positions=prompt_positions),
        model_bytes=model_bytes(model),
        machine_bytes=machine_memory_bytes(),
    )


__all__ = [
    "MemoryBudgetError",
    "MemoryPlan",
    "SlotMemory",
    "machine_memory_bytes",
    "model_bytes",
    "plan",
    "slot_memory",
]
