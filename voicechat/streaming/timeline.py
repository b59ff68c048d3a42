"""The generation timeline shared by `generate`, `generate_stream` and the streaming session.

One timeline position per system-prompt token, then one per audio frame
(docs/model.md §7.5, §10.2-10.3). At each position:

    in_t   = E(text_{t-1}) + a_t + w_f * E(function_{t-1})     (PAD before t = 0)
    hidden = Nemotron-H step (cached state, or the whole history recomputed)
    text_t, function_t = argmax of the two heads (PAD at prompt positions)
    codes_t = silence codes at t = 0, else one EAR-TTS step fed text_t

Everything stays on the device: ids are MLX scalars and codes MLX arrays
until the caller evaluates them once per frame.
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx
import numpy as np

from voicechat.errors import PrefillStoppedError
from voicechat.io.states import nest, part
from voicechat.model.llm.nemotron_h import NemotronHState
from voicechat.model.ops import stack_rows
from voicechat.model.tts.ear_tts import EarTtsState, TextEmbeddingCache
from voicechat.model.tts.rng import SessionRandom
from voicechat.tools.channel import render_system_prompt


@dataclass
class StepOutput:
    """Lazy outputs of one audio position."""

    position: int
    text_id: mx.array  # int32 scalar
    function_id: mx.array  # int32 scalar
    codes: mx.array  # int32 (Q,), raw (before control-code replacement)
    text_logits: mx.array  # float32 (V,)
    function_logits: mx.array  # float32 (V,)
    forced: bool = False  # a tool response token was forced (text_id is then PAD, function_id that token)


class TimelineState:
    """Explicit state of the generation side (inspect with `arrays()`, `copy()` to branch)."""

    def __init__(self, llm: NemotronHState | None, tts: EarTtsState, rng: SessionRandom, pad_id: int):
        self.llm = llm  # None in recompute mode (use_language_cache=False)
        self.llm_inputs: list[mx.array] = []  # history of LLM inputs, recompute mode only
        self.tts = tts
        self.rng = rng
        self.prev_text = mx.array(pad_id, dtype=mx.int32)
        self.prev_function = mx.array(pad_id, dtype=mx.int32)
        self.position = 0

    def copy(self) -> TimelineState:
        other = TimelineState.__new__(TimelineState)
        other.llm = self.llm.copy() if self.llm is not None else None
        other.llm_inputs = list(self.llm_inputs)
        other.tts = self.tts.copy()
        other.rng = self.rng.copy()
        other.prev_text, other.prev_function = self.prev_text, self.prev_function
        other.position = self.position
        return other

    def arrays(self) -> dict[str, mx.array]:
        out = {}
        if self.llm is not None:
            out.update({f"llm.{k}": v for k, v in self.llm.arrays().items()})
        out.update({f"tts.{k}": v for k, v in self.tts.arrays().items()})
        out.update({f"rng.{k}": v for k, v in self.rng.arrays().items()})
        out["prev_text"], out["prev_function"] = self.prev_text, self.prev_function
        return out

    # -- as arrays + metadata (voicechat/io/states.py)

    @property
    def state(self) -> dict[str, mx.array]:
        """Its parts' `state` under `llm.` (absent in recompute mode), `tts.`, `rng.`; the ids fed
        forward `prev_text` / `prev_function`; in recompute mode the LLM inputs `llm_inputs.{j}`."""
        out = nest("llm", self.llm.state) if self.llm is not None else {}
        out.update(nest("tts", self.tts.state))
        out.update(nest("rng", self.rng.state))
        out["prev_text"], out["prev_function"] = self.prev_text, self.prev_function
        if self.llm is None:
            out.update({f"llm_inputs.{j}": x for j, x in enumerate(self.llm_inputs)})
        return out

    @property
    def meta_state(self) -> dict:
        """{"position", "llm" (None in recompute mode), "tts", "rng"}: the parts' `meta_state`;
        in recompute mode also "llm_inputs" (their count)."""
        meta = {
            "position": self.position,
            "llm": None if self.llm is None else self.llm.meta_state,
            "tts": self.tts.meta_state,
            "rng": self.rng.meta_state,
        }
        if self.llm is None:
            meta["llm_inputs"] = len(self.llm_inputs)
        return meta

    @classmethod
    def from_state(cls, state: dict, meta_state: dict, like: TimelineState) -> TimelineState:
        """The timeline's state from `state` / `meta_state`; `like` (a fresh one of the same model
        and mode) gives its parts' shapes."""
        other = cls.__new__(cls)
        if (meta_state["llm"] is None) != (like.llm is None):
            raise ValueError("a language cache stored for a timeline without one, or none for one with it")
        other.llm = (
            None if like.llm is None else type(like.llm).from_state(part(state, "llm"), meta_state["llm"], like.llm)
        )
        other.llm_inputs = [state[f"llm_inputs.{j}"] for j in range(meta_state.get("llm_inputs", 0))]
        other.tts = type(like.tts).from_state(part(state, "tts"), meta_state["tts"], like.tts)
        other.rng = type(like.rng).from_state(part(state, "rng"), meta_state["rng"], like.rng)
        other.prev_text, other.prev_function = state["prev_text"], state["prev_function"]
        other.position = int(meta_state["position"])
        return other


