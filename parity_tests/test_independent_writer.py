"""Checkpoints from the independent writer (parity_tests/independent_writer.py) load and stream.

The writer shares no code with `voicechat.synthetic` / `voicechat.io.checkpoint`:
its own tensor inventory from docs/model.md, its own trained byte-level BPE
tokenizer, MLX's `mx.quantize` for packing. Every layout it can write must
load with `voicechat.load`, stream, and give in the streamed path exactly the
offline path's text ids, function ids and codes on every common frame (the
stream has one frame less: the offline path also sees the centred last mel
frame), and the same audio over the common frames to float32 rounding
(1e-4: a float32 decode of identical codes in a different chunking; the
measured difference is ~1e-6).

Default suite: every quantization layout (dtype x bits x predicate) at the
tiny depth, plus the other axes (control codes outside the range, shipped
sampling, 6 codebooks) on one layout each. `-m slow`: the real depth.
"""

from __future__ import annotations

import numpy as np
import pytest

import voicechat

from .independent_writer import (
    Spec,
    config_dict,
    inventory,
    module_settings,
    quantized_modules_written,
    quantized_names,
    write,
)

CLIP_SAMPLES = 1280 * 6  # six streamed frames (the warm-up frame included)

LAYOUTS = [Spec(dtype=d) for d in ("float32", "bfloat16")] + [
    Spec(dtype=d, bits=b, predicate=p)
    for d in ("float32", "bfloat16")
    for b in (4, 8)
    for p in ("published", "mlx-vlm-runnable", "mlx-vlm-default")
]
OTHER_AXES = [
    Spec(bits=4, predicate="mlx-vlm-default", control_inside=False),
    Spec(bits=8, predicate="mlx-vlm-default", sampling="shipped"),
    Spec(bits=4, predicate="published", num_quantizers=6, codebook_size=32, sampling="shipped"),
    # Per-module config entries (8-bit group 32 down projections) and MLX's scale-only modes.
    Spec(bits=4, predicate="mlx-vlm-default", mixed=True),
    Spec(bits=4, predicate="mlx-vlm-default", mode="mxfp4"),
    Spec(bits=8, predicate="mlx-vlm-default", mode="mxfp8", dtype="float32"),
    Spec(bits=4, predicate="published", mode="nvfp4"),
]


def _stream(model, wav, prompt):
    session = model.create_streaming_session(system_prompt=prompt, seed=3)
    events = []
    for i in range(0, len(wav), 1280):
        events += session.push_audio(wav[i : i + 1280])
    events += session.flush()
    audio = [e for e in events if e.kind == "audio"]
    samples = np.concatenate([e.samples for e in events if e.kind in ("audio", "audio_tail")])
    return session, np.stack([e.audio_codes for e in audio]), samples


def check_stream_equals_offline(model, wav, prompt=None):
    off = model.generate(wav, system_prompt=prompt, seed=3)
    session, codes, streamed = _stream(model, wav, prompt)
    k = codes.shape[0]
    assert k >= 5 and off.text_tokens.shape[0] == k + 1
    np.testing.assert_array_equal(np.array(session.text_ids), off.text_tokens[:k])
    np.testing.assert_array_equal(np.array(session.function_ids), off.function_tokens[:k])
    np.testing.assert_array_equal(codes, off.audio_codes[:k])
    codec = model.tts_model.audio_codec
    ratio = codec.samples_per_frame
    edge = (model.config.codec_config.n_fft - model.config.codec_config.hop_length) // 2
    assert streamed.shape[0] == k * ratio + codec.lead_in  # audio events + the flushed tail
    a = streamed[codec.lead_in :][codec.warmup_samples : k * ratio - edge]
    b = off.audio[codec.warmup_samples : k * ratio - edge]
    assert a.size > 0 and np.isfinite(a).all()
    assert np.max(np.abs(a - b)) <= 1e-4
    return off, codes


def _quantized_in_model(model) -> set[str]:
    import mlx.nn as nn

    return {p for p, m in model.named_modules() if isinstance(m, (nn.QuantizedLinear, nn.QuantizedEmbedding))}


@pytest.fixture(scope="module")
def clip(question_wav):
    return question_wav[:CLIP_SAMPLES]


@pytest.mark.parametrize("spec", LAYOUTS + OTHER_AXES, ids=lambda s: s.name())
def test_layout_loads_and_streams_like_offline(tmp_path, spec, clip):
    folder = write(tmp_path / "ckpt", spec)
    model = voicechat.load(folder)
    # Exactly the modules whose scales are stored are quantized (docs/model.md §3.3).
    assert _quantized_in_model(model) == quantized_modules_written(folder)
    if spec.bits is not None:  # with the settings the files were packed with
        for path, m in model.named_modules():
            if path in quantized_modules_written(folder):
                want = module_settings(spec, path)
                assert (m.mode, m.group_size, m.bits) == (spec.mode, want["group_size"], want["bits"]), path
    _off, codes = check_stream_equals_offline(model, clip, prompt="hello there")
    # The run has content: codes vary, and with a prompt the ids are not all one value.
    assert len(set(codes.ravel().tolist())) > 4


