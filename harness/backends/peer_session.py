"""What the two peer backends (mlx-vlm's and mlx-audio's nemotron_voicechat) share.

mlx-audio 0.6.2's `mlx_audio.sts.models.nemotron_voicechat` mirrors mlx-vlm 0.7.10's
`mlx_vlm.models.nemotron_voicechat`: a `session` module with `log_mel_spectrogram` and
`rnnt_tokenizer`, a `VoiceChatSession` with `_rnnt_decode`, `_replace_control_codes`,
`_decode_text`, `generate` and `create_streaming_session`, and a streaming session with
`_step_audio_frame`, `_perception_step`, `_language_step`, `_mel_stream`, `_rnnt`,
`_text`, `_text_tokens`, `_function_tokens`, `push_audio` and `flush`. `PeerSessionBackend`
drives that surface once; a subclass says only what differs (how it loads, where its
config keeps the TTS / codec settings, its session module and streaming RNNT state, how
it creates a streaming session and what profile it reports).

Values the public API does not return are recorded by wrapping methods / module
attributes for one run: every wrapper calls the original with the same arguments and
only records what passes through, so the peer computes exactly what it computes
unobserved (docs/peers.md).
"""

from __future__ import annotations

import gc
import math
import time
from contextlib import ExitStack, contextmanager
from types import ModuleType, SimpleNamespace
from typing import Any

import mlx.core as mx
import numpy as np
from mlx.utils import tree_flatten, tree_map, tree_unflatten

from .base import Backend, OfflineRun, StreamRun

_MISSING = object()


@contextmanager
def _patched(target, name: str, value):
    """Set `target.name = value` (module or instance attribute) and restore it afterwards."""
    old = vars(target).get(name, _MISSING)
    setattr(target, name, value)
    try:
        yield
    finally:
        if old is _MISSING:
            delattr(target, name)  # the instance falls back to its class's method again
        else:
            setattr(target, name, old)


_RECORDING_CLASSES: dict[type, type] = {}


@contextmanager
def _recording_calls(module, sink: list):
    """Record every output of `module(...)` into `sink` while active.

    `nn.Module.__call__` is looked up on the type, so an instance attribute
    cannot intercept it: the instance's class is swapped for a subclass whose
    `__call__` delegates to the original and appends the output.
    """
    cls = type(module)
    rec = _RECORDING_CLASSES.get(cls)
    if rec is None:

        def __call__(self, *args, **kwargs):
            out = cls.__call__(self, *args, **kwargs)
            sink_of = getattr(self, "_peer_sink", None)
            if sink_of is not None:
                sink_of.append(out)
            return out

        rec = type(f"Recording{cls.__name__}", (cls,), {"__call__": __call__})
        _RECORDING_CLASSES[cls] = rec
    module.__class__ = rec
    object.__setattr__(module, "_peer_sink", sink)  # a plain attribute, not a parameter
    try:
        yield
    finally:
        object.__delattr__(module, "_peer_sink")
        module.__class__ = cls


def _as_audio(audio) -> np.ndarray:
    """1-D finite float32 16 kHz samples, or a ValueError/TypeError saying what is wrong."""
    if isinstance(audio, (str, bytes)) or not hasattr(audio, "__len__"):
        raise TypeError(f"audio must be a 1-D array of 16 kHz float samples, got {type(audio).__name__}")
    a = np.asarray(audio)
    if not (np.issubdtype(a.dtype, np.floating) or np.issubdtype(a.dtype, np.integer)):
        raise TypeError(f"audio must hold float samples, got dtype {a.dtype}")
    if a.ndim != 1:
        raise ValueError(f"audio must be mono 1-D (samples,), got shape {a.shape}")
    if a.size == 0:
        raise ValueError("audio is empty; expected at least one sample")
    a = a.astype(np.float32)
    if not np.all(np.isfinite(a)):
        raise ValueError("audio contains NaN or infinite samples; expected finite values")
    return a


def _np(x, dtype=None) -> np.ndarray:
    if isinstance(x, mx.array) and x.dtype == mx.bfloat16:
        x = x.astype(mx.float32)
    a = np.array(x)
    return a.astype(dtype) if dtype is not None else a


def _event_dict(e) -> dict:
    d: dict[str, Any] = {"kind": e.kind, "frame_index": e.frame_index}
    for key in ("token_id", "delta", "text", "sample_rate"):
        v = getattr(e, key, None)
        if v is not None:
            d[key] = v
    if e.samples is not None:
        d["n_samples"] = int(e.samples.shape[0])
    return d


