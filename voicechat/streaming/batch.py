"""Many conversations on one loaded model: a batch of sessions whose frames are computed together.

`model.create_session_batch(max_sessions=N)` gives a `SessionBatch` with N slots. `batch.open(...)`
takes the keyword arguments of `create_streaming_session` and returns a `BatchedSession` (a
`VoiceChatStreamingSession`: the same events, errors, `states()`, `profile`). Each tick
(`batch.step()`) computes the next frame of every session that has one buffered, as one pass of
the frame engine through each stage (`FrameEngine.step_batch`); `batch.push({session: samples})`
buffers and runs ticks until no session has a complete frame.

Slots, not copies: each session's caches are its own arrays, made when it opens and dropped when
it closes; a session joining or leaving touches no other session's state, and a tick reads each
session's caches where they are (no stacking of histories). What the sessions share in a tick is
the weights: the language stage's products read each weight once for every session's row.

Each session computes exactly what it computes alone (docs/voicechat.md, "Many sessions in one
process"): a session run alone goes through the same engine (`step` is `step_batch` of one).
"""

from __future__ import annotations

import threading
from collections.abc import Iterator, Mapping

import numpy as np

from voicechat.errors import BatchFullError, ContextLimitError, SessionClosedError, WrongThreadError
from voicechat.streaming.engine import FrameEngine
from voicechat.streaming.session import VoiceChatStreamingSession


class BatchedSession(VoiceChatStreamingSession):
    """A session in a `SessionBatch` slot (create with `batch.open(...)`). Its frames run in the
    batch's ticks; `push_audio(samples)` is `batch.push({session: samples})[session]`."""

    def __init__(self, batch: SessionBatch, slot: int, **kwargs):
        self.batch = batch
        self.slot = slot
        super().__init__(batch.model, **kwargs)
        self._engine = batch.engine  # one engine (one runtime) for the batch

    def push_audio(self, samples, sample_rate: int = 16000) -> list:
        self._check_open()
        try:
            return self.batch.push({self: samples}, sample_rate)[self]
        except ContextLimitError as err:
            if isinstance(err.events, dict):
                err.events = err.events.get(self, [])
            raise

    def push_frames(self, samples, sample_rate: int = 16000) -> Iterator[list]:
        self._check_open()
        self.batch.append({self: samples}, sample_rate)
        return self._frames()

    def _frames(self, *, at_limit_raise: bool = True) -> Iterator[list]:
        # This session's buffered frames, each a tick of this session alone.
        while self._has_frame():
            if self._at_limit():
                if not at_limit_raise:
                    return
                self.batch._release(self)
                self._close_at_limit()
            yield self._frame(self._pop_frame())

    def flush(self, pad_partial: bool = True) -> list:
        events = super().flush(pad_partial)
        self.batch._release(self)
        return events

    def cancel(self) -> list:
        events = super().cancel()
        self.batch._release(self)
        return events


