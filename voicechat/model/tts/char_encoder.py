"""Text side of EAR-TTS: the character table and the char-aware subword encoder
(docs/model.md §8.3).

Each LLM token is spelled out as characters, the characters go through a
bidirectional T5Gemma encoder, the rows are mean-pooled and projected; then
two flag embeddings (word continuation, BOS/EOS) are added.

Two ways to embed a token:

* `embed_host(ids, mask, table)` — token ids known on the host; every
  sequence has its exact length (what the reference does).
* `embed_device(token, table)` — token id is an mx.array (e.g. the LLM's
  argmax, still on the device): the chars come from the device table padded to
  `table.max_chars` with a key padding mask, so no host sync is needed. Same
  result up to float32 summation order; costs max_chars encoder rows.

Precision: activations are float32 by default. `in_weight_dtype=True` keeps
them in the weight dtype instead (bf16 for the published checkpoints): the
reference (mlx-vlm) runs this whole encoder, the flag embeddings and their sums
with the activations in the char embedding's dtype (only the norms and the
attention softmax compute in float32 internally). The model's `Numerics.text_side_in_weight_dtype`
(voicechat/model/tts/numerics.py) selects it.
"""

from __future__ import annotations

import math

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from voicechat.model.config import CharEncoderConfig
from voicechat.model.tts.layers import GeluGatedMLP, OnePlusRMSNorm, repeat_kv_heads

# The flag tables are sized for the published 131072-token vocabulary whatever
# the text vocabulary is (§13.1): ids at or beyond it map to the pad entry.
FLAG_TABLE_VOCAB = 131072
MASKED_SCORE = -1e30  # key padding mask value of the reference (mlx-vlm)


# --------------------------------------------------------------------------- char table


class CharTable:
    """Token id -> char ids, built from the tokenizer vocabulary (§8.3).

    Char ids 0..char_vocab_size-2 are the single-character vocabulary entries
    in token-id order; `pad_char_id` = char_vocab_size - 1 pads sequences.
    Host lookup: `sequence(token_id)`. Device lookup: `device_ids[token]`
    (num_tokens, max_chars), `device_lengths[token]` (num_tokens,).
    """

    def __init__(self, alphabet: str, sequences: list[list[int]], char_vocab_size: int):
        if len(alphabet) != char_vocab_size - 1:
            raise ValueError(
                f"CharTable: alphabet has {len(alphabet)} characters, expected char_vocab_size - 1 = "
                f"{char_vocab_size - 1}"
            )
        self.alphabet = alphabet
        self.char_vocab_size = char_vocab_size
        self._sequences = sequences
        self.max_chars = max(1, max((len(s) for s in sequences), default=0))
        ids = np.full((len(sequences), self.max_chars), self.pad_char_id, dtype=np.int32)
        for t, s in enumerate(sequences):
            ids[t, : len(s)] = s
        # int16 halves the table (131072 x max_chars) when char ids fit.
        id_dtype = mx.int16 if char_vocab_size <= 2**15 else mx.int32
        self.device_ids = mx.array(ids).astype(id_dtype)
        self.device_lengths = mx.array(np.array([len(s) for s in sequences], dtype=np.int32))

    @classmethod
    def from_vocab(cls, vocab: dict[str, int], char_vocab_size: int, num_tokens: int | None = None) -> CharTable:
        """Build from `tokenizer.get_vocab()` (token string -> id, added tokens included).

        `num_tokens` (default max id + 1) sizes the table; give the LLM
        vocabulary size so every id the LLM can emit has a row (ids missing from
        the vocabulary spell as the empty sequence).
        """
        if not isinstance(vocab, dict) or not vocab:
            raise TypeError("CharTable.from_vocab: expected a non-empty dict token string -> id")
        if isinstance(char_vocab_size, bool) or not isinstance(char_vocab_size, int) or char_vocab_size < 2:
            raise ValueError(f"CharTable.from_vocab: char_vocab_size must be an int >= 2, got {char_vocab_size!r}")
        by_id: dict[int, str] = {}
        for s, i in vocab.items():
            if not isinstance(s, str) or isinstance(i, bool) or not isinstance(i, (int, np.integer)) or i < 0:
                raise ValueError(f"CharTable.from_vocab: bad vocabulary entry {s!r}: {i!r} (expected str -> int >= 0)")
            if int(i) in by_id:
                raise ValueError(f"CharTable.from_vocab: token id {int(i)} appears twice ({by_id[int(i)]!r} and {s!r})")
            by_id[int(i)] = s
        singles = [by_id[i] for i in sorted(by_id) if len(by_id[i]) == 1]
        if len(singles) != char_vocab_size - 1:
            raise ValueError(
                f"CharTable.from_vocab: the vocabulary has {len(singles)} single-character tokens, expected "
                f"exactly char_vocab_size - 1 = {char_vocab_size - 1} (the byte-level alphabet)"
            )
        rows = max(by_id) + 1
        if num_tokens is not None:
            if num_tokens < rows:
                raise ValueError(
                    f"CharTable.from_vocab: num_tokens={num_tokens} is smaller than the largest token id + 1 ({rows})"
                )
            rows = num_tokens
        char_id = {c: k for k, c in enumerate(singles)}
        sequences = [[] for _ in range(rows)]
        for i, s in by_id.items():
            # Characters outside the alphabet are dropped, as in the reference.
            sequences[i] = [char_id[c] for c in s if c in char_id]
        return cls("".join(singles), sequences, char_vocab_size)

    @property
    def num_tokens(self) -> int:
        return len(self._sequences)

    @property
    def pad_char_id(self) -> int:
        return self.char_vocab_size - 1

    def sequence(self, token_id: int) -> list[int]:
        if not 0 <= token_id < self.num_tokens:
            raise ValueError(f"token id {token_id} is outside the char table (expected 0 <= id < {self.num_tokens})")
        return self._sequences[token_id]

    def arrays(self) -> dict[str, mx.array]:
        return {"device_ids": self.device_ids, "device_lengths": self.device_lengths}

    def __repr__(self) -> str:
        return (
            f"CharTable(num_tokens={self.num_tokens}, char_vocab_size={self.char_vocab_size}, "
            f"max_chars={self.max_chars})"
        )


