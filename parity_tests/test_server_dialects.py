"""The OpenAI dialects of `voicechat serve` (docs/server.md, "Dialects"), driven by the real openai SDK.

`client.realtime.connect()` (Realtime GA on /v1/realtime) and `client.live.connect()` (Live on
/v1/live/sessions) against `voicechat serve` processes on 127.0.0.1: every server event is
validated against the SDK's own pydantic schema (required fields), the framing order is checked,
and the audio equals the in-process session's output for the same input after the documented
resampling. soxr's stream equals its one-shot resampling of the whole signal whatever the
chunking, so the comparison is exact (0 PCM16 steps): the server and the reference compute the
same float samples and round them the same way.

The audio comparisons use the `small` preset (the real frame geometry: 1764 output samples a
frame; the tiny preset's 24-sample frames stay inside soxr's block latency until the end).
"""

from __future__ import annotations

import asyncio
import json
import signal
import sys

import numpy as np
import pytest
import soxr

from parity_tests.conftest import TIME_TOOL, TOOLCALL_ARGUMENTS, TOOLCALL_TOOL

from .server_util import FRAME, Raw, b64, pcm16, run, unb64, wait_released

openai = pytest.importorskip("openai")


def ga_validate(raw: dict):
    from openai.types.realtime import RealtimeServerEvent
    from pydantic import TypeAdapter

    return TypeAdapter(RealtimeServerEvent).validate_python(raw)


def live_validate(raw: dict):
    from openai.types.live import ServerEvent
    from pydantic import TypeAdapter

    return TypeAdapter(ServerEvent).validate_python(raw)


def serve(ckpt, tmp_path, *extra):
    from voicechat.server.compare import free_port, start_process

    port = free_port()
    p = start_process(
        [
            sys.executable,
            "-m",
            "voicechat.cli",
            "serve",
            "-m",
            str(ckpt),
            "--port",
            str(port),
            "--warmup-seconds",
            "0",
            "--log-level",
            "warning",
            *extra,
        ],
        f"http://127.0.0.1:{port}/healthz",
        tmp_path / f"serve_{port}.log",
        timeout=180,
    )
    return p, port


def stop(p) -> None:
    p.send_signal(signal.SIGINT)
    try:
        p.wait(30)
    except Exception:
        p.kill()


def sdk(port, api_key="unused"):
    return openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key=api_key)


async def recv_raw(conn, timeout=60.0) -> dict:
    return json.loads(await asyncio.wait_for(conn.recv_bytes(), timeout))


# -- the reference: the in-process session on the same input, resampled as documented


def reference(model, pcm_in: np.ndarray, in_rate: int, *, close: bool):
    """(events, 16 kHz float input) the server's session sees for PCM16 `pcm_in` at `in_rate`.
    GA never ends its stream (the resampler keeps its last samples); Live's close flushes it and pads."""
    from voicechat.server.resample import StreamResampler

    x = pcm_in.astype(np.float32) / 32768.0
    r = StreamResampler(in_rate, 16000)
    x16 = np.concatenate([r.push(x), r.flush()]) if close else r.push(x)
    s = model.create_streaming_session()
    events = s.push_audio(x16)
    if close:
        events += s.flush()
    return events, x16


def frames_audio(events) -> np.ndarray:
    return np.concatenate([e.samples for e in events if e.kind in ("audio", "audio_tail")]).astype(np.float32)


@pytest.fixture(scope="module")
def small_model_ckpt(tmp_path_factory):
    import voicechat
    from voicechat.synthetic.checkpoint import write_checkpoint

    path = write_checkpoint(tmp_path_factory.mktemp("small"), "small")
    return path, voicechat.load(path)


@pytest.fixture(scope="module")
def small_server(small_model_ckpt, tmp_path_factory):
    # --silence-frames 10000: one response from the first non-silent frame on, so its audio is contiguous.
    p, port = serve(small_model_ckpt[0], tmp_path_factory.mktemp("srv"), "--silence-frames", "10000")
    yield port
    stop(p)


def _port(srv):
    return srv.port


# -- Realtime GA through client.realtime.connect()


