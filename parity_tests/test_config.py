"""config.json parsing: round trip, non-standard JSON tokens, and every rejection naming its key."""

import json
import math

import pytest

from voicechat.errors import ConfigError
from voicechat.model.config import VoiceChatConfig, dump_config, parse_config_text
from voicechat.synthetic.presets import PRESETS, preset_dict


@pytest.mark.parametrize("preset", PRESETS)
def test_round_trip(preset):
    cfg = VoiceChatConfig.from_dict(preset_dict(preset))
    text = dump_config(cfg)
    assert "Infinity" in text  # time_step_limit is written as the published converter does
    again = parse_config_text(text)
    assert again.to_dict() == cfg.to_dict()
    assert again.text_config.time_step_limit == (0.0, math.inf)


def test_nonstandard_json_tokens_accepted():
    d = preset_dict("tiny")
    d["text_config"]["time_step_limit"] = [0.0, float("inf")]
    d["some_future_key"] = float("nan")
    d["other"] = float("-inf")
    text = json.dumps(d, allow_nan=True)
    assert "NaN" in text and "-Infinity" in text and "Infinity" in text
    cfg = parse_config_text(text)
    assert cfg.text_config.time_step_limit[1] == math.inf


def test_unknown_keys_ignored_and_defaults_apply():
    d = preset_dict("tiny")
    d["audio_config"]["encoder"]["some_nemo_key"] = 3
    d["tts_config"]["character_encoder"]["rope_theta"] = 1.0
    del d["tts_config"]["top_p"]
    cfg = VoiceChatConfig.from_dict(d)
    assert cfg.tts_config.top_p == 0.95
    assert cfg.tts_config.rope_global_base_freq == 1_000_000.0


def test_flat_att_context_size_accepted():
    d = preset_dict("full")
    d["audio_config"]["encoder"]["att_context_size"] = [70, 0]
    assert VoiceChatConfig.from_dict(d).audio_config.encoder.left_context == 70


def test_num_hidden_layers_follows_pattern():
    d = preset_dict("full")
    d["text_config"]["num_hidden_layers"] = 3
    cfg = VoiceChatConfig.from_dict(d)
    assert cfg.text_config.num_hidden_layers == 56
    assert cfg.text_config.layer_types.count("mamba") == 27
    assert cfg.text_config.layer_types.count("attention") == 4
    assert cfg.text_config.layer_types.count("mlp") == 25


def _reject(mutate, key_in_message):
    d = preset_dict("tiny")
    mutate(d)
    with pytest.raises(ConfigError) as e:
        VoiceChatConfig.from_dict(d)
    assert key_in_message in str(e.value), str(e.value)


def test_rejects_wrong_model_type():
    _reject(lambda d: d.update(model_type="llama"), "model_type")


def test_rejects_missing_text_config():
    _reject(lambda d: d.pop("text_config"), "text_config")


def test_rejects_output_dim_mismatch():
    _reject(lambda d: d["audio_config"].update(output_dim=65), "audio_config.output_dim")


def test_rejects_quantizer_count_mismatch():
    _reject(lambda d: d["codec_config"].update(num_quantizers=5), "codec_config.num_quantizers")


def test_rejects_unknown_layer_letter():
    _reject(lambda d: d["text_config"].update(hybrid_override_pattern="M*E-"), "text_config.hybrid_override_pattern")


def test_rejects_wrong_text_model_type():
    _reject(lambda d: d["text_config"].update(model_type="mamba2"), "text_config.model_type")


def test_rejects_gqa_mismatch():
    _reject(lambda d: d["text_config"].update(num_key_value_heads=3), "text_config.num_key_value_heads")


def test_rejects_rnnt_vocabulary_size():
    _reject(lambda d: d.update(rnnt_vocabulary=["a"]), "rnnt_vocabulary")


def test_rejects_not_json():
    with pytest.raises(ConfigError, match="not valid JSON"):
        parse_config_text("{not json")
