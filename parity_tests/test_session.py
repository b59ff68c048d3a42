"""The streaming session (api.md): chunking, lifecycle, event invariance, parity with offline generate."""

import itertools
import threading

import mlx.core as mx
import numpy as np
import pytest

import voicechat
from voicechat.errors import ContextLimitError, SessionClosedError, WrongThreadError
from voicechat.streaming.profiler import FrameTiming, Profile, percentile
from voicechat.synthetic.checkpoint import write_checkpoint


def run_stream(model, audio, push=1280, **kw):
    s = model.create_streaming_session(**kw)
    events = []
    for i in range(0, len(audio), push):
        events += s.push_audio(audio[i : i + push])
    events += s.flush()
    return s, events


def audio_of(events):
    return np.concatenate([e.samples for e in events if e.kind in ("audio", "audio_tail")])


def test_push_chunking_and_flush(tiny_model, question_wav):
    s = tiny_model.create_streaming_session()
    counts = []
    pos = 0
    for n in (300, 1000, 1280, 2000):
        ev = s.push_audio(question_wav[pos : pos + n])
        pos += n
        counts.append(sum(e.kind == "audio" for e in ev))
    assert counts == [0, 1, 1, 1]
    assert s.pending_samples == 4580 - 3 * 1280
    ev = s.flush(pad_partial=True)
    assert [
        e.kind
        for e in ev
        if e.kind != "assistant_text_delta" and e.kind != "function_delta" and e.kind != "user_transcript_delta"
    ] == ["audio", "audio_tail", "done"]
    assert ev[-1].frame_index == 4
    # closed: push raises, flush / cancel return []
    with pytest.raises(SessionClosedError):
        s.push_audio(question_wav[:1280])
    assert s.flush() == [] and s.cancel() == []


def test_flush_without_padding_drops_partial(tiny_model, question_wav):
    s = tiny_model.create_streaming_session()
    s.push_audio(question_wav[:2000])
    ev = s.flush(pad_partial=False)
    assert sum(e.kind == "audio" for e in ev) == 0
    assert [e.kind for e in ev] == ["audio_tail", "done"]
    assert len(ev[0].samples) == tiny_model.tts_model.audio_codec.lead_in


def test_cancel(tiny_model, question_wav):
    s = tiny_model.create_streaming_session()
    s.push_audio(question_wav[:3000])
    ev = s.cancel()
    assert [e.kind for e in ev] == ["cancelled"] and ev[0].frame_index == 2
    with pytest.raises(SessionClosedError):
        s.push_audio(question_wav[:1280])


def test_context_limit_keeps_events(tiny_model, question_wav):
    s = tiny_model.create_streaming_session(max_streaming_seconds=0.24)  # 3 frames
    with pytest.raises(ContextLimitError) as e:
        s.push_audio(question_wav[: 1280 * 5])
    assert [ev.frame_index for ev in e.value.events if ev.kind == "audio"] == [0, 1, 2]
    with pytest.raises(SessionClosedError):
        s.push_audio(question_wav[:1280])


@pytest.mark.parametrize("push", [300, 1000, 3000, None])
def test_event_stream_independent_of_push_size(tiny_model, question_wav, push):
    _, ref = run_stream(tiny_model, question_wav, 1280)
    _, got = run_stream(tiny_model, question_wav, push or len(question_wav))
    assert got == ref


def test_events_and_audio_shapes(tiny_model, question_wav):
    s, ev = run_stream(tiny_model, question_wav)
    audio = [e for e in ev if e.kind == "audio"]
    ratio = tiny_model.config.codec_config.waveform_to_token_ratio
    q = tiny_model.config.tts_config.num_quantizers
    assert len(audio) == int(np.ceil(len(question_wav) / 1280))
    assert all(e.samples.dtype == np.float32 and e.samples.shape == (ratio,) for e in audio)
    assert all(e.audio_codes.dtype == np.int32 and e.audio_codes.shape == (q,) for e in audio)
    assert [e.frame_index for e in audio] == list(range(len(audio)))
    assert np.isfinite(audio_of(ev)).all()
    text = [e for e in ev if e.kind == "assistant_text_delta"]
    assert text and text[-1].text == s.text.text
    assert "".join(e.delta for e in text) == text[-1].text or any(
        not e.text.startswith(p.text) for p, e in itertools.pairwise(text)
    )


