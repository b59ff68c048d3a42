"""`voicechat serve` attacked as a hostile or broken client would (issue 34), over 127.0.0.1 only.

Each case asserts the exact outcome: the error code, the close code, the time to free the slot,
the samples accounted for. Request loops are bounded in count and time. The SIGTERM case runs
the real command in a subprocess (-m slow, with the other multi-second cases).
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import urllib.error
import urllib.request

import numpy as np
import pytest

from voicechat.server.client import to_pcm16

from .server_util import (
    Raw,
    RawSocketWS,
    WrappedServer,
    append_msg,
    failing_frame,
    http_raw,
    run,
    slow_frames,
    wait_released,
)


def _metric(srv, name: str, key: str | None = None) -> float:
    req = urllib.request.Request(
        srv.http + "/metrics",
        headers={"Host": f"127.0.0.1:{srv.port}", **({"Authorization": f"Bearer {key}"} if key else {})},
    )
    text = urllib.request.urlopen(req).read().decode()
    for line in text.splitlines():
        if line.split(" ")[0] == name:
            return float(line.split()[-1])
    return 0.0


def _assert_short_error(e: dict, code: str) -> None:
    assert e["type"] == "error" and e["error"]["code"] == code, e
    assert 20 < len(e["error"]["message"]) < 400, e  # says what was wrong; never echoes a whole message


# -- Host and Origin (DNS rebinding)


def test_foreign_host_refused_on_every_route_and_upgrade(server):
    port = server.port
    for host in (
        "evil.example",
        f"evil.example:{port}",
        "127.0.0.1.evil.example",
        "",
        "a/b",
        "localhost@evil",
        "[::2]",
        "0.0.0.0",
    ):
        for path in ("/healthz", "/", "/metrics", "/static/app.js", "/nothing"):
            assert http_raw(port, path, {"Host": host})[0] == 421, (host, path)
        # The DNS-rebinding pair: the page's own name as Host and Origin, both foreign.
        status, body = http_raw(port, "/v1/realtime", {"Host": host, "Origin": f"http://{host}"}, upgrade=True)
        assert status == 421, host
        assert json.loads(body)["error"]["code"] == "host"
    for host in (f"127.0.0.1:{port}", f"localhost:{port}", "LOCALHOST", f"[::1]:{port}", "127.0.0.1", "localhost."):
        assert http_raw(port, "/healthz", {"Host": host})[0] == 200, host
        assert http_raw(port, "/v1/realtime", {"Host": host}, upgrade=True)[0] == 101, host
    assert _metric(server, 'voicechat_sessions_refused_total{reason="host"}') >= 8


def test_every_route_of_the_app_is_guarded(make_server):
    """Whatever routes (and protocol dialects) the app has, the middleware guards each one the same way."""
    from starlette.routing import Route, WebSocketRoute

    srv = make_server(api_key="s3cret")
    port = srv.port
    ws_paths = [r.path for r in srv.app.routes if isinstance(r, WebSocketRoute)]
    http_paths = [r.path for r in srv.app.routes if isinstance(r, Route)]
    assert "/v1/realtime" in ws_paths and "/healthz" in http_paths
    key = {"Authorization": "Bearer s3cret"}
    for path in ws_paths:
        up = lambda path=path, **h: http_raw(port, path, h, upgrade=True)[0]  # noqa: E731
        assert up(Host="evil.example", **key) == 421, path
        assert up(Host=f"127.0.0.1:{port}", Origin="https://evil.example", **key) == 403, path
        assert up(Host=f"127.0.0.1:{port}", Origin="null", **key) == 403, path
        assert up(Host=f"127.0.0.1:{port}") == 401, path
        assert up(Host=f"127.0.0.1:{port}", **key) == 101, path
    for path in http_paths:
        assert http_raw(port, path, {"Host": "evil.example"})[0] == 421, path


def test_allow_host_adds_a_name(make_server):
    srv = make_server(hosts=("voice.lan",))
    assert http_raw(srv.port, "/healthz", {"Host": f"voice.lan:{srv.port}"})[0] == 200
    assert http_raw(srv.port, "/healthz", {"Host": "Voice.LAN"})[0] == 200
    assert http_raw(srv.port, "/healthz", {"Host": "other.lan"})[0] == 421
    from voicechat.server.security import ServerSecurity

    with pytest.raises(ValueError, match="not a host name"):
        ServerSecurity(allowed_hosts=("voice.lan:80",))
    with pytest.raises(ValueError, match="not an origin"):
        ServerSecurity(allowed_origins=("app.example",))


def test_origin_normalised_and_null_refused(make_server):
    srv = make_server(origins=("https://app.example",))
    port = srv.port
    own = {"Host": f"127.0.0.1:{port}"}
    cases = [
        ("https://app.example", 101),
        ("HTTPS://APP.EXAMPLE:443", 101),
        ("https://app.example.", 101),
        ("https://app.example:8443", 403),
        ("http://app.example", 403),
        ("https://app.example/x", 403),
        ("https://app.example.evil", 403),
        ("null", 403),
        ("NULL", 403),
        ("", 403),
        ("file://", 403),
        (f"http://127.0.0.1:{port}", 101),
        ("http://127.0.0.1", 403),
        (f"https://127.0.0.1:{port}", 403),
        (f"http://localhost:{port}", 403),  # another name than the Host the browser connected to
        ("https://user@app.example", 403),
    ]
    for origin, want in cases:
        assert http_raw(port, "/v1/realtime", {**own, "Origin": origin}, upgrade=True)[0] == want, origin
    assert (
        http_raw(
            port, "/v1/realtime", {"Host": f"localhost:{port}", "Origin": f"http://localhost:{port}"}, upgrade=True
        )[0]
        == 101
    )
    anyo = make_server(origins=("*",))
    assert (
        http_raw(
            anyo.port, "/v1/realtime", {"Host": f"127.0.0.1:{anyo.port}", "Origin": "https://x.example"}, upgrade=True
        )[0]
        == 101
    )
    assert (
        http_raw(anyo.port, "/v1/realtime", {"Host": f"127.0.0.1:{anyo.port}", "Origin": "null"}, upgrade=True)[0]
        == 403
    )


# -- keys


def test_key_edge_cases_at_start(capsys, tmp_path):
    from voicechat.cli.main import main
    from voicechat.server.security import check_api_key

    for bad, why in (
        ("", "empty"),
        (" key", "whitespace"),
        ("ke y", "whitespace"),
        ("key\n", "cannot send"),
        ("kéy", "cannot send"),
        ("a,b", "cannot send"),
    ):
        with pytest.raises(ValueError, match=why if why != "whitespace" else "no whitespace"):
            check_api_key(bad)
    assert check_api_key("s3cret-Key_1.~") == "s3cret-Key_1.~"
    # Refused before any model is loaded (a missing checkpoint would otherwise be the error).
    missing = str(tmp_path / "no-model")
    argv = ["serve", "-m", missing, "--port", "1"]
    assert main(argv + ["--api-key", ""]) == 2
    assert main(argv + ["--api-key", "has space"]) == 2
    assert main(argv + ["--host", "0.0.0.0"]) == 2
    assert main(argv + ["--host", "192.168.1.5"]) == 2
    assert main(argv + ["--tls-cert", str(tmp_path / "c.pem")]) == 2
    assert (
        main(
            argv
            + ["--api-key", "goodkey1", "--tls-cert", str(tmp_path / "c.pem"), "--tls-key", str(tmp_path / "k.pem")]
        )
        == 2
    )
    assert main(argv + ["--allow-origin", "app.example"]) == 2
    err = capsys.readouterr().err
    assert err.count("voicechat serve: error:") == 7
    assert "the API key is empty" in err and "--insecure" in err and "go together" in err and "does not exist" in err
    assert "no-model" not in err  # nothing loaded: the flags were refused first
    # --insecure lets a wildcard bind start without a key (here it stops at the missing checkpoint).
    assert main(argv + ["--host", "0.0.0.0", "--insecure"]) == 2
    assert "no-model" in capsys.readouterr().err


def test_key_edge_cases_live(make_server):
    srv = make_server(api_key="s3cret")
    port = srv.port
    own = {"Host": f"127.0.0.1:{port}"}

    def up(**h):
        return http_raw(port, "/v1/realtime", {**own, **h}, upgrade=True)[0]

    assert up() == 401
    assert up(Authorization="Bearer s3cret") == 101
    assert up(Authorization="bearer s3cret  ") == 101
    for auth in ("Bearer ", "Bearer s3cre", "Bearer s3cret2", "Basic czNjcmV0", "s3cret", "Bearer  "):
        assert up(Authorization=auth) == 401, auth
    assert up(**{"Sec-WebSocket-Protocol": "voicechat.bearer.s3cret"}) == 101
    for proto in ("voicechat.bearer.", "voicechat.bearer.S3CRET", "voicechat.bearer"):
        assert up(**{"Sec-WebSocket-Protocol": proto}) == 401, proto
    assert http_raw(port, "/metrics", own)[0] == 401
    assert http_raw(port, "/metrics", {**own, "Authorization": "Bearer s3cret"})[0] == 200
    status, body = http_raw(port, "/healthz", own)
    assert status == 200 and json.loads(body)["status"] == "ok"


# -- malformed and extreme JSON: every class gets its error, the session goes on


JSON_ATTACKS = [
    ("", "invalid_json"),
    ("   ", "invalid_json"),
    ("{", "invalid_json"),
    ('{"type": "session.ping"} trailing', "invalid_json"),
    ("null", "invalid_json"),
    ("123", "invalid_json"),
    ('"session.ping"', "invalid_json"),
    ("[" * 100_000, "invalid_json"),  # deep nesting (would be a RecursionError)
    ('{"type": "session.ping", "x": ' + "[" * 40 + "]" * 40 + "}", "invalid_json"),
    ('{"type": "session.ping", "x": NaN}', "invalid_json"),
    ('{"type": "session.ping", "x": Infinity}', "invalid_json"),
    ('{"type": "session.ping", "x": -Infinity}', "invalid_json"),
    ('{"type": "session.ping", "x": 1e999}', "invalid_json"),  # overflows to inf
    ('{"type": "session.ping", "x": ' + "9" * 5000 + "}", "invalid_json"),  # past int's digit limit (ValueError)
    ('{"type": "session.ping", "x": 1' + "0" * 60 + "}", "invalid_json"),
    ('{"type": "\\ud800"}', "invalid_json"),  # a lone surrogate
    ('{"\\udfff": 1, "type": "session.ping"}', "invalid_json"),
    ('{"type": 5}', "invalid_message"),
    ('{"type": ["session.ping"]}', "invalid_message"),
    ('{"type": null}', "invalid_message"),
    ('{"type": "' + "x" * 10_000 + '"}', "unknown_type"),
    ('{"type": "\\u0000\\u001b[31m"}', "unknown_type"),
]


def test_malformed_and_extreme_json_every_class(server, question_wav, tiny_model):
    pcm = to_pcm16(question_wav[: 3 * 1280])

    async def go():
        async with Raw(server.url) as c:
            await c.configure()
            for text, code in JSON_ATTACKS:
                await c.send(text)
                e = await c.recv(10)
                _assert_short_error(e, code)
                assert "x" * 50 not in e["error"]["message"] and "\x1b" not in e["error"]["message"]
            assert await c.ping_ok()
            await c.send(append_msg(pcm))
            await c.send({"type": "input_audio_buffer.commit"})
            return await c.closed()

    code, events = run(go())
    assert code == 1000 and events[-1]["type"] == "response.done" and events[-1]["frame_index"] == 3
    assert not [e for e in events if e["type"] == "error"]
    assert wait_released(server)


def test_size_is_counted_in_bytes_before_decoding(make_server):
    srv = make_server(max_message_bytes=20_000)

    async def go():
        async with Raw(srv.url) as c:
            await c.configure()
            # 12 000 characters, 24 000 UTF-8 bytes: over the limit in bytes though not in characters.
            await c.send(json.dumps({"type": "session.ping", "pad": "é" * 12_000}, ensure_ascii=False))
            e = await c.recv()
            _assert_short_error(e, "message_too_large")
            assert "24" in e["error"]["message"] and "20000" in e["error"]["message"]
            assert await c.ping_ok()

    run(go())


def test_invalid_utf8_text_frame_closes_1007_and_frees_the_slot(server):
    ws = RawSocketWS(server.port)
    assert ws.recv_frame()[0] == 1  # session.created
    t0 = time.monotonic()
    ws.send_frame(b'{"type": "session.ping", "x": "\xff\xfe"}')
    code, _ = ws.read_until_close(10)
    ws.close()
    assert code == 1007
    assert wait_released(server, 5)
    assert time.monotonic() - t0 < 5

    async def again():
        async with Raw(server.url) as c:
            await c.configure()
            return await c.ping_ok()

    assert run(again())


def test_a_handler_bug_does_not_kill_the_reader(server, monkeypatch, caplog):
    import voicechat.server.protocol as P

    real = P.decode_append
    calls = []

    def broken(msg):
        calls.append(1)
        if len(calls) == 1:
            raise KeyError("a bug")
        return real(msg)

    monkeypatch.setattr(P, "decode_append", broken)

    async def go():
        async with Raw(server.url) as c:
            await c.configure()
            await c.send(append_msg(np.zeros(1280, np.int16)))
            e = await c.recv()
            _assert_short_error(e, "internal_error")
            assert "KeyError" not in e["error"]["message"] and "a bug" not in e["error"]["message"]
            await c.send(append_msg(np.zeros(1280, np.int16)))
            await c.send({"type": "input_audio_buffer.commit", "pad_partial": False})
            return await c.closed()

    with caplog.at_level(logging.ERROR, logger="voicechat.server"):
        code, events = run(go())
    assert code == 1000 and events[-1]["type"] == "response.done" and events[-1]["frame_index"] == 1
    assert any("KeyError" in (r.exc_text or "") or r.exc_info for r in caplog.records)


# -- out-of-range fields of every numeric setting (and their neighbours)


SESSION_ATTACKS = [
    ({"seed": -1}, "session.seed", "0 to 9223372036854775807"),
    ({"seed": 2**63}, "session.seed", "0 to"),
    ({"seed": 1.5}, "session.seed", "integer"),
    ({"seed": 1e30}, "session.seed", "integer"),
    ({"seed": "1"}, "session.seed", "integer"),
    ({"seed": True}, "session.seed", "integer"),
    ({"seed": None}, "session.seed", "integer"),
    ({"seed": 10**30}, "session.seed", "integer"),
    ({"max_streaming_seconds": 0}, "session.max_streaming_seconds", "above 0"),
    ({"max_streaming_seconds": -1}, "session.max_streaming_seconds", "above 0"),
    ({"max_streaming_seconds": 1e308}, "session.max_streaming_seconds", "at most 600"),
    ({"max_streaming_seconds": 600.5}, "session.max_streaming_seconds", "at most 600"),
    ({"max_streaming_seconds": "10"}, "session.max_streaming_seconds", "number"),
    ({"max_streaming_seconds": True}, "session.max_streaming_seconds", "number"),
    ({"system_prompt": 5}, "session.system_prompt", "string"),
    ({"system_prompt": ["a"]}, "session.system_prompt", "string"),
    ({"system_prompt": "x" * 100_001}, "session.system_prompt", "100000 characters"),
    ({"instructions": {"a": 1}}, "session.instructions", "string"),
    ({"model": 7}, "session.model", "string"),
]


def test_out_of_range_session_fields(server):
    async def go():
        async with Raw(server.url) as c:
            await c.recv()
            for fields, name, allowed in SESSION_ATTACKS:
                await c.send({"type": "session.update", "session": fields})
                e = await c.recv(10)
                _assert_short_error(e, "invalid_session")
                assert name in e["error"]["message"] and allowed in e["error"]["message"], (fields, e)
            for s in (5, "x", [1]):
                await c.send({"type": "session.update", "session": s})
                _assert_short_error(await c.recv(), "invalid_session")
            # The largest accepted values are accepted.
            await c.send({"type": "session.update", "session": {"seed": 2**63 - 1, "max_streaming_seconds": 600}})
            upd = await c.recv()
            assert upd["type"] == "session.updated" and upd["session"]["seed"] == 2**63 - 1

    run(go())
    assert wait_released(server)


APPEND_ATTACKS = [
    ({"sample_rate": 0}, "invalid_sample_rate"),
    ({"sample_rate": -16000}, "invalid_sample_rate"),
    ({"sample_rate": 16000.5}, "invalid_sample_rate"),
    ({"sample_rate": 1e308}, "invalid_sample_rate"),
    ({"sample_rate": "16000"}, "invalid_sample_rate"),
    ({"sample_rate": None}, "invalid_sample_rate"),
    ({"sample_rate": True}, "invalid_sample_rate"),
    ({"audio": None}, "invalid_audio"),
    ({"audio": ["AAAA"]}, "invalid_audio"),
    ({"audio": "A"}, "invalid_audio"),
    ({"audio": "AA=="}, "invalid_audio"),
]


def test_out_of_range_append_and_commit_fields(server):
    async def go():
        async with Raw(server.url) as c:
            await c.configure()
            for fields, code in APPEND_ATTACKS:
                await c.send({"type": "input_audio_buffer.append", "audio": "AAAA", "sample_rate": 16000, **fields})
                _assert_short_error(await c.recv(), code)
            for pad in (1, 0, "true", None, [], 2.5):
                await c.send({"type": "input_audio_buffer.commit", "pad_partial": pad})
                e = await c.recv()
                _assert_short_error(e, "invalid_message")
                assert "pad_partial" in e["error"]["message"]
            await c.send(append_msg(np.zeros(1280, np.int16)))
            await c.send({"type": "input_audio_buffer.commit"})
            return await c.closed()

    code, events = run(go())
    assert code == 1000 and events[-1]["type"] == "response.done" and events[-1]["frame_index"] == 1


# -- prompts: bounded in tokens, refused before work


def test_huge_prompt_is_refused_at_once_and_the_next_client_works(server, tiny_model):
    huge = " ".join(["hello world"] * 2000)  # ~16 000 tokens, 4x the tiny model's context
    n = len(tiny_model.tokenizer.encode(huge)) + 2
    limit = server.state.limits.max_prompt_tokens

    async def go():
        async with Raw(server.url) as c:
            await c.recv()
            t0 = time.monotonic()
            await c.send({"type": "session.update", "session": {"system_prompt": huge}})
            e = await c.recv(10)
            refused_after = time.monotonic() - t0
            _assert_short_error(e, "invalid_session")
            assert f"{n} tokens" in e["error"]["message"] and f"at most {limit}" in e["error"]["message"]
            await c.send({"type": "session.update", "session": {"system_prompt": "Be brief."}})
            assert (await c.recv())["type"] == "session.updated"  # the same connection goes on
        assert wait_released(server)
        async with Raw(server.url) as c:
            await c.configure()
        return refused_after

    refused_after = run(go())
    assert refused_after < 1.0, refused_after  # no prefill ran
    print(f"prompt of {n} tokens refused in {refused_after * 1000:.0f} ms")


def test_disconnect_mid_prefill_frees_the_slot_in_bounded_time(make_server, tiny_model):
    """A prompt the tiny model prefills in ~15 s; the client leaves at once: the prefill stops at its next piece."""
    srv = make_server(max_prompt_tokens=4000)
    prompt = " ".join(["hello world"] * 450)  # ~3600 tokens
    n = len(tiny_model.tokenizer.encode(prompt)) + 2
    assert 3000 < n <= 4000
    frames_before = _metric(srv, "voicechat_frames_total")

    async def go():
        async with Raw(srv.url) as c:
            await c.recv()
            await c.send({"type": "session.update", "session": {"system_prompt": prompt}})
            await c.send(append_msg(np.zeros(16000, np.int16)))  # 1 s of audio, queued behind the prefill
            await asyncio.sleep(0.5)
            assert srv.state.active_session is not None  # prefilling
        return time.monotonic()

    gone = run(go())
    assert wait_released(srv, 30)
    freed_after = time.monotonic() - gone
    # One piece of PREFILL_PIECE positions (~0.15 s on the tiny model) and the session's close.
    assert freed_after < 2.0, freed_after
    assert _metric(srv, "voicechat_frames_total") == frames_before  # none of its audio was computed
    print(f"prefill of {n} tokens: slot freed {freed_after:.2f} s after the client left")

    async def again():
        async with Raw(srv.url) as c:
            await c.configure()

    run(again())


# -- backpressure: nothing refused, nothing lost


def test_append_larger_than_the_queue_bound_is_accepted(make_server, long_question_wav):
    srv = make_server(max_queued_audio_seconds=0.25)
    pcm = to_pcm16(long_question_wav[: 3 * 16000])  # 3 s in one append: 12x the bound

    async def go():
        async with Raw(srv.url) as c:
            await c.configure()
            await c.send(append_msg(pcm))
            await c.send(append_msg(pcm[:1000]))  # waits (backpressure) until the big one is computed
            await c.send({"type": "input_audio_buffer.commit"})
            return await c.closed(60)

    code, events = run(go())
    assert code == 1000 and not [e for e in events if e["type"] == "error"]
    frames = [e for e in events if e["type"] == "response.audio.delta"]
    assert events[-1]["type"] == "response.done" and len(frames) == -(-(pcm.size + 1000) // 1280) == 39
    print(f"append of {pcm.size} samples (12x the bound) + 1000: {len(frames)} frames, no error")


def test_voicechat_client_with_a_large_chunk_gets_everything(server, long_question_wav, tmp_path):
    import soundfile as sf

    from voicechat.cli.main import main

    audio = long_question_wav[: 8 * 16000]
    wav = tmp_path / "in.wav"
    sf.write(str(wav), audio, 16000, subtype="PCM_16")
    out = tmp_path / "out.wav"
    # 7 s chunks: larger than the 5 s queue bound.
    rc = main(
        [
            "client",
            "--url",
            server.url,
            "--audio",
            str(wav),
            "--fast",
            "--chunk-ms",
            "7000",
            "--output-audio",
            str(out),
            "--events",
            str(tmp_path / "ev.jsonl"),
        ]
    )
    events = [json.loads(x) for x in (tmp_path / "ev.jsonl").read_text().splitlines()]
    assert rc == 0 and not [e for e in events if e["type"] == "error"]
    assert len([e for e in events if e["type"] == "response.audio.delta"]) == -(-audio.size // 1280)


def test_voicechat_client_splits_a_chunk_larger_than_the_message_limit(make_server, long_question_wav):
    from voicechat.server.client import run_stream_audio

    srv = make_server(max_message_bytes=20_000)  # ~7 500 samples an append
    pcm = to_pcm16(long_question_wav[: 3 * 16000])
    r = run_stream_audio(srv.url, pcm, fast=True, chunk_samples=pcm.size)  # one 3 s chunk asked
    assert r.end == "response.done" and not r.errors and r.frames == -(-pcm.size // 1280)


def test_voicechat_client_exits_nonzero_on_an_error_event(make_server, question_wav, tmp_path, capsys):
    from voicechat.cli.main import main
    from voicechat.samples import sample_path

    srv = make_server(max_session_audio_seconds=1.0)  # question.wav is longer: some appends are refused
    rc = main(
        [
            "client",
            "--url",
            srv.url,
            "--audio",
            str(sample_path("question")),
            "--fast",
            "--events",
            str(tmp_path / "ev.jsonl"),
        ]
    )
    events = [json.loads(x) for x in (tmp_path / "ev.jsonl").read_text().splitlines()]
    assert events[-1]["type"] == "response.done"  # the session ended normally...
    assert next(e["error"]["code"] for e in events if e["type"] == "error") == "session_audio_limit"
    assert rc == 1  # ...but audio was refused: not a success


# -- slow readers: bounded outbox, send deadline, slot freed


def _stall(srv, seconds_of_audio: float) -> float:
    """A client with a 4 KiB receive buffer that configures, sends audio, and never reads. -> when it stopped.
    The server's socket send buffer is made small too (accepted sockets inherit the listener's), so the
    buffers between the two fill after a few frames instead of Linux's autotuned megabytes."""
    import socket

    srv.sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 8192)
    ws = RawSocketWS(srv.port, rcvbuf=4096)
    ws.send_json({"type": "session.update"})
    pcm = np.zeros(int(seconds_of_audio * 16000), np.int16)
    for i in range(0, pcm.size, 16000):
        try:
            ws.send_frame(append_msg(pcm[i : i + 16000]).encode())
        except OSError:  # the server already dropped us
            break
    return ws, time.monotonic()