# --------------------------------------------------------------------------- encoder


class CharSelfAttention(nn.Module):
    """Bidirectional attention over one char sequence: RoPE, score scale, soft-cap, key padding mask."""

    def __init__(self, cfg: CharEncoderConfig):
        super().__init__()
        h, d = cfg.num_attention_heads, cfg.head_dim
        if h % cfg.num_key_value_heads:
            raise ValueError(
                f"character_encoder: num_key_value_heads ({cfg.num_key_value_heads}) must divide "
                f"num_attention_heads ({h})"
            )
        self.q_proj = nn.Linear(cfg.hidden_size, h * d, bias=False)
        self.k_proj = nn.Linear(cfg.hidden_size, cfg.num_key_value_heads * d, bias=False)
        self.v_proj = nn.Linear(cfg.hidden_size, cfg.num_key_value_heads * d, bias=False)
        self.o_proj = nn.Linear(h * d, cfg.hidden_size, bias=False)
        self.num_heads, self.num_kv_heads, self.head_dim = h, cfg.num_key_value_heads, d
        self.scale = float(cfg.query_pre_attn_scalar) ** -0.5
        self.softcap = float(cfg.attn_logit_softcapping)
        self.rope_base = float(cfg.rope_base)

    def __call__(self, x: mx.array, key_valid: mx.array) -> mx.array:
        n, length, _ = x.shape
        q = self.q_proj(x).reshape(n, length, self.num_heads, self.head_dim).transpose(0, 2, 1, 3)
        k = self.k_proj(x).reshape(n, length, self.num_kv_heads, self.head_dim).transpose(0, 2, 1, 3)
        v = self.v_proj(x).reshape(n, length, self.num_kv_heads, self.head_dim).transpose(0, 2, 1, 3)
        q = mx.fast.rope(q, self.head_dim, traditional=False, base=self.rope_base, scale=1.0, offset=0)
        k = mx.fast.rope(k, self.head_dim, traditional=False, base=self.rope_base, scale=1.0, offset=0)
        k, v = repeat_kv_heads(k, self.num_heads), repeat_kv_heads(v, self.num_heads)
        scores = (q @ k.transpose(0, 1, 3, 2)) * self.scale
        scores = self.softcap * mx.tanh(scores / self.softcap)
        scores = mx.where(key_valid[:, None, None, :], scores, MASKED_SCORE)
        # Softmax in float32, then to the projections' dtype (a no-op in float32). That is q's
        # dtype, not x's: a quantized q_proj with float32 scales gives float32 q from bf16 x.
        probs = mx.softmax(scores.astype(mx.float32), axis=-1).astype(q.dtype)
        out = (probs @ v).transpose(0, 2, 1, 3).reshape(n, length, self.num_heads * self.head_dim)
        return self.o_proj(out)


