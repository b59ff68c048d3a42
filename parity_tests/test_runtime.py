"""The seam between what a component computes and how a frame is executed (voicechat.model.ops,
voicechat.runtime): every execution policy gives the same numbers, a policy is a frozen value on
the model, and the model code does not know the runtime.

Tolerances: ids, codes and every cache but the codec's must be equal bit for bit: a policy only
changes which thread, kernel or compiled trace runs an operation, never the float32 operations
themselves (each product is the same chain of multiply-adds in the same order, each fused piece
the same elementwise sequence). The codec's products run through numpy's BLAS under a policy with
`host_products` and through MLX's otherwise: the same products summed in another order, so the
codec's caches and the audio agree to `harness.families.codec_cross_tolerance` (8 sqrt(n) L u
times the signal's peak), the bound for two float32 implementations of one codec.
"""

from __future__ import annotations

import ast
import dataclasses
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

import voicechat
from harness.families import codec_cross_tolerance
from voicechat.model import ops
from voicechat.runtime import ENV_VARS, ExecutionPolicy
from voicechat.runtime.policy import UNBOUND

from . import independent_writer
from .runtime_util import POLICIES, bound_policy, default_policy

PACKAGE = Path(voicechat.__file__).parent
COMPONENT_DIRS = ("model/audio", "model/llm", "model/tts")
EXECUTION_MODULES = {"runtime", "compiled", "parallel", "cpu_qmv", "host_gemm", "overlap", "heap", "switch"}


def _imports(path: Path) -> list[str]:
    """Every module `path` imports, as written (relative imports with their dots)."""
    names = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = "." * node.level + (node.module or "")
            names += [base] + [base + ("" if base.endswith(".") else ".") + a.name for a in node.names]
    return names


def test_component_modules_do_not_import_the_runtime():
    """mel, conformer, rnnt, nemotron_h, ear_tts (with its char encoder, layers, rng) and the codec
    compute with mlx and `voicechat.model.ops` only; how they execute is not theirs to know."""
    files = sorted(p for d in COMPONENT_DIRS for p in (PACKAGE / d).glob("*.py"))
    assert len(files) >= 10
    offending = {}
    for path in files:
        bad = [
            name for name in _imports(path) if any(part in EXECUTION_MODULES for part in name.lstrip(".").split("."))
        ]
        if bad:
            offending[str(path.relative_to(PACKAGE))] = bad
    assert offending == {}


def test_the_op_seam_imports_no_runtime():
    assert not [n for n in _imports(PACKAGE / "model" / "ops.py") if "runtime" in n]


def test_execution_variables_are_read_only_by_the_policy():
    """No module but runtime/policy.py reads an execution variable from the environment: nothing
    can change how a live model executes between its frames."""
    readers = []
    for path in PACKAGE.rglob("*.py"):
        if path == PACKAGE / "runtime" / "policy.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.Call, ast.Subscript)):
                text = ast.unparse(node)
                if ("environ" in text or "getenv" in text) and any(v in text for v in ENV_VARS.values()):
                    readers.append(f"{path.relative_to(PACKAGE)}: {text}")
    assert readers == []


def test_policy_from_the_environment_once():
    env = {
        "VOICECHAT_CPU_STREAMS": "1",
        "VOICECHAT_COMPILE": "0",
        "VOICECHAT_HOST_GEMM": "0",
        "VOICECHAT_OVERLAP": "0",
        "VOICECHAT_KEEP_HEAP": "0",
        "VOICECHAT_FLOAT32_COPIES": "1",
        "VOICECHAT_CPU_QMV": "0",
    }
    p = ExecutionPolicy.for_device(mx.cpu, environ=env)
    assert (
        p.cpu_streams,
        p.compiled,
        p.host_products,
        p.overlap,
        p.keep_heap,
        p.float32_copies,
        p.cpu_kernels,
        p.bf16_transposed,
    ) == (1, False, False, False, False, True, False, False)
    for name in ENV_VARS.values():
        with pytest.raises(ValueError, match=name):
            ExecutionPolicy.for_device(mx.cpu, environ={name: "maybe"})
    with pytest.raises(dataclasses.FrozenInstanceError):
        p.cpu_streams = 2
    with pytest.raises(ValueError, match="1 or 2"):
        ExecutionPolicy(name="x", cpu_streams=3)
    with pytest.raises(TypeError, match="compiled"):
        ExecutionPolicy(name="x", compiled=1)