PREFILL_PIECE = 32  # prompt positions between two should_stop questions of a prefill


def _stop_point(st, should_stop) -> None:
    mx.eval(st.arrays())
    if should_stop():
        raise PrefillStoppedError("the system-prompt prefill was stopped (should_stop returned true)")


class Timeline:
    """Drives `TimelineState` over a model. Create, `start(prompt)`, then `step(audio_emb)` per frame."""

    def __init__(self, model, *, seed: int = 0, use_language_cache: bool = True):
        self.model = model
        self.llm = model.stt_model.llm  # Nemotron-H
        self.tts = model.tts_model.tts_model  # EAR-TTS (the published naming nests it)
        cfg = model.config
        self.cfg = cfg
        self.use_language_cache = use_language_cache
        llm_state = model.stt_model.llm.make_state() if use_language_cache else None
        self.state = TimelineState(llm_state, model.warm_tts_state(), SessionRandom(seed), cfg.pad_token_id)
        self.silence_codes = model.tts_model.codec_silence_tokens.astype(mx.int32)
        self.prompt_positions = 0
        self.text_cache = TextEmbeddingCache()

    # -- LLM

    def _llm_last_hidden(self, x: mx.array) -> mx.array:
        """x (1, L, H) new inputs -> final hidden of the last position (1, H)."""
        st = self.state
        llm = self.llm
        if st.llm is not None:
            return llm(x, st.llm)[:, -1]
        st.llm_inputs.append(x)
        # Diagnostic mode: recompute the whole history every step (quadratic).
        return llm.forward_uncached(mx.concatenate(st.llm_inputs, axis=1))[:, -1]

    # -- TTS

    def _tts(self, text_id) -> mx.array:
        return tts_steps([self], [text_id])[0]

    # -- public

    def prompt_ids(self, system_prompt: str | None) -> list[int]:
        """[bos] + encode(prompt) + [eos] when the stripped prompt is non-empty, else []."""
        if system_prompt is None:
            system_prompt = self.cfg.default_system_prompt
        if not isinstance(system_prompt, str):
            raise TypeError(f"system_prompt must be a str or None, got {type(system_prompt).__name__}")
        if not system_prompt.strip():
            return []
        return [self.cfg.bos_token_id] + self.model.tokenizer.encode(system_prompt) + [self.cfg.eos_token_id]

    def start(self, system_prompt: str | None, should_stop=None) -> int:
        """System-prompt prefill; returns the number of prompt positions.

        `should_stop`: a callable asked between pieces of PREFILL_PIECE positions (each piece
        evaluated first, the same operations as in one go); when it returns true the prefill
        stops with `PrefillStoppedError` (a server whose client left frees the model at once).
        Under the float32 numerics the LLM's sequence pass stays one piece (chunking it would
        change its rounding); the TTS steps are still asked between pieces.

        The prompt's LLM inputs do not depend on its outputs (forced PAD): the LLM
        steps one token at a time as the reference does, or, with the float32
        numerics, runs them as one sequence pass (the two agree to float rounding;
        `NemotronH.prefill`). The TTS takes one (autoregressive) step per prompt
        position after position 0.
        """
        ids = self.prompt_ids(system_prompt)
        if not ids:
            return 0
        st = self.state
        m = self.model
        pad = self.cfg.pad_token_id
        x = m.prompt_input(mx.array(ids, dtype=mx.int32))[None]  # E(PAD) + E(prompt) + w * E(PAD)
        llm = self.llm
        if st.llm is None:
            st.llm_inputs.append(x)
        elif should_stop is None or not llm.reference_rounding:
            llm.prefill(x, st.llm)
        else:  # reference rounding steps one position at a time anyway: pieces are the same steps
            for a in range(0, x.shape[1], PREFILL_PIECE):
                llm.prefill(x[:, a : a + PREFILL_PIECE], st.llm)
                _stop_point(st, should_stop)
        pad_id = mx.array(pad, dtype=mx.int32)
        for i in range(len(ids)):
            self._tts(pad_id)
            st.position += 1
            if should_stop is not None and (i + 1) % PREFILL_PIECE == 0:
                _stop_point(st, should_stop)
        mx.eval(st.arrays())
        self.prompt_positions = len(ids)
        return len(ids)

    def step(self, audio_emb: mx.array, forced: int | None = None) -> StepOutput:
        """One audio position (lazy); `forced`: a function token forced onto this position (tools)."""
        position = self.state.position
        text_id, function_id, text_logits, function_logits = self.language_step(audio_emb)
        text_id, function_id = self.feed(text_id, function_id, forced)
        codes = self.tts_step(text_id, function_id)
        return StepOutput(position, text_id, function_id, codes, text_logits, function_logits, forced is not None)

    def feed(self, text_id: mx.array, function_id: mx.array, forced: int | None):
        """The ids this position carries on (to the TTS and the next input): the model's argmax, or,
        while a tool response is injected, PAD on the text channel and the forced function token."""
        if forced is None:
            return text_id, function_id
        return mx.array(self.cfg.pad_token_id, dtype=mx.int32), mx.array(int(forced), dtype=mx.int32)

    def language_step(self, audio_emb: mx.array):
        """The LLM half of `step` (the profiler times the halves separately): `language_steps` of
        this timeline alone."""
        return language_steps([self], [audio_emb])[0]

    def language_input(self, audio_emb: mx.array) -> mx.array:
        """This position's LLM input (1, 1, H): E(prev text) + audio + w_f * E(prev function)."""
        st = self.state
        return self.model.fused_input(st.prev_text[None], audio_emb.reshape(1, -1), st.prev_function[None])[None]

    def tts_step(self, text_id: mx.array, function_id: mx.array) -> mx.array:
        """The TTS half of `step`; advances the position."""
        return advance(self, text_id, function_id, tts_steps([self], [text_id])[0])


