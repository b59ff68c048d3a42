"""Deterministic random-weight checkpoints in the published on-disk layout.

`write_checkpoint(path, preset, bits=None, seed=0)` writes what the published
`mlx-community/NemotronLabs-VoiceChat-11B-*` folders hold: raw (NeMo) tensor
names and layouts (PyTorch conv orders, separate LSTM `bias_ih`/`bias_hh`, the
preprocessor buffers the loader drops), sharded safetensors with an index, a
`config.json` with `Infinity` in `time_step_limit`, a byte-level BPE
`tokenizer.json` with the published special ids, and the inline RNNT
vocabulary. Unquantized float tensors are bf16; with `bits` the 123-module
language path (the same module set at any preset) is affine-quantized with
group size 64 and float32 scales/biases; integer buffers are int64.

Values: every tensor is drawn from its own numpy generator seeded by (seed,
crc32(name)), with the mean and standard deviation of the module's own
initialisation (so the random model keeps finite activations and non-tied
decisions), and files are written by a small safetensors writer with sorted
keys, so the same preset and seed give byte-identical files. Tensors are
generated and written shard by shard, so the `full` preset fits in 24 GiB.
"""

from __future__ import annotations

import json
import math
import struct
import sys
import zlib
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx.utils import tree_flatten

from .checkpoint import unsanitize
from .config import VoiceChatConfig
from .presets import preset_dict
from .tokenizer import write_synthetic_tokenizer

GROUP_SIZE = 64
SHARD_BYTES = 5 * 1024**3  # at most ~5 GB per shard for the full preset
SUBWORD_TABLE_SIZE = 131072  # hard-wired in the reference (architecture.md §13.1)

_SAFETENSORS_DTYPE = {
    np.dtype(np.float32): "F32", np.dtype(np.uint16): "BF16", np.dtype(np.uint32): "U32",
    np.dtype(np.int64): "I64", np.dtype(np.int32): "I32",
}


def language_path_modules(model) -> list[str]:
    """The modules the published 4/8-bit checkpoints quantize (architecture.md §3.1)."""
    out = []
    for path, m in model.named_modules():
        if not isinstance(m, (nn.Linear, nn.Embedding)):
            continue
        if path in ("stt_model.embed_tokens", "stt_model.lm_head", "stt_model.function_head") or \
                path.startswith("stt_model.llm."):
            out.append(path)
    return sorted(out)


def _f32_to_bf16_bits(a: np.ndarray) -> np.ndarray:
    """Round-to-nearest-even float32 -> bfloat16 bit pattern (as MLX's cast does for finite values)."""
    u = np.require(np.asarray(a, dtype=np.float32), requirements='C').view(np.uint32)
    u = u + (np.uint32(0x7FFF) + ((u >> np.uint32(16)) & np.uint32(1)))
    return (u >> np.uint32(16)).astype(np.uint16)


def _rng(seed: int, name: str) -> np.random.Generator:
    return np.random.default_rng([seed, zlib.crc32(name.encode())])


def _init_stats(init: mx.array) -> tuple[float, float]:
    a = init.astype(mx.float32)
    mean, std = mx.mean(a), mx.sqrt(mx.var(a))
    mx.eval(mean, std)
    # Rounded so tiny platform differences in the init cannot change the files.
    return float(f"{mean.item():.4g}"), float(f"{std.item():.4g}")


def _draw(name: str, shape, init: mx.array, cfg: VoiceChatConfig, seed: int) -> np.ndarray:
    """float32 (or int64) values for one MLX-layout tensor."""
    rng = _rng(seed, name)
    q = cfg.tts_config.num_quantizers
    cb = cfg.tts_config.codebook_size
    if name.endswith("subword_flag_emb.is_continuation"):
        return rng.integers(0, 2, size=shape, dtype=np.int64)
    if name.endswith("subword_flag_emb.pad_tensor"):
        return np.array(SUBWORD_TABLE_SIZE, dtype=np.int64)
    if name.endswith("bos_eos_emb.pad_tensor"):
        return np.array(SUBWORD_TABLE_SIZE - 1, dtype=np.int64)
    if name.endswith("bos_eos_emb.special_flags"):
        flags = np.zeros(shape, dtype=np.int64)
        flags[cfg.bos_token_id], flags[cfg.eos_token_id] = 1, 2
        return flags
    if name == "tts_model.control_codes":
        # In range on purpose, so that control-code replacement is exercised.
        return np.array([cb - 3, cb - 2, cb - 1], dtype=np.int64)
    if name == "tts_model.codec_silence_tokens":
        return rng.integers(0, cb - 3, size=(q,), dtype=np.int64)
    if mx.issubdtype(init.dtype, mx.integer):
        return np.zeros(shape, dtype=np.int64)
    if name.startswith("tts_model.audio_prompt_latents."):
        return (0.5 * rng.standard_normal(shape)).astype(np.float32)
    mean, std = _init_stats(init)
    if std <= 1e-6 * max(1.0, abs(mean)):  # constant init (norm weights, scalars): jitter it
        return np.asarray(mean + 0.05 * rng.standard_normal(shape), dtype=np.float32)
    value = (mean + std * rng.standard_normal(shape, dtype=np.float32)).astype(np.float32)
    return _rnnt_shaping(name, value, cfg)


