"""EAR-TTS (docs/model.md §8): cached steps vs recompute-from-history, the
sliding window and its ring layout, seeded sampling, the top-p rule, the EOS
rule, control-code replacement, the MoG pass schedule, the char table, the
per-model numerics ("reference" / "float32") (exact comparison against mlx-vlm: test_peers_codes.py)
and input validation.

Tolerances. Every path computes in float32; the backbone output is RMS-normed,
so |hidden| is O(1) (~3 at most here). The cached step and the recompute pass
run the same operations, only with different attention shapes (one query
against a K/V ring vs all queries against all keys under a mask), so reductions
are ordered differently: a few ulp (6e-8 relative) per op over 2 layers and a
char encoder, measured ~1.5e-6 over 87 positions. 1e-4 leaves ~100x margin,
while a wrong RoPE offset, a lost or extra cached position, or a missing
sliding-window limit moves the hidden by > 1e-2 (checked below for the window).
Codes are compared exactly: they come from argmax/argmin decisions on those
values and the same random stream.
"""

from __future__ import annotations

import dataclasses

import mlx.core as mx
import numpy as np
import pytest
from mlx.utils import tree_flatten

from voicechat.model.tts import ear_tts as ear_tts_module
from voicechat.model.tts.char_encoder import FLAG_TABLE_VOCAB, CharTable
from voicechat.model.tts.ear_tts import EarTts, EarTtsState, mog_pass_schedule, replace_control_codes
from voicechat.model.tts.numerics import FLOAT32, NUMERICS, REFERENCE, numerics_from
from voicechat.model.tts.rng import SessionRandom
from voicechat.synthetic.presets import preset_config

F32_TOL = 1e-4
EOS, PAD = 2, 12
PROMPT_FRAMES = 37  # the speaker latent's length in the published checkpoints


# ----------------------------------------------------------------- fixtures


