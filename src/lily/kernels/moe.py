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

A verify pass (`union=True`) runs level 2 over the union of its tokens' experts instead, as two
levels: `moe_route_union` routes every token once and lists the distinct experts with the
(token, slot) pairs that chose each; `moe_gate_up_union` reads each listed expert's gate and up
weights once for all those tokens. Its tokens are consecutive tokens of one text, whose experts
overlap well beyond chance (docs/architecture.md); the down projection stays per token (see
`record_moe`).

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
    lane_sums_bytes,
    record_qgemv,
    require_vector_aligned,
)

if TYPE_CHECKING:
    from lily.device import Device, Graph

# Must match MOE_MAX_EXPERTS_PER_LANE in moe.metal.
MAX_EXPERTS = 256
# Must match MOE_UNION_MAX_TOKENS and MOE_UNION_MAX_TOP_K in moe.metal.
UNION_MAX_TOKENS = 9
UNION_MAX_TOP_K = 8


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
    expert_union: BufferRef  # uint32, moe_route_union's layout (moe.metal) for up to `tokens`
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
            expert_union=device.alloc(4 * union_words(experts, top_k, tokens)),
            tokens=tokens,
        )


def gate_up_lane_values(tokens: int, normed: bool) -> int:
    """What a gate/up lane shares for its one reduction of `tokens` tokens (moe.metal's
    moe_gate_up_lane_stride): gate and up sums of ROWS_PER_SIMDGROUP rows each, and, normed,
    the sum of squares, per token."""
    return (2 * ROWS_PER_SIMDGROUP + (1 if normed else 0)) * tokens


def union_entries(experts: int, top_k: int, tokens: int) -> int:
    """The most distinct experts `tokens` tokens can choose: the union's entries."""
    return min(tokens * top_k, experts)


def union_words(experts: int, top_k: int, tokens: int) -> int:
    """moe_route_union's output: the count, each entry's expert and pair count, and room for
    tokens * top_k pairs per entry."""
    entries = union_entries(experts, top_k, tokens)
    return 1 + 2 * entries + entries * tokens * top_k


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


def record_moe_route_union(
    graph: Graph,
    device: Device,
    logits: BufferRef,
    experts: int,
    top_k: int,
    expert_ids: BufferRef,
    expert_weights: BufferRef,
    expert_union: BufferRef,
    normalize: bool = True,
    tokens: int = 1,
) -> None:
    """Routes `tokens` tokens as `record_moe_route` does (logits [tokens, experts], ids and
    weights [tokens, top_k]) and writes the union of their experts to `expert_union`
    (`union_words` of them; layout in moe.metal): one threadgroup, a SIMD-group per token."""
    if experts > MAX_EXPERTS or not 1 <= top_k <= min(experts, UNION_MAX_TOP_K):
        raise ValueError(
            f"the union's routing supports top_k <= {UNION_MAX_TOP_K}, top_k <= experts <= "
            f"{MAX_EXPERTS}"
        )
    if not 1 <= tokens <= UNION_MAX_TOKENS:
        raise ValueError(f"the union holds 1 to {UNION_MAX_TOKENS} tokens, got {tokens}")
    graph.dispatch(
        device.kernel("moe_route_union"),
        threadgroups=(1, 1, 1),
        threads=(tokens * SIMD_WIDTH, 1, 1),
        buffers={
            1: binding(logits),
            2: binding(expert_ids),
            3: binding(expert_weights),
            4: binding(expert_union),
        },
        bytes={
            0: pack_params(
                "IIIII",
                experts,
                top_k,
                int(normalize),
                tokens,
                union_entries(experts, top_k, tokens),
            )
        },
    )


