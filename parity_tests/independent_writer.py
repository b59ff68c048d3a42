"""A second, independent checkpoint writer, written from docs/model.md §1-3 only.

It does not import `voicechat` (neither `voicechat.synthetic` nor
`voicechat.io.checkpoint` nor the config classes): the tensor inventory below is
the spec's table (§2.3) in raw NeMo names and layouts (§2.1-2.2), the config is
the runtime-v2 schema (§1.2-1.6) written as a plain dict, and the tokenizer is
a byte-level BPE *trained* with the `tokenizers` library on a small corpus (the
project's own synthetic tokenizer is built by hand). Packing uses MLX's own
`mx.quantize`, so the quantized layout is whatever MLX (and so mlx-vlm) writes.

What varies (`Spec`), as real checkpoints vary it:

* geometry: `num_quantizers` (31 = real), `codebook_size`, and whether the
  three control codes lie inside the generated range (the top three codes) or
  outside it (codebook_size, +1, +2);
* `dtype` of the unquantized float tensors: "float32" or "bfloat16";
* `bits` (None / 4 / 8) and the quantization `predicate`:
  - "published": the language path only (§3.1, 123 modules at full size);
  - "mlx-vlm-default": what `mlx_vlm.convert --quantize` selects: every Linear /
    Embedding whose input width is a multiple of the group size (64), in every
    component, including `mog_head.proj_mus` and the char embedding;
  - "mlx-vlm-runnable": the same minus `proj_mus` and the char embedding, which
    mlx-vlm 0.7.10's own TTS reads as dense matrices (so it can run this one);
* `depth`: "tiny" (a few layers) or "real" (56 LLM / 24 conformer / 28 TTS
  layers, the published pattern and the real codec geometry) at reduced width;
* `sampling`: "greedy" (top_p 1e-6, noise 0: no random draw matters) or
  "shipped" (top_p 0.95, noise 0.001, guidance 0.2).

Written: raw-layout shards + `model.safetensors.index.json`, `config.json`
with the `Infinity` token in `time_step_limit`, `tokenizer.json` (+ config and
special-tokens map), integer buffers as int64, quantization scales/biases in
float32 (quantized from float32 masters, §2.4).
"""

from __future__ import annotations

import json
import math
import zlib
from dataclasses import dataclass, replace
from pathlib import Path

import mlx.core as mx
import numpy as np

GROUP_SIZE = 64
# Published pattern (docs/model.md §1.3): 27 Mamba, 4 attention, 25 MLP.
REAL_PATTERN = "M-M-M-MM-M-M-M*-M-M-M*-M-M-M-M*-M-M-M-M*-M-MM-M-M-M-M-M-"
TINY_PATTERN = "MM-*M"
FLAG_TABLE = 131072  # the subword flag tables are hard-wired to this size (§2.3, §13.1)
SPEAKER_FRAMES = 37


@dataclass(frozen=True)
class Spec:
    depth: str = "tiny"  # "tiny" | "real"
    num_quantizers: int = 31
    codebook_size: int = 1024  # the published size (near-ties need many entries)
    control_inside: bool = True
    dtype: str = "bfloat16"  # "float32" | "bfloat16"
    bits: int | None = None
    predicate: str = "published"  # "published" | "mlx-vlm-default" | "mlx-vlm-runnable"
    sampling: str = "greedy"  # "greedy" | "shipped"
    seed: int = 0
    # MLX quantization mode: "affine" (the published one: scales + biases) or a scale-only
    # floating-point mode ("mxfp4", "mxfp8", "nvfp4": uint8 scales, no biases, group 32/32/16).
    mode: str = "affine"
    # Per-module settings in the config entry (a mixed-precision converter): the quantized
    # down projections get 8 bits with group 32 instead of the top-level bits / group size.
    mixed: bool = False

    def name(self) -> str:
        q = "dense" if self.bits is None else f"{self.bits}bit-{self.predicate}"
        if self.bits is not None and self.mode != "affine":
            q += f"-{self.mode}"
        if self.bits is not None and self.mixed:
            q += "-mixed"
        ctl = "ctl-in" if self.control_inside else "ctl-out"
        return f"{self.depth}-q{self.num_quantizers}x{self.codebook_size}-{ctl}-{self.dtype}-{q}-{self.sampling}"

    def with_(self, **kw) -> Spec:
        return replace(self, **kw)


# --------------------------------------------------------------------------- tokenizer


_WORDS = (
    "hello world how are you today the weather is fine thank you very much what time is it "
    "please tell me a story about a small cat and a big dog who lived in a house near the river "
    "voice chat model speech audio text question answer assistant user good morning evening"
)


