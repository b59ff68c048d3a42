"""Offline generation over a whole input: `model.generate(...)` and `model.generate_stream(...)`.

The reference timeline (docs/model.md §10.2) with the offline perception:
log-mel of the whole waveform (plus `extra_decoding_seconds` of zeros), the
chunked-limited FastConformer over all frames, one timeline position per
encoder frame after the system prompt. Deliberate differences from the
reference (docs/voicechat.md):

* frame 0 without a system prompt carries the codec silence codes, as the
  streaming path does; the reference leaves an all-zero code row there
  (§12.2 item 7, a bug: its offline frame 0 then differs from its stream);
* the language cache is on by default (`use_language_cache=False` recomputes
  the whole history each step, the reference's quadratic default);
* with `numerics="float32"` the system prompt's LLM positions run as one sequence pass (the
  default steps them one at a time, as the reference does).

The offline path yields one frame more than a stream of the same 1280·K
samples (K+1: the centred last mel frame completes one more encoder frame).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field

import mlx.core as mx
import numpy as np

from voicechat.io.audio_input import load_audio
from voicechat.io.progress import progress
from voicechat.model.audio.mel import log_mel
from voicechat.model.audio.rnnt import greedy_decode
from voicechat.model.tts.ear_tts import replace_control_codes
from voicechat.streaming.prompt_state import UNSET, Unset, resolve_prompt_arguments
from voicechat.streaming.speech_output import AudioChunk, ChunkedSpeechOutput
from voicechat.streaming.timeline import Timeline, session_prompt
from voicechat.tools.channel import FunctionChannel, normalize_tools, timeout_frames


@dataclass
class OfflineResult:
    text: str
    text_tokens: np.ndarray  # int32 (T,), one per audio frame
    function_tokens: np.ndarray  # int32 (T,)
    audio_codes: np.ndarray  # int32 (T, Q): the decoded codes, after control-code replacement
    audio: np.ndarray  # float32 (T * samples_per_frame,)
    sample_rate: int
    user_transcript: str
    transcript_tokens: list[int] = field(default_factory=list)
    prompt_positions: int = 0
    encoder_frames: np.ndarray | None = None  # (T, d), kept for the parity harness
    mel: np.ndarray | None = None
    raw_audio_codes: np.ndarray | None = None  # int32 (T, Q): the codes EAR-TTS generated (fed back)
    tool_events: list = field(default_factory=list)  # ToolCall / ToolCallError / ToolResultDone, in order
    forced: np.ndarray | None = None  # bool (T,): a tool response token was forced at that frame


@dataclass
class OfflineInputs:
    """Everything the offline timeline consumes, computed from the whole waveform."""

    waveform: np.ndarray
    mel: mx.array  # (n_mel, F)
    encoder: mx.array  # (T, d)
    audio_emb: mx.array  # (T, H)


def offline_perception(
    model, audio, *, extra_decoding_seconds: float = 0.0, max_frames: int | None = None
) -> OfflineInputs:
    cfg = model.config
    wave = load_audio(audio, cfg.input_sample_rate, allow_empty=False)
    if not isinstance(extra_decoding_seconds, (int, float)) or extra_decoding_seconds < 0:
        raise ValueError(f"extra_decoding_seconds must be a number >= 0, got {extra_decoding_seconds!r}")
    if extra_decoding_seconds:
        wave = np.concatenate([wave, np.zeros(int(round(extra_decoding_seconds * cfg.input_sample_rate)), np.float32)])
    if max_frames is not None and (not isinstance(max_frames, int) or max_frames < 2):
        raise ValueError(f"max_frames must be an int >= 2, got {max_frames!r}")
    per = model.stt_model.perception
    with model.executing():
        mel = log_mel(wave, cfg.audio_config.preprocessor)
        enc = per.encoder(mel)
        if max_frames is not None:
            enc = enc[:max_frames]
        emb = per.project(enc)
        mx.eval(mel, enc, emb)
    return OfflineInputs(wave, mel, enc, emb)


def offline_transcript(model, encoder_frames: mx.array) -> tuple[list[int], str]:
    """Greedy RNNT over all encoder frames -> (tokens, text)."""
    st = model.stt_model
    text = model.rnnt_text()
    with model.executing():
        tokens = greedy_decode(
            st.rnnt_decoder,
            st.rnnt_joint,
            encoder_frames,
            model.config.audio_config.max_symbols,
            skip_ids=text.special_ids,
        )
    return tokens, text.decode(tokens)


def _decode_text(model, ids) -> str:
    skip = model.config.special_text_ids
    return model.tokenizer.decode([int(i) for i in ids if int(i) not in skip])


class ToolSchedule:
    """The offline form of `submit_tool_result`: `(after_frame, call_id, output)` entries, each
    submitted after that frame (the streamed session's results submitted between the same frames)."""

    def __init__(self, model, tools, tool_results, tool_timeout_seconds):

        cfg = model.config
        self.tools = normalize_tools(tools)
        entries = list(tool_results or ())
        if entries and not self.tools:
            raise ValueError("tool_results need tools")
        if tool_timeout_seconds is not None and not self.tools:
            raise ValueError("tool_timeout_seconds needs tools")
        for i, e in enumerate(entries):
            if (
                not isinstance(e, (tuple, list))
                or len(e) != 3
                or isinstance(e[0], bool)
                or not isinstance(e[0], int)
                or e[0] < 0
                or not isinstance(e[1], str)
            ):
                raise ValueError(f"tool_results[{i}] must be (after_frame: int >= 0, call_id: str, output), got {e!r}")
        self.entries = sorted(entries, key=lambda e: e[0])  # stable: equal frames keep their order
        self.channel = (
            FunctionChannel(
                model.tokenizer,
                self.tools,
                pad_id=cfg.pad_token_id,
                timeout_frames=timeout_frames(tool_timeout_seconds, cfg.frame_duration),
            )
            if self.tools
            else None
        )
        self.events: list = []

    def forced_token(self, t: int):
        return self.channel.forced_token(t) if self.channel is not None else None

    def after_frame(self, t: int, function_id: int, forced: bool) -> None:
        if self.channel is None:
            return
        self.events.extend(self.channel.observe(t, function_id, forced))
        while self.entries and self.entries[0][0] == t:
            _, call_id, output = self.entries.pop(0)
            self.channel.submit(call_id, output)

    def finish(self, frames: int) -> None:
        if self.entries:
            left = ", ".join(f"({f}, {c!r})" for f, c, _ in self.entries)
            raise ValueError(f"tool_results {left} come after the last frame ({frames - 1})")


def _run_timeline(
    model,
    inputs: OfflineInputs,
    *,
    system_prompt,
    seed,
    use_language_cache,
    on_frame=None,
    schedule: ToolSchedule | None = None,
    prompt_state=None,
):

    with model.executing():
        return _timeline_frames(
            model,
            inputs,
            system_prompt=system_prompt,
            seed=seed,
            use_language_cache=use_language_cache,
            on_frame=on_frame,
            schedule=schedule,
            prompt_state=prompt_state,
            session_prompt=session_prompt,
        )


def _timeline_frames(
    model, inputs, *, system_prompt, seed, use_language_cache, on_frame, schedule, prompt_state, session_prompt
):
    timeline = Timeline(model, seed=seed, use_language_cache=use_language_cache)
    if prompt_state is not None:  # a copy of the state after that very prefill (voicechat/streaming/prompt_state.py)
        prompt_positions = prompt_state.restore(timeline)
    else:
        prompt_positions = timeline.start(
            session_prompt(model.config, system_prompt, schedule.tools if schedule else ())
        )
    text_ids, function_ids, codes, forced_frames = [], [], [], []
    for t in progress(range(inputs.audio_emb.shape[0]), desc="generating", unit="frame"):
        forced = schedule.forced_token(t) if schedule is not None else None
        out = timeline.step(inputs.audio_emb[t], forced)
        mx.eval(out.text_id, out.function_id, out.codes)
        text_ids.append(out.text_id.item())
        function_ids.append(out.function_id.item())
        forced_frames.append(out.forced)
        codes.append(out.codes)
        if schedule is not None:
            schedule.after_frame(t, function_ids[-1], out.forced)
        if on_frame is not None:
            on_frame(t, out)
    if schedule is not None:
        schedule.finish(len(text_ids))
    codes = mx.stack(codes) if codes else mx.zeros((0, model.config.tts_config.num_quantizers), mx.int32)
    return timeline, prompt_positions, text_ids, function_ids, codes, forced_frames


def generate(
    model,
    audio,
    *,
    system_prompt: str | Unset | None = UNSET,
    seed: int | Unset = UNSET,
    extra_decoding_seconds: float = 0.0,
    max_frames: int | None = None,
    use_language_cache: bool = True,
    tools=UNSET,
    tool_results=None,
    tool_timeout_seconds=None,
    prompt_state=None,
) -> OfflineResult:
    system_prompt, tools, seed = resolve_prompt_arguments(
        model, prompt_state, system_prompt, tools, seed, use_language_cache
    )
    schedule = ToolSchedule(model, tools, tool_results, tool_timeout_seconds)
    inputs = offline_perception(model, audio, extra_decoding_seconds=extra_decoding_seconds, max_frames=max_frames)
    tr_tokens, transcript = offline_transcript(model, inputs.encoder)
    _, prompt_positions, text_ids, function_ids, codes, forced = _run_timeline(
        model,
        inputs,
        system_prompt=system_prompt,
        seed=seed,
        use_language_cache=use_language_cache,
        schedule=schedule,
        prompt_state=prompt_state,
    )
    tts = model.tts_model
    with model.executing():
        clean = replace_control_codes(codes, tts.control_codes, tts.codec_silence_tokens)
        audio_out = tts.audio_codec.decode(clean) if codes.shape[0] else mx.zeros((0,), mx.float32)
        mx.eval(audio_out)
    return OfflineResult(
        text=_decode_text(model, text_ids),
        text_tokens=np.array(text_ids, dtype=np.int32),
        function_tokens=np.array(function_ids, dtype=np.int32),
        audio_codes=np.array(clean, dtype=np.int32),
        audio=np.array(audio_out, dtype=np.float32),
        sample_rate=model.config.output_sample_rate,
        user_transcript=transcript,
        transcript_tokens=tr_tokens,
        prompt_positions=prompt_positions,
        encoder_frames=np.array(inputs.encoder),
        mel=np.array(inputs.mel),
        raw_audio_codes=np.array(codes, dtype=np.int32),
        tool_events=schedule.events,
        forced=np.array(forced, dtype=bool),
    )


def generate_stream(
    model,
    audio,
    *,
    chunk_frames: int = 25,
    system_prompt: str | None = None,
    seed: int = 0,
    extra_decoding_seconds: float = 0.0,
    max_frames: int | None = None,
    use_language_cache: bool = True,
) -> Iterator[AudioChunk]:
    """The `generate` timeline, yielding audio chunks decoded with the codec's streaming state.

    The concatenation of the chunks equals `generate(...).audio` in length, and
    in value apart from the codec's warm-up samples at the very start
    (`model.tts_model.audio_codec.warmup_samples`).
    """
    if isinstance(chunk_frames, bool) or not isinstance(chunk_frames, int) or chunk_frames < 1:
        raise ValueError(f"chunk_frames must be an int >= 1, got {chunk_frames!r}")
    inputs = offline_perception(model, audio, extra_decoding_seconds=extra_decoding_seconds, max_frames=max_frames)
    tts = model.tts_model
    out = ChunkedSpeechOutput(tts.audio_codec, chunk_frames=chunk_frames)
    timeline = Timeline(model, seed=seed, use_language_cache=use_language_cache)
    with model.executing():  # bound per piece of work, never across a yield to the caller
        timeline.start(system_prompt)
    for t in range(inputs.audio_emb.shape[0]):
        with model.executing():
            step = timeline.step(inputs.audio_emb[t])
            clean = replace_control_codes(step.codes, tts.control_codes, tts.codec_silence_tokens)
            chunks = list(out.push(clean))
        yield from chunks
    with model.executing():
        chunks = list(out.finish())
    yield from chunks
