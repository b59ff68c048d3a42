"""`voicechat cache-prompt`: run a system prompt's prefill once and write its prompt state to a file
(voicechat/streaming/prompt_state.py; `voicechat generate --prompt-state FILE`,
`voicechat serve --prompt-state FILE`)."""

from __future__ import annotations

import sys
import time

from voicechat.cli.options import add_model, add_numerics, add_prompt, add_seed, add_tools


def add_cache_prompt_parser(sub) -> None:
    c = sub.add_parser(
        "cache-prompt",
        help="prefill a system prompt once, write its prompt state (safetensors)",
        description=__doc__.split("\n\n")[0],
    )
    add_model(c, required=True, note="; the file is bound to it")
    add_prompt(c)
    add_tools(c, "a JSON list of OpenAI function tools (their block is part of the prefilled prompt)")
    add_seed(c)
    add_numerics(c, note="; the file is bound to it")
    c.add_argument("-o", "--output", required=True, metavar="FILE", help="the state file to write (.safetensors)")
    c.set_defaults(func=run_cache_prompt)


def run_cache_prompt(args) -> int:
    from voicechat.streaming.model import load
    from voicechat.synthetic.checkpoint import resolve_model_arg

    tools = None
    if args.tools:
        from voicechat.tools.runners import tools_from_file

        tools = tools_from_file(args.tools)
    t0 = time.perf_counter()
    model = load(resolve_model_arg(args.model), numerics=args.numerics)
    print(f"loaded {args.model} in {time.perf_counter() - t0:.2f} s", file=sys.stderr)
    t1 = time.perf_counter()
    print("prefilling the system prompt ...", file=sys.stderr, flush=True)
    state = model.prepare_prompt(args.prompt, tools=tools, seed=args.seed)
    dt = time.perf_counter() - t1
    path = state.save(args.output)
    print(
        f"wrote {path}: {state.prompt_positions} prompt positions prefilled in {dt:.2f} s, "
        f"{state.nbytes / 2**20:.2f} MiB, {len(state.tools)} tool(s), seed {state.seed}"
    )
    return 0