def test_client_that_stops_reading_is_disconnected_by_the_send_deadline(make_server):
    srv = make_server(send_timeout=1.0, max_outbound_events=100_000)
    ws, t0 = _stall(srv, 60.0)
    try:
        assert wait_released(srv, 30)
        freed_after = time.monotonic() - t0
        code, _ = ws.read_until_close(5)
    finally:
        ws.close()
    # Computing the backlog (~1-3 s on the tiny model) until the buffers fill, then the 1 s deadline.
    assert freed_after < 15.0, freed_after
    assert _metric(srv, 'voicechat_sessions_errored_total{reason="slow_consumer"}') == 1
    assert code in (1008, None)  # 1008 when the close frame got through the full buffers; else a dropped socket
    print(f"stopped reading: slot freed {freed_after:.2f} s after the client stopped sending; close {code}")

    async def again():
        async with Raw(srv.url) as c:
            await c.configure()
            return await c.ping_ok()

    assert run(again())


def test_outbound_queue_is_bounded(make_server):
    srv = make_server(send_timeout=60.0, max_outbound_events=40)
    ws, t0 = _stall(srv, 60.0)
    try:
        assert wait_released(srv, 30)
        freed_after = time.monotonic() - t0
    finally:
        ws.close()
    assert freed_after < 15.0, freed_after  # long before the 60 s send deadline
    print(f"outbox bound 40: slot freed {freed_after:.2f} s after the client stopped sending")
    assert _metric(srv, 'voicechat_sessions_errored_total{reason="slow_consumer"}') == 1


