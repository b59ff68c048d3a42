"""What the package reads from the process environment: 0 / 1 switches and the cache folder."""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path


def env_flag(name: str, environ: Mapping[str, str] | None = None, what: str = "") -> bool | None:
    """The 0 / 1 variable `name` of `environ` (default os.environ): True, False, or None when unset
    or empty; anything else raises, naming the variable (and `what` it switches, when given)."""
    value = (os.environ if environ is None else environ).get(name, "").strip()
    if value == "":
        return None
    if value in ("0", "1"):
        return value == "1"
    raise ValueError(f"{name} must be 0 or 1{f' ({what})' if what else ''}, got {value!r}")


def cache_home() -> Path:
    """This project's cache folder: `$VOICECHAT_CACHE`, default `~/.cache/voicechat` (synthetic
    checkpoints, the TTS warm-up cache)."""
    return Path(os.environ.get("VOICECHAT_CACHE", Path.home() / ".cache" / "voicechat"))


__all__ = ["cache_home", "env_flag"]