class SessionBatch:
    """Up to `max_sessions` concurrent conversations of one model, their frames computed together.

    `open(**kwargs)` (the keyword arguments of `create_streaming_session`) -> a session in a free
    slot, or `BatchFullError` with every slot taken; `push({session: samples})` -> {session: events};
    `append` / `step` split `push` into buffering and one tick (a server ticks as frames arrive);
    `sessions` (the open ones, in slot order), `max_sessions`. Bound to the thread that created it."""

    def __init__(self, model, max_sessions: int):
        if isinstance(max_sessions, bool) or not isinstance(max_sessions, int) or max_sessions < 1:
            raise ValueError(f"max_sessions must be a positive int, got {max_sessions!r}")
        self.model = model
        self.max_sessions = max_sessions
        self.engine = FrameEngine(model)
        self._slots: list[BatchedSession | None] = [None] * max_sessions
        self._owner = threading.get_ident()

    @property
    def sessions(self) -> list[BatchedSession]:
        """The open sessions, in slot order."""
        return [s for s in self._slots if s is not None]

    @property
    def free_slots(self) -> int:
        return sum(s is None for s in self._slots)

    def open(self, **kwargs) -> BatchedSession:
        """A new session in a free slot (its prompt prefilled now): `BatchFullError` when every slot is
        taken; the arguments' errors as `create_streaming_session` raises them. Nothing changes on error."""
        self._check_thread()
        slot = next((i for i, s in enumerate(self._slots) if s is None), None)
        if slot is None:
            raise BatchFullError(
                f"all {self.max_sessions} slots of this batch are taken; close a session (flush() or "
                "cancel()) or create the batch with a larger max_sessions"
            )
        session = BatchedSession(self, slot, **kwargs)
        self._slots[slot] = session
        return session

    def append(self, chunks: Mapping[BatchedSession, object], sample_rate: int = 16000) -> None:
        """Buffer each session's chunk without computing. Every chunk is checked first: one bad chunk
        (or a session that is closed or not this batch's) raises and no session changes."""
        self._check_thread()
        if not isinstance(chunks, Mapping):
            raise TypeError(f"expected a mapping {{session: samples}}, got {type(chunks).__name__}")
        checked = []
        for session, samples in chunks.items():
            self._check_member(session)
            try:
                checked.append((session, session._checked(samples, sample_rate)))
            except (TypeError, ValueError) as err:
                raise type(err)(f"session in slot {session.slot}: {err}") from err
        for session, a in checked:
            session._append(a)

    def step(self, sessions=None, *, on_error=None) -> dict[BatchedSession, list]:
        """One tick: the next frame of each session (of `sessions`, default all) that has a complete
        frame buffered, computed together -> {session: that frame's events} (only sessions that
        computed a frame). A session at its `max_streaming_seconds` closes and frees its slot instead;
        the tick's other frames are computed, then `ContextLimitError` is raised with `events` the
        tick's {session: events} and `sessions` the sessions that closed.

        `on_error(session, exception)` (a server's isolation): after the shared pass, each session
        turns its outputs into events on its own (its decoders, tool channel, `on_frame`); with
        `on_error`, a session that fails there is closed (its slot freed), reported to `on_error` and
        left out of the result, and the tick's other sessions keep their events. Without it the
        exception propagates (the other sessions' frames are then computed but their events lost).
        An exception in the shared pass always propagates: every session of the tick may then have
        been advanced in part."""
        self._check_thread()
        candidates = self.sessions if sessions is None else list(sessions)
        for session in candidates:
            self._check_member(session)
        ready, limited = [], []
        for session in candidates:
            if not session._has_frame():
                continue
            if session._at_limit():
                limited.append(session)
            else:
                ready.append(session)
        results: dict[BatchedSession, list] = {}
        if ready:
            inputs = [s._frame_input() for s in ready]
            outs = self.engine.step_batch(
                [s.state for s in ready],
                [s._pop_frame() for s in ready],
                [forced for _, forced in inputs],
                profile=any(s.profile is not None for s in ready),
                on_stage=_first_hook(ready),
            )
            for s, (i, forced), out in zip(ready, inputs, outs, strict=True):
                if s.profile is None:
                    out.stage_ms = None
                if on_error is None:
                    results[s] = s._frame_done(i, out, forced)
                    continue
                try:
                    results[s] = s._frame_done(i, out, forced)
                except Exception as err:  # this session's own part: it alone ends
                    s.closed = True
                    s._pending = np.zeros(0, dtype=np.float32)
                    self._release(s)
                    on_error(s, err)
        if limited:
            raise self._limit_reached(limited, results)
        return results

    def push(self, chunks: Mapping[BatchedSession, object], sample_rate: int = 16000) -> dict[BatchedSession, list]:
        """Every named session advances exactly as its own `push_audio(samples)` would: the chunks are
        checked (one bad chunk raises, no session changes) and buffered, then ticks run while any of
        them has a complete frame; the k-th frame this call completes in each session is computed in
        one step for all of them. -> {session: events} for every named session. A session reaching
        `max_streaming_seconds` closes; the others' frames still run, then `ContextLimitError` is
        raised with `events` this call's {session: events}."""
        self.append(chunks, sample_rate)
        named = list(chunks)
        results: dict[BatchedSession, list] = {s: [] for s in named}
        limited: list[BatchedSession] = []
        while True:
            live = [s for s in named if not s.closed]
            try:
                tick = self.step(live)
            except ContextLimitError as err:
                tick = err.events if isinstance(err.events, dict) else {}
                limited.extend(err.sessions)
            if not tick:
                break
            for s, events in tick.items():
                results[s].extend(events)
        if limited:
            raise self._limit_reached(limited, results)
        return results

    # -- internals

    def _limit_reached(self, sessions: list[BatchedSession], results: dict) -> ContextLimitError:
        for s in sessions:
            if not s.closed:
                s.closed = True
                s._pending = np.zeros(0, dtype=np.float32)
            self._release(s)
        slots = ", ".join(str(s.slot) for s in sessions)
        return ContextLimitError(
            f"max_streaming_seconds reached by the session(s) in slot {slots}; they are closed",
            events=results,
            sessions=sessions,
        )

    def _release(self, session: BatchedSession) -> None:
        if 0 <= session.slot < len(self._slots) and self._slots[session.slot] is session:
            self._slots[session.slot] = None
            session.state.release_blocks()

    def _check_member(self, session) -> None:
        if not isinstance(session, BatchedSession) or session.batch is not self:
            raise ValueError(f"{type(session).__name__} is not a session of this batch (open it with batch.open())")
        if session.closed:
            raise SessionClosedError(f"the session in slot {session.slot} is closed (flush() or cancel() was called)")

    def _check_thread(self) -> None:
        if threading.get_ident() != self._owner:
            raise WrongThreadError(
                "this session batch was created on another thread; MLX work must stay on the thread that created it"
            )


def _first_hook(sessions: list[BatchedSession]):
    for s in sessions:
        if s.on_stage is not None:
            return s.on_stage
    return None


__all__ = ["BatchedSession", "SessionBatch"]
