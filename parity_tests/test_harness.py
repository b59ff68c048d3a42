"""Self-tests of the parity harness: it must be able to fail, and fail in the right place.

Each broken backend subclasses `VoiceChatBackend` and corrupts exactly one
thing (a cache value, a frame shift, the codec tail, one token, one audio
frame, one mel frame); the test checks that the RIGHT family fails with the
RIGHT first failing frame and that every other row still passes. A healthy
backend passes everything; a backend that cannot provide a family gets
"not available", never "pass". The cross-implementation tests pin the table of
documented differences: a fake reference that behaves as docs/model.md §12.2
says is reported "documented difference" (verified), one with an extra
corruption still fails.

Runs use the tiny 4-bit synthetic checkpoint and question.wav; offline and
streamed runs are memoised per input so each broken variant costs only its
own corruption (plus the component checks).
"""

from __future__ import annotations

import copy

import mlx.core as mx
import numpy as np
import pytest

from harness.backends.voicechat_backend import VoiceChatBackend
from harness.differences import DIFFERENCES
from harness.dump import DumpBackend, dump_reference
from harness.engine import audio_digest, run_parity
from harness.families import (
    CODEC,
    CONFORMER,
    DOCUMENTED,
    E2E,
    EAR_TTS,
    FAIL,
    FAMILIES,
    MEL,
    NEMOTRON,
    NOT_AVAILABLE,
    PASS,
    compare_aligned_audio,
    compare_codes,
    compare_ids,
    logit_gap,
)
from harness.report import ParityReport

_MEMO: dict = {}


class MemoBackend(VoiceChatBackend):
    """VoiceChatBackend whose offline / streamed runs are computed once per (model, input, arguments)."""

    def _memo(self, kind, fn, audio, kw):
        key = (
            kind,
            id(self.model),
            self.numerics,
            audio_digest(np.asarray(audio, np.float32)),
            tuple(sorted(kw.items())),
        )
        if key not in _MEMO:
            _MEMO[key] = fn(audio, **kw)
        return copy.deepcopy(_MEMO[key])

    def offline(self, audio, **kw):
        return self._memo("offline", super().offline, audio, kw)

    def stream(self, audio, **kw):
        return self._memo("stream", super().stream, audio, kw)


@pytest.fixture(scope="module")
def model(tiny_ckpt_4bit):
    import voicechat

    return voicechat.load(tiny_ckpt_4bit)


@pytest.fixture(scope="module")
def model_f32(tiny_ckpt_4bit):
    """The same checkpoint with the float32 EAR-TTS option (its codes differ from the reference's)."""
    import voicechat

    return voicechat.load(tiny_ckpt_4bit, numerics="float32")


@pytest.fixture(scope="module")
def healthy(model, question_wav):
    return run_parity(MemoBackend(model), question_wav, checkpoint="tiny-4bit")


def failing_rows(report: ParityReport) -> list[tuple[str, str]]:
    return [(r.family, r.metric) for r in report.rows if r.status == FAIL]


def assert_only_fails(report: ParityReport, expected: set[tuple[str, str]]):
    got = set(failing_rows(report))
    assert got == expected, f"failing rows {sorted(got)}, expected {sorted(expected)}\n{report.to_markdown()}"
    assert not report.ok


# ----------------------------------------------------------------- the healthy backend


def test_healthy_backend_passes_every_family(healthy):
    assert healthy.ok, healthy.to_markdown()
    for family in FAMILIES:
        assert healthy.family_status(family) == PASS, family
    assert not any(r.status == NOT_AVAILABLE for r in healthy.rows)


def test_report_json_markdown_round_trip(healthy, tmp_path):
    jp, mp = healthy.write(tmp_path)
    back = ParityReport.from_json(jp.read_text())
    assert [r.as_dict() for r in back.rows] == [r.as_dict() for r in healthy.rows]
    assert back.ok and back.header["seed"] == 0
    md = mp.read_text()
    assert "| family | comparison | metric | observed | tolerance | margin | first failing frame | status |" in md
    assert "**Result: PASS**" in md and "tiny-4bit" in md
    for family in FAMILIES:
        assert f"| {family} |" in md


# ----------------------------------------------------------------- broken backends

K_LLM, K_TTS, K_SHIFT, K_TOKEN, K_AUDIO, K_MEL = 5, 4, 6, 3, 2, 40


