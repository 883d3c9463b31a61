"""Weight bytes read per generated token by batched decode (`ModelGraph.batch_graph`) at 1, 2, 4
and 8 streams against the single-sequence decode step, counted by the counting sim (the distinct
bytes every dispatch read from the checkpoint's buffers), on a real checkpoint's format at any
size (default: the demo). Then the same ratio at the real model's dims from
`model_graph.pass_traffic` (an analytic count: projections and lm_head once per pass, the
expected number of distinct experts the streams' tokens choose), since the sim cannot run the
real model's 19.5 GB in reasonable time.

Each stream's newest token is a different id at position 0, so that the streams route to
different experts as independent requests would.

    python benchmarks/bench_batched_decode.py [MODEL]
"""

from __future__ import annotations

import argparse

import numpy as np
from make_synthetic_checkpoint import real_config

from lily.checkpoint.config import parse_config
from lily.checkpoint.loader import load_checkpoint, resolve_model
from lily.device import Device, Graph, open_device
from lily.engine.model_graph import ModelGraph, pass_traffic
from lily.kernels.step import POSITION, PROMPT_END, TOKEN

STREAMS = (1, 2, 4, 8)


def weight_bytes(device: Device, graph: Graph) -> int:
    """Runs `graph` on the counting sim: the bytes its dispatches read from read-only buffers
    (the checkpoint's shards are the only ones)."""
    device.traffic()  # forget earlier runs
    device.run(graph)
    return sum(
        binding.read
        for dispatch in device.traffic()
        for binding in dispatch.buffers.values()
        if not binding.buffer.writable
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model", nargs="?", default="demo", help="checkpoint directory or 'demo'")
    args = parser.parse_args()
    checkpoint = load_checkpoint(resolve_model(args.model))
    c = checkpoint.config
    device = open_device("sim", count_traffic=True)
    graph = ModelGraph(checkpoint, device, 16, c.vocab_size, max_chunk=max(STREAMS))
    graph.allocate_slots(max(STREAMS))
    rng = np.random.default_rng(0)
    for slot, token in zip(graph.slots, rng.choice(c.vocab_size, max(STREAMS)), strict=True):
        slot.history.numpy().view(np.uint32)[0] = token
        step = slot.step.numpy().view(np.uint32)
        step[POSITION], step[PROMPT_END], step[TOKEN] = 0, 1, token
    graph.history_view()[0] = graph.slots[0].history.numpy().view(np.uint32)[0]
    step = graph.step_view()
    step[POSITION], step[PROMPT_END], step[TOKEN] = 0, 1, graph.history_view()[0]
    single = weight_bytes(device, graph.decode)
    print(f"{args.model}: {c.num_experts} experts, {c.num_experts_per_tok} per token")
    print(f"  decode step (1 sequence): {single:,} weight bytes per token")
    for streams in STREAMS:
        for slot in graph.slots:
            slot.step.numpy().view(np.uint32)[POSITION] = 0  # each pass from position 0 again
        per_token = weight_bytes(device, graph.batch_graph(range(streams))) / streams
        print(
            f"  {streams} streams: {per_token:,.0f} weight bytes per generated token "
            f"({per_token / single:.2f}x), counted"
        )
    real = parse_config(real_config())
    one = pass_traffic(real, 1).weight_bytes
    print("real dims (analytic, pass_traffic: not counted):")
    for streams in STREAMS:
        per_token = pass_traffic(real, streams).weight_bytes / streams
        print(f"  {streams} streams: {per_token / 1e9:.2f} GB per token ({per_token / one:.2f}x)")


if __name__ == "__main__":
    main()
