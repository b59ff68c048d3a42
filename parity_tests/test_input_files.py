"""Files as people have them (any rate, any channel count, WAV/FLAC/OGG) through the CLI and
generate(path); conventional output (16-bit PCM by default, float32 on request); the strict
streaming API; bundled sample names; progress bars only on a terminal.

Inputs are made here from the bundled 16 kHz sample with soxr and soundfile.
"""

from __future__ import annotations

import math
import os
import pty
import select
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import soundfile as sf
import soxr

from voicechat.cli.generate import to_pcm16
from voicechat.io.audio_input import read_audio_file, resolve_input_path
from voicechat.samples import sample_path


def _expected_length(n: int, rate: int, target: int = 16000) -> int:
    # soxr's output length: n * target / rate rounded to nearest, halves up (measured over
    # 8 rates x 1000 lengths, including exact halves such as 7 samples at 32 kHz -> 3.5 -> 4).
    return math.floor(n * target / rate + 0.5)


def _cli(*args, **kw):
    return subprocess.run(
        [sys.executable, "-m", "voicechat.cli", *args], capture_output=True, text=True, timeout=300, check=False, **kw
    )


@pytest.fixture(scope="module")
def x16(question_wav):
    return question_wav


@pytest.fixture(scope="module")
def stereo44(tmp_path_factory, x16):
    """44.1 kHz stereo float WAV with L = x, R = 0.5 x: the channel mean is 0.75 x."""
    x44 = soxr.resample(x16, 16000, 44100, quality="HQ")
    p = tmp_path_factory.mktemp("in") / "question44.wav"
    sf.write(p, np.stack([x44, 0.5 * x44], axis=1), 44100, subtype="FLOAT")
    return p, x44


@pytest.fixture(scope="module")
def mono48_flac(tmp_path_factory, x16):
    x48 = soxr.resample(x16, 16000, 48000, quality="HQ")
    p = tmp_path_factory.mktemp("in") / "question48.flac"
    sf.write(p, x48, 48000, subtype="PCM_16")
    return p, x48


@pytest.mark.parametrize(
    "rate,n", [(44100, 95047), (48000, 103452), (22050, 1001), (32000, 7), (8000, 5), (96000, 12345), (11025, 29)]
)
def test_resampled_length(tmp_path, rate, n):
    p = tmp_path / "in.wav"
    sf.write(p, np.random.default_rng(0).uniform(-0.5, 0.5, n).astype(np.float32), rate, subtype="FLOAT")
    y = read_audio_file(p, 16000, report=False)
    assert y.dtype == np.float32 and y.ndim == 1
    assert y.size == _expected_length(n, rate)


def test_ogg_and_many_channels(tmp_path, x16):
    x22 = soxr.resample(x16, 16000, 22050, quality="HQ")
    p = tmp_path / "q.ogg"
    sf.write(p, np.stack([x22, x22, x22], axis=1), 22050, format="OGG", subtype="VORBIS")
    y = read_audio_file(p, 16000, report=False)
    assert y.size == _expected_length(x22.size, 22050) == x16.size
    # Vorbis is lossy: the signal is kept up to its coding noise (measured -24 dB here; bound -20 dB).
    assert np.sqrt(np.mean((y - x16) ** 2)) < 0.1 * np.sqrt(np.mean(x16**2))


def test_stereo_downmix_is_channel_mean(stereo44, x16, capsys):
    p, x44 = stereo44
    y = read_audio_file(p, 16000)
    assert (
        capsys.readouterr().err.strip()
        == "question44.wav: 44100 Hz stereo -> 16000 Hz mono (mean of 2 channels, soxr HQ)"
    )
    assert y.size == _expected_length(x44.size, 44100) == x16.size == 34484
    # Mean first, then one resampling: fl(x + 0.5x) / 2 differs from 0.75x by one float32
    # rounding (<= 2^-24 relative); soxr is linear with a filter gain ~1, so 1e-6 is ample.
    want = soxr.resample(np.float32(0.75) * x44, 44100, 16000, quality="HQ")
    np.testing.assert_allclose(y, want, rtol=0, atol=1e-6)
    # And back at 16 kHz it is 0.75 x up to the round trip's band edge (L alone would be 1.0,
    # the sum 1.5): least-squares gain within 1e-3.
    gain = float(np.dot(y, x16) / np.dot(x16, x16))
    assert abs(gain - 0.75) < 1e-3, gain


