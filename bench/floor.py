"""The physical floor of one streaming frame: weight bytes it must read, over this machine's bandwidth.

Weight bytes per stage come from the loaded model's parameters (docs/model.md
§11.3 says which weights each stage touches per steady-state frame):

* perception: the whole conformer (subsampling + layers) and the projection;
* rnnt: the prediction network and the joint once (one symbol iteration, the
  minimum), the prediction embedding as 1 row;
* language: every Nemotron-H layer, both heads, 3 rows of the token embedding
  (previous text id, previous function id, and nothing else: the audio
  embedding comes from perception); plus the Mamba SSM states, read and written
  once (float32), counted separately as state bytes;
* tts: the backbone, the char-aware encoder, the gated fusion, `embed_code`
  once per step plus once per MoG pass, the MoG trunk and its small heads once
  per effective refinement pass, `proj_mus` 64 (low-rank) rows and one
  `low_mat` slice per pass, all of `rvq_embs` (each codebook is searched once);
  `audio_prompt_projection_W` and the speaker latent are not used per frame;
* codec: the decoder, and one row of each RVQ codebook (`prvq.mus_list`).

Integer lookup tables (subword flags, control codes) are not counted.

Bandwidth: the best effective read rate MLX reaches on this machine for a
large matrix-vector product in each weight format (bf16, float32, and the
affine-quantized kernel at 4 and 8 bits: `mx.quantized_matmul` / `mx.matmul`, or
`voicechat.runtime.kernels`'s products where they are on and faster, as the runtime uses them): matrix
bytes / wall time, best of several repetitions after a warm-up. The floor of a
stage is the sum over its weight formats of bytes / bandwidth; the ratio
measured / floor says how far the implementation is from streaming its weights
at that rate.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from functools import partial

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

from voicechat.runtime import ExecutionPolicy
from voicechat.runtime.kernels import float32_matmul, quantized_matmul as cpu_qmv_matmul
from voicechat.runtime.linear import resident_arrays, secondary_stream
from voicechat.streaming.engine import STAGES

FORMATS = ("bf16", "f32", "q4", "q8")  # weight storage formats the floor distinguishes


@dataclass
class StageBytes:
    """Bytes one frame reads in one stage, split by weight format (plus float32 state traffic)."""

    stage: str
    by_format: dict[str, float] = field(default_factory=lambda: dict.fromkeys(FORMATS, 0.0))
    state_bytes: float = 0.0  # float32 recurrent state read + written per frame (Mamba SSM)

    @property
    def weight_bytes(self) -> float:
        return float(sum(self.by_format.values()))

    def add(self, fmt: str, nbytes: float) -> None:
        if fmt not in self.by_format:
            raise ValueError(f"unknown weight format {fmt!r}; expected one of {FORMATS}")
        self.by_format[fmt] += float(nbytes)


def _float_format(a: mx.array) -> str | None:
    if a.dtype == mx.bfloat16:
        return "bf16"
    if a.dtype == mx.float16:
        return "bf16"  # same width; MLX's half kernels read at the same rate to first order
    if a.dtype == mx.float32:
        return "f32"
    return None  # integer buffers: lookups, not streamed


def _quantized_modules(model) -> dict[str, int]:
    """module path -> bits of every quantized module."""
    out = {}
    for path, m in model.named_modules():
        if isinstance(m, (nn.QuantizedLinear, nn.QuantizedEmbedding)):
            out[path] = int(m.bits)
    return out


def _stage_of(name: str) -> str | None:
    if name.startswith("stt_model.perception."):
        return "perception"
    if name.startswith(("stt_model.rnnt_decoder.", "stt_model.rnnt_joint.")):
        return "rnnt"
    if name.startswith(("stt_model.llm.", "stt_model.lm_head.", "stt_model.function_head.", "stt_model.embed_tokens.")):
        return "language"
    if name.startswith("tts_model.tts_model."):
        return "tts"
    if name.startswith("tts_model.audio_codec."):
        return "codec"
    return None  # tts_model.control_codes / codec_silence_tokens / audio_prompt_latents


def _mog_passes(cfg) -> int:
    from voicechat.model.tts.ear_tts import mog_pass_schedule

    t = cfg.tts_config
    return sum(1 for c in mog_pass_schedule(t.num_quantizers, t.num_iterations, t.exponent) if c > 0)


def _per_frame_fraction(name: str, shape: tuple, cfg, passes: int) -> float | None:
    """How many times (possibly a fraction of the tensor) one frame reads this tensor; None = never."""
    tts = "tts_model.tts_model."
    if name.startswith("stt_model.embed_tokens."):
        return 3.0 / shape[0]  # 3 rows (packed weights, scales and biases are per row)
    if name.startswith("stt_model.rnnt_decoder.prediction.embed."):
        return 1.0 / shape[0]  # one row (of the weight, or of a quantized one's packed weight, scales, biases)
    if name.startswith("tts_model.audio_codec.encoder."):
        return None  # only used to build the silent prompt codes at load
    if name.startswith("tts_model.audio_codec.prvq.mus_list."):
        return 1.0 / shape[0]  # one codebook row per frame
    if name.startswith("tts_model.audio_codec.prvq.variance_list."):
        return None  # unused (docs/model.md §9.1)
    if name.startswith(tts):
        local = name[len(tts) :]
        if local == "audio_prompt_projection_W":
            return None
        if local.startswith("embed_code."):
            return 1.0 + passes
        if local.startswith("mog_head.proj_mus."):
            low_rank = cfg.tts_config.mog_head.low_rank
            return passes * low_rank / shape[0]
        if local == "mog_head.low_mat":
            return passes / shape[0]  # one component's (latent, rank) slice per pass
        if local.startswith("mog_head."):
            return float(passes)  # trunk, final norm, proj_logits / proj_else / proj_logs
    return 1.0


def frame_weight_bytes(model) -> dict[str, StageBytes]:
    """Bytes per stage one steady-state streaming frame must read (see the module docstring)."""
    cfg = model.config
    passes = _mog_passes(cfg)
    quantized = _quantized_modules(model)
    out = {s: StageBytes(s) for s in STAGES}
    for name, arr in tree_flatten(model.parameters()):
        stage = _stage_of(name)
        if stage is None:
            continue
        module, _, leaf = name.rpartition(".")
        if module in quantized and leaf in ("weight", "scales", "biases"):
            fmt = f"q{quantized[module]}"
        else:
            fmt = _float_format(arr)
            if fmt is None:
                continue
        frac = _per_frame_fraction(name, tuple(arr.shape), cfg, passes)
        if frac is None:
            continue
        out[stage].add(fmt, arr.nbytes * frac)
    # Mamba SSM states: (heads, head_dim, state) float32 per Mamba layer, read and written each frame.
    t = cfg.text_config
    n_mamba = t.hybrid_override_pattern.count("M")
    out["language"].state_bytes = 2.0 * n_mamba * t.mamba_num_heads * t.mamba_head_dim * t.ssm_state_size * 4
    return out


# -- bandwidth


def _best_seconds(fn, reps: int) -> float:
    mx.eval(fn())  # warm-up (allocation, first-use setup)
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        mx.eval(fn())
        best = min(best, time.perf_counter() - t0)
    return best


def _rows_split(policy: ExecutionPolicy, fn, *mats):
    """fn over the two row halves of `mats`, the second on `policy`'s second CPU stream, as the
    runtime splits its large products (voicechat.runtime.linear); plain fn(*mats) on one stream."""
    stream = secondary_stream(policy)
    if stream is None:
        return fn(*mats)
    half = mats[0].shape[0] // 2
    lo = fn(*(m[:half] for m in mats))
    with mx.stream(stream):
        hi = fn(*(m[half:] for m in mats))
    return mx.concatenate([lo, hi], axis=-1)


def _transposed_halves(w: mx.array, policy: ExecutionPolicy) -> list[mx.array]:
    """W.T as contiguous (cols, rows / 2) halves when `policy` runs on two streams, else one (cols, rows)."""
    parts = [w] if secondary_stream(policy) is None else [w[: w.shape[0] // 2], w[w.shape[0] // 2 :]]
    out = [mx.contiguous(p.T) for p in parts]
    mx.eval(out)
    return out


def _halves_product(policy: ExecutionPolicy, x: mx.array, halves_t: list[mx.array], product=None) -> mx.array:
    """x @ W_t over the halves, the second on `policy`'s second CPU stream (as FastLinear runs them:
    through `cpu_qmv.float32_matmul` with the policy's kernels, unless `product` says otherwise)."""
    if product is None:

        def product(a, b, stream=None):
            return float32_matmul(a, b, stream=stream, enabled=policy.cpu_kernels)

    if len(halves_t) == 1:
        return product(x, halves_t[0])
    lo = product(x, halves_t[0])
    hi = product(x, halves_t[1], stream=secondary_stream(policy))
    return mx.concatenate([lo, hi], axis=-1)


