"""`voicechat parity --against mlx-vlm-server`: protocol-level parity of the two realtime servers.

`mlx_vlm.server` and `voicechat serve` (numerics "reference", the default) run as subprocesses on the same
checkpoint and the same reference client (`voicechat.server.client`) streams the same audio
to both (1280-sample appends, as fast as accepted, then commit). Rows (family `server`), all
exact: event kinds and order (our `response.audio.tail` aside: the codec tail mlx-vlm's server
drops, api.md), frames, text ids, function ids, transcript, audio_codes per frame (as each server sends them).
"""

from __future__ import annotations

import datetime as _dt
import tempfile
import time

from .families import FAIL, PASS, SERVER, TOLERANCES, FamilyResult
from .report import ParityReport

COMPARISON = "voicechat-server vs mlx-vlm-server"


def _row(metric: str, ok: bool, observed, *, first=None, frames=None, note: str = "") -> FamilyResult:
    t = TOLERANCES["exact"]
    return FamilyResult(
        SERVER,
        COMPARISON,
        metric,
        PASS if ok else FAIL,
        observed=observed,
        tolerance=t.value,
        tolerance_name=t.name,
        justification=t.justification,
        first_failing_frame=first,
        frames_compared=frames,
        note=note,
    )


def server_rows(ours: list[dict], reference: list[dict]) -> list[FamilyResult]:
    from voicechat.server.compare import compare_streams

    c = compare_streams(ours, reference)
    n = min(c["frames_ours"], c["frames_reference"])
    rows = [
        _row(
            "event kinds and order",
            c["kinds_equal"],
            "equal" if c["kinds_equal"] else f"differ at event {c['first_kind_mismatch']}",
            note=f"{c['events_ours']} vs {c['events_reference']} events; ours only: "
            f"{', '.join(c['ours_only']) or 'none'} (the codec tail at commit)",
        ),
        _row("frames", c["frames_ours"] == c["frames_reference"], f"{c['frames_ours']} vs {c['frames_reference']}"),
        _row("text ids", c["text_ids_equal"], "equal" if c["text_ids_equal"] else "differ", frames=n),
        _row("function ids", c["function_ids_equal"], "equal" if c["function_ids_equal"] else "differ", frames=n),
        _row("transcript deltas", c["transcript_equal"], "equal" if c["transcript_equal"] else "differ", frames=n),
        _row(
            "audio_codes",
            c["codes_equal"],
            c["code_frames_differing"],
            first=c["first_code_mismatch"],
            frames=n,
            note="frames whose codes differ; audio (PCM16) max |diff| on equal-code frames: "
            f"{c.get('audio_max_abs_pcm16_on_equal_code_frames')} (codec float32 differences, "
            "docs/voicechat.md)",
        ),
    ]
    return rows


def run_server_parity(
    checkpoint: str, wave, *, system_prompt=None, seed: int = 0, input_name: str = "input", model_arg: str | None = None
) -> ParityReport:
    from voicechat.server.client import run_stream_audio, to_pcm16
    from voicechat.server.compare import ServerPair

    from .engine import audio_digest, versions

    t0 = time.perf_counter()
    pcm = to_pcm16(wave)
    with tempfile.TemporaryDirectory() as logs, ServerPair(checkpoint, logs) as pair:
        kw = dict(fast=True, chunk_samples=1280, seed=seed, system_prompt=system_prompt, model=checkpoint)
        ours = run_stream_audio(pair.ours_url, pcm, **kw)
        ref = run_stream_audio(pair.reference_url, pcm, **kw)
    rows = server_rows(ours.events, ref.events)
    for name, r in (("voicechat-server", ours), ("mlx-vlm-server", ref)):
        if r.errors or r.end != "response.done":
            rows.append(_row(f"{name} session", False, r.end or "closed", note=str(r.errors)))
    header = {
        "title": COMPARISON,
        "mode": "server",
        "checkpoint": model_arg or checkpoint,
        "backend": "voicechat-server",
        "against": "mlx-vlm-server",
        "input": f"{input_name} ({pcm.size} samples, {pcm.size / 16000:.2f} s, sha256 {audio_digest(wave)})",
        "input_name": input_name,
        "ours": "voicechat serve --numerics reference",
        "seed": seed,
        "system_prompt": system_prompt or "",
        "chunk_samples": 1280,
        "versions": versions(),
        "date": _dt.datetime.now(_dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "elapsed_s": round(time.perf_counter() - t0, 2),
    }
    return ParityReport(header=header, rows=rows)
