"""Reliability: any partition of the input, long sessions, isolation after cancel, bad files."""

import os

import mlx.core as mx
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

import voicechat


def _events(session, audio, sizes):
    out, pos, i = [], 0, 0
    while pos < len(audio):
        n = sizes[i % len(sizes)]
        out += session.push_audio(audio[pos : pos + n])
        pos += n
        i += 1
    return out + session.flush()


@pytest.fixture(scope="module")
def short_audio(question_wav):
    return question_wav[: 16000 + 777]


@pytest.fixture(scope="module")
def reference_events(tiny_model, short_audio):
    return _events(tiny_model.create_streaming_session(), short_audio, [1280])


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(sizes=st.lists(st.integers(min_value=1, max_value=5000), min_size=1, max_size=8))
def test_any_partition_same_events(tiny_model, short_audio, reference_events, sizes):
    assert _events(tiny_model.create_streaming_session(), short_audio, sizes) == reference_events


def test_cancelled_session_leaves_model_ready(tiny_ckpt, tiny_model, question_wav):
    s = tiny_model.create_streaming_session(system_prompt="hi")
    s.push_audio(question_wav[:5000])
    s.cancel()
    used = _events(tiny_model.create_streaming_session(), question_wav, [1280])
    fresh_model = voicechat.load(tiny_ckpt)
    fresh = _events(fresh_model.create_streaming_session(), question_wav, [1280])
    assert used == fresh


def test_cli_rejects_non_wav(tmp_path, tiny_ckpt):
    import subprocess
    import sys

    junk = tmp_path / "junk.wav"
    junk.write_bytes(b"RIFF....not really a wave file")
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "voicechat.cli",
            "generate",
            "-m",
            str(tiny_ckpt),
            "--audio",
            str(junk),
            "--output-audio",
            str(tmp_path / "o.wav"),
        ],
        capture_output=True,
        text=True,
        check=False,
    )
    assert r.returncode == 2 and "not a readable audio file" in r.stderr


def _buffer_address(a: mx.array) -> int:
    """Address of the first element of `a` as numpy sees it through the buffer protocol."""
    v1, v2 = np.asarray(a), np.asarray(a)
    # Two zero-copy views share the address; two live copies could not.
    assert v1.__array_interface__["data"][0] == v2.__array_interface__["data"][0], "numpy copied the array"
    return v1.__array_interface__["data"][0]


def test_growing_caches_are_written_in_place(tiny_model):
    """The caches that grow with the session (LLM attention K/V, TTS global-layer K/V) take a
    frame's new position in their buffer: between two capacity steps no frame copies the
    positions before it. A copy per frame would make each frame O(context) in memory traffic,
    a drift the 10-minute test (slow suite) could only see as time."""
    from voicechat.model.llm.nemotron_h import KV_ALLOC_STEP as LLM_STEP
    from voicechat.model.tts.ear_tts import KV_ALLOC_STEP as TTS_STEP

    cfg = tiny_model.config
    tts_cfg = cfg.tts_config
    chunk = (0.05 * np.random.default_rng(0).standard_normal(cfg.frame_samples)).astype(np.float32)
    s = tiny_model.create_streaming_session()
    growing = [
        f"tts.layers.{i}.{kv}"
        for i in range(tts_cfg.num_hidden_layers)
        if tts_cfg.is_global_layer(i)
        for kv in ("keys", "values")
    ]
    growing += [k for k in s.states() if k.startswith("llm.") and k.endswith((".keys", ".values"))]
    assert any(k.startswith("llm.") for k in growing) and any(k.startswith("tts.") for k in growing)
    for _ in range(5):
        s.push_audio(chunk)
    before = s.states()
    where = {k: _buffer_address(before[k]) for k in growing}
    lengths = {k: before[k].shape[2] for k in growing}
    del before
    # Checked after every frame: a copy is written while the old buffer is still alive, so it
    # lands at another address at least every other frame (the allocator may hand the old
    # block back one frame later).
    for frame in range(1, 21):
        s.push_audio(chunk)
        after = s.states()
        for k in growing:
            step = LLM_STEP if k.startswith("llm.") else TTS_STEP
            n0, n1 = lengths[k], after[k].shape[2]
            assert n1 == n0 + frame, (k, n0, n1)
            assert (n0 - 1) // step == (n1 - 1) // step, f"{k}: a capacity step between {n0} and {n1} positions"
            assert _buffer_address(after[k]) == where[k], f"{k}: the buffer moved between {n0} and {n1} positions"
        del after


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


