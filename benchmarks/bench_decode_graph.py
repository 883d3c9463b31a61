"""The decode graph of a checkpoint, measured without a GPU: dispatches and barriers per decoded
token, the weight bytes one token reads (against spec/model.md's 1.80 GB minimum for the real
model), and the host's time to submit and retire one step, with the sim recording and submitting
but not executing kernels (so the number is the host overhead alone).

Usage:
    python benchmarks/make_synthetic_checkpoint.py SYNTH_DIR   # once, ~19.5 GB
    python benchmarks/bench_decode_graph.py SYNTH_DIR [--steps 200] [--context 256]
    python benchmarks/bench_decode_graph.py demo
"""

from __future__ import annotations

import argparse
import time

from lily.checkpoint import load_checkpoint, resolve_model
from lily.config import FULL_ATTENTION
from lily.decode_graph import DecodeGraph
from lily.device import open_device
from lily.kernels.attention import cache_bytes
from lily.kernels.gdn import state_bytes
from lily.validate import expected_layout

EMBEDDING = "language_model.model.embed_tokens"
SPEC_MINIMUM_GB = 1.80


def weight_bytes_per_token(checkpoint) -> dict[str, int]:
    """Bytes of weights and recurrent state one decoded token reads, by kind: every projection
    is read whole once, except the embedding (one row) and the routed experts (top-k of E)."""
    c = checkpoint.config
    layout = expected_layout(c)
    totals = {"projections": 0, "routed experts": 0, "embedding row": 0, "small tensors": 0}
    for lin in layout.linears.values():
        q = lin.quant
        per_row = lin.in_features * q.bits // 8 + 2 * 2 * (lin.in_features // q.group_size)
        if lin.path == EMBEDDING:
            totals["embedding row"] += per_row
        elif lin.experts is not None:
            totals["routed experts"] += per_row * lin.out_features * c.num_experts_per_tok
        else:
            totals["projections"] += per_row * lin.out_features
    for name in layout.plain:
        totals["small tensors"] += checkpoint.locations[name].nbytes
    gdn_layers = sum(1 for t in c.layer_types if t != FULL_ATTENTION)
    totals["GDN state (read + write)"] = 2 * gdn_layers * state_bytes(c.linear_num_value_heads)
    return totals


def kv_bytes_per_context_token(config) -> int:
    return len(config.full_attention_layers) * 2 * cache_bytes(config.num_key_value_heads, 1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model", help="checkpoint directory, repo id or 'demo'")
    parser.add_argument("--steps", type=int, default=200, help="steps timed in no-execute mode")
    parser.add_argument("--context", type=int, default=256, help="context for the KV bytes")
    parser.add_argument("--max-seq", type=int, default=4096)
    args = parser.parse_args()

    checkpoint = load_checkpoint(resolve_model(args.model))
    config = checkpoint.config
    device = open_device("sim", execute=False)
    start = time.perf_counter()
    decode = DecodeGraph(checkpoint, device, args.max_seq, config.vocab_size)
    recorded = time.perf_counter() - start
    graph = decode.graph

    totals = weight_bytes_per_token(checkpoint)
    weights = sum(totals.values())
    kv = kv_bytes_per_context_token(config) * args.context
    print(f"checkpoint          {checkpoint.path} ({checkpoint.level})")
    print(f"graph recorded in   {recorded * 1e3:.1f} ms")
    print(f"dispatches / token  {graph.dispatch_count}")
    print(f"barriers / token    {graph.barrier_count}")
    for kind, nbytes in totals.items():
        print(f"  {kind:<24} {nbytes / 1e9:8.4f} GB")
    print(f"bytes / token       {weights / 1e9:.4f} GB + KV {kv / 1e6:.2f} MB at {args.context}")
    if checkpoint.level == "strict":
        print(f"spec minimum        {SPEC_MINIMUM_GB:.2f} GB (spec/model.md section 4)")

    in_flight = []
    start = time.perf_counter()
    for _ in range(args.steps):
        in_flight.append(device.submit(graph))
        if len(in_flight) == 2:
            device.wait(in_flight.pop(0))
    for ticket in in_flight:
        device.wait(ticket)
    per_step = (time.perf_counter() - start) / args.steps
    print(f"host time / step    {per_step * 1e6:.1f} us (submit + wait, kernels not executed)")


if __name__ == "__main__":
    main()
