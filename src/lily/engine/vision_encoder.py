"""The vision tower on the device: an image's patch rows to its embeddings in the language
model's hidden size, on the kernels of `metal/vision.metal` (docs/vision.md, "The encoder on the
device"). It computes what lily.engine.vision_reference.VisionTower computes, step for step.

The weights are on the device once, bf16 as the checkpoint stores them (bound where they lie in
the checkpoint, as the language model's are); activations are fp32 from the patch rows to the
output. The rotary angles depend only on the patch grid: their cos and sin
tables are computed on the host, per image, with the reference's own function (rotary_angles).

A graph is recorded for each call rather than kept per grid shape: recording its 8 dispatches
per block (221 at full size) is cheap next to the encode itself, and graphs kept per shape would
keep the activation buffers of every image size seen alive (at full size, hundreds of MB for a
large image). The graph is cut into command buffers of at most `command_buffer_flops` of estimated
work each, as the prefill's are (lily.engine.command_buffer_budget): attention grows with the
square of the patches, so a large image's block is split by rows, and its attention by query
rows, to keep every command buffer far from macOS's GPU watchdog.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from lily.checkpoint.quant import float32_to_bf16
from lily.checkpoint.vision import VISION_PREFIX, VisionConfig, parse_vision_config, vision_weights
from lily.device import Graph
from lily.engine.command_buffer_budget import command_buffer_flops
from lily.engine.device_weights import DeviceWeights
from lily.engine.vision_reference import rotary_angles
from lily.kernels import BufferRef, offset_by
from lily.kernels.vision import (
    ATTENTION_ROWS,
    LINEAR_TILE,
    Epilogue,
    record_attention,
    record_layer_norm,
    record_linear,
    record_position_embedding,
    record_rotary,
    rotary_tables,
)

if TYPE_CHECKING:
    from lily.checkpoint.loader import Checkpoint
    from lily.device import Buffer, Device
    from lily.engine.image_input import ImagePatches

PATCH_WEIGHT = "patch_embed.proj.weight"
POSITION_TABLE = "pos_embed.weight"
# The slowest supported Mac's budget (lily.engine.command_buffer_budget) unless told another.
DEFAULT_COMMAND_BUFFER_FLOPS = command_buffer_flops("", 0)


@dataclass
class EncodePass:
    """One image's recorded pass: run `graph`, then `out` holds the embeddings. `buffers` keeps
    every buffer the graph binds alive as long as the graph."""

    graph: Graph
    out: Buffer
    tokens: int
    buffers: list[Buffer]


class VisionEncoder:
    """`VisionEncoder(device, config, weights).encode(image)`: the tower of one checkpoint on a
    device. `weights` are the tower's tensors by name without `vision_tower.`: numpy arrays,
    float32 (as lily.checkpoint.vision.vision_weights gives them; rounded to bf16, which is exact
    for the bf16 tensors of a converted checkpoint) or raw bf16 bits (uint16), are uploaded;
    bf16 tensors already on the device (BufferRefs, as DeviceWeights binds a checkpoint's) are
    used where they lie. `command_buffer_flops`: the most estimated work of one command buffer
    (the engine's budget for its Mac)."""

    def __init__(
        self,
        device: Device,
        config: VisionConfig,
        weights: Mapping[str, np.ndarray | BufferRef],
        command_buffer_flops: float = DEFAULT_COMMAND_BUFFER_FLOPS,
    ) -> None:
        self.device = device
        self.config = config
        self.command_buffer_flops = command_buffer_flops
        self._weights: dict[str, BufferRef] = {}
        for name, value in weights.items():
            if not isinstance(value, np.ndarray):
                self._weights[name] = value
                continue
            bits = value if value.dtype == np.uint16 else float32_to_bf16(value)
            if name == PATCH_WEIGHT:
                # Stored channels-last [D, T, P, P, C]; the rows are channel-major (C, T, P, P).
                bits = bits.transpose(0, 4, 1, 2, 3).reshape(config.hidden_size, -1)
            self._weights[name] = self._upload(bits)

    @classmethod
    def from_checkpoint(
        cls,
        device: Device,
        checkpoint: Checkpoint,
        command_buffer_flops: float = DEFAULT_COMMAND_BUFFER_FLOPS,
    ) -> VisionEncoder:
        """The tower of a loaded checkpoint (lily.checkpoint.loader.load_checkpoint). Its bf16
        tensors are bound where they lie in the checkpoint's shards, as the language model's
        are (DeviceWeights: no copy), except the patch embedding's kernel, which is reordered
        into a copy of 3.5 MB; a checkpoint with a quantized projection (which mlx-vlm's
        converter never writes) goes through vision_weights, dequantized, and is uploaded."""
        config = parse_vision_config(checkpoint.config.raw)
        names = [name for name in checkpoint.tensors if name.startswith(VISION_PREFIX)]
        if not all(checkpoint.tensors[name].dtype == np.uint16 for name in names):
            weights = vision_weights(checkpoint.tensors, checkpoint.config)
            return cls(device, config, weights, command_buffer_flops)
        on_device = DeviceWeights(checkpoint, device)
        bound: dict[str, np.ndarray | BufferRef] = {
            name.removeprefix(VISION_PREFIX): on_device.tensor(name) for name in names
        }
        bound[PATCH_WEIGHT] = checkpoint.tensors[VISION_PREFIX + PATCH_WEIGHT]
        return cls(device, config, bound, command_buffer_flops)

    def _upload(self, array: np.ndarray) -> Buffer:
        data = np.ascontiguousarray(array)
        buffer = self.device.scratch(data.nbytes)
        buffer.numpy()[:] = data.reshape(-1).view(np.uint8)
        return buffer

    def _scratch(self, rows: int, width: int) -> Buffer:
        return self.device.scratch(4 * rows * width)

    def encode(self, image: ImagePatches) -> np.ndarray:
        """The image's embeddings [num_tokens, out_hidden_size] float32, in merge-block order
        (the order of its tokens in the prompt)."""
        recorded = self.record(image)
        self.device.run(recorded.graph)
        out = recorded.out.numpy().view(np.float32)
        return out.reshape(recorded.tokens, self.config.out_hidden_size).copy()

    def record(self, image: ImagePatches) -> EncodePass:
        """The pass of one image, recorded with its inputs uploaded, not yet run."""
        c, w = self.config, self._weights
        t, h, width = image.grid_thw
        rows, frame = t * h * width, h * width
        merge = c.spatial_merge_size
        if image.merge_size != merge or h % merge or width % merge:
            raise ValueError(f"grid {image.grid_thw} is not made of {merge} x {merge} blocks")
        if image.pixel_values.shape != (rows, c.patch_values):
            raise ValueError(
                f"pixel values {image.pixel_values.shape} do not match grid {image.grid_thw}"
            )
        d, mlp, tokens = c.hidden_size, c.intermediate_size, rows // merge**2
        merged = d * merge**2  # a merge block's rows concatenated
        eps, budget = c.layer_norm_eps, self.command_buffer_flops

        cos, sin = rotary_tables(rotary_angles(image.grid_thw, merge, c.head_dim, c.rope_theta))
        pixels = self._upload(image.pixel_values.astype(np.float32, copy=False))
        x = self._scratch(rows, d)
        cos_table, sin_table = self._upload(cos), self._upload(sin)
        normed, qkv, mixed = (
            self._scratch(rows, d),
            self._scratch(rows, 3 * d),
            self._scratch(rows, d),
        )
        hidden, merged_hidden = self._scratch(rows, mlp), self._scratch(tokens, merged)
        out = self._scratch(tokens, c.out_hidden_size)

        graph = Graph()
        spent = 0.0

        def account(flops: float) -> None:
            """Starts a new command buffer before work that would take this one over budget."""
            nonlocal spent
            if spent and spent + flops > budget:
                graph.end_command_buffer()
                spent = 0.0
            spent += flops

        # Each step reads what the one before it wrote: a barrier after every step.
        def linear(
            name: str,
            source: Buffer,
            target: Buffer,
            n: int,
            k: int,
            epilogue: Epilogue = Epilogue.STORE,
            m: int = rows,
        ) -> None:
            weight, bias = w[f"{name}.weight"], w[f"{name}.bias"]
            piece = max(1, int(budget / (2 * n * k)) // LINEAR_TILE) * LINEAR_TILE
            for start in range(0, m, piece):
                count = min(piece, m - start)
                account(2 * count * n * k)
                record_linear(
                    graph, self.device, offset_by(source, 4 * start * k), weight, bias,
                    offset_by(target, 4 * start * n), count, n, k, epilogue,
                )  # fmt: skip
            graph.barrier()

        def layer_norm(name: str) -> None:
            record_layer_norm(
                graph, self.device, x, w[f"{name}.weight"], w[f"{name}.bias"], normed, rows, d, eps
            )
            graph.barrier()

        def attention() -> None:
            per_query = 4 * t * frame * d  # q k^T and p v over every head of every frame
            piece = max(1, int(budget / per_query) // ATTENTION_ROWS) * ATTENTION_ROWS
            for start in range(0, frame, piece):
                queries = range(start, min(start + piece, frame))
                account(per_query * len(queries))
                record_attention(
                    graph, self.device, qkv, mixed, t, frame, c.num_heads, c.head_dim, queries
                )
            graph.barrier()

        # x = position embedding + patch embedding.
        side, table = c.position_grid_side, w[POSITION_TABLE]
        record_position_embedding(graph, self.device, table, x, image.grid_thw, merge, side, d)
        graph.barrier()
        linear("patch_embed.proj", pixels, x, d, c.patch_values, Epilogue.ADD)
        for i in range(c.depth):
            block = f"blocks.{i}"
            layer_norm(f"{block}.norm1")
            linear(f"{block}.attn.qkv", normed, qkv, 3 * d, d)
            record_rotary(
                graph, self.device, qkv, cos_table, sin_table, rows, c.num_heads, c.head_dim
            )
            graph.barrier()
            attention()
            linear(f"{block}.attn.proj", mixed, x, d, d, Epilogue.ADD)
            layer_norm(f"{block}.norm2")
            linear(f"{block}.mlp.linear_fc1", normed, hidden, mlp, d, Epilogue.GELU_TANH)
            linear(f"{block}.mlp.linear_fc2", hidden, x, d, mlp, Epilogue.ADD)
        # The merger: rows are in merge-block order, so the normed [rows, d] read as
        # [tokens, d * merge^2] is each block's rows concatenated, with no copy.
        layer_norm("merger.norm")
        linear(
            "merger.linear_fc1", normed, merged_hidden, merged, merged, Epilogue.GELU_ERF, m=tokens
        )
        linear("merger.linear_fc2", merged_hidden, out, c.out_hidden_size, merged, m=tokens)
        buffers = [pixels, x, cos_table, sin_table, normed, qkv, mixed, hidden, merged_hidden, out]
        return EncodePass(graph, out, tokens, buffers)