class CorruptLlmState(MemoBackend):
    """Adds 0.5 to the first Mamba layer's SSM state right before the step of audio frame K_LLM."""

    def llm_cached_step(self, x, state, position):
        if position == self._prompt + K_LLM:
            layer = next(s for s in state.layers if s is not None and hasattr(s, "ssm"))
            layer.ssm = layer.ssm + 0.5
        return super().llm_cached_step(x, state, position)

    def component_checks(self, audio, **kw):
        self._prompt = len(self.prompt_ids(kw.get("system_prompt")))
        return super().component_checks(audio, **kw)


def test_corrupted_llm_cache_fails_nemotron_at_that_frame(model, question_wav):
    report = run_parity(CorruptLlmState(model), question_wav)
    assert report.row(NEMOTRON, "text logits").status == FAIL
    assert report.row(NEMOTRON, "text logits").first_failing_frame == K_LLM
    assert report.row(NEMOTRON, "function logits").first_failing_frame == K_LLM
    assert {f for f, _ in failing_rows(report)} == {NEMOTRON}
    for family in FAMILIES:
        if family != NEMOTRON:
            assert report.family_status(family) == PASS, family


class CorruptTtsCache(MemoBackend):
    """Scales the sliding layer's cached keys by 1.5 right before the TTS step of audio frame K_TTS."""

    def tts_cached_step(self, state, text_token, rng, position):
        if position == K_TTS:  # no system prompt: audio frame == timeline position
            state.keys[0] = state.keys[0] * 1.5
        return super().tts_cached_step(state, text_token, rng, position)


def test_corrupted_tts_cache_fails_ear_tts_at_that_frame(model, question_wav):
    report = run_parity(CorruptTtsCache(model), question_wav)
    row = report.row(EAR_TTS, "backbone hidden")
    assert row.status == FAIL and row.first_failing_frame == K_TTS
    codes = report.row(EAR_TTS, "codes per frame")
    assert codes.status == PASS or codes.first_failing_frame >= K_TTS
    assert {f for f, _ in failing_rows(report)} == {EAR_TTS}


class ShiftedEncoder(MemoBackend):
    """From frame K_SHIFT on, the streamed path reports the previous encoder frame (off by one)."""

    def stream(self, audio, **kw):
        run = super().stream(audio, **kw)
        run.encoder[K_SHIFT:] = run.encoder[K_SHIFT - 1 : -1].copy()
        return run


def test_off_by_one_stream_frame_fails_conformer(model, question_wav):
    report = run_parity(ShiftedEncoder(model), question_wav)
    assert_only_fails(report, {(CONFORMER, "encoder frames (max abs)")})
    assert report.row(CONFORMER, "encoder frames (max abs)").first_failing_frame == K_SHIFT


class DroppedTail(MemoBackend):
    def stream(self, audio, **kw):
        run = super().stream(audio, **kw)
        run.tail = np.zeros(0, np.float32)
        return run


def test_dropped_codec_tail_fails_codec(model, question_wav):
    report = run_parity(DroppedTail(model), question_wav)
    assert_only_fails(
        report,
        {
            (CODEC, "tail length"),
            (CODEC, "streamed length vs decode length"),
            (E2E, "streamed audio length (frames x spf + tail)"),
        },
    )
    last = len(report.runs.stream.text_ids) - 1
    for metric in ("tail length", "streamed length vs decode length"):
        assert report.row(CODEC, metric).first_failing_frame == last
    assert report.row(CODEC, "streamed samples vs decode (aligned)").status == PASS


class FlippedToken(MemoBackend):
    def stream(self, audio, **kw):
        run = super().stream(audio, **kw)
        run.text_ids[K_TOKEN] = (int(run.text_ids[K_TOKEN]) + 1) % self.model.config.text_config.vocab_size
        return run


def test_flipped_token_fails_end_to_end_ids_with_margin(model, question_wav):
    report = run_parity(FlippedToken(model), question_wav)
    assert_only_fails(report, {(E2E, "text ids per frame")})
    row = report.row(E2E, "text ids per frame")
    assert row.first_failing_frame == K_TOKEN and row.observed == 1
    expected_gap = logit_gap(report.runs.offline.text_logits, K_TOKEN)
    assert row.margin == pytest.approx(expected_gap) and row.margin > 0
    assert row.margin_kind == "logit gap at first mismatch"


