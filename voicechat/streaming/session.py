"""The cache-aware streaming session: one 1280-sample frame per step (api.md, docs/model.md §10.3).

Per frame: (1) perception (streaming log-mel + cache-aware FastConformer, or
the uncached fallback) and projection, (2) one RNNT transcript step, (3) one
Nemotron-H step from the persistent state, (4) one EAR-TTS step (silence codes
at timeline position 0), (5) `decode_step` of the control-code-cleaned codes
-> exactly one output frame of audio, (6) events.

The session's caches are explicit state objects (`session.states()`), so the
parity harness can read them without reaching into internals. A session is
bound to the thread that created it (MLX streams are per thread); use from
another thread raises `WrongThreadError`.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Callable

import mlx.core as mx
import numpy as np

from voicechat.model.audio.conformer import ConformerStream, PerceptionFallback
from voicechat.model.audio.mel import StreamingLogMel
from voicechat.io.audio_input import as_mono_float32, check_sample_rate
from voicechat.errors import ContextLimitError, SessionClosedError, WrongThreadError
from voicechat.events import (
    AssistantTextDelta,
    Audio,
    AudioTail,
    Cancelled,
    Done,
    FunctionDelta,
    UserTranscriptDelta,
)
from voicechat.tools.channel import FunctionChannel, normalize_tools, timeout_frames
from voicechat.model import ops
from voicechat.streaming.profiler import FrameTiming, Profile
from voicechat.streaming.engine import FrameExecutor
from voicechat.streaming.prompt_state import UNSET, resolve_prompt_arguments
from voicechat.streaming.timeline import Timeline, session_prompt
from voicechat.io.tokenizer import IncrementalDecoder


@dataclass(frozen=True)
class FrameRecord:
    """The session's own intermediate values of one frame, handed to `on_frame` (host copies).

    mel: (n, n_mels) log-mel frames the conformer consumed (None with the uncached perception
    fallback); encoder: (d,) encoder frame; rnnt_tokens: transcript tokens this frame emitted;
    text_logits / function_logits: (V,) float32; text_id / function_id: the heads' argmax;
    text_fed / function_fed: the ids the frame carried on (to the TTS and the next frame's input),
    which differ from the argmax only while a tool response is forced (`forced`: PAD text, the
    response's token); raw_codes: (Q,) codes the TTS generated; codes: (Q,) the decoded codes
    (control codes replaced); samples: the frame's audio."""

    frame_index: int
    mel: np.ndarray | None
    encoder: np.ndarray
    rnnt_tokens: tuple[int, ...]
    text_logits: np.ndarray
    function_logits: np.ndarray
    text_id: int
    function_id: int
    raw_codes: np.ndarray
    codes: np.ndarray
    samples: np.ndarray
    text_fed: int = -1
    function_fed: int = -1
    forced: bool = False


class StreamingPerception:
    """Streaming log-mel + cache-aware FastConformer + projection: 1280 samples -> one frame."""

    def __init__(self, model, *, use_cache: bool = True):
        cfg = model.config
        per = model.stt_model.perception
        self.perception = per
        self.use_cache = use_cache
        if use_cache:
            self.mel = StreamingLogMel(cfg.audio_config.preprocessor, lookahead_samples=cfg.frame_samples,
                                       reference_edge=model.numerics.streaming_mel_edge_as_reference)
            self.conformer = ConformerStream(per.encoder)
            self.fallback = None
        else:
            self.mel = self.conformer = None
            self.fallback = PerceptionFallback(per.encoder, cfg.audio_config.preprocessor, cfg.frame_samples)
        self.last_mel = None  # the log-mel frames of the last push (cached path)

    def push_frame(self, samples: np.ndarray) -> tuple[mx.array, mx.array]:
        """-> (encoder frame (d,), audio embedding (H,))."""
        if self.use_cache:
            mel = self.mel.push(samples)
            self.last_mel = mel
            enc = self.conformer.push_one(mel)
        else:
            enc = self.fallback.push_frame(samples)
        return enc, self.perception.project(enc)

    def arrays(self) -> dict[str, mx.array]:
        if self.use_cache:
            out = {f"mel.{k}": v for k, v in self.mel.arrays().items()}
            out.update({f"conformer.{k}": v for k, v in self.conformer.state.arrays().items()})
            return out
        return {f"fallback.{k}": v for k, v in self.fallback.arrays().items()}


class VoiceChatStreamingSession:
    """Create with `model.create_streaming_session(...)`."""

    def __init__(self, model, *, system_prompt: str | None = UNSET, seed: int = UNSET,
                 max_streaming_seconds: float | None = None, use_language_cache: bool = True,
                 use_perception_cache: bool = True, profile: bool = False,
                 on_frame: Callable[[FrameRecord], None] | None = None, tools=UNSET,
                 tool_timeout_seconds: float | None = None, prompt_state=None,
                 should_stop: Callable[[], bool] | None = None):
        cfg = model.config
        system_prompt, tools, seed = resolve_prompt_arguments(model, prompt_state, system_prompt, tools, seed,
                                                              use_language_cache)
        if on_frame is not None and not callable(on_frame):
            raise TypeError(f"on_frame must be a callable taking a FrameRecord, or None; got {type(on_frame).__name__}")
        self._on_frame = on_frame
        self.model = model
        self.config = cfg
        # Runs the frames under the model's runtime, fixed for the session's life; the prefill and
        # the codec's tail are bound to the same runtime.
        self._executor = FrameExecutor(model.runtime)
        self._owner = threading.get_ident()
        self.frame_samples = cfg.frame_samples
        if max_streaming_seconds is not None:
            if isinstance(max_streaming_seconds, bool) or not isinstance(max_streaming_seconds, (int, float)) \
                    or max_streaming_seconds <= 0:
                raise ValueError(f"max_streaming_seconds must be a positive number or None, got {max_streaming_seconds!r}")
            self.max_frames = int(max_streaming_seconds / cfg.frame_duration + 1e-9)
        else:
            self.max_frames = None
        self.perception = StreamingPerception(model, use_cache=use_perception_cache)
        self.rnnt, self.transcript = model.rnnt_transcriber()
        self.tools = normalize_tools(tools)
        # Tools are checked (markers in the tokenizer, the timeout) before any work starts.
        self.tool_channel = FunctionChannel(model.tokenizer, self.tools, pad_id=cfg.pad_token_id,
                                            timeout_frames=timeout_frames(tool_timeout_seconds, cfg.frame_duration)) \
            if self.tools else None
        if tool_timeout_seconds is not None and not self.tools:
            raise ValueError("tool_timeout_seconds needs tools")
        self.timeline = Timeline(model, seed=seed, use_language_cache=use_language_cache)
        self.system_prompt = session_prompt(cfg, system_prompt, self.tools)
        if should_stop is not None and not callable(should_stop):
            raise TypeError(f"should_stop must be a callable returning bool, or None; got {type(should_stop).__name__}")
        if prompt_state is None:
            with ops.bound(self._executor.runtime):
                self.prompt_positions = self.timeline.start(self.system_prompt, should_stop=should_stop)
        else:  # a copy of the state after that very prefill (voicechat/streaming/prompt_state.py)
            self.prompt_positions = prompt_state.restore(self.timeline)
        codec = model.tts_model.audio_codec
        self.codec = codec
        self.codec_state = codec.make_state()
        specials = cfg.special_text_ids
        self.text = IncrementalDecoder(model.tokenizer, specials)
        self.function_text = IncrementalDecoder(model.tokenizer, specials)
        self.profile = Profile(cfg.frame_duration * 1000.0,
                               model.policy.as_dict() if model.policy is not None else None) if profile else None
        self._pending = np.zeros(0, dtype=np.float32)
        self.frame_index = 0
        self.closed = False
        # Host-side copies for the harness: ids and the generated (raw) codes per emitted frame; the
        # Audio events carry the decoded codes (after control-code replacement).
        self.text_ids: list[int] = []
        self.function_ids: list[int] = []
        self.raw_audio_codes: list[np.ndarray] = []
        self.transcript_tokens: list[int] = []

    # -- helpers

    def _check_thread(self):
        if threading.get_ident() != self._owner:
            raise WrongThreadError(
                "this streaming session was created on another thread; MLX work of a session must stay on "
                "the thread that created it. Create one session per thread."
            )

    def states(self) -> dict[str, mx.array]:
        """Every cache family of the session, flattened (for inspection and diffs)."""
        out = {f"perception.{k}": v for k, v in self.perception.arrays().items()}
        out.update({f"rnnt.{k}": v for k, v in self.rnnt.state.arrays().items()})
        out.update(self.timeline.state.arrays())
        out.update({f"codec.{k}": v for k, v in self.codec_state.arrays().items()})
        return out

    @property
    def pending_samples(self) -> int:
        return int(self._pending.shape[0])

    # -- one frame

    def _frame(self, samples: np.ndarray) -> list:
        tc = self.tool_channel
        forced = tc.forced_token(self.frame_index) if tc is not None else None
        # The five stages, under the model's runtime (the server samples which frames it profiles).
        out = self._executor.run(self, samples, forced, profile=self.profile is not None)
        events = []
        self._transcribe(out.rnnt_tokens, events)
        tid, fid = int(out.text_fed.item()), int(out.function_fed.item())
        self.text_ids.append(tid)
        self.function_ids.append(fid)
        self.raw_audio_codes.append(np.array(out.codes, dtype=np.int32))
        r = self.text.push(tid)
        if r is not None:
            events.append(AssistantTextDelta(self.frame_index, tid, r[0], r[1]))
        if forced is None:  # the model's own function tokens; forced response tokens are not its output
            r = self.function_text.push(fid)
            if r is not None:
                events.append(FunctionDelta(self.frame_index, fid, r[0], r[1]))
        if tc is not None:
            events.extend(tc.observe(self.frame_index, fid, forced is not None))
        events.append(Audio(self.frame_index, np.array(out.audio, dtype=np.float32), np.array(out.clean, dtype=np.int32)))
        record = None  # after the timed frame; the arrays are already evaluated
        if self._on_frame is not None:
            record = self._record(out.encoder, out.rnnt_tokens, out.text_logits, out.function_logits,
                                  out.text_id.item(), out.function_id.item(), out.codes, out.clean, out.audio, tid,
                                  fid, forced is not None)
        if out.stage_ms is not None:
            self.profile.add(FrameTiming(self.frame_index, *out.stage_ms))
        self.frame_index += 1
        if record is not None:  # the session is consistent before the observer runs
            self._on_frame(record)
        return events

    def _transcribe(self, tokens: list[int], events: list) -> None:
        """Add the frame's RNNT tokens to the transcript, with its delta event."""
        if tokens:
            self.transcript_tokens.extend(tokens)
            delta, text = self.transcript.add(tokens)
            if delta:
                events.append(UserTranscriptDelta(self.frame_index, delta, text))

    def _record(self, enc, tokens, text_logits, function_logits, tid, fid, codes, clean, audio, text_fed,
                function_fed, forced) -> FrameRecord:
        mel = self.perception.last_mel if self.perception.use_cache else None
        f32 = lambda a: np.array(a, dtype=np.float32)  # noqa: E731
        return FrameRecord(self.frame_index, None if mel is None else f32(mel), f32(enc), tuple(int(t) for t in tokens),
                           f32(text_logits), f32(function_logits), tid, fid, np.array(codes, dtype=np.int32),
                           np.array(clean, dtype=np.int32), f32(audio), text_fed, function_fed, forced)

    # -- public API

    def submit_tool_result(self, call_id: str, output) -> None:
        """The result of a `ToolCall` (a str of JSON text, or a JSON-serialisable value). From the next
        frame the session computes, `<TOOL_RESPONSE>[output]</TOOL_RESPONSE>` is forced onto the
        function channel one token a frame (results of one call list go together, in call order,
        once all have come). An unknown or already answered `call_id` raises ValueError and changes
        nothing."""
        self._check_thread()
        if self.closed:
            raise SessionClosedError("the session is closed (flush() or cancel() was called); create a new one")
        if self.tool_channel is None:
            raise ValueError(f"call_id {call_id!r} is not a pending tool call: this session has no tools")
        self.tool_channel.submit(call_id, output)

    @property
    def pending_tool_calls(self) -> list[str]:
        """Call ids whose results the session waits for."""
        return self.tool_channel.pending_call_ids if self.tool_channel is not None else []

    def push_audio(self, samples, sample_rate: int = 16000) -> list:
        """Append audio; run one step per complete frame; return the events of those frames.

        Validation happens before any state changes: a refused push leaves the
        session exactly as it was. When `max_streaming_seconds` is reached,
        `ContextLimitError` is raised with the events of the frames completed in
        this call attached as `err.events`, and the session is closed.
        """
        self._check_thread()
        if self.closed:
            raise SessionClosedError("the session is closed (flush() or cancel() was called); create a new one")
        check_sample_rate(sample_rate, self.config.input_sample_rate)
        a = as_mono_float32(samples)
        self._pending = np.concatenate([self._pending, a]) if a.size else self._pending
        events: list = []
        n = self.frame_samples
        while self._pending.shape[0] >= n:
            if self.max_frames is not None and self.frame_index >= self.max_frames:
                self.closed = True
                err = ContextLimitError(
                    f"max_streaming_seconds reached ({self.max_frames} frames of "
                    f"{self.config.frame_duration * 1000:g} ms); the session is closed"
                )
                err.events = events
                raise err
            chunk, self._pending = self._pending[:n], self._pending[n:]
            events.extend(self._frame(chunk))
        return events

    def flush(self, pad_partial: bool = True) -> list:
        """Run the zero-padded partial frame (if `pad_partial`), emit the codec tail and `Done`; close."""
        self._check_thread()
        if self.closed:
            return []
        events: list = []
        if self._pending.shape[0] and pad_partial:
            chunk = np.zeros(self.frame_samples, dtype=np.float32)
            chunk[: self._pending.shape[0]] = self._pending
            self._pending = np.zeros(0, dtype=np.float32)
            if self.max_frames is None or self.frame_index < self.max_frames:
                events.extend(self._frame(chunk))
        self._pending = np.zeros(0, dtype=np.float32)
        if self.frame_index > 0:
            with ops.bound(self._executor.runtime):
                tail = self.codec.flush(self.codec_state)
                mx.eval(tail)
            events.append(AudioTail(self.frame_index - 1, np.array(tail, dtype=np.float32)))
        events.append(Done(self.frame_index))
        self.closed = True
        return events

    def cancel(self) -> list:
        """Drop pending audio and close; emits `Cancelled`."""
        self._check_thread()
        if self.closed:
            return []
        self._pending = np.zeros(0, dtype=np.float32)
        self.closed = True
        return [Cancelled(self.frame_index)]
