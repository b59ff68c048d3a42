"""`voicechat generate`: offline by default, `--stream` drives the streaming session.

Input: any WAV / FLAC / OGG file (converted to 16 kHz mono, see audio_input.read_audio_file),
the bundled `question.wav` by default. Output: a 16-bit PCM WAV by default, `--output-format
float32` for the exact samples."""

from __future__ import annotations

import json
import sys
import time

import numpy as np

from voicechat.cli.options import add_model, add_numerics, add_prompt, add_quiet, add_seed, add_tools

OUTPUT_FORMATS = ("pcm16", "float32")


def add_generate_parser(sub) -> None:
    g = sub.add_parser("generate", help="speech in -> speech + text out (offline, or --stream)")
    add_model(g)
    g.add_argument(
        "--audio",
        default="question.wav",
        help="input audio file: WAV / FLAC / OGG, any sample rate and channel count (mixed down to "
        "mono, resampled to 16 kHz with soxr); or a bundled sample name, question.wav or "
        "long_question.wav (default %(default)s)",
    )
    g.add_argument("--output-audio", required=True, help="output WAV file (22.05 kHz mono)")
    g.add_argument(
        "--output-format",
        choices=OUTPUT_FORMATS,
        default="pcm16",
        help="pcm16 (default: 16-bit PCM, what players open; rounded, clipped to [-1, 1)) or "
        "float32 (the exact samples)",
    )
    add_prompt(g, "system prompt")
    add_seed(g, default=None)
    g.add_argument(
        "--prompt-state",
        default=None,
        metavar="FILE",
        help="start from this prompt state (written by `voicechat cache-prompt` for the same checkpoint "
        "and numerics) instead of prefilling the system prompt; its prompt, tools and seed are used, "
        "and -p / --tools / --seed, if given, must agree with them",
    )
    add_numerics(g)
    g.add_argument("--stream", action="store_true", help="run the streaming session in 1280-sample pushes")
    g.add_argument("--profile", action="store_true", help="print per-stage timings (first 5 frames dropped)")
    g.add_argument("--max-streaming-seconds", type=float, default=None)
    g.add_argument(
        "--extra-decoding-seconds",
        type=float,
        default=0.0,
        help="zeros appended to the input so the model can finish its answer",
    )
    add_tools(
        g,
        "a JSON list of OpenAI function tools the model may call (implies --stream; docs/tools.md); "
        "without --mcp each call is answered with --tool-output",
    )
    g.add_argument(
        "--mcp",
        default=None,
        metavar="CMD",
        help="run the tools of this MCP server (started over stdio, e.g. "
        "'python -m mcp_server_time'); implies --stream",
    )
    g.add_argument(
        "--tool-output",
        default='{"error": "no tool runner"}',
        help="with --tools and no --mcp: the result each call gets (JSON text)",
    )
    g.add_argument(
        "--tool-timeout-seconds",
        type=float,
        default=None,
        help='inject {"error": "timeout"} when a call\'s result has not come within this much audio',
    )
    add_quiet(g)
    g.set_defaults(func=run_generate)


def run_generate(args) -> int:
    from voicechat.io.audio_input import resolve_input_path
    from voicechat.io.progress import set_quiet

    if args.quiet:
        set_quiet(True)
    audio_path = resolve_input_path(args.audio)
    if not audio_path.exists():  # before minutes of loading
        raise FileNotFoundError(f"{args.audio}: no such audio file (bundled samples: question.wav, long_question.wav)")
    runner, tools = None, None
    if args.mcp:
        from voicechat.tools.runners import McpToolRunner

        runner = McpToolRunner(args.mcp)
        tools = runner.tools()
        print(f"MCP server {args.mcp!r}: tools {', '.join(t['name'] for t in tools)}", file=sys.stderr)
    if args.tools:
        from voicechat.tools.runners import tools_from_file

        tools = tools_from_file(args.tools)
    if tools is not None:
        args.stream = True
    try:
        return _generate(args, audio_path, tools, runner)
    finally:
        if runner is not None:
            runner.close()


