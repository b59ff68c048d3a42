"""voicechat.runtime.heap: `load` on a CPU device with a policy that keeps the heap (the CPU default
on glibc) sets glibc's trim and mmap thresholds once (so a frame's large temporaries stay in the
heap), not at all with the policy's `keep_heap` off (VOICECHAT_KEEP_HEAP=0, read by
`ExecutionPolicy.for_device`) or off glibc, and a refusal by glibc is an error that names the
variable."""

from __future__ import annotations

import mlx.core as mx
import pytest

import voicechat
from voicechat.runtime import ENV_VARS, ExecutionPolicy, heap

from .runtime_util import default_policy


@pytest.fixture
def spy(monkeypatch):
    calls = []
    monkeypatch.setattr(heap, "_mallopt", lambda param, value: calls.append((param, value)) or 1)
    monkeypatch.setattr(heap, "_done", [])
    monkeypatch.setattr(heap, "served", lambda: True)
    return calls


def test_load_sets_both_thresholds_once(spy, tiny_ckpt):
    policy = default_policy(keep_heap=True)
    assert voicechat.load(tiny_ckpt, policy=policy).prepared.heap_kept is True
    assert voicechat.load(tiny_ckpt, policy=policy).prepared.heap_kept is True
    assert sorted(spy) == sorted([(heap.M_MMAP_THRESHOLD, 32 << 20), (heap.M_TRIM_THRESHOLD, 1 << 30)])


def test_switched_off_or_not_glibc_leaves_the_defaults(spy, tiny_ckpt, monkeypatch):
    var = ENV_VARS["keep_heap"]
    assert var == "VOICECHAT_KEEP_HEAP"
    assert ExecutionPolicy.for_device(mx.cpu, environ={}).keep_heap is True  # the CPU default where served
    assert ExecutionPolicy.for_device(mx.gpu, environ={}).keep_heap is False
    off = ExecutionPolicy.for_device(environ={var: "0"})
    assert off.keep_heap is False
    assert voicechat.load(tiny_ckpt, policy=off).prepared.heap_kept is False
    assert spy == []
    monkeypatch.setattr(heap, "served", lambda: False)
    assert ExecutionPolicy.for_device(mx.cpu, environ={}).keep_heap is False
    assert heap.keep_heap() is False
    assert spy == []
    with pytest.raises(ValueError, match="VOICECHAT_KEEP_HEAP must be 0 or 1"):
        ExecutionPolicy.for_device(environ={var: "maybe"})


def test_a_refused_setting_raises_and_is_retried(monkeypatch):
    monkeypatch.setattr(heap, "_done", [])
    monkeypatch.setattr(heap, "served", lambda: True)
    monkeypatch.setattr(heap, "_mallopt", lambda param, value: 0)
    for _ in range(2):  # not marked done: the next call tries again
        with pytest.raises(
            RuntimeError, match=r"mallopt\(M_MMAP_THRESHOLD, 33554432\) failed; set VOICECHAT_KEEP_HEAP=0"
        ):
            heap.keep_heap()
        assert heap._done == []


@pytest.mark.skipif(not heap.served(), reason="glibc only")
def test_glibc_accepts_the_values():
    """The real mallopt takes both values."""
    assert heap._mallopt(heap.M_MMAP_THRESHOLD, heap.MMAP_THRESHOLD_BYTES) == 1
    assert heap._mallopt(heap.M_TRIM_THRESHOLD, heap.TRIM_THRESHOLD_BYTES) == 1