def test_flac_48k_mono(mono48_flac, x16, capsys):
    p, x48 = mono48_flac
    y = read_audio_file(p, 16000)
    assert capsys.readouterr().err.strip() == "question48.flac: 48000 Hz mono -> 16000 Hz mono (soxr HQ)"
    assert y.size == _expected_length(x48.size, 48000) == x16.size
    # PCM_16 storage adds <= 2^-16 per sample; the 16k -> 48k -> 16k round trip loses only
    # the band edge above soxr HQ's passband: measured max |y - x| 0.005 on this speech.
    assert np.max(np.abs(y - x16)) < 0.01


def test_16k_mono_file_untouched(tmp_path, x16, capsys):
    p = tmp_path / "plain.wav"
    sf.write(p, x16, 16000, subtype="FLOAT")
    y = read_audio_file(p, 16000)
    assert capsys.readouterr().err == ""  # nothing done, nothing said
    assert y.tobytes() == x16.tobytes()


def test_generate_path_converts(tiny_model, stereo44, mono48_flac, capsys):
    """generate(path) takes any file; generate(array) stays strict about the shape."""
    p, _ = stereo44
    a = tiny_model.generate(str(p))
    b = tiny_model.generate(read_audio_file(p, 16000, report=False))
    assert a.audio.tobytes() == b.audio.tobytes()
    assert "44100 Hz stereo -> 16000 Hz mono" in capsys.readouterr().err
    with pytest.raises(ValueError, match="mono"):
        tiny_model.generate(np.stack([b.audio, b.audio], axis=1))


@pytest.mark.parametrize("which", ["stereo44", "mono48_flac"])
def test_cli_generate_any_file(request, tmp_path, tiny_ckpt, tiny_model, which):
    p, _ = request.getfixturevalue(which)
    out = tmp_path / "out.wav"
    r = _cli(
        "generate", "-m", str(tiny_ckpt), "--audio", str(p), "--output-audio", str(out), "--output-format", "float32"
    )
    assert r.returncode == 0, r.stderr
    assert f"{p.name}: {44100 if which == 'stereo44' else 48000} Hz" in r.stderr
    assert "-> 16000 Hz mono" in r.stderr
    data, sr = sf.read(out, dtype="float32")
    assert sf.info(out).subtype == "FLOAT" and sr == 22050
    # the run is the model's output for the converted input, sample for sample
    want = tiny_model.generate(read_audio_file(p, 16000, report=False)).audio
    assert data.tobytes() == want.tobytes()
    assert data.size == (math.ceil(34484 / 1280) + 1) * 24  # offline: K + 1 frames of 24 samples


def test_cli_default_input_and_pcm16_output(tmp_path, tiny_ckpt, tiny_model, question_wav):
    """No --audio: the bundled question.wav; no --output-format: 16-bit PCM."""
    pcm, flt = tmp_path / "pcm.wav", tmp_path / "flt.wav"
    r = _cli("generate", "-m", str(tiny_ckpt), "--output-audio", str(pcm))
    assert r.returncode == 0, r.stderr
    assert "input 2.16 s" in r.stderr and "pcm16" in r.stderr
    r = _cli("generate", "-m", str(tiny_ckpt), "--output-audio", str(flt), "--output-format", "float32")
    assert r.returncode == 0, r.stderr
    assert sf.info(pcm).subtype == "PCM_16" and sf.info(flt).subtype == "FLOAT"
    f, _ = sf.read(flt, dtype="float32")
    assert f.tobytes() == tiny_model.generate(question_wav).audio.tobytes()
    q, _ = sf.read(pcm, dtype="int16")
    # PCM16 rule: round(x * 32768) to nearest, saturated to [-32768, 32767].
    np.testing.assert_array_equal(q, np.clip(np.round(f.astype(np.float64) * 32768), -32768, 32767))
    # so inside [-1, 32767/32768] the file is within half a step (1/65536) of the float samples
    inside = (f >= -1) & (f <= 32767 / 32768)
    assert np.max(np.abs(q[inside] / 32768.0 - f[inside])) <= 0.5 / 32768


