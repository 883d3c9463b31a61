"""The checkpoint validator: the expected-tensor table against model.md, and one test per
kind of mismatch, each on a mutated copy of a tiny mlx-lm checkpoint."""

from __future__ import annotations

import json
import os
import shutil
import struct
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
from tiny_models import tiny_checkpoint

from lily.checkpoint.config import parse_config
from lily.checkpoint.loader import load_checkpoint
from lily.checkpoint.safetensors_mmap import NUMPY_DTYPES, Shard, TensorInfo
from lily.checkpoint.validate import ValidationError, claims_real_model, expected_layout, validate

SHARD = "model.safetensors"
P = "language_model.model."

# model.md section 1, typed from the spec (not from lily.checkpoint.validate).
REAL_TEXT_CONFIG = {
    "hidden_size": 2048,
    "num_hidden_layers": 40,
    "vocab_size": 248320,
    "num_attention_heads": 16,
    "num_key_value_heads": 2,
    "linear_num_key_heads": 16,
    "linear_num_value_heads": 32,
    "num_experts": 256,
    "num_experts_per_tok": 8,
    "moe_intermediate_size": 512,
    "shared_expert_intermediate_size": 512,
    "eos_token_id": [248046, 248044],
    "layer_types": ["full_attention" if i % 4 == 3 else "linear_attention" for i in range(40)],
}


def real_config_json(base: dict) -> dict:
    """A tiny checkpoint's config.json (as mlx-lm wrote it) with the real model's values."""
    config = json.loads(json.dumps(base))
    config["text_config"].update(REAL_TEXT_CONFIG)
    config["eos_token_id"] = REAL_TEXT_CONFIG["eos_token_id"]
    quant = {"group_size": 64, "bits": 4, "mode": "affine"}
    for i in range(40):
        for gate in ("mlp.gate", "mlp.shared_expert_gate"):
            quant[f"{P}layers.{i}.{gate}"] = {"group_size": 64, "bits": 8}
    config["quantization"] = config["quantization_config"] = quant
    return config


@pytest.fixture(scope="module")
def small() -> Path:
    return tiny_checkpoint("small")


@pytest.fixture(scope="module")
def real_config(small):
    return parse_config(real_config_json(json.loads((small / "config.json").read_text())))


def write_tensors(path: Path, tensors: dict[str, tuple[str, np.ndarray]]) -> None:
    header, offset = {}, 0
    for name, (dtype, array) in tensors.items():
        offset += -offset % 16
        header[name] = {
            "dtype": dtype,
            "shape": list(array.shape),
            "data_offsets": [offset, offset + array.nbytes],
        }
        offset += array.nbytes
    encoded = json.dumps(header).encode()
    encoded += b" " * (-(8 + len(encoded)) % 16)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(encoded)) + encoded)
        for _, (_, array) in tensors.items():
            f.write(bytes(-f.tell() % 16))
            f.write(array.tobytes())


def mutated(source: Path, destination: Path, tensors=None, config=None) -> Path:
    """Copy a checkpoint, letting `tensors` edit {name: (dtype, array)} and `config` the JSON."""
    shutil.copytree(source, destination)
    if tensors is not None:
        shard = Shard(destination / SHARD)
        contents = {n: (i.dtype, np.array(shard.array(n))) for n, i in shard.tensors.items()}
        del shard
        tensors(contents)
        # Write beside and rename, so the old map (if still alive) keeps its inode.
        write_tensors(destination / "new.tmp", contents)
        os.replace(destination / "new.tmp", destination / SHARD)
        index_path = destination / "model.safetensors.index.json"
        index = json.loads(index_path.read_text())
        index["weight_map"] = dict.fromkeys(sorted(contents), SHARD)
        index_path.write_text(json.dumps(index))
    if config is not None:
        raw = json.loads((destination / "config.json").read_text())
        config(raw)
        (destination / "config.json").write_text(json.dumps(raw))
    return destination


# --- the expected table -----------------------------------------------------------------


