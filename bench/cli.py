"""`voicechat bench`: run the benchmark, re-render a run folder, or regenerate docs/performance.md."""

from __future__ import annotations

import json
import sys
from datetime import datetime
from pathlib import Path

BACKENDS = ("voicechat", "voicechat-serial", "voicechat-gpu-policy", "mlx-vlm", "mlx-audio")
DEFAULT_AUDIO = "long_question.wav"  # bundled: past the conformer's attention window

EPILOG = """examples:
  voicechat bench -m synthetic:small:4 -m synthetic:small:8 --audio long_question.wav \\
      --backend voicechat --backend mlx-vlm --out reports/bench/small
  voicechat bench --update-docs reports/bench/small       # regenerate docs/performance.md
  voicechat bench --rerender reports/bench/small          # redraw plots and summary.md from the CSVs
  voicechat bench -m synthetic:small16:4 --sessions 1,2,4,8 --frames 40 --runs 2 \\
      --out reports/bench/small16-sessions                 # tick time and real-time capacity against N

exit status: 0 if every run succeeded, 1 if any run failed (failures are in summary.md), 2 on bad arguments."""


def add_bench_parser(subparsers) -> None:
    import argparse

    p = subparsers.add_parser(
        "bench",
        help="benchmark streaming sessions: RTF / p50 / p95 tables, plots, physical floor",
        description="For each checkpoint x backend x input: warm-up, then N runs of a profiled streamed session "
        "(backends interleaved), plus the offline path's wall time. Writes frames.csv, runs.csv, "
        "summary.csv, summary.md, floor.csv, env.json and PNG plots into --out.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "-m",
        "--model",
        dest="models",
        action="append",
        default=[],
        metavar="CKPT",
        help="checkpoint folder, Hugging Face repo id, or synthetic:PRESET[:4|8] (repeatable)",
    )
    p.add_argument(
        "--audio",
        action="append",
        default=[],
        metavar="FILE",
        help="input audio (repeatable): WAV / FLAC / OGG at any rate and channel count (mixed down to "
        "mono, resampled to 16 kHz with soxr), or a bundled sample, question.wav or "
        f"long_question.wav (default {DEFAULT_AUDIO})",
    )
    p.add_argument(
        "--backend",
        dest="backends",
        action="append",
        choices=BACKENDS,
        default=None,
        help="implementation to run (repeatable; default voicechat); voicechat-serial = this project under "
        "ExecutionPolicy.serial() (one CPU stream, nothing compiled, no CPU kernels, no overlapped evaluation); "
        "voicechat-gpu-policy = under the policy a GPU device gets, run on this device; mlx-vlm and mlx-audio "
        "need the peers extra",
    )
    p.add_argument("--runs", type=int, default=3, help="measured runs per checkpoint x backend x input (default 3)")
    p.add_argument("--warmup", type=int, default=1, help="warm-up runs, not counted (default 1)")
    p.add_argument(
        "--drop-first", type=int, default=5, help="cold frames dropped from each run's statistics (default 5)"
    )
    p.add_argument(
        "--extra-decoding-seconds",
        type=float,
        default=3.0,
        help="silence streamed after the input, and offline extra decoding (default 3)",
    )
    p.add_argument("--chunk-samples", type=int, default=1280, help="samples per push_audio call (default 1280)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("-p", "--system-prompt", default=None)
    p.add_argument("--no-offline", dest="offline", action="store_false", help="skip the offline timing")
    p.add_argument(
        "--no-floor",
        dest="floor",
        action="store_false",
        help="skip the bandwidth measurement, the floor table and the dispatch counts (dispatch.csv)",
    )
    p.add_argument("--no-plots", dest="plots", action="store_false")
    p.add_argument(
        "--frames",
        type=int,
        default=None,
        metavar="N",
        help="stream only the first N frames of input + silence (full-size checkpoints on a CPU take "
        "seconds per frame); the offline timing still uses the whole input, see --no-offline",
    )
    p.add_argument(
        "--isolate",
        action="store_true",
        help="run each load + stream (and the floor model) in its own process, for checkpoints too "
        "large for two models to sit in memory one after the other",
    )
    p.add_argument(
        "--cold-page-cache",
        dest="warm_page_cache",
        action="store_false",
        help="do not read the checkpoint's files before each run (by default they are read, so every "
        "backend's load starts from the same page cache; without it the first to load pays the disk)",
    )
    p.add_argument(
        "--bandwidth-mb",
        type=float,
        default=256.0,
        help="size of each matrix of the bandwidth measurement (default 256 MB)",
    )
    p.add_argument("--out", default=None, help="run folder (default reports/bench/<date>-<time>)")
    p.add_argument(
        "--update-docs",
        nargs="?",
        const="",
        default=None,
        metavar="RUN_DIR",
        help="regenerate the generated section of --docs from RUN_DIR; without RUN_DIR (with -m), "
        "from this run's folder when it finishes",
    )
    p.add_argument("--docs", default="docs/performance.md", help="page --update-docs writes (default %(default)s)")
    p.add_argument(
        "--section",
        default=None,
        metavar="NAME",
        help="with --update-docs: write the named generated section (e.g. full: the full-shape run) "
        "instead of the default one; appended to the page if it has none yet",
    )
    p.add_argument(
        "--rerender",
        metavar="RUN_DIR",
        default=None,
        help="redraw the plots and summary.md of RUN_DIR from its CSV files, then exit",
    )
    p.add_argument(
        "--prompt-sweep",
        default=None,
        metavar="N,N,...",
        help="instead of the streaming benchmark: session start per prompt length in positions (e.g. "
        "19,95,376,1000): from scratch, prepare_prompt, from the prompt state, the state's bytes "
        "(bench/prompt_sweep.py; --runs runs per length)",
    )
    p.add_argument(
        "--sessions",
        type=session_counts,
        default=None,
        metavar="N,N,...",
        help="instead of the streaming benchmark: N sessions in one batch (model.create_session_batch) for "
        "each N (e.g. 1,2,4,8), different seeds and system prompts, the same input, one frame per session "
        "per tick; the wall time of batch.step() per tick, per N: mean / p50 / p95, ratio to N=1, RTF per "
        "session, and the real-time capacity (the largest N whose p95 tick is under 80 ms). The N take "
        "turns in rounds (--warmup rounds, then --runs); --frames ticks per batch run, --drop-first dropped; "
        "backends voicechat, voicechat-serial, voicechat-gpu-policy; writes ticks.csv, sessions.csv, "
        "dispatch.csv (dispatches and host syncs per tick; not with --no-floor), summary.md, sessions.png "
        "(bench/sessions.py)",
    )
    p.add_argument("--quiet", action="store_true", help="no progress lines or bars on stderr")
    p.set_defaults(func=cmd_bench)


def session_counts(text: str) -> list[int]:
    """`--sessions` value: a comma list of distinct session counts >= 1 -> sorted ints (argparse type)."""
    import argparse

    items = [x.strip() for x in str(text).split(",")]
    if not any(items):
        raise argparse.ArgumentTypeError("expected a comma list of session counts such as 1,2,4,8, got an empty value")
    counts = []
    for x in items:
        if not x:
            raise argparse.ArgumentTypeError(f"empty item in {text!r}; expected a comma list such as 1,2,4,8")
        try:
            n = int(x)
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"{x!r} is not a whole number; expected a comma list of session counts such as 1,2,4,8"
            ) from None
        if n < 1:
            raise argparse.ArgumentTypeError(f"session counts must be at least 1, got {n}")
        counts.append(n)
    if len(set(counts)) != len(counts):
        raise argparse.ArgumentTypeError(f"session counts repeated in {text!r}")
    return sorted(counts)


