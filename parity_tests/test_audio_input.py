"""User audio validation rules shared by push_audio, generate, the ASR session and the CLI."""

import numpy as np
import pytest
import soundfile as sf

from voicechat.io.audio_input import as_mono_float32, check_sample_rate, load_audio, read_audio_file


def test_int_pcm_scaled():
    a = np.array([-32768, 0, 16384], dtype=np.int16)
    np.testing.assert_array_equal(as_mono_float32(a), np.array([-1.0, 0.0, 0.5], np.float32))
    b = np.array([-(2**31), 2**30], dtype=np.int32)
    np.testing.assert_array_equal(as_mono_float32(b), np.array([-1.0, 0.5], np.float32))


def test_float64_and_lists_converted():
    out = as_mono_float32(np.array([0.25, -0.5], np.float64))
    assert out.dtype == np.float32 and out.tolist() == [0.25, -0.5]
    assert as_mono_float32([0.0, 0.5]).tolist() == [0.0, 0.5]


@pytest.mark.parametrize(
    "bad,exc,msg",
    [
        (np.zeros((10, 2), np.float32), ValueError, "mono"),
        (np.zeros((2, 10), np.float32), ValueError, "mono"),
        (np.zeros((10, 1), np.float32), ValueError, "1-D"),
        (np.array([0.0, np.nan], np.float32), ValueError, "NaN or infinite samples \\(first at index 1\\)"),
        (np.array([np.inf], np.float32), ValueError, "NaN or infinite"),
        (np.zeros(4, np.uint8), TypeError, "unsupported sample dtype uint8"),
        (np.zeros(4, np.int64), TypeError, "int16/int32"),
        (np.zeros(4, bool), TypeError, "unsupported"),
        ("file.wav", TypeError, "file reader"),
        (["a", "b"], TypeError, "list of numbers"),
        (3.0, TypeError, "1-D"),
    ],
)
def test_rejections(bad, exc, msg):
    with pytest.raises(exc, match=msg):
        as_mono_float32(bad)


def test_empty():
    assert as_mono_float32(np.zeros(0, np.float32)).size == 0
    with pytest.raises(ValueError, match="empty"):
        as_mono_float32(np.zeros(0, np.float32), allow_empty=False)


@pytest.mark.parametrize("rate", [8000, 22050, 44100, 48000, 16000.5])
def test_other_rates_refused(rate):
    with pytest.raises(ValueError, match="16000 Hz"):
        check_sample_rate(rate, 16000)


@pytest.mark.parametrize("rate", ["16000", None, True])
def test_mistyped_rate(rate):
    with pytest.raises(TypeError, match="sample_rate must be a number"):
        check_sample_rate(rate, 16000)


def test_files(tmp_path):
    p = tmp_path / "ok.wav"
    sf.write(p, np.full(160, 0.5, np.float32), 16000, subtype="PCM_16")
    np.testing.assert_allclose(read_audio_file(p, 16000), 0.5, atol=1 / 32768)
    # files at other rates / channel counts are converted (parity_tests/test_input_files.py)
    st = tmp_path / "stereo.wav"
    sf.write(st, np.stack([np.full(160, 0.5), np.full(160, 0.25)], 1).astype(np.float32), 16000, subtype="FLOAT")
    np.testing.assert_array_equal(read_audio_file(st, 16000, report=False), np.full(160, 0.375, np.float32))
    hi = tmp_path / "48k.wav"
    sf.write(hi, np.zeros(480, np.float32), 48000)
    assert read_audio_file(hi, 16000, report=False).size == 160
    with pytest.raises(ValueError, match="is a folder"):
        load_audio(tmp_path, 16000)
    junk = tmp_path / "junk.wav"
    junk.write_bytes(b"this is not a wav file at all")
    with pytest.raises(ValueError, match="not a readable audio file"):
        load_audio(junk, 16000)
    with pytest.raises(FileNotFoundError):
        load_audio(tmp_path / "missing.wav", 16000)
