"""Two CPU streams per frame (voicechat.runtime.linear): every split is bit-identical to the unsplit op.

Why exact equality is the right tolerance: a split changes only which thread
computes which output rows (or input rows); each output element is still the
same dot product over the same inputs in the same order, and a 16-bit weight
converted to float32 once is the same float32 value MLX would convert it to on
every call. Any difference at all would mean the split changed the arithmetic.

The layers get their weight layout from the `ExecutionPolicy` they are prepared for
(`prepare_linears(module, policy)`) and split while the runtime bound on the thread has two CPU
streams (`runtime_util.running`, as a session binds its model's runtime around each frame); a
whole model runs under the policy it was loaded with, so comparing two policies loads two models.
"""

from __future__ import annotations

import dataclasses
import os
import sys
import threading

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest

import voicechat
from voicechat.runtime import ENV_VARS, ExecutionPolicy, compiled, linear as parallel
from voicechat.runtime.kernels import platform_served, unavailable_reason
from voicechat.runtime.linear import (
    MIN_SPLIT_MACS,
    QMV_SPEEDUP,
    FastLinear,
    FastQuantizedLinear,
    ParallelQuantizedLinear,
    prepare_linears,
    split_rows,
)
from voicechat.runtime.policy import UNBOUND

from .runtime_util import bound_policy, default_policy, running


@pytest.fixture
def two_streams():
    """The device's default policy with two CPU streams, bound on this thread for the test (the
    policy the test's layers are prepared for)."""
    policy = default_policy(cpu_streams=2)
    with running(policy):
        yield policy


def _same(a: mx.array, b: mx.array) -> None:
    assert a.dtype == b.dtype and a.shape == b.shape
    assert np.array_equal(np.array(a.astype(mx.float32)), np.array(b.astype(mx.float32)))


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("shape", [(1, 256), (3, 256), (2, 1, 256)])
def test_parallel_quantized_linear_is_bit_identical(two_streams, bits, shape):
    mx.random.seed(3)
    plain = nn.Linear(256, 322, bias=True)  # odd split: 161 / 161 rows; bias included
    plain.bias = mx.random.normal((322,))
    plain = nn.QuantizedLinear.from_linear(plain, group_size=64, bits=bits)
    x = mx.random.normal(shape)
    want = plain(x)
    prepare_linears(plain, two_streams, min_split_macs=0)
    assert isinstance(plain, ParallelQuantizedLinear)
    assert parallel.secondary_stream(bound_policy()) is not None
    _same(plain(x), want)


@pytest.mark.parametrize("dtype", [mx.bfloat16, mx.float32])
@pytest.mark.parametrize("bias", [True, False])
def test_fast_linear_is_bit_identical(dtype, bias):
    mx.random.seed(4)
    layer = nn.Linear(96, 131, bias=bias)
    layer.update({k: v.astype(dtype) for k, v in layer.parameters().items()})
    x32 = mx.random.normal((5, 96))
    x16 = x32.astype(mx.bfloat16)
    want32, want16 = layer(x32), layer(x16)
    policy = default_policy(cpu_streams=2, float32_copies=True)
    report = prepare_linears(layer, policy, min_split_macs=0)
    # A layer whose weight became its float32 copy runs unsplit (its halves would be a second copy).
    assert isinstance(layer, FastLinear) and report["split"] == ([] if dtype == mx.bfloat16 else [""])
    assert report["float32"] == ([""] if dtype == mx.bfloat16 else [])
    with running(policy):
        _same(layer(x32), want32)  # float32 copy (bf16) or split (float32)
        _same(layer(x16), want16)  # 16-bit input: the stored weight, result stays bf16
    with running(policy, cpu_streams=1):
        _same(layer(x32), want32)  # one stream: unsplit, float32 copy