class CorruptAudioFrame(MemoBackend):
    def stream(self, audio, **kw):
        run = super().stream(audio, **kw)
        spf = self.samples_per_frame
        run.audio[K_AUDIO * spf : (K_AUDIO + 1) * spf] += 1e-3
        return run


def test_corrupted_decode_step_fails_codec_at_that_frame(model, question_wav):
    report = run_parity(CorruptAudioFrame(model), question_wav)
    assert_only_fails(
        report, {(CODEC, "streamed samples vs decode (aligned)"), (E2E, "audio samples (streamed delayed by lead-in)")}
    )
    assert report.row(CODEC, "streamed samples vs decode (aligned)").first_failing_frame == K_AUDIO
    assert report.row(E2E, "audio samples (streamed delayed by lead-in)").first_failing_frame == K_AUDIO


class CorruptMelFrame(MemoBackend):
    def stream(self, audio, **kw):
        run = super().stream(audio, **kw)
        run.mel[K_MEL] += 0.1
        return run


def test_corrupted_mel_frame_fails_log_mel(model, question_wav):
    report = run_parity(CorruptMelFrame(model), question_wav)
    assert_only_fails(report, {(MEL, "log-mel frames (max abs)")})
    row = report.row(MEL, "log-mel frames (max abs)")
    assert row.first_failing_frame == K_MEL and row.frame_unit == "mel frame"
    assert row.observed == pytest.approx(0.1, rel=1e-3)


class NoComponents(MemoBackend):
    component_checks = None
    decode_codes = None


def test_missing_families_are_not_available_never_pass(model, question_wav):
    report = run_parity(NoComponents(model), question_wav)
    for family in (NEMOTRON, EAR_TTS, CODEC):
        assert report.family_status(family) == NOT_AVAILABLE, family
        assert all(r.status == NOT_AVAILABLE for r in report.rows_for(family))
    assert report.ok  # nothing failed; the report says what was not checked
    assert "not available" in report.to_markdown()


# ----------------------------------------------------------------- primitives


def test_primitives_fail_where_expected():
    a = np.arange(12).reshape(6, 2)
    b = a.copy()
    b[4, 1] = 99
    row = compare_codes(E2E, "x", "codes", a, b)
    assert row.status == FAIL and row.first_failing_frame == 4 and row.observed == 1
    logits = np.zeros((5, 4))
    logits[2] = [1.0, 0.75, 0.0, 0.0]
    row = compare_ids(E2E, "x", "ids", [1, 1, 0, 1, 1], [1, 1, 1, 1, 1], logits=logits)
    assert row.first_failing_frame == 2 and row.margin == pytest.approx(0.25)
    ref = np.linspace(-1, 1, 100).astype(np.float32)
    delayed = np.concatenate([np.zeros(4, np.float32), ref])
    delayed[4 + 57] += 1.0
    row = compare_aligned_audio(
        CODEC, "x", "s", delayed, ref, delay=4, skip=0, samples_per_frame=10, tol_name="codec_abs"
    )
    assert row.status == FAIL and row.first_failing_frame == (57 + 4) // 10
    with pytest.raises(ValueError, match="family must be one of"):
        compare_codes("no such family", "x", "codes", a, a)


# ----------------------------------------------------------------- cross mode and documented differences


class ReferenceLike(MemoBackend):
    """Behaves as docs/model.md §12.2 says the reference does: no-prompt offline frame 0 is an all-zero
    code row (decoded as such), no codec tail at flush, the reference's roundings (numerics "reference",
    or whatever numerics the given model has)."""

    name = "reference-like"
    extra_corruption = False

    def offline(self, audio, **kw):
        run = super().offline(audio, **kw)
        if not (kw.get("system_prompt") or "").strip():
            run.codes[0] = 0
        if self.extra_corruption:
            run.codes[5, 0] = (run.codes[5, 0] + 1) % self.model.config.tts_config.codebook_size
        run.audio = self.decode_codes(run.codes)
        return run

    def stream(self, audio, **kw):
        run = super().stream(audio, **kw)
        run.tail = np.zeros(0, np.float32)
        return run


class ReferenceLikeBroken(ReferenceLike):
    extra_corruption = True


