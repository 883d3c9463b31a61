"""A MODEL (not a measurement: no Mac ran batched decode) of decoding B streams in one pass at
the real dims (`ModelGraph.batch_graph`, issue 42): aggregate tok/s at 1, 2, 4 and 8 streams on
the Macs of `prefill_model.py`, each stream at the same context.

A pass over B streams' newest tokens runs the 40-layer walk a verify pass of B tokens runs
(the GEMV-shaped kernels: `qgemv_tokens` reads each projection's weights once for all B, the
experts the B tokens chose are read once each), plus what each stream owns: its recurrent
state read and written (conv windows and GDN state), and its KV cache read once by attention.
So, per pass:

- bytes = `pass_traffic(c, B).weight_bytes` (projections and lm_head once; the expected number
  of distinct experts of B tokens choosing 8 of 256 each) + B x 2 x `recurrent_state_bytes`
  + B x context x `kv_cache_bytes_per_token` (bf16);
- ALU instructions = `pass_traffic(c, B).gemv_ops` (codes unpacked once per pass for the
  projections, once per token for the experts), issued at half the published fp32 FLOP rate
  (an FMA is two FLOPs);
- time = max(bytes / (bandwidth x memory efficiency), instructions / issue rate) + levels x
  `LEVEL_SECONDS`: 253 levels for the decode step (B = 1) and 408 for a pass of several tokens
  (the counts issue 39's review gives for the decode and verify graphs). The batched pass's
  per-row stages (conv and GDN steps, attention, sampler) are one dispatch over all rows through
  the slot table, so its levels do not grow with B: on the demo it records 83 levels at B = 2, 4
  and 8, against 87 for a verify pass (counted from `Graph.barrier_count`). The last column is
  the same model with the per-row stages one dispatch per row, as they were before the slot
  table: the rows' attention and draws then ran one after another, B - 1 more levels for each
  attention layer's two dispatches and the sampler's two, 22 (B - 1) at the real dims.

Left out: the host's work per pass (sampling is on the device; the host reads B tokens),
attention's own latency model (`model_decode_attention.py`; at these contexts attention is a
small share), and any contention between streams' prefill slices and the batch.

    python benchmarks/batched_decode_model.py [--context 4096]
"""

from __future__ import annotations

import argparse

from make_synthetic_checkpoint import real_config
from prefill_model import CENTRAL, FAST, GPUS, LEVEL_SECONDS, MEMORY_EFFICIENCY, SLOW

from lily.checkpoint.config import ModelConfig, parse_config
from lily.engine.model_graph import kv_cache_bytes_per_token, pass_traffic, recurrent_state_bytes

STREAMS = (1, 2, 4, 8)
DECODE_LEVELS = 253
VERIFY_LEVELS = 408


def serial_row_levels(c: ModelConfig, streams: int) -> int:
    """The levels a pass had when each row's attention and draw were dispatches of their own,
    one row after another: two per attention layer and two for the sampler, per extra row."""
    return (streams - 1) * (2 * len(c.full_attention_layers) + 2)


def pass_seconds(
    c: ModelConfig, gpu, streams: int, context: int, efficiency: int, extra_levels: int = 0
) -> float:
    traffic = pass_traffic(c, streams)
    per_stream = 2 * recurrent_state_bytes(c) + context * kv_cache_bytes_per_token(c, "bf16")
    moved = traffic.weight_bytes + streams * per_stream
    bandwidth = gpu.bandwidth * MEMORY_EFFICIENCY[efficiency]
    issue_rate = gpu.fp32_rate / 2
    levels = (DECODE_LEVELS if streams == 1 else VERIFY_LEVELS) + extra_levels
    return max(moved / bandwidth, traffic.gemv_ops / issue_rate) + levels * LEVEL_SECONDS


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--context", type=int, default=4096, help="each stream's context")
    args = parser.parse_args()
    c = parse_config(real_config())
    print(
        f"batched decode at the real dims, each stream at {args.context} tokens of context "
        "(a MODEL, not a measurement: no Mac ran it)"
    )
    print(f"{'Mac':8s} {'streams':>7s} {'ms/pass':>8s} {'tok/s each':>11s} "
          f"{'aggregate tok/s':>16s}  (memory efficiency 0.7-0.85)  "
          "one dispatch per row")  # fmt: skip
    for gpu in GPUS:
        for streams in STREAMS:
            central = pass_seconds(c, gpu, streams, args.context, CENTRAL)
            slow = pass_seconds(c, gpu, streams, args.context, SLOW)
            fast = pass_seconds(c, gpu, streams, args.context, FAST)
            serial = pass_seconds(
                c, gpu, streams, args.context, CENTRAL, serial_row_levels(c, streams)
            )
            print(
                f"{gpu.name:8s} {streams:7d} {central * 1e3:8.2f} {1 / central:11.0f} "
                f"{streams / central:16.0f}  {f'({streams / slow:.0f}-{streams / fast:.0f})':28s}"
                f"{streams / serial:22.0f}"
            )


if __name__ == "__main__":
    main()