# The bench writes its tables with pandas and its plots with matplotlib: the `bench` extra, not
# dependencies of the speech model.
BENCH_EXTRA = ("pandas", "matplotlib")


def missing_bench_extra() -> list[str]:
    """The packages of the `bench` extra that are not installed."""
    import importlib.util

    return [name for name in BENCH_EXTRA if importlib.util.find_spec(name) is None]


def cmd_bench(args) -> int:
    missing = missing_bench_extra()
    if missing:
        print(
            f"voicechat bench: needs {' and '.join(missing)} (the `bench` extra): "
            f"pip install 'voicechat-mlx[bench]' (from a clone: pip install -e '.[bench]')",
            file=sys.stderr,
        )
        return 2
    from .docs import update_docs

    if args.rerender:
        from .plots import make_plots
        from .report import render_markdown

        run_dir = Path(args.rerender)
        if (run_dir / "ticks.csv").is_file():  # a `--sessions` run
            from .sessions import make_sessions_plot, render_sessions

            make_sessions_plot(run_dir)
            (run_dir / "summary.md").write_text(render_sessions(run_dir))
        else:
            make_plots(run_dir)
            (run_dir / "summary.md").write_text(render_markdown(run_dir))
        print(f"re-rendered {run_dir}")
        return 0
    if args.update_docs and not args.models:
        changed = update_docs(Path(args.update_docs), Path(args.docs), args.section)
        print(f"{args.docs}: {'updated' if changed else 'unchanged'} from {args.update_docs}")
        return 0
    if not args.models:
        raise ValueError(
            "nothing to do: pass -m CKPT [--audio FILE] to run, or --update-docs RUN_DIR / --rerender RUN_DIR"
        )
    if args.update_docs:
        raise ValueError(
            "--update-docs RUN_DIR cannot be combined with -m; use --update-docs without a folder "
            "to update the docs from this run"
        )

    if args.prompt_sweep and args.sessions:
        raise ValueError("--prompt-sweep and --sessions are separate benchmarks; run them one at a time")
    if args.prompt_sweep:
        from .prompt_sweep import run_prompt_sweep

        try:
            lengths = [int(x) for x in args.prompt_sweep.split(",") if x.strip()]
        except ValueError:
            raise ValueError(
                f"--prompt-sweep takes comma-separated prompt lengths, got {args.prompt_sweep!r}"
            ) from None
        out = (
            Path(args.out)
            if args.out
            else Path("reports/bench") / datetime.now().strftime("prompt-sweep-%Y%m%d-%H%M%S")
        )
        for m in args.models:
            run_prompt_sweep(
                m, lengths, out / _slug(m) if len(args.models) > 1 else out, runs=args.runs, progress=not args.quiet
            )
        print(f"wrote {out}")
        if args.update_docs is not None:
            changed = update_docs(out, Path(args.docs), args.section or "prompt_sweep")
            print(f"{args.docs}: {'updated' if changed else 'unchanged'} from {out}")
        return 0

    from voicechat.io.audio_input import resolve_input_path
    from voicechat.io.progress import set_quiet

    from .runner import BenchOptions, Progress, run_bench

    if args.quiet:
        set_quiet(True)
    audio = [str(resolve_input_path(a)) for a in (args.audio or [DEFAULT_AUDIO])]

    stamp = datetime.now().strftime("sessions-%Y%m%d-%H%M%S" if args.sessions else "%Y%m%d-%H%M%S")
    out = Path(args.out) if args.out else Path("reports/bench") / stamp
    opts = BenchOptions(
        checkpoints=list(args.models),
        audio=audio,
        out=out,
        backends=list(args.backends or ["voicechat"]),
        runs=args.runs,
        warmup=args.warmup,
        drop_first=args.drop_first,
        extra_decoding_seconds=args.extra_decoding_seconds,
        chunk_samples=args.chunk_samples,
        seed=args.seed,
        system_prompt=args.system_prompt,
        offline=args.offline,
        floor=args.floor,
        bandwidth_mb=args.bandwidth_mb,
        plots=args.plots,
        frames=args.frames,
        isolate=args.isolate,
        warm_page_cache=args.warm_page_cache,
    )
    if args.sessions:
        from .sessions import run_sessions

        run_sessions(opts, args.sessions, progress=Progress(enabled=not args.quiet))
        print((out / "summary.md").read_text())
        if args.update_docs is not None:
            changed = update_docs(out, Path(args.docs), args.section or "sessions")
            print(f"{args.docs}: {'updated' if changed else 'unchanged'} from {out}")
        errors = json.loads((out / "env.json").read_text()).get("errors") or []
        if errors:
            print(f"voicechat bench: {len(errors)} checkpoint(s) failed; see {out / 'summary.md'}", file=sys.stderr)
            return 1
        return 0
    result = run_bench(opts, progress=Progress(enabled=not args.quiet))
    print((out / "summary.md").read_text())
    if args.update_docs is not None:
        changed = update_docs(out, Path(args.docs), args.section)
        print(f"{args.docs}: {'updated' if changed else 'unchanged'} from {out}")
    if not result.ok:
        print(f"voicechat bench: {result.failed} run(s) failed; see {out / 'summary.md'}", file=sys.stderr)
        return 1
    return 0


def _slug(spec: str) -> str:
    return "".join(c if c.isalnum() or c in "-_." else "-" for c in spec)


__all__ = ["add_bench_parser", "cmd_bench"]
