"""A pipecat voice agent on `voicechat serve`: a WAV file in, the model's speech to a WAV file out.

In one terminal:

    voicechat serve -m mlx-community/NemotronLabs-VoiceChat-11B-4bit

In another (pip install "pipecat-ai[openai,websocket]==1.14.0"):

    python examples/pipecat_agent.py --input voicechat/samples/question.wav --output answer.wav
    python examples/pipecat_agent.py --service live --input question.wav --output answer.wav

`--service realtime` (default) is pipecat's OpenAIRealtimeLLMService on /v1/realtime (OpenAI
Realtime GA); `--service live` is its OpenAILiveLLMService on /v1/live/sessions (OpenAI Live). The
file is played at real time, then `--tail-seconds` of silence while the model answers; the
model's function calls run `get_current_time` below. The synthetic checkpoints refuse tools (pass
`--no-tools` to a plain `voicechat serve`) except the toolcall preset, which always calls one:
`voicechat synth tc --preset toolcall --tool get_current_time --arguments '{"timezone": "UTC"}'`,
then `voicechat serve -m tc`. docs/server.md, "Clients", "pipecat", says more.
"""

import argparse
import asyncio
import datetime
import wave

from pipecat.adapters.llm.schemas.function_schema import FunctionSchema
from pipecat.adapters.llm.schemas.tools_schema import ToolsSchema
from pipecat.frames.frames import (
    EndFrame,
    InputAudioRawFrame,
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
from pipecat.processors.frame_processor import FrameProcessor
from pipecat.services.openai.live.llm import OpenAILiveLLMService
from pipecat.services.openai.realtime.llm import OpenAIRealtimeLLMService
from pipecat.services.openai.responses.llm import OpenAIResponsesLLMService
from pipecat.workers.runner import WorkerRunner

INSTRUCTIONS = "You are a helpful voice assistant. Answer briefly."
TIME_TOOL = FunctionSchema(
    name="get_current_time",
    description="Get the current time in a timezone",
    properties={"timezone": {"type": "string"}},
    required=["timezone"],
)


async def get_current_time(params):
    print(f"get_current_time({dict(params.arguments)})")
    await params.result_callback({"datetime": datetime.datetime.now(datetime.UTC).isoformat()})


class WavPlayer(FrameProcessor):
    """Plays a 16-bit mono WAV as microphone frames (20 ms each, real time) once `ready` is set, then silence."""

    def __init__(self, path, tail_seconds, ready):
        super().__init__()
        with wave.open(path) as w:
            assert w.getsampwidth() == 2 and w.getnchannels() == 1, "a 16-bit mono WAV"
            self.rate, pcm = w.getframerate(), w.readframes(w.getnframes())
        self.pcm = pcm + bytes(2 * int(tail_seconds * self.rate))
        self.ready, self.done, self.task = ready, asyncio.Event(), None

    async def process_frame(self, frame, direction):
        await super().process_frame(frame, direction)
        await self.push_frame(frame, direction)
        if isinstance(frame, StartFrame):
            self.task = self.create_task(self.play())

    async def play(self):
        await self.ready.wait()  # the server takes the instructions and tools from the session at the first audio
        step = 2 * self.rate // 50
        for i in range(0, len(self.pcm), step):
            await self.push_frame(InputAudioRawFrame(self.pcm[i : i + step], self.rate, 1))
            await asyncio.sleep(0.02)
        self.done.set()


class Recorder(FrameProcessor):
    """Keeps the model's audio and prints what it says and what it heard."""

    def __init__(self, ready):
        super().__init__()
        self.ready, self.audio, self.rate = ready, bytearray(), 24000

    async def process_frame(self, frame, direction):
        await super().process_frame(frame, direction)
        if isinstance(frame, OutputAudioRawFrame):
            self.audio += frame.audio
            self.rate = frame.sample_rate
        elif isinstance(frame, TTSTextFrame):
            print(frame.text, end="", flush=True)
        elif isinstance(frame, TranscriptionFrame):
            print(f"\n[user] {frame.text}")
        elif isinstance(frame, LLMFullResponseStartFrame):
            self.ready.set()  # Realtime: pipecat's session.update is on the server
        await self.push_frame(frame, direction)


async def main(args):
    ready = asyncio.Event()
    if args.service == "live":  # the tools travel in a Responses delegation; the model is its own backend
        settings = OpenAILiveLLMService.Settings(system_instruction=INSTRUCTIONS)
        backend = OpenAILiveLLMService.ResponsesDelegation(OpenAIResponsesLLMService.Settings(model="voicechat"))
        url = f"{args.url}/v1/live/sessions"
        llm = OpenAILiveLLMService(api_key=args.api_key, base_url=url, settings=settings, delegation=backend)
        llm.add_event_handler("on_session_started", lambda *_: ready.set())
    else:
        settings = OpenAIRealtimeLLMService.Settings(system_instruction=INSTRUCTIONS)
        llm = OpenAIRealtimeLLMService(api_key=args.api_key, base_url=f"{args.url}/v1/realtime", settings=settings)
    llm.register_function("get_current_time", get_current_time)
    context = LLMContext() if args.no_tools else LLMContext(tools=ToolsSchema([TIME_TOOL]))
    user, assistant = LLMContextAggregatorPair(context)
    player, recorder, heard = WavPlayer(args.input, args.tail_seconds, ready), Recorder(ready), Recorder(ready)
    worker = PipelineWorker(
        Pipeline([player, user, heard, llm, recorder, assistant]),  # `heard` sees the user transcript (upstream)
        params=PipelineParams(audio_in_sample_rate=player.rate, audio_out_sample_rate=24000),
        enable_rtvi=False,
    )
    runner = WorkerRunner(handle_sigint=False)
    await runner.add_workers(worker)
    await worker.queue_frame(LLMRunFrame())

    async def end_when_played():
        await player.done.wait()
        await worker.queue_frame(EndFrame())

    ender = asyncio.create_task(end_when_played())
    await runner.run()
    ender.cancel()
    with wave.open(args.output, "wb") as w:
        w.setnchannels(1), w.setsampwidth(2), w.setframerate(recorder.rate)
        w.writeframes(bytes(recorder.audio))
    print(f"\nwrote {len(recorder.audio) // 2 / recorder.rate:.2f} s to {args.output}")


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--url", default="ws://127.0.0.1:8080", help="the server, ws:// or wss://")
    ap.add_argument("--service", choices=("realtime", "live"), default="realtime")
    ap.add_argument("--input", required=True, help="16-bit mono WAV, any rate")
    ap.add_argument("--output", required=True, help="the model's speech, 16-bit mono WAV at 24 kHz")
    ap.add_argument("--tail-seconds", type=float, default=3.0, help="silence after the file")
    ap.add_argument("--api-key", default="unused", help="the server's --api-key, if it has one")
    ap.add_argument("--no-tools", action="store_true", help="for a model that takes no tools")
    asyncio.run(main(ap.parse_args()))
