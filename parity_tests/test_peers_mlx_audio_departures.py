"""Each known departure of mlx-audio 0.6.2 from mlx-vlm 0.7.10, pinned by its cause (`-m peers`).

`harness.backends.mlx_audio_backend.DEPARTURES` lists them with mlx-audio's file:line. Proof of each
cause on the tiny 4-bit synthetic checkpoint (bf16 TTS weights, shipped sampling), `question.wav`,
no prompt, offline: with all four undone in memory mlx-audio's codes equal mlx-vlm's on every frame;
leaving any one of them in place makes the codes differ again (so each is necessary, and together they
are the whole difference). A release of mlx-audio that fixes or changes one of them fails here. The
offline agent text's strip is pinned separately. Exact comparisons only (codes are integers).
"""

from __future__ import annotations

import os

import mlx.core as mx
import numpy as np
import pytest

pytest.importorskip("mlx_vlm")
pytest.importorskip("mlx_audio")
pytestmark = pytest.mark.peers
os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["TRANSFORMERS_OFFLINE"] = "1"

from harness.backends import get_backend  # noqa: E402
from harness.backends.mlx_audio_backend import CODE_DEPARTURES, DEPARTURES, departures_undone  # noqa: E402


@pytest.fixture(scope="module")
def reference(tiny_ckpt_4bit, question_wav):
    b = get_backend("mlx-vlm")
    b.load(tiny_ckpt_4bit)
    run = b.offline(question_wav)
    b.close()
    return run


@pytest.fixture(scope="module")
def audio4(tiny_ckpt_4bit):
    b = get_backend("mlx-audio")
    b.load(tiny_ckpt_4bit)
    yield b
    b.close()


def _first_diff(a, b):
    a, b = np.asarray(a), np.asarray(b)
    assert a.shape == b.shape
    bad = np.nonzero((a != b).any(1))[0]
    return None if bad.size == 0 else int(bad[0])


def test_all_departures_undone_equal_codes(audio4, reference, question_wav):
    assert _first_diff(audio4.offline(question_wav).codes, reference.codes) == 1
    with departures_undone(audio4, CODE_DEPARTURES):
        out = audio4.offline(question_wav)
    assert len(out.codes) == len(reference.codes) == 28
    assert _first_diff(out.codes, reference.codes) is None
    assert _first_diff(out.decoded_codes, reference.decoded_codes) is None


# The first frame whose codes differ when only this departure is left in place (measured; the exact
# frame is pinned so that a change of mlx-audio's arithmetic there is noticed).
LEFT_IN_FIRST_DIFF = {"mixture_sampling": 1, "norm_dtype": 5, "depthsum_dtype": 13, "continuation_flags": 4}


@pytest.mark.parametrize("departure", CODE_DEPARTURES)
def test_each_departure_is_necessary(audio4, reference, question_wav, departure):
    assert set(LEFT_IN_FIRST_DIFF) == set(DEPARTURES)
    others = tuple(d for d in CODE_DEPARTURES if d != departure)
    with departures_undone(audio4, others):
        out = audio4.offline(question_wav)
    assert _first_diff(out.codes, reference.codes) == LEFT_IN_FIRST_DIFF[departure]


def test_continuation_flags_come_from_the_tokenizer(audio4):
    """tts.py:193-201: mlx-audio replaces the stored buffer by a rule on the token strings."""
    ear = audio4.model.tts_model.tts_model
    rebuilt = np.array(ear.embed_subword.subword_flag_emb.is_continuation)
    stored = audio4.stored_tokenizer_buffers["tts_model.tts_model.embed_subword.subword_flag_emb.is_continuation"]
    vocab = audio4.session.tokenizer.get_vocab()
    tokens = {i: t for t, i in vocab.items()}
    rule = [
        int(bool(tokens.get(i, "")) and not tokens.get(i, "").startswith(("Ġ", "▁", "<")))
        for i in range(len(rebuilt) - 1)
    ]
    assert rebuilt[:-1].tolist() == rule
    assert not np.array_equal(rebuilt, stored)
    with departures_undone(audio4, ("continuation_flags",)):
        assert np.array_equal(np.array(ear.embed_subword.subword_flag_emb.is_continuation), stored)
    assert np.array_equal(np.array(ear.embed_subword.subword_flag_emb.is_continuation), rebuilt)  # restored


def test_offline_text_is_stripped(audio4, reference, question_wav):
    """session.py:42: `_decode_text` strips the decoded text; mlx-vlm's does not. With a tokenizer whose
    decode protects the ends (a non-space sentinel around the text), mlx-audio's offline text is
    mlx-vlm's exactly: the strip is the only difference."""
    out = audio4.offline(question_wav)
    assert reference.text != reference.text.strip()  # this input has whitespace at the ends
    assert out.text == reference.text.strip()
    sess = audio4.session
    tok = sess.tokenizer

    class Sentinel:
        def __getattr__(self, k):
            return getattr(tok, k)

        def decode(self, ids, **kw):
            return "\x01" + tok.decode(ids, **kw) + "\x01"

    sess.tokenizer = Sentinel()
    try:
        protected = sess._decode_text(mx.array(out.text_ids))
    finally:
        sess.tokenizer = tok
    assert protected[1:-1] == reference.text
