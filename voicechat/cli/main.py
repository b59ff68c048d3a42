"""`voicechat` command line: synth, generate, cache-prompt, parity, bench, serve, client, talk.

The commands import what they run when they run (the model, the server's packages, the bench's
pandas): `voicechat --help` stays quick, and each extra is needed only by its own command."""

from __future__ import annotations

import argparse
import sys

from voicechat.cli.options import add_quiet


def _cmd_synth(args) -> int:
    from voicechat.synthetic.checkpoint import write_checkpoint

    if args.preset == "toolcall" and args.tool is None:
        print("voicechat synth: --preset toolcall needs --tool NAME (and --arguments JSON)", file=sys.stderr)
        return 2
    if args.preset != "toolcall" and (args.tool is not None or args.arguments is not None):
        print("voicechat synth: --tool / --arguments are for --preset toolcall", file=sys.stderr)
        return 2
    try:
        path = write_checkpoint(
            args.out,
            args.preset,
            bits=args.bits,
            seed=args.seed,
            progress=False if args.quiet else None,
            tool=args.tool,
            arguments=args.arguments,
        )
    except ValueError as e:
        print(f"voicechat synth: {e}", file=sys.stderr)
        return 2
    extra = f", calls {args.tool}" if args.tool else ""
    print(
        f"wrote synthetic checkpoint {path} (preset {args.preset}, bits {args.bits or 'bf16'}, seed {args.seed}{extra})"
    )
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="voicechat", description=__doc__)
    sub = p.add_subparsers(dest="command", required=True)

    s = sub.add_parser("synth", help="write a synthetic random-weight checkpoint in the published layout")
    s.add_argument("out", help="output folder")
    s.add_argument(
        "--preset",
        choices=["tiny", "small", "small16", "full", "toolcall"],
        default="tiny",
        help="toolcall: tiny, with a language path that calls --tool with --arguments (docs/tools.md)",
    )
    s.add_argument("--tool", default=None, help="toolcall preset: the tool the model calls")
    s.add_argument("--arguments", default=None, help="toolcall preset: the call's arguments, a JSON object")
    s.add_argument(
        "--bits",
        type=int,
        choices=[4, 8],
        default=None,
        help="quantize the language path as the published 4-/8-bit checkpoints do",
    )
    s.add_argument("--seed", type=int, default=0, help="seed of the random weights (default 0)")
    add_quiet(s)
    s.set_defaults(func=_cmd_synth)

    from voicechat.cli.generate import add_generate_parser

    add_generate_parser(sub)
    from voicechat.cli.prompt import add_cache_prompt_parser

    add_cache_prompt_parser(sub)
    from harness.cli import add_parity_parser

    add_parity_parser(sub)
    from bench.cli import add_bench_parser

    add_bench_parser(sub)
    try:
        from voicechat.cli.serve import add_server_parsers

        add_server_parsers(sub)
    except ImportError as e:
        # The base install (README's first command) has no `serve` extra: the other commands must
        # still work, and these say what to install.
        _add_missing_extra_parsers(sub, e)
    return p


def _add_missing_extra_parsers(sub, error: ImportError) -> None:
    def refuse(args) -> int:
        print(
            f"voicechat {args.command}: needs the `serve` extra ({error}); install it with: pip install -e '.[serve]'",
            file=sys.stderr,
        )
        return 2

    for name in ("serve", "client", "talk"):
        if name not in sub.choices:
            q = sub.add_parser(name, help="(needs the `serve` extra: pip install -e '.[serve]')")
            q.set_defaults(func=refuse)


def main(argv=None) -> int:
    from voicechat.errors import VoiceChatError

    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except (VoiceChatError, ValueError, TypeError, FileNotFoundError) as e:
        # Bad input or a bad checkpoint: one clear line, not a traceback.
        print(f"voicechat {args.command}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
