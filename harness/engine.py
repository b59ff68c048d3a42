"""The parity engine: run a backend's offline and streamed paths on one input and diff each cache family.

    report = run_parity(backend, audio, system_prompt=None, seed=0)                 # offline vs streamed
    report = run_parity(backend, audio, against=other_backend)                       # + A vs B, per path

Self mode (one backend) compares, each family on its own terms:

* log-mel: streamed mel frames vs the offline log-mel (common frames);
* FastConformer: streamed encoder frames vs the offline chunked-limited encoder;
* RNNT: transcript tokens per frame (common frames) and the session's tokens
  as a prefix of the offline tokens;
* Nemotron-H: cached single steps vs the no-cache recompute (logits and argmax
  ids per timeline position) through `backend.component_checks`;
* EAR-TTS: cached steps vs recompute-from-history (hidden, codes per frame);
* codec: the session's `decode_step` stream + tail vs one `decode` of the same
  codes, sample-aligned by the codec lead-in, warm-up samples excluded;
* end to end: the first audio frame (text id, function id, codes), ids and
  codes per frame, text, transcript, frame counts, audio lengths
  (frames x samples_per_frame + tail) and the audio samples.

Cross mode (`against=`) adds, for the offline and the streamed path
separately, backend A vs backend B rows, among them the text / function logits
of every frame against B's (`report.per_frame`: per frame the max abs
difference beside B's top-2 gap, in both report formats); differences listed in
`harness.differences` are marked "documented difference" only after the engine
has verified that the difference is exactly the documented one.
"""

from __future__ import annotations

import copy
import datetime as _dt
import hashlib
import platform
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import cast

import numpy as np

from .backends.base import Backend, OfflineRun, StreamRun
from .differences import DIFFERENCES
from .families import (
    CODEC,
    CONFORMER,
    DOCUMENTED,
    E2E,
    EAR_TTS,
    FAIL,
    MEL,
    NEMOTRON,
    PASS,
    RNNT,
    ComponentRun,
    FamilyResult,
    codec_cross_tolerance,
    compare_aligned_audio,
    compare_codes,
    compare_frames,
    compare_ids,
    compare_logits_per_frame,
    compare_text,
    compare_token_frames,
    compare_token_lists,
    compare_value,
    logits_per_frame,
    not_available,
)
from .report import ParityReport

OFFLINE_VS_STREAMED = "offline vs streamed"
CACHED_VS_RECOMPUTE = "cached steps vs recompute"
STEP_VS_DECODE = "decode_step stream vs one decode"


@dataclass
class Runs:
    """Everything one backend produced for one input."""

    backend: str
    offline: OfflineRun
    stream: StreamRun
    components: ComponentRun | None = None
    first_text_logits: np.ndarray | None = None
    first_function_logits: np.ndarray | None = None


# --------------------------------------------------------------------------- input


def read_input(audio, sample_rate: int = 16000) -> tuple[np.ndarray, str]:
    """A path (any WAV/FLAC/OGG, converted to mono at `sample_rate`; or a bundled sample name such
    as question.wav) or a 1-D float array -> (float32 samples, display name)."""
    if isinstance(audio, (str, Path)):
        from voicechat.io.audio_input import read_audio_file, resolve_input_path

        return read_audio_file(resolve_input_path(audio), sample_rate), str(audio)
    arr = np.asarray(audio)
    if arr.ndim != 1 or not np.issubdtype(arr.dtype, np.floating):
        raise ValueError(
            f"audio: expected a path or a 1-D float array at {sample_rate} Hz, got {arr.dtype} {arr.shape}"
        )
    return arr.astype(np.float32, copy=False), "array"


def audio_digest(audio: np.ndarray) -> str:
    return hashlib.sha256(np.ascontiguousarray(audio, dtype=np.float32).tobytes()).hexdigest()[:16]


# --------------------------------------------------------------------------- running a backend


def collect_runs(
    backend: Backend,
    audio: np.ndarray,
    *,
    system_prompt: str | None = None,
    seed: int = 0,
    chunk_samples: int = 1280,
    components: bool = True,
) -> Runs:
    from voicechat.io.progress import bar

    checks = getattr(backend, "component_checks", None)
    with bar(total=3 if components and callable(checks) else 2, desc=f"parity {backend.name}", unit="run") as b:
        b.set_postfix_str("offline")
        off = backend.offline(audio, system_prompt=system_prompt, seed=seed, with_logits=True)
        b.update()
        b.set_postfix_str("streamed")
        st = backend.stream(
            audio, system_prompt=system_prompt, seed=seed, chunk_samples=chunk_samples, with_logits=True
        )
        b.update()
        comp: ComponentRun | None = None
        if components and callable(checks):
            b.set_postfix_str("components")
            comp = cast(ComponentRun, checks(audio, system_prompt=system_prompt, seed=seed, offline=off))
            b.update()
    runs = Runs(backend.name, off, st, comp)
    if off.text_logits is not None and np.asarray(off.text_logits).shape[-1] > 2 and len(off.text_logits):
        runs.first_text_logits = np.asarray(off.text_logits[0])
        runs.first_function_logits = None if off.function_logits is None else np.asarray(off.function_logits[0])
    else:
        first = getattr(backend, "first_logits", None)
        if first is not None:
            runs.first_text_logits, runs.first_function_logits = first
    return runs


def _warmup(backend) -> int:
    w = getattr(backend, "warmup_samples", None)
    # api.md: the reference's streaming warm-up covers 8 more samples than lead_in; 2 * lead_in bounds both.
    return int(w) if w is not None else 2 * int(backend.lead_in)


def _concat_stream_audio(st: StreamRun) -> np.ndarray:
    return np.concatenate([np.asarray(st.audio, np.float32), np.asarray(st.tail, np.float32)])


def _first_code_mismatch(a, b) -> int | None:
    a, b = np.asarray(a), np.asarray(b)
    n = min(a.shape[0], b.shape[0])
    if a.ndim != 2 or b.ndim != 2 or a.shape[1:] != b.shape[1:]:
        return 0
    bad = np.nonzero((a[:n] != b[:n]).any(axis=1))[0]
    return int(bad[0]) if bad.size else None


# --------------------------------------------------------------------------- self mode