# A random RNNT at init scale is degenerate (every frame emits max_symbols of one
# token): the encoder and prediction terms barely move the joint's logits. These
# factors (chosen by measuring emissions on speech and noise with the tiny preset)
# make the encoder frame matter and favour blank, so synthetic transcripts mix
# blank frames, single symbols and capped runs.
_RNNT_SCALE = {
    "stt_model.rnnt_joint.enc.weight": 4.0,
    "stt_model.rnnt_joint.pred.weight": 4.0,
    "stt_model.rnnt_joint.joint_net.2.weight": 2.0,
}
_RNNT_BLANK_BIAS = 2.0


def _rnnt_shaping(name: str, value: np.ndarray, cfg: VoiceChatConfig) -> np.ndarray:
    if name in _RNNT_SCALE:
        return value * np.float32(_RNNT_SCALE[name])
    if name == "stt_model.rnnt_joint.joint_net.2.bias":
        value = value.copy()
        value[cfg.rnnt_blank_id] += np.float32(_RNNT_BLANK_BIAS)
    return value


def _preprocessor_buffers(cfg: VoiceChatConfig) -> dict[str, np.ndarray]:
    """The NeMo featurizer buffers the published files carry (the loader drops them)."""
    p = cfg.audio_config.preprocessor
    n = p.win_length
    window = (0.5 - 0.5 * np.cos(2 * np.pi * np.arange(n) / (n - 1))).astype(np.float32)
    try:
        from .audio.mel import mel_filterbank

        fb = np.asarray(mel_filterbank(p), dtype=np.float32)[None]
    except Exception:  # the buffer is never read back; its shape is what matters
        fb = np.zeros((1, p.features, p.n_fft // 2 + 1), dtype=np.float32)
    return {
        "stt_model.perception.preprocessor.featurizer.fb": fb,
        "stt_model.perception.preprocessor.featurizer.window": window,
    }


class _SafetensorsShard:
    """Minimal safetensors writer: sorted keys, fixed metadata, so output is byte-stable."""

    def __init__(self):
        self.tensors: dict[str, np.ndarray] = {}
        self.nbytes = 0

    def add(self, name: str, arr: np.ndarray):
        self.tensors[name] = np.require(np.asarray(arr), requirements='C')  # keeps 0-d shapes
        self.nbytes += arr.nbytes

    def write(self, path: Path, bf16: set[str]):
        header, offset = {}, 0
        for k in sorted(self.tensors):
            a = self.tensors[k]
            dt = "BF16" if k in bf16 else _SAFETENSORS_DTYPE[a.dtype]
            header[k] = {"dtype": dt, "shape": list(a.shape), "data_offsets": [offset, offset + a.nbytes]}
            offset += a.nbytes
        header["__metadata__"] = {"format": "pt"}
        blob = json.dumps(header, separators=(",", ":"), sort_keys=True).encode()
        blob += b" " * ((8 - len(blob) % 8) % 8)
        with open(path, "wb") as f:
            f.write(struct.pack("<Q", len(blob)))
            f.write(blob)
            for k in sorted(self.tensors):
                f.write(self.tensors[k].tobytes())


def _tensor_plan(model, cfg: VoiceChatConfig, bits: int | None):
    """(mlx_name, shape, init, quantized?) for every parameter, sorted by name."""
    qmods = set(language_path_modules(model)) if bits else set()
    plan = []
    for name, arr in tree_flatten(model.parameters()):
        module = name.rsplit(".", 1)[0]
        quant = module in qmods and name.endswith(".weight")
        plan.append((name, tuple(arr.shape), arr, quant))
    return sorted(plan, key=lambda t: t[0])


def _stored_nbytes(name, shape, init, quant, bits) -> int:
    n = math.prod(shape)
    if quant:
        out, inp = shape[0], shape[-1]
        return out * inp * bits // 8 + 2 * out * (inp // GROUP_SIZE) * 4
    if mx.issubdtype(init.dtype, mx.integer):
        return n * 8
    lstm_bias = ".lstm." in name and name.endswith(".bias")  # stored as bias_ih + bias_hh
    return n * 2 * (2 if lstm_bias else 1)


def checkpoint_size(preset: str, bits: int | None = None) -> dict:
    """On-disk tensor count and bytes of a preset, computed from shapes (nothing is written)."""
    from .model import VoiceChatModel

    cfg = VoiceChatConfig.from_dict(preset_dict(preset))
    model = VoiceChatModel(cfg)
    count, total = 2, sum(a.nbytes for a in _preprocessor_buffers(cfg).values())
    for name, shape, init, quant in _tensor_plan(model, cfg, bits):
        total += _stored_nbytes(name, shape, init, quant, bits)
        count += 3 if quant else (2 if ".lstm." in name and name.endswith(".bias") else 1)
    return {"preset": preset, "bits": bits, "tensors": count, "bytes": total}


def _deep_update(d: dict, u: dict) -> dict:
    for k, v in u.items():
        if isinstance(v, dict) and isinstance(d.get(k), dict):
            _deep_update(d[k], v)
        else:
            d[k] = v
    return d


def write_checkpoint(path, preset: str = "tiny", *, bits: int | None = None, seed: int = 0,
                     dtype: str = "bfloat16", n_shards: int | None = None, progress: bool | None = False,
                     overrides: dict | None = None) -> Path:
    """Write a synthetic checkpoint folder; returns its path.

    `overrides` is deep-merged into the preset's config (e.g. fewer layers for a
    quick structural test of the `small` geometry).
    """
    from .model import VoiceChatModel

    if bits not in (None, 4, 8):
        raise ValueError(f"bits must be None, 4 or 8, got {bits!r}")
    if dtype not in ("bfloat16", "float32"):
        raise ValueError(f"dtype must be 'bfloat16' (published) or 'float32', got {dtype!r}")
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    cfg_dict = _deep_update(preset_dict(preset), overrides or {})
    if bits:
        cfg_dict["quantization"] = {"group_size": GROUP_SIZE, "bits": bits}
        cfg_dict["quantization_config"] = dict(cfg_dict["quantization"])
    cfg = VoiceChatConfig.from_dict(cfg_dict)

    # MLX's module initialisers draw from the global RNG and its state cannot be
    # set back, so: seed it for a reproducible init, then reseed it from a value
    # drawn from the caller's stream beforehand (the caller's stream stays a
    # deterministic function of its own seed).
    resume_seed = int(mx.random.randint(0, 2**31 - 1, ()).item())
    mx.random.seed(0x5EED + seed)
    model = VoiceChatModel(cfg)
    plan = _tensor_plan(model, cfg, bits)
    # (init arrays are lazy but captured their keys at construction)
    mx.random.seed(resume_seed)

    total = sum(_stored_nbytes(*p, bits) for p in plan)
    if n_shards is None:
        n_shards = max(2, math.ceil(total / SHARD_BYTES))
    target = total / n_shards

    shards: list[_SafetensorsShard] = [_SafetensorsShard()]
    bf16_names: set[str] = set()
    weight_map: dict[str, int] = {}

    def emit(raw_name: str, value: np.ndarray, as_bf16: bool):
        if shards[-1].nbytes >= target and len(shards) < n_shards:
            _flush(len(shards) - 1)
            shards.append(_SafetensorsShard())
        if as_bf16:
            bf16_names.add(raw_name)
            value = _f32_to_bf16_bits(value)
        shards[-1].add(raw_name, value)
        weight_map[raw_name] = len(shards) - 1

    tmp_files: list[Path] = []

    def _flush(i: int):
        f = path / f".shard-{i}.tmp"
        shards[i].write(f, bf16_names)
        tmp_files.append(f)
        shards[i].tensors.clear()

    float_bf16 = dtype == "bfloat16"
    for k, v in sorted(_preprocessor_buffers(cfg).items()):
        emit(k, v, False)  # NeMo stores these in float32
    from .progress import progress as progress_bar

    # progress: None draws a bar on a terminal, False never (see voicechat/progress.py)
    for name, shape, init, quant in progress_bar(plan, desc=f"writing {preset}", unit="tensor",
                                                  enabled=False if progress is False else None):
        value = _draw(name, shape, init, cfg, seed)
        if quant:
            wq, scales, biases = mx.quantize(mx.array(value), group_size=GROUP_SIZE, bits=bits)
            module = name[: -len(".weight")]
            emit(name, np.array(wq), False)
            emit(module + ".scales", np.array(scales.astype(mx.float32)), False)
            emit(module + ".biases", np.array(biases.astype(mx.float32)), False)
            continue
        if value.dtype == np.int64:
            raw = unsanitize({name: mx.array(value)}, cfg)
            for rk, rv in raw.items():
                emit(rk, np.array(rv).astype(np.int64), False)
            continue
        if name.startswith("stt_model.rnnt_decoder.prediction.dec_rnn.lstm.") and name.endswith(".bias"):
            # Raw LSTM stores two bias vectors that the loader sums.
            layer = name.split(".")[-2]
            rng = _rng(seed, name + ".split")
            hh = (0.1 * rng.standard_normal(shape)).astype(np.float32)
            prefix = "stt_model.rnnt_decoder.prediction.dec_rnn.lstm."
            emit(f"{prefix}bias_ih_l{layer}", value - hh, float_bf16)
            emit(f"{prefix}bias_hh_l{layer}", hh, float_bf16)
            continue
        raw = unsanitize({name: mx.array(value)}, cfg)
        for rk, rv in raw.items():
            emit(rk, np.array(rv), float_bf16)

    _flush(len(shards) - 1)
    n = len(shards)
    names = {}
    for i, f in enumerate(tmp_files):
        final = path / f"model-{i + 1:05d}-of-{n:05d}.safetensors"
        f.replace(final)
        names[i] = final.name
    index = {
        "metadata": {"total_size": total, "synthetic": True, "preset": preset, "seed": seed, "bits": bits},
        "weight_map": {k: names[v] for k, v in sorted(weight_map.items())},
    }
    (path / "model.safetensors.index.json").write_text(json.dumps(index, indent=2, sort_keys=True))
    (path / "config.json").write_text(json.dumps(cfg_dict, indent=2, allow_nan=True, ensure_ascii=False))
    write_synthetic_tokenizer(path, cfg.text_config.vocab_size)
    (path / "README.md").write_text(
        f"# Synthetic VoiceChat checkpoint\n\nRandom weights (preset `{preset}`, seed {seed}, "
        f"bits {bits or 'none (bf16)'}), written by `voicechat.synthetic` in the published on-disk layout. "
        "Not a trained model: use it for tests and timing only.\n"
    )
    return path


def cache_root() -> Path:
    import os

    return Path(os.environ.get("VOICECHAT_CACHE", Path.home() / ".cache" / "voicechat")) / "synthetic"


def parse_synthetic_spec(spec: str) -> tuple[str, int | None, int]:
    """`synthetic:PRESET[:BITS][:seedN]` -> (preset, bits, seed); e.g. synthetic:small:4."""
    parts = spec.split(":")
    if parts[0] != "synthetic" or len(parts) < 2:
        raise ValueError(f"not a synthetic checkpoint spec: {spec!r} (expected synthetic:PRESET[:4|8])")
    preset, bits, seed = parts[1], None, 0
    for p in parts[2:]:
        if p in ("4", "8"):
            bits = int(p)
        elif p in ("bf16", ""):
            bits = None
        elif p.startswith("seed") and p[4:].isdigit():
            seed = int(p[4:])
        else:
            raise ValueError(f"{spec!r}: unknown part {p!r}; expected 4, 8, bf16 or seedN")
    if preset not in ("tiny", "small", "full"):
        raise ValueError(f"{spec!r}: unknown preset {preset!r}; expected tiny, small or full")
    return preset, bits, seed


def ensure_synthetic(spec: str, *, progress: bool = True) -> Path:
    """The folder of a `synthetic:...` checkpoint, written once into the cache (VOICECHAT_CACHE)."""
    preset, bits, seed = parse_synthetic_spec(spec)
    folder = cache_root() / f"{preset}-{bits or 'bf16'}-seed{seed}"
    if not (folder / "model.safetensors.index.json").exists():
        if progress:
            print(f"writing synthetic checkpoint {spec} to {folder} ...", file=sys.stderr, flush=True)
        import os
        import shutil

        # A private temporary folder, renamed into place: concurrent writers cannot collide.
        tmp = folder.with_name(f"{folder.name}.tmp{os.getpid()}")
        if tmp.exists():
            shutil.rmtree(tmp)
        write_checkpoint(tmp, preset, bits=bits, seed=seed, progress=None if progress else False)
        try:
            tmp.replace(folder)
        except OSError:  # another process finished first: keep its (identical) files
            shutil.rmtree(tmp, ignore_errors=True)
    return folder


def resolve_model_arg(spec: str) -> str:
    """A CLI `-m` value: `synthetic:...` -> its cached folder, anything else unchanged."""
    return str(ensure_synthetic(spec)) if str(spec).startswith("synthetic:") else str(spec)
