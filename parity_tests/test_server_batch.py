"""`voicechat serve --max-sessions N`: several conversations in one process, their frames computed
together (docs/server.md, "Many sessions").

Every client's stream is compared with what its session computes alone: the in-process
`create_streaming_session` on the same audio, prompt and seed (mlx-vlm's dialect: ids, codes,
PCM16; Live: the audio exactly, after the documented resampling), or the same client run alone on a
one-slot server (GA, whose mapping has no codes on the wire). Tiny synthetic checkpoint, a few
seconds of audio per client.
"""

from __future__ import annotations

import asyncio
import json
import logging
import socket
import types
import urllib.request

import numpy as np
import pytest
import soxr

from voicechat.server.client import to_pcm16

from .server_util import (
    FRAME,
    Raw,
    RawSocketWS,
    WrappedServer,
    append_msg,
    b64,
    failing_frame,
    pcm16,
    run,
    slow_frames,
    unb64,
    wait_released,
)
from .test_server import PROMPT, _expected_events, _wire_events


def live_reference(model, pcm24):
    """The events of the in-process session on what Live's server side hears of 24 kHz PCM16 (resampled
    to 16 kHz as a stream, flushed at session.close), flushed."""
    from voicechat.server.resample import StreamResampler

    r = StreamResampler(24000, 16000)
    x = pcm24.astype(np.float32) / 32768.0
    s = model.create_streaming_session()
    return s.push_audio(np.concatenate([r.push(x), r.flush()])) + s.flush()


def frames_audio(events) -> np.ndarray:
    return np.concatenate([e.samples for e in events if e.kind in ("audio", "audio_tail")]).astype(np.float32)


def _metrics(srv) -> dict:
    text = urllib.request.urlopen(srv.http + "/metrics").read().decode()
    return {line.split()[0]: float(line.split()[1]) for line in text.splitlines() if line and not line.startswith("#")}


def _healthz(srv) -> dict:
    return json.loads(urllib.request.urlopen(srv.http + "/healthz").read())


def _live_url(srv) -> str:
    return f"ws://127.0.0.1:{srv.port}/v1/live/sessions"


def _ga_url(srv) -> str:
    return srv.url + "?model=gpt-realtime"


# -- clients (raw websockets), each starting its audio at `go` (all sessions open first)