def _first_frame_and_common(model, wav, prompt):
    off = model.generate(wav, system_prompt=prompt)
    s, ev = run_stream(model, wav, system_prompt=prompt)
    codes = np.stack([e.audio_codes for e in ev if e.kind == "audio"])
    return off, s, ev, codes


@pytest.mark.parametrize("prompt", [None, "you are a helpful voice assistant"])
@pytest.mark.parametrize("which", ["tiny_model", "tiny_model_4bit"])
def test_streaming_matches_offline(request, which, prompt, question_wav):
    model = request.getfixturevalue(which)
    off, s, ev, codes = _first_frame_and_common(model, question_wav, prompt)
    k = codes.shape[0]
    # Offline has one frame more than the stream (the centred last mel frame).
    assert off.text_tokens.shape[0] == k + 1
    silence = np.array(model.tts_model.codec_silence_tokens).astype(np.int32)
    # First audio frame: text id, function id and every code identical (without a prompt both are the
    # codec silence codes; the reference's offline path has an all-zero row there, §12.2 item 7).
    assert s.text_ids[0] == off.text_tokens[0] and s.function_ids[0] == off.function_tokens[0]
    if prompt is None:
        np.testing.assert_array_equal(codes[0], silence)
    np.testing.assert_array_equal(codes[:1], off.audio_codes[:1])
    # All common frames.
    np.testing.assert_array_equal(np.array(s.text_ids), off.text_tokens[:k])
    np.testing.assert_array_equal(np.array(s.function_ids), off.function_tokens[:k])
    np.testing.assert_array_equal(codes, off.audio_codes[:k])
    np.testing.assert_array_equal(np.stack(s.raw_audio_codes), off.raw_audio_codes[:k])
    # Audio: streamed (after the codec lead-in) vs offline over the common frames. The first
    # `warmup_samples` differ by design (causal warm-up) and the last (n_fft - hop) / 2 samples of
    # the common region depend on the frame that follows, which only the offline decode has.
    codec = model.tts_model.audio_codec
    ratio = codec.samples_per_frame
    streamed = audio_of(ev)
    assert streamed.shape[0] == k * ratio + codec.lead_in
    edge = (model.config.codec_config.n_fft - model.config.codec_config.hop_length) // 2
    a = streamed[codec.lead_in :][codec.warmup_samples : k * ratio - edge]
    b = off.audio[codec.warmup_samples : k * ratio - edge]
    # float32 decode of identical codes in a different chunking: agreement to rounding (<< 1e-4)
    assert np.max(np.abs(a - b)) <= 1e-4
    assert s.transcript.text == off.user_transcript or off.user_transcript.startswith(s.transcript.text)


def test_language_cache_off_same_ids(tiny_model, question_wav):
    s1, _ = run_stream(tiny_model, question_wav)
    s2, _ = run_stream(tiny_model, question_wav, use_language_cache=False)
    assert s1.text_ids == s2.text_ids and s1.function_ids == s2.function_ids
    off1 = tiny_model.generate(question_wav)
    off2 = tiny_model.generate(question_wav, use_language_cache=False)
    np.testing.assert_array_equal(off1.text_tokens, off2.text_tokens)
    np.testing.assert_array_equal(off1.audio_codes, off2.audio_codes)


@pytest.fixture(scope="module")
def wide_window_model(tmp_path_factory):
    # Attention window longer than question.wav (27 frames), so the uncached fallback's
    # recompute window (left + 1 frames of audio) covers the whole history.
    p = write_checkpoint(
        tmp_path_factory.mktemp("wide"),
        "tiny",
        overrides={"audio_config": {"encoder": {"att_context_size": [[40, 0]]}}},
    )
    return voicechat.load(p)


def test_perception_cache_off_same_ids(wide_window_model, question_wav):
    s1, _ = run_stream(wide_window_model, question_wav)
    s2, _ = run_stream(wide_window_model, question_wav, use_perception_cache=False)
    assert s1.text_ids == s2.text_ids and s1.function_ids == s2.function_ids


def test_sessions_isolated_and_rng_untouched(tiny_model, question_wav):
    key_before = np.array(mx.random.state[0])
    a = tiny_model.create_streaming_session(seed=1)
    b = tiny_model.create_streaming_session(seed=2, system_prompt="hello")
    np.testing.assert_array_equal(np.array(mx.random.state[0]), key_before)
    ea, eb = [], []
    for i in range(0, len(question_wav), 1280):
        ea += a.push_audio(question_wav[i : i + 1280])
        eb += b.push_audio(question_wav[i : i + 1280])
    ea += a.flush()
    eb += b.flush()
    _, alone_a = run_stream(tiny_model, question_wav, seed=1)
    _, alone_b = run_stream(tiny_model, question_wav, seed=2, system_prompt="hello")
    assert ea == alone_a and eb == alone_b
    np.testing.assert_array_equal(np.array(mx.random.state[0]), key_before)


