"""What a Qwen3.6-MoE checkpoint in MLX format must contain, and the check that it does.

`expected_layout(config)` is the one table of tensor names, shapes, dtypes and quantization,
derived from a ModelConfig (model.md section 3); the engine binds weights from the same table.
`validate(config, tensors, level)` compares a checkpoint against it at one of two levels:

- **strict**: the real Qwen3.6-35B-A3B. Every config value of model.md section 1, bf16 floats,
  4-bit group-64 everywhere except the router and shared-expert gates, which are exactly 8-bit.
- **family**: the same architecture at a smaller size (tests, the demo). Head dims, GDN dims,
  conv width, partial rotary factor and the output gate are fixed; hidden size, layer count,
  experts, intermediate sizes, vocab and head counts follow the config, and every tensor must
  agree with what the config implies.

Only metadata (dtype code and shape) is read; no tensor data is touched.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Literal

from lily.checkpoint.config import FULL_ATTENTION, LINEAR_ATTENTION, ModelConfig, QuantSpec
from lily.checkpoint.mtp import (
    MTP_FC,
    MTP_FINAL_NORM,
    MTP_LAYER,
    MTP_NORM_EMBEDDING,
    MTP_NORM_HIDDEN,
    is_mtp,
    mtp_quant,
)
from lily.checkpoint.safetensors_mmap import CheckpointError, TensorInfo

Level = Literal["strict", "family"]

PREFIX = "language_model.model."
LM_HEAD = "language_model.lm_head"
# Parts of the multimodal file Lily does not run: the vision tower, and MTP tensors under the
# language model's prefix (not a layout Lily writes). The multi-token-prediction head at `mtp.`
# (lily.checkpoint.mtp) is optional and checked when present.
SKIPPED_PREFIXES = ("vision_tower.", "language_model.vision_tower.", "language_model.mtp.")

_FLOAT_DTYPES = {"bfloat16": "BF16", "float16": "F16", "float32": "F32"}


class ValidationError(CheckpointError):
    """The checkpoint does not match the architecture (or, under strict, the real model)."""


# --- the expected layout ------------------------------------------------------------------


@dataclass(frozen=True)
class QuantizedLinear:
    """An MLX affine-quantized projection: `<path>.weight` u32 codes, `.scales`, `.biases`."""

    path: str
    out_features: int
    in_features: int
    quant: QuantSpec
    experts: int | None = None  # stacked experts carry a leading E axis

    @property
    def lead(self) -> tuple[int, ...]:
        return (self.out_features,) if self.experts is None else (self.experts, self.out_features)

    @property
    def weight_shape(self) -> tuple[int, ...]:
        return (*self.lead, self.in_features * self.quant.bits // 32)

    @property
    def scales_shape(self) -> tuple[int, ...]:
        return (*self.lead, self.in_features // self.quant.group_size)


@dataclass(frozen=True)
class PlainTensor:
    name: str
    shape: tuple[int, ...]
    dtypes: tuple[str, ...]  # accepted safetensors dtype codes, the preferred one first


@dataclass(frozen=True)
class ExpectedTensor:
    name: str
    shape: tuple[int, ...]
    dtypes: tuple[str, ...]


@dataclass(frozen=True)
class CheckpointLayout:
    linears: dict[str, QuantizedLinear]  # by module path
    plain: dict[str, PlainTensor]  # by tensor name
    float_dtype: str

    def tensors(self) -> dict[str, ExpectedTensor]:
        """Every tensor the checkpoint must hold, by full name."""
        out: dict[str, ExpectedTensor] = {}
        for lin in self.linears.values():
            out[f"{lin.path}.weight"] = ExpectedTensor(
                f"{lin.path}.weight", lin.weight_shape, ("U32",)
            )
            for part in ("scales", "biases"):
                name = f"{lin.path}.{part}"
                out[name] = ExpectedTensor(name, lin.scales_shape, (self.float_dtype,))
        for t in self.plain.values():
            out[t.name] = ExpectedTensor(t.name, t.shape, t.dtypes)
        return out


def declared_float_dtype(config: ModelConfig) -> str:
    """The float dtype the config declares for non-quantized tensors (bf16 if it says nothing)."""
    text = config.raw.get("text_config", config.raw)
    for source in (text, config.raw):
        for key in ("dtype", "torch_dtype"):
            if isinstance(source.get(key), str):
                name = source[key]
                if name not in _FLOAT_DTYPES:
                    raise ValidationError(f"config.json declares unsupported dtype {name!r}")
                return _FLOAT_DTYPES[name]
    return "BF16"


def expected_layout(config: ModelConfig, float_dtype: str | None = None) -> CheckpointLayout:
    """The tensors of a Qwen3.6-MoE MLX checkpoint with this config (model.md section 3)."""
    c = config
    fdt = float_dtype or declared_float_dtype(config)
    linears: dict[str, QuantizedLinear] = {}
    plain: dict[str, PlainTensor] = {}

    def linear(path: str, out_features: int, in_features: int, experts: int | None = None):
        linears[path] = QuantizedLinear(path, out_features, in_features, c.quant_for(path), experts)

    def tensor(name: str, shape: tuple[int, ...], dtypes: tuple[str, ...] = (fdt,)):
        plain[name] = PlainTensor(name, shape, dtypes)

    h = c.hidden_size
    linear(PREFIX + "embed_tokens", c.vocab_size, h)
    for i, kind in enumerate(c.layer_types):
        _decoder_layer(c, f"{PREFIX}layers.{i}.", kind, linear, tensor, fdt)
    tensor(PREFIX + "norm.weight", (h,))
    linear(LM_HEAD, c.vocab_size, h)
    return CheckpointLayout(linears, plain, fdt)


def mtp_layout(config: ModelConfig, float_dtype: str | None = None) -> CheckpointLayout:
    """The tensors of the multi-token-prediction head as Lily's sidecar holds them
    (lily.checkpoint.mtp): the two pre-fc norms, `fc` over their concatenation, one
    full-attention decoder layer with the MoE, and the final norm."""
    c = config
    fdt = float_dtype or declared_float_dtype(config)
    linears: dict[str, QuantizedLinear] = {}
    plain: dict[str, PlainTensor] = {}

    def linear(path: str, out_features: int, in_features: int, experts: int | None = None):
        linears[path] = QuantizedLinear(path, out_features, in_features, mtp_quant(path), experts)

    def tensor(name: str, shape: tuple[int, ...], dtypes: tuple[str, ...] = (fdt,)):
        plain[name] = PlainTensor(name, shape, dtypes)

    h = c.hidden_size
    tensor(MTP_NORM_EMBEDDING, (h,))
    tensor(MTP_NORM_HIDDEN, (h,))
    linear(MTP_FC, h, 2 * h)
    _decoder_layer(c, MTP_LAYER, FULL_ATTENTION, linear, tensor, fdt)
    tensor(MTP_FINAL_NORM, (h,))
    return CheckpointLayout(linears, plain, fdt)


def _decoder_layer(
    c: ModelConfig,
    p: str,
    kind: str,
    linear: Callable[..., None],
    tensor: Callable[..., None],
    fdt: str,
) -> None:
    """One decoder layer's tensors under the prefix `p` (ending in a dot); `fdt` is the float
    dtype of its unquantized tensors."""
    h = c.hidden_size
    tensor(p + "input_layernorm.weight", (h,))
    tensor(p + "post_attention_layernorm.weight", (h,))
    if kind == LINEAR_ATTENTION:
        hv = c.linear_num_value_heads
        linear(p + "linear_attn.in_proj_qkv", c.linear_conv_dim, h)
        linear(p + "linear_attn.in_proj_z", c.linear_value_dim, h)
        linear(p + "linear_attn.in_proj_b", hv, h)
        linear(p + "linear_attn.in_proj_a", hv, h)
        linear(p + "linear_attn.out_proj", h, c.linear_value_dim)
        tensor(p + "linear_attn.conv1d.weight", (c.linear_conv_dim, c.linear_conv_kernel_dim, 1))
        # mlx-lm never casts A_log, so it keeps the float32 of the original file.
        tensor(p + "linear_attn.A_log", (hv,), tuple(dict.fromkeys(("F32", fdt))))
        tensor(p + "linear_attn.dt_bias", (hv,))
        tensor(p + "linear_attn.norm.weight", (c.linear_value_head_dim,))
    else:
        q_rows = c.num_attention_heads * c.head_dim * (2 if c.attn_output_gate else 1)
        kv_rows = c.num_key_value_heads * c.head_dim
        linear(p + "self_attn.q_proj", q_rows, h)
        linear(p + "self_attn.k_proj", kv_rows, h)
        linear(p + "self_attn.v_proj", kv_rows, h)
        linear(p + "self_attn.o_proj", h, c.num_attention_heads * c.head_dim)
        tensor(p + "self_attn.q_norm.weight", (c.head_dim,))
        tensor(p + "self_attn.k_norm.weight", (c.head_dim,))
    e, mi, si = c.num_experts, c.moe_intermediate_size, c.shared_expert_intermediate_size
    linear(p + "mlp.gate", e, h)
    linear(p + "mlp.switch_mlp.gate_proj", mi, h, experts=e)
    linear(p + "mlp.switch_mlp.up_proj", mi, h, experts=e)
    linear(p + "mlp.switch_mlp.down_proj", h, mi, experts=e)
    linear(p + "mlp.shared_expert.gate_proj", si, h)
    linear(p + "mlp.shared_expert.up_proj", si, h)
    linear(p + "mlp.shared_expert.down_proj", h, si)
    linear(p + "mlp.shared_expert_gate", 1, h)


def expected_tensors(config: ModelConfig) -> dict[str, ExpectedTensor]:
    return expected_layout(config).tensors()


# --- config checks ------------------------------------------------------------------------

# model.md section 1: the real Qwen3.6-35B-A3B.
REAL_MODEL: dict[str, object] = {
    "hidden_size": 2048,
    "num_hidden_layers": 40,
    "vocab_size": 248320,
    "num_attention_heads": 16,
    "num_key_value_heads": 2,
    "head_dim": 256,
    "attn_output_gate": True,
    "rope_theta": 1e7,
    "partial_rotary_factor": 0.25,
    "linear_num_key_heads": 16,
    "linear_num_value_heads": 32,
    "linear_key_head_dim": 128,
    "linear_value_head_dim": 128,
    "linear_conv_kernel_dim": 4,
    "num_experts": 256,
    "num_experts_per_tok": 8,
    "moe_intermediate_size": 512,
    "shared_expert_intermediate_size": 512,
    "norm_topk_prob": True,
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": False,
    "max_position_embeddings": 262144,
}
REAL_EOS_TOKEN_IDS = frozenset({248044, 248046})  # <|endoftext|>, <|im_end|>
REAL_MROPE = {"mrope_section": [11, 11, 10], "mrope_interleaved": True}
REAL_MTP_LAYERS = 1

# What every member of the family shares with the real model.
FAMILY_FIXED = (
    "head_dim",
    "attn_output_gate",
    "partial_rotary_factor",
    "linear_key_head_dim",
    "linear_value_head_dim",
    "linear_conv_kernel_dim",
    "tie_word_embeddings",
)
GROUP_SIZE = 64
DEFAULT_BITS = 4
GATE_BITS = 8
GATE_SUFFIXES = (".mlp.gate", ".mlp.shared_expert_gate")
# Bit widths MLX affine quantization can produce (to tell a bit-width from a shape mismatch).
MLX_BIT_WIDTHS = (2, 3, 4, 5, 6, 8)


def claims_real_model(config: ModelConfig) -> bool:
    """True if the config has the real model's dimensions (so 'auto' validates strictly)."""
    return all(
        getattr(config, key) == REAL_MODEL[key]
        for key in ("hidden_size", "num_hidden_layers", "num_experts")
    )


