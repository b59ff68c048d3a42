"""The CPU quantized kernel's time per call for M = 1, 2, 4, 8 rows of x (a script, not a test).

    python -m bench.kernel_rows [--so LABEL=PATH ...] [--reps 41] [--presets small16 full] [--bits 4 8]

Each `--so` is a built `_voicechat_cpu_qmv` module (e.g. a copy of the build before a change);
without one, the extension `voicechat.runtime.kernels` builds for this checkout is timed. The
shapes are the language model's quantized products at the presets (the Mamba in_proj, out_proj,
the MLP's up / down, attention q / kv / o, the LM head) and a square (4096, 4096); group size 64
as the published checkpoints. Every module and every M is timed in turn within each repetition
(alternating, so drifts in the machine's load fall on all alike); the table gives the median time
of one call (graph built and evaluated, one dispatch) and the ratio time(M) / time(1).
"""

from __future__ import annotations

import argparse
import importlib.util
import statistics
import time
from pathlib import Path

import mlx.core as mx
import numpy as np

GROUP = 64
ROWS = (1, 2, 4, 8)


def shapes(preset: str) -> list[tuple[str, int, int]]:
    """(name, N, K) of the language model's quantized products at `preset`, each shape once."""
    from voicechat.synthetic.presets import preset_config

    t = preset_config(preset).text_config
    h = t.hidden_size
    out = [
        ("mamba in_proj", t.mamba_in_proj_dim, h),
        ("mamba out_proj", h, t.mamba_d_inner),
        ("mlp up", t.intermediate_size, h),
        ("mlp down", h, t.intermediate_size),
        ("attn q", t.num_attention_heads * t.head_dim, h),
        ("attn k/v", t.num_key_value_heads * t.head_dim, h),
        ("attn o", h, t.num_attention_heads * t.head_dim),
        ("lm_head", t.vocab_size, h),
    ]
    seen, unique = set(), []
    for name, n, k in out:
        if (n, k) not in seen:
            seen.add((n, k))
            unique.append((name, n, k))
    return unique


def load(path: str):
    path = Path(path)
    spec = importlib.util.spec_from_file_location(path.name.split(".")[0], path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def quantized(rng, n: int, k: int, bits: int):
    """Random (n, k) weights quantized, in row chunks (the LM head's float32 would be 2.3 GB)."""
    parts = []
    for start in range(0, n, 8192):
        rows = min(8192, n - start)
        w = mx.array(rng.standard_normal((rows, k), dtype=np.float32))
        parts.append(mx.quantize(w, group_size=GROUP, bits=bits))
        mx.eval(parts[-1])
    return tuple(mx.concatenate([p[i] for p in parts]) for i in range(3))


def time_call(module, x, w, s, b, bits) -> float:
    start = time.perf_counter()
    mx.eval(module.quantized_matvec(x, w, s, b, GROUP, bits, stream=mx.cpu))
    return time.perf_counter() - start


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--so", action="append", default=[], help="LABEL=PATH of a built module (repeatable)")
    p.add_argument("--reps", type=int, default=41)
    p.add_argument("--presets", nargs="+", default=["small16", "full"])
    p.add_argument("--bits", nargs="+", type=int, default=[4, 8])
    p.add_argument("--square", action=argparse.BooleanOptionalAction, default=True, help="also (4096, 4096)")
    p.add_argument("--max-mb", type=float, default=1e9, help="skip matrices larger than this (MB packed)")
    args = p.parse_args(argv)

    modules = {}
    for spec in args.so:
        label, _, path = spec.partition("=")
        modules[label] = load(path)
    if not modules:
        from voicechat.runtime import kernels

        module = kernels.extension()
        if module is None:
            raise SystemExit(f"the extension cannot be used here: {kernels.unavailable_reason()}")
        modules["this checkout"] = module

    cases = [(preset, *shape) for preset in args.presets for shape in shapes(preset)]
    if args.square:
        cases.append(("square", "", 4096, 4096))
    rng = np.random.default_rng(0)
    print(f"median of {args.reps} calls; ratio: time(M rows) / time(1 row) of the same module")
    header = f"{'preset':8} {'product':15} {'N':>7} {'K':>6} {'bits':>4} {'module':14}"
    print(
        header
        + "".join(f" {'M=' + str(m) + ' ms':>10}" for m in ROWS)
        + "".join(f" {'r' + str(m):>6}" for m in ROWS[1:])
    )
    for bits in args.bits:
        for preset, name, n, k in cases:
            if n * k * bits / 8 / 1e6 > args.max_mb:
                continue
            w, s, b = quantized(rng, n, k, bits)
            xs = {m: mx.array(rng.standard_normal((m, k), dtype=np.float32)) for m in ROWS}
            times = {(label, m): [] for label in modules for m in ROWS}
            for module in modules.values():  # warm up: the weights in cache as far as they fit
                for m in ROWS:
                    time_call(module, xs[m], w, s, b, bits)
            for _ in range(args.reps):
                for label, module in modules.items():
                    for m in ROWS:
                        times[label, m].append(time_call(module, xs[m], w, s, b, bits))
            for label in modules:
                med = {m: statistics.median(times[label, m]) * 1e3 for m in ROWS}
                print(
                    f"{preset:8} {name:15} {n:>7} {k:>6} {bits:>4} {label:14}"
                    + "".join(f" {med[m]:>10.3f}" for m in ROWS)
                    + "".join(f" {med[m] / med[1]:>6.2f}" for m in ROWS[1:]),
                    flush=True,
                )
            del w, s, b


if __name__ == "__main__":
    main()