def test_mlx_vlm_default_predicate_covers_every_component():
    """The default predicate really quantizes conformer, RNNT, TTS (incl. proj_mus and the char
    embedding) layers, so the test above exercises them; the published one only the language path."""
    entries = inventory(config_dict(Spec()))
    everything = quantized_names(entries, "mlx-vlm-default")
    for part in (
        "stt_model.perception.encoder.layers.0.feed_forward1.linear2",
        "stt_model.perception.encoder.pre_encode.out",
        "stt_model.perception.proj",
        "stt_model.rnnt_decoder.prediction.embed",
        "stt_model.rnnt_joint.enc",
        "stt_model.rnnt_joint.joint_net.2",
        "tts_model.tts_model.mog_head.proj_mus",
        "tts_model.tts_model.embed_subword.embed_tokens",
        "tts_model.tts_model.embed_subword.backbone.encoder.layers.0.self_attn.q_proj",
        "tts_model.tts_model.backbone.layers.1.mlp.down_proj",
        "tts_model.tts_model.embed_code",
        "tts_model.tts_model.gated_fusion_audio_text.text_proj",
        "tts_model.tts_model.mog_head.proj_logs",
        "tts_model.tts_model.embed_subword.subword_flag_emb.cont_emb",
    ):
        assert part in everything, part
    published = quantized_names(entries, "published")
    assert published and all(
        p.startswith(("stt_model.llm.", "stt_model.embed_tokens", "stt_model.lm_head", "stt_model.function_head"))
        for p in published
    )
    runnable = quantized_names(entries, "mlx-vlm-runnable")
    assert everything - runnable == {
        "tts_model.tts_model.mog_head.proj_mus",
        "tts_model.tts_model.embed_subword.embed_tokens",
    }


def test_quantized_model_computes_what_its_dense_twin_does(tmp_path, clip):
    """A 4-bit everywhere checkpoint and the float32 checkpoint of the *dequantized* weights give
    the same ids and codes (greedy sampling): the quantized paths (RNNT embedding, char embedding,
    proj_mus rows, ...) compute the product of the stored values, not of something else."""
    import mlx.core as mx

    spec = Spec(dtype="float32", bits=8, predicate="mlx-vlm-default")
    qfolder = write(tmp_path / "q", spec)
    # The dense twin: same files with every packed weight replaced by its dequantized matrix.
    dfolder = tmp_path / "d"
    dfolder.mkdir()
    import json
    import shutil

    for f in qfolder.iterdir():
        if f.suffix != ".safetensors" and f.name != "model.safetensors.index.json" and f.name != "config.json":
            shutil.copy(f, dfolder / f.name)
    index = json.loads((qfolder / "model.safetensors.index.json").read_text())
    weight_map = {}
    for shard in sorted(set(index["weight_map"].values())):
        t = mx.load(str(qfolder / shard))
        for p in [k[: -len(".scales")] for k in t if k.endswith(".scales")]:
            t[p + ".weight"] = mx.dequantize(
                t[p + ".weight"], t.pop(p + ".scales"), t.pop(p + ".biases"), group_size=64, bits=spec.bits
            )
        mx.save_safetensors(str(dfolder / shard), t)
        weight_map.update(dict.fromkeys(t, shard))
    (dfolder / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    cfg = json.loads((qfolder / "config.json").read_text())
    cfg.pop("quantization"), cfg.pop("quantization_config")
    (dfolder / "config.json").write_text(json.dumps(cfg))
    q, d = voicechat.load(qfolder), voicechat.load(dfolder)
    assert _quantized_in_model(q) and not _quantized_in_model(d)
    # The char encoder on its own (its final norm hides a wrong scale from the codes): the
    # quantized table's rows are the dense twin's, so the outputs agree to float32 rounding.
    chars, lengths = mx.array([[5, 17, 200, 256], [40, 41, 256, 256]]), mx.array([3, 2])
    cq = q.tts_model.tts_model.embed_subword.encode_chars(chars, lengths)
    cd = d.tts_model.tts_model.embed_subword.encode_chars(chars, lengths)
    assert float(mx.abs(cq - cd).max()) <= 1e-5 * float(mx.abs(cd).max())
    a, b = q.generate(clip, system_prompt="hi", seed=1), d.generate(clip, system_prompt="hi", seed=1)
    np.testing.assert_array_equal(a.text_tokens, b.text_tokens)
    np.testing.assert_array_equal(a.function_tokens, b.function_tokens)
    np.testing.assert_array_equal(a.audio_codes, b.audio_codes)
    assert a.transcript_tokens == b.transcript_tokens


@pytest.mark.slow
@pytest.mark.parametrize(
    "spec",
    [
        Spec(depth="real", bits=4, predicate="mlx-vlm-default"),
        Spec(depth="real", bits=8, predicate="published", sampling="shipped"),
    ],
    ids=lambda s: s.name(),
)
def test_real_depth_layout_streams_like_offline(tmp_path, spec, long_question_wav):
    model = voicechat.load(write(tmp_path / "ckpt", spec))
    check_stream_equals_offline(model, long_question_wav[: 1280 * 80], prompt="hello")