def test_pcm16_rounding_and_clipping():
    x = np.array(
        [0.0, 0.5 / 32768, 1.5 / 32768, -0.5, 32767 / 32768, 1.0, 1.7, -1.0, -1.2, -32768.6 / 32768], np.float32
    )
    q, clipped = to_pcm16(x)
    assert q.tolist() == [0, 0, 2, -16384, 32767, 32767, 32767, -32768, -32768, -32768]
    assert clipped == 4  # 1.0, 1.7, -1.2, -32769/32768: -1.0 itself is representable
    with pytest.raises(ValueError, match="NaN or infinite"):
        to_pcm16(np.array([0.0, np.nan], np.float32))


def test_cli_bad_output_format_and_missing_input(tmp_path, tiny_ckpt):
    r = _cli("generate", "-m", str(tiny_ckpt), "--output-audio", str(tmp_path / "o.wav"), "--output-format", "mp3")
    assert r.returncode == 2 and "invalid choice: 'mp3'" in r.stderr
    r = _cli(
        "generate",
        "-m",
        str(tiny_ckpt),
        "--audio",
        str(tmp_path / "nope.wav"),
        "--output-audio",
        str(tmp_path / "o.wav"),
    )
    assert r.returncode == 2 and "nope.wav: no such audio file" in r.stderr
    assert not (tmp_path / "o.wav").exists()


def test_bundled_names(tmp_path, monkeypatch, question_wav):
    monkeypatch.chdir(tmp_path)
    assert resolve_input_path("question.wav") == sample_path("question")
    assert resolve_input_path("long_question") == sample_path("long_question")
    assert resolve_input_path("other/question.wav") == Path("other/question.wav")  # only bare names
    assert resolve_input_path("answer.wav") == Path("answer.wav")  # not a sample: fails later as missing
    # a file of that name where the user is takes precedence over the bundled one
    sf.write(tmp_path / "question.wav", np.zeros(16, np.float32), 16000)
    assert resolve_input_path("question.wav").resolve() == (tmp_path / "question.wav").resolve()
    # the parity harness reads the bundled name too
    from harness.engine import read_input

    (tmp_path / "empty").mkdir()
    monkeypatch.chdir(tmp_path / "empty")
    wave, name = read_input("question.wav")
    assert name == "question.wav" and wave.tobytes() == question_wav.tobytes()


def test_session_stays_strict_at_44k(tiny_model, question_wav):
    """The streaming API never resamples: 44.1 kHz is refused, and the session is still usable."""
    x44 = soxr.resample(question_wav, 16000, 44100, quality="HQ")
    s = tiny_model.create_streaming_session()
    ref = tiny_model.create_streaming_session()
    ev = s.push_audio(question_wav[:1280])
    with pytest.raises(ValueError, match=r"16000 Hz, got sample_rate=44100.*nothing is resampled"):
        s.push_audio(x44[:3528], sample_rate=44100)
    ev += s.push_audio(question_wav[1280:2560]) + s.flush()
    ev_ref = ref.push_audio(question_wav[:1280]) + ref.push_audio(question_wav[1280:2560]) + ref.flush()
    assert ev == ev_ref
    asr = tiny_model.create_asr_session()
    with pytest.raises(ValueError, match="16000 Hz"):
        asr.step(x44[:3528], sample_rate=44100)


# --------------------------------------------------------------------------- progress bars


def _run_on_pty(args, env=None) -> str:
    """Run with stderr on a pseudo-terminal (stdout piped); return what reached the terminal."""
    master, slave = pty.openpty()
    p = subprocess.Popen([sys.executable, "-m", "voicechat.cli", *args], stdout=subprocess.PIPE, stderr=slave, env=env)
    os.close(slave)
    chunks = []
    while True:
        r, _, _ = select.select([master], [], [], 120)
        if not r:
            break
        try:
            b = os.read(master, 65536)
        except OSError:  # EIO once the child closed its end
            break
        if not b:
            break
        chunks.append(b)
    p.wait(timeout=120)
    os.close(master)
    assert p.returncode == 0, b"".join(chunks).decode(errors="replace")
    return b"".join(chunks).decode(errors="replace")


