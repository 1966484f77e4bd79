"""Every config inconsistency is a ValueError naming the field and the values."""

import json

import pytest

from muse_spark.builder.tiny import tiny_configs
from muse_spark.config import MuseSpark1xConfig, MuseSparkDSparkConfig, load_config


def target_dict(**kw):
    d = tiny_configs()[0]
    d.update(kw)
    return d


def draft_dict(**kw):
    d = tiny_configs()[1]
    d.update(kw)
    return d


def test_tiny_configs_parse_and_cross_validate():
    t = MuseSpark1xConfig.from_dict(target_dict())
    d = MuseSparkDSparkConfig.from_dict(draft_dict())
    d.validate_against(t)
    assert d.gamma == 5 and d.draft_vocab_size == 131 and t.eos_token_id == (257,)


def test_round_trip_through_json(tmp_path):
    d = MuseSparkDSparkConfig.from_dict(draft_dict())
    d.save(tmp_path / "config.json")
    assert load_config(tmp_path) == d


@pytest.mark.parametrize(
    "change, message",
    [
        ({"metap": {"use_metap": True, "router_has_one_inf_dim": True, "base_width": 8, "metap_mode": "xyz"}},
         "Unknown Metap mode 'xyz'"),
        ({"num_attention_heads": 4, "num_key_value_heads": 3}, "num_attention_heads=4 is not divisible by num_key_value_heads=3"),
        ({"hidden_size": 0}, "hidden_size must be >= 1, got 0"),
        ({"head_dim": 15}, "head_dim=15 must be even"),
        ({"residual_dtype": "bfloat16"}, "residual_dtype must be 'float32'"),
        ({"torch_dtype": "int7"}, "unknown dtype 'int7'"),
        ({"eos_token_id": [300]}, "eos_token_id 300 is outside the vocabulary"),
        ({"eos_token_id": "x"}, "eos_token_id"),
        ({"rms_norm_eps": -1}, "rms_norm_eps must be positive"),
        ({"output_soft_cap_temp": 0}, "output_soft_cap_temp must be positive"),
        ({"vocab_size": "259"}, "field 'vocab_size' must be"),
    ],
)
def test_target_config_errors(change, message):
    with pytest.raises(ValueError) as e:
        MuseSpark1xConfig.from_dict(target_dict(**change))
    assert message in str(e.value)


def test_missing_field_is_named():
    d = target_dict()
    del d["hidden_size"]
    with pytest.raises(ValueError, match="missing required field 'hidden_size'"):
        MuseSpark1xConfig.from_dict(d)


@pytest.mark.parametrize(
    "change, message",
    [
        ({"layer_use_rope": [True, False]}, "Muse Spark DSpark layers must share their positional mode"),
        ({"use_rope": False, "layer_use_rope": [True, True]}, "Muse Spark DSpark layers must share their positional mode"),
        ({"layer_kv_geometry": [[2, 16], [4, 16]]}, "Muse Spark DSpark layers must share KV geometry"),
        ({"target_layer_ids": [2, 0]}, "target_layer_ids must be strictly increasing, got [2, 0]"),
        ({"target_layer_ids": [1, 1]}, "strictly increasing"),
        ({"target_layer_ids": []}, "target_layer_ids must not be empty"),
        ({"target_layer_ids": [-1, 2]}, "target_layer_ids must be >= 0"),
        ({"block_size": 0}, "block_size must be >= 1, got 0"),
        ({"markov_head_type": "lstm"}, "unknown markov_head_type 'lstm'"),
        ({"draft_vocab_size": 1000}, "draft_vocab_size must be in [1, vocab_size=259], got 1000"),
        ({"mask_token_id": 259}, "mask_token_id=259 is outside the vocabulary"),
        ({"dspark_draft_topk": 0}, "dspark_draft_topk must be in"),
        ({"markov_rank": -1}, "markov_rank must be >= 0"),
        ({"markov_rank": 0, "confidence_head_with_markov": True}, "confidence_head_with_markov needs markov_rank > 0"),
        ({"sample_from_anchor": False}, "sample_from_anchor=false is not supported"),
    ],
)
def test_draft_config_errors(change, message):
    with pytest.raises(ValueError) as e:
        MuseSparkDSparkConfig.from_dict(draft_dict(**change))
    assert message in str(e.value)


@pytest.mark.parametrize(
    "change, message",
    [
        ({"vocab_size": 300, "draft_vocab_size": 131}, "vocab_size=300 differs from the target's vocab_size=259"),
        ({"target_layer_ids": [0, 3]}, "target_layer_ids [3] out of range"),
        ({"target_layer_ids": [0, 7]}, "target_layer_ids [7] out of range"),
        ({"target_hidden_size": 32}, "target_hidden_size=32 differs from the target's hidden_size=64"),
    ],
)
def test_draft_against_target_errors(change, message):
    t = MuseSpark1xConfig.from_dict(target_dict())
    d = MuseSparkDSparkConfig.from_dict(draft_dict(**change))
    with pytest.raises(ValueError) as e:
        d.validate_against(t)
    assert message in str(e.value)


def test_last_target_layer_is_refused():
    t = MuseSpark1xConfig.from_dict(target_dict())  # 4 layers: ids must be in [0, 3)
    d = MuseSparkDSparkConfig.from_dict(draft_dict(target_layer_ids=[1, 3]))
    with pytest.raises(ValueError, match="its last layer 3 is excluded"):
        d.validate_against(t)


def test_output_multiplier_modes():
    mup = MuseSpark1xConfig.from_dict(target_dict(metap={"use_metap": True, "router_has_one_inf_dim": True,
                                                         "base_width": 16, "metap_mode": "mup"}))
    sp = MuseSpark1xConfig.from_dict(target_dict(metap={"use_metap": True, "router_has_one_inf_dim": True,
                                                        "base_width": 16, "metap_mode": "sp"}))
    off = MuseSpark1xConfig.from_dict(target_dict(metap={"use_metap": False}))
    assert mup.output_multiplier == pytest.approx(0.25)
    assert sp.output_multiplier == pytest.approx(0.5)
    assert off.output_multiplier == 1.0


def test_bad_json_file(tmp_path):
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ValueError, match="not valid JSON"):
        load_config(tmp_path)
    with pytest.raises(FileNotFoundError):
        load_config(tmp_path / "nowhere")


def test_config_file_dispatches_on_kind(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(draft_dict()))
    assert isinstance(load_config(tmp_path), MuseSparkDSparkConfig)
