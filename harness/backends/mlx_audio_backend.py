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
`mlx_vlm_backend.py` does (both drive the session through `peer_session.py`); the
conventions of the returned runs are that backend's (raw codes before control-code
replacement in `codes`, frame-major `mel` / `encoder`).
Not available: profiling (mlx-audio's streaming session has no profile; `frame_timings`
holds the wall time of each frame measured around `_step_audio_frame`), component
checks, and the codec tail (mlx-audio's `flush` clears the codec without emitting it).
"""

from __future__ import annotations

import json
import math
import os
import time
from contextlib import ExitStack, contextmanager
from pathlib import Path
from types import ModuleType, SimpleNamespace
from typing import Any

import mlx.core as mx
import numpy as np
from mlx.utils import tree_flatten

from .mlx_vlm_backend import unrunnable_quantized_modules
from .peer_session import PeerSessionBackend, _patched

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


# The folder's tts_config keys that mlx-audio reads as its TTS backbone's sizes (`backbone_config`).
_TTS_BACKBONE_KEYS = (
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "sliding_window",
)


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
                        "backbone_config": {k: tts[k] for k in _TTS_BACKBONE_KEYS if k in tts},
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
        *_TTS_BACKBONE_KEYS,
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


class MlxAudioBackend(PeerSessionBackend):
    """Drives mlx-audio's nemotron_voicechat (offline `generate` and the streaming session)."""

    name = "mlx-audio"

    def __init__(self):
        super().__init__()
        self.load_report: dict = {}
        self.version = "?"
        self.stored_tokenizer_buffers: dict = {}

    # -- loading

    def unrunnable_modules(self) -> list[str]:
        """Modules of the loaded checkpoint mlx-audio cannot run: the same two as mlx-vlm's
        (`UNRUNNABLE_QUANTIZED`), which its EAR-TTS also applies as dense layers; [] if none."""
        return unrunnable_quantized_modules(self.checkpoint) if self.checkpoint else []

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

    # -- where mlx-audio keeps what the shared driver (peer_session.py) needs; the codec is the same class
    # as mlx-vlm's (`mlx_audio.codec.models.nemotron_voicechat`)

    def _session_module(self) -> ModuleType:
        from mlx_audio.sts.models.nemotron_voicechat import session as ma_session

        return ma_session

    def _tts_config(self) -> Any:
        return self.model.config.tts

    def _codec_config(self) -> Any:
        return self.model.config.codec

    def _rnnt_state(self) -> Any:
        from mlx_audio.sts.models.nemotron_voicechat.streaming import _RNNTState

        return _RNNTState(SimpleNamespace(config=self.model.config, model=self.model))

    def _create_streaming(self, sess, *, system_prompt: str | None, seed: int, profile: bool) -> Any:
        return sess.create_streaming_session(system_prompt=system_prompt, seed=seed)  # no profile in mlx-audio

    def _profile(self, s, frames: list[dict]) -> tuple[list[dict] | None, dict | None]:
        """mlx-audio's streaming session has no profile: the wall time of each frame around
        `_step_audio_frame`, and its mean / median / max."""
        timings = [{"frame_ms": f["frame_ms"]} for f in frames]
        summary = None
        if frames:
            ms = np.array([f["frame_ms"] for f in frames])
            summary = {
                "frames": len(frames),
                "frame_ms_mean": float(ms.mean()),
                "frame_ms_p50": float(np.median(ms)),
                "frame_ms_max": float(ms.max()),
            }
        return timings, summary


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
