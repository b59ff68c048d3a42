"""Operations dispatched and host synchronisations per streamed frame, counted from MLX's graph.

MLX builds a lazy graph and runs it when something needs the values: `mx.eval`,
`array.item()` / `.tolist()`, or numpy reading the array (`np.asarray`, `np.array`); or
earlier, without waiting, `mx.async_eval` (counted as dispatches, not as a synchronisation).
While `count_dispatches()` is active those entry points are wrapped: before each
evaluation the graph behind the requested arrays is exported (`mx.export_to_dot`)
and its operation nodes are counted. Each node is one kernel dispatch on the CPU
backend (a compiled function is one node: one generated kernel); arrays already
evaluated are leaves and cost nothing. An evaluation with at least one node to
run is one host synchronisation (Python waits for the device).

Stages of this project's session are attributed by the frame engine itself: the
session's `on_stage` hook is told each stage's name as it starts (perception, RNNT,
language, TTS, and the codec from the control-code replacement on).
Two passes: with `profile=True` every stage ends with its outputs evaluated, so
each stage's dispatches are counted in it; the host synchronisations are counted
in a pass with `profile=False` (the profiler's stage-end evaluations are not
part of a normal frame). mlx-vlm's session is counted per frame only.
`count_batch` counts the same per tick of a session batch (`voicechat bench --sessions`).
"""

from __future__ import annotations

import contextlib
import io
import re
from collections import Counter, defaultdict

import mlx.core as mx
import numpy as np

from voicechat.streaming.engine import STAGES

_NODE = re.compile(r'label ="([^"]*)", shape=rectangle')


class DispatchCounter:
    """Dispatches (graph nodes run) and synchronisations (evaluations that ran nodes), by stage."""

    def __init__(self):
        self.stage = "other"
        self.dispatches: Counter = Counter()
        self.syncs: Counter = Counter()
        self.ops: dict[str, Counter] = defaultdict(Counter)

    def record(self, arrays, *, sync: bool = True) -> None:
        """Count the nodes behind `arrays` that would run; `sync`: the caller waits for them
        (an `mx.async_eval` ahead of the wait, `voicechat.runtime.overlap`, does not)."""
        lazy = [a for a in _flatten(arrays) if isinstance(a, mx.array)]
        if not lazy:
            return
        buf = io.StringIO()
        mx.export_to_dot(buf, *lazy)
        labels = _NODE.findall(buf.getvalue())
        if labels:
            self.dispatches[self.stage] += len(labels)
            self.syncs[self.stage] += int(sync)
            self.ops[self.stage].update(re.sub(r"[\s(].*", "", lab) for lab in labels)

    def enter(self, stage: str) -> None:
        """Count what follows under `stage` (the session's `on_stage` hook)."""
        self.stage = stage

    def snapshot(self) -> tuple[Counter, Counter]:
        return Counter(self.dispatches), Counter(self.syncs)


def _flatten(tree):
    if isinstance(tree, (list, tuple)):
        for t in tree:
            yield from _flatten(t)
    elif isinstance(tree, dict):
        for t in tree.values():
            yield from _flatten(t)
    else:
        yield tree


@contextlib.contextmanager
def count_dispatches():
    """Count every MLX evaluation inside the block into the yielded `DispatchCounter`."""
    counter = DispatchCounter()
    eval_, async_eval, item, tolist = mx.eval, mx.async_eval, mx.array.item, mx.array.tolist
    asarray, array = np.asarray, np.array

    def eval_counted(*args):
        counter.record(args)
        return eval_(*args)

    def async_eval_counted(*args):
        counter.record(args, sync=False)
        return async_eval(*args)

    def item_counted(self):
        counter.record(self)
        return item(self)

    def tolist_counted(self):
        counter.record(self)
        return tolist(self)

    def asarray_counted(a, *args, **kwargs):
        if isinstance(a, mx.array):
            counter.record(a)
        return asarray(a, *args, **kwargs)

    def array_counted(a, *args, **kwargs):
        if isinstance(a, mx.array):
            counter.record(a)
        return array(a, *args, **kwargs)

    mx.eval, mx.async_eval, mx.array.item, mx.array.tolist = (
        eval_counted,
        async_eval_counted,
        item_counted,
        tolist_counted,
    )
    np.asarray, np.array = asarray_counted, array_counted
    try:
        yield counter
    finally:
        mx.eval, mx.async_eval, mx.array.item, mx.array.tolist = eval_, async_eval, item, tolist
        np.asarray, np.array = asarray, array


