"""The server's per-frame overhead over the in-process session, measured side by side.

    python -m bench.server.overhead [-m synthetic:tiny] [--rounds 3] [--audio long_question]

Alternates, round by round, (a) an in-process streaming session pushed one 1280-sample
frame at a time (wall time of each `push_audio`) and (b) `voicechat serve` in a subprocess
driven in lock-step by the reference client (one frame sent, wait for its
`response.audio.delta`: the round trip). Reports mean / p95 of both, their difference, and
the round trip minus the server's own `compute_ms` for the same frame (transport + queue +
JSON/base64). Writes reports/server/overhead.json.
"""

from __future__ import annotations

import argparse
import json
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import numpy as np

from . import frame_stats, push_times_ms, sample_pcm16


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("-m", "--model", default="synthetic:tiny")
    p.add_argument("--audio", default="long_question", help="bundled sample name or a WAV path")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--drop-first", type=int, default=5, help="cold frames dropped from each session")
    p.add_argument(
        "--mlx-vlm", action="store_true", help="also time mlx_vlm.server (peers extra) with the same lock-step client"
    )
    p.add_argument("--out", default="reports/server/overhead.json")
    args = p.parse_args(argv)

    import voicechat
    from voicechat.server.client import run_stream_audio
    from voicechat.synthetic.checkpoint import resolve_model_arg

    pcm = sample_pcm16(args.audio)
    ckpt = resolve_model_arg(args.model)
    model = voicechat.load(ckpt)
    servers = {}
    try:
        for name, extra in (
            ("stage_metrics_every_10", []),
            ("stage_metrics_every_frame", ["--stage-metrics-every", "1"]),
            ("stage_metrics_off", ["--stage-metrics-every", "0"]),
        ):
            with socket.socket() as sk:
                sk.bind(("127.0.0.1", 0))
                port = sk.getsockname()[1]
            proc = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "voicechat.cli",
                    "serve",
                    "-m",
                    ckpt,
                    "--port",
                    str(port),
                    "--log-level",
                    "warning",
                    *extra,
                ],
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )
            servers[name] = (proc, port)
        if args.mlx_vlm:
            with socket.socket() as sk:
                sk.bind(("127.0.0.1", 0))
                port = sk.getsockname()[1]
            proc = subprocess.Popen(
                [sys.executable, "-m", "mlx_vlm.server", "--host", "127.0.0.1", "--port", str(port)],
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )
            servers["mlx_vlm_server"] = (proc, port)
        for name, (_proc, port) in servers.items():
            health = "health" if name == "mlx_vlm_server" else "healthz"
            for _ in range(600):
                try:
                    urllib.request.urlopen(f"http://127.0.0.1:{port}/{health}", timeout=1)
                    break
                except Exception:
                    time.sleep(0.2)
        n = model.config.frame_samples
        whole = pcm[: pcm.size - pcm.size % n]
        inproc = []
        rt = {k: [] for k in servers}
        comp = {k: [] for k in servers}
        rmc = {k: [] for k in servers}
        warm = model.create_streaming_session()
        warm.push_audio(pcm[: n * 10])
        for _r in range(args.rounds):
            inproc += push_times_ms(model, whole, n)[args.drop_first :]
            for name, (_proc, port) in servers.items():
                res = run_stream_audio(
                    f"ws://127.0.0.1:{port}/v1/realtime", whole, lockstep=True, chunk_samples=n, model=ckpt
                )
                deltas = [e for e in res.events if e["type"] == "response.audio.delta"]
                rts = res.frame_round_trip_ms
                rt[name] += rts[args.drop_first :]
                if name != "mlx_vlm_server":  # its events carry no compute time
                    comp[name] += [e["compute_ms"] for e in deltas[args.drop_first : len(rts)]]
                    rmc[name] += [
                        a - e["compute_ms"]
                        for a, e in zip(rts[args.drop_first :], deltas[args.drop_first :], strict=False)
                    ]
        out = {
            "model": args.model,
            "audio": Path(args.audio).name,
            "rounds": args.rounds,
            "drop_first": args.drop_first,
            "in_process_push_ms": frame_stats(inproc),
        }
        for name in servers:
            out[name] = {
                "server_round_trip_ms": frame_stats(rt[name]),
                "server_compute_ms": frame_stats(comp[name]) if comp[name] else None,
                "overhead_mean_ms": round(float(np.mean(rt[name]) - np.mean(inproc)), 3),
                "overhead_p95_ms": round(frame_stats(rt[name])["p95_ms"] - frame_stats(inproc)["p95_ms"], 3),
                "round_trip_minus_compute_ms": frame_stats(rmc[name]) if rmc[name] else None,
            }
    finally:
        for proc, _ in servers.values():
            proc.terminate()
            proc.wait(15)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=1) + "\n")
    print(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