def self_rows(runs: Runs, backend: Backend, n_samples: int) -> list[FamilyResult]:
    """Every family of one backend: offline vs streamed, cached vs recompute, step vs decode."""
    off, st, comp = runs.offline, runs.stream, runs.components
    c = OFFLINE_VS_STREAMED
    rows: list[FamilyResult] = []
    spf, lead = int(backend.samples_per_frame), int(backend.lead_in)
    warm = _warmup(backend)
    T, K = len(off.text_ids), len(st.text_ids)
    extra = T - K

    # log-mel
    rows.append(compare_frames(MEL, c, "log-mel frames (max abs)", st.mel, off.mel, "mel_abs", frame_unit="mel frame"))

    # FastConformer
    rows.append(compare_frames(CONFORMER, c, "encoder frames (max abs)", st.encoder, off.encoder, "encoder_abs"))

    # RNNT
    rows.append(
        compare_token_frames(
            RNNT,
            c,
            "transcript tokens per frame (common frames)",
            st.transcript_frame_tokens,
            off.transcript_frame_tokens,
        )
    )
    rows.append(
        compare_token_lists(
            RNNT,
            c,
            "session transcript tokens (prefix of offline)",
            st.transcript_tokens,
            off.transcript_tokens,
            prefix_ok=extra > 0,
            note=f"offline decodes {extra} more frame(s)" if extra > 0 else "",
        )
    )

    # Nemotron-H / EAR-TTS through the component checks
    rows.extend(_component_rows(comp, backend))

    # codec: the session's decode_step stream + tail vs one decode of the same codes
    decode = getattr(backend, "decode_codes", None)
    if not callable(decode) or st.codes is None:
        for m in ("streamed samples vs decode (aligned)", "tail length", "streamed length vs decode length"):
            rows.append(not_available(CODEC, STEP_VS_DECODE, m, "the backend has no offline decode of given codes"))
    else:
        ref = np.asarray(decode(np.asarray(st.codes)))
        streamed = _concat_stream_audio(st)
        rows.append(
            compare_aligned_audio(
                CODEC,
                STEP_VS_DECODE,
                "streamed samples vs decode (aligned)",
                streamed,
                ref,
                delay=lead,
                skip=warm,
                samples_per_frame=spf,
                tol_name="codec_abs",
                end=len(ref),
                note=f"{warm} warm-up samples excluded",
            )
        )
        rows.append(
            compare_value(
                CODEC, STEP_VS_DECODE, "tail length", int(len(st.tail)), lead, first_failing_frame=max(K - 1, 0)
            )
        )
        rows.append(
            compare_value(
                CODEC,
                STEP_VS_DECODE,
                "streamed length vs decode length",
                int(len(streamed) - lead),
                int(len(ref)),
                first_failing_frame=max(K - 1, 0),
                note="audio + tail - lead_in",
            )
        )

    # end to end
    first = _first_frame_rows(E2E, c, st, off, logits=off)
    rows.extend(first)
    rows.append(compare_ids(E2E, c, "text ids per frame", st.text_ids, off.text_ids, logits=off.text_logits))
    rows.append(
        compare_ids(E2E, c, "function ids per frame", st.function_ids, off.function_ids, logits=off.function_logits)
    )
    rows.append(compare_codes(E2E, c, "codes per frame", st.codes, off.codes))
    expected_frames = getattr(backend, "expected_frames", None)
    expected = cast("tuple[int, int]", expected_frames(n_samples)) if callable(expected_frames) else None
    row = compare_value(
        E2E,
        c,
        "frame count (offline, streamed)",
        f"{T}, {K}",
        None if expected is None else f"{expected[0]}, {expected[1]}",
        first_failing_frame=min(T, K),
    )
    if row.status == PASS and extra:
        row.note = f"offline has {extra} more frame(s): extra_offline_frame ({DIFFERENCES['extra_offline_frame'].spec})"
    rows.append(row)
    rows.append(
        _text_row(
            E2E,
            c,
            "assistant text",
            st.text,
            off.text,
            off.text_ids,
            st.text_ids,
            getattr(backend, "decode_text", None),
            extra,
        )
    )
    rows.append(_transcript_row(st, off, getattr(backend, "decode_transcript", None), extra))
    rows.append(
        compare_value(
            E2E,
            c,
            "streamed audio length (frames x spf + tail)",
            int(len(st.audio) + len(st.tail)),
            K * spf + lead,
            first_failing_frame=max(K - 1, 0),
            note=f"{K} x {spf} + {lead}",
        )
    )
    rows.append(
        compare_value(
            E2E,
            c,
            "offline audio length (frames x spf)",
            int(len(off.audio)),
            T * spf,
            first_failing_frame=max(T - 1, 0),
        )
    )
    st_codes, off_codes = np.asarray(st.codes), np.asarray(off.codes)
    mis = _first_code_mismatch(st_codes, off_codes)
    last = min(T, K) if mis is None else mis
    end = K * spf if (mis is None and T == K) else max(0, last * spf - lead)
    rows.append(
        compare_aligned_audio(
            E2E,
            c,
            "audio samples (streamed delayed by lead-in)",
            _concat_stream_audio(st),
            off.audio,
            delay=lead,
            skip=warm,
            samples_per_frame=spf,
            tol_name="audio_abs",
            end=end,
            note="; ".join(
                p
                for p in (
                    f"up to the first code mismatch (frame {mis})" if mis is not None else "",
                    f"{warm} warm-up samples excluded",
                )
                if p
            ),
        )
    )
    return rows


def _first_frame_rows(family, comparison, a, b, *, logits=None) -> list[FamilyResult]:
    tl = None if logits is None or logits.text_logits is None else np.asarray(logits.text_logits)[:1]
    fl = None if logits is None or logits.function_logits is None else np.asarray(logits.function_logits)[:1]
    return [
        compare_ids(
            family,
            comparison,
            "first audio frame: text id",
            np.asarray(a.text_ids)[:1],
            np.asarray(b.text_ids)[:1],
            logits=tl,
        ),
        compare_ids(
            family,
            comparison,
            "first audio frame: function id",
            np.asarray(a.function_ids)[:1],
            np.asarray(b.function_ids)[:1],
            logits=fl,
        ),
        compare_codes(family, comparison, "first audio frame: codes", np.asarray(a.codes)[:1], np.asarray(b.codes)[:1]),
    ]


def _text_row(family, comparison, metric, stream_text, offline_text, offline_ids, stream_ids, decode_text, extra):
    row = compare_text(family, comparison, metric, stream_text, offline_text)
    if row.status != FAIL or extra <= 0 or decode_text is None:
        return row
    k = len(stream_ids)
    if decode_text(offline_ids[:k]) == stream_text:  # (the ids themselves are judged by their own row)
        return _documented(
            row,
            "extra_offline_frame",
            f"the offline text of the {k} common frames equals the streamed text; "
            f"the offline-only {extra} frame(s) add {offline_text[len(stream_text) :]!r}",
        )
    return row


