"""The mlx-audio peer backend (`harness/backends/mlx_audio_backend.py`, `-m peers`, needs the peers extra).

What is checked: mlx-audio's own VoiceChat loads a published-layout folder with no network (a translated
config, every hard-coded value checked, a strict load that names what mlx-audio's `strict=False` lets
through); a value mlx-audio hard-codes differently is refused by key; on a float32 checkpoint (greedy
sampling) every observation equals mlx-vlm's bit for bit, offline and streamed; on the tiny 4-bit
checkpoint the language path (ids, logits, mel, encoder, RNNT) equals mlx-vlm's bit for bit while the
codes differ from the first TTS step, and equal mlx-vlm's on every frame once mlx-audio's four known
departures are undone in memory (docs/peers.md, "mlx-audio"). No tolerance: every comparison is exact
(the two implementations share the codec, conformer, mel and Nemotron-H code paths bit for bit).
"""

from __future__ import annotations

import json
import os

import numpy as np
import pytest

pytest.importorskip("mlx_vlm")
pytest.importorskip("mlx_audio")
pytestmark = pytest.mark.peers
os.environ["HF_HUB_OFFLINE"] = "1"  # mlx-audio's own loader would reach the hub; ours must not
os.environ["TRANSFORMERS_OFFLINE"] = "1"

import mlx.nn as nn  # noqa: E402

from harness.backends import get_backend  # noqa: E402
from harness.backends.mlx_audio_backend import (  # noqa: E402
    TOKENIZER_BUFFERS,
    MlxAudioBackend,
    UnsupportedCheckpoint,
    departures_undone,
)

from .independent_writer import Spec, write  # noqa: E402

FRAME = 1280


@pytest.fixture(scope="module")
def clip(question_wav):
    return question_wav[: 12 * FRAME].copy()


@pytest.fixture(scope="module")
def f32_ckpt(tmp_path_factory):
    """Float32, greedy sampling (top_p 1e-6, noise 0), 31 codebooks, as CI's `ind-f32`."""
    return write(tmp_path_factory.mktemp("ma_f32"), Spec(dtype="float32", control_inside=False))


def _runs(backend, clip, prompt):
    return (
        backend.offline(clip, system_prompt=prompt, with_logits=True),
        backend.stream(clip, system_prompt=prompt, with_logits=True),
    )


@pytest.fixture(scope="module")
def pair_f32(f32_ckpt, clip):
    out = {}
    for name in ("mlx-vlm", "mlx-audio"):
        b = get_backend(name)
        b.load(f32_ckpt)
        out[name] = {p: _runs(b, clip, p) for p in (None, "hello")}
        out[name + ":report"] = getattr(b, "load_report", None)
        b.close()
    return out


@pytest.fixture(scope="module")
def audio4(tiny_ckpt_4bit):
    b = get_backend("mlx-audio")
    b.load(tiny_ckpt_4bit)
    yield b
    b.close()


@pytest.fixture(scope="module")
def vlm4_runs(tiny_ckpt_4bit, clip):
    b = get_backend("mlx-vlm")
    b.load(tiny_ckpt_4bit)
    out = {p: _runs(b, clip, p) for p in (None, "hello")}
    quantized = {n for n, m in b.model.named_modules() if isinstance(m, (nn.QuantizedLinear, nn.QuantizedEmbedding))}
    b.close()
    return out, quantized


def _first_diff(a, b):
    a, b = np.asarray(a), np.asarray(b)
    assert a.shape == b.shape, (a.shape, b.shape)
    bad = np.nonzero((a != b).reshape(len(a), -1).any(1))[0] if len(a) else []
    return None if len(bad) == 0 else int(bad[0])


FIELDS = (
    "text_ids",
    "function_ids",
    "codes",
    "decoded_codes",
    "transcript_tokens",
    "mel",
    "encoder",
    "text_logits",
    "function_logits",
)
LANGUAGE_FIELDS = ("text_ids", "function_ids", "transcript_tokens", "mel", "encoder", "text_logits", "function_logits")


def test_loads_offline_and_strictly(audio4, vlm4_runs):
    """No hub access (HF_HUB_OFFLINE=1; mlx-audio's loader would fetch the LM config and tokenizer); the
    only tensors mlx-audio's strict=False would let through are the two tokenizer buffers, sized for the
    published 131072-entry vocabulary in the checkpoint and by the LM vocabulary (512) in mlx-audio."""
    assert os.environ.get("HF_HUB_OFFLINE") == "1"
    lt = audio4.load_report["let_through_by_strict_false"]
    assert {d["tensor"]: (d["problem"], d["expected"], d["checkpoint"]) for d in lt} == {
        TOKENIZER_BUFFERS[0]: ("shape", (513,), (131073,)),
        TOKENIZER_BUFFERS[1]: ("shape", (512,), (131072,)),
    }
    assert audio4.model.config.llm.vocab_size == 512 and len(audio4.model.stt_model.llm.layers) == 4
    # the same modules quantized as in mlx-vlm (the folder's `.scales` decide in both loaders)
    quantized = {
        n for n, m in audio4.model.named_modules() if isinstance(m, (nn.QuantizedLinear, nn.QuantizedEmbedding))
    }
    assert quantized == vlm4_runs[1] and quantized
    # rebuilt from the tokenizer: special flags equal the stored ones, continuation flags do not
    buf = audio4.load_report["tokenizer_buffers"]
    assert buf[TOKENIZER_BUFFERS[1]]["n_differing"] == 0
    assert buf[TOKENIZER_BUFFERS[0]]["n_differing"] > 0
    assert audio4.samples_per_frame == 24 and audio4.lead_in == 8


