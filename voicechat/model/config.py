"""Runtime configuration (`config.json`) of a VoiceChat checkpoint.

One dataclass per section, defaults as docs/model.md §1 lists them. Unknown
keys are ignored (the published config carries NeMo keys MLX never reads);
a config that cannot describe a working model raises `ConfigError` naming
the offending key.
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from voicechat.errors import ConfigError

LAYER_TYPES = {"M": "mamba", "-": "mlp", "*": "attention"}

DEFAULT_PATTERN = "M-M-M-MM-M-M-M*-M-M-M*-M-M-M-M*-M-M-M-M*-M-MM-M-M-M-M-M-"


def _from_dict(cls, data: dict | None, where: str):
    """Build dataclass `cls` from `data`, keeping only the keys it knows."""
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(f"{where}: expected a JSON object, got {type(data).__name__}")
    names = {f.name for f in dataclasses.fields(cls)}
    return cls(**{k: v for k, v in data.items() if k in names})


def _to_dict(obj) -> dict:
    out = {}
    for f in dataclasses.fields(obj):
        v = getattr(obj, f.name)
        if dataclasses.is_dataclass(v):
            v = _to_dict(v)
        elif isinstance(v, tuple):
            v = list(v)
        out[f.name] = v
    return out


# --------------------------------------------------------------------------- text


@dataclass
class TextConfig:
    """Nemotron-H (docs/model.md §1.3, §7)."""

    model_type: str = "nemotron_h"
    vocab_size: int = 131072
    hidden_size: int = 4480
    intermediate_size: int = 15680
    num_hidden_layers: int = 56
    max_position_embeddings: int = 131072
    num_attention_heads: int = 40
    num_key_value_heads: int = 8
    head_dim: int = 128
    attention_bias: bool = False
    mamba_num_heads: int = 128
    mamba_head_dim: int = 80
    mamba_proj_bias: bool = False
    ssm_state_size: int = 128
    conv_kernel: int = 4
    n_groups: int = 8
    mlp_bias: bool = False
    layer_norm_epsilon: float = 1e-5
    use_bias: bool = False
    use_conv_bias: bool = True
    hybrid_override_pattern: str = DEFAULT_PATTERN
    time_step_limit: Any = (0.0, math.inf)

    def __post_init__(self):
        if self.model_type != "nemotron_h":
            raise ConfigError(f"text_config.model_type: expected 'nemotron_h', got {self.model_type!r}")
        bad = sorted({c for c in self.hybrid_override_pattern if c not in LAYER_TYPES})
        if bad or not self.hybrid_override_pattern:
            raise ConfigError(
                "text_config.hybrid_override_pattern: unknown layer letter(s) "
                f"{bad} in {self.hybrid_override_pattern!r}; expected only "
                "'M' (Mamba-2), '-' (MLP) and '*' (attention)"
            )
        # The reference overrides the layer count with the pattern length.
        self.num_hidden_layers = len(self.hybrid_override_pattern)
        if self.time_step_limit is None:
            self.time_step_limit = (0.0, math.inf)
        lim = tuple(float(x) for x in self.time_step_limit)
        if len(lim) != 2:
            raise ConfigError(f"text_config.time_step_limit: expected [min, max], got {self.time_step_limit!r}")
        self.time_step_limit = lim
        if self.num_attention_heads % self.num_key_value_heads:
            raise ConfigError(
                "text_config.num_key_value_heads: must divide num_attention_heads "
                f"({self.num_attention_heads} % {self.num_key_value_heads} != 0)"
            )
        if self.mamba_num_heads % self.n_groups:
            raise ConfigError(
                f"text_config.n_groups: must divide mamba_num_heads ({self.mamba_num_heads} % {self.n_groups} != 0)"
            )

    @property
    def layer_types(self) -> list[str]:
        return [LAYER_TYPES[c] for c in self.hybrid_override_pattern]

    @property
    def mamba_d_inner(self) -> int:
        return self.mamba_num_heads * self.mamba_head_dim

    @property
    def mamba_conv_dim(self) -> int:
        return self.mamba_d_inner + 2 * self.n_groups * self.ssm_state_size

    @property
    def mamba_in_proj_dim(self) -> int:
        return 2 * self.mamba_d_inner + 2 * self.n_groups * self.ssm_state_size + self.mamba_num_heads


# --------------------------------------------------------------------------- audio


@dataclass
class PreprocessorConfig:
    """Log-mel frontend (docs/model.md §1.4, §4)."""

    sample_rate: int = 16000
    features: int = 128
    n_fft: int = 512
    window_size: float = 0.025
    window_stride: float = 0.01
    window: str = "hann"
    preemph: float = 0.97
    dither: float = 1e-5
    normalize: str = "NA"
    log_zero_guard_value: float = 2.0**-24
    pad_to: int = 0
    pad_value: float = 0.0
    pad_mode: str = "reflect"

    def __post_init__(self):
        if self.normalize != "NA":
            raise ConfigError(f"audio_config.preprocessor.normalize: only 'NA' streams; got {self.normalize!r}")
        if self.pad_to not in (0, None):
            raise ConfigError(f"audio_config.preprocessor.pad_to: only 0 streams; got {self.pad_to!r}")
        if self.window != "hann":
            raise ConfigError(f"audio_config.preprocessor.window: only 'hann' is supported; got {self.window!r}")
        if self.pad_mode not in ("reflect", "constant"):
            raise ConfigError(
                f"audio_config.preprocessor.pad_mode: expected 'reflect' or 'constant'; got {self.pad_mode!r}"
            )

    @property
    def win_length(self) -> int:
        return int(self.window_size * self.sample_rate)

    @property
    def hop_length(self) -> int:
        return int(self.window_stride * self.sample_rate)


@dataclass
class EncoderConfig:
    """FastConformer (docs/model.md §1.4, §5)."""

    feat_in: int = 128
    n_layers: int = 24
    d_model: int = 1024
    n_heads: int = 8
    ff_expansion_factor: int = 4
    subsampling_factor: int = 8
    subsampling_conv_channels: int = 256
    conv_kernel_size: int = 9
    causal_downsampling: bool = True
    conv_context_size: Any = "causal"
    conv_norm_type: str = "layer_norm"
    self_attention_model: str = "rel_pos"
    att_context_style: str = "chunked_limited"
    att_context_size: Any = ((70, 0),)
    pos_emb_max_len: int = 5000
    use_bias: bool = False
    xscaling: bool = False

    def __post_init__(self):
        acs = self.att_context_size
        if acs and not isinstance(acs[0], (list, tuple)):
            acs = [acs]  # the loader also accepts the flat form [70, 0]
        try:
            self.att_context_size = tuple((int(a), int(b)) for a, b in acs)
        except (TypeError, ValueError):
            raise ConfigError(
                f"audio_config.encoder.att_context_size: expected [[left, right]], got {self.att_context_size!r}"
            ) from None
        if self.att_context_size[0][1] != 0:
            raise ConfigError(
                "audio_config.encoder.att_context_size: right context must be 0 for "
                f"cache-aware streaming, got {self.att_context_size[0]!r}"
            )
        k = self.conv_kernel_size
        if self.conv_context_size not in ("causal", [k - 1, 0], (k - 1, 0)):
            raise ConfigError(
                "audio_config.encoder.conv_context_size: expected 'causal' or "
                f"[{k - 1}, 0], got {self.conv_context_size!r}"
            )
        if self.subsampling_factor != 8:
            raise ConfigError(
                "audio_config.encoder.subsampling_factor: only 8 (3 stride-2 stages) "
                f"is supported, got {self.subsampling_factor}"
            )
        if self.conv_norm_type != "layer_norm":
            raise ConfigError(
                f"audio_config.encoder.conv_norm_type: only 'layer_norm' is supported, got {self.conv_norm_type!r}"
            )
        if self.self_attention_model != "rel_pos":
            raise ConfigError(
                "audio_config.encoder.self_attention_model: only 'rel_pos' is supported, "
                f"got {self.self_attention_model!r}"
            )
        if self.d_model % self.n_heads:
            raise ConfigError(f"audio_config.encoder.n_heads: must divide d_model ({self.d_model})")

    @property
    def left_context(self) -> int:
        return self.att_context_size[0][0]


@dataclass
class RnntDecoderConfig:
    pred_hidden: int = 640
    pred_rnn_layers: int = 2
    vocab_size: int = 1024
    blank_as_pad: bool = True


@dataclass
class JointConfig:
    joint_hidden: int = 640
    activation: str = "relu"
    encoder_hidden: int = 1024
    pred_hidden: int = 640
    num_classes: int = 1024

    def __post_init__(self):
        if self.activation != "relu":
            raise ConfigError(f"audio_config.joint.activation: only 'relu' is supported, got {self.activation!r}")


@dataclass
class AudioConfig:
    preprocessor: PreprocessorConfig = field(default_factory=PreprocessorConfig)
    encoder: EncoderConfig = field(default_factory=EncoderConfig)
    decoder: RnntDecoderConfig = field(default_factory=RnntDecoderConfig)
    joint: JointConfig = field(default_factory=JointConfig)
    output_dim: int = 4480
    max_symbols: int = 10

    @classmethod
    def from_dict(cls, d: dict | None) -> AudioConfig:
        d = dict(d or {})
        return cls(
            preprocessor=_from_dict(PreprocessorConfig, d.pop("preprocessor", None), "audio_config.preprocessor"),
            encoder=_from_dict(EncoderConfig, d.pop("encoder", None), "audio_config.encoder"),
            decoder=_from_dict(RnntDecoderConfig, d.pop("decoder", None), "audio_config.decoder"),
            joint=_from_dict(JointConfig, d.pop("joint", None), "audio_config.joint"),
            **{k: v for k, v in d.items() if k in ("output_dim", "max_symbols")},
        )


# --------------------------------------------------------------------------- tts


@dataclass
class CharEncoderConfig:
    hidden_size: int = 1152
    intermediate_size: int = 4608
    num_hidden_layers: int = 1
    num_attention_heads: int = 16
    num_key_value_heads: int = 16
    head_dim: int = 72
    rms_norm_eps: float = 1e-6
    query_pre_attn_scalar: float = 256
    attn_logit_softcapping: float = 50.0
    rope_base: float = 10000.0
    char_vocab_size: int = 257


@dataclass
class MogHeadConfig:
    intermediate_size: int = 4608
    low_rank: int = 64
    min_log_std: float = -4.0
    num_layers: int = 3
    num_predictions: int = 1024
    eps: float = 1e-6


@dataclass
class TtsConfig:
    """EAR-TTS (docs/model.md §1.5, §8)."""

    hidden_size: int = 1152
    intermediate_size: int = 4608
    num_hidden_layers: int = 28
    num_attention_heads: int = 16
    num_key_value_heads: int = 16
    head_dim: int = 72
    sliding_window: int = 7500
    sliding_window_pattern: int = 6
    rms_norm_eps: float = 1e-6
    query_pre_attn_scalar: float = 256
    rope_global_base_freq: float = 1_000_000.0
    rope_local_base_freq: float = 10_000.0
    latent_size: int = 512
    num_quantizers: int = 31
    codebook_size: int = 1024
    num_delay_speech_tokens: int = 2
    exponent: float = 3.0
    num_iterations: int = 8
    disable_eos_prediction: bool = True
    use_gated_fusion_for_text_audio: bool = True
    use_subword_flag_emb: bool = True
    use_bos_eos_emb: bool = True
    use_audio_prompt_frozen_projection: bool = True
    guidance_scale: float = 0.2
    top_p: float = 0.95
    noise_scale: float = 0.001
    audio_prompt_duration: float = 3.0
    character_encoder: CharEncoderConfig = field(default_factory=CharEncoderConfig)
    mog_head: MogHeadConfig = field(default_factory=MogHeadConfig)

    @classmethod
    def from_dict(cls, d: dict | None) -> TtsConfig:
        d = dict(d or {})
        ce = _from_dict(CharEncoderConfig, d.pop("character_encoder", None), "tts_config.character_encoder")
        mog = _from_dict(MogHeadConfig, d.pop("mog_head", None), "tts_config.mog_head")
        cfg = _from_dict(cls, d, "tts_config")
        cfg.character_encoder, cfg.mog_head = ce, mog
        if ce.hidden_size != cfg.hidden_size:
            raise ConfigError(
                "tts_config.character_encoder.hidden_size: must equal tts_config.hidden_size "
                f"({ce.hidden_size} != {cfg.hidden_size})"
            )
        if mog.num_predictions <= 0 or mog.low_rank <= 0:
            raise ConfigError("tts_config.mog_head: num_predictions and low_rank must be positive")
        return cfg

    def is_global_layer(self, i: int) -> bool:
        return (i + 1) % self.sliding_window_pattern == 0


# --------------------------------------------------------------------------- codec


@dataclass
class CodecConfig:
    """Audio codec (docs/model.md §1.6, §9)."""

    sample_rate: int = 22050
    base_channels: int = 384
    channel_multipliers: Any = (1, 2, 4)
    downsample_rates: Any = (7, 7, 9)
    blocks_per_stage: int = 3
    block_kernel_size: int = 7
    latent_dim: int = 512
    n_fft: int = 16
    hop_length: int = 4
    num_quantizers: int = 31
    codebook_size: int = 1024

    def __post_init__(self):
        self.channel_multipliers = tuple(int(x) for x in self.channel_multipliers)
        self.downsample_rates = tuple(int(x) for x in self.downsample_rates)
        if len(self.channel_multipliers) != len(self.downsample_rates):
            raise ConfigError(
                "codec_config.channel_multipliers: must have one entry per downsample rate "
                f"({len(self.channel_multipliers)} != {len(self.downsample_rates)})"
            )
        if self.n_fft % self.hop_length or self.n_fft % 2:
            raise ConfigError(
                f"codec_config.n_fft: must be even and a multiple of hop_length ({self.n_fft}, {self.hop_length})"
            )

    @property
    def waveform_to_token_ratio(self) -> int:
        r = self.hop_length
        for s in self.downsample_rates:
            r *= s
        return r

    @property
    def spectral_frames_per_token(self) -> int:
        return self.waveform_to_token_ratio // self.hop_length

    @property
    def stft_channels(self) -> int:
        return 2 * (self.n_fft // 2 + 1)


# --------------------------------------------------------------------------- top level


@dataclass
class VoiceChatConfig:
    text_config: TextConfig
    audio_config: AudioConfig = field(default_factory=AudioConfig)
    tts_config: TtsConfig = field(default_factory=TtsConfig)
    codec_config: CodecConfig = field(default_factory=CodecConfig)
    model_type: str = "nemotron_voicechat"
    architectures: Any = ("NemotronVoiceChatForConditionalGeneration",)
    bos_token_id: int = 1
    eos_token_id: int = 2
    pad_token_id: int = 12
    silence_token_id: int = 11
    rnnt_blank_id: int = 1024
    input_sample_rate: int = 16000
    output_sample_rate: int = 22050
    frame_duration: float = 0.08
    function_channel_weight: float = 2.0
    speaker: str = "Aria"
    rnnt_vocabulary: Any = ()
    default_system_prompt: str = ""
    quantization: Any = None
    # Keys we keep only to write them back (provenance).
    mlx_runtime_config_version: Any = None
    source_revision: Any = None
    base_tokenizer_revision: Any = None

    @classmethod
    def from_dict(cls, d: dict) -> VoiceChatConfig:
        if not isinstance(d, dict):
            raise ConfigError(f"config.json: expected a JSON object, got {type(d).__name__}")
        d = dict(d)
        mt = d.get("model_type")
        if mt != "nemotron_voicechat":
            raise ConfigError(f"model_type: expected 'nemotron_voicechat', got {mt!r}")
        if "text_config" not in d or d["text_config"] is None:
            raise ConfigError("text_config: missing; a VoiceChat config needs the Nemotron-H text_config")
        text = _from_dict(TextConfig, d.pop("text_config"), "text_config")
        audio = AudioConfig.from_dict(d.pop("audio_config", None))
        tts = TtsConfig.from_dict(d.pop("tts_config", None))
        codec = _from_dict(CodecConfig, d.pop("codec_config", None), "codec_config")
        if d.get("quantization") is None and d.get("quantization_config") is not None:
            d["quantization"] = d["quantization_config"]
        names = {f.name for f in dataclasses.fields(cls)}
        cfg = cls(
            text_config=text,
            audio_config=audio,
            tts_config=tts,
            codec_config=codec,
            **{k: v for k, v in d.items() if k in names},
        )
        cfg.validate()
        return cfg

    def validate(self) -> None:
        t, a, s, c = self.text_config, self.audio_config, self.tts_config, self.codec_config
        if a.output_dim != t.hidden_size:
            raise ConfigError(
                f"audio_config.output_dim: must equal text_config.hidden_size ({a.output_dim} != {t.hidden_size})"
            )
        if a.joint.encoder_hidden != a.encoder.d_model:
            raise ConfigError(
                f"audio_config.joint.encoder_hidden: must equal audio_config.encoder.d_model "
                f"({a.joint.encoder_hidden} != {a.encoder.d_model})"
            )
        if a.joint.pred_hidden != a.decoder.pred_hidden:
            raise ConfigError(
                f"audio_config.joint.pred_hidden: must equal audio_config.decoder.pred_hidden "
                f"({a.joint.pred_hidden} != {a.decoder.pred_hidden})"
            )
        if a.encoder.feat_in != a.preprocessor.features:
            raise ConfigError(
                f"audio_config.encoder.feat_in: must equal audio_config.preprocessor.features "
                f"({a.encoder.feat_in} != {a.preprocessor.features})"
            )
        if self.rnnt_blank_id != a.decoder.vocab_size:
            raise ConfigError(
                f"rnnt_blank_id: must equal audio_config.decoder.vocab_size "
                f"({self.rnnt_blank_id} != {a.decoder.vocab_size})"
            )
        if self.rnnt_vocabulary and len(self.rnnt_vocabulary) != a.decoder.vocab_size:
            raise ConfigError(
                f"rnnt_vocabulary: has {len(self.rnnt_vocabulary)} pieces, expected "
                f"audio_config.decoder.vocab_size = {a.decoder.vocab_size}"
            )
        if c.num_quantizers != s.num_quantizers:
            raise ConfigError(
                f"codec_config.num_quantizers: must equal tts_config.num_quantizers "
                f"({c.num_quantizers} != {s.num_quantizers})"
            )
        if c.codebook_size != s.codebook_size:
            raise ConfigError(
                f"codec_config.codebook_size: must equal tts_config.codebook_size "
                f"({c.codebook_size} != {s.codebook_size})"
            )
        if c.latent_dim != s.latent_size:
            raise ConfigError(
                f"codec_config.latent_dim: must equal tts_config.latent_size ({c.latent_dim} != {s.latent_size})"
            )
        in_samples = round(self.input_sample_rate * self.frame_duration)
        if in_samples % a.preprocessor.hop_length or in_samples // a.preprocessor.hop_length != 8:
            raise ConfigError(
                "frame_duration: one frame must be exactly 8 mel hops "
                f"({in_samples} samples / hop {a.preprocessor.hop_length})"
            )
        if self.input_sample_rate != a.preprocessor.sample_rate:
            raise ConfigError(
                f"input_sample_rate: must equal audio_config.preprocessor.sample_rate "
                f"({self.input_sample_rate} != {a.preprocessor.sample_rate})"
            )
        if self.output_sample_rate != c.sample_rate:
            raise ConfigError(
                f"output_sample_rate: must equal codec_config.sample_rate "
                f"({self.output_sample_rate} != {c.sample_rate})"
            )
        for name in ("bos_token_id", "eos_token_id", "pad_token_id", "silence_token_id"):
            v = getattr(self, name)
            if not (0 <= v < t.vocab_size):
                raise ConfigError(f"{name}: {v} is outside the text vocabulary [0, {t.vocab_size})")

    # -- derived frame geometry
    @property
    def frame_samples(self) -> int:
        return round(self.input_sample_rate * self.frame_duration)

    @property
    def output_frame_samples(self) -> int:
        return self.codec_config.waveform_to_token_ratio

    @property
    def special_text_ids(self) -> frozenset[int]:
        return frozenset({self.pad_token_id, self.silence_token_id, self.bos_token_id, self.eos_token_id})

    def to_dict(self) -> dict:
        d = _to_dict(self)
        if d.get("quantization") is not None:
            d["quantization_config"] = d["quantization"]
        for k in ("mlx_runtime_config_version", "source_revision", "base_tokenizer_revision", "quantization"):
            if d.get(k) is None:
                d.pop(k, None)
        return d


def parse_config_text(text: str, where: str = "config.json") -> VoiceChatConfig:
    """Parse config JSON; Python's json accepts the non-standard Infinity / -Infinity / NaN tokens."""
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        raise ConfigError(f"{where}: not valid JSON ({e})") from None
    return VoiceChatConfig.from_dict(data)


def load_config(path: str | Path) -> VoiceChatConfig:
    path = Path(path)
    if path.is_dir():
        path = path / "config.json"
    if not path.exists():
        raise ConfigError(f"{path}: no config.json found")
    return parse_config_text(path.read_text(encoding="utf-8"), str(path))


def dump_config(cfg: VoiceChatConfig) -> str:
    """JSON text as the published converter writes it (`Infinity` token included)."""
    return json.dumps(cfg.to_dict(), indent=2, allow_nan=True, ensure_ascii=False)