@pytest.mark.parametrize("split", [True, False])
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("shape", [(1, 144), (2, 1, 144), (37, 144)])
def test_fast_linear_transposed_copies_are_bit_identical(split, bias, shape):
    """The float32 copy stored as W.T contiguous, replacing the bf16 weight: x @ W_t (+ b)
    equals nn.Linear's addmm(b, x, W.T) on the bf16 weight bit for bit, on one stream and on
    two, whatever the split threshold says."""
    mx.random.seed(6)
    layer = nn.Linear(144, 577, bias=bias)  # odd width
    layer.update({k: v.astype(mx.bfloat16) for k, v in layer.parameters().items()})
    x = mx.random.normal(shape)
    want = layer(x)
    policy = default_policy(cpu_streams=2, float32_copies=True)
    prepare_linears(layer, policy, min_split_macs=0 if split else 1 << 30)
    with running(policy):
        weights = layer.unsplit_weights(x, bound_policy())
        assert "weight_t" in weights and layer.weight.dtype == mx.float32
        _same(layer(x), want)
    with running(policy, cpu_streams=1):
        _same(layer(x), want)
        got = layer.unsplit_weights(x, bound_policy())  # what a compiled piece would receive on one stream
        _same(parallel.linear(x, got, cpu_kernels=bound_policy().cpu_kernels), want)


def test_fast_linear_follows_replaced_weights(two_streams):
    """A cached float32 copy must never outlive the weight it was made from."""
    mx.random.seed(5)
    layer = nn.Linear(64, 48, bias=False)
    layer.weight = layer.weight.astype(mx.bfloat16)
    prepare_linears(layer, two_streams, min_split_macs=0)
    x = mx.random.normal((2, 64))
    before = layer(x)
    new_w = (mx.random.normal((48, 64)) * 3).astype(mx.bfloat16)
    layer.update({"weight": new_w})
    reference = x @ new_w.astype(mx.float32).T
    after = layer(x)
    _same(after, reference)
    assert not np.array_equal(np.array(after), np.array(before))


def test_parallel_quantized_linear_follows_replaced_weights(two_streams):
    mx.random.seed(6)
    layer = nn.QuantizedLinear(128, 64, bias=False, group_size=64, bits=4)
    prepare_linears(layer, two_streams, min_split_macs=0)
    x = mx.random.normal((1, 128))
    layer(x)
    other = nn.QuantizedLinear.from_linear(nn.Linear(128, 64, bias=False), group_size=64, bits=4)
    layer.update(other.parameters())
    _same(layer(x), other(x))


@pytest.mark.parametrize("bias", [True, False])
def test_float32_copy_replaces_the_16_bit_weight(bias):
    """One resident copy: after `prepare_linears` the layer keeps the float32 weight (and bias)
    and nothing else, a bf16 input still gets the bf16 product, and saving-relevant values
    (the parameter) are the stored values exactly."""
    mx.random.seed(9)
    layer = nn.Linear(64, 96, bias=bias)
    layer.update({k: v.astype(mx.bfloat16) for k, v in layer.parameters().items()})
    stored = {k: np.array(v.astype(mx.float32)) for k, v in layer.parameters().items()}
    x32 = mx.random.normal((3, 64))
    x16 = x32.astype(mx.bfloat16)
    want32, want16 = layer(x32), layer(x16)
    policy = default_policy(cpu_streams=2, float32_copies=True)
    prepare_linears(layer, policy, min_split_macs=0)
    with running(policy):
        layer(x32), layer(x16)  # nothing a call makes may stay cached beside the weight
        float32_bytes = 4 * (64 * 96 + (96 if bias else 0))
        assert parallel.resident_bytes(layer) == float32_bytes
        for k, v in layer.parameters().items():
            assert v.dtype == mx.float32 and np.array_equal(np.array(v), stored[k])
        _same(layer(x32), want32)
        _same(layer(x16), want16)


