"""`VoiceChatModel`: a loaded network with its tokenizer and runtime, and the entry points that
start conversations (api.md): `generate`, `generate_stream`, `create_streaming_session`,
`prepare_prompt`, `create_asr_session`. `load` builds one from a checkpoint.

Everything it holds is given at construction; the values it computes once per weights (the
speaker prompt codes, the EAR-TTS state after the speaker warm-up) are made on first use and kept
in slots declared here.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from voicechat.io import warmup_cache
from voicechat.io.loading import load_network
from voicechat.model import ops
from voicechat.model.tts.char_encoder import CharTable
from voicechat.model.voicechat import SpeechDecoder, SttModel, VoiceChatNetwork
from voicechat.streaming.asr import AsrStreamSession
from voicechat.streaming.batch import SessionBatch
from voicechat.streaming.generate import generate, generate_stream
from voicechat.streaming.prompt_state import UNSET, Unset, prepare_prompt
from voicechat.streaming.session import VoiceChatStreamingSession


class VoiceChatModel:
    """A loaded model. Build with `voicechat.load(...)`.

    `network`: the module tree (`VoiceChatNetwork`; `stt_model` / `tts_model` are its halves);
    `tokenizer`; `runtime`: how its frames execute (`voicechat.runtime.Runtime`, made by `prepare`
    under the policy chosen at load; None: the plain ops); `prepared`: what `prepare` rewrote;
    `source` / `folder`: where it came from."""

    def __init__(
        self,
        network: VoiceChatNetwork,
        *,
        tokenizer=None,
        runtime=None,
        prepared=None,
        source: str | None = None,
        folder=None,
    ):
        if not isinstance(network, VoiceChatNetwork):
            raise TypeError(f"VoiceChatModel wraps a VoiceChatNetwork, got {type(network).__name__}")
        self.network = network
        self.config = network.config
        self.tokenizer = tokenizer
        self.runtime = runtime
        self.prepared = prepared
        self.source = source
        self.folder = folder
        self._prompt_codes: mx.array | None = None  # speaker prompt codes, once per weights
        self._warm_tts = None  # the EAR-TTS state after the speaker warm-up, once per weights

    def __repr__(self) -> str:
        return f"VoiceChatModel({self.source or 'unsaved'}, numerics={self.numerics.name}, policy={self.policy})"

    # -- the network's parts and math

    @property
    def stt_model(self) -> SttModel:
        return self.network.stt_model

    @property
    def tts_model(self) -> SpeechDecoder:
        return self.network.tts_model

    @property
    def numerics(self):
        """The EAR-TTS numerics this model was built with (`model.numerics.name`)."""
        return self.network.numerics

    @property
    def speaker_latent(self) -> mx.array:
        return self.network.speaker_latent

    def embed(self, ids: mx.array) -> mx.array:
        return self.network.embed(ids)

    def fused_input(self, prev_text: mx.array, audio_emb: mx.array, prev_function: mx.array) -> mx.array:
        return self.network.fused_input(prev_text, audio_emb, prev_function)

    def prompt_input(self, ids: mx.array) -> mx.array:
        return self.network.prompt_input(ids)

    def heads(self, hidden: mx.array) -> tuple[mx.array, mx.array]:
        return self.network.heads(hidden)

    def rnnt_transcriber(self):
        return self.network.rnnt_transcriber()

    def rnnt_text(self):
        return self.network.rnnt_text()

    def parameters(self):
        """The network's parameters (for inspection; the network is `model.network`)."""
        return self.network.parameters()

    def named_modules(self):
        return self.network.named_modules()

    def modules(self):
        return self.network.modules()

    # -- execution

    @property
    def policy(self):
        """The `voicechat.runtime.ExecutionPolicy` this model's frames run under (fixed at load),
        or None for a model that was never prepared (its components then run the plain ops)."""
        return None if self.runtime is None else self.runtime.policy

    def executing(self):
        """A with-block in which this thread runs the model's components under its runtime (the
        sessions, `generate` and `prepare_prompt` use it; so may code calling components directly)."""
        return ops.bound(self.runtime if self.runtime is not None else ops.PLAIN)

    # -- EAR-TTS speaker warm-up (depends on the weights only: computed once per model)

    def speaker_prompt_codes(self) -> mx.array:
        """(F, Q) speaker prompt codes (`VoiceChatNetwork.encode_prompt_codes`), once."""
        if self._prompt_codes is None:
            with self.executing():
                self._prompt_codes = self.network.encode_prompt_codes()
        return self._prompt_codes

    def ensure_char_table(self) -> None:
        tts = self.tts_model.tts_model
        if tts.char_table is None:
            if self.tokenizer is None:
                raise RuntimeError("the model has no tokenizer; load it with voicechat.load()")
            tts.set_char_table(
                CharTable.from_vocab(
                    self.tokenizer.get_vocab(),
                    self.config.tts_config.character_encoder.char_vocab_size,
                    num_tokens=self.config.text_config.vocab_size,
                )
            )

    def warm_tts_state(self):
        """A fresh copy of the EAR-TTS state right after the speaker warm-up.

        The warm-up (codec encoder on silence + one backbone pass over the prompt)
        depends only on the weights, so it runs once per model, not per session, and is
        kept on disk for later loads of the same checkpoint (voicechat/io/warmup_cache.py).
        """
        if self._warm_tts is None:
            self.ensure_char_table()
            key = warmup_cache.cache_key(self) if warmup_cache.enabled() else None
            cached = None if key is None else warmup_cache.load_cached(self, key)
            if cached is not None:  # bit-identical to computing it (voicechat/io/warmup_cache.py)
                self._prompt_codes, self._warm_tts = cached
            else:
                tts = self.tts_model.tts_model
                state = tts.make_state()
                with self.executing():
                    tts.warmup(state, self.speaker_prompt_codes(), self.speaker_latent, self.config.pad_token_id)
                    mx.eval(state.arrays())
                self._warm_tts = state
                if key is not None:
                    warmup_cache.store(key, self.speaker_prompt_codes(), state)
        return self._warm_tts.copy()

    def warm_runtime(self, frames: int = 2) -> None:
        """Run `frames` silent frames through a throwaway streaming session (needs >= 2 to reach a
        TTS step) so per-weights constants, float32 copies and the second CPU stream exist before
        the first real session: its first frame then costs what a steady frame does. Touches no
        state of later sessions (each has its own caches and random generator)."""
        session = self.create_streaming_session()
        session.push_audio(np.zeros(frames * self.config.frame_samples, dtype=np.float32))
        session.cancel()

    # -- entry points (api.md)

    def generate(
        self,
        audio,
        *,
        system_prompt: str | Unset | None = UNSET,
        seed: int | Unset = UNSET,
        extra_decoding_seconds: float = 0.0,
        max_frames=None,
        use_language_cache: bool = True,
        tools=UNSET,
        tool_results=None,
        tool_timeout_seconds=None,
        prompt_state=None,
    ):
        """Offline generation over the whole input -> `OfflineResult` (see voicechat.streaming.generate).

        `tools`: OpenAI-style function tools (voicechat.tools); `tool_results`: a schedule of
        `(after_frame, call_id, output)`, each submitted after that frame as a streaming session's
        `submit_tool_result` would be. `prompt_state`: start from `prepare_prompt`'s state instead
        of prefilling (its prompt, tools and seed; any of them given must agree with it). Without
        one, `system_prompt`, `seed` and `tools` default to None, 0 and None."""
        return generate(
            self,
            audio,
            system_prompt=system_prompt,
            seed=seed,
            extra_decoding_seconds=extra_decoding_seconds,
            max_frames=max_frames,
            use_language_cache=use_language_cache,
            tools=tools,
            tool_results=tool_results,
            tool_timeout_seconds=tool_timeout_seconds,
            prompt_state=prompt_state,
        )

    def prepare_prompt(self, system_prompt=None, *, tools=None, seed: int = 0, should_stop=None):
        """Run the system-prompt prefill once -> a frozen `voicechat.PromptState` (api.md, "Prompt
        state"): `create_streaming_session(prompt_state=...)` and `generate(prompt_state=...)` start
        from a copy of it, bit for bit as if they had prefilled the same prompt."""
        return prepare_prompt(self, system_prompt, tools=tools, seed=seed, should_stop=should_stop)

    def generate_stream(
        self,
        audio,
        *,
        chunk_frames: int = 25,
        system_prompt=None,
        seed: int = 0,
        extra_decoding_seconds: float = 0.0,
        max_frames=None,
        use_language_cache: bool = True,
    ):
        """Like `generate`, yielding `AudioChunk`s decoded with the codec's streaming state."""
        return generate_stream(
            self,
            audio,
            chunk_frames=chunk_frames,
            system_prompt=system_prompt,
            seed=seed,
            extra_decoding_seconds=extra_decoding_seconds,
            max_frames=max_frames,
            use_language_cache=use_language_cache,
        )

    def create_streaming_session(
        self,
        system_prompt: str | Unset | None = UNSET,
        seed: int | Unset = UNSET,
        max_streaming_seconds=None,
        use_language_cache: bool = True,
        use_perception_cache: bool = True,
        profile: bool = False,
        on_frame=None,
        tools=UNSET,
        tool_timeout_seconds=None,
        prompt_state=None,
        should_stop=None,
    ) -> VoiceChatStreamingSession:
        """`on_frame`: optional callable handed a `voicechat.streaming.session.FrameRecord` (the frame's mel,
        encoder frame, RNNT tokens, logits, ids, raw and decoded codes, samples) after each frame.
        `tools`: OpenAI-style function tools the model may call (docs/tools.md); results go back
        with `session.submit_tool_result`; `tool_timeout_seconds` injects `{"error": "timeout"}`
        for a call whose result has not come within that much audio. `prompt_state`: start from
        `prepare_prompt`'s state instead of prefilling (its prompt, tools and seed; any of them
        given must agree with it). Without one, `system_prompt`, `seed` and `tools` default to
        None, 0 and None. `should_stop`: a callable the system-prompt prefill asks between pieces;
        true stops it with `PrefillStoppedError`."""
        return VoiceChatStreamingSession(
            self,
            system_prompt=system_prompt,
            seed=seed,
            max_streaming_seconds=max_streaming_seconds,
            use_language_cache=use_language_cache,
            use_perception_cache=use_perception_cache,
            profile=profile,
            on_frame=on_frame,
            tools=tools,
            tool_timeout_seconds=tool_timeout_seconds,
            prompt_state=prompt_state,
            should_stop=should_stop,
        )

    def create_session_batch(self, max_sessions: int) -> SessionBatch:
        """Room for `max_sessions` concurrent conversations whose frames are computed together
        (`voicechat.streaming.batch`): `batch.open(**kwargs)` takes this method's neighbour
        `create_streaming_session`'s arguments; `batch.push({session: samples})`. Each session
        computes exactly what it computes alone."""
        return SessionBatch(self, max_sessions)

    def create_asr_session(self) -> AsrStreamSession:
        return AsrStreamSession(self)


def load(path_or_repo, *, revision=None, warmup: bool = True, **kwargs) -> VoiceChatModel:
    """A checkpoint folder or Hugging Face repo id -> `VoiceChatModel` (`voicechat.load`; the
    arguments of `voicechat.io.loading.load_network`). `warmup=False` skips the EAR-TTS speaker
    warm-up (it then runs at the first session)."""
    network, parts = load_network(path_or_repo, revision=revision, **kwargs)
    model = VoiceChatModel(
        network,
        tokenizer=parts.tokenizer,
        runtime=parts.runtime,
        prepared=parts.prepared,
        source=parts.source,
        folder=parts.folder,
    )
    if warmup:
        # The EAR-TTS speaker warm-up depends only on the weights: do it once here, so creating a
        # session (when the user is about to speak) costs only a state copy.
        model.warm_tts_state()
    return model


__all__ = ["VoiceChatModel", "load"]
