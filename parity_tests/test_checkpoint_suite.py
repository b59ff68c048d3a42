"""Acceptance on a real (or any on-disk) checkpoint: `pytest -m checkpoint`.

Env-gated: VOICECHAT_CHECKPOINT_4BIT, VOICECHAT_CHECKPOINT_8BIT, VOICECHAT_CHECKPOINT_BF16 each name
a local folder or a Hugging Face repo id (e.g. mlx-community/NemotronLabs-VoiceChat-11B-4bit).
Unset variables skip their parameter with the reason. CI points them at synthetic checkpoints
written to disk so this code runs on every push.
"""

import os

import numpy as np
import pytest

import voicechat

pytestmark = pytest.mark.checkpoint

VARIANTS = ["4BIT", "8BIT", "BF16"]


def _spec(variant):
    return os.environ.get(f"VOICECHAT_CHECKPOINT_{variant}")


@pytest.fixture(scope="module", params=VARIANTS)
def model(request):
    spec = _spec(request.param)
    if not spec:
        pytest.skip(f"VOICECHAT_CHECKPOINT_{request.param} is not set (a checkpoint folder or repo id)")
    return voicechat.load(spec)


@pytest.fixture(scope="module")
def five_seconds(long_question_wav):
    return long_question_wav[: 5 * 16000]


@pytest.fixture(scope="module")
def runs(model, five_seconds):
    off = model.generate(five_seconds)
    s = model.create_streaming_session(profile=True)
    events = []
    for i in range(0, len(five_seconds), 1280):
        events += s.push_audio(five_seconds[i : i + 1280])
    events += s.flush()
    return off, s, events


def test_streaming_first_frame_matches_offline(model, runs):
    off, s, events = runs
    first = next(e for e in events if e.kind == "audio")
    assert first.frame_index == 0
    assert s.text_ids[0] == off.text_tokens[0]
    assert s.function_ids[0] == off.function_tokens[0]
    np.testing.assert_array_equal(first.audio_codes, off.audio_codes[0])


def test_streamed_text_equals_offline(model, runs):
    off, s, _ = runs
    k = len(s.text_ids)
    np.testing.assert_array_equal(np.array(s.text_ids), off.text_tokens[:k])
    skip = model.config.special_text_ids
    assert s.text.text == model.tokenizer.decode([int(i) for i in off.text_tokens[:k] if int(i) not in skip])


def test_wav_length(model, runs, five_seconds):
    _, _s, events = runs
    ratio = model.config.codec_config.waveform_to_token_ratio
    frames = int(np.ceil(len(five_seconds) / model.config.frame_samples))
    audio = [e for e in events if e.kind == "audio"]
    tail = [e for e in events if e.kind == "audio_tail"]
    assert len(audio) == frames and len(tail) == 1
    total = sum(len(e.samples) for e in audio) + len(tail[0].samples)
    assert total == frames * ratio + model.tts_model.audio_codec.lead_in


def test_profiler_numbers_finite(runs):
    _, s, _ = runs
    summary = s.profile.summary(drop_first=5)
    for stage in ("perception", "rnnt", "language", "tts", "codec", "total"):
        for stat in ("mean_ms", "p50_ms", "p95_ms", "max_ms"):
            assert np.isfinite(summary[stage][stat]) and summary[stage][stat] >= 0
    assert np.isfinite(summary["realtime_factor"]) and summary["realtime_factor"] > 0
