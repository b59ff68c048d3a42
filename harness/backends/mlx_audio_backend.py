"""mlx-audio 0.6.2's own VoiceChat (`mlx_audio.sts.models.nemotron_voicechat`) as a parity backend.

Needs the `peers` extra (mlx-vlm==0.7.10, mlx-audio==0.6.2). Nothing of mlx-audio is
copied here. mlx-audio's loader (`mlx_audio.sts.utils.load_model`) cannot read a
published-layout checkpoint folder offline: it expects NeMo's nested config, fetches
the language model's config (and, in `Model.post_load_hook`, the tokenizer) from the
Hugging Face hub under `pretrained_llm` (`config.py`: `nvidia/NVIDIA-Nemotron-Nano-9B-v2`
by default), and loads with `strict=False`. This backend therefore runs the same steps
as mlx-audio's `base_load_model`, with mlx-audio's own pieces, on a translated config:

1. `translate_config`: the folder's `config.json` rewritten in the nested NeMo layout
   `ModelConfig.from_dict` parses, with `mlx_audio.llm_config` (mlx-audio's own hook
   for an explicit language-model config, so nothing is fetched) taken from the
   folder's `text_config`, and `pretrained_llm` set to the folder (the post-load hook
   then reads the folder's tokenizer).
2. `Model(ModelConfig.from_dict(...))`, then `check_config`: every value of the
   folder that mlx-audio parses differently or hard-codes (checked against the
   built model's attributes, not a copy of its defaults) is refused, naming the key.
3. `mlx_audio.utils.load_weights` + `Model.sanitize` + `mlx_audio.utils.apply_quantization`
   (the rule of its loader: a Linear / Embedding is quantized when the weights carry
   its `.scales`).
4. A strict load. Every tensor mlx-audio's default `strict=False` would have let
   through (missing, unexpected, or of another shape) is listed in `load_report`;
   the load is refused unless the only ones are the two tokenizer-derived buffers
   that `set_tokenizer` rebuilds anyway (`TOKENIZER_BUFFERS`: the checkpoint stores
   them at the published 131072-entry vocabulary, mlx-audio sizes them by the
   language model's vocabulary). They are not loaded; `load_report` says whether
   mlx-audio's rebuilt values equal the stored ones on the ids the model can emit.
5. `Model.post_load_hook(model, folder)` (mlx-audio's hook, the folder's tokenizer),
   `model.create_session()`.

`HF_HUB_OFFLINE=1` and `TRANSFORMERS_OFFLINE=1` are set for the process before
mlx-audio is imported: a path that would reach the hub fails instead.

Runs: offline `VoiceChatSession.generate(..., use_language_cache=True)` and the
streaming `VoiceChatStreamingSession` (`create_streaming_session`, `push_audio` in
`chunk_samples` pieces, `flush(pad_partial=True)`). Values the public API does not
return are recorded by wrapping methods / module attributes for one run (each
wrapper calls the original with the same arguments and returns its result), as
`mlx_vlm_backend.py` does; the conventions of the returned runs are that backend's
(raw codes before control-code replacement in `codes`, frame-major `mel` / `encoder`).
Not available: profiling (mlx-audio's streaming session has no profile; `frame_timings`
holds the wall time of each frame measured around `_step_audio_frame`), component
checks, and the codec tail (mlx-audio's `flush` clears the codec without emitting it).
"""

from __future__ import annotations

import gc
import json
import math
import os
import time
from contextlib import ExitStack, contextmanager
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import mlx.core as mx
import numpy as np
from mlx.utils import tree_flatten, tree_map, tree_unflatten

from .base import Backend, OfflineRun, StreamRun
from .mlx_vlm_backend import _as_audio, _event_dict, _np, _patched, _recording_calls

# The two buffers `CharAwareSubwordEncoder.set_tokenizer` (mlx-audio tts.py) rebuilds from the tokenizer.
TOKENIZER_BUFFERS = (
    "tts_model.tts_model.embed_subword.subword_flag_emb.is_continuation",
    "tts_model.tts_model.embed_subword.bos_eos_emb.special_flags",
)

# What the published layout means where config.json leaves a key out (docs/model.md §2; the defaults of
# this project's and mlx-vlm's config parsers). Only keys mlx-audio does not read from the folder.
PUBLISHED_DEFAULTS = {
    "bos_token_id": 1,
    "eos_token_id": 2,
    "pad_token_id": 12,
    "silence_token_id": 11,
    "default_system_prompt": "",
    "tts_config.rms_norm_eps": 1e-6,
    "tts_config.query_pre_attn_scalar": 256.0,
    "tts_config.rope_global_base_freq": 1_000_000.0,
    "tts_config.rope_local_base_freq": 10_000.0,
    "tts_config.sliding_window_pattern": 6,
    "tts_config.num_iterations": 8,
    "tts_config.num_delay_speech_tokens": 2,
    "tts_config.disable_eos_prediction": True,
    "tts_config.use_gated_fusion_for_text_audio": True,
    "tts_config.use_subword_flag_emb": True,
    "tts_config.use_bos_eos_emb": True,
    "tts_config.use_audio_prompt_frozen_projection": True,
    "tts_config.character_encoder.num_hidden_layers": 1,
    "tts_config.character_encoder.rms_norm_eps": 1e-6,
    "tts_config.character_encoder.query_pre_attn_scalar": 256.0,
    "tts_config.character_encoder.attn_logit_softcapping": 50.0,
    "tts_config.character_encoder.rope_base": 10_000.0,
    "tts_config.mog_head.eps": 1e-6,
}


