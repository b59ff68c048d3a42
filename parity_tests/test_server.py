"""`voicechat serve`: the /v1/realtime protocol against a server on 127.0.0.1 (tiny synthetic checkpoint).

Default suite: round trips, equality with the in-process session, every limit and error,
busy / release, cancel, timeouts, security, the page's assets. The soak and the browser
test are in test_server_slow.py (-m slow); mlx-vlm's server in test_server_peers.py (-m peers).
"""

from __future__ import annotations

import asyncio
import base64
import json
import urllib.error
import urllib.request

import numpy as np
import pytest

from voicechat.server.client import run_stream_audio, to_pcm16

from .server_util import Raw, WrappedServer, append_msg, run, slow_frames, wait_released

PROMPT = "You are a helpful assistant."


def _expected_events(model, pcm: np.ndarray, *, seed=0, prompt=None):
    """The in-process session's events for the same PCM16 audio, as the wire should carry them."""
    s = model.create_streaming_session(system_prompt=prompt, seed=seed)
    events = s.push_audio(pcm) + s.flush()
    names = {
        "user_transcript_delta": "conversation.item.input_audio_transcription.delta",
        "assistant_text_delta": "response.text.delta",
        "function_delta": "response.function.delta",
        "audio": "response.audio.delta",
        "audio_tail": "response.audio.tail",
        "done": "response.done",
    }
    out = []
    for e in events:
        d = {"type": names[e.kind], "frame_index": e.frame_index}
        if e.kind in ("assistant_text_delta", "function_delta"):
            d.update(token_id=e.token_id, delta=e.delta, text=e.text)
        elif e.kind == "user_transcript_delta":
            d.update(delta=e.delta, transcript=e.text)
        elif e.kind in ("audio", "audio_tail"):
            # mlx-vlm's server rounding: clip to [-1, 1], x 32767, round half to even.
            d["pcm"] = np.round(np.clip(e.samples, -1, 1) * 32767).astype(np.int16).tolist()
            if e.kind == "audio":
                d["audio_codes"] = np.asarray(e.audio_codes).tolist()
        out.append(d)
    return out


def _wire_events(result):
    from voicechat.server.protocol import b64_to_int16

    out = []
    for e in result.events:
        if e["type"] in ("session.created", "session.updated", "input_audio_buffer.committed"):
            continue
        d = {
            k: e[k] for k in ("type", "frame_index", "token_id", "delta", "text", "transcript", "audio_codes") if k in e
        }
        if e["type"] == "conversation.item.input_audio_transcription.delta":
            assert e["text"] == e["transcript"]
            d.pop("text")
        if e["type"] in ("response.audio.delta", "response.audio.tail"):
            d["pcm"] = b64_to_int16(e["delta"]).tolist()
            d.pop("delta")
        out.append(d)
    return out


# -- round trips and equality with the in-process session


