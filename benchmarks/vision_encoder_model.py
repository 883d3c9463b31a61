"""A model (not a measurement: nothing here runs on a GPU) of the vision encoder's time per image
on the Macs of `prefill_model.py`, for the real tower (lily.engine.vision_encoder on the kernels
of metal/vision.metal; docs/vision.md, "The encoder on the device").

Usage::

    python benchmarks/vision_encoder_model.py            # the estimate per image size and Mac
    python benchmarks/vision_encoder_model.py --stages   # and each stage's FLOPs and bytes
    python benchmarks/vision_encoder_model.py --host     # and the host's per-image inputs, timed
    python benchmarks/vision_encoder_model.py --sim      # and a tiny random tower timed on the sim

**The method is prefill_model.py's**: each stage takes the longer of its bytes at the memory
bandwidth and its FLOPs at the rate of what runs them, with the same GPU figures (`GPUS`:
published bandwidths, the fp32 rate of command_buffer_budget), memory efficiency, drain per
barrier level and gap per command buffer. The stages run one after another (each reads the one
before it). Bytes are counted as prefill_model counts them: every weight read once per image (the
whole image is one pass; the tower is 852 MiB of bf16), every activation written once and read
once by each stage that uses it, fp32; attention streams each frame's K and V once per
threadgroup of 32 query rows and head, all counted from memory (caches may serve part of it).

**Rates.** Both the linear maps (vision_linear) and attention's two products (vision_attention)
run on fp32 simdgroup-matrix fragments: the fp32 rate (fp32 simdgroup FMAs issue at it on every
GPU here; the M5's tensor units are not used by these kernels), the linear maps at
prefill_model's GEMM efficiencies (40-60-70%), attention at its chunk-attention efficiencies
(25-40-50%: the online softmax sits between the two products, as in attention_chunk). The norms
and the rotary embedding are bandwidth-bound.

The host computes one per-image input, the rotary cos and sin tables, with numpy; `--host`
times that on this machine, which is not a Mac. `--sim` times the encoder of a tiny random tower
(the tiny test checkpoints' dims) on the sim device: the CPU's time, which says nothing of a Mac's.
"""

from __future__ import annotations

import argparse
import math
import time
from dataclasses import dataclass

import numpy as np
from prefill_model import (
    ATTENTION,
    CENTRAL,
    COMMAND_BUFFER_SECONDS,
    FAST,
    GPUS,
    HALF_GEMM,
    LEVEL_SECONDS,
    MEMORY_EFFICIENCY,
    SLOW,
    Gpu,
)

from lily.chat.images import ProcessorConfig, resized_size
from lily.checkpoint.demo import demo_checkpoint_dir
from lily.checkpoint.loader import load_checkpoint
from lily.checkpoint.vision import VisionConfig, parse_vision_config
from lily.device import open_device
from lily.engine.image_input import ImagePatches
from lily.engine.vision_encoder import VisionEncoder
from lily.engine.vision_reference import rotary_angles
from lily.kernels.vision import ATTENTION_ROWS

# Qwen3.6-35B-A3B's vision_config (docs/vision.md, "Dimensions").
REAL_TOWER = VisionConfig(
    depth=27,
    hidden_size=1152,
    num_heads=16,
    intermediate_size=4304,
    patch_size=16,
    temporal_patch_size=2,
    spatial_merge_size=2,
    out_hidden_size=2048,
    num_position_embeddings=2304,
)
IMAGES = ((448, 448), (1024, 768), (1920, 1080))  # width x height
SIM_IMAGES = ((256, 256), (448, 448))
ATTENTION_EFFICIENCY = ATTENTION
GEMM_EFFICIENCY = HALF_GEMM
FP32, BF16 = 4, 2
# Barrier levels per block (norm1, qkv, rotary, attention, proj, norm2, fc1, fc2) and outside
# the blocks (position embedding, patch embedding, merger norm, fc1, fc2).
LEVELS_PER_BLOCK, OTHER_LEVELS = 8, 5


@dataclass(frozen=True)
class Stage:
    name: str
    flops: float
    bytes: float
    attention: bool = False


def grid(width: int, height: int) -> tuple[int, int, int]:
    """The patch grid (t, h, w) the preprocessor gives an image of this size."""
    h, w = resized_size(height, width, ProcessorConfig())
    return 1, h // REAL_TOWER.patch_size, w // REAL_TOWER.patch_size


def linear(name: str, rows: int, n: int, k: int, output_reads: int = 0) -> Stage:
    """rows x k fp32 @ (n x k bf16 + bias)^T: the weights once, the input read, the output written
    (and read first, `output_reads` = 1, for a residual add)."""
    weights = BF16 * (n * k + n)
    activations = FP32 * rows * (k + n * (1 + output_reads))
    return Stage(name, 2.0 * rows * n * k, float(weights + activations))


