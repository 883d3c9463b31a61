"""The multi-token-prediction (MTP) head: its tensors in Lily's layout, and how Lily makes them
from the original Hugging Face tensors.

Qwen3.5/3.6 checkpoints carry one MTP layer under `mtp.` (see docs/architecture.md, "The MTP
draft head", for the forward pass and the sources). mlx-lm drops those tensors when converting,
so no MLX file has them: Lily quantizes the original ones itself, once, into a sidecar
safetensors file that the checkpoint's index lists next to the main shards. The sidecar follows
the conventions of the rest of an MLX file, so that the engine binds it the same way:

- every projection is MLX affine 4-bit with groups of 64, except the router (`mlp.gate`) and the
  shared-expert gate, which are 8-bit, as mlx-community quantizes the main layers' gates;
- the zero-centred norms (both pre-fc norms, the layer's two norms, q/k norms, the final norm)
  are stored as 1 + w in bf16, as mlx-lm stores the main model's;
- the experts are stacked as `mlp.switch_mlp.{gate,up,down}_proj` with a leading expert axis
  (the original fuses gate and up as `mlp.experts.gate_up_proj`, gate rows first, or stores each
  expert separately as `mlp.experts.<e>.<proj>.weight`).
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Mapping
from pathlib import Path

import numpy as np

from lily.checkpoint.config import QuantSpec
from lily.checkpoint.quant import bf16_to_float32, float32_to_bf16, quantize, round_to_bf16

MTP_PREFIX = "mtp."
MTP_LAYER = MTP_PREFIX + "layers.0."
# The projection of [pre_fc_norm_embedding(embedding), pre_fc_norm_hidden(hidden)] (that order).
MTP_FC = MTP_PREFIX + "fc"
MTP_NORM_EMBEDDING = MTP_PREFIX + "pre_fc_norm_embedding.weight"
MTP_NORM_HIDDEN = MTP_PREFIX + "pre_fc_norm_hidden.weight"
MTP_FINAL_NORM = MTP_PREFIX + "norm.weight"
# The file Lily writes the quantized head into, listed in model.safetensors.index.json.
MTP_SHARD = "lily-mtp.safetensors"

GROUP_SIZE = 64
_GATE_SUFFIXES = (".mlp.gate", ".mlp.shared_expert_gate")
_ZERO_CENTRED_NORMS = (
    "pre_fc_norm_embedding.weight",
    "pre_fc_norm_hidden.weight",
    "norm.weight",
    "input_layernorm.weight",
    "post_attention_layernorm.weight",
    "q_norm.weight",
    "k_norm.weight",
)
_PROJECTIONS = ("gate_proj", "up_proj", "down_proj")


def mtp_quant(module_path: str) -> QuantSpec:
    """How the sidecar quantizes an MTP projection (the config's overrides do not list them)."""
    return QuantSpec(bits=8 if module_path.endswith(_GATE_SUFFIXES) else 4, group_size=GROUP_SIZE)


def is_mtp(name: str) -> bool:
    return name.startswith(MTP_PREFIX)


def _expert_stacks(hf: Mapping[str, np.ndarray], num_experts: int) -> dict[str, np.ndarray]:
    """The routed experts' [E, out, in] weights by projection, from either original layout."""
    experts = MTP_LAYER + "mlp.experts."
    fused = hf.get(experts + "gate_up_proj")
    if fused is not None:
        half = fused.shape[-2] // 2
        return {
            "gate_proj": fused[..., :half, :],
            "up_proj": fused[..., half:, :],
            "down_proj": hf[experts + "down_proj"],
        }
    return {
        proj: np.stack([hf[f"{experts}{e}.{proj}.weight"] for e in range(num_experts)])
        for proj in _PROJECTIONS
    }  # bf16 bits as they are: converted one expert at a time


def is_routed_expert(name: str) -> bool:
    """Whether an original tensor is one of the routed experts' (stacked by `_expert_stacks`)."""
    return name.startswith(MTP_LAYER + "mlp.experts.")


def _float32(tensor: np.ndarray) -> np.ndarray:
    """An original tensor as float32 (bf16 arrives as uint16 bits, as Lily's reader gives it)."""
    return bf16_to_float32(tensor) if tensor.dtype == np.uint16 else np.asarray(tensor, np.float32)


def quantize_mtp_head(hf: Mapping[str, np.ndarray], num_experts: int) -> dict[str, np.ndarray]:
    """The MTP head in Lily's layout (see the module docstring) from the original `mtp.*`
    tensors (float arrays, or bf16 as uint16 bits, under their Hugging Face names; other names
    are ignored). bf16 values are handed back as uint16 bits, quantized triples as U32 codes
    and bf16 scales/biases."""
    out: dict[str, np.ndarray] = {}

    def linear(path: str, weight: np.ndarray) -> None:
        # Rounded to bf16 first, as mlx-lm rounds a bf16 checkpoint's weights before quantizing;
        # a stack of experts one expert at a time (the real head's are 1.6 GB in bf16).
        spec = mtp_quant(path)
        parts = [weight] if weight.ndim == 2 else list(weight)
        triples = [
            quantize(round_to_bf16(_float32(part)), spec.bits, spec.group_size) for part in parts
        ]
        packed, scales, biases = (
            triples[0] if weight.ndim == 2 else [np.stack(t) for t in zip(*triples, strict=True)]
        )
        out[path + ".weight"], out[path + ".scales"], out[path + ".biases"] = packed, scales, biases

    for name, tensor in hf.items():
        if not is_mtp(name) or is_routed_expert(name):
            continue
        if name.endswith(_ZERO_CENTRED_NORMS):
            out[name] = float32_to_bf16(1 + _float32(tensor))
        elif name.endswith(".weight") and np.ndim(tensor) == 2:
            linear(name.removesuffix(".weight"), tensor)
        else:
            raise ValueError(f"unexpected MTP tensor {name} of shape {list(np.shape(tensor))}")
    for proj, stack in _expert_stacks(hf, num_experts).items():
        linear(f"{MTP_LAYER}mlp.switch_mlp.{proj}", stack)
    return out


def write_mtp_index(directory: Path, names: Iterable[str]) -> None:
    """Lists the head's tensors `names` under MTP_SHARD in `directory`'s
    `model.safetensors.index.json`, when it has one (without, every shard there is read)."""
    from lily.checkpoint.safetensors_mmap import INDEX_FILE

    index_path = directory / INDEX_FILE
    if not index_path.exists():
        return
    index = json.loads(index_path.read_text())
    index["weight_map"].update(dict.fromkeys(sorted(names), MTP_SHARD))
    # A new file rather than a rewrite: the index may be a hard link shared with another copy.
    fresh = index_path.with_name(index_path.name + ".new")
    fresh.write_text(json.dumps(index, indent=4))
    os.replace(fresh, index_path)
