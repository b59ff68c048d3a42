"""LiveKit Agents (livekit-agents / livekit-plugins-openai 1.8.9, pinned) against `voicechat serve`.

No LiveKit server and no room: the plugin's sessions are driven the way LiveKit's AgentSession drives
them (voice/agent_activity.py: `_update_session` with the agent's instructions and tools, audio frames
pushed as `rtc.AudioFrame`s, the `generation_created` streams read, a tool call executed with
LiveKit's own `execute_function_call`, its output sent back with `update_chat_ctx`, then `interrupt()`
and `generate_reply()`), against a real `voicechat serve` process over real sockets:

* `openai.realtime.RealtimeModel(base_url="http://HOST:PORT/v1")` (Realtime GA on /v1/realtime) with
  the `toolcall` preset, which calls `get_current_time {"timezone": "UTC"}` after a few seconds of audio;
* `openai.realtime.GPTLiveModel` (OpenAI Live on /v1/live/sessions) inside `llm.DuplexRealtimeAdapter`,
  as AgentSession runs a duplex model: audio and transcripts, and with the `toolcall` preset a tool round
  trip through its default Responses delegation (the call as `response.event`s, the output as
  `response.item.create` + `response.create`, the model going on by itself);
* the slot load (voicechat/server/load.py) that a LiveKit worker reports, and the availability LiveKit's
  own AgentServer code derives from it (load vs load_threshold);
* examples/livekit_agent.py: what runs without a LiveKit server (the worker's load wiring, the agent).

docs/server.md ("Clients", "LiveKit Agents") and docs/deploy.md say what LiveKit relies on.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib.util
import json
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import soxr
from livekit import rtc
from livekit.agents import AgentServer, APIConnectionError, APIConnectOptions, function_tool, llm, utils as lk_utils
from livekit.plugins import openai as lk_openai
from livekit.protocol import agent as lk_agent

from parity_tests.conftest import TOOLCALL_ARGUMENTS, TOOLCALL_TOOL
from voicechat.server.load import SlotLoadError, read_slots, slot_load, slot_load_fnc

from .server_util import FRAME, Raw, pcm16, run
from .test_server_dialects import serve, stop

pytestmark = pytest.mark.frameworks

ROOT = Path(__file__).resolve().parents[1]
INSTRUCTIONS = "You are a helpful voice assistant. Use get_current_time when asked for the time."
RESULT = {"datetime": "2026-12-03T12:00:00+00:00", "timezone": "UTC"}
CHUNK = 2400  # LiveKit's RealtimeSession sends its input in 100 ms appends (24 kHz)
NO_RETRY = APIConnectOptions(max_retry=0)  # a failure is the test's, not something to retry
executed: list[str] = []


@function_tool
async def get_current_time(timezone: str) -> str:
    """Get the current time in a timezone.

    Args:
        timezone: The IANA name of the timezone, e.g. UTC.
    """
    executed.append(timezone)
    return json.dumps(dict(RESULT, timezone=timezone))


# -- fixtures: the toolcall checkpoint, one `voicechat serve` process for the model tests


@pytest.fixture(scope="module")
def toolcall_ckpt(tmp_path_factory):
    import voicechat
    from voicechat.synthetic.checkpoint import write_checkpoint

    path = write_checkpoint(
        tmp_path_factory.mktemp("lk_toolcall"), "toolcall", bits=8, tool=TOOLCALL_TOOL, arguments=TOOLCALL_ARGUMENTS
    )
    return path, voicechat.load(path)


@pytest.fixture(scope="module")
def lk_server(toolcall_ckpt, tmp_path_factory):
    # The client sends faster than real time: room for the whole input in the queue.
    p, port = serve(
        toolcall_ckpt[0], tmp_path_factory.mktemp("lk_srv"), "--max-sessions", "2", "--max-queued-audio-seconds", "30"
    )
    yield port
    stop(p)


# -- helpers


async def until(pred, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {timeout:g} s: {what}")
        await asyncio.sleep(0.02)


async def slots_free(base_url: str, timeout: float = 15.0) -> tuple[int, int]:
    """Poll /healthz until no slot is taken; -> (active_sessions, max_sessions)."""
    deadline = time.monotonic() + timeout
    while True:
        slots = await asyncio.to_thread(read_slots, base_url)
        if (slots is not None and slots[0] == 0) or time.monotonic() > deadline:
            return slots
        await asyncio.sleep(0.05)


def push(sess, pcm24: np.ndarray) -> None:
    """24 kHz PCM16 into a LiveKit session as AudioFrames of CHUNK samples (no resampling in LiveKit)."""
    for i in range(0, pcm24.size, CHUNK):
        part = np.ascontiguousarray(pcm24[i : i + CHUNK])
        sess.push_audio(rtc.AudioFrame(part.tobytes(), 24000, 1, part.size))


class Generation:
    """One `generation_created` event, read to its end as AgentSession's generation task reads it."""

    def __init__(self, ev: llm.GenerationCreatedEvent):
        self.ev, self.text, self.samples, self.calls = ev, "", 0, []
        self.task = asyncio.create_task(self._read())

    async def _read(self) -> None:
        async def message(m: llm.MessageGeneration) -> None:
            async def audio():
                async for f in m.audio_stream:
                    self.samples += f.samples_per_channel

            async def text():
                async for t in m.text_stream:
                    self.text += t

            await asyncio.gather(audio(), text())

        async def messages():
            readers = [asyncio.create_task(message(m)) async for m in self.ev.message_stream]
            await asyncio.gather(*readers)

        async def functions():
            async for c in self.ev.function_stream:
                self.calls.append(c)

        await asyncio.gather(messages(), functions())


