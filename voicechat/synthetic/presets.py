"""Model-size presets for synthetic checkpoints and tests.

* ``tiny``  - CI: every structural case (each Nemotron-H block type, GQA with
  fewer KV heads than query heads, more than one Mamba group, a sliding and a
  global TTS layer, more than one block per codec stage, a conformer attention
  window shorter than the test inputs) at widths that run a frame in
  milliseconds.
* ``small`` - CPU benchmarks: the real depth (56 LLM, 24 conformer, 28 TTS
  layers) and the real frame geometry (1280 samples in, 128 mel bins, 8x
  subsampling, 70-frame attention window, 31 RVQ codes of 1024, 1764 samples
  out), widths divided by about 8.
* ``small16`` - the real depth and frame geometry at widths divided by about 16,
  rounded to multiples of 64 where the quantized language path needs it (its
  Linear inputs), so the 4/8-bit checkpoints have the published layout: the
  language path quantized, bf16 elsewhere. Per-operation overhead weighs more
  here than at `small`.
* ``full``  - the published shapes (docs/model.md §1).
"""

from __future__ import annotations

import copy

from voicechat.model.config import VoiceChatConfig

PRESETS = ("tiny", "small", "small16", "full")

# Pieces of the inline RNNT vocabulary: specials first (skipped in text), then
# word-initial and continuation pieces.
_RNNT_SPECIALS = ["<unk>", "<en-US>"]
_RNNT_LETTERS = "abcdefghijklmnopqrstuvwxyz"


