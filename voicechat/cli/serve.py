"""`voicechat serve`, `voicechat client`, `voicechat talk` (imports deferred: see cli/main.py)."""

from __future__ import annotations

import sys

from voicechat.cli.options import add_model, add_numerics, add_prompt, add_seed


def add_server_parsers(sub) -> None:
    from voicechat.server.limits import ServerLimits

    d = ServerLimits()
    s = sub.add_parser(
        "serve",
        help="realtime WebSocket server (/v1/realtime), browser page at /",
        description="Serve /v1/realtime, / (browser page), /healthz and /metrics (docs/server.md).",
    )
    add_model(s)
    s.add_argument("--host", default="127.0.0.1", help="bind address (default 127.0.0.1: this machine only)")
    s.add_argument("--port", type=int, default=8080)
    s.add_argument(
        "--api-key",
        default=None,
        help="require 'Authorization: Bearer KEY' on the WebSocket upgrade and /metrics "
        "(default: the VOICECHAT_API_KEY environment variable, if set)",
    )
    s.add_argument(
        "--allow-origin",
        action="append",
        default=[],
        metavar="ORIGIN",
        help="browser Origin allowed to connect besides the page's own (repeatable; '*' allows any)",
    )
    s.add_argument(
        "--allow-host",
        action="append",
        default=[],
        metavar="NAME",
        help="Host header name accepted besides the loopback names and the bound address (repeatable; "
        "'*' accepts any; other Hosts get 421, against DNS rebinding)",
    )
    s.add_argument(
        "--insecure",
        action="store_true",
        help="allow binding beyond loopback without --api-key (anyone who reaches the port may use it)",
    )
    s.add_argument("--tls-cert", default=None, metavar="PEM", help="serve HTTPS / WSS with this certificate")
    s.add_argument("--tls-key", default=None, metavar="PEM", help="the certificate's private key")
    s.add_argument(
        "--max-message-bytes", type=int, default=d.max_message_bytes, help="largest client message (default 1 MiB)"
    )
    s.add_argument(
        "--max-session-audio-seconds",
        type=float,
        default=d.max_session_audio_seconds,
        help="input audio accepted per session (default 600)",
    )
    s.add_argument(
        "--session-update-timeout",
        type=float,
        default=d.session_update_timeout,
        help="seconds from connecting to session.update (default 30)",
    )
    s.add_argument(
        "--idle-timeout",
        type=float,
        default=d.idle_timeout,
        help="seconds without a client message before closing with 1008 (default 120)",
    )
    s.add_argument(
        "--max-queued-audio-seconds",
        type=float,
        default=d.max_queued_audio_seconds,
        help="audio received but not yet computed before appends are refused with input_overflow (default 5)",
    )
    s.add_argument(
        "--max-prompt-tokens",
        type=int,
        default=d.max_prompt_tokens,
        help="longest system prompt in tokens; its prefill runs before the first frame, about one frame's "
        f"language + TTS step per token (default {d.max_prompt_tokens})",
    )
    s.add_argument(
        "--max-session-seconds",
        type=float,
        default=d.max_session_seconds,
        help=f"wall-clock cap of one session (default {d.max_session_seconds:g})",
    )
    s.add_argument(
        "--send-timeout",
        type=float,
        default=d.send_timeout,
        help="a client that does not take an event within this many seconds is disconnected with 1008 "
        f"(default {d.send_timeout:g})",
    )
    s.add_argument(
        "--max-outbound-events",
        type=int,
        default=d.max_outbound_events,
        help=f"events waiting for a slow client before it is disconnected (default {d.max_outbound_events})",
    )
    s.add_argument(
        "--shutdown-timeout",
        type=float,
        default=d.shutdown_timeout,
        help=f"SIGTERM / SIGINT: seconds for live sessions to close with 1001 (default {d.shutdown_timeout:g})",
    )
    s.add_argument(
        "--max-sessions",
        type=int,
        default=1,
        metavar="N",
        help="concurrent sessions, their frames computed together in one batch (default 1); the "
        "connection after the N-th gets server_busy (close 1013)",
    )
    s.add_argument(
        "--no-memory-check",
        action="store_true",
        help="start even when --max-sessions slots at the session length limit (--max-session-audio-seconds) "
        "and the model do not fit in the machine's memory (the startup line gives the figures)",
    )
    s.add_argument(
        "--warmup-seconds",
        type=float,
        default=0.5,
        help="silent audio run through one session at startup, so the first client gets warm kernels",
    )
    s.add_argument(
        "--stage-metrics-every",
        type=int,
        default=10,
        metavar="K",
        help="time the stages of every Kth frame for /metrics (default 10; each timed frame pays one "
        "synchronisation per stage; 1 = every frame, 0 = never)",
    )
    add_numerics(s)
    add_prompt(
        s,
        "the system prompt of sessions whose client sends none (default: the config's); its prompt "
        "state is prepared at startup, so those sessions start without a prefill",
    )
    s.add_argument(
        "--prompt-state",
        default=None,
        metavar="FILE",
        help="read the default prompt's state from this file (`voicechat cache-prompt`) instead of "
        "prefilling it at startup; its prompt is the default",
    )
    s.add_argument(
        "--prompt-cache-entries",
        type=int,
        default=4,
        metavar="N",
        help="prompt states of other prompts kept for later clients, least recently used dropped first "
        "(default 4; 0 = none)",
    )
    s.add_argument(
        "--prompt-cache-mb",
        type=float,
        default=1024.0,
        metavar="MB",
        help="at most this many MB of cached prompt states (default 1024; /metrics: "
        "voicechat_prompt_state_bytes, voicechat_prompt_cache_bytes)",
    )
    s.add_argument(
        "--mcp",
        default=None,
        metavar="CMD",
        help='run this MCP server\'s tools in the server (e.g. "python -m mcp_server_time"): sessions '
        "whose client gives no tools get them, and the server answers the model's calls "
        "(needs the `tools` extra)",
    )
    s.add_argument(
        "--silence-frames",
        type=int,
        default=8,
        metavar="N",
        help="OpenAI Realtime GA dialect: a response ends at the first run of N silent frames of the "
        "model (default 8 = 640 ms); a user turn after N frames without a transcript token",
    )
    s.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    s.set_defaults(func=run_serve)

    c = sub.add_parser("client", help="stream a WAV file to a voicechat server, write the answer audio")
    c.add_argument("--url", default="ws://127.0.0.1:8080/v1/realtime")
    c.add_argument("--audio", required=True, help="input audio (16 kHz mono)")
    c.add_argument("--output-audio", default=None, help="answer audio, PCM16 WAV at the server's output rate")
    c.add_argument("--fast", action="store_true", help="send as fast as the server accepts, not in real time")
    c.add_argument("--chunk-ms", type=float, default=80.0, help="append size in ms (default 80: one frame)")
    add_prompt(c, "system prompt")
    add_seed(c)
    c.add_argument("--max-streaming-seconds", type=float, default=None)
    c.add_argument("--api-key", default=None, help="Bearer key (default: VOICECHAT_API_KEY)")
    c.add_argument("--model-name", default=None, help="session.model to send (mlx-vlm's server needs it)")
    c.add_argument("--events", default=None, metavar="FILE.jsonl", help="write every server event")
    c.set_defaults(func=run_client)

    t = sub.add_parser("talk", help="talk through the microphone (needs the `mic` extra: sounddevice)")
    t.add_argument("--url", default=None, help="server URL; default: run the model in this process")
    add_model(t, note="; for the in-process server")
    add_prompt(t)
    add_seed(t)
    t.add_argument("--api-key", default=None)
    t.set_defaults(func=run_talk)


