"""The DFlash block drafter (docs/dflash.md): its `config.json`, checked against the target, and
its tensors in the layout Lily keeps on the device.

The drafter is a small dense transformer that reads the target's residual stream after a few of
its layers (`target_layer_ids`) and drafts a whole block of tokens in one pass. It shares the
target's embedding and lm_head, so its own file holds only `fc`, `hidden_norm`, the layers and
the final `norm`, under the names of z-lab's module tree (no prefix).

Lily keeps it as a sidecar directory: the drafter's `config.json` as published, and
DFLASH_SHARD, which holds every projection as an MLX affine triple of DRAFTER_QUANT (8-bit:
whether the drafter keeps its acceptance at 4 bits is not established, docs/dflash.md section 2)
and every norm as bf16 gains used as they are (`x * w`: Qwen3's plain RMSNorm, not the
target's zero-centred `1 + w`).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from lily.checkpoint.config import (
    _REQUIRED,
    MAX_DIM,
    MAX_HEAD_DIM,
    MAX_HEADS,
    MAX_LAYERS,
    MAX_POSITIONS,
    MAX_VOCAB,
    RMS_NORM_EPS_RANGE,
    ModelConfig,
    QuantSpec,
    _Table,
    rope_block,
)
from lily.checkpoint.quant import bf16_to_float32, float32_to_bf16, quantize, round_to_bf16
from lily.errors import CheckpointError, ConfigError

# The drafter Lily fetches for the real model, at the only revision whose config is attested
# (docs/dflash.md section 1, [S]).
DFLASH_REPO = "z-lab/Qwen3.6-35B-A3B-DFlash"
DFLASH_REVISION = "42d3b34d588423cdae7ba8f53a8cf7789346a719"
# The quantized tensors inside a drafter's sidecar directory (beside its config.json), and the
# name of that directory when it sits in a checkpoint's.
DFLASH_SHARD = "lily-dflash.safetensors"
DFLASH_DIR = "dflash"
DRAFTER_QUANT = QuantSpec(bits=8, group_size=64)

FULL_ATTENTION = "full_attention"
SLIDING_ATTENTION = "sliding_attention"
_PROJECTIONS = (
    "self_attn.q_proj",
    "self_attn.k_proj",
    "self_attn.v_proj",
    "self_attn.o_proj",
    "mlp.gate_proj",
    "mlp.up_proj",
    "mlp.down_proj",
)
_NORMS = ("input_layernorm", "post_attention_layernorm", "self_attn.q_norm", "self_attn.k_norm")


@dataclass(frozen=True)
class YarnRope:
    """RoPE over all of a head's dims, with YaRN's frequency blend when `factor` > 1 (factor 1
    is plain RoPE): the parameters of the config's `rope_scaling` (or `rope_parameters`)."""

    theta: float
    factor: float = 1.0
    original_max_position_embeddings: int = 4096
    beta_fast: float = 32.0
    beta_slow: float = 1.0


@dataclass(frozen=True)
class DFlashConfig:
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    rms_norm_eps: float
    block_size: int
    mask_token_id: int
    # The target layers whose outputs (the residual stream after them) the drafter reads.
    target_layer_ids: tuple[int, ...]
    num_target_layers: int
    layer_types: tuple[str, ...]
    sliding_window: int | None
    rope: YarnRope
    # None: z-lab's default, causal inside the block on sliding layers only.
    is_causal: bool | None = None

    def causal_in_block(self, layer: int) -> bool:
        """Whether block rows of `layer` see only the block rows up to their own (context rows
        are always all visible, within a sliding layer's window)."""
        if self.is_causal is not None:
            return self.is_causal
        return self.layer_types[layer] == SLIDING_ATTENTION

    def window(self, layer: int) -> int | None:
        """The sliding window of `layer` (a key is seen when its position is less than this far
        behind the query's), None for a full-attention layer."""
        return self.sliding_window if self.layer_types[layer] == SLIDING_ATTENTION else None


def _rope(text: _Table) -> YarnRope:
    params, rope_type, theta = rope_block(text, ("default", "yarn"))
    if rope_type == "default":
        return YarnRope(theta=theta)
    return YarnRope(
        theta=theta,
        factor=params.number("factor", 1.0, 1e6),
        original_max_position_embeddings=params.integer(
            "original_max_position_embeddings", 1, MAX_POSITIONS
        ),
        beta_fast=params.number("beta_fast", 0.0, 1e6, 32.0, open_low=True),
        beta_slow=params.number("beta_slow", 0.0, 1e6, 1.0, open_low=True),
    )