# -- faults: a worker exception mid-frame; the wall-clock cap


def test_worker_exception_mid_frame_ends_the_session_with_1011(tiny_ckpt, question_wav, caplog):
    failing = {"on": True}
    pcm = to_pcm16(question_wav[: 8 * 1280])
    with WrappedServer(tiny_ckpt, lambda kw: failing_frame(3) if failing["on"] else None) as w:
        srv, metrics = w.srv, w.metrics

        async def go():
            async with Raw(srv.url) as c:
                await c.configure()
                await c.send(append_msg(pcm))
                return await c.closed(30)

        with caplog.at_level(logging.ERROR, logger="voicechat.server"):
            t0 = time.monotonic()
            code, events = run(go())
            assert wait_released(srv, 10)
            freed_after = time.monotonic() - t0
        frames = [e["frame_index"] for e in events if e["type"] == "response.audio.delta"]
        assert frames == [0, 1, 2]
        err = events[-1]
        _assert_short_error(err, "internal_error")
        assert "secret" not in err["error"]["message"] and "RuntimeError" not in err["error"]["message"]
        assert code == 1011 and freed_after < 5.0
        print(f"worker fault at frame 3: frames {frames}, close {code}, slot freed {freed_after:.2f} s after start")
        assert any(r.exc_info and "injected fault" in str(r.exc_info[1]) for r in caplog.records)
        # The next session works.
        failing["on"] = False
        r_events = run(_full_session(srv.url, pcm))
        assert r_events[-1]["type"] == "response.done" and r_events[-1]["frame_index"] == 8
        assert metrics.sessions_errored.labels(reason="internal_error")._value.get() == 1