def test_progress_bar_on_terminal_only(tmp_path, tiny_ckpt):
    # on a terminal: the synthetic writer's bar (tensors) and the loading and generating bars
    tty = _run_on_pty(["synth", str(tmp_path / "a"), "--preset", "tiny"])
    assert "synth tiny" in tty and "tensor" in tty
    tty = _run_on_pty(["generate", "-m", str(tiny_ckpt), "--output-audio", str(tmp_path / "o.wav")])
    assert "loading" in tty and "generating" in tty and "frame" in tty
    # --quiet on a terminal: no bar
    tty = _run_on_pty(["synth", str(tmp_path / "b"), "--preset", "tiny", "--quiet"])
    assert "synth tiny" not in tty and "tensor" not in tty
    tty = _run_on_pty(["generate", "-m", str(tiny_ckpt), "--output-audio", str(tmp_path / "o.wav"), "--quiet"])
    assert "generating" not in tty and "loading" not in tty and "wrote" in tty
    # stderr not a terminal: no bar, no carriage returns
    r = _cli("synth", str(tmp_path / "c"), "--preset", "tiny")
    assert r.returncode == 0 and "tensor" not in r.stderr and "\r" not in r.stderr
    r = _cli("generate", "-m", str(tiny_ckpt), "--output-audio", str(tmp_path / "o.wav"))
    assert r.returncode == 0 and "generating" not in r.stderr and "\r" not in r.stderr


# --------------------------------------------------------------------------- parity and bench inputs


def test_parity_cli_reads_any_file(tmp_path, tiny_ckpt, stereo44, capsys):
    import json

    from voicechat.cli.main import main

    p, x44 = stereo44
    assert main(["parity", "-m", str(tiny_ckpt), "--audio", str(p), "--out", str(tmp_path), "--no-components"]) == 0
    assert "question44.wav: 44100 Hz stereo -> 16000 Hz mono (mean of 2 channels, soxr HQ)" in capsys.readouterr().err
    (report,) = tmp_path.glob("*.json")
    header = json.loads(report.read_text())["header"]
    assert header["input_name"] == "question44.wav"
    assert header["input_samples"] == _expected_length(x44.size, 44100) == 34484


def test_bench_cli_audio_defaults_and_names(monkeypatch, tmp_path):
    import bench.runner
    import voicechat.io.progress
    from voicechat.cli.main import main

    seen = []

    def fake_run_bench(opts, progress=None):
        seen.append(list(opts.audio))
        raise ValueError("stop here")  # the CLI turns it into exit status 2

    monkeypatch.setattr(bench.runner, "run_bench", fake_run_bench)
    monkeypatch.setitem(voicechat.io.progress._state, "quiet", False)  # --quiet below must not leak to other tests
    monkeypatch.chdir(tmp_path)
    assert main(["bench", "-m", "ckpt", "--quiet", "--out", str(tmp_path / "a")]) == 2
    assert (
        main(
            ["bench", "-m", "ckpt", "--audio", "question.wav", "--audio", "long_question", "--out", str(tmp_path / "b")]
        )
        == 2
    )
    assert seen == [
        [str(sample_path("long_question"))],
        [str(sample_path("question")), str(sample_path("long_question"))],
    ]


def test_base_install_without_serve_extra(monkeypatch, tmp_path, tiny_ckpt, capsys):
    """`pip install -e .` has no server packages: generate works, serve says what to install."""
    import voicechat.io.progress
    from voicechat.cli.main import main

    monkeypatch.setitem(voicechat.io.progress._state, "quiet", False)  # --quiet below must not leak to other tests
    monkeypatch.setitem(sys.modules, "voicechat.cli.serve", None)  # its import now raises ImportError
    assert main(["generate", "-m", str(tiny_ckpt), "--output-audio", str(tmp_path / "o.wav"), "--quiet"]) == 0
    assert sf.info(tmp_path / "o.wav").subtype == "PCM_16"
    assert main(["serve"]) == 2
    assert "needs the `serve` extra" in capsys.readouterr().err
