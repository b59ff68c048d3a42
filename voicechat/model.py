"""`VoiceChatModel`: the module tree in the published naming, plus the per-frame glue.

The tree mirrors the checkpoint names (docs/model.md §2.3) so loading is a
strict one-to-one update:

    stt_model.{embed_tokens, lm_head, function_head}   language embedding and heads
    stt_model.llm                                        Nemotron-H backbone
    stt_model.perception.{encoder, proj}                 FastConformer + projection
    stt_model.rnnt_decoder / rnnt_joint                  user transcript branch
    tts_model.tts_model                                  EAR-TTS
    tts_model.audio_codec                                codec
    tts_model.{control_codes, codec_silence_tokens, audio_prompt_latents.<speaker>}
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from .audio.codec import Codec
from .audio.conformer import Perception
from .audio.rnnt import RnntDecoder, RnntJoint
from . import ops
from .config import VoiceChatConfig
from .llm.nemotron_h import NemotronH
from .prompt_state import UNSET
from .tts.ear_tts import EarTts
from .tts.numerics import DEFAULT_NUMERICS, Numerics, numerics_from

# EAR-TTS speaker prompt length in frames (fixed by the reference; the stored latent's shape).
SPEAKER_PROMPT_FRAMES = 37


class SttModel(nn.Module):
    def __init__(self, cfg: VoiceChatConfig, numerics: Numerics | str = DEFAULT_NUMERICS):
        super().__init__()
        t = cfg.text_config
        self.embed_tokens = nn.Embedding(t.vocab_size, t.hidden_size)
        self.lm_head = nn.Linear(t.hidden_size, t.vocab_size, bias=False)
        self.function_head = nn.Linear(t.hidden_size, t.vocab_size, bias=False)
        self.llm = NemotronH(t, reference_rounding=numerics_from(numerics).language_rounding_as_reference)
        self.perception = Perception(cfg.audio_config)
        self.rnnt_decoder = RnntDecoder(cfg.audio_config)
        self.rnnt_joint = RnntJoint(cfg.audio_config)


class SpeechDecoder(nn.Module):
    def __init__(self, cfg: VoiceChatConfig, numerics: Numerics | str = DEFAULT_NUMERICS):
        super().__init__()
        s = cfg.tts_config
        numerics = numerics_from(numerics)
        self.tts_model = EarTts(s, numerics=numerics)
        self.audio_codec = Codec(cfg.codec_config, rvq_norms_in_weight_dtype=numerics.rvq_norms_in_weight_dtype)
        # Integer buffers (int64 in the published files; the stored dtype is kept on load).
        self.control_codes = mx.full((3,), s.codebook_size, dtype=mx.int32)
        self.codec_silence_tokens = mx.zeros((s.num_quantizers,), dtype=mx.int32)
        self.audio_prompt_latents = {cfg.speaker: mx.zeros((1, SPEAKER_PROMPT_FRAMES, s.hidden_size))}


class VoiceChatModel(nn.Module):
    """The whole model. Build with `voicechat.load(...)`; runtime entry points below.

    `numerics` ("reference", the default, or "float32"; voicechat/tts/numerics.py) is fixed for
    the model's life: everything it caches (the speaker warm-up, codebook norms, compiled
    pieces) is computed under it."""

    def __init__(self, cfg: VoiceChatConfig, numerics: Numerics | str = DEFAULT_NUMERICS):
        super().__init__()
        numerics = numerics_from(numerics)
        self.config = cfg
        self.stt_model = SttModel(cfg, numerics)
        self.tts_model = SpeechDecoder(cfg, numerics)
        self.tokenizer = None  # set by the loader (voicechat.tokenizer.TextTokenizer)
        self.source = None  # where it was loaded from (path or repo id)
        self.runtime = None  # set by `voicechat.runtime.prepare` (what `load` calls); None: plain ops

    @property
    def policy(self):
        """The `voicechat.runtime.ExecutionPolicy` this model's frames run under (fixed at load),
        or None for a model that was never prepared (its components then run the plain ops)."""
        return None if self.runtime is None else self.runtime.policy

    def executing(self):
        """A with-block in which this thread runs the model's components under its runtime (the
        sessions, `generate` and `prepare_prompt` use it; so may code calling components directly)."""
        return ops.bound(self.runtime if self.runtime is not None else ops.PLAIN)

    @property
    def numerics(self) -> Numerics:
        """The EAR-TTS numerics this model was built with (`model.numerics.name`)."""
        return self.tts_model.tts_model.numerics

    # -- small building blocks used by generation, sessions and the harness

    @property
    def speaker_latent(self) -> mx.array:
        return self.tts_model.audio_prompt_latents[self.config.speaker]

    def embed(self, ids: mx.array) -> mx.array:
        """Token embedding in float32 (activations are float32 throughout)."""
        return self.stt_model.embed_tokens(ids).astype(mx.float32)

    def fused_input(self, prev_text: mx.array, audio_emb: mx.array, prev_function: mx.array) -> mx.array:
        """LLM input E(prev_text) + audio_emb + w_f * E(prev_function) (docs/model.md §7.5)."""
        w = self.config.function_channel_weight
        return self.embed(prev_text) + audio_emb.astype(mx.float32) + w * self.embed(prev_function)

    def prompt_input(self, ids: mx.array) -> mx.array:
        """LLM inputs (P, H) of system-prompt positions: the prompt token's embedding in the audio
        slot, PAD in both id slots, summed in `fused_input`'s order as the reference does."""
        pad = mx.full(ids.shape, self.config.pad_token_id, dtype=mx.int32)
        return self.fused_input(pad, self.embed(ids), pad)

    # -- EAR-TTS speaker warm-up (depends on the weights only: computed once per model)

    def speaker_prompt_codes(self) -> mx.array:
        """(F, Q) prompt codes: the codec encoder applied to F+1 frames of silence, frames 0 and
        F-1 set to the mask code, the last frame dropped (docs/model.md §8.5 step 1)."""
        if getattr(self, "_prompt_codes", None) is None:
            with self.executing():
                self._prompt_codes = self._encode_prompt_codes()
        return self._prompt_codes

    def _encode_prompt_codes(self) -> mx.array:
        codec = self.tts_model.audio_codec
        frames = self.speaker_latent.shape[1]
        codes = codec.encode(mx.zeros(((frames + 1) * codec.samples_per_frame,), dtype=mx.float32))
        mask = self.tts_model.tts_model.mask_code
        codes = codes[:frames]
        rows = mx.arange(frames)[:, None]
        codes = mx.where((rows == 0) | (rows == frames - 1), mask, codes).astype(mx.int32)
        mx.eval(codes)
        return codes

    def ensure_char_table(self) -> None:
        tts = self.tts_model.tts_model
        if tts.char_table is None:
            if self.tokenizer is None:
                raise RuntimeError("the model has no tokenizer; load it with voicechat.load()")
            from .tts.char_encoder import CharTable

            tts.set_char_table(CharTable.from_vocab(
                self.tokenizer.get_vocab(), self.config.tts_config.character_encoder.char_vocab_size,
                num_tokens=self.config.text_config.vocab_size))

    def warm_tts_state(self):
        """A fresh copy of the EAR-TTS state right after the speaker warm-up.

        The warm-up (codec encoder on silence + one backbone pass over the prompt)
        depends only on the weights, so it runs once per model, not per session, and is
        kept on disk for later loads of the same checkpoint (voicechat/warmup_cache.py).
        """
        if getattr(self, "_warm_tts", None) is None:
            from . import warmup_cache

            self.ensure_char_table()
            key = warmup_cache.cache_key(self) if warmup_cache.enabled() else None
            cached = None if key is None else warmup_cache.load_cached(self, key)
            if cached is not None:  # bit-identical to computing it (voicechat/warmup_cache.py)
                self._prompt_codes, self._warm_tts = cached
            else:
                tts = self.tts_model.tts_model
                state = tts.make_state()
                with self.executing():
                    tts.warmup(state, self.speaker_prompt_codes(), self.speaker_latent, self.config.pad_token_id)
                    mx.eval(state.arrays())
                self._warm_tts = state
                if key is not None:
                    warmup_cache.store(key, self._prompt_codes, state)
        return self._warm_tts.copy()

    def warm_runtime(self, frames: int = 2) -> None:
        """Run `frames` silent frames through a throwaway streaming session (needs >= 2 to reach a
        TTS step) so per-weights constants, float32 copies and the second CPU stream exist before
        the first real session: its first frame then costs what a steady frame does. Touches no
        state of later sessions (each has its own caches and random generator)."""
        session = self.create_streaming_session()
        session.push_audio(np.zeros(frames * self.config.frame_samples, dtype=np.float32))
        session.cancel()

    def rnnt_transcriber(self):
        """A fresh RNNT stream and its incremental transcript (shared by the session and ASR)."""
        from .audio.rnnt import RnntStream, RnntTranscript

        text = self.rnnt_text()
        st = self.stt_model
        stream = RnntStream(st.rnnt_decoder, st.rnnt_joint, self.config.audio_config.max_symbols,
                            skip_ids=text.special_ids)
        return stream, RnntTranscript(text)

    def rnnt_text(self):
        """The RNNT piece decoder over the inline `rnnt_vocabulary`."""
        from .audio.rnnt import RnntText

        return RnntText(list(self.config.rnnt_vocabulary))

    def heads(self, hidden: mx.array) -> tuple[mx.array, mx.array]:
        """Text and function logits (float32) of the given final hidden states."""
        return (self.stt_model.lm_head(hidden).astype(mx.float32),
                self.stt_model.function_head(hidden).astype(mx.float32))

    # -- runtime entry points (api.md)

    def generate(self, audio, *, system_prompt=UNSET, seed: int = UNSET, extra_decoding_seconds: float = 0.0,
                 max_frames=None, use_language_cache: bool = True, tools=UNSET, tool_results=None,
                 tool_timeout_seconds=None, prompt_state=None):
        """Offline generation over the whole input -> `OfflineResult` (see voicechat.generate).

        `tools`: OpenAI-style function tools (voicechat.tools); `tool_results`: a schedule of
        `(after_frame, call_id, output)`, each submitted after that frame as a streaming session's
        `submit_tool_result` would be. `prompt_state`: start from `prepare_prompt`'s state instead
        of prefilling (its prompt, tools and seed; any of them given must agree with it). Without
        one, `system_prompt`, `seed` and `tools` default to None, 0 and None."""
        from .generate import generate

        return generate(self, audio, system_prompt=system_prompt, seed=seed,
                        extra_decoding_seconds=extra_decoding_seconds, max_frames=max_frames,
                        use_language_cache=use_language_cache, tools=tools, tool_results=tool_results,
                        tool_timeout_seconds=tool_timeout_seconds, prompt_state=prompt_state)

    def prepare_prompt(self, system_prompt=None, *, tools=None, seed: int = 0, should_stop=None):
        """Run the system-prompt prefill once -> a frozen `voicechat.PromptState` (api.md, "Prompt
        state"): `create_streaming_session(prompt_state=...)` and `generate(prompt_state=...)` start
        from a copy of it, bit for bit as if they had prefilled the same prompt."""
        from .prompt_state import prepare_prompt

        return prepare_prompt(self, system_prompt, tools=tools, seed=seed, should_stop=should_stop)

    def generate_stream(self, audio, *, chunk_frames: int = 25, system_prompt=None, seed: int = 0,
                        extra_decoding_seconds: float = 0.0, max_frames=None, use_language_cache: bool = True):
        """Like `generate`, yielding `AudioChunk`s decoded with the codec's streaming state."""
        from .generate import generate_stream

        return generate_stream(self, audio, chunk_frames=chunk_frames, system_prompt=system_prompt, seed=seed,
                               extra_decoding_seconds=extra_decoding_seconds, max_frames=max_frames,
                               use_language_cache=use_language_cache)

    def create_streaming_session(self, system_prompt=UNSET, seed: int = UNSET, max_streaming_seconds=None,
                                 use_language_cache: bool = True, use_perception_cache: bool = True,
                                 profile: bool = False, on_frame=None, tools=UNSET, tool_timeout_seconds=None,
                                 prompt_state=None, should_stop=None):
        """`on_frame`: optional callable handed a `voicechat.session.FrameRecord` (the frame's mel,
        encoder frame, RNNT tokens, logits, ids, raw and decoded codes, samples) after each frame.
        `tools`: OpenAI-style function tools the model may call (docs/tools.md); results go back
        with `session.submit_tool_result`; `tool_timeout_seconds` injects `{"error": "timeout"}`
        for a call whose result has not come within that much audio. `prompt_state`: start from
        `prepare_prompt`'s state instead of prefilling (its prompt, tools and seed; any of them
        given must agree with it). Without one, `system_prompt`, `seed` and `tools` default to
        None, 0 and None. `should_stop`: a callable the system-prompt prefill asks between pieces;
        true stops it with `PrefillStoppedError`."""
        from .session import VoiceChatStreamingSession

        return VoiceChatStreamingSession(
            self, system_prompt=system_prompt, seed=seed, max_streaming_seconds=max_streaming_seconds,
            use_language_cache=use_language_cache, use_perception_cache=use_perception_cache, profile=profile,
            on_frame=on_frame, tools=tools, tool_timeout_seconds=tool_timeout_seconds, prompt_state=prompt_state,
            should_stop=should_stop)

    def create_asr_session(self):
        from .asr import AsrStreamSession

        return AsrStreamSession(self)