def record_moe_gate_up_union(
    graph: Graph,
    device: Device,
    x: BufferRef,
    expert_union: BufferRef,
    experts: int,
    top_k: int,
    w: MoeWeights,
    hidden: BufferRef,
    norm: FoldedNorm | None = None,
    tokens: int = 1,
) -> None:
    """hidden[token, slot] = silu(gate_e x_token) * up_e x_token for every (token, slot) pair of
    the union `record_moe_route_union` wrote (x [tokens, in_dim], rms_norm of each row with
    `norm`; hidden in MoeScratch's layout, the shared expert's rows left alone): the same values,
    bit for bit, as `record_moe_gate_up` over the routed slots, each expert's weights read once.
    The grid covers the most entries `tokens` tokens can have; those past the union's count
    leave at once."""
    require_vector_aligned(x, "float32", norm)
    expert_rows = w.expert_gate.rows
    row_simdgroups = ceil_div(expert_rows, ROWS_PER_SIMDGROUP)
    entries = union_entries(experts, top_k, tokens)
    simdgroups = gemv_simdgroups(row_simdgroups * entries)
    gain = norm.gain if norm is not None else x
    buffers = {1: binding(x), 2: binding(expert_union), 9: binding(hidden), 10: binding(gain)}
    for i, m in enumerate((w.expert_gate, w.expert_up)):
        buffers[3 + 3 * i] = binding(m.weight)
        buffers[4 + 3 * i] = binding(m.scales)
        buffers[5 + 3 * i] = binding(m.biases)
    variant = "moe_gate_up_union" + ("_normed" if norm is not None else "")
    params = pack_params(
        "IIIIfII",
        w.expert_gate.in_dim,
        expert_rows,
        w.shared_gate.rows,
        top_k,
        norm.eps if norm is not None else 0.0,
        tokens,
        entries,
    )
    # A SIMD-group reduces its pairs `tokens` at a time (more only if NaN logits repeat one).
    lane_values = gate_up_lane_values(min(tokens, UNION_MAX_TOKENS), norm is not None)
    graph.dispatch(
        device.kernel(f"{variant}_{w.expert_gate.bits}"),
        threadgroups=(ceil_div(row_simdgroups, simdgroups), entries, 1),
        threads=(simdgroups * SIMD_WIDTH, 1, 1),
        buffers=buffers,
        bytes={0: params},
        threadgroup_memory={0: lane_sums_bytes(simdgroups, lane_values)},
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
    lane_values = gate_up_lane_values(1, norm is not None)
    graph.dispatch(
        device.kernel(f"{variant}_{w.expert_gate.bits}"),
        threadgroups=(ceil_div(row_simdgroups, simdgroups), len(slots), tokens),
        threads=(simdgroups * SIMD_WIDTH, 1, 1),
        buffers=buffers,
        bytes={0: params},
        threadgroup_memory={0: lane_sums_bytes(simdgroups, lane_values)},
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
    union: bool = False,
) -> None:
    """The whole block, out = MoE(x), with barriers between its levels (the caller places the
    one before, x ready, and after, out ready); MoE(rms_norm(x)) with `norm`, and out += with
    `accumulate`. With `tokens` (at most the scratch's), x and out are [tokens, hidden]: a
    verify pass's few tokens, each expert's weights read per token that chose it, the norm and
    the residual add folded in per token as for one.

    With `union` (a verify or a batched pass), the routed experts' gate and up run over the
    union of the tokens' experts, one level more: every value is the same, bit for bit, and an
    expert several tokens chose is read once. The down projection stays per (token, expert):
    over the union it would sum a token's experts in the union's order, not its slots' (its rows
    would no longer be the decode step's bit for bit), or take a level more to sum them in slot
    order (40 levels a pass at the real dims, past the verify pass's budget of 1.3 decode steps'
    levels); it is a third of the experts' bytes."""
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
    if union:
        record_moe_route_union(
            graph,
            device,
            scratch.logits,
            experts,
            top_k,
            scratch.expert_ids,
            scratch.expert_weights,
            scratch.expert_union,
            normalize,
            tokens,
        )
        graph.barrier()
        record_moe_gate_up_union(
            graph, device, x, scratch.expert_union, experts, top_k, w, scratch.hidden, norm, tokens
        )
    else:
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