def test_cross_documented_differences(model, model_f32, question_wav):
    """This project with numerics="float32" against the reference: the frame-0 row and the float32 code
    differences are documented, each verified (the latter by re-running with numerics="reference")."""
    report = run_parity(MemoBackend(model_f32), question_wav, against=ReferenceLike(model), components=False)
    assert report.ok, report.to_markdown()
    assert report.header["numerics"] == "float32" and "| numerics | float32 |" in report.to_markdown()
    assert "_voicechat_float32_vs_" in report.file_stem()  # never overwrites the default run's report
    applied = {r.difference_id for r in report.rows if r.status == DOCUMENTED}
    assert {"frame0_codes_no_prompt", "codec_tail", "float32_numerics"} <= applied
    c_off = "offline: voicechat vs reference-like"
    assert report.row(E2E, "codes per frame", c_off).difference_id == "float32_numerics"
    for c in (c_off, "streamed: voicechat vs reference-like"):  # the float32 decay rate moves the logits
        for ch in ("text", "function"):
            row = report.row(NEMOTRON, f"{ch} logits per frame (max abs)", c)
            assert row.difference_id == "float32_numerics" and row.observed > 1e-5, row
    c_off = "offline: voicechat vs reference-like"
    assert report.row(E2E, "first audio frame: codes", c_off).difference_id == "frame0_codes_no_prompt"
    assert report.row(E2E, "our decode of their codes vs their audio", c_off).status == PASS
    assert report.row(E2E, "tail length", "streamed: voicechat vs reference-like").difference_id == "codec_tail"
    for r in report.rows:
        if r.status == DOCUMENTED:
            assert r.difference_id in DIFFERENCES and "verified:" in r.note
    # Every documented entry names the tests that pin it, and they exist.
    for d in DIFFERENCES.values():
        assert d.pinned_by and all("::test_" in p for p in d.pinned_by)


def test_default_numerics_pass_codes_against_the_reference(model, question_wav):
    """Default numerics: the codes equal the reference's on every frame, so the codes rows pass; the
    documented rows are the codec tail and the reference's own offline frame-0 bug (§12.2 item 7:
    its zero row, our silence row, verified by the engine)."""
    report = run_parity(MemoBackend(model), question_wav, against=ReferenceLike(model), components=False)
    assert report.ok, report.to_markdown()
    assert report.header["numerics"] == "reference" and "_voicechat_vs_" in report.file_stem()
    cross = [r for r in report.rows if "vs reference-like" in r.comparison]
    assert {r.difference_id for r in cross if r.status == DOCUMENTED} == {"codec_tail", "frame0_codes_no_prompt"}
    c_off, c_st = "offline: voicechat vs reference-like", "streamed: voicechat vs reference-like"
    assert [r.metric for r in cross if r.difference_id == "frame0_codes_no_prompt"] == [
        "first audio frame: codes",
        "audio samples",
    ]
    for c in (c_off, c_st):
        for metric in ("codes per frame", "decoded codes per frame"):
            assert report.row(E2E, metric, c).status == PASS, (c, metric)
    assert report.row(E2E, "first audio frame: codes", c_st).status == PASS
    assert report.row(E2E, "our decode of their codes vs their audio", c_off).status == PASS


def test_default_numerics_code_mismatch_is_never_documented(model, model_f32, question_wav):
    """A code mismatch with the ids equal, on the default numerics, stays a failure: here the
    'reference' is the float32 model (the mismatch the float32_numerics entry documents for a
    float32 run)."""
    report = run_parity(MemoBackend(model), question_wav, against=ReferenceLike(model_f32), components=False)
    c_off = "offline: voicechat vs reference-like"
    assert report.row(E2E, "text ids per frame", c_off).status == PASS
    assert report.row(E2E, "codes per frame", c_off).status == FAIL
    cross = [r for r in report.rows if "vs reference-like" in r.comparison]
    assert not any(r.difference_id == "float32_numerics" for r in cross)
    assert not report.ok


def test_cross_undocumented_difference_still_fails(model, question_wav):
    report = run_parity(MemoBackend(model), question_wav, against=ReferenceLikeBroken(model), components=False)
    row = report.row(E2E, "codes per frame", "offline: voicechat vs reference-like")
    assert row.status == FAIL and row.first_failing_frame == 5
    assert not report.ok


