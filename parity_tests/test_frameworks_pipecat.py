"""pipecat (pinned in the `frameworks` extra) against `voicechat serve` (docs/server.md, "Clients", "pipecat").

Real pipecat pipelines (`PipelineWorker` run by a `WorkerRunner`) with pipecat's own services,
over real sockets to `voicechat serve` processes on 127.0.0.1:

* `OpenAIRealtimeLLMService` on `/v1/realtime` (the GA dialect) and `OpenAILiveLLMService` on
  `/v1/live/sessions` (the Live dialect), `small` preset: the sample question goes in as
  `InputAudioRawFrame`s, and the output audio frames equal the in-process session's output for the
  same input (exactly, after the documented resampling); the user transcript and the model's text
  arrive as pipecat frames and equal the session's.
* `toolcall` preset through both services: the function registered with `llm.register_function`
  (its schema in the `LLMContext`) is called with the model's name, arguments and call id, its
  result goes back to the server (what the model says next equals the in-process session given the
  same result at the same frame; GA also echoes the item).
* `examples/pipecat_agent.py` run as a subprocess against a server, per service: the function is
  called and the model's speech written.

Each pipeline ends with an `EndFrame` and the server's slot is free afterwards (`/healthz`).
pipecat is imported here unconditionally: without the `frameworks` extra this module fails.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time
import urllib.request
import wave

import numpy as np
import pytest
import soxr
from pipecat.adapters.llm.schemas.function_schema import FunctionSchema
from pipecat.adapters.llm.schemas.tools_schema import ToolsSchema
from pipecat.frames.frames import (
    EndFrame,
    Frame,
    FunctionCallResultFrame,
    InputAudioRawFrame,
    InterimTranscriptionFrame,
    LLMFullResponseStartFrame,
    LLMRunFrame,
    OutputAudioRawFrame,
    StartFrame,
    TranscriptionFrame,
    TTSTextFrame,
)
from pipecat.pipeline.pipeline import Pipeline
from pipecat.pipeline.worker import PipelineParams, PipelineWorker
from pipecat.processors.aggregators.llm_context import LLMContext
from pipecat.processors.aggregators.llm_response_universal import LLMContextAggregatorPair
from pipecat.processors.frame_processor import FrameDirection, FrameProcessor
from pipecat.services.llm_service import FunctionCallParams
from pipecat.services.openai.live.llm import OpenAILiveLLMService
from pipecat.services.openai.realtime.llm import OpenAIRealtimeLLMService
from pipecat.services.openai.responses.llm import OpenAIResponsesLLMService
from pipecat.workers.runner import WorkerRunner

from parity_tests.conftest import REPO, TIME_TOOL, TOOLCALL_ARGUMENTS, TOOLCALL_TOOL

from .server_util import FRAME, pcm16
from .test_server_dialects import frames_audio, reference, reported_transcript, serve, stop

pytestmark = pytest.mark.frameworks

RATE = 24000  # pipecat's OpenAI services speak PCM16 at 24 kHz both ways
CHUNK = 960  # 40 ms appends


# -- servers


@pytest.fixture(scope="module")
def small(tmp_path_factory):
    """The small preset (the real frame geometry), its in-process model and a server on it.
    --silence-frames 10000: one GA response from the model's first non-silent frame on."""
    import voicechat
    from voicechat.synthetic.checkpoint import write_checkpoint

    path = write_checkpoint(tmp_path_factory.mktemp("pipecat_small"), "small")
    p, port = serve(path, tmp_path_factory.mktemp("pipecat_small_srv"), "--silence-frames", "10000")
    yield path, voicechat.load(path), port
    stop(p)


@pytest.fixture(scope="module")
def toolcall(tmp_path_factory):
    import voicechat
    from voicechat.synthetic.checkpoint import write_checkpoint

    path = write_checkpoint(
        tmp_path_factory.mktemp("pipecat_toolcall"),
        "toolcall",
        bits=8,
        tool=TOOLCALL_TOOL,
        arguments=TOOLCALL_ARGUMENTS,
    )
    # The pipeline below sends faster than real time: room for the whole input in the backlog.
    p, port = serve(path, tmp_path_factory.mktemp("pipecat_toolcall_srv"), "--max-queued-audio-seconds", "30")
    yield path, voicechat.load(path), port
    stop(p)


def healthz(port) -> dict:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=5) as r:
        return json.loads(r.read())


def slot_freed(port, timeout=10.0) -> bool:
    deadline = time.monotonic() + timeout
    while healthz(port)["active_sessions"] > 0:
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


# -- the pipeline's ends