def test_other_thread_refused(tiny_model, question_wav):
    s = tiny_model.create_streaming_session()
    errors = []

    def worker():
        try:
            s.push_audio(question_wav[:1280])
        except WrongThreadError as e:
            errors.append(e)

    t = threading.Thread(target=worker)
    t.start()
    t.join()
    assert errors and "another thread" in str(errors[0])
    assert len(s.push_audio(question_wav[:1280])) >= 1  # still usable on its own thread


def test_refused_push_changes_nothing(tiny_model, question_wav):
    s = tiny_model.create_streaming_session()
    ref = tiny_model.create_streaming_session()
    ev, ev_ref = [], []
    for i in range(0, 3000, 1000):
        ev += s.push_audio(question_wav[i : i + 1000])
        ev_ref += ref.push_audio(question_wav[i : i + 1000])
        for bad, exc in [
            (np.stack([question_wav[:100]] * 2, 1), ValueError),
            (np.array([np.nan] * 10, np.float32), ValueError),
            (np.zeros(10, np.uint8), TypeError),
        ]:
            with pytest.raises(exc):
                s.push_audio(bad)
        with pytest.raises(ValueError, match="16000 Hz"):
            s.push_audio(question_wav[:100], sample_rate=48000)
    ev += s.flush()
    ev_ref += ref.flush()
    assert ev == ev_ref


def test_int16_push_equals_scaled_float(tiny_model, question_wav):
    pcm = np.round(question_wav * 32767).astype(np.int16)
    _, a = run_stream(tiny_model, pcm)
    _, b = run_stream(tiny_model, pcm.astype(np.float32) / 32768.0)
    assert a == b


def test_profile_summary_percentiles():
    p = Profile(80.0)
    totals = [10.0, 20.0, 30.0, 40.0, 100.0]
    for i, t in enumerate(totals):
        p.add(FrameTiming(i, t / 5, t / 5, t / 5, t / 5, t / 5, t))
    s = p.summary(drop_first=1)
    assert s["frames"] == 4 and s["dropped_cold_frames"] == 1
    assert s["total"]["mean_ms"] == pytest.approx(47.5)
    assert s["total"]["p50_ms"] == pytest.approx(35.0)  # interpolated between 30 and 40
    assert s["total"]["p95_ms"] == pytest.approx(40 + 0.85 * 60)  # position 3 * 0.95 = 2.85
    assert s["total"]["max_ms"] == 100.0
    assert s["realtime_factor"] == pytest.approx(47.5 / 80)
    assert s["processing_frames_per_second"] == pytest.approx(1000 / 47.5)
    assert percentile([1.0], 0.95) == 1.0


def test_session_profile(tiny_model, question_wav):
    s, _ = run_stream(tiny_model, question_wav, profile=True)
    summ = s.profile.summary(drop_first=2)
    assert summ["frames"] == s.frame_index - 2
    for stage in ("perception", "rnnt", "language", "tts", "codec", "total"):
        assert np.isfinite(summ[stage]["p95_ms"]) and summ[stage]["mean_ms"] >= 0
    assert summ["total"]["mean_ms"] >= summ["tts"]["mean_ms"]


