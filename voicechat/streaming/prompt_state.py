"""Prompt states: the session state after the system-prompt prefill, as a value (api.md, "Prompt state").

A session with a system prompt first prefills it: one LLM step and one TTS step per prompt token,
no audio, no events. What the prefill leaves behind depends only on the model, the rendered prompt
(system prompt + tools block) and the seed, so `model.prepare_prompt(...)` runs it once and keeps
the result; `create_streaming_session(prompt_state=...)` and `generate(prompt_state=...)` start
from a copy of it and compute exactly what a session that prefilled the same prompt computes.

What a state holds: the generation side the prefill advanced (`voicechat.streaming.timeline.TimelineState`:
the Nemotron-H cache (Mamba conv/SSM states, attention K/V), the EAR-TTS K/V and previous codes,
the random stream's key, the ids fed forward, the timeline position), the number of prompt
positions and the TTS character-encoder rows the prefill computed. The other session state (the
perception, RNNT and codec caches, the token accumulators, the tool-call state machine) is not
touched by a prefill: a session from a state builds it fresh, exactly as the prefilling session
holds it (tested through `session.states()`), so the state does not store those initial values.

Nothing in a state is a copy of the model's own arrays: with an empty prompt its TTS buffers are
the model's warm-up buffers themselves (not counted in `nbytes`). Arrays are only ever replaced,
never written in place while shared (MLX donates a buffer only when nothing else holds it), so
sessions started from one state, one after another or side by side, never change it.

Files: `state.save(path)` writes safetensors (the arrays) with JSON metadata (format version, the
checkpoint's identity, numerics, prompt, tools, seed, the project's version, a SHA-256 of
everything); `PromptState.load(path, model)` refuses another checkpoint, numerics setting or format
version and a truncated or corrupt file with `PromptStateError` naming why.
"""

from __future__ import annotations

import copy
import hashlib
import json
import os
import struct
import weakref
from pathlib import Path

import mlx.core as mx
import numpy as np

from voicechat.errors import PromptStateError

FORMAT = "voicechat-prompt-state"
FORMAT_VERSION = 1
_META_KEY = "voicechat.prompt_state"
_DIGEST_KEY = "voicechat.prompt_state.sha256"


class _Unset:
    """The default of `system_prompt` / `tools` / `seed` where a `prompt_state` may supply them."""

    _instance = None

    def __new__(cls):
        if cls._instance is None:
            cls._instance = super().__new__(cls)
        return cls._instance

    def __repr__(self) -> str:
        return "UNSET"

    def __bool__(self) -> bool:
        return False


UNSET = _Unset()


# --------------------------------------------------------------------------- identity


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
        raise PromptStateError("the model was not loaded from a checkpoint folder (voicechat.load), so its "
                               "identity cannot be recorded or checked; load it with voicechat.load(PATH)")
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


# --------------------------------------------------------------------------- the value


def _norm_prompt(cfg, system_prompt):
    """The prompt text a prefill uses (None: the config's default)."""
    return cfg.default_system_prompt if system_prompt is None else system_prompt