class XscalingClaim(MemoBackend):
    """Our runs, but claiming a checkpoint with encoder.xscaling true."""

    @property
    def encoder_xscaling(self):
        return True


class UnscaledStreamReference(MemoBackend):
    name = "unscaled-stream"

    def stream(self, audio, **kw):
        run = super().stream(audio, **kw)
        run.encoder = run.encoder / 32.0  # what a missing sqrt(d) scale looks like on the streamed frames
        return run


def test_xscaling_difference_needs_xscaling(model, question_wav):
    plain = run_parity(MemoBackend(model), question_wav, against=UnscaledStreamReference(model), components=False)
    row = plain.row(CONFORMER, "encoder frames (max abs)", "streamed: voicechat vs unscaled-stream")
    assert row.status == FAIL  # xscaling false: no excuse
    claimed = run_parity(XscalingClaim(model), question_wav, against=UnscaledStreamReference(model), components=False)
    row = claimed.row(CONFORMER, "encoder frames (max abs)", "streamed: voicechat vs unscaled-stream")
    assert row.status == DOCUMENTED and row.difference_id == "xscaling_streaming"
    assert claimed.ok


def test_reference_dump_round_trip(model, question_wav, tmp_path):
    backend = MemoBackend(model)
    report = run_parity(backend, question_wav, components=False)
    path = dump_reference(tmp_path / "ref.npz", backend, report.runs, question_wav, system_prompt=None, seed=0)
    dump = DumpBackend(path)
    cross = run_parity(backend, question_wav, against=dump, components=False)
    assert cross.ok, cross.to_markdown()
    assert cross.row(E2E, "first audio frame: text logits", "offline: voicechat vs dump:voicechat").status == PASS
    with pytest.raises(ValueError, match="seed"):
        dump.offline(question_wav, seed=1)
    with pytest.raises(ValueError, match="input audio differs"):
        dump.stream(question_wav[:-1])


def test_cli_exit_status(tiny_ckpt_4bit, tmp_path, model, question_wav):
    from voicechat.cli.main import main

    wav = str(tmp_path / "q.wav")
    import soundfile as sf

    sf.write(wav, question_wav, 16000, subtype="FLOAT")
    ref = tmp_path / "ref.npz"
    rc = main(
        [
            "parity",
            "-m",
            str(tiny_ckpt_4bit),
            "--audio",
            wav,
            "--out",
            str(tmp_path),
            "--dump-reference",
            str(ref),
            "--no-components",
        ]
    )
    assert rc == 0 and ref.is_file()
    assert sorted(p.suffix for p in tmp_path.glob("*_seed0.*")) == [".json", ".md"]
    # A tampered reference (one code changed at frame 7 of the streamed run) must fail the gate.
    with np.load(ref) as z:
        arrays = {k: z[k] for k in z.files}
    arrays["stream.codes"][7, 0] = (arrays["stream.codes"][7, 0] + 1) % model.config.tts_config.codebook_size
    bad = tmp_path / "bad.npz"
    np.savez(bad, **arrays)
    rc = main(
        [
            "parity",
            "-m",
            str(tiny_ckpt_4bit),
            "--audio",
            wav,
            "--out",
            str(tmp_path / "bad"),
            "--against",
            str(bad),
            "--no-components",
        ]
    )
    assert rc == 1
    assert main(["parity", "-m", str(tiny_ckpt_4bit), "--audio", wav, "--against", "nope"]) == 2
    mx.clear_cache()


def test_margin_tells_near_tie_from_clear_decision():
    logits = np.zeros((3, 4))
    logits[1] = [2.0, 2.0 - 1e-6, 0.0, 0.0]  # near tie
    logits[2] = [2.0, -3.0, 0.0, 0.0]  # clear decision
    near = compare_ids(E2E, "x", "ids", [0, 1, 0], [0, 0, 0], logits=logits)
    clear = compare_ids(E2E, "x", "ids", [0, 0, 1], [0, 0, 0], logits=logits)
    assert near.first_failing_frame == 1 and near.margin == pytest.approx(1e-6) and "near tie" in near.note
    assert clear.first_failing_frame == 2 and clear.margin == pytest.approx(2.0) and "clear decision" in clear.note
    assert near.status == clear.status == FAIL