def rnnt_vocabulary(size: int) -> list[str]:
    pieces = list(_RNNT_SPECIALS)
    i = 0
    while len(pieces) < size:
        a = _RNNT_LETTERS[i % 26]
        b = _RNNT_LETTERS[(i // 26) % 26]
        cand = ["▁" + a, a, "▁" + a + b, a + b][(i // 676) % 4] if i >= 26 else ("▁" + a if i % 2 == 0 else a)
        if cand not in pieces:
            pieces.append(cand)
        i += 1
    return pieces[:size]


def _full_dict() -> dict:
    return {
        "model_type": "nemotron_voicechat",
        "architectures": ["NemotronVoiceChatForConditionalGeneration"],
        "mlx_runtime_config_version": 2,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "pad_token_id": 12,
        "silence_token_id": 11,
        "rnnt_blank_id": 1024,
        "input_sample_rate": 16000,
        "output_sample_rate": 22050,
        "frame_duration": 0.08,
        "function_channel_weight": 2.0,
        "speaker": "Aria",
        "rnnt_vocabulary": rnnt_vocabulary(1024),
        "text_config": {
            "model_type": "nemotron_h",
            "vocab_size": 131072,
            "hidden_size": 4480,
            "intermediate_size": 15680,
            "num_hidden_layers": 56,
            "max_position_embeddings": 131072,
            "num_attention_heads": 40,
            "num_key_value_heads": 8,
            "head_dim": 128,
            "attention_bias": False,
            "mamba_num_heads": 128,
            "mamba_head_dim": 80,
            "mamba_proj_bias": False,
            "ssm_state_size": 128,
            "conv_kernel": 4,
            "n_groups": 8,
            "mlp_bias": False,
            "layer_norm_epsilon": 1e-5,
            "use_bias": False,
            "use_conv_bias": True,
            "hybrid_override_pattern": "M-M-M-MM-M-M-M*-M-M-M*-M-M-M-M*-M-M-M-M*-M-MM-M-M-M-M-M-",
            "time_step_limit": [0.0, float("inf")],
        },
        "audio_config": {
            "preprocessor": {
                "sample_rate": 16000,
                "features": 128,
                "n_fft": 512,
                "window_size": 0.025,
                "window_stride": 0.01,
                "window": "hann",
                "normalize": "NA",
                "pad_to": 0,
                "dither": 1e-5,
                "log": True,
            },
            "encoder": {
                "feat_in": 128,
                "n_layers": 24,
                "d_model": 1024,
                "n_heads": 8,
                "ff_expansion_factor": 4,
                "subsampling_factor": 8,
                "subsampling_conv_channels": 256,
                "conv_kernel_size": 9,
                "causal_downsampling": True,
                "conv_context_size": "causal",
                "conv_norm_type": "layer_norm",
                "self_attention_model": "rel_pos",
                "att_context_style": "chunked_limited",
                "att_context_size": [[70, 0]],
                "pos_emb_max_len": 5000,
                "use_bias": False,
                "xscaling": False,
                "subsampling": "dw_striding",
            },
            "decoder": {"pred_hidden": 640, "pred_rnn_layers": 2, "vocab_size": 1024, "blank_as_pad": True},
            "joint": {
                "joint_hidden": 640,
                "activation": "relu",
                "encoder_hidden": 1024,
                "pred_hidden": 640,
                "num_classes": 1024,
            },
            "output_dim": 4480,
            "max_symbols": 10,
        },
        "tts_config": {
            "hidden_size": 1152,
            "intermediate_size": 4608,
            "num_hidden_layers": 28,
            "num_attention_heads": 16,
            "num_key_value_heads": 16,
            "head_dim": 72,
            "sliding_window": 7500,
            "latent_size": 512,
            "num_quantizers": 31,
            "codebook_size": 1024,
            "num_delay_speech_tokens": 2,
            "exponent": 3.0,
            "disable_eos_prediction": True,
            "use_gated_fusion_for_text_audio": True,
            "use_subword_flag_emb": True,
            "use_bos_eos_emb": True,
            "use_audio_prompt_frozen_projection": True,
            "guidance_scale": 0.2,
            "top_p": 0.95,
            "noise_scale": 0.001,
            "audio_prompt_duration": 3.0,
            "character_encoder": {
                "hidden_size": 1152,
                "intermediate_size": 4608,
                "num_hidden_layers": 1,
                "num_attention_heads": 16,
                "num_key_value_heads": 16,
                "head_dim": 72,
                "rms_norm_eps": 1e-6,
                "query_pre_attn_scalar": 256,
                "attn_logit_softcapping": 50.0,
                "rope_base": 10000,
                "char_vocab_size": 257,
            },
            "mog_head": {
                "intermediate_size": 4608,
                "low_rank": 64,
                "min_log_std": -4.0,
                "num_layers": 3,
                "num_predictions": 1024,
                "eps": 1e-6,
            },
        },
        "codec_config": {
            "sample_rate": 22050,
            "base_channels": 384,
            "channel_multipliers": [1, 2, 4],
            "downsample_rates": [7, 7, 9],
            "blocks_per_stage": 3,
            "block_kernel_size": 7,
            "latent_dim": 512,
            "n_fft": 16,
            "hop_length": 4,
            "num_quantizers": 31,
            "codebook_size": 1024,
        },
    }


def _reduced_dict(
    *,
    rnnt_vocab: int,
    text: dict,
    d_model: int,
    subsampling_channels: int,
    pred_hidden: int,
    tts_hidden: int,
    tts_head_dim: int,
    latent: int,
    low_rank: int,
    codec_channels: int,
) -> dict:
    """The full config at the real depth and frame geometry with the given widths (`small`, `small16`)."""
    d = _full_dict()
    d["rnnt_blank_id"] = rnnt_vocab
    d["rnnt_vocabulary"] = rnnt_vocabulary(rnnt_vocab)
    d["text_config"].update(text)
    a = d["audio_config"]
    a["encoder"].update(d_model=d_model, n_heads=8, subsampling_conv_channels=subsampling_channels)
    a["decoder"].update(pred_hidden=pred_hidden, vocab_size=rnnt_vocab)
    a["joint"].update(joint_hidden=pred_hidden, encoder_hidden=d_model, pred_hidden=pred_hidden, num_classes=rnnt_vocab)
    a["output_dim"] = text["hidden_size"]
    tts = dict(
        hidden_size=tts_hidden,
        intermediate_size=4 * tts_hidden,
        num_attention_heads=4,
        num_key_value_heads=4,
        head_dim=tts_head_dim,
    )
    t = d["tts_config"]
    t.update(tts, latent_size=latent)
    t["character_encoder"].update(tts)
    t["mog_head"].update(intermediate_size=4 * tts_hidden, low_rank=low_rank)
    d["codec_config"].update(base_channels=codec_channels, latent_dim=latent)
    return d


def _small_dict() -> dict:
    return _reduced_dict(
        rnnt_vocab=256,
        text=dict(
            vocab_size=16384,
            hidden_size=576,
            intermediate_size=1920,
            num_attention_heads=10,
            num_key_value_heads=2,
            head_dim=64,
            mamba_num_heads=16,
            mamba_head_dim=40,
            ssm_state_size=64,
            n_groups=8,
        ),
        d_model=128,
        subsampling_channels=32,
        pred_hidden=80,
        tts_hidden=144,
        tts_head_dim=36,
        latent=64,
        low_rank=8,
        codec_channels=48,
    )


def _small16_dict() -> dict:
    return _reduced_dict(
        rnnt_vocab=64,
        text=dict(
            vocab_size=8192,
            hidden_size=320,
            intermediate_size=960,
            num_attention_heads=5,
            num_key_value_heads=1,
            head_dim=64,
            mamba_num_heads=8,
            mamba_head_dim=80,
            ssm_state_size=16,
            n_groups=8,
        ),
        d_model=64,
        subsampling_channels=16,
        pred_hidden=40,
        tts_hidden=72,
        tts_head_dim=18,
        latent=32,
        low_rank=4,
        codec_channels=24,
    )


def _tiny_dict() -> dict:
    d = _full_dict()
    d["rnnt_blank_id"] = 16
    d["rnnt_vocabulary"] = rnnt_vocabulary(16)
    d["text_config"].update(
        vocab_size=512,
        hidden_size=64,
        intermediate_size=128,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        mamba_num_heads=4,
        mamba_head_dim=16,
        ssm_state_size=32,
        n_groups=2,
        hybrid_override_pattern="M*-M",
        max_position_embeddings=4096,
    )
    a = d["audio_config"]
    a["preprocessor"].update(features=32)
    a["encoder"].update(
        feat_in=32,
        n_layers=2,
        d_model=64,
        n_heads=4,
        ff_expansion_factor=2,
        subsampling_conv_channels=8,
        att_context_size=[[8, 0]],
        pos_emb_max_len=512,
    )
    a["decoder"].update(pred_hidden=16, vocab_size=16)
    a["joint"].update(joint_hidden=16, encoder_hidden=64, pred_hidden=16, num_classes=16)
    a["output_dim"] = 64
    t = d["tts_config"]
    t.update(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        head_dim=16,
        sliding_window=8,
        sliding_window_pattern=2,
        latent_size=16,
        num_quantizers=6,
        codebook_size=32,
    )
    t["character_encoder"].update(
        hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=4, head_dim=16
    )
    t["mog_head"].update(intermediate_size=128, low_rank=4, num_layers=2, num_predictions=16)
    d["codec_config"].update(
        base_channels=8,
        channel_multipliers=[1, 2],
        downsample_rates=[2, 3],
        blocks_per_stage=2,
        block_kernel_size=3,
        latent_dim=16,
        num_quantizers=6,
        codebook_size=32,
    )
    return d


_BUILDERS = {"tiny": _tiny_dict, "small": _small_dict, "small16": _small16_dict, "full": _full_dict}


def preset_dict(name: str) -> dict:
    """The config.json contents of a preset (a fresh copy)."""
    if name not in _BUILDERS:
        raise ValueError(f"unknown preset {name!r}; expected one of {', '.join(PRESETS)}")
    return copy.deepcopy(_BUILDERS[name]())


def preset_config(name: str) -> VoiceChatConfig:
    return VoiceChatConfig.from_dict(preset_dict(name))
