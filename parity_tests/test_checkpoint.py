"""Synthetic checkpoints in the published layout, the strict loader, and its error messages."""

import hashlib
import json
import shutil
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx.utils import tree_flatten

import voicechat
import voicechat.io.loading
import voicechat.model.voicechat
from voicechat.errors import CheckpointError, ConfigError
from voicechat.synthetic.checkpoint import checkpoint_size, language_path_modules, write_checkpoint

from .runtime_util import default_policy


def _hashes(folder: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.iterdir()) if p.is_file()}


def _raw(folder: Path) -> dict:
    out = {}
    for f in sorted(folder.glob("*.safetensors")):
        out.update(mx.load(str(f)))
    return out


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def test_published_layout_on_disk(tiny_ckpt, tiny_ckpt_4bit):
    raw = _raw(tiny_ckpt)
    index = json.loads((tiny_ckpt / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"]) == set(raw)
    assert len(set(index["weight_map"].values())) == 2  # two shards
    # Raw (NeMo) names and layouts, as docs/model.md §2.1-2.2 describe
    assert "stt_model.perception.preprocessor.featurizer.fb" in raw
    assert "stt_model.rnnt_decoder.prediction.dec_rnn.lstm.weight_ih_l0" in raw
    assert "stt_model.rnnt_decoder.prediction.dec_rnn.lstm.bias_hh_l1" in raw
    assert "tts_model._control_codes" in raw
    assert "tts_model.audio_codec.prvq._variance_list.0.variance" in raw
    c = raw["stt_model.perception.encoder.pre_encode.conv.0.weight"]
    assert c.shape == (8, 1, 3, 3)  # (O, I, kH, kW)
    up = raw["tts_model.audio_codec.decoder.layers.0.weight"]
    assert up.shape[0] == 16  # ConvTranspose raw (I=latent, O, K)
    # Published dtypes: bf16 floats, int64 buffers
    assert raw["stt_model.llm.norm_f.weight"].dtype == mx.bfloat16
    assert raw["tts_model.codec_silence_tokens"].dtype == mx.int64
    cfg_text = (tiny_ckpt / "config.json").read_text()
    assert "Infinity" in cfg_text
    # Quantized: uint32 weights, float32 scales/biases, only on the language path
    raw4 = _raw(tiny_ckpt_4bit)
    assert raw4["stt_model.lm_head.weight"].dtype == mx.uint32
    assert raw4["stt_model.lm_head.scales"].dtype == mx.float32
    scaled = {k[: -len(".scales")] for k in raw4 if k.endswith(".scales")}
    assert all(
        k.startswith(("stt_model.llm.", "stt_model.embed_tokens", "stt_model.lm_head", "stt_model.function_head"))
        for k in scaled
    )
    assert len(raw4) == len(raw) + 2 * len(scaled)


@pytest.mark.parametrize("fixture", ["tiny_ckpt", "tiny_ckpt_4bit", "tiny_ckpt_8bit"])
def test_write_load_every_parameter(fixture, request):
    folder = request.getfixturevalue(fixture)
    # Without the CPU's float32 copies (voicechat.runtime.linear), which replace dense 16-bit weights
    # by the same values in float32 after loading.
    model = voicechat.load(folder, policy=default_policy(float32_copies=False))
    params = dict(tree_flatten(model.parameters()))
    fresh = voicechat.model.voicechat.VoiceChatNetwork(model.config)
    bits = (model.config.quantization or {}).get("bits")
    qmods = set(language_path_modules(fresh))
    if bits:
        nn.quantize(fresh, group_size=64, bits=bits, class_predicate=lambda p, m: p in qmods)
    expected = dict(tree_flatten(fresh.parameters()))
    assert set(params) == set(expected)
    for k, v in expected.items():
        assert params[k].shape == v.shape, k
    quantized = {p for p, m in model.named_modules() if isinstance(m, (nn.QuantizedLinear, nn.QuantizedEmbedding))}
    assert quantized == (qmods if bits else set())
    # Stored dtypes are kept (no silent casting on load)
    assert params["stt_model.perception.proj.weight"].dtype == mx.bfloat16
    assert params["tts_model.codec_silence_tokens"].dtype == mx.int64
    # Sanitize applied exactly once: the summed LSTM bias equals bias_ih + bias_hh on disk
    raw = _raw(folder)
    for layer in range(model.config.audio_config.decoder.pred_rnn_layers):
        p = "stt_model.rnnt_decoder.prediction.dec_rnn.lstm."
        want = raw[f"{p}bias_ih_l{layer}"] + raw[f"{p}bias_hh_l{layer}"]
        assert mx.array_equal(params[f"{p}{layer}.bias"], want)
    assert model.tokenizer.vocab_size == model.config.text_config.vocab_size


def test_same_seed_byte_identical_other_seed_differs(tmp_path, tiny_ckpt):
    again = write_checkpoint(tmp_path / "again", "tiny")
    assert _hashes(again) == _hashes(tiny_ckpt)
    other = write_checkpoint(tmp_path / "other", "tiny", seed=1)
    h1, h2 = _hashes(other), _hashes(tiny_ckpt)
    assert h1["config.json"] == h2["config.json"]
    assert any(h1[k] != h2[k] for k in h1 if k.endswith(".safetensors"))


@pytest.mark.parametrize("bits", [None, 4, 8])
def test_small_geometry_reduced_depth(tmp_path, bits):
    # The `small` preset's widths and frame geometry with fewer layers (CI time).
    overrides = {
        "text_config": {"hybrid_override_pattern": "M-M*"},
        "audio_config": {"encoder": {"n_layers": 2}},
        "tts_config": {"num_hidden_layers": 6},
    }
    folder = write_checkpoint(tmp_path / "small", "small", bits=bits, overrides=overrides)
    model = voicechat.load(folder)
    assert model.config.codec_config.waveform_to_token_ratio == 1764
    assert model.config.text_config.num_hidden_layers == 4
    n_quant = sum(isinstance(m, (nn.QuantizedLinear, nn.QuantizedEmbedding)) for _, m in model.named_modules())
    # 3 (embed + 2 heads) + 2 Mamba x 2 + 1 MLP x 2 + 1 attention x 4
    assert n_quant == (3 + 4 + 2 + 4 if bits else 0)


def test_widths_the_group_size_does_not_divide_stay_bf16(tmp_path, question_wav):
    """The converter's rule (docs/voicechat.md, "Quantization layouts"): a language-path weight is
    quantized only where the group size (64) divides its last dim. With hidden 96 and MLP width 160,
    the modules reading the hidden state (Mamba in_proj, MLP up, attention q/k/v, both heads) and
    the MLP down_proj stay bf16; the embedding (last dim 96) too; Mamba out_proj (64) and o_proj
    (4 x 16) are quantized. Such a bf16-heavy checkpoint loads and streams as offline."""
    folder = write_checkpoint(
        tmp_path / "heavy",
        "tiny",
        bits=4,
        overrides={"text_config": {"hidden_size": 96, "intermediate_size": 160}, "audio_config": {"output_dim": 96}},
    )
    model = voicechat.load(folder)
    quantized = {p for p, m in model.named_modules() if isinstance(m, (nn.QuantizedLinear, nn.QuantizedEmbedding))}
    assert quantized == {
        "stt_model.llm.layers.0.mixer.out_proj",
        "stt_model.llm.layers.3.mixer.out_proj",
        "stt_model.llm.layers.1.mixer.o_proj",
    }, sorted(quantized)
    off = model.generate(question_wav[:12800])
    s = model.create_streaming_session()
    s.push_audio(question_wav[:12800])
    np.testing.assert_array_equal(np.stack(s.raw_audio_codes), off.raw_audio_codes[: len(s.raw_audio_codes)])


def test_full_preset_sizes_match_published():
    # Computed from shapes only. Published (docs/model.md §1.1, §2.1): the 4-bit index lists
    # 1243 stt + 635 tts = 1878 tensors; 997 + 635 = 1632 raw tensors unquantized.
    four, eight, bf16 = checkpoint_size("full", 4), checkpoint_size("full", 8), checkpoint_size("full")
    assert four["tensors"] == 1878 and eight["tensors"] == 1878
    assert bf16["tensors"] == 1632
    # Sizes: the spec's deduction 9.165 GB / 13.90 GB (float32 scales); bf16 = 2 B x 11.095e9.
    assert abs(four["bytes"] / 9.165e9 - 1) < 0.01
    assert abs(eight["bytes"] / 13.90e9 - 1) < 0.01
    assert abs(bf16["bytes"] / 22.19e9 - 1) < 0.01


def test_save_and_reload_round_trip(tmp_path, tiny_ckpt_4bit, tiny_model_4bit):
    """`save` writes the checkpoint it was loaded from, tensor for tensor in the stored dtypes
    (the weights `load` replaced by float32 copies go back to bf16), and reloads to the same
    parameters."""
    out = voicechat.io.loading.save(tiny_model_4bit, tmp_path / "saved")
    original, written = _raw(tiny_ckpt_4bit), _raw(out)
    # the mel front end's window and filterbank (stored in the published layout) are not
    # written back: sanitize drops them (docs/model.md), the front end computes its own
    assert set(original) - set(written) <= {
        "stt_model.perception.preprocessor.featurizer.window",
        "stt_model.perception.preprocessor.featurizer.fb",
    }
    assert set(written) <= set(original)
    for k, v in ((k, v) for k, v in original.items() if k in written):
        assert written[k].dtype == v.dtype, k
        if ".lstm.bias_" in k:  # load keeps bias_ih + bias_hh (one bias); save writes it as bias_ih
            k_ih, k_hh = k.replace("bias_hh", "bias_ih"), k.replace("bias_ih", "bias_hh")
            assert mx.array_equal(written[k_ih] + written[k_hh], original[k_ih] + original[k_hh]), k
        else:
            assert mx.array_equal(written[k], v), k
    again = voicechat.load(out)
    a = dict(tree_flatten(tiny_model_4bit.parameters()))
    b = dict(tree_flatten(again.parameters()))
    assert set(a) == set(b)
    for k in a:
        assert a[k].dtype == b[k].dtype and mx.array_equal(a[k], b[k]), k


# --------------------------------------------------------------------------- loader errors


def _edit_shards(folder: Path, fn):
    """Apply fn(weights: dict) to the union of shards, rewriting the shards and index."""
    from voicechat.io.checkpoint import write_shards

    raw = _raw(folder)
    fn(raw)
    for f in folder.glob("*.safetensors"):
        f.unlink()
    write_shards(raw, folder)


def test_missing_tensor_named(tmp_path, tiny_ckpt):
    f = _copy(tiny_ckpt, tmp_path / "c")
    _edit_shards(f, lambda w: w.pop("stt_model.llm.norm_f.weight"))
    with pytest.raises(CheckpointError, match=r"missing tensors \(1\): stt_model\.llm\.norm_f\.weight"):
        voicechat.load(f)


def test_unexpected_tensor_named(tmp_path, tiny_ckpt):
    f = _copy(tiny_ckpt, tmp_path / "c")
    _edit_shards(f, lambda w: w.update({"stt_model.llm.extra.weight": mx.zeros((2,))}))
    with pytest.raises(CheckpointError, match=r"unexpected tensors \(1\): stt_model\.llm\.extra\.weight"):
        voicechat.load(f)


def test_wrong_shape_named(tmp_path, tiny_ckpt):
    f = _copy(tiny_ckpt, tmp_path / "c")
    _edit_shards(f, lambda w: w.update({"stt_model.llm.norm_f.weight": mx.zeros((3,), mx.bfloat16)}))
    with pytest.raises(CheckpointError, match=r"stt_model\.llm\.norm_f\.weight: stored shape \(3,\)"):
        voicechat.load(f)


def test_wrong_dtype_named(tmp_path, tiny_ckpt):
    f = _copy(tiny_ckpt, tmp_path / "c")
    _edit_shards(f, lambda w: w.update({"stt_model.llm.norm_f.weight": mx.zeros((64,), mx.int32)}))
    with pytest.raises(CheckpointError, match=r"norm_f\.weight: stored dtype"):
        voicechat.load(f)


def test_nan_weights_named(tmp_path, tiny_ckpt):
    f = _copy(tiny_ckpt, tmp_path / "c")
    bad = mx.array(np.full((64,), np.nan, np.float32)).astype(mx.bfloat16)
    _edit_shards(f, lambda w: w.update({"stt_model.llm.norm_f.weight": bad}))
    with pytest.raises(CheckpointError, match=r"NaN or infinite.*norm_f\.weight"):
        voicechat.load(f)


def test_read_weights_names_every_nonfinite_tensor_across_groups(monkeypatch):
    """read_weights reads and scans a group at a time: with groups of ~1 KB (one or two tensors
    each) a bad tensor in the first, a middle and the last group is named, in order, and nothing
    else; float64 goes through MLX's own test, integers are not scanned, a clean set passes and
    is evaluated."""
    from voicechat.io import loading

    monkeypatch.setattr(loading, "READ_GROUP_BYTES", 1000)
    rng = np.random.default_rng(0)

    def tensors(bad: dict, wide: float) -> dict:
        out = {"ids": mx.arange(300, dtype=mx.int32)}
        for i in range(20):
            values = rng.standard_normal(256).astype(np.float32)
            if i in bad:
                values[17 * i % 256] = bad[i]
            dtype = (mx.float16, mx.bfloat16, mx.float32)[i % 3]
            out[f"t{i:02d}"] = mx.array(values).astype(dtype) + 0  # lazy, as mx.load's arrays are
            if i == 4:  # float64: no bit test in the scan, MLX's isfinite
                out["wide"] = mx.array(np.array([1.0, wide]), dtype=mx.float64) + 0
        return out

    clean = tensors({}, 2.0)
    loading.read_weights(clean)
    assert all(a.nbytes and np.isfinite(np.array(a.astype(mx.float32))).all() for a in clean.values())
    bad = tensors({0: np.nan, 9: -np.inf, 10: np.inf, 19: np.nan}, np.nan)  # t19 is in the last group
    with pytest.raises(CheckpointError, match=r"\(5\): t00, wide, t09, t10, t19$"):
        loading.read_weights(bad)


def test_truncated_shard(tmp_path, tiny_ckpt):
    f = _copy(tiny_ckpt, tmp_path / "c")
    shard = sorted(f.glob("*.safetensors"))[0]
    data = shard.read_bytes()
    shard.write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match=shard.name):
        voicechat.load(f)


def test_index_names_missing_shard(tmp_path, tiny_ckpt):
    f = _copy(tiny_ckpt, tmp_path / "c")
    shard = sorted(f.glob("*.safetensors"))[1]
    shard.unlink()
    with pytest.raises(CheckpointError, match=r"shard.*do not exist"):
        voicechat.load(f)


def test_config_without_text_config(tmp_path, tiny_ckpt):
    f = _copy(tiny_ckpt, tmp_path / "c")
    cfg = json.loads((f / "config.json").read_text())
    del cfg["text_config"]
    (f / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ConfigError, match="text_config"):
        voicechat.load(f)


def test_config_weights_mismatch(tmp_path, tiny_ckpt):
    f = _copy(tiny_ckpt, tmp_path / "c")
    cfg = json.loads((f / "config.json").read_text())
    cfg["text_config"]["intermediate_size"] = 256
    (f / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match=r"up_proj\.weight: stored shape"):
        voicechat.load(f)


def test_quantization_entry_disagrees_with_scales(tmp_path, tiny_ckpt_4bit):
    f = _copy(tiny_ckpt_4bit, tmp_path / "c")
    cfg = json.loads((f / "config.json").read_text())
    cfg["quantization"]["bits"] = 8
    cfg["quantization_config"]["bits"] = 8
    (f / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match=r"config says 8-bit.*imply 4-bit"):
        voicechat.load(f)


def test_scales_without_quantization_entry(tmp_path, tiny_ckpt_4bit):
    f = _copy(tiny_ckpt_4bit, tmp_path / "c")
    cfg = json.loads((f / "config.json").read_text())
    cfg.pop("quantization"), cfg.pop("quantization_config")
    (f / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match="no 'quantization' entry"):
        voicechat.load(f)


def test_not_a_folder_or_repo():
    with pytest.raises(CheckpointError, match="no such folder"):
        voicechat.load("/nonexistent/path/to/ckpt")


def test_pickle_only_folder_rejected(tmp_path, tiny_ckpt):
    f = tmp_path / "pt"
    f.mkdir()
    shutil.copy(tiny_ckpt / "config.json", f / "config.json")
    (f / "pytorch_model.bin").write_bytes(b"\x80\x04not really")
    with pytest.raises(CheckpointError, match=r"no \*\.safetensors"):
        voicechat.load(f)
