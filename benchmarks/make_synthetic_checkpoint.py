"""Write a full-size random Qwen3.6-35B-A3B checkpoint in the mlx-community 4-bit format.

Usage: python benchmarks/make_synthetic_checkpoint.py OUT_DIR [--seed N] [--shard-gb 5] [--zeros]

Exactly the real tensor names, shapes and dtypes (taken from lily.checkpoint.validate's expected
layout of
the real config) and a config.json with the real values and mlx-lm's per-path quantization
overrides: about 19.5 GB in ~5 GB shards with model.safetensors.index.json. Weights are random
(not a model): uniform 4/8-bit codes with scales and biases that centre each dequantized
projection on 0 with about 1/sqrt(in_features) spread, norms near 1. Tensors are streamed
in chunks, so memory stays small whatever the checkpoint size. The output is a deterministic
function of the seed. Every tensor starts on a 16-byte boundary of its shard, as Lily's
loader requires.

With `--zeros` (`write_checkpoint(..., zeros=True)`) the shards hold the headers alone and every
tensor's bytes are a hole of the file, read as zeros: written at once and taking no disk, for
recording the full-size graphs on a sim that does not execute them (bench_speculative.py).
"""

from __future__ import annotations

import argparse
import json
import struct
import zlib
from collections.abc import Iterator
from pathlib import Path

import numpy as np
from tqdm import tqdm

from lily.checkpoint.config import parse_config
from lily.checkpoint.safetensors_mmap import DATA_ALIGNMENT, INDEX_FILE, NUMPY_DTYPES
from lily.checkpoint.validate import (
    GATE_SUFFIXES,
    GROUP_SIZE,
    REAL_MODEL,
    ExpectedTensor,
    expected_tensors,
)

CHUNK_ELEMENTS = 16 << 20
ZERO_CENTRED_NORMS = (
    "input_layernorm.weight",
    "post_attention_layernorm.weight",
    "q_norm.weight",
    "k_norm.weight",
    "model.norm.weight",
)


def real_config() -> dict:
    """config.json as an mlx-community conversion of Qwen3.6-35B-A3B writes it."""
    n_layers = REAL_MODEL["num_hidden_layers"]
    rope_keys = ("rope_theta", "partial_rotary_factor")
    text = {key: value for key, value in REAL_MODEL.items() if key not in rope_keys}
    text.update(
        model_type="qwen3_5_moe_text",
        dtype="bfloat16",
        full_attention_interval=4,
        layer_types=[
            "full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(n_layers)
        ],
        mtp_num_hidden_layers=1,
        eos_token_id=248044,
        rope_parameters={
            "type": "default",
            "rope_theta": REAL_MODEL["rope_theta"],
            "partial_rotary_factor": REAL_MODEL["partial_rotary_factor"],
            "mrope_section": [11, 11, 10],
            "mrope_interleaved": True,
        },
    )
    quantization: dict[str, object] = {"group_size": 64, "bits": 4, "mode": "affine"}
    for i in range(n_layers):
        for suffix in GATE_SUFFIXES:
            quantization[f"language_model.model.layers.{i}{suffix}"] = {"group_size": 64, "bits": 8}
    return {
        "architectures": ["Qwen3_5MoeForConditionalGeneration"],
        "model_type": "qwen3_5_moe",
        "tie_word_embeddings": False,
        "text_config": text,
        "quantization": quantization,
        "quantization_config": quantization,
    }


def to_bf16_bits(x: np.ndarray) -> np.ndarray:
    """float32 -> bfloat16 raw bits, rounding to nearest even."""
    bits = x.astype(np.float32).view(np.uint32)
    return ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16)


def _rng(seed: int, key: str) -> np.random.Generator:
    # One generator per key: a module's scales and biases draw the same sequence, and the
    # output does not depend on shard boundaries or write order.
    return np.random.default_rng([seed, zlib.crc32(key.encode())])


