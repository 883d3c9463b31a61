"""The DFlash drafter's config and weights (lily.checkpoint.dflash): the published config
parses and fits the real model, every mismatch is named, the quantized sidecar holds what the
original tensors say, and the tiny random drafter round-trips through it."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import huggingface_hub
import numpy as np
import pytest
from huggingface_hub.errors import EntryNotFoundError, LocalEntryNotFoundError
from tiny_models import tiny_checkpoint, tiny_drafter

from lily.checkpoint import hub
from lily.checkpoint.config import load_config, parse_config
from lily.checkpoint.demo import demo_config, write_safetensors
from lily.checkpoint.dflash import (
    DFLASH_REPO,
    DFLASH_REVISION,
    DFLASH_SHARD,
    SLIDING_ATTENTION,
    check_against_target,
    dflash_shapes,
    load_dflash,
    parse_dflash_config,
    quantize_dflash,
    random_drafter_config,
    random_hf_drafter,
    spread_layer_ids,
)
from lily.checkpoint.quant import bf16_to_float32, dequantize, float32_to_bf16, round_to_bf16
from lily.errors import CheckpointError, ConfigError

# z-lab/Qwen3.6-35B-A3B-DFlash's config at the pinned revision, as docs/dflash.md section 1
# quotes it from vllm-project/speculators#761 (typed from the doc, not from the parser).
REAL_DRAFTER_CONFIG = {
    "architectures": ["DFlashDraftModel"],
    "hidden_size": 2048,
    "num_hidden_layers": 8,
    "num_attention_heads": 32,
    "num_key_value_heads": 4,
    "head_dim": 128,
    "intermediate_size": 6144,
    "vocab_size": 248320,
    "attention_bias": False,
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": False,
    "block_size": 16,
    "num_target_layers": 40,
    "max_position_embeddings": 262144,
    "rope_theta": 10000000,
    "rope_scaling": {
        "rope_type": "yarn",
        "factor": 64.0,
        "original_max_position_embeddings": 4096,
        "beta_fast": 32.0,
        "beta_slow": 1.0,
    },
    "dflash_config": {"mask_token_id": 248070, "target_layer_ids": [1, 10, 19, 28, 37]},
}
# The real model's text config values the drafter is checked against (spec/model.md section 1).
REAL_TARGET = {"hidden_size": 2048, "num_hidden_layers": 40, "vocab_size": 248320}


def real_target():
    raw = demo_config()
    raw["text_config"] = {**raw["text_config"], **REAL_TARGET}
    raw["text_config"]["layer_types"] = [
        "linear_attention",
        "linear_attention",
        "linear_attention",
        "full_attention",
    ] * 10
    return parse_config(raw)


def drafter_config(**changes):
    raw = json.loads(json.dumps(REAL_DRAFTER_CONFIG))
    for key, value in changes.items():
        if key in ("mask_token_id", "target_layer_ids"):
            raw["dflash_config"][key] = value
        elif value is None:
            raw.pop(key)
        else:
            raw[key] = value
    return raw


def test_the_published_config_parses_and_fits_the_real_model():
    config = parse_dflash_config(REAL_DRAFTER_CONFIG)
    assert config.target_layer_ids == (1, 10, 19, 28, 37)
    assert (config.mask_token_id, config.block_size) == (248070, 16)
    assert config.rope.theta == 1e7 and config.rope.factor == 64
    assert config.rope.original_max_position_embeddings == 4096
    assert (config.rope.beta_fast, config.rope.beta_slow) == (32, 1)
    # No layer_types: every layer full attention, non-causal inside the block.
    assert not any(config.causal_in_block(i) for i in range(8))
    assert config.window(0) is None
    check_against_target(config, real_target())
    # docs/dflash.md: about 474 M parameters (0.95 GB in bf16, the "~905 MB" download).
    parameters = sum(int(np.prod(shape)) for shape in dflash_shapes(config).values())
    assert 473e6 < parameters < 475e6


def test_layer_ids_spread_as_the_real_drafter_s():
    assert spread_layer_ids(40, 5) == [1, 10, 19, 28, 37]
    assert spread_layer_ids(8, 3) == [1, 3, 5]


def test_every_difference_from_the_target_is_named():
    config = parse_dflash_config(
        drafter_config(hidden_size=1024, num_target_layers=48, vocab_size=262144)
    )
    with pytest.raises(CheckpointError) as caught:
        check_against_target(config, real_target())
    message = str(caught.value)
    for named in ("hidden_size is 1024", "num_target_layers is 48", "vocab_size is 262144"):
        assert named in message


@pytest.mark.parametrize(
    ("changes", "named"),
    [
        ({"target_layer_ids": [1, 10, 40]}, "target_layer_ids"),
        ({"target_layer_ids": [10, 1]}, "target_layer_ids"),
        ({"target_layer_ids": []}, "target_layer_ids"),
        ({"mask_token_id": 248320}, "mask_token_id"),
        ({"layer_types": ["full_attention"] * 7}, "layer_types"),
        ({"layer_types": ["sliding_attention"] * 8}, "sliding_window"),
        ({"rope_scaling": {"rope_type": "longrope", "factor": 4.0}}, "longrope"),
        ({"hidden_size": None}, "hidden_size"),
    ],
)
def test_a_bad_config_is_refused_naming_the_key(changes, named):
    with pytest.raises(ConfigError, match="DFlash drafter") as caught:
        parse_dflash_config(drafter_config(**changes))
    assert named in str(caught.value)


def test_sliding_layers_take_the_window_and_a_causal_block():
    types = ["sliding_attention"] * 4 + ["full_attention"] * 4
    config = parse_dflash_config(drafter_config(layer_types=types, sliding_window=2048))
    assert config.window(0) == 2048 and config.window(7) is None
    assert config.causal_in_block(0) and not config.causal_in_block(7)
    forced = parse_dflash_config(
        drafter_config(layer_types=types, sliding_window=2048, is_causal=False)
    )
    assert not forced.causal_in_block(0)


@pytest.fixture(scope="module")
def small_drafter_config():
    raw = json.loads((tiny_drafter("small") / "config.json").read_text())
    return parse_dflash_config(raw)


def test_quantizing_keeps_plain_norms_and_8_bit_projections(small_drafter_config):
    config = small_drafter_config
    hf = random_hf_drafter(config, np.random.default_rng(0))
    out = quantize_dflash(hf, config)
    # Norms are the gains as given (x * w), not the target's zero-centred 1 + w.
    for name in ("hidden_norm.weight", "layers.1.self_attn.k_norm.weight"):
        np.testing.assert_array_equal(bf16_to_float32(out[name]), round_to_bf16(hf[name]))
    # Each weight is recovered within two 8-bit steps of its group of 64, (max - min) / 255: half
    # a step of rounding to the code, up to half a step from the scale's bf16 rounding (255
    # codes x 2^-9), the bf16 rounding of the weight and of the bias (max |w| x 2^-9 each, up to
    # a step together in these groups; measured: 1.7 steps at most). A 4-bit code's step is 17
    # times an 8-bit one's.
    for name in ("fc", "layers.0.mlp.down_proj"):
        w = hf[name + ".weight"]
        recovered = dequantize(
            out[name + ".weight"], out[name + ".scales"], out[name + ".biases"], 8, 64
        )
        groups = w.reshape(w.shape[0], -1, 64)
        step = (groups.max(-1) - groups.min(-1)) / 255
        error = np.abs(recovered - w).reshape(groups.shape).max(-1)
        assert np.all(error <= 2 * step)
        assert out[name + ".weight"].shape[-1] == w.shape[1] // 4  # four 8-bit codes a word


def test_quantizing_names_missing_extra_and_misshapen_tensors(small_drafter_config):
    config = small_drafter_config
    hf = random_hf_drafter(config, np.random.default_rng(0))
    del hf["layers.0.mlp.up_proj.weight"]
    hf["layers.1.self_attn.o_proj.weight"] = hf["layers.1.self_attn.o_proj.weight"][:, :64]
    hf["lm_head.weight"] = np.zeros((4, 4), np.float32)
    with pytest.raises(CheckpointError) as caught:
        quantize_dflash(hf, config)
    message = str(caught.value)
    assert "layers.0.mlp.up_proj.weight is missing" in message
    assert "layers.1.self_attn.o_proj.weight has shape [128, 64], expected [128, 512]" in message
    assert "lm_head.weight is not a drafter tensor" in message


def test_the_tiny_drafter_loads_against_its_target_only():
    small, wide = tiny_checkpoint("small"), tiny_checkpoint("wide")
    drafter = load_dflash(tiny_drafter("small"), load_config(small))
    assert drafter.config.target_layer_ids == (1, 3, 5)
    assert drafter.config.layer_types[1] == SLIDING_ATTENTION
    assert drafter.tensors["fc.weight"].shape == (128, 3 * 128 // 4)
    assert drafter.tensors["norm.weight"].dtype == np.uint16
    with pytest.raises(CheckpointError, match="hidden_size is 128 where the target's is 256"):
        load_dflash(tiny_drafter("small"), load_config(wide))


def test_a_directory_without_the_shard_is_refused(tmp_path: Path):
    shutil.copy(tiny_drafter("small") / "config.json", tmp_path / "config.json")
    with pytest.raises(CheckpointError, match=DFLASH_SHARD):
        load_dflash(tmp_path, load_config(tiny_checkpoint("small")))


# ---- the drafter from a fake Hub -----------------------------------------------------------------


@pytest.fixture
def fake_drafter_repo(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """A drafter repo in miniature for the small tiny checkpoint: its config.json and its bf16
    tensors in one model.safetensors, no index. Downloads are served from it and recorded."""
    repo = tmp_path / "repo"
    repo.mkdir()
    raw = random_drafter_config(
        json.loads((tiny_checkpoint("small") / "config.json").read_text())["text_config"]
    )
    config = parse_dflash_config(raw)
    hf = random_hf_drafter(config, np.random.default_rng(11))
    write_safetensors(
        repo / "model.safetensors", {n: float32_to_bf16(v) for n, v in hf.items()}, {"format": "pt"}
    )
    (repo / "config.json").write_text(json.dumps(raw))
    downloads: list[str] = []

    def hf_hub_download(repo_id, filename, revision=None, local_files_only=False):
        assert (repo_id, revision) == (DFLASH_REPO, DFLASH_REVISION)
        if local_files_only:
            raise LocalEntryNotFoundError(filename)
        if not (repo / filename).is_file():
            raise EntryNotFoundError(filename)
        downloads.append(filename)
        return str(repo / filename)

    monkeypatch.setattr(huggingface_hub, "hf_hub_download", hf_hub_download)
    monkeypatch.setattr(hub, "hub_reachable", lambda: True)
    monkeypatch.setenv("LILY_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    return hf, config, downloads


def test_the_drafter_is_fetched_quantized_once_and_loads(fake_drafter_repo):
    hf, config, downloads = fake_drafter_repo
    target = load_config(tiny_checkpoint("small"))
    directory = hub.fetch_dflash(target)
    assert sorted(downloads) == ["config.json", "model.safetensors"]
    drafter = load_dflash(directory, target)
    # The bf16 originals, quantized as quantize_dflash does.
    expected = quantize_dflash({n: float32_to_bf16(v) for n, v in hf.items()}, config)
    for name, value in expected.items():
        np.testing.assert_array_equal(drafter.tensors[name], value)
    downloads.clear()
    assert hub.fetch_dflash(target) == directory and downloads == []


def test_without_the_hub_the_drafter_names_the_download_command(
    fake_drafter_repo, monkeypatch: pytest.MonkeyPatch
):
    monkeypatch.setattr(hub, "hub_reachable", lambda: False)
    command = f"`hf download {DFLASH_REPO} --revision {DFLASH_REVISION}`"
    with pytest.raises(CheckpointError, match="cannot be reached: download it once with") as e:
        hub.fetch_dflash(load_config(tiny_checkpoint("small")))
    assert command in str(e.value)


def test_a_drafter_for_another_model_is_refused_before_its_weights(fake_drafter_repo):
    _, _, downloads = fake_drafter_repo
    with pytest.raises(CheckpointError, match="hidden_size is 128 where the target's is 256"):
        hub.fetch_dflash(load_config(tiny_checkpoint("wide")))
    assert downloads == ["config.json"]
