"""The benchmark runner: checkpoints x backends x inputs, warm-up, interleaved measured runs.

For each checkpoint and input, every run loads the checkpoint afresh through a
harness backend (`harness.backends.get_backend`), streams the input (plus
`extra_decoding_seconds` of silence, the time a user would stay quiet while the
assistant answers) in `chunk_samples` pushes with the profiler on, flushes, then
times the offline path on the same input (with the same extra decoding
seconds), and releases the model. Backends take turns within each run
(A B A B ...), so slow drift of the machine (thermal state, other load) hits
them alike, and only one model is resident at a time, so memory peaks are
per backend. Warm-up runs do the same and are recorded in runs.csv but not in
the statistics.

A run that raises is recorded as failed with its error; the rest continue.
"""

from __future__ import annotations

import gc
import math
import sys
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path

import numpy as np

from voicechat.streaming.engine import STAGES

STAGE_KEYS = tuple(f"{stage}_ms" for stage in (*STAGES, "total"))
FRAME_MS = 80.0
FRAME_SAMPLES = 1280  # one 80 ms frame at 16 kHz


@dataclass
class BenchOptions:
    checkpoints: list[str]
    audio: list[str]
    out: Path
    backends: list[str] = field(default_factory=lambda: ["voicechat"])
    runs: int = 3
    warmup: int = 1
    drop_first: int = 5
    extra_decoding_seconds: float = 3.0
    chunk_samples: int = 1280
    seed: int = 0
    system_prompt: str | None = None
    offline: bool = True
    floor: bool = True
    bandwidth_mb: float = 256.0
    heartbeat_s: float = 30.0
    plots: bool = True
    frames: int | None = None  # stream at most this many frames of input + silence (None: all)
    isolate: bool = False  # each run (and the floor model) in a fresh process
    warm_page_cache: bool = True  # read the checkpoint's files before each run (see read_through)

    def validate(self) -> None:
        if not self.checkpoints:
            raise ValueError(
                "no checkpoint given; pass -m CKPT (a folder, a Hugging Face repo id or synthetic:PRESET[:4|8])"
            )
        if not self.audio:
            raise ValueError("no input given; pass --audio FILE (WAV/FLAC/OGG) or a bundled sample name")
        if not self.backends:
            raise ValueError("no backend given; expected --backend voicechat and/or --backend mlx-vlm")
        if len(set(self.backends)) != len(self.backends):
            raise ValueError(f"backends repeated: {self.backends}")
        if len(set(self.checkpoints)) != len(self.checkpoints):
            raise ValueError(f"checkpoints repeated: {self.checkpoints}")
        if self.frames is not None and self.frames < 1:
            raise ValueError(f"frames must be at least 1 (frames streamed per run), got {self.frames}")
        for name, v, lo in (
            ("runs", self.runs, 1),
            ("warmup", self.warmup, 0),
            ("drop_first", self.drop_first, 0),
            ("chunk_samples", self.chunk_samples, 1),
        ):
            if isinstance(v, bool) or not isinstance(v, int) or v < lo:
                raise ValueError(f"{name} must be an int >= {lo}, got {v!r}")
        if not (
            isinstance(self.extra_decoding_seconds, (int, float))
            and self.extra_decoding_seconds >= 0
            and math.isfinite(self.extra_decoding_seconds)
        ):
            raise ValueError(
                f"extra_decoding_seconds must be a finite number >= 0, got {self.extra_decoding_seconds!r}"
            )


@dataclass
class BenchResult:
    out: Path
    runs: int
    failed: int

    @property
    def ok(self) -> bool:
        return self.failed == 0


class Progress:
    """Progress lines on stderr, each prefixed with the time since the benchmark started."""

    def __init__(self, stream=None, enabled: bool = True):
        self.stream = stream if stream is not None else sys.stderr
        self.enabled = enabled
        self.t0 = time.perf_counter()

    def elapsed(self) -> str:
        s = int(time.perf_counter() - self.t0)
        return f"{s // 3600}:{s % 3600 // 60:02d}:{s % 60:02d}"

    def __call__(self, msg: str) -> None:
        if self.enabled:
            from voicechat.io.progress import write

            write(f"[bench {self.elapsed()}] {msg}", file=self.stream)  # above the runs bar, if one is drawn


