"""The run folder: frames.csv, runs.csv, floor.csv, summary.csv, summary.md, env.json, plots.

Files (one folder per benchmark run):

* `frames.csv`: one row per streamed frame per measured run: checkpoint, backend,
  input, run, frame_index, the stage times in ms, `dropped` (a cold frame
  excluded from the statistics).
* `runs.csv`: one row per run (warm-up and measured): status and error, load /
  session creation / first audio / first text times, stream wall time, frames,
  mean and p50 frame time, RTF, offline wall time and RTF, MLX and RSS peaks.
* `summary.csv`: one row per checkpoint x backend: per stage mean / p50 / p95 /
  max over the kept frames of all measured runs, RTF, frames per second,
  medians of the per-run times, memory peaks, the floor and ratios against the
  first backend.
* `floor.csv`: per checkpoint x backend x stage: bytes a frame reads, the floor
  time at this machine's measured bandwidth, the measured p50, their ratio.
* `env.json`: machine, OS, MLX, packages, checkpoints (hashes), git revision,
  date, the method (inputs, runs, ...) and the measured bandwidths.
* `summary.md`: the tables above for people, rendered from the files only
  (`render_markdown`), so the docs page made from a folder is reproducible.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pandas as pd

from voicechat.streaming.engine import STAGES as FRAME_STAGES

STAGES = (*FRAME_STAGES, "total")
FRAME_MS = 80.0

FRAME_COLUMNS = ["checkpoint", "backend", "input", "run", "frame_index", *[f"{s}_ms" for s in STAGES], "dropped"]
RUN_COLUMNS = [
    "checkpoint",
    "backend",
    "input",
    "phase",
    "run",
    "status",
    "error",
    "load_s",
    "create_s",
    "first_audio_s",
    "first_text_s",
    "stream_wall_s",
    "frames",
    "total_mean_ms",
    "total_p50_ms",
    "rtf",
    "offline_wall_s",
    "offline_frames",
    "offline_rtf",
    "mlx_peak_mb",
    "rss_peak_mb",
    "rss_peak_scope",
    "offline_mlx_peak_mb",
    "asr_mean_ms",
    "asr_p50_ms",
]
FLOOR_BASE_COLUMNS = [
    "checkpoint",
    "stage",
    "weight_mb",
    "state_mb",
    "bf16_mb",
    "f32_mb",
    "q4_mb",
    "q8_mb",
    "floor_ms",
    "resident_mb",
]
DISPATCH_COLUMNS = ["checkpoint", "backend", "stage", "frames_counted", "dispatches_per_frame", "syncs_per_frame"]
FLOOR_COLUMNS = [
    "checkpoint",
    "backend",
    *FLOOR_BASE_COLUMNS[1:],
    "measured_mean_ms",
    "measured_p50_ms",
    "p50_over_floor",
]
PER_RUN_MEDIANS = (
    "load_s",
    "create_s",
    "first_audio_s",
    "first_text_s",
    "offline_wall_s",
    "offline_rtf",
    "asr_mean_ms",
    "asr_p50_ms",
)
SUMMARY_COLUMNS = (
    [
        "checkpoint",
        "backend",
        "synthetic",
        "status",
        "runs_ok",
        "runs_failed",
        "warmup_failed",
        "inputs",
        "frames",
        "dropped_per_run",
    ]
    + [f"{s}_{k}_ms" for s in STAGES for k in ("mean", "p50", "p95", "max")]
    + [
        "rtf",
        "frames_per_second",
        *PER_RUN_MEDIANS,
        "first_frame_ms",
        "first_frame_over_p50",
        "mlx_peak_mb",
        "rss_peak_mb",
        "floor_ms",
        "total_p50_over_floor",
        "baseline",
        "rtf_vs_baseline",
    ]
    + [f"{s}_p50_vs_baseline" for s in STAGES]
    + ["errors"]
)
PLOTS = {
    "frame_times.png": "Per-frame total time over the session",
    "stage_p50.png": "Per-stage p50 frame time",
    "frame_cdf.png": "Distribution of frame times (CDF)",
    "floor.png": "Measured p50 vs the physical floor per stage",
}


# -- aggregation


def _nan(x) -> float:
    return math.nan if x is None else float(x)


def _median(series: pd.Series) -> float:
    s = pd.to_numeric(series, errors="coerce").dropna()
    return float(s.median()) if len(s) else math.nan


def _max(series: pd.Series) -> float:
    s = pd.to_numeric(series, errors="coerce").dropna()
    return float(s.max()) if len(s) else math.nan


def _ratio(a: float, b: float) -> float:
    return a / b if b and math.isfinite(b) and b > 0 else math.nan


def summarize(frames: pd.DataFrame, runs: pd.DataFrame, floor: pd.DataFrame, env: dict) -> pd.DataFrame:
    """One row per checkpoint x backend (order: as given on the command line)."""
    method = env["method"]
    synthetic = {c["spec"]: bool(c.get("synthetic")) for c in env["checkpoints"]}
    rows = []
    for ck in [c["spec"] for c in env["checkpoints"]]:
        for be in method["backends"]:
            f = frames[(frames.checkpoint == ck) & (frames.backend == be)]
            kept = f[~f.dropped.astype(bool)]
            r = runs[(runs.checkpoint == ck) & (runs.backend == be)]
            measured = r[r.phase == "measured"]
            ok = measured[measured.status == "ok"]
            failed = r[r.status != "ok"]
            row = {
                "checkpoint": ck,
                "backend": be,
                "synthetic": synthetic.get(ck, False),
                "runs_ok": int(len(ok)),
                "runs_failed": int((measured.status != "ok").sum()),
                "warmup_failed": int((r[r.phase == "warmup"].status != "ok").sum()),
                "inputs": " ".join(sorted(set(map(str, measured.input)))) if len(measured) else "",
                "frames": int(len(kept)),
                "dropped_per_run": int(method["drop_first"]),
            }
            if row["runs_ok"] == 0:
                row["status"] = "failed"
            elif row["runs_failed"] or row["warmup_failed"]:
                row["status"] = "partial"
            else:
                row["status"] = "ok"
            for s in STAGES:
                v = kept[f"{s}_ms"].astype(float)
                row[f"{s}_mean_ms"] = float(v.mean()) if len(v) else math.nan
                # pandas' default linear interpolation at (n-1)p, as the session profiler
                row[f"{s}_p50_ms"] = float(v.quantile(0.50)) if len(v) else math.nan
                row[f"{s}_p95_ms"] = float(v.quantile(0.95)) if len(v) else math.nan
                row[f"{s}_max_ms"] = float(v.max()) if len(v) else math.nan
            mean_total = row["total_mean_ms"]
            row["rtf"] = mean_total / FRAME_MS
            row["frames_per_second"] = 1000.0 / mean_total if mean_total and mean_total > 0 else math.nan
            for k in PER_RUN_MEDIANS:
                row[k] = _median(ok[k]) if k in ok and len(ok) else math.nan
            # The first frame after session creation (frame 0 of each measured run; median over runs).
            meas_runs = set(measured.run) if "run" in measured else set()
            first = f[(f.frame_index == 0) & f.run.isin(meas_runs)] if "run" in f and len(f) else f.iloc[0:0]
            row["first_frame_ms"] = _median(first.total_ms) if len(first) else math.nan
            row["first_frame_over_p50"] = _ratio(row["first_frame_ms"], row["total_p50_ms"])
            row["mlx_peak_mb"] = _max(ok.mlx_peak_mb) if len(ok) else math.nan
            row["rss_peak_mb"] = _max(ok.rss_peak_mb) if len(ok) else math.nan
            fl = floor[(floor.checkpoint == ck) & (floor.stage == "total")] if len(floor) else floor
            row["floor_ms"] = float(fl.floor_ms.iloc[0]) if len(fl) else math.nan
            row["total_p50_over_floor"] = (
                row["total_p50_ms"] / row["floor_ms"] if row["floor_ms"] and row["floor_ms"] > 0 else math.nan
            )
            errors = sorted({str(e) for e in failed.error if str(e)})
            row["errors"] = " | ".join(errors)
            rows.append(row)
    # Ratios against the first backend given for the checkpoint that has results ("baseline").
    for ck in dict.fromkeys(r["checkpoint"] for r in rows):
        sel = [r for r in rows if r["checkpoint"] == ck]
        good = [r for r in sel if r["runs_ok"] > 0]
        for r in sel:
            base = good[0] if good else None
            r["baseline"] = base["backend"] if base else ""
            r["rtf_vs_baseline"] = _ratio(r["rtf"], base["rtf"]) if base else math.nan
            for st in STAGES:
                r[f"{st}_p50_vs_baseline"] = _ratio(r[f"{st}_p50_ms"], base[f"{st}_p50_ms"]) if base else math.nan
    df = pd.DataFrame(rows, columns=SUMMARY_COLUMNS)
    return df


def floor_with_measured(floor: pd.DataFrame, summary: pd.DataFrame) -> pd.DataFrame:
    """floor.csv rows: each checkpoint's floor per stage beside each backend's measured times."""
    rows = []
    for _, s in summary.iterrows():
        fl = floor[floor.checkpoint == s.checkpoint] if len(floor) else floor
        for _, f in fl.iterrows():
            row = {"checkpoint": s.checkpoint, "backend": s.backend}
            row.update({k: f.get(k, math.nan) for k in FLOOR_BASE_COLUMNS[1:]})
            row["measured_mean_ms"] = s[f"{f.stage}_mean_ms"]
            row["measured_p50_ms"] = s[f"{f.stage}_p50_ms"]
            row["p50_over_floor"] = row["measured_p50_ms"] / f.floor_ms if f.floor_ms > 0 else math.nan
            rows.append(row)
    return pd.DataFrame(rows, columns=FLOOR_COLUMNS)


# -- writing


def _json_default(o):
    if isinstance(o, (np.integer,)):
        return int(o)
    if isinstance(o, (np.floating,)):
        return float(o)
    if isinstance(o, Path):
        return str(o)
    raise TypeError(f"not JSON serializable: {type(o).__name__}")


def write_run_folder(
    out: Path,
    *,
    env: dict,
    frame_rows: list[dict],
    run_rows: list[dict],
    floor_rows: list[dict],
    dispatch_rows: list[dict] | None = None,
    plots: bool = True,
) -> dict[str, Path]:
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    frames = pd.DataFrame(frame_rows, columns=FRAME_COLUMNS)
    runs = pd.DataFrame(run_rows, columns=RUN_COLUMNS)
    floor = pd.DataFrame(floor_rows, columns=FLOOR_BASE_COLUMNS)
    summary = summarize(frames, runs, floor, env)
    floor_full = floor_with_measured(floor, summary)
    paths = {
        name: out / name for name in ("frames.csv", "runs.csv", "summary.csv", "floor.csv", "env.json", "summary.md")
    }
    frames.to_csv(paths["frames.csv"], index=False)
    runs.to_csv(paths["runs.csv"], index=False)
    summary.to_csv(paths["summary.csv"], index=False)
    floor_full.to_csv(paths["floor.csv"], index=False)
    if dispatch_rows:
        paths["dispatch.csv"] = out / "dispatch.csv"
        pd.DataFrame(dispatch_rows, columns=DISPATCH_COLUMNS).to_csv(paths["dispatch.csv"], index=False)
    paths["env.json"].write_text(json.dumps(env, indent=2, default=_json_default, allow_nan=True) + "\n")
    if plots:
        from .plots import make_plots

        paths.update(make_plots(out))
    paths["summary.md"].write_text(render_markdown(out))
    return paths


# -- Markdown (from the folder's files only)


def _fmt(x, digits: int = 1, suffix: str = "") -> str:
    try:
        v = float(x)
    except (TypeError, ValueError):
        return str(x) if x not in (None, "") else "n/a"
    if not math.isfinite(v):
        return "n/a"
    return f"{v:.{digits}f}{suffix}"


def _ms(x) -> str:
    try:
        v = float(x)
    except (TypeError, ValueError):
        return "n/a"
    if not math.isfinite(v):
        return "n/a"
    if v == 0:
        return "0"
    if abs(v) < 1:
        return f"{v:.3g}"  # floors of small stages are fractions of a millisecond
    return f"{v:.2f}" if abs(v) < 10 else f"{v:.1f}"


def _table(headers: list[str], rows: list[list[str]], align: str | None = None) -> str:
    align = align or ("l" + "r" * (len(headers) - 1))
    sep = ["---:" if a == "r" else ":---" for a in align]
    lines = ["| " + " | ".join(headers) + " |", "| " + " | ".join(sep) + " |"]
    lines += ["| " + " | ".join(str(c).replace("|", "\\|") for c in r) + " |" for r in rows]
    return "\n".join(lines)


def machine_line(env: dict) -> str:
    """The summary's machine line from env.json."""
    m = env["machine"]
    return (
        f"- **Machine:** {m.get('cpu')}, {m.get('usable_cpus')} usable CPU cores "
        f"({m.get('cpu_count')} online), {m.get('memory_gib')} GiB RAM; {m.get('platform')}"
    )