def test_gpu_policy_is_what_a_gpu_gets():
    gpu = ExecutionPolicy.gpu()
    assert gpu == ExecutionPolicy.for_device(mx.gpu, environ={})
    assert (
        gpu.cpu_streams,
        gpu.cpu_kernels,
        gpu.host_products,
        gpu.overlap,
        gpu.keep_heap,
        gpu.float32_copies,
        gpu.bf16_transposed,
        gpu.rnnt_on_device,
    ) == (1, False, False, False, False, False, True, True)
    assert gpu.compiled  # fewer dispatches on any device


def test_load_takes_a_policy_and_keeps_it(tiny_ckpt_4bit, monkeypatch):
    with pytest.raises(TypeError, match="ExecutionPolicy"):
        voicechat.load(tiny_ckpt_4bit, policy="serial")
    monkeypatch.setenv("VOICECHAT_CPU_STREAMS", "1")
    model = voicechat.load(tiny_ckpt_4bit, warmup=False)
    assert model.policy.cpu_streams == 1
    monkeypatch.setenv("VOICECHAT_CPU_STREAMS", "2")  # read once, at load
    session = model.create_streaming_session(profile=True)
    session.push_audio(np.zeros(1280, np.float32))
    summary = session.profile.summary()
    assert summary["execution_policy"] == model.policy.as_dict() and summary["execution_policy"]["cpu_streams"] == 1
    assert "execution policy" in session.profile.table()
    with model.executing():
        assert bound_policy() is model.policy
    assert model.policy.cpu_streams == 1
    assert bound_policy() is UNBOUND  # nothing stays bound after a frame


# -- every policy gives the same numbers


def _stream(model, wave, prompt):
    session = model.create_streaming_session(system_prompt=prompt, seed=0)
    events = session.push_audio(wave) + session.flush()
    audio = np.concatenate([e.samples for e in events if e.kind in ("audio", "audio_tail")])
    ids = [(e.kind, e.frame_index, e.token_id) for e in events if e.kind in ("assistant_text_delta", "function_delta")]
    return {k: np.array(v) for k, v in session.states().items()}, ids, audio


def _checkpoints():
    return {
        "tiny-4bit": lambda tmp: voicechat.synthetic.write_checkpoint(tmp / "t4", "tiny", bits=4),
        "writer-real-depth-bf16-4bit": lambda tmp: independent_writer.write(
            tmp / "w", independent_writer.Spec(depth="real", dtype="bfloat16", bits=4, predicate="published")
        ),
        "writer-tiny-float32": lambda tmp: independent_writer.write(
            tmp / "f", independent_writer.Spec(dtype="float32", control_inside=False)
        ),
    }


@pytest.fixture(scope="module", params=list(_checkpoints()))
def checkpoint(request, tmp_path_factory):

    return _checkpoints()[request.param](tmp_path_factory.mktemp(request.param))


@pytest.fixture(scope="module")
def device_run(checkpoint, question_wav):
    model = voicechat.load(checkpoint, policy=default_policy())
    wave = question_wav[: 1280 * 24]
    return model, _stream(model, wave, "hello"), model.generate(wave, system_prompt="hello", seed=0)


@pytest.mark.parametrize("name", ["serial", "gpu"])
def test_every_policy_gives_the_same_numbers(name, checkpoint, device_run, question_wav):
    base_model, (base_states, base_ids, base_audio), base_offline = device_run
    model = voicechat.load(checkpoint, policy=POLICIES[name]())
    wave = question_wav[: 1280 * 24]
    states, ids, audio = _stream(model, wave, "hello")
    offline = model.generate(wave, system_prompt="hello", seed=0)
    assert model.policy != base_model.policy
    assert ids == base_ids
    np.testing.assert_array_equal(offline.text_tokens, base_offline.text_tokens)
    np.testing.assert_array_equal(offline.function_tokens, base_offline.function_tokens)
    np.testing.assert_array_equal(offline.audio_codes, base_offline.audio_codes)
    assert offline.transcript_tokens == base_offline.transcript_tokens
    assert set(states) == set(base_states)
    codec_cfg = model.config.codec_config
    both_host = model.policy.host_products == base_model.policy.host_products
    for family, value in states.items():
        want = base_states[family]
        assert value.shape == want.shape, family
        if family.startswith("codec.") and not both_host:
            tol = codec_cross_tolerance(codec_cfg, float(np.abs(want).max())).value
            assert np.abs(value.astype(np.float64) - want).max() <= tol, family
        else:
            assert np.array_equal(value, want), family
    for got, want in ((audio, base_audio), (offline.audio, base_offline.audio)):
        assert got.shape == want.shape
        tol = 0.0 if both_host else codec_cross_tolerance(codec_cfg, float(np.abs(want).max())).value
        assert np.abs(got.astype(np.float64) - want).max() <= tol