class _Heartbeat:
    """Prints 'still running' lines from a side thread while a long blocking call runs (no MLX work here)."""

    def __init__(self, progress: Progress, label: str, every_s: float):
        self.progress, self.label, self.every_s = progress, label, every_s
        self._stop = threading.Event()
        self._thread = None
        self._t0 = time.perf_counter()

    def __enter__(self):
        if self.every_s and self.every_s > 0:
            self._thread = threading.Thread(target=self._run, daemon=True)
            self._thread.start()
        return self

    def _run(self):
        while not self._stop.wait(self.every_s):
            self.progress(f"    ... {self.label}: {time.perf_counter() - self._t0:.0f} s so far")

    def __exit__(self, *exc):
        self._stop.set()
        if self._thread is not None:
            self._thread.join()


# -- memory


def _reset_rss_peak() -> bool:
    """Reset the kernel's peak-RSS counter (VmHWM) of this process (Linux); False where unsupported."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def _rss_peak_mb(reset_ok: bool) -> tuple[float | None, str]:
    """(peak RSS MB, what it covers): since the last reset on Linux, else the process lifetime peak."""
    if reset_ok:
        try:
            with open("/proc/self/status") as f:
                for line in f:
                    if line.startswith("VmHWM:"):
                        return int(line.split()[1]) * 1024 / 1e6, "run"
        except OSError:
            pass
    try:
        import resource

        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        return (peak / 1e6 if sys.platform == "darwin" else peak * 1024 / 1e6), "process"
    except (ImportError, OSError):
        return None, "unavailable"


def _release_memory() -> None:
    import mlx.core as mx

    gc.collect()
    mx.clear_cache()


# -- checkpoints and inputs


def resolve_checkpoints(specs, progress) -> list[dict]:
    """[{"spec", "folder", "info"}] of each checkpoint spec, resolved (written or found) in turn."""
    from .env import checkpoint_info

    ckpts = []
    for spec in specs:
        progress(f"resolving checkpoint {spec}")
        folder = resolve_checkpoint(spec)
        ckpts.append({"spec": spec, "folder": folder, "info": checkpoint_info(spec, folder)})
    return ckpts


def resolve_checkpoint(spec: str) -> Path:
    """A -m value -> a local checkpoint folder (synthetic specs are written to the cache on first use)."""
    from voicechat.io.loading import resolve_checkpoint as resolve
    from voicechat.synthetic.checkpoint import resolve_model_arg

    return Path(resolve(resolve_model_arg(str(spec))))


def read_through(folder: Path, chunk_bytes: int = 16 << 20) -> int:
    """Read every file of a checkpoint folder once (into the OS page cache); -> bytes read.

    Called before each run, so every backend's load starts from the same page cache: otherwise
    the first backend to load a checkpoint pays the disk for it and the next one is spared it
    (at the published shapes, 26 s against 20 s for the same bytes on this machine). Where the
    files and the loaded model do not fit in memory together, part of the files is read from
    the disk again by each load, by every backend alike."""
    total = 0
    buf = bytearray(chunk_bytes)
    for path in sorted(Path(folder).iterdir()):
        if path.is_file():
            with open(path, "rb", buffering=0) as f:
                while n := f.readinto(buf):
                    total += n
    return total


def load_input(path: str) -> np.ndarray:
    from voicechat.io.audio_input import load_audio

    return load_audio(str(path), 16000, allow_empty=False)


def _input_name(path: str, all_paths: list[str]) -> str:
    name = Path(path).name
    return name if sum(Path(p).name == name for p in all_paths) == 1 else str(path)


# -- one run


def _frame_rows(timings: list[dict], *, drop_first: int, base: dict) -> list[dict]:
    rows = []
    for i, t in enumerate(timings):
        missing = [k for k in STAGE_KEYS if k not in t]
        row = dict(base)
        row["frame_index"] = int(t.get("frame_index", i))
        if missing and not any(k in t for k in STAGE_KEYS[:-1]) and ("total_ms" in t or "frame_ms" in t):
            # A backend that times only whole frames (mlx-audio): its stages are not available.
            row.update(dict.fromkeys(STAGE_KEYS[:-1], math.nan))
            row["total_ms"] = float(t.get("total_ms", t.get("frame_ms")))
        elif missing:
            raise ValueError(f"frame timing {i} lacks {missing}; got keys {sorted(t)}")
        else:
            for k in STAGE_KEYS:
                row[k] = float(t[k])
        row["dropped"] = i < drop_first
        rows.append(row)
    return rows


def run_once(
    backend_factory: Callable[[str], object],
    backend_name: str,
    folder: Path,
    *,
    wave: np.ndarray,
    stream_wave: np.ndarray,
    opts: BenchOptions,
    base: dict,
    progress: Progress,
    label: str,
) -> tuple[dict, list[dict]]:
    """Load, stream (profiled), offline, release. -> (run record, frame rows); never raises."""
    import mlx.core as mx

    rec = dict(base)
    rec.update(
        status="ok",
        error="",
        load_s=math.nan,
        create_s=math.nan,
        first_audio_s=math.nan,
        first_text_s=math.nan,
        stream_wall_s=math.nan,
        frames=0,
        total_mean_ms=math.nan,
        total_p50_ms=math.nan,
        rtf=math.nan,
        offline_wall_s=math.nan,
        offline_frames=0,
        offline_rtf=math.nan,
        mlx_peak_mb=math.nan,
        rss_peak_mb=math.nan,
        rss_peak_scope="",
        offline_mlx_peak_mb=math.nan,
        asr_mean_ms=math.nan,
        asr_p50_ms=math.nan,
    )
    frames: list[dict] = []
    backend = None
    step = "creating the backend"
    _release_memory()
    mx.reset_peak_memory()
    rss_reset = _reset_rss_peak()
    try:
        backend = backend_factory(backend_name)
        step = "loading the checkpoint"
        t0 = time.perf_counter()
        with _Heartbeat(progress, f"{label} loading", opts.heartbeat_s):
            backend.load(str(folder))
        rec["load_s"] = time.perf_counter() - t0
        step = "streaming"
        with _Heartbeat(progress, f"{label} streaming", opts.heartbeat_s):
            run = backend.stream(
                stream_wave,
                system_prompt=opts.system_prompt,
                seed=opts.seed,
                chunk_samples=opts.chunk_samples,
                profile=True,
            )
        rec["mlx_peak_mb"] = mx.get_peak_memory() / 1e6
        rec["rss_peak_mb"], rec["rss_peak_scope"] = _rss_peak_mb(rss_reset)
        if not run.frame_timings:
            raise RuntimeError(f"backend {backend_name!r} returned no frame timings with profile=True")
        frames = _frame_rows(run.frame_timings, drop_first=opts.drop_first, base=base)
        totals = [f["total_ms"] for f in frames if not f["dropped"]]
        rec.update(
            create_s=run.create_s,
            stream_wall_s=run.wall_s,
            frames=len(frames),
            first_audio_s=math.nan if run.first_audio_s is None else run.first_audio_s,
            first_text_s=math.nan if run.first_text_s is None else run.first_text_s,
        )
        if totals:
            rec.update(
                total_mean_ms=float(np.mean(totals)),
                total_p50_ms=float(np.percentile(totals, 50)),
                rtf=float(np.mean(totals)) / FRAME_MS,
            )
        if hasattr(backend, "asr_frame_ms"):  # backends with a transcript-only streaming session
            step = "ASR session"
            asr = backend.asr_frame_ms(stream_wave, chunk_samples=FRAME_SAMPLES)[opts.drop_first :]
            if asr:
                rec.update(asr_mean_ms=float(np.mean(asr)), asr_p50_ms=float(np.percentile(asr, 50)))
        if opts.offline:
            step = "offline generation"
            mx.reset_peak_memory()
            with _Heartbeat(progress, f"{label} offline", opts.heartbeat_s):
                off = backend.offline(
                    wave,
                    system_prompt=opts.system_prompt,
                    seed=opts.seed,
                    extra_decoding_seconds=opts.extra_decoding_seconds,
                )
            rec["offline_mlx_peak_mb"] = mx.get_peak_memory() / 1e6
            n = int(len(off.text_ids))
            rec.update(
                offline_wall_s=off.wall_s,
                offline_frames=n,
                offline_rtf=off.wall_s / (n * FRAME_MS / 1000.0) if n else math.nan,
            )
    except Exception as e:  # recorded, reported, and the benchmark goes on
        rec["status"] = "failed"
        rec["error"] = f"{step}: {type(e).__name__}: {e}".replace("\n", " ")
        progress(f"    FAILED {label} while {step}: {type(e).__name__}: {e}")
        for line in traceback.format_exc().rstrip().splitlines()[-6:]:
            progress(f"      {line}")
    finally:
        if backend is not None:
            try:
                backend.close()
            except Exception as e:  # pragma: no cover - a close that fails must not stop the benchmark
                progress(f"    warning: {label}: close() raised {type(e).__name__}: {e}")
        del backend
        _release_memory()
    return rec, frames


# -- the whole benchmark


def _default_factory(name: str):
    from harness.backends import get_backend

    return get_backend(name)


def run_bench(
    opts: BenchOptions, *, backend_factory: Callable[[str], object] | None = None, progress: Progress | None = None
) -> BenchResult:
    """Run everything `opts` asks and write the run folder (see bench.report). Returns counts of runs."""
    from . import report
    from .env import environment, sha256_file

    opts.validate()
    progress = progress or Progress()
    factory = backend_factory or _default_factory
    out = Path(opts.out)

    # Inputs first: a bad file should fail before minutes of loading.
    inputs = []
    for path in opts.audio:
        wave = load_input(path)
        silence = np.zeros(int(round(opts.extra_decoding_seconds * 16000)), np.float32)
        stream_wave = np.concatenate([wave, silence])
        if opts.frames is not None:
            stream_wave = stream_wave[: opts.frames * FRAME_SAMPLES]
        inputs.append(
            {"path": str(path), "name": _input_name(path, opts.audio), "wave": wave, "stream_wave": stream_wave}
        )

    out.mkdir(parents=True, exist_ok=True)
    ckpts = resolve_checkpoints(opts.checkpoints, progress)

    bandwidth = None
    if opts.floor:
        progress(f"measuring MLX matrix-vector bandwidth (~{opts.bandwidth_mb:g} MB per format)")
        from .floor import measure_bandwidth

        bandwidth = measure_bandwidth(opts.bandwidth_mb)
        progress("    " + ", ".join(f"{k} {v['gbps']:.2f} GB/s" for k, v in bandwidth.items()))

    env = environment([c["info"] for c in ckpts])
    env["machine"]["load_average_start"] = _loadavg()
    env["method"] = {
        "backends": list(opts.backends),
        "runs": opts.runs,
        "warmup": opts.warmup,
        "drop_first": opts.drop_first,
        "extra_decoding_seconds": float(opts.extra_decoding_seconds),
        "chunk_samples": opts.chunk_samples,
        "seed": opts.seed,
        "system_prompt": opts.system_prompt,
        "offline": opts.offline,
        "warm_page_cache": opts.warm_page_cache,
        "order": "per checkpoint and input: warm-up runs, then measured runs; within each run the backends "
        "take turns in the order given; each run loads the checkpoint, streams, runs offline, releases",
        "inputs": [
            {
                "name": i["name"],
                "path": i["path"],
                "samples": int(i["wave"].size),
                "seconds": i["wave"].size / 16000.0,
                "streamed_samples": int(i["stream_wave"].size),
                "streamed_frames": -(-int(i["stream_wave"].size) // 1280),
                "sha256": sha256_file(Path(i["path"])),
            }
            for i in inputs
        ],
    }
    env["bandwidth"] = bandwidth

    floor_rows: list[dict] = []
    dispatch_rows: list[dict] = []
    floor_errors: list[str] = []
    run_rows: list[dict] = []
    frame_rows: list[dict] = []
    total_runs = len(ckpts) * len(inputs) * (opts.warmup + opts.runs) * len(opts.backends)
    done = 0
    from voicechat.io.progress import bar

    runs_bar = bar(total=total_runs, desc="bench", unit="run", enabled=None if progress.enabled else False)
    for ci, ck in enumerate(ckpts):
        spec, folder = ck["spec"], ck["folder"]
        progress(f"checkpoint {ci + 1}/{len(ckpts)}: {spec} ({folder})")
        if opts.floor:
            try:
                floor_rows.extend(
                    _isolated(_floor_rows, spec, folder, bandwidth)
                    if opts.isolate
                    else _floor_rows(spec, folder, bandwidth)
                )
            except Exception as e:
                progress(f"    floor model failed for {spec}: {type(e).__name__}: {e}")
                floor_errors.append(f"{spec}: {type(e).__name__}: {e}")
            frames_counted = min(DISPATCH_FRAMES, opts.frames or DISPATCH_FRAMES)
            for name in opts.backends:
                progress(f"    counting dispatches and host syncs: {name}, {frames_counted} frames")
                try:
                    args = (
                        spec,
                        name,
                        folder,
                        inputs[0]["stream_wave"],
                        frames_counted,
                        min(opts.drop_first, frames_counted - 2),
                    )
                    dispatch_rows.extend(
                        _isolated(_dispatch_rows, *args) if opts.isolate else _dispatch_rows(*args, factory=factory)
                    )
                except Exception as e:
                    progress(f"    dispatch count failed for {spec} / {name}: {type(e).__name__}: {e}")
                    floor_errors.append(f"{spec} / {name} dispatch count: {type(e).__name__}: {e}")
        for inp in inputs:
            n_frames = -(-int(inp["stream_wave"].size) // 1280)  # flush runs the zero-padded partial frame
            schedule = [("warmup", i + 1) for i in range(opts.warmup)] + [("measured", i + 1) for i in range(opts.runs)]
            for phase, r in schedule:
                for name in opts.backends:
                    done += 1
                    count = opts.warmup if phase == "warmup" else opts.runs
                    label = f"{spec} | {name} | {inp['name']} | {phase} {r}/{count}"
                    progress(
                        f"[{done}/{total_runs}] {label}: ~{n_frames} frames "
                        f"({inp['wave'].size / 16000:.2f} s input + {opts.extra_decoding_seconds:g} s silence)"
                    )
                    base = {"checkpoint": spec, "backend": name, "input": inp["name"], "run": r}
                    if opts.warm_page_cache:
                        read_through(folder)
                    if opts.isolate:
                        if backend_factory is not None:
                            raise ValueError("isolate=True runs the registered backends; it takes no backend_factory")
                        rec, frames = _isolated(
                            _run_once_default,
                            name,
                            folder,
                            inp["wave"],
                            inp["stream_wave"],
                            opts,
                            base,
                            progress.enabled,
                            label,
                        )
                    else:
                        rec, frames = run_once(
                            factory,
                            name,
                            folder,
                            wave=inp["wave"],
                            stream_wave=inp["stream_wave"],
                            opts=opts,
                            base=base,
                            progress=progress,
                            label=label,
                        )
                    rec = {
                        "checkpoint": spec,
                        "backend": name,
                        "input": inp["name"],
                        "phase": phase,
                        "run": r,
                        **rec,
                    }
                    run_rows.append(rec)
                    runs_bar.update()
                    if phase == "measured":
                        frame_rows.extend(frames)
                    if rec["status"] == "ok":
                        progress(
                            f"    done: {rec['frames']} frames, total mean {rec['total_mean_ms']:.1f} ms "
                            f"p50 {rec['total_p50_ms']:.1f} ms, RTF {rec['rtf']:.2f}; load {rec['load_s']:.2f} s, "
                            f"session {rec['create_s']:.2f} s, first audio {rec['first_audio_s']:.2f} s"
                            + (
                                f"; offline {rec['offline_wall_s']:.1f} s (RTF {rec['offline_rtf']:.2f})"
                                if opts.offline
                                else ""
                            )
                        )

    runs_bar.close()
    env["floor_errors"] = floor_errors
    env["machine"]["load_average_end"] = _loadavg()
    env["wall_seconds"] = time.perf_counter() - progress.t0
    progress(f"writing reports to {out}")
    report.write_run_folder(
        out,
        env=env,
        frame_rows=frame_rows,
        run_rows=run_rows,
        floor_rows=floor_rows,
        dispatch_rows=dispatch_rows,
        plots=opts.plots,
    )
    failed = sum(1 for r in run_rows if r["status"] != "ok") + len(floor_errors)
    progress(f"finished: {len(run_rows)} runs, {failed} failed; summary in {out / 'summary.md'}")
    return BenchResult(out=out, runs=len(run_rows), failed=failed)


def _loadavg() -> list[float] | None:
    """1/5/15-minute load averages: other processes competing for the CPU skew timings."""
    try:
        import os

        return [round(x, 2) for x in os.getloadavg()]
    except (AttributeError, OSError):
        return None


def _isolated(fn, *args):
    """fn(*args) in a fresh Python process (spawned, so nothing of this one's memory is shared):
    a run's memory peaks are its own, and a model too large to sit beside another never does."""
    import multiprocessing

    with multiprocessing.get_context("spawn").Pool(1) as pool:
        return pool.apply(fn, args)


def _run_once_default(name, folder, wave, stream_wave, opts, base, progress_enabled, label):
    return run_once(
        _default_factory,
        name,
        folder,
        wave=wave,
        stream_wave=stream_wave,
        opts=opts,
        base=base,
        progress=Progress(enabled=progress_enabled),
        label=label,
    )


def _floor_rows(spec: str, folder: Path, bandwidth: dict) -> list[dict]:
    """Floor table of one checkpoint, from this project's loader (the parameter set is the checkpoint's;
    no warm-up: the floor needs only the parameters and what loading derives from them)."""
    import voicechat

    from .floor import floor_table

    model = voicechat.load(str(folder), warmup=False)
    try:
        rows = floor_table(model, bandwidth)
    finally:
        del model
        _release_memory()
    return [{"checkpoint": spec, **r} for r in rows]


# Frames streamed (per pass) to count dispatches and host syncs; counts of steady frames barely vary.
DISPATCH_FRAMES = 12


def _dispatch_rows(
    spec: str,
    backend: str,
    folder: Path,
    wave,
    frames: int,
    drop_first: int,
    *,
    factory: Callable[[str], object] | None = None,
) -> list[dict]:
    """Dispatches and host syncs per frame (bench.dispatch) of one backend, made by the run's backend
    factory, on one checkpoint."""
    from harness.backends.voicechat_backend import VoiceChatBackend

    from .dispatch import count_mlx_vlm, count_voicechat

    drop_first = max(0, drop_first)
    b = (factory or _default_factory)(backend)
    b.load(str(folder))
    try:
        if isinstance(b, VoiceChatBackend):
            with b.execution_settings():  # the backend's execution policy (chosen at its load)
                rows = count_voicechat(b.model, wave, frames=frames, drop_first=drop_first)
        else:  # mlx-vlm
            rows = count_mlx_vlm(
                partial(b.session.create_streaming_session, seed=0), wave, frames=frames, drop_first=drop_first
            )
    finally:
        b.close()
        del b
        _release_memory()
    return [{"checkpoint": spec, "backend": backend, "frames_counted": frames - drop_first, **r} for r in rows]


__all__ = ["BenchOptions", "BenchResult", "Progress", "run_bench", "run_once", "resolve_checkpoint", "read_through"]
