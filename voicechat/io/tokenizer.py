"""The LLM tokenizer (`tokenizer.json`, loaded with `tokenizers`) and incremental decoding."""

from __future__ import annotations

import json
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers

from voicechat.errors import CheckpointError


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2 byte-level alphabet: byte -> printable character (256 entries)."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {b: chr(c) for b, c in zip(bs, cs, strict=True)}


BYTE_TO_CHAR = _bytes_to_unicode()
CHAR_TO_BYTE = {c: b for b, c in BYTE_TO_CHAR.items()}


class TextTokenizer:
    """Thin wrapper over `tokenizers.Tokenizer` with the calls the model needs."""

    def __init__(self, tok: Tokenizer):
        self._tok = tok
        self._vocab = tok.get_vocab(with_added_tokens=True)
        self._id_to_token = {i: t for t, i in self._vocab.items()}
        self.byte_level = isinstance(tok.decoder, decoders.ByteLevel)
        self._token_bytes: dict[int, bytes] = {}

    @classmethod
    def from_file(cls, path: str | Path) -> TextTokenizer:
        path = Path(path)
        if path.is_dir():
            path = path / "tokenizer.json"
        if not path.exists():
            raise CheckpointError(f"{path}: tokenizer.json not found")
        try:
            return cls(Tokenizer.from_file(str(path)))
        except Exception as e:
            raise CheckpointError(f"{path}: cannot load tokenizer ({e})") from None

    @property
    def vocab_size(self) -> int:
        return len(self._vocab)

    def get_vocab(self) -> dict[str, int]:
        return dict(self._vocab)

    def id_to_token(self, i: int) -> str | None:
        return self._id_to_token.get(int(i))

    def encode(self, text: str) -> list[int]:
        """Token ids without special tokens (the system prompt is wrapped by the caller)."""
        return self._tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids) -> str:
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=False)

    def token_bytes(self, i: int) -> bytes:
        """The bytes a byte-level decoder produces for token i (before UTF-8 decoding)."""
        b = self._token_bytes.get(i)
        if b is None:
            t = self._id_to_token.get(int(i), "")
            try:
                b = bytes(CHAR_TO_BYTE[c] for c in t)
            except KeyError:  # not byte-level characters (e.g. some added tokens): raw UTF-8
                b = t.encode("utf-8")
            self._token_bytes[i] = b
        return b


class IncrementalDecoder:
    """Cumulative decode of one token channel with the reference's delta rule (docs/model.md §10.3).

    The reference re-decodes the whole id list on every token; here the text is
    kept as (committed prefix, undecided trailing bytes) so each token costs
    O(token), with results equal to the full decode (tested). For a tokenizer
    whose decoder is not byte-level the full decode is used.
    """

    def __init__(self, tokenizer: TextTokenizer, skip_ids=()):
        self.tok = tokenizer
        self.skip_ids = frozenset(int(i) for i in skip_ids)
        self.ids: list[int] = []
        self.text = ""
        self._committed = ""
        self._pending = b""

    def push(self, token_id: int) -> tuple[str, str] | None:
        """Add one id; None if it is skipped, else (delta, cumulative text)."""
        token_id = int(token_id)
        if token_id in self.skip_ids:
            return None
        self.ids.append(token_id)
        if self.tok.byte_level:
            data = self._pending + self.tok.token_bytes(token_id)
            cut = _complete_utf8_prefix(data)
            self._committed += data[:cut].decode("utf-8", errors="replace")
            self._pending = data[cut:]
            new = self._committed + self._pending.decode("utf-8", errors="replace")
        else:
            new = self.tok.decode(self.ids)
        delta = new[len(self.text) :] if new.startswith(self.text) else self.tok.decode([token_id])
        self.text = new
        return delta, new


def _complete_utf8_prefix(data: bytes) -> int:
    """Length of the longest prefix that cannot change when more bytes follow.

    Only a possibly-incomplete multi-byte sequence at the very end is held back
    (at most 3 bytes); invalid bytes elsewhere decode to U+FFFD either way.
    """
    n = len(data)
    for back in range(1, min(4, n) + 1):
        b = data[n - back]
        if b < 0x80:
            return n  # ASCII: everything before and including it is final
        if b >= 0xC0:  # a lead byte: is its sequence complete?
            need = 2 if b < 0xE0 else 3 if b < 0xF0 else 4 if b < 0xF8 else 1
            return n if back >= need else n - back
    return n


# --------------------------------------------------------------------------- synthetic tokenizer


def special_tokens(count: int = 20) -> list[str]:
    return ["<unk>", "<s>", "</s>"] + [f"<SPECIAL_{i}>" for i in range(3, count)]


SPECIAL_TOKENS = special_tokens()
_MERGE_LETTERS = "etaoinshrdlcumwfgypbvkjxqz"


def build_synthetic_tokenizer(vocab_size: int, n_special: int = 20) -> Tokenizer:
    """A byte-level BPE tokenizer with `vocab_size` entries and the published special ids.

    Ids 0..n_special-1 are special tokens (bos 1, eos 2, silence 11 = <SPECIAL_11>, pad 12 =
    <SPECIAL_12>; with n_special > 22 also the tool markers <SPECIAL_20..22>), then the 256
    byte-level characters (so the TTS character table has exactly 256 entries), then merged
    tokens built deterministically from letters.
    """
    specials = special_tokens(n_special)
    n_base = len(specials) + 256
    if vocab_size < n_base:
        raise ValueError(f"vocab_size must be at least {n_base}, got {vocab_size}")
    vocab: dict[str, int] = {t: i for i, t in enumerate(specials)}
    for b in range(256):
        vocab[BYTE_TO_CHAR[b]] = len(vocab)
    merges: list[tuple[str, str]] = []
    space = BYTE_TO_CHAR[ord(" ")]
    # Word-initial letters first ("Ġa"), then grow tokens by appending letters.
    frontier = [space] + list(_MERGE_LETTERS)
    grow = list(frontier)
    i = 0
    while len(vocab) < vocab_size:
        left = grow[i]
        for c in _MERGE_LETTERS:
            if len(vocab) >= vocab_size:
                break
            tok = left + c
            if tok not in vocab:
                vocab[tok] = len(vocab)
                merges.append((left, c))
                grow.append(tok)
        i += 1
    model = models.BPE(vocab=vocab, merges=merges, unk_token="<unk>")
    tok = Tokenizer(model)
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    from tokenizers import AddedToken

    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in specials])
    return tok


def write_synthetic_tokenizer(folder: Path, vocab_size: int, n_special: int = 20) -> None:
    tok = build_synthetic_tokenizer(vocab_size, n_special)
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "bos_token": "<s>",
                "eos_token": "</s>",
                "pad_token": "<SPECIAL_12>",
                "unk_token": "<unk>",
                "tokenizer_class": "PreTrainedTokenizerFast",
                "fix_mistral_regex": True,
            },
            indent=2,
        )
    )
    (folder / "special_tokens_map.json").write_text(
        json.dumps(
            {
                "bos_token": "<s>",
                "eos_token": "</s>",
                "pad_token": "<SPECIAL_12>",
                "unk_token": "<unk>",
            },
            indent=2,
        )
    )
