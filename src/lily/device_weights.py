"""The checkpoint's tensors on a device, where they lie: every shard is wrapped once as a device
buffer over its memory map, and each tensor is bound as (shard buffer, byte offset). Nothing is
copied, so 19.5 GB of weights cost no extra memory on either device."""

from __future__ import annotations

from typing import TYPE_CHECKING

from lily.kernels import BufferRef
from lily.kernels.quantized import GROUP_SIZE, QuantWeight

if TYPE_CHECKING:
    from lily.checkpoint import Checkpoint
    from lily.device import Device


class DeviceWeights:
    def __init__(self, checkpoint: Checkpoint, device: Device) -> None:
        self.checkpoint = checkpoint
        # Each tensor is a region of its shard: the checking sim holds a binding to its tensor.
        regions: dict = {path: [] for path in checkpoint.shards}
        for info in checkpoint.locations.values():
            regions[info.shard].append((info.offset, info.nbytes))
        self._shards = {
            path: device.wrap(shard.buffer, regions[path])
            for path, shard in checkpoint.shards.items()
        }

    def tensor(self, name: str) -> BufferRef:
        """An unquantized tensor (bf16 norms, f32 A_log, ...) bound where it lies."""
        info = self.checkpoint.locations[name]
        return self._shards[info.shard], info.offset

    def quantized(self, base: str) -> QuantWeight:
        """The MLX affine triple `<base>.weight|scales|biases`; a leading axis is a stack of
        experts. The bit width follows from the shapes (validated against the config on load)."""
        locations = self.checkpoint.locations
        weight = locations[f"{base}.weight"]
        scales = locations[f"{base}.scales"]
        in_dim = scales.shape[-1] * GROUP_SIZE
        return QuantWeight(
            weight=self.tensor(f"{base}.weight"),
            scales=self.tensor(f"{base}.scales"),
            biases=self.tensor(f"{base}.biases"),
            rows=weight.shape[-2],
            in_dim=in_dim,
            bits=weight.shape[-1] * 32 // in_dim,
            experts=weight.shape[0] if len(weight.shape) == 3 else 1,
        )