def stages(c: VisionConfig, grid_thw: tuple[int, int, int]) -> list[Stage]:
    """The work of one image's pass, stage by stage, over all blocks."""
    t, h, w = grid_thw
    n, frame = t * h * w, h * w
    d, mlp, depth = c.hidden_size, c.intermediate_size, c.depth
    tokens, merged = n // c.spatial_merge_size**2, d * c.spatial_merge_size**2
    norm_bytes = FP32 * 2 * n * d + BF16 * 2 * d  # one read, one write, weight and bias
    query_blocks = math.ceil(frame / ATTENTION_ROWS)
    # Each threadgroup (ATTENTION_ROWS query rows of one head) streams its frame's K and V.
    kv_reads = FP32 * 2 * t * query_blocks * c.num_heads * frame * c.head_dim
    per_block = [
        Stage("LayerNorms", 2 * 8.0 * n * d, 2.0 * norm_bytes),
        linear("qkv", n, 3 * d, d),
        Stage("rotary", 6.0 * n * 2 * d, FP32 * (2 * 2 * n * d + n * c.head_dim)),
        Stage(
            "attention",
            4.0 * t * frame * frame * d,
            float(kv_reads + FP32 * n * d * 2),  # + q read, output written
            attention=True,
        ),
        linear("attention proj", n, d, d, output_reads=1),
        linear("MLP fc1", n, mlp, d),
        linear("MLP fc2", n, d, mlp, output_reads=1),
    ]
    position_grid = BF16 * c.num_position_embeddings * d
    out = [
        Stage("position embedding", 8.0 * n * d, float(position_grid + FP32 * n * d)),
        linear("patch embedding", n, d, c.patch_values, output_reads=1),
        *(Stage(s.name, depth * s.flops, depth * s.bytes, s.attention) for s in per_block),
        Stage("merger LayerNorm", 8.0 * n * d, float(norm_bytes)),
        linear("merger fc1", tokens, merged, merged),
        linear("merger fc2", tokens, c.out_hidden_size, merged),
    ]
    return out


def stage_seconds(stage: Stage, gpu: Gpu, case: int) -> float:
    efficiency = ATTENTION_EFFICIENCY if stage.attention else GEMM_EFFICIENCY
    compute = stage.flops / (gpu.fp32_rate * efficiency[case])
    return max(stage.bytes / (gpu.bandwidth * MEMORY_EFFICIENCY[case]), compute)


def image_seconds(c: VisionConfig, grid_thw: tuple[int, int, int], gpu: Gpu, case: int) -> float:
    work = stages(c, grid_thw)
    # The encoder cuts command buffers at the Mac's budget of estimated FLOPs.
    flops = sum(s.flops for s in work)
    command_buffers = math.ceil(flops / gpu.command_buffer_flops)
    levels = LEVELS_PER_BLOCK * c.depth + OTHER_LEVELS
    overhead = levels * LEVEL_SECONDS + command_buffers * COMMAND_BUFFER_SECONDS
    return sum(stage_seconds(s, gpu, case) for s in work) + overhead


def host_inputs_seconds(c: VisionConfig, grid_thw: tuple[int, int, int]) -> float:
    """The host's per-image input (the rotary tables), timed on this machine."""
    start = time.perf_counter()
    angles = rotary_angles(grid_thw, c.spatial_merge_size, c.head_dim, c.rope_theta)
    np.cos(angles).astype(np.float32), np.sin(angles).astype(np.float32)
    return time.perf_counter() - start


def time_on_sim() -> None:
    rng = np.random.default_rng(0)
    demo = load_checkpoint(demo_checkpoint_dir())
    encoder = VisionEncoder.from_checkpoint(open_device("sim"), demo)
    tower = parse_vision_config(demo.config.raw)
    print("\nsim (this machine's CPU, not a Mac), the demo's random tower (2 blocks, 64 wide):")
    for width, height in SIM_IMAGES:
        grid_thw = grid(width, height)
        rows = rng.uniform(-1, 1, (math.prod(grid_thw), tower.patch_values))
        image = ImagePatches(rows.astype(np.float32), grid_thw, tower.spatial_merge_size)
        encoder.encode(image)  # the first call pays for the kernels' first use
        start = time.perf_counter()
        encoder.encode(image)
        seconds = time.perf_counter() - start
        print(f"  {width}x{height} ({image.num_tokens} tokens): {seconds * 1e3:.0f} ms on the sim")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--stages", action="store_true", help="print each stage's work")
    parser.add_argument("--host", action="store_true", help="time the host's per-image inputs")
    parser.add_argument("--sim", action="store_true", help="time a tiny tower on the sim")
    args = parser.parse_args()
    c = REAL_TOWER
    print("A model, not a measurement: no Mac ran this (inputs: prefill_model.py's GPU figures")
    print(f"and efficiencies; attention at {ATTENTION_EFFICIENCY} of the fp32 rate).")
    for width, height in IMAGES:
        grid_thw = grid(width, height)
        patches = math.prod(grid_thw)
        tokens = patches // c.spatial_merge_size**2
        work = stages(c, grid_thw)
        flops = sum(s.flops for s in work)
        attention = sum(s.flops for s in work if s.attention)
        print(
            f"\n{width}x{height}: grid {grid_thw[1]}x{grid_thw[2]} patches, {tokens} LM tokens; "
            f"{flops / 1e12:.2f} TFLOP, {sum(s.bytes for s in work) / 1e9:.1f} GB; "
            f"attention (N^2) {attention / flops:.0%} of the FLOPs"
        )
        if args.stages:
            for s in work:
                ms = ", ".join(f"{g.name} {1e3 * stage_seconds(s, g, CENTRAL):.1f}" for g in GPUS)
                print(
                    f"  {s.name:<18} {s.flops / 1e9:8.1f} GFLOP {s.bytes / 1e9:7.2f} GB  ms: {ms}"
                )
        for gpu in GPUS:
            slow, central, fast = (
                1e3 * image_seconds(c, grid_thw, gpu, k) for k in (SLOW, CENTRAL, FAST)
            )
            print(
                f"vision encoder estimate, {width}x{height} ({patches} patches, {tokens} tokens): "
                f"{gpu.name} {central:.0f} ms (range {fast:.0f}-{slow:.0f} ms)"
            )
        if args.host:
            seconds = host_inputs_seconds(c, grid_thw)
            print(f"host rotary tables, on this machine (not a Mac): {seconds * 1e3:.1f} ms")
    if args.sim:
        time_on_sim()


if __name__ == "__main__":
    main()