class PromptState:
    """The session state after one system-prompt prefill. Make with `model.prepare_prompt(...)` or
    `PromptState.load(path, model)`; never changed by the sessions started from it."""

    def __init__(self, *, model, system_prompt, tools, seed: int, timeline_state, prompt_positions: int,
                 text_rows: dict, checkpoint: str | None = None):
        self._model_ref = weakref.ref(model)
        self._system_prompt = system_prompt
        self._tools = tuple(tools)
        self._seed = int(seed)
        self._timeline = timeline_state
        self._prompt_positions = int(prompt_positions)
        self._text_rows = dict(text_rows)
        self._checkpoint = checkpoint
        self._numerics = numerics_identity(model)

    # -- read-only properties

    @property
    def system_prompt(self) -> str | None:
        """The system prompt as given to `prepare_prompt` (None: the config's default)."""
        return self._system_prompt

    @property
    def tools(self) -> tuple[dict, ...]:
        """The normalised tool definitions (voicechat.tools.normalize_tools); () without tools. A copy:
        the state's own cannot be changed through it."""
        return copy.deepcopy(self._tools)

    @property
    def seed(self) -> int:
        return self._seed

    @property
    def prompt_positions(self) -> int:
        """Timeline positions the prefill took ([bos] + prompt tokens + [eos]; 0 for an empty prompt)."""
        return self._prompt_positions

    @property
    def numerics(self) -> dict:
        return dict(self._numerics)

    def _model_arrays(self, model) -> set[int]:
        warm = getattr(model, "_warm_tts", None) if model is not None else None
        return {id(a) for a in (warm.keys + warm.values + [warm.previous_codes])} if warm is not None else set()

    def _arrays(self) -> dict[str, mx.array]:
        """Every array the state holds, by file name (full K/V buffers, spare capacity included)."""
        from voicechat.model.llm.nemotron_h import MambaLayerState

        ts = self._timeline
        out = {}
        for i, layer in enumerate(ts.llm.layers):
            if layer is None:
                continue
            if isinstance(layer, MambaLayerState):
                out[f"llm.{i}.conv"], out[f"llm.{i}.ssm"] = layer.conv, layer.ssm
            else:
                out[f"llm.{i}.keys"], out[f"llm.{i}.values"] = layer.keys, layer.values
        for i in range(ts.tts.num_layers):
            out[f"tts.{i}.keys"], out[f"tts.{i}.values"] = ts.tts.keys[i], ts.tts.values[i]
        out["tts.previous_codes"] = ts.tts.previous_codes
        out["rng.key"] = ts.rng.arrays()["key"]
        out["prev_text"], out["prev_function"] = ts.prev_text, ts.prev_function
        for token, row in self._text_rows.items():
            out[f"text_rows.{token}"] = row
        return out

    @property
    def nbytes(self) -> int:
        """Bytes this state holds itself: its arrays, less those that are the model's own (the TTS
        warm-up buffers, which an empty prompt leaves unchanged)."""
        shared = self._model_arrays(self._model_ref())
        seen, total = set(), 0
        for a in self._arrays().values():
            if id(a) not in seen and id(a) not in shared:
                seen.add(id(a))
                total += a.nbytes
        return total

    def __repr__(self) -> str:
        prompt = self._system_prompt if self._system_prompt is None or len(self._system_prompt) <= 40 \
            else self._system_prompt[:37] + "..."
        return (f"PromptState(system_prompt={prompt!r}, tools={len(self._tools)}, seed={self._seed}, "
                f"prompt_positions={self._prompt_positions}, nbytes={self.nbytes})")

    # -- use by sessions

    def check_model(self, model) -> None:
        """PromptStateError unless `model` computes what the state's model computed."""
        mine = self._model_ref()
        if mine is model:
            return
        theirs = numerics_identity(model)
        if theirs != self._numerics:
            raise PromptStateError(_numerics_mismatch(self._numerics, theirs))
        have = self._checkpoint or (checkpoint_identity(mine) if mine is not None else None)
        if have is None or have != checkpoint_identity(model):
            raise PromptStateError(
                f"this prompt state was prepared for another checkpoint (identity {str(have)[:16]}...), the model "
                f"is {checkpoint_identity(model)[:16]}... ({getattr(model, 'folder', None)}); prepare it with "
                "this model's prepare_prompt")

    def resolve(self, model, system_prompt, tools, seed, use_language_cache: bool):
        """The session arguments with the state's values filled in; ValueError where a given one
        disagrees with the state's."""
        from voicechat.tools.channel import normalize_tools

        self.check_model(model)
        if not use_language_cache:
            raise ValueError("prompt_state holds the language cache; use_language_cache=False (recompute mode) "
                             "prefills from scratch: pass no prompt_state")
        cfg = model.config
        if system_prompt is not UNSET and _norm_prompt(cfg, system_prompt) != _norm_prompt(cfg, self._system_prompt):
            raise ValueError(f"system_prompt {_short(system_prompt)} disagrees with the prompt_state's "
                             f"{_short(self._system_prompt)}; leave system_prompt out to use the state's")
        if tools is not UNSET and normalize_tools(tools) != self._tools:
            raise ValueError(f"tools ({len(normalize_tools(tools))} given) disagree with the prompt_state's "
                             f"{len(self._tools)} tool(s) ({', '.join(t['name'] for t in self._tools) or 'none'}); "
                             "leave tools out to use the state's")
        if seed is not UNSET and seed != self._seed:
            raise ValueError(f"seed {seed!r} disagrees with the prompt_state's seed {self._seed}; leave seed out "
                             "to use the state's")
        return self._system_prompt, (list(self._tools) or None), self._seed

    def restore(self, timeline) -> int:
        """Put a copy of the state into a fresh `Timeline` (instead of `timeline.start`); -> positions."""
        timeline.state = self._timeline.copy()
        timeline.prompt_positions = self._prompt_positions
        for token, row in self._text_rows.items():
            timeline.text_cache.put(token, row)
        return self._prompt_positions

    # -- files

    def save(self, path) -> Path:
        """Write the state to `path` (safetensors + JSON metadata; atomically: a temporary file, then a
        rename). The file is bound to this checkpoint and numerics setting."""
        from voicechat._version import __version__

        model = self._model_ref()
        checkpoint = self._checkpoint or (checkpoint_identity(model) if model is not None else None)
        if checkpoint is None:
            raise PromptStateError("the state's model is gone; its checkpoint identity cannot be recorded")
        from voicechat.model.llm.nemotron_h import MambaLayerState

        ts = self._timeline
        arrays = self._arrays()
        meta = {
            "format": FORMAT, "format_version": FORMAT_VERSION, "voicechat": __version__,
            "checkpoint": checkpoint, "numerics": self._numerics,
            "system_prompt": self._system_prompt, "tools": list(self._tools), "seed": self._seed,
            "prompt_positions": self._prompt_positions, "position": ts.position,
            "llm": {"offset": ts.llm.offset,
                    "layers": [None if s is None else ("mamba" if isinstance(s, MambaLayerState) else ["attention", s.length])
                               for s in ts.llm.layers]},
            "tts": {"offset": ts.tts.offset, "ring_origin": list(ts.tts.ring_origin), "windows": list(ts.tts.windows)},
            "rng": {"seed": ts.rng.seed, "draws": ts.rng.draws},
            "text_rows": [int(t) for t in self._text_rows],
        }
        meta_text = json.dumps(meta, sort_keys=True)
        mx.eval(list(arrays.values()))
        digest = _digest(meta_text, arrays)
        path = Path(path)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp.safetensors")
        try:
            mx.save_safetensors(str(tmp), arrays, metadata={_META_KEY: meta_text, _DIGEST_KEY: digest})
            os.replace(tmp, path)
        finally:
            tmp.unlink(missing_ok=True)
        return path

    @classmethod
    def load(cls, path, model) -> "PromptState":
        """Read a state written by `save` for `model`. PromptStateError (nothing is used) for a missing,
        truncated or corrupt file, another format version, checkpoint or numerics setting."""
        path = Path(path)
        meta_text, digest = _read_header(path)
        try:
            meta = json.loads(meta_text)
        except json.JSONDecodeError as e:
            raise PromptStateError(f"{path}: corrupt prompt state (its metadata is not JSON: {e})") from None
        if not isinstance(meta, dict) or meta.get("format") != FORMAT:
            got = meta.get("format") if isinstance(meta, dict) else None
            raise PromptStateError(f"{path}: not a voicechat prompt state (format {got!r}; expected {FORMAT!r})")
        if meta.get("format_version") != FORMAT_VERSION:
            raise PromptStateError(f"{path}: prompt state format version {meta.get('format_version')!r}; this "
                                   f"voicechat reads version {FORMAT_VERSION}. Write it again with "
                                   "`voicechat cache-prompt`")
        want = checkpoint_identity(model)
        if meta.get("checkpoint") != want:
            raise PromptStateError(
                f"{path}: prompt state of another checkpoint (identity {str(meta.get('checkpoint'))[:16]}...); the "
                f"model {getattr(model, 'folder', '')} is {want[:16]}.... Write one for it with `voicechat "
                "cache-prompt -m CKPT`")
        have = numerics_identity(model)
        if meta.get("numerics") != have:
            raise PromptStateError(f"{path}: {_numerics_mismatch(meta.get('numerics') or {}, have)}")
        try:
            arrays = mx.load(str(path))
            mx.eval(list(arrays.values()))
        except Exception as e:  # a truncated data section, an unreadable file
            raise PromptStateError(f"{path}: corrupt prompt state (cannot read its arrays: {e})") from None
        if _digest(meta_text, arrays) != digest:
            raise PromptStateError(f"{path}: corrupt prompt state (its SHA-256 does not match its contents)")
        try:
            state = _build(model, meta, arrays)
        except (KeyError, TypeError, ValueError, IndexError) as e:
            raise PromptStateError(f"{path}: prompt state does not fit the model ({type(e).__name__}: {e})") from None
        return state


