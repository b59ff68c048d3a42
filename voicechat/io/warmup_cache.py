"""On-disk cache of the EAR-TTS speaker warm-up (docs/model.md §8.5).

The warm-up (the codec encoder over 38 frames of silence, then the TTS backbone
over the 37 prompt positions of the guidance pair) depends only on the weights
and on how the products are computed. It is the largest part of `voicechat.load`
after reading the weights (docs/performance.md). Its result (prompt codes and the TTS K/V
buffers) is a few MB even at the published shapes, so it is computed once per checkpoint
and read back on later loads.

The key covers everything the result depends on: config.json (its bytes),
tokenizer.json and each safetensors file (name, size, modification time), the
numerics, the voicechat and MLX versions, the device type and the product paths
(float32 copies, numpy GEMM for the codec). Replacing or touching a shard or the tokenizer makes
a new key. A cached file is read back bit for bit (tested against a fresh
computation); a file that cannot be read, or does not fit the model, is reported
on stderr and recomputed, never used.

`VOICECHAT_WARMUP_CACHE=0` turns the cache off; files live in
`$VOICECHAT_CACHE/warmup` (default `~/.cache/voicechat/warmup`), the `MAX_ENTRIES`
most recently used ones kept.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import sys
from pathlib import Path

import mlx.core as mx

from voicechat._version import __version__
from voicechat.environment import cache_home, env_flag
from voicechat.io.states import load_state, nest, part, rebuild, save_state
from voicechat.model.ops import stored_transposed

ENV_VAR = "VOICECHAT_WARMUP_CACHE"
# 2: the prompt codes use the codec RVQ norms of the numerics setting (stored dtype under "reference").
# 3: the state as its `state` / `meta_state` (voicechat/io/states.py): arrays `prompt_codes` and
#    `tts.{i}.keys` / `tts.{i}.values` / `tts.previous_codes`, metadata one JSON text.
FORMAT = "voicechat-tts-warmup-3"
# Entries kept (the most recently used): every new or touched checkpoint adds one, each a few MB
# at the published shapes.
MAX_ENTRIES = 8


def enabled() -> bool:
    """Whether the warm-up is cached on disk (default yes; `VOICECHAT_WARMUP_CACHE=0` turns it off)."""
    return env_flag(ENV_VAR, what="cache the TTS speaker warm-up on disk") is not False


def cache_dir() -> Path:
    return cache_home() / "warmup"


def _file_identity(path: Path) -> list:
    st = path.stat()
    return [path.name, st.st_size, st.st_mtime_ns]


def cache_key(model) -> str | None:
    """Hex key of `model`'s warm-up, or None when the model has no checkpoint folder."""
    folder = getattr(model, "folder", None)
    if folder is None:
        return None
    folder = Path(folder)
    h = hashlib.sha256()
    parts = {
        "format": FORMAT,
        "voicechat": __version__,
        "mlx": mx.__version__,
        "device": str(mx.default_device().type),
        "numerics": model.numerics.name,
        "host_gemm": bool(model.policy is not None and model.policy.host_products),
        "transposed_weights": sorted(
            f"{path}:{stored_transposed(m).dtype}"
            for path, m in model.tts_model.named_modules()
            if stored_transposed(m) is not None
        ),
        # Shards and tokenizer.json by identity (re-reading them would add to every load; the
        # tokenizer is ~10 MB at the published size), config.json by its bytes.
        "files": [
            _file_identity(p) for p in sorted(folder.glob("*.safetensors")) + [folder / "tokenizer.json"] if p.exists()
        ],
        "config": hashlib.sha256((folder / "config.json").read_bytes()).hexdigest(),
    }
    h.update(json.dumps(parts, sort_keys=True).encode())
    return h.hexdigest()[:32]


def _warn(msg: str) -> None:
    print(f"voicechat: TTS warm-up cache: {msg}", file=sys.stderr)


META_KEY = "voicechat.tts_warmup"
WHAT = "TTS warm-up cache entry"


def load_cached(model, key: str):
    """(prompt_codes, EarTtsState) read from the cache for `key`, or None (absent or unusable)."""
    path = cache_dir() / f"{key}.safetensors"
    if not path.exists():
        return None
    tts = model.tts_model.tts_model

    def check(meta):
        if not isinstance(meta, dict) or meta.get("format") != FORMAT or meta.get("key") != key:
            got = meta.get("format") if isinstance(meta, dict) else None
            raise ValueError(f"written for another key or format ({got!r})")

    try:
        arrays, meta = load_state(path, meta_key=META_KEY, what=WHAT, check=check)
        codes = arrays.pop("prompt_codes")
        fresh = tts.make_state()
        state = rebuild(type(fresh), part(arrays, "tts"), meta["tts"], fresh)
        extra = sorted(set(arrays) - set(nest("tts", state.state)))
        if extra:
            raise ValueError(f"unexpected arrays {extra[:5]}")
        if codes.ndim != 2 or codes.shape[1] != state.num_quantizers:
            raise ValueError(
                f"prompt codes of shape {tuple(codes.shape)}; the model has {state.num_quantizers} codebooks"
            )
    except Exception as e:  # unusable: say so, recompute (the caller overwrites it)
        _warn(f"ignoring {path} ({type(e).__name__}: {e}); recomputing")
        return None
    with contextlib.suppress(OSError):
        os.utime(path)  # most recently used: kept by the pruning in `store`
    return codes, state


def store(key: str, prompt_codes: mx.array, state) -> Path | None:
    """Write the warm-up for `key` (atomically: a temporary file, then a rename): the prompt codes
    and the state's `state` / `meta_state` (voicechat/io/states.py). A failure to write is reported
    on stderr; the model goes on with its computed warm-up."""
    folder = cache_dir()
    path = folder / f"{key}.safetensors"
    arrays = {"prompt_codes": prompt_codes, **nest("tts", state.state)}
    meta = {"format": FORMAT, "key": key, "tts": state.meta_state}
    try:
        folder.mkdir(parents=True, exist_ok=True)
        save_state(path, arrays, meta, meta_key=META_KEY)
    except OSError as e:
        _warn(f"could not write {path} ({e}); the next load computes the warm-up again")
        return None
    _prune(folder)
    return path


def _prune(folder: Path) -> None:
    """Keep the MAX_ENTRIES most recently used entries."""
    entries = []
    for p in folder.glob("*.safetensors"):
        if p.name.startswith("."):
            continue
        with contextlib.suppress(OSError):  # removed by another process meanwhile
            entries.append((p.stat().st_mtime_ns, p))
    for _, p in sorted(entries, reverse=True)[MAX_ENTRIES:]:
        p.unlink(missing_ok=True)


__all__ = ["ENV_VAR", "FORMAT", "enabled", "cache_dir", "cache_key", "load_cached", "store"]