# ----------------------------------------------------------------- per-frame logits against the reference

K_TIE = 3  # the frame where the fabricated near tie sits


class TiedLogits(MemoBackend):
    """Our streamed run with frame K_TIE's text logits made a near tie: the runner-up 1e-6 below the top."""

    def stream(self, audio, **kw):
        run = super().stream(audio, **kw)
        row = run.text_logits[K_TIE]
        top, second = np.argsort(row)[-1], np.argsort(row)[-2]
        row[second] = row[top] - 1e-6
        return run


class FlippedOnTie(TiedLogits):
    """A reference that decides the tie the other way: its runner-up moved to `lift` + 1e-6 above the
    top (and `drop` taken off the top), so it emits the other id at K_TIE. Here: its gap is 2e-6,
    the difference 3e-6 (the runner-up moved by 1e-6 + 2e-6): a near tie."""

    name = "tie-ref"
    lift, drop = 1e-6, 0.0

    def stream(self, audio, **kw):
        run = super().stream(audio, **kw)
        row = run.text_logits[K_TIE]
        top, second = np.argsort(row)[-1], np.argsort(row)[-2]
        row[second] = row[top] + self.lift + 1e-6  # was 1e-6 below the top: now `lift` above it
        row[top] -= self.drop
        run.text_ids[K_TIE] = second
        return run


class FlippedClearly(FlippedOnTie):
    """The reference's top-2 gap (8e-6) exceeds the measured difference (5e-6): not a near tie."""

    lift, drop = 3e-6, 4e-6


def test_near_tie_flip_is_documented_only_below_the_error(model, question_wav, tmp_path):
    report = run_parity(TiedLogits(model), question_wav, against=FlippedOnTie(model), components=False)
    c = "streamed: voicechat vs tie-ref"
    text = report.row(NEMOTRON, "text logits per frame (max abs)", c)
    assert text.status == PASS and text.observed == pytest.approx(3e-6, abs=5e-7)  # float32 logits ~4
    assert report.row(NEMOTRON, "function logits per frame (max abs)", c).observed == 0
    ids = report.row(E2E, "text ids per frame", c)
    assert ids.status == DOCUMENTED and ids.difference_id == "near_tie_flip" and ids.first_failing_frame == K_TIE
    frames = report.per_frame["streamed"]
    assert len(frames) == len(report.runs.stream.text_ids)
    assert frames[K_TIE]["text_gap_ref"] < frames[K_TIE]["text_abs"] and not frames[K_TIE]["text_id_equal"]
    assert all(f["after_divergence"] == (f["frame"] > K_TIE) for f in frames)
    assert report.ok, report.to_markdown()
    # Both formats carry the per-frame table.
    jp, mp = report.write(tmp_path)
    again = ParityReport.from_json(jp.read_text())
    assert again.per_frame["streamed"][K_TIE] == pytest.approx(frames[K_TIE])
    assert "Per-frame logits, streamed" in mp.read_text()

    clear = run_parity(TiedLogits(model), question_wav, against=FlippedClearly(model), components=False)
    ids = clear.row(E2E, "text ids per frame", c)
    assert ids.status == FAIL and "not a near tie" in ids.note
    assert not clear.ok


class DriftedLogits(MemoBackend):
    """Logits 3e-5 off from frame 5 on (ids unchanged): above cross_logits_abs."""

    name = "drift-ref"

    def stream(self, audio, **kw):
        run = super().stream(audio, **kw)
        run.function_logits[5:] += 3e-5
        return run


def test_logits_drift_fails_nemotron_at_that_frame(model, question_wav):
    report = run_parity(MemoBackend(model), question_wav, against=DriftedLogits(model), components=False)
    c = "streamed: voicechat vs drift-ref"
    row = report.row(NEMOTRON, "function logits per frame (max abs)", c)
    assert row.status == FAIL and row.first_failing_frame == 5
    assert report.row(NEMOTRON, "text logits per frame (max abs)", c).status == PASS
    assert report.row(NEMOTRON, "text logits per frame (max abs)", "offline: voicechat vs drift-ref").observed == 0