def test_streamed_events_equal_in_process_session(server, tiny_model, question_wav):
    pcm = to_pcm16(question_wav)
    expected = _expected_events(tiny_model, pcm, seed=3, prompt=PROMPT)
    # Odd chunk sizes: the event stream must not depend on how the audio is split.
    r = run_stream_audio(server.url, pcm, fast=True, chunk_samples=777, seed=3, system_prompt=PROMPT)
    assert r.end == "response.done" and r.close_code == 1000 and not r.errors
    got = _wire_events(r)
    assert [e["type"] for e in got] == [e["type"] for e in expected]
    for g, x in zip(got, expected, strict=True):
        assert g == x, (g["type"], g["frame_index"])
    assert r.frames == -(-pcm.size // 1280)
    # The tail follows the last frame and carries the codec's held-back samples: nothing lost.
    assert [e["type"] for e in r.events[-3:]] == ["response.audio.delta", "response.audio.tail", "response.done"]
    assert r.events[-1]["frame_index"] == r.frames
    # `committed` follows the frames of the complete audio before the commit (mlx-vlm's order); the padded
    # partial frame comes after it.
    kinds = [(e["type"], e.get("frame_index")) for e in r.events]
    at = kinds.index(("input_audio_buffer.committed", None))
    assert ("response.audio.delta", pcm.size // 1280 - 1) in kinds[:at]
    assert kinds[at + 1 :].count(("response.audio.delta", pcm.size // 1280)) == 1


def test_session_messages_and_fields(server, tiny_model):
    async def go():
        async with Raw(server.url) as c:
            created = await c.recv()
            assert created["type"] == "session.created" and created["session"]["state"] == "configuring"
            assert created["session"]["input_audio_format"] == {"type": "pcm16", "sample_rate": 16000, "channels": 1}
            await c.send({"type": "session.ping"})
            assert (await c.recv())["type"] == "session.pong"  # ping works before session.update
            await c.send(
                {"type": "session.update", "session": {"system_prompt": PROMPT, "seed": 5, "model": "anything"}}
            )
            upd = await c.recv()
            assert upd["type"] == "session.updated" and upd["session"]["state"] == "ready"
            s = upd["session"]
            cfg = tiny_model.config
            assert s["frame_samples"] == cfg.frame_samples and s["seed"] == 5 and s["system_prompt"] == PROMPT
            assert s["output_audio_format"]["sample_rate"] == cfg.output_sample_rate
            assert s["output_frame_samples"] == tiny_model.tts_model.audio_codec.samples_per_frame
            await c.send(append_msg(np.zeros(2 * cfg.frame_samples + 100, np.int16)))
            deltas = []
            for _ in range(2):
                e, seen = await c.until("response.audio.delta")
                deltas.append(e)
            for i, e in enumerate(deltas):
                assert e["frame_index"] == i and len(e["audio_codes"]) == cfg.codec_config.num_quantizers
                assert e["samples"] == s["output_frame_samples"] and e["compute_ms"] > 0 and e["lag_ms"] >= 0
                assert e["format"] == "pcm16" and e["sample_rate"] == cfg.output_sample_rate
            await c.send({"type": "input_audio_buffer.commit", "pad_partial": False})
            e, seen = await c.until("response.done")
            types = [x["type"] for x in seen]
            assert types[0] == "input_audio_buffer.committed" and "response.audio.delta" not in types
            assert e["frame_index"] == 2  # pad_partial=False: the 100 samples are dropped, as asked
            code, _rest = await c.closed()
            assert code == 1000
            ids = [x["event_id"] for x in [created, upd, *deltas, *seen]]
            assert len(set(ids)) == len(ids)

    run(go())


# -- errors: each one clear, the connection stays usable


def test_bad_messages_get_errors_and_the_session_goes_on(server, question_wav, tiny_model):
    pcm = to_pcm16(question_wav[: 4 * 1280])
    bad = [
        ("{not json", "invalid_json"),
        ("[1, 2]", "invalid_json"),
        (json.dumps({"no": "type"}), "invalid_message"),
        (json.dumps({"type": "response.create"}), "unknown_type"),
        (b"\x00\x01", "invalid_message"),
    ]
    after_update = [
        (
            json.dumps({"type": "input_audio_buffer.append", "audio": "@@@notbase64", "sample_rate": 16000}),
            "invalid_audio",
        ),
        (
            json.dumps(
                {
                    "type": "input_audio_buffer.append",
                    "audio": base64.b64encode(bytes(15)).decode(),
                    "sample_rate": 16000,
                }
            ),
            "invalid_audio",
        ),  # 15 bytes: odd
        (append_msg(pcm[:100], sample_rate=48000), "invalid_sample_rate"),
        (json.dumps({"type": "input_audio_buffer.append", "audio": 5}), "invalid_audio"),
        (json.dumps({"type": "session.update", "session": {}}), "session_already_configured"),
        (json.dumps({"type": "input_audio_buffer.commit", "pad_partial": "yes"}), "invalid_message"),
    ]

    async def go():
        async with Raw(server.url) as c:
            await c.recv()
            for msg, code in bad:
                await c.send(msg)
                e = await c.recv()
                assert e["type"] == "error" and e["error"]["code"] == code, (msg, e)
                assert len(e["error"]["message"]) > 20
            await c.send(append_msg(pcm[:1280]))
            e = await c.recv()
            assert e["error"]["code"] == "session_not_configured"
            await c.send({"type": "session.update", "session": {"seed": "x"}})
            assert (await c.recv())["error"]["code"] == "invalid_session"
            await c.send({"type": "session.update", "session": {"seed": 0}})
            assert (await c.recv())["type"] == "session.updated"
            for msg, code in after_update:
                await c.send(msg)
                e = await c.recv()
                assert e["type"] == "error" and e["error"]["code"] == code, (msg, e)
            await c.send(append_msg(pcm))
            await c.send({"type": "input_audio_buffer.commit"})
            code, events = await c.closed()
            return code, events

    code, events = run(go())
    assert code == 1000 and events[-1]["type"] == "response.done"
    # Nothing of the refused messages reached the session: the frames are exactly those of `pcm`.
    expected = _expected_events(tiny_model, pcm)
    got = [e for e in events if e["type"] == "response.audio.delta"]
    assert [e["audio_codes"] for e in got] == [e["audio_codes"] for e in expected if "audio_codes" in e]


def test_message_size_limit(make_server):
    srv = make_server(max_message_bytes=20_000)

    async def go():
        async with Raw(srv.url) as c:
            await c.configure()
            await c.send(append_msg(np.zeros(9000, np.int16)))  # ~24 kB of base64
            e = await c.recv()
            assert e["error"]["code"] == "message_too_large" and "20000" in e["error"]["message"]
            assert await c.ping_ok()
            await c.send(append_msg(np.zeros(5000, np.int16)))  # under the limit: accepted
            await c.send({"type": "input_audio_buffer.commit"})
            done, _ = await c.until("response.done")
            assert done["frame_index"] == 4  # ceil(5000 / 1280): only the accepted append
        async with Raw(srv.url) as c:
            await c.recv()
            await c.send("x" * (srv.state.limits.transport_max_bytes + 10))  # beyond the transport cap
            code, _ = await c.closed()
            assert code == 1009

    run(go())


def test_faster_than_real_time_is_slowed_not_refused(make_server, question_wav):
    """Backpressure: a client far ahead of the model is held back by TCP (the server stops reading), every
    append is accepted and computed; nothing is refused or lost."""
    srv = make_server(max_queued_audio_seconds=0.25)
    pcm = to_pcm16(question_wav)
    chunk = 640

    async def go():
        async with Raw(srv.url) as c:
            await c.configure()
            for i in range(0, pcm.size, chunk):  # as fast as possible: far ahead of the model
                await c.send(append_msg(pcm[i : i + chunk]))
            await c.send({"type": "input_audio_buffer.commit"})
            return await c.closed()

    code, events = run(go())
    assert code == 1000 and events[-1]["type"] == "response.done"
    assert not [e for e in events if e["type"] == "error"]
    # Every sample computed: frames = all the audio, padded.
    assert events[-1]["frame_index"] == -(-pcm.size // 1280)
    # lag = received - computed <= admitted backlog (0.25 s) + one append (40 ms) + the partial frame (< 80 ms)
    assert max(e["lag_ms"] for e in events if e["type"] == "response.audio.delta") < 250 + 40 + 80


def test_session_audio_limit(make_server):
    srv = make_server(max_session_audio_seconds=0.5)

    async def go():
        async with Raw(srv.url) as c:
            await c.configure()
            for _ in range(4):
                await c.send(append_msg(np.zeros(2560, np.int16)))  # 0.16 s each: the 4th passes 0.5 s
            await c.send({"type": "input_audio_buffer.commit"})
            return await c.closed()

    code, events = run(go())
    errs = [e["error"]["code"] for e in events if e["type"] == "error"]
    assert errs == ["session_audio_limit"] and code == 1000
    assert events[-1]["type"] == "response.done" and events[-1]["frame_index"] == 6


def test_context_limit_of_the_session(server):
    async def go():
        async with Raw(server.url) as c:
            await c.recv()
            await c.send({"type": "session.update", "session": {"max_streaming_seconds": 0.24}})
            await c.recv()
            await c.send(append_msg(np.zeros(6 * 1280, np.int16)))
            return await c.closed()

    code, events = run(go())
    assert [e["frame_index"] for e in events if e["type"] == "response.audio.delta"] == [0, 1, 2]
    assert events[-1]["type"] == "error" and events[-1]["error"]["code"] == "context_limit" and code == 1000


# -- one session per process


def _busy_refusals(server) -> float:
    text = urllib.request.urlopen(server.http + "/metrics").read().decode()
    return float(
        next(x.split()[1] for x in text.splitlines() if x.startswith('voicechat_sessions_refused_total{reason="busy"}'))
    )


def test_busy_and_release(server, question_wav):
    pcm = to_pcm16(question_wav[: 3 * 1280])
    refused_before = _busy_refusals(server)

    async def go():
        async with Raw(server.url) as first:
            await first.recv()
            async with Raw(server.url) as second:
                e = await second.recv()
                assert e["type"] == "error" and e["error"]["code"] == "server_busy"
                code, _ = await second.closed()
                assert code == 1013
            assert await first.ping_ok()  # the first is unaffected
        # first closed by the client: the slot is free again
        for end in ("disconnect_configured", "commit", "cancel"):
            async with Raw(server.url) as c:
                await c.configure()
                await c.send(append_msg(pcm))
                if end == "commit":
                    await c.send({"type": "input_audio_buffer.commit"})
                    await c.closed()
                elif end == "cancel":
                    await c.send({"type": "session.cancel"})
                    await c.closed()
        await asyncio.sleep(0.2)

    run(go())
    r = run_stream_audio(server.url, pcm, fast=True)
    assert r.end == "response.done"
    assert wait_released(server)
    assert _busy_refusals(server) - refused_before == 1


def test_cancel_mid_stream(server, long_question_wav):
    pcm = to_pcm16(long_question_wav)
    r = run_stream_audio(server.url, pcm, fast=False, chunk_samples=1280, cancel_after_frames=5)
    assert r.end == "response.cancelled" and r.close_code == 1000
    cancelled = r.of_type("response.cancelled")[0]
    assert 5 <= cancelled["frame_index"] < pcm.size // 1280
    assert not r.of_type("response.done") and not r.of_type("response.audio.tail")
    assert wait_released(server)


def test_idle_and_session_update_timeouts(make_server):
    srv = make_server(idle_timeout=1.5, session_update_timeout=0.3)  # idle > one frame's compute, even loaded

    async def go():
        async with Raw(srv.url) as c:  # never sends session.update
            await c.recv()
            code, events = await c.closed()
            assert code == 1008 and events[-1]["error"]["code"] == "session_update_timeout"
        async with Raw(srv.url) as c:  # configured, then silent
            await c.configure()
            await c.send(append_msg(np.zeros(1280, np.int16)))
            code, events = await c.closed()
            assert code == 1008 and events[-1]["error"]["code"] == "idle_timeout"
            assert any(e["type"] == "response.audio.delta" for e in events)
        await asyncio.sleep(0.2)
        async with Raw(srv.url) as c:  # and the slot came back
            assert (await c.recv())["type"] == "session.created"

    run(go())
    text = urllib.request.urlopen(srv.http + "/metrics").read().decode()
    assert 'voicechat_sessions_errored_total{reason="idle_timeout"} 1.0' in text


# -- security


def test_api_key_and_origin(make_server):
    from websockets.exceptions import InvalidStatus

    srv = make_server(api_key="s3cret", origins=("https://app.example",))

    async def status(**kw):
        try:
            async with Raw(srv.url, **kw) as c:
                return (await c.recv())["type"]
        except InvalidStatus as e:
            return e.response.status_code

    assert run(status()) == 401
    assert run(status(additional_headers={"Authorization": "Bearer wrong"})) == 401
    ok = {"Authorization": "Bearer s3cret"}
    assert run(status(additional_headers=ok)) == "session.created"
    assert run(status(subprotocols=["voicechat.bearer.s3cret"])) == "session.created"  # the browser's way
    assert run(status(additional_headers=ok, origin="https://evil.example")) == 403
    assert run(status(additional_headers=ok, origin="https://app.example")) == "session.created"
    assert run(status(additional_headers=ok, origin=srv.http)) == "session.created"  # the page's own origin
    with pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.urlopen(srv.http + "/metrics")
    assert e.value.code == 401
    req = urllib.request.Request(srv.http + "/metrics", headers={"Authorization": "Bearer s3cret"})
    assert b'voicechat_sessions_refused_total{reason="unauthorized"} 2.0' in urllib.request.urlopen(req).read()


def test_default_bind_and_origin(server):
    from voicechat.cli.main import build_parser

    args = build_parser().parse_args(["serve"])
    assert args.host == "127.0.0.1" and args.model == "synthetic:tiny" and args.api_key is None
    from websockets.exceptions import InvalidStatus

    with pytest.raises(InvalidStatus) as e:
        run(Raw(server.url, origin="http://localhost:1").__aenter__())
    assert e.value.response.status_code == 403


def test_page_assets_and_nothing_else(server):
    def get(path):
        try:
            r = urllib.request.urlopen(server.http + path)
            return r.status, r.read(), r.headers
        except urllib.error.HTTPError as e:
            return e.code, b"", e.headers

    status, body, headers = get("/")
    assert status == 200 and b"/static/app.js" in body and headers["Content-Type"].startswith("text/html")
    assert "default-src 'self'" in headers["Content-Security-Policy"]
    for p in ("/static/app.js", "/static/worklets.js", "/static/style.css"):
        assert get(p)[0] == 200, p
    for p in (
        "/static/../app.py",
        "/static/%2e%2e/app.py",
        "/static/..%2fapp.py",
        "/app.py",
        "/static/",
        "/static/protocol.py",
        "/..%2f..%2fetc/passwd",
        "/static/%2e%2e/%2e%2e/__init__.py",
    ):
        assert get(p)[0] == 404, p


def test_healthz_and_metrics(server, question_wav):
    h = json.loads(urllib.request.urlopen(server.http + "/healthz").read())
    # Nothing else: no path, no queue (those are in /metrics, behind the key).
    assert set(h) == {"status", "active_sessions", "max_sessions", "slot_bytes_at_limit"}
    assert h["status"] == "ok" and h["active_sessions"] == 0 and h["max_sessions"] == 1
    assert h["slot_bytes_at_limit"] == server.state.worker.memory["slot_bytes"] > 0

    def frames():
        text = urllib.request.urlopen(server.http + "/metrics").read().decode()
        return {
            line.split()[0]: float(line.split()[1]) for line in text.splitlines() if line and not line.startswith("#")
        }

    before = frames()
    r = run_stream_audio(server.url, to_pcm16(question_wav[: 5 * 1280]), fast=True)
    after = frames()
    assert after["voicechat_frames_total"] - before["voicechat_frames_total"] == r.frames == 5
    assert after["voicechat_sessions_opened_total"] - before["voicechat_sessions_opened_total"] == 1
    every = server.state.worker.stage_metrics_every
    for stage in ("perception", "rnnt", "language", "tts", "codec"):
        key = f'voicechat_stage_seconds_count{{stage="{stage}"}}'
        assert after[key] - before.get(key, 0) == len(range(0, 5, every))  # the sampled frames
    assert after["voicechat_frame_compute_seconds_count"] - before["voicechat_frame_compute_seconds_count"] == 5


def test_file_client_cli(server, tmp_path):
    import soundfile as sf

    from voicechat.cli.main import main
    from voicechat.samples import sample_path

    out = tmp_path / "answer.wav"
    rc = main(
        [
            "client",
            "--url",
            server.url,
            "--audio",
            str(sample_path("question")),
            "--output-audio",
            str(out),
            "--fast",
            "--events",
            str(tmp_path / "ev.jsonl"),
        ]
    )
    assert rc == 0
    data, sr = sf.read(str(out), dtype="int16")
    events = [json.loads(x) for x in (tmp_path / "ev.jsonl").read_text().splitlines()]
    frames = [e for e in events if e["type"] == "response.audio.delta"]
    tail = [e for e in events if e["type"] == "response.audio.tail"]
    assert sr == events[1]["session"]["output_audio_format"]["sample_rate"]
    assert (
        data.size == sum(e["samples"] for e in frames + tail) == len(frames) * frames[0]["samples"] + tail[0]["samples"]
    )


def test_talk_jitter_buffer_plays_every_sample_in_order():
    from voicechat.server.talk import JitterBuffer

    jb = JitterBuffer(prefill=50)
    assert not jb.pull(10).any()  # silence until the prefill is queued
    src = np.arange(1, 121, dtype=np.int16)
    for i in range(0, 120, 24):
        jb.push(src[i : i + 24])
    out = np.concatenate([jb.pull(35) for _ in range(4)])
    assert np.array_equal(out[:120], src) and not out[120:].any() and jb.underruns == 1


def test_serve_without_the_extra_says_what_to_install(monkeypatch, capsys):
    import sys

    from voicechat.cli.main import main

    monkeypatch.setitem(sys.modules, "starlette", None)  # as on the base install
    assert main(["serve", "--port", "1"]) == 2
    assert main(["client", "--audio", "x.wav"]) == 2
    err = capsys.readouterr().err
    assert err.count("needs the `serve` extra") == 2 and "pip install -e '.[serve]'" in err


def test_slow_model_shows_growing_lag_not_a_stall(tiny_ckpt, question_wav):
    """Frames computed at ~2.5x real time: every frame's delta still arrives as it is done, with its lag."""
    with WrappedServer(tiny_ckpt, lambda kw: slow_frames(0.2)) as w:
        pcm = to_pcm16(question_wav[: 24 * 1280])  # 1.92 s of input; ~4.8 s of compute
        arrivals = []
        r = run_stream_audio(
            w.srv.url, pcm, fast=False, chunk_samples=1280, on_event=lambda e: arrivals.append(e["type"])
        )
    assert r.end == "response.done" and not r.errors
    lags = [e["lag_ms"] for e in r.of_type("response.audio.delta")]
    # Input at 80 ms per frame, compute >= 200 ms per frame: while the client streams (the first ~9 frames),
    # the backlog grows by >= 120 ms a frame (asserted: half of that).
    assert lags[8] > lags[1] + 7 * 60, lags
    # No stall: frames were delivered while the client was still streaming (before its commit).
    assert arrivals.index("response.audio.delta") < arrivals.index("input_audio_buffer.committed")
    assert len(lags) == 24 and [e["frame_index"] for e in r.of_type("response.audio.delta")] == list(range(24))


def test_one_structured_log_line_per_session(server, question_wav, caplog):
    import logging

    pcm = to_pcm16(question_wav[: 7 * 1280 + 300])
    with caplog.at_level(logging.INFO, logger="voicechat.server"):
        r = run_stream_audio(server.url, pcm, fast=True)
        assert wait_released(server)
    lines = [
        json.loads(rec.getMessage())
        for rec in caplog.records
        if rec.name == "voicechat.server" and rec.getMessage().startswith("{")
    ]
    assert len(lines) == 1
    line = lines[0]
    assert line["event"] == "session_end" and line["end"] == "done" and line["frames"] == r.frames == 8
    assert line["audio_in_s"] == round(pcm.size / 16000, 3) and line["errors"] == 0 and line["input_overflows"] == 0
    assert 0 < line["compute_ms_mean"] <= line["compute_ms_max"] and line["compute_ms_p95"] <= line["compute_ms_max"]
    assert set(line["stage_ms_mean"]) == {"perception", "rnnt", "language", "tts", "codec"}


def test_voicechat_serve_process(tiny_ckpt, question_wav, tmp_path):
    """The real command: starts, serves a session, logs it, stops on SIGINT with exit status 0."""
    import signal
    import sys

    from voicechat.server.compare import free_port, start_process

    port = free_port()
    log = tmp_path / "serve.log"
    p = start_process(
        [
            sys.executable,
            "-m",
            "voicechat.cli",
            "serve",
            "-m",
            str(tiny_ckpt),
            "--port",
            str(port),
            "--warmup-seconds",
            "0.2",
        ],
        f"http://127.0.0.1:{port}/healthz",
        log,
        timeout=120,
    )
    try:
        r = run_stream_audio(f"ws://127.0.0.1:{port}/v1/realtime", to_pcm16(question_wav[: 4 * 1280]), fast=True)
        assert r.end == "response.done" and r.frames == 4
    finally:
        p.send_signal(signal.SIGINT)
        rc = p.wait(30)
    text = log.read_text()
    assert rc == 0 and '"event": "session_end"' in text and '"frames": 4' in text, text[-3000:]
    assert f"127.0.0.1:{port}" in text


def test_serve_with_a_missing_checkpoint_is_one_clear_error(tmp_path, capsys):
    from voicechat.cli.main import main

    assert main(["serve", "-m", str(tmp_path / "nothing-here"), "--port", "1"]) == 2
    err = capsys.readouterr().err
    assert "voicechat serve: error:" in err and "nothing-here" in err and "Traceback" not in err
