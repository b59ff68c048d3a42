"""The MLX worker: one thread that owns the model and its sessions (`voicechat serve --max-sessions N`).

The network side (asyncio) never touches MLX. It hands commands (voicechat.server.messages:
OpenSession, AppendAudio, Commit, Cancel, Sync, SubmitToolResult, Close) to this thread through a
queue whose audio is bounded by admission control (`Channel.queued_samples` and
`max_queued_appends`, checked by the connection before it submits an AppendAudio); control
commands are at most three per connection. Outputs (SessionOpened, FrameEvents, Finished, ...) go
back to the connection's asyncio queue with `loop.call_soon_threadsafe`; the session's events travel
as they are, and each dialect renders them.

The sessions live in one `SessionBatch(max_sessions=N)` (voicechat.streaming.batch), one per
connection. The loop (docs/server.md, "Many sessions"): take every queued command (blocking only
while no session has a frame ready), apply each connection's commands in its own order, then run
one tick, `batch.step()`: the next frame of every session that has one buffered, as one pass per
stage, each session's events to its own connection. A commit, a Sync and a tool result wait
behind their own session's buffered frames (so they land where they would in a session of one);
nothing waits for another connection. A prompt's prefill pauses between its pieces of 32
positions to run the other sessions' ready frames (as many ticks as the piece took frames of
time). An exception ends only the session it belongs to; one that escapes the engine's shared
pass ends the sessions of that tick (logged).
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import json
import logging
import math
import queue
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from voicechat.errors import BatchFullError, ContextLimitError, PrefillStoppedError, VoiceChatError
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
# Commands that wait until their session's buffered frames are computed (they act after that audio).
AFTER_FRAMES = (Commit, Sync, SubmitToolResult)
INTERNAL_ERROR = "the server failed while computing this session; the session was ended. Start a new session"


@dataclass(eq=False)  # identity: the worker keys its sessions by channel
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
    appended: int = 0  # samples of this connection's appends (given to the session or discarded)
    counted: int = 0  # of those, counted in channel.consumed_samples


class ModelWorker:
    """Start with `start()`, then `wait_ready()`; `load_model` runs on the worker thread.

    `max_sessions`: slots of the session batch. `session_seconds` / `prompt_tokens`: the session
    length and prompt limits the startup memory figure counts (voicechat.server.memory);
    `memory_check`: refuse to start (`MemoryBudgetError`) when more than one slot at the limit and
    the model do not fit in the machine's memory (one slot only warns, as the server always ran)."""

    def __init__(
        self,
        load_model: Callable[[], Any],
        *,
        metrics=None,
        stage_metrics_every: int = 10,
        warmup_seconds: float = 0.0,
        prompt_states=None,
        tool_runner=None,
        max_sessions: int = 1,
        session_seconds: float | None = None,
        prompt_tokens: int | None = None,
        memory_check: bool = True,
    ):
        from voicechat.server.limits import ServerLimits

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
        if isinstance(max_sessions, bool) or not isinstance(max_sessions, int) or max_sessions < 1:
            raise ValueError(f"max_sessions must be an int >= 1, got {max_sessions!r}")
        self.stage_metrics_every = stage_metrics_every
        self.warmup_seconds = warmup_seconds
        self.max_sessions = max_sessions
        d = ServerLimits()
        self.session_seconds = float(d.max_session_audio_seconds if session_seconds is None else session_seconds)
        self.prompt_tokens = int(d.max_prompt_tokens if prompt_tokens is None else prompt_tokens)
        self.memory_check = memory_check
        self._commands: queue.Queue[tuple[Channel | None, Command]] = queue.Queue()
        self._thread = threading.Thread(target=self._run, name="voicechat-mlx-worker", daemon=True)
        self.ready = threading.Event()
        self.load_error: BaseException | None = None
        self.info: dict = {}
        self.memory: dict = {}  # voicechat.server.memory.MemoryPlan.as_dict() of the loaded model
        self.model = None
        # Worker-thread state: the batch, one entry per connection with a session, each connection's
        # commands not yet applied (in its order), the connection whose prompt is being prefilled.
        self._batch = None
        self._active: dict[Channel, _Active] = {}
        self._waiting: dict[Channel, deque] = {}
        self._prefilling: Channel | None = None
        self._pause_mark = 0.0  # when the prefill's last pause ended (its next piece started)
        self._stopping = False

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
            self._batch = None
            self._active.clear()
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
            self._check_memory(model)
            self._batch = model.create_session_batch(self.max_sessions)
            if self.warmup_seconds > 0:
                self._warmup(model)
            if self.prompt_states is not None:
                self.prompt_states.start(model)
        except BaseException as e:  # reported to the starter by wait_ready
            self.load_error = e
            self.ready.set()
            return
        if self.metrics is not None:
            self.metrics.sessions_max.set(self.max_sessions)
            self.metrics.slot_bytes.set(self.memory.get("slot_bytes", 0))
        self.ready.set()
        try:
            while not self._stopping:
                try:
                    self._take(block=not self._any_ready())
                    self._advance_all()
                    if self._stopping:
                        break
                    self._tick()
                    self._advance_all()  # commands that waited for the frames this tick computed
                except Exception:  # the loop's own machinery (each command and tick isolates its errors)
                    log.exception("the worker loop failed; ending every session (the server goes on)")
                    for ch in list(self._active):
                        self._fail(ch)
        finally:
            for a in list(self._active.values()):
                with contextlib.suppress(Exception):
                    self._close(a)
            self._active.clear()

    def _check_memory(self, model) -> None:
        from voicechat.server import memory

        prompt = max(self.prompt_tokens, _prompt_tokens(model, None))
        plan = memory.plan(
            model, slots=self.max_sessions, session_seconds=self.session_seconds, prompt_positions=prompt
        )
        self.memory = plan.as_dict()
        if plan.fits:
            log.info("memory: %s", plan.describe())
        elif self.max_sessions > 1 and self.memory_check:
            raise memory.MemoryBudgetError(plan.refusal())
        else:
            log.warning("memory: %s: more than this machine has (sessions that long may not fit)", plan.describe())

    def _warmup(self, model) -> None:
        n = int(round(self.warmup_seconds * model.config.input_sample_rate))
        b = self._batch
        sessions = [b.open(profile=self.stage_metrics_every > 0)]
        if self.max_sessions > 1:  # the language stage's batched step too (no second prefill)
            sessions.append(b.open(system_prompt=""))
        b.push({s: np.zeros(n, np.float32) for s in sessions})
        for s in sessions:
            s.flush()
        gc.collect()

    # -- the loop's parts

    def _take(self, block: bool) -> None:
        """Every queued command into its connection's waiting line (waiting for one when `block`)."""
        items = [self._commands.get()] if block else []
        while True:
            try:
                items.append(self._commands.get_nowait())
            except queue.Empty:
                break
        if self.metrics is not None:
            self.metrics.queue_depth.set(self._commands.qsize())
        for ch, cmd in items:
            if isinstance(cmd, Stop):
                self._stopping = True
            elif ch is not None:
                self._waiting.setdefault(ch, deque()).append(cmd)

    def _advance_all(self) -> None:
        progress = True
        while progress:
            progress = False
            for ch in list(self._waiting):
                progress = self._advance(ch) or progress

    def _advance(self, ch: Channel) -> bool:
        """Apply `ch`'s waiting commands in order while the first can go; -> any applied."""
        line = self._waiting.get(ch)
        if line is None:
            return False
        applied = False
        while line:
            cmd = line[0]
            if ch is self._prefilling:  # its session does not exist until the prefill returns
                break
            if self._prefilling is not None and isinstance(cmd, OpenSession):  # one prefill at a time
                break
            if isinstance(cmd, AFTER_FRAMES) and (a := self._active.get(ch)) is not None and self._ready(a):
                break  # after this session's buffered frames (the next ticks)
            line.popleft()
            applied = True
            self._apply(ch, cmd)
        if not line and self._waiting.get(ch) is line:
            del self._waiting[ch]
        return applied

    def _ready(self, a: _Active) -> bool:
        """The session takes part in the next tick: open, its connection live, a complete frame buffered."""
        s, ch = a.session, a.channel
        return (
            s is not None
            and not s.closed
            and not ch.gone.is_set()
            and not ch.cancel_requested.is_set()
            and s.pending_samples >= s.frame_samples
        )

    def _any_ready(self) -> bool:
        return any(self._ready(a) for a in self._active.values())

    def _apply(self, ch: Channel, cmd: Command) -> None:
        try:
            self._handle(ch, cmd)
        except Exception:  # never let one session kill the worker, nor touch another session
            # The traceback goes to the log; the client gets a code and a message without internals.
            log.exception("worker command %s of session %s failed", type(cmd).__name__, ch.session_id)
            self._fail(ch)

    def _fail(self, ch: Channel) -> None:
        """End `ch`'s session with internal_error (its slot freed); the others are not touched."""
        ch.emit(SessionError("internal_error", INTERNAL_ERROR))
        ch.emit(Finished("internal_error"))
        a = self._active.get(ch)
        if a is None:
            return
        s, a.session = a.session, None
        if s is not None and not s.closed:
            try:
                a.discarded_samples += s.pending_samples
                s.cancel()  # frees its batch slot
            except Exception:
                log.exception("session %s: could not cancel the failed session", ch.session_id)
        self._sync_consumed(a)

    def _handle(self, ch: Channel, cmd: Command) -> None:
        if isinstance(cmd, OpenSession):
            old = self._active.pop(ch, None)
            if old is not None:  # one session per connection: the dialects never ask twice; be loud if so
                log.error("session %s: a second OpenSession; the first session is closed", ch.session_id)
                self._close(old)
            a = self._open(ch, cmd.params)
            if a is not None:
                self._active[ch] = a
            return
        if isinstance(cmd, Sync):  # a marker: every command before it is done (the GA dialect's commit)
            ch.emit(Synced(cmd.tag))
            return
        a = self._active.get(ch)
        if a is None:
            # Commands of a connection that never opened a session (or was already closed).
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
            return
        match cmd:
            case AppendAudio(pcm=pcm):
                self._append(a, pcm)
            case Commit(pad_partial=pad):
                ch.emit(Committed())
                if ch.gone.is_set():  # nobody reads the last frames: their audio is not computed
                    self._finish(a, lambda s: s.cancel(), "done", drops=True)
                else:
                    self._finish(a, lambda s: s.flush(pad_partial=bool(pad)), "done")
            case Cancel():
                self._finish(a, lambda s: s.cancel(), "cancelled", drops=True)
            case Close():
                del self._active[ch]
                self._close(a)
            case SubmitToolResult(call_id=call_id, output=output, by_server=by_server):
                s = a.session
                if s is None or s.closed:
                    return
                try:
                    s.submit_tool_result(call_id, output)
                except ValueError as e:  # unknown or already answered call_id: nothing changed
                    ch.emit(SessionError("invalid_tool_result", str(e)))
                    return
                if by_server:  # the client may be shown what the server answered (mlx-vlm's dialect: the page)
                    ch.emit(ToolOutputSent(s.frame_index, call_id, output))

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

        def should_stop() -> bool:  # between two pieces of the prefill
            return self._prefill_pause(ch)

        self._prefilling = ch
        self._pause_mark = time.perf_counter()
        try:
            prompt = {"system_prompt": p.system_prompt, "seed": p.seed, "tools": tools}
            if self.prompt_states is not None:  # a cached state: no prefill
                prompt = {
                    "prompt_state": self.prompt_states.state_for(
                        self.model, p.system_prompt, p.seed, tools=tools, should_stop=should_stop
                    )
                }
            session = self._batch.open(
                max_streaming_seconds=p.max_streaming_seconds,
                profile=self.stage_metrics_every > 0,
                should_stop=should_stop,
                **prompt,
            )
        except PrefillStoppedError:
            # The client left during the prefill (or the server stops): nothing to answer; its Close follows.
            log.info("session %s: prefill stopped, the client left", ch.session_id)
            return None
        except BatchFullError as e:  # the network side's slots make this unreachable; be loud if not
            log.error("session %s: %s", ch.session_id, e)
            ch.emit(SessionRefused("session_initialization_failed", "every session slot of this server is taken"))
            return None
        except (VoiceChatError, ValueError, TypeError) as e:
            # e.g. a system prompt longer than the context: the client may send another session.update.
            ch.emit(SessionRefused("session_initialization_failed", str(e)[:300]))
            return None
        finally:
            self._prefilling = None
        ch.emit(SessionOpened(dict(self.info)))
        return _Active(ch, session, profile=session.profile, runs_tools=runs_tools)

    def _prefill_pause(self, ch: Channel) -> bool:
        """Between two pieces of `ch`'s prefill (32 prompt positions): the other connections' queued
        commands are applied and ticks run for their ready frames, as many as frames of audio the
        clients sent in real time while the piece ran (its time / the frame duration, at least one,
        fewer when fewer are ready): the others keep pace while the prompt is prefilled, and a pause
        is bounded (a deeper backlog is computed once the new session has joined the ticks). ->
        stop the prefill (the client left, or the server stops)."""
        if ch.gone.is_set() or self._stopping:
            return True
        try:
            piece = time.perf_counter() - self._pause_mark
            budget = max(1, math.ceil(piece * 1000.0 / self.info["frame_ms"]))
            self._take(block=False)
            self._advance_all()
            for _ in range(budget):
                if self._stopping or not self._tick():
                    break
                self._advance_all()
        except Exception:  # the pause's own parts isolate their errors; this is a last resort
            log.exception("session %s: the other sessions' frames between prefill pieces failed", ch.session_id)
        self._pause_mark = time.perf_counter()
        return ch.gone.is_set() or self._stopping

    def _append(self, a: _Active, pcm: np.ndarray) -> None:
        ch, s = a.channel, a.session
        a.appended += int(pcm.size)
        if s is None or s.closed or ch.gone.is_set() or ch.cancel_requested.is_set():
            a.discarded_samples += int(pcm.size)
        else:
            self._batch.append({s: pcm})  # checked and buffered; the ticks compute its frames
        self._sync_consumed(a)

    def _sync_consumed(self, a: _Active) -> None:
        """The connection's consumed samples: its appends, less the complete frames its session has
        buffered but not computed (a partial frame's samples count as consumed, as they always have).
        Never decreases."""
        s = a.session
        waiting = 0
        if s is not None and not s.closed:
            waiting = (s.pending_samples // s.frame_samples) * s.frame_samples
        target = a.appended - waiting
        if target > a.counted:
            a.channel.consumed_samples += target - a.counted
            a.counted = target

    def _tick(self) -> bool:
        """One tick: the next frame of every ready session, as one pass (`SessionBatch.step`), each
        session's events to its connection. -> whether any session was ready."""
        ready = sorted((a for a in self._active.values() if self._ready(a)), key=lambda a: a.session.slot)
        if not ready:
            return False
        every = self.stage_metrics_every
        # Stage timing synchronises every stage of the tick: it is sampled by the first session's frame
        # index (every Kth frame of a session alone, as before).
        timed = every > 0 and ready[0].session.frame_index % every == 0
        for a in ready:
            if a.profile is not None:
                a.session.profile = a.profile if timed else None
        failed: dict = {}
        limited: list = []
        t0 = time.perf_counter()
        try:
            results = self._batch.step([a.session for a in ready], on_error=failed.__setitem__)
        except ContextLimitError as e:
            results = e.events if isinstance(e.events, dict) else {}
            limited = list(e.sessions)
        except Exception:
            # The shared pass failed: which session's data caused it cannot be told, and every session of
            # the tick was advanced in part (their caches no longer agree), so all of them end.
            log.exception(
                "a tick of %d session(s) failed in the frame engine's shared pass; ending all of them: %s",
                len(ready),
                ", ".join(a.channel.session_id for a in ready),
            )
            for a in ready:
                self._fail(a.channel)
            return True
        tick_ms = (time.perf_counter() - t0) * 1000.0
        self._observe_tick(tick_ms, len(ready) - len(limited))
        observed_stages = False
        for a in ready:
            s = a.session
            ch = a.channel
            err = failed.get(s)
            if err is not None:
                log.error(
                    "session %s: its frame failed after the tick's shared pass; it alone is ended",
                    ch.session_id,
                    exc_info=(type(err), err, err.__traceback__),
                )
                self._fail(ch)
                continue
            try:
                if a.profile is not None:
                    observed_stages = self._observe_stages(a, count=not observed_stages) or observed_stages
                events = results.get(s)
                if events:
                    self._send_events(a, events, tick_ms)
                if s in limited:
                    ch.emit(
                        SessionError(
                            "context_limit",
                            f"max_streaming_seconds reached ({s.max_frames} frames of "
                            f"{self.info['frame_ms']:g} ms); the session is closed",
                        )
                    )
                    ch.emit(Finished("context_limit"))
                self._sync_consumed(a)
            except Exception:
                log.exception("session %s: its frame's events could not be sent; it alone is ended", ch.session_id)
                self._fail(ch)
        return True

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
                self._observe(compute_ms, lag)
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

    def _observe(self, compute_ms: float, lag_ms: float) -> None:
        m = self.metrics
        if m is None:
            return
        m.frames.inc()
        m.frame_seconds.observe(compute_ms / 1000.0)
        m.lag_seconds.observe(lag_ms / 1000.0)
        m.lag_current.set(lag_ms / 1000.0)

    def _observe_stages(self, a: _Active, count: bool = True) -> bool:
        """The stage times the session's profile gained since last seen (`count`: into the histograms;
        a tick's sessions share one set of stage times, counted once). -> whether any were new."""
        prof = a.profile
        new = prof.frames[a.stages_seen :]
        a.stages_seen = len(prof.frames)
        m = self.metrics
        if count and m is not None:
            for t in new:
                for f in STAGE_FIELDS:
                    m.stage_seconds.labels(stage=f[:-3]).observe(getattr(t, f) / 1000.0)
        return bool(new)

    def _observe_tick(self, tick_ms: float, frames: int) -> None:
        m = self.metrics
        if m is None or frames <= 0:
            return
        m.tick_seconds.observe(tick_ms / 1000.0)
        m.tick_frames.observe(frames)
        if tick_ms > self.info["frame_ms"]:  # each frame of a tick longer than a frame missed its deadline
            m.frames_missed.inc(frames)

    def _finish(self, a: _Active, end, reason: str, drops: bool = False) -> None:
        """`end(session)` (flush or cancel; `drops`: its buffered audio is dropped), its events, Finished."""
        if a.session is None or a.session.closed:
            return
        t0 = time.perf_counter()
        s = a.session
        if a.profile is not None:
            s.profile = a.profile if s.frame_index % self.stage_metrics_every == 0 else None
        if drops:
            a.discarded_samples += s.pending_samples
        events = end(s)
        if a.profile is not None:
            self._observe_stages(a)
        self._send_events(a, events, (time.perf_counter() - t0) * 1000.0)
        self._sync_consumed(a)
        a.channel.emit(Finished(reason))

    def _close(self, a: _Active) -> None:
        s = a.session
        if s is not None and not s.closed:
            a.discarded_samples += s.pending_samples
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
        self._sync_consumed(a)
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