def _text_config(config: ModelConfig) -> Mapping[str, object]:
    return config.raw.get("text_config", config.raw)


def _check_family_config(config: ModelConfig) -> list[str]:
    c = config
    problems = [
        f"{key} is {getattr(c, key)!r}, the architecture requires {REAL_MODEL[key]!r}"
        for key in FAMILY_FIXED
        if getattr(c, key) != REAL_MODEL[key]
    ]
    interval = c.full_attention_interval
    pattern = tuple(
        FULL_ATTENTION if (i + 1) % interval == 0 else LINEAR_ATTENTION
        for i in range(c.num_hidden_layers)
    )
    if c.layer_types != pattern:
        problems.append(
            f"layer pattern {_describe_layers(c.layer_types)} does not follow "
            f"full_attention_interval {interval} ({_describe_layers(pattern)})"
        )
    if FULL_ATTENTION not in c.layer_types or LINEAR_ATTENTION not in c.layer_types:
        problems.append("the model must have both linear_attention and full_attention layers")
    if c.num_key_value_heads <= 0 or c.num_attention_heads % c.num_key_value_heads:
        problems.append(
            f"num_attention_heads {c.num_attention_heads} is not a multiple of "
            f"num_key_value_heads {c.num_key_value_heads}"
        )
    if c.linear_num_key_heads <= 0 or c.linear_num_value_heads % c.linear_num_key_heads:
        problems.append(
            f"linear_num_value_heads {c.linear_num_value_heads} is not a multiple of "
            f"linear_num_key_heads {c.linear_num_key_heads}"
        )
    if not 0 < c.num_experts_per_tok <= c.num_experts:
        problems.append(
            f"num_experts_per_tok {c.num_experts_per_tok} must be in 1..num_experts "
            f"({c.num_experts})"
        )
    if c.quantization is None:
        problems.append("config.json has no 'quantization' block: Lily runs MLX 4-bit files")
    for key in ("hidden_size", "moe_intermediate_size", "shared_expert_intermediate_size"):
        if getattr(c, key) % GROUP_SIZE:
            problems.append(
                f"{key} {getattr(c, key)} is not a multiple of the group size {GROUP_SIZE}"
            )
    return problems