def parse_dflash_config(raw: dict[str, Any]) -> DFlashConfig:
    """The drafter's config.json (z-lab's keys: the DFlash ones under `dflash_config`, or at
    the top level). Every value is type- and range-checked; ConfigError names the key."""
    try:
        return _parse(raw)
    except ConfigError as e:
        raise ConfigError(f"the DFlash drafter's {e}") from None


def _parse(raw: dict[str, Any]) -> DFlashConfig:
    top = _Table(raw, "")
    dflash = top.sub("dflash_config") if isinstance(raw.get("dflash_config"), dict) else top
    n_layers = top.integer("num_hidden_layers", 1, MAX_LAYERS)
    vocab = top.integer("vocab_size", 1, MAX_VOCAB)
    types = top.table.get("layer_types") or [FULL_ATTENTION] * n_layers
    if (
        not isinstance(types, list)
        or len(types) != n_layers
        or not set(types) <= {FULL_ATTENTION, SLIDING_ATTENTION}
    ):
        raise top.bad("layer_types", types, f"{n_layers} of {FULL_ATTENTION}/{SLIDING_ATTENTION}")
    window = None
    if SLIDING_ATTENTION in types:
        window = top.integer("sliding_window", 1, MAX_POSITIONS)
    n_target = top.integer("num_target_layers", 1, MAX_LAYERS)
    ids = dflash._get("target_layer_ids", _REQUIRED)
    if (
        not isinstance(ids, list)
        or not ids
        or not all(isinstance(i, int) and not isinstance(i, bool) for i in ids)
        or ids != sorted(set(ids))
        or not 0 <= ids[0] <= ids[-1] < n_target
    ):
        raise dflash.bad(
            "target_layer_ids", ids, f"increasing layer indices below num_target_layers {n_target}"
        )
    block = dflash.integer("block_size", 2, 1024, top.integer("block_size", 2, 1024, 16))
    causal = top.table.get("is_causal")
    if causal is not None and not isinstance(causal, bool):
        raise top.bad("is_causal", causal, "true, false or absent")
    return DFlashConfig(
        hidden_size=top.integer("hidden_size", 1, MAX_DIM),
        num_hidden_layers=n_layers,
        num_attention_heads=top.integer("num_attention_heads", 1, MAX_HEADS),
        num_key_value_heads=top.integer("num_key_value_heads", 1, MAX_HEADS),
        head_dim=top.integer("head_dim", 2, MAX_HEAD_DIM),
        intermediate_size=top.integer("intermediate_size", 1, MAX_DIM),
        vocab_size=vocab,
        rms_norm_eps=top.number("rms_norm_eps", *RMS_NORM_EPS_RANGE, 1e-6),
        block_size=block,
        mask_token_id=dflash.integer("mask_token_id", 0, vocab - 1),
        target_layer_ids=tuple(ids),
        num_target_layers=n_target,
        layer_types=tuple(types),
        sliding_window=window,
        rope=_rope(top),
        is_causal=causal,
    )


def check_against_target(config: DFlashConfig, target: ModelConfig) -> None:
    """Raises CheckpointError naming every way the drafter does not fit `target`: it reads the
    target's residual stream, embedding and lm_head, and its layer ids count target layers."""
    mismatches = [
        f"{what} is {mine} where the target's is {theirs}"
        for what, mine, theirs in (
            ("hidden_size", config.hidden_size, target.hidden_size),
            ("num_target_layers", config.num_target_layers, target.num_hidden_layers),
            ("vocab_size", config.vocab_size, target.vocab_size),
        )
        if mine != theirs
    ]
    if config.num_attention_heads % config.num_key_value_heads:
        mismatches.append(
            f"{config.num_attention_heads} query heads do not share "
            f"{config.num_key_value_heads} KV heads evenly"
        )
    if config.head_dim % 2:
        mismatches.append(f"head_dim {config.head_dim} is odd (RoPE rotates pairs)")
    for what, size in (
        ("hidden_size", config.hidden_size),
        ("intermediate_size", config.intermediate_size),
        ("num_attention_heads x head_dim", config.num_attention_heads * config.head_dim),
    ):
        if size % DRAFTER_QUANT.group_size:
            mismatches.append(
                f"{what} {size} is not a multiple of the quantization group "
                f"{DRAFTER_QUANT.group_size}"
            )
    if mismatches:
        raise CheckpointError(
            "the DFlash drafter does not fit this model: " + "; ".join(mismatches)
        )


