"""The cache-aware streaming session: any chunk of audio in, one 1280-sample frame per step, events out
(api.md, docs/model.md §10.3).

The session checks its input once, where it comes in (16 kHz, mono, finite), keeps the samples
that do not yet make a frame, hands each complete frame to the frame engine
(`voicechat.streaming.engine`: perception, RNNT, language, TTS, codec over the conversation's
state) and turns what the frame computed into events: transcript and text deltas, function
tokens, tool calls, audio. The caches are the engine's explicit state (`session.states()`), so the
parity harness can read them without reaching into internals. A session is bound to the thread
that created it (MLX streams are per thread); use from another thread raises `WrongThreadError`.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import cast

import mlx.core as mx
import numpy as np

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
from voicechat.io.audio_input import as_mono_float32, check_sample_rate
from voicechat.io.tokenizer import IncrementalDecoder
from voicechat.model.audio.rnnt import RnntTranscript
from voicechat.streaming.engine import ConversationState, FrameEngine, FrameOutputs
from voicechat.streaming.profiler import FrameTiming, Profile
from voicechat.streaming.prompt_state import UNSET, Unset, resolve_prompt_arguments
from voicechat.streaming.timeline import session_prompt
from voicechat.tools.channel import FunctionChannel, normalize_tools, timeout_frames


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


def _host_int(a: mx.array) -> int:
    """The id an int32 scalar array holds, on the host (`item()` of an integer array is an int)."""
    return cast(int, a.item())


class VoiceChatStreamingSession:
    """Create with `model.create_streaming_session(...)`."""

    def __init__(
        self,
        model,
        *,
        system_prompt: str | Unset | None = UNSET,
        seed: int | Unset = UNSET,
        max_streaming_seconds: float | None = None,
        use_language_cache: bool = True,
        use_perception_cache: bool = True,
        profile: bool = False,
        on_frame: Callable[[FrameRecord], None] | None = None,
        tools=UNSET,
        tool_timeout_seconds: float | None = None,
        prompt_state=None,
        should_stop: Callable[[], bool] | None = None,
    ):
        cfg = model.config
        system_prompt, tools, seed = resolve_prompt_arguments(
            model, prompt_state, system_prompt, tools, seed, use_language_cache
        )
        if on_frame is not None and not callable(on_frame):
            raise TypeError(f"on_frame must be a callable taking a FrameRecord, or None; got {type(on_frame).__name__}")
        if should_stop is not None and not callable(should_stop):
            raise TypeError(f"should_stop must be a callable returning bool, or None; got {type(should_stop).__name__}")
        self._on_frame = on_frame
        self.model = model
        self.config = cfg
        self._owner = threading.get_ident()
        self.frame_samples = cfg.frame_samples
        if max_streaming_seconds is not None:
            if (
                isinstance(max_streaming_seconds, bool)
                or not isinstance(max_streaming_seconds, (int, float))
                or max_streaming_seconds <= 0
            ):
                raise ValueError(
                    f"max_streaming_seconds must be a positive number or None, got {max_streaming_seconds!r}"
                )
            self.max_frames = int(max_streaming_seconds / cfg.frame_duration + 1e-9)
        else:
            self.max_frames = None
        self.tools = normalize_tools(tools)
        # Tools are checked (markers in the tokenizer, the timeout) before any work starts.
        self.tool_channel = (
            FunctionChannel(
                model.tokenizer,
                self.tools,
                pad_id=cfg.pad_token_id,
                timeout_frames=timeout_frames(tool_timeout_seconds, cfg.frame_duration),
            )
            if self.tools
            else None
        )
        if tool_timeout_seconds is not None and not self.tools:
            raise ValueError("tool_timeout_seconds needs tools")
        # The frames run on the engine, under the model's runtime, fixed for the session's life.
        self._engine = FrameEngine(model)
        self.state: ConversationState = self._engine.new_state(
            seed=seed, use_language_cache=use_language_cache, use_perception_cache=use_perception_cache
        )
        self.transcript = RnntTranscript(model.rnnt_text())
        self.system_prompt = session_prompt(cfg, system_prompt, self.tools)
        if prompt_state is None:
            self.prompt_positions = self._engine.prefill(self.state, self.system_prompt, should_stop)
        else:  # a copy of the state after that very prefill (voicechat/streaming/prompt_state.py)
            self.prompt_positions = prompt_state.restore(self.state.timeline)
        specials = cfg.special_text_ids
        self.text = IncrementalDecoder(model.tokenizer, specials)
        self.function_text = IncrementalDecoder(model.tokenizer, specials)
        self.profile = (
            Profile(cfg.frame_duration * 1000.0, model.policy.as_dict() if model.policy is not None else None)
            if profile
            else None
        )
        # Instrumentation: told each stage's name as it starts (bench/dispatch.py attributes MLX's
        # dispatches by it); None costs nothing.
        self.on_stage: Callable[[str], None] | None = None
        self._pending = np.zeros(0, dtype=np.float32)
        self.closed = False
        # Host-side copies for the harness: ids and the generated (raw) codes per emitted frame; the
        # Audio events carry the decoded codes (after control-code replacement).
        self.text_ids: list[int] = []
        self.function_ids: list[int] = []
        self.raw_audio_codes: list[np.ndarray] = []
        self.transcript_tokens: list[int] = []

    # -- the conversation's state (the engine's; read it, do not change it)

    @property
    def frame_index(self) -> int:
        """Frames computed so far (the index of the next one)."""
        return self.state.frames

    @property
    def perception(self):
        return self.state.perception

    @property
    def rnnt(self):
        return self.state.rnnt

    @property
    def timeline(self):
        return self.state.timeline

    @property
    def codec_state(self):
        return self.state.codec

    @property
    def codec(self):
        return self._engine.codec

    def states(self) -> dict[str, mx.array]:
        """Every cache family of the session, flattened (for inspection and diffs)."""
        return self.state.arrays()

    @property
    def pending_samples(self) -> int:
        """Samples received that do not yet make a frame."""
        return int(self._pending.shape[0])

    def _check_thread(self):
        if threading.get_ident() != self._owner:
            raise WrongThreadError(
                "this streaming session was created on another thread; MLX work of a session must stay on "
                "the thread that created it. Create one session per thread."
            )

    def _check_open(self):
        self._check_thread()
        if self.closed:
            raise SessionClosedError("the session is closed (flush() or cancel() was called); create a new one")

    # -- one frame

    def _frame(self, samples: np.ndarray) -> list:
        i, forced = self._frame_input()
        out = self._engine.step(self.state, samples, forced, profile=self.profile is not None, on_stage=self.on_stage)
        return self._frame_done(i, out, forced)

    def _frame_input(self) -> tuple[int, int | None]:
        """The next frame's index and the tool-response token forced onto it (None: the model's own)."""
        i = self.state.frames
        tc = self.tool_channel
        return i, tc.forced_token(i) if tc is not None else None

    def _frame_done(self, i: int, out: FrameOutputs, forced: int | None) -> list:
        """A computed frame's events; its profile entry; the `on_frame` record."""
        events = self._events(i, out, forced)
        if out.stage_ms is not None and self.profile is not None:
            self.profile.add(FrameTiming(i, *out.stage_ms))
        if self._on_frame is not None:  # after the timed frame (its arrays are evaluated); the session
            self._on_frame(self._record(i, out, forced is not None))  # is consistent before the observer runs
        return events

    def _events(self, i: int, out: FrameOutputs, forced: int | None) -> list:
        """The frame's events, and the session's host copies of its ids and codes."""
        events = []
        if out.rnnt_tokens:
            self.transcript_tokens.extend(out.rnnt_tokens)
            delta, text = self.transcript.add(out.rnnt_tokens)
            if delta:
                events.append(UserTranscriptDelta(i, delta, text))
        tid, fid = _host_int(out.text_fed), _host_int(out.function_fed)
        self.text_ids.append(tid)
        self.function_ids.append(fid)
        self.raw_audio_codes.append(np.array(out.codes, dtype=np.int32))
        r = self.text.push(tid)
        if r is not None:
            events.append(AssistantTextDelta(i, tid, r[0], r[1]))
        if forced is None:  # the model's own function tokens; forced response tokens are not its output
            r = self.function_text.push(fid)
            if r is not None:
                events.append(FunctionDelta(i, fid, r[0], r[1]))
        if self.tool_channel is not None:
            events.extend(self.tool_channel.observe(i, fid, forced is not None))
        events.append(Audio(i, np.array(out.audio, dtype=np.float32), np.array(out.clean, dtype=np.int32)))
        return events

    def _record(self, i: int, out: FrameOutputs, forced: bool) -> FrameRecord:
        f32 = lambda a: np.array(a, dtype=np.float32)  # noqa: E731
        return FrameRecord(
            i,
            None if out.mel is None else f32(out.mel),
            f32(out.encoder),
            tuple(int(t) for t in out.rnnt_tokens),
            f32(out.text_logits),
            f32(out.function_logits),
            _host_int(out.text_id),
            _host_int(out.function_id),
            np.array(out.codes, dtype=np.int32),
            np.array(out.clean, dtype=np.int32),
            f32(out.audio),
            self.text_ids[-1],
            self.function_ids[-1],
            forced,
        )

    def _frames(self, *, at_limit_raise: bool = True) -> Iterator[list]:
        """Compute the buffered complete frames one at a time, yielding each one's events; at
        `max_streaming_seconds` close and raise `ContextLimitError` (or just stop)."""
        while self._has_frame():
            if self._at_limit():
                if not at_limit_raise:
                    return
                self._close_at_limit()
            yield self._frame(self._pop_frame())

    def _has_frame(self) -> bool:
        """A complete frame is buffered."""
        return self._pending.shape[0] >= self.frame_samples

    def _pop_frame(self) -> np.ndarray:
        n = self.frame_samples
        chunk, self._pending = self._pending[:n], self._pending[n:]
        return chunk

    def _at_limit(self) -> bool:
        return self.max_frames is not None and self.frame_index >= self.max_frames

    def _close_at_limit(self):
        """Close the session at `max_streaming_seconds`: raises `ContextLimitError`."""
        self.closed = True
        raise ContextLimitError(
            f"max_streaming_seconds reached ({self.max_frames} frames of "
            f"{self.config.frame_duration * 1000:g} ms); the session is closed"
        )

    def _checked(self, samples, sample_rate) -> np.ndarray:
        """A chunk checked and converted (the only check its samples get); nothing changes."""
        check_sample_rate(sample_rate, self.config.input_sample_rate)
        return as_mono_float32(samples)

    def _append(self, a: np.ndarray) -> None:
        if a.size:
            self._pending = np.concatenate([self._pending, a])

    def _take(self, samples, sample_rate) -> None:
        """Check a chunk and buffer it; a refused chunk changes nothing."""
        self._append(self._checked(samples, sample_rate))

    # -- public API

    def submit_tool_result(self, call_id: str, output) -> None:
        """The result of a `ToolCall`: a str goes in exactly as given, any other JSON-serialisable value
        as `json.dumps(value)`. From the next frame the session computes,
        `<TOOL_RESPONSE>[output]</TOOL_RESPONSE>` is forced onto the function channel one token a frame
        (results of one call list go together, in call order, once all have come). An unknown or
        already answered `call_id` raises ValueError and changes nothing."""
        self._check_open()
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
        self._check_open()
        self._take(samples, sample_rate)
        events: list = []
        try:
            for frame_events in self._frames():
                events.extend(frame_events)
        except ContextLimitError as err:
            err.events = events
            raise
        return events

    def push_frames(self, samples, sample_rate: int = 16000) -> Iterator[list]:
        """`push_audio`, one frame at a time: checks and buffers `samples` now (a refused chunk raises
        here and changes nothing), then computes each complete frame as the returned iterator is
        advanced, yielding that frame's events (a server sends them before computing the next).
        Frames the caller does not take stay buffered: the next push or `flush` computes them."""
        self._check_open()
        self._take(samples, sample_rate)
        return self._frames()

    def flush(self, pad_partial: bool = True) -> list:
        """Run the zero-padded partial frame (if `pad_partial`), emit the codec tail and `Done`; close."""
        self._check_thread()
        if self.closed:
            return []
        events: list = []
        for frame_events in self._frames(at_limit_raise=False):  # frames an abandoned push_frames left
            events.extend(frame_events)
        if self._pending.shape[0] and pad_partial:
            chunk = np.zeros(self.frame_samples, dtype=np.float32)
            chunk[: self._pending.shape[0]] = self._pending
            self._pending = np.zeros(0, dtype=np.float32)
            if self.max_frames is None or self.frame_index < self.max_frames:
                events.extend(self._frame(chunk))
        self._pending = np.zeros(0, dtype=np.float32)
        if self.frame_index > 0:
            tail = self._engine.finish(self.state)
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