def build_tokenizer(vocab_size: int):
    """A byte-level BPE tokenizer trained on a small corpus, with the spec's special ids:
    <unk>=0, <s>=1, </s>=2, <SPECIAL_3>..<SPECIAL_15> (11 = silence, 12 = pad)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    specials = ["<unk>", "<s>", "</s>"] + [f"<SPECIAL_{i}>" for i in range(3, 16)]
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=specials,
        min_frequency=1,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    rng = np.random.default_rng(1234)
    words = _WORDS.split()
    corpus = [" ".join(rng.choice(words, size=12)) for _ in range(400)]
    corpus += [
        "".join(rng.choice(list("abcdefghijklmnopqrstuvwxyz"), size=int(rng.integers(2, 9)))) for _ in range(3000)
    ]
    tok.train_from_iterator(corpus, trainer=trainer)
    have = tok.get_vocab_size(with_added_tokens=True)
    if have < vocab_size:  # fill up to the embedding size with plain added words
        tok.add_tokens([f"filler{i:04d}" for i in range(vocab_size - have)])
    vocab = tok.get_vocab(with_added_tokens=True)
    assert len(vocab) == vocab_size, (len(vocab), vocab_size)
    assert [vocab[s] for s in specials] == list(range(len(specials)))
    assert sum(1 for t in vocab if len(t) == 1) == 256  # the byte-level alphabet: char_vocab_size 257
    return tok


# --------------------------------------------------------------------------- config


def _rnnt_pieces(n: int) -> list[str]:
    pieces = ["<unk>", "<en-US>"]
    letters = "etaoinshrdlucmfwyp"
    for a in letters:
        for p in ("▁" + a, a):
            if len(pieces) < n:
                pieces.append(p)
    i = 0
    while len(pieces) < n:
        pieces.append("▁" + letters[i % len(letters)] + letters[(i // len(letters)) % len(letters)])
        i += 1
    return pieces


def config_dict(spec: Spec) -> dict:
    real = spec.depth == "real"
    text = {
        "model_type": "nemotron_h",
        "vocab_size": 512,
        "hidden_size": 128,
        "intermediate_size": 256,
        "num_hidden_layers": len(REAL_PATTERN if real else TINY_PATTERN),
        "max_position_embeddings": 8192,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 32,
        "attention_bias": False,
        "mamba_num_heads": 8,
        "mamba_head_dim": 16,
        "mamba_proj_bias": False,
        "ssm_state_size": 32,
        "conv_kernel": 4,
        "n_groups": 2,
        "mlp_bias": False,
        "layer_norm_epsilon": 1e-5,
        "use_bias": False,
        "use_conv_bias": True,
        "hybrid_override_pattern": REAL_PATTERN if real else TINY_PATTERN,
        "time_step_limit": [0.0, math.inf],
    }
    rnnt_vocab = 32
    audio = {
        "preprocessor": {
            "sample_rate": 16000,
            "features": 116,
            "n_fft": 512,
            "window_size": 0.025,
            "window_stride": 0.01,
            "window": "hann",
            "normalize": "NA",
            "pad_to": 0,
            "dither": 1e-5,
            "log": True,
            "_target_removed": True,
        },
        "encoder": {
            "feat_in": 116,
            "n_layers": 24 if real else 2,
            "d_model": 64,
            "n_heads": 4,
            "ff_expansion_factor": 4,
            "subsampling_factor": 8,
            "subsampling_conv_channels": 8,
            "conv_kernel_size": 9,
            "causal_downsampling": True,
            "conv_context_size": [8, 0],
            "conv_norm_type": "layer_norm",
            "self_attention_model": "rel_pos",
            "att_context_style": "chunked_limited",
            "att_context_size": [70, 0],
            "pos_emb_max_len": 5000,
            "use_bias": False,
            "xscaling": False,
            "subsampling": "dw_striding",
        },
        "decoder": {"pred_hidden": 64, "pred_rnn_layers": 2, "vocab_size": rnnt_vocab, "blank_as_pad": True},
        "joint": {
            "joint_hidden": 64,
            "activation": "relu",
            "encoder_hidden": 64,
            "pred_hidden": 64,
            "num_classes": rnnt_vocab,
        },
        "output_dim": text["hidden_size"],
        "max_symbols": 10,
    }
    greedy = spec.sampling == "greedy"
    tts = {
        # 128: a width whose square root (the char embedding scale) is not an integer.
        "hidden_size": 128,
        "intermediate_size": 256,
        "num_hidden_layers": 28 if real else 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 4,
        "head_dim": 32,
        "sliding_window": 16,
        "latent_size": 64,
        "num_quantizers": spec.num_quantizers,
        "codebook_size": spec.codebook_size,
        "num_delay_speech_tokens": 2,
        "exponent": 3.0,
        "disable_eos_prediction": True,
        "use_gated_fusion_for_text_audio": True,
        "use_subword_flag_emb": True,
        "use_bos_eos_emb": True,
        "use_audio_prompt_frozen_projection": True,
        "guidance_scale": 0.2,
        "top_p": 1e-6 if greedy else 0.95,
        "noise_scale": 0.0 if greedy else 0.001,
        "audio_prompt_duration": 3.0,
        "character_encoder": {
            "hidden_size": 128,
            "intermediate_size": 256,
            "num_hidden_layers": 1,
            "num_attention_heads": 4,
            "num_key_value_heads": 4,
            "head_dim": 32,
            "rms_norm_eps": 1e-6,
            "query_pre_attn_scalar": 256,
            "attn_logit_softcapping": 50.0,
            "rope_base": 10000,
            "char_vocab_size": 257,
        },
        "mog_head": {
            "intermediate_size": 256,
            "low_rank": 8,
            "min_log_std": -4.0,
            "num_layers": 3 if real else 2,
            "num_predictions": 64,
            "eps": 1e-6,
        },
    }
    if not real:
        tts["sliding_window_pattern"] = 2  # layer 0 sliding, layer 1 global
    codec = {
        "sample_rate": 22050,
        "base_channels": 16,
        "channel_multipliers": [1, 2, 4] if real else [1, 2],
        "downsample_rates": [7, 7, 9] if real else [2, 3],
        "blocks_per_stage": 3 if real else 2,
        "block_kernel_size": 7 if real else 3,
        "latent_dim": 64,
        "n_fft": 16,
        "hop_length": 4,
        "num_quantizers": spec.num_quantizers,
        "codebook_size": spec.codebook_size,
    }
    cfg = {
        "model_type": "nemotron_voicechat",
        "architectures": ["NemotronVoiceChatForConditionalGeneration"],
        "text_config": text,
        "audio_config": audio,
        "tts_config": tts,
        "codec_config": codec,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "pad_token_id": 12,
        "silence_token_id": 11,
        "rnnt_blank_id": rnnt_vocab,
        "input_sample_rate": 16000,
        "output_sample_rate": 22050,
        "frame_duration": 0.08,
        "function_channel_weight": 2.0,
        "speaker": "Aria",
        "rnnt_vocabulary": _rnnt_pieces(rnnt_vocab),
        "source_revision": "independent-writer",
        "base_tokenizer_revision": "independent-writer",
    }
    if spec.bits is not None:
        q = {"group_size": group_size(spec), "bits": spec.bits}
        if spec.mode != "affine":
            q["mode"] = spec.mode
        cfg["quantization"] = q
        cfg["quantization_config"] = dict(q)
    return cfg


_MODE_GROUP = {"affine": GROUP_SIZE, "mxfp4": 32, "mxfp8": 32, "nvfp4": 16}
MIXED_SETTINGS = {"group_size": 32, "bits": 8}


def group_size(spec: Spec) -> int:
    return _MODE_GROUP[spec.mode]


def module_settings(spec: Spec, module: str) -> dict:
    """(group_size, bits) a quantized module is packed with."""
    if spec.mixed and module.endswith("down_proj"):
        return dict(MIXED_SETTINGS)
    return {"group_size": group_size(spec), "bits": spec.bits}


# --------------------------------------------------------------------------- tensor inventory


def inventory(cfg: dict) -> list[tuple[str, tuple, str]]:
    """(raw name, raw shape, kind) for every stored tensor (docs/model.md §2.3 in raw layout).

    kinds: linear, embed, head (language heads), out (residual output projections), norm1 (w ~ 1),
    norm0 ("1 + w" norms, w ~ 0), bias, conv, lstm, a_log, dt_bias, d, vec (plain vectors),
    int (buffers), fixed (preprocessor buffers)."""
    t, a, s, c = cfg["text_config"], cfg["audio_config"], cfg["tts_config"], cfg["codec_config"]
    out: list[tuple[str, tuple, str]] = []

    def add(name, shape, kind):
        out.append((name, tuple(int(x) for x in shape), kind))

    # ---- language model
    H, V = t["hidden_size"], t["vocab_size"]
    add("stt_model.embed_tokens.weight", (V, H), "embed")
    add("stt_model.lm_head.weight", (V, H), "head")
    add("stt_model.function_head.weight", (V, H), "head")
    add("stt_model.llm.norm_f.weight", (H,), "norm1")
    d_inner = t["mamba_num_heads"] * t["mamba_head_dim"]
    gs = t["n_groups"] * t["ssm_state_size"]
    conv_dim = d_inner + 2 * gs
    for i, kind in enumerate(t["hybrid_override_pattern"]):
        p = f"stt_model.llm.layers.{i}."
        add(p + "norm.weight", (H,), "norm1")
        if kind == "M":
            add(p + "mixer.in_proj.weight", (2 * d_inner + 2 * gs + t["mamba_num_heads"], H), "linear")
            add(p + "mixer.conv1d.weight", (conv_dim, 1, t["conv_kernel"]), "conv")
            add(p + "mixer.conv1d.bias", (conv_dim,), "bias")
            add(p + "mixer.dt_bias", (t["mamba_num_heads"],), "dt_bias")
            add(p + "mixer.A_log", (t["mamba_num_heads"],), "a_log")
            add(p + "mixer.D", (t["mamba_num_heads"],), "d")
            add(p + "mixer.norm.weight", (d_inner,), "norm1")
            add(p + "mixer.out_proj.weight", (H, d_inner), "out")
        elif kind == "-":
            add(p + "mixer.up_proj.weight", (t["intermediate_size"], H), "linear")
            add(p + "mixer.down_proj.weight", (H, t["intermediate_size"]), "out")
        elif kind == "*":
            q, kv = t["num_attention_heads"] * t["head_dim"], t["num_key_value_heads"] * t["head_dim"]
            add(p + "mixer.q_proj.weight", (q, H), "linear")
            add(p + "mixer.k_proj.weight", (kv, H), "linear")
            add(p + "mixer.v_proj.weight", (kv, H), "linear")
            add(p + "mixer.o_proj.weight", (H, q), "out")
        else:
            raise ValueError(kind)

    # ---- perception
    pre, enc = a["preprocessor"], a["encoder"]
    win = int(round(pre["window_size"] * pre["sample_rate"]))
    add("stt_model.perception.preprocessor.featurizer.fb", (1, pre["features"], pre["n_fft"] // 2 + 1), "fixed")
    add("stt_model.perception.preprocessor.featurizer.window", (win,), "fixed")
    ch, d = enc["subsampling_conv_channels"], enc["d_model"]
    e = "stt_model.perception.encoder."
    add(e + "pre_encode.conv.0.weight", (ch, 1, 3, 3), "conv")
    add(e + "pre_encode.conv.0.bias", (ch,), "bias")
    for j in (2, 5):
        add(e + f"pre_encode.conv.{j}.weight", (ch, 1, 3, 3), "conv")
        add(e + f"pre_encode.conv.{j}.bias", (ch,), "bias")
        add(e + f"pre_encode.conv.{j + 1}.weight", (ch, ch, 1, 1), "conv")
        add(e + f"pre_encode.conv.{j + 1}.bias", (ch,), "bias")
    freq = enc["feat_in"]
    for _ in range(3):
        freq = freq // 2 + 1  # kernel 3, stride 2, causal padding 2 + 1 (§5.1): 116 -> 59 -> 30 -> 16
    add(e + "pre_encode.out.weight", (d, ch * freq), "linear")
    add(e + "pre_encode.out.bias", (d,), "bias")
    ff = d * enc["ff_expansion_factor"]
    for i in range(enc["n_layers"]):
        p = e + f"layers.{i}."
        for n in ("norm_feed_forward1", "norm_self_att", "norm_conv", "norm_feed_forward2", "norm_out"):
            add(p + n + ".weight", (d,), "norm1")
            add(p + n + ".bias", (d,), "bias")
        for f in ("feed_forward1", "feed_forward2"):
            add(p + f + ".linear1.weight", (ff, d), "linear")
            add(p + f + ".linear2.weight", (d, ff), "out")
        for n in ("linear_q", "linear_k", "linear_v", "linear_pos"):
            add(p + f"self_attn.{n}.weight", (d, d), "linear")
        add(p + "self_attn.linear_out.weight", (d, d), "out")
        add(p + "self_attn.pos_bias_u", (enc["n_heads"], d // enc["n_heads"]), "vec")
        add(p + "self_attn.pos_bias_v", (enc["n_heads"], d // enc["n_heads"]), "vec")
        add(p + "conv.pointwise_conv1.weight", (2 * d, d, 1), "conv")
        add(p + "conv.depthwise_conv.weight", (d, 1, enc["conv_kernel_size"]), "conv")
        add(p + "conv.batch_norm.weight", (d,), "norm1")
        add(p + "conv.batch_norm.bias", (d,), "bias")
        add(p + "conv.pointwise_conv2.weight", (d, d, 1), "conv")
    add("stt_model.perception.proj.weight", (a["output_dim"], d), "linear")
    add("stt_model.perception.proj.bias", (a["output_dim"],), "bias")

    # ---- RNNT
    P, J, R = a["decoder"]["pred_hidden"], a["joint"]["joint_hidden"], a["decoder"]["vocab_size"]
    add("stt_model.rnnt_decoder.prediction.embed.weight", (R + 1, P), "embed")
    for k in range(a["decoder"]["pred_rnn_layers"]):
        lstm = "stt_model.rnnt_decoder.prediction.dec_rnn.lstm."
        add(lstm + f"weight_ih_l{k}", (4 * P, P), "lstm")
        add(lstm + f"weight_hh_l{k}", (4 * P, P), "lstm")
        add(lstm + f"bias_ih_l{k}", (4 * P,), "bias")
        add(lstm + f"bias_hh_l{k}", (4 * P,), "bias")
    add("stt_model.rnnt_joint.enc.weight", (J, a["joint"]["encoder_hidden"]), "linear")
    add("stt_model.rnnt_joint.enc.bias", (J,), "bias")
    add("stt_model.rnnt_joint.pred.weight", (J, P), "linear")
    add("stt_model.rnnt_joint.pred.bias", (J,), "bias")
    add("stt_model.rnnt_joint.joint_net.2.weight", (R + 1, J), "linear")
    add("stt_model.rnnt_joint.joint_net.2.bias", (R + 1,), "bias")

    # ---- EAR-TTS
    Ht, L = s["hidden_size"], s["latent_size"]  # the backbone's MLP widths come from each block's config
    Q, C = s["num_quantizers"], s["codebook_size"]
    tp = "tts_model.tts_model."

    def attention_mlp(p, cfg_, norms, qk_norm):
        hd, nh, nkv = cfg_["head_dim"], cfg_["num_attention_heads"], cfg_["num_key_value_heads"]
        h, inter = cfg_["hidden_size"], cfg_["intermediate_size"]
        add(p + "self_attn.q_proj.weight", (nh * hd, h), "linear")
        add(p + "self_attn.k_proj.weight", (nkv * hd, h), "linear")
        add(p + "self_attn.v_proj.weight", (nkv * hd, h), "linear")
        add(p + "self_attn.o_proj.weight", (h, nh * hd), "out")
        if qk_norm:
            add(p + "self_attn.q_norm.weight", (hd,), "norm0")
            add(p + "self_attn.k_norm.weight", (hd,), "norm0")
        add(p + "mlp.gate_proj.weight", (inter, h), "linear")
        add(p + "mlp.up_proj.weight", (inter, h), "linear")
        add(p + "mlp.down_proj.weight", (h, inter), "out")
        for n in norms:
            add(p + n + ".weight", (h,), "norm0")

    for i in range(s["num_hidden_layers"]):
        attention_mlp(
            tp + f"backbone.layers.{i}.",
            s,
            ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm", "post_feedforward_layernorm"),
            qk_norm=True,
        )
    add(tp + "backbone.norm.weight", (Ht,), "norm0")
    add(tp + "bos_emb", (Ht,), "vec")
    add(tp + "null_emb", (Ht,), "vec")
    add(tp + "embed_code.weight", (Ht, L), "linear")
    add(tp + "audio_prompt_projection_W", (Ht, Ht), "linear")
    add(tp + "rvq_embs", (Q, C, L), "codebook")
    g = tp + "gated_fusion_audio_text."
    add(g + "audio_proj.weight", (Ht, Ht), "linear")
    add(g + "audio_proj.bias", (Ht,), "bias")
    add(g + "text_proj.weight", (Ht, Ht), "linear")
    add(g + "text_proj.bias", (Ht,), "bias")
    add(g + "gate", (Ht,), "vec")
    add(g + "residual_scale", (), "vec")
    add(g + "final_norm.weight", (Ht,), "norm0")
    ce = s["character_encoder"]
    w = tp + "embed_subword."
    add(w + "embed_tokens.weight", (ce["char_vocab_size"], ce["hidden_size"]), "embed")
    add(w + "proj_embedding.weight", (Ht, ce["hidden_size"]), "linear")
    for i in range(ce["num_hidden_layers"]):
        attention_mlp(
            w + f"backbone.encoder.layers.{i}.",
            ce,
            (
                "pre_self_attn_layernorm",
                "post_self_attn_layernorm",
                "pre_feedforward_layernorm",
                "post_feedforward_layernorm",
            ),
            qk_norm=False,
        )
    add(w + "backbone.encoder.norm.weight", (ce["hidden_size"],), "norm0")
    add(w + "subword_flag_emb.is_continuation", (FLAG_TABLE + 1,), "int")
    add(w + "subword_flag_emb.pad_tensor", (), "int")
    add(w + "subword_flag_emb.cont_emb.weight", (2, ce["hidden_size"]), "embed")
    add(w + "bos_eos_emb.special_flags", (FLAG_TABLE,), "int")
    add(w + "bos_eos_emb.pad_tensor", (), "int")
    add(w + "bos_eos_emb.special_emb.weight", (3, ce["hidden_size"]), "embed")
    m = s["mog_head"]
    mh = tp + "mog_head."
    for j in range(m["num_layers"]):
        add(mh + f"mlp_stack.{j}.pre_norm.weight", (Ht,), "norm0")
        add(mh + f"mlp_stack.{j}.post_norm.weight", (Ht,), "norm0")
        add(mh + f"mlp_stack.{j}.mlp.gate_proj.weight", (m["intermediate_size"], Ht), "linear")
        add(mh + f"mlp_stack.{j}.mlp.up_proj.weight", (m["intermediate_size"], Ht), "linear")
        add(mh + f"mlp_stack.{j}.mlp.down_proj.weight", (Ht, m["intermediate_size"]), "out")
    add(mh + f"mlp_stack.{m['num_layers']}.weight", (Ht,), "norm0")
    add(mh + "proj_logits.weight", (m["num_predictions"], Ht), "head")
    add(mh + "proj_mus.weight", (m["num_predictions"] * m["low_rank"], Ht), "linear")
    add(mh + "proj_logs.weight", (1, Ht), "linear")
    add(mh + "proj_else.weight", (L, Ht), "linear")
    add(mh + "low_mat", (m["num_predictions"], L, m["low_rank"]), "lowmat")
    add("tts_model._control_codes", (3,), "int")
    add("tts_model.codec_silence_tokens", (Q,), "int")
    add("tts_model.audio_prompt_latents.Aria", (1, SPEAKER_FRAMES, Ht), "vec")

    # ---- codec (raw layouts: Conv1d (O, I, K), ConvTranspose1d (I, O, K))
    cp = "tts_model.audio_codec."
    chans = [c["base_channels"] * mlt for mlt in c["channel_multipliers"]]
    stft = 2 * (c["n_fft"] // 2 + 1)
    k, b = c["block_kernel_size"], c["blocks_per_stage"]

    def convnext(p, C_):
        add(p + "dwconv.weight", (C_, 1, k), "conv")
        add(p + "dwconv.bias", (C_,), "bias")
        add(p + "norm.weight", (C_,), "norm1")
        add(p + "norm.bias", (C_,), "bias")
        add(p + "pwconv1.weight", (4 * C_, C_, 1), "conv")
        add(p + "pwconv1.bias", (4 * C_,), "bias")
        add(p + "pwconv2.weight", (C_, 4 * C_, 1), "conv")
        add(p + "pwconv2.bias", (C_,), "bias")

    n = 0
    add(cp + f"encoder.layers.{n}.weight", (chans[0], stft, 1), "conv")
    n += 1
    for si, (ch_, rate) in enumerate(zip(chans, c["downsample_rates"], strict=True)):
        for _ in range(b):
            convnext(cp + f"encoder.layers.{n}.", ch_)
            n += 1
        nxt = chans[si + 1] if si + 1 < len(chans) else c["latent_dim"]
        add(cp + f"encoder.layers.{n}.weight", (nxt, ch_, rate), "conv")
        n += 1
    n, src = 0, c["latent_dim"]
    for ch_, rate in zip(reversed(chans), reversed(c["downsample_rates"]), strict=True):
        add(cp + f"decoder.layers.{n}.weight", (src, ch_, rate), "convt")
        n += 1
        for _ in range(b):
            convnext(cp + f"decoder.layers.{n}.", ch_)
            n += 1
        src = ch_
    add(cp + f"decoder.layers.{n}.weight", (stft, chans[0], 1), "conv")
    for q in range(c["num_quantizers"]):
        add(cp + f"prvq.mus_list.{q}", (c["codebook_size"], c["latent_dim"]), "codebook1")
        add(cp + f"prvq._variance_list.{q}.variance", (), "one")
    return out


# --------------------------------------------------------------------------- values


def _rng(seed: int, name: str) -> np.random.Generator:
    return np.random.default_rng([seed, zlib.crc32(name.encode())])


# Trained RVQ codebooks: each stage quantizes what the stages before it left, so the spread of
# codebook q shrinks with q. With 1024 entries the two nearest entries of a residual are often
# closer than bf16's rounding of the squared norms ‖m_j‖², so late codebooks have near-ties that
# rounding decides (docs/model.md §9.3): the class of the published bf16 codebooks.
RVQ_SCALE0, RVQ_DECAY = 0.5, 0.93


def _rvq_codebook(seed: int, q: int, shape: tuple) -> np.ndarray:
    """Codebook q of the greedy RVQ; EAR-TTS's `rvq_embs[q]` holds the same values (the TTS
    quantizes in the codec's latent space; whether the published files share them is open)."""
    return _rng(seed, f"rvq.codebook.{q}").standard_normal(shape) * (RVQ_SCALE0 * RVQ_DECAY**q)


