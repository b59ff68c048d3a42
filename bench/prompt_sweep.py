"""`voicechat bench --prompt-sweep N,N,...`: session start with and without a prompt state, per prompt length.

For each prompt length (in prompt positions: [bos] + tokens + [eos]) and each run: a session created
from scratch (it prefills), `model.prepare_prompt`, a session created from the state, and the first
frame of each of the two sessions; the state's bytes (`state.nbytes`), its file's bytes and the time
to save and load it; and one steady frame's time (the median of frames 3-12 of a session), the
yardstick of the target "session creation from a state within one steady frame". Everything runs
in one process on one loaded model, lengths in increasing order, after one warm-up session.

Writes `prompt_sweep.csv` (one row per length x run), `env.json` and `summary.md` into the run folder;
`voicechat bench --update-docs RUN_DIR --section prompt_sweep` puts the table into docs/performance.md.
"""

from __future__ import annotations

import json
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np

FILLER = (
    "You are a friendly voice assistant for a small bookshop. Answer briefly, speak naturally, "
    "and ask a short question back when the request is unclear. "
)
COLUMNS = (
    "checkpoint",
    "positions",
    "run",
    "scratch_session_s",
    "prepare_s",
    "state_session_ms",
    "scratch_first_frame_ms",
    "state_first_frame_ms",
    "state_bytes",
    "file_bytes",
    "save_ms",
    "load_ms",
    "steady_frame_ms",
)


