"""The checkpoint's tensors on a device, where they lie: every shard is wrapped once as a device
buffer over its memory map, and each tensor is bound as (shard buffer, byte offset). Nothing is
copied, so 19.5 GB of weights cost no extra memory on either device.

The exception is a checkpoint loaded without its aligned copy (no disk room for it, see
`lily.checkpoint.loader.aligned_checkpoint`): its tensors that do not start on a 16-byte boundary
are
copied into device memory, once per load, and a shard is wrapped only if one of its tensors is
bound in place (so that a wrapped shard's pages are not kept wired next to the copies).
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import TYPE_CHECKING

from lily.kernels import BufferRef
from lily.kernels.quant_weight import GROUP_SIZE, QuantWeight

if TYPE_CHECKING:
    from lily.checkpoint.loader import Checkpoint
    from lily.device import Buffer, Device


class DeviceWeights:
    def __init__(self, checkpoint: Checkpoint, device: Device) -> None:
        self.checkpoint = checkpoint
        self.device = device
        self._shards: dict[Path, Buffer] = {}
        self._copies: dict[str, Buffer] = {}
        if checkpoint.unaligned:
            nbytes = sum(checkpoint.locations[n].nbytes for n in checkpoint.unaligned)
            print(
                f"lily: {len(checkpoint.unaligned)} tensors ({nbytes / 1e9:.2f} GB) of "
                f"{checkpoint.path} are not 16-byte aligned: copying them into device memory",
                file=sys.stderr,
            )

    def tensor(self, name: str) -> BufferRef:
        """An unquantized tensor (bf16 norms, f32 A_log, ...) bound where it lies, or its copy
        in device memory when it lies unaligned."""
        info = self.checkpoint.locations[name]
        shard = self.checkpoint.shards[info.shard]
        if name in self.checkpoint.unaligned:
            if name not in self._copies:
                copy = self.device.alloc(info.nbytes)
                copy.numpy()[:] = shard.buffer[info.offset : info.offset + info.nbytes]
                self._copies[name] = copy
            return self._copies[name], 0
        if info.shard not in self._shards:
            # Each tensor is a region of its shard: the checking sim holds a binding to its
            # tensor.
            regions = [
                (other.offset, other.nbytes)
                for other in self.checkpoint.locations.values()
                if other.shard == info.shard
            ]
            self._shards[info.shard] = self.device.wrap(shard.buffer, regions)
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
