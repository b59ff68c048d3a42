"""`VoiceChatBackend`: this project behind the harness's adapter interface.

Offline path: `model.generate(...)`. Streamed path: `model.create_streaming_session(...)`
fed `chunk_samples` at a time, then `flush()`; ids come from the session's
per-frame records, codes and audio from its `Audio` events, the tail from
`AudioTail`. The streamed mel / encoder frames, RNNT tokens per frame and
logits are the session's own values, handed out per frame by its observation
point (`create_streaming_session(on_frame=...)`, `voicechat.streaming.session.FrameRecord`).

Component checks (`component_checks`) drive the model's components directly:
Nemotron-H single cached steps vs the no-cache recompute over the same inputs,
and EAR-TTS cached steps vs recompute-from-history. Each step goes through a
small overridable method (`llm_cached_step`, `tts_cached_step`) so tests can
feed the engine a deliberately broken backend.
"""

from __future__ import annotations

import functools
import time
from typing import Any

import mlx.core as mx
import numpy as np

from ..families import ComponentRun
from .base import Backend, OfflineRun, StreamRun


def _np(a, dtype=None) -> np.ndarray:
    out = np.array(a)
    return out.astype(dtype) if dtype is not None else out


def _event_dict(e) -> dict:
    d = {"kind": e.kind}
    for k, v in vars(e).items():
        if k == "kind":
            continue
        if isinstance(v, np.ndarray):
            d[k + "_len"] = int(v.size)
        else:
            d[k] = v
    return d


def _executing(method):
    """Run a backend method with the model's runtime bound (its execution policy)."""

    @functools.wraps(method)
    def wrapper(self, *args, **kwargs):
        with self.execution_settings():
            return method(self, *args, **kwargs)

    return wrapper