def _value(name: str, shape: tuple, kind: str, spec: Spec, cfg: dict, tok_vocab: dict) -> np.ndarray:
    r = _rng(spec.seed, name)
    fan_in = int(np.prod(shape[1:])) if len(shape) > 1 else 1
    if kind in ("linear", "head"):
        return r.standard_normal(shape) / math.sqrt(shape[-1])
    if kind == "out":
        return 0.5 * r.standard_normal(shape) / math.sqrt(shape[-1])
    if kind == "embed":
        return r.standard_normal(shape)
    if kind == "norm1":
        return 1.0 + 0.1 * r.standard_normal(shape)
    if kind == "norm0":
        return 0.1 * r.standard_normal(shape)
    if kind == "bias":
        return 0.1 * r.standard_normal(shape)
    if kind in ("conv", "convt", "lstm"):
        if kind == "convt":
            fan_in = shape[0] * shape[2]
        bound = 1.0 / math.sqrt(max(fan_in, 1))
        return r.uniform(-bound, bound, shape) * (math.sqrt(3.0) if kind == "conv" else 1.0)
    if kind == "a_log":
        return np.log(r.uniform(1.0, 16.0, shape))
    if kind == "dt_bias":
        dt = np.exp(r.uniform(np.log(1e-3), np.log(1e-1), shape))
        return dt + np.log(-np.expm1(-dt))  # inverse softplus
    if kind == "d":
        return 1.0 + 0.1 * r.standard_normal(shape)
    if kind == "vec":
        return r.standard_normal(shape)
    if kind == "lowmat":
        return r.standard_normal(shape) / math.sqrt(shape[-1])
    if kind == "codebook1":  # codec `prvq.mus_list.{q}` (C, L)
        return _rvq_codebook(spec.seed, int(name.rsplit(".", 1)[1]), shape)
    if kind == "codebook":  # EAR-TTS `rvq_embs` (Q, C, L): the codec's codebooks (see _rvq_codebook)
        return np.stack([_rvq_codebook(spec.seed, q, shape[1:]) for q in range(shape[0])])
    if kind == "one":
        return np.ones(shape)
    if kind == "fixed":
        if name.endswith(".window"):
            return np.hanning(shape[0] + 1)[:-1]
        return np.abs(r.standard_normal(shape)) * 0.01
    if kind == "int":
        s = cfg["tts_config"]
        C, Q = s["codebook_size"], s["num_quantizers"]
        if name.endswith("_control_codes"):
            base = C - 3 if spec.control_inside else C
            return np.arange(base, base + 3)
        if name.endswith("codec_silence_tokens"):
            return r.integers(0, C - 3, size=Q)  # a real code row, never a control code
        if name.endswith("subword_flag_emb.pad_tensor"):
            return np.array(FLAG_TABLE)
        if name.endswith("bos_eos_emb.pad_tensor"):
            return np.array(FLAG_TABLE - 1)
        if name.endswith("is_continuation"):
            table = np.zeros(shape)
            for t, i in tok_vocab.items():
                if t and not t.startswith(("Ġ", "<")):
                    table[i] = 1
            return table
        if name.endswith("special_flags"):
            table = np.zeros(shape)
            table[cfg["bos_token_id"]], table[cfg["eos_token_id"]] = 1, 2
            return table
    raise ValueError(f"{name}: no value rule for kind {kind!r}")


