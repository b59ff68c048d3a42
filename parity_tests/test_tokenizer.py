"""The synthetic tokenizer's special ids, and incremental decoding equal to the full decode."""

import random

import pytest

from voicechat.io.tokenizer import BYTE_TO_CHAR, IncrementalDecoder, TextTokenizer, build_synthetic_tokenizer

SKIP = {12, 11, 1, 2}


@pytest.fixture(scope="module")
def tok():
    return TextTokenizer(build_synthetic_tokenizer(2048))


def test_special_ids_and_byte_alphabet(tok):
    v = tok.get_vocab()
    assert (v["<s>"], v["</s>"], v["<SPECIAL_11>"], v["<SPECIAL_12>"]) == (1, 2, 11, 12)
    singles = [t for t in v if len(t) == 1]
    assert len(singles) == 256  # the TTS character table needs exactly the byte alphabet
    assert tok.vocab_size == 2048
    ids = tok.encode("hello world")
    assert tok.decode(ids) == "hello world"
    assert 1 not in ids and 2 not in ids  # no special tokens added


def _reference_deltas(tok, ids):
    """The reference rule (docs/model.md §10.3): re-decode the whole list each time."""
    out, prev, acc = [], "", []
    for i in ids:
        if i in SKIP:
            continue
        acc.append(i)
        new = tok.decode(acc)
        delta = new[len(prev) :] if new.startswith(prev) else tok.decode([i])
        out.append((delta, new))
        prev = new
    return out


def _byte_token(tok, b):
    return tok.get_vocab()[BYTE_TO_CHAR[b]]


def test_multibyte_character_split_across_tokens(tok):
    # "é" = C3 A9 and "€" = E2 82 AC, each split into single-byte tokens.
    ids = (
        tok.encode("caf")
        + [_byte_token(tok, 0xC3), _byte_token(tok, 0xA9)]
        + [12]
        + [_byte_token(tok, b) for b in (0xE2, 0x82, 0xAC)]
        + tok.encode(" ok")
    )
    dec = IncrementalDecoder(tok, SKIP)
    got = [r for r in (dec.push(i) for i in ids) if r is not None]
    assert got == _reference_deltas(tok, ids)
    assert dec.text == "café€ ok"
    # while the character is incomplete the text shows a replacement char, as the full decode does
    assert any("\ufffd" in text for _, text in got)


def test_random_sequences_equal_full_decode(tok):
    rng = random.Random(0)
    n = tok.vocab_size
    for _trial in range(30):
        ids = [
            rng.choice([rng.randrange(n), rng.randrange(20, 276), rng.choice(sorted(SKIP))])
            for _ in range(rng.randrange(1, 60))
        ]
        dec = IncrementalDecoder(tok, SKIP)
        got = [r for r in (dec.push(i) for i in ids) if r is not None]
        assert got == _reference_deltas(tok, ids), ids
        assert dec.text == tok.decode([i for i in ids if i not in SKIP])