def test_ga_sdk_session_audio_and_events_equal_in_process(small_server, small_model_ckpt, question_wav):
    model = small_model_ckpt[1]
    pcm24 = pcm16(soxr.resample(question_wav, 16000, 24000))  # the sample as a 24 kHz client sends it
    events, x16 = reference(model, pcm24, 24000, close=False)
    frames = [e for e in events if e.kind == "audio"]
    from voicechat.server.dialects.common import DialectOptions
    from voicechat.server.dialects.ga import GaMapper

    m = GaMapper(
        model_rate=22050,
        client_rate=24000,
        silence_codes=np.asarray(model.tts_model.codec_silence_tokens),
        options=DialectOptions(),
    )
    # The response opens at the model's first non-silent frame (frame 0 carries the codec's silence codes).
    k0 = next(i for i, e in enumerate(frames) if not m._silent(e))
    assert k0 < 3 and all(not m._silent(e) for e in frames[k0:]), "precondition: the small model speaks on"
    from voicechat.server.resample import StreamResampler

    out = StreamResampler(22050, 24000)
    sizes = [out.push(e.samples).size for e in frames]  # what the stream emits at each frame
    offset, expected_n = sum(sizes[:k0]), sum(sizes[k0:])
    expected = pcm16(soxr.resample(frames_audio(frames), 22050, 24000))[offset : offset + expected_n]
    user_text = "".join(e.delta for e in events if e.kind == "user_transcript_delta")
    text = "".join(e.delta for e in events if e.kind == "assistant_text_delta")  # pending text joins the response
    # 24 kHz read as 16 kHz would be another input: the reference is sensitive to it.
    wrong = model.create_streaming_session().push_audio(pcm24[: x16.size].astype(np.float32) / 32768.0)
    assert [e.delta for e in wrong if e.kind == "assistant_text_delta"] != [
        e.delta for e in events if e.kind == "assistant_text_delta"
    ]

    async def go():
        seen = []
        async with sdk(small_server).realtime.connect(model="gpt-realtime") as conn:
            seen.append(await recv_raw(conn))
            await conn.session.update(
                session={
                    "type": "realtime",
                    "instructions": None or "",
                    "audio": {
                        "input": {"format": {"type": "audio/pcm", "rate": 24000}},
                        "output": {"format": {"type": "audio/pcm", "rate": 24000}},
                    },
                }
            )
            seen.append(await recv_raw(conn))
            for i in range(0, pcm24.size, 960):  # 40 ms appends
                await conn.input_audio_buffer.append(audio=b64(pcm24[i : i + 960]))
            got = 0
            while got < expected_n:  # the last frame's audio comes after its transcript deltas
                e = await recv_raw(conn, 120)
                seen.append(e)
                if e["type"] == "response.output_audio.delta":
                    got += unb64(e["delta"]).size
        return seen

    seen = run(go())
    for e in seen:
        ga_validate(e)  # every required field of the GA schema, nested
        assert isinstance(e["event_id"], str) and e["event_id"]
    types = [e["type"] for e in seen]
    assert types[:2] == ["session.created", "session.updated"], types[:5]
    s = seen[0]["session"]
    assert s["type"] == "realtime" and s["audio"]["input"]["format"] == {"type": "audio/pcm", "rate": 24000}
    assert "/" not in s["model"] and s["model"]  # a name, not the checkpoint's path
    assert "error" not in types, [e for e in seen if e["type"] == "error"]
    assert "response.created" in types, json.dumps([{k: v for k, v in e.items() if k != "delta"} for e in seen])[:3000]
    # One response, in GA's framing order.
    order = [
        "response.created",
        "response.output_item.added",
        "conversation.item.added",
        "response.content_part.added",
        "response.output_audio.delta",
    ]
    first = [types.index(t, types.index("response.created")) for t in order]
    assert first == sorted(first), first
    rid = seen[types.index("response.created")]["response"]["id"]
    item = seen[types.index("response.output_item.added")]["item"]
    assert item["type"] == "message" and item["role"] == "assistant"
    deltas = [e for e in seen if e["type"] == "response.output_audio.delta"]
    assert all(
        d["response_id"] == rid and d["item_id"] == item["id"] and d["output_index"] == 0 and d["content_index"] == 0
        for d in deltas
    )
    audio = np.concatenate([unb64(d["delta"]) for d in deltas])
    # Duration at the negotiated rate: the frames' 80 ms each, less soxr's held-back samples (< 1 frame).
    assert audio.size == expected_n and 0 <= (len(frames) - k0) * 1920 - audio.size < 1920
    assert np.array_equal(audio, expected), np.abs(audio.astype(int) - expected).max()
    got_text = "".join(e["delta"] for e in seen if e["type"] == "response.output_audio_transcript.delta")
    assert got_text == text
    got_user = "".join(e["delta"] for e in seen if e["type"] == "conversation.item.input_audio_transcription.delta")
    assert got_user == user_text


# -- Live through client.live.connect()


def test_live_sdk_session_audio_and_transcripts_equal_in_process(small_server, small_model_ckpt, question_wav):
    model = small_model_ckpt[1]
    pcm24 = pcm16(soxr.resample(question_wav, 16000, 24000))
    events, _ = reference(model, pcm24, 24000, close=True)
    expected = pcm16(soxr.resample(frames_audio(events), 22050, 24000))
    n_frames = sum(e.kind == "audio" for e in events)

    async def go():
        seen = []
        async with sdk(small_server).live.connect() as conn:
            await conn.send(
                {
                    "type": "session.start",
                    "event_id": "start-1",
                    "session": {"model": "gpt-live-1", "audio": {"format": {"type": "audio/pcm", "rate": 24000}}},
                }
            )
            seen.append(await recv_raw(conn))
            for i in range(0, pcm24.size, 960):
                await conn.send({"type": "session.input_audio.append", "audio": b64(pcm24[i : i + 960])})
            await conn.send({"type": "session.close"})
            while seen[-1]["type"] != "session.closed":
                seen.append(await recv_raw(conn, 120))
        return seen

    seen = run(go())
    for e in seen:
        live_validate(e)
    types = [e["type"] for e in seen]
    assert types[0] == "session.started" and types[-1] == "session.closed" and "error" not in types
    st = seen[0]
    assert st["client_event_id"] == "start-1" and st["session"]["audio"]["format"]["rate"] == 24000
    assert st["session"]["model"] and "/" not in st["session"]["model"]
    audio = np.concatenate([unb64(e["delta"]) for e in seen if e["type"] == "session.output_audio.delta"])
    # Continuous: every frame plus the codec tail, at 24 kHz.
    assert audio.size == expected.size and abs(audio.size - n_frames * 1920) < 1920
    assert np.array_equal(audio, expected), np.abs(audio.astype(int) - expected).max()
    for kind, t in (
        ("user_transcript_delta", "session.input_transcript.delta"),
        ("assistant_text_delta", "session.output_transcript.delta"),
    ):
        want = [(e.delta, e.frame_index * 80, e.frame_index * 80 + 80) for e in events if e.kind == kind and e.delta]
        got = [(e["delta"], e["start_ms"], e["end_ms"]) for e in seen if e["type"] == t]
        assert got == want
    assert seen[-1]["reason"] == "close_requested" and seen[-1]["usage"]["seconds"] >= 2


# -- every standard GA client event: acknowledged, never an error