def test_real_layout_matches_model_md(real_config):
    tensors = expected_layout(real_config).tensors()

    def shapes(base):
        return tuple(
            tensors[f"{base}.{p}"].shape if f"{base}.{p}" in tensors else None
            for p in ("weight", "scales")
        )

    # model.md section 3, row by row (weight u32 / scales bf16).
    assert shapes(P + "embed_tokens") == ((248320, 256), (248320, 32))
    assert shapes("language_model.lm_head") == ((248320, 256), (248320, 32))
    gdn, attn, mlp = P + "layers.0.linear_attn.", P + "layers.3.self_attn.", P + "layers.7.mlp."
    assert shapes(gdn + "in_proj_qkv") == ((8192, 256), (8192, 32))
    assert shapes(gdn + "in_proj_z") == ((4096, 256), (4096, 32))
    assert shapes(gdn + "in_proj_a") == shapes(gdn + "in_proj_b") == ((32, 256), (32, 32))
    assert shapes(gdn + "out_proj") == ((2048, 512), (2048, 64))
    assert shapes(attn + "q_proj") == ((8192, 256), (8192, 32))
    assert shapes(attn + "k_proj") == shapes(attn + "v_proj") == ((512, 256), (512, 32))
    assert shapes(attn + "o_proj") == ((2048, 512), (2048, 64))
    assert shapes(mlp + "gate") == ((256, 512), (256, 32))
    assert shapes(mlp + "switch_mlp.gate_proj") == ((256, 512, 256), (256, 512, 32))
    assert shapes(mlp + "switch_mlp.up_proj") == ((256, 512, 256), (256, 512, 32))
    assert shapes(mlp + "switch_mlp.down_proj") == ((256, 2048, 64), (256, 2048, 8))
    assert shapes(mlp + "shared_expert.gate_proj") == ((512, 256), (512, 32))
    assert shapes(mlp + "shared_expert.down_proj") == ((2048, 64), (2048, 8))
    assert shapes(mlp + "shared_expert_gate") == ((1, 512), (1, 32))
    plain = {
        gdn + "conv1d.weight": ((8192, 4, 1), "BF16"),
        gdn + "A_log": ((32,), "F32"),
        gdn + "dt_bias": ((32,), "BF16"),
        gdn + "norm.weight": ((128,), "BF16"),
        attn + "q_norm.weight": ((256,), "BF16"),
        P + "layers.5.post_attention_layernorm.weight": ((2048,), "BF16"),
        P + "norm.weight": ((2048,), "BF16"),
    }
    for name, (shape, dtype) in plain.items():
        assert (tensors[name].shape, tensors[name].dtypes[0]) == (shape, dtype), name
    # Per layer: 2 norms; GDN 5 projections x 3 + conv, A_log, dt_bias, norm; attention
    # 4 projections x 3 + q_norm, k_norm; MoE 8 projections x 3. Plus embed, lm_head, final norm.
    gdn_layer, attention_layer, moe = 2 + 5 * 3 + 4, 2 + 4 * 3 + 2, 8 * 3
    assert len(tensors) == 30 * gdn_layer + 10 * attention_layer + 40 * moe + 2 * 3 + 1
    assert not any(
        P + "layers.3.linear_attn" in n or P + "layers.0.self_attn" in n for n in tensors
    )


def layout_infos(config) -> dict[str, TensorInfo]:
    return {
        t.name: TensorInfo(
            t.name, t.dtypes[0], t.shape, Path("x"), 0, NUMPY_DTYPES[t.dtypes[0]].itemsize
        )
        for t in expected_layout(config).tensors().values()
    }


def test_strict_accepts_the_real_layout_and_refuses_a_4_bit_router(real_config):
    assert claims_real_model(real_config)
    infos = layout_infos(real_config)
    validate(real_config, infos, "strict")
    router = P + "layers.12.mlp.gate"
    overrides = dict(real_config.quant_overrides)
    del overrides[router]
    four_bit_router = replace(real_config, quant_overrides=overrides)
    infos[router + ".weight"] = replace(infos[router + ".weight"], shape=(256, 256))
    validate(four_bit_router, infos, "family")  # a consistent 4-bit router is fine in the family
    with pytest.raises(
        ValidationError, match=rf"config quantizes {router} as 4-bit group 64.*8-bit"
    ):
        validate(four_bit_router, infos, "strict")


# --- mutated tiny checkpoints -------------------------------------------------------------