def _check_strict_config(config: ModelConfig) -> list[str]:
    c = config
    problems = [
        f"{key} is {getattr(c, key)!r}, the real model has {expected!r}"
        for key, expected in REAL_MODEL.items()
        if getattr(c, key) != expected
    ]
    if c.model_type != "qwen3_5_moe":
        problems.append(f"model_type is {c.model_type!r}, the real model has 'qwen3_5_moe'")
    text = _text_config(c)
    rope = text.get("rope_parameters") or text.get("rope_scaling") or {}
    for key, expected in REAL_MROPE.items():
        if key in rope and rope[key] != expected:
            problems.append(
                f"rope_parameters.{key} is {rope[key]!r}, the real model has {expected!r}"
            )
    if "mtp_num_hidden_layers" in text and text["mtp_num_hidden_layers"] != REAL_MTP_LAYERS:
        problems.append(
            f"mtp_num_hidden_layers is {text['mtp_num_hidden_layers']!r}, "
            f"the real model has {REAL_MTP_LAYERS}"
        )
    unknown_eos = sorted(set(c.eos_token_ids) - REAL_EOS_TOKEN_IDS)
    if unknown_eos:
        problems.append(f"eos_token_id {unknown_eos} is not one of {sorted(REAL_EOS_TOKEN_IDS)}")
    if c.quantization != QuantSpec(DEFAULT_BITS, GROUP_SIZE):
        problems.append(
            f"default quantization is {c.quantization}, the real model has "
            f"{DEFAULT_BITS}-bit group {GROUP_SIZE}"
        )
    return problems