class AudioSource(FrameProcessor):
    """Plays PCM16 at 24 kHz as `InputAudioRawFrame`s once `ready` is set, `CHUNK` samples a frame at
    twice real time; stops before sample `pause_at` until `resume` is set."""

    def __init__(self, pcm: np.ndarray, ready: asyncio.Event, *, pause_at=None, resume=None):
        super().__init__()
        self.pcm, self.ready, self.pause_at, self.resume = pcm, ready, pause_at, resume
        self.done = asyncio.Event()
        self._task = None

    async def process_frame(self, frame: Frame, direction: FrameDirection):
        await super().process_frame(frame, direction)
        await self.push_frame(frame, direction)
        if isinstance(frame, StartFrame):
            self._task = self.create_task(self._play())

    async def _play(self):
        await self.ready.wait()
        for i in range(0, self.pcm.size, CHUNK):
            if i == self.pause_at:
                await self.resume.wait()
            audio = self.pcm[i : i + CHUNK].astype("<i2").tobytes()
            await self.push_frame(InputAudioRawFrame(audio=audio, sample_rate=RATE, num_channels=1))
            await asyncio.sleep(CHUNK / RATE / 2)
        self.done.set()

    async def cleanup(self):
        await super().cleanup()
        if self._task:
            await self.cancel_task(self._task)


class Recorder(FrameProcessor):
    """Keeps every frame that passes (both directions) and passes it on; `on_frame` sees each one."""

    def __init__(self, on_frame=None):
        super().__init__()
        self.frames: list[Frame] = []
        self.on_frame = on_frame

    async def process_frame(self, frame: Frame, direction: FrameDirection):
        await super().process_frame(frame, direction)
        self.frames.append(frame)
        if self.on_frame:
            self.on_frame(frame)
        await self.push_frame(frame, direction)

    def audio(self) -> np.ndarray:
        out = [np.frombuffer(f.audio, "<i2") for f in self.frames if isinstance(f, OutputAudioRawFrame)]
        return np.concatenate(out) if out else np.zeros(0, np.int16)

    def text(self, kind) -> str:
        return "".join(f.text for f in self.frames if type(f) is kind)


async def run_pipeline(llm, context, source, up, down, until, timeout=120.0):
    """source -> user aggregator -> up -> llm -> down -> assistant aggregator, started with an
    `LLMRunFrame`; once `until()` is true, an `EndFrame`; returns when the runner has finished."""
    user_agg, assistant_agg = LLMContextAggregatorPair(context)
    worker = PipelineWorker(
        Pipeline([source, user_agg, up, llm, down, assistant_agg]),
        params=PipelineParams(audio_in_sample_rate=RATE, audio_out_sample_rate=RATE),
        idle_timeout_secs=None,
        enable_rtvi=False,
    )
    runner = WorkerRunner(handle_sigint=False)
    await runner.add_workers(worker)

    async def end_when_done():
        while not until():
            await asyncio.sleep(0.05)
        await worker.queue_frame(EndFrame())

    await worker.queue_frames([LLMRunFrame()])
    ender = asyncio.create_task(end_when_done())
    try:
        await asyncio.wait_for(runner.run(), timeout)
    finally:
        ender.cancel()
    return worker


def sample_24k(question_wav) -> np.ndarray:
    return pcm16(soxr.resample(question_wav, 16000, RATE))


# -- Realtime GA: OpenAIRealtimeLLMService on /v1/realtime


def test_realtime_service_audio_and_transcripts_equal_in_process(small, question_wav):
    from voicechat.server.dialects.common import DialectOptions
    from voicechat.server.dialects.ga import GaMapper
    from voicechat.server.resample import StreamResampler

    _, model, port = small
    pcm24 = sample_24k(question_wav)
    events, _ = reference(model, pcm24, RATE, close=False)
    frames = [e for e in events if e.kind == "audio"]
    m = GaMapper(
        model_rate=22050,
        client_rate=RATE,
        silence_codes=np.asarray(model.tts_model.codec_silence_tokens),
        options=DialectOptions(),
    )
    k0 = next(i for i, e in enumerate(frames) if not m._silent(e))  # the response opens here
    out = StreamResampler(22050, RATE)
    sizes = [out.push(e.samples).size for e in frames]
    offset, expected_n = sum(sizes[:k0]), sum(sizes[k0:])
    expected = pcm16(soxr.resample(frames_audio(frames), 22050, RATE))[offset : offset + expected_n]
    user_text = "".join(e.delta for e in events if e.kind == "user_transcript_delta")
    text = "".join(e.delta for e in events if e.kind == "assistant_text_delta")
    assert expected_n > 20 * 1920 and user_text.strip() and text.strip()  # preconditions: something to compare

    async def go():
        ready = asyncio.Event()  # pipecat opened its first response: its session.update is on the server
        down = Recorder(lambda f: isinstance(f, LLMFullResponseStartFrame) and ready.set())
        up = Recorder()
        source = AudioSource(pcm24, ready)
        llm = OpenAIRealtimeLLMService(api_key="unused", base_url=f"ws://127.0.0.1:{port}/v1/realtime")
        await run_pipeline(llm, LLMContext(), source, up, down, lambda: down.audio().size >= expected_n)
        return up, down

    up, down = asyncio.run(go())
    audio = down.audio()
    assert audio.size == expected_n
    assert np.array_equal(audio, expected), np.abs(audio.astype(int) - expected).max()
    assert down.text(TTSTextFrame) == text
    # The user's side: pipecat pushes the transcript upstream, as deltas and as the final item's text.
    assert "".join(f.text for f in up.frames if type(f) is InterimTranscriptionFrame) == user_text
    assert slot_freed(port), healthz(port)