def advance(timeline: Timeline, text_id: mx.array, function_id: mx.array, codes: mx.array) -> mx.array:
    """After a position's TTS: its ids are the next input's; -> codes."""
    st = timeline.state
    st.prev_text, st.prev_function = text_id, function_id
    st.position += 1
    return codes


def tts_steps(timelines: list[Timeline], text_ids: list) -> list[mx.array]:
    """The TTS of one position for several conversations of one model: -> raw codes (Q,) each (lazy);
    does not advance the positions (`advance`). A conversation at position 0 takes the silence codes
    (the reference runs no TTS step there); the others take one EAR-TTS step together
    (`EarTts.step_batch`), each exactly as alone. The ids are read on the host (one wait for all):
    the char encoder then runs each token's own characters (as the reference does) instead of the
    table's max_chars padded rows; the TTS cannot start before the ids exist."""
    out: list = [t.silence_codes for t in timelines]
    stepping = [i for i, t in enumerate(timelines) if t.state.position != 0]
    if not stepping:
        return out
    ids = [text_ids[i] for i in stepping]
    if len(ids) > 1 and all(isinstance(x, mx.array) for x in ids):
        tokens = [int(t) for t in np.array(mx.stack(ids)).reshape(-1)]  # one wait for every id
    else:
        tokens = [int(x.item()) if isinstance(x, mx.array) else x for x in ids]
    first = timelines[stepping[0]]
    codes = first.tts.step_batch(
        [timelines[i].state.tts for i in stepping],
        tokens,
        [timelines[i].state.rng for i in stepping],
        eos_id=first.cfg.eos_token_id,
        silence_codes=first.silence_codes,
        text_caches=[timelines[i].text_cache for i in stepping],
    )
    for i, c in zip(stepping, codes, strict=True):
        out[i] = c
    return out


def language_steps(timelines: list[Timeline], audio_embs: list[mx.array]) -> list[tuple]:
    """The LLM half of a position for several conversations of one model at once: ->
    [(text_id, function_id, text_logits, function_logits)] per timeline (lazy).

    The timelines with a language cache take one Nemotron-H step together (`NemotronH.step_batch`:
    the products read their weights once for every row, each row's state its own) and one pass
    of the heads; each row computes exactly what it computes alone. A timeline in recompute mode
    (a diagnostic) runs alone."""
    results: list = [None] * len(timelines)
    cached = [i for i, t in enumerate(timelines) if t.state.llm is not None]
    for i, t in enumerate(timelines):
        if t.state.llm is None:
            hidden = t._llm_last_hidden(t.language_input(audio_embs[i]))
            results[i] = _choose(*t.model.heads(hidden))
    if cached:
        first = timelines[cached[0]]
        x = stack_rows([timelines[i].language_input(audio_embs[i]) for i in cached])
        hidden = first.llm.step_batch(x, [timelines[i].state.llm for i in cached])[:, -1]
        text_logits, function_logits = first.model.heads(hidden)
        if len(cached) == 1:
            results[cached[0]] = _choose(text_logits, function_logits)
        else:
            text_ids = mx.argmax(text_logits, axis=-1).astype(mx.int32)
            function_ids = mx.argmax(function_logits, axis=-1).astype(mx.int32)
            for row, i in enumerate(cached):
                results[i] = (text_ids[row], function_ids[row], text_logits[row], function_logits[row])
    return results


def _choose(text_logits: mx.array, function_logits: mx.array) -> tuple:
    """One conversation's (1, V) logits -> its ids (argmax) and logits (V,)."""
    text_id = mx.argmax(text_logits[0]).astype(mx.int32)
    function_id = mx.argmax(function_logits[0]).astype(mx.int32)
    return text_id, function_id, text_logits[0], function_logits[0]


def session_prompt(cfg, system_prompt, tools) -> str | None:
    """The prompt the timeline prefills: the given one (None: the config's default), with the
    trained tools block when there are tools (voicechat.tools.render_system_prompt)."""
    if not tools:
        return system_prompt
    return render_system_prompt(cfg.default_system_prompt if system_prompt is None else system_prompt, tools)
