"""Threadgroup sizes: what launchers choose from what the compiled pipeline allows, and the
exact counts kernels declare."""

from types import SimpleNamespace

import pytest

from lily.device import open_device
from lily.kernels import (
    attention,
    dflash_attention,
    gdn,
    gdn_out_proj,
    gemm,
    lane_layout,
    moe,
    moe_chunk,
    quantized_gemm,
    threads_within,
    vision,
)


def pipeline(limit: int) -> SimpleNamespace:
    return SimpleNamespace(max_threads_per_threadgroup=limit)


@pytest.mark.parametrize(
    ("limit", "preferred", "expected"),
    [(1024, 256, 256), (1024, 1024, 1024), (896, 1024, 896), (100, 1024, 96), (32, 64, 32)],
)
def test_threads_are_whole_simdgroups_within_the_pipeline_limit(limit, preferred, expected):
    assert threads_within(pipeline(limit), preferred) == expected


def test_a_pipeline_below_one_simdgroup_is_refused():
    with pytest.raises(ValueError, match="less than one SIMD-group"):
        threads_within(pipeline(16), 256)


# Kernels that need an exact number of threads per threadgroup declare it with
# [[max_total_threads_per_threadgroup(N)]] (so Apple's compiler keeps their registers within N
# threads), and their launchers must use that N: both are listed here, by host name.
EXACT_THREADS = {
    "attention_prepare": attention.SIMD_WIDTH,
    "attention_prepare_int8": attention.SIMD_WIDTH,
    "attention_decode": attention.DECODE_THREADS,
    "attention_decode_int8": attention.DECODE_THREADS,
    "attention_decode_fused": attention.DECODE_THREADS,
    "attention_decode_fused_int8": attention.DECODE_THREADS,
    "attention_decode_fused_rows": attention.DECODE_THREADS,
    "attention_decode_fused_rows_int8": attention.DECODE_THREADS,
    "attention_combine": attention.COMBINE_DIMS,
    "attention_combine_rows": attention.COMBINE_DIMS,
    # One simdgroup per token: its launcher uses 32 per token, up to this.
    "attention_decode_tokens": attention.DECODE_TOKENS_MAX_THREADS,
    "attention_decode_tokens_int8": attention.DECODE_TOKENS_MAX_THREADS,
    "attention_chunk": attention.CHUNK_THREADS,
    "attention_chunk_int8": attention.CHUNK_THREADS,
    "attention_chunk_queries": attention.SIMD_WIDTH,
    "attention_chunk_tensor": attention.TENSOR_CHUNK_THREADS,
    "gdn_step": gdn.STEP_THREADS_PER_THREADGROUP,
    "gdn_step_rows": gdn.STEP_THREADS_PER_THREADGROUP,
    "gdn_tokens": gdn.STEP_THREADS_PER_THREADGROUP,
    "gdn_commit": gdn.STEP_THREADS_PER_THREADGROUP,
    "gdn_chunk": gdn.CHUNK_THREADS_PER_THREADGROUP,
    "gdn_gated_norm": gdn.NORM_THREADS_PER_THREADGROUP,
    "gdn_out_proj_4": gdn_out_proj.THREADS_PER_THREADGROUP,
    "gdn_out_proj_8": gdn_out_proj.THREADS_PER_THREADGROUP,
    "gdn_out_proj_tokens_4": gdn_out_proj.THREADS_PER_THREADGROUP,
    "gdn_out_proj_tokens_8": gdn_out_proj.THREADS_PER_THREADGROUP,
    "gemm_nt_float": gemm.THREADS_PER_THREADGROUP,
    "gemm_nt_bfloat": gemm.THREADS_PER_THREADGROUP,
    "lane_layout_self_test": lane_layout.THREADS,
    "moe_route": moe.SIMD_WIDTH,
    # One SIMD-group per token: its launcher uses 32 per token, up to this.
    "moe_route_union": moe.UNION_MAX_TOKENS * moe.SIMD_WIDTH,
    "moe_sort_by_expert": moe_chunk.SORT_THREADS,
    **{
        f"qgemm{kind}_{bits}": quantized_gemm.THREADS_PER_THREADGROUP
        for kind in ("_grouped", "_grouped_swiglu")
        for bits in (4, 8)
    },
    **{
        f"qgemm_{bits}_{tile}": quantized_gemm.THREADS_PER_THREADGROUP
        for bits in (4, 8)
        for tile in quantized_gemm.TILE_TOKENS
    },
    **{
        f"qgemm{kind}_tensor_{bits}": quantized_gemm.THREADS_PER_THREADGROUP
        for kind in ("_grouped", "_grouped_swiglu")
        for bits in (4, 8)
    },
    **{
        f"qgemm_tensor_{bits}_{tile}": quantized_gemm.THREADS_PER_THREADGROUP
        for bits in (4, 8)
        for tile in (quantized_gemm.TENSOR_MIN_TILE_TOKENS, quantized_gemm.MAX_TILE_TOKENS)
    },
    "qgemm_row_exponents": quantized_gemm.ROW_EXPONENT_THREADS,
    "vision_linear": vision.LINEAR_THREADS,
    "vision_attention": vision.ATTENTION_THREADS,
    "dflash_prepare": dflash_attention.SIMD_WIDTH,
    "dflash_attention": dflash_attention.SIMD_WIDTH,
}


def test_exact_thread_counts_are_declared_by_the_kernels():
    """Each kernel's declared maximum (the sim reads the attribute through its pre-pass) is the
    count its launcher uses; every other engine kernel declares none and adapts to the
    pipeline's limit (threads_within) or needs few threads."""
    device = open_device("sim", workers=1)
    engine_kernels = [
        name for name in device.kernel_names() if not name.startswith(("test_", "broken_"))
    ]
    assert set(EXACT_THREADS) <= set(engine_kernels)
    declared = {name: device.kernel(name).max_threads_per_threadgroup for name in engine_kernels}
    assert {name: declared[name] for name in EXACT_THREADS} == EXACT_THREADS
    undeclared = {name: limit for name, limit in declared.items() if name not in EXACT_THREADS}
    assert undeclared == dict.fromkeys(undeclared, 1024)
