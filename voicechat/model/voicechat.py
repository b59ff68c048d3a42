"""`VoiceChatNetwork`: the module tree in the published naming, and the math that joins its parts.

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

from voicechat.model.audio.codec import Codec
from voicechat.model.audio.conformer import Perception
from voicechat.model.audio.rnnt import RnntDecoder, RnntJoint, RnntStream, RnntText, RnntTranscript
from voicechat.model.config import VoiceChatConfig
from voicechat.model.llm.nemotron_h import NemotronH
from voicechat.model.tts.ear_tts import EarTts
from voicechat.model.tts.numerics import DEFAULT_NUMERICS, Numerics, numerics_from

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


class VoiceChatNetwork(nn.Module):
    """The whole network, its weights in the published naming, and the math that joins its parts
    (the fused LLM input, the heads, the prompt inputs). `voicechat.load` builds one and hands it to
    a `voicechat.streaming.model.VoiceChatModel`, which adds the tokenizer, the runtime and the
    entry points.

    `numerics` ("reference", the default, or "float32"; voicechat/model/tts/numerics.py) is fixed for
    the network's life: everything cached from it (the speaker warm-up, codebook norms, compiled
    pieces) is computed under it."""

    def __init__(self, cfg: VoiceChatConfig, numerics: Numerics | str = DEFAULT_NUMERICS):
        super().__init__()
        numerics = numerics_from(numerics)
        self.config = cfg
        self.stt_model = SttModel(cfg, numerics)
        self.tts_model = SpeechDecoder(cfg, numerics)

    @property
    def numerics(self) -> Numerics:
        """The EAR-TTS numerics this network was built with (`numerics.name`)."""
        return self.tts_model.tts_model.numerics

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

    def heads(self, hidden: mx.array) -> tuple[mx.array, mx.array]:
        """Text and function logits (float32) of the given final hidden states."""
        return (
            self.stt_model.lm_head(hidden).astype(mx.float32),
            self.stt_model.function_head(hidden).astype(mx.float32),
        )

    def encode_prompt_codes(self) -> mx.array:
        """(F, Q) EAR-TTS speaker prompt codes: the codec encoder applied to F+1 frames of silence,
        frames 0 and F-1 set to the mask code, the last frame dropped (docs/model.md §8.5 step 1)."""
        codec = self.tts_model.audio_codec
        frames = self.speaker_latent.shape[1]
        codes = codec.encode(mx.zeros(((frames + 1) * codec.samples_per_frame,), dtype=mx.float32))
        mask = self.tts_model.tts_model.mask_code
        codes = codes[:frames]
        rows = mx.arange(frames)[:, None]
        codes = mx.where((rows == 0) | (rows == frames - 1), mask, codes).astype(mx.int32)
        mx.eval(codes)
        return codes

    def rnnt_transcriber(self):
        """A fresh RNNT stream and its incremental transcript (shared by the session and ASR)."""
        text = self.rnnt_text()
        st = self.stt_model
        stream = RnntStream(
            st.rnnt_decoder, st.rnnt_joint, self.config.audio_config.max_symbols, skip_ids=text.special_ids
        )
        return stream, RnntTranscript(text)

    def rnnt_text(self):
        """The RNNT piece decoder over the inline `rnnt_vocabulary`."""
        return RnntText(list(self.config.rnnt_vocabulary))