async def mlx_client(url, pcm, *, seed=0, prompt=None, go=None, chunk=2560, extra=None, **session):
    """mlx-vlm's dialect: session.update, the audio in appends, commit; -> (close code, events)."""
    async with Raw(url) as c:
        created = await c.recv()
        await c.send({"type": "session.update", "session": {"seed": seed, "system_prompt": prompt, **session}})
        _, seen = await c.until("session.updated", "error")
        if go is not None:
            await go()
        for i in range(0, pcm.size, chunk):
            await c.send(append_msg(pcm[i : i + chunk]))
            if extra is not None:
                await extra(c, i // chunk)
        await c.send({"type": "input_audio_buffer.commit"})
        code, rest = await c.closed(60)
        return code, [created, *seen, *rest]


async def ga_client(url, pcm24, *, go=None):
    """OpenAI Realtime GA: the audio at 24 kHz, a commit, then a tool result for a call that does not
    exist. GA's stream never ends; the result waits behind the session's frames like any tool result,
    so its `invalid_tool_result` error comes after every frame's events: the end of the stream. The
    echo of that item (sent at once, wherever it falls among the frames) is left out."""
    ending = {"type": "function_call_output", "call_id": "call_none", "output": "{}"}
    async with Raw(url) as c:
        seen = [await c.recv()]
        await c.send({"type": "session.update", "session": {"type": "realtime", "instructions": "Be brief."}})
        _, got = await c.until("session.updated")
        seen += got
        if go is not None:
            await go()
        for i in range(0, pcm24.size, 1920):
            await c.send({"type": "input_audio_buffer.append", "audio": b64(pcm24[i : i + 1920])})
        await c.send({"type": "input_audio_buffer.commit"})
        await c.send({"type": "conversation.item.create", "item": ending})
        while not (seen[-1]["type"] == "error" and seen[-1]["error"]["code"] == "invalid_tool_result"):
            seen.append(await c.recv(60))
        return [e for e in seen if (e.get("item") or {}).get("call_id") != "call_none"]


async def live_client(url, pcm24, *, go=None):
    """OpenAI Live at 24 kHz: session.start, the audio, session.close; -> (close code, events)."""
    async with Raw(url) as c:
        await c.send(
            {
                "type": "session.start",
                "session": {"model": "gpt-live-1", "audio": {"format": {"type": "audio/pcm", "rate": 24000}}},
            }
        )
        _, seen = await c.until("session.started", "error")
        if go is not None:
            await go()
        for i in range(0, pcm24.size, 1920):
            await c.send({"type": "session.input_audio.append", "audio": b64(pcm24[i : i + 1920])})
        await c.send({"type": "session.close"})
        code, rest = await c.closed(60)
        return code, seen + rest


def _barrier(n):
    """`go()` for n clients: each waits until all n have their session configured."""
    b = asyncio.Barrier(n)

    async def go():
        await b.wait()

    return go


def _normalized(events) -> list:
    """GA events without what differs between two runs of one stream: event ids, generated ids (renamed
    by first appearance), timestamps."""
    names: dict = {}

    def norm(x):
        if isinstance(x, dict):
            return {k: norm(v) for k, v in x.items() if k not in ("event_id", "expires_at", "created_at")}
        if isinstance(x, list):
            return [norm(v) for v in x]
        if isinstance(x, str) and "_" in x and x.split("_")[-1].isalnum() and len(x.split("_")[-1]) >= 16:
            return names.setdefault(x, f"id{len(names)}")
        return x

    return [norm(e) for e in events]


def _shared_ticks(before: dict, after: dict) -> float:
    """Ticks that computed more than one frame (between two /metrics reads)."""
    count = after["voicechat_tick_frames_count"] - before.get("voicechat_tick_frames_count", 0)
    one = after['voicechat_tick_frames_bucket{le="1.0"}'] - before.get('voicechat_tick_frames_bucket{le="1.0"}', 0)
    return count - one


def _mlx_expected(model, pcm, seed, prompt):
    return _expected_events(model, pcm, seed=seed, prompt=prompt)


def _mlx_got(events):
    return _wire_events(types.SimpleNamespace(events=[e for e in events if e["type"] != "error"]))


# -- several clients at once, in every dialect: each stream is the one its session computes alone


@pytest.mark.parametrize("dialects", [("ga", "live"), ("mlx-vlm", "ga", "live")], ids=["2-slots", "3-slots"])
def test_dialects_at_once_each_get_their_solo_stream(dialects, make_server, server, tiny_model, question_wav):
    srv = make_server(max_sessions=len(dialects))
    pcm = to_pcm16(question_wav)
    pcm24 = pcm16(soxr.resample(question_wav, 16000, 24000))
    live_pcm24 = pcm16(soxr.resample(question_wav[::-1].copy(), 16000, 24000))  # another input
    ga_alone = run(ga_client(_ga_url(server), pcm24))  # the GA client alone, on a one-slot server
    before = _metrics(srv)

    async def together():
        go = _barrier(len(dialects))
        clients = {
            "mlx-vlm": lambda: mlx_client(srv.url, pcm, seed=3, prompt=PROMPT, go=go),
            "ga": lambda: ga_client(_ga_url(srv), pcm24, go=go),
            "live": lambda: live_client(_live_url(srv), live_pcm24, go=go),
        }
        return dict(zip(dialects, await asyncio.gather(*(clients[d]() for d in dialects)), strict=True))

    got = run(together())
    after = _metrics(srv)
    if "mlx-vlm" in got:  # ids, codes and PCM16 of every frame, as the in-process session alone
        mlx_code, mlx_events = got["mlx-vlm"]
        assert mlx_code == 1000 and mlx_events[-1]["type"] == "response.done"
        wire, want = _mlx_got(mlx_events), _mlx_expected(tiny_model, pcm, 3, PROMPT)
        assert len(wire) == len(want) and wire == want
    # GA: the same events as alone (ids renamed), audio and transcripts included.
    ga_events = got["ga"]
    assert [e["type"] for e in ga_events].count("error") == 1  # the end marker only
    assert sum(e["type"] == "input_audio_buffer.committed" for e in ga_events) >= 1
    assert _normalized(ga_events) == _normalized(ga_alone)
    assert any(e["type"] == "conversation.item.input_audio_transcription.delta" for e in ga_events)
    # Live: the audio (every frame and the tail, resampled) exactly, and the transcripts.
    live_code, live_events = got["live"]
    assert live_code == 1000 and live_events[-1]["type"] == "session.closed"
    events = live_reference(tiny_model, live_pcm24)
    expected = pcm16(soxr.resample(frames_audio(events), 22050, 24000))
    audio = np.concatenate([unb64(e["delta"]) for e in live_events if e["type"] == "session.output_audio.delta"])
    assert np.array_equal(audio, expected)
    want_text = [(e.delta, e.frame_index * 80) for e in events if e.kind == "user_transcript_delta" and e.delta]
    got_text = [(e["delta"], e["start_ms"]) for e in live_events if e["type"] == "session.input_transcript.delta"]
    assert got_text == want_text and want_text
    # They ran as a batch: some ticks computed frames of more than one session.
    assert _shared_ticks(before, after) > 0
    assert wait_released(srv)


def test_extra_client_is_busy_in_every_dialect_and_a_freed_slot_takes_the_next(make_server, tiny_model, question_wav):
    srv = make_server(max_sessions=2)
    pcm = to_pcm16(question_wav[: 6 * FRAME])
    h = _healthz(srv)
    assert h == {
        "status": "ok",
        "active_sessions": 0,
        "max_sessions": 2,
        "slot_bytes_at_limit": h["slot_bytes_at_limit"],
    }
    m = _metrics(srv)
    assert m["voicechat_sessions_max"] == 2 and m["voicechat_sessions_active"] == 0
    assert m["voicechat_slot_bytes_at_limit"] == srv.state.worker.memory["slot_bytes"] > 0

    async def busy(url):
        async with Raw(url) as c:
            e = await c.recv()
            code, _ = await c.closed()
            return e, code

    async def go():
        async with Raw(srv.url) as a, Raw(srv.url) as b:
            await a.configure()
            await b.configure()
            h, m = _healthz(srv), _metrics(srv)
            assert h["status"] == "busy" and h["active_sessions"] == 2 and h["max_sessions"] == 2
            assert m["voicechat_sessions_active"] == 2
            for url in (srv.url, _ga_url(srv), _live_url(srv)):
                e, code = await busy(url)
                assert e["type"] == "error" and e["error"]["code"] == "server_busy", (url, e)
                assert "--max-sessions 2" in e["error"]["message"]
                assert code == 1013, url
            assert await a.ping_ok() and await b.ping_ok()  # the two are unaffected
            # One leaves: its slot takes the next client, who gets its whole stream; b is still there.
            await a.send({"type": "input_audio_buffer.commit"})
            await a.closed()
            assert await asyncio.to_thread(wait_released, srv, 10, 1)
            code, events = await mlx_client(srv.url, pcm, seed=5)
            assert code == 1000 and _mlx_got(events) == _mlx_expected(tiny_model, pcm, 5, None)
            assert await b.ping_ok()

    run(go())
    assert wait_released(srv)
    assert _metrics(srv)['voicechat_sessions_refused_total{reason="busy"}'] == 3
    assert _healthz(srv)["active_sessions"] == 0


# -- one client's trouble leaves the others' streams intact and complete


def _stall(srv, seconds):
    """A client with a 4 KiB receive buffer that configures, sends audio and never reads (on a thread)."""
    import socket

    srv.sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 8192)
    ws = RawSocketWS(srv.port, rcvbuf=4096, timeout=5.0)
    ws.send_json({"type": "session.update"})
    z = np.zeros(int(seconds * 16000), np.int16)
    for i in range(0, z.size, 16000):
        try:
            ws.send_frame(append_msg(z[i : i + 16000]).encode())
        except OSError:  # the server stopped reading us, or dropped us
            break
    return ws