class PeerSessionBackend(Backend):
    """Offline `generate` and the streaming session of a peer's nemotron_voicechat `VoiceChatSession`.

    A subclass sets `name` and `self.model` / `self.session` in `load`, and implements the
    hooks below (`_session_module`, `_tts_config`, `_codec_config`, `_rnnt_state`,
    `_create_streaming`, `_profile`).
    """

    name = "peer"

    def __init__(self):
        self.model: Any = None
        self.session: Any = None  # the peer's VoiceChatSession
        self.checkpoint: str | None = None
        self.load_s: float = 0.0

    # -- what a peer says

    def _session_module(self) -> ModuleType:
        """The peer's `nemotron_voicechat.session` module (its `log_mel_spectrogram`, `rnnt_tokenizer`)."""
        raise NotImplementedError

    def _tts_config(self) -> Any:
        """The loaded config's TTS section (`num_quantizers`)."""
        raise NotImplementedError

    def _codec_config(self) -> Any:
        """The loaded config's codec section (`n_fft`, `hop_length`)."""
        raise NotImplementedError

    def _rnnt_state(self) -> Any:
        """A fresh streaming RNNT state of the peer (`step(encoder_frame)`, `tokens`)."""
        raise NotImplementedError

    def _create_streaming(self, sess, *, system_prompt: str | None, seed: int, profile: bool) -> Any:
        """`sess.create_streaming_session(...)` as the peer takes it."""
        raise NotImplementedError

    def _profile(self, s, frames: list[dict]) -> tuple[list[dict] | None, dict | None]:
        """(frame_timings, profile_summary) of a profiled streaming run; `frames[i]["frame_ms"]` is the
        wall time of frame i measured around `_step_audio_frame`."""
        raise NotImplementedError

    # -- common surface

    def _require(self):
        if self.session is None:
            raise RuntimeError(f"{type(self).__name__}: call load(checkpoint) first")
        return self.session

    @property
    def samples_per_frame(self) -> int:
        self._require()
        return int(self.model.tts_model.audio_codec.waveform_to_token_ratio)

    @property
    def lead_in(self) -> int:
        """Samples by which the streamed codec output lags the offline decode (docs/model.md §9.4).

        The streaming iSTFT keeps ceil(((n_fft - hop) // 2) / hop) spectral frames of
        context on each side, i.e. that many hops of samples: 8 at n_fft 16, hop 4.
        """
        self._require()
        c = self._codec_config()
        return int(math.ceil(((c.n_fft - c.hop_length) // 2) / c.hop_length) * c.hop_length)

    @property
    def warmup_samples(self) -> int:
        """Streamed samples (from the start) that differ from the delayed offline decode: 2 * lead_in.

        The first `lead_in` streamed samples are pre-roll and the next `lead_in`
        see zero-initialised codec caches instead of the offline edge (api.md:
        "in the reference: 8 more").
        """
        return 2 * self.lead_in

    def close(self) -> None:
        self.model = self.session = None
        gc.collect()
        mx.clear_cache()

    # -- helpers the harness uses when present (the peer's code paths, nothing re-implemented)

    def decode_codes(self, codes: np.ndarray, *, float32_latent: bool = False) -> np.ndarray:
        """The peer's offline codec decode of (T, Q) raw codes, control codes replaced as it does.

        The peer sums the stored (bf16) codebook vectors in bf16, so its whole
        decoder then runs with bf16 activations (~1e-2 abs on the audio against a
        float32 decode). `float32_latent=True` runs the same peer code with its
        codebooks temporarily cast to float32 (weights restored afterwards), which
        isolates that one precision difference.
        """
        sess = self._require()
        codes = np.asarray(codes)
        q = self._tts_config().num_quantizers
        if codes.ndim != 2 or codes.shape[1] != q:
            raise ValueError(f"codes must be (T, {q}), got {codes.shape}")
        if codes.shape[0] == 0:
            return np.zeros((0,), np.float32)
        codec = self.model.tts_model.audio_codec
        clean = sess._replace_control_codes(mx.array(codes.astype(np.int32))[None])
        saved = tree_flatten(codec.prvq.parameters())
        if float32_latent:
            codec.prvq.update(tree_map(lambda a: a.astype(mx.float32), codec.prvq.parameters()))
        try:
            out = codec.decode(clean.transpose(0, 2, 1))[0, 0]
            mx.eval(out)
        finally:
            codec.prvq.update(tree_unflatten(saved))
        return _np(out, np.float32)

    def decode_text(self, ids) -> str:
        """Agent text of per-frame ids as the peer decodes it (specials dropped, not stripped)."""
        return self._require()._decode_text(mx.array([int(i) for i in ids], dtype=mx.int32))

    def decode_transcript(self, tokens) -> str:
        """User transcript of RNNT ids as the peer decodes it (stripped)."""
        from mlx_audio.stt.models.nemotron_asr import tokenizer as rnnt_tokenizer

        self._require()
        return rnnt_tokenizer.decode([int(t) for t in tokens], self.model.config.rnnt_vocabulary).strip()

    def _frame_tokens(self, encoder: mx.array) -> list[list[int]]:
        """Non-special RNNT ids emitted per encoder frame, by the peer's streaming RNNT state."""
        state = self._rnnt_state()
        out = []
        for t in range(encoder.shape[0]):
            before = len(state.tokens)
            state.step(encoder[t][None, None])
            out.append([int(x) for x in state.tokens[before:]])
        return out

    # -- offline

    def offline(
        self,
        audio: np.ndarray,
        *,
        system_prompt: str | None = None,
        seed: int = 0,
        extra_decoding_seconds: float = 0.0,
        with_logits: bool = False,
    ) -> OfflineRun:
        session_module = self._session_module()
        sess = self._require()
        wave = _as_audio(audio)
        seen = SimpleNamespace(mel=None, encoder=None, rnnt_tokens=None, raw_codes=None)
        lm_outputs: list = []

        orig_mel = session_module.log_mel_spectrogram
        orig_tok = session_module.rnnt_tokenizer
        orig_rnnt = sess._rnnt_decode
        orig_replace = sess._replace_control_codes

        def log_mel_spectrogram(x, args):
            out = orig_mel(x, args)
            seen.mel = out
            return out

        def rnnt_decode(encoded, length):
            seen.encoder = encoded[0, :length]
            return orig_rnnt(encoded, length)

        def rnnt_text(tokens, vocabulary, *a, **k):
            seen.rnnt_tokens = [int(t) for t in tokens]
            return orig_tok.decode(tokens, vocabulary, *a, **k)

        def replace_control_codes(codes):
            seen.raw_codes = codes
            return orig_replace(codes)

        tok_proxy = SimpleNamespace(is_special_token=orig_tok.is_special_token, decode=rnnt_text)
        with ExitStack() as stack:
            stack.enter_context(_patched(session_module, "log_mel_spectrogram", log_mel_spectrogram))
            stack.enter_context(_patched(session_module, "rnnt_tokenizer", tok_proxy))
            stack.enter_context(_patched(sess, "_rnnt_decode", rnnt_decode))
            stack.enter_context(_patched(sess, "_replace_control_codes", replace_control_codes))
            if with_logits:
                stack.enter_context(_recording_calls(self.model.stt_model, lm_outputs))
            t0 = time.perf_counter()
            result = sess.generate(
                mx.array(wave),
                system_prompt=system_prompt,
                seed=seed,
                extra_decoding_seconds=extra_decoding_seconds,
                use_language_cache=True,
            )
            mx.eval(result.audio)
            wall = time.perf_counter() - t0

        text_ids = _np(result.text_tokens, np.int32)
        n = text_ids.shape[0]
        text_logits = function_logits = None
        if with_logits:
            # One language call per timeline position (prompt first): keep the last n.
            outs = lm_outputs[-n:] if n else []
            text_logits = np.stack([_np(o.text_logits[0, -1], np.float32) for o in outs]) if outs else None
            function_logits = np.stack([_np(o.function_logits[0, -1], np.float32) for o in outs]) if outs else None
        if seen.raw_codes is None:
            raise RuntimeError(f"{self.name} generate did not pass its codes through _replace_control_codes")
        frame_tokens = None
        if seen.encoder is not None and self.model.config.rnnt_vocabulary:
            frame_tokens = self._frame_tokens(seen.encoder)
        return OfflineRun(
            text_ids=text_ids,
            function_ids=_np(result.function_tokens, np.int32),
            codes=_np(seen.raw_codes[0], np.int32),
            decoded_codes=_np(result.audio_codes, np.int32),
            audio=_np(result.audio, np.float32),
            text=result.text,
            transcript=result.user_transcript or "",
            transcript_tokens=seen.rnnt_tokens,
            mel=None if seen.mel is None else _np(seen.mel[0], np.float32),
            encoder=None if seen.encoder is None else _np(seen.encoder, np.float32),
            text_logits=text_logits,
            function_logits=function_logits,
            wall_s=wall,
            transcript_frame_tokens=frame_tokens,
        )

    # -- streaming

    def stream(
        self,
        audio: np.ndarray,
        *,
        system_prompt: str | None = None,
        seed: int = 0,
        chunk_samples: int = 1280,
        profile: bool = False,
        with_logits: bool = False,
    ) -> StreamRun:
        sess = self._require()
        wave = _as_audio(audio)
        if isinstance(chunk_samples, bool) or not isinstance(chunk_samples, int) or chunk_samples < 1:
            raise ValueError(f"chunk_samples must be a positive int, got {chunk_samples!r}")

        t0 = time.perf_counter()
        s = self._create_streaming(sess, system_prompt=system_prompt, seed=seed, profile=profile)
        create_s = time.perf_counter() - t0

        # Per audio frame: ids (PAD and other specials included), raw codes, encoder frame, logits, wall time.
        frames: list[dict] = []
        mel_chunks: list = []
        current: dict = {}
        orig_step = s._step_audio_frame
        orig_perception = s._perception_step
        orig_language = s._language_step
        orig_replace = sess._replace_control_codes

        def step_audio_frame(frame):
            current.clear()
            before = len(s._rnnt.tokens)
            f0 = time.perf_counter()
            events = orig_step(frame)
            current["frame_ms"] = (time.perf_counter() - f0) * 1e3
            current["rnnt_tokens"] = [int(t) for t in s._rnnt.tokens[before:]]
            current["text_id"] = int(s._text_tokens[-1])
            current["function_id"] = int(s._function_tokens[-1])
            frames.append(dict(current))
            return events

        def perception_step(frame):
            projected, encoded = orig_perception(frame)
            current["encoder"] = encoded[0, -1]
            return projected, encoded

        def language_step(inputs):
            out = orig_language(inputs)
            current["text_logits"] = out.text_logits[0, -1]
            current["function_logits"] = out.function_logits[0, -1]
            return out

        def replace_control_codes(codes):
            current["codes"] = codes[0, -1]
            return orig_replace(codes)

        events: list = []
        first_audio_s = first_text_s = None
        with ExitStack() as stack:
            stack.enter_context(_patched(s, "_step_audio_frame", step_audio_frame))
            stack.enter_context(_patched(s, "_perception_step", perception_step))
            stack.enter_context(_patched(sess, "_replace_control_codes", replace_control_codes))
            if with_logits:
                stack.enter_context(_patched(s, "_language_step", language_step))
            if s._mel_stream is not None:
                orig_push = s._mel_stream.push

                def mel_push(samples, *a, **k):
                    out = orig_push(samples, *a, **k)
                    mel_chunks.append(out)
                    return out

                stack.enter_context(_patched(s._mel_stream, "push", mel_push))

            start = time.perf_counter()
            calls = [
                lambda c=wave[i : i + chunk_samples]: s.push_audio(c) for i in range(0, wave.shape[0], chunk_samples)
            ]
            calls.append(lambda: s.flush(pad_partial=True))
            for call in calls:
                new = call()
                now = time.perf_counter() - start  # events reach the caller when the call returns
                for e in new:
                    if e.kind == "audio" and first_audio_s is None:
                        first_audio_s = now
                    if e.kind == "assistant_text_delta" and first_text_s is None:
                        first_text_s = now
                events.extend(new)
            wall = time.perf_counter() - start

        audio_events = [e for e in events if e.kind == "audio"]
        if len(audio_events) != len(frames):
            raise RuntimeError(f"{self.name} emitted {len(audio_events)} audio events for {len(frames)} frames")
        q = self._tts_config().num_quantizers
        codes = np.stack([_np(f["codes"], np.int32) for f in frames]) if frames else np.zeros((0, q), np.int32)
        out_audio = (
            np.concatenate([_np(e.samples, np.float32) for e in audio_events])
            if audio_events
            else np.zeros((0,), np.float32)
        )
        mels = [m for m in mel_chunks if m.shape[1]]
        rnnt_on = bool(self.model.config.rnnt_vocabulary)
        frame_timings, profile_summary = self._profile(s, frames) if profile else (None, None)
        return StreamRun(
            text_ids=np.array([f["text_id"] for f in frames], dtype=np.int32),
            function_ids=np.array([f["function_id"] for f in frames], dtype=np.int32),
            codes=codes,
            decoded_codes=(
                np.stack([_np(e.audio_codes, np.int32) for e in audio_events])
                if audio_events
                else np.zeros((0, q), np.int32)
            ),
            audio=out_audio,
            # neither peer emits the codec tail: mlx-vlm never flushes the codec (docs/model.md §12.2
            # item 13), mlx-audio's flush clears it without emitting it
            tail=np.zeros((0,), np.float32),
            text=s._text.text,
            transcript=s._rnnt.text,
            transcript_tokens=[int(t) for t in s._rnnt.tokens] if rnnt_on else None,
            events=[_event_dict(e) for e in events],
            mel=np.concatenate([_np(m[0], np.float32) for m in mels]) if mels else None,
            encoder=np.stack([_np(f["encoder"], np.float32) for f in frames]) if frames else None,
            text_logits=np.stack([_np(f["text_logits"], np.float32) for f in frames])
            if with_logits and frames
            else None,
            function_logits=np.stack([_np(f["function_logits"], np.float32) for f in frames])
            if with_logits and frames
            else None,
            frame_timings=frame_timings,
            profile_summary=profile_summary,
            create_s=create_s,
            first_audio_s=first_audio_s,
            first_text_s=first_text_s,
            wall_s=wall,
            transcript_frame_tokens=[f["rnnt_tokens"] for f in frames] if rnnt_on else None,
        )