@pytest.mark.slow
def test_ten_minute_session(tiny_model):
    """10 minutes through a tiny session: bounded caches stay bounded, designed growth is linear,
    RSS beyond that stays under 50 MB, frame time does not drift (last minute within 1.6x of the second)."""
    import time

    cfg = tiny_model.config
    frames_per_min = int(60 / cfg.frame_duration)
    rng = np.random.default_rng(0)
    s = tiny_model.create_streaming_session()
    chunk = (0.05 * rng.standard_normal(cfg.frame_samples)).astype(np.float32)
    llm_kv = s.timeline.state.llm.kv_bytes_per_position
    tts_cfg = cfg.tts_config
    tts_global_layers = sum(tts_cfg.is_global_layer(i) for i in range(tts_cfg.num_hidden_layers))
    tts_kv = tts_global_layers * 2 * 2 * tts_cfg.num_key_value_heads * tts_cfg.head_dim * 4
    rss0 = None
    for f in range(10 * frames_per_min):
        ev = s.push_audio(chunk)
        assert sum(e.kind == "audio" for e in ev) == 1
        if f == frames_per_min:
            rss0 = _rss_bytes()
            sizes0 = {k: v.nbytes for k, v in s.states().items()}
    sizes = {k: v.nbytes for k, v in s.states().items()}
    grown = {k for k in sizes if sizes[k] != sizes0[k]}
    # Only the designed-to-grow caches grow: LLM attention K/V and TTS global-layer K/V (+ offsets).
    for k in grown:
        assert (
            (k.startswith("llm.") and (k.endswith((".keys", ".values"))))
            or k.startswith("tts.layers.")
            or k in ("tts.offset",)
        ), k
    sliding = [i for i in range(tts_cfg.num_hidden_layers) if not tts_cfg.is_global_layer(i)]
    for i in sliding:
        assert s.timeline.state.tts.arrays()[f"layers.{i}.keys"].shape[2] == tts_cfg.sliding_window
    n = 9 * frames_per_min
    growth = sum(sizes[k] - sizes0[k] for k in grown)
    assert growth == pytest.approx(n * (llm_kv + tts_kv), rel=0.01)
    rss_growth = _rss_bytes() - rss0
    assert rss_growth - growth < 50 * 2**20, rss_growth
    # Drift: frames at minute 10 vs frames at minute 2, timed side by side. This machine is a
    # shared VM whose speed shifts by tens of percent from one minute to the next, so the two
    # minutes are not compared across time: a second session is brought to minute 2 and the two
    # sessions then alternate frame by frame, so any change of machine speed hits both alike.
    # What may grow: attention over 5x the context. At the tiny widths that is a large part of
    # the frame, and how large depends on the host: on an AMD EPYC VM MLX's attention over 7,500
    # positions cost ~1.8 ms more than over 1,500 (LLM layer ~0.7 ms, TTS global layer ~1.1 ms,
    # measured alone; over half of it the softmax's exp), 1.308x / 1.315x of a ~6.2 ms frame;
    # on an Intel Xeon VM ~3.1 ms of an 8.1 ms frame, 1.384x alone and 1.420x with another test
    # run beside it. The bound, 1.6x, is what a frame whose work does not grow with the session
    # but for its attention stays under on both; it catches a blow-up (a cache re-encoded or
    # re-projected per frame, attention recomputed over the history: multiples), not one copy
    # per frame of the grown caches (8.6 MB, ~1.5 ms, +0.2x): that is caught deterministically
    # by test_growing_caches_are_written_in_place (each grown cache keeps its buffer).
    # 600 alternating frames per session (instead of 300) cut the sampling noise of the two means
    # by a factor of 1.4.
    young = tiny_model.create_streaming_session()
    for _ in range(2 * frames_per_min):
        young.push_audio(chunk)
    t_old, t_young = [], []
    for _ in range(600):
        for sess, out in ((s, t_old), (young, t_young)):
            t0 = time.perf_counter()
            sess.push_audio(chunk)
            out.append(time.perf_counter() - t0)

    def trimmed_mean(ts):  # the slowest 5% (one-off pauses) are not drift
        ts = np.sort(np.asarray(ts))
        return float(np.mean(ts[: int(len(ts) * 0.95)]))

    second, last = trimmed_mean(t_young), trimmed_mean(t_old)
    print(
        f"\n10-minute session: frame at minute 2 {second * 1e3:.2f} ms, at minute 10 {last * 1e3:.2f} ms "
        f"({last / second:.3f}x, side by side); cache growth {growth} B; RSS growth {rss_growth / 2**20:.1f} MB"
    )
    assert last <= 1.6 * second, (second, last)


@pytest.mark.slow
def test_ten_minute_single_push(tiny_model):
    rng = np.random.default_rng(1)
    audio = (0.05 * rng.standard_normal(600 * 16000)).astype(np.float32)
    s = tiny_model.create_streaming_session()
    ev = s.push_audio(audio)
    assert sum(e.kind == "audio" for e in ev) == 7500
    mx.clear_cache()
