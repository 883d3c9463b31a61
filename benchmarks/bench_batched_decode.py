"""Weight bytes read per generated token by batched decode (`ModelGraph.batch_graph`) at 1, 2, 4
and 8 streams against the single-sequence decode step, counted by the counting sim (the distinct
bytes every dispatch read from the checkpoint's buffers), on a real checkpoint's format at any
size (default: the demo), and the levels of its passes. Then the same ratio at the real
model's dims from `model_graph.pass_traffic` (an analytic count: projections and lm_head once
per pass, the expected number of distinct experts the streams' tokens choose), since the sim
cannot run the real model's 19.5 GB in reasonable time.

Then one timed run on the sim (a CPU, so the times say how the work shrinks, not how fast a Mac
is): 4 requests of `--new-tokens` tokens each, one after another with `DeviceEngine.generate`,
then the same 4 together with `BatchedDecoder` (each joins after its own prefill, then they
decode in shared passes).

Each stream's newest token is a different id at position 0, so that the streams route to
different experts as independent requests would.

    python benchmarks/bench_batched_decode.py [MODEL] [--new-tokens 32]
"""

from __future__ import annotations

import argparse
import time

import numpy as np
from make_synthetic_checkpoint import real_config

from lily.checkpoint.config import parse_config
from lily.checkpoint.loader import load_checkpoint, resolve_model
from lily.device import Device, Graph, open_device
from lily.engine.batch import BatchedDecoder
from lily.engine.engine import DeviceEngine
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
    parser.add_argument("--new-tokens", type=int, default=32, help="tokens per timed request")
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
    levels = ", ".join(
        f"{streams}: {graph.batch_graph(range(streams)).barrier_count + 1}" for streams in STREAMS
    )
    print(
        f"  levels: decode step {graph.decode.barrier_count + 1}, batched pass by streams {levels}"
    )
    real = parse_config(real_config())
    one = pass_traffic(real, 1).weight_bytes
    print("real dims (analytic, pass_traffic: not counted):")
    for streams in STREAMS:
        per_token = pass_traffic(real, streams).weight_bytes / streams
        print(f"  {streams} streams: {per_token / 1e9:.2f} GB per token ({per_token / one:.2f}x)")
    time_four_requests(checkpoint, args.new_tokens)


def time_four_requests(checkpoint, new_tokens: int) -> None:
    c = checkpoint.config
    rng = np.random.default_rng(1)
    prompts = [rng.integers(0, c.vocab_size, n).tolist() for n in (12, 20, 28, 36)]
    max_seq = max(map(len, prompts)) + new_tokens
    engine = DeviceEngine(checkpoint, open_device("sim"), max_seq, c.vocab_size, max_chunk=64)
    start = time.perf_counter()
    alone = [[t.id for t in engine.generate(p, new_tokens)] for p in prompts]
    sequential = time.perf_counter() - start
    start = time.perf_counter()
    batch = BatchedDecoder(engine, slots=len(prompts))
    streams = [batch.join(p, new_tokens) for p in prompts]
    while not all(batch.finished(s) for s in streams):
        batch.step()
    together = time.perf_counter() - start
    same = [batch.tokens(s) for s in streams] == alone
    print(f"4 requests of {new_tokens} tokens on the sim, one run each (measured):")
    print(f"  one after another: {sequential:.2f} s")
    ratio = together / sequential
    print(f"  together:          {together:.2f} s ({ratio:.2f}x), same tokens: {same}")
    engine.close()


if __name__ == "__main__":
    main()