def test_unmutated_tiny_checkpoint_passes(small):
    assert load_checkpoint(small, level="family").level == "family"


@pytest.mark.parametrize(
    ("name", "new_dtype", "message"),
    [
        (
            P + "layers.0.linear_attn.in_proj_z.weight",
            "F32",
            r"in_proj_z.weight has dtype F32, but the config quantizes .* must be U32",
        ),
        (
            P + "layers.1.mlp.shared_expert.up_proj.scales",
            "F16",
            r"up_proj.scales has dtype F16, the config implies BF16",
        ),
        (
            P + "layers.2.linear_attn.dt_bias",
            "F16",
            r"dt_bias has dtype F16, the config implies BF16",
        ),
    ],
)
def test_dtype_contradicting_config(small, tmp_path, name, new_dtype, message):
    def retype(t):
        array = t[name][1]
        t[name] = (new_dtype, array.view(NUMPY_DTYPES[new_dtype]))

    with pytest.raises(ValidationError, match=message):
        load_checkpoint(mutated(small, tmp_path / "m", tensors=retype))


def test_shape_contradicting_config(small, tmp_path):
    base = P + "layers.4.linear_attn.in_proj_z"

    def drop_a_head(t):
        for part in ("weight", "scales", "biases"):
            dtype, array = t[f"{base}.{part}"]
            t[f"{base}.{part}"] = (dtype, array[:-128])

    with pytest.raises(
        ValidationError,
        match=r"in_proj_z.weight has shape \[384, 16\], the config implies \[512, 16\]",
    ):
        load_checkpoint(mutated(small, tmp_path / "m", tensors=drop_a_head))


