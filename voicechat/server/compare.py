"""Protocol-level comparison of two servers' event streams for the same input (ours vs mlx-vlm's).

Used by the `-m peers` test and `voicechat parity --against mlx-vlm-server`. Fields that
are per-server by nature (event_id, session ids, timings) are not compared.
"""

from __future__ import annotations

import numpy as np

from .protocol import b64_to_int16

# Events only this project sends (api.md: the codec tail at commit, so no sample is lost).
OURS_ONLY = ("response.audio.tail",)


def _frames(events, t, key):
    return [(e["frame_index"], e[key]) for e in events if e["type"] == t]


def compare_streams(ours: list[dict], ref: list[dict]) -> dict:
    """-> figures and verdicts: kinds/order, text and function ids, transcript, codes, PCM16 audio."""
    kinds_a = [e["type"] for e in ours if e["type"] not in OURS_ONLY]
    kinds_b = [e["type"] for e in ref]
    first_kind = next((i for i, (x, y) in enumerate(zip(kinds_a, kinds_b)) if x != y),
                      None if len(kinds_a) == len(kinds_b) else min(len(kinds_a), len(kinds_b)))
    out = {"events_ours": len(ours), "events_reference": len(ref), "ours_only": sorted(
        {e["type"] for e in ours if e["type"] in OURS_ONLY}), "kinds_equal": first_kind is None,
        "first_kind_mismatch": first_kind}
    for name, t, key in (("text_ids", "response.text.delta", "token_id"),
                         ("function_ids", "response.function.delta", "token_id"),
                         ("transcript", "conversation.item.input_audio_transcription.delta", "transcript")):
        a, b = _frames(ours, t, key), _frames(ref, t, key)
        out[f"{name}_equal"] = a == b
        out[f"{name}_count"] = len(a)
    ca = [e["audio_codes"] for e in ours if e["type"] == "response.audio.delta"]
    cb = [e["audio_codes"] for e in ref if e["type"] == "response.audio.delta"]
    out["frames_ours"], out["frames_reference"] = len(ca), len(cb)
    n = min(len(ca), len(cb))
    diff = [i for i in range(n) if ca[i] != cb[i]]
    out["codes_equal"] = len(ca) == len(cb) and not diff
    out["code_frames_differing"] = len(diff)
    out["first_code_mismatch"] = diff[0] if diff else None
    pa = [b64_to_int16(e["delta"]) for e in ours if e["type"] == "response.audio.delta"]
    pb = [b64_to_int16(e["delta"]) for e in ref if e["type"] == "response.audio.delta"]
    same = [i for i in range(n) if ca[i] == cb[i]]
    if same:
        d = max(int(np.max(np.abs(pa[i].astype(np.int32) - pb[i].astype(np.int32)))) for i in same)
        out["audio_max_abs_pcm16_on_equal_code_frames"] = d
    return out