@pytest.mark.parametrize("trouble", ["bad_input", "cancel", "disconnect", "context_limit", "slow_reader"])
def test_one_clients_trouble_leaves_the_other_stream_intact(trouble, make_server, tiny_model, question_wav):
    srv = make_server(max_sessions=2, send_timeout=1.0)
    good_pcm = to_pcm16(question_wav)
    bad_pcm = to_pcm16(question_wav[::-1].copy())

    async def troubled(go):
        if trouble == "bad_input":

            async def garbage(c, k):
                if k in (1, 4):
                    for msg in ("{not json", json.dumps({"type": "input_audio_buffer.append", "audio": 5})):
                        await c.send(msg)
                    await c.send(append_msg(bad_pcm[:100], sample_rate=48000))

            return await mlx_client(srv.url, bad_pcm, seed=9, go=go, extra=garbage)
        if trouble == "context_limit":
            return await mlx_client(srv.url, bad_pcm, seed=9, go=go, max_streaming_seconds=0.24)
        if trouble == "slow_reader":
            await go()
            ws = await asyncio.to_thread(_stall, srv, 8.0)
            return ws, None
        async with Raw(srv.url) as c:  # cancel / disconnect: mid-stream, after its 5th frame
            await c.configure()
            await go()
            await c.send(append_msg(to_pcm16(np.tile(question_wav, 3))))
            for _ in range(5):
                await c.until("response.audio.delta")
            if trouble == "disconnect":
                c.ws.transport.abort()  # no close frame: the TCP connection just ends
                return None, []
            await c.send({"type": "session.cancel"})
            return await c.closed(30)

    async def go_both():
        go = _barrier(2)
        return await asyncio.gather(mlx_client(srv.url, good_pcm, seed=1, prompt=PROMPT, go=go), troubled(go))

    (code, events), (t_code, t_events) = run(go_both())
    # The good client: its whole stream, exactly as its session alone.
    assert code == 1000 and events[-1]["type"] == "response.done"
    assert not [e for e in events if e["type"] == "error"]
    assert _mlx_got(events) == _mlx_expected(tiny_model, good_pcm, 1, PROMPT)
    # The troubled one got what it asked for.
    if trouble == "bad_input":
        errors = [e["error"]["code"] for e in t_events if e["type"] == "error"]
        assert errors == ["invalid_json", "invalid_audio", "invalid_sample_rate"] * 2 and t_code == 1000
        assert _mlx_got(t_events) == _mlx_expected(tiny_model, bad_pcm, 9, None)  # nothing refused reached it
    elif trouble == "context_limit":
        assert [e["frame_index"] for e in t_events if e["type"] == "response.audio.delta"] == [0, 1, 2]
        assert t_events[-1]["error"]["code"] == "context_limit" and t_code == 1000
    elif trouble == "cancel":
        assert t_code == 1000 and t_events[-1]["type"] == "response.cancelled"
    elif trouble == "slow_reader":
        ws = t_code
        try:
            assert wait_released(srv, 30)
        finally:
            ws.close()
        assert _metrics(srv)['voicechat_sessions_errored_total{reason="slow_consumer"}'] == 1
    # Every slot is free again, and a new client gets one.
    assert wait_released(srv, 30)
    pcm = to_pcm16(question_wav[: 4 * FRAME])
    code, events = run(mlx_client(srv.url, pcm, seed=2))
    assert code == 1000 and _mlx_got(events) == _mlx_expected(tiny_model, pcm, 2, None)


