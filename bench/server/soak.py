"""Memory and handles of a `voicechat serve` process over many sequential sessions.

    python -m bench.server.soak [-m synthetic:tiny] [--sessions 50] [--every 10]

Starts the server as a subprocess, streams the bundled sample (fast) `--sessions` times and
records the server process's RSS (VmRSS) and open file descriptors (/proc, Linux) before the
first session and every `--every` sessions. Writes reports/server/soak_process.json.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path


def _figures(pid: int, session: int) -> dict:
    rss = next(
        int(x.split()[1]) for x in Path(f"/proc/{pid}/status").read_text().splitlines() if x.startswith("VmRSS:")
    )
    return {"session": session, "rss_mb": round(rss / 1024, 1), "open_fds": len(os.listdir(f"/proc/{pid}/fd"))}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("-m", "--model", default="synthetic:tiny")
    p.add_argument("--sessions", type=int, default=50)
    p.add_argument("--every", type=int, default=10)
    p.add_argument("--out", default="reports/server/soak_process.json")
    args = p.parse_args(argv)

    import soundfile as sf

    from voicechat.samples import sample_path
    from voicechat.server.client import run_stream_audio
    from voicechat.server.compare import free_port, start_process, stop_process

    pcm, _ = sf.read(str(sample_path("question")), dtype="int16")
    port = free_port()
    with tempfile.TemporaryDirectory() as logs:
        proc = start_process(
            [
                sys.executable,
                "-m",
                "voicechat.cli",
                "serve",
                "-m",
                args.model,
                "--port",
                str(port),
                "--log-level",
                "warning",
            ],
            f"http://127.0.0.1:{port}/healthz",
            Path(logs) / "serve.log",
        )
        rows = [_figures(proc.pid, 0)]
        try:
            for i in range(1, args.sessions + 1):
                r = run_stream_audio(f"ws://127.0.0.1:{port}/v1/realtime", pcm, fast=True, seed=i)
                if r.end != "response.done":
                    raise RuntimeError(f"session {i} ended with {r.end}: {r.errors}")
                if i % args.every == 0:
                    time.sleep(0.2)  # the server closes the session just after the client saw the close
                    rows.append(_figures(proc.pid, i))
        finally:
            stop_process(proc)
    out = {"model": args.model, "sessions": args.sessions, "figures": rows}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=1) + "\n")
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