def _transcript_row(st, off, decode_transcript, extra):
    row = compare_text(E2E, OFFLINE_VS_STREAMED, "user transcript", st.transcript, off.transcript)
    if row.status != FAIL or extra <= 0 or decode_transcript is None or off.transcript_frame_tokens is None:
        return row
    k = len(st.text_ids)
    common = [t for frame in off.transcript_frame_tokens[:k] for t in frame]
    if decode_transcript(common) == st.transcript:
        return _documented(
            row, "extra_offline_frame", f"the offline transcript of the {k} common frames equals the streamed one"
        )
    return row


def _documented(row: FamilyResult, difference_id: str, verification: str) -> FamilyResult:
    if difference_id not in DIFFERENCES:
        raise KeyError(f"no documented difference {difference_id!r}")
    row.status = DOCUMENTED
    row.difference_id = difference_id
    row.note = "; ".join(p for p in (row.note, f"verified: {verification}") if p)
    return row


def _component_rows(comp: ComponentRun | None, backend) -> list[FamilyResult]:
    c = CACHED_VS_RECOMPUTE
    if comp is None:
        why = "the backend has no component checks"
        return [
            not_available(NEMOTRON, c, m, why)
            for m in ("text logits", "function logits", "text argmax ids", "function argmax ids")
        ] + [not_available(EAR_TTS, c, m, why) for m in ("backbone hidden", "codes per frame")]
    p = comp.prompt_positions
    rows = []
    pos_note = f"{p} system-prompt positions shown as frames -{p}..-1" if p else ""
    rows.append(
        compare_frames(
            NEMOTRON,
            c,
            "text logits",
            comp.llm_cached_text_logits,
            comp.llm_recompute_text_logits,
            "logits_rel",
            relative_to_scale=True,
            frame_offset=-p,
            note=pos_note,
        )
    )
    rows.append(
        compare_frames(
            NEMOTRON,
            c,
            "function logits",
            comp.llm_cached_function_logits,
            comp.llm_recompute_function_logits,
            "logits_rel",
            relative_to_scale=True,
            frame_offset=-p,
            note=pos_note,
        )
    )
    for name, cached, recomputed in (
        ("text argmax ids", comp.llm_cached_text_logits, comp.llm_recompute_text_logits),
        ("function argmax ids", comp.llm_cached_function_logits, comp.llm_recompute_function_logits),
    ):
        if cached is None or recomputed is None:
            rows.append(not_available(NEMOTRON, c, name, "no logits"))
            continue
        cached, recomputed = np.asarray(cached)[p:], np.asarray(recomputed)[p:]
        rows.append(
            compare_ids(
                NEMOTRON, c, name, cached.argmax(-1), recomputed.argmax(-1), logits=recomputed, note="audio positions"
            )
        )
    rows.append(
        compare_frames(
            EAR_TTS,
            c,
            "backbone hidden",
            comp.tts_cached_hidden,
            comp.tts_recompute_hidden,
            "tts_hidden_abs",
            frame_offset=1 - p,
            note="timeline positions >= 1",
        )
    )
    rows.append(
        compare_codes(
            EAR_TTS,
            c,
            "codes per frame",
            comp.tts_cached_codes,
            comp.tts_recompute_codes,
            frame_offset=1 - p,
            note="same seed on both paths",
        )
    )
    return rows


# --------------------------------------------------------------------------- cross mode


def cross_rows(
    a: Runs,
    b: Runs,
    a_backend: Backend,
    b_backend: Backend,
    *,
    system_prompt: str | None,
    audio: np.ndarray,
    seed: int,
    chunk_samples: int,
    per_frame: dict | None = None,
) -> list[FamilyResult]:
    """A vs B rows per path; `per_frame` (a dict, if given) receives each path's per-frame logits
    comparison (`harness.families.logits_per_frame`) under "offline" / "streamed"."""
    rows: list[FamilyResult] = []
    spf, lead = int(a_backend.samples_per_frame), int(a_backend.lead_in)
    frame0_rows = None
    for path in ("offline", "streamed"):
        ra = a.offline if path == "offline" else a.stream
        rb = b.offline if path == "offline" else b.stream
        c = f"{path}: {a.backend} vs {b.backend}"
        if ra is None or rb is None:
            rows.append(not_available(E2E, c, "all", f"a backend has no {path} run"))
            continue
        path_rows: list[FamilyResult] = []
        path_rows.append(
            compare_frames(MEL, c, "log-mel frames (max abs)", ra.mel, rb.mel, "cross_mel_abs", frame_unit="mel frame")
        )
        path_rows.append(
            compare_frames(CONFORMER, c, "encoder frames (max abs)", ra.encoder, rb.encoder, "cross_encoder_abs")
        )
        path_rows.append(compare_token_lists(RNNT, c, "transcript tokens", ra.transcript_tokens, rb.transcript_tokens))
        path_rows.append(
            compare_value(
                E2E,
                c,
                "frame count",
                len(ra.text_ids),
                len(rb.text_ids),
                first_failing_frame=min(len(ra.text_ids), len(rb.text_ids)),
            )
        )
        if path == "offline":
            if (
                a.first_text_logits is not None
                and b.first_text_logits is not None
                and np.shape(a.first_text_logits) == np.shape(b.first_text_logits)
            ):
                path_rows.append(
                    compare_frames(
                        E2E,
                        c,
                        "first audio frame: text logits",
                        a.first_text_logits[None],
                        b.first_text_logits[None],
                        "cross_logits_rel",
                        relative_to_scale=True,
                    )
                )
            else:
                path_rows.append(
                    not_available(
                        E2E,
                        c,
                        "first audio frame: text logits",
                        "full first-frame logits from both backends are needed",
                    )
                )
        logits = ra if ra.text_logits is not None else rb
        first = _first_frame_rows(E2E, c, ra, rb, logits=logits)
        path_rows.extend(first)
        path_rows.append(compare_ids(E2E, c, "text ids per frame", ra.text_ids, rb.text_ids, logits=logits.text_logits))
        path_rows.append(
            compare_ids(
                E2E, c, "function ids per frame", ra.function_ids, rb.function_ids, logits=logits.function_logits
            )
        )
        frames = _logits_rows(path_rows, c, ra, rb)
        if per_frame is not None and frames is not None:
            per_frame[path] = frames
        frame0 = path == "offline" and _frame0_difference(a, b, system_prompt, a_backend)
        codes_row = compare_codes(E2E, c, "codes per frame", ra.codes, rb.codes, skip_frames=(0,) if frame0 else ())
        path_rows.append(codes_row)
        if ra.decoded_codes is not None and rb.decoded_codes is not None:
            # What each implementation reports and decodes (control codes replaced).
            path_rows.append(
                compare_codes(
                    E2E,
                    c,
                    "decoded codes per frame",
                    ra.decoded_codes,
                    rb.decoded_codes,
                    skip_frames=(0,) if frame0 else (),
                )
            )
        path_rows.append(compare_text(E2E, c, "assistant text", ra.text, rb.text))
        path_rows.append(compare_text(E2E, c, "user transcript", ra.transcript, rb.transcript))
        path_rows.append(
            compare_value(
                E2E,
                c,
                "audio length (frames x spf)",
                int(len(ra.audio)),
                int(len(rb.audio)),
                first_failing_frame=min(len(ra.text_ids), len(rb.text_ids)),
            )
        )
        mis = _first_code_mismatch(
            np.asarray(ra.codes)[1:] if frame0 else ra.codes, np.asarray(rb.codes)[1:] if frame0 else rb.codes
        )
        mis = None if mis is None else mis + (1 if frame0 else 0)
        n_common = min(len(ra.text_ids), len(rb.text_ids))
        end = (n_common if mis is None else mis) * spf - (lead if mis is not None else 0)
        audio_row = compare_aligned_audio(
            E2E,
            c,
            "audio samples",
            ra.audio,
            rb.audio,
            delay=0,
            skip=0,
            samples_per_frame=spf,
            tol_name=_cross_audio_tol(a_backend, ra.audio, rb.audio),
            end=max(end, 0),
            note=f"up to the first code mismatch (frame {mis})" if mis is not None else "",
        )
        path_rows.append(audio_row)
        if path == "offline" and frame0:
            frame0_rows = (path_rows, first[2], audio_row, codes_row, rb)
        if path == "streamed":
            _apply_codec_tail(path_rows, c, cast(StreamRun, ra), cast(StreamRun, rb), lead)
        rows.extend(path_rows)

    # Order matters: a later frame's code difference explained by the norm rounding must be settled
    # before the frame-0 entry (which needs every later frame equal or explained) is judged.
    _apply_xscaling(rows, a_backend)
    _apply_mlx_audio(
        rows,
        a,
        b,
        a_backend,
        b_backend,
        system_prompt=system_prompt,
        audio=audio,
        seed=seed,
        chunk_samples=chunk_samples,
    )
    _apply_norm_precision(
        rows, a, b, a_backend, system_prompt=system_prompt, audio=audio, seed=seed, chunk_samples=chunk_samples
    )
    _apply_reference_stream_logits(rows, a, b, system_prompt=system_prompt)
    if frame0_rows is not None:
        path_rows, first_codes, audio_row, codes_row, rb = frame0_rows
        at = rows.index(audio_row) + 1
        extra: list[FamilyResult] = []
        _apply_frame0(extra, first_codes, audio_row, codes_row, a_backend, cast(OfflineRun, rb))
        rows[at:at] = extra
    frame0_audio = None
    if frame0_rows is not None:
        first_codes_row, audio_row = frame0_rows[1], frame0_rows[2]
        frame0_audio = (audio_row, first_codes_row.status == DOCUMENTED)
    _apply_codec_precision(rows, a_backend, b_backend, b, frame0_audio)
    return rows