def dflash_shapes(config: DFlashConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor of the drafter's original file, by name, with its shape ([out, in])."""
    h, d = config.hidden_size, config.head_dim
    q, kv, mlp = (
        config.num_attention_heads * d,
        config.num_key_value_heads * d,
        config.intermediate_size,
    )
    shapes: dict[str, tuple[int, ...]] = {
        "fc.weight": (h, len(config.target_layer_ids) * h),
        "hidden_norm.weight": (h,),
        "norm.weight": (h,),
    }
    per_layer = {
        "input_layernorm.weight": (h,),
        "post_attention_layernorm.weight": (h,),
        "self_attn.q_proj.weight": (q, h),
        "self_attn.k_proj.weight": (kv, h),
        "self_attn.v_proj.weight": (kv, h),
        "self_attn.o_proj.weight": (h, q),
        "self_attn.q_norm.weight": (d,),
        "self_attn.k_norm.weight": (d,),
        "mlp.gate_proj.weight": (mlp, h),
        "mlp.up_proj.weight": (mlp, h),
        "mlp.down_proj.weight": (h, mlp),
    }
    for i in range(config.num_hidden_layers):
        shapes.update({f"layers.{i}.{name}": shape for name, shape in per_layer.items()})
    return shapes


def projection_names(config: DFlashConfig) -> list[str]:
    """The quantized projections' module paths (each stored as .weight/.scales/.biases)."""
    layers = [f"layers.{i}.{p}" for i in range(config.num_hidden_layers) for p in _PROJECTIONS]
    return ["fc", *layers]


def norm_names(config: DFlashConfig) -> list[str]:
    layers = [f"layers.{i}.{n}.weight" for i in range(config.num_hidden_layers) for n in _NORMS]
    return ["hidden_norm.weight", "norm.weight", *layers]


def _float32(tensor: np.ndarray) -> np.ndarray:
    """An original tensor as float32 (bf16 arrives as uint16 bits, as Lily's reader gives it)."""
    return bf16_to_float32(tensor) if tensor.dtype == np.uint16 else np.asarray(tensor, np.float32)


def quantize_dflash(hf: Mapping[str, np.ndarray], config: DFlashConfig) -> dict[str, np.ndarray]:
    """The drafter in Lily's layout (module docstring) from its original tensors (float arrays,
    or bf16 as uint16 bits). Raises CheckpointError naming every tensor that is missing, extra
    or of the wrong shape."""
    expected = dflash_shapes(config)
    problems = [f"{n} is missing" for n in expected if n not in hf]
    problems += [f"{n} is not a drafter tensor" for n in hf if n not in expected]
    problems += [
        f"{n} has shape {list(np.shape(hf[n]))}, expected {list(shape)}"
        for n, shape in expected.items()
        if n in hf and tuple(np.shape(hf[n])) != shape
    ]
    if problems:
        shown = "; ".join(problems[:8]) + ("; ..." if len(problems) > 8 else "")
        raise CheckpointError(f"the DFlash drafter's tensors do not match its config: {shown}")
    out: dict[str, np.ndarray] = {}
    for path in projection_names(config):
        # Rounded to bf16 first, as mlx-lm rounds a bf16 checkpoint's weights before quantizing.
        weight = round_to_bf16(_float32(hf[path + ".weight"]))
        triple = quantize(weight, DRAFTER_QUANT.bits, DRAFTER_QUANT.group_size)
        out[path + ".weight"], out[path + ".scales"], out[path + ".biases"] = triple
    for name in norm_names(config):
        out[name] = float32_to_bf16(_float32(hf[name]))
    return out


def write_dflash(
    directory: Path, raw_config: Mapping[str, Any], tensors: Mapping[str, np.ndarray], source: str
) -> None:
    """Writes a drafter's sidecar into the new directory `directory`: its config.json as
    given and the quantized tensors (quantize_dflash) as DFLASH_SHARD."""
    from lily.checkpoint.demo import write_safetensors

    directory.mkdir(parents=True)
    (directory / "config.json").write_text(json.dumps(raw_config, indent=4, sort_keys=True))
    metadata = {"format": "mlx", "source": source, "bits": str(DRAFTER_QUANT.bits)}
    write_safetensors(directory / DFLASH_SHARD, tensors, metadata)


@dataclass
class DFlashDrafter:
    """A loaded drafter: its config and its tensors in Lily's layout (mapped read-only)."""

    config: DFlashConfig
    tensors: Mapping[str, np.ndarray]


def load_dflash(directory: str | Path, target: ModelConfig) -> DFlashDrafter:
    """The drafter in the sidecar `directory` (write_dflash), checked against `target`."""
    from lily.checkpoint.files import read_json_file
    from lily.checkpoint.safetensors_mmap import Shard

    directory = Path(directory)
    for name in ("config.json", DFLASH_SHARD):
        if not (directory / name).is_file():
            raise CheckpointError(f"{directory} is not a DFlash drafter directory (no {name})")
    raw = read_json_file(directory / "config.json")
    if not isinstance(raw, dict):
        raise ConfigError(f"the DFlash drafter's config.json in {directory} is not a JSON object")
    config = parse_dflash_config(raw)
    check_against_target(config, target)
    shard = Shard(directory / DFLASH_SHARD)
    tensors = {name: shard.array(name) for name in shard.tensors}
    expected = {
        f"{p}.{part}" for p in projection_names(config) for part in ("weight", "scales", "biases")
    }
    expected |= set(norm_names(config))
    missing, extra = sorted(expected - set(tensors)), sorted(set(tensors) - expected)
    if missing or extra:
        raise CheckpointError(
            f"{directory / DFLASH_SHARD} does not hold the drafter its config describes "
            f"(missing {missing[:4]}, unexpected {extra[:4]}): delete the directory to rebuild it"
        )
    return DFlashDrafter(config, tensors)


def spread_layer_ids(num_target_layers: int, count: int) -> list[int]:
    """`count` target layers spread evenly from layer 1 to the fourth from last (layer 1 if the
    model is too shallow): the rule that gives the real drafter's [1, 10, 19, 28, 37] for 40."""
    last = max(num_target_layers - 3, 1)
    if count == 1:
        return [1]
    return sorted({round(1 + i * (last - 1) / (count - 1)) for i in range(count)})


def random_drafter_config(text: Mapping[str, Any]) -> dict[str, Any]:
    """A DFlash drafter's config.json (z-lab's keys) for a small random
    drafter of the real one's shape family that fits the target text config `text`: the
    target's hidden size and vocabulary, the real head_dim and YaRN parameters, two layers of
    both kinds (a full one, and a sliding one whose window a test prompt passes)."""
    num_target_layers, vocab = int(text["num_hidden_layers"]), int(text["vocab_size"])
    return {
        "architectures": ["DFlashDraftModel"],
        "model_type": "qwen3",
        "hidden_size": int(text["hidden_size"]),
        "num_hidden_layers": 2,
        "layer_types": [FULL_ATTENTION, SLIDING_ATTENTION],
        "sliding_window": 8,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 128,
        "intermediate_size": 192,
        "vocab_size": vocab,
        "rms_norm_eps": 1e-6,
        "max_position_embeddings": 262144,
        "tie_word_embeddings": False,
        "attention_bias": False,
        "num_target_layers": num_target_layers,
        "block_size": 16,
        "rope_theta": 10_000_000,
        "rope_scaling": {
            "rope_type": "yarn",
            "factor": 64.0,
            "original_max_position_embeddings": 4096,
            "beta_fast": 32.0,
            "beta_slow": 1.0,
        },
        "dflash_config": {
            "mask_token_id": vocab - 1,
            "target_layer_ids": spread_layer_ids(num_target_layers, 3),
        },
        "lily_demo": {"random_weights": True},
    }


def random_hf_drafter(config: DFlashConfig, rng: np.random.Generator) -> dict[str, np.ndarray]:
    """Random tensors for the drafter `config` under its original names and shapes; the norms
    are plain gains (`x * w`) drawn around 1, far enough from it that a stray `1 + w` shows."""
    tensors = {}
    for name, shape in dflash_shapes(config).items():
        if len(shape) == 1:
            tensors[name] = (1 + rng.normal(0, 0.1, shape)).astype(np.float32)
        else:
            tensors[name] = rng.normal(0, shape[1] ** -0.5, shape).astype(np.float32)
    return tensors


def demo_drafter_dir() -> Path:
    """The demo model's random drafter (random_drafter_config for the demo's text config, its
    own seed), written into Lily's cache on first use like the demo itself."""
    import hashlib

    from lily.checkpoint.cache import build_once, cache_root
    from lily.checkpoint.demo import DEMO_SEED, TEXT_CONFIG

    raw = random_drafter_config(TEXT_CONFIG)
    digest = hashlib.sha256(Path(__file__).read_bytes() + json.dumps(raw).encode())

    def write(out: Path) -> None:
        config = parse_dflash_config(raw)
        hf = random_hf_drafter(config, np.random.default_rng(DEMO_SEED + 3))
        write_dflash(out, raw, quantize_dflash(hf, config), "lily.checkpoint.dflash (demo)")

    return build_once(cache_root() / f"demo-dflash-{digest.hexdigest()[:16]}", write)