def test_every_ga_client_event_is_acknowledged_without_error(server, question_wav):
    pcm = pcm16(soxr.resample(question_wav[: 8 * FRAME], 16000, 24000))

    async def go():
        seen = []
        async with sdk(server.port).realtime.connect(model="anything-at-all") as conn:

            async def until(t):
                while True:
                    e = await recv_raw(conn)
                    seen.append(e)
                    if e["type"] == t:
                        return e

            await until("session.created")
            await conn.session.update(
                session={
                    "type": "realtime",
                    "instructions": "Be brief.",
                    "output_modalities": ["audio"],
                    "tool_choice": "auto",
                }
            )
            await until("session.updated")
            # Before any audio (no response can be open yet): the model's first stretch answers it and
            # carries its metadata (LiveKit's generate_reply waits for exactly that).
            await conn.response.create(response={"metadata": {"client_event_id": "early"}})
            for i in range(0, pcm.size, 1920):
                await conn.input_audio_buffer.append(audio=b64(pcm[i : i + 1920]))
            await conn.input_audio_buffer.commit()
            await until("response.created")
            await until("input_audio_buffer.committed")
            await conn.input_audio_buffer.clear()
            await until("input_audio_buffer.cleared")
            await conn.response.cancel()
            await conn.send({"type": "output_audio_buffer.clear"})
            await until("output_audio_buffer.cleared")
            await conn.conversation.item.create(
                item={"type": "message", "role": "user", "content": [{"type": "input_text", "text": "hi"}]}
            )
            added = await until("conversation.item.added")
            await until("conversation.item.done")
            item_id = added["item"]["id"]
            await conn.conversation.item.retrieve(item_id=item_id)
            await until("conversation.item.retrieved")
            await conn.conversation.item.truncate(item_id=item_id, content_index=0, audio_end_ms=0)
            await until("conversation.item.truncated")
            await conn.conversation.item.delete(item_id=item_id)
            await until("conversation.item.deleted")
            await conn.session.update(session={"type": "realtime"})
            await until("session.updated")
        return seen

    seen = run(go())
    assert [e for e in seen if e["type"] == "error"] == []
    for e in seen:
        ga_validate(e)
    assert seen[1]["session"]["instructions"] == "Be brief."
    first = next(e for e in seen if e["type"] == "response.created")
    assert first["response"]["metadata"] == {"client_event_id": "early"}
    assert wait_released(server)


# -- the dialect choice


def test_dialect_choice_mlx_vlm_then_ga_on_one_server(server, question_wav):
    from voicechat.server.client import run_stream_audio, to_pcm16

    r = run_stream_audio(server.url, to_pcm16(question_wav[: 4 * FRAME]), fast=True)
    assert r.end == "response.done" and r.frames == 4  # mlx-vlm's dialect, unchanged
    assert wait_released(server)

    async def go():
        out = {}
        async with sdk(server.port).realtime.connect(model="gpt-realtime") as conn:  # ?model= -> GA
            out["sdk"] = await recv_raw(conn)
        wait_released(server)
        async with Raw(server.url) as c:  # no query: mlx-vlm's session.created, then a GA session.update
            out["plain_created"] = await c.recv()
            await c.send({"type": "session.update", "session": {"type": "realtime", "instructions": "x"}})
            out["upgraded"] = await c.recv()
        wait_released(server)
        async with Raw(server.url) as c:  # no query, mlx-vlm's session.update: mlx-vlm
            await c.recv()
            await c.send({"type": "session.update", "session": {"system_prompt": "x", "model": "m"}})
            out["mlx_updated"] = await c.recv()
        wait_released(server)
        async with Raw(server.url + "?model=gpt-realtime&dialect=mlx-vlm") as c:  # forced
            out["forced"] = await c.recv()
        wait_released(server)
        async with Raw(server.url + "?dialect=openai") as c:
            out["explicit"] = await c.recv()
        return out

    out = run(go())
    assert out["sdk"]["type"] == "session.created" and out["sdk"]["session"]["type"] == "realtime"
    ga_validate(out["sdk"])
    assert out["plain_created"]["session"]["state"] == "configuring"  # mlx-vlm's
    assert out["upgraded"]["type"] == "session.updated" and out["upgraded"]["session"]["type"] == "realtime"
    ga_validate(out["upgraded"])
    assert out["mlx_updated"]["session"]["state"] == "ready" and "type" not in out["mlx_updated"]["session"]
    assert out["forced"]["session"]["state"] == "configuring"
    assert out["explicit"]["session"]["type"] == "realtime"
    assert wait_released(server)


# -- rates the server cannot serve


def test_unsupported_rates_and_formats_are_refused_clearly(server):
    async def go():
        errs = []
        async with sdk(server.port).realtime.connect(model="gpt-realtime") as conn:
            await recv_raw(conn)
            for fmt in ({"type": "audio/pcm", "rate": 16000}, {"type": "audio/pcmu"}):  # GA's pcm is 24 kHz
                await conn.send(
                    {"type": "session.update", "session": {"type": "realtime", "audio": {"input": {"format": fmt}}}}
                )
                errs.append(await recv_raw(conn))
            await conn.session.update(session={"type": "realtime"})
            errs.append(await recv_raw(conn))  # still usable, still 24 kHz
        wait_released(server)
        async with sdk(server.port).live.connect() as conn:
            await conn.send(
                {
                    "type": "session.start",
                    "session": {"model": "gpt-live-1", "audio": {"format": {"type": "audio/pcm", "rate": 48000}}},
                }
            )
            errs.append(await recv_raw(conn))
        return errs

    rate, ulaw, ok, live = run(go())
    for e in (rate, ulaw):
        ga_validate(e)
    assert (
        rate["error"]["code"] == "invalid_sample_rate"
        and "16000" in rate["error"]["message"]
        and "24000" in rate["error"]["message"]
        and rate["error"]["type"] == "invalid_request_error"
    )
    assert ulaw["error"]["code"] == "unsupported_audio_format" and "audio/pcmu" in ulaw["error"]["message"]
    assert ok["type"] == "session.updated" and ok["session"]["audio"]["input"]["format"]["rate"] == 24000
    live_validate(live)
    assert (
        live["error"]["code"] == "invalid_sample_rate"
        and "48000" in live["error"]["message"]
        and "16000" in live["error"]["message"]
    )
    assert wait_released(server)


