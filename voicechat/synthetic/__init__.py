"""Synthetic checkpoints in the published on-disk layout (checkpoint.py), their presets
(presets.py) and the tool-call script the `toolcall` preset spells (toolcall.py)."""

from voicechat.synthetic.checkpoint import (
    checkpoint_size,
    ensure_synthetic,
    language_path_modules,
    resolve_model_arg,
    write_checkpoint,
)

__all__ = ["checkpoint_size", "ensure_synthetic", "language_path_modules", "resolve_model_arg", "write_checkpoint"]