def question_input(question_wav: np.ndarray, frames: int) -> np.ndarray:
    """The sample then silence, `frames` model frames long, as 24 kHz PCM16 cut to whole CHUNKs."""
    wave = np.zeros(frames * FRAME, np.float32)
    wave[: question_wav.size] = question_wav[: wave.size]
    pcm24 = pcm16(soxr.resample(wave, 16000, 24000))
    return pcm24[: pcm24.size // CHUNK * CHUNK]


def tool_reference(model, pcm24: np.ndarray, *, close: bool = False) -> SimpleNamespace:
    """The in-process session on the server's input: the same 24 kHz appends through the same resampling,
    the result submitted right after the append whose frames brought the call (where the client below
    answers it). -> upto (samples up to that append), call, said (what the model says after the result),
    tools (what the server opens its session with), result_done (the model's EOTR closing the result),
    timeline (every transcript delta with its start_ms; with `close`, the session.close flush included)."""
    from voicechat.server.resample import StreamResampler
    from voicechat.tools.channel import normalize_tools

    schema = llm.utils.build_legacy_openai_schema(get_current_time, internally_tagged=True)
    tools = [dict(t, type="function") for t in normalize_tools([schema])]
    s = model.create_streaming_session(system_prompt=INSTRUCTIONS, tools=tools)
    r = StreamResampler(24000, 16000)
    upto, call, every, after = None, None, [], []
    for i in range(0, pcm24.size, CHUNK):
        events = s.push_audio(r.push(pcm24[i : i + CHUNK].astype(np.float32) / 32768.0))
        every += events
        if upto is not None:
            after += events
        elif s.pending_tool_calls:
            upto = i + CHUNK
            call = next(e for e in events if e.kind == "tool_call")
            s.submit_tool_result(s.pending_tool_calls[0], json.dumps(RESULT))
    assert upto is not None, "precondition: the toolcall preset calls its tool within the input"
    if close:  # session.close: the resampler's last samples, the padded last frame
        every += s.push_audio(r.flush()) + s.flush()
    said = "".join(e.delta for e in after if e.kind == "assistant_text_delta")
    done = next((e for e in every if e.kind == "tool_result_done"), None)
    timeline = [(e.delta, e.frame_index * 80) for e in every if e.kind == "assistant_text_delta" and e.delta]
    return SimpleNamespace(upto=upto, call=call, said=said, tools=tools, result_done=done, timeline=timeline)


# -- RealtimeModel (Realtime GA): audio, transcripts, a tool round trip, generate_reply, close


def test_realtime_model_tool_round_trip_generate_reply_and_close(lk_server, toolcall_ckpt, question_wav):
    base_url = f"http://127.0.0.1:{lk_server}/v1"
    pcm24 = question_input(question_wav, 200)  # the call, the forced result (~60 frames), EOTR and speech fit
    ref = tool_reference(toolcall_ckpt[1], pcm24)
    upto, ref_call, ref_reply, ref_tools = ref.upto, ref.call, ref.said, ref.tools
    assert ref_reply, "precondition: the model speaks after the result"
    executed.clear()

    async def go():
        model = lk_openai.realtime.RealtimeModel(base_url=base_url, api_key="unused", conn_options=NO_RETRY)
        sess = model.session()
        sent, errors, gens, user = [], [], [], []
        sess.on("openai_client_event_queued", sent.append)
        sess.on("error", errors.append)
        sess.on("generation_created", lambda ev: gens.append(Generation(ev)))
        sess.on("input_audio_transcription_completed", user.append)
        # What AgentActivity does when the agent starts (voice/agent_activity.py, _start_session).
        await sess._update_session(
            instructions=INSTRUCTIONS, chat_ctx=llm.ChatContext.empty(), tools=[get_current_time]
        )
        push(sess, pcm24[:CHUNK])
        await until(lambda: gens, 30, "the model's first stretch (a response of its own)")
        first = gens[0]
        assert not first.ev.user_initiated
        # generate_reply() while that response is open: refused by name at once (the error carries the
        # response.create's event_id), not after LiveKit's 10 s generate_reply timeout.
        t0 = time.monotonic()
        with pytest.raises(llm.RealtimeError) as refused:
            await asyncio.wait_for(sess.generate_reply(), 5)
        assert refused.value.code == "conversation_already_has_active_response"
        refused_after = time.monotonic() - t0
        push(sess, pcm24[CHUNK:upto])
        await until(lambda: first.calls, 60, "the function call surfaced in the generation's function_stream")
        call = first.calls[0]
        # The tool, executed as AgentSession executes it, and its output sent back as AgentSession does.
        result = await llm.utils.execute_function_call(
            llm.FunctionToolCall(name=call.name, arguments=call.arguments, call_id=call.call_id),
            llm.ToolContext([get_current_time]),
        )
        output = result.fnc_call_out
        chat_ctx = sess.chat_ctx.copy()
        chat_ctx.items.append(output)
        await sess.update_chat_ctx(chat_ctx)  # returns once the server has the item (conversation.item.added)
        in_remote = sess.chat_ctx.get_by_id(output.id) is not None
        sess.interrupt()
        reply_fut = sess.generate_reply(tool_choice="auto")
        push(sess, pcm24[upto:])
        reply_ev = await asyncio.wait_for(reply_fut, 10)
        reply = next(g for g in gens if g.ev is reply_ev)
        await until(lambda: len(reply.text) >= len(ref_reply), 30, f"the reply's transcript ({ref_reply!r})")
        await asyncio.sleep(0.2)  # the reply's audio keeps coming; enough of it is here
        await sess.aclose()
        await model.aclose()
        await asyncio.wait_for(first.task, 5)  # the cancelled response's streams were closed
        slots = await slots_free(base_url)
        return call, output, in_remote, refused_after, reply_ev, reply, first, sent, errors, user, slots

    call, output, in_remote, refused_after, reply_ev, reply, first, sent, errors, user, slots = run(go())
    # The tool the LiveKit way: its schema reached the model, its call came back by name with the arguments.
    tools_sent = [e["session"]["tools"] for e in sent if e["type"] == "session.update" and "tools" in e["session"]]
    assert [dict(t, type="function") for t in tools_sent[0]] == ref_tools
    assert call.name == TOOLCALL_TOOL and json.loads(call.arguments) == TOOLCALL_ARGUMENTS
    assert call.call_id == ref_call.call_id
    assert executed == [TOOLCALL_ARGUMENTS["timezone"]]
    assert not output.is_error and json.loads(output.output) == RESULT and in_remote
    # The output as LiveKit sends it: a conversation.item.create of a function_call_output with its id.
    created = [e["item"] for e in sent if e["type"] == "conversation.item.create"]
    assert created == [
        {"id": output.id, "type": "function_call_output", "call_id": call.call_id, "output": output.output}
    ], created
    assert refused_after < 5
    # generate_reply resolved with the response the server opened for it, and the model spoke again:
    # audio, and the transcript the in-process session says after the result (the result reached it).
    assert reply_ev.user_initiated and reply_ev.response_id != first.ev.response_id
    assert reply.samples > 0 and first.samples > 0
    assert reply.text == ref_reply
    assert user and user[-1].is_final and user[-1].transcript, "the user's transcript (RNNT) reached LiveKit"
    # The only error is the refused generate_reply above.
    codes = [getattr(e.error, "body", None) for e in errors]
    assert len(errors) == 1 and getattr(codes[0], "code", None) == "conversation_already_has_active_response", errors
    assert slots == (0, 2), f"/healthz after aclose: {slots}"


# -- GPTLiveModel (OpenAI Live) in the adapter AgentSession puts around a duplex model


def test_gpt_live_model_audio_transcripts_and_close(lk_server, question_wav):
    base_url = f"http://127.0.0.1:{lk_server}/v1"
    pcm24 = question_input(question_wav, 60)

    async def go():
        live = lk_openai.realtime.GPTLiveModel(base_url=base_url, api_key="unused", conn_options=NO_RETRY)
        adapter = llm.DuplexRealtimeAdapter(live)  # what AgentSession(llm=GPTLiveModel(...)) wraps it in
        sess = adapter.session()
        raw, sent, errors, gens, user = [], [], [], [], []
        sess.duplex_session.on("openai_server_event_received", raw.append)
        sess.duplex_session.on("openai_client_event_queued", sent.append)
        sess.on("error", errors.append)
        sess.on("generation_created", lambda ev: gens.append(Generation(ev)))
        sess.on("input_audio_transcription_completed", user.append)
        await sess._update_session(instructions=INSTRUCTIONS, chat_ctx=llm.ChatContext.empty(), tools=[])
        # GPT Live's context appends (its generate_reply) have no counterpart here: refused by name, and
        # LiveKit goes on (a recoverable error).
        sess.duplex_session.append_commentary("Say hello.")
        push(sess, pcm24)
        await until(lambda: any(g.samples and g.text for g in gens), 60, "a speech burst with audio and words")
        await until(lambda: user, 30, "the user's transcript")
        await sess.aclose()
        await adapter.aclose()
        slots = await slots_free(base_url)
        return raw, sent, errors, gens, user, slots

    raw, sent, errors, gens, user, slots = run(go())
    types = [e["type"] for e in raw]
    assert types[0] == "session.started", types[:3]
    assert sent[0]["type"] == "session.start" and sent[0]["session"]["instructions"] == INSTRUCTIONS
    assert raw[0]["session"]["instructions"] == INSTRUCTIONS
    # The close LiveKit sends (session.close) is answered by session.closed before the socket closes.
    assert "session.close" in [e["type"] for e in sent] and types[-1] == "session.closed", types[-3:]
    refused = [e["error"]["code"] for e in raw if e["type"] == "error"]
    assert refused == ["unsupported_event"] and len(errors) == 1 and errors[0].recoverable, (refused, errors)
    assert types.count("session.output_audio.delta") > 0
    spoke = [g for g in gens if g.samples]
    assert spoke and any(g.text for g in spoke)
    assert any(u.transcript for u in user)
    assert slots == (0, 2), f"/healthz after aclose: {slots}"


def test_gpt_live_model_tool_round_trip_and_close(lk_server, toolcall_ckpt, question_wav):
    """GPTLiveModel's default Responses delegation: the agent's tool in session.start's delegation, the
    model's call (session.delegation.created + response.event) surfaced as LiveKit's function_call, run
    with LiveKit's execute_function_call, its output sent back the way agent_activity sends it (the
    adapter's update_chat_ctx -> response.item.create + response.create); no generate_reply, the model
    goes on by itself (auto_tool_reply_generation) and says what the in-process session says."""
    base_url = f"http://127.0.0.1:{lk_server}/v1"
    pcm24 = question_input(question_wav, 200)
    ref = tool_reference(toolcall_ckpt[1], pcm24, close=True)
    after_result = [d for d in ref.timeline if d[1] > ref.result_done.frame_index * 80]
    assert after_result, "precondition: the model speaks after the result"
    executed.clear()

    async def go():
        live = lk_openai.realtime.GPTLiveModel(base_url=base_url, api_key="unused", conn_options=NO_RETRY)
        adapter = llm.DuplexRealtimeAdapter(live)
        sess = adapter.session()
        raw, sent, errors, gens, said = [], [], [], [], []
        sess.duplex_session.on("openai_server_event_received", raw.append)
        sess.duplex_session.on("openai_client_event_queued", sent.append)
        sess.duplex_session.on("transcript_delta", said.append)
        sess.on("error", errors.append)
        sess.on("generation_created", lambda ev: gens.append(Generation(ev)))
        # AgentActivity's start: instructions, the (empty) chat context and the agent's tools, then audio.
        await sess._update_session(
            instructions=INSTRUCTIONS, chat_ctx=llm.ChatContext.empty(), tools=[get_current_time]
        )
        push(sess, pcm24[: ref.upto])
        await until(lambda: any(g.calls for g in gens), 60, "the function call on a generation's function_stream")
        call = next(g for g in gens if g.calls).calls[0]
        # agent_activity (_realtime_generation_task): execute, then the session's chat_ctx plus the outputs.
        result = await llm.utils.execute_function_call(
            llm.FunctionToolCall(name=call.name, arguments=call.arguments, call_id=call.call_id),
            llm.ToolContext([get_current_time]),
        )
        output = result.fnc_call_out
        chat_ctx = sess.chat_ctx.copy()
        chat_ctx.items.append(output)
        await sess.update_chat_ctx(chat_ctx)
        push(sess, pcm24[ref.upto :])
        # The model's words up to its last one after the result (a model that never got the result says
        # something else, or nothing: then the message says what the in-process session says there).
        last_ms, words = after_result[-1][1], "".join(d for d, _ in after_result)
        await until(
            lambda: any(d.start_ms >= last_ms for d in said), 30, f"the model's words after the result {words!r}"
        )
        await sess.aclose()  # session.close, and LiveKit waits for session.closed
        await adapter.aclose()
        slots = await slots_free(base_url)
        return call, output, raw, sent, errors, said, slots

    call, output, raw, sent, errors, said, slots = run(go())
    assert not errors, errors
    assert "error" not in [e["type"] for e in raw], [e for e in raw if e["type"] == "error"]
    # The tool went out in session.start's Responses delegation, as the server opens the session with it.
    start = sent[0]
    assert start["type"] == "session.start" and start["session"]["delegation"]["type"] == "responses"
    tools_sent = start["session"]["delegation"]["responses"]["tools"]
    assert [dict(t, type="function") for t in tools_sent] == ref.tools
    assert raw[0]["type"] == "session.started" and raw[0]["session"]["delegation"]["responses"]["tools"] == tools_sent
    # The call: by name, with the arguments and the call_id of the in-process session; run once by LiveKit.
    assert call.name == TOOLCALL_TOOL and json.loads(call.arguments) == TOOLCALL_ARGUMENTS
    assert call.call_id == ref.call.call_id
    assert executed == [TOOLCALL_ARGUMENTS["timezone"]]
    assert not output.is_error and json.loads(output.output) == RESULT
    # The output as LiveKit's GPT Live sends it: one response.item.create, then response.create (continue).
    backend = [e for e in sent if e["type"] in ("response.item.create", "response.create")]
    assert [e["type"] for e in backend] == ["response.item.create", "response.create"], backend
    assert backend[0]["item"] == {"type": "function_call_output", "call_id": call.call_id, "output": output.output}
    # Nothing went to the voice model as context (no session.*.append: the server refuses those).
    assert not [e for e in sent if e["type"].endswith(".append") and e["type"] != "session.input_audio.append"]
    # The result reached the model at the frame it does in-process: the transcript LiveKit surfaced is the
    # in-process session's, word for word and frame for frame, through its words after the result (the
    # server's events after LiveKit's close began are not LiveKit's to handle, and may be cut by its 5 s).
    got = [(d.text, d.start_ms) for d in said]
    assert got == ref.timeline[: len(got)]
    assert set(after_result) <= set(got), (got, after_result)
    wire = [(e["delta"], e["start_ms"]) for e in raw if e["type"] == "session.output_transcript.delta"]
    assert wire == ref.timeline[: len(wire)] and len(wire) >= len(got)
    # Clean close: session.close answered by session.closed, the slot free.
    assert "session.close" in [e["type"] for e in sent] and raw[-1]["type"] == "session.closed", raw[-3:]
    assert slots == (0, 2), f"/healthz after aclose: {slots}"


# -- the slot load and LiveKit's availability rule


async def livekit_availability(load_fnc, load_threshold: float) -> tuple[bool, float, bool, bool]:
    """What LiveKit's own AgentServer code decides from `load_fnc` (livekit/agents/worker.py): the status
    it reports (`_update_worker_status`: WS_FULL when load >= load_threshold) and its answer to a job
    (`_answer_availability`: refused before the request_fnc when not `_is_available()`).

    No LiveKit server: the AgentServer gets the few attributes run() sets before it connects (no job
    processes, no connection); these names are the pinned 1.8.9's. -> (status is available, the load it
    reports, the job reached the request_fnc, the job was answered available=False)."""
    server = AgentServer(load_fnc=load_fnc, load_threshold=load_threshold)
    server._devmode = False
    server._loop = asyncio.get_running_loop()
    server._msg_chan = lk_utils.aio.Chan(128)
    server._proc_pool = SimpleNamespace(processes=[])
    server._job_lifecycle_tasks = set()
    server._reserved_slots = 0
    server._worker_load = 0.0
    server._previous_status = lk_agent.WorkerStatus.WS_AVAILABLE
    asked = []

    async def on_request(req):
        asked.append(req.id)
        await req.reject(terminate=False)  # the test asks only whether the request got this far

    server._request_fnc = on_request
    await server._refresh_worker_load()
    await server._update_worker_status()
    status = server._msg_chan.recv_nowait().update_worker
    await server._answer_availability(lk_agent.AvailabilityRequest(job=lk_agent.Job(id="job_1")))
    await asyncio.gather(*list(server._job_lifecycle_tasks))
    answer = server._msg_chan.recv_nowait().availability
    assert answer.job_id == "job_1"
    return status.status == lk_agent.WorkerStatus.WS_AVAILABLE, status.load, bool(asked), not answer.available


def test_slot_load_and_livekit_availability_follow_the_taken_slots(make_server):
    srv = make_server(max_sessions=3)
    base_url = f"ws://127.0.0.1:{srv.port}/v1"  # the URL a RealtimeModel is given works as it is
    load_fnc = slot_load_fnc(base_url)

    async def go():
        seen, held = [], []
        try:
            for k in range(4):
                await until(lambda k=k: srv.state.active_sessions == k, 10, f"{k} slots taken")
                load = await asyncio.to_thread(slot_load, base_url)
                decided = await livekit_availability(load_fnc, 1.0)
                seen.append((k, load, decided))
                if k < 3:  # take one more slot: a real session, held open
                    c = await Raw(srv.url + "?model=gpt-realtime").__aenter__()
                    assert (await c.recv())["type"] == "session.created"
                    held.append(c)
            # All taken: the next connection is refused by the server itself (the last guard) ...
            async with Raw(srv.url + "?model=gpt-realtime") as c:
                code, events = await c.closed(10)
            # ... and a LiveKit session there reports it (server_busy, then the close).
            model = lk_openai.realtime.RealtimeModel(base_url=base_url, api_key="unused", conn_options=NO_RETRY)
            sess = model.session()
            errors = []
            sess.on("error", errors.append)
            await until(lambda: any(not e.recoverable for e in errors), 15, "LiveKit's error for a full server")
            with contextlib.suppress(APIConnectionError):  # aclose re-raises the session's connection error
                await sess.aclose()
            await model.aclose()
        finally:
            for c in held:
                await c.__aexit__(None, None, None)
        await until(lambda: srv.state.active_sessions == 0, 15, "the slots freed")
        after = await asyncio.to_thread(slot_load, base_url)
        return seen, code, events, errors, after

    seen, code, events, errors, after = run(go())
    for k, load, (available, reported, reached_request, refused) in seen:
        assert load == pytest.approx(k / 3) and reported == pytest.approx(k / 3)
        # LiveKit's rule: available while load < load_threshold (1.0): every slot but the last taken.
        assert available == (k < 3) and reached_request == (k < 3), (k, load)
        assert refused  # the test's request_fnc rejects what it is asked: both paths answer the job
    assert code == 1013 and events[-1]["error"]["code"] == "server_busy"
    bodies = [getattr(e.error, "body", None) for e in errors]
    assert any(getattr(b, "code", None) == "server_busy" for b in bodies), errors
    assert after == 0.0


def test_slot_load_without_a_voicechat_server():
    import http.server
    import socket
    import threading

    # Nothing listens: full (LiveKit then sends no job to the machine), and said in the log, not raised.
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    dead = s.getsockname()[1]
    s.close()
    assert slot_load(f"http://127.0.0.1:{dead}/v1", timeout=1.0) == 1.0

    answer = {}

    class H(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            status, body = answer["now"] if self.path == "/healthz" else (404, b"")
            self.send_response(status)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *a):
            pass

    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), H)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{httpd.server_address[1]}/v1"
    try:
        # Not voicechat's /healthz: a clear error from slot_load; full (1.0) from LiveKit's load_fnc.
        for status, body, message in (
            (200, b"<html>not json</html>", "not JSON"),
            (200, b'{"status": "ok"}', "slot counts"),
            (200, b'{"active_sessions": 0, "max_sessions": 0}', "max_sessions >= 1"),
            (200, b'{"active_sessions": true, "max_sessions": 2}', "slot counts"),
            (404, b"no", "HTTP 404"),
        ):
            answer["now"] = (status, body)
            with pytest.raises(SlotLoadError, match=message):
                slot_load(url)
            assert slot_load_fnc(url)(None) == 1.0
        answer["now"] = (503, b'{"status": "unavailable", "active_sessions": 0, "max_sessions": 2}')
        assert slot_load(url) == 1.0  # the model is loading or failed: full
        answer["now"] = (200, b'{"status": "busy", "active_sessions": 5, "max_sessions": 4}')
        assert slot_load(url) == 1.0  # more taken than slots (a restart with fewer): clamped
        answer["now"] = (200, b'{"status": "ok", "active_sessions": 1, "max_sessions": 4}')
        assert slot_load(url) == 0.25
        # LiveKit's load_fnc also counts the worker's jobs whose sessions have not connected yet.
        assert slot_load_fnc(url)(SimpleNamespace(active_jobs=[1, 2, 3])) == 0.75
    finally:
        httpd.shutdown()
    with pytest.raises(ValueError, match="not a server URL"):
        slot_load("127.0.0.1:8000")