def test_live_16k_needs_session_start_and_other_commands_are_refused_by_name(server, question_wav):
    async def go():
        seen = []
        async with sdk(server.port).live.connect() as conn:
            await conn.send({"type": "session.input_audio.append", "audio": b64(pcm16(question_wav[:FRAME]))})
            seen.append(await recv_raw(conn))
            await conn.send(
                {
                    "type": "session.start",
                    "session": {"model": "x", "audio": {"format": {"type": "audio/pcm", "rate": 16000}}},
                }
            )
            # Pipelined right after session.start (before session.started): accepted, in order.
            await conn.send({"type": "session.input_audio.append", "audio": b64(pcm16(question_wav[: 2 * FRAME]))})
            seen.append(await recv_raw(conn))
            await conn.send({"type": "thinking.append", "event_id": "t1", "text": "hm"})
            while seen[-1]["type"] != "error":
                seen.append(await recv_raw(conn))
            await conn.send(
                {"type": "session.input_audio.append", "audio": b64(pcm16(question_wav[2 * FRAME : 4 * FRAME]))}
            )
            await conn.send({"type": "session.close"})
            while seen[-1]["type"] != "session.closed":
                seen.append(await recv_raw(conn))
        return seen

    seen = run(go())
    for e in seen:
        live_validate(e)
    assert seen[0]["error"]["code"] == "session_not_started" and "session.start" in seen[0]["error"]["message"]
    assert seen[1]["type"] == "session.started" and seen[1]["session"]["audio"]["format"]["rate"] == 16000
    errors = [e for e in seen[1:] if e["type"] == "error"]
    assert (
        len(errors) == 1
        and errors[0]["error"]["code"] == "unsupported_event"
        and errors[0]["error"]["client_event_id"] == "t1"
    )
    # 4 frames were computed (a lost pipelined append would leave 2): the transcripts reach frame 3.
    assert max(e["end_ms"] for e in seen if e["type"].endswith("transcript.delta")) == 4 * 80
    # 16 kHz in -> 16 kHz out: 4 frames of 24 samples at 22.05 kHz plus the tail, resampled.
    assert sum(e["type"] == "session.output_audio.delta" for e in seen) >= 1
    assert wait_released(server)


def test_auth_applies_to_both_openai_dialects(make_server):
    srv = make_server(api_key="sekrit")

    async def go(key):
        out = []
        for connect in (lambda c: c.realtime.connect(model="m"), lambda c: c.live.connect()):
            try:
                async with connect(sdk(srv.port, key)) as conn:
                    if key == "sekrit":
                        out.append("ok")
                        await conn.close()
            except Exception as e:  # the SDK raises on the HTTP 401 of the upgrade
                out.append(type(e).__name__ + ":" + str(e)[:200])
        return out

    assert run(go("sekrit")) == ["ok", "ok"]
    bad = run(go("wrong"))
    assert len(bad) == 2 and all("401" in b for b in bad), bad

    async def origin(path):  # a browser page of another site: refused before any session (the Origin rules)
        try:
            async with Raw(
                f"ws://127.0.0.1:{srv.port}{path}",
                origin="http://evil.example",
                additional_headers={"Authorization": "Bearer sekrit"},
            ):
                return "connected"
        except Exception as e:
            return str(e)

    for path in ("/v1/realtime?model=m", "/v1/live/sessions"):
        assert "403" in run(origin(path))
    assert wait_released(srv)


# -- tool calls through GA events (the toolcall preset)


@pytest.fixture(scope="module")
def toolcall(tmp_path_factory):
    import voicechat
    from voicechat.synthetic.checkpoint import write_checkpoint

    path = write_checkpoint(
        tmp_path_factory.mktemp("toolcall_srv"), "toolcall", bits=8, tool=TOOLCALL_TOOL, arguments=TOOLCALL_ARGUMENTS
    )
    return path, voicechat.load(path)


def reported_transcript(model, events) -> str:
    """The assistant transcript GA reports for these session events (the mapping; its own tests are below)."""
    from voicechat.server.dialects.common import DialectOptions
    from voicechat.server.dialects.ga import GaMapper

    m = GaMapper(
        model_rate=22050,
        client_rate=24000,
        options=DialectOptions(),
        silence_codes=np.asarray(model.tts_model.codec_silence_tokens),
    )
    return "".join(e["delta"] for e in m.events(events) if e["type"] == "response.output_audio_transcript.delta")


def tool_reference(model, question_wav, result: str):
    """The in-process reference of a tool round trip over 24 kHz appends: the question then silence
    (room for the forced result, ~60 tokens one a frame, and EOTR), 80 ms appends through the
    server's resampling, the result submitted right after the append whose frames brought the call
    (a client sends up to there, waits for the call, answers). -> (pcm24, resampler, session,
    events, samples sent before the answer)."""
    from voicechat.server.resample import StreamResampler

    wave = np.zeros(200 * FRAME, np.float32)
    wave[: question_wav.size] = question_wav
    pcm24 = pcm16(soxr.resample(wave, 16000, 24000))
    chunk = 1920  # 80 ms at 24 kHz
    r = StreamResampler(24000, 16000)
    s = model.create_streaming_session(tools=[TIME_TOOL])
    ev, upto = [], None
    for i in range(0, pcm24.size, chunk):
        ev += s.push_audio(r.push(pcm24[i : i + chunk].astype(np.float32) / 32768.0))
        if s.pending_tool_calls and upto is None:
            upto = i + chunk
            s.submit_tool_result(s.pending_tool_calls[0], result)
    return pcm24, r, s, ev, upto


