"""Launching the simdgroup_matrix GEMM tile (`metal/gemm.metal`): C = A B^T."""

from __future__ import annotations

from typing import TYPE_CHECKING

from lily.kernels import BufferRef, binding, ceil_div, element_type, pack_params

if TYPE_CHECKING:
    from lily.device import Device, Graph

# Must match GEMM_TILE and GEMM_THREADS in gemm.metal.
TILE = 32
THREADS_PER_THREADGROUP = 128


def record_gemm_nt(
    graph: Graph,
    device: Device,
    a: BufferRef,
    b: BufferRef,
    c: BufferRef,
    m: int,
    n: int,
    k: int,
    dtype: str = "float32",
) -> None:
    """C [m, n] fp32 = A [m, k] B [n, k]^T, A and B row-major in `dtype` (float32 or bfloat16)."""
    graph.dispatch(
        device.kernel(f"gemm_nt_{element_type(dtype)}"),
        threadgroups=(ceil_div(n, TILE), ceil_div(m, TILE), 1),
        threads=(THREADS_PER_THREADGROUP, 1, 1),
        buffers={1: binding(a), 2: binding(b), 3: binding(c)},
        bytes={0: pack_params("III", m, n, k)},
    )