@pytest.mark.parametrize("bias", [True, False])
def test_bf16_weights_stored_transposed_in_place(bias):
    """Without float32 copies, bf16 W.T (the CPU policy with the kernels on): a bf16 dense weight
    is stored as bf16 W.T, the same bytes (`resident_bytes` unchanged, MLX's active memory back
    where it was once the original is released), the parameter still the stored values in the
    stored shape, and the layer's output MLX's bit for bit for float32 and bf16 inputs (the
    float32 product goes through `kernels.float32_matmul` on the bf16 W.T)."""
    mx.random.seed(10)
    policy = default_policy(cpu_streams=2, float32_copies=False, bf16_transposed=True)
    layer = nn.Linear(256, 384, bias=bias)
    layer.update({k: v.astype(mx.bfloat16) for k, v in layer.parameters().items()})
    mx.eval(layer.parameters())
    stored = {k: np.array(v.astype(mx.float32)) for k, v in layer.parameters().items()}
    x32 = mx.random.normal((3, 256))
    x16 = x32.astype(mx.bfloat16)
    want32, want16 = layer(x32), layer(x16)
    mx.eval(want32, want16)
    bytes_before = parallel.resident_bytes(layer)
    mx.clear_cache()
    active = mx.get_active_memory()
    report = prepare_linears(layer, policy, min_split_macs=0)
    mx.clear_cache()
    assert report["bf16_transposed"] == [""] and report["float32"] == [] and report["split"] == []
    assert abs(mx.get_active_memory() - active) <= 16384  # no second copy kept
    assert parallel.resident_bytes(layer) == bytes_before
    assert layer.weight.dtype == mx.bfloat16 and layer.weight.shape == (384, 256)
    w_t = np.asarray(layer.__dict__["_weight_t"].view(mx.uint16))
    assert w_t.shape == (256, 384) and w_t.flags["C_CONTIGUOUS"]  # row-major: no per-call copy
    for k, v in layer.parameters().items():
        assert np.array_equal(np.array(v.astype(mx.float32)), stored[k])
    calls = []
    real = parallel.float32_matmul
    with running(policy):
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(parallel, "float32_matmul", lambda *a, **k: calls.append(a[1].dtype) or real(*a, **k))
            _same(layer(x32), want32)
        assert calls == [mx.bfloat16]
        _same(layer(x16), want16)


def test_language_path_and_policy_keep_16_bit_weights():
    """No copy for the language path (published: quantized; a bf16 copy of it would not fit at
    the published shapes), nor anywhere with a policy without float32 copies (the GPU default,
    or VOICECHAT_FLOAT32_COPIES=0, which `ExecutionPolicy.for_device` reads and validates)."""
    mx.random.seed(10)

    def tree():
        t = nn.Module()
        t.stt_model = nn.Module()
        t.stt_model.llm = nn.Linear(64, 64, bias=False)
        t.stt_model.perception = nn.Linear(64, 64, bias=False)
        t.update(
            {
                "stt_model": {
                    "llm": {"weight": t.stt_model.llm.weight.astype(mx.bfloat16)},
                    "perception": {"weight": t.stt_model.perception.weight.astype(mx.bfloat16)},
                }
            }
        )
        return t

    t = tree()
    x = mx.random.normal((2, 64))
    want = t.stt_model.llm(x)
    policy = default_policy(cpu_streams=2, float32_copies=True)
    report = prepare_linears(t, policy)
    assert report["float32"] == ["stt_model.perception"]
    assert t.stt_model.llm.weight.dtype == mx.bfloat16
    with running(policy):
        _same(t.stt_model.llm(x), want)
    assert parallel.resident_bytes(t) == 64 * 64 * (2 + 4)  # no derived float32 copy of the llm layer
    env = ENV_VARS["float32_copies"]
    assert env == "VOICECHAT_FLOAT32_COPIES"
    off = ExecutionPolicy.for_device(environ={env: "0"})
    assert off.float32_copies is False and prepare_linears(tree(), off)["float32"] == []
    assert prepare_linears(tree(), ExecutionPolicy.gpu())["float32"] == []
    assert ExecutionPolicy.for_device(environ={env: "1"}).float32_copies is True
    with pytest.raises(ValueError, match="VOICECHAT_FLOAT32_COPIES must be 0 or 1"):
        ExecutionPolicy.for_device(environ={env: "2"})


def test_prepare_linears_threshold_and_redecision():
    mx.random.seed(7)
    tree = nn.Sequential(nn.Linear(16, 8), nn.QuantizedLinear(512, 512, group_size=64, bits=4))
    # MLX's kernel: 512 * 512 MACs >= 256K splits, 16 * 8 does not
    policy = default_policy(cpu_streams=2, cpu_kernels=False)
    report = prepare_linears(tree, policy)
    assert report["split"] == ["layers.1"]
    assert type(tree.layers[1]) is ParallelQuantizedLinear
    report = prepare_linears(tree, policy, min_split_macs=1 << 30)  # re-decided: nothing splits now
    assert report["split"] == [] and type(tree.layers[1]) is FastQuantizedLinear
    assert tree.layers[0].__dict__["_split"] is False
    report = prepare_linears(tree, policy.replace(cpu_streams=1), min_split_macs=0)  # one stream: nothing splits
    assert report["split"] == [] and type(tree.layers[1]) is FastQuantizedLinear
    assert tree.layers[0].__dict__["_split"] is False


