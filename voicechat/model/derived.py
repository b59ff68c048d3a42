"""Values computed from parameters alone, made once per weights instead of at every call.

A frame at the small widths is bound by MLX's per-operation dispatch, not by
arithmetic: "1 + w" of a norm, -exp(A_log) of a Mamba layer or the taps of a
depthwise conv cost one or more dispatched operations per call although they
only change when the weights do. `derived` keeps such a value on its module,
keyed by the parameter arrays themselves (held, so a replaced weight can never
be mistaken for its successor), and recomputes it when any of them is replaced.
The value is the same computation on the same inputs, so results are
bit-identical to computing it per call.
"""

from __future__ import annotations

from collections.abc import Callable

import mlx.nn as nn


def derived(module: nn.Module, name: str, params: tuple, fn: Callable[..., object]):
    """fn(*params), cached on `module` under `name` until one of `params` is replaced.

    `params` are the arrays fn reads (compared by identity); fn returns an array
    or a container of arrays. The value is lazy until first evaluated with a frame.
    """
    store = module.__dict__.setdefault("_derived", {})
    hit = store.get(name)
    if hit is None or len(hit[0]) != len(params) or any(a is not b for a, b in zip(hit[0], params, strict=True)):
        hit = (tuple(params), fn(*params))
        store[name] = hit
    return hit[1]


__all__ = ["derived"]