_AUDIO_METRICS = (
    "audio samples",
    "audio samples with the reference's rounding",
    "our decode of their codes vs their audio",
)


def _apply_codec_precision(rows: list[FamilyResult], a_backend, b_backend, b: Runs, frame0_audio=None) -> None:
    """Audio rows that fail because the reference's codec computes in bf16.

    Verified, not assumed: the reference's own decoder run with a float32 latent
    must reproduce our decode of the same codes within audio_abs, while its
    default (bf16) decode must not.
    """
    failing = [r for r in rows if r.family == E2E and r.metric in _AUDIO_METRICS and r.status == FAIL]
    if not failing:
        return
    dec_a, dec_b = getattr(a_backend, "decode_codes", None), getattr(b_backend, "decode_codes", None)
    run = b.offline if b.offline is not None else b.stream
    if not callable(dec_a) or not callable(dec_b) or run is None or len(run.codes) == 0:
        return
    codes = np.asarray(run.codes)
    try:
        theirs_f32 = dec_b(codes, float32_latent=True)
    except TypeError:  # a backend without that switch cannot verify the entry
        return
    spf = int(a_backend.samples_per_frame)
    ours = dec_a(codes)
    tol = _cross_audio_tol(a_backend, ours, theirs_f32)
    same_f32 = compare_aligned_audio(
        E2E,
        "verification",
        "ours vs theirs(float32 latent)",
        ours,
        theirs_f32,
        delay=0,
        skip=0,
        samples_per_frame=spf,
        tol_name=tol,
    )
    differ_bf16 = compare_aligned_audio(
        E2E,
        "verification",
        "ours vs theirs(default)",
        ours,
        dec_b(codes),
        delay=0,
        skip=0,
        samples_per_frame=spf,
        tol_name=tol,
    )
    if same_f32.status != PASS or differ_bf16.status != FAIL:
        return
    why = (
        f"the reference's decoder with a float32 latent reproduces our decode of the same codes "
        f"(max abs {same_f32.observed:.2e}); its default bf16 decode differs by {differ_bf16.observed:.2e}"
    )
    for r in failing:
        if frame0_audio is not None and r is frame0_audio[0]:
            # This window also holds frame 0, whose codes differ by the frame-0 entry: both must hold.
            if frame0_audio[1]:
                _documented(
                    r,
                    "frame0_codes_no_prompt",
                    "frame 0's codes differ as documented and the rest of the "
                    "difference is the reference's bf16 codec: " + why,
                )
            continue
        # Every other audio row compares only frames whose codes are equal (it stops at the first code
        # mismatch), so the codec's precision is the only remaining cause.
        _documented(r, "reference_codec_bf16", why)