def tensor_chunks(t: ExpectedTensor, seed: int) -> Iterator[np.ndarray]:
    """The tensor's contents as consecutive flat chunks."""
    count = int(np.prod(t.shape))
    name = t.name
    module = name.rsplit(".", 1)[0]
    rng = _rng(seed, module if name.endswith((".scales", ".biases")) else name)
    for start in range(0, count, CHUNK_ELEMENTS):
        n = min(CHUNK_ELEMENTS, count - start)
        if t.dtypes[0] == "U32":
            yield rng.integers(0, 1 << 32, n, dtype=np.uint32)
        elif name.endswith((".scales", ".biases")):
            # Codes are uniform in [0, 2^bits), so bias = -(2^bits - 1)/2 * scale centres the
            # weights on 0, and a scale of ~1 / (code std * sqrt(in_features)) keeps a
            # projection's outputs at the size of its inputs.
            in_features = t.shape[-1] * GROUP_SIZE
            levels = 2 ** (8 if module.endswith(GATE_SUFFIXES) else 4)
            code_std = levels / 12**0.5
            scales = rng.uniform(0.5, 1.5, n) / (code_std * in_features**0.5)
            yield to_bf16_bits(scales if name.endswith(".scales") else -(levels - 1) / 2 * scales)
        elif name.endswith("A_log"):
            yield np.log(rng.uniform(0.1, 4.0, n)).astype(np.float32)
        elif name.endswith("dt_bias"):
            yield to_bf16_bits(rng.normal(0, 0.5, n))
        elif name.endswith("conv1d.weight"):
            yield to_bf16_bits(rng.normal(0, 0.3, n))
        elif name.endswith(ZERO_CENTRED_NORMS) or name.endswith("linear_attn.norm.weight"):
            # MLX files store 1+w for the zero-centred norms; the gated norm is a gain near 1.
            yield to_bf16_bits(1 + rng.normal(0, 0.1, n))
        else:
            raise ValueError(f"no generator for {name}")


def nbytes(t: ExpectedTensor) -> int:
    return int(np.prod(t.shape)) * NUMPY_DTYPES[t.dtypes[0]].itemsize


def plan_shards(tensors: list[ExpectedTensor], max_bytes: int) -> list[list[ExpectedTensor]]:
    shards: list[list[ExpectedTensor]] = [[]]
    size = 0
    for t in tensors:
        if shards[-1] and size + nbytes(t) > max_bytes:
            shards.append([])
            size = 0
        shards[-1].append(t)
        size += nbytes(t)
    return shards


def write_shard(
    path: Path, tensors: list[ExpectedTensor], seed: int, progress: tqdm | None
) -> None:
    """The shard's header, then its tensors' random contents, or without `progress` (zeros)
    the file extended over them unwritten."""
    header: dict[str, object] = {"__metadata__": {"format": "mlx"}}
    offset = 0
    for t in tensors:
        # Every real tensor is a multiple of 16 bytes, so they pack without gaps.
        assert nbytes(t) % DATA_ALIGNMENT == 0, t.name
        header[t.name] = {
            "dtype": t.dtypes[0],
            "shape": list(t.shape),
            "data_offsets": [offset, offset + nbytes(t)],
        }
        offset += nbytes(t)
    encoded = json.dumps(header, separators=(",", ":")).encode()
    encoded += b" " * (-(8 + len(encoded)) % DATA_ALIGNMENT)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(encoded)))
        f.write(encoded)
        if progress is None:
            f.truncate(8 + len(encoded) + offset)
            return
        for t in tensors:
            for chunk in tensor_chunks(t, seed):
                f.write(chunk.tobytes())
                progress.update(chunk.nbytes)


def write_checkpoint(
    out: Path, seed: int = 0, shard_bytes: int = 5 << 30, zeros: bool = False
) -> tuple[int, int, int]:
    """The real config's checkpoint in `out`, random or (`zeros`) holes; returns the tensors,
    bytes and shards written."""
    config_json = real_config()
    tensors = sorted(expected_tensors(parse_config(config_json)).values(), key=lambda t: t.name)
    shards = plan_shards(tensors, shard_bytes)
    total = sum(nbytes(t) for t in tensors)
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(config_json, indent=2))
    weight_map = {}
    with tqdm(total=total, unit="B", unit_scale=True, desc="writing", disable=zeros) as progress:
        for i, shard in enumerate(shards):
            name = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
            write_shard(out / name, shard, seed, None if zeros else progress)
            weight_map.update({t.name: name for t in shard})
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    (out / INDEX_FILE).write_text(json.dumps(index, indent=2))
    return len(tensors), total, len(shards)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out_dir", type=Path)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--shard-gb", type=float, default=5.0, help="maximum shard size (GiB)")
    parser.add_argument("--zeros", action="store_true", help="tensors as holes (zeros)")
    args = parser.parse_args()
    count, total, shards = write_checkpoint(
        args.out_dir, args.seed, int(args.shard_gb * (1 << 30)), args.zeros
    )
    print(f"wrote {count} tensors, {total / 1e9:.2f} GB in {shards} shards to {args.out_dir}")


if __name__ == "__main__":
    main()