# -- an error ends only the session it belongs to


def test_an_error_in_one_session_ends_it_alone_and_one_in_the_shared_pass_ends_that_tick(
    tiny_ckpt, tiny_model, question_wav, caplog
):
    shared = {"fail": False}

    def engine_hook(states):
        if shared["fail"] and len(states) == 2:
            raise RuntimeError("injected shared-pass fault")

    # Each frame a little slower (10 ms), so the two sessions' frames meet in ticks.
    with WrappedServer(
        tiny_ckpt,
        lambda kw: failing_frame(3) if kw.get("seed") == 7 else slow_frames(0.01),
        max_sessions=2,
        engine_hook=engine_hook,
    ) as w:
        srv = w.srv
        good, bad = to_pcm16(question_wav), to_pcm16(question_wav[: 8 * FRAME])

        async def both(seeds):
            go = _barrier(2)
            return await asyncio.gather(
                *(mlx_client(srv.url, p, seed=s, go=go) for p, s in zip((good, bad), seeds, strict=True))
            )

        with caplog.at_level(logging.ERROR, logger="voicechat.server"):
            (code, events), (f_code, f_events) = run(both((1, 7)))
        # Seed 7's frame 3 failed after the shared pass: it alone ended, with internal_error and 1011 ...
        assert [e["frame_index"] for e in f_events if e["type"] == "response.audio.delta"] == [0, 1, 2]
        assert f_events[-1]["error"]["code"] == "internal_error" and f_code == 1011
        assert "injected" not in f_events[-1]["error"]["message"]
        # ... and the other session's stream is whole, as alone.
        assert code == 1000 and _mlx_got(events) == _mlx_expected(tiny_model, good, 1, None)
        assert any("it alone is ended" in r.getMessage() for r in caplog.records)
        assert wait_released(srv)
        assert w.metrics.sessions_errored.labels(reason="internal_error")._value.get() == 1

        # A fault in the shared pass of a tick of two: which session's data caused it cannot be told, and
        # both were advanced in part, so both end (and the log says so).
        shared["fail"] = True
        caplog.clear()
        with caplog.at_level(logging.ERROR, logger="voicechat.server"):
            results = run(both((1, 2)))
        for code, events in results:
            assert events[-1]["error"]["code"] == "internal_error" and code == 1011
        assert any("shared pass" in r.getMessage() and "ending all of them" in r.getMessage() for r in caplog.records)
        assert wait_released(srv)
        shared["fail"] = False
        code, events = run(mlx_client(srv.url, bad, seed=2))  # the next session works
        assert code == 1000 and _mlx_got(events) == _mlx_expected(tiny_model, bad, 2, None)


