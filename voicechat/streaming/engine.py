"""The frame engine: a conversation's per-frame state, and the five stages that advance it.

`ConversationState` holds everything a frame reads and advances, the five cache families:
perception (streaming log-mel + conformer), RNNT, the timeline (Nemotron-H, EAR-TTS and their
random stream) and the codec. `FrameEngine.step(state, samples, forced)` runs one frame over it
under the model's runtime, in the order of `STAGES`, and returns its `FrameOutputs`; nothing
else reads or writes the state while a frame runs. The session keeps the input buffer and turns
the outputs into events.

Where the frame waits:

* a profiled frame ends every stage with its outputs evaluated, so stage times are compute times;
* otherwise the frame waits once, at its end, for the ids, codes, audio and the codec state;
  under `ExecutionPolicy.rnnt_on_device` the RNNT's symbols are read with them (`RnntStream.
  step_on_device`) instead of once per symbol.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import mlx.core as mx
import numpy as np

from voicechat.model import ops
from voicechat.model.audio.codec import CodecState
from voicechat.model.audio.rnnt import RnntStream, step_rows as rnnt_steps, step_rows_on_device as rnnt_steps_on_device
from voicechat.model.tts.ear_tts import replace_control_codes
from voicechat.streaming.perception import StreamingPerception, perceive
from voicechat.streaming.timeline import Timeline, advance, language_steps, tts_steps

# A frame's stages, in the order they run (the profiler's and the bench's names).
STAGES = ("perception", "rnnt", "language", "tts", "codec")


@dataclass
class ConversationState:
    """One conversation's per-frame state (the five cache families) and its frame count."""

    perception: StreamingPerception
    rnnt: RnntStream
    timeline: Timeline
    codec: CodecState  # the codec's streaming state (`Codec.make_state()`)
    frames: int = 0

    def arrays(self) -> dict[str, mx.array]:
        """Every cache family, flattened (for inspection and diffs)."""
        out = {f"perception.{k}": v for k, v in self.perception.arrays().items()}
        out.update({f"rnnt.{k}": v for k, v in self.rnnt.state.arrays().items()})
        out.update(self.timeline.state.arrays())
        out.update({f"codec.{k}": v for k, v in self.codec.arrays().items()})
        return out

    def release_blocks(self) -> None:
        """The conversation ended: its growing K/V caches (TTS, language attention) leave the blocks
        a batch kept them in, as their own copies, and free their rows there."""
        ts = self.timeline.state
        ts.tts.release()
        if ts.llm is not None:
            for layer in ts.llm.layers:
                if layer is not None and hasattr(layer, "release"):
                    layer.release()


@dataclass
class FrameOutputs:
    """What one frame computed (evaluated), and its stage times (ms; None unless profiled)."""

    encoder: mx.array
    mel: mx.array | None  # the log-mel frames the conformer consumed (None without the perception cache)
    rnnt_tokens: list[int]
    text_id: mx.array  # the language model's own choices
    function_id: mx.array
    text_fed: mx.array  # what was fed back (a forced tool-response token replaces the function id)
    function_fed: mx.array
    text_logits: mx.array
    function_logits: mx.array
    codes: mx.array  # raw EAR-TTS codes
    clean: mx.array  # after control-code replacement: what the codec decoded
    audio: mx.array
    stage_ms: tuple[float, ...] | None = None  # ms of each of STAGES, then the total


