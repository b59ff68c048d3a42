"""mlx-vlm's (and mlxcel's) dialect on /v1/realtime, the default (docs/server.md, "Protocol").

`session.created` on connect; one `session.update` (prompt, seed, clock limit) opens the model
session and is answered by `session.updated`; `input_audio_buffer.append` (16 kHz PCM16) streams
audio; the session's events go out one payload each (protocol.event_payload: `response.audio.delta`
carries the frame's `compute_ms` / `lag_ms`); `input_audio_buffer.commit` ends the turn
(`input_audio_buffer.committed`, the last frame, `response.audio.tail`, `response.done`, close
1000), `session.cancel` / `response.cancel` cancel it. A first `session.update` written for OpenAI
Realtime GA switches the connection to GA (dialects/ga.py).
"""

from __future__ import annotations

from voicechat.events import Audio
from voicechat.server import protocol as P
from voicechat.server.dialects.common import Dialect, wants_ga
from voicechat.server.messages import (
    Commit,
    Committed,
    FrameEvents,
    SessionOpened,
    SessionParams,
    SessionRefused,
    ToolOutputSent,
)
from voicechat.server.security import excerpt
from voicechat.server.validation import MessageRefused


class MlxVlmDialect(Dialect):
    name = "mlx-vlm"

    def __init__(self, conn):
        super().__init__(conn)
        self.output_rate = int(conn.model_info["output_sample_rate"])

    def error_payload(self, code: str, message: str, client_event_id=None) -> dict:
        return P.error_event(code, message)

    def connected(self) -> None:
        c, info, lim = self.conn, self.conn.model_info, self.conn.limits
        self.send(
            {
                "type": "session.created",
                "session": {
                    "id": c.session_id,
                    "state": "configuring",
                    "model": c.model_name,
                    "input_audio_format": P.AudioFormat(info["input_sample_rate"]).as_dict(),
                    "output_audio_format": P.AudioFormat(info["output_sample_rate"]).as_dict(),
                    "limits": {
                        "max_message_bytes": lim.max_message_bytes,
                        "max_session_audio_seconds": lim.max_session_audio_seconds,
                        "max_session_seconds": lim.max_session_seconds,
                        "max_prompt_tokens": lim.max_prompt_tokens,
                        "session_update_timeout": lim.session_update_timeout,
                        "idle_timeout": lim.idle_timeout,
                        "max_queued_audio_seconds": lim.max_queued_audio_seconds,
                    },
                },
            }
        )

    # -- client messages

    async def handle_text(self, text) -> None:
        try:
            await self.dispatch(P.parse_message(text))
        except MessageRefused as e:
            self.error(e.code, str(e))

    async def dispatch(self, msg: dict) -> None:
        t, c = msg["type"], self.conn
        if t == P.PING:
            self.send({"type": "session.pong"})
            return
        if t == P.SESSION_UPDATE:
            if c.configured:
                raise P.ProtocolError(
                    "session_already_configured",
                    "session.update may be sent once, before audio; this session is configured",
                )
            if wants_ga(msg):  # an OpenAI Realtime GA client that did not name a model in the URL
                await c.switch_dialect("ga").handle_msg(msg)
                return
            params = P.decode_session_update(msg, max_streaming_seconds=c.limits.max_session_audio_seconds)
            c.open_session(SessionParams(**params))
            return
        if not c.configured:
            raise P.ProtocolError("session_not_configured", f"send session.update before {t}")
        if t == P.APPEND:
            await c.admit_audio(P.decode_append(msg))
            return
        if t == P.COMMIT:
            pad = msg.get("pad_partial", True)
            if not isinstance(pad, bool):
                raise P.ProtocolError("invalid_message", f"pad_partial must be true or false, got {excerpt(pad)}")
            c.ending = True
            # `input_audio_buffer.committed` comes from the worker, after the frames of the audio before it
            # (the order mlx-vlm's server gives).
            c.submit(Commit(pad))
            return
        if t in P.CANCEL_TYPES:
            c.cancel()

    # -- the worker's outputs

    async def on_output(self, out) -> None:
        c = self.conn
        match out:
            case FrameEvents(events=events, compute_ms=compute_ms, lag_ms=lag_ms):
                rate = self.output_rate
                await c.send_now(
                    [
                        P.event_payload(e, rate, compute_ms=compute_ms, lag_ms=lag_ms)
                        if isinstance(e, Audio)
                        else P.event_payload(e, rate)
                        for e in events
                    ]
                )
            case Committed():
                await c.send_now([{"type": "input_audio_buffer.committed"}])
            case ToolOutputSent(frame_index=f, call_id=call_id, output=output):  # the page shows it
                await c.send_now(
                    [{"type": "response.function_call.output", "frame_index": f, "call_id": call_id, "output": output}]
                )
            case SessionOpened(info=info):
                s = c.session_params
                await c.send_now(
                    [
                        {
                            "type": "session.updated",
                            "session": {
                                "id": c.session_id,
                                "state": "ready",
                                "model": c.model_name,
                                "system_prompt": s.system_prompt,
                                "seed": s.seed,
                                "max_streaming_seconds": s.max_streaming_seconds,
                                "frame_samples": info["frame_samples"],
                                "output_frame_samples": info["output_frame_samples"],
                                "num_codebooks": info["num_codebooks"],
                                "input_audio_format": P.AudioFormat(info["input_sample_rate"]).as_dict(),
                                "output_audio_format": P.AudioFormat(info["output_sample_rate"]).as_dict(),
                            },
                        }
                    ]
                )
            case SessionRefused(code=code, message=message):
                c.configured = False  # the client may try another session.update
                c.count_error(code)
                await c.send_now([self.error_payload(code, message)])
