"""Launching the sparse MoE block (`metal/moe.metal`) for one token.

The block is three levels separated by barriers:
1. the 8-bit router GEMV, with the shared-expert gate as a second projection of the same dispatch
   (its one logit is written right after the router logits), and beside it the shared expert's
   gate and up projections with SwiGLU, which need no routing;
2. gate and up projections of the chosen experts, with SwiGLU; each threadgroup routes for
   itself first (softmax, top-k, renormalised weights, all on the device), and one also stores
   the expert ids and weights;
3. down projections weighted by the router (and the sigmoid shared gate), summed into the output.
Level 1 alone would read half a megabyte; the shared expert's megabyte moves there from level 2,
whose routed experts read eight times as much.
`record_moe_route` (routing as a dispatch of its own) serves the prefill chunk's MoE and tests.

In the decode step the block also takes the RMSNorm before it and the residual add after it: given
a `FoldedNorm`, the router GEMV and the gate/up kernel norm the residual themselves, and with
`accumulate` the down kernel adds the block's output to `out` (the residual) instead of writing it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from lily.kernels import BufferRef, binding, ceil_div, offset_by, pack_params
from lily.kernels.norm import FoldedNorm
from lily.kernels.quant_weight import QuantWeight
from lily.kernels.quantized import (
    ROWS_PER_SIMDGROUP,
    SIMD_WIDTH,
    gemv_simdgroups,
    record_qgemv,
    require_vector_aligned,
)

if TYPE_CHECKING:
    from lily.device import Device, Graph

# Must match MOE_MAX_EXPERTS_PER_LANE in moe.metal.
MAX_EXPERTS = 256


@dataclass(frozen=True)
class MoeWeights:
    """One layer's MoE weights where they lie: the router and shared-expert gate (8-bit), the
    stacked expert projections [experts, ...] and the shared expert's projections."""

    router: QuantWeight
    shared_expert_gate: QuantWeight
    expert_gate: QuantWeight
    expert_up: QuantWeight
    expert_down: QuantWeight
    shared_gate: QuantWeight
    shared_up: QuantWeight
    shared_down: QuantWeight


@dataclass(frozen=True)
class MoeScratch:
    """Device buffers the block passes between its dispatches (all fp32 except ids), for up to
    `tokens` tokens (the decode step's one, or a verify pass's few)."""

    logits: BufferRef  # [tokens, experts] router logits, then [tokens] shared-expert gate logits
    expert_ids: BufferRef  # uint32 [tokens, top_k]
    expert_weights: BufferRef  # [tokens, top_k]
    hidden: BufferRef  # [tokens, top_k * expert_rows + shared_rows]
    tokens: int = 1

    @staticmethod
    def allocate(
        device: Device,
        experts: int,
        top_k: int,
        expert_rows: int,
        shared_rows: int,
        tokens: int = 1,
    ) -> MoeScratch:
        return MoeScratch(
            logits=device.alloc(4 * tokens * (experts + 1)),
            expert_ids=device.alloc(4 * tokens * top_k),
            expert_weights=device.alloc(4 * tokens * top_k),
            hidden=device.alloc(4 * tokens * (top_k * expert_rows + shared_rows)),
            tokens=tokens,
        )


def record_moe_route(
    graph: Graph,
    device: Device,
    logits: BufferRef,
    experts: int,
    top_k: int,
    expert_ids: BufferRef,
    expert_weights: BufferRef,
    normalize: bool = True,
    token_count: int = 1,
) -> None:
    """Softmax over `experts` logits, the top_k (ties to the lowest id) with their probabilities,
    renormalised over the top_k when `normalize`."""
    if experts > MAX_EXPERTS or not 1 <= top_k <= experts:
        raise ValueError(f"routing supports top_k <= experts <= {MAX_EXPERTS}")
    graph.dispatch(
        device.kernel("moe_route"),
        threadgroups=(token_count, 1, 1),
        threads=(32, 1, 1),
        buffers={1: binding(logits), 2: binding(expert_ids), 3: binding(expert_weights)},
        bytes={0: pack_params("III", experts, top_k, int(normalize))},
    )


