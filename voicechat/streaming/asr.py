"""Streaming ASR session: perception + RNNT only, for live captioning (api.md).

`step(samples)` takes any number of samples and returns the text decoded by
this call; `finish()` ends the stream. Mel frames are emitted as soon as they
are final (look-ahead n_fft/2), the cache-aware conformer turns every 8 mel
frames into one encoder frame, and the RNNT decodes each frame as it comes.
`finish()` flushes the mel stream with the same end-of-signal padding as the
offline log-mel and lets the conformer emit the frames the offline encoder has
beyond the last complete one, so the final transcript equals the offline
transcript of the whole audio byte for byte, for any push sizes (no zero
padding is added: that would change the last frames). Audio shorter than
n_fft/2 + 1 samples has no valid mel frame and transcribes to "".
"""

from __future__ import annotations

import threading
import time

import mlx.core as mx

from voicechat.errors import SessionClosedError, WrongThreadError
from voicechat.io.audio_input import as_mono_float32, check_sample_rate
from voicechat.model.audio.conformer import ConformerStream
from voicechat.model.audio.mel import StreamingLogMel


class AsrStreamSession:
    def __init__(self, model):
        cfg = model.config
        self.config = cfg
        self._model = model
        self._owner = threading.get_ident()
        pre = cfg.audio_config.preprocessor
        self.mel = StreamingLogMel(pre, lookahead_samples=pre.n_fft // 2)
        self.conformer = ConformerStream(model.stt_model.perception.encoder)
        self.rnnt, self._transcript = model.rnnt_transcriber()
        self.tokens: list[int] = []
        self.samples_seen = 0
        self.frames = 0
        self.closed = False
        self.first_text_latency_s: float | None = None  # push of the deciding audio -> text returned
        self.frame_ms: list[float] = []  # wall time per encoder frame (conformer + RNNT)

    @property
    def text(self) -> str:
        return self._transcript.text

    def _check(self):
        if threading.get_ident() != self._owner:
            raise WrongThreadError("this ASR session was created on another thread; use it from that thread")
        if self.closed:
            raise SessionClosedError("the ASR session is finished; create a new one")

    def _decode(self, mel: mx.array, final: bool, t_push: float) -> str:
        with self._model.executing():  # the model's execution policy, bound for the push
            return self._decode_held(mel, final, t_push)

    def _decode_held(self, mel: mx.array, final: bool, t_push: float) -> str:
        if not mel.shape[0] and not final:
            return ""
        enc = self.conformer.push(mel, final=final)
        delta_all = ""
        for i in range(enc.shape[0]):
            t0 = time.perf_counter()
            tokens = self.rnnt.step(enc[i])
            self.frames += 1
            if tokens:
                self.tokens.extend(tokens)
                delta, _ = self._transcript.add(tokens)
                delta_all += delta
                if delta and self.first_text_latency_s is None:
                    self.first_text_latency_s = time.perf_counter() - t_push
            self.frame_ms.append((time.perf_counter() - t0) * 1000.0)
        return delta_all

    def step(self, samples, sample_rate: int = 16000) -> str:
        """Push any number of samples; returns the transcript text decoded by this call."""
        self._check()
        check_sample_rate(sample_rate, self.config.input_sample_rate)
        a = as_mono_float32(samples)
        if a.size == 0:
            return ""
        t_push = time.perf_counter()
        self.samples_seen += a.size
        return self._decode(self.mel.push(a), False, t_push)

    def finish(self) -> str:
        """End of audio: decode the remaining frames; returns the text they add. Closes the session."""
        self._check()
        t_push = time.perf_counter()
        if self.samples_seen <= self.config.audio_config.preprocessor.n_fft // 2:
            delta = ""  # no valid frame (the reflect padding needs more samples); offline refuses it
        else:
            delta = self._decode(self.mel.flush(), True, t_push)
        self.closed = True
        return delta
