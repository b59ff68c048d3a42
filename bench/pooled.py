"""Pool the frames of several benchmark run folders per side and compare two sides.

    python -m bench.pooled --before 'reports/bench/seam-before-after/small16-before-*' \\
        --after 'reports/bench/seam-before-after/small16-after-*'

For before / after measurements of one change, run alternately (old code from a worktree, new
code from the checkout) so the machine's drift falls on both sides. Each side pools its folders'
measured frames (cold frames dropped as the runs dropped them) and reports the frame mean, p50,
p95, stage means, the median load time and the largest MLX / RSS peaks, then after / before.
Prints a Markdown table.
"""

from __future__ import annotations

import argparse
import glob

import numpy as np
import pandas as pd

from voicechat.streaming.engine import STAGES


def pooled(folders: list[str]) -> dict:
    if not folders:
        raise ValueError("no run folders matched")
    frames = pd.concat([pd.read_csv(f"{d}/frames.csv") for d in folders])
    frames = frames[~frames.dropped.astype(bool)]
    runs = pd.concat([pd.read_csv(f"{d}/runs.csv") for d in folders])
    runs = runs[runs.phase != "warmup"]
    total = frames.total_ms.to_numpy()
    out = {
        "folders": len(folders),
        "frames": int(total.size),
        "mean_ms": float(total.mean()),
        "p50_ms": float(np.percentile(total, 50)),
        "p95_ms": float(np.percentile(total, 95)),
        "load_s_median": float(runs.load_s.median()),
        "mlx_peak_mb": float(runs.mlx_peak_mb.max()),
        "rss_peak_mb": float(runs.rss_peak_mb.max()),
    }
    out.update({f"{s}_mean_ms": float(frames[f"{s}_ms"].mean()) for s in STAGES})
    return out


def table(before: dict, after: dict) -> str:
    keys = [k for k in before if k not in ("folders", "frames")]
    lines = [
        (
            f"| | before ({before['folders']} runs, {before['frames']} frames) | "
            f"after ({after['folders']} runs, {after['frames']} frames) | after / before |"
        ),
        "|---|---:|---:|---:|",
    ]
    for k in keys:
        lines.append(f"| {k} | {before[k]:.2f} | {after[k]:.2f} | {after[k] / before[k]:.3f} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--before", required=True, help="glob of the old code's run folders")
    p.add_argument("--after", required=True, help="glob of the new code's run folders")
    args = p.parse_args(argv)
    print(table(pooled(sorted(glob.glob(args.before))), pooled(sorted(glob.glob(args.after)))))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