class CharEncoderLayer(nn.Module):
    def __init__(self, cfg: CharEncoderConfig):
        super().__init__()
        eps = cfg.rms_norm_eps
        self.self_attn = CharSelfAttention(cfg)
        self.mlp = GeluGatedMLP(cfg.hidden_size, cfg.intermediate_size)
        self.pre_self_attn_layernorm = OnePlusRMSNorm(cfg.hidden_size, eps)
        self.post_self_attn_layernorm = OnePlusRMSNorm(cfg.hidden_size, eps)
        self.pre_feedforward_layernorm = OnePlusRMSNorm(cfg.hidden_size, eps)
        self.post_feedforward_layernorm = OnePlusRMSNorm(cfg.hidden_size, eps)

    def __call__(self, x: mx.array, key_valid: mx.array) -> mx.array:
        h = x + self.post_self_attn_layernorm(self.self_attn(self.pre_self_attn_layernorm(x), key_valid))
        return h + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(h)))


class CharEncoderStack(nn.Module):
    def __init__(self, cfg: CharEncoderConfig):
        super().__init__()
        self.layers = [CharEncoderLayer(cfg) for _ in range(cfg.num_hidden_layers)]
        self.norm = OnePlusRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def __call__(self, x: mx.array, key_valid: mx.array) -> mx.array:
        for layer in self.layers:
            x = layer(x, key_valid)
        return self.norm(x)


class CharBackbone(nn.Module):
    """Holds the encoder under the checkpoint's `backbone.encoder.` prefix."""

    def __init__(self, cfg: CharEncoderConfig):
        super().__init__()
        self.encoder = CharEncoderStack(cfg)


class SubwordFlagEmbedding(nn.Module):
    """cont_emb[is_continuation[id']], id' = pad_tensor for ids >= 131072 (in the embedding's dtype)."""

    def __init__(self, hidden: int):
        super().__init__()
        # Integer buffers: the checkpoint stores int64; a loader overwrites them.
        self.is_continuation = mx.zeros((FLAG_TABLE_VOCAB + 1,), dtype=mx.int64)
        self.pad_tensor = mx.array(FLAG_TABLE_VOCAB, dtype=mx.int64)
        self.cont_emb = nn.Embedding(2, hidden)

    def __call__(self, ids: mx.array) -> mx.array:
        ids = mx.where(ids >= FLAG_TABLE_VOCAB, self.pad_tensor, ids)
        return self.cont_emb(self.is_continuation[ids])


class BosEosEmbedding(nn.Module):
    """special_emb[special_flags[id']], id' = pad_tensor for ids >= 131072 (in the embedding's dtype)."""

    def __init__(self, hidden: int):
        super().__init__()
        self.special_flags = mx.zeros((FLAG_TABLE_VOCAB,), dtype=mx.int64)
        self.pad_tensor = mx.array(FLAG_TABLE_VOCAB - 1, dtype=mx.int64)
        self.special_emb = nn.Embedding(3, hidden)

    def __call__(self, ids: mx.array) -> mx.array:
        ids = mx.where(ids >= FLAG_TABLE_VOCAB, self.pad_tensor, ids)
        return self.special_emb(self.special_flags[ids])


