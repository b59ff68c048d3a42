"""Per-family comparisons of the parity harness: named tolerances and the diff primitives.

Every check produces one `FamilyResult` row: which cache family, which
comparison (offline vs streamed, cached vs recompute, backend A vs B), which
metric, the observed value, the named tolerance with its one-line
justification, pass / fail, the first failing frame (in the metric's own unit:
mel frames for the log-mel, samples are mapped to output frames, timeline
positions are mapped to audio frames with system-prompt positions negative),
and a margin:

* continuous metrics: ``headroom`` = tolerance / observed (how far below the
  bound the run stayed; ``inf`` when bit-identical);
* argmax decisions: ``logit gap`` = top-1 minus top-2 logit at the first
  mismatch (a flip on a near-tie shows a gap of ~1e-6, a real bug a large one);
  when everything matches, the smallest gap over all frames (how close the run
  came to a flip).

A family a backend cannot provide is reported "not available", never "pass".
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field

import numpy as np

PASS = "pass"
FAIL = "fail"
NOT_AVAILABLE = "not available"
DOCUMENTED = "documented difference"
STATUSES = (PASS, FAIL, NOT_AVAILABLE, DOCUMENTED)

# Family names, in report order.
MEL = "log-mel"
CONFORMER = "FastConformer"
RNNT = "RNNT"
NEMOTRON = "Nemotron-H"
EAR_TTS = "EAR-TTS"
CODEC = "codec"
E2E = "end-to-end"
SERVER = "server"  # protocol level: two realtime servers driven by the same client (harness/server_parity.py)
FAMILIES = (MEL, CONFORMER, RNNT, NEMOTRON, EAR_TTS, CODEC, E2E)
# Families of reports that compare something else than a backend's runs (not in every report).
ALL_FAMILIES = FAMILIES + (SERVER,)


@dataclass(frozen=True)
class Tolerance:
    name: str
    value: float | int | str
    justification: str


# One table of tolerances. Values were chosen ~100x above what float32 rounding
# gives on the tiny and small presets (measured values in docs/parity.md) and
# well below what a real bug moves (> 1e-2).
TOLERANCES: dict[str, Tolerance] = {
    t.name: t
    for t in (
        Tolerance(
            "mel_abs",
            1e-4,
            "same framing code on the same samples; only FFT/matmul row blocking differs, and the "
            "streamed first frame is built as the reference's streaming frontend builds it "
            "(~1e-6 on log values of magnitude ~20)",
        ),
        Tolerance(
            "encoder_abs",
            1e-3,
            "one query row vs a masked T x T score matrix: reduction order differs by a few ulp "
            "per op over the layers on O(1) activations (measured ~1e-6 tiny)",
        ),
        Tolerance(
            "logits_rel",
            1e-4,
            "single-step recurrence vs chunked SSD scan: same recurrence, different summation order; "
            "bound is relative to max(1, max |logit|)",
        ),
        Tolerance(
            "tts_hidden_abs",
            1e-4,
            "cached K/V ring vs full causal recompute: attention reductions reorder; RMS-normed O(1) "
            "hidden (measured ~1.5e-6 tiny)",
        ),
        Tolerance(
            "codec_abs",
            1e-5,
            "decode_step vs one decode: same convs on cached vs zero-padded history, float32 "
            "iSTFT overlap-add; samples of RMS ~0.1 (warm-up samples excluded)",
        ),
        Tolerance(
            "audio_abs", 1e-5, "same codes through the streaming and the offline codec path (api.md: within 1e-5)"
        ),
        Tolerance(
            "cross_audio_abs",
            "8 * sqrt(n) * L * 2^-24 * peak",
            "two codec implementations on the same codes: float32 reductions in another order; n the "
            "codec decoder's longest reduction, L its layers, peak the signals' max |sample| "
            "(harness.families.codec_cross_tolerance; each row states its value)",
        ),
        Tolerance(
            "cross_mel_abs",
            2e-4,
            "two implementations of the same float32 filterbank recipe (docs/model.md §4.1: ~2e-4 "
            "without the exact float32 mel-point recipe)",
        ),
        Tolerance(
            "cross_encoder_abs",
            1e-3,
            "two implementations, same math; reduction order and mel rounding propagate through the "
            "conformer (reference check: ~3e-6 encoder from a 2e-4 mel difference)",
        ),
        Tolerance(
            "cross_logits_rel",
            1e-3,
            "two implementations of the first-frame LLM pass (quantized matmul kernels, summation "
            "order), relative to max(1, max |logit|)",
        ),
        Tolerance(
            "cross_logits_abs",
            1e-5,
            "text / function logits of every frame against the reference (issue 15): both run the "
            "same operations in the same order on the same inputs (measured 0, bit-identical, at "
            "real depth over 105 frames); 1e-5 is ~40 ulp of float32 at logits of order 4",
        ),
        Tolerance("exact", 0, "discrete decisions (ids, codes, tokens, strings, lengths) must be identical"),
    )
}


# A mismatched argmax whose top-1 / top-2 gap is below NEAR_TIE_FACTOR x logits_rel x max(1, max|logit|)
# is labelled a near tie (the decision could flip on float rounding alone); the row still fails.
NEAR_TIE_FACTOR = 10.0


@dataclass
class FamilyResult:
    family: str
    comparison: str
    metric: str
    status: str
    observed: float | int | str | None = None
    tolerance: float | int | str | None = None
    tolerance_name: str | None = None
    justification: str = ""
    first_failing_frame: int | None = None
    frame_unit: str = "frame"
    margin: float | None = None
    margin_kind: str | None = None
    frames_compared: int | None = None
    note: str = ""
    difference_id: str | None = None

    def __post_init__(self):
        if self.status not in STATUSES:
            raise ValueError(f"FamilyResult.status must be one of {STATUSES}, got {self.status!r}")
        if self.family not in ALL_FAMILIES:
            raise ValueError(f"FamilyResult.family must be one of {ALL_FAMILIES}, got {self.family!r}")

    @property
    def failed(self) -> bool:
        return self.status == FAIL

    def as_dict(self) -> dict:
        return {k: _jsonable(v) for k, v in asdict(self).items()}

    @classmethod
    def from_dict(cls, d: dict) -> FamilyResult:
        d = dict(d)
        for k in ("observed", "tolerance", "margin"):
            if d.get(k) in ("inf", "-inf", "nan"):
                d[k] = float(d[k])
        return cls(**d)


def _jsonable(v):
    if isinstance(v, (np.integer,)):
        return int(v)
    if isinstance(v, (np.floating, float)):
        v = float(v)
        if math.isinf(v) or math.isnan(v):
            return str(v)
        return v
    return v


def _tol(name) -> Tolerance:
    return name if isinstance(name, Tolerance) else TOLERANCES[name]


FLOAT32_UNIT_ROUNDOFF = 2.0**-24


def codec_cross_tolerance(codec_cfg, peak: float) -> Tolerance:
    """Audio tolerance between two implementations of the codec on the same codes.

    Each output sample is the end of a chain of float32 reductions whose order differs between
    implementations. A reduction of n terms rounds to about sqrt(n) * u relative to the magnitude
    it carries (u = 2^-24; random-walk rounding); the chain has L such layers, which add linearly in
    the worst case. n is the longest reduction: a decoder conv over the widest stage (channels x
    kernel); L the decoder's layers (blocks of every stage, the stages' up-samplings, the input
    projection, the output head, the iSTFT). The bound is 8 * sqrt(n) * L * u * peak, with peak
    the larger of the two signals' max |sample| (at least 1e-3); 8 covers the constant of the
    estimate and the gain of the layers. With a peak of 1: 7.4e-4 at the published geometry
    (n = 10752, L = 15), 3.4e-5 on the tiny preset. The offline-vs-streamed audio of one
    implementation keeps audio_abs (the API's 1e-5): there both paths do the same reductions."""
    width = int(codec_cfg.base_channels) * max(int(m) for m in codec_cfg.channel_multipliers)
    n = width * max(int(codec_cfg.block_kernel_size), 4)
    layers = len(codec_cfg.downsample_rates) * (int(codec_cfg.blocks_per_stage) + 1) + 3
    value = 8.0 * math.sqrt(n) * layers * FLOAT32_UNIT_ROUNDOFF * max(float(peak), 1e-3)
    return Tolerance(
        "cross_audio_abs",
        float(f"{value:.3g}"),
        f"two codec implementations, float32 reductions in another order: 8 * sqrt(n = {n}) * "
        f"(L = {layers}) * 2^-24 * peak {max(float(peak), 1e-3):.3g} (harness.families."
        "codec_cross_tolerance)",
    )


def not_available(family: str, comparison: str, metric: str, why: str) -> FamilyResult:
    return FamilyResult(family, comparison, metric, NOT_AVAILABLE, note=why)


def _headroom(tol: float, observed: float) -> float:
    if observed <= 0:
        return math.inf
    return tol / observed


# --------------------------------------------------------------------------- continuous arrays


def compare_frames(
    family: str,
    comparison: str,
    metric: str,
    a,
    b,
    tol_name: str,
    *,
    frame_unit: str = "frame",
    relative_to_scale: bool = False,
    frame_offset: int = 0,
    note: str = "",
) -> FamilyResult:
    """Frame-major arrays (T, ...) compared over their common frames.

    observed = max abs difference (or max abs / max(1, max |b|) with
    `relative_to_scale`); the first failing frame is the first frame whose own
    difference exceeds the tolerance. The frame counts are reported in the
    note; a frame-count difference is judged by a separate length metric.
    """
    tol = _tol(tol_name)
    if a is None or b is None:
        return not_available(family, comparison, metric, "the backend did not provide these arrays")
    a = np.asarray(a, dtype=np.float64)
    b = np.asarray(b, dtype=np.float64)
    if a.ndim == 1:
        a, b = a[:, None], b[:, None]
    if a.shape[1:] != b.shape[1:]:
        return FamilyResult(
            family,
            comparison,
            metric,
            FAIL,
            observed=f"shape {a.shape} vs {b.shape}",
            tolerance=tol.value,
            tolerance_name=tol.name,
            justification=tol.justification,
            first_failing_frame=frame_offset,
            frame_unit=frame_unit,
            note="per-frame shapes differ",
        )
    n = min(a.shape[0], b.shape[0])
    counts = f"{a.shape[0]} vs {b.shape[0]} {frame_unit}s, {n} compared"
    if n == 0:
        return FamilyResult(
            family,
            comparison,
            metric,
            FAIL,
            observed="no common frames",
            tolerance=tol.value,
            tolerance_name=tol.name,
            justification=tol.justification,
            frame_unit=frame_unit,
            frames_compared=0,
            note=counts,
        )
    diff = np.abs(a[:n] - b[:n]).reshape(n, -1)
    finite = np.isfinite(a[:n]).reshape(n, -1).all(axis=1) & np.isfinite(b[:n]).reshape(n, -1).all(axis=1)
    per_frame = np.where(finite, diff.max(axis=1), np.inf)
    scale = 1.0
    if relative_to_scale:
        scale = max(1.0, float(np.nanmax(np.abs(b[:n]))) if np.isfinite(b[:n]).any() else 1.0)
        per_frame = per_frame / scale
    observed = float(per_frame.max())
    bad = np.nonzero(per_frame > float(tol.value))[0]
    status = FAIL if bad.size else PASS
    rel = float(diff.max() / max(float(np.abs(b[:n]).max()), 1e-30))
    extra = f"{counts}; max rel {rel:.3g}"
    if relative_to_scale:
        extra += f"; scale max(1, max|ref|) = {scale:.4g}"
    return FamilyResult(
        family,
        comparison,
        metric,
        status,
        observed=observed,
        tolerance=tol.value,
        tolerance_name=tol.name,
        justification=tol.justification,
        first_failing_frame=(int(bad[0]) + frame_offset) if bad.size else None,
        frame_unit=frame_unit,
        margin=_headroom(float(tol.value), observed),
        margin_kind="headroom",
        frames_compared=n,
        note=_join(note, extra),
    )


# --------------------------------------------------------------------------- discrete decisions


def logit_gap(logits, frame: int) -> float | None:
    """Top-1 minus top-2 logit at `frame` (logits (T, V); a (T, 2) array of the two largest values works too)."""
    if logits is None:
        return None
    logits = np.asarray(logits)
    if frame >= logits.shape[0] or logits.shape[-1] < 2:
        return None
    row = np.partition(np.asarray(logits[frame], dtype=np.float64), -2)[-2:]
    return float(row[1] - row[0])


def min_logit_gap(logits, frames: int) -> tuple[float | None, int | None]:
    if logits is None:
        return None, None
    logits = np.asarray(logits, dtype=np.float64)
    n = min(frames, logits.shape[0])
    if n == 0 or logits.shape[-1] < 2:
        return None, None
    top2 = np.partition(logits[:n], -2, axis=-1)[:, -2:]
    gaps = top2[:, 1] - top2[:, 0]
    i = int(np.argmin(gaps))
    return float(gaps[i]), i


def compare_ids(
    family: str, comparison: str, metric: str, a, b, *, logits=None, frame_offset: int = 0, note: str = ""
) -> FamilyResult:
    """Per-frame argmax ids over common frames; margin from `logits` (either side's)."""
    tol = _tol("exact")
    if a is None or b is None:
        return not_available(family, comparison, metric, "the backend did not provide these ids")
    a = np.asarray(a).astype(np.int64).reshape(-1)
    b = np.asarray(b).astype(np.int64).reshape(-1)
    n = min(a.size, b.size)
    counts = f"{a.size} vs {b.size} frames, {n} compared"
    mism = np.nonzero(a[:n] != b[:n])[0]
    if mism.size:
        k = int(mism[0])
        gap = logit_gap(logits, k)
        verdict = ""
        if gap is not None and logits is not None:
            # A decision whose top-2 gap is within a few rounding bounds can flip on rounding alone.
            scale = max(1.0, float(np.abs(np.asarray(logits[k], dtype=np.float64)).max()))
            near = gap <= NEAR_TIE_FACTOR * float(TOLERANCES["logits_rel"].value) * scale
            verdict = (
                "near tie: the gap is within rounding reach, likely a flip"
                if near
                else "clear decision: the gap is far beyond rounding, a real difference"
            )
        return FamilyResult(
            family,
            comparison,
            metric,
            FAIL,
            observed=int(mism.size),
            tolerance=0,
            tolerance_name=tol.name,
            justification=tol.justification,
            first_failing_frame=k + frame_offset,
            margin=gap,
            margin_kind="logit gap at first mismatch" if gap is not None else None,
            frames_compared=n,
            note=_join(note, f"{counts}; frame {k + frame_offset}: {int(a[k])} vs {int(b[k])}", verdict),
        )
    gap, at = min_logit_gap(logits, n)
    return FamilyResult(
        family,
        comparison,
        metric,
        PASS if n else FAIL,
        observed=0,
        tolerance=0,
        tolerance_name=tol.name,
        justification=tol.justification,
        margin=gap,
        margin_kind=(f"min logit gap (frame {at + frame_offset})" if gap is not None and at is not None else None),
        frames_compared=n,
        note=_join(note, counts if n else "no common frames"),
    )


def logits_per_frame(ours_text, ref_text, ours_function, ref_function, ours_ids=None, ref_ids=None) -> list[dict]:
    """Per common frame: max abs logits difference (text, function), the reference's top-1 minus
    top-2 gap and whether the emitted ids agree. Frames after the first id difference are marked
    `after_divergence` (they are fed different ids, so their logits are no longer comparable).

    ours_ids / ref_ids: ((text ids), (function ids)) as emitted; None = the argmax of the logits."""
    arrays = [np.asarray(a, dtype=np.float32) for a in (ours_text, ref_text, ours_function, ref_function)]
    n = min(a.shape[0] for a in arrays)
    if ours_ids is None:
        ours_ids = (arrays[0].argmax(-1), arrays[2].argmax(-1))
    if ref_ids is None:
        ref_ids = (arrays[1].argmax(-1), arrays[3].argmax(-1))
    out, diverged = [], False
    for t in range(n):
        row = {"frame": t, "after_divergence": diverged}
        for name, ours, ref, k in (("text", arrays[0], arrays[1], 0), ("function", arrays[2], arrays[3], 1)):
            row[f"{name}_abs"] = float(np.abs(ours[t].astype(np.float64) - ref[t]).max())
            row[f"{name}_gap_ref"] = logit_gap(ref, t)
            a = int(ours_ids[k][t]) if t < len(ours_ids[k]) else None
            b = int(ref_ids[k][t]) if t < len(ref_ids[k]) else None
            row[f"{name}_id_equal"] = a == b
        out.append(row)
        diverged = diverged or not (row["text_id_equal"] and row["function_id_equal"])
    return out


def compare_logits_per_frame(family: str, comparison: str, channel: str, per_frame: list[dict]) -> FamilyResult:
    """Max over the comparable frames (up to and including the first id difference) of one channel's
    per-frame max abs logits difference, against `cross_logits_abs`."""
    tol = _tol("cross_logits_abs")
    metric = f"{channel} logits per frame (max abs)"
    frames = [f for f in per_frame if not f["after_divergence"]]
    if not frames:
        return FamilyResult(
            family,
            comparison,
            metric,
            FAIL,
            observed="no common frames",
            tolerance=tol.value,
            tolerance_name=tol.name,
            justification=tol.justification,
            frames_compared=0,
        )
    errs = np.array([f[f"{channel}_abs"] for f in frames])
    observed = float(errs.max())
    bad = np.nonzero(~(errs <= tol.value))[0]
    note = f"{len(per_frame)} common frames, {len(frames)} compared"
    if len(frames) < len(per_frame):
        note += f" (frames after the first id difference, frame {frames[-1]['frame']}, are fed different ids)"
    return FamilyResult(
        family,
        comparison,
        metric,
        FAIL if bad.size else PASS,
        observed=observed,
        tolerance=tol.value,
        tolerance_name=tol.name,
        justification=tol.justification,
        first_failing_frame=int(frames[bad[0]]["frame"]) if bad.size else None,
        margin=_headroom(float(tol.value), observed),
        margin_kind="headroom",
        frames_compared=len(frames),
        note=note,
    )


def compare_codes(
    family: str,
    comparison: str,
    metric: str,
    a,
    b,
    *,
    frame_offset: int = 0,
    note: str = "",
    skip_frames: tuple[int, ...] = (),
) -> FamilyResult:
    """Per-frame code rows (T, Q) over common frames; observed = number of differing frames."""
    tol = _tol("exact")
    if a is None or b is None:
        return not_available(family, comparison, metric, "the backend did not provide codes")
    a = np.asarray(a).astype(np.int64)
    b = np.asarray(b).astype(np.int64)
    if a.ndim != 2 or b.ndim != 2 or a.shape[1] != b.shape[1]:
        return FamilyResult(
            family,
            comparison,
            metric,
            FAIL,
            observed=f"shape {a.shape} vs {b.shape}",
            tolerance=0,
            tolerance_name=tol.name,
            justification=tol.justification,
            first_failing_frame=frame_offset,
            note=_join(note, "code shapes differ"),
        )
    n = min(a.shape[0], b.shape[0])
    rows = a[:n] != b[:n]
    frame_bad = rows.any(axis=1)
    for f in skip_frames:
        if 0 <= f < n:
            frame_bad[f] = False
    bad = np.nonzero(frame_bad)[0]
    counts = f"{a.shape[0]} vs {b.shape[0]} frames, {n} compared"
    if skip_frames:
        counts += f"; frames {list(skip_frames)} excluded"
    if bad.size:
        k = int(bad[0])
        books = np.nonzero(rows[k])[0].tolist()
        return FamilyResult(
            family,
            comparison,
            metric,
            FAIL,
            observed=int(bad.size),
            tolerance=0,
            tolerance_name=tol.name,
            justification=tol.justification,
            first_failing_frame=k + frame_offset,
            frames_compared=n,
            note=_join(
                note,
                f"{counts}; frame {k + frame_offset} differs in codebooks {books[:8]}{'...' if len(books) > 8 else ''}",
            ),
        )
    return FamilyResult(
        family,
        comparison,
        metric,
        PASS if n else FAIL,
        observed=0,
        tolerance=0,
        tolerance_name=tol.name,
        justification=tol.justification,
        frames_compared=n,
        note=_join(note, counts if n else "no common frames"),
    )


def compare_token_frames(family: str, comparison: str, metric: str, a, b, *, note: str = "") -> FamilyResult:
    """Per-frame token lists (list of lists) over common frames."""
    tol = _tol("exact")
    if a is None or b is None:
        return not_available(family, comparison, metric, "the backend did not provide per-frame tokens")
    n = min(len(a), len(b))
    counts = f"{len(a)} vs {len(b)} frames, {n} compared"
    for k in range(n):
        if list(a[k]) != list(b[k]):
            diff = sum(1 for i in range(n) if list(a[i]) != list(b[i]))
            return FamilyResult(
                family,
                comparison,
                metric,
                FAIL,
                observed=diff,
                tolerance=0,
                tolerance_name=tol.name,
                justification=tol.justification,
                first_failing_frame=k,
                frames_compared=n,
                note=_join(note, f"{counts}; frame {k}: {list(a[k])} vs {list(b[k])}"),
            )
    return FamilyResult(
        family,
        comparison,
        metric,
        PASS,
        observed=0,
        tolerance=0,
        tolerance_name=tol.name,
        justification=tol.justification,
        frames_compared=n,
        note=_join(note, counts),
    )


def compare_token_lists(
    family: str, comparison: str, metric: str, a, b, *, prefix_ok: bool = False, note: str = ""
) -> FamilyResult:
    """Flat token lists; the first differing index is reported in tokens. With `prefix_ok`, `a` may be a
    prefix of `b` (b decoded more frames)."""
    tol = _tol("exact")
    if a is None or b is None:
        return not_available(family, comparison, metric, "the backend did not provide tokens")
    a, b = [int(t) for t in a], [int(t) for t in b]
    n = min(len(a), len(b))
    first = next((i for i in range(n) if a[i] != b[i]), None)
    if first is None and len(a) != len(b) and not (prefix_ok and len(a) < len(b)):
        first = n
    counts = f"{len(a)} vs {len(b)} tokens"
    if first is not None:
        return FamilyResult(
            family,
            comparison,
            metric,
            FAIL,
            observed=f"differ at token {first}",
            tolerance=0,
            tolerance_name=tol.name,
            justification=tol.justification,
            first_failing_frame=first,
            frame_unit="token",
            note=_join(note, counts),
        )
    return FamilyResult(
        family,
        comparison,
        metric,
        PASS,
        observed=0,
        tolerance=0,
        tolerance_name=tol.name,
        justification=tol.justification,
        frame_unit="token",
        note=_join(note, counts),
    )


def compare_text(
    family: str, comparison: str, metric: str, a: str | None, b: str | None, *, note: str = ""
) -> FamilyResult:
    tol = _tol("exact")
    if a is None or b is None:
        return not_available(family, comparison, metric, "the backend did not provide this text")
    if a == b:
        return FamilyResult(
            family,
            comparison,
            metric,
            PASS,
            observed=f"{len(a)} chars equal",
            tolerance=0,
            tolerance_name=tol.name,
            justification=tol.justification,
            note=note,
        )
    i = next((k for k in range(min(len(a), len(b))) if a[k] != b[k]), min(len(a), len(b)))
    return FamilyResult(
        family,
        comparison,
        metric,
        FAIL,
        observed=f"differ at char {i}",
        tolerance=0,
        tolerance_name=tol.name,
        justification=tol.justification,
        note=_join(note, f"{a[max(0, i - 10) : i + 20]!r} vs {b[max(0, i - 10) : i + 20]!r}"),
    )


def compare_value(
    family: str,
    comparison: str,
    metric: str,
    observed,
    expected,
    *,
    first_failing_frame: int | None = None,
    frame_unit: str = "frame",
    note: str = "",
) -> FamilyResult:
    """An exact scalar check (a length, a count)."""
    tol = _tol("exact")
    if observed is None or expected is None:
        return not_available(family, comparison, metric, "the backend did not provide this value")
    ok = observed == expected
    return FamilyResult(
        family,
        comparison,
        metric,
        PASS if ok else FAIL,
        observed=_scalar(observed),
        tolerance=f"== {_scalar(expected)}",
        tolerance_name=tol.name,
        justification=tol.justification,
        first_failing_frame=None if ok else first_failing_frame,
        frame_unit=frame_unit,
        note=note,
    )


def _scalar(v):
    if isinstance(v, (np.integer,)):
        return int(v)
    return v


# --------------------------------------------------------------------------- audio


def compare_aligned_audio(
    family: str,
    comparison: str,
    metric: str,
    delayed,
    reference,
    *,
    delay: int,
    skip: int,
    samples_per_frame: int,
    tol_name: str | Tolerance,
    end: int | None = None,
    note: str = "",
) -> FamilyResult:
    """`delayed[delay + i]` vs `reference[i]` for skip <= i < end (default: all common samples).

    A failing sample is reported by the frame of `delayed` that holds it
    ((delay + i) // samples_per_frame): for a stream, the Audio event that emitted it.
    """
    tol = _tol(tol_name)
    if delayed is None or reference is None:
        return not_available(family, comparison, metric, "the backend did not provide audio")
    d = np.asarray(delayed, dtype=np.float64)[delay:]
    r = np.asarray(reference, dtype=np.float64)
    n = min(d.size, r.size) if end is None else min(d.size, r.size, end)
    if n <= skip:
        return FamilyResult(
            family,
            comparison,
            metric,
            FAIL if n < skip else PASS,
            observed="no samples compared",
            tolerance=tol.value,
            tolerance_name=tol.name,
            justification=tol.justification,
            frames_compared=0,
            note=note,
        )
    diff = np.abs(d[skip:n] - r[skip:n])
    diff = np.where(np.isfinite(diff), diff, np.inf)
    observed = float(diff.max())
    bad = np.nonzero(diff > tol.value)[0]
    detail = f"samples [{skip}, {n}) after a {delay}-sample delay"
    return FamilyResult(
        family,
        comparison,
        metric,
        FAIL if bad.size else PASS,
        observed=observed,
        tolerance=tol.value,
        tolerance_name=tol.name,
        justification=tol.justification,
        first_failing_frame=int((bad[0] + skip + delay) // samples_per_frame) if bad.size else None,
        margin=_headroom(float(tol.value), observed),
        margin_kind="headroom",
        frames_compared=int(-(-n // samples_per_frame)),
        note=_join(note, detail),
    )


def _join(*parts: str) -> str:
    return "; ".join(p for p in parts if p)


@dataclass
class ComponentRun:
    """What a backend's component checks return: raw arrays, diffed by the engine.

    Nemotron-H (one entry per timeline position, system-prompt positions first):
      llm_cached_text_logits / llm_cached_function_logits (T, V): single cached steps;
      llm_recompute_text_logits / llm_recompute_function_logits (T, V): the no-cache
      recompute over the same inputs (teacher-forced with the cached run's ids).
    EAR-TTS (one entry per timeline position >= 1):
      tts_cached_codes / tts_recompute_codes (T-1, Q); tts_cached_hidden /
      tts_recompute_hidden (T-1, 2, hidden) backbone outputs [conditional, unconditional].
    prompt_positions: P, so audio frame = position - P.
    """

    prompt_positions: int = 0
    llm_cached_text_logits: np.ndarray | None = None
    llm_cached_function_logits: np.ndarray | None = None
    llm_recompute_text_logits: np.ndarray | None = None
    llm_recompute_function_logits: np.ndarray | None = None
    tts_cached_codes: np.ndarray | None = None
    tts_recompute_codes: np.ndarray | None = None
    tts_cached_hidden: np.ndarray | None = None
    tts_recompute_hidden: np.ndarray | None = None
    notes: dict = field(default_factory=dict)


__all__ = [
    "PASS",
    "FAIL",
    "NOT_AVAILABLE",
    "DOCUMENTED",
    "STATUSES",
    "FAMILIES",
    "MEL",
    "CONFORMER",
    "RNNT",
    "NEMOTRON",
    "EAR_TTS",
    "CODEC",
    "E2E",
    "Tolerance",
    "TOLERANCES",
    "FamilyResult",
    "ComponentRun",
    "compare_frames",
    "compare_ids",
    "compare_codes",
    "compare_token_frames",
    "compare_token_lists",
    "compare_text",
    "compare_value",
    "compare_aligned_audio",
    "logit_gap",
    "min_logit_gap",
    "not_available",
]
