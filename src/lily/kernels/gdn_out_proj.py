"""Launching the Gated DeltaNet's output projection with its gated RMSNorm folded in
(`metal/gdn_out_proj.metal`), the decode step's consumer of `gdn_step`'s readout (and a verify
pass's of `gdn_tokens`').

residual += out_proj(rms_norm(o_h) * norm_weight * silu(z_h) per value head h): the norm needs
a whole head's readout, which no threadgroup of gdn_step holds, while this GEMV reads all of it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from lily.kernels import BufferRef, binding, pack_params, require_aligned
from lily.kernels.gdn import VALUE_HEAD_DIM
from lily.kernels.norm import FoldedNorm
from lily.kernels.quant_weight import QuantWeight

# A verify pass's most tokens, as the GEMVs around it take: kOutProjMaxTokens must match.
from lily.kernels.quantized import MAX_TOKENS, SIMD_WIDTH, lane_sums_bytes

if TYPE_CHECKING:
    from lily.device import Device, Graph

# Must match kOutProjRowsPerSimdgroup * kOutProjSimdgroups in gdn_out_proj.metal.
ROWS_PER_THREADGROUP = 4
THREADS_PER_THREADGROUP = 32


def record_gdn_out_proj(
    graph: Graph,
    device: Device,
    *,
    readout: BufferRef,
    z: BufferRef,
    norm: FoldedNorm,
    weight: QuantWeight,
    residual: BufferRef,
    tokens: int = 1,
) -> None:
    """residual += weight @ gated_rms_norm(readout, norm.gain, z, norm.eps), the norm taken per
    128-wide value head.

    readout, z: fp32 [tokens, Hv*128]; norm.gain: bf16 [128]; weight [rows, Hv*128]; residual
    fp32 [tokens, rows], added to in place. Over several tokens (a verify pass's, at most
    MAX_TOKENS) each weight is read once for all of them, each token's rows bit for bit the
    one-token kernel's.
    """
    if not 1 <= tokens <= MAX_TOKENS:
        raise ValueError(f"the output projection takes 1 to {MAX_TOKENS} tokens, got {tokens}")
    if weight.in_dim % VALUE_HEAD_DIM:
        raise ValueError(f"input {weight.in_dim} is not a whole number of {VALUE_HEAD_DIM}-heads")
    if weight.rows % ROWS_PER_THREADGROUP:
        raise ValueError(f"{weight.rows} rows are not a multiple of {ROWS_PER_THREADGROUP}")
    # The readout and z are read 16 bytes at a time.
    require_aligned(readout, 16, "GDN readout")
    require_aligned(z, 16, "GDN z")
    graph.dispatch(
        device.kernel(f"gdn_out_proj{'_tokens' if tokens > 1 else ''}_{weight.bits}"),
        threadgroups=(weight.rows // ROWS_PER_THREADGROUP, 1, 1),
        threads=(THREADS_PER_THREADGROUP, 1, 1),
        buffers={
            1: binding(readout),
            2: binding(z),
            3: binding(norm.gain),
            4: binding(weight.weight),
            5: binding(weight.scales),
            6: binding(weight.biases),
            7: binding(residual),
        },
        bytes={0: pack_params("IfII", weight.in_dim, norm.eps, weight.rows, tokens)},
        # Each lane shares its partial sums of the SIMD-group's rows for every token.
        threadgroup_memory={
            0: lane_sums_bytes(THREADS_PER_THREADGROUP // SIMD_WIDTH, ROWS_PER_THREADGROUP * tokens)
        },
    )