async def _full_session(url, pcm):
    async with Raw(url) as c:
        await c.configure()
        await c.send(append_msg(pcm))
        await c.send({"type": "input_audio_buffer.commit"})
        _, events = await c.closed(30)
        return events


def test_wall_clock_cap_per_session(make_server):
    srv = make_server(max_session_seconds=1.0, idle_timeout=5.0)

    async def go():
        async with Raw(srv.url) as c:
            await c.configure()
            t0 = time.monotonic()
            for _ in range(30):  # a steady trickle: never idle
                try:
                    await c.send(append_msg(np.zeros(320, np.int16)))
                except Exception:
                    break
                await asyncio.sleep(0.1)
            code, events = await c.closed(5)
            return code, events, time.monotonic() - t0

    code, events, took = run(go())
    assert code == 1008 and events[-1]["error"]["code"] == "session_time_limit"
    assert "--max-session-seconds" in events[-1]["error"]["message"]
    assert 0.8 <= took < 3.0, took  # the cap counts from connecting; t0 is after session.updated
    print(f"wall-clock cap 1 s: session_time_limit, close {code} after {took:.2f} s")
    assert wait_released(srv, 5)


def test_healthz_says_busy_during_a_session(server):
    async def go():
        async with Raw(server.url) as c:
            await c.recv()
            return json.loads(urllib.request.urlopen(server.http + "/healthz").read())

    busy = run(go())
    assert busy["status"] == "busy" and busy["active_sessions"] == busy["max_sessions"] == 1
    assert wait_released(server)
    idle = json.loads(urllib.request.urlopen(server.http + "/healthz").read())
    assert idle["status"] == "ok" and idle["active_sessions"] == 0