def _check_strict_quantization(layout: CheckpointLayout) -> list[str]:
    problems = []
    for path, lin in layout.linears.items():
        bits = GATE_BITS if path.endswith(GATE_SUFFIXES) else DEFAULT_BITS
        if lin.quant != QuantSpec(bits, GROUP_SIZE):
            problems.append(
                f"config quantizes {path} as {lin.quant.bits}-bit group {lin.quant.group_size}, "
                f"the real model has {bits}-bit group {GROUP_SIZE}"
            )
    return problems


def _describe_layers(types: tuple[str, ...]) -> str:
    return "".join("F" if t == FULL_ATTENTION else "L" for t in types)


# --- tensor checks ------------------------------------------------------------------------


def _is_skipped(name: str) -> bool:
    return name.startswith(SKIPPED_PREFIXES)


def _list(names: list[str], limit: int = 5) -> str:
    shown = ", ".join(names[:limit])
    return shown + (f", ... ({len(names)} in total)" if len(names) > limit else "")


def _check_linear(
    lin: QuantizedLinear, tensors: Mapping[str, TensorInfo], float_dtype: str
) -> Iterator[str]:
    weight, scales, biases = (tensors[f"{lin.path}.{p}"] for p in ("weight", "scales", "biases"))
    if weight.dtype != "U32":
        yield (
            f"{weight.name} has dtype {weight.dtype}, but the config quantizes {lin.path} "
            "so it must be U32 packed codes"
        )
        return
    packed = weight.shape[-1] if weight.shape else 0
    bits = packed * 32 / lin.in_features
    if weight.shape[:-1] != lin.lead or len(weight.shape) != len(lin.lead) + 1:
        yield (
            f"{weight.name} has shape {list(weight.shape)}, "
            f"the config implies {list(lin.weight_shape)}"
        )
        return
    if bits != lin.quant.bits:
        if bits in MLX_BIT_WIDTHS:
            yield (
                f"{weight.name} is {bits:g}-bit ({packed} u32 columns for {lin.in_features} "
                f"inputs), but the config says {lin.quant.bits}-bit for {lin.path}"
            )
        else:
            yield (
                f"{weight.name} has shape {list(weight.shape)}, "
                f"the config implies {list(lin.weight_shape)}"
            )
        return
    for part in (scales, biases):
        if part.dtype != float_dtype:
            yield f"{part.name} has dtype {part.dtype}, the config implies {float_dtype}"
        elif part.shape != lin.scales_shape:
            yield (
                f"{part.name} has shape {list(part.shape)}, the config implies "
                f"{list(lin.scales_shape)} (group size {lin.quant.group_size})"
            )


