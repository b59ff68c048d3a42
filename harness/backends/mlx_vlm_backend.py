"""The reference implementation, mlx-vlm 0.7.10 (`mlx_vlm.models.nemotron_voicechat`), as a backend.

Needs the `peers` extra (mlx-vlm==0.7.10, mlx-audio==0.6.2). Nothing of the
reference is copied here: the backend calls its public API (`mlx_vlm.utils.load`,
`Model.create_session`, `VoiceChatSession.generate` / `create_streaming_session`,
`push_audio`, `flush`, `profile.summary`) and, to see values the public API does
not return, temporarily wraps a few of its methods and module-level functions
for the duration of one run (see docs/peers.md for the list). Every wrapper
calls the original with the same arguments and only records what passes
through, so the reference computes exactly what it computes unobserved.

Conventions of the returned runs (shared with this project's backend):

* `codes` are the TTS output codes *before* control-code replacement (what the
  TTS generated), captured at the reference's `_replace_control_codes`; the
  codec decodes the replaced codes. mlx-vlm's own result and Audio events carry
  the replaced codes: they are `decoded_codes`.
* `mel` is (frames, n_mel) and `encoder` is (frames, d_model): frame-major, as
  the harness compares them (base.py's comment says (n_mel, F) for `mel`).
* Offline runs use `use_language_cache=True` (the reference default `False`
  re-runs the whole history every frame; same results to float rounding,
  docs/model.md §12.2 item 8).
* mlx-vlm reseeds MLX's global random generator (`mx.random.seed(seed)`) at the
  start of `generate` and at streaming-session creation; this backend does not
  save or restore it.
"""

from __future__ import annotations

import dataclasses
import gc
import math
import time
from contextlib import ExitStack, contextmanager
from types import SimpleNamespace
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


# Modules mlx-vlm 0.7.10 cannot run quantized (docs/voicechat.md, "Quantization layouts"): its MoG
# head reshapes a packed `proj_mus` as the dense matrix (a matmul shape error at the first TTS step),
# and it builds the text-side input in a quantized char embedding's dtype, uint32 (wrong codes).
UNRUNNABLE_QUANTIZED = ("tts_model.tts_model.mog_head.proj_mus", "tts_model.tts_model.embed_subword.embed_tokens")


def unrunnable_quantized_modules(checkpoint) -> list[str]:
    """The modules of a local checkpoint that mlx-vlm cannot run because they are stored quantized
    (a `.scales` tensor in the shard index or headers); [] when there are none or the folder has no
    index to read."""
    import json
    from pathlib import Path

    folder = Path(str(checkpoint))
    names: set[str] = set()
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        names = set(json.loads(index.read_text()).get("weight_map", {}))
    else:
        for shard in folder.glob("*.safetensors"):
            with open(shard, "rb") as f:
                n = int.from_bytes(f.read(8), "little")
                names |= set(json.loads(f.read(n)))
    return [m for m in UNRUNNABLE_QUANTIZED if f"{m}.scales" in names]