class UnsupportedCheckpoint(ValueError):
    """The folder holds a value mlx-audio parses differently or hard-codes; `key` names it."""

    def __init__(self, key: str, folder_value, mlx_audio_value, why: str = ""):
        self.key, self.folder_value, self.mlx_audio_value = key, folder_value, mlx_audio_value
        super().__init__(
            f"mlx-audio cannot run this checkpoint as written: {key} = {folder_value!r} in config.json, "
            f"mlx-audio uses {mlx_audio_value!r}" + (f" ({why})" if why else "")
        )


def _offline_env() -> None:
    os.environ["HF_HUB_OFFLINE"] = "1"
    os.environ["TRANSFORMERS_OFFLINE"] = "1"


def _get(cfg: dict, dotted: str):
    """The folder's value of `dotted` (a.b.c), else the published default, else KeyError."""
    node: Any = cfg
    for part in dotted.split("."):
        if not isinstance(node, dict) or part not in node:
            if dotted in PUBLISHED_DEFAULTS:
                return PUBLISHED_DEFAULTS[dotted]
            raise KeyError(dotted)
        node = node[part]
    return node


def _att_context(enc: dict):
    acs = enc.get("att_context_size", [[70, 0]])
    if acs and isinstance(acs[0], (int, float)):
        acs = [acs]
    return [int(x) for x in acs[0]]


def translate_config(raw: dict, folder: Path) -> dict:
    """The folder's config.json in the nested NeMo layout mlx-audio's `ModelConfig.from_dict` reads."""
    text = dict(raw["text_config"])
    audio = raw.get("audio_config", {})
    tts = raw.get("tts_config", {})
    codec = raw.get("codec_config", {})
    enc = dict(audio.get("encoder", {}))
    enc["att_context_size"] = _att_context(enc)  # mlx-audio wraps it in a list itself
    dec, joint = audio.get("decoder", {}), audio.get("joint", {})
    llm = dict(text.items())
    lim = llm.get("time_step_limit")
    if lim is not None and math.isinf(float(lim[1])):
        llm.pop("time_step_limit")  # mlx-audio's ModelArgs default is (0.0, inf); as its convert.py does
    if isinstance(llm.get("hybrid_override_pattern"), str):
        llm["hybrid_override_pattern"] = list(llm["hybrid_override_pattern"])
    char_vocab = int(_get(raw, "tts_config.character_encoder.char_vocab_size") if "character_encoder" in tts else 257)
    return {
        "model_type": "nemotron_voicechat",
        "data": {
            "source_sample_rate": raw.get("input_sample_rate", 16000),
            "target_sample_rate": raw.get("output_sample_rate", 22050),
            "frame_length": raw.get("frame_duration", 0.08),
        },
        "model": {
            "inference_speaker_name": raw.get("speaker", "Aria"),
            "stt": {
                "model": {
                    "pretrained_llm": str(folder),
                    "perception": {
                        "preprocessor": dict(audio.get("preprocessor", {})),
                        "encoder": enc,
                        "output_dim": audio.get("output_dim", text["hidden_size"]),
                    },
                    "duplex_function_channel_weight": raw.get("function_channel_weight", 2.0),
                    "max_symbols": audio.get("max_symbols", 10),
                    "use_function_head": True,
                }
            },
            "speech_generation": {
                "model": {
                    "tts_config": {
                        "backbone_config": {
                            k: tts[k]
                            for k in (
                                "hidden_size",
                                "intermediate_size",
                                "num_hidden_layers",
                                "num_attention_heads",
                                "num_key_value_heads",
                                "head_dim",
                                "sliding_window",
                            )
                            if k in tts
                        },
                        "mog_head_config": dict(tts.get("mog_head", {})),
                        **{
                            k: tts[k]
                            for k in ("latent_size", "codebook_size", "num_quantizers", "exponent")
                            if k in tts
                        },
                    },
                    "codec_config": {
                        **({"base_hidden_size": codec["base_channels"]} if "base_channels" in codec else {}),
                        **({"channel_mult": codec["channel_multipliers"]} if "channel_multipliers" in codec else {}),
                        **({"rates": codec["downsample_rates"]} if "downsample_rates" in codec else {}),
                        **({"num_blocks": codec["blocks_per_stage"]} if "blocks_per_stage" in codec else {}),
                        **({"kernel_size": codec["block_kernel_size"]} if "block_kernel_size" in codec else {}),
                        **({"latent_size": codec["latent_dim"]} if "latent_dim" in codec else {}),
                        **{
                            k: codec[k]
                            for k in ("sample_rate", "n_fft", "hop_length", "num_quantizers", "codebook_size")
                            if k in codec
                        },
                    },
                    **{
                        f"inference_{a}": tts[b]
                        for a, b in (
                            ("num_iterations", "num_iterations"),
                            ("guidance_scale", "guidance_scale"),
                            ("top_p_or_k", "top_p"),
                            ("noise_scale", "noise_scale"),
                        )
                        if b in tts
                    },
                },
                "data": {
                    "audio_prompt_duration": tts.get("audio_prompt_duration", 3.0),
                    "frame_length": raw.get("frame_duration", 0.08),
                },
            },
        },
        "_rnnt_merge_info": {
            "decoder_config": {
                "prednet": {k: dec[k] for k in ("pred_hidden", "pred_rnn_layers") if k in dec},
                **{k: dec[k] for k in ("vocab_size", "blank_as_pad") if k in dec},
            },
            "joint_config": {
                "jointnet": {
                    k: joint[k] for k in ("joint_hidden", "activation", "encoder_hidden", "pred_hidden") if k in joint
                },
                **({"num_classes": joint["num_classes"]} if "num_classes" in joint else {}),
                "vocabulary": list(raw.get("rnnt_vocabulary", [])),
                **({"blank_id": raw["rnnt_blank_id"]} if "rnnt_blank_id" in raw else {}),
            },
        },
        "mlx_audio": {"llm_config": llm, "char_vocab_size": char_vocab - 1},
    }


