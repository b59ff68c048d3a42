"""PNG plots of a run folder (matplotlib, Agg): frame times over the session, stacked stage p50s, CDF, floor."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pandas as pd

from voicechat.streaming.engine import STAGES

STAGE_COLORS = {"perception": "#4C72B0", "rnnt": "#8172B3", "language": "#DD8452", "tts": "#55A868", "codec": "#C44E52"}
FRAME_MS = 80.0


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    plt.rcParams.update(
        {
            "font.size": 10,
            "axes.titlesize": 11,
            "figure.dpi": 110,
            "savefig.dpi": 110,
            "axes.grid": True,
            "grid.alpha": 0.3,
        }
    )
    return plt


def _ms_axis(ax, axis: str = "y") -> None:
    """Log scale with plain millisecond tick labels."""
    from matplotlib.ticker import FuncFormatter, LogLocator

    fmt = FuncFormatter(lambda v, _: f"{v:g}")
    target = ax.yaxis if axis == "y" else ax.xaxis
    (ax.set_yscale if axis == "y" else ax.set_xscale)("log")
    target.set_major_locator(LogLocator(base=10, subs=(1.0, 2.0, 5.0)))
    target.set_major_formatter(fmt)
    target.set_minor_formatter(FuncFormatter(lambda v, _: ""))


def _series(env: dict) -> list[tuple[str, str]]:
    return [(c["spec"], b) for c in env["checkpoints"] for b in env["method"]["backends"]]


def _backend_colors(env: dict) -> dict:
    """One colour per backend, the same in every plot and subplot."""
    import matplotlib

    cmap = matplotlib.colormaps["tab10"]
    return {b: cmap(i % 10) for i, b in enumerate(env["method"]["backends"])}


LINESTYLES = ("-", "--", ":", "-.")


def _synthetic_note(env: dict) -> str:
    return " (synthetic weights)" if any(c.get("synthetic") for c in env["checkpoints"]) else ""


def plot_frame_times(frames: pd.DataFrame, env: dict, path: Path) -> None:
    plt = _plt()
    ckpts = [c["spec"] for c in env["checkpoints"]]
    colors = _backend_colors(env)
    drop = env["method"]["drop_first"]
    fig, axes = plt.subplots(len(ckpts), 1, figsize=(10, 3.2 * len(ckpts) + 1.4), sharex=True, squeeze=False)
    handles = {}
    for ax, ck in zip(axes[:, 0], ckpts, strict=True):
        for be in env["method"]["backends"]:
            f = frames[(frames.checkpoint == ck) & (frames.backend == be)]
            if not len(f):
                continue
            g = f.groupby("frame_index").total_ms
            idx = np.asarray(g.median().index, dtype=float)
            t = idx * FRAME_MS / 1000.0
            n_runs = f.groupby(["input", "run"]).ngroups
            band = ax.fill_between(t, g.min().values, g.max().values, color=colors[be], alpha=0.2, linewidth=0)
            (line,) = ax.plot(t, g.median().values, color=colors[be], linewidth=1.3)
            handles[f"{be}: median over {n_runs} run{'s' if n_runs != 1 else ''}"] = line
            handles[f"{be}: min to max over the runs"] = band
        handles["80 ms real-time budget"] = ax.axhline(FRAME_MS, color="black", linestyle="--", linewidth=1.1)
        if drop:
            handles[f"first {drop} frames (dropped from the statistics)"] = ax.axvspan(
                -0.04, (drop - 0.5) * FRAME_MS / 1000.0, color="grey", alpha=0.15
            )
        _ms_axis(ax, "y")
        ax.set_ylabel("time per frame (ms, log)")
        ax.set_title(ck, fontsize=10)
    axes[-1, 0].set_xlabel("position in the session (s of streamed audio; one frame = 80 ms)")
    fig.suptitle(
        "Processing time of each 80 ms frame over a streamed session"
        + _synthetic_note(env)
        + "\nbelow the dashed line a frame is processed faster than real time",
        fontsize=11,
    )
    fig.legend(list(handles.values()), list(handles.keys()), loc="lower center", ncol=3, fontsize=8, frameon=False)
    fig.tight_layout(rect=(0, 0.09 if len(handles) > 3 else 0.06, 1, 1))
    fig.savefig(path)
    plt.close(fig)


def plot_stage_p50(summary: pd.DataFrame, env: dict, path: Path) -> None:
    plt = _plt()
    ok = summary[summary.runs_ok > 0].reset_index(drop=True)
    fig, ax = plt.subplots(figsize=(max(6.0, 1.7 * len(ok) + 3.0), 5.2))
    x = np.arange(len(ok))
    bottom = np.zeros(len(ok))
    for st in STAGES:
        v = ok[f"{st}_p50_ms"].astype(float).fillna(0).values
        ax.bar(x, v, bottom=bottom, color=STAGE_COLORS[st], width=0.6, label=st, edgecolor="white", linewidth=0.5)
        for xi, b, h in zip(x, bottom, v, strict=True):
            if h > 0.06 * max(1e-9, float((ok[[f"{s}_p50_ms" for s in STAGES]].sum(axis=1)).max())):
                ax.text(xi, b + h / 2, f"{h:.0f}", ha="center", va="center", fontsize=8, color="white")
        bottom += v
    totals = ok.total_p50_ms.astype(float).values
    ax.scatter(x, totals, marker="D", color="black", zorder=3, s=22, label="p50 of the whole frame")
    for xi, b, t in zip(x, bottom, totals, strict=True):
        ax.text(xi, max(b, t) * 1.02, f"{t:.0f} ms\n= {t / FRAME_MS:.2f} × 80 ms", ha="center", va="bottom", fontsize=8)
    ax.axhline(FRAME_MS, color="black", linestyle="--", linewidth=1.1, label="80 ms real-time budget")
    ax.set_xticks(x)
    ax.set_xticklabels([f"{c}\n{b}" for c, b in zip(ok.checkpoint, ok.backend, strict=True)], fontsize=9)
    ax.set_ylabel("p50 time per frame (ms)")
    ax.set_ylim(
        0,
        max(float(np.nanmax(bottom)) if len(bottom) else 1, float(np.nanmax(totals)) if len(totals) else 1, FRAME_MS)
        * 1.22,
    )
    ax.grid(axis="x", visible=False)
    ax.set_title(
        "Median (p50) time per stage of one 80 ms frame, stacked"
        + _synthetic_note(env)
        + "\n(bar height: sum of the stage p50s; diamond: p50 of the whole frame)"
    )
    handles, labels = ax.get_legend_handles_labels()
    ax.legend(handles, labels, loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def plot_cdf(frames: pd.DataFrame, env: dict, path: Path) -> None:
    plt = _plt()
    colors = _backend_colors(env)
    ckpts = [c["spec"] for c in env["checkpoints"]]
    kept = frames[~frames.dropped.astype(bool)]
    fig, ax = plt.subplots(figsize=(9.5, 5.4))
    for ck, be in _series(env):
        v = np.sort(kept[(kept.checkpoint == ck) & (kept.backend == be)].total_ms.astype(float).values)
        if not len(v):
            continue
        y = np.arange(1, len(v) + 1) / len(v)
        c, ls = colors[be], LINESTYLES[ckpts.index(ck) % len(LINESTYLES)]
        p50, p95 = float(np.percentile(v, 50)), float(np.percentile(v, 95))
        ax.step(
            v,
            y,
            where="post",
            color=c,
            linestyle=ls,
            linewidth=1.4,
            label=f"{ck} | {be}: p50 {p50:.1f} ms, p95 {p95:.1f} ms ({len(v)} frames)",
        )
        ax.plot([p50], [0.50], marker="o", color=c, markersize=7, markeredgecolor="black", zorder=3)
        ax.plot([p95], [0.95], marker="^", color=c, markersize=7, markeredgecolor="black", zorder=3)
    ax.axvline(FRAME_MS, color="black", linestyle="--", linewidth=1.1, label="80 ms real-time budget")
    ax.axhline(0.5, color="grey", linewidth=0.6, linestyle=":")
    ax.axhline(0.95, color="grey", linewidth=0.6, linestyle=":")
    ax.plot([], [], "o", color="white", markeredgecolor="black", label="marker: p50 (median)")
    ax.plot([], [], "^", color="white", markeredgecolor="black", label="marker: p95")
    _ms_axis(ax, "x")
    ax.set_xlabel("time per frame (ms, log)")
    ax.set_ylabel("fraction of frames taking at most this long")
    ax.set_ylim(0, 1.02)
    ax.set_title(
        "Distribution of per-frame processing time (CDF)"
        + _synthetic_note(env)
        + f"\nmeasured runs pooled, first {env['method']['drop_first']} frames of each run dropped"
    )
    ax.legend(loc="lower right", fontsize=8, framealpha=0.9)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def plot_floor(floor: pd.DataFrame, env: dict, path: Path) -> None:
    plt = _plt()
    ckpts = [c for c in (c["spec"] for c in env["checkpoints"]) if c in set(floor.checkpoint)]
    backends = env["method"]["backends"]
    stages = list(STAGES) + ["total"]
    colors = _backend_colors(env)
    fig, axes = plt.subplots(1, len(ckpts), figsize=(6.2 * len(ckpts), 5.0), squeeze=False, sharey=True)
    width = 0.8 / (1 + len(backends))
    for ax, ck in zip(axes[0], ckpts, strict=True):
        f = floor[floor.checkpoint == ck]
        x = np.arange(len(stages))
        first = f[f.backend == f.backend.iloc[0]].set_index("stage")
        ax.bar(
            x - 0.4 + width / 2,
            [first.floor_ms.get(s, np.nan) for s in stages],
            width,
            color="#999999",
            label="floor: weight bytes / measured bandwidth",
        )
        for i, be in enumerate(backends):
            g = f[f.backend == be].set_index("stage")
            if not len(g) or g.measured_p50_ms.isna().all():
                continue
            vals = [g.measured_p50_ms.get(s, np.nan) for s in stages]
            ax.bar(x - 0.4 + width * (i + 1.5), vals, width, color=colors[be], label=f"{be}: measured p50")
            for xi, s in zip(x, stages, strict=True):
                r = g.p50_over_floor.get(s, np.nan)
                if np.isfinite(r):
                    ax.text(
                        xi - 0.4 + width * (i + 1.5),
                        g.measured_p50_ms.get(s) * 1.08,
                        f"{r:.1f}×" if r < 10 else f"{r:.0f}×",
                        ha="center",
                        va="bottom",
                        fontsize=7,
                        rotation=90,
                    )
        ax.set_xticks(x)
        ax.set_xticklabels(stages)
        _ms_axis(ax, "y")
        lo, hi = ax.get_ylim()
        ax.set_ylim(lo, hi * 3)  # room for the ratio labels above the tallest bars
        ax.set_title(ck)
        ax.grid(axis="x", visible=False)
        ax.legend(fontsize=8, loc="upper left")
    axes[0, 0].set_ylabel("time per frame (ms, log)")
    fig.suptitle(
        "Measured p50 per stage vs the bandwidth floor"
        + _synthetic_note(env)
        + "\n(number above each bar: measured p50 / floor)",
        fontsize=11,
    )
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def plot_sessions(summary: pd.DataFrame, env: dict, path: Path) -> None:
    """`voicechat bench --sessions`: tick p50 and p95 against N (one subplot per checkpoint, one colour
    per backend), the 80 ms line, and N times N=1's p50 (the sessions one after the other) for scale."""
    from matplotlib.ticker import FixedLocator, FuncFormatter

    plt = _plt()
    ckpts = [c["spec"] for c in env["checkpoints"] if c["spec"] in set(summary.checkpoint)]
    colors = _backend_colors(env)
    fig, axes = plt.subplots(1, len(ckpts), figsize=(max(9.5, 6.2 * len(ckpts)), 6.0), squeeze=False)
    handles = {}
    for ax, ck in zip(axes[0], ckpts, strict=True):
        s_ck = summary[(summary.checkpoint == ck) & (summary.ticks > 0)]
        top, bottom = FRAME_MS, FRAME_MS
        for be in env["method"]["backends"]:
            g = s_ck[s_ck.backend == be].sort_values("sessions")
            if not len(g):
                continue
            n = g.sessions.astype(float).to_numpy()
            p50, p95 = g.tick_p50_ms.to_numpy(float), g.tick_p95_ms.to_numpy(float)
            (h50,) = ax.plot(n, p50, "o-", color=colors[be], linewidth=1.5)
            (h95,) = ax.plot(n, p95, "^--", color=colors[be], linewidth=1.2)
            handles[f"{be}: tick p50"] = h50
            handles[f"{be}: tick p95"] = h95
            for x, y in zip(n, p95, strict=True):
                ax.annotate(f"{y:.0f}", (x, y), textcoords="offset points", xytext=(0, 6), ha="center", fontsize=7)
            top, bottom = max(top, float(np.nanmax(p95))), min(bottom, float(np.nanmin(p50)))
            one = g[g.sessions == 1]
            if len(one):
                (hn,) = ax.plot(n, n * float(one.tick_p50_ms.iloc[0]), ":", color=colors[be], linewidth=1.0)
                handles[f"{be}: N × p50 of N=1 (no gain from batching)"] = hn
        handles["80 ms: one frame of audio (real-time budget)"] = ax.axhline(
            FRAME_MS, color="black", linestyle="--", linewidth=1.1
        )
        ax.set_xscale("log", base=2)
        ax.xaxis.set_major_locator(FixedLocator(sorted({int(x) for x in s_ck.sessions})))
        ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
        ax.xaxis.set_minor_formatter(FuncFormatter(lambda v, _: ""))
        _ms_axis(ax, "y")
        ax.set_ylim(bottom / 1.6, top * 1.6)
        ax.set_xlabel("sessions in the batch (N)")
        ax.set_ylabel("wall time of one tick (ms, log)")
        ax.set_title(ck, fontsize=10)
    fig.suptitle(
        "One tick (every session's next 80 ms frame) against the number of sessions"
        + _synthetic_note(env)
        + "\nreal-time capacity: the largest N whose p95 tick is below the dashed line",
        fontsize=11,
    )
    fig.legend(list(handles.values()), list(handles.keys()), loc="lower center", ncol=2, fontsize=8, frameon=False)
    rows = -(-len(handles) // 2)
    fig.tight_layout(rect=(0, 0.035 * rows + 0.02, 1, 1))
    fig.savefig(path)
    plt.close(fig)


def make_plots(run_dir: Path) -> dict[str, Path]:
    """Write the PNGs of a run folder from its CSV files; returns {file name: path} of those written."""
    run_dir = Path(run_dir)
    env = json.loads((run_dir / "env.json").read_text())
    frames = pd.read_csv(run_dir / "frames.csv")
    summary = pd.read_csv(run_dir / "summary.csv")
    floor = pd.read_csv(run_dir / "floor.csv")
    out = {}
    if len(frames):
        out["frame_times.png"] = run_dir / "frame_times.png"
        plot_frame_times(frames, env, out["frame_times.png"])
        out["frame_cdf.png"] = run_dir / "frame_cdf.png"
        plot_cdf(frames, env, out["frame_cdf.png"])
    if (summary.runs_ok > 0).any():
        out["stage_p50.png"] = run_dir / "stage_p50.png"
        plot_stage_p50(summary, env, out["stage_p50.png"])
    if len(floor) and floor.measured_p50_ms.notna().any():
        out["floor.png"] = run_dir / "floor.png"
        plot_floor(floor, env, out["floor.png"])
    return out


__all__ = ["make_plots", "plot_frame_times", "plot_stage_p50", "plot_cdf", "plot_floor", "plot_sessions"]
