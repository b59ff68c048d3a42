"""Per-model EAR-TTS numerics (`voicechat.load(path, numerics=...)`) and the decoded `audio_codes`.

* Two models loaded from the same bf16 checkpoint with the two settings live in
  one process: used alternately, and from two threads at once, each gives the
  codes it gives when used alone (nothing is process-wide, each model's
  speaker warm-up and cached pieces are its own).
* The settings do differ on bf16 weights (else the test above has no power).
* `Audio.audio_codes` / `OfflineResult.audio_codes` are the decoded codes:
  the generated (raw) codes with every control code replaced by the silence
  code of its codebook; the raw codes stay in `OfflineResult.raw_audio_codes`
  and `session.raw_audio_codes`.
* Offline frame 0 without a prompt: the codec silence codes under both
  settings, as in streaming (the reference's offline path leaves an all-zero
  row there, §12.2 item 7: a bug, not a rounding).
"""

from __future__ import annotations

import threading

import numpy as np
import pytest

import voicechat
from voicechat.model.tts.ear_tts import replace_control_codes

PROMPT = "hello"


def _stream(model, audio, prompt=None) -> dict:
    s = model.create_streaming_session(system_prompt=prompt)
    events = s.push_audio(audio) + s.flush()
    return {
        "raw": np.stack(s.raw_audio_codes),
        "decoded": np.stack([e.audio_codes for e in events if e.kind == "audio"]),
        "ids": (list(s.text_ids), list(s.function_ids)),
    }


def _offline(model, audio, prompt=None) -> dict:
    r = model.generate(audio, system_prompt=prompt)
    return {
        "raw": r.raw_audio_codes,
        "decoded": r.audio_codes,
        "ids": (r.text_tokens.tolist(), r.function_tokens.tolist()),
    }


def _run(model, audio) -> dict:
    return {"stream": _stream(model, audio, PROMPT), "offline": _offline(model, audio)}


def _same(a: dict, b: dict) -> None:
    for path in ("stream", "offline"):
        for key in ("raw", "decoded"):
            np.testing.assert_array_equal(a[path][key], b[path][key], err_msg=f"{path} {key}")
        assert a[path]["ids"] == b[path]["ids"]


@pytest.fixture(scope="module")
def models(tiny_ckpt):
    """The bf16 tiny checkpoint (bf16 weights: the two settings compute differently) loaded twice."""
    return voicechat.load(tiny_ckpt, numerics="reference"), voicechat.load(tiny_ckpt, numerics="float32")


@pytest.fixture(scope="module")
def alone(tiny_ckpt, question_wav):
    """Each setting's results from a fresh process-state: one model at a time, loaded, run, dropped."""
    out = {}
    for name in ("reference", "float32"):
        m = voicechat.load(tiny_ckpt, numerics=name)
        out[name] = _run(m, question_wav)
        del m
    return out


def test_load_validates_numerics(tiny_ckpt):
    with pytest.raises(ValueError, match=r"numerics: expected one of 'reference', 'float32', got 'fp32'"):
        voicechat.load(tiny_ckpt, numerics="fp32")
    with pytest.raises(TypeError, match="numerics: expected one of"):
        voicechat.load(tiny_ckpt, numerics=None)


def test_model_carries_its_numerics(models, tiny_model):
    ref, f32 = models
    assert ref.numerics.name == "reference" and f32.numerics.name == "float32"
    assert tiny_model.numerics.name == "reference"  # the default


def test_settings_differ_on_bf16_weights(alone):
    """Power of the tests below: with bf16 weights the two settings give different codes."""
    a, b = alone["reference"]["stream"]["raw"], alone["float32"]["stream"]["raw"]
    assert a.shape == b.shape and not np.array_equal(a, b)


def test_two_models_alternately(models, question_wav, alone):
    ref, f32 = models
    audio = question_wav
    got = {"reference": {}, "float32": {}}
    # Interleave: every run of one model sits between runs of the other.
    got["reference"]["stream"] = _stream(ref, audio, PROMPT)
    got["float32"]["stream"] = _stream(f32, audio, PROMPT)
    got["reference"]["offline"] = _offline(ref, audio)
    got["float32"]["offline"] = _offline(f32, audio)
    for name in got:
        _same(got[name], alone[name])


def test_two_models_in_two_threads(models, question_wav, alone):
    ref, f32 = models
    audio = question_wav
    results, errors = {}, []
    start = threading.Barrier(2)

    def work(name, model):
        try:
            start.wait()
            results[name] = [_run(model, audio) for _ in range(2)]
        except BaseException as e:  # reported below
            errors.append((name, e))

    threads = [threading.Thread(target=work, args=(n, m)) for n, m in (("reference", ref), ("float32", f32))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    for name in ("reference", "float32"):
        for run in results[name]:
            _same(run, alone[name])


def test_audio_codes_are_the_decoded_codes(tiny_model, question_wav):
    """Events and the offline result carry the raw codes with control codes replaced; some frame of
    this input generates a control code (the tiny preset's control codes lie inside the generated
    range), so the two differ there."""
    tts = tiny_model.tts_model
    control = set(np.array(tts.control_codes).tolist())
    silence = np.array(tts.codec_silence_tokens).astype(np.int32)
    for run in (_stream(tiny_model, question_wav), _offline(tiny_model, question_wav)):
        raw, decoded = run["raw"], run["decoded"]
        assert raw.dtype == decoded.dtype == np.int32 and raw.shape == decoded.shape
        is_control = np.isin(raw, list(control))
        assert is_control.any(), "no control code generated: the test has no power"
        np.testing.assert_array_equal(decoded[~is_control], raw[~is_control])
        np.testing.assert_array_equal(decoded, np.where(is_control, silence[None, :], raw))
        assert not np.isin(decoded, list(control)).any()


def test_replace_control_codes_on_one_frame(tiny_model):
    """The piece itself on a frame made of control codes and ordinary codes."""
    tts = tiny_model.tts_model
    control = np.array(tts.control_codes).astype(np.int32)
    silence = np.array(tts.codec_silence_tokens).astype(np.int32)
    q = silence.shape[0]
    raw = np.arange(q, dtype=np.int32) % 5
    raw[0], raw[q - 1] = control[0], control[2]
    out = np.array(replace_control_codes(raw, tts.control_codes, tts.codec_silence_tokens))
    want = raw.copy()
    want[0], want[q - 1] = silence[0], silence[q - 1]
    np.testing.assert_array_equal(out, want)


def test_offline_frame0_is_silence_under_both_numerics(models, question_wav):
    """Without a prompt, offline frame 0 is the codec silence codes (raw and decoded), as streaming
    frame 0, under both settings; every later frame of the two paths is equal too."""
    audio = question_wav[:16000]
    for model in models:
        silence = np.array(model.tts_model.codec_silence_tokens).astype(np.int32)
        assert silence.any()  # else silence and an all-zero row could not be told apart
        off = model.generate(audio)
        np.testing.assert_array_equal(off.raw_audio_codes[0], silence)
        np.testing.assert_array_equal(off.audio_codes[0], silence)
        stream = _stream(model, audio)
        np.testing.assert_array_equal(stream["raw"][0], silence)
        np.testing.assert_array_equal(off.raw_audio_codes[1 : len(stream["raw"])], stream["raw"][1:])
        # With a prompt, frame 0 is a generated frame in both paths.
        with_prompt = model.generate(audio, system_prompt=PROMPT)
        np.testing.assert_array_equal(
            with_prompt.raw_audio_codes[: len(stream["raw"])], _stream(model, audio, PROMPT)["raw"]
        )
