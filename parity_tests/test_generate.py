"""Offline generation, generate_stream chunking, and the CLI end to end."""

import hashlib
import subprocess
import sys

import numpy as np
import pytest
import soundfile as sf


def test_generate_result_shapes(tiny_model, question_wav):
    r = tiny_model.generate(question_wav, extra_decoding_seconds=0.5)
    cfg = tiny_model.config
    n = len(question_wav) + 8000
    frames = 1 + ((n // 160 + 1) - 1) // 8 + (1 if ((n // 160 + 1) - 1) % 8 else 0)
    assert r.text_tokens.shape == (frames,) and r.text_tokens.dtype == np.int32
    assert r.audio_codes.shape == (frames, cfg.tts_config.num_quantizers)
    assert r.audio.shape == (frames * cfg.codec_config.waveform_to_token_ratio,)
    assert r.audio.dtype == np.float32 and np.isfinite(r.audio).all()
    assert r.sample_rate == 22050
    # frame 0 without a prompt: the codec silence codes, as in streaming (test_numerics.py)
    np.testing.assert_array_equal(r.raw_audio_codes[0], np.array(tiny_model.tts_model.codec_silence_tokens))


def test_generate_deterministic_and_seeded(tiny_model, question_wav):
    a = tiny_model.generate(question_wav, seed=3)
    b = tiny_model.generate(question_wav, seed=3)
    c = tiny_model.generate(question_wav, seed=4)
    np.testing.assert_array_equal(a.audio_codes, b.audio_codes)
    assert a.audio.tobytes() == b.audio.tobytes()
    assert not np.array_equal(a.audio_codes, c.audio_codes)  # non-degenerate sampling


def test_max_frames(tiny_model, question_wav):
    r = tiny_model.generate(question_wav, max_frames=5)
    assert r.text_tokens.shape == (5,)
    with pytest.raises(ValueError, match="max_frames"):
        tiny_model.generate(question_wav, max_frames=1)


@pytest.mark.parametrize(
    "bad,exc",
    [
        (np.zeros(0, np.float32), ValueError),
        (np.zeros((10, 2)), ValueError),
        ([float("nan")] * 400, ValueError),
        ("/no/such.wav", FileNotFoundError),
    ],
)
def test_generate_bad_audio(tiny_model, bad, exc):
    with pytest.raises(exc):
        tiny_model.generate(bad)


@pytest.mark.parametrize("prompt", [None, "be brief"])
def test_generate_stream_chunks_equal_generate(tiny_model_4bit, question_wav, prompt):
    ref = tiny_model_4bit.generate(question_wav, system_prompt=prompt)
    codec = tiny_model_4bit.tts_model.audio_codec
    outs = {}
    for chunk in (1, 6, 25, 10_000):
        chunks = list(tiny_model_4bit.generate_stream(question_wav, chunk_frames=chunk, system_prompt=prompt))
        assert chunks[0].first_frame == 0 and chunks[-1].last_frame == ref.text_tokens.size - 1
        outs[chunk] = np.concatenate([c.samples for c in chunks])
    for chunk, audio in outs.items():
        assert audio.shape == ref.audio.shape, chunk
        assert audio.tobytes() == outs[1].tobytes()
        w = codec.warmup_samples
        assert np.max(np.abs(audio[w:] - ref.audio[w:])) <= 1e-5
    # generate() is unchanged by having run generate_stream (same draws, same order)
    again = tiny_model_4bit.generate(question_wav, system_prompt=prompt)
    assert again.audio.tobytes() == ref.audio.tobytes()


def _cli(*args, env=None):
    return subprocess.run(
        [sys.executable, "-m", "voicechat.cli", *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
        check=False,
    )


def test_cli_generate_offline_and_stream(tmp_path, tiny_ckpt, question_wav):
    from voicechat.samples import sample_path

    wav = str(sample_path("question"))
    out1, out2, out3 = tmp_path / "a.wav", tmp_path / "b.wav", tmp_path / "c.wav"
    r = _cli("generate", "-m", str(tiny_ckpt), "--audio", wav, "--output-audio", str(out1))
    assert r.returncode == 0, r.stderr
    data, sr = sf.read(out1, dtype="float32")
    frames = int(np.ceil(len(question_wav) / 1280)) + 1  # offline: K + 1 frames
    assert sr == 22050 and data.shape == (frames * 24,)
    r = _cli("generate", "-m", str(tiny_ckpt), "--audio", wav, "--output-audio", str(out2), "--stream", "--profile")
    assert r.returncode == 0, r.stderr
    assert "real-time factor" in r.stdout
    data, sr = sf.read(out2, dtype="float32")
    assert data.shape == ((frames - 1) * 24 + 8,)  # streamed frames * samples + codec tail
    # byte-identical across processes
    r = _cli("generate", "-m", str(tiny_ckpt), "--audio", wav, "--output-audio", str(out3), "--stream")
    assert r.returncode == 0, r.stderr
    assert hashlib.sha256(out2.read_bytes()).digest() == hashlib.sha256(out3.read_bytes()).digest()


def test_cli_generate_numerics(tmp_path, tiny_ckpt, question_wav):
    """`--numerics float32` reaches voicechat.load: the CLI's exact samples equal generate() of a
    float32 model, and differ from the default (reference) model's codes-driven audio."""
    import voicechat
    from voicechat.samples import sample_path

    out = tmp_path / "f32.wav"
    r = _cli(
        "generate",
        "-m",
        str(tiny_ckpt),
        "--audio",
        str(sample_path("question")),
        "--output-audio",
        str(out),
        "--output-format",
        "float32",
        "--numerics",
        "float32",
    )
    assert r.returncode == 0, r.stderr
    data, _ = sf.read(out, dtype="float32")
    f32 = voicechat.load(tiny_ckpt, numerics="float32").generate(question_wav)
    ref = voicechat.load(tiny_ckpt).generate(question_wav)
    assert not np.array_equal(f32.audio_codes, ref.audio_codes)  # else this test could not tell them apart
    assert data.tobytes() == f32.audio.astype(np.float32).tobytes()
    r = _cli("generate", "--numerics", "fp16", "--output-audio", str(out))
    assert r.returncode != 0 and "invalid choice" in r.stderr


# Other sample rates and channel counts are converted by the CLI: parity_tests/test_input_files.py.