# -- a long prompt's prefill does not stall the others


def test_a_prefill_runs_the_other_sessions_frames_between_its_pieces(tiny_ckpt, tiny_model, question_wav):
    """B's prompt takes seconds to prefill (tiny: ~5 ms a token); A's audio arrives once it has started.
    A's frames are computed between the prefill's pieces, so A has its whole stream before B is
    ready. The prompt's state is prepared by the server's prompt cache (a miss), and a later client
    with the same prompt starts from the cached state: both streams equal their sessions alone."""
    from voicechat.server.metrics import ServerMetrics
    from voicechat.server.prompt_cache import PromptStates
    from voicechat.server.runner import ServerThread, make_state

    long_prompt = " ".join(["hello world"] * 60)  # ~480 tokens
    assert 300 < len(tiny_model.tokenizer.encode(long_prompt)) < 512
    state = make_state(
        str(tiny_ckpt),
        warmup_seconds=0.0,
        max_sessions=2,
        prompt_states=PromptStates(announce=False, metrics=(metrics := ServerMetrics())),
        metrics=metrics,
    )
    srv = ServerThread(state).start()
    worker = state.worker
    a_pcm, b_pcm = to_pcm16(question_wav[: 10 * FRAME]), to_pcm16(question_wav[: 6 * FRAME])
    try:

        async def go():
            order = []
            async with Raw(srv.url) as a, Raw(srv.url) as b:
                await a.configure()
                await b.recv()
                await b.send({"type": "session.update", "session": {"system_prompt": long_prompt, "seed": 4}})
                while worker._prefilling is None:  # B's prefill has started
                    await asyncio.sleep(0.005)
                await a.send(append_msg(a_pcm))
                await a.send({"type": "input_audio_buffer.commit"})

                async def read(c, name, last):
                    seen = []
                    while True:
                        e = await c.recv(60)
                        seen.append(e)
                        order.append((name, e["type"]))
                        if e["type"] == last:
                            return seen

                a_events, b_first = await asyncio.gather(read(a, "a", "response.done"), read(b, "b", "session.updated"))
                await b.send(append_msg(b_pcm))
                await b.send({"type": "input_audio_buffer.commit"})
                _, b_rest = await b.closed(60)
            return order, a_events, b_first + b_rest

        order, a_events, b_events = run(go())
        # A's whole stream came before B's session was ready.
        assert order.index(("a", "response.done")) < order.index(("b", "session.updated")), order[:5]
        assert _mlx_got(a_events) == _mlx_expected(tiny_model, a_pcm, 0, None)
        assert _mlx_got(b_events) == _mlx_expected(tiny_model, b_pcm, 4, long_prompt)
        assert wait_released(srv)
        # The same prompt again: the cached state, no prefill, the same stream.
        hits = state.metrics.registry.get_sample_value("voicechat_prompt_cache_lookups_total", {"result": "hit"})
        code, events = run(mlx_client(srv.url, b_pcm, seed=4, prompt=long_prompt))
        assert code == 1000 and _mlx_got(events) == _mlx_expected(tiny_model, b_pcm, 4, long_prompt)
        assert state.metrics.registry.get_sample_value("voicechat_prompt_cache_lookups_total", {"result": "hit"}) == (
            hits + 1
        )
    finally:
        srv.stop()
        worker.stop()


