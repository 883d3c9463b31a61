"""An MLX-quantized weight where it lies in device memory: the one description every quantized
kernel launcher (GEMV, GEMM, the MoE and the embedding gather) takes."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from lily.kernels import BufferRef, require_aligned

if TYPE_CHECKING:
    from collections.abc import Callable

    from lily.device import Buffer, Device

# Weights share one scale and bias per this many inputs (MLX's group size).
GROUP_SIZE = 64


@dataclass(frozen=True)
class QuantWeight:
    """An MLX-quantized projection where it lies in memory.

    `weight` holds uint32 codes [experts?, rows, in_dim * bits / 32]; `scales` and `biases` hold
    bf16 [experts?, rows, in_dim / 64]. `experts` > 1 for stacked expert tensors.
    """

    weight: BufferRef
    scales: BufferRef
    biases: BufferRef
    rows: int
    in_dim: int
    bits: int
    experts: int = 1

    def __post_init__(self) -> None:
        if self.bits not in (4, 8):
            raise ValueError(f"unsupported bit width {self.bits}")
        if self.in_dim % GROUP_SIZE:
            raise ValueError(f"input dimension {self.in_dim} is not a multiple of {GROUP_SIZE}")
        # Codes are read 16 bytes at a time; every row is a multiple of 32 bytes long.
        require_aligned(self.weight, 16, "quantized weight")
        require_aligned(self.scales, 2, "quantization scales")
        require_aligned(self.biases, 2, "quantization biases")


def wrap_quant_weight(
    device: Device, weight: np.ndarray, scales: np.ndarray, biases: np.ndarray
) -> QuantWeight:
    """Binds numpy arrays of an MLX-quantized triple (scales/biases as raw bf16 uint16) in place
    (`Device.wrap`). A leading axis on all three is a stack of experts."""
    return _quant_weight(device.wrap, weight, scales, biases)


def copy_quant_weight(
    device: Device, weight: np.ndarray, scales: np.ndarray, biases: np.ndarray
) -> QuantWeight:
    """An MLX-quantized triple copied once into buffers of the device's own: for weights the
    engine derives from the checkpoint's (a slice of a stored matrix), which the metal device
    could not bind in place and would otherwise mirror at every pass (`Device.wrap`)."""

    def copied(array: np.ndarray) -> Buffer:
        buffer = device.alloc(array.nbytes)
        buffer.numpy()[:] = array.reshape(-1).view(np.uint8)
        return buffer

    return _quant_weight(copied, weight, scales, biases)


def _quant_weight(
    bind: Callable[[np.ndarray], Buffer],
    weight: np.ndarray,
    scales: np.ndarray,
    biases: np.ndarray,
) -> QuantWeight:
    in_dim = scales.shape[-1] * GROUP_SIZE
    bits = weight.shape[-1] * 32 // in_dim
    experts = weight.shape[0] if weight.ndim == 3 else 1
    return QuantWeight(
        weight=bind(np.ascontiguousarray(weight, dtype=np.uint32)),
        scales=bind(np.ascontiguousarray(scales, dtype=np.uint16)),
        biases=bind(np.ascontiguousarray(biases, dtype=np.uint16)),
        rows=weight.shape[-2],
        in_dim=in_dim,
        bits=bits,
        experts=experts,
    )