def _copy_with_config(src, dst, edit):
    dst.mkdir()
    for f in src.iterdir():
        if f.name != "config.json":
            os.symlink(f, dst / f.name)
    cfg = json.loads((src / "config.json").read_text())
    edit(cfg)
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst


@pytest.mark.parametrize(
    "key,edit",
    [
        (
            "tts_config.character_encoder.num_hidden_layers",
            lambda c: c["tts_config"]["character_encoder"].__setitem__("num_hidden_layers", 2),
        ),
        ("tts_config.rope_local_base_freq", lambda c: c["tts_config"].__setitem__("rope_local_base_freq", 5000.0)),
        ("pad_token_id", lambda c: c.__setitem__("pad_token_id", 13)),
        ("tts_config.mog_head.eps", lambda c: c["tts_config"]["mog_head"].__setitem__("eps", 1e-5)),
        (
            "audio_config.preprocessor.pad_mode",
            lambda c: c["audio_config"]["preprocessor"].__setitem__("pad_mode", "constant"),
        ),
    ],
)
def test_refuses_a_value_mlx_audio_hard_codes(tiny_ckpt_4bit, tmp_path, key, edit):
    folder = _copy_with_config(tiny_ckpt_4bit, tmp_path / "edited", edit)
    with pytest.raises(UnsupportedCheckpoint) as e:
        MlxAudioBackend().load(folder)
    assert e.value.key == key and key in str(e.value)


def test_refuses_a_tensor_its_loader_would_let_through(tiny_ckpt_4bit, tmp_path):
    import mlx.core as mx

    folder = _copy_with_config(tiny_ckpt_4bit, tmp_path / "extra", lambda c: None)
    mx.save_safetensors(str(folder / "extra.safetensors"), {"stt_model.lm_head.stray": mx.zeros((2,))})
    with pytest.raises(ValueError, match=r"stt_model\.lm_head\.stray \(unexpected\)"):
        MlxAudioBackend().load(folder)


@pytest.mark.parametrize("prompt", [None, "hello"])
@pytest.mark.parametrize("path", [0, 1], ids=["offline", "streamed"])
def test_float32_every_observation_equals_mlx_vlm(pair_f32, prompt, path):
    a, b = pair_f32["mlx-vlm"][prompt][path], pair_f32["mlx-audio"][prompt][path]
    assert len(a.text_ids) == len(b.text_ids) == (13 if path == 0 else 12)
    for f in FIELDS:
        assert _first_diff(getattr(a, f), getattr(b, f)) is None, f
    assert np.array_equal(a.audio, b.audio)  # the same codec on the same codes
    assert b.transcript == a.transcript
    # agent text: mlx-audio strips its offline text (session.py:42), mlx-vlm does not; streams agree
    assert b.text == (a.text.strip() if path == 0 else a.text)
    assert pair_f32["mlx-audio:report"]["tokenizer_buffers"][TOKENIZER_BUFFERS[0]]["n_differing"] == 0


@pytest.mark.parametrize("prompt", [None, "hello"])
def test_4bit_language_path_equal_codes_differ_until_the_departures_are_undone(audio4, vlm4_runs, clip, prompt):
    ref_off, ref_st = vlm4_runs[0][prompt]
    off, st = _runs(audio4, clip, prompt)
    for ours, ref in ((off, ref_off), (st, ref_st)):
        for f in LANGUAGE_FIELDS:
            assert _first_diff(getattr(ours, f), getattr(ref, f)) is None, f
        # the first TTS step: audio frame 1 without a prompt (frame 0 is the silence / zero row), frame 0
        # with one (the prompt's positions ran a TTS step before it)
        assert _first_diff(ours.codes, ref.codes) == (1 if prompt is None else 0)
    with departures_undone(audio4):
        off, st = _runs(audio4, clip, prompt)
    assert (
        _first_diff(off.codes, ref_off.codes) is None and _first_diff(off.decoded_codes, ref_off.decoded_codes) is None
    )
    assert _first_diff(st.codes, ref_st.codes) is None and _first_diff(st.decoded_codes, ref_st.decoded_codes) is None
    assert np.array_equal(st.audio, ref_st.audio)
    # and nothing stays patched
    again = audio4.offline(clip, system_prompt=prompt)
    assert _first_diff(again.codes, ref_off.codes) == (1 if prompt is None else 0)
