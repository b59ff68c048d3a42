"""Streaming ASR session: transcript equal to offline byte for byte for any push sizes."""

import numpy as np
import pytest

from voicechat.errors import SessionClosedError
from voicechat.streaming.generate import offline_perception, offline_transcript


def offline_text(model, audio):
    return offline_transcript(model, offline_perception(model, audio).encoder)


def stream_text(model, audio, push):
    s = model.create_asr_session()
    deltas = [s.step(audio[i : i + push]) for i in range(0, len(audio), push)]
    deltas.append(s.finish())
    assert "".join(deltas) == s.text  # deltas add up to the transcript
    return s


@pytest.fixture(scope="module")
def noise():
    return (0.1 * np.random.default_rng(7).standard_normal(3 * 16000 + 333)).astype(np.float32)


@pytest.mark.parametrize("push", [7, 160, 300, 1280, 4000, None])
@pytest.mark.parametrize("which", ["question_wav", "long_question_wav", "noise"])
def test_push_sizes_equal_offline(request, tiny_model_4bit, which, push):
    audio = request.getfixturevalue(which)
    tokens, text = offline_text(tiny_model_4bit, audio)
    s = stream_text(tiny_model_4bit, audio, push or len(audio))
    assert s.tokens == tokens
    assert s.text == text
    assert text  # the synthetic RNNT emits something on these inputs


def test_single_sample_pushes(tiny_model_4bit, question_wav):
    audio = question_wav[:8000]
    _, text = offline_text(tiny_model_4bit, audio)
    assert stream_text(tiny_model_4bit, audio, 1).text == text


def test_bad_input_and_lifecycle(tiny_model_4bit, question_wav):
    s = tiny_model_4bit.create_asr_session()
    with pytest.raises(ValueError, match="mono"):
        s.step(np.zeros((100, 2), np.float32))
    with pytest.raises(ValueError, match="16000 Hz"):
        s.step(question_wav[:100], sample_rate=8000)
    with pytest.raises(ValueError, match="NaN"):
        s.step(np.array([0.0, np.inf], np.float32))
    assert s.step(np.zeros(0, np.float32)) == ""
    pcm = np.round(question_wav * 32767).astype(np.int16)
    s.step(pcm)  # int16 PCM is scaled by 1/32768
    s.finish()
    ref = tiny_model_4bit.create_asr_session()
    ref.step(pcm.astype(np.float32) / 32768.0)
    ref.finish()
    assert s.text == ref.text
    with pytest.raises(SessionClosedError):
        s.step(question_wav[:100])
    with pytest.raises(SessionClosedError):
        s.finish()


def test_too_short_audio_is_empty(tiny_model_4bit):
    s = tiny_model_4bit.create_asr_session()
    s.step(np.zeros(200, np.float32))
    assert s.finish() == "" and s.text == ""


def test_time_to_first_text_recorded(tiny_model_4bit, question_wav):
    s = stream_text(tiny_model_4bit, question_wav, 1280)
    assert s.first_text_latency_s is not None and s.first_text_latency_s >= 0
    assert len(s.frame_ms) == s.frames