def test_gpu_policy_runs_no_cpu_kernel_and_keeps_weights_as_stored(tiny_ckpt, question_wav, monkeypatch):
    """Under the GPU policy no product goes through this project's CPU kernels (a call would hit
    the poisoned module below) and no 16-bit weight gets a float32 copy."""
    from voicechat.runtime import kernels

    model = voicechat.load(tiny_ckpt, policy=ExecutionPolicy.gpu())
    assert model.prepared.linears["float32"] == [] and model.prepared.linears["bf16_transposed"]
    stored = [ops.stored_transposed(m) for _, m in model.named_modules() if ops.stored_transposed(m) is not None]
    assert stored and all(w.dtype == mx.bfloat16 for w in stored)  # the stored bytes, transposed; no copies

    class Poisoned:
        def __getattr__(self, name):
            raise AssertionError(f"the GPU policy called the CPU kernel {name}")

    monkeypatch.setitem(kernels._state, "module", Poisoned())
    _stream(model, question_wav[: 1280 * 6], None)


def test_two_models_with_different_policies_share_a_process(tiny_ckpt_4bit, question_wav):
    """Frames of a model under the device policy and of one under the GPU policy, interleaved on
    one thread, give what each gives alone: nothing about execution is process-wide."""
    wave = question_wav[: 1280 * 8]
    models = {name: voicechat.load(tiny_ckpt_4bit, policy=POLICIES[name]()) for name in ("device", "gpu")}
    alone = {name: _stream(m, wave, None)[0] for name, m in models.items()}
    sessions = {name: m.create_streaming_session(seed=0) for name, m in models.items()}
    for start in range(0, wave.shape[0], 1280):
        for s in sessions.values():
            s.push_audio(wave[start : start + 1280])
    for name, s in sessions.items():
        s.flush()
        got = {k: np.array(v) for k, v in s.states().items()}
        assert all(np.array_equal(got[k], alone[name][k]) for k in got), name


def test_unbound_components_run_the_plain_ops():
    """Outside any runtime the seam is its meaning in mx / mx.fast."""
    assert ops.current() is ops.PLAIN and bound_policy() is UNBOUND
    x = mx.random.normal((3, 16))
    w = mx.random.normal((16,))
    assert np.array_equal(np.array(ops.rms_norm(x, w, 1e-5)), np.array(mx.fast.rms_norm(x, w, 1e-5)))
    assert ops.fused(("k",), lambda: lambda a: a + 1)(x).shape == x.shape
    assert ops.rvq_pass(x[:1], mx.zeros((1, 16, 4)), mx.zeros((1, 4))) is None


def test_gpu_policy_waits_three_times_a_frame(tiny_ckpt_4bit, question_wav):
    """Under the GPU's policy a streamed frame waits for the device three times (counted by the
    bench's dispatch counter, bench/dispatch.py): the TTS reads the text id, the codec validates
    the codes, and the frame's end reads everything else; no wait in perception (the mel and
    conformer cut their graphs with async_eval) or in the RNNT (its symbols are read at the
    frame's end). The device policy's RNNT reads each symbol (a CPU waits cheaply)."""
    from bench.dispatch import count_voicechat

    syncs = {}
    for name in ("gpu", "device"):
        model = voicechat.load(tiny_ckpt_4bit, policy=POLICIES[name]())
        rows = count_voicechat(model, question_wav, frames=8, drop_first=3)
        syncs[name] = {r["stage"]: r["syncs_per_frame"] for r in rows}
    gpu = syncs["gpu"]
    assert gpu["perception"] == gpu["rnnt"] == gpu["language"] == 0
    assert gpu["tts"] == 1 and gpu["total"] == 3
    assert syncs["device"]["rnnt"] >= 1
