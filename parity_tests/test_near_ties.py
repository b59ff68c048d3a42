"""Near-ties of the greedy RVQ: the test data has them, and the codec's search rounds as the reference.

A trained RVQ's codebook q quantizes what stages 0..q-1 left, so its spread shrinks with q. With
1024 entries, the two nearest entries of a residual are often closer than bf16's rounding of
the squared norms ‖m_j‖², so whether those norms are formed in bf16 (the reference) or float32
decides the code. Test codebooks of 64 entries of equal spread hid exactly that difference once
(the model's own latents never came near a tie there); these tests keep the property from
silently disappearing from both checkpoint writers, and pin the codec's rounding on a tie built
by hand. The peers matrix (test_peers_matrix.py) checks the codes against mlx-vlm on them.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from voicechat.model.audio.codec import ResidualVectorQuantizer
from voicechat.synthetic import checkpoint as synthetic
from voicechat.synthetic.presets import preset_config

from . import independent_writer

SHAPE = (1024, 512)  # the published codebook_size x latent_dim
NUM_QUANTIZERS = 31


def _bf16(x: np.ndarray) -> np.ndarray:
    """Round float32 to bf16 (nearest, ties to even), returned as float32: an emulation
    independent of MLX."""
    u = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32).astype(np.uint64)
    u = ((u + 0x7FFF + ((u >> 16) & 1)) >> 16) << 16
    return u.astype(np.uint32).view(np.float32)


def _greedy_flips(books: list[np.ndarray], scale: float, n: int = 256, seed: int = 1) -> np.ndarray:
    """Per codebook, how many of `n` Gaussian latents (std `scale`, the first codebook's) the
    greedy search (float32 norms) would code differently with the norms rounded to bf16 as
    mlx-audio forms them (bf16 products, bf16 sum)."""
    rng = np.random.default_rng(seed)
    residual = (scale * rng.standard_normal((n, books[0].shape[1]))).astype(np.float32)
    flips = np.zeros(len(books), dtype=int)
    for q, m in enumerate(books):
        dots = residual @ m.T
        n32 = (m * m).sum(axis=1)
        n16 = _bf16(_bf16(m * m).sum(axis=1))
        a = np.argmin(n32[None, :] - 2 * dots, axis=1)
        b = np.argmin(n16[None, :] - 2 * dots, axis=1)
        flips[q] = int((a != b).sum())
        residual = residual - m[a]
    return flips


def _synthetic_books() -> list[np.ndarray]:
    return [_bf16(synthetic._rvq_codebook(np.random.default_rng(q), q, SHAPE)) for q in range(NUM_QUANTIZERS)]


def _writer_books() -> list[np.ndarray]:
    return [_bf16(independent_writer._rvq_codebook(0, q, SHAPE).astype(np.float32)) for q in range(NUM_QUANTIZERS)]


@pytest.mark.parametrize("source", ["synthetic", "independent_writer"])
def test_generated_codebooks_have_near_ties_below_bf16_rounding(source):
    """The codebooks both writers put in checkpoints (published shape, bf16) have near-ties that
    bf16 rounding of the norms decides: measured 83 (synthetic) and 60 (writer) of 256 x 31
    searches; at least 20 are required."""
    books, scale0 = {
        "synthetic": (_synthetic_books(), synthetic.RVQ_SCALE0),
        "independent_writer": (_writer_books(), independent_writer.RVQ_SCALE0),
    }[source]
    flips = _greedy_flips(books, scale0)
    assert flips.sum() >= 20, flips
    # The spread shrinks with depth as a trained RVQ's does (0.93 per stage, +-5 %).
    ratio = books[30].std() / books[0].std()
    assert ratio == pytest.approx(0.93**30, rel=0.05)


def _tie_quantizer(norms_in_weight_dtype: bool) -> ResidualVectorQuantizer:
    """A quantizer whose first codebook has two candidate entries built so the squared norms decide:
    m0 = e0 (norm 1), m1 = e0 + 2^-5 (e1 + e2) (norm 1 + 2^-9 in float32, 1.0 in bf16)."""
    cfg = preset_config("tiny").codec_config
    rvq = ResidualVectorQuantizer(cfg, norms_in_weight_dtype)
    books = []
    for q in range(cfg.num_quantizers):
        m = np.zeros((cfg.codebook_size, cfg.latent_dim), np.float32)
        m[:, 3] = 8.0  # every other entry far away (norm 64)
        if q == 0:
            m[0] = 0.0
            m[0, 0] = 1.0
            m[1] = 0.0
            m[1, 0], m[1, 1], m[1, 2] = 1.0, 2.0**-5, 2.0**-5
        books.append(mx.array(m).astype(mx.bfloat16))
    rvq.mus_list = books
    return rvq


@pytest.mark.parametrize("in_weight_dtype, want", [(True, 1), (False, 0)])
def test_codec_search_rounds_the_norms_as_its_setting_says(in_weight_dtype, want):
    """r = 2^-7 (e1 + e2): the distances (less ‖r‖²) are 1 for m0 and ‖m1‖² - 2^-10 for m1, all
    exact in float32. Norms in float32: 1 + 2^-10 > 1, so m0; norms in bf16 (the reference):
    1 - 2^-10 < 1, so m1."""
    cfg = preset_config("tiny").codec_config
    r = np.zeros((1, cfg.latent_dim), np.float32)
    r[0, 1] = r[0, 2] = 2.0**-7
    codes = np.array(_tie_quantizer(in_weight_dtype).quantize(mx.array(r)))
    assert codes[0, 0] == want


def test_speaker_prompt_codes_hinge_on_the_norm_rounding_at_the_real_depth(tmp_path):
    """On the independent writer's real-depth bf16 checkpoint, the codec encoder's latents of
    silence come near ties: the speaker prompt codes of the two numerics settings differ (measured:
    1020 of 37 x 31, from the first flipped codebook on). Were the test codebooks benign again,
    this count would drop to 0 and the peers matrix's prompt rows would lose their power."""
    import voicechat

    folder = independent_writer.write(tmp_path / "real", independent_writer.Spec(depth="real", dtype="bfloat16"))
    codes = {
        n: np.array(voicechat.load(folder, numerics=n, warmup=False).speaker_prompt_codes())
        for n in ("reference", "float32")
    }
    assert codes["reference"].shape == codes["float32"].shape
    assert (codes["reference"] != codes["float32"]).sum() >= 100


def test_writer_checkpoints_have_head_argmax_near_ties(tmp_path, question_wav):
    """The text and function heads of the writer's checkpoint (the peers matrix's first layout)
    come near ties: some frame's top-2 logit gap is below 2^-7 = 7.8e-3, one bf16 ulp for |logit|
    in [2, 4) and half of one in [4, 8); measured 1.8e-3 (text) and 2.3e-3 (function). So a
    rounding difference in the language path would flip an id there, and the matrix's "ids equal
    on every frame" has power."""
    from harness.backends import get_backend

    folder = independent_writer.write(tmp_path / "w", independent_writer.Spec(dtype="bfloat16", bits=4))
    backend = get_backend("voicechat")
    backend.load(str(folder))
    run = backend.offline(question_wav, system_prompt="hello", seed=0, with_logits=True)
    for logits in (run.text_logits, run.function_logits):
        top = np.sort(np.asarray(logits, np.float32).reshape(-1, np.shape(logits)[-1]), axis=-1)[:, -2:]
        assert np.abs(top).max() < 8.0  # the bound below is at most one bf16 ulp for |logit| < 8
        assert (top[:, 1] - top[:, 0]).min() < 2.0**-7