# -- Live: OpenAILiveLLMService on /v1/live/sessions


def test_live_service_audio_and_transcripts_equal_in_process(small, question_wav):
    _, model, port = small
    pcm24 = sample_24k(question_wav)
    events, _ = reference(model, pcm24, RATE, close=True)
    expected = pcm16(soxr.resample(frames_audio(events), 22050, RATE))
    user_text = "".join(e.delta for e in events if e.kind == "user_transcript_delta")
    text = "".join(e.delta for e in events if e.kind == "assistant_text_delta")
    assert user_text.strip() and text.strip()

    async def go():
        ready = asyncio.Event()
        up, down = Recorder(), Recorder()
        source = AudioSource(pcm24, ready)
        llm = OpenAILiveLLMService(api_key="unused", base_url=f"ws://127.0.0.1:{port}/v1/live/sessions")

        @llm.event_handler("on_session_started")
        async def on_session_started(service, session):
            ready.set()

        # End once the input is in and the audio of all but the last frames is back; pipecat's stop
        # sends session.close and waits for session.closed, so the rest (and the codec's tail) comes then.
        await run_pipeline(
            llm,
            LLMContext(),
            source,
            up,
            down,
            lambda: source.done.is_set() and down.audio().size >= expected.size - 4 * 1920,
        )
        return up, down

    up, down = asyncio.run(go())
    audio = down.audio()
    assert audio.size == expected.size
    assert np.array_equal(audio, expected), np.abs(audio.astype(int) - expected).max()
    assert down.text(TTSTextFrame) == text
    # The user's turns as pipecat closes them (TranscriptionFrame after 0.8 s without a fragment), and the
    # turn still open at the end (the deltas of the frames session.close runs come after pipecat's stop
    # closed its turns: its cumulative InterimTranscriptionFrame).
    finals, open_turn = [], ""
    for f in up.frames:
        if type(f) is InterimTranscriptionFrame:
            open_turn = f.text
        elif type(f) is TranscriptionFrame:
            finals, open_turn = [*finals, f.text], ""
    assert finals and "".join(finals) + open_turn == user_text, (finals, open_turn)
    assert slot_freed(port), healthz(port)


# -- a function call through pipecat's function registry (toolcall preset)


RESULT = {"datetime": "2026-12-03T12:00:00+00:00"}


@pytest.fixture(scope="module")
def tool_reference(toolcall, question_wav):
    """(24 kHz input, the in-process session's events, the sample after which the result goes in): the
    result is submitted after the append whose frames brought the call (the pipelines below pause their
    audio there until pipecat has sent the result)."""
    from voicechat.server.resample import StreamResampler

    wave = np.zeros(200 * FRAME, np.float32)  # the forced result (~60 tokens, one a frame) and EOTR fit
    wave[: question_wav.size] = question_wav
    pcm24 = pcm16(soxr.resample(wave, 16000, RATE))
    r = StreamResampler(RATE, 16000)
    s = toolcall[1].create_streaming_session(tools=[TIME_TOOL])
    ev, upto = [], None
    for i in range(0, pcm24.size, CHUNK):
        ev += s.push_audio(r.push(pcm24[i : i + CHUNK].astype(np.float32) / 32768.0))
        if s.pending_tool_calls and upto is None:
            upto = i + CHUNK
            s.submit_tool_result(s.pending_tool_calls[0], json.dumps(RESULT))
    return pcm24, ev, upto