# -- examples/livekit_agent.py, without a LiveKit server


def load_example():
    spec = importlib.util.spec_from_file_location("livekit_agent_example", ROOT / "examples" / "livekit_agent.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_livekit_example_wires_the_slot_load_and_the_agent(make_server, monkeypatch):
    srv = make_server(max_sessions=2)
    monkeypatch.setenv("VOICECHAT_URL", f"http://127.0.0.1:{srv.port}/v1")
    monkeypatch.setenv("OPENAI_API_KEY", "unused")
    ex = load_example()
    server = ex.server
    assert isinstance(server, AgentServer)
    assert server._load_threshold == 1.0 and server._entrypoint_fnc is ex.entrypoint
    assert server.load_fnc(server) == 0.0  # the example's server, read through /healthz

    async def go():
        async with Raw(srv.url + "?model=gpt-realtime") as c:
            assert (await c.recv())["type"] == "session.created"
            held = await asyncio.to_thread(server.load_fnc, server)
        return held

    assert run(go()) == 0.5
    agent = ex.VoiceAgent()
    assert agent.instructions == ex.INSTRUCTIONS
    assert [t.info.name for t in agent.tools] == ["get_current_time"]
    model = ex.make_model()
    assert isinstance(model, lk_openai.realtime.RealtimeModel)
    url = lk_openai.realtime.realtime_model.process_base_url(model._opts.base_url, model.model)
    assert url.startswith(f"ws://127.0.0.1:{srv.port}/v1/realtime?model=")
