"""`voicechat bench --sessions 1,2,4,8`: tick time of a batch of N sessions against N, and the real-time capacity.

For each checkpoint, each backend of this project (its execution policy: `voicechat`,
`voicechat-serial`, `voicechat-gpu-policy`) loads the checkpoint once. Session i of a batch has
seed `seed + i` and its own system prompt (a longer one for each i, so their prompt lengths
differ), started from a `prepare_prompt` state made once per model (bit for bit the session that
prefills the same prompt; the prefills are not what is measured). A batch run opens N sessions in
one `model.create_session_batch(max_sessions=N)` and feeds each the same input (the bench's input
plus its silence), one 1280-sample frame per session per tick: `batch.append(...)` (not timed), then
`batch.step()` timed. `step` returns after the tick's wait (every session's frame evaluated, the
events built), so a tick's wall time is what a server ticking N conversations waits for.

Interleaved: the benchmark runs in rounds (warm-up rounds first, not in the statistics); every
round runs every N, each N's batch under every backend in turn, and the order of the N rotates
from round to round (1 2 4 8, then 2 4 8 1, ...), so drift of a shared machine falls on every N
alike. The first `drop_first` ticks of every batch run are dropped (cold start), as the solo
bench drops its first frames.

The run folder: `ticks.csv` (one row per tick), `sessions.csv` (per checkpoint x backend x N:
ticks, tick mean / p50 / p95 / max, ratios to N=1, per-session RTF), `dispatch.csv` (dispatches
and host synchronisations per tick against N, unless --no-floor), `env.json`, `summary.md`
(rendered from those files only) and `sessions.png`.

The real-time capacity of a checkpoint x backend: the largest N whose p95 tick is under 80 ms
(every session then gets its frame within the frame's own duration 95% of the time); "none" when
no N run meets it.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pandas as pd

from .runner import FRAME_MS, FRAME_SAMPLES, BenchOptions, Progress, _release_memory, load_input, resolve_checkpoints

# Backends with a batch API: this project under its execution policies.
BATCH_BACKENDS = ("voicechat", "voicechat-serial", "voicechat-gpu-policy")
TICK_COLUMNS = [
    "checkpoint",
    "backend",
    "input",
    "phase",
    "run",
    "sessions",
    "order",
    "tick_index",
    "tick_ms",
    "frames",
    "dropped",
]
SESSIONS_COLUMNS = [
    "checkpoint",
    "backend",
    "sessions",
    "ticks",
    "tick_mean_ms",
    "tick_p50_ms",
    "tick_p95_ms",
    "tick_max_ms",
    "p50_vs_1",
    "mean_vs_1",
    "rtf",
    "p95_rtf",
    "realtime_p95",
]
DISPATCH_COLUMNS = [
    "checkpoint",
    "backend",
    "sessions",
    "stage",
    "ticks_counted",
    "dispatches_per_tick",
    "syncs_per_tick",
]
STAGE_COLUMNS = [
    "checkpoint",
    "backend",
    "sessions",
    "stage",
    "ticks_profiled",
    "stage_ms",
    "stage_vs_1",
    "floor_ms",
    "floor_vs_1",
]
DISPATCH_TICKS = 12  # ticks per pass counted (as the solo bench's DISPATCH_FRAMES)
PLOT = ("sessions.png", "Tick time against the number of sessions")
PROMPT_BASE = "You are a friendly voice assistant."
FILLER = (
    "Answer briefly, speak naturally, and ask a short question back when the request is unclear. "
    "Keep a warm tone, do not read lists aloud, and let the caller interrupt you at any time."
)


def session_prompts(n: int, base: str | None = None) -> list[str]:
    """n system prompts, each longer than the one before (session i: the base and 6 i words more)."""
    base = PROMPT_BASE if base is None else base
    filler = FILLER.split()
    words = filler * (6 * n // len(filler) + 1)
    return [base if i == 0 else f"{base} {' '.join(words[: 6 * i])}" for i in range(n)]


def round_orders(counts: list[int], rounds: int) -> list[list[int]]:
    """The order of the N in each round: the list rotated by one more place each round."""
    k = len(counts)
    return [[counts[(r + j) % k] for j in range(k)] for r in range(rounds)]


# -- statistics (from ticks.csv; the report and the docs use nothing else)


def summarize_ticks(ticks: pd.DataFrame) -> pd.DataFrame:
    """One row per checkpoint x backend x N (first-seen order of checkpoint and backend, N ascending)
    over the measured ticks that are not dropped. Percentiles: linear interpolation (numpy's default)."""
    kept = ticks[(ticks.phase == "measured") & ~ticks.dropped.astype(bool)]
    rows = []
    for ck in dict.fromkeys(ticks.checkpoint):
        for be in dict.fromkeys(ticks[ticks.checkpoint == ck].backend):
            sel = kept[(kept.checkpoint == ck) & (kept.backend == be)]
            stats = {}
            for n in sorted({int(x) for x in ticks[(ticks.checkpoint == ck) & (ticks.backend == be)].sessions}):
                v = sel[sel.sessions == n].tick_ms.to_numpy(float)
                stats[n] = (
                    len(v),
                    float(np.mean(v)) if len(v) else math.nan,
                    float(np.percentile(v, 50)) if len(v) else math.nan,
                    float(np.percentile(v, 95)) if len(v) else math.nan,
                    float(np.max(v)) if len(v) else math.nan,
                )
            one = stats.get(1)
            for n, (count, mean, p50, p95, mx) in stats.items():
                rows.append(
                    {
                        "checkpoint": ck,
                        "backend": be,
                        "sessions": n,
                        "ticks": count,
                        "tick_mean_ms": mean,
                        "tick_p50_ms": p50,
                        "tick_p95_ms": p95,
                        "tick_max_ms": mx,
                        "p50_vs_1": p50 / one[2] if one and one[2] > 0 else math.nan,
                        "mean_vs_1": mean / one[1] if one and one[1] > 0 else math.nan,
                        "rtf": mean / FRAME_MS,
                        "p95_rtf": p95 / FRAME_MS,
                        "realtime_p95": bool(p95 < FRAME_MS),
                    }
                )
    return pd.DataFrame(rows, columns=SESSIONS_COLUMNS)


def capacity(p95_by_n: dict[int, float], budget_ms: float = FRAME_MS) -> int | None:
    """The largest N whose p95 tick is under `budget_ms`; None when no N meets it."""
    ok = [int(n) for n, p in p95_by_n.items() if p is not None and math.isfinite(p) and p < budget_ms]
    return max(ok) if ok else None


def capacities(summary: pd.DataFrame) -> list[dict]:
    """Per checkpoint x backend: {checkpoint, backend, capacity (int or None), largest (the largest N run)}."""
    out = []
    for (ck, be), g in summary.groupby(["checkpoint", "backend"], sort=False):
        out.append(
            {
                "checkpoint": ck,
                "backend": be,
                "capacity": capacity(dict(zip(g.sessions.astype(int), g.tick_p95_ms.astype(float), strict=True))),
                "largest": int(g.sessions.max()),
            }
        )
    return out


# -- the measurement


def _batch_run(model, states: list, n: int, wave: np.ndarray, ticks: int, drop_first: int, base: dict) -> list[dict]:
    """One batch of n sessions over `ticks` frames of `wave`: one row per tick (step() timed)."""
    batch = model.create_session_batch(max_sessions=n)
    sessions = [batch.open(prompt_state=states[i]) for i in range(n)]
    rows = []
    try:
        for t in range(ticks):
            frame = wave[t * FRAME_SAMPLES : (t + 1) * FRAME_SAMPLES]
            batch.append(dict.fromkeys(sessions, frame))
            t0 = time.perf_counter()
            out = batch.step()
            dt = (time.perf_counter() - t0) * 1000.0
            rows.append({**base, "tick_index": t, "tick_ms": dt, "frames": len(out), "dropped": t < drop_first})
    finally:
        for s in sessions:
            if not s.closed:
                s.cancel()
    return rows


def _stage_run(model, states: list, n: int, wave: np.ndarray, ticks: int, drop_first: int) -> tuple[dict, int]:
    """A profiled batch of n sessions: per stage (and "total") the mean over the kept ticks of its
    milliseconds in a tick (every stage ends evaluated; means, so the stages add up to the total),
    and the number of ticks kept."""
    from voicechat.streaming.engine import STAGES

    batch = model.create_session_batch(max_sessions=n)
    sessions = [batch.open(prompt_state=states[i], profile=True) for i in range(n)]
    per_tick = []
    try:
        for t in range(ticks):
            frame = wave[t * FRAME_SAMPLES : (t + 1) * FRAME_SAMPLES]
            batch.append(dict.fromkeys(sessions, frame))
            batch.step()
            timing = sessions[0].profile.frames[-1]  # the tick's stage times (each session holds the same)
            if t >= drop_first:
                per_tick.append([getattr(timing, f"{st}_ms") for st in STAGES] + [timing.total_ms])
    finally:
        for s in sessions:
            if not s.closed:
                s.cancel()
    mean = np.mean(np.array(per_tick), axis=0)
    return dict(zip((*STAGES, "total"), (float(v) for v in mean), strict=True)), len(per_tick)


def stage_rows(spec: str, backend: str, model, states: list, counts: list[int], wave, ticks: int, drop: int, bandwidth):
    """Per N and stage: the profiled tick's stage milliseconds against the per-tick floor (bench/floor.py,
    `tick_floor_ms`: the stage's weights read once, each session's state bytes), each as a ratio to N=1."""
    from voicechat.streaming.engine import STAGES

    from .floor import StageBytes, frame_weight_bytes, tick_floor_ms

    per_stage = frame_weight_bytes(model)
    total = StageBytes("total")
    for b in per_stage.values():
        for fmt, v in b.by_format.items():
            total.add(fmt, v)
        total.state_bytes += b.state_bytes
    per_stage["total"] = total
    measured = {n: _stage_run(model, states, n, wave, ticks, drop) for n in counts}
    base_n = min(counts)
    base_ms = measured[base_n][0]
    rows = []
    for n in counts:
        ms, kept = measured[n]
        for stage in (*STAGES, "total"):
            floor = tick_floor_ms(per_stage[stage], bandwidth, n)
            floor_1 = tick_floor_ms(per_stage[stage], bandwidth, base_n)
            rows.append(
                {
                    "checkpoint": spec,
                    "backend": backend,
                    "sessions": n,
                    "stage": stage,
                    "ticks_profiled": kept,
                    "stage_ms": ms[stage],
                    "stage_vs_1": ms[stage] / base_ms[stage] if base_ms[stage] else float("nan"),
                    "floor_ms": floor,
                    "floor_vs_1": floor / floor_1 if floor_1 else float("nan"),
                }
            )
    return rows


def _default_factory(name: str):
    from harness.backends import get_backend

    return get_backend(name)


def validate_sessions(opts: BenchOptions, counts: list[int]) -> None:
    opts.validate()
    if not counts:
        raise ValueError("--sessions needs at least one session count, e.g. --sessions 1,2,4,8")
    for n in counts:
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise ValueError(f"session counts must be ints >= 1, got {n!r}")
    if len(set(counts)) != len(counts):
        raise ValueError(f"session counts repeated: {counts}")
    bad = [b for b in opts.backends if b not in BATCH_BACKENDS]
    if bad:
        raise ValueError(
            f"--sessions runs this project's session batch; backend(s) {', '.join(bad)} have none "
            f"(expected {', '.join(BATCH_BACKENDS)})"
        )
    if len(opts.audio) != 1:
        raise ValueError(f"--sessions takes one --audio input (every session hears it), got {len(opts.audio)}")
    if opts.isolate:
        raise ValueError("--sessions runs in one process (one model per backend); --isolate does not apply")
    if opts.chunk_samples != FRAME_SAMPLES:
        raise ValueError(
            f"--sessions feeds one {FRAME_SAMPLES}-sample frame per session per tick; drop --chunk-samples"
        )


def run_sessions(
    opts: BenchOptions,
    counts: list[int],
    *,
    backend_factory: Callable[[str], object] | None = None,
    progress: Progress | None = None,
) -> Path:
    """Measure ticks of N sessions for every N in `counts` and write the run folder `opts.out`."""
    from .dispatch import count_batch
    from .env import environment, sha256_file

    counts = sorted(counts)
    validate_sessions(opts, counts)
    progress = progress or Progress()
    factory = backend_factory or _default_factory
    out = Path(opts.out)

    path = opts.audio[0]
    wave = load_input(path)
    silence = np.zeros(int(round(opts.extra_decoding_seconds * 16000)), np.float32)
    stream = np.concatenate([wave, silence])
    if opts.frames is not None:
        stream = stream[: opts.frames * FRAME_SAMPLES]
    n_ticks = -(-stream.size // FRAME_SAMPLES)
    stream = np.pad(stream, (0, n_ticks * FRAME_SAMPLES - stream.size))  # the last partial frame, zero-padded
    if n_ticks <= opts.drop_first:
        raise ValueError(
            f"{n_ticks} ticks per batch run, all of them dropped (--drop-first {opts.drop_first}); "
            "stream more frames or drop fewer"
        )
    input_name = Path(path).name
    out.mkdir(parents=True, exist_ok=True)
    ckpts = resolve_checkpoints(opts.checkpoints, progress)

    prompts = session_prompts(max(counts), opts.system_prompt)
    orders = round_orders(counts, opts.warmup + opts.runs)
    env = environment([c["info"] for c in ckpts])
    from .runner import _loadavg

    env["machine"]["load_average_start"] = _loadavg()
    env["method"] = {
        "mode": "sessions",
        "sessions": counts,
        "backends": list(opts.backends),
        "runs": opts.runs,
        "warmup": opts.warmup,
        "drop_first": opts.drop_first,
        "extra_decoding_seconds": float(opts.extra_decoding_seconds),
        "seed": opts.seed,
        "system_prompts": prompts,
        "ticks_per_batch_run": n_ticks,
        "frames": opts.frames,
        "round_orders": orders,
        "dispatch_counted": bool(opts.floor),
        "input": {
            "name": input_name,
            "path": str(path),
            "samples": int(wave.size),
            "seconds": wave.size / 16000.0,
            "sha256": sha256_file(Path(path)),
        },
        "prompt_positions": {},
    }

    bandwidth = None
    if opts.floor:
        progress(f"measuring MLX matrix-vector bandwidth (~{opts.bandwidth_mb:g} MB per format)")
        from .floor import measure_bandwidth

        bandwidth = measure_bandwidth(opts.bandwidth_mb)
        progress("    " + ", ".join(f"{k} {v['gbps']:.2f} GB/s" for k, v in bandwidth.items()))
        env["bandwidth"] = bandwidth

    tick_rows: list[dict] = []
    dispatch_rows: list[dict] = []
    stage_rows_all: list[dict] = []
    errors: list[str] = []
    for ci, ck in enumerate(ckpts):
        spec, folder = ck["spec"], ck["folder"]
        progress(f"checkpoint {ci + 1}/{len(ckpts)}: {spec} ({folder})")
        backends = {}
        try:
            for name in opts.backends:
                progress(f"    loading {name}, preparing {len(prompts)} prompt states")
                b = factory(name)
                b.load(str(folder))
                with b.execution_settings():
                    states = [b.model.prepare_prompt(p, seed=opts.seed + i) for i, p in enumerate(prompts)]
                backends[name] = (b, states)
            env["method"]["prompt_positions"][spec] = [int(s.prompt_positions) for s in backends[opts.backends[0]][1]]
            if opts.floor:
                ticks_counted = min(DISPATCH_TICKS, n_ticks)
                drop = max(0, min(opts.drop_first, ticks_counted - 2))
                for name, (b, states) in backends.items():
                    for n in counts:
                        progress(f"    counting dispatches and host syncs: {name}, N={n}, {ticks_counted} ticks")
                        with b.execution_settings():
                            rows = count_batch(b.model, stream, states[:n], ticks=ticks_counted, drop_first=drop)
                        dispatch_rows.extend(
                            {
                                "checkpoint": spec,
                                "backend": name,
                                "sessions": n,
                                "ticks_counted": ticks_counted - drop,
                                **r,
                            }
                            for r in rows
                        )
                    ns = ", ".join(map(str, counts))
                    progress(f"    profiling stages per tick: {name}, N={ns}, {ticks_counted} ticks")
                    with b.execution_settings():
                        stage_rows_all.extend(
                            stage_rows(spec, name, b.model, states, counts, stream, ticks_counted, drop, bandwidth)
                        )
            for r, order in enumerate(orders):
                phase, run = ("warmup", r + 1) if r < opts.warmup else ("measured", r + 1 - opts.warmup)
                for pos, n in enumerate(order):
                    for name, (b, states) in backends.items():
                        progress(f"    {phase} {run}: {name}, N={n}: {n_ticks} ticks")
                        base = {
                            "checkpoint": spec,
                            "backend": name,
                            "input": input_name,
                            "phase": phase,
                            "run": run,
                            "sessions": n,
                            "order": pos,
                        }
                        _release_memory()
                        with b.execution_settings():
                            rows = _batch_run(b.model, states, n, stream, n_ticks, opts.drop_first, base)
                        kept = [x["tick_ms"] for x in rows if not x["dropped"]]
                        progress(f"        tick p50 {np.percentile(kept, 50):.1f} ms, max {max(kept):.1f} ms")
                        tick_rows.extend(rows)
        except Exception as e:  # recorded; the other checkpoints still run
            progress(f"    FAILED {spec}: {type(e).__name__}: {e}")
            errors.append(f"{spec}: {type(e).__name__}: {e}".replace("\n", " "))
        finally:
            for b, _ in backends.values():
                b.close()
            backends.clear()
            _release_memory()

    env["errors"] = errors
    env["machine"]["load_average_end"] = _loadavg()
    env["wall_seconds"] = time.perf_counter() - progress.t0
    write_sessions_folder(
        out, env=env, tick_rows=tick_rows, dispatch_rows=dispatch_rows, stage_rows=stage_rows_all, plots=opts.plots
    )
    progress(f"wrote {out}")
    return out


def write_sessions_folder(
    out: Path,
    *,
    env: dict,
    tick_rows: list[dict],
    dispatch_rows: list[dict],
    stage_rows: list[dict] | None = None,
    plots: bool = True,
) -> None:
    from .report import _json_default

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    ticks = pd.DataFrame(tick_rows, columns=TICK_COLUMNS)
    ticks.to_csv(out / "ticks.csv", index=False)
    summarize_ticks(ticks).to_csv(out / "sessions.csv", index=False)
    if dispatch_rows:
        pd.DataFrame(dispatch_rows, columns=DISPATCH_COLUMNS).to_csv(out / "dispatch.csv", index=False)
    if stage_rows:
        pd.DataFrame(stage_rows, columns=STAGE_COLUMNS).to_csv(out / "stages.csv", index=False)
    (out / "env.json").write_text(json.dumps(env, indent=2, default=_json_default, allow_nan=True) + "\n")
    if plots:
        make_sessions_plot(out)
    (out / "summary.md").write_text(render_sessions(out))


def make_sessions_plot(run_dir: Path) -> dict[str, Path]:
    from .plots import plot_sessions

    run_dir = Path(run_dir)
    env = json.loads((run_dir / "env.json").read_text())
    summary = summarize_ticks(_read_ticks(run_dir))
    if not summary.ticks.gt(0).any():
        return {}
    path = run_dir / PLOT[0]
    plot_sessions(summary, env, path)
    return {PLOT[0]: path}


# -- Markdown (from the folder's files only)


def _read_ticks(run_dir: Path) -> pd.DataFrame:
    return pd.read_csv(Path(run_dir) / "ticks.csv")


def _capacity_text(c: dict) -> str:
    if c["capacity"] is None:
        return "none (even the smallest N misses 80 ms at p95)"
    if c["capacity"] == c["largest"]:
        return f"{c['capacity']} (the largest N run; more may fit)"
    return str(c["capacity"])


def render_sessions(run_dir: Path, *, link_prefix: str = "", level: int = 1, title: str | None = None) -> str:
    """The run's Markdown: capacity, tick statistics per N, dispatches per tick, the plot. Deterministic:
    depends only on the folder's files (the statistics are recomputed from ticks.csv)."""
    from .report import _ckpt_label, _fmt, _ms, _table, machine_line, machine_load_line, software_line

    run_dir = Path(run_dir)
    env = json.loads((run_dir / "env.json").read_text())
    ticks = _read_ticks(run_dir)
    summary = summarize_ticks(ticks)
    method = env["method"]
    h = "#" * level
    date = env.get("date", "n/a")
    m = env["machine"]
    out = [f"{h} {title or 'Many sessions on one model: tick time against N'}: {date[:10]}", ""]
    synth = [c for c in env["checkpoints"] if c.get("synthetic")]
    if synth:
        out += [
            "> **Synthetic weights.** "
            + ", ".join(f"`{c['spec']}`" for c in synth)
            + (" is" if len(synth) == 1 else " are")
            + " random-weight checkpoint(s) written by `voicechat.synthetic` in the published on-disk layout "
            "and quantization, not the trained model; these timings are not the 11B model's.",
            "",
        ]
    out.append(machine_line(env))
    out.append(software_line(env))
    load = machine_load_line(
        m, "absolute times are pessimistic, and the capacity with them; the interleaved N saw the same load"
    )
    if load:
        out.append(load)
    ws = env.get("wall_seconds")
    out.append(f"- **Date:** {date} (UTC)" + (f"; the benchmark took {ws / 60:.0f} min" if ws else ""))
    out.append("- **Checkpoints:** " + ", ".join(_ckpt_label(c) for c in env["checkpoints"]))
    out.append("")
    inp = method["input"]
    positions = method.get("prompt_positions") or {}
    out += [f"{h}# Method", ""]
    out.append(
        f"- **Input:** `{inp['name']}`, {inp['seconds']:.2f} s of 16 kHz speech then "
        f"{method['extra_decoding_seconds']:g} s of silence"
        + (f", cut to the first {method['frames']} frames (--frames)" if method.get("frames") else "")
        + f": {method['ticks_per_batch_run']} ticks per batch run, every session fed the same audio."
    )
    out.append(
        f"- **Sessions:** N in {', '.join(str(n) for n in method['sessions'])}, opened in one "
        "`model.create_session_batch(max_sessions=N)`; session i has seed "
        f"{method['seed']} + i and its own system prompt (each one longer than the one before; prompt "
        "positions "
        + "; ".join(f"`{ck}`: {', '.join(str(p) for p in pos)}" for ck, pos in positions.items())
        + "), started from a `prepare_prompt` state (the prefills are not measured)."
    )
    out.append(
        f"- **Ticks:** each tick appends one {FRAME_SAMPLES}-sample frame to every session, then "
        "`batch.step()` is timed: it computes every session's frame as one pass per stage and returns "
        "after the tick's wait (all N frames evaluated). *frames* in ticks.csv: the sessions that "
        "computed a frame in the tick."
    )
    out.append(
        f"- **Rounds:** {method['warmup']} warm-up round(s) (not counted), then {method['runs']} measured; "
        "each round runs every N, each N under every backend in turn ("
        + " → ".join(method["backends"])
        + "), and the order of the N rotates from round to round ("
        + "; ".join(" ".join(str(n) for n in o) for o in method["round_orders"])
        + "), so the machine's drift falls on every N alike. One model per backend, loaded once."
    )
    out.append(
        f"- **Statistics:** the first {method['drop_first']} ticks of every batch run are dropped (cold "
        "start); the rest of the measured rounds are pooled per N. *Ratio to N=1*: the tick's p50 (mean) "
        "over N=1's. *RTF per session*: mean tick / 80 ms (each session advances 80 ms per tick; above "
        "1.0 every session falls behind real time). **Real-time capacity**: the largest N whose p95 tick "
        "is under 80 ms; none when no N run meets it."
    )
    out.append("")
    out += [f"{h}# Real-time capacity", ""]
    caps = capacities(summary)
    out.append(
        _table(
            ["checkpoint", "backend", "capacity (largest N with p95 tick < 80 ms)", "N run"],
            [
                [
                    f"`{c['checkpoint']}`",
                    c["backend"],
                    _capacity_text(c),
                    ", ".join(
                        str(int(n))
                        for n in summary[
                            (summary.checkpoint == c["checkpoint"]) & (summary.backend == c["backend"])
                        ].sessions
                    ),
                ]
                for c in caps
            ],
            "llll",
        )
    )
    out.append("")
    out += [f"{h}# Tick time against N", ""]
    rows = [
        [
            f"`{s.checkpoint}`",
            s.backend,
            str(int(s.sessions)),
            str(int(s.ticks)),
            _ms(s.tick_mean_ms),
            _ms(s.tick_p50_ms),
            _ms(s.tick_p95_ms),
            _ms(s.tick_max_ms),
            _fmt(s.p50_vs_1, 2, "×"),
            _fmt(s.mean_vs_1, 2, "×"),
            _fmt(s.rtf, 2),
            "yes" if s.realtime_p95 else "no",
        ]
        for s in summary.itertuples()
    ]
    out.append(
        _table(
            [
                "checkpoint",
                "backend",
                "N",
                "ticks",
                "tick mean ms",
                "tick p50 ms",
                "tick p95 ms",
                "tick max ms",
                "p50 / N=1",
                "mean / N=1",
                "RTF per session",
                "p95 < 80 ms",
            ],
            rows,
            "ll" + "r" * 10,
        )
    )
    out.append("")
    out.append(
        "A ratio to N=1 below N: the batch costs less than N frames of one session (in a tick every "
        "stage runs its products, norms, element-wise operations and attention once over all the "
        "sessions' rows; what stays per session is its log-mel and subsampling window, its MoG draws "
        "and RVQ, its RNNT decisions and, with the codec's products in numpy, those products; "
        'docs/voicechat.md, "Many sessions in one process"); at N the batch saves nothing over running '
        "the sessions one after the other."
    )
    out.append("")
    if (run_dir / "dispatch.csv").is_file():
        d = pd.read_csv(run_dir / "dispatch.csv")
        total = d[d.stage == "total"]
        if len(total):
            out += [f"{h}# Dispatches and host synchronisations per tick", ""]
            out.append(
                _table(
                    ["checkpoint", "backend", "N", "operations dispatched", "per session", "host syncs", "ticks"],
                    [
                        [
                            f"`{r.checkpoint}`",
                            r.backend,
                            str(int(r.sessions)),
                            _fmt(r.dispatches_per_tick, 0),
                            _fmt(r.dispatches_per_tick / r.sessions, 0),
                            _fmt(r.syncs_per_tick, 1),
                            str(int(r.ticks_counted)),
                        ]
                        for r in total.itertuples()
                    ],
                    "llrrrrr",
                )
            )
            out.append("")
            out.append(
                "Counted from MLX's graph as for single frames (bench/dispatch.py, `count_batch`): the "
                "operation nodes every evaluation runs (one kernel dispatch each on the CPU backend) and "
                "the evaluations that ran any (host synchronisations), per tick of N sessions after the "
                "dropped ticks; dispatches from a profiled pass, syncs from an unprofiled one. Per stage "
                "in dispatch.csv."
            )
            out.append("")
    if (run_dir / "stages.csv").is_file():
        out += _render_stages(pd.read_csv(run_dir / "stages.csv"), h)
    for e in env.get("errors") or []:
        out.append(f"- failed: {e}")
    if (run_dir / PLOT[0]).is_file():
        out += [f"{h}# Plot", "", f"![{PLOT[1]}]({link_prefix}{PLOT[0]})", ""]
    return "\n".join(out).rstrip() + "\n"


def _render_stages(st: pd.DataFrame, h: str) -> list[str]:
    """What bounds a tick: per stage the profiled milliseconds against the per-tick floor, as ratios to N=1."""
    from .report import _fmt, _table

    if not len(st):
        return []
    out = [f"{h}# What bounds a tick: each stage against its floor", ""]
    rows = [
        [
            f"`{r.checkpoint}`",
            r.backend,
            str(int(r.sessions)),
            r.stage,
            _fmt(r.stage_ms, 1),
            _fmt(r.stage_vs_1, 2),
            _fmt(r.floor_ms, 2),
            _fmt(r.floor_vs_1, 2),
        ]
        for r in st.itertuples()
    ]
    out.append(
        _table(
            ["checkpoint", "backend", "N", "stage", "ms per tick", "vs N=1", "floor ms", "floor vs N=1"],
            rows,
            "lllrrrrr",
        )
    )
    out.append("")
    out.append(
        "Profiled ticks (every stage ends evaluated, so stages do not overlap; mean over the kept ticks "
        "of a pass as long as the dispatch count's). The floor of a stage in a tick of N sessions (bench/floor.py, "
        "`tick_floor_ms`): its weights read once at the measured matrix-vector bandwidth plus each "
        "session's Mamba SSM state read and written. A stage whose time grows faster than its floor is "
        "bound by what it computes per session (its attention over its own caches, its draws, the codec's "
        "arithmetic), not by reading weights."
    )
    out.append("")
    return out


__all__ = [
    "run_sessions",
    "render_sessions",
    "summarize_ticks",
    "capacity",
    "capacities",
    "session_prompts",
    "round_orders",
    "write_sessions_folder",
    "make_sessions_plot",
    "TICK_COLUMNS",
    "SESSIONS_COLUMNS",
    "DISPATCH_COLUMNS",
    "STAGE_COLUMNS",
    "stage_rows",
]
