"""Launching the sparse MoE block for a chunk of T tokens (`metal/moe_chunk.metal`, batched
prefill).

The routed experts run as grouped GEMMs over the T * top_k (token, expert) assignments sorted by
expert, so each chosen expert's weights are read once for all of its tokens; the shared expert
runs as dense GEMMs over all T rows. The GEMMs multiply half operands; the two down projections
read a SwiGLU hidden state, which half's range does not bound, so each takes the range guard's
exponents per row (`record_qgemm_row_exponents`, lily.kernels.quantized_gemm). The block is 11
dispatches in 7 barrier levels:

1. router + shared-expert gate logits (8-bit GEMM, 2 projections) | shared gate + up (4-bit GEMM);
2. routing (softmax, top-k, renormalised weights, one row per token) | shared SwiGLU;
3. counting sort of the assignments by expert | the shared hidden rows' exponents;
4. grouped gate|up GEMM of the routed experts, SwiGLU fused | shared down GEMM;
5. the routed hidden rows' exponents;
6. grouped down GEMM;
7. combine: out[t] = sum_k w[t, k] down[slot(t, k)] + sigmoid(shared gate logit[t]) shared[t].

The shared expert's chain rides along the routing, the sort and the gate|up GEMM, which leave
most of the GPU idle or do not depend on it. `record_moe_chunk` places the barriers between its
levels; the caller places the one before (x ready) and after (out ready).

Scratch (`moe_chunk_scratch_bytes`) is about 95 KB per token at the real dims (256 experts, top-8,
expert and shared size 512, hidden 2048), two thirds of it the sorted expert outputs
[T * top_k, hidden] the combine gathers from: 49 MB for a 512-token chunk.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from lily.kernels import BufferRef, binding, ceil_div, pack_params, require_aligned, threads_within
from lily.kernels.moe import MAX_EXPERTS, MoeWeights, record_moe_route
from lily.kernels.quantized_gemm import (
    record_qgemm,
    record_qgemm_grouped,
    record_qgemm_row_exponents,
)

if TYPE_CHECKING:
    from lily.device import Device, Graph

# Must match MOE_SORT_THREADS in moe_chunk.metal.
SORT_THREADS = 256
ELEMENTWISE_THREADS = 256


@dataclass(frozen=True)
class MoeChunkScratch:
    """Device buffers the block passes between its dispatches, sized for `max_tokens` rows
    (fp32 unless noted; A = max_tokens * top_k assignments, sorted by expert where noted)."""

    experts: int
    top_k: int
    expert_rows: int
    shared_rows: int
    hidden_size: int
    max_tokens: int
    logits: BufferRef  # [max_tokens, experts] router logits
    shared_gate_logit: BufferRef  # [max_tokens] the shared-expert gate logit
    expert_ids: BufferRef  # uint32 [max_tokens, top_k]
    expert_weights: BufferRef  # [max_tokens, top_k]
    expert_offsets: BufferRef  # uint32 [experts + 1]
    row_index: BufferRef  # uint32 [A] token of each sorted assignment
    slot_of: BufferRef  # uint32 [max_tokens, top_k] sorted position of each assignment
    expert_hidden: BufferRef  # [A, expert_rows] silu(gate) * up, sorted
    expert_exponents: BufferRef  # int32 [A] the range guard's exponents of expert_hidden's rows
    expert_down: BufferRef  # [A, hidden] expert outputs, sorted
    shared_hidden: BufferRef  # [max_tokens, shared_rows] gate projection, then SwiGLU in place
    shared_up: BufferRef  # [max_tokens, shared_rows]
    shared_exponents: BufferRef  # int32 [max_tokens] the guard's exponents of shared_hidden's rows
    shared_down: BufferRef  # [max_tokens, hidden]

    @staticmethod
    def allocate(
        device: Device,
        experts: int,
        top_k: int,
        expert_rows: int,
        shared_rows: int,
        hidden_size: int,
        max_tokens: int,
    ) -> MoeChunkScratch:
        a = max_tokens * top_k
        return MoeChunkScratch(
            experts=experts,
            top_k=top_k,
            expert_rows=expert_rows,
            shared_rows=shared_rows,
            hidden_size=hidden_size,
            max_tokens=max_tokens,
            logits=device.alloc(4 * max_tokens * experts),
            shared_gate_logit=device.alloc(4 * max_tokens),
            expert_ids=device.alloc(4 * a),
            expert_weights=device.alloc(4 * a),
            expert_offsets=device.alloc(4 * (experts + 1)),
            row_index=device.alloc(4 * a),
            slot_of=device.alloc(4 * a),
            expert_hidden=device.alloc(4 * a * expert_rows),
            expert_exponents=device.alloc(4 * a),
            expert_down=device.alloc(4 * a * hidden_size),
            shared_hidden=device.alloc(4 * max_tokens * shared_rows),
            shared_up=device.alloc(4 * max_tokens * shared_rows),
            shared_exponents=device.alloc(4 * max_tokens),
            shared_down=device.alloc(4 * max_tokens * hidden_size),
        )


def moe_chunk_scratch_bytes(
    experts: int, top_k: int, expert_rows: int, shared_rows: int, hidden_size: int, max_tokens: int
) -> int:
    """Bytes `MoeChunkScratch.allocate` takes: 4 * (experts + 1) for the offsets, plus per token
    4 * (experts + 2 + 5 top_k + top_k (expert_rows + hidden) + 2 shared_rows + hidden)."""
    per_token = (
        experts
        + 2
        + 5 * top_k
        + top_k * (expert_rows + hidden_size)
        + 2 * shared_rows
        + hidden_size
    )
    return 4 * (experts + 1) + 4 * max_tokens * per_token


def record_moe_sort(
    graph: Graph,
    device: Device,
    expert_ids: BufferRef,
    tokens: int,
    top_k: int,
    experts: int,
    expert_offsets: BufferRef,
    row_index: BufferRef,
    slot_of: BufferRef,
) -> None:
    """Stable counting sort of the tokens * top_k assignments (uint32 expert_ids [tokens, top_k])
    by expert: expert_offsets [experts + 1] (exclusive scan of the counts), row_index
    [tokens * top_k] (the token of each sorted assignment) and slot_of [tokens, top_k] (where each
    assignment went). Within an expert, assignments keep their (token, k) order."""
    if not 1 <= experts <= MAX_EXPERTS or tokens < 1 or top_k < 1:
        raise ValueError(f"sorting needs 1 <= experts <= {MAX_EXPERTS} and tokens, top_k >= 1")
    graph.dispatch(
        device.kernel("moe_sort_by_expert"),
        threadgroups=(experts, 1, 1),
        threads=(SORT_THREADS, 1, 1),
        buffers={
            1: binding(expert_ids),
            2: binding(expert_offsets),
            3: binding(row_index),
            4: binding(slot_of),
        },
        bytes={0: pack_params("III", tokens, top_k, experts)},
    )


def record_moe_chunk_swiglu(
    graph: Graph, device: Device, gate_then_hidden: BufferRef, up: BufferRef, count: int
) -> None:
    """gate_then_hidden = silu(gate_then_hidden) * up over `count` fp32 values, in place."""
    kernel = device.kernel("moe_chunk_swiglu")
    threads = threads_within(kernel, ELEMENTWISE_THREADS)
    graph.dispatch(
        kernel,
        threadgroups=(ceil_div(count, threads), 1, 1),
        threads=(threads, 1, 1),
        buffers={1: binding(gate_then_hidden), 2: binding(up)},
        bytes={0: pack_params("I", count)},
    )


def record_moe_combine(
    graph: Graph,
    device: Device,
    expert_down: BufferRef,
    slot_of: BufferRef,
    expert_weights: BufferRef,
    shared_gate_logit: BufferRef,
    shared_down: BufferRef,
    out: BufferRef,
    tokens: int,
    top_k: int,
    hidden_size: int,
) -> None:
    """out[t] = sum_k expert_weights[t, k] expert_down[slot_of[t, k]] (k in order)
    + sigmoid(shared_gate_logit[t]) shared_down[t]; expert_down [tokens * top_k, hidden] in
    sorted-assignment order, shared_down and out [tokens, hidden]."""
    if hidden_size % 4:
        raise ValueError(f"hidden size {hidden_size} is not a multiple of 4")
    for ref, what in ((expert_down, "expert outputs"), (shared_down, "shared expert output")):
        require_aligned(ref, 16, what)
    require_aligned(out, 16, "MoE output")
    kernel = device.kernel("moe_chunk_combine")
    threads = threads_within(kernel, ELEMENTWISE_THREADS)
    graph.dispatch(
        kernel,
        threadgroups=(ceil_div(hidden_size // 4, threads), tokens, 1),
        threads=(threads, 1, 1),
        buffers={
            1: binding(expert_down),
            2: binding(slot_of),
            3: binding(expert_weights),
            4: binding(shared_gate_logit),
            5: binding(shared_down),
            6: binding(out),
        },
        bytes={0: pack_params("III", tokens, hidden_size, top_k)},
    )


def record_moe_chunk(
    graph: Graph,
    device: Device,
    x: BufferRef,
    w: MoeWeights,
    top_k: int,
    scratch: MoeChunkScratch,
    out: BufferRef,
    tokens: int,
    normalize: bool = True,
) -> None:
    """out [tokens, hidden] = MoE(x [tokens, hidden]) row by row, 11 dispatches in 7 levels with
    barriers between them (the caller places the one before, x ready, and after, out ready)."""
    experts = w.router.rows
    hidden_size = w.expert_down.rows
    shared_rows = w.shared_gate.rows
    dims = (experts, top_k, w.expert_gate.rows, shared_rows, hidden_size)
    s = scratch
    if dims != (s.experts, s.top_k, s.expert_rows, s.shared_rows, s.hidden_size):
        raise ValueError(
            f"(experts, top_k, expert, shared, hidden sizes) {dims} differ from the scratch's"
        )
    if not 1 <= tokens <= s.max_tokens:
        raise ValueError(f"{tokens} tokens, the scratch holds 1 to {s.max_tokens}")
    assignments = tokens * top_k

    record_qgemm(
        graph,
        device,
        x,
        [(w.router, s.logits), (w.shared_expert_gate, s.shared_gate_logit)],
        tokens,
    )
    record_qgemm(
        graph, device, x, [(w.shared_gate, s.shared_hidden), (w.shared_up, s.shared_up)], tokens
    )
    graph.barrier()
    record_moe_route(
        graph, device, s.logits, experts, top_k, s.expert_ids, s.expert_weights, normalize, tokens
    )
    record_moe_chunk_swiglu(graph, device, s.shared_hidden, s.shared_up, tokens * shared_rows)
    graph.barrier()
    record_moe_sort(
        graph,
        device,
        s.expert_ids,
        tokens,
        top_k,
        experts,
        s.expert_offsets,
        s.row_index,
        s.slot_of,
    )
    record_qgemm_row_exponents(
        graph, device, s.shared_hidden, tokens, shared_rows, s.shared_exponents
    )
    graph.barrier()
    record_qgemm_grouped(
        graph,
        device,
        x,
        [w.expert_gate, w.expert_up],
        s.expert_hidden,
        s.expert_offsets,
        s.row_index,
        assignments,
    )
    record_qgemm(
        graph,
        device,
        s.shared_hidden,
        [(w.shared_down, s.shared_down)],
        tokens,
        x_exponents=s.shared_exponents,
    )
    graph.barrier()
    record_qgemm_row_exponents(
        graph, device, s.expert_hidden, assignments, w.expert_gate.rows, s.expert_exponents
    )
    graph.barrier()
    record_qgemm_grouped(
        graph,
        device,
        s.expert_hidden,
        [w.expert_down],
        s.expert_down,
        s.expert_offsets,
        None,
        assignments,
        x_exponents=s.expert_exponents,
    )
    graph.barrier()
    record_moe_combine(
        graph,
        device,
        s.expert_down,
        s.slot_of,
        s.expert_weights,
        s.shared_gate_logit,
        s.shared_down,
        out,
        tokens,
        top_k,
        hidden_size,
    )
