"""Deterministic random-weight checkpoints in the published on-disk layout.

`write_checkpoint(path, preset, bits=None, seed=0)` writes what the published
`mlx-community/NemotronLabs-VoiceChat-11B-*` folders hold: raw (NeMo) tensor
names and layouts (PyTorch conv orders, separate LSTM `bias_ih`/`bias_hh`, the
preprocessor buffers the loader drops), sharded safetensors with an index, a
`config.json` with `Infinity` in `time_step_limit`, a byte-level BPE
`tokenizer.json` with the published special ids, and the inline RNNT
vocabulary. Unquantized float tensors are bf16; with `bits` the 123-module
language path (the same module set at any preset) is affine-quantized with
group size 64 and float32 scales/biases, each module only where 64 divides its
weight's last dim (the converter's rule: with other widths, passed as
`overrides`, most of the language path stays bf16); integer buffers are int64.

Values: every tensor is drawn from its own numpy generator seeded by (seed,
crc32(name)), with the mean and standard deviation of the module's own
initialisation (so the random model keeps finite activations and non-tied
decisions), and files are written by a small safetensors writer with sorted
keys, so the same preset and seed give byte-identical files.

Memory is bounded whatever the preset: every shard's header and size are laid
out from the shapes first, then each tensor is drawn, converted (bf16 bits or
quantized), written at its offset and dropped; tensors of more than
`CHUNK_ELEMENTS` go a row chunk at a time. Measured peak RSS writing the
published shapes: see docs/performance.md ("Writing and loading the full shapes").
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

from voicechat.environment import cache_home
from voicechat.io.checkpoint import unsanitize
from voicechat.io.progress import bar
from voicechat.io.tokenizer import build_synthetic_tokenizer, write_synthetic_tokenizer
from voicechat.model.audio.mel import mel_filterbank
from voicechat.model.config import VoiceChatConfig
from voicechat.model.voicechat import VoiceChatNetwork
from voicechat.synthetic.presets import PRESETS, preset_dict
from voicechat.synthetic.toolcall import SPECIAL_COUNT, ToolcallScript, toolcall_overrides, toolcall_tensors

GROUP_SIZE = 64
SHARD_BYTES = 5 * 1024**3  # at most ~5 GB per shard for the full preset
SUBWORD_TABLE_SIZE = 131072  # hard-wired in the reference (docs/model.md §13.1)


def language_path_modules(model) -> list[str]:
    """The modules the published 4/8-bit checkpoints quantize (docs/model.md §3.1)."""
    out = []
    for path, m in model.named_modules():
        if not isinstance(m, (nn.Linear, nn.Embedding)):
            continue
        if path in ("stt_model.embed_tokens", "stt_model.lm_head", "stt_model.function_head") or path.startswith(
            "stt_model.llm."
        ):
            out.append(path)
    return sorted(out)


def _f32_to_bf16_bits(a: np.ndarray) -> np.ndarray:
    """Round-to-nearest-even float32 -> bfloat16 bit pattern (as MLX's cast does for finite values)."""
    u = np.require(np.asarray(a, dtype=np.float32), requirements="C").view(np.uint32)
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
    if name.startswith(_CODEC_BOOKS):
        return _rvq_codebook(rng, int(name.rsplit(".", 1)[1]), shape)
    if name == "tts_model.tts_model.rvq_embs":
        return np.stack([_rvq_codebook(rng, k, shape[1:]) for k in range(shape[0])])
    mean, std = _init_stats(init)
    if std <= 1e-6 * max(1.0, abs(mean)):  # constant init (norm weights, scalars): jitter it
        return np.asarray(mean + 0.05 * rng.standard_normal(shape), dtype=np.float32)
    value = (mean + std * rng.standard_normal(shape, dtype=np.float32)).astype(np.float32)
    return _rnnt_shaping(name, value, cfg)


# Trained RVQ codebooks: stage q quantizes what stages 0..q-1 left, so the spread of codebook q
# shrinks with q (here geometrically, from RVQ_SCALE0 to about a tenth of it at q = 30). With 1024
# entries the top-2 distances of a residual are then often closer than bf16's rounding of the
# squared norms, so late codebooks have near-ties that rounding decides, as the published bf16
# codebooks do; parity_tests/test_near_ties.py counts them.
RVQ_SCALE0, RVQ_DECAY = 0.2, 0.93
_CODEC_BOOKS = "tts_model.audio_codec.prvq.mus_list."


def _rvq_codebook(rng: np.random.Generator, q: int, shape) -> np.ndarray:
    return (rng.standard_normal(shape, dtype=np.float32) * np.float32(RVQ_SCALE0 * RVQ_DECAY**q)).astype(np.float32)


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
        fb = np.asarray(mel_filterbank(p), dtype=np.float32)[None]
    except Exception:  # the buffer is never read back; its shape is what matters
        fb = np.zeros((1, p.features, p.n_fft // 2 + 1), dtype=np.float32)
    return {
        "stt_model.perception.preprocessor.featurizer.fb": fb,
        "stt_model.perception.preprocessor.featurizer.window": window,
    }


def _safetensors_header(pieces: list[tuple[str, tuple, str, int]]) -> tuple[bytes, dict[str, int]]:
    """The header block of a shard (sorted keys, fixed metadata, so output is byte-stable) and
    each tensor's byte offset in the file. `pieces`: (name, shape, dtype, nbytes)."""
    header, offsets, offset = {}, {}, 0
    for name, shape, dt, nbytes in sorted(pieces):
        header[name] = {"dtype": dt, "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
        offsets[name] = offset
        offset += nbytes
    header["__metadata__"] = {"format": "pt"}
    blob = json.dumps(header, separators=(",", ":"), sort_keys=True).encode()
    blob += b" " * ((8 - len(blob) % 8) % 8)
    start = 8 + len(blob)
    return struct.pack("<Q", len(blob)) + blob, {k: start + v for k, v in offsets.items()}


def _tensor_plan(model, cfg: VoiceChatConfig, bits: int | None):
    """(mlx_name, shape, init, quantized?) for every parameter, sorted by name."""
    qmods = set(language_path_modules(model)) if bits else set()
    plan = []
    for name, arr in tree_flatten(model.parameters()):
        module = name.rsplit(".", 1)[0]
        # The converter's rule: a language-path 2-D weight whose last dim the group size divides.
        quant = module in qmods and name.endswith(".weight") and arr.shape[-1] % GROUP_SIZE == 0
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
    cfg = VoiceChatConfig.from_dict(preset_dict(preset))
    model = VoiceChatNetwork(cfg)
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


# Row chunks of this many elements are drawn, converted and written at a time, so a
# tensor of any size costs a bounded amount of memory (the values do not depend on it:
# numpy's generator continues its stream across draws; tested).
CHUNK_ELEMENTS = 1 << 22
# Above this size, a Linear / Embedding weight's init statistics come from a same-class
# module with fewer rows (the init scale depends only on the input width) instead of
# evaluating the whole init (2.3 GB at the published embedding shape). No tensor of the
# tiny or small presets is this large, so their files are unchanged.
PROXY_STATS_ELEMENTS = 1 << 24

_INT_NAMES = (
    "subword_flag_emb.is_continuation",
    "subword_flag_emb.pad_tensor",
    "bos_eos_emb.pad_tensor",
    "bos_eos_emb.special_flags",
)


def _is_integer(name: str, init: mx.array) -> bool:
    """Whether `_draw` gives int64 values for this tensor (planned before anything is drawn)."""
    return (
        name.endswith(_INT_NAMES)
        or name in ("tts_model.control_codes", "tts_model.codec_silence_tokens")
        or mx.issubdtype(init.dtype, mx.integer)
    )


def _proxy_stats(module, shape) -> tuple[float, float] | None:
    """Init statistics of a large Linear / Embedding weight from a smaller module of the same class."""
    if type(module) is nn.Linear:
        rows = max(1, PROXY_STATS_ELEMENTS // shape[1])
        return _init_stats(nn.Linear(shape[1], rows, bias=False).weight)
    if type(module) is nn.Embedding:
        rows = max(1, PROXY_STATS_ELEMENTS // shape[1])
        return _init_stats(nn.Embedding(rows, shape[1]).weight)
    return None


_LSTM = "stt_model.rnnt_decoder.prediction.dec_rnn.lstm."


def _pieces(name, shape, init, quant, bits, cfg, float_dt: str) -> list[tuple[str, tuple, str]]:
    """(raw name, shape, safetensors dtype) of what one MLX-layout tensor is stored as, in the
    order they are emitted; computed from shapes (the zeros are never evaluated)."""
    if quant:
        module, (out, inp) = name[: -len(".weight")], shape
        return [
            (name, (out, inp * bits // 32), "U32"),
            (module + ".scales", (out, inp // GROUP_SIZE), "F32"),
            (module + ".biases", (out, inp // GROUP_SIZE), "F32"),
        ]
    if _is_integer(name, init):
        return [(k, tuple(v.shape), "I64") for k, v in unsanitize({name: mx.zeros(shape, mx.int64)}, cfg).items()]
    if name.startswith(_LSTM) and name.endswith(".bias"):
        layer = name.split(".")[-2]
        return [(f"{_LSTM}bias_ih_l{layer}", shape, float_dt), (f"{_LSTM}bias_hh_l{layer}", shape, float_dt)]
    return [(k, tuple(v.shape), float_dt) for k, v in unsanitize({name: mx.zeros(shape)}, cfg).items()]


def _nbytes(shape, dt: str) -> int:
    return math.prod(shape) * {"U32": 4, "F32": 4, "I64": 8, "BF16": 2}[dt]


class _ShardFiles:
    """The shards of a checkpoint, laid out before any value exists: each file gets its header
    and its final size up front, and every tensor (or row chunk of one) is written at its
    offset as soon as it is made, then dropped."""

    def __init__(self, folder: Path, pieces: list[tuple[str, tuple, str]], n_shards: int):
        total = sum(_nbytes(shape, dt) for _, shape, dt in pieces)
        target = total / n_shards
        groups: list[list] = [[]]
        filled = 0
        for name, shape, dt in pieces:  # same rule as filling shards in emission order
            if filled >= target and len(groups) < n_shards:
                groups.append([])
                filled = 0
            nb = _nbytes(shape, dt)
            groups[-1].append((name, shape, dt, nb))
            filled += nb
        self.paths, self.where, self.dtype = [], {}, {}
        for i, group in enumerate(groups):
            f = folder / f".shard-{i}.tmp"
            header, offsets = _safetensors_header(group)
            with open(f, "wb") as fh:
                fh.write(header)
                fh.truncate(len(header) + sum(g[3] for g in group))
            self.paths.append(f)
            for name, _shape, dt, nb in group:
                self.where[name] = (i, offsets[name], nb)
                self.dtype[name] = dt
        self._files = [open(f, "r+b") for f in self.paths]  # noqa: SIM115 - written across calls; closed in close()

    def write(self, name: str, arr: np.ndarray, start: int = 0) -> None:
        """The bytes of `arr` at byte `start` within tensor `name`."""
        i, offset, nb = self.where[name]
        data = np.require(arr, requirements="C")
        if start + data.nbytes > nb:
            raise AssertionError(f"{name}: writing past its planned size ({start + data.nbytes} > {nb})")
        f = self._files[i]
        f.seek(offset + start)
        f.write(memoryview(data).cast("B") if data.ndim else data.tobytes())

    def close(self):
        for f in self._files:
            f.close()


def _stored(value: np.ndarray, dt: str) -> np.ndarray:
    if dt == "BF16":
        return _f32_to_bf16_bits(value)
    want = {"F32": np.float32, "I64": np.int64, "U32": np.uint32}[dt]
    if value.dtype != want:
        raise AssertionError(f"planned {dt}, drew {value.dtype}")
    return value


def write_checkpoint(
    path,
    preset: str = "tiny",
    *,
    bits: int | None = None,
    seed: int = 0,
    dtype: str = "bfloat16",
    n_shards: int | None = None,
    progress: bool | None = False,
    overrides: dict | None = None,
    tool: str | None = None,
    arguments=None,
) -> Path:
    """Write a synthetic checkpoint folder; returns its path.

    Memory is bounded whatever the preset: the shard files are laid out from the shapes
    first, then each tensor is drawn, converted, written at its offset and dropped (large
    ones in row chunks of `CHUNK_ELEMENTS`). `overrides` is deep-merged into the preset's
    config (e.g. fewer layers for a quick structural test of the `small` geometry).
    """

    if bits not in (None, 4, 8):
        raise ValueError(f"bits must be None, 4 or 8, got {bits!r}")
    if dtype not in ("bfloat16", "float32"):
        raise ValueError(f"dtype must be 'bfloat16' (published) or 'float32', got {dtype!r}")
    script = None
    n_special = 20
    if preset == "toolcall":  # tiny, with a language path that spells one call (voicechat/synthetic/toolcall.py)
        if tool is None:
            raise ValueError("the toolcall preset needs tool=NAME (and arguments=JSON object)")
        n_special = SPECIAL_COUNT
        script = ToolcallScript(
            build_synthetic_tokenizer(preset_dict("tiny")["text_config"]["vocab_size"], n_special),
            tool,
            {} if arguments is None else arguments,
        )
        overrides = _deep_update(toolcall_overrides(script), overrides or {})
    elif tool is not None or arguments is not None:
        raise ValueError("tool / arguments are for the toolcall preset")
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    cfg_dict = _deep_update(preset_dict("tiny" if preset == "toolcall" else preset), overrides or {})
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
    model = VoiceChatNetwork(cfg)
    plan = _tensor_plan(model, cfg, bits)
    designed = {}
    if script is not None:
        designed = toolcall_tensors(cfg, None, script, [(n, s) for n, s, _, _ in plan])
    # The init arrays are lazy (nothing is allocated until one is evaluated for its
    # statistics); the plan keeps them, the model is not needed any more.
    modules = dict(model.named_modules())
    proxy = {}
    for name, shape, _, _ in plan:
        if math.prod(shape) > PROXY_STATS_ELEMENTS:
            stats = _proxy_stats(modules[name.rsplit(".", 1)[0]], shape)
            if stats is not None:
                proxy[name] = stats
    del model, modules
    mx.random.seed(resume_seed)

    total = sum(_stored_nbytes(*p, bits) for p in plan)
    if n_shards is None:
        n_shards = max(2, math.ceil(total / SHARD_BYTES))
    float_dt = "BF16" if dtype == "bfloat16" else "F32"
    buffers = sorted(_preprocessor_buffers(cfg).items())  # NeMo stores these in float32
    pieces = [(k, tuple(v.shape), "F32") for k, v in buffers]
    for name, shape, init, quant in plan:
        pieces += _pieces(name, shape, init, quant, bits, cfg, float_dt)
    files = _ShardFiles(path, pieces, n_shards)
    old_limit = mx.set_cache_limit(64 * 1024**2)  # freed tensors go back to the system
    # progress: None or True draw a bar when stderr is a terminal, False never (voicechat/io/progress.py)
    bar = _progress_bar(len(plan), f"synth {preset} {bits or 'bf16'}") if progress is not False else None
    try:
        for k, v in buffers:
            files.write(k, _stored(v, "F32"))
        for idx in range(len(plan)):
            name, shape, init, quant = plan[idx]
            plan[idx] = None  # drop the init (evaluated below for its statistics) with the tensor
            _write_tensor(
                files, name, shape, init, quant, bits, cfg, seed, float_dt, proxy.get(name), designed.get(name)
            )
            del init
            if bar is not None:
                bar.update(1)
    finally:
        files.close()
        mx.set_cache_limit(old_limit)
        mx.clear_cache()
        if bar is not None:
            bar.close()

    n = len(files.paths)
    names = {}
    for i, f in enumerate(files.paths):
        final = path / f"model-{i + 1:05d}-of-{n:05d}.safetensors"
        f.replace(final)
        names[i] = final.name
    index = {
        "metadata": {
            "total_size": total,
            "synthetic": True,
            "preset": preset,
            "seed": seed,
            "bits": bits,
            **({"tool": script.name, "arguments": script.arguments} if script is not None else {}),
        },
        "weight_map": {k: names[files.where[k][0]] for k in sorted(files.where)},
    }
    (path / "model.safetensors.index.json").write_text(json.dumps(index, indent=2, sort_keys=True))
    (path / "config.json").write_text(json.dumps(cfg_dict, indent=2, allow_nan=True, ensure_ascii=False))
    write_synthetic_tokenizer(path, cfg.text_config.vocab_size, n_special)
    (path / "README.md").write_text(
        f"# Synthetic VoiceChat checkpoint\n\nRandom weights (preset `{preset}`, seed {seed}, "
        f"bits {bits or 'none (bf16)'}), written by `voicechat.synthetic` in the published on-disk layout. "
        "Not a trained model: use it for tests and timing only.\n"
    )
    return path


def _progress_bar(total: int, desc: str):

    return bar(total=total, desc=desc, unit="tensor")


def _write_tensor(
    files: _ShardFiles,
    name,
    shape,
    init,
    quant,
    bits,
    cfg,
    seed,
    float_dt,
    proxy_stats,
    designed: np.ndarray | None = None,
):
    """Draw one MLX-layout tensor and write what it is stored as (row chunks when it is large).
    `designed`: the tensor's values instead of a random draw (the toolcall preset)."""
    chunked = (
        designed is None
        and len(shape) == 2
        and not _is_integer(name, init)
        and [k for k, _, _ in _pieces(name, shape, init, False, bits, cfg, float_dt)] == [name]
        and name not in _RNNT_SCALE
        and not name.startswith(("tts_model.audio_prompt_latents.", _CODEC_BOOKS))
    )
    if chunked:
        mean, std = proxy_stats or _init_stats(init)
        if not std <= 1e-6 * max(1.0, abs(mean)):
            _write_rows(files, name, shape, mean, std, quant, bits, seed)
            return
    value = _draw(name, shape, init, cfg, seed) if designed is None else designed
    if quant:
        wq, scales, biases = mx.quantize(mx.array(value), group_size=GROUP_SIZE, bits=bits)
        module = name[: -len(".weight")]
        files.write(name, _stored(np.array(wq), "U32"))
        files.write(module + ".scales", _stored(np.array(scales.astype(mx.float32)), "F32"))
        files.write(module + ".biases", _stored(np.array(biases.astype(mx.float32)), "F32"))
        return
    if value.dtype == np.int64:
        for rk, rv in unsanitize({name: mx.array(value)}, cfg).items():
            files.write(rk, _stored(np.array(rv).astype(np.int64), "I64"))
        return
    if name.startswith(_LSTM) and name.endswith(".bias"):
        # Raw LSTM stores two bias vectors that the loader sums.
        layer = name.split(".")[-2]
        rng = _rng(seed, name + ".split")
        hh = (0.1 * rng.standard_normal(shape)).astype(np.float32)
        files.write(f"{_LSTM}bias_ih_l{layer}", _stored(value - hh, float_dt))
        files.write(f"{_LSTM}bias_hh_l{layer}", _stored(hh, float_dt))
        return
    for rk, rv in unsanitize({name: mx.array(value)}, cfg).items():
        files.write(rk, _stored(np.array(rv), float_dt))


def _write_rows(files: _ShardFiles, name, shape, mean, std, quant, bits, seed):
    """`mean + std * normal` (as `_draw`), drawn, converted and written a row chunk at a time."""
    rows, cols = shape
    rng = _rng(seed, name)
    step = max(1, CHUNK_ELEMENTS // cols)
    module = name[: -len(".weight")]
    for r in range(0, rows, step):
        n = min(step, rows - r)
        value = (mean + std * rng.standard_normal((n, cols), dtype=np.float32)).astype(np.float32)
        if quant:
            wq, scales, biases = mx.quantize(mx.array(value), group_size=GROUP_SIZE, bits=bits)
            files.write(name, _stored(np.array(wq), "U32"), r * (cols * bits // 8))
            files.write(
                module + ".scales", _stored(np.array(scales.astype(mx.float32)), "F32"), r * (cols // GROUP_SIZE) * 4
            )
            files.write(
                module + ".biases", _stored(np.array(biases.astype(mx.float32)), "F32"), r * (cols // GROUP_SIZE) * 4
            )
        else:
            files.write(name, _stored(value, files.dtype[name]), r * cols * (2 if files.dtype[name] == "BF16" else 4))


def cache_root() -> Path:

    return cache_home() / "synthetic"


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

    if preset not in PRESETS:
        raise ValueError(f"{spec!r}: unknown preset {preset!r}; expected one of {', '.join(PRESETS)}")
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
