"""States on disk: one writer and one reader over any state's `state` / `meta_state`.

Every state class that can be saved says what it is made of, as mlx-lm's caches do:

* `state`: its arrays, a flat dict by name (a composite state prefixes its parts' names, `nest`);
* `meta_state`: what is not an array, JSON-able (offsets, lengths, layer kinds, seeds);
* `Class.from_state(state, meta_state, like)`: the state rebuilt from the two, checked against
  `like` (a fresh state of the same model: its constants and the shapes it needs), using the
  arrays as given (no copies). A state that does not fit raises ValueError / KeyError.

A file is safetensors: the arrays, and in its metadata one JSON text (under `meta_key`) holding a
header (format, version, identities: whatever the caller records) and the `meta_state`, with an
optional SHA-256 over that text and every array (under `digest_key`). `save_state` writes it
atomically; `load_state` checks its size against its header, hands the metadata to the caller's
`check` (format, version, identity: before anything else is read), reads the arrays and checks
the digest. Errors are raised as the caller's `error` class, naming `what` the file is.

Nothing here knows which states exist: the prompt state (voicechat/streaming/prompt_file.py) and
the TTS warm-up cache (voicechat/io/warmup_cache.py) are two callers.
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
from collections.abc import Callable
from pathlib import Path

import mlx.core as mx
import numpy as np

# --------------------------------------------------------------------------- composing states


def nest(prefix: str, arrays: dict) -> dict:
    """`arrays` with names `prefix.name`: a part's `state` inside a composite state's."""
    return {f"{prefix}.{k}": v for k, v in arrays.items()}


def part(arrays: dict, prefix: str) -> dict:
    """The arrays named `prefix.name`, by `name`: a part's `state` out of a composite's."""
    lead = prefix + "."
    return {k[len(lead) :]: v for k, v in arrays.items() if k.startswith(lead)}


def rebuild(cls, arrays: dict, meta_state, like=None):
    """`cls.from_state(arrays, meta_state, like)`, refusing arrays the rebuilt state does not hold
    (a file of another layout)."""
    state = cls.from_state(arrays, meta_state, like)
    extra = sorted(set(arrays) - set(state.state))
    if extra:
        raise ValueError(f"unexpected arrays {extra[:5]}")
    return state


# --------------------------------------------------------------------------- files


def digest(meta_text: str, arrays: dict) -> str:
    """SHA-256 over the metadata text and every array's name, dtype, shape and bytes."""
    h = hashlib.sha256(meta_text.encode())
    for name in sorted(arrays):
        a = arrays[name]
        h.update(f"{name}:{a.dtype}:{tuple(a.shape)}".encode())
        raw = a.view(mx.uint16) if a.dtype == mx.bfloat16 else a
        h.update(np.ascontiguousarray(np.array(raw)).tobytes())
    return h.hexdigest()


def save_state(path, arrays: dict, meta: dict, *, meta_key: str, digest_key: str | None = None) -> Path:
    """Write `arrays` with `meta` (JSON, keys sorted) under `meta_key`, and its digest under
    `digest_key`, to `path` atomically (a temporary file beside it, then a rename)."""
    meta_text = json.dumps(meta, sort_keys=True)
    mx.eval(list(arrays.values()))
    metadata = {meta_key: meta_text}
    if digest_key is not None:
        metadata[digest_key] = digest(meta_text, arrays)
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp.safetensors")
    try:
        mx.save_safetensors(str(tmp), arrays, metadata=metadata)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    return path


def read_metadata(path: Path, *, what: str, error=ValueError) -> dict:
    """The safetensors metadata of `path` (str -> str), after checking the file's size against its
    header: `error` names a missing, truncated or corrupt file."""
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise error(f"{path}: truncated {what} ({size} bytes, no safetensors header)")
            (n,) = struct.unpack("<Q", head)
            if n > size - 8:
                raise error(
                    f"{path}: truncated {what} (its header says {n} bytes, the file has {size - 8} after the length)"
                )
            header = json.loads(f.read(n))
    except FileNotFoundError:
        raise error(f"{path}: no such {what} file") from None
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise error(f"{path}: corrupt {what} (its safetensors header is not JSON: {e})") from None
    if not isinstance(header, dict):
        raise error(f"{path}: corrupt {what} (its header is not a JSON object)")
    try:
        end = max((int(v["data_offsets"][1]) for k, v in header.items() if k != "__metadata__"), default=0)
    except (KeyError, TypeError, ValueError, IndexError) as e:
        raise error(
            f"{path}: corrupt {what} (a tensor entry of its header is malformed: {type(e).__name__}: {e})"
        ) from None
    if 8 + n + end != size:
        raise error(f"{path}: truncated or corrupt {what} ({size} bytes; its header describes {8 + n + end})")
    return header.get("__metadata__") or {}


def load_state(
    path,
    *,
    meta_key: str,
    digest_key: str | None = None,
    what: str,
    error=ValueError,
    check: Callable[[dict], None] | None = None,
) -> tuple[dict, dict]:
    """(arrays, meta) of a file `save_state` wrote. `check(meta)` runs on the metadata before the
    arrays are read (and may raise); with `digest_key` the digest must match the contents."""
    path = Path(path)
    md = read_metadata(path, what=what, error=error)
    if meta_key not in md or (digest_key is not None and digest_key not in md):
        raise error(f"{path}: not a voicechat {what} (no {meta_key!r} metadata)")
    meta_text = md[meta_key]
    try:
        meta = json.loads(meta_text)
    except json.JSONDecodeError as e:
        raise error(f"{path}: corrupt {what} (its metadata is not JSON: {e})") from None
    if check is not None:
        check(meta)
    try:
        arrays = mx.load(str(path))
        mx.eval(list(arrays.values()))
    except Exception as e:  # a truncated data section, an unreadable file
        raise error(f"{path}: corrupt {what} (cannot read its arrays: {e})") from None
    if digest_key is not None and digest(meta_text, arrays) != md[digest_key]:
        raise error(f"{path}: corrupt {what} (its SHA-256 does not match its contents)")
    return arrays, meta


__all__ = ["digest", "load_state", "nest", "part", "read_metadata", "rebuild", "save_state"]