def _per_frame(frames: list[tuple[Counter, Counter]], drop_first: int) -> tuple[dict, dict]:
    """Mean per-frame dispatches and syncs by stage from cumulative snapshots after each frame."""
    deltas = [(a[0] - b[0], a[1] - b[1]) for a, b in zip(frames[1:], frames[:-1], strict=True)][drop_first:]
    if not deltas:
        raise ValueError("no frames left to count after the dropped ones")
    n = len(deltas)
    disp = {s: sum(d[0][s] for d in deltas) / n for s in STAGES}
    sync = {s: sum(d[1][s] for d in deltas) / n for s in STAGES}
    disp["total"], sync["total"] = sum(disp.values()), sum(sync.values())
    return disp, sync


def count_voicechat(model, wave: np.ndarray, *, frames: int = 12, drop_first: int = 4) -> list[dict]:
    """Per stage: mean dispatches (profiled pass) and host syncs (unprofiled pass) per frame."""
    n = model.config.frame_samples
    wave = np.asarray(wave, dtype=np.float32)
    if wave.shape[0] < frames * n:
        raise ValueError(f"need {frames} frames of input ({frames * n} samples), got {wave.shape[0]}")
    result = {}
    for profile in (True, False):
        session = model.create_streaming_session(profile=profile)
        with count_dispatches() as counter:
            session.on_stage = counter.enter  # the engine names each stage as it starts
            snaps = [counter.snapshot()]
            for i in range(frames):
                session.push_audio(wave[i * n : (i + 1) * n])
                snaps.append(counter.snapshot())
        result[profile] = _per_frame(snaps, drop_first)
    disp, _ = result[True]
    _, sync = result[False]
    return [{"stage": s, "dispatches_per_frame": disp[s], "syncs_per_frame": sync[s]} for s in (*STAGES, "total")]


def count_batch(model, wave: np.ndarray, prompt_states: list, *, ticks: int = 12, drop_first: int = 4) -> list[dict]:
    """Per stage: mean dispatches (profiled pass) and host syncs (unprofiled pass) per tick of a session
    batch (`model.create_session_batch`) with one session per prompt state, each fed the same frame of
    `wave` every tick. The sessions open (their prompt states restored) before counting starts."""
    n = model.config.frame_samples
    wave = np.asarray(wave, dtype=np.float32)
    if wave.shape[0] < ticks * n:
        raise ValueError(f"need {ticks} frames of input ({ticks * n} samples), got {wave.shape[0]}")
    if not prompt_states:
        raise ValueError("count_batch needs at least one session (one prompt state per session)")
    result = {}
    for profile in (True, False):
        batch = model.create_session_batch(max_sessions=len(prompt_states))
        sessions = [batch.open(prompt_state=st, profile=profile) for st in prompt_states]
        try:
            with count_dispatches() as counter:
                sessions[0].on_stage = counter.enter  # the batch's engine names each stage (first session's hook)
                snaps = [counter.snapshot()]
                for i in range(ticks):
                    frame = wave[i * n : (i + 1) * n]
                    batch.append(dict.fromkeys(sessions, frame))
                    done = batch.step()
                    if len(done) != len(sessions):
                        raise RuntimeError(f"tick {i}: {len(done)} of {len(sessions)} sessions computed a frame")
                    snaps.append(counter.snapshot())
        finally:
            for s in sessions:
                if not s.closed:
                    s.cancel()
        result[profile] = _per_frame(snaps, drop_first)
    disp, _ = result[True]
    _, sync = result[False]
    return [{"stage": s, "dispatches_per_tick": disp[s], "syncs_per_tick": sync[s]} for s in (*STAGES, "total")]


def count_mlx_vlm(
    session_factory, wave: np.ndarray, *, frame_samples: int = 1280, frames: int = 12, drop_first: int = 4
) -> list[dict]:
    """mlx-vlm: per-frame totals (its stages are not attributed), unprofiled."""
    wave = np.asarray(wave, dtype=np.float32)
    session = session_factory()
    with count_dispatches() as counter:
        counter.stage = "codec"  # any stage name: only the total is reported
        snaps = [counter.snapshot()]
        for i in range(frames):
            out = session.push_audio(wave[i * frame_samples : (i + 1) * frame_samples])
            if out is not None and not isinstance(out, list):
                list(out)  # a generator: run the frame
            snaps.append(counter.snapshot())
    disp, sync = _per_frame(snaps, drop_first)
    return [{"stage": "total", "dispatches_per_frame": disp["total"], "syncs_per_frame": sync["total"]}]


__all__ = ["DispatchCounter", "count_dispatches", "count_voicechat", "count_batch", "count_mlx_vlm", "STAGES"]
