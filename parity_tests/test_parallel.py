"""Two CPU streams per frame (voicechat.runtime.linear): every split is bit-identical to the unsplit op.

Why exact equality is the right tolerance: a split changes only which thread
computes which output rows (or input rows); each output element is still the
same dot product over the same inputs in the same order, and a 16-bit weight
converted to float32 once is the same float32 value MLX would convert it to on
every call. Any difference at all would mean the split changed the arithmetic.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest

import voicechat
from voicechat import parallel
from voicechat.runtime.kernels import cpu_qmv_set, platform_served, unavailable_reason
from voicechat.runtime.linear import (MIN_SPLIT_MACS, QMV_SPEEDUP, FastLinear, FastQuantizedLinear, ParallelQuantizedLinear,
                                prepare_linears, split_rows)


@pytest.fixture
def two_streams():
    parallel.set_cpu_streams(2)
    yield
    parallel.set_cpu_streams(None)


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
    prepare_linears(plain, min_split_macs=0)
    assert isinstance(plain, ParallelQuantizedLinear)
    assert parallel.secondary_stream() is not None
    _same(plain(x), want)


@pytest.mark.parametrize("dtype", [mx.bfloat16, mx.float32])
@pytest.mark.parametrize("bias", [True, False])
def test_fast_linear_is_bit_identical(two_streams, dtype, bias):
    mx.random.seed(4)
    layer = nn.Linear(96, 131, bias=bias)
    layer.update({k: v.astype(dtype) for k, v in layer.parameters().items()})
    x32 = mx.random.normal((5, 96))
    x16 = x32.astype(mx.bfloat16)
    want32, want16 = layer(x32), layer(x16)
    report = prepare_linears(layer, min_split_macs=0, float32_copies=True)
    # A layer whose weight became its float32 copy runs unsplit (its halves would be a second copy).
    assert isinstance(layer, FastLinear) and report["split"] == ([] if dtype == mx.bfloat16 else [""])
    assert report["float32"] == ([""] if dtype == mx.bfloat16 else [])
    _same(layer(x32), want32)  # float32 copy (bf16) or split (float32)
    _same(layer(x16), want16)  # 16-bit input: the stored weight, result stays bf16
    parallel.set_cpu_streams(1)
    _same(layer(x32), want32)  # one stream: unsplit, float32 copy


@pytest.mark.parametrize("split", [True, False])
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("shape", [(1, 144), (2, 1, 144), (37, 144)])
def test_fast_linear_transposed_copies_are_bit_identical(two_streams, split, bias, shape):
    """The float32 copy stored as W.T contiguous, replacing the bf16 weight: x @ W_t (+ b)
    equals nn.Linear's addmm(b, x, W.T) on the bf16 weight bit for bit, on one stream and on
    two, whatever the split threshold says."""
    mx.random.seed(6)
    layer = nn.Linear(144, 577, bias=bias)  # odd width
    layer.update({k: v.astype(mx.bfloat16) for k, v in layer.parameters().items()})
    x = mx.random.normal(shape)
    want = layer(x)
    prepare_linears(layer, min_split_macs=0 if split else 1 << 30, float32_copies=True)
    weights = layer.unsplit_weights(x)
    assert "weight_t" in weights and layer.weight.dtype == mx.float32
    _same(layer(x), want)
    parallel.set_cpu_streams(1)
    _same(layer(x), want)
    got = layer.unsplit_weights(x)  # what a compiled piece would receive on one stream
    _same(parallel.linear(x, got), want)


def test_fast_linear_follows_replaced_weights(two_streams):
    """A cached float32 copy must never outlive the weight it was made from."""
    mx.random.seed(5)
    layer = nn.Linear(64, 48, bias=False)
    layer.weight = layer.weight.astype(mx.bfloat16)
    prepare_linears(layer, min_split_macs=0)
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
    prepare_linears(layer, min_split_macs=0)
    x = mx.random.normal((1, 128))
    layer(x)
    other = nn.QuantizedLinear.from_linear(nn.Linear(128, 64, bias=False), group_size=64, bits=4)
    layer.update(other.parameters())
    _same(layer(x), other(x))


@pytest.mark.parametrize("bias", [True, False])
def test_float32_copy_replaces_the_16_bit_weight(two_streams, bias):
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
    prepare_linears(layer, min_split_macs=0, float32_copies=True)
    layer(x32), layer(x16)  # nothing a call makes may stay cached beside the weight
    float32_bytes = 4 * (64 * 96 + (96 if bias else 0))
    assert parallel.resident_bytes(layer) == float32_bytes
    for k, v in layer.parameters().items():
        assert v.dtype == mx.float32 and np.array_equal(np.array(v), stored[k])
    _same(layer(x32), want32)
    _same(layer(x16), want16)


@pytest.mark.parametrize("bias", [True, False])
def test_bf16_weights_stored_transposed_in_place(two_streams, bias):
    """Without float32 copies, on a CPU with the extension: a bf16 dense weight is stored as
    bf16 W.T, the same bytes (`resident_bytes` unchanged, MLX's active memory back where it
    was once the original is released), the parameter still the stored values in the stored
    shape, and the layer's output MLX's bit for bit for float32 and bf16 inputs (the float32
    product goes through `cpu_qmv.float32_matmul` on the bf16 W.T)."""
    from voicechat import cpu_qmv

    mx.random.seed(10)
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
    report = prepare_linears(layer, min_split_macs=0, float32_copies=False, bf16_transposed=True)
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
    real = cpu_qmv.float32_matmul
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(parallel, "float32_matmul", lambda *a, **k: calls.append(a[1].dtype) or real(*a, **k))
        _same(layer(x32), want32)
    assert calls == [mx.bfloat16]
    _same(layer(x16), want16)


def test_language_path_and_switch_keep_16_bit_weights(two_streams, monkeypatch):
    """No copy for the language path (published: quantized; a bf16 copy of it would not fit at
    the published shapes), nor anywhere with VOICECHAT_FLOAT32_COPIES=0 (the GPU default)."""
    mx.random.seed(10)

    def tree():
        t = nn.Module()
        t.stt_model = nn.Module()
        t.stt_model.llm = nn.Linear(64, 64, bias=False)
        t.stt_model.perception = nn.Linear(64, 64, bias=False)
        t.update({"stt_model": {"llm": {"weight": t.stt_model.llm.weight.astype(mx.bfloat16)},
                                "perception": {"weight": t.stt_model.perception.weight.astype(mx.bfloat16)}}})
        return t

    t = tree()
    x = mx.random.normal((2, 64))
    want = t.stt_model.llm(x)
    report = prepare_linears(t, float32_copies=True)
    assert report["float32"] == ["stt_model.perception"]
    assert t.stt_model.llm.weight.dtype == mx.bfloat16
    _same(t.stt_model.llm(x), want)
    assert parallel.resident_bytes(t) == 64 * 64 * (2 + 4)  # no derived float32 copy of the llm layer
    monkeypatch.setenv(parallel.FLOAT32_COPIES_ENV, "0")
    t = tree()
    assert prepare_linears(t)["float32"] == []
    monkeypatch.setenv(parallel.FLOAT32_COPIES_ENV, "2")
    with pytest.raises(ValueError, match="VOICECHAT_FLOAT32_COPIES must be 0 or 1"):
        prepare_linears(tree())


def test_prepare_linears_threshold_and_redecision():
    mx.random.seed(7)
    tree = nn.Sequential(nn.Linear(16, 8), nn.QuantizedLinear(512, 512, group_size=64, bits=4))
    with cpu_qmv_set(False):  # MLX's kernel: 512 * 512 MACs >= 256K splits, 16 * 8 does not
        report = prepare_linears(tree)
    assert report["split"] == ["layers.1"]
    assert type(tree.layers[1]) is ParallelQuantizedLinear
    report = prepare_linears(tree, min_split_macs=1 << 30)  # re-decided: nothing splits now
    assert report["split"] == [] and type(tree.layers[1]) is FastQuantizedLinear
    assert tree.layers[0].__dict__["_split"] is False


@pytest.mark.skipif(not platform_served(), reason="cpu_qmv serves Linux x86-64 only")
def test_quantized_split_threshold_counts_the_faster_kernel():
    """Through cpu_qmv a quantized product counts 1 / QMV_SPEEDUP of its multiply-adds: 512 x 512
    (262K) no longer splits, 1024 x 1024 (1M) does, and the split point moves with the cost."""
    if unavailable_reason() is not None:
        pytest.skip(f"cpu_qmv not built here: {unavailable_reason()}")
    mx.random.seed(7)
    tree = nn.Sequential(nn.QuantizedLinear(512, 512, group_size=64, bits=4),
                         nn.QuantizedLinear(1024, 1024, group_size=64, bits=4))
    with cpu_qmv_set(True):
        assert prepare_linears(tree)["split"] == ["layers.1"]
    assert QMV_SPEEDUP * MIN_SPLIT_MACS == 1 << 20


@pytest.mark.parametrize("rows", [1, 2, 7, 64])
def test_split_rows_is_bit_identical(two_streams, rows):
    mx.random.seed(8)
    w = mx.random.normal((48, 40)).astype(mx.bfloat16)

    def rowwise(y):
        return nn.gelu(mx.fast.layer_norm(y, None, None, 1e-5) @ w.T)

    x = mx.random.normal((rows, 40))
    _same(split_rows(rowwise, x), rowwise(x))


def test_cpu_streams_validation(monkeypatch):
    with pytest.raises(ValueError, match=r"set_cpu_streams\(n\) must be 1 or 2.*got 3"):
        parallel.set_cpu_streams(3)
    monkeypatch.setenv(parallel.ENV_VAR, "four")
    with pytest.raises(ValueError, match="VOICECHAT_CPU_STREAMS must be 1 or 2.*'four'"):
        parallel.cpu_streams()
    monkeypatch.setenv(parallel.ENV_VAR, "1")
    assert parallel.cpu_streams() == 1 and parallel.secondary_stream() is None
    parallel.set_cpu_streams(2)  # the explicit setting wins over the environment
    try:
        assert parallel.cpu_streams() == 2 and parallel.secondary_stream() is not None
    finally:
        parallel.set_cpu_streams(None)


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
    states = {k: np.array(v.astype(mx.float32) if mx.issubdtype(v.dtype, mx.floating) else v)
              for k, v in s.states().items()}
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
def test_whole_model_two_streams_equal_one_stream(tiny_ckpt, question_wav, host_products, weights, monkeypatch):
    """Every Linear of the tiny model split (threshold 0) where its weight keeps the stored
    layout ("stored": no float32 copies and the extension off; with float32 copies or bf16
    W.T, the tiny bf16 model's dense layers run unsplit on them), and the codec rows split when
    its products run in MLX (with them in numpy the codec runs unsplit): the streamed session
    (outputs and caches) equals the one-stream run bit for bit, and so does offline."""
    from voicechat import cpu_qmv
    from voicechat.runtime.host_products import host_gemm_set

    monkeypatch.setenv(parallel.FLOAT32_COPIES_ENV, "1" if weights == "float32" else "0")
    if weights == "stored":
        monkeypatch.setenv(cpu_qmv.ENV_VAR, "0")
    model = voicechat.load(tiny_ckpt)
    report = prepare_linears(model, min_split_macs=0)
    # only stored-layout weights split: copies and bf16 W.T run on one stream
    assert (len(report["split"]) > 50) is (weights == "stored")
    assert (len(report["float32"]) > 50) is (weights == "float32")
    assert bool(report["bf16_transposed"]) is (weights != "stored")
    assert (len(report["bf16_transposed"]) > 50) is (weights == "bf16_transposed")
    if weights == "float32":  # the language path is never copied; its bf16 weights are transposed
        assert all(parallel._language_path(p) for p in report["bf16_transposed"])
    audio = question_wav[: 1280 * 12]
    runs = {}
    with host_gemm_set(host_products):
        for n in (1, 2):
            with parallel.cpu_streams_set(n):
                runs[n] = _streamed_and_offline(model, audio)
    _assert_identical(runs[1], runs[2])


# -- compiled pieces (voicechat.runtime.compiled)


@pytest.mark.parametrize("module, getter, setter, cpu_only", [("compiled", "compile_enabled", "set_compile", False),
                                                              ("overlap", "overlap_enabled", "set_overlap", True)])
def test_switch_flag_validation(monkeypatch, module, getter, setter, cpu_only):
    """VOICECHAT_COMPILE / VOICECHAT_OVERLAP: 0 / 1 only (the error names the variable), unset
    means the default (compile: on; overlap: on for a CPU device only), and the setter takes
    True, False or None only."""
    import importlib

    mod = importlib.import_module(f"voicechat.{module}")
    monkeypatch.setenv(mod.ENV_VAR, "yes")
    with pytest.raises(ValueError, match=f"{mod.ENV_VAR} must be 0 or 1.*got 'yes'"):
        getattr(mod, getter)()
    monkeypatch.setenv(mod.ENV_VAR, "0")
    assert getattr(mod, getter)() is False
    monkeypatch.delenv(mod.ENV_VAR)
    assert getattr(mod, getter)() is (not cpu_only or mx.default_device().type == mx.DeviceType.cpu)
    with pytest.raises(TypeError, match=f"{setter} expects True, False or None"):
        getattr(mod, setter)("on")


@pytest.mark.parametrize("streams", [1, 2])
def test_compiled_pieces_equal_uncompiled(tiny_ckpt, question_wav, streams):
    """Every compiled piece (Mamba step core, conformer feed-forward and conv module, TTS q/k/v and
    post-attention block, MoG trunk) vs the same functions uncompiled: the streamed session
    (outputs and caches) is bit-identical, and offline too."""
    from voicechat import compiled

    model = voicechat.load(tiny_ckpt)
    audio = question_wav[: 1280 * 12]
    runs = {}
    with parallel.cpu_streams_set(streams):
        for enabled in (False, True):
            with compiled.compile_set(enabled):
                runs[enabled] = _streamed_and_offline(model, audio)
    _assert_identical(runs[False], runs[True])
    assert any(key[1] for key in compiled._compiled)  # compiled pieces were built ((key, compiled, kernels))


# -- overlapped evaluation (voicechat.runtime.overlap)


@pytest.mark.parametrize("streams", [1, 2])
def test_overlapped_evaluation_equals_waiting(tiny_ckpt, question_wav, streams, monkeypatch):
    """Layers evaluated ahead (`mx.async_eval` after each conformer, Nemotron-H and TTS backbone
    layer and each MoG pass) vs evaluated when needed: the streamed session (outputs and caches)
    and offline are bit-identical; with the switch on, each of the three stacks did evaluate
    ahead, with it off none did."""
    import sys

    from voicechat import overlap

    callers = []
    real = mx.async_eval

    def counted(*arrays):
        callers.append(sys._getframe(2).f_code.co_filename)  # past overlap.start
        return real(*arrays)

    monkeypatch.setattr(mx, "async_eval", counted)
    model = voicechat.load(tiny_ckpt)
    audio = question_wav[: 1280 * 12]
    runs = {}
    with parallel.cpu_streams_set(streams):
        for enabled in (False, True):
            callers.clear()
            with overlap.overlap_set(enabled):
                runs[enabled] = _streamed_and_offline(model, audio)
            stacks = {name for name in ("conformer.py", "nemotron_h.py", "ear_tts.py")
                      if any(c.endswith(name) for c in callers)}
            assert stacks == ({"conformer.py", "nemotron_h.py", "ear_tts.py"} if enabled else set())
    _assert_identical(runs[False], runs[True])


def test_compiled_mog_trunk_equals_uncompiled(tiny_model):
    """The MoG trunk feeds only the sampling, whose discrete choices can absorb a rounding
    difference; compare its features directly (both guidance rows, as generate_codes runs it)."""
    from voicechat import compiled

    trunk = tiny_model.tts_model.tts_model.mog_head.trunk
    x = mx.random.normal((2, tiny_model.config.tts_config.hidden_size), key=mx.random.key(9))
    with compiled.compile_set(False):
        plain = trunk(x)
    with compiled.compile_set(True):
        fused = trunk(x)
    _same(fused, plain)


def test_serial_backend_matches_and_restores_settings(tiny_ckpt_4bit, question_wav):
    """The benchmark's `voicechat-serial` backend (one stream, nothing compiled, codec products and
    quantized products in MLX; a 4-bit model) gives the same streamed ids and codes as `voicechat`, audio within the 1e-5 bound of two
    float32 summation orders (api.md's streaming-vs-offline audio bound), and leaves the process
    settings as it found them."""
    from harness.backends import get_backend
    from voicechat import compiled, cpu_qmv, host_gemm

    audio = question_wav[: 1280 * 8]
    parallel.set_cpu_streams(2)
    compiled.set_compile(True)
    host_gemm.set_host_gemm(True)
    qmv = cpu_qmv.cpu_qmv_enabled()
    try:
        runs = {}
        for name in ("voicechat", "voicechat-serial"):
            backend = get_backend(name)
            backend.load(str(tiny_ckpt_4bit))
            runs[name] = backend.stream(audio, profile=True)
            assert backend.asr_frame_ms(audio)  # per-step times, one per whole frame
            assert parallel.cpu_streams() == 2 and compiled.compile_enabled() is True
            assert host_gemm.host_gemm_enabled() is True and cpu_qmv.cpu_qmv_enabled() is qmv
    finally:
        parallel.set_cpu_streams(None)
        compiled.set_compile(None)
        host_gemm.set_host_gemm(None)
    a, b = runs["voicechat"], runs["voicechat-serial"]
    assert np.array_equal(a.text_ids, b.text_ids) and np.array_equal(a.codes, b.codes)
    assert a.audio.shape == b.audio.shape and np.abs(a.audio - b.audio).max() <= 1e-5


def test_float32_copies_change_no_output(tiny_ckpt, question_wav, monkeypatch):
    """Loaded with and without float32 copies (the CPU and GPU defaults), the streamed session
    and offline run give the same outputs and caches bit for bit."""
    audio = question_wav[: 1280 * 12]
    runs = {}
    for copies in ("0", "1"):
        monkeypatch.setenv(parallel.FLOAT32_COPIES_ENV, copies)
        model = voicechat.load(tiny_ckpt)
        runs[copies] = _streamed_and_offline(model, audio)
    _assert_identical(runs["0"], runs["1"])


def test_cpu_default_copies_only_within_the_budget(monkeypatch):
    """On a CPU the default makes float32 copies of the 16-bit weights bf16 W.T does not serve
    (float16 here) only while they add at most FLOAT32_COPY_BUDGET_BYTES (2 bytes per copied
    element); the switch overrides the budget. A bf16 weight is stored as bf16 W.T where the
    extension serves it, whatever the budget, and copied to float32 when the switch asks."""
    monkeypatch.delenv(parallel.FLOAT32_COPIES_ENV, raising=False)
    mx.random.seed(11)

    def layer(dtype=mx.float16):
        m = nn.Linear(64, 32, bias=True)
        m.update({k: v.astype(dtype) for k, v in m.parameters().items()})
        return m

    extra = 2 * (64 * 32 + 32)
    monkeypatch.setattr(parallel, "FLOAT32_COPY_BUDGET_BYTES", extra)
    assert prepare_linears(layer())["float32"] == [""]
    monkeypatch.setattr(parallel, "FLOAT32_COPY_BUDGET_BYTES", extra - 1)
    assert prepare_linears(layer())["float32"] == []
    if parallel.default_bf16_transposed():
        report = prepare_linears(layer(mx.bfloat16))
        assert report["bf16_transposed"] == [""] and report["float32"] == []
    monkeypatch.setenv(parallel.FLOAT32_COPIES_ENV, "1")
    assert prepare_linears(layer())["float32"] == [""]
    report = prepare_linears(layer(mx.bfloat16))
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


def test_switch_decisions_are_held_for_a_frame(monkeypatch):
    """Inside `decisions_held()` (one streamed frame) each switch is decided once: a change of its
    environment variable applies from the next block; nested blocks share the outer decisions; a
    decision that raises is not kept; another thread decides for itself."""
    import threading

    from voicechat import compiled, cpu_qmv
    from voicechat.switch import decisions_held

    monkeypatch.delenv(compiled.ENV_VAR, raising=False)
    monkeypatch.delenv(parallel.ENV_VAR, raising=False)
    with decisions_held():
        assert compiled.compile_enabled() is True and parallel.cpu_streams() == parallel.default_cpu_streams()
        monkeypatch.setenv(compiled.ENV_VAR, "0")
        monkeypatch.setenv(parallel.ENV_VAR, "1")
        assert compiled.compile_enabled() is True  # held for the frame
        with decisions_held():
            assert compiled.compile_enabled() is True
        seen = {}
        thread = threading.Thread(target=lambda: seen.update(compile=compiled.compile_enabled()))
        thread.start()
        thread.join()
        assert seen == {"compile": False}  # not this thread's frame
    assert compiled.compile_enabled() is False and parallel.cpu_streams() == 1  # the next frame
    monkeypatch.setenv(cpu_qmv.ENV_VAR, "yes")
    with decisions_held():
        for _ in range(2):  # raises each time: a failed decision is not held
            with pytest.raises(ValueError, match="VOICECHAT_CPU_QMV must be 0 or 1"):
                cpu_qmv.cpu_qmv_enabled()


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
    for a in (mx.array(bits).view(mx.bfloat16), mx.array(bits).view(mx.float16),
              mx.array(np.random.default_rng(rows).standard_normal((rows, cols), dtype=np.float32))):
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
