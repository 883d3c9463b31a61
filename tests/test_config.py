"""config.json parsing: every value is type- and range-checked before anything is sized from it,
so a broken or hostile config is a ConfigError naming the key, at once, never a crash, a hang or
NaN activations later (a negative epsilon or a zero RoPE base poison every logit)."""

from __future__ import annotations

import json
import math
import time

import pytest
from tiny_models import tiny_checkpoint

from lily.checkpoint.config import ConfigError, load_config, parse_config
from lily.errors import CheckpointError


@pytest.fixture(scope="module")
def good() -> dict:
    return json.loads((tiny_checkpoint("small") / "config.json").read_text())


def _with(config: dict, dotted: str, value: object) -> dict:
    """A deep copy of `config` with the value at `a/b/c` replaced (or added)."""
    copy = json.loads(json.dumps(config))
    *parents, last = dotted.split("/")
    table = copy
    for key in parents:
        table = table[key]
    table[last] = value
    return copy


def test_the_tiny_config_parses(good):
    config = parse_config(good)
    assert config.rms_norm_eps == 1e-6 and config.rope_theta == 1e7
    assert config.num_hidden_layers == 8 and config.eos_token_ids == (962, 960)
    # The vision ids the tiny checkpoints lay out after <|endoftext|> (960), as the real one.
    assert (config.vision_start_token_id, config.image_token_id) == (969, 972)
    assert config.video_token_id == 973 and config.takes_images
    assert config.mrope_section == (11, 11, 10) and config.mrope_bounds == (33, 30)
    # 32 rotary frequencies: T H W interleaved, the last two temporal.
    assert config.rope_streams() == (0, 1, 2) * 10 + (0, 1)


def test_a_text_only_config_takes_no_images(good):
    text_only = json.loads(json.dumps(good))
    del text_only["vision_config"], text_only["image_token_id"]
    del text_only["text_config"]["rope_parameters"]["mrope_section"]
    config = parse_config(text_only)
    assert not config.takes_images and config.image_token_id is None
    assert config.mrope_section is None and set(config.rope_streams()) == {0}
    # Ids without a tower are not enough to take images.
    assert not parse_config(_with(text_only, "image_token_id", 972)).takes_images


T = "text_config/"
BAD_VALUES = [
    # Values that make the model compute NaN or inf.
    (T + "rms_norm_eps", -1.0),
    (T + "rms_norm_eps", 0.0),
    (T + "rms_norm_eps", math.nan),
    (T + "rms_norm_eps", 1e-40),
    (T + "rms_norm_eps", "1e-6"),
    (T + "rope_parameters/rope_theta", 0),
    (T + "rope_parameters/rope_theta", -10000.0),
    (T + "rope_parameters/rope_theta", math.inf),
    (T + "rope_parameters/rope_theta", math.nan),
    (T + "rope_parameters/partial_rotary_factor", 0.0),
    (T + "rope_parameters/partial_rotary_factor", 1.5),
    # Sizes: garbage, and values that would take minutes or all memory to lay out.
    (T + "num_hidden_layers", 100_000_000),
    (T + "num_hidden_layers", 0),
    (T + "num_hidden_layers", 8.0),
    (T + "num_hidden_layers", True),
    (T + "hidden_size", -128),
    (T + "hidden_size", 10**400),
    (T + "vocab_size", 2**32),
    (T + "num_attention_heads", 0),
    (T + "num_key_value_heads", "2"),
    (T + "head_dim", 0),
    (T + "linear_conv_kernel_dim", 10**6),
    (T + "num_experts", 512),
    (T + "num_experts_per_tok", 17),
    (T + "num_experts_per_tok", 0),
    (T + "moe_intermediate_size", [64]),
    (T + "max_position_embeddings", -1),
    (T + "full_attention_interval", 0),
    (T + "layer_types", "linear_attention"),
    (T + "layer_types", [["full_attention"]] * 8),
    # Flags are JSON booleans: bool("false") would be True.
    (T + "attn_output_gate", "false"),
    (T + "norm_topk_prob", 1),
    ("tie_word_embeddings", "no"),
    # Ids, quantization, structure.
    ("eos_token_id", [962, 1024]),
    ("eos_token_id", "962"),
    ("eos_token_id", [-1]),
    ("quantization/bits", 7),
    ("quantization/bits", math.inf),
    ("quantization/group_size", 0),
    ("quantization/language_model.model.layers.0.mlp.gate/bits", 16),
    ("quantization/mode", ["affine"]),
    (T + "rope_parameters", [10000000]),
    # Multimodal rotary sections: three counts summing to rotary_dim / 2, interleaved.
    (T + "rope_parameters/mrope_section", [11, 11, 11]),
    (T + "rope_parameters/mrope_section", [16, 16]),
    (T + "rope_parameters/mrope_section", [11, 11, "10"]),
    (T + "rope_parameters/mrope_interleaved", False),
    ("image_token_id", 1024),
    ("vision_start_token_id", -1),
    (T + "rope_parameters/type", {"x": 1}),
    (T + "rope_parameters/rope_type", "yarn"),
    ("text_config", ["not", "an", "object"]),
    ("model_type", 3),
]


@pytest.mark.parametrize(("key", "value"), BAD_VALUES, ids=[f"{k}={v!r}" for k, v in BAD_VALUES])
def test_each_bad_value_is_a_config_error_naming_its_key(good, key, value):
    with pytest.raises(ConfigError) as error:
        parse_config(_with(good, key, value))
    assert key.split("/")[-1] in str(error.value), error.value


def test_a_hundred_million_layers_are_refused_at_once(tmp_path, good):
    (tmp_path / "config.json").write_text(
        json.dumps(_with(good, T + "num_hidden_layers", 100_000_000)).replace(
            '"layer_types"', '"unused_layer_types"'
        )
    )
    started = time.monotonic()
    with pytest.raises(ConfigError, match="num_hidden_layers is 100000000"):
        load_config(tmp_path)
    assert time.monotonic() - started < 5  # laying the layers out took 37 minutes


@pytest.mark.parametrize(
    "text",
    [
        "[1, 2, 3]",
        "{",
        "[" * 100_000 + "]" * 100_000,
        '{"text_config": {"hidden_size": ' + "9" * 5000 + "}}",
        "\udcff",
    ],
    ids=["list", "truncated", "deeply nested", "5000 digits", "not utf-8"],
)
def test_a_malformed_file_is_a_config_error(tmp_path, text):
    (tmp_path / "config.json").write_bytes(text.encode("utf-8", "surrogateescape"))
    with pytest.raises(ConfigError):
        load_config(tmp_path)


def test_config_error_is_a_checkpoint_error():
    assert issubclass(ConfigError, CheckpointError)
