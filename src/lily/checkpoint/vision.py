"""The checkpoint's vision tower: its dimensions (`vision_config` in config.json) and its weights
(`vision_tower.*`), for the numpy reference (lily.engine.vision_reference). docs/vision.md, "The
vision tower", states the real model's values and where they come from.

The language-model loader still skips these tensors (lily.checkpoint.validate's
SKIPPED_PREFIXES): nothing runs the tower on a device yet.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from lily.checkpoint.config import ModelConfig
from lily.checkpoint.quant import bf16_to_float32, dequantize
from lily.errors import ConfigError

VISION_PREFIX = "vision_tower."
# The tower's activations: tanh-approximated GELU in the blocks' MLPs; the merger's GELU is the
# exact (erf) one whatever the config says (both reference implementations hard-code it).
MLP_ACTIVATION = "gelu_pytorch_tanh"


@dataclass(frozen=True)
class VisionConfig:
    depth: int
    hidden_size: int
    num_heads: int
    intermediate_size: int
    patch_size: int
    temporal_patch_size: int
    spatial_merge_size: int
    out_hidden_size: int
    num_position_embeddings: int
    in_channels: int = 3
    # Not in config.json: both reference implementations fix it.
    layer_norm_eps: float = 1e-6
    rope_theta: float = 10_000.0

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def position_grid_side(self) -> int:
        """The learned position embeddings are a square grid of this many per side."""
        return int(round(self.num_position_embeddings**0.5))

    @property
    def patch_values(self) -> int:
        """Values in one patch row of the input: channels x frames x pixels."""
        return self.in_channels * self.temporal_patch_size * self.patch_size**2


def parse_vision_config(raw: Mapping[str, Any]) -> VisionConfig:
    """The tower's dimensions from config.json (the whole file); ConfigError if it has none or
    describes a tower this reference does not compute (deepstack features, another activation,
    a non-square position grid)."""
    block = raw.get("vision_config")
    if not isinstance(block, dict):
        raise ConfigError("config.json has no vision_config: the checkpoint has no vision tower")
    if block.get("deepstack_visual_indexes"):
        raise ConfigError("vision_config: deepstack features are not part of this model")
    activation = block.get("hidden_act", MLP_ACTIVATION)
    if activation != MLP_ACTIVATION:
        raise ConfigError(f"vision_config: hidden_act {activation!r} is not {MLP_ACTIVATION!r}")
    try:
        config = VisionConfig(
            **{
                name: int(block[name])
                for name in (
                    "depth",
                    "hidden_size",
                    "num_heads",
                    "intermediate_size",
                    "patch_size",
                    "temporal_patch_size",
                    "spatial_merge_size",
                    "out_hidden_size",
                    "num_position_embeddings",
                )
            },
            in_channels=int(block.get("in_channels", 3)),
        )
    except KeyError as missing:
        raise ConfigError(f"vision_config has no {missing.args[0]}") from None
    if config.position_grid_side**2 != config.num_position_embeddings:
        raise ConfigError("vision_config: num_position_embeddings must be a square")
    if config.hidden_size % config.num_heads or config.head_dim % 4:
        raise ConfigError("vision_config: the head dim must be a multiple of 4 (2-D rotary)")
    return config


def vision_weights(tensors: Mapping[str, np.ndarray], config: ModelConfig) -> dict[str, np.ndarray]:
    """Every `vision_tower.*` tensor as float32, by its name without the prefix. Projections the
    converter quantized (a `.scales` beside the `.weight`) are dequantized with the config's
    quantization for that path; bf16 (raw uint16 bits) is widened exactly."""
    names = [n for n in tensors if n.startswith(VISION_PREFIX)]
    if not names:
        raise ConfigError("the checkpoint has no vision_tower.* tensors")
    out: dict[str, np.ndarray] = {}
    for name in names:
        if name.endswith((".scales", ".biases")) and name.rsplit(".", 1)[0] + ".weight" in tensors:
            continue
        path, _, part = name.rpartition(".")
        if part == "weight" and f"{path}.scales" in tensors:
            spec = config.quant_overrides.get(path, config.quantization)
            if spec is None:
                raise ConfigError(f"{path} is quantized but config.json has no quantization")
            value = dequantize(
                tensors[name], tensors[f"{path}.scales"], tensors[f"{path}.biases"],
                spec.bits, spec.group_size,
            )  # fmt: skip
        else:
            value = np.asarray(tensors[name])
            value = bf16_to_float32(value) if value.dtype == np.uint16 else value
        out[name.removeprefix(VISION_PREFIX)] = value.astype(np.float32)
    return out