def test_frame_records_are_the_sessions_own_values(tiny_model, question_wav):
    """The observation point (`on_frame`) hands out the frame's own intermediates: they agree with the
    session's ids / transcript / events and with what the offline path computes from the same audio
    (streamed and offline log-mel / encoder frames run the same code on the same samples; the first
    streamed mel frame is built as the reference's streaming frontend builds it, ~1e-6 from the
    offline one: bounds 1e-4 (mel_abs) for it, 1e-5 for the others and 1e-4 for the encoder, far
    below what a frame shift moves)."""
    records = []
    s, events = run_stream(tiny_model, question_wav, on_frame=records.append)
    audio = [e for e in events if e.kind == "audio"]
    assert [r.frame_index for r in records] == list(range(len(audio))) and len(records) == len(s.text_ids)
    for r, e in zip(records, audio, strict=True):
        assert r.text_id == s.text_ids[r.frame_index] == int(np.argmax(r.text_logits))
        assert r.function_id == s.function_ids[r.frame_index] == int(np.argmax(r.function_logits))
        assert np.array_equal(r.samples, e.samples)
        # decoded codes: the raw codes with control codes replaced, so none remains
        control = set(np.asarray(tiny_model.tts_model.control_codes).tolist())
        keep = ~np.isin(r.raw_codes, list(control))
        assert np.array_equal(r.codes[keep], r.raw_codes[keep]) and not np.isin(r.codes, list(control)).any()
    assert [t for r in records for t in r.rnnt_tokens] == s.transcript_tokens
    off = tiny_model.generate(question_wav)
    mel = np.concatenate([r.mel for r in records])
    off_mel = np.asarray(off.mel)
    off_mel = off_mel if off_mel.shape[-1] == mel.shape[-1] else off_mel.T
    n = min(len(mel), len(off_mel))
    assert n >= 8 * (len(records) - 1)
    assert np.abs(mel[:1] - off_mel[:1]).max() <= 1e-4 and np.abs(mel[1:n] - off_mel[1:n]).max() <= 1e-5
    enc = np.stack([r.encoder for r in records])
    assert np.abs(enc - np.asarray(off.encoder_frames)[: len(enc)]).max() <= 1e-4
    assert s.text_ids == list(off.text_tokens[: len(s.text_ids)])


def test_frame_records_without_perception_cache_and_bad_observer(wide_window_model, question_wav):
    records = []
    run_stream(wide_window_model, question_wav[: 4 * 1280], on_frame=records.append, use_perception_cache=False)
    assert len(records) == 4 and all(r.mel is None and r.encoder.ndim == 1 for r in records)
    with pytest.raises(TypeError, match="on_frame"):
        wide_window_model.create_streaming_session(on_frame="not callable")


def _same_events(a, b):
    assert [type(e) for e in a] == [type(e) for e in b]
    for x, y in zip(a, b, strict=True):
        if hasattr(x, "samples"):
            assert x.frame_index == y.frame_index and np.array_equal(x.samples, y.samples)
        else:
            assert x == y


def test_push_frames_yields_each_frames_events_and_keeps_what_is_not_taken(tiny_model, question_wav):
    """push_frames checks and buffers the chunk at once, then computes one frame per step of its
    iterator; frames the caller leaves stay buffered and the next push or flush computes them: the
    events equal push_audio's, frame for frame."""
    wave = question_wav[: 1280 * 6 + 500]
    whole = tiny_model.create_streaming_session()
    expected = whole.push_audio(wave) + whole.flush()
    s = tiny_model.create_streaming_session()
    frames = s.push_frames(wave[: 1280 * 4 + 100])
    assert s.frame_index == 0 and s.pending_samples == 1280 * 4 + 100  # nothing computed yet
    got = []
    for _ in range(2):  # take two frames, leave the other two
        ev = next(frames)
        assert {e.frame_index for e in ev} == {s.frame_index - 1}  # one frame's events
        got += ev
    assert s.frame_index == 2 and s.pending_samples == 1280 * 2 + 100
    got += s.push_audio(wave[1280 * 4 + 100 :])  # computes the two left behind, then the rest
    got += s.flush()
    _same_events(got, expected)


def test_a_refused_push_frames_changes_nothing(tiny_model, question_wav):
    s = tiny_model.create_streaming_session()
    s.push_audio(question_wav[:1000])
    bad = question_wav[:2000].copy()
    bad[1500] = np.nan
    with pytest.raises(ValueError, match="NaN"):
        s.push_frames(bad)  # raises at the call, before any iteration
    assert s.pending_samples == 1000 and s.frame_index == 0


def test_audio_is_checked_once_where_it_comes_in(tiny_model, question_wav, monkeypatch):
    """The session checks a chunk (rate, shape, dtype, finiteness) when it comes in; the frames it
    cuts go to the log-mel and the conformer without their own checks running again."""
    import voicechat.model.audio.conformer as conformer
    import voicechat.model.audio.mel as mel

    def again(*a, **k):
        raise AssertionError("input checked a second time")

    s = tiny_model.create_streaming_session()
    monkeypatch.setattr(mel, "as_waveform", again)
    monkeypatch.setattr(conformer, "_as_mel", again)
    monkeypatch.setattr(conformer, "as_waveform", again)
    assert len([e for e in s.push_audio(question_wav[: 1280 * 3]) if e.kind == "audio"]) == 3
    with pytest.raises(ValueError, match="NaN"):
        s.push_audio(np.full(1280, np.nan, np.float32))  # the one check still refuses bad input
