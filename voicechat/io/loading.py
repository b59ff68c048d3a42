"""Reading a checkpoint folder or Hugging Face repo id into a `VoiceChatNetwork` (`voicechat.load`).

Strict: every tensor the model needs must be stored with the right shape and a
compatible dtype, nothing else may be stored, and problems are reported all
at once. Safetensors only (no pickle, no remote code).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten, tree_unflatten

from voicechat.errors import CheckpointError
from voicechat.io.checkpoint import (
    is_raw_layout,
    nonfinite_tensors,
    quantization_plan,
    read_safetensors,
    sanitize,
    unsanitize,
    write_shards,
)
from voicechat.io.progress import bar
from voicechat.io.tokenizer import TextTokenizer
from voicechat.model.config import VoiceChatConfig, dump_config, load_config
from voicechat.model.ops import stored_transposed
from voicechat.model.tts.numerics import Numerics, numerics_from
from voicechat.model.voicechat import VoiceChatNetwork
from voicechat.runtime import ExecutionPolicy, Prepared, Runtime, prepare
from voicechat.runtime.prepare import before_reading

# Files a checkpoint needs (README and the optional rnnt_tokenizer/ are not read).
ALLOW_PATTERNS = [
    "config.json",
    "*.safetensors",
    "model.safetensors.index.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
]

_REPO_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


def resolve_checkpoint(path_or_repo, revision: str | None = None) -> Path:
    """A local folder as is; otherwise a Hub repo id through `snapshot_download` (cache, HF_HUB_OFFLINE)."""
    p = Path(str(path_or_repo)).expanduser()
    if p.exists():
        if not p.is_dir():
            raise CheckpointError(f"{p}: expected a checkpoint folder, got a file")
        return p
    name = str(path_or_repo)
    if not _REPO_ID.match(name):
        raise CheckpointError(f"{name}: no such folder, and not a Hugging Face repo id (owner/name)")
    try:
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(name, revision=revision, allow_patterns=ALLOW_PATTERNS))
    except Exception as e:
        raise CheckpointError(
            f"{name}: not a local folder and could not be fetched from the Hugging Face Hub "
            f"({type(e).__name__}: {e}). Download it first or pass a folder."
        ) from None


def _check_tensors(model: nn.Module, weights: dict) -> None:
    expected = dict(tree_flatten(model.parameters()))
    missing = sorted(set(expected) - set(weights))
    unexpected = sorted(set(weights) - set(expected))
    problems = []
    for k in sorted(set(expected) & set(weights)):
        e, w = expected[k], weights[k]
        if tuple(e.shape) != tuple(w.shape):
            problems.append(f"{k}: stored shape {tuple(w.shape)}, model expects {tuple(e.shape)}")
        elif mx.issubdtype(e.dtype, mx.floating) != mx.issubdtype(w.dtype, mx.floating) or (e.dtype == mx.uint32) != (
            w.dtype == mx.uint32
        ):
            problems.append(f"{k}: stored dtype {w.dtype}, model expects {e.dtype}-like")
    if missing or unexpected or problems:
        lines = []
        if missing:
            lines.append(f"missing tensors ({len(missing)}): " + ", ".join(missing[:50]))
        if unexpected:
            lines.append(f"unexpected tensors ({len(unexpected)}): " + ", ".join(unexpected[:50]))
        if problems:
            lines.append(f"mismatched tensors ({len(problems)}):\n    " + "\n    ".join(problems[:50]))
        raise CheckpointError("checkpoint does not match the model:\n  " + "\n  ".join(lines))


# Tensors are read (and checked for NaN / inf) in groups of about this many bytes, so the
# temporaries of a load are bounded by one group beside what the model keeps.
READ_GROUP_BYTES = 512 * 1024**2


def _progress(total: int, desc: str):
    return bar(total=total, desc=desc, unit="B", unit_scale=True)  # a TTY bar, see progress.py


def read_weights(weights: dict, *, check_finite: bool = True, desc: str = "loading") -> None:
    """Evaluate the (lazy, file-backed) arrays of `weights` a group at a time, with a progress
    bar in bytes; raise CheckpointError naming the float tensors that hold NaN or inf.

    `mx.load` of a safetensors file only records where each tensor is; its bytes are read
    when it is evaluated, straight into the array that keeps them (transposed sanitize views
    share it), so the load's peak is what the model keeps plus one group's temporaries."""
    names = list(weights)
    bar = _progress(sum(weights[k].nbytes for k in names), desc)
    bad: list[str] = []
    try:
        start = 0
        while start < len(names):
            group, size = [], 0
            while start < len(names) and (not group or size < READ_GROUP_BYTES):
                group.append(names[start])
                size += weights[names[start]].nbytes
                start += 1
            mx.eval([weights[k] for k in group])
            if check_finite:
                bad += nonfinite_tensors({k: weights[k] for k in group})
            if bar is not None:
                bar.update(size)
    finally:
        if bar is not None:
            bar.close()
    if bad:
        raise CheckpointError(f"tensors with NaN or infinite values ({len(bad)}): " + ", ".join(bad[:20]))


@dataclass(frozen=True)
class LoadedParts:
    """What a loaded model holds besides its network (`VoiceChatModel`'s other arguments)."""

    tokenizer: TextTokenizer
    runtime: Runtime
    prepared: Prepared
    source: str
    folder: Path


def load_network(
    path_or_repo,
    *,
    revision: str | None = None,
    numerics: str | Numerics = "reference",
    check_finite: bool = True,
    policy: ExecutionPolicy | None = None,
) -> tuple[VoiceChatNetwork, LoadedParts]:
    """Read a checkpoint into a `VoiceChatNetwork` prepared for `policy` -> (network, parts), where
    `parts` are the rest of a loaded model (`tokenizer`, `runtime`, `prepared`, `source`, `folder`):
    `voicechat.load` (voicechat.streaming.model.load) makes the `VoiceChatModel` of both. See the
    module docstring; raises CheckpointError / ConfigError.

    `numerics`: "reference" (EAR-TTS rounds as mlx-vlm does: same codes) or "float32"
    (voicechat/model/tts/numerics.py); fixed for this model. `policy`: how its frames execute
    (`voicechat.runtime.ExecutionPolicy`; default `ExecutionPolicy.for_device()`, which reads the
    `VOICECHAT_*` execution variables once, here); fixed for this model (`model.policy`).
    """
    chosen = numerics_from(numerics)  # a bad value fails before anything is read
    if policy is None:
        policy = ExecutionPolicy.for_device()
    elif not isinstance(policy, ExecutionPolicy):
        raise TypeError(f"load(policy=...) expects a voicechat.runtime.ExecutionPolicy, got {type(policy).__name__}")
    before_reading(policy)  # e.g. glibc's heap thresholds, before the weights are allocated
    folder = resolve_checkpoint(path_or_repo, revision)
    cfg: VoiceChatConfig = load_config(folder)
    steps = bar(total=3, desc=f"loading {folder.name}", unit="step")  # a TTY bar, see progress.py
    weights, _ = read_safetensors(folder)
    if is_raw_layout(weights):
        weights = sanitize(weights, cfg)
    network = VoiceChatNetwork(cfg, chosen)
    plan = quantization_plan(weights, cfg)
    if plan:
        quantizable = {p for p, m in network.named_modules() if hasattr(m, "to_quantized")}
        not_quantizable = sorted(set(plan) - quantizable)
        if not_quantizable:
            raise CheckpointError(
                "'.scales' stored for modules that are not Linear/Embedding layers: " + ", ".join(not_quantizable[:20])
            )
        nn.quantize(network, class_predicate=lambda p, m: dict(plan[p]) if p in plan else False)
    _check_tensors(network, weights)
    read_weights(weights, check_finite=check_finite, desc=f"reading {folder.name}")
    steps.update()  # read and checked
    network.update(tree_unflatten(list(weights.items())))
    del weights  # the network holds the arrays now; a float32 copy below may release its original
    mx.eval(network.parameters())
    steps.update()  # in memory
    prepared = prepare(network, policy)  # the weight layout the policy runs on (voicechat/runtime)
    steps.update()  # prepared
    steps.close()
    return network, LoadedParts(
        tokenizer=TextTokenizer.from_file(folder / "tokenizer.json"),
        runtime=prepared.runtime,
        prepared=prepared,
        source=str(path_or_repo),
        folder=folder,
    )


def save(model, folder, n_shards: int = 2) -> Path:
    """Save a loaded model back in the published raw layout (reloads with `load`)."""
    import shutil

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    network = model.network
    params = dict(tree_flatten(network.parameters()))
    for path, m in network.named_modules():  # float32 copies go back to the dtype they were stored in
        dtype = m.__dict__.get("_stored_dtype")
        if dtype is not None and stored_transposed(m) is not None:
            for name in ("weight", "bias"):
                if f"{path}.{name}" in params:
                    params[f"{path}.{name}"] = params[f"{path}.{name}"].astype(dtype)
    raw = unsanitize(params, model.config)
    write_shards(raw, folder, n_shards=n_shards)
    (folder / "config.json").write_text(dump_config(model.config))
    src = model.folder
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        if src is not None and (Path(src) / name).exists():
            shutil.copy(Path(src) / name, folder / name)
    return folder
