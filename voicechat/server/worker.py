"""The MLX worker: one thread that owns the model and the (single) streaming session.

The network side (asyncio) never touches MLX. It hands commands (voicechat.server.messages:
OpenSession, AppendAudio, Commit, Cancel, Sync, SubmitToolResult, Close) to this thread through a
queue whose audio is bounded by admission control (`Channel.queued_samples` and
`max_queued_appends`, checked by the connection before it submits an AppendAudio); control
commands are at most three per connection. Outputs (SessionOpened, FrameEvents, Finished, ...) go
back to the connection's asyncio queue with `loop.call_soon_threadsafe`; the session's events travel
as they are, and each dialect renders them.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import json
import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from voicechat.errors import ContextLimitError, PrefillStoppedError, VoiceChatError
from voicechat.events import Audio, ToolCall
from voicechat.server.messages import (
    AppendAudio,
    Cancel,
    Close,
    Closed,
    Command,
    Commit,
    Committed,
    Finished,
    FrameEvents,
    OpenSession,
    SessionError,
    SessionOpened,
    SessionRefused,
    Stop,
    SubmitToolResult,
    Sync,
    Synced,
    ToolOutputSent,
)
from voicechat.streaming.profiler import percentile

log = logging.getLogger("voicechat.server")

STAGE_FIELDS = ("perception_ms", "rnnt_ms", "language_ms", "tts_ms", "codec_ms")


@dataclass
class Channel:
    """One connection's link to the worker; fields written by one side and read by the other are plain
    ints / Events (atomic under the GIL)."""

    session_id: str
    loop: asyncio.AbstractEventLoop
    outbox: asyncio.Queue
    peer: str = ""
    received_samples: int = 0  # accepted by the network side (written there)
    consumed_samples: int = 0  # pushed into the session by the worker (written there)
    cancel_requested: threading.Event = field(default_factory=threading.Event)
    gone: threading.Event = field(default_factory=threading.Event)  # connection over: skip its queued audio
    opened_at: float = field(default_factory=time.monotonic)
    # Filled by the network side before it sends `close` (for the session's log line).
    end: str = "disconnect"
    errors: int = 0
    overflows: int = 0
    dropped_samples: int = 0  # appends refused with input_overflow (nothing else is dropped)
    # The outbox is bounded: past max_outbox items waiting for the client, on_overfull runs once (on the loop).
    max_outbox: int = 0
    on_overfull: Callable[[], None] | None = None
    _overfull: bool = False

    @property
    def queued_samples(self) -> int:
        return self.received_samples - self.consumed_samples

    def _put(self, item) -> None:
        self.outbox.put_nowait(item)
        if self.max_outbox and not self._overfull and self.outbox.qsize() > self.max_outbox:
            self._overfull = True
            if self.on_overfull is not None:
                self.on_overfull()

    def emit(self, item) -> None:
        """An output (voicechat.server.messages) for the connection, from any thread."""
        with contextlib.suppress(RuntimeError):  # the event loop is closed: the connection is long gone
            self.loop.call_soon_threadsafe(self._put, item)


@dataclass
class _Active:
    channel: Channel
    session: Any
    compute_ms: list = field(default_factory=list)
    lag_ms: list = field(default_factory=list)
    discarded_samples: int = 0
    stages_seen: int = 0
    profile: Any = None  # the session's Profile; attached to the session only on sampled frames
    runs_tools: bool = False  # --mcp: the session's tools are the runner's, and the server answers its calls


class ModelWorker:
    """Start with `start()`, then `wait_ready()`; `load_model` runs on the worker thread."""

    def __init__(
        self,
        load_model: Callable[[], Any],
        *,
        metrics=None,
        stage_metrics_every: int = 10,
        warmup_seconds: float = 0.0,
        prompt_states=None,
        tool_runner=None,
    ):
        self._load_model = load_model
        # voicechat.server.prompt_cache.PromptStates: sessions start from prompt states (None: each prefills).
        self.prompt_states = prompt_states
        # `voicechat serve --mcp CMD`: the server runs the tools (voicechat.tools.runners); a session
        # whose client gives no tools gets the runner's.
        self.tool_runner = tool_runner
        self.metrics = metrics
        # Stage timing forces one synchronisation per stage; doing it on every Kth frame keeps the
        # per-stage histograms while costing the other frames nothing (0 = never).
        if isinstance(stage_metrics_every, bool) or not isinstance(stage_metrics_every, int) or stage_metrics_every < 0:
            raise ValueError(f"stage_metrics_every must be an int >= 0, got {stage_metrics_every!r}")
        self.stage_metrics_every = stage_metrics_every
        self.warmup_seconds = warmup_seconds
        self._commands: queue.Queue[tuple[Channel | None, Command]] = queue.Queue()
        self._thread = threading.Thread(target=self._run, name="voicechat-mlx-worker", daemon=True)
        self.ready = threading.Event()
        self.load_error: BaseException | None = None
        self.info: dict = {}
        self.model = None

    # -- network side

    def start(self) -> ModelWorker:
        self._thread.start()
        return self

    def wait_ready(self, timeout: float | None = None) -> dict:
        if not self.ready.wait(timeout):
            raise TimeoutError(f"the model did not load within {timeout} s")
        if self.load_error is not None:
            raise self.load_error
        return self.info

    def is_worker_thread(self) -> bool:
        return threading.current_thread() is self._thread

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def queue_depth(self) -> int:
        return self._commands.qsize()

    def submit(self, channel: Channel | None, command: Command) -> None:
        """`command` (voicechat.server.messages) for the session of `channel`, in order."""
        self._commands.put((channel, command))
        if self.metrics is not None:
            self.metrics.queue_depth.set(self._commands.qsize())

    def stop(self, timeout: float = 10.0) -> None:
        self._commands.put((None, Stop()))
        self._thread.join(timeout)

    # -- worker thread

    def _run(self) -> None:
        try:
            self._serve()
        finally:
            # MLX streams belong to the thread that made them; a thread that ends with live streams
            # aborts the interpreter at exit ("terminate called without an active exception").
            self.model = None
            gc.collect()
            import mlx.core as mx

            mx.synchronize()
            mx.clear_streams()

    def _serve(self) -> None:
        try:
            model = self.model = self._load_model()
            cfg = model.config
            self.info = {
                "input_sample_rate": int(cfg.input_sample_rate),
                "output_sample_rate": int(cfg.output_sample_rate),
                "frame_samples": int(cfg.frame_samples),
                "frame_ms": float(cfg.frame_duration * 1000.0),
                "output_frame_samples": int(model.tts_model.audio_codec.samples_per_frame),
                "num_codebooks": int(cfg.codec_config.num_quantizers),
                "silence_codes": [int(c) for c in np.asarray(model.tts_model.codec_silence_tokens).reshape(-1)],
            }
            if self.warmup_seconds > 0:
                self._warmup(model)
            if self.prompt_states is not None:
                self.prompt_states.start(model)
        except BaseException as e:  # reported to the starter by wait_ready
            self.load_error = e
            self.ready.set()
            return
        self.ready.set()
        active: _Active | None = None
        while True:
            ch, cmd = self._commands.get()
            if self.metrics is not None:
                self.metrics.queue_depth.set(self._commands.qsize())
            if isinstance(cmd, Stop):
                if active is not None:
                    self._close(active)
                return
            try:
                active = self._handle(ch, cmd, active)
            except Exception:  # never let one session kill the worker
                # The traceback goes to the log; the client gets a code and a message without internals.
                log.exception(
                    "worker command %s of session %s failed",
                    type(cmd).__name__,
                    ch.session_id if ch is not None else "-",
                )
                if ch is not None:
                    ch.emit(
                        SessionError(
                            "internal_error",
                            "the server failed while computing this session; "
                            "the session was ended. Start a new session",
                        )
                    )
                    ch.emit(Finished("internal_error"))
                if active is not None and (ch is None or active.channel is ch):
                    active.session = None

    def _warmup(self, model) -> None:
        n = int(round(self.warmup_seconds * model.config.input_sample_rate))
        s = model.create_streaming_session(profile=self.stage_metrics_every > 0)
        s.push_audio(np.zeros(n, np.float32))
        s.flush()
        gc.collect()

    def _handle(self, ch: Channel | None, cmd: Command, active: _Active | None) -> _Active | None:
        if isinstance(cmd, OpenSession):
            if active is not None:  # the network side's slot makes this unreachable; be loud if not
                self._close(active)
                active = None
            return self._open(ch, cmd.params)
        if isinstance(cmd, Sync):  # a marker: every command before it is done (the GA dialect's commit)
            ch.emit(Synced(cmd.tag))
            return active
        if active is None or active.channel is not ch:
            # Commands of a connection that never opened a session (or was already closed).
            if ch is None:
                return active
            match cmd:
                case AppendAudio(pcm=pcm):
                    ch.consumed_samples += int(pcm.size)
                case Close():
                    ch.emit(Closed(None))
                case Commit():
                    ch.emit(Committed())
                    ch.emit(Finished("done"))
                case Cancel():
                    ch.emit(Finished("cancelled"))
            return active
        match cmd:
            case AppendAudio(pcm=pcm):
                self._append(active, pcm)
            case Commit(pad_partial=pad):
                ch.emit(Committed())
                self._finish(active, lambda s: s.flush(pad_partial=bool(pad)), "done")
            case Cancel():
                self._finish(active, lambda s: s.cancel(), "cancelled")
            case Close():
                self._close(active)
                return None
            case SubmitToolResult(call_id=call_id, output=output, by_server=by_server):
                s = active.session
                if s is None or s.closed:
                    return active
                try:
                    s.submit_tool_result(call_id, output)
                except ValueError as e:  # unknown or already answered call_id: nothing changed
                    ch.emit(SessionError("invalid_tool_result", str(e)))
                    return active
                if by_server:  # the client may be shown what the server answered (mlx-vlm's dialect: the page)
                    ch.emit(ToolOutputSent(s.frame_index, call_id, output))
        return active

    def _open(self, ch: Channel, p) -> _Active | None:

        tools = p.tools
        runs_tools = not tools and self.tool_runner is not None  # a client with tools answers its own calls
        if runs_tools:
            tools = self.tool_runner.tools()
        tools = tools or None
        limit = p.max_prompt_tokens
        if limit is not None:
            # Counted before any work: the prefill costs about one frame's language + TTS step per token.
            # The client's own prompt; the tools' block is bounded by the tool rules (at most 5, docs/tools.md)
            # and the message size.
            n = _prompt_tokens(self.model, p.system_prompt)
            if n > limit:
                ch.emit(
                    SessionRefused(
                        "invalid_session",
                        f"session.system_prompt is {n} tokens; at most {limit} are accepted "
                        "(--max-prompt-tokens). Send a shorter prompt",
                    )
                )
                return None
        try:
            prompt = {"system_prompt": p.system_prompt, "seed": p.seed, "tools": tools}
            if self.prompt_states is not None:  # a cached state: no prefill
                prompt = {
                    "prompt_state": self.prompt_states.state_for(
                        self.model, p.system_prompt, p.seed, tools=tools, should_stop=ch.gone.is_set
                    )
                }
            session = self.model.create_streaming_session(
                max_streaming_seconds=p.max_streaming_seconds,
                profile=self.stage_metrics_every > 0,
                should_stop=ch.gone.is_set,
                **prompt,
            )
        except PrefillStoppedError:
            # The client left during the prefill: nothing to answer; its Close command follows.
            log.info("session %s: prefill stopped, the client left", ch.session_id)
            return None
        except (VoiceChatError, ValueError, TypeError) as e:
            # e.g. a system prompt longer than the context: the client may send another session.update.
            ch.emit(SessionRefused("session_initialization_failed", str(e)[:300]))
            return None
        ch.emit(SessionOpened(dict(self.info)))
        return _Active(ch, session, profile=session.profile, runs_tools=runs_tools)

    def _append(self, a: _Active, pcm: np.ndarray) -> None:
        ch, s = a.channel, a.session
        if s is None or s.closed or ch.gone.is_set() or ch.cancel_requested.is_set():
            a.discarded_samples += int(pcm.size)
            ch.consumed_samples += int(pcm.size)
            return
        given_before = s.frame_index * s.frame_samples + s.pending_samples  # samples the session had
        frames = s.push_frames(pcm)  # checked and buffered; the session cuts the frames
        counted = 0  # samples of `pcm` counted as consumed

        def consumed_upto(k: int) -> None:
            nonlocal counted
            ch.consumed_samples += k - counted
            counted = k

        while True:
            if ch.gone.is_set() or ch.cancel_requested.is_set():
                a.discarded_samples += int(pcm.size - counted)
                consumed_upto(int(pcm.size))
                return
            if a.profile is not None:  # the next step computes frame `s.frame_index`
                s.profile = a.profile if s.frame_index % self.stage_metrics_every == 0 else None
            t0 = time.perf_counter()
            try:
                events = next(frames, None)  # one frame, so each frame's events leave as soon as it is done
            except ContextLimitError as e:
                consumed_upto(int(pcm.size))
                self._send_events(a, e.events, (time.perf_counter() - t0) * 1000.0)
                ch.emit(SessionError("context_limit", str(e)))
                ch.emit(Finished("context_limit"))
                return
            if events is None:
                consumed_upto(int(pcm.size))  # the rest waits in the session for its frame
                return
            consumed_upto(min(int(pcm.size), s.frame_index * s.frame_samples - given_before))
            self._send_events(a, events, (time.perf_counter() - t0) * 1000.0)

    def _send_events(self, a: _Active, events, compute_ms: float) -> None:
        if not events:
            return
        ch = a.channel
        lag = 0.0
        for e in events:
            if isinstance(e, Audio):
                done = (e.frame_index + 1) * a.session.frame_samples
                lag = max(0, ch.received_samples - done) * 1000.0 / self.info["input_sample_rate"]
                a.compute_ms.append(compute_ms)
                a.lag_ms.append(lag)
                self._observe(a, compute_ms, lag)
            elif isinstance(e, ToolCall) and a.runs_tools:
                self._run_tool(ch, e)
        # The session's own events; each dialect renders them (mlx-vlm: protocol.event_payload).
        ch.emit(FrameEvents(tuple(events), compute_ms, lag))

    def _run_tool(self, ch: Channel, call) -> None:
        """`--mcp`: run the call on its own thread (the model keeps computing frames meanwhile) and
        hand the result back through the queue, as a client's result would come."""

        def run():
            try:
                output = self.tool_runner.call(call.name, call.arguments, timeout=30.0)
            except Exception as e:  # an unknown tool name: the model gets the error as its result
                output = json.dumps({"error": f"{type(e).__name__}: {e}"})
            self.submit(ch, SubmitToolResult(call.call_id, output, by_server=True))

        threading.Thread(target=run, name="voicechat-tool-call", daemon=True).start()

    def _observe(self, a: _Active, compute_ms: float, lag_ms: float) -> None:
        m = self.metrics
        if m is None:
            return
        m.frames.inc()
        m.frame_seconds.observe(compute_ms / 1000.0)
        m.lag_seconds.observe(lag_ms / 1000.0)
        m.lag_current.set(lag_ms / 1000.0)
        prof = a.profile
        if prof is not None:
            for t in prof.frames[a.stages_seen :]:
                for f in STAGE_FIELDS:
                    m.stage_seconds.labels(stage=f[:-3]).observe(getattr(t, f) / 1000.0)
            a.stages_seen = len(prof.frames)

    def _finish(self, a: _Active, end, reason: str) -> None:
        if a.session is None or a.session.closed:
            return
        t0 = time.perf_counter()
        if a.profile is not None:
            s = a.session
            s.profile = a.profile if s.frame_index % self.stage_metrics_every == 0 else None
        events = end(a.session)
        self._send_events(a, events, (time.perf_counter() - t0) * 1000.0)
        a.channel.emit(Finished(reason))

    def _close(self, a: _Active) -> None:
        s = a.session
        if s is not None and not s.closed:
            s.cancel()
        ch = a.channel
        frames = s.frame_index if s is not None else 0
        stats = _stats(a.compute_ms)
        line = {
            "event": "session_end",
            "session_id": ch.session_id,
            "peer": ch.peer,
            "end": ch.end,
            "duration_s": round(time.monotonic() - ch.opened_at, 3),
            "audio_in_s": round(ch.received_samples / self.info["input_sample_rate"], 3),
            "frames": frames,
            "compute_ms_mean": stats["mean"],
            "compute_ms_p95": stats["p95"],
            "compute_ms_max": stats["max"],
            "lag_ms_max": round(max(a.lag_ms), 3) if a.lag_ms else 0.0,
            "discarded_samples": a.discarded_samples,
            "errors": ch.errors,
            "input_overflows": ch.overflows,
            "dropped_samples": ch.dropped_samples,
        }
        if a.profile is not None and a.profile.frames:
            summ = a.profile.summary()
            line["stage_ms_frames"] = len(a.profile.frames)
            line["stage_ms_mean"] = {
                k: round(summ[k]["mean_ms"], 3) for k in ("perception", "rnnt", "language", "tts", "codec")
            }
        log.info(json.dumps(line, sort_keys=False))
        a.session = None
        ch.emit(Closed(line))


def _prompt_tokens(model, prompt) -> int:
    """Positions the prompt's prefill takes (voicechat.streaming.timeline.Timeline.prompt_ids: bos + tokens + eos)."""
    text = model.config.default_system_prompt if prompt is None else prompt
    if not text or not text.strip():
        return 0
    return len(model.tokenizer.encode(text)) + 2


def _stats(values) -> dict:

    if not values:
        return {"mean": 0.0, "p95": 0.0, "max": 0.0}
    return {
        "mean": round(sum(values) / len(values), 3),
        "p95": round(percentile(values, 0.95), 3),
        "max": round(max(values), 3),
    }


__all__ = ["ModelWorker", "Channel"]