def _logits_rows(path_rows: list[FamilyResult], comparison: str, ra, rb) -> list[dict] | None:
    """Per-frame logits of A against B (Nemotron-H rows), and the near-tie rule on the id rows."""
    have = all(x is not None for x in (ra.text_logits, rb.text_logits, ra.function_logits, rb.function_logits))
    if not have or np.shape(ra.text_logits)[-1] != np.shape(rb.text_logits)[-1]:
        for ch in ("text", "function"):
            path_rows.append(
                not_available(
                    NEMOTRON,
                    comparison,
                    f"{ch} logits per frame (max abs)",
                    "full per-frame logits from both backends are needed",
                )
            )
        return None
    frames = logits_per_frame(
        ra.text_logits,
        rb.text_logits,
        ra.function_logits,
        rb.function_logits,
        (ra.text_ids, ra.function_ids),
        (rb.text_ids, rb.function_ids),
    )
    logit_rows = [compare_logits_per_frame(NEMOTRON, comparison, ch, frames) for ch in ("text", "function")]
    path_rows.extend(logit_rows)
    # A differing id is a near-tie flip only if, at the first differing frame, the reference's gap of
    # that channel is below our measured error there and all earlier logits are within tolerance.
    first = next((f for f in frames if not (f["text_id_equal"] and f["function_id_equal"])), None)
    if first is None or any(
        r.status == FAIL and r.first_failing_frame is not None and r.first_failing_frame < first["frame"]
        for r in logit_rows
    ):
        return frames
    for ch, metric in (("text", "text ids per frame"), ("function", "function ids per frame")):
        row = next((r for r in path_rows if r.metric == metric and r.comparison == comparison), None)
        if row is None or row.status != FAIL or row.first_failing_frame != first["frame"]:
            continue
        gap, err = first[f"{ch}_gap_ref"], first[f"{ch}_abs"]
        if gap is not None and gap < err:
            _documented(
                row,
                "near_tie_flip",
                f"frame {first['frame']}: the reference's top-2 gap {gap:.3g} is below "
                f"our logits difference {err:.3g} there",
            )
        else:
            row.note = "; ".join(
                p
                for p in (
                    row.note,
                    f"frame {first['frame']}: reference gap {gap} >= our logits difference {err:.3g}: not a near tie",
                )
                if p
            )
    return frames


def _frame0_difference(a: Runs, b: Runs, system_prompt, a_backend) -> bool:
    """The reference's no-prompt offline frame 0 is an all-zero row (§12.2 item 7, a bug of its own) and
    ours is the streamed silence row, under every numerics setting."""
    if system_prompt and system_prompt.strip():
        return False
    ca, cb = np.asarray(a.offline.codes), np.asarray(b.offline.codes)
    if ca.shape[0] == 0 or cb.shape[0] == 0 or a.stream is None or len(a.stream.codes) == 0:
        return False
    return bool(
        (cb[0] == 0).all() and np.array_equal(ca[0], np.asarray(a.stream.codes)[0]) and not np.array_equal(ca[0], cb[0])
    )


def _apply_frame0(rows, first_codes_row, audio_row, codes_row, a_backend, rb: OfflineRun) -> None:
    diff = DIFFERENCES["frame0_codes_no_prompt"]
    if codes_row.status in (PASS, DOCUMENTED):
        codes_row.note = "; ".join(p for p in (codes_row.note, f"frame 0 excluded: {diff.id}") if p)
        if first_codes_row.status == FAIL:
            _documented(
                first_codes_row,
                diff.id,
                "their frame 0 is all zeros, ours is the streamed silence row, all later frames are equal",
            )
    decode = getattr(a_backend, "decode_codes", None)
    if not callable(decode):
        rows.append(
            not_available(
                E2E,
                audio_row.comparison,
                "our decode of their codes vs their audio",
                "the primary backend has no offline decode",
            )
        )
        return
    ours = decode(np.asarray(rb.codes))
    check = compare_aligned_audio(
        E2E,
        audio_row.comparison,
        "our decode of their codes vs their audio",
        ours,
        rb.audio,
        delay=0,
        skip=0,
        samples_per_frame=int(a_backend.samples_per_frame),
        tol_name=_cross_audio_tol(a_backend, ours, rb.audio),
    )
    rows.append(check)
    if audio_row.status == FAIL and check.status == PASS and first_codes_row.status == DOCUMENTED:
        _documented(
            audio_row,
            diff.id,
            "the audio difference comes from the frame-0 codes alone: our codec "
            "decodes their codes to their audio within audio_abs",
        )


def _apply_codec_tail(rows, comparison, ra: StreamRun, rb: StreamRun, lead: int) -> None:
    row_len = compare_value(E2E, comparison, "tail length", int(len(ra.tail)), int(len(rb.tail)))
    row_total = compare_value(
        E2E,
        comparison,
        "total streamed length (audio + tail)",
        int(len(ra.audio) + len(ra.tail)),
        int(len(rb.audio) + len(rb.tail)),
    )
    if len(rb.tail) == 0 and len(ra.tail) == lead and len(ra.audio) == len(rb.audio):
        for r in (row_len, row_total):
            if r.status == FAIL:
                _documented(
                    r,
                    "codec_tail",
                    f"their tail is empty, ours has lead_in = {lead} samples, the audio events have equal lengths",
                )
    rows.extend([row_len, row_total])


def _apply_mlx_audio(
    rows, a: Runs, b: Runs, a_backend, b_backend, *, system_prompt, audio, seed, chunk_samples
) -> None:
    """Rows of a pair with mlx-audio that fail by its known departures (harness.differences:
    mlx_audio_tts_departures, mlx_audio_text_strip), verified by re-running mlx-audio with the departures
    undone (codes) or by the stripped text (offline agent text)."""
    if "mlx-audio" not in (a_backend.name, b_backend.name):
        return
    ma, other_runs, ma_runs = (a_backend, b, a) if a_backend.name == "mlx-audio" else (b_backend, a, b)
    code_metrics = ("codes per frame", "decoded codes per frame", "first audio frame: codes")
    cache: dict[str, OfflineRun | StreamRun] = {}
    for r in rows:
        if r.status != FAIL:
            continue
        path = "offline" if r.comparison.startswith("offline:") else "streamed"
        theirs = other_runs.offline if path == "offline" else other_runs.stream
        mine = ma_runs.offline if path == "offline" else ma_runs.stream
        if r.family == E2E and r.metric == "assistant text" and path == "offline":
            ids_ok = np.array_equal(np.asarray(mine.text_ids), np.asarray(theirs.text_ids))
            if ids_ok and mine.text == theirs.text.strip() and theirs.text != mine.text:
                _documented(r, "mlx_audio_text_strip", "equal text ids; mlx-audio's text is the other's stripped")
            continue
        if not (r.family == E2E and r.metric in code_metrics):
            continue
        from .backends.mlx_audio_backend import departures_undone

        if path not in cache:
            with departures_undone(ma):
                cache[path] = (
                    ma.offline(audio, system_prompt=system_prompt, seed=seed)
                    if path == "offline"
                    else ma.stream(audio, system_prompt=system_prompt, seed=seed, chunk_samples=chunk_samples)
                )
        redo = cache[path]
        decoded = r.metric == "decoded codes per frame"
        x = np.asarray(redo.decoded_codes if decoded else redo.codes)
        y = np.asarray(theirs.decoded_codes if decoded else theirs.codes)
        skip = 1 if (path == "offline" and _frame0_difference(a, b, system_prompt, a_backend)) else 0
        if r.metric == "first audio frame: codes":
            if skip:
                continue  # frame 0 is the frame0_codes_no_prompt entry's
            x, y = x[:1], y[:1]
        else:
            x, y = x[skip:], y[skip:]
        if x.shape == y.shape and np.array_equal(x, y):
            _documented(
                r,
                "mlx_audio_tts_departures",
                f"with its departures undone mlx-audio's {path} codes equal "
                "the other's on every frame" + (" after frame 0" if skip else ""),
            )
        else:
            k = _first_code_mismatch(x, y)
            r.note = "; ".join(
                p
                for p in (
                    r.note,
                    (
                        "with mlx-audio's departures undone the codes still differ at "
                        f"frame {None if k is None else k + skip}"
                    ),
                )
                if p
            )