def _short(prompt) -> str:
    if prompt is None:
        return "None (the config's default)"
    return repr(prompt if len(prompt) <= 40 else prompt[:37] + "...")


def _numerics_mismatch(stored: dict, have: dict) -> str:
    diff = [f"{k} {stored.get(k)!r} (the model: {have.get(k)!r})" for k in sorted(set(stored) | set(have))
            if stored.get(k) != have.get(k)]
    return ("prompt state made under other numerics: " + "; ".join(diff) +
            ". Prepare it again under this model's settings")


def _digest(meta_text: str, arrays: dict) -> str:
    """SHA-256 over the metadata and every array's name, dtype, shape and bytes."""
    h = hashlib.sha256(meta_text.encode())
    for name in sorted(arrays):
        a = arrays[name]
        h.update(f"{name}:{a.dtype}:{tuple(a.shape)}".encode())
        raw = a.view(mx.uint16) if a.dtype == mx.bfloat16 else a
        h.update(np.ascontiguousarray(np.array(raw)).tobytes())
    return h.hexdigest()


def _read_header(path: Path) -> tuple[str, str]:
    """The metadata and digest of a state file, after checking its size against its header."""
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise PromptStateError(f"{path}: truncated prompt state ({size} bytes, no safetensors header)")
            (n,) = struct.unpack("<Q", head)
            if n > size - 8:
                raise PromptStateError(f"{path}: truncated prompt state (its header says {n} bytes, the file has "
                                       f"{size - 8} after the length)")
            header = json.loads(f.read(n))
    except FileNotFoundError:
        raise PromptStateError(f"{path}: no such prompt state file") from None
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise PromptStateError(f"{path}: corrupt prompt state (its safetensors header is not JSON: {e})") from None
    if not isinstance(header, dict):
        raise PromptStateError(f"{path}: corrupt prompt state (its header is not a JSON object)")
    try:
        end = max((int(v["data_offsets"][1]) for k, v in header.items() if k != "__metadata__"), default=0)
    except (KeyError, TypeError, ValueError, IndexError) as e:
        raise PromptStateError(f"{path}: corrupt prompt state (a tensor entry of its header is malformed: "
                               f"{type(e).__name__}: {e})") from None
    if 8 + n + end != size:
        raise PromptStateError(f"{path}: truncated or corrupt prompt state ({size} bytes; its header describes "
                               f"{8 + n + end})")
    md = header.get("__metadata__") or {}
    if _META_KEY not in md or _DIGEST_KEY not in md:
        raise PromptStateError(f"{path}: not a voicechat prompt state (no {_META_KEY!r} metadata)")
    return md[_META_KEY], md[_DIGEST_KEY]