class PromptDriftedStream(MemoBackend):
    """A reference whose streamed logits part from its own offline ones from frame `start` on (its
    ids unchanged), as the reference's streamed prompt prefill does on bf16 weights from frame 0."""

    name = "prompt-drift-ref"
    start = 0

    def stream(self, audio, **kw):
        run = super().stream(audio, **kw)
        run.text_logits[self.start :] += 3e-3
        return run


class LateDriftedStream(PromptDriftedStream):
    start = 4


def test_reference_stream_logits_needs_the_reference_to_disagree_with_itself(model, question_wav):
    """Documented only with a prompt, when our stream equals the reference's offline and the
    reference's stream parts from its own offline pass at frame 0; otherwise a failure."""
    c = "streamed: voicechat vs prompt-drift-ref"
    with_prompt = run_parity(
        MemoBackend(model), question_wav, against=PromptDriftedStream(model), system_prompt="hello", components=False
    )
    row = with_prompt.row(NEMOTRON, "text logits per frame (max abs)", c)
    assert row.status == DOCUMENTED and row.difference_id == "reference_stream_logits", row
    assert with_prompt.ok, with_prompt.to_markdown()
    no_prompt = run_parity(MemoBackend(model), question_wav, against=PromptDriftedStream(model), components=False)
    assert no_prompt.row(NEMOTRON, "text logits per frame (max abs)", c).status == FAIL
    late = run_parity(
        MemoBackend(model), question_wav, against=LateDriftedStream(model), system_prompt="hello", components=False
    )
    assert late.row(NEMOTRON, "text logits per frame (max abs)", c).status == FAIL


class ScaledAudioReference(MemoBackend):
    """A reference whose streamed audio is off by `factor` times the derived cross tolerance."""

    name = "audio-ref"
    factor = 0.5

    def stream(self, audio, **kw):
        from harness.families import codec_cross_tolerance

        run = super().stream(audio, **kw)
        tol = codec_cross_tolerance(self.model.config.codec_config, float(np.abs(run.audio).max())).value
        run.audio = run.audio + np.float32(self.factor * tol)
        return run


class OverAudioReference(ScaledAudioReference):
    factor = 2.0


def test_cross_audio_tolerance_is_derived_from_the_codec(model, question_wav):
    """Cross audio rows use the codec-derived bound (`cross_audio_abs`), not the API's 1e-5: half
    of it passes, twice of it fails."""
    c = "streamed: voicechat vs audio-ref"
    ok = run_parity(MemoBackend(model), question_wav, against=ScaledAudioReference(model), components=False)
    row = ok.row(E2E, "audio samples", c)
    assert row.status == PASS and row.tolerance_name == "cross_audio_abs" and row.tolerance != 1e-5, row
    bad = run_parity(MemoBackend(model), question_wav, against=OverAudioReference(model), components=False)
    assert bad.row(E2E, "audio samples", c).status == FAIL


def test_layouts_the_reference_cannot_run_are_named(tmp_path):
    """mlx-vlm's default predicate quantizes proj_mus and the char embedding, which mlx-vlm cannot
    run; the runnable predicate leaves them dense."""
    from harness.backends.mlx_vlm_backend import UNRUNNABLE_QUANTIZED, unrunnable_quantized_modules

    from .independent_writer import Spec, write

    default = write(tmp_path / "default", Spec(bits=4, predicate="mlx-vlm-default"))
    runnable = write(tmp_path / "runnable", Spec(bits=4, predicate="mlx-vlm-runnable"))
    assert unrunnable_quantized_modules(default) == list(UNRUNNABLE_QUANTIZED)
    assert unrunnable_quantized_modules(runnable) == []


class CannotRun(MemoBackend):
    name = "cannot-run-ref"

    def unrunnable_modules(self):
        return ["tts_model.tts_model.mog_head.proj_mus"]

    def offline(self, audio, **kw):
        raise AssertionError("a reference that cannot run this layout is never run")


def test_reference_that_cannot_run_the_layout_gives_not_available_rows(model, question_wav):
    report = run_parity(MemoBackend(model), question_wav, against=CannotRun(model), components=False)
    rows = [r for r in report.rows if r.comparison == "voicechat vs cannot-run-ref"]
    assert len(rows) == 1 and rows[0].status == NOT_AVAILABLE and "proj_mus" in rows[0].note
    assert not any(r.status == PASS and "cannot-run-ref" in r.comparison for r in report.rows)
    assert report.ok  # this project's own rows pass