# -- SIGTERM during a session (the real command)


@pytest.mark.parametrize("signame", ["SIGTERM", "SIGINT"])
def test_signal_during_a_session_closes_1001_and_exits_0(signame, tiny_ckpt, long_question_wav, tmp_path):
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
            "0",
            "--shutdown-timeout",
            "3",
        ],
        f"http://127.0.0.1:{port}/healthz",
        log,
        timeout=120,
    )
    pcm = to_pcm16(long_question_wav)
    try:

        async def go():
            async with Raw(f"ws://127.0.0.1:{port}/v1/realtime") as c:
                await c.configure()
                for i in range(0, 6 * 1280, 1280):  # real time
                    await c.send(append_msg(pcm[i : i + 1280]))
                    await asyncio.sleep(0.08)
                await c.until("response.audio.delta")
                t0 = time.monotonic()
                p.send_signal(getattr(signal, signame))
                code, events = await c.closed(10)
                return code, events, t0

        code, events, t0 = run(go())
        rc = p.wait(15)
        exit_after = time.monotonic() - t0
    finally:
        if p.poll() is None:
            p.kill()
            p.wait(5)
    assert code == 1001 and events[-1]["type"] == "error" and events[-1]["error"]["code"] == "server_shutdown"
    assert rc == 0, log.read_text()[-2000:]
    assert exit_after < 8.0, exit_after
    print(f"{signame}: close {code}, exit {rc} after {exit_after:.2f} s")
    assert '"end": "shutdown"' in log.read_text()


