"""A LiveKit Agents voice agent whose speech model is a local `voicechat serve` (docs/deploy.md).

Pinned: livekit-agents==1.8.9, livekit-plugins-openai==1.8.9 (`pip install -e ".[serve,frameworks]"`).

1. The model server, N conversations at once (one slot each):

       voicechat serve -m CHECKPOINT --port 8000 --max-sessions 4

2. The worker, on the same machine, registered with your LiveKit server:

       export LIVEKIT_URL=wss://YOUR-PROJECT.livekit.cloud   # or ws://127.0.0.1:7880 for `livekit-server --dev`
       export LIVEKIT_API_KEY=...  LIVEKIT_API_SECRET=...
       export VOICECHAT_URL=http://127.0.0.1:8000/v1          # the default
       export OPENAI_API_KEY=unused                           # or the server's --api-key
       python examples/livekit_agent.py dev                   # `start` in production

   Then join a room of that LiveKit project (the Agents Playground, or any LiveKit client): LiveKit
   dispatches the room to this worker, whose AgentSession talks to `voicechat serve` over its
   OpenAI Realtime GA dialect (/v1/realtime). `openai.realtime.GPTLiveModel(base_url=VOICECHAT_URL)`
   works too (OpenAI Live on /v1/live/sessions, the agent's tools through its default Responses
   delegation); its `generate_reply` and context appends are refused (docs/server.md, "LiveKit Agents").

The worker reports the model server's slots as its load (`slot_load_fnc`: active_sessions /
max_sessions from GET /healthz, or the worker's own jobs if more); with `load_threshold=1.0` LiveKit
marks it full (WS_FULL, job requests refused) when every slot is taken, and available again when one
frees. If the model server does not answer, the worker reports itself full. (LiveKit's built-in CLI
is deprecated in favour of `lk agent` / `python -m livekit.agents`; it still runs this file.)
"""

from __future__ import annotations

import datetime
import json
import os
import zoneinfo

from livekit.agents import Agent, AgentServer, AgentSession, JobContext, cli, function_tool
from livekit.plugins import openai

from voicechat.server.load import slot_load_fnc

VOICECHAT_URL = os.environ.get("VOICECHAT_URL", "http://127.0.0.1:8000/v1")
INSTRUCTIONS = "You are a friendly voice assistant. When asked for the time, call get_current_time."


@function_tool
async def get_current_time(timezone: str) -> str:
    """Get the current time in a timezone.

    Args:
        timezone: The IANA name of the timezone, e.g. Europe/Paris or UTC.
    """
    try:
        tz = zoneinfo.ZoneInfo(timezone)
    except (zoneinfo.ZoneInfoNotFoundError, ValueError):
        return json.dumps({"error": f"unknown timezone {timezone!r}"})
    return json.dumps({"datetime": datetime.datetime.now(tz).isoformat(timespec="seconds"), "timezone": timezone})


class VoiceAgent(Agent):
    def __init__(self) -> None:
        super().__init__(instructions=INSTRUCTIONS, tools=[get_current_time])


def make_model() -> openai.realtime.RealtimeModel:
    """The OpenAI Realtime plugin pointed at `voicechat serve`: it connects to
    ws://HOST:PORT/v1/realtime?model=... (the `model` query selects the server's GA dialect)."""
    return openai.realtime.RealtimeModel(
        base_url=VOICECHAT_URL,
        api_key=os.environ.get("OPENAI_API_KEY", "unused"),  # sent as a bearer key: the server's --api-key
        model="voicechat",  # accepted and ignored: the server serves its one checkpoint
    )


# One AgentSession per room; each holds one `voicechat serve` slot while it runs.
server = AgentServer(load_fnc=slot_load_fnc(VOICECHAT_URL), load_threshold=1.0)


@server.rtc_session()
async def entrypoint(ctx: JobContext) -> None:
    session = AgentSession(llm=make_model())
    await session.start(room=ctx.room, agent=VoiceAgent())


if __name__ == "__main__":
    cli.run_app(server)