def _apply_xscaling(rows: list[FamilyResult], a_backend) -> None:
    if not getattr(a_backend, "encoder_xscaling", False):
        return
    offline_ok = all(r.status != FAIL for r in rows if r.comparison.startswith("offline:"))
    if not offline_ok:
        return
    for r in rows:
        if r.comparison.startswith("streamed:") and r.status == FAIL:
            _documented(
                r,
                "xscaling_streaming",
                "the checkpoint has encoder.xscaling true and every offline row between the implementations passes",
            )


def _reference_cannot_run(against) -> list[str]:
    """Modules of the loaded checkpoint that the reference backend is known not to run ([] if none)."""
    check = getattr(against, "unrunnable_modules", None)
    return [str(m) for m in cast("list[str]", check())] if callable(check) else []


def _cross_audio_tol(a_backend, *signals):
    """The audio tolerance of a row between two implementations: derived from our codec's geometry
    and the signals' peak (`codec_cross_tolerance`); audio_abs where the backend exposes no model."""
    cfg = getattr(getattr(getattr(a_backend, "model", None), "config", None), "codec_config", None)
    peaks = [float(np.abs(np.asarray(x)).max()) for x in signals if x is not None and np.size(x)]
    if cfg is None or not peaks:
        return "audio_abs"
    return codec_cross_tolerance(cfg, max(peaks))


def _max_abs_common(x, y) -> float | None:
    """max |x - y| over the frames both have (frame t of a stream is frame t offline), or None."""
    if x is None or y is None:
        return None
    x, y = np.asarray(x, dtype=np.float32), np.asarray(y, dtype=np.float32)
    n = min(len(x), len(y))
    if n == 0 or x.shape[1:] != y.shape[1:]:
        return None
    return float(np.abs(x[:n] - y[:n]).max())


def _apply_reference_stream_logits(rows, a: Runs, b: Runs, *, system_prompt) -> None:
    """Streamed logits rows that fail because the reference's streamed prompt prefill disagrees with
    its own offline pass: verified when a prompt was prefilled, our streamed logits are within the
    row's tolerance of the reference's offline logits, and the reference's streamed logits are not,
    already at frame 0 (so the two paths of the reference parted before the first audio frame, in
    the prefill; a drift that starts later stays a failure)."""
    if not (system_prompt and system_prompt.strip()) or a.stream is None or b.stream is None or b.offline is None:
        return
    for r in rows:
        if not (
            r.family == NEMOTRON
            and r.status == FAIL
            and r.comparison.startswith("streamed:")
            and r.metric in ("text logits per frame (max abs)", "function logits per frame (max abs)")
        ):
            continue
        ch = "text_logits" if r.metric.startswith("text") else "function_logits"
        ours = _max_abs_common(getattr(a.stream, ch), getattr(b.offline, ch))
        theirs = _max_abs_common(getattr(b.stream, ch), getattr(b.offline, ch))
        theirs0 = _max_abs_common(getattr(b.stream, ch)[:1], getattr(b.offline, ch)[:1]) if theirs else None
        tol = r.tolerance if isinstance(r.tolerance, (int, float)) else None
        if ours is None or theirs0 is None or tol is None or not (ours <= tol < theirs0):
            continue
        _documented(
            r,
            "reference_stream_logits",
            f"our streamed logits are within {ours:.2e} of the reference's offline logits; the "
            f"reference's streamed logits differ from its own offline logits by {theirs:.2e}",
        )


def _apply_norm_precision(rows, a: Runs, b: Runs, a_backend, *, system_prompt, audio, seed, chunk_samples) -> None:
    """Code rows that fail while the ids agree, on a numerics="float32" run: re-run ours with
    numerics="reference" (a second load of the checkpoint). On the default numerics a code
    mismatch stays a failure."""
    code_metrics = ("codes per frame", "decoded codes per frame", "first audio frame: codes")
    logit_metrics = ("text logits per frame (max abs)", "function logits per frame (max abs)")
    failing = [
        r
        for r in rows
        if r.status == FAIL
        and ((r.family == E2E and r.metric in code_metrics) or (r.family == NEMOTRON and r.metric in logit_metrics))
    ]
    if not failing or getattr(a_backend, "numerics", None) != "float32" or not getattr(a_backend, "checkpoint", None):
        return
    rerun = copy.copy(a_backend)
    rerun.numerics = "reference"
    rerun.load(a_backend.checkpoint)
    cache: dict[str, OfflineRun | StreamRun] = {}
    for r in failing:
        path = "offline" if r.comparison.startswith("offline:") else "streamed"
        if path not in cache:
            cache[path] = (
                rerun.offline(audio, system_prompt=system_prompt, seed=seed, with_logits=True)
                if path == "offline"
                else rerun.stream(
                    audio, system_prompt=system_prompt, seed=seed, chunk_samples=chunk_samples, with_logits=True
                )
            )
        if r.metric in logit_metrics:
            _float32_logits(r, cache[path], b.offline if path == "offline" else b.stream)
            continue
        ids_ok = all(
            x.status != FAIL
            for x in rows
            if x.comparison == r.comparison and x.metric in ("text ids per frame", "function ids per frame")
        )
        if not ids_ok:
            continue
        decoded = r.metric == "decoded codes per frame"
        theirs_run = b.offline if path == "offline" else b.stream
        ours = np.asarray(cache[path].decoded_codes if decoded else cache[path].codes)
        theirs = np.asarray(theirs_run.decoded_codes if decoded else theirs_run.codes)
        skip = 1 if (path == "offline" and _frame0_difference(a, b, system_prompt, a_backend)) else 0
        if r.metric == "first audio frame: codes" and skip:
            continue  # frame 0 is the frame0_codes_no_prompt entry's
        if r.metric == "first audio frame: codes":
            equal = np.array_equal(ours[:1], theirs[:1])
        else:
            equal = ours.shape == theirs.shape and np.array_equal(ours[skip:], theirs[skip:])
        if equal:
            _documented(r, "float32_numerics", "with numerics='reference' our codes equal theirs exactly")
            if r.metric == "codes per frame" and not skip:
                # With the codes equal again, the whole audio can be compared (the regular row stops at the
                # first code difference).
                theirs_run = b.offline if path == "offline" else b.stream
                check = compare_aligned_audio(
                    E2E,
                    r.comparison,
                    "audio samples with the reference's rounding",
                    cache[path].audio,
                    theirs_run.audio,
                    delay=0,
                    skip=0,
                    samples_per_frame=int(a_backend.samples_per_frame),
                    tol_name=_cross_audio_tol(a_backend, cache[path].audio, theirs_run.audio),
                )
                rows.insert(rows.index(r) + 1, check)
        else:
            k = _first_code_mismatch(ours[skip:], theirs[skip:])
            r.note = "; ".join(
                p
                for p in (
                    r.note,
                    f"with the reference's rounding the codes still differ at frame {None if k is None else k + skip}",
                )
                if p
            )