def _same(a, b) -> bool:
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, bool) or isinstance(b, bool):
        return a == b
    if isinstance(a, (int, float)) and isinstance(b, (int, float)):
        return float(a) == float(b) or (math.isinf(float(a)) and math.isinf(float(b)))
    return a == b


def _eps(norm) -> float:
    return float(norm.eps)


def check_config(raw: dict, model) -> list[tuple[str, Any]]:
    """Every config.json value checked against what mlx-audio built; raises `UnsupportedCheckpoint`
    naming the first key that differs. Returns the (key, value) pairs checked."""
    cfg = model.config
    checked: list[tuple[str, Any]] = []

    def need(key: str, theirs, why: str = ""):
        try:
            ours = _get(raw, key)
        except KeyError:
            return
        if not _same(ours, theirs):
            raise UnsupportedCheckpoint(key, ours, theirs, why)
        checked.append((key, ours))

    # top level
    for key, theirs in (
        ("bos_token_id", cfg.bos_token_id),
        ("eos_token_id", cfg.eos_token_id),
        ("pad_token_id", cfg.pad_token_id),
        ("silence_token_id", cfg.silence_token_id),
        ("rnnt_blank_id", cfg.rnnt_blank_id),
        ("input_sample_rate", cfg.source_sample_rate),
        ("output_sample_rate", cfg.target_sample_rate),
        ("frame_duration", cfg.frame_duration),
        ("function_channel_weight", cfg.function_channel_weight),
        ("speaker", cfg.speaker_name),
        ("rnnt_vocabulary", cfg.rnnt_vocabulary),
        ("default_system_prompt", cfg.default_system_prompt),
    ):
        need(key, theirs, "not read from the config" if key in PUBLISHED_DEFAULTS else "")
    if cfg.text_channel_weight != 1.0 or cfg.audio_channel_weight != 1.0:
        raise UnsupportedCheckpoint(
            "text/audio channel weight", 1.0, (cfg.text_channel_weight, cfg.audio_channel_weight)
        )
    # language model: every text_config key that is a field of mlx-audio's ModelArgs
    llm = cfg.llm
    for key, value in raw["text_config"].items():
        if key == "hybrid_override_pattern":
            need(f"text_config.{key}", "".join(llm.hybrid_override_pattern))
            need(f"text_config.{key}", "".join(layer.block_type for layer in model.stt_model.llm.layers))
        elif key == "num_hidden_layers" and "hybrid_override_pattern" in raw["text_config"]:
            # the pattern decides the depth in every implementation (this project's parser, mlx-vlm's, mlx-audio's)
            checked.append((f"text_config.{key}", value))
        elif hasattr(llm, key):
            need(f"text_config.{key}", getattr(llm, key))
        else:
            raise UnsupportedCheckpoint(
                f"text_config.{key}", value, None, "not a field of mlx-audio's NemotronH ModelArgs"
            )
    # audio side: mlx-audio parses a fixed subset of each section; every folder key must land
    audio = raw.get("audio_config", {})
    for section, parsed in (
        ("preprocessor", cfg.preprocessor),
        ("encoder", cfg.encoder),
        ("decoder", cfg.decoder),
        ("joint", cfg.joint),
    ):
        for key, value in audio.get(section, {}).items():
            dotted = f"audio_config.{section}.{key}"
            if key.startswith("_"):
                continue  # NeMo bookkeeping (e.g. _target_removed), read by no implementation
            if key == "att_context_size":
                if [_att_context(audio[section])] != [list(x) for x in parsed.att_context_size]:
                    raise UnsupportedCheckpoint(dotted, value, parsed.att_context_size)
                checked.append((dotted, value))
            elif hasattr(parsed, key):
                need(dotted, getattr(parsed, key))
            elif (section, key, value) in (("preprocessor", "log", True), ("encoder", "subsampling", "dw_striding")):
                checked.append((dotted, value))  # what mlx-audio's mel / conformer always do
            else:
                raise UnsupportedCheckpoint(dotted, value, None, "mlx-audio has no such setting")
    need("audio_config.output_dim", cfg.output_dim)
    need("audio_config.max_symbols", cfg.rnnt_max_symbols)
    # TTS: parsed values and what the built modules hard-code
    tts, ear = cfg.tts, model.tts_model.tts_model
    bb = ear.backbone.args
    for key in (
        "hidden_size",
        "intermediate_size",
        "num_hidden_layers",
        "num_attention_heads",
        "num_key_value_heads",
        "head_dim",
        "sliding_window",
        "latent_size",
        "codebook_size",
        "num_quantizers",
        "exponent",
        "guidance_scale",
        "top_p",
        "noise_scale",
        "num_iterations",
    ):
        need(f"tts_config.{key}", getattr(tts, key))
    need("tts_config.rms_norm_eps", bb.rms_norm_eps, "hard-coded: gemma3 ModelArgs default")
    need("tts_config.rms_norm_eps", _eps(ear.gated_fusion_audio_text.final_norm), "hard-coded in tts.RMSNorm")
    need("tts_config.query_pre_attn_scalar", bb.query_pre_attn_scalar, "hard-coded: gemma3 ModelArgs default")
    need("tts_config.rope_global_base_freq", bb.rope_theta, "hard-coded: gemma3 ModelArgs default")
    need("tts_config.rope_local_base_freq", bb.rope_local_base_freq, "hard-coded: gemma3 ModelArgs default")
    need("tts_config.sliding_window_pattern", bb.sliding_window_pattern, "mlx-audio uses min(6, num_hidden_layers)")
    # audio_prompt_duration: mlx-audio sizes the speaker latent int(duration / frame_length) frames; the
    # strict load checks that shape against the stored latent.
    for flag in (
        "disable_eos_prediction",
        "use_gated_fusion_for_text_audio",
        "use_subword_flag_emb",
        "use_bos_eos_emb",
        "use_audio_prompt_frozen_projection",
    ):
        need(f"tts_config.{flag}", True, "mlx-audio builds only this structure")
    need("tts_config.num_delay_speech_tokens", 2, "not read by mlx-audio")
    mog = ear.mog_head
    for key, theirs in (
        ("intermediate_size", mog.mlp_stack[0].mlp.gate_proj.weight.shape[0]),
        ("low_rank", mog.low_rank),
        ("min_log_std", mog.min_log_std),
        ("num_layers", len(mog.mlp_stack) - 1),
        ("num_predictions", mog.num_predictions),
        ("eps", _eps(mog.mlp_stack[-1])),
    ):
        need(f"tts_config.mog_head.{key}", theirs)
    sub = ear.embed_subword
    enc_layers = sub.backbone.encoder.layers
    attn = enc_layers[0].self_attn
    for key, theirs in (
        ("hidden_size", sub.embed_tokens.weight.shape[1]),
        ("intermediate_size", enc_layers[0].mlp.gate_proj.weight.shape[0]),
        ("num_hidden_layers", len(enc_layers)),
        ("num_attention_heads", attn.num_attention_heads),
        ("num_key_value_heads", attn.num_key_value_heads),
        ("head_dim", attn.head_dim),
        ("rms_norm_eps", _eps(sub.backbone.encoder.norm)),
        ("query_pre_attn_scalar", round(attn.scale**-2, 6)),
        ("attn_logit_softcapping", attn.softcap),
        ("rope_base", attn.rope.base),
        ("char_vocab_size", sub.embed_tokens.weight.shape[0]),
    ):
        need(
            f"tts_config.character_encoder.{key}",
            theirs,
            "mlx-audio builds the character encoder from the TTS sizes and t5gemma.py's constants",
        )
    # codec: every folder key is a field of mlx-audio's codec config
    for key, value in raw.get("codec_config", {}).items():
        if not hasattr(cfg.codec, key):
            raise UnsupportedCheckpoint(f"codec_config.{key}", value, None, "not a field of mlx-audio's codec config")
        need(f"codec_config.{key}", getattr(cfg.codec, key))
    return checked


