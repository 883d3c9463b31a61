"""A MODEL (not a measurement: no Mac ran batched decode) of decoding B streams in one pass at
the real dims (`ModelGraph.batch_graph`, issue 42): aggregate tok/s at 1, 2, 4 and 8 streams on
the Macs of `prefill_model.py`, each stream at the same context.

A pass over B streams' newest tokens runs the 40-layer walk a verify pass of B tokens runs
(the GEMV-shaped kernels: `qgemv_tokens` reads each projection's weights once for all B, the
experts the B tokens chose are read once each), plus what each stream owns: its recurrent
state read and written (conv windows and GDN state), and its KV cache read once by attention.
So, per pass:

- bytes = `pass_traffic(c, B).weight_bytes` (projections and lm_head once; the expected number
  of distinct experts of B tokens choosing 8 of 256 each) + the down projections read once per
  (row, expert) pair (`verify_pass_model.expert_bytes_beyond_traffic`: the MoE's gate and up
  run over the union of the rows' experts, its down per pair) + B x 2 x `recurrent_state_bytes`
  + B x context x `kv_cache_bytes_per_token` (bf16);
- ALU instructions = `pass_traffic(c, B).gemv_ops` (codes unpacked once per pass for the
  projections, once per token for the experts), issued at half the published fp32 FLOP rate
  (an FMA is two FLOPs);
- time = max(bytes / (bandwidth x memory efficiency), instructions / issue rate) + levels x
  `LEVEL_SECONDS`: the levels of the decode step (B = 1) and of the batched pass (B > 1),
  recorded (not run) on the full-size layout (`Graph.barrier_count` + 1), printed first. The
  batched pass is folded as a verify pass is (norms and residual adds inside the GEMVs and the
  MoE, the gated norm in the output projection, the final norm in the lm_head) and its per-row
  stages (embedding lookup, conv and GDN steps, attention, sampler) are one dispatch over all
  rows through the slot table, so its levels do not grow with B: 324 at the real dims (284
  before the MoE's routing took a level of its own for the union; 395 unfolded; the decode
  step has 253). The last column is the
  same model with the per-row stages one dispatch per row, as they were before the slot table:
  the rows' attention and draws then ran one after another, B - 1 more levels for each
  attention layer's two dispatches and the sampler's two, 22 (B - 1) at the real dims.

Last, the ceiling the bytes set: aggregate tok/s were a pass only its bytes at the whole
published bandwidth (no levels, no instructions, no efficiency loss).

Left out: the host's work per pass (sampling is on the device; the host reads B tokens),
attention's own latency model (`model_decode_attention.py`; at these contexts attention is a
small share), and any contention between streams' prefill slices and the batch.

    python benchmarks/batched_decode_model.py [--context 4096]
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

from make_synthetic_checkpoint import real_config, write_checkpoint
from prefill_model import CENTRAL, FAST, GPUS, LEVEL_SECONDS, MEMORY_EFFICIENCY, SLOW
from verify_pass_model import UNION_DESIGNS, expert_bytes_beyond_traffic

from lily.checkpoint.config import ModelConfig, parse_config
from lily.checkpoint.loader import load_checkpoint
from lily.device import open_device
from lily.engine.model_graph import (
    ModelGraph,
    kv_cache_bytes_per_token,
    pass_traffic,
    recurrent_state_bytes,
)

STREAMS = (1, 2, 4, 8)


def full_size_levels() -> dict[int, int]:
    """Levels by stream count: the decode step's for 1, the batched pass's beyond, recorded on
    the full-size layout of zeros."""
    with tempfile.TemporaryDirectory() as directory:
        write_checkpoint(Path(directory), zeros=True)
        checkpoint = load_checkpoint(Path(directory))
        c = checkpoint.config
        device = open_device("sim", execute=False)
        model = ModelGraph(checkpoint, device, 4096, c.vocab_size, max_chunk=max(STREAMS))
        model.allocate_slots(max(STREAMS))
        levels = {1: model.decode.barrier_count + 1}
        for streams in STREAMS[1:]:
            levels[streams] = model.batch_graph(range(streams)).barrier_count + 1
        return levels


def serial_row_levels(c: ModelConfig, streams: int) -> int:
    """The levels a pass had when each row's attention and draw were dispatches of their own,
    one row after another: two per attention layer and two for the sampler, per extra row."""
    return (streams - 1) * (2 * len(c.full_attention_layers) + 2)


def pass_bytes(c: ModelConfig, streams: int, context: int) -> float:
    """What a pass over `streams` streams moves: weights (the experts as the kernels read them:
    gate and up once per distinct expert, down once per (row, expert) pair, the rows' routing
    uniform), recurrent states, KV caches."""
    per_stream = 2 * recurrent_state_bytes(c) + context * kv_cache_bytes_per_token(c, "bf16")
    union = UNION_DESIGNS["union gate/up"]
    weights = pass_traffic(c, streams).weight_bytes
    weights += expert_bytes_beyond_traffic(c, streams, 0.0, union)
    return weights + streams * per_stream


def pass_seconds(
    c: ModelConfig, gpu, streams: int, context: int, efficiency: int, levels: int
) -> float:
    traffic = pass_traffic(c, streams)
    moved = pass_bytes(c, streams, context)
    bandwidth = gpu.bandwidth * MEMORY_EFFICIENCY[efficiency]
    issue_rate = gpu.fp32_rate / 2
    return max(moved / bandwidth, traffic.gemv_ops / issue_rate) + levels * LEVEL_SECONDS


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--context", type=int, default=4096, help="each stream's context")
    args = parser.parse_args()
    c = parse_config(real_config())
    levels = full_size_levels()
    shown = ", ".join(f"{n} at {streams}" for streams, n in levels.items())
    print(f"levels (recorded on the full-size layout) by streams: {shown}")
    print(
        f"batched decode at the real dims, each stream at {args.context} tokens of context "
        "(a MODEL, not a measurement: no Mac ran it)"
    )
    print(f"{'Mac':8s} {'streams':>7s} {'ms/pass':>8s} {'tok/s each':>11s} "
          f"{'aggregate tok/s':>16s}  (memory efficiency 0.7-0.85)  "
          "one dispatch per row")  # fmt: skip
    for gpu in GPUS:
        for streams in STREAMS:
            level = levels[streams]
            central = pass_seconds(c, gpu, streams, args.context, CENTRAL, level)
            slow = pass_seconds(c, gpu, streams, args.context, SLOW, level)
            fast = pass_seconds(c, gpu, streams, args.context, FAST, level)
            serial_levels = level + serial_row_levels(c, streams)
            serial = pass_seconds(c, gpu, streams, args.context, CENTRAL, serial_levels)
            print(
                f"{gpu.name:8s} {streams:7d} {central * 1e3:8.2f} {1 / central:11.0f} "
                f"{streams / central:16.0f}  {f'({streams / slow:.0f}-{streams / fast:.0f})':28s}"
                f"{streams / serial:22.0f}"
            )
    # The ceiling of this design: its bytes at the whole published bandwidth, nothing else.
    for gpu in GPUS:
        ceiling = ", ".join(
            f"{streams * gpu.bandwidth / pass_bytes(c, streams, args.context):.0f} at {streams}"
            for streams in STREAMS
        )
        print(f"{gpu.name}: the bytes alone at 100 % of the bandwidth: {ceiling} streams (tok/s)")


if __name__ == "__main__":
    main()
