"""The model configuration: `config.json` of a Qwen3.6-MoE checkpoint, parsed into one dataclass.

The file is multimodal (top-level `qwen3_5_moe` with the text model under `text_config`);
mlx-community conversions add a top-level `quantization` block whose extra keys are per-path
overrides (the router and shared-expert gates are 8-bit). The text model is read, and what the
language model needs of the images: the vision token ids (top level) and the multimodal rotary
sections (`mrope_section`, interleaved; docs/vision.md). A config without `image_token_id` is a
text-only model.

Every value is checked for its JSON type and range before anything is sized or computed from it
(`ConfigError` names the key): a size far beyond the real model's, a non-positive epsilon or RoPE
base, a string where a flag belongs are refused here rather than hanging the layout or turning
every activation into NaN.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from lily.checkpoint.files import checkpoint_file, read_json_file
from lily.errors import CheckpointError, ConfigError

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
    # The period of full-attention layers that `layer_types` must follow (validate.py checks).
    full_attention_interval: int = 4
    model_type: str = "qwen3_5_moe"
    # The vision token ids (None: a text-only model) and the rotary frequencies each of the
    # three M-RoPE streams (temporal, height, width) takes, interleaved (docs/vision.md).
    image_token_id: int | None = None
    vision_start_token_id: int | None = None
    video_token_id: int | None = None
    mrope_section: tuple[int, int, int] | None = None
    raw: dict[str, Any] = field(default_factory=dict, repr=False, compare=False)

    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def takes_images(self) -> bool:
        """Whether the checkpoint has a vision tower and the ids to put its output in a prompt."""
        return self.image_token_id is not None and isinstance(self.raw.get("vision_config"), dict)

    def rope_streams(self) -> tuple[int, ...]:
        """For each rotary frequency i (rotary_dim / 2 of them), the M-RoPE stream its angle
        takes the position from: 1 (height) for i % 3 == 1 below 3 * mrope_section[1], 2 (width)
        for i % 3 == 2 below 3 * mrope_section[2], else 0 (temporal). All 0 without sections."""
        height, width = self.mrope_bounds
        return tuple(
            1 if i % 3 == 1 and i < height else 2 if i % 3 == 2 and i < width else 0
            for i in range(self.rotary_dim // 2)
        )

    @property
    def mrope_bounds(self) -> tuple[int, int]:
        """The frequencies below which the height and width streams interleave (0, 0: none)."""
        if self.mrope_section is None:
            return 0, 0
        return 3 * self.mrope_section[1], 3 * self.mrope_section[2]

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


_REQUIRED = object()

# Bounds every config value must fall in before anything is sized from it. They are far
# beyond the real model (hidden 2048, 40 layers, 248320 tokens, 256 experts) yet refuse
# garbage at once: a million layers would otherwise be laid out one by one before failing.
MAX_DIM = 1 << 16
MAX_LAYERS = 1024
MAX_HEADS = 1024
MAX_HEAD_DIM = 1024
MAX_CONV_KERNEL = 64
MAX_VOCAB = 1 << 24
MAX_POSITIONS = 1 << 24
# moe_route holds at most 8 router logits per lane of a 32-lane SIMD-group.
MAX_EXPERTS = 256
MLX_BITS = (2, 3, 4, 5, 6, 8)
MLX_GROUP_SIZES = (32, 64, 128)
# A RoPE base below 1 turns frequencies past one radian per position; above 1e12 it is garbage.
ROPE_THETA_RANGE = (1.0, 1e12)
# Below 1e-12 the epsilon is lost in fp32 and an all-zero row normalises to inf.
RMS_NORM_EPS_RANGE = (1e-12, 1.0)


class _Table:
    """Typed, range-checked reads of one JSON object of config.json, each failure a ConfigError
    naming the key, the value and what is allowed."""

    def __init__(self, table: object, where: str) -> None:
        if not isinstance(table, dict):
            raise ConfigError(
                f"config.json: {where.rstrip('.') or 'the file'} is not a JSON object"
            )
        self.table = table
        self.where = where

    def _get(self, key: str, default: object) -> object:
        if key in self.table and self.table[key] is not None:
            return self.table[key]
        if default is _REQUIRED:
            raise ConfigError(f"config.json is missing {self.where}{key!r}")
        return default

    def bad(self, key: str, value: object, allowed: str) -> ConfigError:
        shown = repr(value)
        shown = shown if len(shown) <= 40 else shown[:37] + "..."
        return ConfigError(f"config.json: {self.where}{key} is {shown}, must be {allowed}")

    def integer(self, key: str, low: int, high: int, default: object = _REQUIRED) -> int:
        value = self._get(key, default)
        if not isinstance(value, int) or isinstance(value, bool) or not low <= value <= high:
            raise self.bad(key, value, f"an integer from {low} to {high}")
        return value

    def number(
        self,
        key: str,
        low: float,
        high: float,
        default: object = _REQUIRED,
        *,
        open_low: bool = False,
    ) -> float:
        value = self._get(key, default)
        # NaN fails every comparison and +-inf the bounds, so both are refused here.
        is_number = isinstance(value, (int, float)) and not isinstance(value, bool)
        if not is_number or not ((low < value) if open_low else (low <= value)) or value > high:
            bracket = "(" if open_low else "["
            raise self.bad(key, value, f"a finite number in {bracket}{low:g}, {high:g}]")
        return float(value)

    def flag(self, key: str, default: bool) -> bool:
        value = self._get(key, default)
        if not isinstance(value, bool):
            raise self.bad(key, value, "true or false")
        return value

    def text(self, key: str, default: str) -> str:
        value = self._get(key, default)
        if not isinstance(value, str):
            raise self.bad(key, value, "a string")
        return value

    def sub(self, key: str) -> _Table:
        return _Table(self._get(key, {}), f"{self.where}{key}.")


def rope_block(text: _Table, types: tuple[str, ...]) -> tuple[_Table, str, float]:
    """The config's rope block (`rope_parameters`, or the older `rope_scaling`), its type (one
    of `types`; "default" when it names none) and rope_theta (the block's, else the top level's)."""
    params = _rope_params(text)
    rope_type = params.text("rope_type", params.text("type", "default"))
    if rope_type not in types:
        raise params.bad("rope_type", rope_type, " or ".join(types))
    theta_from = params if "rope_theta" in params.table else text
    return params, rope_type, theta_from.number("rope_theta", *ROPE_THETA_RANGE)


def _rope_params(text: _Table) -> _Table:
    return text.sub("rope_parameters" if text.table.get("rope_parameters") else "rope_scaling")


def _rope(text: _Table) -> tuple[float, float]:
    params, _, theta = rope_block(text, ("default", "mrope"))
    # Either block may hold the factor; the rope block wins.
    factor_from = params if "partial_rotary_factor" in params.table else text
    factor = factor_from.number("partial_rotary_factor", 0.0, 1.0, open_low=True)
    return theta, factor


def _mrope_section(text: _Table, rotary_dim: int) -> tuple[int, int, int] | None:
    params = _rope_params(text)
    if "mrope_section" not in params.table:
        return None
    section = params.table["mrope_section"]
    if (
        not isinstance(section, list)
        or len(section) != 3
        or not all(isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in section)
        or sum(section) != rotary_dim // 2
    ):
        raise params.bad(
            "mrope_section", section, f"three counts summing to rotary_dim / 2 = {rotary_dim // 2}"
        )
    # Qwen3.5/3.6 interleave the streams (mlx-vlm and transformers always do for this model);
    # the chunked layout of older Qwen-VL models is not implemented.
    if not params.flag("mrope_interleaved", True):
        raise ConfigError(f"config.json: {params.where}mrope_interleaved false is not supported")
    return section[0], section[1], section[2]


def _token_id(top: _Table, key: str, vocab: int) -> int | None:
    if top.table.get(key) is None:
        return None
    return top.integer(key, 0, vocab - 1)


def _layer_types(text: _Table, n_layers: int, interval: int) -> tuple[str, ...]:
    if "layer_types" in text.table:
        types = text.table["layer_types"]
        if not isinstance(types, list) or not all(isinstance(t, str) for t in types):
            raise ConfigError("config.json: layer_types must be a list of strings")
        if len(types) != n_layers:
            raise ConfigError(f"layer_types has {len(types)} entries for {n_layers} layers")
        types = tuple(types)
    else:
        types = tuple(
            FULL_ATTENTION if (i + 1) % interval == 0 else LINEAR_ATTENTION for i in range(n_layers)
        )
    unknown = sorted(set(types) - {FULL_ATTENTION, LINEAR_ATTENTION})
    if unknown:
        raise ConfigError(f"unknown layer types {unknown}")
    return types


def _quant_spec(block: _Table, default: QuantSpec | None) -> QuantSpec:
    bits = block.integer("bits", 1, 8, _REQUIRED if default is None else default.bits)
    group = block.integer(
        "group_size", 1, 1024, _REQUIRED if default is None else default.group_size
    )
    if bits not in MLX_BITS:
        raise block.bad("bits", bits, f"one of {MLX_BITS}")
    if group not in MLX_GROUP_SIZES:
        raise block.bad("group_size", group, f"one of {MLX_GROUP_SIZES}")
    return QuantSpec(bits, group)


def _quantization(raw: _Table) -> tuple[QuantSpec | None, dict[str, QuantSpec]]:
    key = "quantization" if raw.table.get("quantization") else "quantization_config"
    if not raw.table.get(key):
        return None, {}
    block = raw.sub(key)
    mode = block.text("mode", "affine")
    if mode != "affine":
        raise ConfigError(f"unsupported quantization mode {mode!r}")
    default = _quant_spec(block, None)
    overrides = {}
    for path, value in block.table.items():
        if isinstance(value, dict):
            overrides[path] = _quant_spec(block.sub(path), default)
    return default, overrides


def _eos_token_ids(raw: _Table, text: _Table, vocab: int) -> tuple[int, ...]:
    table = raw if "eos_token_id" in raw.table else text
    eos = table.table.get("eos_token_id")
    listed = [] if eos is None else eos if isinstance(eos, list) else [eos]
    if not all(isinstance(e, int) and not isinstance(e, bool) and 0 <= e < vocab for e in listed):
        raise table.bad("eos_token_id", eos, f"token ids (or one id) below vocab_size {vocab}")
    return tuple(listed)


def parse_config(raw: dict[str, Any]) -> ModelConfig:
    """Build a ModelConfig from the parsed JSON of config.json. Every value is type- and
    range-checked; anything else raises ConfigError naming the key."""
    top = _Table(raw, "")
    text = top.sub("text_config") if "text_config" in raw else top
    n_layers = text.integer("num_hidden_layers", 1, MAX_LAYERS)
    hidden = text.integer("hidden_size", 1, MAX_DIM)
    n_heads = text.integer("num_attention_heads", 1, MAX_HEADS)
    vocab = text.integer("vocab_size", 1, MAX_VOCAB)
    theta, factor = _rope(text)
    quant, overrides = _quantization(top)
    experts = text.integer("num_experts", 1, MAX_EXPERTS)
    interval = text.integer("full_attention_interval", 1, MAX_LAYERS, 4)
    head_dim = text.integer("head_dim", 1, MAX_HEAD_DIM, max(hidden // n_heads, 1))
    return ModelConfig(
        hidden_size=hidden,
        num_hidden_layers=n_layers,
        vocab_size=vocab,
        num_attention_heads=n_heads,
        num_key_value_heads=text.integer("num_key_value_heads", 1, MAX_HEADS),
        head_dim=head_dim,
        attn_output_gate=text.flag("attn_output_gate", True),
        rope_theta=theta,
        partial_rotary_factor=factor,
        linear_num_key_heads=text.integer("linear_num_key_heads", 1, MAX_HEADS),
        linear_num_value_heads=text.integer("linear_num_value_heads", 1, MAX_HEADS),
        linear_key_head_dim=text.integer("linear_key_head_dim", 1, MAX_HEAD_DIM),
        linear_value_head_dim=text.integer("linear_value_head_dim", 1, MAX_HEAD_DIM),
        linear_conv_kernel_dim=text.integer("linear_conv_kernel_dim", 1, MAX_CONV_KERNEL),
        num_experts=experts,
        num_experts_per_tok=text.integer("num_experts_per_tok", 1, experts),
        moe_intermediate_size=text.integer("moe_intermediate_size", 1, MAX_DIM),
        shared_expert_intermediate_size=text.integer("shared_expert_intermediate_size", 1, MAX_DIM),
        norm_topk_prob=text.flag("norm_topk_prob", True),
        rms_norm_eps=text.number("rms_norm_eps", *RMS_NORM_EPS_RANGE, 1e-6),
        tie_word_embeddings=text.flag(
            "tie_word_embeddings", top.flag("tie_word_embeddings", False)
        ),
        max_position_embeddings=text.integer("max_position_embeddings", 1, MAX_POSITIONS, 262144),
        layer_types=_layer_types(text, n_layers, interval),
        eos_token_ids=_eos_token_ids(top, text, vocab),
        quantization=quant,
        quant_overrides=overrides,
        full_attention_interval=interval,
        model_type=top.text("model_type", ""),
        image_token_id=_token_id(top, "image_token_id", vocab),
        vision_start_token_id=_token_id(top, "vision_start_token_id", vocab),
        video_token_id=_token_id(top, "video_token_id", vocab),
        mrope_section=_mrope_section(text, int(head_dim * factor)),
        raw=raw,
    )


def load_config(model_dir: str | Path, allow_external_links: bool | None = None) -> ModelConfig:
    """The config.json of a checkpoint directory (read as lily.checkpoint.files allows)."""
    if not (Path(model_dir) / "config.json").exists():
        raise ConfigError(f"no config.json in {model_dir}")
    try:
        path = checkpoint_file(model_dir, "config.json", allow_external_links)
        raw = read_json_file(path)
    except CheckpointError as e:
        raise ConfigError(f"config.json: {e}") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"{path} is not a JSON object")
    return parse_config(raw)