class MlxVlmBackend(Backend):
    """Drives mlx-vlm's nemotron_voicechat (offline `generate` and the streaming session)."""

    name = "mlx-vlm"

    def __init__(self):
        self.model = None  # mlx_vlm...nemotron_voicechat.Model
        self.processor = None
        self.session = None  # mlx_vlm...nemotron_voicechat.VoiceChatSession
        self.checkpoint: str | None = None
        self.load_s: float = 0.0

    # -- loading

    def unrunnable_modules(self) -> list[str]:
        """Modules of the loaded checkpoint this mlx-vlm cannot run (stored quantized), or []."""
        return unrunnable_quantized_modules(self.checkpoint) if self.checkpoint else []

    def load(self, checkpoint: str) -> Any:
        """Load a checkpoint folder (or HF repo id) with `mlx_vlm.utils.load`; returns the mlx-vlm model."""
        try:
            from mlx_vlm.utils import load as vlm_load
        except ImportError as e:  # pragma: no cover - depends on the environment
            raise ImportError("the mlx-vlm backend needs the `peers` extra: pip install -e '.[peers]'") from e
        self.close()
        t0 = time.perf_counter()
        model, processor = vlm_load(str(checkpoint))
        if getattr(model, "model_type", None) != "nemotron_voicechat":
            raise ValueError(
                f"{checkpoint} is not a nemotron_voicechat checkpoint "
                f"(mlx-vlm loaded model_type {getattr(model, 'model_type', None)!r})"
            )
        session = model.create_session(processor)
        self.load_s = time.perf_counter() - t0
        self.model, self.processor, self.session = model, processor, session
        self.checkpoint = str(checkpoint)
        return model

    def _require(self):
        if self.session is None:
            raise RuntimeError("MlxVlmBackend: call load(checkpoint) first")
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
        c = self.model.config.codec_config
        return int(math.ceil(((c.n_fft - c.hop_length) // 2) / c.hop_length) * c.hop_length)

    def close(self) -> None:
        self.model = self.processor = self.session = None
        gc.collect()
        mx.clear_cache()

    @property
    def warmup_samples(self) -> int:
        """Streamed samples (from the start) that differ from the delayed offline decode: 2 * lead_in.

        The first `lead_in` streamed samples are pre-roll and the next `lead_in`
        see zero-initialised codec caches instead of the offline edge (api.md:
        "in the reference: 8 more").
        """
        return 2 * self.lead_in

    # -- helpers the harness uses when present (reference code paths, nothing re-implemented)

    def decode_codes(self, codes: np.ndarray, *, float32_latent: bool = False) -> np.ndarray:
        """The reference's offline codec decode of (T, Q) raw codes, control codes replaced as it does.

        The reference sums the stored (bf16) codebook vectors in bf16, so its whole
        decoder then runs with bf16 activations (~1e-2 abs on the audio against a
        float32 decode). `float32_latent=True` runs the same reference code with its
        codebooks temporarily cast to float32 (weights restored afterwards), which
        isolates that one precision difference.
        """
        sess = self._require()
        codes = np.asarray(codes)
        q = self.model.config.tts_config.num_quantizers
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
        """Agent text of per-frame ids as the reference decodes it (specials dropped, not stripped)."""
        return self._require()._decode_text(mx.array([int(i) for i in ids], dtype=mx.int32))

    def decode_transcript(self, tokens) -> str:
        """User transcript of RNNT ids as the reference decodes it (stripped)."""
        from mlx_audio.stt.models.nemotron_asr import tokenizer as rnnt_tokenizer

        self._require()
        return rnnt_tokenizer.decode([int(t) for t in tokens], self.model.config.rnnt_vocabulary).strip()

    def _frame_tokens(self, encoder: mx.array) -> list[list[int]]:
        """Non-special RNNT ids emitted per encoder frame, by the reference's streaming RNNT state."""
        from mlx_vlm.models.nemotron_voicechat.streaming import _RNNTState

        state = _RNNTState(self._require())
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
        from mlx_vlm.models.nemotron_voicechat import session as vlm_session

        sess = self._require()
        wave = _as_audio(audio)
        seen = SimpleNamespace(mel=None, encoder=None, rnnt_tokens=None, raw_codes=None)
        lm_outputs: list = []

        orig_mel = vlm_session.log_mel_spectrogram
        orig_tok = vlm_session.rnnt_tokenizer
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
            stack.enter_context(_patched(vlm_session, "log_mel_spectrogram", log_mel_spectrogram))
            stack.enter_context(_patched(vlm_session, "rnnt_tokenizer", tok_proxy))
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
            raise RuntimeError("mlx-vlm generate did not pass its codes through _replace_control_codes")
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
        s = sess.create_streaming_session(system_prompt=system_prompt, seed=seed, profile=profile)
        create_s = time.perf_counter() - t0

        # Per audio frame: ids (PAD and other specials included), raw codes, encoder frame, logits.
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
            events = orig_step(frame)
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
            raise RuntimeError(f"mlx-vlm emitted {len(audio_events)} audio events for {len(frames)} frames")
        q = self.model.config.tts_config.num_quantizers
        codes = np.stack([_np(f["codes"], np.int32) for f in frames]) if frames else np.zeros((0, q), np.int32)
        out_audio = (
            np.concatenate([_np(e.samples, np.float32) for e in audio_events])
            if audio_events
            else np.zeros((0,), np.float32)
        )
        mels = [m for m in mel_chunks if m.shape[1]]
        rnnt_on = bool(self.model.config.rnnt_vocabulary)
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
            tail=np.zeros((0,), np.float32),  # mlx-vlm never flushes the codec (§12.2 item 13)
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
            frame_timings=[dataclasses.asdict(t) for t in s.profile.frames] if profile else None,
            profile_summary=s.profile.summary() if profile else None,
            create_s=create_s,
            first_audio_s=first_audio_s,
            first_text_s=first_text_s,
            wall_s=wall,
            transcript_frame_tokens=[f["rnnt_tokens"] for f in frames] if rnnt_on else None,
        )
