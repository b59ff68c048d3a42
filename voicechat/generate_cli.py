"""`voicechat generate`: offline by default, `--stream` drives the streaming session."""

from __future__ import annotations

import sys
import time

import numpy as np

DEFAULT_MODEL = "synthetic:tiny"


def add_generate_parser(sub) -> None:
    g = sub.add_parser("generate", help="speech in -> speech + text out (offline, or --stream)")
    g.add_argument("-m", "--model", default=DEFAULT_MODEL,
                   help="checkpoint folder, Hugging Face repo id, or synthetic:PRESET[:4|8] "
                        f"(default {DEFAULT_MODEL}: a random-weight tiny model, written on first use)")
    g.add_argument("--audio", required=True, help="input audio file (mono, 16 kHz; not resampled)")
    g.add_argument("--output-audio", required=True, help="output WAV (22.05 kHz, float32)")
    g.add_argument("-p", "--prompt", default=None, help="system prompt")
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--stream", action="store_true", help="run the streaming session in 1280-sample pushes")
    g.add_argument("--profile", action="store_true", help="print per-stage timings (first 5 frames dropped)")
    g.add_argument("--max-streaming-seconds", type=float, default=None)
    g.add_argument("--extra-decoding-seconds", type=float, default=0.0,
                   help="zeros appended to the input so the model can finish its answer")
    g.set_defaults(func=run_generate)


def run_generate(args) -> int:
    import voicechat
    from voicechat.audio_input import read_audio_file
    from voicechat.errors import ContextLimitError
    from voicechat.synthetic import resolve_model_arg

    t0 = time.perf_counter()
    model = voicechat.load(resolve_model_arg(args.model))
    cfg = model.config
    audio = read_audio_file(args.audio, cfg.input_sample_rate)
    print(f"loaded {args.model} in {time.perf_counter() - t0:.2f} s; input {audio.size / cfg.input_sample_rate:.2f} s",
          file=sys.stderr)
    if not args.stream:
        t1 = time.perf_counter()
        r = model.generate(audio, system_prompt=args.prompt, seed=args.seed,
                           extra_decoding_seconds=args.extra_decoding_seconds)
        dt = time.perf_counter() - t1
        print(f"user: {r.user_transcript}")
        print(f"assistant: {r.text}")
        out = r.audio
        print(f"offline: {r.text_tokens.size} frames in {dt:.2f} s "
              f"({dt * 1000 / max(r.text_tokens.size, 1):.1f} ms/frame)", file=sys.stderr)
    else:
        session = model.create_streaming_session(
            system_prompt=args.prompt, seed=args.seed, max_streaming_seconds=args.max_streaming_seconds,
            profile=args.profile)
        if args.extra_decoding_seconds:
            audio = np.concatenate([audio, np.zeros(int(round(args.extra_decoding_seconds * cfg.input_sample_rate)),
                                                    np.float32)])
        pieces: list[np.ndarray] = []
        n = cfg.frame_samples
        events = []
        try:
            for i in range(0, audio.size, n):
                events = session.push_audio(audio[i:i + n])
                _show(events, pieces)
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
    write_wav_float32(args.output_audio, out, cfg.output_sample_rate)
    print(f"wrote {args.output_audio}: {out.size} samples at {cfg.output_sample_rate} Hz", file=sys.stderr)
    return 0


def _show(events, pieces) -> None:
    for e in events:
        if e.kind == "assistant_text_delta":
            print(e.delta, end="", flush=True)
        elif e.kind == "user_transcript_delta":
            print(f"[user: {e.delta}]", end="", flush=True)
        elif e.kind in ("audio", "audio_tail"):
            pieces.append(e.samples)


def write_wav_float32(path, samples: np.ndarray, sample_rate: int) -> None:
    """Mono 32-bit float WAV with only fmt + data chunks.

    libsndfile adds a PEAK chunk holding a timestamp to float WAVs, so two runs
    would differ in bytes; this writer makes the file a function of the samples.
    """
    import struct

    data = np.asarray(samples, dtype="<f4").tobytes()
    fmt = struct.pack("<HHIIHH", 3, 1, sample_rate, sample_rate * 4, 4, 32)  # WAVE_FORMAT_IEEE_FLOAT
    with open(path, "wb") as f:
        f.write(b"RIFF" + struct.pack("<I", 4 + 8 + len(fmt) + 8 + len(data)) + b"WAVE")
        f.write(b"fmt " + struct.pack("<I", len(fmt)) + fmt)
        f.write(b"data" + struct.pack("<I", len(data)) + data)