def software_line(env: dict) -> str:
    """The summary's software line from env.json: MLX, its device, Python, this project at its revision."""
    mlx, pk = env["mlx"], env["packages"]
    return (
        f"- **Software:** MLX {mlx.get('version')} on `{mlx.get('default_device')}` "
        f"(Metal {'available' if mlx.get('metal_available') else 'not available'}), "
        f"Python {env['python']['version']}, voicechat-mlx {pk.get('voicechat-mlx')} at git "
        f"`{_short(env.get('git_revision'))}`"
    )


def machine_load_line(machine: dict, under_load: str) -> str | None:
    """The summary's machine-load line from env.json's `machine` (None without load averages); when the
    1-minute load exceeded 0.75 of the usable cores it adds "other processes were competing for the
    CPU: " + `under_load`."""
    la0, la1 = machine.get("load_average_start"), machine.get("load_average_end")
    if not (la0 or la1):
        return None
    busy = max((la0 or [0])[:1] + (la1 or [0])[:1]) > (machine.get("usable_cpus") or 1) * 0.75
    return (
        f"- **Machine load** (1/5/15-min load average, {machine.get('usable_cpus')} cores): "
        f"{' / '.join(f'{x:g}' for x in la0) if la0 else 'n/a'} at the start, "
        f"{' / '.join(f'{x:g}' for x in la1) if la1 else 'n/a'} at the end"
        + (f" (other processes were competing for the CPU: {under_load})" if busy else "")
    )


