"""`FrameExecutor`: one streamed frame's five stages under a model's runtime.

The session owns the state (perception, RNNT, timeline, codec) and turns a frame's results into
events; the executor runs the stages in order with the runtime bound, places the evaluation
points its policy asks for, and times the stages when profiling:

* a profiled frame ends every stage with its outputs evaluated, so stage times are compute times;
* otherwise the frame waits once, at its end, for the ids, codes, audio and the codec state;
  under `ExecutionPolicy.rnnt_on_device` the RNNT's symbols are read with them (`RnntStream.
  step_on_device`) instead of once per symbol.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import mlx.core as mx

from voicechat.model import ops
from voicechat.model.tts.ear_tts import replace_control_codes


@dataclass
class FrameOutputs:
    """What one frame computed (evaluated), and its stage times (ms; None unless profiled)."""

    encoder: mx.array
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
    stage_ms: tuple[float, float, float, float, float, float] | None = None  # 5 stages and the total


class FrameExecutor:
    """Runs frames of one session under `runtime` (a `voicechat.runtime.Runtime`, or the plain ops)."""

    def __init__(self, runtime):
        self.runtime = runtime if runtime is not None else ops.PLAIN
        policy = getattr(self.runtime, "policy", None)
        self.rnnt_on_device = bool(policy is not None and policy.rnnt_on_device)

    def run(self, session, samples, forced, *, profile: bool = False) -> FrameOutputs:
        """One frame of `session` (its `perception`, `rnnt`, `timeline`, `codec`, `codec_state`) on
        `samples`; `forced`: a tool-response token to feed on the function channel, or None;
        `profile`: time the stages (each ends with its outputs evaluated)."""
        with ops.bound(self.runtime):
            return self._run(session, samples, forced, profile)

    def _run(self, s, samples, forced, prof: bool) -> FrameOutputs:
        t0 = time.perf_counter()
        enc, emb = s.perception.push_frame(samples)
        if prof:
            mx.eval(enc, emb)
        t1 = time.perf_counter()
        if self.rnnt_on_device:
            rnnt_ids = s.rnnt.step_on_device(enc)
            if prof:
                mx.eval(rnnt_ids)
        else:
            tokens = s.rnnt.step(enc)  # one read per symbol
        t2 = time.perf_counter()
        text_id, function_id, text_logits, function_logits = s.timeline.language_step(emb)
        text_fed, function_fed = s.timeline.feed(text_id, function_id, forced)
        if prof:
            mx.eval(text_id, function_id)
        t3 = time.perf_counter()
        codes = s.timeline.tts_step(text_fed, function_fed)
        if prof:
            mx.eval(codes)
        t4 = time.perf_counter()
        tts = s.model.tts_model
        clean = replace_control_codes(codes, tts.control_codes, tts.codec_silence_tokens)
        audio = s.codec.decode_step(clean, s.codec_state)
        # The frame's wait: ids, codes, audio and the codec state (with the codec's products on the
        # host, the codec evaluated its inputs on the way), and the RNNT's symbols when on the device.
        mx.eval(text_id, function_id, codes, clean, audio, s.codec_state.arrays(),
                *((rnnt_ids, s.rnnt.state.lstm) if self.rnnt_on_device else ()))
        t5 = time.perf_counter()
        if self.rnnt_on_device:
            tokens = s.rnnt.finish_on_device(rnnt_ids)
        stage_ms = None
        if prof:
            stage_ms = tuple((b - a) * 1000.0 for a, b in ((t0, t1), (t1, t2), (t2, t3), (t3, t4), (t4, t5), (t0, t5)))
        return FrameOutputs(enc, tokens, text_id, function_id, text_fed, function_fed, text_logits, function_logits,
                            codes, clean, audio, stage_ms)


__all__ = ["FrameExecutor", "FrameOutputs"]
