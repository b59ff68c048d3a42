"""The process-wide forced value of one execution switch (`VOICECHAT_CPU_STREAMS`,
`VOICECHAT_COMPILE`, `VOICECHAT_HOST_GEMM`): what `set_...(value)` and the
`with ..._set(value):` blocks of those modules change. None lets the switch's
default (its environment variable, then the device) apply."""

from __future__ import annotations

import contextlib
import os
import threading
from typing import Callable

_held = threading.local()  # .values: {switch name: decision} while `decisions_held()` is active


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


@contextlib.contextmanager
def decisions_held():
    """Inside the block (one streamed frame), each switch (`held`) is decided once on this thread:
    a frame asks them ~1,000 times, and each decision reads the environment (~0.6 us a read), ~1-2
    ms of a small frame. A change of a switch's environment variable or forced value applies from
    the next frame. Nested blocks share the outer one's decisions."""
    outer = getattr(_held, "values", None)
    if outer is None:
        _held.values = {}
    try:
        yield
    finally:
        if outer is None:
            _held.values = None


def held(name: str, decide: Callable[[], object]):
    """`decide()`, made once per `decisions_held()` block on this thread (every call outside one);
    a decision that raises is not kept."""
    values = getattr(_held, "values", None)
    if values is None:
        return decide()
    try:
        return values[name]
    except KeyError:
        value = values[name] = decide()
        return value


__all__ = ["Override", "bool_check", "decisions_held", "env_flag", "held"]