def _short(h) -> str:
    return str(h)[:12] if h else "n/a"


def _ckpt_label(info: dict) -> str:
    if info.get("synthetic"):
        b = info.get("bits")
        width = f"{b}-bit" if b else "bf16"
        return f"`{info['spec']}` (synthetic, preset {info.get('preset')}, {width}, seed {info.get('seed')})"
    q = info.get("quantization") or {}
    return f"`{info['spec']}` ({q.get('bits')}-bit)" if q.get("bits") else f"`{info['spec']}`"


def read_run_folder(run_dir: Path) -> dict:
    run_dir = Path(run_dir)
    missing = [n for n in ("env.json", "summary.csv", "runs.csv", "floor.csv") if not (run_dir / n).is_file()]
    if missing:
        raise FileNotFoundError(f"{run_dir} is not a benchmark run folder: missing {', '.join(missing)}")
    return {
        "env": json.loads((run_dir / "env.json").read_text()),
        "summary": pd.read_csv(run_dir / "summary.csv", keep_default_na=False, na_values=[""]),
        "runs": pd.read_csv(run_dir / "runs.csv", keep_default_na=False, na_values=[""]),
        "floor": pd.read_csv(run_dir / "floor.csv", keep_default_na=False, na_values=[""]),
        "dispatch": (
            pd.read_csv(run_dir / "dispatch.csv", keep_default_na=False, na_values=[""])
            if (run_dir / "dispatch.csv").is_file()
            else None
        ),
    }