def _generate(args, audio_path, tools, runner) -> int:
    from voicechat.errors import ContextLimitError
    from voicechat.io.audio_input import read_audio_file
    from voicechat.streaming.model import load
    from voicechat.streaming.prompt_state import PromptState
    from voicechat.synthetic.checkpoint import resolve_model_arg

    t0 = time.perf_counter()
    model = load(resolve_model_arg(args.model), numerics=args.numerics)
    cfg = model.config
    audio = read_audio_file(audio_path, cfg.input_sample_rate)
    print(
        f"loaded {args.model} in {time.perf_counter() - t0:.2f} s; input {audio.size / cfg.input_sample_rate:.2f} s",
        file=sys.stderr,
    )
    kw = {"system_prompt": args.prompt, "seed": 0 if args.seed is None else args.seed, "tools": tools}
    if args.prompt_state:
        from voicechat.errors import PromptStateError

        try:
            state = PromptState.load(args.prompt_state, model)
        except PromptStateError as e:
            print(f"voicechat generate: --prompt-state: {e}", file=sys.stderr)
            return 2
        print(
            f"prompt state {args.prompt_state}: {state.prompt_positions} prompt positions, "
            f"{state.nbytes / 2**20:.1f} MiB, {len(state.tools)} tool(s); no prefill",
            file=sys.stderr,
        )
        # Only what was given on the command line is checked against the state.
        kw = {k: v for k, v in (("system_prompt", args.prompt), ("seed", args.seed), ("tools", tools)) if v is not None}
        kw["prompt_state"] = state
        if state.tools:
            args.stream = True  # the tool loop runs in the streaming session
    if not args.stream:
        t1 = time.perf_counter()
        kw.pop("tools", None)
        r = model.generate(audio, extra_decoding_seconds=args.extra_decoding_seconds, **kw)
        dt = time.perf_counter() - t1
        print(f"user: {r.user_transcript}")
        print(f"assistant: {r.text}")
        out = r.audio
        print(
            f"offline: {r.text_tokens.size} frames in {dt:.2f} s "
            f"({dt * 1000 / max(r.text_tokens.size, 1):.1f} ms/frame)",
            file=sys.stderr,
        )
    else:
        session = model.create_streaming_session(
            max_streaming_seconds=args.max_streaming_seconds,
            profile=args.profile,
            tool_timeout_seconds=args.tool_timeout_seconds,
            **kw,
        )
        if args.extra_decoding_seconds:
            audio = np.concatenate(
                [audio, np.zeros(int(round(args.extra_decoding_seconds * cfg.input_sample_rate)), np.float32)]
            )
        pieces: list[np.ndarray] = []
        n = cfg.frame_samples
        events = []
        try:
            for i in range(0, audio.size, n):  # no bar: the live text is the progress
                events = session.push_audio(audio[i : i + n])
                _show(events, pieces)
                _run_tools(events, session, runner, args.tool_output)
            events = session.flush()
        except ContextLimitError as e:
            _show(getattr(e, "events", []), pieces)
            print(f"stopped: {e}", file=sys.stderr)
            events = []
        _show(events, pieces)
        print()
        print(f"user: {session.transcript.text}")
        print(f"assistant: {session.text.text}")
        out = np.concatenate(pieces) if pieces else np.zeros(0, np.float32)
        if args.profile:
            print(session.profile.table(drop_first=5))
    clipped = write_wav(args.output_audio, out, cfg.output_sample_rate, args.output_format)
    print(
        f"wrote {args.output_audio}: {out.size} samples at {cfg.output_sample_rate} Hz, {args.output_format}"
        + (f" ({clipped} samples clipped to [-1, 1))" if clipped else ""),
        file=sys.stderr,
    )
    return 0


