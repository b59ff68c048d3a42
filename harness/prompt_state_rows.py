"""The prompt-state parity rows: a session started from `model.prepare_prompt(...)`'s state computes
exactly what a session that prefilled the same prompt computes (api.md, "Prompt state").

Streamed: every event (kinds, frame indices, ids, text, codes, samples), the ids fed per frame,
the generated codes, and every cache family right after the session starts. Offline: text and
function ids, generated codes and the audio. The state goes through a file (`save` /
`PromptState.load`) when `through_file` is set, so the rows also cover the on-disk form.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import numpy as np

from .families import E2E, FamilyResult, compare_codes, compare_ids, compare_value

COMPARISON = "prefilled vs from prompt state"


def _event_key(e) -> str:
    """One event as text, arrays by their exact bytes (dtype, shape, hex digest)."""
    import hashlib

    parts = []
    for k, v in e.__dict__.items():
        if isinstance(v, np.ndarray):
            v = f"{v.dtype}{v.shape}:{hashlib.sha256(np.ascontiguousarray(v).tobytes()).hexdigest()[:16]}"
        parts.append(f"{k}={v!r}")
    return ",".join(parts)


def _states(session) -> dict[str, bytes]:
    return {
        k: np.array(v).tobytes() + str(v.dtype).encode() + str(v.shape).encode() for k, v in session.states().items()
    }


def _first_diff(a: list, b: list) -> int | None:
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def _stream(model, audio, chunk_samples, **kw):
    s = model.create_streaming_session(**kw)
    start = _states(s)
    events = []
    for i in range(0, audio.size, chunk_samples):
        events += s.push_audio(audio[i : i + chunk_samples])
    events += s.flush()
    return s, start, events


def prompt_state_rows(
    model,
    audio: np.ndarray,
    *,
    system_prompt=None,
    tools=None,
    seed: int = 0,
    chunk_samples: int = 1280,
    offline: bool = True,
    through_file: bool = True,
) -> list[FamilyResult]:
    """Rows comparing a prefilling run with a run from the prompt's state, streamed (and offline)."""
    from voicechat import PromptState

    state = model.prepare_prompt(system_prompt, tools=tools, seed=seed)
    how = "in memory"
    if through_file:
        with tempfile.TemporaryDirectory() as d:
            path = state.save(Path(d) / "prompt.safetensors")
            state = PromptState.load(path, model)
        how = "through a file"
    note = f"{state.prompt_positions} prompt positions, {len(state.tools)} tool(s), state {how}, {state.nbytes} bytes"
    ref, ref_start, ref_events = _stream(
        model, audio, chunk_samples, system_prompt=system_prompt, tools=tools, seed=seed
    )
    got, got_start, got_events = _stream(model, audio, chunk_samples, prompt_state=state)
    diff_states = sorted(k for k in set(ref_start) | set(got_start) if ref_start.get(k) != got_start.get(k))
    ek_ref, ek_got = [_event_key(e) for e in ref_events], [_event_key(e) for e in got_events]
    first = _first_diff(ek_ref, ek_got)
    rows = [
        compare_value(
            E2E,
            COMPARISON,
            "cache families after session start (streamed)",
            ", ".join(diff_states) or "all equal",
            "all equal",
            note=note,
        ),
        compare_value(
            E2E,
            COMPARISON,
            "events (streamed; every field, arrays by their bytes)",
            f"{len(ek_got)} events" + ("" if first is None else f", first difference at event {first}"),
            f"{len(ek_ref)} events",
            first_failing_frame=first,
            frame_unit="event",
        ),
        compare_ids(E2E, COMPARISON, "text ids fed per frame (streamed)", got.text_ids, ref.text_ids),
        compare_ids(E2E, COMPARISON, "function ids fed per frame (streamed)", got.function_ids, ref.function_ids),
        compare_codes(
            E2E,
            COMPARISON,
            "generated codes per frame (streamed)",
            np.stack(got.raw_audio_codes),
            np.stack(ref.raw_audio_codes),
        ),
    ]
    if offline:
        a = model.generate(audio, system_prompt=system_prompt, tools=tools, seed=seed)
        b = model.generate(audio, prompt_state=state)
        rows += [
            compare_ids(E2E, COMPARISON, "text ids per frame (offline)", b.text_tokens, a.text_tokens),
            compare_ids(E2E, COMPARISON, "function ids per frame (offline)", b.function_tokens, a.function_tokens),
            compare_codes(E2E, COMPARISON, "generated codes per frame (offline)", b.raw_audio_codes, a.raw_audio_codes),
            compare_value(
                E2E,
                COMPARISON,
                "audio bytes (offline)",
                "equal" if a.audio.tobytes() == b.audio.tobytes() else "differ",
                "equal",
            ),
        ]
    return rows


__all__ = ["prompt_state_rows", "COMPARISON"]