def test_ga_tool_call_round_trip_with_the_toolcall_preset(toolcall, tmp_path, question_wav):
    from voicechat.server.resample import StreamResampler

    path, model = toolcall
    result = '{"datetime": "2026-12-03T12:00:00+00:00"}'
    pcm24, _, _, ev, upto = tool_reference(model, question_wav, result)
    chunk = 1920  # 80 ms at 24 kHz
    call = next(e for e in ev if e.kind == "tool_call")
    eotr = [e for e in ev if e.kind == "tool_result_done"]
    assert eotr and eotr[0].frame_index > call.frame_index  # the model closed the result with its EOTR
    with_result = reported_transcript(model, ev)
    r2, s2 = StreamResampler(24000, 16000), model.create_streaming_session(tools=[TIME_TOOL])
    no_result = reported_transcript(model, s2.push_audio(r2.push(pcm24.astype(np.float32) / 32768.0)))
    assert no_result != with_result  # the result changes what the model says: the comparison can fail
    p, port = serve(path, tmp_path, "--max-queued-audio-seconds", "30")  # the test sends faster than real time
    try:

        async def go():
            seen = []
            async with sdk(port).realtime.connect(model="gpt-realtime") as conn:
                await conn.session.update(session={"type": "realtime", "tools": [TIME_TOOL]})
                for i in range(0, upto, chunk):
                    await conn.input_audio_buffer.append(audio=b64(pcm24[i : i + chunk]))
                while True:
                    e = await recv_raw(conn)
                    seen.append(e)
                    assert e["type"] != "error", e
                    if e["type"] == "response.function_call_arguments.done":
                        break
                await conn.conversation.item.create(
                    item={"type": "function_call_output", "call_id": e["call_id"], "output": result}
                )
                for i in range(upto, pcm24.size, chunk):
                    await conn.input_audio_buffer.append(audio=b64(pcm24[i : i + chunk]))
                said = ""
                try:
                    while len(said) < len(with_result):
                        seen.append(await recv_raw(conn, 30))
                        if seen[-1]["type"] == "response.output_audio_transcript.delta":
                            said += seen[-1]["delta"]
                except TimeoutError:
                    pass  # the assertions below say what is missing
            return seen

        seen = run(go())
    finally:
        stop(p)
    for e in seen:
        ga_validate(e)
    types = [e["type"] for e in seen]
    assert "error" not in types, [e for e in seen if e["type"] == "error"]
    done = seen[types.index("response.function_call_arguments.done")]
    assert done["name"] == TOOLCALL_TOOL and json.loads(done["arguments"]) == TOOLCALL_ARGUMENTS
    assert done["call_id"] == call.call_id
    i_added = max(
        i
        for i, e in enumerate(seen[: types.index("response.function_call_arguments.done")])
        if e["type"] == "response.output_item.added"
    )
    assert seen[i_added]["item"]["type"] == "function_call" and seen[i_added]["item"]["call_id"] == call.call_id
    delta = seen[types.index("response.function_call_arguments.delta")]
    assert delta["call_id"] == call.call_id and delta["item_id"] == done["item_id"]
    out_done = [e for e in seen if e["type"] == "response.output_item.done" and e["item"]["type"] == "function_call"]
    assert out_done and out_done[0]["item"]["arguments"] == done["arguments"]
    echoed = [e for e in seen if e["type"] == "conversation.item.added" and e["item"]["type"] == "function_call_output"]
    assert echoed and echoed[0]["item"]["call_id"] == call.call_id
    said = "".join(e["delta"] for e in seen if e["type"] == "response.output_audio_transcript.delta")
    assert said == with_result  # the result reached the model at the same frame as in-process


def test_live_tool_call_round_trip_as_a_responses_delegation(toolcall, tmp_path, question_wav):
    """Live's Responses delegation carries the model's calls: tools in session.start's delegation, the call as
    session.delegation.created + response.event, the result as response.item.create (pipecat's OpenAILiveLLMService
    reads exactly these; parity_tests/test_frameworks_pipecat.py runs it)."""
    path, model = toolcall
    result = '{"datetime": "2026-12-03T12:00:00+00:00"}'
    pcm24, r, s, ev, upto = tool_reference(model, question_wav, result)
    chunk = 1920
    ev += s.push_audio(r.flush()) + s.flush()  # session.close: the resampler's last samples, the padded frame
    call = next(e for e in ev if e.kind == "tool_call")
    eotr = next(e for e in ev if e.kind == "tool_result_done")
    want = [(e.delta, e.frame_index * 80) for e in ev if e.kind == "assistant_text_delta" and e.delta]
    assert [d for d in want if d[1] > eotr.frame_index * 80]  # the model speaks after the result: can fail
    tool = dict(TIME_TOOL)
    p, port = serve(path, tmp_path, "--max-queued-audio-seconds", "30")
    try:

        async def go():
            seen = []
            async with sdk(port).live.connect() as conn:
                delegation = {"type": "responses", "responses": {"model": "backend", "tools": [tool]}}
                await conn.send({"type": "session.start", "session": {"model": "m", "delegation": delegation}})
                seen.append(await recv_raw(conn))
                for i in range(0, upto, chunk):
                    await conn.send({"type": "session.input_audio.append", "audio": b64(pcm24[i : i + chunk])})
                while not (seen[-1]["type"] == "response.event" and seen[-1]["event"]["type"] == "response.completed"):
                    seen.append(await recv_raw(conn))
                    assert seen[-1]["type"] != "error", seen[-1]
                item = {"type": "function_call_output", "call_id": call.call_id, "output": result}
                await conn.send({"type": "response.item.create", "item": item})
                await conn.send({"type": "response.create"})
                for i in range(upto, pcm24.size, chunk):
                    await conn.send({"type": "session.input_audio.append", "audio": b64(pcm24[i : i + chunk])})
                await conn.send({"type": "session.close"})
                while seen[-1]["type"] != "session.closed":
                    seen.append(await recv_raw(conn, 120))
            return seen

        seen = run(go())
    finally:
        stop(p)
    for e in seen:
        live_validate(e)
    assert "error" not in [e["type"] for e in seen], [e for e in seen if e["type"] == "error"]
    assert seen[0]["session"]["delegation"] == {"type": "responses", "responses": {"model": "backend", "tools": [tool]}}
    created = [e for e in seen if e["type"] == "session.delegation.created"]
    assert len(created) == 1 and created[0]["offset_ms"] == call.frame_index * 80
    d = created[0]["delegation"]
    assert d["target"] == "responses" and d["type"] == "delegation"
    inner = [e["event"] for e in seen if e["type"] == "response.event" and e["delegation_id"] == d["id"]]
    assert [e["type"] for e in inner] == [
        "response.created",
        "response.output_item.added",
        "response.output_item.done",
        "response.completed",
    ]
    fc = inner[2]["item"]
    assert (fc["type"], fc["status"], fc["call_id"], fc["name"]) == (
        "function_call",
        "completed",
        call.call_id,
        TOOLCALL_TOOL,
    )
    assert json.loads(fc["arguments"]) == TOOLCALL_ARGUMENTS
    assert inner[0]["response"]["id"] == inner[3]["response"]["id"] == d["response_id"]
    got = [(e["delta"], e["start_ms"]) for e in seen if e["type"] == "session.output_transcript.delta"]
    assert got == want  # the result reached the model at the same frame as in-process