# -- metrics: ticks and frames that missed their deadline


def test_ticks_and_missed_deadlines_are_counted(tiny_ckpt, question_wav):
    """Every frame 90 ms longer: every tick is longer than the 80 ms frame, so each of its frames counts
    as missed; the ticks' frames add up to the frames computed."""
    with WrappedServer(tiny_ckpt, lambda kw: slow_frames(0.09), max_sessions=2) as w:
        pcm = to_pcm16(question_wav[: 5 * FRAME])  # whole frames: the commit adds none

        async def both():
            go = _barrier(2)
            return await asyncio.gather(mlx_client(w.srv.url, pcm, seed=1, go=go), mlx_client(w.srv.url, pcm, go=go))

        for code, events in run(both()):
            assert code == 1000 and sum(e["type"] == "response.audio.delta" for e in events) == 5
        m = _metrics(w.srv)
    assert m["voicechat_frames_total"] == 10
    assert m["voicechat_tick_frames_sum"] == 10 == m["voicechat_frames_missed_deadline_total"]
    assert 5 <= m["voicechat_tick_seconds_count"] == m["voicechat_tick_frames_count"] <= 10
    assert m["voicechat_sessions_max"] == 2


# -- memory: a slot at the session length limit, and the check at startup


def test_slot_memory_is_what_a_session_of_that_length_holds(tiny_model):
    from voicechat.server.memory import slot_memory

    prompt = "You are a helpful assistant."
    s = tiny_model.create_streaming_session(system_prompt=prompt)
    frames = 300
    s.push_audio(np.zeros(frames * FRAME, np.float32))
    sm = slot_memory(tiny_model, session_seconds=frames * 0.08, prompt_positions=s.prompt_positions)
    assert sm.frames == frames and sm.prompt_positions == s.prompt_positions > 0
    tl = s.timeline.state
    # The growing caches at their capacity (whole buffers), exactly.
    assert sm.language_kv == sum(v.nbytes for k, v in tl.llm.state.items() if k.endswith((".keys", ".values")))
    tts = sum(k.nbytes + v.nbytes for k, v in zip(tl.tts.keys, tl.tts.values, strict=True))
    assert sm.tts_global_kv + sm.tts_sliding_kv == tts
    # The bounded ones (the conformer's window is full after 300 frames): exactly what is counted.
    others = sum(
        v.nbytes
        for k, v in s.states().items()
        if not (k.startswith(("llm.", "tts.layers.")) and k.endswith(("keys", "values")))
    )
    assert others == sm.bounded
    assert sm.total == sm.language_kv + sm.tts_global_kv + sm.tts_sliding_kv + sm.bounded


