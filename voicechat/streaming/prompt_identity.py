"""What a prompt state's bits depend on besides its prompt: the checkpoint and the numerics.

A prompt state (voicechat/streaming/prompt_state.py) is bound to both: `check_model` refuses a
state in memory for another model, `check_file` a file (voicechat/streaming/prompt_file.py) of
another checkpoint or numerics setting, each with a `PromptStateError` naming the difference.
"""

from __future__ import annotations

import hashlib
import struct
import weakref
from pathlib import Path

import mlx.core as mx

from voicechat.errors import PromptStateError


def numerics_identity(model) -> dict:
    """What the state's bits depend on besides the weights and the prompt: the numerics setting,
    the MLX version and the device type."""
    return {"setting": model.numerics.name, "mlx": mx.__version__, "device": str(mx.default_device().type)}


def _sampled_digest(path: Path, h) -> None:
    """A shard's safetensors header (its tensor index: names, dtypes, shapes, offsets) and 16
    evenly spaced 4 KiB samples of its data: re-reading whole shards (GBs) would cost seconds."""
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise PromptStateError(f"{path}: not a safetensors file (shorter than its header length)")
        (n,) = struct.unpack("<Q", head)
        h.update(f.read(n))
        start = 8 + n
        span = max(0, size - start)
        for i in range(16):
            f.seek(start + (span * i) // 16)
            h.update(f.read(4096))
    h.update(str(size).encode())


# Each loaded model's checkpoint identity, hashed once (kept beside the model, not on it).
_IDENTITIES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def checkpoint_identity(model) -> str:
    """Hex SHA-256 of the checkpoint: config.json, the index, tokenizer.json (the prompt's token ids
    come from it) and each shard's tensor index with samples of its data. Computed once per model."""
    cached = _IDENTITIES.get(model)
    if cached is not None:
        return cached
    folder = getattr(model, "folder", None)
    if folder is None:
        raise PromptStateError(
            "the model was not loaded from a checkpoint folder (voicechat.load), so its "
            "identity cannot be recorded or checked; load it with voicechat.load(PATH)"
        )
    folder = Path(folder)
    h = hashlib.sha256()
    for name in ("config.json", "model.safetensors.index.json", "tokenizer.json"):
        p = folder / name
        h.update(name.encode())
        if p.exists():
            h.update(hashlib.sha256(p.read_bytes()).digest())
    for p in sorted(folder.glob("*.safetensors")):
        h.update(p.name.encode())
        _sampled_digest(p, h)
    _IDENTITIES[model] = h.hexdigest()
    return _IDENTITIES[model]


def numerics_mismatch(stored: dict, have: dict) -> str:
    diff = [
        f"{k} {stored.get(k)!r} (the model: {have.get(k)!r})"
        for k in sorted(set(stored) | set(have))
        if stored.get(k) != have.get(k)
    ]
    return (
        "prompt state made under other numerics: " + "; ".join(diff) + ". Prepare it again under this model's settings"
    )


def check_model(model, *, made_by, checkpoint: str | None, numerics: dict) -> None:
    """PromptStateError unless `model` computes what the state's model (`made_by`, None when gone)
    computed: the same numerics and checkpoint."""
    if made_by is model:
        return
    theirs = numerics_identity(model)
    if theirs != numerics:
        raise PromptStateError(numerics_mismatch(numerics, theirs))
    have = checkpoint or (checkpoint_identity(made_by) if made_by is not None else None)
    if have is None or have != checkpoint_identity(model):
        raise PromptStateError(
            f"this prompt state was prepared for another checkpoint (identity {str(have)[:16]}...), the model "
            f"is {checkpoint_identity(model)[:16]}... ({getattr(model, 'folder', None)}); prepare it with "
            "this model's prepare_prompt"
        )


def check_file(path, meta: dict, model) -> None:
    """PromptStateError unless the file's recorded checkpoint and numerics are `model`'s."""
    want = checkpoint_identity(model)
    if meta.get("checkpoint") != want:
        raise PromptStateError(
            f"{path}: prompt state of another checkpoint (identity {str(meta.get('checkpoint'))[:16]}...); the "
            f"model {getattr(model, 'folder', '')} is {want[:16]}.... Write one for it with `voicechat "
            "cache-prompt -m CKPT`"
        )
    have = numerics_identity(model)
    if meta.get("numerics") != have:
        raise PromptStateError(f"{path}: {numerics_mismatch(meta.get('numerics') or {}, have)}")


__all__ = ["check_file", "check_model", "checkpoint_identity", "numerics_identity", "numerics_mismatch"]
