"""SessionRandom (voicechat/model/tts/rng.py): bit-identical to MLX's global generator
after `mx.random.seed(seed)`, without touching the global state.

Comparisons here are exact (array_equal): both sides run the same kernels on
the same keys, so any difference means a different key, not rounding.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from voicechat.model.tts.rng import SessionRandom

# A mixed sequence of 20 draws: the MoG shapes (uniform (1,1,P), normal (1,1,latent))
# interleaved with other shapes, dtypes and orders.
DRAWS = [
    ("uniform", (1, 1, 1024), mx.float32),
    ("normal", (1, 1, 512), mx.float32),
    ("uniform", (1, 1, 16), mx.float32),
    ("normal", (1, 1, 16), mx.float32),
    ("normal", (3,), mx.float32),
    ("normal", (2, 5), mx.float32),
    ("uniform", (), mx.float32),
    ("uniform", (7, 3), mx.float32),
    ("normal", (1,), mx.float32),
    ("uniform", (4, 4, 4), mx.float16),
    ("normal", (8,), mx.bfloat16),
    ("uniform", (1, 1, 1024), mx.float32),
    ("normal", (1, 1, 512), mx.float32),
    ("uniform", (1, 1, 1024), mx.float32),
    ("normal", (1, 1, 512), mx.float32),
    ("uniform", (5,), mx.float32),
    ("uniform", (5,), mx.float32),
    ("normal", (33,), mx.float32),
    ("normal", (2, 2, 2), mx.float32),
    ("uniform", (1, 1, 1024), mx.float32),
]


def global_draws(seed: int) -> list[mx.array]:
    mx.random.seed(seed)
    out = []
    for kind, shape, dtype in DRAWS:
        fn = mx.random.uniform if kind == "uniform" else mx.random.normal
        out.append(fn(shape=shape, dtype=dtype))
    mx.eval(out)
    return out


def session_draws(rng: SessionRandom) -> list[mx.array]:
    out = [getattr(rng, kind)(shape, dtype=dtype) for kind, shape, dtype in DRAWS]
    mx.eval(out)
    return out


def global_key() -> np.ndarray:
    return np.array(mx.random.state[0])


@pytest.mark.parametrize("seed", [0, 1, 1234, 2**40 + 7])
def test_matches_global_generator(seed):
    expected = global_draws(seed)
    got = session_draws(SessionRandom(seed))
    assert len(got) == len(DRAWS) == 20
    for i, (a, b) in enumerate(zip(expected, got, strict=True)):
        assert a.shape == b.shape and a.dtype == b.dtype, i
        assert mx.array_equal(a, b).item(), f"draw {i} {DRAWS[i]} differs"


def test_global_state_untouched():
    mx.random.seed(99)
    before = global_key()
    rng = SessionRandom(5)
    session_draws(rng)
    assert np.array_equal(global_key(), before), "SessionRandom changed mx.random.state"
    # And the other way round: global draws in between do not disturb the session stream.
    a, b = SessionRandom(5), SessionRandom(5)
    first = a.uniform((1, 1, 16))
    mx.random.uniform(shape=(100,))
    mx.random.normal(shape=(3, 3))
    second = a.normal((1, 1, 16))
    mx.eval(first, second)
    assert mx.array_equal(first, b.uniform((1, 1, 16))).item()
    assert mx.array_equal(second, b.normal((1, 1, 16))).item()


def test_different_seeds_differ():
    a = session_draws(SessionRandom(0))
    b = session_draws(SessionRandom(1))
    assert not any(mx.array_equal(x, y).item() for x, y in zip(a, b, strict=True))


def test_copy_reset_and_counters():
    rng = SessionRandom(3)
    rng.uniform((4,))
    clone = rng.copy()
    x, y = rng.normal((6,)), clone.normal((6,))
    assert mx.array_equal(x, y).item()
    assert rng.draws == clone.draws == 2
    rng.reset()
    assert rng.draws == 0
    assert mx.array_equal(rng.arrays()["key"], mx.random.key(3)).item()
    mx.random.seed(3)
    assert mx.array_equal(rng.uniform((4,)), mx.random.uniform(shape=(4,))).item()


@pytest.mark.parametrize("bad, exc", [(-1, ValueError), (2**64, ValueError), (1.5, TypeError), (True, TypeError)])
def test_bad_seed(bad, exc):
    with pytest.raises(exc, match="seed"):
        SessionRandom(bad)


@pytest.mark.parametrize("compiled", [True, False])
@pytest.mark.parametrize("seed", [0, 1, 12345, 2**63 + 7])
def test_uniform_then_normal_is_the_global_stream(seed, compiled):
    """The MoG's two draws as one compiled piece give the global stream's values bit for bit
    (the fused bits-to-float conversions must not round differently) and leave the same state."""
    from .runtime_util import running

    shapes = [((1, 1, 1024), (1, 1, 512)), ((1, 1, 16), (1, 1, 16)), ((1, 1, 1024), (1, 1, 32))]
    mx.random.seed(seed)
    expected = []
    for u_shape, n_shape in shapes * 2:
        expected += [mx.random.uniform(shape=u_shape), mx.random.normal(shape=n_shape)]
    mx.eval(expected)
    want_key = global_key()
    rng = SessionRandom(seed)
    got = []
    with running(compiled=compiled):
        for u_shape, n_shape in shapes * 2:
            got += list(rng.uniform_then_normal(u_shape, n_shape))
    mx.eval(got)
    assert all(g.shape == e.shape and g.dtype == mx.float32 for g, e in zip(got, expected, strict=True))
    assert all(mx.array_equal(g, e).item() for g, e in zip(got, expected, strict=True))
    assert np.array_equal(np.array(rng.arrays()["key"]), want_key)
    assert rng.draws == 2 * len(shapes) * 2