def _key(arg):
    import os

    return arg if arg is not None else (os.environ.get("VOICECHAT_API_KEY") or None)


def _missing_serve_extra(command: str) -> bool:
    """Print what to install and return True when the `serve` extra is missing."""
    import importlib

    for name in ("starlette", "uvicorn", "websockets", "prometheus_client"):
        try:
            importlib.import_module(name)
        except ImportError as e:
            print(
                f"voicechat {command}: needs the `serve` extra ({e}); install it with: pip install -e '.[serve]'",
                file=sys.stderr,
            )
            return True
    return False


def run_serve(args) -> int:
    if _missing_serve_extra("serve"):
        return 2
    import os

    from voicechat.server.app import create_app
    from voicechat.server.limits import ServerLimits
    from voicechat.server.runner import configure_logging, make_server, make_state, uvicorn_config
    from voicechat.server.security import ServerSecurity, check_bind

    # Every flag is checked before the model loads: a refused start costs nothing.
    try:
        limits = ServerLimits(
            max_message_bytes=args.max_message_bytes,
            max_session_audio_seconds=args.max_session_audio_seconds,
            session_update_timeout=args.session_update_timeout,
            idle_timeout=args.idle_timeout,
            max_queued_audio_seconds=args.max_queued_audio_seconds,
            max_prompt_tokens=args.max_prompt_tokens,
            max_session_seconds=args.max_session_seconds,
            send_timeout=args.send_timeout,
            max_outbound_events=args.max_outbound_events,
            shutdown_timeout=args.shutdown_timeout,
        )
        security = ServerSecurity(
            api_key=_key(args.api_key),
            allowed_origins=tuple(args.allow_origin),
            allowed_hosts=tuple(args.allow_host),
            bound_host=args.host,
        )
        check_bind(args.host, security.api_key, args.insecure)
        if (args.tls_cert is None) != (args.tls_key is None):
            raise ValueError("--tls-cert and --tls-key go together; give both or neither")
        for f in (args.tls_cert, args.tls_key):
            if f is not None and not os.path.isfile(f):
                raise ValueError(f"TLS file {f} does not exist")
    except ValueError as e:
        print(f"voicechat serve: error: {e}", file=sys.stderr)
        return 2
    configure_logging(args.log_level)
    if args.insecure and security.api_key is None:
        print(f"voicechat serve: warning: listening on {args.host} without --api-key (--insecure)", file=sys.stderr)
    from voicechat.server.dialects.common import DialectOptions
    from voicechat.server.metrics import ServerMetrics
    from voicechat.server.prompt_cache import PromptStates

    if args.prompt_cache_entries < 0 or not args.prompt_cache_mb >= 0:
        print("voicechat serve: error: --prompt-cache-entries and --prompt-cache-mb must be >= 0", file=sys.stderr)
        return 2
    if args.max_sessions < 1:
        print(f"voicechat serve: error: --max-sessions must be >= 1, got {args.max_sessions}", file=sys.stderr)
        return 2
    if args.silence_frames < 1:
        print(f"voicechat serve: error: --silence-frames must be >= 1, got {args.silence_frames}", file=sys.stderr)
        return 2
    runner = None
    if args.mcp:
        from voicechat.tools.runners import McpToolRunner

        try:
            runner = McpToolRunner(args.mcp)
        except (RuntimeError, ValueError, ImportError) as e:
            print(f"voicechat serve: error: --mcp: {e}", file=sys.stderr)
            return 2
        print(f"voicechat serve: MCP tools: {', '.join(t['name'] for t in runner.tools())}", file=sys.stderr)
    metrics = ServerMetrics()
    prompts = PromptStates(
        default_prompt=args.prompt,
        state_file=args.prompt_state,
        max_entries=args.prompt_cache_entries,
        max_bytes=int(args.prompt_cache_mb * 2**20),
        metrics=metrics,
    )
    try:
        state = make_state(
            args.model,
            limits=limits,
            security=security,
            warmup_seconds=args.warmup_seconds,
            load_kwargs={"numerics": args.numerics},
            stage_metrics_every=args.stage_metrics_every,
            prompt_states=prompts,
            metrics=metrics,
            tool_runner=runner,
            dialect_options=DialectOptions(silence_frames=args.silence_frames),
            max_sessions=args.max_sessions,
            memory_check=not args.no_memory_check,
        )
    except BaseException:
        if runner is not None:
            runner.close()
        raise
    info = state.worker.info
    mem = state.worker.memory
    tls = args.tls_cert is not None
    from voicechat.server.memory import gib

    print(
        f"voicechat serve: {args.max_sessions} session slot(s), each up to {gib(mem['slot_bytes'])} at "
        f"{mem['session_seconds']:g} s (--max-session-audio-seconds); with the model {gib(mem['needed_bytes'])}"
        + (f" of {gib(mem['machine_bytes'])}" if mem.get("machine_bytes") else ""),
        file=sys.stderr,
        flush=True,
    )
    print(
        f"voicechat serve: model {args.model} ready ({info['frame_samples']} samples/frame in, "
        f"{info['output_frame_samples']} out at {info['output_sample_rate']} Hz); "
        f"http{'s' if tls else ''}://{args.host}:{args.port}/  ws{'s' if tls else ''}://{args.host}:{args.port}"
        f"/v1/realtime  ws{'s' if tls else ''}://{args.host}:{args.port}/v1/live/sessions",
        file=sys.stderr,
        flush=True,
    )
    server = make_server(
        uvicorn_config(
            create_app(state),
            state,
            host=args.host,
            port=args.port,
            log_level=args.log_level,
            tls_cert=args.tls_cert,
            tls_key=args.tls_key,
        ),
        state,
    )
    try:
        server.run()
    except KeyboardInterrupt:  # uvicorn re-raises the Ctrl-C it already handled (graceful shutdown done)
        pass
    finally:
        state.worker.stop()
        if runner is not None:
            runner.close()
    print("voicechat serve: stopped", file=sys.stderr)
    return 0