@pytest.mark.parametrize("gate", ["mlp.gate", "mlp.shared_expert_gate"])
def test_gate_with_wrong_bit_width(small, tmp_path, gate):
    base = f"{P}layers.5.{gate}"

    def requantize_4_bit(t):
        dtype, weight = t[base + ".weight"]
        t[base + ".weight"] = (dtype, np.ascontiguousarray(weight[:, : weight.shape[1] // 2]))

    with pytest.raises(
        ValidationError,
        match=rf"{base}.weight is 4-bit \(16 u32 columns for 128 inputs\), "
        "but the config says 8-bit",
    ):
        load_checkpoint(mutated(small, tmp_path / "m", tensors=requantize_4_bit))


def test_missing_tensor(small, tmp_path):
    name = P + "layers.6.linear_attn.A_log"
    with pytest.raises(ValidationError, match=rf"missing tensors: {name}$"):
        load_checkpoint(mutated(small, tmp_path / "m", tensors=lambda t: t.pop(name)))


def test_unexpected_tensors_name_the_first_few_and_count(small, tmp_path):
    def add_extras(t):
        for i in range(7):
            t[f"{P}layers.0.mlp.extra_{i}.weight"] = ("F32", np.zeros(4, np.float32))

    with pytest.raises(
        ValidationError,
        match=r"unexpected tensors: language_model\.model\.layers\.0\.mlp\.extra_0\.weight, "
        r".*extra_4\.weight, \.\.\. \(7 in total\)",
    ):
        load_checkpoint(mutated(small, tmp_path / "m", tensors=add_extras))


def test_vision_tower_and_mtp_tensors_are_skipped(small, tmp_path):
    extras = [
        "vision_tower.blocks.0.attn.qkv.weight",
        "language_model.mtp.fc.weight",
        "language_model.vision_tower.merger.weight",
    ]

    def add_skipped(t):
        for name in extras:
            t[name] = ("BF16", np.zeros((2, 64), np.uint16))

    checkpoint = load_checkpoint(mutated(small, tmp_path / "m", tensors=add_skipped))
    assert set(extras) <= set(checkpoint.tensors)


def test_checkpoint_without_an_mtp_head_says_so(small):
    assert not load_checkpoint(small).has_mtp_head


def test_mtp_head_is_validated_when_present():
    checkpoint = load_checkpoint(tiny_checkpoint("small", mtp_head=True))
    assert checkpoint.has_mtp_head
    mtp = {name: info for name, info in checkpoint.locations.items() if name.startswith("mtp.")}
    main = {n: i for n, i in checkpoint.locations.items() if not n.startswith("mtp.")}
    # The head as model.md's MTP section lays it out: fc over [embedding | hidden] (2 x 128
    # inputs, 4-bit), the router 8-bit, routed experts stacked.
    assert mtp["mtp.fc.weight"].shape == (128, 2 * 128 * 4 // 32)
    assert mtp["mtp.layers.0.mlp.gate.weight"].shape == (16, 128 * 8 // 32)
    assert mtp["mtp.layers.0.mlp.switch_mlp.down_proj.weight"].shape == (16, 128, 64 * 4 // 32)

    partial = {**main, **{n: i for n, i in mtp.items() if "shared_expert." not in n}}
    with pytest.raises(
        ValidationError,
        match=r"multi-token-prediction head \(mtp\.\*\) is incomplete.*missing tensors: "
        r"mtp\.layers\.0\.mlp\.shared_expert\.down_proj\.biases",
    ):
        validate(checkpoint.config, partial, "family")
    name = "mtp.layers.0.mlp.gate.weight"
    four_bit = {**main, **mtp, name: replace(mtp[name], shape=(16, 128 * 4 // 32))}
    with pytest.raises(ValidationError, match=r"mtp\.layers\.0\.mlp\.gate\.weight is 4-bit"):
        validate(checkpoint.config, four_bit, "family")


def test_config_disagreeing_with_the_tensors(small, tmp_path):
    def more_experts(c):
        c["text_config"]["num_experts"] = 32

    with pytest.raises(
        ValidationError,
        match=r"mlp\.gate\.weight has shape \[16, 32\], the config implies \[32, 32\]",
    ):
        load_checkpoint(mutated(small, tmp_path / "m", config=more_experts))


@pytest.mark.parametrize(
    ("key", "value", "message"),
    [
        ("head_dim", 128, "head_dim is 128, the architecture requires 256"),
        ("linear_conv_kernel_dim", 3, "linear_conv_kernel_dim is 3, the architecture requires 4"),
        ("attn_output_gate", False, "attn_output_gate is False, the architecture requires True"),
        (
            "full_attention_interval",
            2,
            "layer pattern LLLFLLLF does not follow full_attention_interval 2",
        ),
    ],
)
def test_family_fixes_the_architecture(small, tmp_path, key, value, message):
    def change(c):
        c["text_config"][key] = value
        # Without the M-RoPE sections, whose sum is checked against the head's rotary dims
        # when the config is parsed: here the family's check is the one under test.
        c["text_config"]["rope_parameters"].pop("mrope_section", None)

    with pytest.raises(ValidationError, match=message):
        load_checkpoint(mutated(small, tmp_path / "m", config=change))


@pytest.mark.parametrize(
    ("path", "value", "message"),
    [
        (
            ("rope_parameters", "rope_theta"),
            10000.0,
            "rope_theta is 10000.0, the real model has 10000000.0",
        ),
        (("rms_norm_eps",), 1e-5, "rms_norm_eps is 1e-05, the real model has 1e-06"),
        (
            ("max_position_embeddings",),
            32768,
            "max_position_embeddings is 32768, the real model has 262144",
        ),
        (("norm_topk_prob",), False, "norm_topk_prob is False, the real model has True"),
        (
            ("rope_parameters", "mrope_section"),
            [16, 8, 8],
            r"rope_parameters\.mrope_section is \[16, 8, 8\], the real model has \[11, 11, 10\]",
        ),
        (("eos_token_id",), [151645], r"eos_token_id \[151645\] is not one of \[248044, 248046\]"),
    ],
)
def test_wrong_config_value_under_strict(small, tmp_path, path, value, message):
    def real_but_one(c):
        c.update(real_config_json(c))
        target = c["text_config"]
        for key in path[:-1]:
            target = target[key]
        target[path[-1]] = value
        if path == ("eos_token_id",):
            c["eos_token_id"] = value

    checkpoint_dir = mutated(small, tmp_path / "m", config=real_but_one)
    # The config claims the real dims, so "auto" validates strictly, and only this value is wrong.
    with pytest.raises(ValidationError, match=rf"^config\.json \(strict\): {message}$"):
        load_checkpoint(checkpoint_dir)