def quantized_names(entries, predicate: str) -> set[str]:
    """Module paths to quantize (names of the modules whose `.weight` is stored packed)."""
    linear_like = [
        n[: -len(".weight")]
        for n, shape, kind in entries
        if n.endswith(".weight") and len(shape) == 2 and kind in ("linear", "head", "out", "embed")
    ]
    if predicate == "published":
        lang = ("stt_model.llm.", "stt_model.embed_tokens", "stt_model.lm_head", "stt_model.function_head")
        return {p for p in linear_like if p.startswith(lang)}
    shapes = {n[: -len(".weight")]: shape for n, shape, _ in entries if n.endswith(".weight")}
    chosen = {p for p in linear_like if shapes[p][-1] % GROUP_SIZE == 0}  # also divisible by 32 and 16
    if predicate == "mlx-vlm-default":
        return chosen
    if predicate == "mlx-vlm-runnable":
        return {p for p in chosen if not p.endswith(("mog_head.proj_mus", "embed_subword.embed_tokens"))}
    raise ValueError(f"unknown predicate {predicate!r}")


def _dump_config(cfg: dict) -> str:
    # json writes float('inf') as the bare token Infinity, as the published converter did.
    text = json.dumps(cfg, indent=2, ensure_ascii=False)
    assert "Infinity" in text
    return text


