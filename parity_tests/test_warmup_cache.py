"""The on-disk TTS warm-up cache (voicechat/io/warmup_cache.py) and the loader's NaN / inf test."""

from __future__ import annotations

import os
import shutil

import mlx.core as mx
import numpy as np
import pytest

import voicechat
from voicechat.io import warmup_cache
from voicechat.io.checkpoint import has_nonfinite
from voicechat.model.tts.ear_tts import EarTts


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("VOICECHAT_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv(warmup_cache.ENV_VAR, raising=False)
    return tmp_path / "cache" / "warmup"


@pytest.fixture
def warmups(monkeypatch):
    """Counts the EAR-TTS warm-ups actually computed."""
    calls = []
    original = EarTts.warmup

    def counting(self, *args, **kwargs):
        calls.append(1)
        return original(self, *args, **kwargs)

    monkeypatch.setattr(EarTts, "warmup", counting)
    return calls


def _state_arrays(model) -> dict:
    st = model._warm_tts
    out = {f"k{i}": k for i, k in enumerate(st.keys)}
    out.update({f"v{i}": v for i, v in enumerate(st.values)})
    out.update(codes=model._prompt_codes, previous=st.previous_codes)
    return out, (st.offset, list(st.ring_origin))


def _assert_same_warmup(a, b):
    arrays_a, meta_a = _state_arrays(a)
    arrays_b, meta_b = _state_arrays(b)
    assert meta_a == meta_b
    assert arrays_a.keys() == arrays_b.keys()
    for k in arrays_a:
        x, y = np.asarray(arrays_a[k]), np.asarray(arrays_b[k])
        assert x.dtype == y.dtype and x.shape == y.shape, k
        assert np.array_equal(x.view(np.uint8), y.view(np.uint8)), f"{k} differs"  # bit for bit


def _copy(src, dst):
    shutil.copytree(src, dst)
    return dst


def test_cached_warmup_is_bit_identical_and_skips_the_computation(cache, warmups, tmp_path, tiny_ckpt, question_wav):
    folder = _copy(tiny_ckpt, tmp_path / "ckpt")
    first = voicechat.load(folder)
    assert len(warmups) == 1
    assert len(list(cache.glob("*.safetensors"))) == 1
    second = voicechat.load(folder)
    assert len(warmups) == 1, "the second load computed the warm-up again"
    _assert_same_warmup(first, second)
    # ... and the sessions built on them give the same ids and codes frame by frame.
    ids = []
    for m in (first, second):
        s = m.create_streaming_session()
        events = s.push_audio(question_wav[: 8 * 1280])
        ids.append(
            (
                list(s.text_ids),
                [np.asarray(c).tolist() for c in s.raw_audio_codes],
                [e for e in events if e.kind == "audio"],
            )
        )
    assert len(ids[0][2]) == 8
    assert ids[0] == ids[1]  # Audio events compare samples and decoded codes exactly


def test_cache_off_and_numerics_have_their_own_entries(cache, warmups, monkeypatch, tmp_path, tiny_ckpt):
    folder = _copy(tiny_ckpt, tmp_path / "ckpt")
    cached = voicechat.load(folder)
    other = voicechat.load(folder, numerics="float32")
    assert len(warmups) == 2 and len(list(cache.glob("*.safetensors"))) == 2
    monkeypatch.setenv(warmup_cache.ENV_VAR, "0")
    fresh = voicechat.load(folder)
    assert len(warmups) == 3
    _assert_same_warmup(cached, fresh)
    monkeypatch.setenv(warmup_cache.ENV_VAR, "yes")
    with pytest.raises(ValueError, match="VOICECHAT_WARMUP_CACHE must be 0 or 1"):
        voicechat.load(folder)
    del other


def test_touched_shard_tokenizer_or_config_makes_a_new_key(cache, warmups, tmp_path, tiny_ckpt):
    folder = _copy(tiny_ckpt, tmp_path / "ckpt")
    model = voicechat.load(folder)
    key = warmup_cache.cache_key(model)
    shard = sorted(folder.glob("*.safetensors"))[0]
    st = shard.stat()
    os.utime(shard, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000_000))
    assert warmup_cache.cache_key(model) != key
    voicechat.load(folder)
    assert len(warmups) == 2
    key = warmup_cache.cache_key(model)
    tok = folder / "tokenizer.json"
    st = tok.stat()
    os.utime(tok, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000_000))
    assert warmup_cache.cache_key(model) != key
    (folder / "config.json").write_text((folder / "config.json").read_text() + "\n")
    assert warmup_cache.cache_key(model) != key


@pytest.mark.parametrize("damage", ["garbage", "other_model"])
def test_unusable_entry_is_reported_and_recomputed(cache, warmups, tmp_path, tiny_ckpt, tiny_ckpt_4bit, capfd, damage):
    folder = _copy(tiny_ckpt, tmp_path / "ckpt")
    reference = voicechat.load(folder)
    (entry,) = cache.glob("*.safetensors")
    if damage == "garbage":
        entry.write_bytes(b"not a safetensors file")
    else:  # a valid file, but with another model's K/V layout under this key
        arrays, meta = mx.load(str(entry), return_metadata=True)
        arrays["keys.0"] = mx.zeros((2, 1, 3, 5))
        mx.save_safetensors(str(entry), arrays, metadata=meta)
    capfd.readouterr()
    again = voicechat.load(folder)
    err = capfd.readouterr().err
    assert "TTS warm-up cache: ignoring" in err and entry.name in err
    assert len(warmups) == 2
    _assert_same_warmup(reference, again)
    voicechat.load(folder)  # the entry was rewritten: a hit now
    assert len(warmups) == 2


def test_cache_keeps_the_most_recent_entries(cache, monkeypatch):
    monkeypatch.setattr(warmup_cache, "MAX_ENTRIES", 2)
    cache.mkdir(parents=True)
    for i in range(4):
        p = cache / f"{i:032x}.safetensors"
        p.write_bytes(b"x")
        os.utime(p, ns=(i * 10**9, i * 10**9))
    warmup_cache._prune(cache)
    assert sorted(p.name[:32] for p in cache.glob("*.safetensors")) == [f"{2:032x}", f"{3:032x}"]


# -- the loader's NaN / inf test (bit test on the stored exponent)


@pytest.mark.parametrize("dtype", [mx.bfloat16, mx.float16, mx.float32])
@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf, None])
def test_has_nonfinite(dtype, bad, monkeypatch):
    import voicechat.io.checkpoint as ck

    monkeypatch.setattr(ck, "NONFINITE_CHUNK_ELEMENTS", 7 * 11)  # several chunks, the bad value in the last
    finfo = {mx.bfloat16: 3.3895e38, mx.float16: 65504.0, mx.float32: 3.4028235e38}[dtype]
    a = np.linspace(-1, 1, 30 * 11, dtype=np.float32).reshape(30, 11)
    a[0, 0], a[1, 1] = finfo, -finfo  # the largest finite values are finite
    a[2, 2] = 1e-40  # a subnormal (flushed or not) is finite
    if bad is not None:
        a[29, 10] = bad
    x = mx.array(a).astype(dtype)
    assert has_nonfinite(x) is (bad is not None)
    assert has_nonfinite(x.T) is (bad is not None)  # a transposed (strided) view
    assert has_nonfinite(x[29, 10]) is (bad is not None)  # a scalar
    assert has_nonfinite(x[:0]) is False