def _check_plain(t: PlainTensor, info: TensorInfo) -> Iterator[str]:
    if info.dtype not in t.dtypes:
        yield f"{info.name} has dtype {info.dtype}, the config implies {' or '.join(t.dtypes)}"
    elif info.shape != t.shape:
        yield f"{info.name} has shape {list(info.shape)}, the config implies {list(t.shape)}"


def validate(config: ModelConfig, tensors: Mapping[str, TensorInfo], level: Level) -> None:
    """Raise ValidationError naming every problem class found (first few offenders of each)."""
    if level not in ("strict", "family"):
        raise ValueError(f"validation level must be 'strict' or 'family', not {level!r}")
    problems = _check_family_config(config)
    if level == "strict":
        problems += _check_strict_config(config)
    if problems:
        raise ValidationError(f"config.json ({level}): " + "; ".join(problems))

    layout = expected_layout(config, float_dtype="BF16" if level == "strict" else None)
    if level == "strict":
        problems = _check_strict_quantization(layout)
        if problems:
            raise ValidationError(f"config.json (strict): {_list(problems, 3)}")

    mismatch = f"checkpoint does not match the config ({level})"
    expected = layout.tensors()
    present = {name for name in tensors if not _is_skipped(name) and not is_mtp(name)}
    missing = sorted(set(expected) - present)
    unexpected = sorted(present - set(expected))
    if missing:
        problems.append(f"missing tensors: {_list(missing)}")
    if unexpected:
        problems.append(f"unexpected tensors: {_list(unexpected)}")
    if problems:
        raise ValidationError(f"{mismatch}: " + "; ".join(problems))

    for lin in layout.linears.values():
        problems.extend(_check_linear(lin, tensors, layout.float_dtype))
    for t in layout.plain.values():
        problems.extend(_check_plain(t, tensors[t.name]))
    if problems:
        raise ValidationError(f"{mismatch}: {_list(problems, 3)}")
    _validate_mtp(config, tensors, layout.float_dtype)


def has_mtp_head(tensors: Mapping[str, object]) -> bool:
    """Whether a checkpoint carries the multi-token-prediction head (validated when present)."""
    return any(is_mtp(name) for name in tensors)


def _validate_mtp(config: ModelConfig, tensors: Mapping[str, TensorInfo], float_dtype: str) -> None:
    """The MTP head is optional (mlx-lm drops it); when any of it is there it must be whole."""
    present = {name for name in tensors if is_mtp(name)}
    if not present:
        return
    layout = mtp_layout(config, float_dtype)
    expected = layout.tensors()
    problems = []
    missing = sorted(set(expected) - present)
    unexpected = sorted(present - set(expected))
    if missing:
        problems.append(f"missing tensors: {_list(missing)}")
    if unexpected:
        problems.append(f"unexpected tensors: {_list(unexpected)}")
    if not problems:
        for lin in layout.linears.values():
            problems.extend(_check_linear(lin, tensors, float_dtype))
        for t in layout.plain.values():
            problems.extend(_check_plain(t, tensors[t.name]))
    if problems:
        raise ValidationError(
            "the checkpoint's multi-token-prediction head (mtp.*) is incomplete or malformed "
            f"(remove every mtp.* tensor to load without it): {_list(problems, 3)}"
        )
