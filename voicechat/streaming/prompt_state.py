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

As arrays and metadata, a state is its `state` / `meta_state` (the timeline state's, whose parts
each say theirs, and the character-encoder rows'), rebuilt by `PromptState.from_state`. Files:
`state.save(path)` writes them with the generic writer (voicechat/streaming/prompt_file.py:
safetensors with JSON metadata: format version, the checkpoint's identity, numerics, the project's
version, a SHA-256 of everything); `PromptState.load(path, model)` refuses another checkpoint,
numerics setting or format version and a truncated or corrupt file with `PromptStateError` naming
why (voicechat/streaming/prompt_identity.py).
"""

from __future__ import annotations

import copy
import weakref
from pathlib import Path
from typing import Any

import mlx.core as mx

from voicechat.errors import PromptStateError
from voicechat.io.states import nest, part, rebuild
from voicechat.model.tts.ear_tts import TextEmbeddingCache
from voicechat.model.tts.rng import SessionRandom
from voicechat.streaming import prompt_file
from voicechat.streaming.prompt_file import FORMAT_VERSION
from voicechat.streaming.prompt_identity import check_model, checkpoint_identity, numerics_identity
from voicechat.streaming.timeline import Timeline, TimelineState, session_prompt
from voicechat.tools.channel import normalize_tools, tool_markers


class Unset:
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


UNSET = Unset()


def _norm_prompt(cfg, system_prompt):
    """The prompt text a prefill uses (None: the config's default)."""
    return cfg.default_system_prompt if system_prompt is None else system_prompt


class PromptState:
    """The session state after one system-prompt prefill. Make with `model.prepare_prompt(...)` or
    `PromptState.load(path, model)`; never changed by the sessions started from it."""

    def __init__(
        self,
        *,
        model,
        system_prompt,
        tools,
        seed: int,
        timeline_state,
        prompt_positions: int,
        text_rows,
        checkpoint: str | None = None,
    ):

        self._model_ref = weakref.ref(model)
        self._system_prompt = system_prompt
        self._tools = tuple(tools)
        self._seed = int(seed)
        self._timeline = timeline_state
        self._prompt_positions = int(prompt_positions)
        # The character-encoder rows the prefill computed (a dict {token: row} or a cache of them).
        if not isinstance(text_rows, TextEmbeddingCache):
            text_rows = TextEmbeddingCache.from_state(
                {str(t): r for t, r in dict(text_rows).items()}, [int(t) for t in text_rows]
            )
        self._text_rows = text_rows
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

    # -- as arrays + metadata (voicechat/io/states.py)

    @property
    def state(self) -> dict[str, mx.array]:
        """Every array the state holds, by file name: the timeline state's `state` (full K/V buffers,
        spare capacity included) and the character-encoder rows as `text_rows.{token}`."""
        return {**self._timeline.state, **nest("text_rows", self._text_rows.state)}

    @property
    def meta_state(self) -> dict:
        """The timeline state's `meta_state`, the rows' tokens ("text_rows") and the prompt's
        arguments (system_prompt, tools, seed, prompt_positions)."""
        return {
            **self._timeline.meta_state,
            "text_rows": self._text_rows.meta_state,
            "system_prompt": self._system_prompt,
            "tools": list(self._tools),
            "seed": self._seed,
            "prompt_positions": self._prompt_positions,
        }

    @classmethod
    def from_state(cls, state: dict, meta_state: dict, like) -> PromptState:
        """The state from `state` / `meta_state` for the model `like` (its fresh timeline state
        gives the shapes; a "checkpoint" in `meta_state`, as files have, is kept as the identity)."""

        model = like
        fresh = TimelineState(
            model.stt_model.llm.make_state(),
            model.tts_model.tts_model.make_state(),
            SessionRandom(0),
            model.config.pad_token_id,
        )
        timeline_state = TimelineState.from_state(state, meta_state, fresh)
        rows = TextEmbeddingCache.from_state(part(state, "text_rows"), meta_state["text_rows"])
        return cls(
            model=model,
            system_prompt=meta_state["system_prompt"],
            tools=meta_state["tools"],
            seed=meta_state["seed"],
            timeline_state=timeline_state,
            prompt_positions=meta_state["prompt_positions"],
            text_rows=rows,
            checkpoint=meta_state.get("checkpoint"),
        )

    def _arrays(self) -> dict[str, mx.array]:
        """Every array the state holds, by file name (`state`)."""
        return self.state

    def _model_arrays(self, model) -> set[int]:
        warm = getattr(model, "_warm_tts", None) if model is not None else None
        return {id(a) for a in (warm.keys + warm.values + [warm.previous_codes])} if warm is not None else set()

    @property
    def nbytes(self) -> int:
        """Bytes this state holds itself: its arrays, less those that are the model's own (the TTS
        warm-up buffers, which an empty prompt leaves unchanged)."""
        shared = self._model_arrays(self._model_ref())
        seen, total = set(), 0
        for a in self.state.values():
            if id(a) not in seen and id(a) not in shared:
                seen.add(id(a))
                total += a.nbytes
        return total

    def __repr__(self) -> str:
        prompt = (
            self._system_prompt
            if self._system_prompt is None or len(self._system_prompt) <= 40
            else self._system_prompt[:37] + "..."
        )
        return (
            f"PromptState(system_prompt={prompt!r}, tools={len(self._tools)}, seed={self._seed}, "
            f"prompt_positions={self._prompt_positions}, nbytes={self.nbytes})"
        )

    # -- use by sessions

    def check_model(self, model) -> None:
        """PromptStateError unless `model` computes what the state's model computed."""
        check_model(model, made_by=self._model_ref(), checkpoint=self._checkpoint, numerics=self._numerics)

    def resolve(self, model, system_prompt, tools, seed, use_language_cache: bool):
        """The session arguments with the state's values filled in; ValueError where a given one
        disagrees with the state's."""

        self.check_model(model)
        if not use_language_cache:
            raise ValueError(
                "prompt_state holds the language cache; use_language_cache=False (recompute mode) "
                "prefills from scratch: pass no prompt_state"
            )
        cfg = model.config
        if system_prompt is not UNSET and _norm_prompt(cfg, system_prompt) != _norm_prompt(cfg, self._system_prompt):
            raise ValueError(
                f"system_prompt {_short(system_prompt)} disagrees with the prompt_state's "
                f"{_short(self._system_prompt)}; leave system_prompt out to use the state's"
            )
        if tools is not UNSET and normalize_tools(tools) != self._tools:
            raise ValueError(
                f"tools ({len(normalize_tools(tools))} given) disagree with the prompt_state's "
                f"{len(self._tools)} tool(s) ({', '.join(t['name'] for t in self._tools) or 'none'}); "
                "leave tools out to use the state's"
            )
        if seed is not UNSET and seed != self._seed:
            raise ValueError(
                f"seed {seed!r} disagrees with the prompt_state's seed {self._seed}; leave seed out to use the state's"
            )
        return self._system_prompt, (list(self._tools) or None), self._seed

    def restore(self, timeline) -> int:
        """Put a copy of the state into a fresh `Timeline` (instead of `timeline.start`); -> positions."""
        timeline.state = self._timeline.copy()
        timeline.prompt_positions = self._prompt_positions
        for token, row in self._text_rows._rows.items():
            timeline.text_cache.put(token, row)
        return self._prompt_positions

    # -- files (voicechat/streaming/prompt_file.py)

    def save(self, path) -> Path:
        """Write the state to `path` (safetensors + JSON metadata; atomically: a temporary file, then a
        rename). The file is bound to this checkpoint and numerics setting."""
        model = self._model_ref()
        checkpoint = self._checkpoint or (checkpoint_identity(model) if model is not None else None)
        if checkpoint is None:
            raise PromptStateError("the state's model is gone; its checkpoint identity cannot be recorded")
        return prompt_file.write(path, self.state, self.meta_state, checkpoint=checkpoint, numerics=self._numerics)

    @classmethod
    def load(cls, path, model) -> PromptState:
        """Read a state written by `save` for `model`. PromptStateError (nothing is used) for a missing,
        truncated or corrupt file, another format version, checkpoint or numerics setting."""
        arrays, meta = prompt_file.read(path, model)
        try:
            return rebuild(cls, arrays, meta, model)
        except (KeyError, TypeError, ValueError, IndexError) as e:
            raise PromptStateError(f"{path}: prompt state does not fit the model ({type(e).__name__}: {e})") from None


def _short(prompt) -> str:
    if prompt is None:
        return "None (the config's default)"
    return repr(prompt if len(prompt) <= 40 else prompt[:37] + "...")


def state_nbytes(
    cfg, positions: int, *, text_row_itemsize: int = 2, kv_alloc_step: int = 256, speaker_frames: int = 37
) -> int:
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
            total += 4 * (
                (t.conv_kernel - 1) * t.mamba_conv_dim + t.mamba_num_heads * t.mamba_head_dim * t.ssm_state_size
            )
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


def resolve_prompt_arguments(
    model, prompt_state, system_prompt, tools, seed, use_language_cache: bool
) -> tuple[str | None, Any, int]:
    """(system_prompt, tools, seed) of a session or `generate`: the state's (any given must agree:
    `PromptState.resolve`), or without a state the given ones, UNSET meaning None / None / 0."""
    if prompt_state is not None:
        if not isinstance(prompt_state, PromptState):
            raise TypeError(
                f"prompt_state must be a voicechat.PromptState (model.prepare_prompt), "
                f"got {type(prompt_state).__name__}"
            )
        return prompt_state.resolve(model, system_prompt, tools, seed, use_language_cache)
    return (
        None if system_prompt is UNSET else system_prompt,
        None if tools is UNSET else tools,
        0 if seed is UNSET else seed,
    )


def prepare_prompt(model, system_prompt=None, *, tools=None, seed: int = 0, should_stop=None) -> PromptState:
    """Run the system-prompt prefill once -> its `PromptState` (see the module docstring); `should_stop`
    as for a session (`Timeline.start`)."""

    tools = normalize_tools(tools)
    if tools:
        tool_markers(model.tokenizer)  # the tokenizer must have the call markers (as a session checks)
    timeline = Timeline(model, seed=seed)
    with model.executing():
        positions = timeline.start(session_prompt(model.config, system_prompt, tools), should_stop=should_stop)
        mx.eval(timeline.state.arrays())
    return PromptState(
        model=model,
        system_prompt=system_prompt,
        tools=tools,
        seed=seed,
        timeline_state=timeline.state,
        prompt_positions=positions,
        text_rows=dict(timeline.text_cache._rows),
    )


__all__ = [
    "Unset",
    "PromptState",
    "prepare_prompt",
    "state_nbytes",
    "checkpoint_identity",
    "numerics_identity",
    "UNSET",
    "FORMAT_VERSION",
]
