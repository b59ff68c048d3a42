"""Session-owned random stream for the MoG sampler (docs/model.md §8.6).

The reference seeds MLX's *global* generator at session start and draws from
it. That reseeds every other MLX user in the process (§12.2 item 12), so a
session here owns a `SessionRandom` instead, which yields the very same arrays
without touching `mx.random.state`.

MLX's global generator (checked against MLX 0.32.4, see
parity_tests/test_tts_rng.py) works like this: `mx.random.seed(s)` sets the
state to `mx.random.key(s)`; every draw without an explicit key first splits
the state, `state, subkey = split(state)`, keeps the first half as the new
state and draws with the second. Replaying that split chain with explicit keys
reproduces the global stream bit for bit.
"""

from __future__ import annotations

import functools

import mlx.core as mx

from voicechat.model import ops

_MAX_SEED = 2**64


def _split(key: mx.array) -> tuple[mx.array, mx.array]:
    """The global generator's step: state -> (next state, the subkey of this draw)."""
    halves = mx.random.split(key)  # (2, 2)
    return halves[0], halves[1]


def _uniform_then_normal(shapes, key):
    """Two draws of the global stream from state `key`: split, uniform, split, normal."""
    uniform_shape, normal_shape = shapes
    key, sub = _split(key)
    u = mx.random.uniform(shape=uniform_shape, key=sub)
    key, sub = _split(key)
    return key, u, mx.random.normal(shape=normal_shape, key=sub)


class SessionRandom:
    """A random stream owned by one session; reproduces `mx.random.seed(seed)` + global draws."""

    def __init__(self, seed: int = 0):
        if isinstance(seed, bool) or not isinstance(seed, int):
            raise TypeError(f"seed: expected an int, got {type(seed).__name__}")
        if not 0 <= seed < _MAX_SEED:
            raise ValueError(f"seed: expected 0 <= seed < 2**64, got {seed}")
        self.seed = seed
        self.reset()

    def reset(self) -> None:
        """Back to the state right after `mx.random.seed(self.seed)`."""
        self._key = mx.random.key(self.seed)
        self.draws = 0

    def next_key(self) -> mx.array:
        """The key the global generator would use for its next draw (advances the stream)."""
        self._key, sub = _split(self._key)
        self.draws += 1
        return sub

    def uniform(self, shape, dtype=mx.float32) -> mx.array:
        """Same values as `mx.random.uniform(shape=shape, dtype=dtype)` on the global stream."""
        return mx.random.uniform(shape=tuple(shape), dtype=dtype, key=self.next_key())

    def normal(self, shape, dtype=mx.float32) -> mx.array:
        """Same values as `mx.random.normal(shape=shape, dtype=dtype)` on the global stream."""
        return mx.random.normal(shape=tuple(shape), dtype=dtype, key=self.next_key())

    def uniform_then_normal(self, uniform_shape, normal_shape) -> tuple[mx.array, mx.array]:
        """`uniform(uniform_shape)` then `normal(normal_shape)` (float32), as one compiled piece:
        the same keys and values, and the bits-to-float conversions fuse (14 dispatches
        instead of 37)."""
        shapes = (tuple(uniform_shape), tuple(normal_shape))
        draw = ops.fused(("uniform_then_normal", shapes), lambda: functools.partial(_uniform_then_normal, shapes))
        self._key, u, n = draw(self._key)
        self.draws += 2
        return u, n

    def copy(self) -> SessionRandom:
        other = SessionRandom.__new__(SessionRandom)
        other.seed, other._key, other.draws = self.seed, self._key, self.draws
        return other

    def arrays(self) -> dict[str, mx.array]:
        """{"key": the current generator state (uint32 (2,))}."""
        return {"key": self._key}

    # -- as arrays + metadata (voicechat/io/states.py)

    @property
    def state(self) -> dict[str, mx.array]:
        """{"key": the current generator state (uint32 (2,))}."""
        return {"key": self._key}

    @property
    def meta_state(self) -> dict:
        return {"seed": self.seed, "draws": self.draws}

    @classmethod
    def from_state(cls, state: dict, meta_state: dict, like=None) -> SessionRandom:
        """The stream at `state`'s key after `meta_state`'s draws (`like` is not needed)."""
        other = cls(int(meta_state["seed"]))
        other._key, other.draws = state["key"], int(meta_state["draws"])
        return other

    def __repr__(self) -> str:
        return f"SessionRandom(seed={self.seed}, draws={self.draws})"