def _float32_logits(row: FamilyResult, ours, theirs) -> None:
    """A logits row of a numerics="float32" run: documented if our numerics="reference" logits are
    within the bound on every compared frame."""
    channel = row.metric.split()[0]
    have = all(
        x is not None for x in (ours.text_logits, theirs.text_logits, ours.function_logits, theirs.function_logits)
    )
    if not have:
        return
    frames = logits_per_frame(
        ours.text_logits,
        theirs.text_logits,
        ours.function_logits,
        theirs.function_logits,
        (ours.text_ids, ours.function_ids),
        (theirs.text_ids, theirs.function_ids),
    )
    check = compare_logits_per_frame(NEMOTRON, row.comparison, channel, frames)
    if check.status == PASS:
        _documented(
            row,
            "float32_numerics",
            f"with numerics='reference' our {channel} logits are within "
            f"cross_logits_abs of theirs on all {check.frames_compared} frames "
            f"(max abs {check.observed:.3g})",
        )
    else:
        row.note = "; ".join(
            p
            for p in (
                row.note,
                f"with numerics='reference' still {check.observed:.3g} at frame {check.first_failing_frame}",
            )
            if p
        )


# --------------------------------------------------------------------------- entry point


def versions() -> dict:
    import mlx.core as mx

    import voicechat

    return {
        "python": platform.python_version(),
        "platform": f"{platform.system()} {platform.machine()}",
        "mlx": getattr(mx, "__version__", "?"),
        "numpy": np.__version__,
        "voicechat": voicechat.__version__,
    }


