"""The tool-call parity row: a streamed session whose result is submitted after frame F equals the
offline run given that schedule (`generate(..., tool_results=[(F, call_id, output)])`), frame for frame.

Run on this project's model (the reference implementations have no tool loop). The call ids of the
offline schedule are the streamed run's, which are deterministic (`call_{frame}_{position}`): an
offline run that calls at another frame refuses the schedule, and the row fails.
"""

from __future__ import annotations

import numpy as np

from .families import E2E, FAIL, FamilyResult, compare_codes, compare_ids, compare_value

COMPARISON = "streamed vs offline (tool schedule)"


def _event_key(e) -> str:
    fields = {k: v for k, v in e.__dict__.items() if k != "kind"}
    return f"{e.kind}{fields}"


def tool_schedule_rows(
    model,
    audio: np.ndarray,
    tools,
    *,
    result_after: int,
    output,
    system_prompt=None,
    seed: int = 0,
    chunk_samples: int = 1280,
) -> list[FamilyResult]:
    """Rows comparing ids, function ids, forced frames, codes and tool events of the two runs."""
    records = []
    s = model.create_streaming_session(system_prompt=system_prompt, seed=seed, tools=tools, on_frame=records.append)
    events, schedule = [], []
    for i in range(0, audio.size, chunk_samples):
        before = s.frame_index
        events += s.push_audio(audio[i : i + chunk_samples])
        if before <= result_after < s.frame_index:
            if s.frame_index - 1 != result_after:
                return [
                    FamilyResult(
                        E2E,
                        COMPARISON,
                        "schedule",
                        FAIL,
                        note=(
                            f"a push of {chunk_samples} samples ran past frame {result_after}; use a push size <= 1280"
                        ),
                    )
                ]
            for call_id in s.pending_tool_calls:
                s.submit_tool_result(call_id, output)
                schedule.append((result_after, call_id, output))
    events += s.flush()
    try:
        off = model.generate(audio, system_prompt=system_prompt, seed=seed, tools=tools, tool_results=schedule)
    except ValueError as e:
        return [FamilyResult(E2E, COMPARISON, "offline run accepts the streamed schedule", FAIL, observed=str(e))]
    k = len(s.text_ids)
    streamed_tool = [_event_key(e) for e in events if e.kind.startswith("tool_")]
    offline_tool = [_event_key(e) for e in off.tool_events if e.frame_index < k]
    note = f"{len(schedule)} result(s) submitted after frame {result_after}; {len(streamed_tool)} tool event(s)"
    return [
        compare_ids(E2E, COMPARISON, "text ids fed per frame", s.text_ids, off.text_tokens[:k], note=note),
        compare_ids(E2E, COMPARISON, "function ids fed per frame", s.function_ids, off.function_tokens[:k]),
        compare_ids(
            E2E, COMPARISON, "forced frames", [int(r.forced) for r in records], off.forced[:k].astype(int).tolist()
        ),
        compare_codes(
            E2E, COMPARISON, "generated codes per frame", np.stack(s.raw_audio_codes), off.raw_audio_codes[:k]
        ),
        compare_value(
            E2E, COMPARISON, "tool events", "; ".join(streamed_tool) or "none", "; ".join(offline_tool) or "none"
        ),
    ]
