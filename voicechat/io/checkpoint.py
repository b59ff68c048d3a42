"""The published on-disk format: raw (PyTorch/NeMo) names and layouts <-> MLX layout.

docs/model.md §2.2 lists the transforms. They are applied exactly once: the
files always hold the raw layout (this module's `save_weights` writes it back),
so a loaded model saved and reloaded loads again (the reference saves MLX
layout and re-transforms it on reload). A folder that already holds MLX-layout
names is recognised and loaded without transforming twice.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import mlx.core as mx
import numpy as np

from voicechat.errors import CheckpointError
from voicechat.model.config import VoiceChatConfig

PREPROCESSOR_PREFIX = "stt_model.perception.preprocessor."
PERCEPTION_PREFIX = "stt_model.perception."
LSTM_PREFIX = "stt_model.rnnt_decoder.prediction.dec_rnn.lstm."
TTS_PREFIX = "tts_model."
CODEC_PREFIX = "tts_model.audio_codec."

_LSTM_RAW = re.compile(r"^(weight_ih|weight_hh|bias_ih|bias_hh)_l(\d+)$")
_DECODER_LAYER = re.compile(r"^tts_model\.audio_codec\.decoder\.layers\.(\d+)\.")


def _is_codec_upsampler(key: str, cfg: VoiceChatConfig) -> bool:
    """ConvTranspose1d upsamplers: decoder layers whose index is divisible by b+1 (clarifications)."""
    m = _DECODER_LAYER.match(key)
    if not m or ".dwconv" in key:
        return False
    b = cfg.codec_config.blocks_per_stage
    stages = len(cfg.codec_config.downsample_rates)
    n = int(m.group(1))
    return n < (b + 1) * stages and n % (b + 1) == 0


def _is_stt_conv1d(key: str, w) -> bool:
    """Conv1d kernels stored (O, I, K) raw / (O, K, I) in MLX: conformer convs and the Mamba conv."""
    return w.ndim == 3 and (
        key.startswith(PERCEPTION_PREFIX) or (key.startswith("stt_model.llm.") and ".conv1d.weight" in key)
    )


def is_raw_layout(weights: dict) -> bool:
    """True for raw (NeMo) names, False for MLX-layout names; mixed raises."""
    raw = any(
        k.startswith(PREPROCESSOR_PREFIX) or "weight_ih_l" in k or "._control_codes" in k or "prvq._variance_list" in k
        for k in weights
    )
    mlx_names = any(
        (k.startswith(LSTM_PREFIX) and (k.endswith((".Wx", ".Wh"))))
        or k == "tts_model.control_codes"
        or "prvq.variance_list" in k
        for k in weights
    )
    if raw and mlx_names:
        raise CheckpointError(
            "checkpoint mixes raw (NeMo) and MLX-layout tensor names (e.g. both "
            "'weight_ih_l0' and '.Wx' LSTM names); expected one layout"
        )
    return raw or not mlx_names


def sanitize(weights: dict, cfg: VoiceChatConfig) -> dict:
    """Raw layout -> MLX layout (docs/model.md §2.2). Input dict is not modified."""
    out: dict = {}
    lstm_bias: dict[int, dict[str, mx.array]] = {}
    for key, w in weights.items():
        if key.startswith(PREPROCESSOR_PREFIX):
            continue  # the frontend recomputes the filterbank and window
        if key.startswith(LSTM_PREFIX):
            m = _LSTM_RAW.match(key[len(LSTM_PREFIX) :])
            if m:
                kind, layer = m.group(1), int(m.group(2))
                if kind == "weight_ih":
                    out[f"{LSTM_PREFIX}{layer}.Wx"] = w
                elif kind == "weight_hh":
                    out[f"{LSTM_PREFIX}{layer}.Wh"] = w
                else:
                    lstm_bias.setdefault(layer, {})[kind] = w
                continue
        if key.startswith(TTS_PREFIX):
            if key == "tts_model._control_codes":
                out["tts_model.control_codes"] = w
                continue
            if key.startswith(CODEC_PREFIX):
                key = key.replace("prvq._variance_list.", "prvq.variance_list.")
                if w.ndim == 3 and key.endswith(".weight"):
                    w = w.transpose(1, 2, 0) if _is_codec_upsampler(key, cfg) else w.transpose(0, 2, 1)
            out[key] = w
            continue
        if key.startswith(PERCEPTION_PREFIX) and w.ndim == 4:
            w = w.transpose(0, 2, 3, 1)
        elif _is_stt_conv1d(key, w):
            w = w.transpose(0, 2, 1)
        out[key] = w
    for layer, parts in sorted(lstm_bias.items()):
        if set(parts) != {"bias_ih", "bias_hh"}:
            missing = {"bias_ih", "bias_hh"} - set(parts)
            raise CheckpointError(
                f"RNNT LSTM layer {layer}: missing {sorted(f'{LSTM_PREFIX}{m}_l{layer}' for m in missing)}"
            )
        out[f"{LSTM_PREFIX}{layer}.bias"] = parts["bias_ih"] + parts["bias_hh"]
    return out


def unsanitize(weights: dict, cfg: VoiceChatConfig) -> dict:
    """MLX layout -> raw layout; the exact inverse of `sanitize` (LSTM bias goes to bias_ih, bias_hh = 0)."""
    out: dict = {}
    for key, w in weights.items():
        if key.startswith(LSTM_PREFIX):
            rest = key[len(LSTM_PREFIX) :]
            layer, name = rest.split(".", 1)
            if name == "Wx":
                out[f"{LSTM_PREFIX}weight_ih_l{layer}"] = w
            elif name == "Wh":
                out[f"{LSTM_PREFIX}weight_hh_l{layer}"] = w
            elif name == "bias":
                out[f"{LSTM_PREFIX}bias_ih_l{layer}"] = w
                out[f"{LSTM_PREFIX}bias_hh_l{layer}"] = mx.zeros_like(w)
            else:
                raise CheckpointError(f"unexpected LSTM tensor {key}")
            continue
        if key.startswith(TTS_PREFIX):
            if key == "tts_model.control_codes":
                out["tts_model._control_codes"] = w
                continue
            if key.startswith(CODEC_PREFIX):
                if w.ndim == 3 and key.endswith(".weight"):
                    # inverse of (1,2,0) is (2,0,1); inverse of (0,2,1) is itself
                    w = w.transpose(2, 0, 1) if _is_codec_upsampler(key, cfg) else w.transpose(0, 2, 1)
                key = key.replace("prvq.variance_list.", "prvq._variance_list.")
            out[key] = w
            continue
        if key.startswith(PERCEPTION_PREFIX) and w.ndim == 4:
            w = w.transpose(0, 3, 1, 2)
        elif _is_stt_conv1d(key, w):
            w = w.transpose(0, 2, 1)  # (0, 2, 1) is its own inverse
        out[key] = w
    return out


# --------------------------------------------------------------------------- quantization


def quantized_module_paths(weights: dict) -> set[str]:
    """Modules whose `.scales` are stored: exactly those are quantized (docs/model.md §3.3)."""
    return {k[: -len(".scales")] for k in weights if k.endswith(".scales")}


def quantization_plan(weights: dict, cfg: VoiceChatConfig) -> dict[str, dict]:
    """path -> {group_size, bits, mode} for every quantized module, checked against the config entry.

    Bits are inferred from the packed width and the scales' width and must agree
    with the config entry; a module the entry switches off (`false`) but whose
    scales are stored is an error, and so are scales without a config entry.
    """
    paths = quantized_module_paths(weights)
    if not paths:
        return {}
    q = cfg.quantization
    if not isinstance(q, dict):
        raise CheckpointError(
            f"{len(paths)} modules have stored '.scales' (e.g. {sorted(paths)[0]}) but config.json "
            "has no 'quantization' entry; expected {'group_size': 64, 'bits': 4|8}"
        )
    plan, problems = {}, []
    for p in sorted(paths):
        entry = q.get(p, None)
        if entry is False:
            problems.append(f"{p}: config quantization entry says false but '{p}.scales' is stored")
            continue
        settings = {"group_size": q.get("group_size"), "bits": q.get("bits"), "mode": q.get("mode", "affine")}
        if isinstance(entry, dict):
            settings.update({k: v for k, v in entry.items() if k in settings})
        w, s = weights.get(p + ".weight"), weights.get(p + ".scales")
        # Affine quantization stores scales and biases; MLX's floating-point modes (mxfp4,
        # mxfp8, nvfp4) store scales only.
        affine = settings["mode"] == "affine"
        if w is None or (p + ".biases" in weights) != affine:
            needs = "'.weight' and '.biases'" if affine else f"'.weight' and no '.biases' (mode {settings['mode']})"
            problems.append(f"{p}: '.scales' stored without {needs}")
            continue
        gs, bits = settings["group_size"], settings["bits"]
        if gs is None or bits is None:
            problems.append(f"{p}: quantization entry lacks group_size/bits")
            continue
        if w.dtype != mx.uint32:
            problems.append(f"{p}.weight: quantized weights must be uint32, got {w.dtype}")
            continue
        in_features = s.shape[-1] * gs
        if w.shape[-1] * 32 != in_features * bits:
            stored_bits = w.shape[-1] * 32 / max(in_features, 1)
            problems.append(
                f"{p}: config says {bits}-bit group {gs} but the stored tensors imply "
                f"{stored_bits:g}-bit (weight {tuple(w.shape)}, scales {tuple(s.shape)})"
            )
            continue
        plan[p] = settings
    if problems:
        raise CheckpointError("quantization does not match the stored tensors:\n  " + "\n  ".join(problems))
    return plan


# --------------------------------------------------------------------------- files


def read_safetensors(folder: Path) -> tuple[dict, list[Path]]:
    """All tensors of a checkpoint folder, through the index when there is one."""
    index = folder / "model.safetensors.index.json"
    if index.exists():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError) as e:
            raise CheckpointError(f"{index}: not a valid safetensors index ({e})") from None
        shards = sorted(set(weight_map.values()))
        missing = [s for s in shards if not (folder / s).exists()]
        if missing:
            raise CheckpointError(f"{index} names shard(s) that do not exist: {missing}")
        files = [folder / s for s in shards]
    else:
        files = sorted(folder.glob("*.safetensors"))
        weight_map = None
    if not files:
        raise CheckpointError(f"{folder}: no *.safetensors files (only safetensors checkpoints are supported)")
    weights: dict = {}
    for f in files:
        try:
            part = mx.load(str(f))
        except Exception as e:  # mlx raises RuntimeError/ValueError on truncated files
            raise CheckpointError(
                f"{f.name}: cannot read safetensors shard ({e}); is it truncated or corrupt?"
            ) from None
        if not isinstance(part, dict):
            raise CheckpointError(f"{f.name}: not a safetensors file")
        dup = set(part) & set(weights)
        if dup:
            raise CheckpointError(f"{f.name}: tensors stored in more than one shard: {sorted(dup)[:5]}")
        weights.update(part)
    if weight_map is not None:
        listed, stored = set(weight_map), set(weights)
        if listed != stored:
            raise CheckpointError(
                "model.safetensors.index.json disagrees with the shards: "
                f"listed but not stored {sorted(listed - stored)[:10]}, "
                f"stored but not listed {sorted(stored - listed)[:10]}"
            )
    return weights, files


def write_shards(raw: dict, folder: Path, n_shards: int = 2, metadata: dict | None = None) -> dict:
    """Write raw tensors as `model-0000i-of-0000n.safetensors` + index; returns the weight map."""
    folder.mkdir(parents=True, exist_ok=True)
    keys = sorted(raw)
    sizes = [raw[k].nbytes for k in keys]
    total = sum(sizes)
    shards: list[list[str]] = [[] for _ in range(n_shards)]
    acc, s = 0, 0
    for k, sz in zip(keys, sizes, strict=True):
        if s < n_shards - 1 and acc >= total * (s + 1) / n_shards:
            s += 1
        shards[s].append(k)
        acc += sz
    shards = [sh for sh in shards if sh]
    weight_map = {}
    n = len(shards)
    for i, names in enumerate(shards):
        fname = f"model-{i + 1:05d}-of-{n:05d}.safetensors"
        mx.save_safetensors(str(folder / fname), {k: raw[k] for k in names}, metadata={"format": "mlx"})
        weight_map.update(dict.fromkeys(names, fname))
    index = {"metadata": {"total_size": total, **(metadata or {})}, "weight_map": dict(sorted(weight_map.items()))}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    return weight_map


# A float is NaN or +-inf exactly when all its exponent bits are set: testing the bits on a numpy
# view of the stored array is ~9x faster than MLX's isfinite + all on the CPU backend (10.6 vs
# 95 ms for a 4096 x 4096 bf16 matrix on the benchmark machine).
_EXPONENT_BITS = {
    mx.bfloat16: (mx.uint16, np.uint16(0x7F80)),
    mx.float16: (mx.uint16, np.uint16(0x7C00)),
    mx.float32: (mx.uint32, np.uint32(0x7F800000)),
}
# Elements tested at a time, so the temporaries stay small beside the largest tensor.
NONFINITE_CHUNK_ELEMENTS = 1 << 24


def _bit_chunks(a: mx.array):
    """(lazy uint views of `a` in row chunks, exponent mask), or None for dtypes without a bit test."""
    spec = _EXPONENT_BITS.get(a.dtype)
    if spec is None:
        return None
    utype, mask = spec
    if a.ndim == 0:
        a = a.reshape(1)
    if a.size == 0:
        return [], mask
    rows = max(1, NONFINITE_CHUNK_ELEMENTS // max(1, a.size // a.shape[0]))
    return [a[start : start + rows].view(utype) for start in range(0, a.shape[0], rows)], mask


def _any_exponent_all_ones(chunks, mask) -> bool:
    return any(bool((np.bitwise_and(np.asarray(c), mask) == mask).any()) for c in chunks)


def has_nonfinite(a: mx.array) -> bool:
    """True if the float array `a` holds a NaN or an infinity (it is evaluated)."""
    return bool(nonfinite_tensors({"a": a}))


def nonfinite_tensors(weights: dict) -> list[str]:
    """Names of the float tensors of `weights` holding NaN or inf (each is evaluated). The bit
    views of all of them are evaluated together: one MLX evaluation per tensor cost ~80 us
    (1745 tensors at `small`)."""
    floats = [k for k, w in weights.items() if mx.issubdtype(w.dtype, mx.floating)]
    tests = {k: _bit_chunks(weights[k]) for k in floats}
    mx.eval([t[0] for t in tests.values() if t is not None])
    bad = []
    for k in floats:
        t = tests[k]
        if t is None:  # float64 and anything else: MLX's own test
            if not bool(mx.isfinite(weights[k]).all().item()):
                bad.append(k)
        elif _any_exponent_all_ones(*t):
            bad.append(k)
    return bad