def run_client(args) -> int:
    if _missing_serve_extra("client"):
        return 2
    import json

    import soundfile as sf

    from voicechat.io.audio_input import read_audio_file
    from voicechat.server.client import run_stream_audio

    audio = read_audio_file(args.audio, 16000)
    chunk = max(1, int(round(args.chunk_ms * 16)))

    def show(e):
        t = e.get("type")
        if t == "response.text.delta":
            print(e["delta"], end="", flush=True)
        elif t == "error":
            print(f"\n[error {e['error']['code']}: {e['error']['message']}]", file=sys.stderr, flush=True)

    r = run_stream_audio(
        args.url,
        audio,
        fast=args.fast,
        chunk_samples=chunk,
        system_prompt=args.prompt,
        seed=args.seed,
        max_streaming_seconds=args.max_streaming_seconds,
        api_key=_key(args.api_key),
        model=args.model_name,
        on_event=show,
    )
    print()
    for e in r.errors:
        if r.end == "":
            print(f"error {e['code']}: {e['message']}", file=sys.stderr)
    print(f"user: {r.transcript}")
    print(f"assistant: {r.text}")
    lag = [e.get("lag_ms", 0.0) for e in r.of_type("response.audio.delta")]
    comp = [e.get("compute_ms", 0.0) for e in r.of_type("response.audio.delta")]
    if comp:
        print(
            f"{r.frames} frames; compute {sum(comp) / len(comp):.1f} ms/frame mean; lag max {max(lag):.0f} ms; "
            f"end {r.end or 'closed'} (close code {r.close_code})",
            file=sys.stderr,
        )
    if args.events:
        with open(args.events, "w") as f:
            for e in r.events:
                f.write(json.dumps(e) + "\n")
    if args.output_audio:
        sf.write(args.output_audio, r.audio, r.output_sample_rate, subtype="PCM_16")
        print(f"wrote {args.output_audio}: {r.audio.size} samples at {r.output_sample_rate} Hz", file=sys.stderr)
    # Any error event (a refused append, a limit) means the answer may be incomplete: not a success.
    return 0 if r.end in ("response.done", "response.cancelled") and not r.errors else 1


def run_talk(args) -> int:
    from voicechat.server.talk import talk

    return talk(args)