def measure_bandwidth(
    target_mb: float = 256.0, *, reps: int = 6, cols: int = 4096, policy: ExecutionPolicy | None = None
) -> dict[str, dict]:
    """`_measure_bandwidth` under `policy` (default: this device's, `ExecutionPolicy.for_device()`)."""
    policy = ExecutionPolicy.for_device() if policy is None else policy
    return _measure_bandwidth(policy, target_mb, reps=reps, cols=cols)


def _measure_bandwidth(
    policy: ExecutionPolicy, target_mb: float = 256.0, *, reps: int = 6, cols: int = 4096
) -> dict[str, dict]:
    """Effective MLX read bandwidth (GB/s) of a large matrix-vector product per weight format.

    The product runs the way the runtime runs its large products: split in two
    row halves on two CPU streams when the policy's `cpu_streams` is 2
    (each entry records "streams").

    Each matrix holds about `target_mb` MB in its format (rows rounded up to a
    multiple of 64). float32 is measured on the stored layout and on contiguous
    W.T halves; bf16 with bf16 and with float32 activations and as a float32
    copy stored transposed (what the runtime does); the fastest is the floor's rate. Returns
    {format: {"gbps", "matrix_mb", "ms", "kernel"}}. Uses a private random
    key (the global generator is not touched).
    """
    if not target_mb > 0 or reps < 1 or cols % 64:
        raise ValueError(
            f"measure_bandwidth: need target_mb > 0, reps >= 1, cols % 64 == 0; got {target_mb}, {reps}, {cols}"
        )
    key = mx.random.key(0)
    x32 = mx.random.normal((1, cols), key=key)
    results: dict[str, dict] = {}

    def rows_for(bytes_per_element: float) -> int:
        r = int(target_mb * 1e6 / (cols * bytes_per_element))
        return max(64, (r + 63) // 64 * 64)

    # float32: x @ W.T on the stored layout, and x @ W_t on contiguous transposed halves (the
    # runtime's float32 copies, voicechat.runtime.linear.linear); the faster is the rate.
    w = mx.random.normal((rows_for(4.0), cols), key=key)
    mx.eval(w, x32)
    s_view = _best_seconds(partial(_rows_split, policy, lambda m: x32 @ m.T, w), reps)
    halves_t = _transposed_halves(w, policy)
    s_t = _best_seconds(partial(_halves_product, policy, x32, halves_t, mx.matmul), reps)
    s, kernel = (s_t, "f32 x f32 matmul, W.T contiguous") if s_t <= s_view else (s_view, "f32 x f32 matmul")
    entry = {}
    if policy.cpu_kernels:  # the runtime's float32 product where it serves (same bits as MLX's)
        s_k = _best_seconds(partial(_halves_product, policy, x32, halves_t), reps)
        entry = {"gbps_cpu_qmv": w.nbytes / s_k / 1e9}
        if s_k < s:
            s, kernel = s_k, "voicechat cpu_qmv float32, W.T contiguous"
    results["f32"] = {
        "gbps": w.nbytes / s / 1e9,
        "matrix_mb": w.nbytes / 1e6,
        "ms": s * 1e3,
        "kernel": kernel,
        "gbps_transposed_view": w.nbytes / s_view / 1e9,
        "gbps_contiguous_transpose": w.nbytes / s_t / 1e9,
        **entry,
    }
    del w, halves_t

    # bf16: bf16 or float32 activations on the stored weight, or a float32 copy stored transposed
    # (what the runtime does; it reads twice the bytes, so its rate here is bf16 bytes / time).
    w = mx.random.normal((rows_for(2.0), cols), key=key).astype(mx.bfloat16)
    xb = x32.astype(mx.bfloat16)
    mx.eval(w, xb)
    s_bb = _best_seconds(partial(_rows_split, policy, lambda m, xb=xb: xb @ m.T, w), reps)
    s_bf = _best_seconds(partial(_rows_split, policy, lambda m: x32 @ m.T, w), reps)
    halves_t = _transposed_halves(w.astype(mx.float32), policy)
    s_copy = _best_seconds(partial(_halves_product, policy, x32, halves_t), reps)
    del halves_t
    s, kernel = min(
        (s_bb, "bf16 x bf16 matmul"), (s_bf, "bf16 weights x f32 activations"), (s_copy, "float32 copy, W.T contiguous")
    )
    results["bf16"] = {
        "gbps": w.nbytes / s / 1e9,
        "matrix_mb": w.nbytes / 1e6,
        "ms": s * 1e3,
        "kernel": kernel,
        "gbps_bf16_activations": w.nbytes / s_bb / 1e9,
        "gbps_f32_activations": w.nbytes / s_bf / 1e9,
        "gbps_float32_copy": w.nbytes / s_copy / 1e9,
    }
    del w, xb

    # affine quantized, group size 64, float32 scales/biases (as the published checkpoints)
    for bits in (4, 8):
        per_el = bits / 8 + 2 * 4 / 64
        w = mx.random.normal((rows_for(per_el), cols), key=key)
        q, sc, bi = mx.quantize(w, group_size=64, bits=bits)
        del w
        mx.eval(q, sc, bi)
        nbytes = q.nbytes + sc.nbytes + bi.nbytes
        s_mlx = _best_seconds(
            partial(
                _rows_split,
                policy,
                lambda a, b, c, bits=bits: mx.quantized_matmul(x32, a, b, c, transpose=True, group_size=64, bits=bits),
                q,
                sc,
                bi,
            ),
            reps,
        )
        s, kernel = s_mlx, f"mx.quantized_matmul {bits}-bit, group 64, f32 activations"
        entry = {}
        if policy.cpu_kernels:  # the runtime's kernel where it serves (same bits as MLX's)
            s_qmv = _best_seconds(
                partial(
                    _rows_split,
                    policy,
                    lambda a, b, c, bits=bits: cpu_qmv_matmul(x32, a, b, c, group_size=64, bits=bits, enabled=True),
                    q,
                    sc,
                    bi,
                ),
                reps,
            )
            entry = {"gbps_mx_quantized_matmul": nbytes / s_mlx / 1e9, "gbps_cpu_qmv": nbytes / s_qmv / 1e9}
            if s_qmv < s_mlx:
                s, kernel = s_qmv, f"voicechat cpu_qmv {bits}-bit, group 64, f32 activations"
        results[f"q{bits}"] = {
            "gbps": nbytes / s / 1e9,
            "matrix_mb": nbytes / 1e6,
            "ms": s * 1e3,
            "kernel": kernel,
            **entry,
        }
        del q, sc, bi
    mx.clear_cache()
    for entry in results.values():
        entry["streams"] = policy.cpu_streams
    return results


def floor_ms(stage_bytes: StageBytes, bandwidth: dict[str, dict]) -> float:
    """Milliseconds to read the stage's bytes once at the measured rate of each format."""
    total = 0.0
    for fmt, nbytes in stage_bytes.by_format.items():
        if nbytes:
            total += nbytes / (bandwidth[fmt]["gbps"] * 1e9)
    if stage_bytes.state_bytes:
        total += stage_bytes.state_bytes / (bandwidth["f32"]["gbps"] * 1e9)
    return total * 1e3


def tick_floor_ms(stage_bytes: StageBytes, bandwidth: dict[str, dict], sessions: int) -> float:
    """A tick of `sessions` conversations in one batch: the weights read once (every row of a product
    shares them), each conversation's own state bytes read and written (`floor_ms` at sessions = 1)."""
    if isinstance(sessions, bool) or not isinstance(sessions, int) or sessions < 1:
        raise ValueError(f"sessions must be an int >= 1, got {sessions!r}")
    weights = floor_ms(StageBytes(stage_bytes.stage, dict(stage_bytes.by_format)), bandwidth)
    state = sessions * stage_bytes.state_bytes / (bandwidth["f32"]["gbps"] * 1e9) * 1e3
    return weights + state


def resident_bytes_by_stage(model) -> dict[str, int]:
    """Bytes each stage keeps resident after `voicechat.load`: its parameters (float32 copies
    replace their 16-bit originals, voicechat.runtime.linear) plus the derived arrays cached on its
    modules (voicechat.model.derived.derived, numpy float32 copies of voicechat.runtime.host_products included;
    views excluded): `voicechat.runtime.linear.resident_arrays`. Arrays outside the five stages
    (speaker latents, control codes) go to "other"; "total" is the sum."""
    out = dict.fromkeys((*STAGES, "other"), 0)
    for path, a in resident_arrays(model):
        out[_stage_of(path + ".") or "other"] += a.nbytes
    out["total"] = sum(out.values())
    return out


def floor_table(model, bandwidth: dict[str, dict]) -> list[dict]:
    """One row per stage (and `total`): weight MB by format, state MB, floor ms, resident MB."""
    per_stage = frame_weight_bytes(model)
    resident = resident_bytes_by_stage(model)
    rows = []
    tot = StageBytes("total")
    for stage in STAGES:
        b = per_stage[stage]
        for fmt, v in b.by_format.items():
            tot.add(fmt, v)
        tot.state_bytes += b.state_bytes
        rows.append(_row(b, bandwidth, resident[stage]))
    rows.append(_row(tot, bandwidth, resident["total"]))
    return rows


def _row(b: StageBytes, bandwidth, resident: int) -> dict:
    row = {"stage": b.stage, "weight_mb": b.weight_bytes / 1e6, "state_mb": b.state_bytes / 1e6}
    for fmt in FORMATS:
        row[f"{fmt}_mb"] = b.by_format[fmt] / 1e6
    row["floor_ms"] = floor_ms(b, bandwidth)
    row["resident_mb"] = resident / 1e6
    return row


__all__ = [
    "STAGES",
    "FORMATS",
    "StageBytes",
    "frame_weight_bytes",
    "resident_bytes_by_stage",
    "measure_bandwidth",
    "floor_ms",
    "tick_floor_ms",
    "floor_table",
]