@pytest.mark.skipif(not platform_served(), reason="cpu_qmv serves Linux x86-64 only")
def test_quantized_split_threshold_counts_the_faster_kernel():
    """Through the CPU kernels a quantized product counts 1 / QMV_SPEEDUP of its multiply-adds:
    512 x 512 (262K) no longer splits, 1024 x 1024 (1M) does, and the split point moves with the cost."""
    if unavailable_reason() is not None:
        pytest.skip(f"cpu_qmv not built here: {unavailable_reason()}")
    mx.random.seed(7)
    tree = nn.Sequential(
        nn.QuantizedLinear(512, 512, group_size=64, bits=4), nn.QuantizedLinear(1024, 1024, group_size=64, bits=4)
    )
    assert prepare_linears(tree, default_policy(cpu_streams=2, cpu_kernels=True))["split"] == ["layers.1"]
    assert QMV_SPEEDUP * MIN_SPLIT_MACS == 1 << 20


@pytest.mark.parametrize("rows", [1, 2, 7, 64])
def test_split_rows_is_bit_identical(two_streams, rows):
    mx.random.seed(8)
    w = mx.random.normal((48, 40)).astype(mx.bfloat16)

    def rowwise(y):
        return nn.gelu(mx.fast.layer_norm(y, None, None, 1e-5) @ w.T)

    x = mx.random.normal((rows, 40))
    assert parallel.secondary_stream(bound_policy()) is not None
    _same(split_rows(rowwise, x, two_streams), rowwise(x))


def test_cpu_streams_validation(monkeypatch):
    """The policy takes 1 or 2 CPU streams (the error names the field, or the environment variable
    `for_device` read); the bound runtime's policy decides, not the environment."""
    with pytest.raises(ValueError, match=r"ExecutionPolicy.cpu_streams must be 1 or 2.*got 3"):
        ExecutionPolicy(name="three", cpu_streams=3)
    with pytest.raises(ValueError, match=r"VOICECHAT_CPU_STREAMS must be 1 or 2.*'four'"):
        ExecutionPolicy.for_device(environ={"VOICECHAT_CPU_STREAMS": "four"})
    one = ExecutionPolicy.for_device(environ={"VOICECHAT_CPU_STREAMS": "1"})
    assert one.cpu_streams == 1
    with running(one):
        assert bound_policy().cpu_streams == 1 and parallel.secondary_stream(bound_policy()) is None
    # outside any runtime: one stream
    assert (
        bound_policy() is UNBOUND
        and bound_policy().cpu_streams == 1
        and parallel.secondary_stream(bound_policy()) is None
    )
    monkeypatch.setenv("VOICECHAT_CPU_STREAMS", "1")  # read by for_device only: the bound policy wins
    with running(one, cpu_streams=2):
        assert bound_policy().cpu_streams == 2 and parallel.secondary_stream(bound_policy()) is not None


def test_rvq_books_follow_the_numerics(tiny_ckpt, tiny_model):
    """The cached codebooks / norms equal a direct computation, per the model's numerics: norms from
    the stored (bf16) codebooks with "reference" (the default), from float32 with "float32"."""
    import voicechat

    tts = tiny_model.tts_model.tts_model
    stored = tts.rvq_embs
    assert stored.dtype == mx.bfloat16
    books_t, norms16 = tts.rvq_books()
    _same(books_t, stored.astype(mx.float32).transpose(0, 2, 1))
    _same(norms16, (stored * stored).sum(axis=-1).astype(mx.float32))
    f32 = voicechat.load(tiny_ckpt, numerics="float32", warmup=False).tts_model.tts_model
    _, norms = f32.rvq_books()
    _same(norms, (stored.astype(mx.float32) ** 2).sum(axis=-1))
    assert not mx.array_equal(norms, norms16).item()
    _, again = tts.rvq_books()
    _same(again, norms16)


def _streamed_and_offline(model, audio) -> dict:
    """One streamed session (its every cache family read before `flush`) and one offline run."""
    s = model.create_streaming_session()
    events = s.push_audio(audio)
    states = {
        k: np.array(v.astype(mx.float32) if mx.issubdtype(v.dtype, mx.floating) else v) for k, v in s.states().items()
    }
    events += s.flush()
    return {
        "ids": (s.text_ids, s.function_ids),
        "codes": np.stack([e.audio_codes for e in events if e.kind == "audio"]),
        "audio": np.concatenate([e.samples for e in events if e.kind in ("audio", "audio_tail")]),
        "offline_audio": np.array(model.generate(audio).audio),
        "states": states,
    }