# -- input_overflow: only what truly cannot be held, and it says how much


def test_input_overflow_only_when_the_model_makes_no_room(tiny_ckpt):
    """A model at ~1/4 real time and a 0.3 s backpressure wait: appends that found no room are dropped, each
    error says how many samples; every other sample is computed (in = computed + dropped)."""
    from voicechat.server.limits import ServerLimits

    limits = ServerLimits(max_queued_audio_seconds=0.16, backpressure_timeout=0.3)
    with WrappedServer(tiny_ckpt, lambda kw: slow_frames(0.3), limits) as w:

        async def go():
            async with Raw(w.srv.url) as c:
                await c.configure()
                for _ in range(8):
                    await c.send(append_msg(np.zeros(1280, np.int16)))
                await c.send({"type": "input_audio_buffer.commit", "pad_partial": False})
                return await c.closed(30)

        code, events = run(go())
    errors = [e["error"] for e in events if e["type"] == "error"]
    assert errors and {e["code"] for e in errors} == {"input_overflow"}
    dropped = 0
    for e in errors:
        dropped += 1280
        assert "1280 samples (0.080 s) was dropped" in e["message"] and f"{dropped} samples dropped" in e["message"]
    frames = [e for e in events if e["type"] == "response.audio.delta"]
    assert code == 1000 and events[-1]["type"] == "response.done"
    assert len(frames) * 1280 + dropped == 8 * 1280
    print(f"input_overflow: {len(errors)} appends dropped ({dropped} samples), {len(frames)} frames computed")