class FrameEngine:
    """Runs the frames of a model's conversations under its runtime (fixed for the engine's life)."""

    def __init__(self, model):
        self.model = model
        self.runtime = model.runtime if model.runtime is not None else ops.PLAIN
        policy = getattr(self.runtime, "policy", None)
        self.rnnt_on_device = bool(policy is not None and policy.rnnt_on_device)
        tts = model.tts_model
        self.codec = tts.audio_codec
        self.control_codes = tts.control_codes
        self.silence_codes = tts.codec_silence_tokens

    # -- a conversation's state

    def new_state(
        self, *, seed: int, use_language_cache: bool = True, use_perception_cache: bool = True
    ) -> ConversationState:
        """A conversation's state before its prompt: fresh caches, the EAR-TTS state after the
        speaker warm-up, the random stream of `seed`."""
        rnnt, _ = self.model.rnnt_transcriber()
        return ConversationState(
            perception=StreamingPerception(self.model, use_cache=use_perception_cache),
            rnnt=rnnt,
            timeline=Timeline(self.model, seed=seed, use_language_cache=use_language_cache),
            codec=self.codec.make_state(),
        )

    def prefill(self, state: ConversationState, system_prompt: str | None, should_stop=None) -> int:
        """The system-prompt prefill (`Timeline.start`) under the runtime; -> prompt positions."""
        with ops.bound(self.runtime):
            return state.timeline.start(system_prompt, should_stop=should_stop)

    # -- one frame

    def step(
        self,
        state: ConversationState,
        samples: np.ndarray,
        forced: int | None = None,
        *,
        profile: bool = False,
        on_stage: Callable[[str], None] | None = None,
    ) -> FrameOutputs:
        """One frame of `state` on `samples` (float32 (frame_samples,), checked by the caller);
        `forced`: a tool-response token to feed on the function channel, or None; `profile`: time
        the stages (each ends with its outputs evaluated); `on_stage(name)`: told as each stage
        starts (the bench attributes MLX's dispatches by it). `step_batch` of one conversation."""
        return self.step_batch([state], [samples], [forced], profile=profile, on_stage=on_stage)[0]

    def step_batch(
        self,
        states: list[ConversationState],
        samples: list[np.ndarray],
        forced: list[int | None],
        *,
        profile: bool = False,
        on_stage: Callable[[str], None] | None = None,
    ) -> list[FrameOutputs]:
        """The next frame of each of several conversations (distinct states of this model), as one
        pass through each stage: `states[b]` on `samples[b]` with `forced[b]`; -> their outputs, in
        order. Each conversation computes exactly what `step` computes for it alone (its frame index,
        prompt, caches and random stream are its own; docs/voicechat.md, "Many sessions in one
        process"). One wait for all of them at the end; a profiled batch times each stage once for
        all (every output carries the same stage times)."""
        if not (len(states) == len(samples) == len(forced)) or not states:
            raise ValueError(
                f"step_batch needs one samples chunk and one forced token (or None) per state; got "
                f"{len(states)} states, {len(samples)} chunks, {len(forced)} forced"
            )
        if len({id(st) for st in states}) != len(states):
            raise ValueError("step_batch: a conversation state appears twice (one frame per conversation per step)")
        with ops.bound(self.runtime):
            outs = self._step(states, samples, forced, profile, on_stage or _silent)
        for st in states:
            st.frames += 1
        return outs

    def _step(self, states, samples, forced, prof: bool, on_stage) -> list[FrameOutputs]:
        t0 = time.perf_counter()
        on_stage("perception")
        perceived = perceive([st.perception for st in states], samples)
        if prof:
            mx.eval(perceived)
        t1 = time.perf_counter()
        on_stage("rnnt")
        if self.rnnt_on_device:
            rnnt_ids = rnnt_steps_on_device([st.rnnt for st in states], [enc for enc, _ in perceived])
            if prof:
                mx.eval(rnnt_ids)
        else:
            tokens = rnnt_steps([st.rnnt for st in states], [enc for enc, _ in perceived])  # one read per symbol
        t2 = time.perf_counter()
        on_stage("language")
        timelines = [st.timeline for st in states]
        chosen = language_steps(timelines, [emb for _, emb in perceived])
        fed = [t.feed(c[0], c[1], f) for t, c, f in zip(timelines, chosen, forced, strict=True)]
        if prof:
            mx.eval([c[:2] for c in chosen])
        t3 = time.perf_counter()
        on_stage("tts")
        raw = tts_steps(timelines, [text for text, _ in fed])
        codes = [advance(t, text, function, c) for t, (text, function), c in zip(timelines, fed, raw, strict=True)]
        if prof:
            mx.eval(codes)
        t4 = time.perf_counter()
        on_stage("codec")
        clean = [replace_control_codes(c, self.control_codes, self.silence_codes) for c in codes]
        audio = self.codec.decode_step_rows(clean, [st.codec for st in states])
        # The frame's wait: ids, codes, audio and the codec state (with the codec's products on the
        # host, the codec evaluated its inputs on the way), and the RNNT's symbols when on the device.
        mx.eval(
            [c[:2] for c in chosen],
            codes,
            clean,
            audio,
            [st.codec.arrays() for st in states],
            *((rnnt_ids, [st.rnnt.state.lstm for st in states]) if self.rnnt_on_device else ()),
        )
        t5 = time.perf_counter()
        if self.rnnt_on_device:
            tokens = [st.rnnt.finish_on_device(ids) for st, ids in zip(states, rnnt_ids, strict=True)]
        stage_ms = None
        if prof:
            stage_ms = tuple((b - a) * 1000.0 for a, b in ((t0, t1), (t1, t2), (t2, t3), (t3, t4), (t4, t5), (t0, t5)))
        return [
            FrameOutputs(
                perceived[b][0],
                st.perception.last_mel if st.perception.use_cache else None,
                tokens[b],
                chosen[b][0],
                chosen[b][1],
                fed[b][0],
                fed[b][1],
                chosen[b][2],
                chosen[b][3],
                codes[b],
                clean[b],
                audio[b],
                stage_ms,
            )
            for b, st in enumerate(states)
        ]

    def finish(self, state: ConversationState) -> mx.array:
        """The codec's held-back tail after the last frame (evaluated)."""
        with ops.bound(self.runtime):
            tail = self.codec.flush(state.codec)
            mx.eval(tail)
        return tail


def _silent(stage: str) -> None:
    pass


__all__ = ["STAGES", "ConversationState", "FrameEngine", "FrameOutputs"]