class CharAwareSubwordEncoder(nn.Module):
    """`embed_subword`: token ids -> conditional text-side input (§8.3)."""

    def __init__(self, cfg: CharEncoderConfig):
        super().__init__()
        self.cfg = cfg
        self.embed_tokens = nn.Embedding(cfg.char_vocab_size, cfg.hidden_size)
        self.proj_embedding = nn.Linear(cfg.hidden_size, cfg.hidden_size, bias=False)
        self.backbone = CharBackbone(cfg)
        self.subword_flag_emb = SubwordFlagEmbedding(cfg.hidden_size)
        self.bos_eos_emb = BosEosEmbedding(cfg.hidden_size)

    # -- pieces

    def table_dtype(self) -> mx.Dtype:
        """The dtype of the char embedding's rows: the stored weight's, or for a quantized table
        (packed uint32) that of its dequantized rows (the affine scales' dtype; MLX decides it for
        the scale-only modes, whose scales are uint8). Read from the lazy graph: nothing runs."""
        emb = self.embed_tokens
        if isinstance(emb, nn.QuantizedEmbedding):
            return emb(mx.zeros((1,), dtype=mx.int32)).dtype
        return emb.weight.dtype

    def activation_dtype(self, in_weight_dtype: bool) -> mx.Dtype:
        """float32, or with `in_weight_dtype` the char embedding's (float) dtype."""
        dtype = self.table_dtype()
        return dtype if in_weight_dtype and mx.issubdtype(dtype, mx.floating) else mx.float32

    def encode_chars(self, char_ids: mx.array, lengths: mx.array, *, in_weight_dtype: bool = False) -> mx.array:
        """(N, L) char ids padded beyond `lengths` (N,) -> (N, hidden) pooled, projected vectors,
        in `activation_dtype(in_weight_dtype)`.

        A sequence of length 0 gives the zero vector (as the reference's
        "all sequences empty" case).
        """
        _n, length = char_ids.shape
        act = self.activation_dtype(in_weight_dtype)
        # The reference multiplies by √hidden rounded to its activation dtype,
        # the embedding table's dtype (34.0 for 1152 in bf16).
        scale = mx.array(math.sqrt(self.cfg.hidden_size), dtype=self.table_dtype()).astype(act)
        x = self.embed_tokens(char_ids).astype(act) * scale
        valid = mx.arange(length)[None, :] < lengths[:, None]
        x = self.backbone.encoder(x, valid)
        pooled = mx.where(valid[..., None], x, 0.0).sum(axis=1)
        pooled = pooled / mx.maximum(lengths, 1).astype(act)[:, None]
        return self.proj_embedding(pooled).astype(act)

    def add_flag_embeddings(self, x: mx.array, ids: mx.array) -> mx.array:
        """x (…, hidden) + both flag embeddings of the int token ids (…), added at every position,
        continuation flag first, with MLX's type promotion (as the reference): a quantized flag
        embedding (float32 rows from float32 scales) makes a bf16 x float32."""
        x = x + self.subword_flag_emb(ids)
        return x + self.bos_eos_emb(ids)

    # -- whole text-side input

    def embed_host(self, ids, mask, table: CharTable, *, in_weight_dtype: bool = False) -> mx.array:
        """Host token ids (T,) and subword mask (T,) -> (T, hidden) in `activation_dtype(in_weight_dtype)`.

        Chars are encoded only where the mask is true (zeros elsewhere); the
        flag embeddings are added everywhere.
        """
        ids = [int(i) for i in ids]
        mask = [bool(m) for m in mask]
        if len(ids) != len(mask):
            raise ValueError(f"embed_host: {len(ids)} ids but {len(mask)} mask entries")
        if any(i < 0 for i in ids):
            raise ValueError(f"embed_host: token ids must be >= 0, got {min(ids)}")
        active = [t for t in range(len(ids)) if mask[t]]
        seqs = [table.sequence(ids[t]) for t in active]
        hidden = self.cfg.hidden_size
        act = self.activation_dtype(in_weight_dtype)
        if not seqs or all(len(s) == 0 for s in seqs):
            chars = mx.zeros((len(ids), hidden), dtype=act)
        else:
            longest = max(len(s) for s in seqs)
            padded = np.full((len(seqs), longest), table.pad_char_id, dtype=np.int32)
            for r, s in enumerate(seqs):
                padded[r, : len(s)] = s
            lengths = mx.array(np.array([len(s) for s in seqs], dtype=np.int32))
            rows = self.encode_chars(mx.array(padded), lengths, in_weight_dtype=in_weight_dtype)
            # Scatter: active position t takes its row, the others the extra zero row.
            rows = mx.concatenate([rows, mx.zeros((1, hidden), dtype=act)], axis=0)
            where = np.full((len(ids),), len(seqs), dtype=np.int32)
            where[active] = np.arange(len(seqs), dtype=np.int32)
            chars = rows[mx.array(where)]
        return self.add_flag_embeddings(chars, mx.array(np.array(ids, dtype=np.int32)))

    def embed_device(self, token: mx.array, table: CharTable, *, in_weight_dtype: bool = False) -> mx.array:
        """One token id as a 0-d int mx.array (mask true) -> (1, hidden), without a host sync.

        The id must be < table.num_tokens (not checked: checking needs a sync).
        """
        char_ids = table.device_ids[token].astype(mx.int32)[None]  # (1, max_chars)
        lengths = table.device_lengths[token][None]  # (1,)
        chars = self.encode_chars(char_ids, lengths, in_weight_dtype=in_weight_dtype)
        return self.add_flag_embeddings(chars, token[None])