def _assert_identical(a: dict, b: dict) -> None:
    """Ids, codes and audio bytes, and every cache of the session (mel, conformer, RNNT, LLM,
    TTS K/V, codec): a rounding difference in any hidden state shows in some cache even where
    the discrete outputs absorb it."""
    assert a["ids"] == b["ids"]
    for key in ("codes", "audio", "offline_audio"):
        assert a[key].shape == b[key].shape and np.array_equal(a[key], b[key]), key
    assert a["states"].keys() == b["states"].keys()
    for key, value in a["states"].items():
        assert value.shape == b["states"][key].shape and np.array_equal(value, b["states"][key]), key


@pytest.mark.parametrize("weights", ["stored", "float32", "bf16_transposed"])
@pytest.mark.parametrize("host_products", [False, True])
def test_whole_model_two_streams_equal_one_stream(tiny_ckpt, question_wav, host_products, weights):
    """Every Linear of the tiny model split (threshold 0) where its weight keeps the stored
    layout ("stored": no float32 copies and the CPU kernels off; with float32 copies or bf16
    W.T, the tiny bf16 model's dense layers run unsplit on them), and the codec rows split when
    its products run in MLX (with them in numpy the codec runs unsplit): the streamed session
    (outputs and caches) of a model loaded for two streams equals the one loaded for one stream
    bit for bit, and so does offline. Two models, one process: each runs on its own policy."""
    base = default_policy(
        float32_copies=weights == "float32", host_products=host_products, bf16_transposed=weights != "stored"
    )
    if weights == "stored":
        base = base.replace(cpu_kernels=False)
    audio = question_wav[: 1280 * 12]
    models = {n: voicechat.load(tiny_ckpt, policy=base.replace(cpu_streams=n)) for n in (1, 2)}
    for n, model in models.items():
        assert model.policy.cpu_streams == n and model.policy.host_products is host_products
        report = prepare_linears(model, model.policy, min_split_macs=0)
        # only stored-layout weights split, on two streams: copies and bf16 W.T run on one stream
        assert (len(report["split"]) > 50) is (weights == "stored" and n == 2)
        assert (len(report["float32"]) > 50) is (weights == "float32")
        assert bool(report["bf16_transposed"]) is (weights != "stored")
        assert (len(report["bf16_transposed"]) > 50) is (weights == "bf16_transposed")
        if weights == "float32":  # the language path is never copied; its bf16 weights are transposed
            assert all(parallel._language_path(p) for p in report["bf16_transposed"])
        with model.executing():
            assert bound_policy() is model.policy
            assert (parallel.secondary_stream(bound_policy()) is not None) is (n == 2)
    runs = {n: _streamed_and_offline(model, audio) for n, model in models.items()}
    _assert_identical(runs[1], runs[2])


# -- the policy's flags (voicechat.runtime.policy)


@pytest.mark.parametrize(
    "field, enabled, cpu_only",
    [("compiled", lambda: bound_policy().compiled, False), ("overlap", lambda: bound_policy().overlap, True)],
)
def test_policy_flag_validation(field, enabled, cpu_only):
    """VOICECHAT_COMPILE / VOICECHAT_OVERLAP (read by `ExecutionPolicy.for_device`): 0 / 1 only
    (the error names the variable), unset means the device's default (compile: on; overlap: on
    for a CPU device only); the field itself takes True or False only; the policy is frozen; and
    the bound runtime's policy (what `Runtime` hands the compiled pieces / `overlap.start`) says it (off
    outside any runtime)."""
    var = ENV_VARS[field]
    assert var == {"compiled": "VOICECHAT_COMPILE", "overlap": "VOICECHAT_OVERLAP"}[field]
    with pytest.raises(ValueError, match=f"{var} must be 0 or 1.*got 'yes'"):
        ExecutionPolicy.for_device(environ={var: "yes"})
    off = ExecutionPolicy.for_device(environ={var: "0"})
    assert getattr(off, field) is False
    assert getattr(ExecutionPolicy.for_device(environ={var: "1"}), field) is True
    assert getattr(ExecutionPolicy.for_device(mx.cpu, environ={}), field) is True
    assert getattr(ExecutionPolicy.for_device(mx.gpu, environ={}), field) is (not cpu_only)
    with pytest.raises(TypeError, match=f"ExecutionPolicy.{field} must be True or False"):
        ExecutionPolicy(name="bad", **{field: "on"})
    with pytest.raises(dataclasses.FrozenInstanceError):
        setattr(off, field, True)
    assert enabled() is False
    with running(off):
        assert enabled() is False
        with running(off, **{field: True}):
            assert enabled() is True
        assert enabled() is False


