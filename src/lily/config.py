"""The model configuration: `config.json` of a Qwen3.6-MoE checkpoint, parsed into one dataclass.

The file is multimodal (top-level `qwen3_5_moe` with the text model under `text_config`);
mlx-community conversions add a top-level `quantization` block whose extra keys are per-path
overrides (the router and shared-expert gates are 8-bit). Only the text model is read.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from lily.errors import ConfigError

FULL_ATTENTION = "full_attention"
LINEAR_ATTENTION = "linear_attention"


@dataclass(frozen=True)
class QuantSpec:
    """MLX affine quantization of one projection: `w = scale * code + bias` per group."""

    bits: int
    group_size: int


@dataclass(frozen=True)
class ModelConfig:
    hidden_size: int
    num_hidden_layers: int
    vocab_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    attn_output_gate: bool
    rope_theta: float
    partial_rotary_factor: float
    linear_num_key_heads: int
    linear_num_value_heads: int
    linear_key_head_dim: int
    linear_value_head_dim: int
    linear_conv_kernel_dim: int
    num_experts: int
    num_experts_per_tok: int
    moe_intermediate_size: int
    shared_expert_intermediate_size: int
    norm_topk_prob: bool
    rms_norm_eps: float
    tie_word_embeddings: bool
    max_position_embeddings: int
    layer_types: tuple[str, ...]
    eos_token_ids: tuple[int, ...]
    # None for an unquantized checkpoint; Lily's loader requires it to be set.
    quantization: QuantSpec | None
    # Per-path overrides, keyed by module path without the `.weight` suffix as written in the file
    # (e.g. "language_model.model.layers.0.mlp.gate").
    quant_overrides: dict[str, QuantSpec] = field(default_factory=dict)
    model_type: str = "qwen3_5_moe"
    raw: dict[str, Any] = field(default_factory=dict, repr=False, compare=False)

    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def linear_key_dim(self) -> int:
        return self.linear_num_key_heads * self.linear_key_head_dim

    @property
    def linear_value_dim(self) -> int:
        return self.linear_num_value_heads * self.linear_value_head_dim

    @property
    def linear_conv_dim(self) -> int:
        return 2 * self.linear_key_dim + self.linear_value_dim

    @property
    def full_attention_layers(self) -> tuple[int, ...]:
        return tuple(i for i, t in enumerate(self.layer_types) if t == FULL_ATTENTION)

    def quant_for(self, module_path: str) -> QuantSpec:
        """Quantization of a module, honouring the per-path overrides."""
        if module_path in self.quant_overrides:
            return self.quant_overrides[module_path]
        if self.quantization is None:
            raise ConfigError(f"checkpoint is not quantized (no 'quantization' for {module_path})")
        return self.quantization


def _rope(text: dict[str, Any]) -> tuple[float, float]:
    params = text.get("rope_parameters") or text.get("rope_scaling") or {}
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in ("default", "mrope"):
        raise ConfigError(f"unsupported rope type {rope_type!r}")
    theta = params.get("rope_theta", text.get("rope_theta"))
    factor = params.get("partial_rotary_factor", text.get("partial_rotary_factor"))
    if theta is None or factor is None:
        raise ConfigError("rope_theta and partial_rotary_factor must be given in config.json")
    return float(theta), float(factor)


def _layer_types(text: dict[str, Any], n_layers: int) -> tuple[str, ...]:
    if "layer_types" in text:
        types = tuple(text["layer_types"])
        if len(types) != n_layers:
            raise ConfigError(f"layer_types has {len(types)} entries for {n_layers} layers")
    else:
        interval = int(text.get("full_attention_interval", 4))
        types = tuple(
            FULL_ATTENTION if (i + 1) % interval == 0 else LINEAR_ATTENTION for i in range(n_layers)
        )
    unknown = sorted(set(types) - {FULL_ATTENTION, LINEAR_ATTENTION})
    if unknown:
        raise ConfigError(f"unknown layer types {unknown}")
    return types


def _quantization(raw: dict[str, Any]) -> tuple[QuantSpec | None, dict[str, QuantSpec]]:
    block = raw.get("quantization") or raw.get("quantization_config")
    if not block:
        return None, {}
    if block.get("mode", "affine") != "affine":
        raise ConfigError(f"unsupported quantization mode {block.get('mode')!r}")
    default = QuantSpec(int(block["bits"]), int(block["group_size"]))
    overrides = {}
    for key, value in block.items():
        if isinstance(value, dict):
            overrides[key] = QuantSpec(
                int(value.get("bits", default.bits)),
                int(value.get("group_size", default.group_size)),
            )
    return default, overrides


def parse_config(raw: dict[str, Any]) -> ModelConfig:
    """Build a ModelConfig from the parsed JSON of config.json."""
    text = raw.get("text_config", raw)
    try:
        n_layers = int(text["num_hidden_layers"])
        theta, factor = _rope(text)
        eos = raw.get("eos_token_id", text.get("eos_token_id", []))
        eos_ids = tuple(eos) if isinstance(eos, list) else (int(eos),)
        quant, overrides = _quantization(raw)
        n_heads = int(text["num_attention_heads"])
        return ModelConfig(
            hidden_size=int(text["hidden_size"]),
            num_hidden_layers=n_layers,
            vocab_size=int(text["vocab_size"]),
            num_attention_heads=n_heads,
            num_key_value_heads=int(text["num_key_value_heads"]),
            head_dim=int(text.get("head_dim") or int(text["hidden_size"]) // n_heads),
            attn_output_gate=bool(text.get("attn_output_gate", True)),
            rope_theta=theta,
            partial_rotary_factor=factor,
            linear_num_key_heads=int(text["linear_num_key_heads"]),
            linear_num_value_heads=int(text["linear_num_value_heads"]),
            linear_key_head_dim=int(text["linear_key_head_dim"]),
            linear_value_head_dim=int(text["linear_value_head_dim"]),
            linear_conv_kernel_dim=int(text["linear_conv_kernel_dim"]),
            num_experts=int(text["num_experts"]),
            num_experts_per_tok=int(text["num_experts_per_tok"]),
            moe_intermediate_size=int(text["moe_intermediate_size"]),
            shared_expert_intermediate_size=int(text["shared_expert_intermediate_size"]),
            norm_topk_prob=bool(text.get("norm_topk_prob", True)),
            rms_norm_eps=float(text.get("rms_norm_eps", 1e-6)),
            tie_word_embeddings=bool(
                text.get("tie_word_embeddings", raw.get("tie_word_embeddings", False))
            ),
            max_position_embeddings=int(text.get("max_position_embeddings", 262144)),
            layer_types=_layer_types(text, n_layers),
            eos_token_ids=tuple(int(e) for e in eos_ids),
            quantization=quant,
            quant_overrides=overrides,
            model_type=str(raw.get("model_type", "")),
            raw=raw,
        )
    except KeyError as e:
        raise ConfigError(f"config.json is missing {e.args[0]!r}") from None
    except (TypeError, ValueError) as e:
        if isinstance(e, ConfigError):
            raise
        raise ConfigError(f"config.json has a malformed value: {e}") from None


def load_config(model_dir: str | Path) -> ModelConfig:
    path = Path(model_dir) / "config.json"
    if not path.is_file():
        raise ConfigError(f"no config.json in {model_dir}")
    try:
        raw = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ConfigError(f"{path} is not valid JSON: {e}") from None
    return parse_config(raw)