def _build(model, meta: dict, arrays: dict) -> PromptState:
    """The in-memory state from a checked file (shapes and layer kinds checked against the model)."""
    from voicechat.model.llm.nemotron_h import AttentionLayerState, MambaLayerState, NemotronHState
    from voicechat.streaming.timeline import TimelineState
    from voicechat.model.tts.rng import SessionRandom

    cfg = model.config
    fresh = model.stt_model.llm.make_state()
    kinds = meta["llm"]["layers"]
    if len(kinds) != len(fresh.layers):
        raise ValueError(f"{len(kinds)} language layers stored, the model has {len(fresh.layers)}")
    layers = []
    for i, (kind, ref) in enumerate(zip(kinds, fresh.layers)):
        if ref is None:
            if kind is not None:
                raise ValueError(f"language layer {i}: state stored for a layer without one")
            layers.append(None)
        elif isinstance(ref, MambaLayerState):
            conv, ssm = arrays.pop(f"llm.{i}.conv"), arrays.pop(f"llm.{i}.ssm")
            if kind != "mamba" or conv.shape != ref.conv.shape or ssm.shape != ref.ssm.shape:
                raise ValueError(f"language layer {i}: Mamba state of shapes {conv.shape} / {ssm.shape}, the model "
                                 f"needs {ref.conv.shape} / {ref.ssm.shape}")
            layers.append(MambaLayerState(conv, ssm))
        else:
            k, v = arrays.pop(f"llm.{i}.keys"), arrays.pop(f"llm.{i}.values")
            if kind[0] != "attention" or k.shape[:2] != ref.keys.shape[:2] or k.shape[3] != ref.keys.shape[3] \
                    or v.shape != k.shape or not 0 <= kind[1] <= k.shape[2]:
                raise ValueError(f"language layer {i}: K/V of shape {k.shape}, length {kind[1]}; the model needs "
                                 f"(1, {ref.keys.shape[1]}, n, {ref.keys.shape[3]})")
            layers.append(AttentionLayerState(k, v, int(kind[1])))
    llm = NemotronHState(layers, int(meta["llm"]["offset"]))
    tts = model.tts_model.tts_model.make_state()
    t = meta["tts"]
    if list(t["windows"]) != list(tts.windows):
        raise ValueError(f"TTS windows {t['windows']}, the model has {tts.windows}")
    tts.keys = [arrays.pop(f"tts.{i}.keys") for i in range(tts.num_layers)]
    tts.values = [arrays.pop(f"tts.{i}.values") for i in range(tts.num_layers)]
    for a in tts.keys + tts.values:
        if a.ndim != 4 or a.shape[:2] != (2, tts.num_kv_heads) or a.shape[3] != tts.head_dim:
            raise ValueError(f"a TTS K/V buffer has shape {a.shape}; the model needs "
                             f"(2, {tts.num_kv_heads}, n, {tts.head_dim})")
    tts.ring_origin, tts.offset = [int(r) for r in t["ring_origin"]], int(t["offset"])
    tts.previous_codes = arrays.pop("tts.previous_codes")
    if tts.previous_codes.shape != (1, tts.num_quantizers):
        raise ValueError(f"previous codes of shape {tts.previous_codes.shape}, the model has "
                         f"{tts.num_quantizers} codebooks")
    rng = SessionRandom(int(meta["rng"]["seed"]))
    rng._key, rng.draws = arrays.pop("rng.key"), int(meta["rng"]["draws"])
    ts = TimelineState(llm, tts, rng, cfg.pad_token_id)
    ts.prev_text, ts.prev_function = arrays.pop("prev_text"), arrays.pop("prev_function")
    ts.position = int(meta["position"])
    rows = {int(tok): arrays.pop(f"text_rows.{tok}") for tok in meta["text_rows"]}
    if arrays:
        raise ValueError(f"unexpected arrays {sorted(arrays)[:5]}")
    return PromptState(model=model, system_prompt=meta["system_prompt"], tools=meta["tools"], seed=meta["seed"],
                       timeline_state=ts, prompt_positions=meta["prompt_positions"], text_rows=rows,
                       checkpoint=meta["checkpoint"])