def render_markdown(run_dir: Path, *, link_prefix: str = "", level: int = 1, title: str | None = None) -> str:
    """The report of a run folder as Markdown. Deterministic: depends only on the folder's files."""
    run_dir = Path(run_dir)
    d = read_run_folder(run_dir)
    env, summary, runs, floor = d["env"], d["summary"], d["runs"], d["floor"]
    method = env["method"]
    h = "#" * level
    out: list[str] = []
    date = env.get("date", "n/a")
    out.append(f"{h} {title or 'VoiceChat MLX benchmark'}: {date[:10]}")
    out.append("")
    synth = [c for c in env["checkpoints"] if c.get("synthetic")]
    if synth:
        out.append(
            "> **Synthetic weights.** "
            + ", ".join(f"`{c['spec']}`" for c in synth)
            + (" is" if len(synth) == 1 else " are")
            + " random-weight checkpoint(s) written by `voicechat.synthetic` in the published on-disk layout "
            "and quantization, not the trained model. The `small` preset has the real depth and frame "
            "geometry with widths divided by about 8, so these timings are not the 11B model's."
        )
        out.append("")
    m, pk, mlx = env["machine"], env["packages"], env["mlx"]
    peers = [f"{p} {pk[p]}" for p in ("mlx-vlm", "mlx-audio") if pk.get(p)]
    out.append(machine_line(env))
    out.append(software_line(env) + (", " + ", ".join(peers) if peers else ""))
    policy = mlx.get("voicechat_policy")
    if policy is not None:
        from voicechat.runtime.policy import switched_on

        on = switched_on(policy)
        out.append(
            f"- **Execution policy** of the `voicechat` backend (`voicechat.runtime.ExecutionPolicy`, "
            f"chosen at load): {policy.get('cpu_streams')} CPU stream(s); on: {', '.join(on) or 'nothing'}"
            + (
                f"; CPU kernels {mlx.get('voicechat_cpu_qmv_isa')}"
                if policy.get("cpu_kernels")
                else f"; CPU kernels off ({mlx.get('voicechat_cpu_qmv_unavailable') or 'not for this device'})"
            )
            + ". `voicechat-serial` runs `ExecutionPolicy.serial()`, `voicechat-gpu-policy` "
            "`ExecutionPolicy.gpu()`; the reference runs on one stream"
        )
    elif mlx.get("voicechat_cpu_streams") is not None:  # env.json written before the policy existed
        out.append(
            f"- **CPU streams per frame** (this project; `VOICECHAT_CPU_STREAMS`): "
            f"{mlx['voicechat_cpu_streams']}; the reference runs on one stream"
            + (
                f". Compiled fixed-shape pieces (`VOICECHAT_COMPILE`): {'on' if mlx['voicechat_compile'] else 'off'}"
                if "voicechat_compile" in mlx
                else ""
            )
            + (
                f". Codec float32 products through numpy's BLAS (`VOICECHAT_HOST_GEMM`): "
                f"{'on' if mlx['voicechat_host_gemm'] else 'off'}"
                if "voicechat_host_gemm" in mlx
                else ""
            )
            + (
                ". Quantized matrix-vector products through `cpu_qmv` (`VOICECHAT_CPU_QMV`; MLX's bits): "
                + (
                    f"on ({mlx.get('voicechat_cpu_qmv_isa')})"
                    if mlx["voicechat_cpu_qmv"]
                    else f"off ({mlx.get('voicechat_cpu_qmv_unavailable') or 'switched off'})"
                )
                if "voicechat_cpu_qmv" in mlx
                else ""
            )
            + (
                f". Layer by layer evaluation overlapped with graph building (`VOICECHAT_OVERLAP`): "
                f"{'on' if mlx['voicechat_overlap'] else 'off'}"
                if "voicechat_overlap" in mlx
                else ""
            )
        )
    load = machine_load_line(m, "absolute times are pessimistic; the interleaved backends saw the same load")
    if load:
        out.append(load)
    ws = env.get("wall_seconds")
    out.append(f"- **Date:** {date} (UTC)" + (f"; the benchmark took {ws / 60:.0f} min" if ws else ""))
    out.append("")
    out.append(f"{h}# Method")
    out.append("")
    for inp in method["inputs"]:
        out.append(
            f"- **Input** `{inp['name']}`: {inp['seconds']:.2f} s of 16 kHz speech, then "
            f"{method['extra_decoding_seconds']:g} s of silence (extra decoding time for the answer): "
            f"{inp['streamed_frames']} streamed frames of 80 ms."
        )
    out.append(
        f"- **Streaming:** a new session per run with the profiler on, fed {method['chunk_samples']}-sample "
        f"pushes, then `flush()`; every stage ends with its outputs evaluated, so stage times are compute "
        f"times. Seed {method['seed']}, system prompt "
        f"{'none' if method.get('system_prompt') is None else repr(method['system_prompt'])}."
    )
    out.append(
        f"- **Runs:** {method['warmup']} warm-up run(s) (not counted), then {method['runs']} measured run(s) "
        f"per checkpoint and backend; the backends take turns within each run "
        f"({' → '.join(method['backends'])}), each run loads the checkpoint afresh and releases it"
        + (
            "; before each run the checkpoint's files are read once, so every load starts from the same "
            "page cache (*load s* is not the disk's speed)."
            if method.get("warm_page_cache")
            else "."
        )
    )
    out.append(
        f"- **Statistics:** the first {method['drop_first']} frames of every run are dropped (cold start); "
        f"the rest of all measured runs are pooled. RTF = mean frame time / 80 ms "
        f"(above 1.0 the stream falls behind real time). Per-run times are medians over the measured runs; "
        f"memory peaks are maxima."
    )
    if method.get("offline"):
        out.append(
            f"- **Offline:** after each stream, the offline path (`generate`) on the same input with "
            f"{method['extra_decoding_seconds']:g} s extra decoding, wall time; offline RTF = wall time / "
            f"(frames × 80 ms)."
        )
    out.append("")
    out.append("Checkpoints:")
    out.append("")
    out.append(
        _table(
            ["checkpoint", "on disk", "config.json sha256", "index sha256"],
            [
                [
                    _ckpt_label(c),
                    _fmt(c.get("weights_bytes_on_disk", math.nan) / 1e6, 1, " MB"),
                    f"`{_short(c.get('config_sha256'))}`",
                    f"`{_short(c.get('index_sha256'))}`",
                ]
                for c in env["checkpoints"]
            ],
            "llll",
        )
    )
    out.append("")

    out.append(f"{h}# Real-time summary")
    out.append("")
    rows = []
    for _, s in summary.iterrows():
        rows.append(
            [
                f"`{s.checkpoint}`",
                s.backend,
                s.status,
                f"{int(s.runs_ok)}",
                f"{int(s.frames)}",
                _fmt(s.rtf, 2),
                _fmt(s.frames_per_second, 2),
                _ms(s.total_p50_ms),
                _ms(s.total_p95_ms),
                _fmt(s.load_s, 2),
                _fmt(s.create_s, 2),
                _fmt(s.first_audio_s, 2),
                _fmt(s.first_text_s, 2),
                _fmt(s.offline_rtf, 2),
                _fmt(s.mlx_peak_mb, 0),
                _fmt(s.rss_peak_mb, 0),
            ]
        )
    out.append(
        _table(
            [
                "checkpoint",
                "backend",
                "status",
                "runs",
                "frames",
                "RTF",
                "frames/s",
                "p50 ms",
                "p95 ms",
                "load s",
                "session s",
                "first audio s",
                "first text s",
                "offline RTF",
                "MLX peak MB",
                "RSS peak MB",
            ],
            rows,
            "lll" + "r" * 13,
        )
    )
    out.append("")
    out.append(
        "RTF: mean frame time / 80 ms (real time needs < 1.0). *session s*: session creation including "
        "the TTS speaker warm-up where the backend does it there. *first audio / first text*: from the "
        "first push to the return of the push that produced the first `Audio` / assistant text event. "
        "MLX peak: `mx.get_peak_memory()` over load + stream; RSS peak: the process's resident-set peak "
        "over the same span."
    )
    out.append("")

    rows = [
        [
            f"`{s.checkpoint}`",
            s.backend,
            _ms(s.first_frame_ms),
            _ms(s.total_p50_ms),
            _fmt(s.first_frame_over_p50, 2, "×"),
            _ms(s.asr_mean_ms),
            _ms(s.asr_p50_ms),
        ]
        for _, s in summary.iterrows()
    ]
    out.append(f"{h}# First frame and ASR session")
    out.append("")
    out.append(
        _table(
            [
                "checkpoint",
                "backend",
                "first frame ms",
                "steady p50 ms",
                "first / p50",
                "ASR mean ms/frame",
                "ASR p50 ms/frame",
            ],
            rows,
            "llrrrrr",
        )
    )
    out.append("")
    out.append(
        "*First frame*: the profiled frame 0 right after `create_streaming_session` (median over the "
        "measured runs). *ASR*: a transcript-only streaming session (`create_asr_session`: log-mel, "
        "cache-aware conformer, RNNT) over the same input in 1280-sample steps, wall time per step after "
        "the dropped frames; empty where the backend has none."
    )
    out.append("")

    out.append(f"{h}# Per-stage frame time (ms)")
    out.append("")
    rows = []
    for _, s in summary.iterrows():
        for st in STAGES:
            rows.append(
                [
                    f"`{s.checkpoint}`",
                    s.backend,
                    st if st != "total" else "**total**",
                    _ms(s[f"{st}_mean_ms"]),
                    _ms(s[f"{st}_p50_ms"]),
                    _ms(s[f"{st}_p95_ms"]),
                    _ms(s[f"{st}_max_ms"]),
                ]
            )
    out.append(_table(["checkpoint", "backend", "stage", "mean", "p50", "p95", "max"], rows, "lllrrrr"))
    out.append("")
    out.append(
        "Stages: perception (streaming log-mel + conformer + projection), rnnt (user transcript), language "
        "(Nemotron-H step + text/function heads), tts (EAR-TTS step: backbone + MoG refinement), codec "
        "(one 80 ms audio frame). The stage percentiles are taken separately, so they do not add up to the "
        "total's."
    )
    out.append("")

    backends = list(method["backends"])
    if len(backends) > 1:
        out.append(f"{h}# Backend ratios")
        out.append("")
        rows = []
        for _, s in summary.iterrows():
            if not isinstance(s.baseline, str) or s.backend == s.baseline:
                continue
            rows.append(
                [f"`{s.checkpoint}`", f"{s.backend} / {s.baseline}", _fmt(s.rtf_vs_baseline, 2, "×")]
                + [_fmt(s[f"{st}_p50_vs_baseline"], 2, "×") for st in STAGES]
            )
        if rows:
            out.append(_table(["checkpoint", "ratio", "RTF"] + [f"{st} p50" for st in STAGES], rows, "ll" + "r" * 7))
            out.append("")
            out.append("Time of the first-named backend divided by the second's: above 1× the second is faster.")
        else:
            out.append("No ratio: fewer than two backends completed a run for any checkpoint.")
        out.append("")

    bw = env.get("bandwidth")
    if bw and len(floor):
        out.append(f"{h}# Physical floor")
        out.append("")
        out.append(
            "Weight bytes one steady-state frame must read per stage (from the loaded model's parameters: "
            "embedding 3 rows, RNNT one symbol iteration, MoG trunk once per refinement pass, `proj_mus` "
            "64 rows per pass, one codebook row per RVQ level; Mamba SSM states read and written in "
            "float32), divided by the read rate MLX reaches on this machine for a large matrix-vector "
            "product in the same format:"
        )
        out.append("")
        out.append(
            _table(
                ["format", "GB/s", "matrix", "kernel", "CPU streams"],
                [
                    [k, _fmt(v["gbps"], 2), _fmt(v["matrix_mb"], 0, " MB"), v["kernel"], str(v.get("streams", 1))]
                    for k, v in bw.items()
                ],
                "lrrlr",
            )
        )
        out.append("")
        rows = []
        for _, f in floor.iterrows():
            rows.append(
                [
                    f"`{f.checkpoint}`",
                    f.backend,
                    f.stage if f.stage != "total" else "**total**",
                    _ms(f.weight_mb),
                    _ms(f.state_mb),
                    _ms(f.floor_ms),
                    _ms(f.measured_p50_ms),
                    _fmt(f.p50_over_floor, 1, "×"),
                    _fmt(f.get("resident_mb", math.nan), 0),
                ]
            )
        out.append(
            _table(
                [
                    "checkpoint",
                    "backend",
                    "stage",
                    "weights MB/frame",
                    "state MB/frame",
                    "floor ms",
                    "measured p50 ms",
                    "measured / floor",
                    "resident MB",
                ],
                rows,
                "lll" + "r" * 6,
            )
        )
        out.append("")
        out.append(
            "measured / floor: how many times faster the stage could get if it did nothing but read its "
            "weights (and states) once at the measured rate. Near 1× the stage is bound by that rate; far "
            "above it, by per-operation overhead, host synchronisation or recomputation. resident MB: "
            "what this project's loaded model keeps for the stage (parameters as `load` stores them: on a "
            "CPU bf16 W.T or float32 copies in place of their originals; cached derived arrays; `total` "
            "includes speaker latents and control codes)."
        )
        out.append("")
    dispatch = d.get("dispatch")
    if dispatch is not None and len(dispatch):
        out.append(f"{h}# Dispatches and host synchronisations per frame")
        out.append("")
        rows = [
            [
                f"`{r.checkpoint}`",
                r.backend,
                r.stage if r.stage != "total" else "**total**",
                _fmt(r.dispatches_per_frame, 0),
                _fmt(r.syncs_per_frame, 1),
                str(int(r.frames_counted)),
            ]
            for r in dispatch.itertuples()
        ]
        out.append(
            _table(["checkpoint", "backend", "stage", "operations dispatched", "host syncs", "frames"], rows, "lllrrr")
        )
        out.append("")
        out.append(
            "Counted from MLX's graph (bench/dispatch.py): before every evaluation (`mx.eval`, `.item()`, "
            "`.tolist()`, numpy reading an array) the operation nodes it runs are counted; each is one "
            "kernel dispatch on the CPU backend (a compiled function is one). A host sync is an "
            "evaluation that ran at least one node. Steady frames of the first input after the dropped "
            "ones; this project's stages from a profiled pass (dispatches) and an unprofiled one (syncs); "
            "mlx-vlm per frame only."
        )
        out.append("")
    for e in env.get("floor_errors") or []:
        out.append(f"- floor model failed: {e}")

    failed = runs[runs.status != "ok"]
    if len(failed):
        out.append(f"{h}# Failures")
        out.append("")
        out.append(
            _table(
                ["checkpoint", "backend", "input", "phase", "run", "error"],
                [
                    [f"`{r.checkpoint}`", r.backend, r.input, r.phase, f"{int(r.run)}", str(r.error)]
                    for _, r in failed.iterrows()
                ],
                "llllrl",
            )
        )
        out.append("")

    present = [(n, t) for n, t in PLOTS.items() if (run_dir / n).is_file()]
    if present:
        out.append(f"{h}# Plots")
        out.append("")
        for name, t in present:
            out.append(f"![{t}]({link_prefix}{name})")
            out.append("")
    return "\n".join(out).rstrip() + "\n"


__all__ = [
    "summarize",
    "floor_with_measured",
    "write_run_folder",
    "render_markdown",
    "read_run_folder",
    "FRAME_COLUMNS",
    "RUN_COLUMNS",
    "SUMMARY_COLUMNS",
    "FLOOR_COLUMNS",
    "PLOTS",
]
