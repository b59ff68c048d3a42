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
import time
from types import ModuleType
from typing import Any

from .peer_session import PeerSessionBackend

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


class MlxVlmBackend(PeerSessionBackend):
    """Drives mlx-vlm's nemotron_voicechat (offline `generate` and the streaming session)."""

    name = "mlx-vlm"

    def __init__(self):
        super().__init__()
        self.processor = None

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

    def close(self) -> None:
        self.processor = None
        super().close()

    # -- where mlx-vlm keeps what the shared driver (peer_session.py) needs

    def _session_module(self) -> ModuleType:
        from mlx_vlm.models.nemotron_voicechat import session as vlm_session

        return vlm_session

    def _tts_config(self) -> Any:
        return self.model.config.tts_config

    def _codec_config(self) -> Any:
        return self.model.config.codec_config

    def _rnnt_state(self) -> Any:
        from mlx_vlm.models.nemotron_voicechat.streaming import _RNNTState

        return _RNNTState(self._require())

    def _create_streaming(self, sess, *, system_prompt: str | None, seed: int, profile: bool) -> Any:
        return sess.create_streaming_session(system_prompt=system_prompt, seed=seed, profile=profile)

    def _profile(self, s, frames: list[dict]) -> tuple[list[dict] | None, dict | None]:
        """mlx-vlm's own streaming profile (`profile=True` at session creation)."""
        return [dataclasses.asdict(t) for t in s.profile.frames], s.profile.summary()