class VoiceChatBackend(Backend):
    """This project. `VoiceChatBackend(model=...)` wraps an already loaded model.

    numerics: the EAR-TTS numerics to load with (`voicechat.load(..., numerics=)`:
    "reference", the default, rounds as the reference does, so the codes equal
    its codes; "float32" is the float32 option, whose code differences the engine
    verifies by re-running with "reference"). With `model=...` it is the model's
    own (a different value is an error).
    Codes: `codes` of a run are the generated (raw) codes, before control-code
    replacement, as the reference backend records them; `decoded_codes` are the
    codes that were decoded (what `OfflineResult.audio_codes` and the `Audio`
    events carry).
    component_max_frames: cap the audio frames of the component checks (the
    EAR-TTS recompute is quadratic in the timeline length).
    record_intermediates: record the session's per-frame mel / encoder frames,
    RNNT tokens and logits through its `on_frame` observer. None = record
    unless `stream(profile=True)`: profiled runs are measurement runs (the
    benchmark runner) and run without an observer.
    """

    name = "voicechat"
    policy = None  # the ExecutionPolicy to load with; None: `ExecutionPolicy.for_device()`

    def __init__(
        self,
        model=None,
        *,
        numerics: str | None = None,
        component_max_frames: int | None = None,
        record_intermediates: bool | None = None,
    ):
        from voicechat.model.tts.numerics import DEFAULT_NUMERICS, numerics_from

        self.model = model
        self.record_intermediates = record_intermediates
        self.checkpoint = getattr(model, "source", None) if model is not None else None
        if model is not None:
            own = model.numerics.name
            if numerics is not None and numerics_from(numerics).name != own:
                raise ValueError(f"numerics={numerics!r} but the given model was loaded with numerics={own!r}")
            numerics = own
        self.numerics = numerics_from(DEFAULT_NUMERICS if numerics is None else numerics).name
        if component_max_frames is not None and (not isinstance(component_max_frames, int) or component_max_frames < 1):
            raise ValueError(f"component_max_frames must be a positive int or None, got {component_max_frames!r}")
        self.component_max_frames = component_max_frames

    # -- identity / geometry

    @property
    def version(self) -> str:
        import voicechat

        return voicechat.__version__

    def load(self, checkpoint: str) -> Any:
        import voicechat
        from voicechat.synthetic.checkpoint import resolve_model_arg

        self.checkpoint = str(checkpoint)
        self.model = voicechat.load(
            resolve_model_arg(str(checkpoint)),
            numerics=self.numerics,
            policy=self.policy() if callable(self.policy) else self.policy,
        )
        return self.model

    def _require(self):
        if self.model is None:
            raise RuntimeError("VoiceChatBackend: no model; call load(checkpoint) or pass model=...")
        return self.model

    @property
    def codec(self):
        return self._require().tts_model.audio_codec

    @property
    def samples_per_frame(self) -> int:
        return self.codec.samples_per_frame

    @property
    def lead_in(self) -> int:
        return self.codec.lead_in

    @property
    def warmup_samples(self) -> int:
        """Offline samples at the very start the streaming codec does not reproduce (api.md)."""
        return self.codec.warmup_samples

    @property
    def encoder_xscaling(self) -> bool:
        return bool(self._require().config.audio_config.encoder.xscaling)

    def expected_frames(self, n_samples: int) -> tuple[int, int]:
        """(offline frames, streamed frames) for an input of n_samples (streamed with flush(pad_partial=True)).

        Offline: the encoder length of N // hop + 1 mel frames; streamed: one
        frame per started 1280-sample frame.
        """
        from voicechat.model.audio.conformer import subsampled_length

        cfg = self._require().config
        hop = cfg.audio_config.preprocessor.hop_length
        return subsampled_length(n_samples // hop + 1), -(-n_samples // cfg.frame_samples)

    def close(self) -> None:
        self.model = None

    def execution_settings(self):
        """A with-block binding the model's runtime (its execution policy, chosen at load). Code
        that drives `self.model`'s components directly (e.g. the bench's dispatch count) enters it."""
        return self._require().executing()

    # -- helpers shared by the paths

    @_executing
    def decode_codes(self, codes: np.ndarray) -> np.ndarray:
        """One offline codec decode of (T, Q) codes (control codes replaced as the runtime does)."""
        from voicechat.model.tts.ear_tts import replace_control_codes

        tts = self._require().tts_model
        codes = np.asarray(codes)
        if codes.shape[0] == 0:
            return np.zeros(0, np.float32)
        clean = replace_control_codes(mx.array(codes.astype(np.int32)), tts.control_codes, tts.codec_silence_tokens)
        out = tts.audio_codec.decode(clean)
        mx.eval(out)
        return _np(out, np.float32)

    def decode_text(self, ids) -> str:
        """Assistant text of a list of ids, as the runtime decodes it (specials dropped)."""
        model = self._require()
        skip = model.config.special_text_ids
        return model.tokenizer.decode([int(i) for i in ids if int(i) not in skip])

    def decode_transcript(self, tokens) -> str:
        """User transcript of a list of RNNT tokens, as the runtime decodes it."""
        from voicechat.model.audio.rnnt import RnntText

        return RnntText(list(self._require().config.rnnt_vocabulary)).decode(tokens)

    def prompt_ids(self, system_prompt: str | None) -> list[int]:
        """The system-prompt token ids exactly as the runtime's timeline builds them."""
        from voicechat.streaming.timeline import Timeline

        return Timeline(self._require(), seed=0).prompt_ids(system_prompt)

    @_executing
    def _frame_tokens(self, encoder_frames: np.ndarray) -> list[list[int]]:
        """RNNT tokens per encoder frame, frame by frame with the streaming decoder."""
        from voicechat.model.audio.rnnt import RnntStream, RnntText

        model = self._require()
        cfg = model.config
        text = RnntText(list(cfg.rnnt_vocabulary))
        rnnt = RnntStream(
            model.stt_model.rnnt_decoder,
            model.stt_model.rnnt_joint,
            cfg.audio_config.max_symbols,
            skip_ids=text.special_ids,
        )
        enc = mx.array(np.asarray(encoder_frames, dtype=np.float32))
        return [rnnt.step(enc[t]) for t in range(enc.shape[0])]

    @_executing
    def _teacher_forced_logits(self, encoder_frames, prompt: list[int], text_ids, function_ids):
        """Text / function logits (T, V) of the audio positions, recomputed over the inputs the given
        ids imply as the offline path computes them: the prompt by `NemotronH.prefill` (as
        `Timeline.start`), then one cached step per audio position (as `Timeline.language_step`)."""
        model = self._require()
        llm = model.stt_model.llm
        x = self._timeline_inputs(encoder_frames, prompt, text_ids, function_ids)
        state = llm.make_state()
        p = len(prompt)
        if p:
            llm.prefill(x[:, :p], state)
        text, function = [], []
        for t in range(p, x.shape[1]):
            tl, fl = model.heads(llm(x[:, t : t + 1], state)[:, -1])
            mx.eval(tl, fl, state.arrays())
            text.append(_np(tl[0], np.float32))
            function.append(_np(fl[0], np.float32))
        if not text:
            return None, None
        return np.stack(text), np.stack(function)

    @_executing
    def _timeline_inputs(self, encoder_frames, prompt: list[int], text_ids, function_ids) -> mx.array:
        """LLM inputs (1, P + T, H) of the timeline: prompt positions, then audio positions fed the
        previous position's ids (PAD before the first audio position)."""
        model = self._require()
        cfg = model.config
        pad = cfg.pad_token_id
        rows = []
        if prompt:
            rows.append(model.prompt_input(mx.array(prompt, dtype=mx.int32)))
        emb = model.stt_model.perception.project(mx.array(np.asarray(encoder_frames, dtype=np.float32)))
        prev_t = mx.array([pad] + [int(i) for i in text_ids[:-1]], dtype=mx.int32)
        prev_f = mx.array([pad] + [int(i) for i in function_ids[:-1]], dtype=mx.int32)
        rows.append(model.fused_input(prev_t, emb, prev_f))
        return mx.concatenate(rows, axis=0)[None]

    # -- offline

    @_executing
    def offline(
        self,
        audio: np.ndarray,
        *,
        system_prompt: str | None = None,
        seed: int = 0,
        extra_decoding_seconds: float = 0.0,
        with_logits: bool = False,
    ) -> OfflineRun:
        model = self._require()
        t0 = time.perf_counter()
        r = model.generate(audio, system_prompt=system_prompt, seed=seed, extra_decoding_seconds=extra_decoding_seconds)
        wall = time.perf_counter() - t0
        run = OfflineRun(
            text_ids=np.asarray(r.text_tokens, np.int32),
            function_ids=np.asarray(r.function_tokens, np.int32),
            codes=np.asarray(r.raw_audio_codes, np.int32),
            decoded_codes=np.asarray(r.audio_codes, np.int32),
            audio=np.asarray(r.audio, np.float32),
            text=r.text,
            transcript=r.user_transcript,
            transcript_tokens=[int(t) for t in r.transcript_tokens],
            mel=r.mel,
            encoder=r.encoder_frames,
            wall_s=wall,
        )
        if r.encoder_frames is not None:
            run.transcript_frame_tokens = self._frame_tokens(r.encoder_frames)
            if with_logits:
                run.text_logits, run.function_logits = self._teacher_forced_logits(
                    r.encoder_frames, self.prompt_ids(system_prompt), run.text_ids, run.function_ids
                )
        return run

    # -- streamed

    @_executing
    def stream(
        self,
        audio: np.ndarray,
        *,
        system_prompt: str | None = None,
        seed: int = 0,
        chunk_samples: int = 1280,
        profile: bool = False,
        with_logits: bool = False,
    ) -> StreamRun:
        from voicechat.io.audio_input import load_audio

        if isinstance(chunk_samples, bool) or not isinstance(chunk_samples, int) or chunk_samples < 1:
            raise ValueError(f"chunk_samples must be a positive int, got {chunk_samples!r}")
        model = self._require()
        cfg = model.config
        wave = load_audio(audio, cfg.input_sample_rate, allow_empty=False)
        record = (not profile) if self.record_intermediates is None else self.record_intermediates
        frames: list = []
        t0 = time.perf_counter()
        session = model.create_streaming_session(
            system_prompt=system_prompt, seed=seed, profile=profile, on_frame=frames.append if record else None
        )
        create_s = time.perf_counter() - t0
        events: list = []
        first_audio = first_text = None
        t_push = time.perf_counter()
        for start in range(0, wave.size, chunk_samples):
            got = session.push_audio(wave[start : start + chunk_samples])
            now = time.perf_counter() - t_push
            if first_audio is None and any(e.kind == "audio" for e in got):
                first_audio = now
            if first_text is None and any(e.kind == "assistant_text_delta" for e in got):
                first_text = now
            events.extend(got)
        events.extend(session.flush())
        wall = time.perf_counter() - t0
        audio_events = [e for e in events if e.kind == "audio"]
        tails = [e for e in events if e.kind == "audio_tail"]
        q = cfg.tts_config.num_quantizers
        run = StreamRun(
            text_ids=np.asarray(session.text_ids, np.int32),
            function_ids=np.asarray(session.function_ids, np.int32),
            codes=(
                np.stack(session.raw_audio_codes).astype(np.int32)
                if session.raw_audio_codes
                else np.zeros((0, q), np.int32)
            ),
            decoded_codes=(
                np.stack([e.audio_codes for e in audio_events]).astype(np.int32)
                if audio_events
                else np.zeros((0, q), np.int32)
            ),
            audio=(
                np.concatenate([e.samples for e in audio_events]).astype(np.float32)
                if audio_events
                else np.zeros(0, np.float32)
            ),
            tail=(np.concatenate([e.samples for e in tails]).astype(np.float32) if tails else np.zeros(0, np.float32)),
            text=session.text.text,
            transcript=session.transcript.text,
            transcript_tokens=[int(t) for t in session.transcript_tokens],
            events=[_event_dict(e) for e in events],
            create_s=create_s,
            first_audio_s=first_audio,
            first_text_s=first_text,
            wall_s=wall,
        )
        if profile and session.profile is not None:
            run.frame_timings = [f.as_dict() for f in session.profile.frames]
            run.profile_summary = session.profile.summary()

        if record:
            _take_frame_records(run, frames, with_logits)
        return run

    @_executing
    def asr_frame_ms(self, audio: np.ndarray, *, chunk_samples: int = 1280) -> list[float]:
        """Wall milliseconds of each `step` of a streaming ASR session fed `chunk_samples` at a time
        (transcript only: log-mel, cache-aware conformer, RNNT), each push's text on the host."""
        from voicechat.io.audio_input import load_audio

        model = self._require()
        wave = load_audio(audio, model.config.input_sample_rate, allow_empty=False)
        session = model.create_asr_session()
        times = []
        for start in range(0, wave.size - chunk_samples + 1, chunk_samples):
            t0 = time.perf_counter()
            session.step(wave[start : start + chunk_samples])
            times.append((time.perf_counter() - t0) * 1000.0)
        session.finish()
        return times

    # -- component checks

    @_executing
    def llm_cached_step(self, x: mx.array, state, position: int) -> mx.array:
        """One cached Nemotron-H step (1, 1, H) -> final hidden (1, H). Overridden by broken test backends."""
        return self._require().stt_model.llm.step(x, state)[:, -1]

    @_executing
    def tts_cached_step(self, state, text_token: int, rng, position: int) -> tuple[mx.array, mx.array]:
        """One cached EAR-TTS step -> (hidden (2, hidden), codes (Q,)); advances `state`."""
        model = self._require()
        tts = model.tts_model.tts_model
        silence = model.tts_model.codec_silence_tokens
        hidden = tts.step_hidden(state, text_token, eos_id=model.config.eos_token_id, silence_codes=silence)
        codes = tts.generate_codes(hidden, rng)
        state.previous_codes = codes[None]
        return hidden, codes

    @_executing
    def component_checks(
        self, audio: np.ndarray, *, system_prompt: str | None = None, seed: int = 0, offline: OfflineRun | None = None
    ) -> ComponentRun:
        """Nemotron-H cached steps vs recompute, EAR-TTS cached steps vs recompute-from-history.

        The timeline inputs come from the offline encoder frames (of `offline`
        if given); the cached run picks the ids by argmax as the runtime does and
        the recompute is fed the same inputs (teacher forcing).
        """
        from voicechat.model.tts.rng import SessionRandom
        from voicechat.streaming.generate import offline_perception

        model = self._require()
        cfg = model.config
        if offline is not None and offline.encoder is not None:
            enc = np.asarray(offline.encoder, np.float32)
        else:
            enc = np.array(offline_perception(model, audio).encoder, dtype=np.float32)
        if self.component_max_frames is not None:
            enc = enc[: self.component_max_frames]
        prompt = self.prompt_ids(system_prompt)
        p = len(prompt)
        pad = cfg.pad_token_id
        llm = model.stt_model.llm

        # Nemotron-H: cached single steps, ids picked as the runtime does.
        state = llm.make_state()
        emb = model.stt_model.perception.project(mx.array(enc))
        prev_t = prev_f = pad
        inputs, c_text, c_func, tokens = [], [], [], []
        for t in range(p + enc.shape[0]):
            if t < p:
                x = model.prompt_input(mx.array([prompt[t]], dtype=mx.int32))
            else:
                x = model.fused_input(
                    mx.array([prev_t], dtype=mx.int32), emb[t - p][None], mx.array([prev_f], dtype=mx.int32)
                )
            x = x[None]
            hidden = self.llm_cached_step(x, state, t)
            tl, fl = model.heads(hidden)
            mx.eval(tl, fl)
            inputs.append(x)
            c_text.append(tl[0])
            c_func.append(fl[0])
            if t < p:
                tokens.append(pad)
            else:
                prev_t, prev_f = int(mx.argmax(tl[0]).item()), int(mx.argmax(fl[0]).item())
                tokens.append(prev_t)
        # The no-cache recompute: the whole history from a fresh state, one pass.
        hidden_all = llm.forward_uncached(mx.concatenate(inputs, axis=1))[0]
        r_text, r_func = model.heads(hidden_all)
        mx.eval(r_text, r_func)

        # EAR-TTS: cached steps vs recompute-from-history, positions 1 .. T-1, same seed.
        model.ensure_char_table()
        tts = model.tts_model.tts_model
        silence = model.tts_model.codec_silence_tokens
        eos = cfg.eos_token_id
        tts_state = model.warm_tts_state()
        history = tts.new_history(model.speaker_prompt_codes(), model.speaker_latent, pad)
        rng_c, rng_r = SessionRandom(seed), SessionRandom(seed)
        ch, cc, rh, rc = [], [], [], []
        for t in range(1, len(tokens)):
            tok = tokens[t]
            h_c, codes_c = self.tts_cached_step(tts_state, tok, rng_c, t)
            h_r = tts.uncached_hidden(history, tok, eos_id=eos, silence_codes=silence)
            codes_r = tts.generate_codes(h_r, rng_r)
            history.steps.append((history.previous_codes, tok, eos, silence))
            history.previous_codes = codes_r[None]
            mx.eval(h_c, codes_c, h_r, codes_r, tts_state.arrays())
            ch.append(_np(h_c, np.float32))
            cc.append(_np(codes_c, np.int32))
            rh.append(_np(h_r, np.float32))
            rc.append(_np(codes_r, np.int32))
        q = cfg.tts_config.num_quantizers
        return ComponentRun(
            prompt_positions=p,
            llm_cached_text_logits=_np(mx.stack(c_text), np.float32),
            llm_cached_function_logits=_np(mx.stack(c_func), np.float32),
            llm_recompute_text_logits=_np(r_text, np.float32),
            llm_recompute_function_logits=_np(r_func, np.float32),
            tts_cached_codes=np.stack(cc) if cc else np.zeros((0, q), np.int32),
            tts_recompute_codes=np.stack(rc) if rc else np.zeros((0, q), np.int32),
            tts_cached_hidden=np.stack(ch) if ch else None,
            tts_recompute_hidden=np.stack(rh) if rh else None,
            notes={"audio_frames": int(enc.shape[0])},
        )


def _take_frame_records(run: StreamRun, frames: list, with_logits: bool) -> None:
    """Fill the run's per-frame intermediates from the session's `FrameRecord`s."""
    run.transcript_frame_tokens = [list(f.rnnt_tokens) for f in frames]
    if not frames:
        return
    if all(f.mel is not None for f in frames):
        run.mel = np.concatenate([f.mel for f in frames])
    run.encoder = np.stack([f.encoder for f in frames])
    if with_logits:
        run.text_logits = np.stack([f.text_logits for f in frames])
        run.function_logits = np.stack([f.function_logits for f in frames])


def _serial_policy():
    from voicechat.runtime import ExecutionPolicy

    return ExecutionPolicy.serial()


def _gpu_policy():
    from voicechat.runtime import ExecutionPolicy

    return ExecutionPolicy.gpu()


class SerialVoiceChatBackend(VoiceChatBackend):
    """This project under `ExecutionPolicy.serial()` (`voicechat-serial`): one CPU stream, nothing
    compiled, every product in MLX. The benchmark runs it beside `voicechat` to measure what the
    runtime's choices give. Ids, codes and every cache but the codec's are bit-identical to
    `voicechat`; the audio differs by float32 summation order (~1e-7) where `voicechat` runs the
    codec products on the host."""

    name = "voicechat-serial"
    policy = staticmethod(_serial_policy)


class GpuPolicyVoiceChatBackend(VoiceChatBackend):
    """This project under the policy a GPU device gets (`ExecutionPolicy.gpu()`: no CPU kernels,
    one stream, no host products, no evaluation ahead, 16-bit weights as stored), run on this
    device (`voicechat-gpu-policy`): every branch an Apple Silicon user takes runs here first, and
    its dispatches and host synchronisations are counted (`dispatch.csv`)."""

    name = "voicechat-gpu-policy"
    policy = staticmethod(_gpu_policy)


__all__ = ["VoiceChatBackend", "SerialVoiceChatBackend", "GpuPolicyVoiceChatBackend"]
