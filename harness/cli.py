"""`voicechat parity`: run the parity harness on one checkpoint and one input; exit 1 when a family fails.

    voicechat parity -m CKPT [--audio question.wav] [--prompt P] [--seed N] [--quiet]
                     [--backend voicechat|mlx-vlm|mlx-audio]
                     [--against voicechat|mlx-vlm|mlx-audio|mlx-vlm-server|FILE.npz ...]
                     [--out DIR] [--dump-reference FILE.npz] [--tools tools.json] [--prompt-state-rows]

Writes `<stem>.json` and `<stem>.md` to --out (default reports/parity/) and
prints the Markdown path and the failing rows. Several --against give every
pair of the implementations (the --backend and each --against) in one report,
with per pair its first difference and, with three, the odd one out. Exit
status: 0 when no row failed (every pair agrees), 1 when a family failed, 2 for
bad arguments.
"""

from __future__ import annotations

import sys
from pathlib import Path

from voicechat.cli.options import add_model, add_prompt, add_quiet, add_seed

BACKENDS = ("voicechat", "voicechat-serial", "voicechat-gpu-policy", "mlx-vlm", "mlx-audio")


def add_parity_parser(sub) -> None:
    p = sub.add_parser(
        "parity",
        help="offline vs streamed parity per cache family (and against another backend)",
        description=__doc__.split("\n\n")[0],
    )
    add_model(p, required=True)
    p.add_argument(
        "--audio",
        default="question.wav",
        help="input audio: WAV / FLAC / OGG at any rate and channel count (mixed down to mono, resampled "
        "to 16 kHz with soxr), or a bundled sample, question.wav or long_question.wav "
        "(default %(default)s)",
    )
    add_quiet(p)
    add_prompt(p, "system prompt")
    add_seed(p)
    p.add_argument("--backend", choices=BACKENDS, default="voicechat", help="the implementation under test")
    p.add_argument(
        "--against",
        default=None,
        action="append",
        metavar="voicechat|mlx-vlm|mlx-audio|mlx-vlm-server|FILE.npz",
        help="also compare offline vs offline and streamed vs streamed against this backend or dump; "
        "repeat it for a matrix of every pair (e.g. --against mlx-vlm --against mlx-audio); "
        "mlx-vlm-server: only the protocol-level rows of voicechat serve vs mlx_vlm.server",
    )
    p.add_argument("--out", default=None, help="report folder (default reports/parity/)")
    p.add_argument(
        "--dump-reference",
        default=None,
        metavar="FILE.npz",
        help="also write the backend's runs as a reference dump for --against on another machine",
    )
    p.add_argument("--chunk-samples", type=int, default=1280, help="streamed push size in samples")
    p.add_argument(
        "--tools",
        default=None,
        metavar="tools.json",
        help="add the tool-schedule row: these tools, results submitted after --tool-result-after",
    )
    p.add_argument(
        "--tool-result-after",
        type=int,
        default=None,
        metavar="F",
        help="with --tools: submit each pending call's result after frame F (default: the call's frame)",
    )
    p.add_argument("--tool-output", default='{"ok": true}', help="with --tools: the result submitted (JSON text)")
    p.add_argument(
        "--prompt-state-rows",
        action="store_true",
        help="add the prompt-state rows: a session (and an offline run) from model.prepare_prompt's "
        "state, saved and loaded back, equals one that prefilled the prompt (with --tools, its tools)",
    )
    p.add_argument(
        "--no-components",
        action="store_true",
        help="skip the Nemotron-H / EAR-TTS component checks (cached vs recompute)",
    )
    p.add_argument(
        "--component-max-frames",
        type=int,
        default=None,
        help="cap the audio frames of the component checks (the EAR-TTS recompute is quadratic)",
    )
    p.add_argument(
        "--numerics",
        choices=("reference", "float32"),
        default="reference",
        help="numerics of this project's model (voicechat.load(..., numerics=)): 'reference' "
        "(default) rounds as mlx-vlm does (streamed mel edge, language path, EAR-TTS), "
        "'float32' is the float32 option",
    )
    p.set_defaults(func=run_parity_cli)