def test_live_function_results_need_responses_delegation(server):
    async def go():
        seen = []
        async with sdk(server.port).live.connect() as conn:
            await conn.send({"type": "session.start", "session": {"model": "m", "delegation": {"type": "client"}}})
            seen.append(await recv_raw(conn))
            item = {"type": "function_call_output", "call_id": "c", "output": "{}"}
            await conn.send({"type": "response.item.create", "event_id": "r1", "item": item})
            seen.append(await recv_raw(conn))
            await conn.send({"type": "session.close"})
            while seen[-1]["type"] != "session.closed":
                seen.append(await recv_raw(conn))
        return seen

    seen = run(go())
    for e in seen:
        live_validate(e)
    assert "delegation" not in seen[0]["session"]
    err = seen[1]["error"]
    assert err["code"] == "unsupported_event" and err["client_event_id"] == "r1" and "responses" in err["message"]
    assert wait_released(server)


def test_live_session_update_keeps_the_started_tools_and_says_so(server, caplog):
    """LiveKit's GPTLiveModel sends a sparse session.update ({delegation: {type: responses, responses: {tools}}}
    or {... {tool_choice}}) when an agent's tools or tool_choice change after session.start. The tools are in
    the model's prompt, prefilled at session.start: session.updated echoes the delegation in effect (unchanged)
    and the server logs the change it did not make; resending what is in effect logs nothing."""
    import logging

    started = {"type": "responses", "responses": {"model": "backend", "tools": []}}

    def update(responses: dict, eid: str) -> dict:
        return {
            "type": "session.update",
            "event_id": eid,
            "session": {"delegation": {"type": "responses", "responses": responses}},
        }

    async def go():
        seen = []
        async with sdk(server.port).live.connect() as conn:
            await conn.send({"type": "session.start", "session": {"model": "m", "delegation": started}})
            seen.append(await recv_raw(conn))
            for eid, responses in (
                ("same", {"tools": []}),
                ("auto", {"tool_choice": "auto"}),
                ("tools", {"tools": [TIME_TOOL]}),
                ("choice", {"tool_choice": "required"}),
            ):
                await conn.send(update(responses, eid))
                seen.append(await recv_raw(conn))
            await conn.send({"type": "session.close"})
            while seen[-1]["type"] != "session.closed":
                seen.append(await recv_raw(conn))
        return seen

    with caplog.at_level(logging.WARNING, logger="voicechat.server"):
        seen = run(go())
    for e in seen:
        live_validate(e)
    updated = seen[1:5]
    assert [(e["type"], e["client_event_id"]) for e in updated] == [
        ("session.updated", eid) for eid in ("same", "auto", "tools", "choice")
    ]
    assert all(e["session"]["delegation"] == started for e in updated)  # what the session runs with
    warned = [r.getMessage() for r in caplog.records if "session.update asks to change" in r.getMessage()]
    assert len(warned) == 2, warned
    assert "delegation.responses.tools" in warned[0] and "delegation.responses.tool_choice" in warned[1]
    assert wait_released(server)


# -- the mapping (GaMapper) on hand-built frames


# The session's own event classes (the mapper dispatches on them), with made-up contents.


def _Audio(f, loud):
    from voicechat.events import Audio

    return Audio(
        f, np.full(1764, 0.3 if loud else 0.0, np.float32), np.ones(4, np.int32) if loud else np.zeros(4, np.int32)
    )


def _User(f, d):
    from voicechat.events import UserTranscriptDelta

    return UserTranscriptDelta(f, d, d)


def _Text(f, d):
    from voicechat.events import AssistantTextDelta

    return AssistantTextDelta(f, 0, d, d)


def _mapper(**kw):
    from voicechat.server.dialects.common import DialectOptions
    from voicechat.server.dialects.ga import GaMapper

    return GaMapper(
        model_rate=22050, client_rate=24000, silence_codes=[0, 0, 0, 0], options=DialectOptions(silence_frames=3, **kw)
    )


def _run(m, script):
    """script: per frame (loud, user_delta or None, text_delta or None) -> GA events."""
    out = []
    for f, (loud, user, text) in enumerate(script):
        ev = ([_User(f, user)] if user else []) + ([_Text(f, text)] if text else []) + [_Audio(f, loud)]
        out += m.events(ev)
    return out