def test_policy_is_fixed_and_bound_per_thread(monkeypatch):
    """What replaced the per-frame switch decisions: a policy is frozen, the environment is read
    once by `for_device` (a change after it changes no bound policy), a runtime's binding holds
    for its block on its own thread (nested blocks restore the outer one, also on an error),
    and another thread runs unbound (`UNBOUND`: one stream, nothing on)."""
    for var in ENV_VARS.values():
        monkeypatch.delenv(var, raising=False)
    policy = ExecutionPolicy.for_device()
    assert policy == default_policy()
    with pytest.raises(dataclasses.FrozenInstanceError):
        policy.cpu_streams = 1
    assert UNBOUND.cpu_streams == 1 and not (
        UNBOUND.compiled or UNBOUND.cpu_kernels or UNBOUND.host_products or UNBOUND.overlap or UNBOUND.keep_heap
    )
    policy = policy.replace(cpu_streams=2, compiled=True)
    with running(policy):
        monkeypatch.setenv("VOICECHAT_COMPILE", "0")
        monkeypatch.setenv("VOICECHAT_CPU_STREAMS", "1")
        assert bound_policy() is policy and bound_policy().compiled is True and bound_policy().cpu_streams == 2
        with running(policy, compiled=False):
            assert bound_policy().compiled is False
        assert bound_policy() is policy
        seen = {}
        thread = threading.Thread(target=lambda: seen.update(policy=bound_policy()))
        thread.start()
        thread.join()
        assert seen["policy"] is UNBOUND  # not this thread's runtime
        with pytest.raises(RuntimeError, match="inside"), running(policy, cpu_streams=1):
            raise RuntimeError("inside")
        assert bound_policy() is policy
    assert bound_policy() is UNBOUND
    assert ExecutionPolicy.for_device().compiled is False  # the environment, read again by for_device


@pytest.mark.parametrize("streams", [1, 2])
def test_compiled_pieces_equal_uncompiled(tiny_ckpt, question_wav, streams, monkeypatch):
    """Every compiled piece (Mamba step core, conformer feed-forward and conv module, TTS q/k/v and
    post-attention block, MoG trunk) vs the same functions uncompiled: the streamed session
    (outputs and caches) is bit-identical, and offline too (a model loaded for each policy)."""
    audio = question_wav[: 1280 * 12]
    runs = {}
    monkeypatch.setattr(compiled, "_compiled", {})  # the pieces this test's models build
    for enabled in (False, True):
        model = voicechat.load(tiny_ckpt, policy=default_policy(cpu_streams=streams, compiled=enabled))
        assert model.policy.compiled is enabled
        runs[enabled] = _streamed_and_offline(model, audio)
        # compiled pieces were built ((key, compiled, kernels)) by the compiled model only
        assert any(key[1] for key in compiled._compiled) is enabled
    _assert_identical(runs[False], runs[True])


# -- overlapped evaluation (voicechat.runtime.overlap)


def _component_file(frame) -> str:
    """The file of the first caller outside the op seam and the runtime (`ops.after_layer` ->
    `Runtime.after_layer` -> `overlap.start` -> `mx.async_eval`)."""
    seam = (os.sep + os.path.join("voicechat", "model", "ops.py"), os.sep + os.path.join("voicechat", "runtime", ""))
    while frame is not None and (frame.f_code.co_filename.endswith(seam[0]) or seam[1] in frame.f_code.co_filename):
        frame = frame.f_back
    return "" if frame is None else frame.f_code.co_filename