def make_backend(
    name: str, checkpoint: str, *, numerics: str | None = None, component_max_frames: int | None = None, model=None
):
    """A loaded backend by name ('voicechat' / 'mlx-vlm') or a DumpBackend for a .npz path."""
    if str(name).endswith(".npz"):
        from .dump import DumpBackend

        return DumpBackend(name)
    if name == "voicechat":
        from .backends.voicechat_backend import VoiceChatBackend

        b = VoiceChatBackend(model, numerics=numerics, component_max_frames=component_max_frames)
        if model is None:
            b.load(checkpoint)
        else:
            b.checkpoint = checkpoint
        return b
    if name in BACKENDS:
        from .backends import get_backend

        b = get_backend(name)
        b.load(_resolve(checkpoint))
        return b
    raise ValueError(f"unknown backend {name!r}; expected one of {BACKENDS} or a .npz reference dump")


def _resolve(checkpoint: str) -> str:
    from voicechat.synthetic.checkpoint import resolve_model_arg

    return resolve_model_arg(checkpoint)


def _run_server_parity(args) -> int:
    from .engine import read_input
    from .server_parity import run_server_parity

    wave, name = read_input(args.audio)
    report = run_server_parity(
        _resolve(args.model),
        wave,
        system_prompt=args.prompt,
        seed=args.seed,
        input_name=Path(name).name,
        model_arg=args.model,
    )
    jp, mp = report.write(args.out)
    c = report.counts()
    print(f"server parity {'PASS' if report.ok else 'FAIL'}: {c['pass']} pass, {c['fail']} fail")
    print(f"wrote {mp} and {jp}")
    for r in report.failed():
        print(f"  FAIL {r.family} / {r.metric}: {r.observed}" + (f" ({r.note})" if r.note else ""))
    return 0 if report.ok else 1


def _run_matrix_cli(args, againsts: list[str]) -> int:
    from .engine import read_input, run_matrix

    names = [args.backend] + againsts
    bad = [n for n in againsts if n not in BACKENDS]
    if bad or len(set(names)) != len(names):
        print(
            f"error: a matrix takes distinct backends among {', '.join(BACKENDS)} (no dumps / server), got {names}",
            file=sys.stderr,
        )
        return 2
    if args.tools or args.prompt_state_rows or args.dump_reference:
        print("error: --tools / --prompt-state-rows / --dump-reference take a single --against", file=sys.stderr)
        return 2
    if args.quiet:
        from voicechat.io.progress import set_quiet

        set_quiet(True)
    from voicechat.io.audio_input import resolve_input_path

    if not resolve_input_path(args.audio).exists():
        raise FileNotFoundError(f"{args.audio}: no such audio file (bundled samples: question.wav, long_question.wav)")
    backends = [
        make_backend(args.backend, args.model, numerics=args.numerics, component_max_frames=args.component_max_frames)
    ]
    backends += [make_backend(n, args.model) for n in againsts]
    wave, name = read_input(args.audio)
    report = run_matrix(
        backends,
        wave,
        system_prompt=args.prompt,
        seed=args.seed,
        checkpoint=args.model,
        input_name=Path(name).name,
        chunk_samples=args.chunk_samples,
        components=not args.no_components,
    )
    jp, mp = report.write(args.out)
    c = report.counts()
    print(
        f"parity {'PASS' if report.ok else 'FAIL'}: {c['pass']} pass, {c['fail']} fail, "
        f"{c['documented difference']} documented difference, {c['not available']} not available"
    )
    print(f"wrote {mp} and {jp}")
    for tag, p in report.matrix["pairs"].items():
        first = p["first_failure"] or p["first_documented"]
        where = (
            ""
            if first is None
            else (
                f"; first {'failing' if p['first_failure'] else 'documented'}: "
                f"{first['family']} / {first['comparison'].split(':')[0]} / frame "
                f"{first['frame']} / {first['field']}"
            )
        )
        print(f"  {tag}: {'agrees' if p['ok'] else 'DIFFERS'} ({p['fail']} fail, {p['documented']} documented){where}")
    for o in report.matrix["odd_one_out"]:
        print(
            f"  odd one out: {o['odd_one_out']} on {o['path']} / {o['family']} / {o['field']}"
            + (" (documented)" if o["documented"] else "")
        )
    for r in report.failed():
        print(
            f"  FAIL {r.family} / {r.comparison} / {r.metric}: observed {r.observed}, tolerance {r.tolerance}, "
            f"first failing {r.frame_unit} {r.first_failing_frame}" + (f" ({r.note})" if r.note else "")
        )
    return 0 if report.ok else 1