def test_serve_refuses_slots_that_do_not_fit_in_memory(tiny_ckpt, monkeypatch, capsys, caplog):
    import voicechat
    from voicechat.cli.main import main
    from voicechat.server import memory
    from voicechat.server.worker import ModelWorker

    monkeypatch.setattr(memory, "machine_memory_bytes", lambda: 1 << 20)  # a 1 MiB machine
    with socket.socket() as taken:  # were the check gone, uvicorn would fail to bind here, not serve
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = str(taken.getsockname()[1])
        rc = main(["serve", "-m", str(tiny_ckpt), "--max-sessions", "2", "--port", port, "--warmup-seconds", "0"])
    err = capsys.readouterr().err
    assert rc == 2, err
    assert "voicechat serve: error: --max-sessions 2 does not fit" in err and "--no-memory-check" in err
    assert "Traceback" not in err
    # The override starts it; one slot (the default) starts as it always did, with a warning.
    for slots, check in ((2, False), (1, True)):
        with caplog.at_level(logging.WARNING, logger="voicechat.server"):
            w = ModelWorker(lambda: voicechat.load(tiny_ckpt), max_sessions=slots, memory_check=check).start()
            try:
                w.wait_ready(60)
                assert w.memory["slots"] == slots and w.memory["machine_bytes"] == 1 << 20
            finally:
                w.stop()
        assert any("more than this machine has" in r.getMessage() for r in caplog.records)
        caplog.clear()


def test_voicechat_serve_process_with_two_slots(tiny_ckpt, tiny_model, question_wav, tmp_path):
    """The real command with --max-sessions 2 (warm-up through the batch, the default prompt's state):
    says what a slot holds at the limit, serves two clients at once, stops on SIGINT with status 0."""
    import signal
    import sys

    from voicechat.server.compare import free_port, start_process

    port = free_port()
    log = tmp_path / "serve.log"
    p = start_process(
        [sys.executable, "-m", "voicechat.cli", "serve", "-m", str(tiny_ckpt), "--port", str(port)]
        + ["--max-sessions", "2", "--warmup-seconds", "0.2"],
        f"http://127.0.0.1:{port}/healthz",
        log,
        timeout=120,
    )
    pcm = to_pcm16(question_wav[: 8 * FRAME])
    try:
        h = json.loads(urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz").read())
        assert h["max_sessions"] == 2 and h["active_sessions"] == 0 and h["slot_bytes_at_limit"] > 0
        url = f"ws://127.0.0.1:{port}/v1/realtime"

        async def both():
            go = _barrier(2)
            return await asyncio.gather(mlx_client(url, pcm, seed=0, go=go), mlx_client(url, pcm, seed=6, go=go))

        for (code, events), seed in zip(run(both()), (0, 6), strict=True):
            assert code == 1000 and _mlx_got(events) == _mlx_expected(tiny_model, pcm, seed, None)
    finally:
        p.send_signal(signal.SIGINT)
        rc = p.wait(30)
    text = log.read_text()
    assert rc == 0 and text.count('"event": "session_end"') == 2, text[-3000:]
    assert "2 session slot(s), each up to" in text and "memory: 2 session slot(s)" in text, text[-3000:]