def _strict_differences(model, weights: dict) -> list[dict]:
    """What `model.load_weights(weights, strict=True)` would refuse: missing, unexpected, other shape."""
    params = dict(tree_flatten(model.parameters()))
    out = []
    for k in sorted(set(params) | set(weights)):
        if k not in weights:
            out.append({"tensor": k, "problem": "missing", "expected": tuple(params[k].shape)})
        elif k not in params:
            out.append({"tensor": k, "problem": "unexpected", "checkpoint": tuple(weights[k].shape)})
        elif tuple(params[k].shape) != tuple(weights[k].shape):
            out.append(
                {
                    "tensor": k,
                    "problem": "shape",
                    "expected": tuple(params[k].shape),
                    "checkpoint": tuple(weights[k].shape),
                }
            )
    return out


class MlxAudioBackend(Backend):
    """Drives mlx-audio's nemotron_voicechat (offline `generate` and the streaming session)."""

    name = "mlx-audio"

    def __init__(self):
        self.model = None
        self.session = None  # mlx_audio ... VoiceChatSession
        self.checkpoint: str | None = None
        self.load_s = 0.0
        self.load_report: dict = {}
        self.version = "?"
        self.stored_tokenizer_buffers: dict = {}

    # -- loading

    def load(self, checkpoint: str) -> Any:
        _offline_env()
        try:
            import mlx_audio
            from mlx_audio.sts.models.nemotron_voicechat import Model, ModelConfig
            from mlx_audio.utils import apply_quantization, load_weights
        except ImportError as e:  # pragma: no cover - depends on the environment
            raise ImportError("the mlx-audio backend needs the `peers` extra: pip install -e '.[peers]'") from e
        self.close()
        folder = Path(str(checkpoint)).expanduser()
        if not (folder / "config.json").is_file():
            raise FileNotFoundError(
                f"{checkpoint}: the mlx-audio backend reads a local checkpoint folder "
                "(config.json + safetensors + tokenizer); no hub access"
            )
        t0 = time.perf_counter()
        raw = json.loads((folder / "config.json").read_text())
        if raw.get("model_type") != "nemotron_voicechat":
            raise ValueError(
                f"{checkpoint} is not a nemotron_voicechat checkpoint (model_type {raw.get('model_type')!r})"
            )
        nested = translate_config(raw, folder.resolve())
        model = Model(ModelConfig.from_dict(nested))
        checked = check_config(raw, model)
        weights = model.sanitize(load_weights(folder))
        apply_quantization(model, raw, weights, getattr(model, "model_quant_predicate", None))
        let_through = _strict_differences(model, weights)
        unexpected = [d for d in let_through if d["tensor"] not in TOKENIZER_BUFFERS or d["problem"] != "shape"]
        if unexpected:
            raise ValueError(
                "mlx-audio's non-strict load would let these tensors through; refusing: "
                + "; ".join(
                    f"{d['tensor']} ({d['problem']}"
                    + (
                        f", expected {d.get('expected')}, checkpoint {d.get('checkpoint')}"
                        if d["problem"] == "shape"
                        else ""
                    )
                    + ")"
                    for d in unexpected
                )
            )
        stored = {k: np.array(weights.pop(k)) for k in TOKENIZER_BUFFERS if k in weights}
        model.load_weights(list(weights.items()), strict=False)  # every key and shape checked above
        # the two buffers left at mlx-audio's own (vocab-sized) shape: strict over everything else
        missing = [k for k, _ in tree_flatten(model.parameters()) if k not in weights and k not in TOKENIZER_BUFFERS]
        if missing:
            raise ValueError(f"strict load: {missing} missing")
        mx.eval(model.parameters())
        model.eval()
        model = Model.post_load_hook(model, folder)  # AutoTokenizer.from_pretrained(<the folder>)
        session = model.create_session()
        # mlx-audio rebuilt the two buffers from the tokenizer: compare with the checkpoint's stored ones on
        # the ids the language model can emit
        vocab = int(model.config.llm.vocab_size)
        rebuilt = {
            TOKENIZER_BUFFERS[0]: np.array(model.tts_model.tts_model.embed_subword.subword_flag_emb.is_continuation),
            TOKENIZER_BUFFERS[1]: np.array(model.tts_model.tts_model.embed_subword.bos_eos_emb.special_flags),
        }
        buffers = {}
        for k in TOKENIZER_BUFFERS:
            if k in stored:
                s, r = stored[k][:vocab], rebuilt[k][:vocab]
                diff = np.nonzero(s != r)[0]
                buffers[k] = {
                    "stored_shape": tuple(stored[k].shape),
                    "mlx_audio_shape": tuple(rebuilt[k].shape),
                    "differing_ids": [int(i) for i in diff[:20]],
                    "n_differing": int(diff.size),
                }
        self.load_s = time.perf_counter() - t0
        self.model, self.session, self.checkpoint = model, session, str(checkpoint)
        self.stored_tokenizer_buffers = {
            k: v[: vocab + 1] if k == TOKENIZER_BUFFERS[0] else v[:vocab] for k, v in stored.items()
        }
        self.version = getattr(mlx_audio, "__version__", "?")
        self.load_report = {
            "let_through_by_strict_false": let_through,
            "tokenizer_buffers": buffers,
            "config_keys_checked": len(checked),
        }
        return model

    def _require(self):
        if self.session is None:
            raise RuntimeError("MlxAudioBackend: call load(checkpoint) first")
        return self.session

    @property
    def samples_per_frame(self) -> int:
        self._require()
        return int(self.model.tts_model.audio_codec.waveform_to_token_ratio)

    @property
    def lead_in(self) -> int:
        """ceil(((n_fft - hop) // 2) / hop) * hop samples: the streaming iSTFT's context (same codec class
        as mlx-vlm's, `mlx_audio.codec.models.nemotron_voicechat`)."""
        self._require()
        c = self.model.config.codec
        return int(math.ceil(((c.n_fft - c.hop_length) // 2) / c.hop_length) * c.hop_length)

    @property
    def warmup_samples(self) -> int:
        return 2 * self.lead_in

    def close(self) -> None:
        self.model = self.session = None
        gc.collect()
        mx.clear_cache()

    # -- helpers the harness uses when present (mlx-audio code paths)

    def decode_codes(self, codes: np.ndarray, *, float32_latent: bool = False) -> np.ndarray:
        """mlx-audio's offline codec decode of (T, Q) raw codes (its `_replace_control_codes` first);
        `float32_latent=True` casts the codebooks to float32 for the call (restored afterwards)."""
        sess = self._require()
        codes = np.asarray(codes)
        q = self.model.config.tts.num_quantizers
        if codes.ndim != 2 or codes.shape[1] != q:
            raise ValueError(f"codes must be (T, {q}), got {codes.shape}")
        if codes.shape[0] == 0:
            return np.zeros((0,), np.float32)
        codec = self.model.tts_model.audio_codec
        clean = sess._replace_control_codes(mx.array(codes.astype(np.int32))[None])
        saved = tree_flatten(codec.prvq.parameters())
        if float32_latent:
            codec.prvq.update(tree_map(lambda a: a.astype(mx.float32), codec.prvq.parameters()))
        try:
            out = codec.decode(clean.transpose(0, 2, 1))[0, 0]
            mx.eval(out)
        finally:
            codec.prvq.update(tree_unflatten(saved))
        return _np(out, np.float32)

    def decode_text(self, ids) -> str:
        return self._require()._decode_text(mx.array([int(i) for i in ids], dtype=mx.int32))

    def decode_transcript(self, tokens) -> str:
        from mlx_audio.stt.models.nemotron_asr import tokenizer as rnnt_tokenizer

        self._require()
        return rnnt_tokenizer.decode([int(t) for t in tokens], self.model.config.rnnt_vocabulary).strip()

    def _frame_tokens(self, encoder: mx.array) -> list[list[int]]:
        """Non-special RNNT ids per encoder frame, by mlx-audio's streaming RNNT state."""
        from mlx_audio.sts.models.nemotron_voicechat.streaming import _RNNTState

        state = _RNNTState(SimpleNamespace(config=self.model.config, model=self.model))
        out = []
        for t in range(encoder.shape[0]):
            before = len(state.tokens)
            state.step(encoder[t][None, None])
            out.append([int(x) for x in state.tokens[before:]])
        return out

    # -- offline

    def offline(
        self,
        audio: np.ndarray,
        *,
        system_prompt: str | None = None,
        seed: int = 0,
        extra_decoding_seconds: float = 0.0,
        with_logits: bool = False,
    ) -> OfflineRun:
        from mlx_audio.sts.models.nemotron_voicechat import session as ma_session

        sess = self._require()
        wave = _as_audio(audio)
        seen = SimpleNamespace(mel=None, encoder=None, rnnt_tokens=None, raw_codes=None)
        lm_outputs: list = []
        orig_mel = ma_session.log_mel_spectrogram
        orig_tok = ma_session.rnnt_tokenizer
        orig_rnnt = sess._rnnt_decode
        orig_replace = sess._replace_control_codes

        def log_mel_spectrogram(x, args):
            out = orig_mel(x, args)
            seen.mel = out
            return out

        def rnnt_decode(encoded, length):
            seen.encoder = encoded[0, :length]
            return orig_rnnt(encoded, length)

        def rnnt_text(tokens, vocabulary, *a, **k):
            seen.rnnt_tokens = [int(t) for t in tokens]
            return orig_tok.decode(tokens, vocabulary, *a, **k)

        def replace_control_codes(codes):
            seen.raw_codes = codes
            return orig_replace(codes)

        tok_proxy = SimpleNamespace(is_special_token=orig_tok.is_special_token, decode=rnnt_text)
        with ExitStack() as stack:
            stack.enter_context(_patched(ma_session, "log_mel_spectrogram", log_mel_spectrogram))
            stack.enter_context(_patched(ma_session, "rnnt_tokenizer", tok_proxy))
            stack.enter_context(_patched(sess, "_rnnt_decode", rnnt_decode))
            stack.enter_context(_patched(sess, "_replace_control_codes", replace_control_codes))
            if with_logits:
                stack.enter_context(_recording_calls(self.model.stt_model, lm_outputs))
            t0 = time.perf_counter()
            result = sess.generate(
                mx.array(wave),
                system_prompt=system_prompt,
                seed=seed,
                extra_decoding_seconds=extra_decoding_seconds,
                use_language_cache=True,
            )
            mx.eval(result.audio)
            wall = time.perf_counter() - t0

        text_ids = _np(result.text_tokens, np.int32)
        n = text_ids.shape[0]
        text_logits = function_logits = None
        if with_logits and n:
            outs = lm_outputs[-n:]
            text_logits = np.stack([_np(o.text_logits[0, -1], np.float32) for o in outs])
            function_logits = np.stack([_np(o.function_logits[0, -1], np.float32) for o in outs])
        if seen.raw_codes is None:
            raise RuntimeError("mlx-audio generate did not pass its codes through _replace_control_codes")
        frame_tokens = None
        if seen.encoder is not None and self.model.config.rnnt_vocabulary:
            frame_tokens = self._frame_tokens(seen.encoder)
        return OfflineRun(
            text_ids=text_ids,
            function_ids=_np(result.function_tokens, np.int32),
            codes=_np(seen.raw_codes[0], np.int32),
            decoded_codes=_np(result.audio_codes, np.int32),
            audio=_np(result.audio, np.float32),
            text=result.text,
            transcript=result.user_transcript or "",
            transcript_tokens=seen.rnnt_tokens,
            mel=None if seen.mel is None else _np(seen.mel[0], np.float32),
            encoder=None if seen.encoder is None else _np(seen.encoder, np.float32),
            text_logits=text_logits,
            function_logits=function_logits,
            wall_s=wall,
            transcript_frame_tokens=frame_tokens,
        )

    # -- streaming

    def stream(
        self,
        audio: np.ndarray,
        *,
        system_prompt: str | None = None,
        seed: int = 0,
        chunk_samples: int = 1280,
        profile: bool = False,
        with_logits: bool = False,
    ) -> StreamRun:
        sess = self._require()
        wave = _as_audio(audio)
        if isinstance(chunk_samples, bool) or not isinstance(chunk_samples, int) or chunk_samples < 1:
            raise ValueError(f"chunk_samples must be a positive int, got {chunk_samples!r}")
        t0 = time.perf_counter()
        s = sess.create_streaming_session(system_prompt=system_prompt, seed=seed)
        create_s = time.perf_counter() - t0

        frames: list[dict] = []
        mel_chunks: list = []
        current: dict = {}
        orig_step = s._step_audio_frame
        orig_perception = s._perception_step
        orig_language = s._language_step
        orig_replace = sess._replace_control_codes

        def step_audio_frame(frame):
            current.clear()
            before = len(s._rnnt.tokens)
            f0 = time.perf_counter()
            events = orig_step(frame)
            current["frame_ms"] = (time.perf_counter() - f0) * 1e3
            current["rnnt_tokens"] = [int(t) for t in s._rnnt.tokens[before:]]
            current["text_id"] = int(s._text_tokens[-1])
            current["function_id"] = int(s._function_tokens[-1])
            frames.append(dict(current))
            return events

        def perception_step(frame):
            projected, encoded = orig_perception(frame)
            current["encoder"] = encoded[0, -1]
            return projected, encoded

        def language_step(inputs):
            out = orig_language(inputs)
            current["text_logits"] = out.text_logits[0, -1]
            current["function_logits"] = out.function_logits[0, -1]
            return out

        def replace_control_codes(codes):
            current["codes"] = codes[0, -1]
            return orig_replace(codes)

        events: list = []
        first_audio_s = first_text_s = None
        with ExitStack() as stack:
            stack.enter_context(_patched(s, "_step_audio_frame", step_audio_frame))
            stack.enter_context(_patched(s, "_perception_step", perception_step))
            stack.enter_context(_patched(sess, "_replace_control_codes", replace_control_codes))
            if with_logits:
                stack.enter_context(_patched(s, "_language_step", language_step))
            if s._mel_stream is not None:
                orig_push = s._mel_stream.push

                def mel_push(samples, *a, **k):
                    out = orig_push(samples, *a, **k)
                    mel_chunks.append(out)
                    return out

                stack.enter_context(_patched(s._mel_stream, "push", mel_push))
            start = time.perf_counter()
            calls = [
                lambda c=wave[i : i + chunk_samples]: s.push_audio(c) for i in range(0, wave.shape[0], chunk_samples)
            ]
            calls.append(lambda: s.flush(pad_partial=True))
            for call in calls:
                new = call()
                now = time.perf_counter() - start
                for e in new:
                    if e.kind == "audio" and first_audio_s is None:
                        first_audio_s = now
                    if e.kind == "assistant_text_delta" and first_text_s is None:
                        first_text_s = now
                events.extend(new)
            wall = time.perf_counter() - start

        audio_events = [e for e in events if e.kind == "audio"]
        if len(audio_events) != len(frames):
            raise RuntimeError(f"mlx-audio emitted {len(audio_events)} audio events for {len(frames)} frames")
        q = self.model.config.tts.num_quantizers
        codes = np.stack([_np(f["codes"], np.int32) for f in frames]) if frames else np.zeros((0, q), np.int32)
        out_audio = (
            np.concatenate([_np(e.samples, np.float32) for e in audio_events])
            if audio_events
            else np.zeros((0,), np.float32)
        )
        mels = [m for m in mel_chunks if m.shape[1]]
        rnnt_on = bool(self.model.config.rnnt_vocabulary)
        timings = [{"frame_ms": f["frame_ms"]} for f in frames] if profile else None
        summary = None
        if profile and frames:
            ms = np.array([f["frame_ms"] for f in frames])
            summary = {
                "frames": len(frames),
                "frame_ms_mean": float(ms.mean()),
                "frame_ms_p50": float(np.median(ms)),
                "frame_ms_max": float(ms.max()),
            }
        return StreamRun(
            text_ids=np.array([f["text_id"] for f in frames], dtype=np.int32),
            function_ids=np.array([f["function_id"] for f in frames], dtype=np.int32),
            codes=codes,
            decoded_codes=(
                np.stack([_np(e.audio_codes, np.int32) for e in audio_events])
                if audio_events
                else np.zeros((0, q), np.int32)
            ),
            audio=out_audio,
            tail=np.zeros((0,), np.float32),  # mlx-audio's flush clears the codec without emitting its tail
            text=s._text.text,
            transcript=s._rnnt.text,
            transcript_tokens=[int(t) for t in s._rnnt.tokens] if rnnt_on else None,
            events=[_event_dict(e) for e in events],
            mel=np.concatenate([_np(m[0], np.float32) for m in mels]) if mels else None,
            encoder=np.stack([_np(f["encoder"], np.float32) for f in frames]) if frames else None,
            text_logits=np.stack([_np(f["text_logits"], np.float32) for f in frames])
            if with_logits and frames
            else None,
            function_logits=np.stack([_np(f["function_logits"], np.float32) for f in frames])
            if with_logits and frames
            else None,
            frame_timings=timings,
            profile_summary=summary,
            create_s=create_s,
            first_audio_s=first_audio_s,
            first_text_s=first_text_s,
            wall_s=wall,
            transcript_frame_tokens=[f["rnnt_tokens"] for f in frames] if rnnt_on else None,
        )


# --------------------------------------------------------------------------- known departures

# Where mlx-audio 0.6.2 computes EAR-TTS differently from mlx-vlm 0.7.10 (and this project's default
# numerics): file:line in mlx_audio/sts/models/nemotron_voicechat/. Each one can be undone in memory for
# one run (`departures_undone`), which is how the harness verifies the documented difference and how
# parity_tests/test_peers_mlx_audio_departures.py pins each cause.
DEPARTURES = {
    "mixture_sampling": "tts.py:93-96 (MoGHead.infer): the mixture component is drawn with "
    "mx.random.categorical on top-p'd log-probabilities; mlx-vlm draws one uniform "
    "tensor and adds its Gumbel transform -log(-log(u + 1e-8) + 1e-8) itself, so the "
    "same seed gives other components",
    "norm_dtype": "tts.py:23 (RMSNorm) and t5gemma.py:14 (RMSNorm): the EAR-TTS MLP / MoG / fusion norms "
    "and the character encoder's norms compute in the activations' dtype with 1 + w in the "
    "weight dtype (bf16 on bf16 weights); mlx-vlm's OffsetRMSNorm computes them in float32",
    "depthsum_dtype": "tts.py:324-331 (EARTTSModel.depthsum_embedding): the codebook vectors are summed in "
    "the codebooks' dtype (bf16); mlx-vlm sums them into a float32 accumulator",
    "continuation_flags": "tts.py:193-201 (CharAwareSubwordEncoder.set_tokenizer): the subword "
    "continuation flags are rebuilt from the tokenizer (a token continues a word unless "
    "it starts with 'Ġ', '▁' or '<'), replacing the checkpoint's stored "
    "is_continuation buffer, which mlx-vlm uses",
}
CODE_DEPARTURES = tuple(DEPARTURES)


class _RandomWithGumbel:
    """`mx.random` as seen by mlx-audio's tts.py, with `categorical` drawing as mlx-vlm does."""

    def __getattr__(self, key):
        return getattr(mx.random, key)

    @staticmethod
    def categorical(logits, axis=-1):
        u = mx.random.uniform(shape=logits.shape)
        return mx.argmax(logits.astype(mx.float32) - mx.log(-mx.log(u + 1e-8) + 1e-8), axis=axis)


class _MxWithGumbel:
    random = _RandomWithGumbel()

    def __getattr__(self, key):
        return getattr(mx, key)


def _float32_norm(self, x):
    return mx.fast.rms_norm(x.astype(mx.float32), 1.0 + self.weight.astype(mx.float32), self.eps).astype(x.dtype)


@contextmanager
def departures_undone(backend: MlxAudioBackend, names=CODE_DEPARTURES):
    """For the duration of the block, mlx-audio computes as mlx-vlm does at the named places (in memory;
    everything restored afterwards)."""
    from mlx_audio.sts.models.nemotron_voicechat import t5gemma as ma_t5gemma, tts as ma_tts

    unknown = set(names) - set(DEPARTURES)
    if unknown:
        raise KeyError(f"unknown mlx-audio departures {sorted(unknown)}; known: {sorted(DEPARTURES)}")
    ear = backend.model.tts_model.tts_model
    with ExitStack() as stack:
        if "mixture_sampling" in names:
            stack.enter_context(_patched(ma_tts, "mx", _MxWithGumbel()))
        if "norm_dtype" in names:
            stack.enter_context(_patched(ma_tts.RMSNorm, "__call__", _float32_norm))
            stack.enter_context(_patched(ma_t5gemma.RMSNorm, "__call__", _float32_norm))
        if "depthsum_dtype" in names:
            orig = ear.depthsum_embedding

            def depthsum_embedding(codes):
                books = ear.rvq_embs
                ear.rvq_embs = books.astype(mx.float32)
                try:
                    return orig(codes)
                finally:
                    ear.rvq_embs = books

            stack.enter_context(_patched(ear, "depthsum_embedding", depthsum_embedding))
        if "continuation_flags" in names and TOKENIZER_BUFFERS[0] in backend.stored_tokenizer_buffers:
            flags = ear.embed_subword.subword_flag_emb
            rebuilt = flags.is_continuation  # a module parameter (not in vars()): swapped by hand
            flags.is_continuation = mx.array(backend.stored_tokenizer_buffers[TOKENIZER_BUFFERS[0]])
            stack.callback(setattr, flags, "is_continuation", rebuilt)
        yield


__all__ = [
    "MlxAudioBackend",
    "DEPARTURES",
    "CODE_DEPARTURES",
    "departures_undone",
    "UnsupportedCheckpoint",
    "translate_config",
    "check_config",
    "TOKENIZER_BUFFERS",
]
