"""Reference dumps: the tensors a machine without the reference implementation needs to compare against it.

    voicechat parity -m CKPT --audio a.wav --backend mlx-vlm --dump-reference ref.npz      (machine with mlx-vlm)
    voicechat parity -m CKPT --audio a.wav --against ref.npz                               (anywhere)

A dump holds, for the offline and the streamed path: per-frame text / function
ids, codes, audio (and the streamed tail), text, transcript and its tokens
(per frame when known), the mel / encoder frames when the backend provides
them, the two largest logits per frame (enough for argmax margins) and the
full first-frame logits; plus the metadata (backend, checkpoint, input digest,
seed, prompt, codec geometry) that `DumpBackend` checks before replaying it.
No pickled objects: plain arrays and one JSON string.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from .backends.base import Backend, OfflineRun, StreamRun
from .engine import Runs, audio_digest

FORMAT = "voicechat-parity-reference/1"


def _top2(logits) -> np.ndarray | None:
    if logits is None:
        return None
    logits = np.asarray(logits, dtype=np.float32)
    if logits.ndim != 2 or logits.shape[-1] < 2:
        return None
    return np.sort(np.partition(logits, -2, axis=-1)[:, -2:], axis=-1)


def dump_reference(
    path,
    backend: Backend,
    runs: Runs,
    audio: np.ndarray,
    *,
    system_prompt: str | None,
    seed: int,
    checkpoint: str | None = None,
    chunk_samples: int = 1280,
) -> Path:
    """Write `runs` (from `engine.collect_runs(backend, audio, ...)`) to a .npz file."""
    path = Path(path)
    if path.suffix != ".npz":
        raise ValueError(f"--dump-reference: expected a .npz file name, got {str(path)!r}")
    arrays: dict[str, np.ndarray] = {}
    meta = {
        "format": FORMAT,
        "backend": backend.name,
        "backend_version": getattr(backend, "version", None),
        "checkpoint": checkpoint or getattr(backend, "checkpoint", None),
        "input_sha256": audio_digest(audio),
        "input_samples": int(np.asarray(audio).size),
        "seed": int(seed),
        "system_prompt": system_prompt or "",
        "chunk_samples": int(chunk_samples),
        "samples_per_frame": int(backend.samples_per_frame),
        "lead_in": int(backend.lead_in),
        "warmup_samples": getattr(backend, "warmup_samples", None),
        "encoder_xscaling": getattr(backend, "encoder_xscaling", None),
    }
    for prefix, run in (("offline", runs.offline), ("stream", runs.stream)):
        if run is None:
            continue
        arrays[f"{prefix}.text_ids"] = np.asarray(run.text_ids, np.int32)
        arrays[f"{prefix}.function_ids"] = np.asarray(run.function_ids, np.int32)
        arrays[f"{prefix}.codes"] = np.asarray(run.codes, np.int32)
        arrays[f"{prefix}.audio"] = np.asarray(run.audio, np.float32)
        if isinstance(run, StreamRun):
            arrays[f"{prefix}.tail"] = np.asarray(run.tail, np.float32)
        for name in ("mel", "encoder"):
            v = getattr(run, name)
            if v is not None:
                arrays[f"{prefix}.{name}"] = np.asarray(v, np.float32)
        for name in ("text_logits", "function_logits"):
            top = _top2(getattr(run, name))
            if top is not None:
                arrays[f"{prefix}.{name}_top2"] = top
        meta[prefix] = {
            "text": run.text,
            "transcript": run.transcript,
            "transcript_tokens": None if run.transcript_tokens is None else [int(t) for t in run.transcript_tokens],
            "transcript_frame_tokens": (
                None
                if run.transcript_frame_tokens is None
                else [[int(t) for t in f] for f in run.transcript_frame_tokens]
            ),
        }
    if runs.first_text_logits is not None:
        arrays["offline.first_text_logits"] = np.asarray(runs.first_text_logits, np.float32)
    if runs.first_function_logits is not None:
        arrays["offline.first_function_logits"] = np.asarray(runs.first_function_logits, np.float32)
    arrays["meta"] = np.array(json.dumps(meta))
    path.parent.mkdir(parents=True, exist_ok=True)
    np.savez_compressed(path, allow_pickle=False, **arrays)
    return path


class DumpBackend(Backend):
    """Replays a reference dump as a backend (for `--against FILE.npz` / `VOICECHAT_REFERENCE`).

    `offline` / `stream` refuse to answer for another input, seed, prompt or
    chunk size than the dump was made with (ValueError naming the mismatch).
    Logits are the two largest values per frame: enough for margins, not argmaxes.
    """

    def __init__(self, path):
        self.path = Path(path)
        if not self.path.is_file():
            raise FileNotFoundError(f"reference dump {str(self.path)!r} does not exist")
        with np.load(self.path, allow_pickle=False) as z:
            self._arrays = {k: z[k] for k in z.files}
        if "meta" not in self._arrays:
            raise ValueError(f"{self.path}: not a parity reference dump (no 'meta' entry)")
        self.meta = json.loads(str(self._arrays["meta"]))
        if self.meta.get("format") != FORMAT:
            raise ValueError(f"{self.path}: dump format {self.meta.get('format')!r}, expected {FORMAT!r}")
        self.name = f"dump:{self.meta['backend']}"
        self.checkpoint = self.meta.get("checkpoint")
        self.version = self.meta.get("backend_version")

    @property
    def samples_per_frame(self) -> int:
        return int(self.meta["samples_per_frame"])

    @property
    def lead_in(self) -> int:
        return int(self.meta["lead_in"])

    @property
    def warmup_samples(self):
        return self.meta.get("warmup_samples")

    @property
    def encoder_xscaling(self):
        return self.meta.get("encoder_xscaling")

    @property
    def first_logits(self):
        a = self._arrays
        if "offline.first_text_logits" not in a:
            return None
        return a["offline.first_text_logits"], a.get("offline.first_function_logits")

    def load(self, checkpoint: str):
        return None

    def _check(self, audio, system_prompt, seed, chunk_samples=None) -> None:
        m = self.meta
        problems = []
        if audio_digest(np.asarray(audio, np.float32)) != m["input_sha256"]:
            problems.append(f"input audio differs (dump: {m['input_samples']} samples, sha256 {m['input_sha256']})")
        if int(seed) != m["seed"]:
            problems.append(f"seed {seed} != {m['seed']}")
        if (system_prompt or "") != m["system_prompt"]:
            problems.append(f"system prompt {system_prompt or ''!r} != {m['system_prompt']!r}")
        if chunk_samples is not None and int(chunk_samples) != m["chunk_samples"]:
            problems.append(f"chunk_samples {chunk_samples} != {m['chunk_samples']}")
        if problems:
            raise ValueError(f"{self.path}: the dump was made for other inputs: " + "; ".join(problems))

    def _get(self, key):
        """An optional array of the dump (None when it has none)."""
        return self._arrays.get(key)

    def _need(self, key) -> np.ndarray:
        """An array every dump of a run has; a dump without it is refused, naming it."""
        a = self._arrays.get(key)
        if a is None:
            raise ValueError(f"{self.path}: the dump has no {key!r}")
        return a

    def offline(self, audio, *, system_prompt=None, seed=0, extra_decoding_seconds=0.0, with_logits=False):
        self._check(audio, system_prompt, seed)
        if "offline" not in self.meta:
            raise ValueError(f"{self.path}: the dump has no offline run")
        m = self.meta["offline"]
        return OfflineRun(
            text_ids=self._need("offline.text_ids"),
            function_ids=self._need("offline.function_ids"),
            codes=self._need("offline.codes"),
            audio=self._need("offline.audio"),
            text=m["text"],
            transcript=m["transcript"],
            transcript_tokens=m["transcript_tokens"],
            mel=self._get("offline.mel"),
            encoder=self._get("offline.encoder"),
            text_logits=self._get("offline.text_logits_top2"),
            function_logits=self._get("offline.function_logits_top2"),
            transcript_frame_tokens=m["transcript_frame_tokens"],
        )

    def stream(self, audio, *, system_prompt=None, seed=0, chunk_samples=1280, profile=False, with_logits=False):
        self._check(audio, system_prompt, seed, chunk_samples)
        if "stream" not in self.meta:
            raise ValueError(f"{self.path}: the dump has no streamed run")
        m = self.meta["stream"]
        return StreamRun(
            text_ids=self._need("stream.text_ids"),
            function_ids=self._need("stream.function_ids"),
            codes=self._need("stream.codes"),
            audio=self._need("stream.audio"),
            tail=self._need("stream.tail"),
            text=m["text"],
            transcript=m["transcript"],
            transcript_tokens=m["transcript_tokens"],
            mel=self._get("stream.mel"),
            encoder=self._get("stream.encoder"),
            text_logits=self._get("stream.text_logits_top2"),
            function_logits=self._get("stream.function_logits_top2"),
            transcript_frame_tokens=m["transcript_frame_tokens"],
        )


__all__ = ["dump_reference", "DumpBackend", "FORMAT"]