@dataclass(frozen=True)
class InKernelRouting:
    """Routing done inside the gate/up kernel: from these router logits, storing the expert ids
    (in the gate/up call's `expert_ids`) and `expert_weights` for the down kernel."""

    logits: BufferRef  # fp32 [experts]
    experts: int
    expert_weights: BufferRef  # fp32 [top_k], written
    normalize: bool = True


def record_moe_gate_up(
    graph: Graph,
    device: Device,
    x: BufferRef,
    expert_ids: BufferRef,
    top_k: int,
    w: MoeWeights,
    hidden: BufferRef,
    norm: FoldedNorm | None = None,
    routing: InKernelRouting | None = None,
    slots: range | None = None,
    tokens: int = 1,
) -> None:
    """hidden = [silu(gate_e x) * up_e x for each chosen e] + [the same for the shared expert];
    with `norm`, of rms_norm(x) instead of x. The chosen experts are read from `expert_ids`, or
    with `routing` chosen in the kernel and written there. `slots` limits the dispatch to a run
    of them (slot top_k is the shared expert); by default it takes all top_k + 1. With `tokens`,
    each token's buffers follow the previous token's (MoeScratch's layout)."""
    require_vector_aligned(x, "float32", norm)
    expert_rows, shared_rows = w.expert_gate.rows, w.shared_gate.rows
    slots = range(top_k + 1) if slots is None else slots
    if slots.step != 1 or not 0 <= slots.start < slots.stop <= top_k + 1:
        raise ValueError(f"slots must be a run within 0..{top_k}, got {slots}")
    if routing is not None and slots.start != 0:
        # Slot 0's first threadgroup stores the routed ids and weights for the down kernel.
        raise ValueError("in-kernel routing needs slot 0 in the dispatch")
    routed = slots.start < top_k
    shared = slots.stop == top_k + 1
    widest = max(expert_rows if routed else 0, shared_rows if shared else 0)
    row_simdgroups = ceil_div(widest, ROWS_PER_SIMDGROUP)
    simdgroups = gemv_simdgroups(row_simdgroups * len(slots))
    matrices = (w.expert_gate, w.expert_up, w.shared_gate, w.shared_up)
    # Slots a variant does not read are bound to x, so every declared buffer is bound.
    gain = norm.gain if norm is not None else x
    logits = routing.logits if routing is not None else x
    weights_out = routing.expert_weights if routing is not None else x
    buffers = {
        1: binding(x),
        2: binding(expert_ids),
        15: binding(hidden),
        16: binding(gain),
        17: binding(logits),
        18: binding(weights_out),
    }
    for i, m in enumerate(matrices):
        buffers[3 + 3 * i] = binding(m.weight)
        buffers[4 + 3 * i] = binding(m.scales)
        buffers[5 + 3 * i] = binding(m.biases)
    if routing is not None and not (top_k <= routing.experts <= MAX_EXPERTS):
        raise ValueError(f"routing supports top_k <= experts <= {MAX_EXPERTS}")
    variant = "moe_gate_up_swiglu"
    variant += "_normed" if norm is not None else ""
    variant += "_routed" if routing is not None else ""
    params = pack_params(
        "IIIIfIII",
        w.expert_gate.in_dim,
        expert_rows,
        shared_rows,
        top_k,
        norm.eps if norm is not None else 0.0,
        routing.experts if routing is not None else 0,
        int(routing.normalize) if routing is not None else 0,
        slots.start,
    )
    graph.dispatch(
        device.kernel(f"{variant}_{w.expert_gate.bits}"),
        threadgroups=(ceil_div(row_simdgroups, simdgroups), len(slots), tokens),
        threads=(simdgroups * SIMD_WIDTH, 1, 1),
        buffers=buffers,
        bytes={0: params},
    )