def write(folder, spec: Spec, n_shards: int = 3) -> Path:
    """Write a checkpoint for `spec` into `folder`; returns the folder."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    cfg = config_dict(spec)
    tok = build_tokenizer(cfg["text_config"]["vocab_size"])
    vocab = tok.get_vocab(with_added_tokens=True)
    entries = inventory(cfg)
    quant = quantized_names(entries, spec.predicate) if spec.bits is not None else set()
    float_dtype = {"float32": mx.float32, "bfloat16": mx.bfloat16}[spec.dtype]
    tensors: dict[str, mx.array] = {}
    per_module: dict[str, dict] = {}
    for name, shape, kind in entries:
        v = _value(name, shape, kind, spec, cfg, vocab)
        if kind == "int":
            tensors[name] = mx.array(np.asarray(v, dtype=np.int64))
            continue
        a = mx.array(np.asarray(v, dtype=np.float32))
        module = name[: -len(".weight")] if name.endswith(".weight") else None
        if module in quant:
            settings = module_settings(spec, module)
            packed = mx.quantize(a, **settings, mode=spec.mode)
            tensors[name] = packed[0]
            tensors[module + ".scales"] = packed[1]  # affine: float32 (quantized from float32 masters)
            if len(packed) > 2:  # affine only; the fp modes store no biases
                tensors[module + ".biases"] = packed[2]
            if settings != {"group_size": group_size(spec), "bits": spec.bits}:
                per_module[module] = settings
        elif kind == "fixed":
            tensors[name] = a  # preprocessor buffers stay float32
        else:
            tensors[name] = a.astype(float_dtype)
    # Shards of roughly equal size + the HF index.
    names = sorted(tensors)
    total = sum(tensors[n].nbytes for n in names)
    shards: list[list[str]] = [[] for _ in range(n_shards)]
    acc = 0
    for n in names:
        shards[min(n_shards - 1, int(acc * n_shards / max(total, 1)))].append(n)
        acc += tensors[n].nbytes
    shards = [s for s in shards if s]
    weight_map = {}
    for i, group in enumerate(shards):
        fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        mx.save_safetensors(str(folder / fname), {n: tensors[n] for n in group}, metadata={"format": "mlx"})
        weight_map.update(dict.fromkeys(group, fname))
    (folder / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}, indent=2)
    )
    if per_module:  # the converter copies per-module settings as top-level keys (§3.3)
        for key in ("quantization", "quantization_config"):
            cfg[key].update(per_module)
    (folder / "config.json").write_text(_dump_config(cfg))
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
                "model_max_length": 131072,
            },
            indent=2,
        )
    )
    (folder / "special_tokens_map.json").write_text(
        json.dumps(
            {"bos_token": "<s>", "eos_token": "</s>", "pad_token": "<SPECIAL_12>", "unk_token": "<unk>"}, indent=2
        )
    )
    (folder / "README.md").write_text(f"Independent-writer test checkpoint {spec.name()} (random weights).\n")
    return folder


def quantized_modules_written(folder) -> set[str]:
    """The module paths whose `.scales` a written folder stores (read back from the index)."""
    index = json.loads((Path(folder) / "model.safetensors.index.json").read_text())
    return {k[: -len(".scales")] for k in index["weight_map"] if k.endswith(".scales")}


def main(argv=None) -> int:
    """`python -m parity_tests.independent_writer OUT [--depth real] [--bits 4] [--predicate P] ...`"""
    import argparse

    p = argparse.ArgumentParser(prog="python -m parity_tests.independent_writer", description=__doc__.split("\n")[0])
    p.add_argument("out")
    p.add_argument("--depth", choices=["tiny", "real"], default="tiny")
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="bfloat16")
    p.add_argument("--bits", type=int, choices=[4, 8], default=None)
    p.add_argument("--predicate", choices=["published", "mlx-vlm-default", "mlx-vlm-runnable"], default="published")
    p.add_argument("--sampling", choices=["greedy", "shipped"], default="greedy")
    p.add_argument("--control-outside", action="store_true", help="control codes outside the generated range")
    p.add_argument("--codebook-size", type=int, default=1024)
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args(argv)
    spec = Spec(
        depth=a.depth,
        dtype=a.dtype,
        bits=a.bits,
        predicate=a.predicate,
        sampling=a.sampling,
        control_inside=not a.control_outside,
        codebook_size=a.codebook_size,
        seed=a.seed,
    )
    print(write(a.out, spec), spec.name())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
