"""Offline generation over a whole input: `model.generate(...)` and `model.generate_stream(...)`.

The reference timeline (architecture.md §10.2) with the offline perception:
log-mel of the whole waveform (plus `extra_decoding_seconds` of zeros), the
chunked-limited FastConformer over all frames, one timeline position per
encoder frame after the system prompt. Deliberate differences from the
reference (docs/voicechat.md):

* frame 0 without a system prompt carries the codec silence codes, as the
  streaming path does; the reference leaves an all-zero code row there
  (§12.2 item 7, a bug: its offline frame 0 then differs from its stream);
* the language cache is on by default (`use_language_cache=False` recomputes
  the whole history each step, the reference's quadratic default);
* the system prompt's LLM positions run as one sequence pass.

The offline path yields one frame more than a stream of the same 1280·K
samples (K+1: the centred last mel frame completes one more encoder frame).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterator

import mlx.core as mx
import numpy as np

from .audio.mel import log_mel
from .audio.rnnt import greedy_decode
from .audio_input import load_audio
from .progress import progress
from .speech_output import AudioChunk, ChunkedSpeechOutput
from .timeline import Timeline
from .tts.ear_tts import replace_control_codes


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


@dataclass
class OfflineInputs:
    """Everything the offline timeline consumes, computed from the whole waveform."""

    waveform: np.ndarray
    mel: mx.array  # (n_mel, F)
    encoder: mx.array  # (T, d)
    audio_emb: mx.array  # (T, H)


def offline_perception(model, audio, *, extra_decoding_seconds: float = 0.0,
                       max_frames: int | None = None) -> OfflineInputs:
    cfg = model.config
    wave = load_audio(audio, cfg.input_sample_rate, allow_empty=False)
    if not isinstance(extra_decoding_seconds, (int, float)) or extra_decoding_seconds < 0:
        raise ValueError(f"extra_decoding_seconds must be a number >= 0, got {extra_decoding_seconds!r}")
    if extra_decoding_seconds:
        wave = np.concatenate([wave, np.zeros(int(round(extra_decoding_seconds * cfg.input_sample_rate)), np.float32)])
    if max_frames is not None and (not isinstance(max_frames, int) or max_frames < 2):
        raise ValueError(f"max_frames must be an int >= 2, got {max_frames!r}")
    per = model.stt_model.perception
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
    tokens = greedy_decode(st.rnnt_decoder, st.rnnt_joint, encoder_frames, model.config.audio_config.max_symbols,
                           skip_ids=text.special_ids)
    return tokens, text.decode(tokens)


def _decode_text(model, ids) -> str:
    skip = model.config.special_text_ids
    return model.tokenizer.decode([int(i) for i in ids if int(i) not in skip])


def _run_timeline(model, inputs: OfflineInputs, *, system_prompt, seed, use_language_cache, on_frame=None):
    timeline = Timeline(model, seed=seed, use_language_cache=use_language_cache)
    prompt_positions = timeline.start(system_prompt)
    text_ids, function_ids, codes = [], [], []
    for t in progress(range(inputs.audio_emb.shape[0]), desc="generating", unit="frame"):
        out = timeline.step(inputs.audio_emb[t])
        mx.eval(out.text_id, out.function_id, out.codes)
        text_ids.append(out.text_id.item())
        function_ids.append(out.function_id.item())
        codes.append(out.codes)
        if on_frame is not None:
            on_frame(t, out)
    codes = mx.stack(codes) if codes else mx.zeros((0, model.config.tts_config.num_quantizers), mx.int32)
    return timeline, prompt_positions, text_ids, function_ids, codes


def generate(model, audio, *, system_prompt: str | None = None, seed: int = 0,
             extra_decoding_seconds: float = 0.0, max_frames: int | None = None,
             use_language_cache: bool = True) -> OfflineResult:
    inputs = offline_perception(model, audio, extra_decoding_seconds=extra_decoding_seconds, max_frames=max_frames)
    tr_tokens, transcript = offline_transcript(model, inputs.encoder)
    _, prompt_positions, text_ids, function_ids, codes = _run_timeline(
        model, inputs, system_prompt=system_prompt, seed=seed, use_language_cache=use_language_cache)
    tts = model.tts_model
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
    )


def generate_stream(model, audio, *, chunk_frames: int = 25, system_prompt: str | None = None, seed: int = 0,
                    extra_decoding_seconds: float = 0.0, max_frames: int | None = None,
                    use_language_cache: bool = True) -> Iterator[AudioChunk]:
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
    timeline.start(system_prompt)
    for t in range(inputs.audio_emb.shape[0]):
        step = timeline.step(inputs.audio_emb[t])
        clean = replace_control_codes(step.codes, tts.control_codes, tts.codec_silence_tokens)
        yield from out.push(clean)
    yield from out.finish()