def _run_tools(events, session, runner, default_output) -> None:
    """Execute each call (here, between frames: the result is injected from the next frame on)."""
    for e in events:
        if e.kind != "tool_call":
            continue
        out = runner.call(e.name, e.arguments) if runner is not None else default_output
        print(f"\n[result {e.call_id}: {out}]", file=sys.stderr, flush=True)
        session.submit_tool_result(e.call_id, out)


def _show(events, pieces) -> None:
    for e in events:
        if e.kind == "tool_call":
            print(
                f"\n[tool call {e.call_id} at frame {e.frame_index}: {e.name}({json.dumps(e.arguments)})]",
                file=sys.stderr,
                flush=True,
            )
        elif e.kind == "tool_call_error":
            print(f"\n[tool call error at frame {e.frame_index}: {e.message}]", file=sys.stderr, flush=True)
        elif e.kind == "tool_result_done":
            print(f"\n[tool response {e.call_id} done at frame {e.frame_index} (EOTR)]", file=sys.stderr, flush=True)
        elif e.kind == "assistant_text_delta":
            print(e.delta, end="", flush=True)
        elif e.kind == "user_transcript_delta":
            print(f"[user: {e.delta}]", end="", flush=True)
        elif e.kind in ("audio", "audio_tail"):
            pieces.append(e.samples)


def write_wav(path, samples: np.ndarray, sample_rate: int, output_format: str = "pcm16") -> int:
    """Mono WAV as `pcm16` (default) or `float32`; returns how many samples were clipped (pcm16 only)."""
    if output_format == "float32":
        write_wav_float32(path, samples, sample_rate)
        return 0
    if output_format == "pcm16":
        return write_wav_pcm16(path, samples, sample_rate)
    raise ValueError(f"unknown output format {output_format!r}; expected one of {', '.join(OUTPUT_FORMATS)}")


def to_pcm16(samples: np.ndarray) -> tuple[np.ndarray, int]:
    """float samples -> int16 PCM: x * 32768 rounded to nearest (ties to even), saturated to
    [-32768, 32767], i.e. [-1, 32767/32768] in float; returns the codes and how many saturated."""
    x = np.asarray(samples, dtype=np.float32)
    if not np.isfinite(x).all():
        raise ValueError("output audio contains NaN or infinite samples; cannot write PCM")
    q = np.round(x.astype(np.float64) * 32768.0)
    clipped = int(np.count_nonzero((q > 32767) | (q < -32768)))
    return np.clip(q, -32768, 32767).astype("<i2"), clipped


def write_wav_pcm16(path, samples: np.ndarray, sample_rate: int) -> int:
    """Mono 16-bit PCM WAV (fmt + data chunks only); returns the number of clipped samples."""
    import struct

    pcm, clipped = to_pcm16(samples)
    data = pcm.tobytes()
    fmt = struct.pack("<HHIIHH", 1, 1, sample_rate, sample_rate * 2, 2, 16)  # WAVE_FORMAT_PCM
    _write_riff(path, fmt, data)
    return clipped


def _write_riff(path, fmt: bytes, data: bytes) -> None:
    import struct

    with open(path, "wb") as f:
        f.write(b"RIFF" + struct.pack("<I", 4 + 8 + len(fmt) + 8 + len(data)) + b"WAVE")
        f.write(b"fmt " + struct.pack("<I", len(fmt)) + fmt)
        f.write(b"data" + struct.pack("<I", len(data)) + data)


def write_wav_float32(path, samples: np.ndarray, sample_rate: int) -> None:
    """Mono 32-bit float WAV with only fmt + data chunks.

    libsndfile adds a PEAK chunk holding a timestamp to float WAVs, so two runs
    would differ in bytes; this writer makes the file a function of the samples.
    """
    import struct

    data = np.asarray(samples, dtype="<f4").tobytes()
    fmt = struct.pack("<HHIIHH", 3, 1, sample_rate, sample_rate * 4, 4, 32)  # WAVE_FORMAT_IEEE_FLOAT
    _write_riff(path, fmt, data)