def test_mapping_speech_stretches_barge_in_and_truncate():
    m = _mapper()
    script = (
        [(False, "hi", None), (False, " there", None)]
        + [(False, None, None)] * 3  # user speaks, model silent
        + [(True, None, "Hel"), (True, None, "lo"), (True, None, None)]  # the model's first stretch
        + [(False, None, None)] * 3  # 3 silent: it ends
        + [(True, None, "Again"), (True, "wait", None), (True, None, None)]
    )
    out = _run(m, script)
    types = [e["type"] for e in out]
    for e in out:
        ga_validate(dict(e, event_id="evt"))
    assert types[:2] == ["conversation.item.input_audio_transcription.delta", "input_audio_buffer.speech_started"]
    assert out[1]["audio_start_ms"] == 0
    # The user's turn ends when the model starts: speech_stopped, committed, the item, its transcript.
    i = types.index("input_audio_buffer.speech_stopped")
    assert types[i : i + 6] == [
        "input_audio_buffer.speech_stopped",
        "input_audio_buffer.committed",
        "conversation.item.added",
        "conversation.item.input_audio_transcription.completed",
        "conversation.item.done",
        "response.created",
    ]
    assert out[i + 3]["transcript"] == "hi there"
    dones = [e for e in out if e["type"] == "response.done"]
    assert len(dones) == 1 and dones[0]["response"]["status"] == "completed"
    assert dones[0]["response"]["output"][0]["content"][0]["transcript"] == "Hello"
    # 3 loud + 3 silent frames of audio in the first response (the silent run's audio is sent).
    first = dones[0]["response"]["id"]
    n = sum(
        unb64(e["delta"]).size for e in out if e["type"] == "response.output_audio.delta" and e["response_id"] == first
    )
    assert abs(n - 6 * 1920) < 1920
    # The second stretch is open; the user talks over it ("wait"): no speech_started while the model talks ...
    assert types.count("input_audio_buffer.speech_started") == 1
    second = [e for e in out if e["type"] == "response.created"][1]["response"]["id"]
    item = [e for e in out if e["type"] == "response.output_item.added"][1]["item"]["id"]
    # ... the client played 40 ms of it and truncates: reported transcript up to there, response cancelled.
    trunc: list = []
    assert m.truncate(item, 40, trunc)
    done = next(e for e in trunc if e["type"] == "response.done")["response"]
    assert done["id"] == second and done["status"] == "cancelled"
    assert done["output"][0]["content"][0]["transcript"] == "Again" and done["output"][0]["status"] == "incomplete"
    # The model still speaks: not reported until its stretch ends (3 silent frames), then a new response may open.
    more = _run_from(m, len(script), [(True, None, "x")] + [(False, None, None)] * 3 + [(True, None, "New")])
    assert [e["type"] for e in more].count("response.created") == 1
    assert next(e for e in more if e["type"] == "response.output_audio_transcript.delta")["delta"] == "New"


def _run_from(m, f0, script):
    out = []
    for k, (loud, user, text) in enumerate(script):
        f = f0 + k
        ev = ([_User(f, user)] if user else []) + ([_Text(f, text)] if text else []) + [_Audio(f, loud)]
        out += m.events(ev)
    return out


def test_mapping_response_create_while_silent_completes_empty_after_the_wait():
    m = _mapper(response_wait_frames=4)
    _run(m, [(False, None, None)])
    m.request()
    out = _run_from(m, 1, [(False, None, None)] * 4)
    types = [e["type"] for e in out]
    assert types == ["response.created", "response.done"] and out[1]["response"]["output"] == []


def test_mapping_response_create_metadata_is_echoed_by_its_response():
    """LiveKit's generate_reply resolves on the response.created carrying its request's metadata: the
    response a response.create opens (the model's next stretch, or an empty one) echoes the metadata
    in response.created and response.done; a stretch the model opens on its own carries none."""
    m = _mapper(response_wait_frames=4)
    _run(m, [(False, None, None)])
    assert m.request({"client_event_id": "evt_1"})
    out = _run_from(m, 1, [(False, None, None), (True, None, "Hi"), (True, None, None)] + [(False, None, None)] * 3)
    created = [e for e in out if e["type"] == "response.created"]
    done = [e for e in out if e["type"] == "response.done"]
    assert len(created) == len(done) == 1
    assert created[0]["response"]["metadata"] == done[0]["response"]["metadata"] == {"client_event_id": "evt_1"}
    out = _run_from(m, 7, [(True, None, "Again"), (True, None, None)] + [(False, None, None)] * 3)
    created = [e for e in out if e["type"] == "response.created"]
    assert len(created) == 1 and created[0]["response"]["metadata"] is None


def test_mapping_response_create_while_a_response_is_open_is_refused():
    m = _mapper(response_wait_frames=4)
    _run(m, [(True, None, "Hello"), (True, None, None)])
    assert m.resp is not None
    opened = m.resp["id"]
    assert not m.request({"client_event_id": "evt_2"})
    assert m.requested_at is None and m.requested_metadata is None and m.resp["id"] == opened


def test_mapping_response_create_after_a_cancel_reports_the_model_again():
    """LiveKit answers a tool call with `interrupt()` (response.cancel) then `generate_reply()`
    (response.create) while the model may still be talking: the cancel stops the report of the stretch,
    the request resumes it, so the model's next loud frame opens the requested response (with its
    metadata) instead of an empty one after the wait."""
    m = _mapper(response_wait_frames=4)
    _run(m, [(True, None, "Let"), (True, None, None)])
    out: list = []
    m.cancel(out)
    assert [e["type"] for e in out][-1] == "response.done" and m.suppress
    # Without a request the rest of the stretch stays unreported ...
    assert _run_from(m, 2, [(True, None, "me")]) == []
    # ... a request reports it from the next loud frame on.
    assert m.request({"client_event_id": "evt_3"}) and not m.suppress
    out = _run_from(m, 3, [(True, None, "It is"), (True, None, " noon")])
    created = [e for e in out if e["type"] == "response.created"]
    assert len(created) == 1 and created[0]["response"]["metadata"] == {"client_event_id": "evt_3"}
    said = "".join(e["delta"] for e in out if e["type"] == "response.output_audio_transcript.delta")
    assert said == "It is noon"
    assert any(e["type"] == "response.output_audio.delta" for e in out)


def test_response_create_metadata_is_checked():
    from voicechat.server.dialects.ga import _metadata
    from voicechat.server.protocol import ProtocolError

    assert _metadata(None) is None and _metadata({"a": "b"}) == {"a": "b"}
    for bad in ([], {"a": 1}, {1: "a"}, {f"k{i}": "v" for i in range(17)}, {"k" * 65: "v"}, {"k": "v" * 513}):
        with pytest.raises(ProtocolError):
            _metadata(bad)


# -- voicechat serve --mcp: the server runs the tools