def prompt_of_positions(model, positions: int) -> str:
    """A prompt whose prefill takes exactly `positions` positions ([bos] + tokens + [eos])."""
    if positions < 3:
        raise ValueError(f"prompt lengths must be >= 3 positions ([bos], a token, [eos]), got {positions}")
    tok = model.tokenizer
    words = (FILLER * (positions // 8 + 4)).split(" ")
    lo, hi = 1, len(words)
    while lo < hi:  # the fewest words reaching the length, then trimmed to it by characters
        mid = (lo + hi) // 2
        if len(tok.encode(" ".join(words[:mid]))) + 2 >= positions:
            hi = mid
        else:
            lo = mid + 1
    text = " ".join(words[:lo])
    while len(tok.encode(text)) + 2 > positions and text:
        text = text[:-1]
    if len(tok.encode(text)) + 2 != positions:
        raise RuntimeError(f"could not build a prompt of exactly {positions} positions with this tokenizer")
    return text


def _steady_frame_ms(model, prompt_state) -> float:
    s = model.create_streaming_session(prompt_state=prompt_state)
    times = []
    frame = np.zeros(model.config.frame_samples, np.float32)
    for _ in range(12):
        t = time.perf_counter()
        s.push_audio(frame)
        times.append((time.perf_counter() - t) * 1000.0)
    s.cancel()
    return statistics.median(times[2:])


def _first_frame_ms(model, session) -> float:
    t = time.perf_counter()
    session.push_audio(np.zeros(model.config.frame_samples, np.float32))
    dt = (time.perf_counter() - t) * 1000.0
    session.cancel()
    return dt


def run_prompt_sweep(
    checkpoint: str, lengths: list[int], out: Path, *, runs: int = 2, numerics: str = "reference", progress: bool = True
) -> Path:
    import voicechat
    from voicechat.synthetic.checkpoint import resolve_model_arg

    from .env import checkpoint_info, environment

    def say(msg):
        if progress:
            print(f"[prompt sweep] {msg}", flush=True)

    lengths = sorted({int(n) for n in lengths})
    folder = Path(resolve_model_arg(checkpoint))
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    env = environment([checkpoint_info(checkpoint, folder)])
    t_start = time.perf_counter()
    model = voicechat.load(folder, numerics=numerics)
    model.warm_runtime()
    rows = []
    for n in lengths:
        prompt = prompt_of_positions(model, n)
        for run in range(1, runs + 1):
            say(f"{checkpoint}: {n} positions, run {run}/{runs}: from scratch ...")
            t = time.perf_counter()
            scratch = model.create_streaming_session(system_prompt=prompt)
            scratch_s = time.perf_counter() - t
            assert scratch.prompt_positions == n
            scratch_first = _first_frame_ms(model, scratch)
            say(f"{checkpoint}: {n} positions, run {run}/{runs}: prepare_prompt ...")
            t = time.perf_counter()
            state = model.prepare_prompt(prompt)
            prepare_s = time.perf_counter() - t
            t = time.perf_counter()
            session = model.create_streaming_session(prompt_state=state)
            state_ms = (time.perf_counter() - t) * 1000.0
            state_first = _first_frame_ms(model, session)
            with tempfile.TemporaryDirectory() as d:
                t = time.perf_counter()
                path = state.save(Path(d) / "state.safetensors")
                save_ms = (time.perf_counter() - t) * 1000.0
                file_bytes = path.stat().st_size
                t = time.perf_counter()
                voicechat.PromptState.load(path, model)
                load_ms = (time.perf_counter() - t) * 1000.0
            steady = _steady_frame_ms(model, state)
            rows.append(
                {
                    "checkpoint": checkpoint,
                    "positions": n,
                    "run": run,
                    "scratch_session_s": scratch_s,
                    "prepare_s": prepare_s,
                    "state_session_ms": state_ms,
                    "scratch_first_frame_ms": scratch_first,
                    "state_first_frame_ms": state_first,
                    "state_bytes": state.nbytes,
                    "file_bytes": file_bytes,
                    "save_ms": save_ms,
                    "load_ms": load_ms,
                    "steady_frame_ms": steady,
                }
            )
            say(
                f"{checkpoint}: {n} positions: scratch {scratch_s:.2f} s, prepare {prepare_s:.2f} s, from state "
                f"{state_ms:.2f} ms, state {state.nbytes / 2**20:.2f} MiB"
            )
            del state, session, scratch
    env["prompt_sweep"] = {
        "lengths": lengths,
        "runs": runs,
        "numerics": numerics,
        "seconds": round(time.perf_counter() - t_start, 1),
    }
    (out / "env.json").write_text(json.dumps(env, indent=2, sort_keys=True) + "\n")
    with open(out / "prompt_sweep.csv", "w") as f:
        f.write(",".join(COLUMNS) + "\n")
        for r in rows:
            f.write(",".join(f"{r[c]:.4f}" if isinstance(r[c], float) else str(r[c]) for c in COLUMNS) + "\n")
    (out / "summary.md").write_text(render_prompt_sweep(out))
    return out


def _read(run_dir: Path) -> tuple[dict, list[dict]]:
    env = json.loads((run_dir / "env.json").read_text())
    lines = (run_dir / "prompt_sweep.csv").read_text().strip().splitlines()
    head = lines[0].split(",")
    rows = []
    for line in lines[1:]:
        d = dict(zip(head, line.split(","), strict=True))
        rows.append({k: (v if k == "checkpoint" else float(v)) for k, v in d.items()})
    return env, rows


def render_prompt_sweep(run_dir: Path, *, level: int = 1, title: str | None = None) -> str:
    """The sweep's Markdown: medians over the runs per checkpoint and length (from the folder's files only)."""
    run_dir = Path(run_dir)
    env, rows = _read(run_dir)
    h = "#" * level
    m = env["machine"]
    sw = env["prompt_sweep"]
    out = [
        f"{h} {title or 'Prompt states: session start per prompt length'}",
        "",
        (
            f"- **Machine:** {m['cpu']}, {m.get('usable_cpus')} usable CPU cores, {m.get('memory_gib')} GiB RAM; "
            f"{m['platform']}"
        ),
        (
            f"- **Software:** MLX {env['mlx']['version']} on `{env['mlx']['default_device']}`, voicechat-mlx at git "
            f"`{(env.get('git_revision') or '?')[:12]}`; numerics `{sw['numerics']}`"
        ),
        (
            f"- **Date:** {env['date']} (UTC); {sw['runs']} run(s) per length, medians shown; the sweep took "
            f"{sw['seconds'] / 60:.1f} min"
        ),
        "",
        (
            "Per prompt length in positions ([bos] + tokens + [eos]): *from scratch* = "
            "`create_streaming_session(system_prompt=...)` (it prefills), *prepare* = `model.prepare_prompt(...)`, "
            "*from state* = `create_streaming_session(prompt_state=state)`; the first frame of each of those two "
            "sessions; *steady frame* = median of frames 3-12 of a session (the target: a session from a state "
            "within one steady frame); the state's bytes (`state.nbytes`), its file's, and saving / loading it."
        ),
        "",
    ]
    out.append(
        "| checkpoint | positions | from scratch s | prepare s | from state ms | first frame ms "
        "(scratch / state) | steady frame ms | state MiB | file MiB | save / load ms |"
    )
    out.append("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    keys = []
    for r in rows:
        k = (r["checkpoint"], int(r["positions"]))
        if k not in keys:
            keys.append(k)
    for ck, n in keys:
        sel = [r for r in rows if r["checkpoint"] == ck and int(r["positions"]) == n]
        med = {c: statistics.median(r[c] for r in sel) for c in COLUMNS if c not in ("checkpoint", "positions", "run")}
        out.append(
            f"| `{ck}` | {n} | {med['scratch_session_s']:.2f} | {med['prepare_s']:.2f} | "
            f"{med['state_session_ms']:.2f} | {med['scratch_first_frame_ms']:.1f} / "
            f"{med['state_first_frame_ms']:.1f} | {med['steady_frame_ms']:.1f} | "
            f"{med['state_bytes'] / 2**20:.2f} | {med['file_bytes'] / 2**20:.2f} | "
            f"{med['save_ms']:.0f} / {med['load_ms']:.0f} |"
        )
    return "\n".join(out) + "\n"


__all__ = ["run_prompt_sweep", "render_prompt_sweep", "prompt_of_positions"]
