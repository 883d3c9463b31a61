"""One-off check at the real model's dims: run the full-size synthetic checkpoint through the sim
engine for a few tokens and compare with the numpy reference model. Slow (seconds per token on
both sides), so not part of the test suite. Four ways to feed the tokens:

- by default each token goes through the decode step (teacher-forced) and every position is
  compared;
- `--prefill`: the tokens go through the engine as one batched prefill chunk and the last
  position's logits are compared;
- `--context N`: the decode step after a context of N positions that is given rather than fed
  (`lily.diagnostics.seeded_context`: random KV rows in the cache's format and random GDN state,
  handed to the engine's prefix cache and to the reference alike), then the tokens teacher-forced
  after it; feeding 8k tokens would take the sim days;
- `--verify K`: the tokens are a prompt; after it, one speculative verify pass over the first
  generated token and K drafts (arbitrary tokens: the pass's K + 1 rows of logits are computed
  whether they are accepted or not), compared row by row.

Decoded tokens: the engine keeps its KV cache in bf16, the reference in float32, and 40 layers
of random weights amplify any rounding. So the reference runs three times: as is; with its cache
rounded to bf16 like the engine's; and that again in float64, the yardstick. The engine agrees
when its distance to the float64 reference is of the order of the float32 reference's own. With
`--kv-cache int8` the engine keeps an int8 cache and the second and third references round
theirs through int8 groups of 32 with fp16 scales, as the engine's cache does, instead of bf16.
(A seeded context holds the cache's values on every side; only the rows appended after it
differ between the first reference and the others.)

A prefill chunk (`--prefill`) or a verify pass (`--verify`) goes through the chunk kernels,
whose products take 2-byte operands (gdn_chunk's from 2 tokens, the GEMMs' and attention_chunk's
from 10). Through 40 random layers such a rounding flips near-tied expert choices, each flip
moving the logits by O(1), so that a comparison with an exact reference measures how many
near-ties there were rather than whether the kernels are right. In those modes the check
(a) pins every reference's routing to the experts the sim chose (each MoE block's choice is
copied out of the sim's scratch as the pass runs), and counts where the exact float64 model
would have chosen otherwise and by what margin; and (b) gives the yardstick the kernels'
rounding: its references feed the tokens in the engine's passes and compute each pass of
several tokens as the chunk kernels do (reference.ChunkRounding, which the kernel tests hold to
the kernels). The references are then float32 and float64 with that rounding (the noise and the
yardstick; bf16 KV only), and float64 without it (what the 2-byte operands cost).

Usage:
    python benchmarks/make_synthetic_checkpoint.py SYNTH_DIR   # once, ~19.5 GB
    python benchmarks/full_size_check.py SYNTH_DIR [--tokens 4]
    python benchmarks/full_size_check.py SYNTH_DIR --prefill --tokens 64
    python benchmarks/full_size_check.py SYNTH_DIR --context 8192 --tokens 2 [--kv-cache int8]
    python benchmarks/full_size_check.py SYNTH_DIR --verify 4 --tokens 3
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable, Sequence

import numpy as np

from lily.checkpoint.loader import load_checkpoint
from lily.device import Device, Graph, open_device
from lily.diagnostics.seeded_context import seed_context
from lily.engine import model_graph, reference
from lily.engine.engine import DeviceEngine
from lily.engine.model_graph import kv_cache_bytes_per_token
from lily.engine.prefix_cache import PrefixCache
from lily.engine.reference import ChunkRounding, ReferenceModel, ReferenceState
from lily.kernels.copy import record_copy

# The engine may be this many times further from float64 than the float32 reference is.
NOISE_FACTOR = 2.0


class _OneDraft:
    """Drafts `drafts` once, after the first generated token, then nothing."""

    def __init__(self, drafts: list[int]) -> None:
        self.drafts = drafts
        self.exhausted = False

    def draft(self, tokens: Sequence[int], limit: int) -> list[int]:
        self.exhausted = True
        return self.drafts[:limit]

    def verified(self, drafted: Sequence[int], accepted: int) -> None:
        pass


class _RoutingProbe:
    """The experts the sim's MoE blocks choose: while installed, every MoE block a graph
    records (model_graph.record_moe and record_moe_chunk) also copies its expert ids
    [tokens, top_k] into a slot of its own in `buffer`, so that after a graph has run once its
    slots hold its choices, layer by layer."""

    def __init__(self, device: Device, nbytes: int) -> None:
        self.buffer = device.alloc(nbytes)
        self.used = 0
        self.slots: dict[int, list[tuple[int, int]]] = {}  # id(graph): (offset, tokens) per block
        self._recording: list[tuple[int, int]] = []
        self._originals = (
            model_graph.record_moe,
            model_graph.record_moe_chunk,
            model_graph._Recorder.record,
        )

    def install(self) -> None:
        record_moe, record_moe_chunk, record = self._originals

        def probed(record_block):
            def record_probed_block(graph: Graph, device: Device, x, w, top_k, scratch, out, **kw):
                record_block(graph, device, x, w, top_k, scratch, out, **kw)
                copy_routes(graph, device, scratch, top_k, kw.get("tokens", 1))

            return record_probed_block

        def copy_routes(graph: Graph, device: Device, scratch, top_k: int, tokens: int) -> None:
            nbytes = 4 * tokens * top_k
            if self.used + nbytes > self.buffer.size:
                raise RuntimeError("the routing probe's buffer is full")
            graph.barrier()
            record_copy(graph, device, scratch.expert_ids, (self.buffer, self.used), nbytes)
            self._recording.append((self.used, tokens))
            self.used += nbytes

        def record_probed(recorder) -> Graph:
            self._recording = []
            graph = record(recorder)
            self.slots[id(graph)] = self._recording
            return graph

        model_graph.record_moe = probed(record_moe)
        model_graph.record_moe_chunk = probed(record_moe_chunk)
        model_graph._Recorder.record = record_probed

    def uninstall(self) -> None:
        (
            model_graph.record_moe,
            model_graph.record_moe_chunk,
            model_graph._Recorder.record,
        ) = self._originals

    def routes(self, graphs: Callable[[], list[Graph]], top_k: int) -> list[np.ndarray]:
        """The choices of the graphs `graphs` looks up, as they last ran: one [tokens, top_k]
        array per MoE block, graph after graph. A lookup that records a graph (one that never
        ran) is refused."""
        recorded = self.used
        looked_up = graphs()
        if self.used != recorded:
            raise RuntimeError("the engine's passes were not the graphs this check reads")
        words = self.buffer.numpy().view(np.uint32)
        return [
            words[offset // 4 : offset // 4 + tokens * top_k].reshape(tokens, top_k).copy()
            for graph in looked_up
            for offset, tokens in self.slots[id(graph)]
        ]


class _PinnedRouting:
    """Makes every ReferenceModel route to given experts (`pin`, one [tokens, top_k] array per
    MoE block in the order the model runs them) with its own router's weights for them, and
    records where its own choice would have differed: (set of ids differs, the margin between
    its top_k-th and next router probability) per token."""

    def __init__(self) -> None:
        self.queue: list[np.ndarray] = []
        self.flips: list[float] = []
        self.routes = 0
        self._original = reference.moe_route

    def pin(self, routes: list[np.ndarray]) -> None:
        self.queue = list(routes)
        self.flips, self.routes = [], 0

    def install(self) -> None:
        def pinned(router_logits: np.ndarray, top_k: int, normalize: bool):
            if not self.queue:
                raise RuntimeError("the reference ran more MoE blocks than the sim recorded")
            ids = self.queue.pop(0).astype(np.int64)
            if ids.shape != (*router_logits.shape[:-1], top_k):
                raise RuntimeError(
                    f"pinned routes {ids.shape}, router logits {router_logits.shape}"
                )
            own, _ = self._original(router_logits, top_k, normalize)
            probs = reference.router_probabilities(router_logits)
            ordered = np.sort(probs, axis=-1)
            for t in range(ids.shape[0]):
                self.routes += 1
                if set(own[t].tolist()) != set(ids[t].tolist()):
                    self.flips.append(float(ordered[t, -top_k] - ordered[t, -top_k - 1]))
            weights = np.take_along_axis(probs, ids, axis=-1)
            if normalize:
                weights = weights / weights.sum(axis=-1, keepdims=True)
            return ids, weights

        reference.moe_route = pinned

    def uninstall(self) -> None:
        reference.moe_route = self._original


def _run_passes(
    model: ReferenceModel, passes: list[list[int]], state: ReferenceState | None
) -> np.ndarray:
    """Logits of every token of `passes`, fed one pass (one prefill call) at a time."""
    logits = []
    for tokens in passes:
        rows, state = model.prefill(tokens, state)
        logits.append(rows)
    return np.concatenate(logits)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("directory")
    parser.add_argument("--tokens", type=int, default=4, help="tokens fed")
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--prefill", action="store_true", help="feed them as one prefill chunk")
    mode.add_argument("--context", type=int, default=0, help="after a seeded context this long")
    mode.add_argument("--verify", type=int, default=0, help="a verify pass of this many drafts")
    parser.add_argument("--kv-cache", choices=("bf16", "int8"), default="bf16")
    args = parser.parse_args()
    rounded = (
        {"bf16_kv_cache": True}
        if args.kv_cache == "bf16"
        else {"kv_int8_group": 32, "kv_int8_fp16_scales": True}
    )

    checkpoint = load_checkpoint(args.directory, level="strict")
    config = checkpoint.config
    tokens = [(i * 2654435761) % 2**32 % config.vocab_size for i in range(args.tokens)]
    context = seed_context(config, args.context, args.kv_cache) if args.context else None
    max_seq = args.context + args.tokens + args.verify + 2
    tensors = checkpoint.tensors
    # Passes of several tokens: the yardstick models the chunk kernels' rounding.
    modelled = bool(args.verify or args.prefill)
    if modelled:
        if args.kv_cache != "bf16":
            raise SystemExit("--verify and --prefill model the chunk kernels for a bf16 cache")
        chunks = ChunkRounding.of_the_engine()
        references = {
            f"float32, {args.kv_cache} KV, the chunk kernels' rounding": ReferenceModel(
                config, tensors, **rounded, chunks=chunks
            ),
            f"float64, {args.kv_cache} KV, the chunk kernels' rounding": ReferenceModel(
                config, tensors, np.float64, **rounded, chunks=chunks
            ),
            f"float64, {args.kv_cache} KV, exact": ReferenceModel(
                config, tensors, np.float64, **rounded
            ),
        }
    else:
        references = {
            "float32, fp32 KV": ReferenceModel(config, tensors),
            f"float32, {args.kv_cache} KV": ReferenceModel(config, tensors, **rounded),
            f"float64, {args.kv_cache} KV": ReferenceModel(config, tensors, np.float64, **rounded),
        }

    # A seeded context must fit the prefix cache, whatever the default budget leaves beside
    # 19.5 GB of weights on this machine.
    cache = PrefixCache(1 << 40, kv_cache_bytes_per_token(config, args.kv_cache))
    device = open_device("sim")
    probe = _RoutingProbe(device, 1 << 20)
    if modelled:
        probe.install()
    try:
        sim = DeviceEngine(
            checkpoint,
            device,
            max_seq,
            config.vocab_size,
            max(len(tokens), args.verify + 1),
            prefix_cache=cache,
            kv_cache=args.kv_cache,
        )
        start = time.perf_counter()
        passes = [tokens]
        routes: list[np.ndarray] | None = None
        top_k = config.num_experts_per_tok
        if args.prefill:
            actual = sim.prompt_logits(tokens)[None]
            routes = probe.routes(lambda: [sim._model.graph(len(tokens), predicts=True)], top_k)
        elif context is not None:
            context.give_to(sim)
            actual = sim.teacher_forced_logits(context.tokens + tokens, reuse=True)
        elif args.verify:
            drafts = [(t * 7 + 3) % config.vocab_size for t in range(args.verify)]
            stream = sim.generate(tokens, args.verify + 2, drafter=_OneDraft(drafts))
            first_token = next(stream).id  # from the prefill; the next comes from the verify pass
            next(stream)
            stream.close()
            actual = sim._model.verify_logits_view(args.verify + 1).copy()
            passes = [tokens, [first_token, *drafts]]
            verify_rows = args.verify + 1
            routes = probe.routes(
                lambda: [
                    sim._model.graph(len(tokens), predicts=True),
                    sim._model.verify_graph(verify_rows, verify_rows),
                ],
                top_k,
            )
        else:
            actual = sim.teacher_forced_logits(tokens)
            passes = [[t] for t in tokens]
        sim_seconds = time.perf_counter() - start
    finally:
        probe.uninstall()
    fed = [t for p in passes for t in p]
    rows = slice(len(tokens) - 1, None) if args.prefill else slice(len(fed) - len(actual), None)

    pinning = _PinnedRouting()
    expected = {}
    flips: list[float] = []
    pinned_routes = 0
    reference_seconds = 0.0
    for name, model in references.items():
        state: ReferenceState | None = None
        if context is not None:
            state = context.reference_state(model.dtype)
        if routes is not None:
            pinning.pin(routes)
            pinning.install()
        start = time.perf_counter()
        try:
            expected[name] = _run_passes(model, passes, state)[rows]
        finally:
            pinning.uninstall()
        reference_seconds = reference_seconds or (time.perf_counter() - start) / len(fed)
        if routes is not None and model.dtype == np.float64 and model.chunks is None:
            flips, pinned_routes = pinning.flips, pinning.routes

    print(f"tokens            {fed}")
    if context is not None:
        print(f"after a seeded context of {args.context} positions ({args.kv_cache} KV)")
    print(f"reference         {reference_seconds:.1f} s/token (float32)")
    print(f"sim               {sim_seconds / len(actual):.1f} s per compared row")
    # The noise estimate and the yardstick: the last two references, or in a modelled mode the
    # first two (the third shows what the 2-byte operands cost).
    names = list(expected)
    noisy, yardstick = (expected[n] for n in (names[:2] if modelled else names[1:]))
    print(f"logit scale       {np.abs(yardstick).max():.3f} (max |logit|)")
    if routes is not None:
        margins = (
            f", at router-probability margins (top_k-th minus next) from {min(flips):.1e} to "
            f"{max(flips):.1e}, median {np.median(flips):.1e}"
            if flips
            else ""
        )
        print(
            f"routing           pinned to the sim's {pinned_routes} choices (token, MoE block); "
            f"the exact float64 model chooses otherwise in {len(flips)}{margins}"
        )
    for name, reference_logits in expected.items():
        difference = np.abs(actual - reference_logits).max(-1)
        same_argmax = (actual.argmax(-1) == reference_logits.argmax(-1)).tolist()
        print(f"sim vs reference ({name}): max |difference| per row {difference}, ", end="")
        print(f"same argmax {same_argmax}")
    noise = np.abs(noisy - yardstick).max()
    error = np.abs(actual - yardstick).max()
    print(f"float32 reference vs float64: {noise:.2e}; sim vs float64: {error:.2e}")
    verdict = "agree" if error <= NOISE_FACTOR * noise else "DISAGREE"
    print(f"verdict: {verdict} (sim within {NOISE_FACTOR}x of float32's own rounding noise)")


if __name__ == "__main__":
    main()