def state_nbytes(cfg, positions: int, *, text_row_itemsize: int = 2, kv_alloc_step: int = 256,
                 speaker_frames: int = 37) -> int:
    """`PromptState.nbytes` of a prefill of `positions` positions, from the config's shapes alone (for
    presets too large to run here). The language cache: per Mamba layer its conv rows (K-1, conv_dim)
    and SSM state (heads, head_dim, state), float32; per attention layer K and V (kv_heads, capacity,
    head_dim), float32, the capacity grown in steps of 256 positions. The EAR-TTS K/V of the guidance
    pair (2, kv_heads, capacity, head_dim), float32, per layer, after the speaker warm-up (37 positions)
    and one step per prompt position but the first; sliding layers hold at most their window. Then the
    previous codes, the random key, the two ids fed forward and the PAD row of the character encoder
    (`text_row_itemsize`: 2 for bf16 weights). An empty prompt's TTS state is the model's own (0 bytes)."""
    t, s = cfg.text_config, cfg.tts_config
    steps = lambda n: -(-n // kv_alloc_step) * kv_alloc_step  # noqa: E731
    total = 0
    for kind in t.layer_types:
        if kind == "mamba":
            total += 4 * ((t.conv_kernel - 1) * t.mamba_conv_dim + t.mamba_num_heads * t.mamba_head_dim * t.ssm_state_size)
        elif kind == "attention":
            total += 2 * 4 * t.num_key_value_heads * steps(positions) * t.head_dim
    total += 8 + 2 * 4  # the random key (2 x uint32), the ids fed forward (int32)
    if positions == 0:
        return total
    n = speaker_frames + positions - 1  # TTS positions after the prefill
    for i in range(s.num_hidden_layers):
        cap = steps(n) if s.is_global_layer(i) else min(steps(n), s.sliding_window)
        total += 2 * 4 * 2 * s.num_key_value_heads * cap * s.head_dim
    total += 4 * s.num_quantizers + text_row_itemsize * s.hidden_size
    return total


def resolve_prompt_arguments(model, prompt_state, system_prompt, tools, seed, use_language_cache: bool):
    """(system_prompt, tools, seed) of a session or `generate`: the state's (any given must agree:
    `PromptState.resolve`), or without a state the given ones, UNSET meaning None / None / 0."""
    if prompt_state is not None:
        if not isinstance(prompt_state, PromptState):
            raise TypeError(f"prompt_state must be a voicechat.PromptState (model.prepare_prompt), "
                            f"got {type(prompt_state).__name__}")
        return prompt_state.resolve(model, system_prompt, tools, seed, use_language_cache)
    return (None if system_prompt is UNSET else system_prompt, None if tools is UNSET else tools,
            0 if seed is UNSET else seed)


def prepare_prompt(model, system_prompt=None, *, tools=None, seed: int = 0, should_stop=None) -> PromptState:
    """Run the system-prompt prefill once -> its `PromptState` (see the module docstring); `should_stop`
    as for a session (`Timeline.start`)."""
    from voicechat.streaming.timeline import session_prompt
    from voicechat.streaming.timeline import Timeline
    from voicechat.tools.channel import normalize_tools

    tools = normalize_tools(tools)
    if tools:
        from voicechat.tools.channel import tool_markers

        tool_markers(model.tokenizer)  # the tokenizer must have the call markers (as a session checks)
    timeline = Timeline(model, seed=seed)
    with model.executing():
        positions = timeline.start(session_prompt(model.config, system_prompt, tools), should_stop=should_stop)
        mx.eval(timeline.state.arrays())
    return PromptState(model=model, system_prompt=system_prompt, tools=tools, seed=seed,
                       timeline_state=timeline.state, prompt_positions=positions,
                       text_rows=dict(timeline.text_cache._rows))


__all__ = ["PromptState", "prepare_prompt", "state_nbytes", "checkpoint_identity", "numerics_identity", "UNSET", "FORMAT_VERSION"]