def run_parity(
    backend: Backend,
    audio,
    *,
    against: Backend | None = None,
    system_prompt: str | None = None,
    seed: int = 0,
    checkpoint: str | None = None,
    input_name: str | None = None,
    chunk_samples: int = 1280,
    components: bool = True,
    runs: Runs | None = None,
) -> ParityReport:
    """Run the parity checks and return a `ParityReport` (not yet written; see `ParityReport.write`).

    `runs` may carry already collected runs of `backend` for this input; the
    report keeps the primary backend's runs as `report.runs` (not serialised),
    e.g. for `dump.dump_reference`.
    """
    t0 = time.perf_counter()
    wave, name = read_input(audio)
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise TypeError(f"seed must be an int, got {type(seed).__name__}")
    if runs is None:
        runs = collect_runs(
            backend, wave, system_prompt=system_prompt, seed=seed, chunk_samples=chunk_samples, components=components
        )
    rows = self_rows(runs, backend, wave.size)
    per_frame: dict = {}
    mode = "self"
    if against is not None:
        mode = "cross"
        unrunnable = _reference_cannot_run(against)
        if unrunnable:
            # Known and documented: the reference fails on this layout. Its rows cannot be had; they are
            # reported as such (never as a pass), and this project's own rows still decide.
            rows.append(
                not_available(
                    E2E,
                    f"{backend.name} vs {against.name}",
                    "all",
                    f"{against.name} cannot run this checkpoint: "
                    f"{', '.join(unrunnable)} stored quantized (docs/voicechat.md, "
                    "'Quantization layouts'); compare on the same layout with those left dense",
                )
            )
        else:
            b_runs = collect_runs(
                against, wave, system_prompt=system_prompt, seed=seed, chunk_samples=chunk_samples, components=False
            )
            rows += cross_rows(
                runs,
                b_runs,
                backend,
                against,
                system_prompt=system_prompt,
                audio=wave,
                seed=seed,
                chunk_samples=chunk_samples,
                per_frame=per_frame,
            )
    ver = versions()
    ver[f"backend {backend.name}"] = getattr(backend, "version", "?")
    if against is not None:
        ver[f"against {against.name}"] = getattr(against, "version", "?")
    rate = 16000
    header = {
        "title": f"{backend.name} offline vs streamed" + (f"; {backend.name} vs {against.name}" if against else ""),
        "mode": mode,
        "checkpoint": checkpoint or getattr(backend, "checkpoint", None),
        "backend": backend.name,
        "numerics": getattr(backend, "numerics", None),  # this project's EAR-TTS / language-path setting
        "against": against.name if against is not None else None,
        "input": f"{input_name or name} ({wave.size} samples, {wave.size / rate:.2f} s, sha256 {audio_digest(wave)})",
        "input_name": input_name or name,
        "input_samples": int(wave.size),
        "input_sha256": audio_digest(wave),
        "seed": seed,
        "system_prompt": system_prompt or "",
        "chunk_samples": chunk_samples,
        "versions": ver,
        "date": _dt.datetime.now(_dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "elapsed_s": round(time.perf_counter() - t0, 2),
        "command": " ".join(sys.argv) if sys.argv and sys.argv[0].endswith("voicechat") else None,
    }
    report = ParityReport(header=header, rows=rows, per_frame=per_frame)
    report.runs = runs
    return report


def _first_row(rows: list[FamilyResult], statuses) -> FamilyResult | None:
    """The row that differs first: the smallest first failing frame, then the report order (perception
    families before the language path before the end-to-end rows)."""
    cands = [r for r in rows if r.status in statuses]
    if not cands:
        return None
    order = {f: i for i, f in enumerate((MEL, CONFORMER, RNNT, NEMOTRON, EAR_TTS, CODEC, E2E))}
    return min(
        cands,
        key=lambda r: (
            r.first_failing_frame if r.first_failing_frame is not None else 10**9,
            order.get(r.family, 99),
            rows.index(r),
        ),
    )


def _row_ref(r: FamilyResult | None) -> dict | None:
    if r is None:
        return None
    return {
        "family": r.family,
        "comparison": r.comparison,
        "field": r.metric,
        "frame": r.first_failing_frame,
        "observed": r.observed,
        "status": r.status,
        "difference_id": r.difference_id,
    }


def matrix_summary(names: list[str], rows: list[FamilyResult]) -> dict:
    """Per pair: agreement and its first differing family / frame / field (failing, then documented);
    per field with three or more implementations: the odd one out where the others agree."""
    pairs = {}
    for i, x in enumerate(names):
        for y in names[i + 1 :]:
            tag = f"{x} vs {y}"
            pr = [r for r in rows if r.comparison.endswith(": " + tag)]
            pairs[tag] = {
                "ok": not any(r.status == FAIL for r in pr),
                "rows": len(pr),
                "fail": sum(r.status == FAIL for r in pr),
                "documented": sum(r.status == DOCUMENTED for r in pr),
                "first_failure": _row_ref(_first_row(pr, (FAIL,))),
                "first_documented": _row_ref(_first_row(pr, (DOCUMENTED,))),
            }
    odd = []
    if len(names) >= 3:
        fields = sorted(
            {
                (r.comparison.split(":")[0], r.family, r.metric)
                for r in rows
                if ": " in r.comparison and " vs " in r.comparison
            }
        )
        for path, family, metric in fields:
            status = {}
            for i, x in enumerate(names):
                for y in names[i + 1 :]:
                    found = [
                        r
                        for r in rows
                        if r.comparison == f"{path}: {x} vs {y}" and r.family == family and r.metric == metric
                    ]
                    if found:
                        status[(x, y)] = found[0].status
            agree = {k for k, v in status.items() if v == PASS}
            differ = {k for k, v in status.items() if v in (FAIL, DOCUMENTED)}
            for z in names:
                others = [n for n in names if n != z]
                with_z = {k for k in status if z in k}
                between_others = {k for k in status if z not in k}
                if (
                    with_z
                    and between_others
                    and with_z <= differ
                    and between_others <= agree
                    and len(with_z) == len(others)
                ):
                    odd.append(
                        {
                            "path": path,
                            "family": family,
                            "field": metric,
                            "odd_one_out": z,
                            "agreeing": others,
                            "documented": all(status[k] == DOCUMENTED for k in with_z),
                        }
                    )
    return {"implementations": names, "pairs": pairs, "odd_one_out": odd}


def run_matrix(
    backends: list[Backend],
    audio,
    *,
    system_prompt: str | None = None,
    seed: int = 0,
    checkpoint: str | None = None,
    input_name: str | None = None,
    chunk_samples: int = 1280,
    components: bool = True,
) -> ParityReport:
    """Every pair of `backends` (the first is the primary: its self rows are included) in one report,
    with `report.matrix` = `matrix_summary`. The report is ok only when every pair agrees within the
    stated tolerances (documented differences applied as in `run_parity`)."""
    if len(backends) < 2:
        raise ValueError("run_matrix needs at least two backends")
    names = [b.name for b in backends]
    if len(set(names)) != len(names):
        raise ValueError(f"each implementation once: {names}")
    t0 = time.perf_counter()
    wave, name = read_input(audio)
    # A peer that cannot run this checkpoint (modules it only runs dense stored quantized) is not
    # run at all: its pairs are "not available" below, naming the modules.
    all_runs = [
        None
        if i > 0 and _reference_cannot_run(b)
        else collect_runs(
            b,
            wave,
            system_prompt=system_prompt,
            seed=seed,
            chunk_samples=chunk_samples,
            components=components and i == 0,
        )
        for i, b in enumerate(backends)
    ]
    first = all_runs[0]
    assert first is not None  # the implementation under test always runs
    rows = self_rows(first, backends[0], wave.size)
    per_frame: dict = {}
    for i in range(len(backends)):
        for j in range(i + 1, len(backends)):
            a, b = backends[i], backends[j]
            unrunnable = _reference_cannot_run(b) or _reference_cannot_run(a)
            if unrunnable:
                rows.append(
                    not_available(
                        E2E,
                        f"offline: {a.name} vs {b.name}",
                        "all",
                        f"cannot run this checkpoint: {', '.join(unrunnable)} stored quantized",
                    )
                )
                continue
            pf: dict = {}
            ra, rb = all_runs[i], all_runs[j]
            assert ra is not None and rb is not None  # both ran: neither is unrunnable
            rows += cross_rows(
                ra,
                rb,
                a,
                b,
                system_prompt=system_prompt,
                audio=wave,
                seed=seed,
                chunk_samples=chunk_samples,
                per_frame=pf,
            )
            for path, frames in pf.items():
                per_frame[f"{path}: {a.name} vs {b.name}"] = frames
    ver = versions()
    for b in backends:
        ver[f"backend {b.name}"] = getattr(b, "version", "?")
    header = {
        "title": f"{backends[0].name} offline vs streamed; matrix " + ", ".join(names),
        "mode": "matrix",
        "checkpoint": checkpoint or getattr(backends[0], "checkpoint", None),
        "backend": backends[0].name,
        "numerics": getattr(backends[0], "numerics", None),
        "against": "+".join(names[1:]),
        "input": f"{input_name or name} ({wave.size} samples, {wave.size / 16000:.2f} s, sha256 {audio_digest(wave)})",
        "input_name": input_name or name,
        "input_samples": int(wave.size),
        "input_sha256": audio_digest(wave),
        "seed": seed,
        "system_prompt": system_prompt or "",
        "chunk_samples": chunk_samples,
        "versions": ver,
        "date": _dt.datetime.now(_dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "elapsed_s": round(time.perf_counter() - t0, 2),
        "command": " ".join(sys.argv) if sys.argv and sys.argv[0].endswith("voicechat") else None,
    }
    for b in backends:
        lr = getattr(b, "load_report", None)
        if lr:
            header[f"load {b.name}"] = {
                "let through by its strict=False loader": [
                    f"{d['tensor']} ({d['problem']}: model {d.get('expected')}, checkpoint {d.get('checkpoint')})"
                    for d in lr.get("let_through_by_strict_false", [])
                ]
            }
    report = ParityReport(header=header, rows=rows, per_frame=per_frame)
    report.matrix = matrix_summary(names, rows)
    report.runs = first
    return report


__all__ = [
    "Runs",
    "collect_runs",
    "self_rows",
    "cross_rows",
    "run_parity",
    "run_matrix",
    "matrix_summary",
    "read_input",
    "audio_digest",
    "versions",
    "OFFLINE_VS_STREAMED",
    "CACHED_VS_RECOMPUTE",
    "STEP_VS_DECODE",
]
