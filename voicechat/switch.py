"""The process-wide forced value of one execution switch (`VOICECHAT_CPU_STREAMS`,
`VOICECHAT_COMPILE`, `VOICECHAT_HOST_GEMM`): what `set_...(value)` and the
`with ..._set(value):` blocks of those modules change. None lets the switch's
default (its environment variable, then the device) apply."""

from __future__ import annotations

import contextlib
import os
from typing import Callable


class Override:
    """`value` is None or a value `check` accepted (check raises on anything else)."""

    def __init__(self, check: Callable[[object], object]):
        self._check = check
        self.value = None

    def set(self, value) -> None:
        self.value = None if value is None else self._check(value)

    @contextlib.contextmanager
    def scoped(self, value):
        """`set(value)` inside a with-block; the previous value (forced or None) after."""
        saved = self.value
        self.set(value)
        try:
            yield
        finally:
            self.value = saved


def bool_check(setter: str) -> Callable[[object], bool]:
    """A check for an on / off switch whose setter is called `setter`."""
    def check(value) -> bool:
        if not isinstance(value, bool):
            raise TypeError(f"{setter} expects True, False or None, got {value!r}")
        return value

    return check


def env_flag(name: str, what: str = "") -> bool | None:
    """The 0 / 1 environment variable `name`: True, False, or None when unset or empty; anything
    else raises, naming the variable (and `what` it switches, when given)."""
    env = os.environ.get(name, "").strip()
    if env == "":
        return None
    if env in ("0", "1"):
        return env == "1"
    raise ValueError(f"{name} must be 0 or 1{f' ({what})' if what else ''}, got {env!r}")


__all__ = ["Override", "bool_check", "env_flag"]