@pytest.mark.parametrize("service", ["realtime", "live"])
def test_service_runs_the_registered_function_and_returns_its_result(service, toolcall, tool_reference):
    """GA: the call is a function_call item, the result a function_call_output item (echoed by the server).
    Live: pipecat's ResponsesDelegation (the tools go in session.start's delegation), the call is a
    delegation's wrapped `response.output_item.done`, the result `response.item.create` (not acknowledged
    in Live: what the model says next shows it arrived)."""
    _, model, port = toolcall
    pcm24, ev, upto = tool_reference
    result = RESULT
    call = next(e for e in ev if e.kind == "tool_call")
    eotr = next(e for e in ev if e.kind == "tool_result_done")
    # What the model says: GA reports the text of its speech stretches; Live every text delta.
    with_result = (
        reported_transcript(model, ev)
        if service == "realtime"
        else "".join(e.delta for e in ev if e.kind == "assistant_text_delta")
    )
    assert any(e.kind == "assistant_text_delta" and e.delta and e.frame_index > eotr.frame_index for e in ev)

    calls, items = [], []

    async def get_current_time(params: FunctionCallParams):
        calls.append((params.function_name, dict(params.arguments), params.tool_call_id))
        await params.result_callback(result)

    async def go():
        ready, resume = asyncio.Event(), asyncio.Event()

        def seen(f):
            if isinstance(f, LLMFullResponseStartFrame) and service == "realtime":
                ready.set()
            if isinstance(f, FunctionCallResultFrame):  # downstream of the llm: the result is sent
                resume.set()

        down, up = Recorder(seen), Recorder()
        source = AudioSource(pcm24, ready, pause_at=upto, resume=resume)
        if service == "realtime":
            llm = OpenAIRealtimeLLMService(api_key="unused", base_url=f"ws://127.0.0.1:{port}/v1/realtime")

            @llm.event_handler("on_conversation_item_created")
            async def on_item(_, item_id, item):
                items.append(item)

        else:
            backend = OpenAIResponsesLLMService.Settings(model="voicechat")  # the model is its own backend
            llm = OpenAILiveLLMService(
                api_key="unused",
                base_url=f"ws://127.0.0.1:{port}/v1/live/sessions",
                delegation=OpenAILiveLLMService.ResponsesDelegation(settings=backend),
            )
            llm.add_event_handler("on_session_started", lambda *_: ready.set())
        llm.register_function(TOOLCALL_TOOL, get_current_time)

        # The schema in the context, as pipecat sends it: TIME_TOOL, the tool the reference session has.
        params = TIME_TOOL["parameters"]
        schema = FunctionSchema(TOOLCALL_TOOL, TIME_TOOL["description"], params["properties"], params["required"])
        tools = ToolsSchema(standard_tools=[schema])
        await run_pipeline(
            llm,
            LLMContext(tools=tools),
            source,
            up,
            down,
            lambda: len(down.text(TTSTextFrame)) >= len(with_result) or source.done.is_set(),
        )
        return down

    down = asyncio.run(go())
    assert calls == [(TOOLCALL_TOOL, TOOLCALL_ARGUMENTS, call.call_id)]
    if service == "realtime":
        echoed = [i for i in items if i.type == "function_call_output"]
        assert [(i.call_id, json.loads(i.output)) for i in echoed] == [(call.call_id, result)]
    assert down.text(TTSTextFrame) == with_result  # the result reached the model at the same frame
    assert slot_freed(port), healthz(port)


# -- examples/pipecat_agent.py, as a user runs it


@pytest.mark.parametrize("service", ["realtime", "live"])
def test_example_agent_calls_its_function_and_writes_the_speech(service, toolcall, tmp_path):
    from voicechat.samples import sample_path

    _, _, port = toolcall
    out = tmp_path / "answer.wav"
    cmd = [sys.executable, str(REPO / "examples" / "pipecat_agent.py"), "--url", f"ws://127.0.0.1:{port}"]
    cmd += ["--service", service, "--input", str(sample_path("question.wav")), "--output", str(out)]
    cmd += ["--tail-seconds", "6"]
    p = subprocess.run(cmd, check=False, capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert p.returncode == 0, p.stderr[-3000:]
    # The toolcall model spells its call one token a frame: the call comes 6.2 s in (8.2 s played).
    assert f"get_current_time({TOOLCALL_ARGUMENTS})" in p.stdout, p.stdout
    with wave.open(str(out)) as w:
        assert (w.getframerate(), w.getnchannels(), w.getsampwidth()) == (RATE, 1, 2)
        audio = np.frombuffer(w.readframes(w.getnframes()), "<i2")
    assert audio.size and np.count_nonzero(audio), audio.size
    assert slot_freed(port), healthz(port)
