"""The synthetic writer's memory is bounded: tensors are written at their offsets one at a time
(large ones in row chunks), never gathered into a shard in memory."""

import hashlib
import tracemalloc
from pathlib import Path

import mlx.core as mx
import pytest
from mlx.utils import tree_flatten

import voicechat.synthetic.checkpoint as synthetic
from voicechat.model.voicechat import VoiceChatNetwork
from voicechat.synthetic.presets import preset_config


def _hashes(folder: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.iterdir()) if p.is_file()}


@pytest.mark.parametrize("bits", [None, 4])
def test_row_chunks_write_the_same_bytes(tmp_path, monkeypatch, bits, tiny_ckpt, tiny_ckpt_4bit):
    # 64-element chunks split every 2-D tiny tensor into many row chunks (a quantized one into
    # single rows): the files must not depend on the chunk size.
    monkeypatch.setattr(synthetic, "CHUNK_ELEMENTS", 64)
    folder = synthetic.write_checkpoint(tmp_path / "chunked", "tiny", bits=bits)
    assert _hashes(folder) == _hashes(tiny_ckpt_4bit if bits else tiny_ckpt)


@pytest.mark.parametrize("dtype", ["bfloat16"])
def test_writer_memory_does_not_scale_with_the_checkpoint(tmp_path, dtype):
    # numpy allocations are seen by tracemalloc, MLX's by its peak counter. A writer that gathers
    # a shard before writing it holds at least half the tensor bytes (two shards: 164 MB in bf16,
    # 327 MB in float32); this one holds a few copies of the largest tensor at most (draw,
    # conversion; the init evaluated for its statistics).
    total = synthetic.checkpoint_size("small")["bytes"] * (2 if dtype == "float32" else 1)
    model = VoiceChatNetwork(preset_config("small"))
    largest = max(a.size for _, a in tree_flatten(model.parameters())) * 4
    del model
    assert 3 * largest < total / 2  # else this test could not tell the two writers apart
    mx.reset_peak_memory()
    tracemalloc.start()
    try:
        synthetic.write_checkpoint(tmp_path / "small", "small", dtype=dtype)
        _, numpy_peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    mlx_peak = mx.get_peak_memory()
    assert numpy_peak < 3 * largest, (numpy_peak, largest, total)
    assert mlx_peak < 3 * largest, (mlx_peak, largest, total)


def test_small16_has_the_published_layout():
    """`small16` (real depth, widths / ~16): every language-path module quantizable with group
    size 64, so its 4/8-bit checkpoints quantize the same 123 modules as the published ones."""
    from voicechat.synthetic.checkpoint import language_path_modules

    cfg = preset_config("small16")
    model = VoiceChatNetwork(cfg)
    modules = dict(model.named_modules())
    paths = language_path_modules(model)
    assert len(paths) == 123
    assert all(modules[p].weight.shape[-1] % 64 == 0 for p in paths)
    full = preset_config("full")
    assert cfg.text_config.num_hidden_layers == full.text_config.num_hidden_layers
    assert cfg.audio_config.encoder.n_layers == full.audio_config.encoder.n_layers
    assert cfg.tts_config.num_hidden_layers == full.tts_config.num_hidden_layers
    assert cfg.codec_config.waveform_to_token_ratio == full.codec_config.waveform_to_token_ratio