def test_tls(tiny_ckpt, tmp_path):
    import shutil
    import ssl
    import subprocess

    from voicechat.server.runner import ServerThread, make_state

    if shutil.which("openssl") is None:
        pytest.skip("needs the openssl command to make a self-signed certificate")
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run(
        [
            "openssl",
            "req",
            "-x509",
            "-newkey",
            "rsa:2048",
            "-nodes",
            "-days",
            "1",
            "-subj",
            "/CN=127.0.0.1",
            "-addext",
            "subjectAltName=IP:127.0.0.1",
            "-keyout",
            str(key),
            "-out",
            str(cert),
        ],
        check=True,
        capture_output=True,
        timeout=60,
    )
    state = make_state(str(tiny_ckpt), warmup_seconds=0.0)
    srv = ServerThread(state, tls_cert=str(cert), tls_key=str(key)).start()
    try:
        ctx = ssl.create_default_context(cafile=str(cert))
        assert srv.url.startswith("wss://")

        async def go():
            async with Raw(srv.url, ssl=ctx) as c:
                await c.configure()
                return await c.ping_ok()

        assert run(go())
        # The slot frees once the worker has closed the session, a moment after the client's close.
        assert wait_released(srv)
        assert json.loads(urllib.request.urlopen(srv.http + "/healthz", context=ctx).read())["status"] == "ok"
    finally:
        srv.stop()
        state.worker.stop()