@pytest.mark.parametrize("streams", [1, 2])
def test_overlapped_evaluation_equals_waiting(tiny_ckpt, question_wav, streams, monkeypatch):
    """Layers evaluated ahead (`mx.async_eval` after each conformer, Nemotron-H and TTS backbone
    layer and each MoG pass) vs evaluated when needed: the streamed session (outputs and caches)
    and offline are bit-identical; with the policy's overlap on, each of the three stacks did
    evaluate ahead, with it off none did."""
    callers = []
    real = mx.async_eval

    def counted(*arrays):
        caller = sys._getframe(1)
        if caller.f_code.co_filename.endswith(os.path.join("runtime", "overlap.py")):  # not a stage's own graph cut
            callers.append(_component_file(caller))
        return real(*arrays)

    monkeypatch.setattr(mx, "async_eval", counted)
    audio = question_wav[: 1280 * 12]
    runs = {}
    for enabled in (False, True):
        model = voicechat.load(tiny_ckpt, policy=default_policy(cpu_streams=streams, overlap=enabled))
        callers.clear()
        runs[enabled] = _streamed_and_offline(model, audio)
        stacks = {
            name for name in ("conformer.py", "nemotron_h.py", "ear_tts.py") if any(c.endswith(name) for c in callers)
        }
        assert stacks == ({"conformer.py", "nemotron_h.py", "ear_tts.py"} if enabled else set())
    _assert_identical(runs[False], runs[True])


def test_compiled_mog_trunk_equals_uncompiled(tiny_model, monkeypatch):
    """The MoG trunk feeds only the sampling, whose discrete choices can absorb a rounding
    difference; compare its features directly (both guidance rows, as generate_codes runs it)."""
    trunk = tiny_model.tts_model.tts_model.mog_head.trunk
    x = mx.random.normal((2, tiny_model.config.tts_config.hidden_size), key=mx.random.key(9))
    monkeypatch.setattr(compiled, "_compiled", {})
    with running(tiny_model.policy, compiled=False):
        plain = trunk(x)
    with running(tiny_model.policy, compiled=True):
        fused = trunk(x)
    assert any(key[0][0] == "mog_trunk" and key[1] for key in compiled._compiled)  # it did run compiled
    _same(fused, plain)


def test_serial_backend_matches_and_restores_settings(tiny_ckpt_4bit, question_wav):
    """The benchmark's `voicechat-serial` backend (`ExecutionPolicy.serial()`: one stream, nothing
    compiled, codec products and quantized products in MLX; a 4-bit model) gives the same
    streamed ids and codes as `voicechat`, audio within the 1e-5 bound of two float32 summation
    orders (api.md's streaming-vs-offline audio bound); each backend's model runs on its own
    policy, and neither changes the runtime bound on the calling thread."""
    from harness.backends import get_backend

    audio = question_wav[: 1280 * 8]
    outer = default_policy(cpu_streams=2, compiled=True, host_products=True)
    want = {"voicechat": ExecutionPolicy.for_device(), "voicechat-serial": ExecutionPolicy.serial()}
    with running(outer):
        runs = {}
        for name in ("voicechat", "voicechat-serial"):
            backend = get_backend(name)
            backend.load(str(tiny_ckpt_4bit))
            assert backend.model.policy == want[name]
            runs[name] = backend.stream(audio, profile=True)
            assert backend.asr_frame_ms(audio)  # per-step times, one per whole frame
            assert bound_policy() is outer
    assert bound_policy() is UNBOUND
    a, b = runs["voicechat"], runs["voicechat-serial"]
    assert np.array_equal(a.text_ids, b.text_ids) and np.array_equal(a.codes, b.codes)
    assert a.audio.shape == b.audio.shape and np.abs(a.audio - b.audio).max() <= 1e-5


def test_float32_copies_change_no_output(tiny_ckpt, question_wav):
    """Loaded with and without float32 copies (the CPU and GPU defaults), the streamed session
    and offline run give the same outputs and caches bit for bit."""
    audio = question_wav[: 1280 * 12]
    runs = {}
    for copies in (False, True):
        model = voicechat.load(tiny_ckpt, policy=default_policy(float32_copies=copies))
        assert bool(model.prepared.linears["float32"]) is copies  # each model as its policy says
        runs[copies] = _streamed_and_offline(model, audio)
    _assert_identical(runs[False], runs[True])


