"""Where the sim's time goes in one decode step, one verify pass and one batched decode pass:
each dispatch of the demo's graphs is also recorded into a graph of its own and timed alone
(after the whole graph ran once), and the times are summed per kernel.

The sim's costs are its own (threads and SIMD collectives more than arithmetic: docs/sim.md),
so this says what to change to make tests and sim runs faster, not what a Mac spends.

Usage:
    python benchmarks/profile_sim_graph.py [--model demo] [--drafts 4] [--rows 4] [--top 12]
"""

from __future__ import annotations

import argparse
import collections
import time
from typing import Any

import lily
from lily import device as lily_device


def record_singles() -> list[tuple[str, lily_device.Graph]]:
    """Makes every Graph also record each dispatch as a graph of its own; returns the list
    they are appended to (kernel name, one-dispatch graph)."""
    singles: list[tuple[str, lily_device.Graph]] = []
    dispatch = lily_device.Graph.dispatch

    def recording(self: lily_device.Graph, kernel: Any, **arguments: Any) -> None:
        dispatch(self, kernel, **arguments)
        alone = lily_device.Graph()
        dispatch(alone, kernel, **arguments)
        singles.append((kernel.name, alone))

    lily_device.Graph.dispatch = recording  # type: ignore[method-assign]
    return singles


def profile(device: lily_device.Device, name: str, record: Any, singles: list, top: int) -> None:
    first = len(singles)
    graph = record()
    mine = singles[first:]
    if not mine:
        raise SystemExit(f"the {name}'s graph was recorded before profiling began")
    device.run(graph)
    started = time.perf_counter()
    device.run(graph)
    whole = time.perf_counter() - started
    seconds: collections.Counter[str] = collections.Counter()
    counts: collections.Counter[str] = collections.Counter()
    for kernel, alone in mine:
        started = time.perf_counter()
        device.run(alone)
        seconds[kernel] += time.perf_counter() - started
        counts[kernel] += 1
    print(f"{name}: {whole * 1e3:.1f} ms for the graph, {len(mine)} dispatches")
    for kernel, spent in seconds.most_common(top):
        print(f"  {spent * 1e3:8.1f} ms  {counts[kernel]:3d} x  {kernel}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="demo")
    parser.add_argument("--drafts", type=int, default=4, help="the verify pass's drafts")
    parser.add_argument("--rows", type=int, default=4, help="the batched pass's streams")
    parser.add_argument("--top", type=int, default=12, help="kernels to list per graph")
    args = parser.parse_args()
    singles = record_singles()
    with lily.load(args.model, device="sim", max_seq=512, speculative="off") as llm:
        model = llm.engine._model
        device = llm.engine.device
        model._graphs.clear()  # loading recorded some: record them again, dispatch by dispatch
        rows = args.drafts + 1
        profile(device, "decode step", lambda: model.graph(1, predicts=True), singles, args.top)
        profile(
            device,
            f"verify pass of {args.drafts} drafts",
            lambda: model.verify_graph(rows, rows),
            singles,
            args.top,
        )
        # Each slot at position 0 of a zeroed state: a pass's work does not depend on the ids.
        model.allocate_slots(args.rows)
        profile(
            device,
            f"batched pass of {args.rows} streams",
            lambda: model.batch_graph(range(args.rows)),
            singles,
            args.top,
        )


if __name__ == "__main__":
    main()