def byte_alphabet() -> list[str]:
    """The 256 single characters of a byte-level BPE vocabulary (GPT-2 byte -> unicode map)."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAC + 1)) + list(range(0xAE, 0xFF + 1))
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + extra)
            extra += 1
    return [chars[b] for b in range(256)]


def fake_vocab() -> dict[str, int]:
    """Specials 0..12, the 256 byte characters 13..268, then multi-character tokens up to 511."""
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    vocab.update({f"<SPECIAL_{i}>": i for i in range(3, 13)})
    alphabet = byte_alphabet()
    vocab.update({c: 13 + i for i, c in enumerate(alphabet)})
    words = ["Ġhello", "Ġworld", "ing", "Ġthe", "ĠVoiceChat", "!!", "Ġa", "tion"]
    letters = "abcdefghijklmnop"
    words += [a + b for a in letters for b in letters]
    for w in words:
        if len(vocab) >= 512:
            break
        vocab.setdefault(w, len(vocab))
    return vocab


@pytest.fixture(scope="module")
def cfg():
    c = preset_config("tiny").tts_config
    # The structural cases this file relies on.
    assert c.num_hidden_layers == 2 and not c.is_global_layer(0) and c.is_global_layer(1)
    assert c.sliding_window < PROMPT_FRAMES
    return c


@pytest.fixture(scope="module")
def vocab():
    return fake_vocab()


@pytest.fixture(scope="module")
def table(cfg, vocab):
    return CharTable.from_vocab(vocab, cfg.character_encoder.char_vocab_size, num_tokens=512)


def build(cfg, table, seed=0) -> EarTts:
    mx.random.seed(seed)
    model = EarTts(cfg, char_table=table)
    mx.eval(model.parameters())
    return model


@pytest.fixture(scope="module")
def model(cfg, table):
    return build(cfg, table)


@pytest.fixture(scope="module")
def silence(cfg):
    return mx.array(np.random.RandomState(7).randint(0, cfg.codebook_size, size=cfg.num_quantizers).astype(np.int32))


@pytest.fixture(scope="module")
def prompt(cfg, silence):
    """[mask, silence x (F-2), mask] codes and a random speaker latent (the warm-up inputs)."""
    mask = mx.full((1, cfg.num_quantizers), cfg.codebook_size, dtype=mx.int32)
    codes = mx.concatenate([mask, mx.broadcast_to(silence, (PROMPT_FRAMES - 2, cfg.num_quantizers)), mask])
    latent = mx.random.normal((1, PROMPT_FRAMES, cfg.hidden_size), key=mx.random.key(11))
    return codes, latent


def token_stream(n: int) -> list[int]:
    """Single chars, multi-char words, PAD/specials and an EOS, in a fixed order."""
    pool = [PAD, 13 + 72, 269, 270, 271, 272, 273, 13 + 100, 400, 3, 11, 511, 300, EOS, 13]
    return [pool[(7 * i) % len(pool)] for i in range(n)]


def warm(model, prompt) -> EarTtsState:
    state = model.make_state()
    model.warmup(state, *prompt, PAD)
    return state


# ----------------------------------------------------------------- parameters


def expected_names(cfg) -> set[str]:
    names = {
        "backbone.norm.weight",
        "bos_emb",
        "null_emb",
        "embed_code.weight",
        "audio_prompt_projection_W",
        "rvq_embs",
    }
    for i in range(cfg.num_hidden_layers):
        p = f"backbone.layers.{i}."
        names |= {p + f"self_attn.{m}_proj.weight" for m in "qkvo"}
        names |= {p + "self_attn.q_norm.weight", p + "self_attn.k_norm.weight"}
        names |= {p + f"mlp.{m}_proj.weight" for m in ("gate", "up", "down")}
        names |= {
            p + f"{n}.weight"
            for n in (
                "input_layernorm",
                "post_attention_layernorm",
                "pre_feedforward_layernorm",
                "post_feedforward_layernorm",
            )
        }
    g = "gated_fusion_audio_text."
    names |= {g + f"{m}_proj.{t}" for m in ("audio", "text") for t in ("weight", "bias")}
    names |= {g + "gate", g + "residual_scale", g + "final_norm.weight"}
    s = "embed_subword."
    names |= {s + "embed_tokens.weight", s + "proj_embedding.weight", s + "backbone.encoder.norm.weight"}
    for j in range(cfg.character_encoder.num_hidden_layers):
        p = s + f"backbone.encoder.layers.{j}."
        names |= {p + f"self_attn.{m}_proj.weight" for m in "qkvo"}
        names |= {p + f"mlp.{m}_proj.weight" for m in ("gate", "up", "down")}
        names |= {
            p + f"{n}.weight"
            for n in (
                "pre_self_attn_layernorm",
                "post_self_attn_layernorm",
                "pre_feedforward_layernorm",
                "post_feedforward_layernorm",
            )
        }
    names |= {
        s + "subword_flag_emb.is_continuation",
        s + "subword_flag_emb.pad_tensor",
        s + "subword_flag_emb.cont_emb.weight",
        s + "bos_eos_emb.special_flags",
        s + "bos_eos_emb.pad_tensor",
        s + "bos_eos_emb.special_emb.weight",
    }
    n = cfg.mog_head.num_layers
    for i in range(n):
        p = f"mog_head.mlp_stack.{i}."
        names |= {p + "pre_norm.weight", p + "post_norm.weight"}
        names |= {p + f"mlp.{m}_proj.weight" for m in ("gate", "up", "down")}
    names |= {f"mog_head.mlp_stack.{n}.weight", "mog_head.low_mat"}
    names |= {f"mog_head.proj_{m}.weight" for m in ("logits", "mus", "logs", "else")}
    return names


def test_parameter_names_and_shapes(model, cfg):
    params = dict(tree_flatten(model.parameters()))
    assert set(params) == expected_names(cfg)
    h, m = cfg.hidden_size, cfg.mog_head
    assert params["embed_code.weight"].shape == (h, cfg.latent_size)
    assert params["rvq_embs"].shape == (cfg.num_quantizers, cfg.codebook_size, cfg.latent_size)
    assert params["gated_fusion_audio_text.residual_scale"].shape == ()
    assert params["embed_subword.embed_tokens.weight"].shape == (cfg.character_encoder.char_vocab_size, h)
    assert params["mog_head.proj_mus.weight"].shape == (m.num_predictions * m.low_rank, h)
    assert params["mog_head.proj_logs.weight"].shape == (1, h)
    assert params["mog_head.proj_else.weight"].shape == (cfg.latent_size, h)
    assert params["mog_head.low_mat"].shape == (m.num_predictions, cfg.latent_size, m.low_rank)
    # Flag tables: hard-wired sizes, integer dtype.
    cont = params["embed_subword.subword_flag_emb.is_continuation"]
    flags = params["embed_subword.bos_eos_emb.special_flags"]
    assert cont.shape == (FLAG_TABLE_VOCAB + 1,) and flags.shape == (FLAG_TABLE_VOCAB,)
    for name in (
        "subword_flag_emb.is_continuation",
        "subword_flag_emb.pad_tensor",
        "bos_eos_emb.special_flags",
        "bos_eos_emb.pad_tensor",
    ):
        assert mx.issubdtype(params["embed_subword." + name].dtype, mx.integer), name
    assert params["embed_subword.subword_flag_emb.pad_tensor"].item() == 131072
    assert params["embed_subword.bos_eos_emb.pad_tensor"].item() == 131071


# ----------------------------------------------------------------- cached vs recomputed


def test_cached_steps_match_recompute_50_steps(model, cfg, prompt, silence):
    state = warm(model, prompt)
    history = model.new_history(*prompt, PAD)
    rng_cached, rng_recomputed = SessionRandom(0), SessionRandom(0)
    worst, all_codes = 0.0, []
    for t, tok in enumerate(token_stream(50)):
        h_cached = model.step_hidden(state.copy(), tok, eos_id=EOS, silence_codes=silence)
        codes = model.step(state, tok, rng_cached, eos_id=EOS, silence_codes=silence)
        h_recomputed = model.uncached_hidden(history, tok, eos_id=EOS, silence_codes=silence)
        codes_re = model.step_uncached(history, tok, rng_recomputed, eos_id=EOS, silence_codes=silence)
        mx.eval(codes, codes_re, h_cached, h_recomputed, *state.arrays().values())
        assert codes.dtype == mx.int32 and codes.shape == (cfg.num_quantizers,)
        assert codes.tolist() == codes_re.tolist(), f"step {t}"
        worst = max(worst, mx.abs(h_cached - h_recomputed).max().item())
        all_codes.append(codes.tolist())
    print(f"cached vs recomputed backbone hidden: max abs {worst:.3g}")
    assert worst <= F32_TOL
    # The random stream: two draws per effective MoG pass, on both paths.
    effective = sum(1 for c in model.pass_counts if c)
    assert rng_cached.draws == rng_recomputed.draws == 50 * 2 * effective
    # Non-degenerate sampling: codes vary over steps and codebooks.
    assert len({tuple(c) for c in all_codes}) > 40
    assert len({c for row in all_codes for c in row}) > cfg.codebook_size // 2
    # Sliding layer: exactly `sliding_window` entries; global layer: every position.
    total = PROMPT_FRAMES + 50
    arrays = state.arrays()
    assert state.offset == arrays["offset"].item() == total
    assert arrays["layers.0.keys"].shape[2] == cfg.sliding_window == state.capacity(0)
    assert arrays["layers.1.keys"].shape[2] == total
    assert mx.array_equal(arrays["previous_codes"], mx.array([all_codes[-1]], dtype=mx.int32)).item()


def test_multi_position_passes_and_ring_order(model, cfg, prompt, silence):
    """The same 37 + 20 positions fed as single steps, as one pass from a fresh state, and as the
    warm-up followed by one 20-position chunk (attends through a wrapped ring): the outputs match
    the offline pass and the kept K/V agree. The ring order is checked against a model whose
    window is wider than the sequence (layer 0's keys do not depend on the window)."""
    history = model.new_history(*prompt, PAD)
    rng = SessionRandom(1)
    for tok in token_stream(20):
        model.step_uncached(history, tok, rng, eos_id=EOS, silence_codes=silence)
    rows = [model.warmup_inputs(*prompt, PAD)]
    stepped = warm(model, prompt)
    for prev, tok, eos, sil in history.steps:
        stepped.previous_codes = prev
        model.step_hidden(stepped, tok, eos_id=eos, silence_codes=sil)
        rows.append(model.step_inputs(prev, tok, eos_id=eos, silence_codes=sil))
    x = mx.concatenate(rows, axis=1)
    offline = model.backbone(x)
    one_pass = model.make_state()
    out_one = model.backbone(x, one_pass)
    chunked = warm(model, prompt)
    out_chunk = model.backbone(x[:, PROMPT_FRAMES:], chunked)
    assert mx.abs(out_one - offline).max().item() <= F32_TOL
    assert mx.abs(out_chunk - offline[:, PROMPT_FRAMES:]).max().item() <= F32_TOL
    a = stepped.arrays()
    for other in (one_pass, chunked):
        b = other.arrays()
        assert a.keys() == b.keys() and b["offset"].item() == PROMPT_FRAMES + 20
        for name in a:
            if name.startswith("layers."):
                assert a[name].shape == b[name].shape, name
                assert mx.abs(a[name] - b[name]).max().item() <= F32_TOL, name
    assert a["layers.0.keys"].shape[2] == cfg.sliding_window
    wide = EarTts(dataclasses.replace(cfg, sliding_window=10_000), char_table=model.char_table)
    wide.load_weights(tree_flatten(model.parameters()))
    wide_state = wide.make_state()
    wide.backbone(x, wide_state)
    for kind in ("keys", "values"):
        last = wide_state.arrays()[f"layers.0.{kind}"][:, :, -cfg.sliding_window :]
        assert mx.abs(a[f"layers.0.{kind}"] - last).max().item() <= F32_TOL


def test_sliding_window_changes_the_result(model, cfg, prompt, silence):
    """Without the window limit the recomputed hidden moves far beyond the tolerance,
    so the cached == recomputed check above does exercise the sliding mask."""
    wide_cfg = dataclasses.replace(cfg, sliding_window=10_000)
    wide = EarTts(wide_cfg, char_table=model.char_table)
    wide.load_weights(tree_flatten(model.parameters()))
    history = model.new_history(*prompt, PAD)
    h_window = model.uncached_hidden(history, 300, eos_id=EOS, silence_codes=silence)
    h_wide = wide.uncached_hidden(history, 300, eos_id=EOS, silence_codes=silence)
    assert mx.abs(h_window - h_wide).max().item() > 1e-2


def test_cached_state_bookkeeping(model, cfg, prompt, silence):
    state = model.make_state()
    assert state.arrays()["layers.0.keys"].shape[2] == 0 and state.nbytes > 0
    model.warmup(state, *prompt, PAD)
    assert state.offset == PROMPT_FRAMES
    assert state.previous_codes.tolist() == [[cfg.codebook_size] * cfg.num_quantizers]
    snapshot = state.copy()
    rng = SessionRandom(0)
    for tok in token_stream(3):
        model.step(state, tok, rng, eos_id=EOS, silence_codes=silence)
    mx.eval(*state.arrays().values())
    # The copy is independent of later steps.
    assert snapshot.offset == PROMPT_FRAMES and state.offset == PROMPT_FRAMES + 3
    assert snapshot.arrays()["layers.1.keys"].shape[2] == PROMPT_FRAMES
    # Warm-up again starts from fresh caches.
    model.warmup(state, *prompt, PAD)
    for name, arr in snapshot.arrays().items():
        assert mx.array_equal(arr, state.arrays()[name]).item(), name


# ----------------------------------------------------------------- sampling


def run_codes(model, prompt, silence, seed, n=8) -> list[list[int]]:
    state, rng = warm(model, prompt), SessionRandom(seed)
    out = []
    for tok in token_stream(n):
        codes = model.step(state, tok, rng, eos_id=EOS, silence_codes=silence)
        mx.eval(codes)
        out.append(codes.tolist())
    return out


def test_seed_determinism(model, prompt, silence):
    a = run_codes(model, prompt, silence, seed=0)
    assert a == run_codes(model, prompt, silence, seed=0)
    assert a != run_codes(model, prompt, silence, seed=1)


def test_draw_order_and_shapes(model, cfg, prompt, silence):
    """Per effective pass: one uniform (1, 1, num_predictions), then one normal (1, 1, latent)."""

    class Recording(SessionRandom):
        def __init__(self, seed):
            super().__init__(seed)
            self.log = []

        def uniform(self, shape, dtype=mx.float32):
            self.log.append(("uniform", tuple(shape)))
            return super().uniform(shape, dtype)

        def normal(self, shape, dtype=mx.float32):
            self.log.append(("normal", tuple(shape)))
            return super().normal(shape, dtype)

        def uniform_then_normal(self, uniform_shape, normal_shape):
            self.log += [("uniform", tuple(uniform_shape)), ("normal", tuple(normal_shape))]
            return super().uniform_then_normal(uniform_shape, normal_shape)

    state, rng = warm(model, prompt), Recording(0)
    model.step(state, 300, rng, eos_id=EOS, silence_codes=silence)
    passes = sum(1 for c in model.pass_counts if c)
    pair = [("uniform", (1, 1, cfg.mog_head.num_predictions)), ("normal", (1, 1, cfg.latent_size))]
    assert rng.log == pair * passes


def test_degenerate_sampling_ignores_the_stream(cfg, table, prompt, silence):
    """top_p tiny (only the best component) and no noise: codes do not depend on the seed."""
    model = build(dataclasses.replace(cfg, top_p=1e-6, noise_scale=0.0), table)
    assert run_codes(model, prompt, silence, seed=0, n=4) == run_codes(model, prompt, silence, seed=3, n=4)


def test_mog_pass_schedule(cfg, model):
    assert mog_pass_schedule(31, 8, 3.0) == [0, 0, 0, 1, 1, 3, 4, 22]

    # Independent exact derivation for exponent 3: masked_i is the least integer m with
    # m³·N³ >= (N³ - i³)·Q³.
    def exact(q, n):
        masked = [next(m for m in range(q + 1) if m**3 * n**3 >= (n**3 - i**3) * q**3) for i in range(n)] + [0]
        return [masked[i] - masked[i + 1] for i in range(n)]

    assert exact(31, 8) == [0, 0, 0, 1, 1, 3, 4, 22]
    tiny = mog_pass_schedule(cfg.num_quantizers, cfg.num_iterations, cfg.exponent)
    assert tiny == exact(cfg.num_quantizers, cfg.num_iterations) == model.pass_counts
    assert sum(tiny) == cfg.num_quantizers


# ----------------------------------------------------------------- EOS, tokens, control codes


def test_eos_rule(model, cfg, prompt, silence):
    state = warm(model, prompt)
    rng = SessionRandom(0)
    for tok in token_stream(3)[:2]:
        model.step(state, tok, rng, eos_id=EOS, silence_codes=silence)
    mx.eval(state.previous_codes)
    assert state.previous_codes.tolist() != [silence.tolist()]
    as_silence = state.copy()
    as_silence.previous_codes = silence[None]
    # EOS: the previous codes are replaced by the silence codes.
    h_eos = model.step_hidden(state.copy(), EOS, eos_id=EOS, silence_codes=silence)
    h_ref = model.step_hidden(as_silence.copy(), EOS, eos_id=EOS, silence_codes=silence)
    assert mx.array_equal(h_eos, h_ref).item()
    # Any other token: the previous codes matter.
    h_tok = model.step_hidden(state.copy(), 300, eos_id=EOS, silence_codes=silence)
    h_tok_sil = model.step_hidden(as_silence.copy(), 300, eos_id=EOS, silence_codes=silence)
    assert mx.abs(h_tok - h_tok_sil).max().item() > 1e-3
    # Device-side token: same select, no host sync needed.
    h_dev = model.step_hidden(state.copy(), mx.array(EOS), eos_id=EOS, silence_codes=silence)
    assert mx.abs(h_dev - h_eos).max().item() <= 1e-5
    # The codes fed back are the raw generated ones (EOS does not rewrite previous_codes).
    codes = model.step(state, EOS, rng, eos_id=EOS, silence_codes=silence)
    assert mx.array_equal(state.previous_codes[0], codes).item()


@pytest.mark.parametrize("tok", [13 + 72, 269, 273, PAD, 400, 511])
def test_device_token_matches_host_token(model, prompt, silence, tok):
    """mx.array token (chars from the device table, padded + masked) vs int token (exact length).
    Same math up to float32 summation order: 1e-5 on O(1) values."""
    state = warm(model, prompt)
    h_host = model.step_hidden(state.copy(), tok, eos_id=EOS, silence_codes=silence)
    h_dev = model.step_hidden(state.copy(), mx.array([tok], dtype=mx.int32), eos_id=EOS, silence_codes=silence)
    assert mx.abs(h_host - h_dev).max().item() <= 1e-5


def test_replace_control_codes():
    rs = np.random.RandomState(0)
    codes = rs.randint(0, 12, size=(5, 6)).astype(np.int32)
    control = np.array([3, 7, 11], dtype=np.int64)
    silence = np.array([100, 101, 102, 103, 104, 105], dtype=np.int64)
    expected = codes.copy()
    for t in range(5):
        for q in range(6):
            if codes[t, q] in control:
                expected[t, q] = silence[q]
    got = replace_control_codes(mx.array(codes), mx.array(control), mx.array(silence))
    assert got.dtype == mx.int32 and np.array_equal(np.array(got), expected)
    assert (expected != codes).any()
    one = replace_control_codes(mx.array(codes[0]), control, silence)  # a single frame, numpy inputs
    assert np.array_equal(np.array(one), expected[0])
    with pytest.raises(ValueError, match="codes"):
        replace_control_codes(mx.array(codes[:, :5]), control, silence)
    with pytest.raises(TypeError, match="control_codes"):
        replace_control_codes(mx.array(codes), mx.array([1.0, 2.0]), silence)


# ----------------------------------------------------------------- char table


def test_char_table(cfg, vocab, table):
    alphabet = byte_alphabet()
    assert table.alphabet == "".join(alphabet) and table.pad_char_id == 256
    assert table.num_tokens == 512
    assert table.sequence(13 + 5) == [5]  # single char -> its own char id
    # Multi-character tokens spell through the table; specials are spelled too.
    hello = vocab["Ġhello"]
    assert table.sequence(hello) == [alphabet.index(c) for c in "Ġhello"]
    assert table.sequence(PAD) == [alphabet.index(c) for c in "<SPECIAL_12>"]
    # Device table agrees with the host sequences.
    ids, lengths = np.array(table.device_ids), np.array(table.device_lengths)
    for tok in (0, PAD, hello, 511):
        seq = table.sequence(tok)
        assert lengths[tok] == len(seq) and ids[tok, : len(seq)].tolist() == seq
        assert (ids[tok, len(seq) :] == 256).all()
    with pytest.raises(ValueError, match="outside the char table"):
        table.sequence(512)


def test_char_table_errors(cfg, vocab, model):
    n = cfg.character_encoder.char_vocab_size
    short = dict(vocab)
    short.pop(byte_alphabet()[40])
    with pytest.raises(ValueError, match="255 single-character tokens, expected exactly"):
        CharTable.from_vocab(short, n)
    extra = dict(vocab)
    extra["€"] = 600
    with pytest.raises(ValueError, match="257 single-character tokens"):
        CharTable.from_vocab(extra, n)
    dup = dict(vocab)
    dup["Ġdup"] = vocab["Ġhello"]
    with pytest.raises(ValueError, match="appears twice"):
        CharTable.from_vocab(dup, n)
    with pytest.raises(ValueError, match="num_tokens"):
        CharTable.from_vocab(vocab, n, num_tokens=100)
    other = CharTable.from_vocab({chr(65 + i): i for i in range(10)}, 11)
    with pytest.raises(ValueError, match="char_vocab_size"):
        model.set_char_table(other)
    with pytest.raises(ValueError, match="no char table"):
        EarTts(cfg).warmup_inputs(
            mx.zeros((PROMPT_FRAMES, cfg.num_quantizers), dtype=mx.int32),
            mx.zeros((1, PROMPT_FRAMES, cfg.hidden_size)),
            PAD,
        )


# ----------------------------------------------------------------- per-model numerics


def copy_with(model, cfg, numerics: str, dtype=None) -> EarTts:
    """A new EarTts with `numerics` and `model`'s weights (floats cast to `dtype` if given: bf16 is
    the published checkpoints' dtype); integer buffers kept."""
    out = EarTts(cfg, char_table=model.char_table, numerics=numerics)
    out.load_weights(
        [
            (n, w.astype(dtype) if dtype is not None and mx.issubdtype(w.dtype, mx.floating) else w)
            for n, w in tree_flatten(model.parameters())
        ]
    )
    mx.eval(out.parameters())
    return out


def test_numerics_setting_and_validation(model, cfg):
    """The setting is per model, fixed at construction and validated with the choices named."""
    assert set(NUMERICS) == {"reference", "float32"}
    assert EarTts(cfg).numerics is REFERENCE  # the default reproduces the reference
    ref, f32 = copy_with(model, cfg, "reference"), copy_with(model, cfg, "float32")
    assert ref.numerics is REFERENCE and f32.numerics is FLOAT32
    assert all(getattr(REFERENCE, f) is True for f in REFERENCE.__dataclass_fields__ if f != "name")
    assert all(getattr(FLOAT32, f) is False for f in FLOAT32.__dataclass_fields__ if f != "name")
    assert ref.backbone.layers[0].input_layernorm.one_plus_in_weight_dtype is True
    assert f32.backbone.norm.one_plus_in_weight_dtype is False
    with pytest.raises(ValueError, match="expected one of 'reference', 'float32', got 'bf16'"):
        EarTts(cfg, numerics="bf16")
    with pytest.raises(TypeError, match="expected one of 'reference', 'float32', got bool True"):
        EarTts(cfg, numerics=True)
    with pytest.raises(AttributeError):
        ref.numerics = FLOAT32  # a property: the modules were built for the setting
    assert numerics_from(FLOAT32) is FLOAT32 and numerics_from("reference") is REFERENCE


def test_backbone_norm_flag(model, cfg):
    """With bf16 norm weights, numerics="reference" rounds 1 + w to bf16: equal to float32 weights
    pre-rounded that way (exact: (1 + w)_bf16 - 1 is representable in float32), different from
    float32 1 + w (numerics="float32")."""
    flagged_model = copy_with(model, cfg, "reference")
    plain_model = copy_with(model, cfg, "float32")
    rounded = copy_with(model, cfg, "float32")
    weights_bf = [
        (n, (mx.random.normal(w.shape, key=mx.random.key(i)) * 0.3).astype(mx.bfloat16))
        for i, (n, w) in enumerate(tree_flatten(model.backbone.parameters()))
        if "norm" in n
    ]
    flagged_model.backbone.load_weights(weights_bf, strict=False)
    plain_model.backbone.load_weights(weights_bf, strict=False)
    rounded.backbone.load_weights([(n, (1 + w).astype(mx.float32) - 1) for n, w in weights_bf], strict=False)
    x = mx.random.normal((2, 5, cfg.hidden_size), key=mx.random.key(3))
    flagged = flagged_model.backbone(x)
    plain = plain_model.backbone(x)
    reference = rounded.backbone(x)
    assert flagged.dtype == mx.float32
    assert mx.abs(flagged - reference).max().item() <= 1e-6
    assert mx.abs(flagged - plain).max().item() > 1e-4


def test_reference_numerics_on_float32_weights(model, cfg, prompt, silence):
    """Three roundings only round to the weight dtype, a no-op for float32 weights (bit-identical
    hidden states); the fourth (log(softmax) log-probs) moves values by ~1 ulp, which flips no
    sampling decision here: the same codes."""
    ref, f32 = copy_with(model, cfg, "reference"), copy_with(model, cfg, "float32")
    h_ref = ref.step_hidden(warm(ref, prompt), 300, eos_id=EOS, silence_codes=silence)
    h_f32 = f32.step_hidden(warm(f32, prompt), 300, eos_id=EOS, silence_codes=silence)
    assert mx.array_equal(h_ref, h_f32).item()
    assert run_codes(ref, prompt, silence, seed=0, n=20) == run_codes(f32, prompt, silence, seed=0, n=20)


def test_text_side_flag(model, cfg, prompt, silence):
    """With bf16 weights, numerics="reference" keeps the char encoder and flag embeddings in bf16
    (the reference's activation dtype) and projects the text in bf16; the fused input stays
    float32. bf16 carries 2^-8 relative rounding per op on O(1) values: the two paths differ by
    more than 1e-3 and less than 0.1 (a wrong formula would move them by O(1))."""
    bf = copy_with(model, cfg, "reference", mx.bfloat16)
    bf_f32 = copy_with(model, cfg, "float32", mx.bfloat16)
    enc, table = bf.embed_subword, bf.char_table
    ids, mask = [PAD, 300, 13 + 72, 400, 273], [False, True, True, True, True]
    f32 = enc.embed_host(ids, mask, table)
    low = enc.embed_host(ids, mask, table, in_weight_dtype=True)
    assert f32.dtype == mx.float32 and low.dtype == mx.bfloat16
    diff = mx.abs(low.astype(mx.float32) - f32).max().item()
    assert 1e-3 < diff < 0.1
    # The device path (chars padded to max_chars, masked) gives the host path's bf16 values: masked
    # keys get probability exactly 0 and padded rows are excluded from the pooled sum.
    for t, tok in enumerate(ids[1:], start=1):
        dev = enc.embed_device(mx.array(tok, dtype=mx.int32), table, in_weight_dtype=True)
        assert dev.dtype == mx.bfloat16 and mx.array_equal(dev[0], low[t]).item(), tok
    prev = prompt[0][-1:]
    x_plain = bf_f32.step_inputs(prev, 300, eos_id=EOS, silence_codes=silence)
    x_flag = bf.step_inputs(prev, 300, eos_id=EOS, silence_codes=silence)
    assert x_plain.dtype == x_flag.dtype == mx.float32 and x_flag.shape == (2, 1, cfg.hidden_size)
    assert 1e-4 < mx.abs(x_flag - x_plain).max().item() < 0.1


def test_rvq_norm_flag(model, cfg):
    """quantize_residual with bf16 codebooks: numerics="reference" computes ‖e_j‖² in bf16 (the
    reference). Every such choice is optimal up to that rounding (float64 distances, bound
    2·max|Δ‖e‖²|), some near ties flip, and with numerics="float32" the choice is the float64
    optimum except at ties closer than float32 rounding (1e-4 on distances of O(10))."""
    bf = copy_with(model, cfg, "reference", mx.bfloat16)
    bf_f32 = copy_with(model, cfg, "float32", mx.bfloat16)
    books = np.array(bf.rvq_embs.astype(mx.float32), dtype=np.float64)
    stored = bf.rvq_embs[0]
    norm_err = np.abs(np.array((stored * stored).sum(axis=-1).astype(mx.float32)) - (books[0] ** 2).sum(-1)).max()
    assert norm_err > 0
    rs = np.random.RandomState(5)
    flips = 0
    for _i in range(200):
        a, b = rs.choice(cfg.codebook_size, size=2, replace=False)
        # Midpoints between two codewords: near ties, where the rounding matters.
        r = 0.5 * (books[0, a] + books[0, b]) + 0.05 * rs.randn(cfg.latent_size)
        res = mx.array(r[None].astype(np.float32))
        plain = bf_f32.quantize_residual(res, 0, 1)[0][0].item()
        flagged = bf.quantize_residual(res, 0, 1)[0][0].item()
        dist = (books[0] ** 2).sum(-1) - 2.0 * books[0] @ r.astype(np.float32)
        assert dist[plain] - dist.min() <= 1e-4
        assert dist[flagged] - dist.min() <= 2 * norm_err
        flips += plain != flagged
    assert flips > 0
    # Float32 codebooks: ‖e_j‖² in the weight dtype is the float32 one, no change at all.
    res = mx.random.normal((1, cfg.latent_size), key=mx.random.key(9))
    ref, f32 = copy_with(model, cfg, "reference"), copy_with(model, cfg, "float32")
    codes_plain, rest_plain = f32.quantize_residual(res, 0, cfg.num_quantizers)
    codes_flag, rest_flag = ref.quantize_residual(res, 0, cfg.num_quantizers)
    assert mx.array_equal(mx.concatenate(codes_plain), mx.concatenate(codes_flag)).item()
    assert mx.array_equal(rest_plain, rest_flag).item()


def test_top_p_keep_rule_and_ties():
    """Keep a component iff the mass ranked above it is < top_p; ranking by descending probability,
    equal probabilities ranked higher index first (the reference's order). Dyadic probabilities
    make every float32 sum exact, so the expected masks are exact."""

    def expected(p, top_p):
        keep, mass = [False] * len(p), 0.0
        for i in sorted(range(len(p)), key=lambda i: (-p[i], -i)):
            keep[i] = mass < top_p
            mass += p[i]
        return keep

    cases = [
        ([0.25, 0.25, 0.25, 0.25], 0.5),  # tie at the boundary: keep 3 and 2, not 1 and 0
        ([0.1875, 0.1875, 0.1875, 0.1875, 0.25], 0.5),
        ([0.5, 0.5], 0.5),
        ([0.125, 0.5, 0.25, 0.125], 0.95),
        ([0.0625] * 16, 0.95),
        ([1.0, 0.0, 0.0], 0.95),
        ([0.25, 0.25, 0.25, 0.25], 1e-6),  # tiny top_p: only the top-ranked (highest index) survives
    ]
    for p, top_p in cases:
        got = ear_tts_module.top_p_keep(mx.array([[p]], dtype=mx.float32), top_p)
        assert np.array(got)[0, 0].tolist() == expected(p, top_p), (p, top_p)
    rs = np.random.RandomState(0)
    for _ in range(20):
        p = rs.dirichlet(np.full(32, 0.3)).astype(np.float32)
        got = ear_tts_module.top_p_keep(mx.array(p[None, None]), 0.95)
        assert np.array(got)[0, 0].tolist() == expected(p.tolist(), 0.95)


def test_sliding_ring_layout_after_warmup(model, cfg, prompt, silence):
    """A pass longer than the window re-lays the ring in position order from index 0 (the order of
    the reference's rotating cache, so single-step attention sums run in the same order); the next
    single step overwrites the oldest entry, index 0, and the ring keeps rotating from there."""
    w = cfg.sliding_window
    state = warm(model, prompt)
    assert state.ring_origin == [PROMPT_FRAMES % w, 0]
    keys, values = state.ordered_kv(0)
    assert state.capacity(0) == w
    assert mx.array_equal(state.keys[0], keys).item() and mx.array_equal(state.values[0], values).item()
    rng = SessionRandom(0)
    for n in range(1, w + 3):
        model.step(state, 300, rng, eos_id=EOS, silence_codes=silence)
        newest = state.ordered_kv(0)[0][:, :, -1:]
        index = (n - 1) % w
        assert mx.array_equal(state.keys[0][:, :, index : index + 1], newest).item(), n
    fresh = model.make_state()
    model.backbone(mx.zeros((2, 3, cfg.hidden_size)), fresh)  # shorter than the window: origin stays 0
    assert fresh.ring_origin == [0, 0] and fresh.capacity(0) == 3


# ----------------------------------------------------------------- input validation


def test_bad_inputs(model, cfg, prompt, silence):
    codes, latent = prompt
    q, c = cfg.num_quantizers, cfg.codebook_size
    state = model.make_state()
    bad_codes = [
        (codes.at[3, 0].add(c), ValueError, "prompt_codes: values must lie in"),  # above the mask code
        (codes.at[3, 0].add(-c - 1), ValueError, "prompt_codes: values must lie in"),  # negative
        (codes[:, : q - 1], ValueError, f"expected {q} codes per frame"),
        (codes.astype(mx.float32), TypeError, "integer"),
        (codes[:1], ValueError, "F >= 2"),
        ("codes", TypeError, "prompt_codes"),
    ]
    for value, exc, msg in bad_codes:
        with pytest.raises(exc, match=msg):
            model.warmup(state, value, latent, PAD)
    with pytest.raises(ValueError, match="speaker_latent: expected shape"):
        model.warmup(state, codes, latent[:, :-1], PAD)
    with pytest.raises(TypeError, match="pad_id"):
        model.warmup(state, codes, latent, 1.5)
    model.warmup(state, codes, latent, PAD)
    rng = SessionRandom(0)
    bad_silence = [
        (silence[:-1], ValueError, f"expected {q} codes per frame"),
        (silence.astype(mx.float32), TypeError, "integer"),
        (mx.full((q,), c, dtype=mx.int32), ValueError, f"values must lie in \\[0, {c - 1}\\]"),  # mask is no silence
        (np.full((q,), -1, dtype=np.int64), ValueError, "values must lie in"),
        (mx.broadcast_to(silence, (2, q)), ValueError, "expected shape"),
    ]
    for value, exc, msg in bad_silence:
        with pytest.raises(exc, match=msg):
            model.step(state, 300, rng, eos_id=EOS, silence_codes=value)
    for token, exc in [
        (-1, ValueError),
        (True, TypeError),
        (1.0, TypeError),
        (mx.array(1.0), TypeError),
        (mx.array([1, 2]), TypeError),
        (600, ValueError),
    ]:
        with pytest.raises(exc, match="token"):
            model.step(state, token, rng, eos_id=EOS, silence_codes=silence)
    with pytest.raises(TypeError, match="state"):
        model.step(object(), 300, rng, eos_id=EOS, silence_codes=silence)
    with pytest.raises(TypeError, match="rng"):
        model.step(state, 300, 0, eos_id=EOS, silence_codes=silence)
    # Refused calls changed nothing: the state is still right after the warm-up.
    assert state.offset == PROMPT_FRAMES


# ----------------------------------------------------------------- dispatch-saving forms (exact)


@pytest.mark.parametrize("head_dim", [18, 64, 128, 256])
@pytest.mark.parametrize("n, offset", [(1, 0), (1, 37), (1, 4099), (37, 0), (3, 120)])
@pytest.mark.parametrize("base", [10_000.0, 1_000_000.0])
def test_rope_table_equals_fast_rope(head_dim, n, offset, base):
    """The backbone's RoPE from a per-step table (cos, sin taken from mx.fast.rope itself) gives
    mx.fast.rope's values bit for bit, on q (B, H, n, D) and k (B, KV, n, D) alike, compiled or not."""
    from voicechat.model.tts.ear_tts import _apply_rope, rope_table

    from .runtime_util import running

    x = mx.random.normal((2, 4, n, head_dim), key=mx.random.key(head_dim + n)) * 3.0
    off = mx.array(offset, dtype=mx.int32)
    want = mx.fast.rope(x, head_dim, traditional=False, base=base, scale=1.0, offset=off)
    cos, sin = rope_table(n, head_dim, base, off)
    assert cos.shape == sin.shape == (1, 1, n, head_dim // 2)
    plain = _apply_rope(x, cos, sin)
    with running(compiled=True):
        fused = mx.compile(_apply_rope)(x, cos, sin)
    for got in (plain, fused):
        assert got.dtype == want.dtype and got.shape == want.shape
        assert np.array_equal(np.array(got), np.array(want))


def _quantize_naive(books_t, norms, residual, first, count):
    """The RVQ search written plainly (§8.6 j): per codebook, j* = argmin ‖e_j‖² − 2·r·e_j, r −= e_j*."""
    codes = []
    for qi in range(first, first + count):
        dist = norms[qi] - 2.0 * (residual @ books_t[qi])[0]
        j = int(mx.argmin(dist).item())
        residual = residual - books_t[qi][:, j][None]
        codes.append(j)
    return codes, residual


@pytest.mark.parametrize("first, count", [(0, 1), (0, 3), (2, 4), (5, 3)])
def test_quantize_pass_equals_the_plain_search(model, cfg, first, count):
    count = min(count, cfg.num_quantizers - first)
    books_t, norms = model.rvq_books()
    residual = mx.random.normal((1, cfg.latent_size), key=mx.random.key(first * 10 + count))
    want_codes, want_rest = _quantize_naive(books_t, norms, residual, first, count)
    codes, rest = model.quantize_pass(residual, first, count)
    assert codes.dtype == mx.int32 and codes.shape == (count,)
    assert codes.tolist() == want_codes
    assert np.array_equal(np.array(rest), np.array(want_rest))
    listed, rest2 = model.quantize_residual(residual, first, count)
    assert [c.item() for c in listed] == want_codes and all(c.shape == (1,) for c in listed)
    assert np.array_equal(np.array(rest2), np.array(want_rest))


def test_text_embedding_cache(model, prompt, silence, monkeypatch):
    """A step with the per-session text cache equals one without it (codes and caches), runs the
    character encoder only for ids not held, and the cache keeps at most max_entries ids."""
    from voicechat.model.tts.ear_tts import TextEmbeddingCache

    tokens = [PAD, 300, 269, 300, 300, 269, PAD, 13 + 72, 300]
    calls = []
    original = model.embed_subword.embed_host

    def counted(ids, *args, **kwargs):
        calls.append(tuple(ids))
        return original(ids, *args, **kwargs)

    monkeypatch.setattr(model.embed_subword, "embed_host", counted)
    runs = {}
    for cached in (False, True):
        state, rng = warm(model, prompt), SessionRandom(3)
        cache = TextEmbeddingCache(max_entries=3) if cached else None
        calls.clear()
        out = []
        for tok in tokens:
            codes = model.step(state, tok, rng, eos_id=EOS, silence_codes=silence, text_cache=cache)
            mx.eval(codes)
            out.append(codes.tolist())
        runs[cached] = (out, state.arrays(), list(calls))
        if cached:
            assert len(cache) == 3
    assert runs[True][0] == runs[False][0]
    for k, v in runs[False][1].items():
        assert np.array_equal(np.array(v), np.array(runs[True][1][k])), k
    assert len(runs[False][2]) == len(tokens)
    # With room for 3 ids: each id is encoded on first use; 85 evicts the least recently used
    # id (300), which is then encoded again.
    assert runs[True][2] == [(PAD,), (300,), (269,), (13 + 72,), (300,)]
    with pytest.raises(ValueError, match="max_entries"):
        TextEmbeddingCache(0)


def test_text_embedding_cache_is_least_recently_used():
    from voicechat.model.tts.ear_tts import TextEmbeddingCache

    cache = TextEmbeddingCache(max_entries=2)
    a, b, c = mx.array([1.0]), mx.array([2.0]), mx.array([3.0])
    cache.put(1, a)
    cache.put(2, b)
    assert cache.get(1) is a  # 1 is now the most recently used
    cache.put(3, c)  # evicts 2
    assert cache.get(2) is None and cache.get(1) is a and cache.get(3) is c


@pytest.mark.parametrize("start", [0, 1, 255, 256, 257, 511, 4099, 70_000])
def test_rope_blocks_equal_per_step_tables(model, start):
    """A single step's RoPE sliced from a cached block of ROPE_BLOCK positions equals the table
    made for that position alone, bit for bit, on both sides of block boundaries."""
    from voicechat.model.tts.ear_tts import rope_table

    backbone = model.backbone
    for layer in backbone.layers[:2]:
        attn = layer.self_attn
        cos, sin = backbone._rope(1, attn.head_dim, attn.rope_base, start)
        want_cos, want_sin = rope_table(1, attn.head_dim, attn.rope_base, mx.array(start, dtype=mx.int32))
        assert cos.shape == want_cos.shape and sin.shape == want_sin.shape
        assert np.array_equal(np.array(cos), np.array(want_cos))
        assert np.array_equal(np.array(sin), np.array(want_sin))
    assert len(backbone.__dict__["_rope_blocks"]) <= 8