def record_moe_down(
    graph: Graph,
    device: Device,
    hidden: BufferRef,
    expert_ids: BufferRef,
    expert_weights: BufferRef,
    shared_gate_logit: BufferRef,
    top_k: int,
    w: MoeWeights,
    out: BufferRef,
    accumulate: bool = False,
    tokens: int = 1,
) -> None:
    """out = sum_k weight_k down_{e_k}(hidden_k) + sigmoid(shared gate) down_s(hidden_shared);
    with `accumulate`, out += the same. With `tokens`, each token's buffers follow the previous
    token's (MoeScratch's layout; out [tokens, rows])."""
    require_vector_aligned(hidden, "float32")
    rows = w.expert_down.rows
    row_simdgroups = ceil_div(rows, ROWS_PER_SIMDGROUP)
    simdgroups = gemv_simdgroups(row_simdgroups)
    graph.dispatch(
        device.kernel(f"moe_down_{w.expert_down.bits}"),
        threadgroups=(ceil_div(row_simdgroups, simdgroups), tokens, 1),
        threads=(simdgroups * SIMD_WIDTH, 1, 1),
        buffers={
            1: binding(hidden),
            2: binding(expert_ids),
            3: binding(expert_weights),
            4: binding(shared_gate_logit),
            5: binding(w.expert_down.weight),
            6: binding(w.expert_down.scales),
            7: binding(w.expert_down.biases),
            8: binding(w.shared_down.weight),
            9: binding(w.shared_down.scales),
            10: binding(w.shared_down.biases),
            11: binding(out),
        },
        bytes={
            0: pack_params(
                "IIIII", w.expert_down.in_dim, w.shared_down.in_dim, rows, top_k, int(accumulate)
            )
        },
    )


def record_moe(
    graph: Graph,
    device: Device,
    x: BufferRef,
    w: MoeWeights,
    top_k: int,
    scratch: MoeScratch,
    out: BufferRef,
    normalize: bool = True,
    norm: FoldedNorm | None = None,
    accumulate: bool = False,
    tokens: int = 1,
) -> None:
    """The whole block, out = MoE(x), with barriers between its levels (the caller places the
    one before, x ready, and after, out ready); MoE(rms_norm(x)) with `norm`, and out += with
    `accumulate`. With `tokens` (at most the scratch's), x and out are [tokens, hidden]: a
    verify pass's few tokens, each expert's weights read per token that chose it, the norm and
    the residual add folded in per token as for one."""
    if not 1 <= tokens <= scratch.tokens:
        raise ValueError(f"the scratch holds 1 to {scratch.tokens} tokens, got {tokens}")
    experts = w.router.rows
    shared_gate_logits = offset_by(scratch.logits, 4 * tokens * experts)
    record_qgemv(
        graph,
        device,
        x,
        [(w.router, scratch.logits), (w.shared_expert_gate, shared_gate_logits)],
        norm=norm,
        tokens=tokens,
    )
    # The shared expert needs no routing, so it runs beside the router.
    gate_up = dict(
        x=x,
        expert_ids=scratch.expert_ids,
        top_k=top_k,
        w=w,
        hidden=scratch.hidden,
        tokens=tokens,
    )
    record_moe_gate_up(graph, device, **gate_up, norm=norm, slots=range(top_k, top_k + 1))
    graph.barrier()
    routing = InKernelRouting(scratch.logits, experts, scratch.expert_weights, normalize)
    record_moe_gate_up(graph, device, **gate_up, norm=norm, routing=routing, slots=range(top_k))
    graph.barrier()
    record_moe_down(
        graph,
        device,
        scratch.hidden,
        scratch.expert_ids,
        scratch.expert_weights,
        shared_gate_logits,
        top_k,
        w,
        out,
        accumulate,
        tokens,
    )