def test_serve_mcp_runs_the_tools_for_a_simple_client(toolcall, tmp_path):
    """mlx-vlm's dialect (the page, `voicechat client`) without tools of its own: the server's MCP tools are the
    session's, the server answers the call, the model closes the result with its EOTR."""
    path, _ = toolcall
    pcm = np.zeros(400 * FRAME, np.int16)  # mcp-server-time's answer is ~150 tokens, forced one a frame
    p, port = serve(
        path,
        tmp_path,
        "--mcp",
        f"{sys.executable} -m mcp_server_time --local-timezone UTC",
        "--max-queued-audio-seconds",
        "30",
    )

    async def go():
        async with Raw(f"ws://127.0.0.1:{port}/v1/realtime") as c:
            await c.configure()
            for i in range(0, 100 * FRAME, FRAME):
                await c.send({"type": "input_audio_buffer.append", "audio": b64(pcm[i : i + FRAME])})
            call, seen = await c.until("response.function_call_arguments.done")
            # The server answers the call itself (a frame after the result is in, the model hears it).
            out, more = await c.until("response.function_call.output")
            for i in range(100 * FRAME, pcm.size, FRAME):
                await c.send({"type": "input_audio_buffer.append", "audio": b64(pcm[i : i + FRAME])})
            await c.send({"type": "input_audio_buffer.commit"})
            code, rest = await c.closed()
            return call, out, seen + more + rest, code

    try:
        call, out, seen, code = run(go())
    finally:
        stop(p)
    assert code == 1000 and not [e for e in seen if e["type"] == "error"]
    assert call["name"] == TOOLCALL_TOOL and json.loads(call["arguments"]) == TOOLCALL_ARGUMENTS
    assert out["call_id"] == call["call_id"] and "datetime" in json.loads(out["output"])
    done = [e for e in seen if e["type"] == "response.function_call.result_done"]
    assert [d["call_id"] for d in done] == [call["call_id"]]  # the model's EOTR after the server's result


def test_mapping_truncate_of_a_finished_item_keeps_what_was_played():
    m = _mapper()
    out = _run(m, [(True, None, "One"), (True, None, " two")] + [(False, None, None)] * 3)
    item = next(e for e in out if e["type"] == "response.output_item.done")["item"]
    assert item["content"][0]["transcript"] == "One two"
    assert m.truncate(item["id"], 40, [])  # " two" came with the second frame, after ~74 ms of audio
    assert m.items[item["id"]]["content"][0]["transcript"] == "One" and m.items[item["id"]]["status"] == "incomplete"
    assert not m.truncate("item_unknown", 0, [])


def test_mapping_text_only_modality_sends_text_events_and_no_audio():
    m = _mapper()
    m.text_only = True
    out = _run(m, [(True, None, "Hi"), (True, None, "!")] + [(False, None, None)] * 3)
    types = [e["type"] for e in out]
    for e in out:
        ga_validate(dict(e, event_id="evt"))
    assert "response.output_audio.delta" not in types and "response.output_audio_transcript.delta" not in types
    assert "".join(e["delta"] for e in out if e["type"] == "response.output_text.delta") == "Hi!"
    done = next(e for e in out if e["type"] == "response.output_text.done")
    assert done["text"] == "Hi!"
    assert next(e for e in out if e["type"] == "response.done")["response"]["output_modalities"] == ["text"]


def test_one_session_slot_is_shared_by_the_dialects(server):
    async def go():
        async with Raw(server.url) as held:  # an mlx-vlm session holds the slot
            await held.configure()
            out = []
            async with sdk(server.port).realtime.connect(model="gpt-realtime") as conn:
                out.append(await recv_raw(conn))
            async with Raw(f"ws://127.0.0.1:{server.port}/v1/live/sessions") as c:
                out.append(await c.recv())
                code, _ = await c.closed()
            return out, code

    (ga, live), code = run(go())
    ga_validate(ga)
    live_validate(live)
    for e in (ga, live):
        assert e["error"]["code"] == "server_busy" and e["error"]["type"] == "server_error"
    assert code == 1013
    assert wait_released(server)


HOSTILE = [
    '{"type": "session.update", "x": ' + "[" * 200 + "]" * 200 + "}",  # deep nesting
    '{"type": "session.update", "n": ' + "9" * 5000 + "}",  # a 5000-digit number
    '{"type": "session.update", "n": NaN}',  # non-finite
    '{"type": "session.update", "s": "\\ud800"}',  # a lone surrogate
    "[1, 2]",
    "not json",
]


@pytest.mark.parametrize("path", ["/v1/realtime?model=gpt-realtime", "/v1/live/sessions"])
def test_openai_dialects_refuse_hostile_json_and_stay_usable(server, path):
    """The OpenAI dialects parse with the same guarded parser as mlx-vlm's: every hostile message is
    one `invalid_json` error in OpenAI's error shape, the message bound holds, and the connection
    then still works (a session starts)."""
    url = server.url.replace("/v1/realtime", path)

    async def go():
        async with Raw(url) as c:
            first = None if "live" in path else await c.recv()  # GA: session.created on connect
            errors = []
            for text in HOSTILE:
                await c.send(text)
                e = await c.recv()
                errors.append(e)
            await c.send('{"type": "x", "pad": "' + "a" * (2 * 2**20) + '"}')  # past the message bound
            errors.append(await c.recv())
            if "live" in path:
                await c.send(
                    {
                        "type": "session.start",
                        "session": {"model": "m", "audio": {"format": {"type": "audio/pcm", "rate": 16000}}},
                    }
                )
                ok = await c.recv()
            else:
                await c.send({"type": "session.update", "session": {"type": "realtime"}})
                ok = await c.recv()
            return first, errors, ok

    _first, errors, ok = run(go())
    wait_released(server)
    assert all(e["type"] == "error" and e["error"]["code"] == "invalid_json" for e in errors[: len(HOSTILE)]), errors
    assert errors[-1]["type"] == "error" and errors[-1]["error"]["code"] == "message_too_large", errors[-1]
    assert all(len(e["error"]["message"]) < 400 for e in errors)
    assert ok["type"] in ("session.started", "session.updated"), ok
