"""Launching RMSNorm and the residual add fused with it (`metal/rms_norm.metal`), and the
description of a norm that its consuming GEMV applies itself (`FoldedNorm`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from lily.kernels import BufferRef, binding, ceil_div, element_type, pack_params, threads_within

if TYPE_CHECKING:
    from lily.device import Device, Graph


@dataclass(frozen=True)
class FoldedNorm:
    """An RMSNorm folded into the GEMV that consumes it: the GEMV reads the un-normed fp32 row
    x and computes W (x * rsqrt(mean(x^2) + eps) * gain) with no norm dispatch before it."""

    gain: BufferRef  # bf16 [in_dim], as stored (see record_rms_norm)
    eps: float


def threads_for(dim: int) -> int:
    """About eight elements per thread, whole SIMD-groups, at most 1024 threads."""
    return min(1024, max(32, ceil_div(ceil_div(dim, 8), 32) * 32))


def record_rms_norm(
    graph: Graph,
    device: Device,
    x: BufferRef,
    weight: BufferRef,
    out: BufferRef,
    rows: int,
    dim: int,
    eps: float,
    x_dtype: str = "float32",
) -> None:
    """out[r] = x[r] * rsqrt(mean(x[r]^2) + eps) * weight, per row; weight bf16 as stored
    (MLX files already hold 1 + w for the zero-centred norms), out fp32."""
    kernel = device.kernel(f"rms_norm_{element_type(x_dtype)}")
    graph.dispatch(
        kernel,
        threadgroups=(rows, 1, 1),
        threads=(threads_within(kernel, threads_for(dim)), 1, 1),
        buffers={1: binding(x), 2: binding(weight), 3: binding(out)},
        bytes={0: pack_params("If", dim, eps)},
    )


def record_add_rms_norm(
    graph: Graph,
    device: Device,
    residual: BufferRef,
    delta: BufferRef,
    weight: BufferRef,
    h: BufferRef,
    out: BufferRef,
    rows: int,
    dim: int,
    eps: float,
) -> None:
    """h = residual + delta (h may be residual itself), then out = rms_norm(h) * weight; fp32."""
    kernel = device.kernel("add_rms_norm")
    graph.dispatch(
        kernel,
        threadgroups=(rows, 1, 1),
        threads=(threads_within(kernel, threads_for(dim)), 1, 1),
        buffers={
            1: binding(residual),
            2: binding(delta),
            3: binding(weight),
            4: binding(h),
            5: binding(out),
        },
        bytes={0: pack_params("If", dim, eps)},
    )
