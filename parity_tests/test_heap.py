"""voicechat.runtime.heap: `load` on a CPU device sets glibc's trim and mmap thresholds once (so a frame's
large temporaries stay in the heap), not at all with VOICECHAT_KEEP_HEAP=0 or off glibc, and a
refusal by glibc is an error that names the switch."""

from __future__ import annotations

import pytest

import voicechat
from voicechat import heap


@pytest.fixture
def spy(monkeypatch):
    calls = []
    monkeypatch.setattr(heap, "_mallopt", lambda param, value: calls.append((param, value)) or 1)
    monkeypatch.setattr(heap, "_done", [])
    monkeypatch.setattr(heap, "served", lambda: True)
    return calls


def test_load_sets_both_thresholds_once(spy, tiny_ckpt, monkeypatch):
    monkeypatch.delenv(heap.ENV_VAR, raising=False)
    voicechat.load(tiny_ckpt)
    voicechat.load(tiny_ckpt)
    assert sorted(spy) == sorted([(heap.M_MMAP_THRESHOLD, 32 << 20), (heap.M_TRIM_THRESHOLD, 1 << 30)])


def test_switched_off_or_not_glibc_leaves_the_defaults(spy, monkeypatch):
    monkeypatch.setenv(heap.ENV_VAR, "0")
    assert heap.keep_heap() is False
    monkeypatch.delenv(heap.ENV_VAR)
    monkeypatch.setattr(heap, "served", lambda: False)
    assert heap.keep_heap() is False
    assert spy == []
    monkeypatch.setenv(heap.ENV_VAR, "maybe")
    with pytest.raises(ValueError, match="VOICECHAT_KEEP_HEAP must be 0 or 1"):
        heap.keep_heap()


def test_a_refused_setting_raises_and_is_retried(monkeypatch):
    monkeypatch.delenv(heap.ENV_VAR, raising=False)
    monkeypatch.setattr(heap, "_done", [])
    monkeypatch.setattr(heap, "served", lambda: True)
    monkeypatch.setattr(heap, "_mallopt", lambda param, value: 0)
    with pytest.raises(RuntimeError, match=r"mallopt\(M_MMAP_THRESHOLD, 33554432\) failed; set VOICECHAT_KEEP_HEAP=0"):
        heap.keep_heap()
    assert heap._done == []


@pytest.mark.skipif(not heap.served(), reason="glibc only")
def test_glibc_accepts_the_values():
    """The real mallopt takes both values."""
    assert heap._mallopt(heap.M_MMAP_THRESHOLD, heap.MMAP_THRESHOLD_BYTES) == 1
    assert heap._mallopt(heap.M_TRIM_THRESHOLD, heap.TRIM_THRESHOLD_BYTES) == 1