def run_parity_cli(args) -> int:
    from .dump import dump_reference
    from .engine import read_input, run_parity

    againsts = [args.against] if isinstance(args.against, str) else list(args.against or [])
    if len(againsts) > 1:
        return _run_matrix_cli(args, againsts)
    args.against = againsts[0] if againsts else None
    if args.against == "mlx-vlm-server":
        return _run_server_parity(args)
    if args.against is not None and not (args.against in BACKENDS or args.against.endswith(".npz")):
        print(
            f"error: --against must be one of {', '.join(BACKENDS)} or a FILE.npz, got {args.against!r}",
            file=sys.stderr,
        )
        return 2
    if args.dump_reference is not None and not args.dump_reference.endswith(".npz"):
        print(f"error: --dump-reference needs a .npz file name, got {args.dump_reference!r}", file=sys.stderr)
        return 2
    if args.prompt_state_rows and args.backend != "voicechat":
        print(
            f"error: --prompt-state-rows needs --backend voicechat (prompt states are this project's API), "
            f"got {args.backend!r}",
            file=sys.stderr,
        )
        return 2
    if args.chunk_samples < 1:
        print(f"error: --chunk-samples must be >= 1, got {args.chunk_samples}", file=sys.stderr)
        return 2
    if args.quiet:
        from voicechat.io.progress import set_quiet

        set_quiet(True)
    from voicechat.io.audio_input import resolve_input_path

    if not resolve_input_path(args.audio).exists():  # before minutes of loading
        raise FileNotFoundError(f"{args.audio}: no such audio file (bundled samples: question.wav, long_question.wav)")
    backend = make_backend(
        args.backend, args.model, numerics=args.numerics, component_max_frames=args.component_max_frames
    )
    against = None
    if args.against is not None:
        shared = getattr(backend, "model", None) if args.against == args.backend == "voicechat" else None
        against = make_backend(args.against, args.model, model=shared)
    wave, name = read_input(args.audio)
    report = run_parity(
        backend,
        wave,
        against=against,
        system_prompt=args.prompt,
        seed=args.seed,
        checkpoint=args.model,
        input_name=Path(name).name,
        chunk_samples=args.chunk_samples,
        components=not args.no_components,
    )
    if args.tools:
        from voicechat.tools.runners import tools_from_file

        from .tool_rows import tool_schedule_rows

        model = backend.model
        tools = tools_from_file(args.tools)
        after = args.tool_result_after
        if after is None:  # the first call's frame, from a streamed run
            probe = model.generate(wave, system_prompt=args.prompt, seed=args.seed, tools=tools)
            calls = [e.frame_index for e in probe.tool_events if e.kind == "tool_call"]
            after = calls[0] if calls else 0
        report.rows += tool_schedule_rows(
            model,
            wave,
            tools,
            result_after=after,
            output=args.tool_output,
            system_prompt=args.prompt,
            seed=args.seed,
            chunk_samples=min(args.chunk_samples, 1280),
        )
    if args.prompt_state_rows:
        from voicechat.tools.runners import tools_from_file

        from .prompt_state_rows import prompt_state_rows

        report.rows += prompt_state_rows(
            backend.model,
            wave,
            system_prompt=args.prompt,
            seed=args.seed,
            tools=tools_from_file(args.tools) if args.tools else None,
            chunk_samples=args.chunk_samples,
        )
    if args.dump_reference:
        path = dump_reference(
            args.dump_reference,
            backend,
            report.runs,
            wave,
            system_prompt=args.prompt,
            seed=args.seed,
            checkpoint=args.model,
            chunk_samples=args.chunk_samples,
        )
        print(f"wrote reference dump {path}")
    jp, mp = report.write(args.out)
    c = report.counts()
    print(
        f"parity {'PASS' if report.ok else 'FAIL'}: {c['pass']} pass, {c['fail']} fail, "
        f"{c['documented difference']} documented difference, {c['not available']} not available"
    )
    print(f"wrote {mp} and {jp}")
    for r in report.rows:
        if r.status == "not available" and r.metric == "all":
            print(f"  NOT AVAILABLE {r.comparison}: {r.note}")
    for r in report.failed():
        print(
            f"  FAIL {r.family} / {r.comparison} / {r.metric}: observed {r.observed}, tolerance {r.tolerance}, "
            f"first failing {r.frame_unit} {r.first_failing_frame}" + (f" ({r.note})" if r.note else "")
        )
    return 0 if report.ok else 1


__all__ = ["add_parity_parser", "run_parity_cli", "make_backend"]