def test_cpu_default_copies_only_within_the_budget(monkeypatch):
    """On a CPU the default makes float32 copies of the 16-bit weights bf16 W.T does not serve
    (float16 here) only while they add at most FLOAT32_COPY_BUDGET_BYTES (2 bytes per copied
    element); VOICECHAT_FLOAT32_COPIES=1 overrides the budget. A bf16 weight is stored as bf16
    W.T where the policy does that (the CPU kernels on), whatever the budget, and copied to
    float32 when the variable asks."""
    mx.random.seed(11)
    cpu = ExecutionPolicy.for_device(mx.cpu, environ={})
    assert cpu.float32_copies is None  # by budget

    def layer(dtype=mx.float16):
        m = nn.Linear(64, 32, bias=True)
        m.update({k: v.astype(dtype) for k, v in m.parameters().items()})
        return m

    extra = 2 * (64 * 32 + 32)
    monkeypatch.setattr(parallel, "FLOAT32_COPY_BUDGET_BYTES", extra)
    assert prepare_linears(layer(), cpu)["float32"] == [""]
    monkeypatch.setattr(parallel, "FLOAT32_COPY_BUDGET_BYTES", extra - 1)
    assert prepare_linears(layer(), cpu)["float32"] == []
    if cpu.bf16_transposed:
        report = prepare_linears(layer(mx.bfloat16), cpu)
        assert report["bf16_transposed"] == [""] and report["float32"] == []
    asked = ExecutionPolicy.for_device(mx.cpu, environ={"VOICECHAT_FLOAT32_COPIES": "1"})
    assert asked.float32_copies is True
    assert prepare_linears(layer(), asked)["float32"] == [""]
    report = prepare_linears(layer(mx.bfloat16), asked)
    assert report["float32"] == [""] and report["bf16_transposed"] == []


def test_split_point_follows_the_product_size():
    """Half the rows plus half the second stream's start-up lag, at most MAX_MAIN_SHARE: a
    published-shape product splits at half, a small one gives the default stream more."""
    from voicechat.runtime.linear import MAX_MAIN_SHARE, STREAM_LAG_MACS, split_point

    rows = 3088
    assert split_point(rows, 640 * rows) == round(rows * (0.5 + STREAM_LAG_MACS / (2 * 640 * rows)))
    assert 0.55 < split_point(rows, 640 * rows) / rows < 0.57  # `small`'s in_proj
    assert split_point(rows, 100 * rows) == round(rows * MAX_MAIN_SHARE)  # capped
    assert abs(split_point(40_000, 4096 * 40_000) - 20_000) <= 40  # published shapes: half (within 0.1%)
    for n in (2, 3, 7):
        assert 1 <= split_point(n, 1) <= n - 1  # both parts non-empty


@pytest.mark.parametrize("rows", [1, parallel.TRANSPOSE_BLOCK_ROWS, parallel.TRANSPOSE_BLOCK_ROWS * 2 + 37])
def test_contiguous_transpose_is_a_row_major_copy_bit_for_bit(rows):
    """`contiguous_transpose` (how load stores W.T) gives a.T stored row-major (what the
    products read without a per-call copy; an elementwise op over a.T would keep the column-major
    layout), bit for bit for every 16-bit pattern (NaN payloads included) and for float32, from
    a strided view too."""
    from voicechat.runtime.linear import contiguous_transpose

    cols = 65536 // rows + 1
    bits = (np.arange(rows * cols, dtype=np.uint32) * 40503 % 65536).astype(np.uint16).reshape(rows, cols)
    assert len(np.unique(bits)) == 65536  # every 16-bit pattern
    for a in (
        mx.array(bits).view(mx.bfloat16),
        mx.array(bits).view(mx.float16),
        mx.array(np.random.default_rng(rows).standard_normal((rows, cols), dtype=np.float32)),
    ):
        got = contiguous_transpose(a)
        mx.eval(got)
        uint = mx.uint16 if a.dtype.size == 2 else mx.uint32
        host = np.asarray(got.view(uint))  # numpy reads MLX's strides: C order = row-major
        assert got.dtype == a.dtype and host.shape == (cols, rows) and host.flags["C_CONTIGUOUS"]
        assert np.array_equal(host, np.asarray(a.view(uint)).T)
    w = mx.random.normal((rows, 3, 7))
    view = w[:, 1, :]  # strided, as the conformer's (O, 1, I) weights become (O, I)
    got = contiguous_transpose(view)
    mx.eval(got)
    assert np.asarray(got).flags["C_CONTIGUOUS"] and np.array_equal(np.asarray(got), np.asarray(w)[:, 1, :].T)