@pytest.mark.parametrize("numerics", ["reference", "float32"])
def test_stoppable_prefill_is_bit_identical_and_stops(numerics, tiny_ckpt, tiny_model, question_wav):
    """The server asks the prefill to stop between pieces: the pieces compute the same bits as one go."""
    import mlx.core as mx

    import voicechat
    from voicechat.errors import PrefillStoppedError
    from voicechat.streaming.timeline import PREFILL_PIECE

    model = tiny_model if numerics == "reference" else voicechat.load(tiny_ckpt, numerics=numerics)
    prompt = " ".join(["hello world"] * 12)  # ~100 tokens: several pieces
    assert len(model.tokenizer.encode(prompt)) > 2 * PREFILL_PIECE
    asked = []
    a = model.create_streaming_session(system_prompt=prompt, seed=1)
    b = model.create_streaming_session(system_prompt=prompt, seed=1, should_stop=lambda: asked.append(1) and False)
    assert len(asked) >= 3
    sa, sb = a.states(), b.states()
    assert sa.keys() == sb.keys()
    for k in sa:
        assert mx.array_equal(sa[k], sb[k]).item(), k
    pcm = question_wav[: 4 * 1280]
    ea, eb = a.push_audio(pcm), b.push_audio(pcm)
    assert [np.asarray(e.audio_codes).tolist() for e in ea if e.kind == "audio"] == [
        np.asarray(e.audio_codes).tolist() for e in eb if e.kind == "audio"
    ]
    calls = []
    with pytest.raises(PrefillStoppedError):
        model.create_streaming_session(system_prompt=prompt, should_stop=lambda: calls.append(1) or len(calls) >= 2)
    assert len(calls) == 2
