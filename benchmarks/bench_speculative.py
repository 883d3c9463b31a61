"""Speculative decoding on the sim: one chat request timed without drafts, with prompt lookup,
with the MTP head (when the checkpoint has one) and with a `prediction` equal to the answer, in
one process on one loaded model, then with the DFlash drafter on a second (the demo's is
random: its drafts are almost never accepted, so its arm shows what drafting with it costs).
With `--json-schema` the request answers under a json_schema `response_format` (every verified row
drawn under the grammar's mask after the drafts before it).

The sim runs the kernels on the CPU, so the times say how many passes and how much work a
request took here, not how fast a Mac is: a verify pass of k + 1 tokens costs the sim about
its arithmetic, while on a GPU a pass of a few tokens costs about what a decode step costs
(reading the weights). Every arm is warmed up first (graphs are recorded on first use) and
must give the same answer.

It first prints the levels (dependent dispatch levels: barriers) of the full-size graph's decode
step and verify passes, recorded on a sim that does not execute them from a checkpoint of the
real model's layout whose tensors are zeros (make_synthetic_checkpoint.py's `--zeros`: holes,
no disk); the loaded model's levels per decode step and verify pass (and, with a head, of
its catch-up and drafts after a read and queued ahead); a model of the delivered tok/s on an
M4 Max and an M5 Max, plain and with the MTP head (k = 1..3) or prompt lookup (k = 4) at
per-draft acceptance 0.9 / 0.7 / 0.5, per expert overlap of the verify pass's tokens and with
its experts read per (token, expert) pair or over their union (`print_mac_estimate`: an
estimate from the shapes, those levels and published bandwidths, not a measurement); and what
a verify pass of the full-size graph (the real model's config.json, as
make_synthetic_checkpoint.py writes it) moves of the recurrent state, per k drafts: the bytes
copied (a backup or a restore: none since the pass keeps its candidates' updates, issue 39),
read and written (`model_graph.verify_state_traffic`). That part is arithmetic on the shapes,
not a measurement. Each arm's line then gives its verify passes and its host round trips per
pass, counted: the host's waits for the device in the timed request (synchronous runs and waits
for submitted work: the prompt's command buffers, the MTP head's draft passes and its catch-up
over the last pass's rows where they have a wait of their own, plain passes, verify passes) over
the passes whose tokens the host read back (the prompt's last chunk, each verify pass, each
plain pass or decode step). 1.00 means that no part of a pass (the head's drafts, its
catch-up) costs a round trip of its own. And it gives how the engine queued them
(`DeviceEngine.speculative_pipeline`, counted): how many passes were queued behind a pass the
host had not read yet (two in flight: the device goes on to it without waiting for the host),
and how many were submitted with none in flight (the device waited while the host drafted and
encoded them).

Usage:
    python benchmarks/bench_speculative.py [--model demo] [--tokens 48] [--draft-tokens 8]
        [--json-schema] [--message TEXT]

"Hi" (the default message) gets an answer of the demo that tokenizes back into the model's own
tokens; "Write a poem about the sea." one that the model spells in other tokens than the
tokenizer would (the prediction is then drafted from its text: docs/python-api.md).
"""

from __future__ import annotations

import argparse
import tempfile
import time
from collections import Counter
from dataclasses import replace
from pathlib import Path

from make_synthetic_checkpoint import real_config, write_checkpoint
from prefill_model import CENTRAL, GPUS, LEVEL_SECONDS, MEMORY_EFFICIENCY
from verify_pass_model import UNION_DESIGNS, expert_bytes_beyond_traffic, overlap_cases

import lily
from lily.api import DEFAULT_MAX_SEQ
from lily.checkpoint.config import parse_config
from lily.checkpoint.loader import load_checkpoint
from lily.device import Device, open_device
from lily.engine.engine import DeviceEngine, SpeculativePipeline
from lily.engine.model_graph import (
    MAX_DRAFT_TOKENS,
    MTP_DRAFT_VOCAB,
    ModelGraph,
    pass_traffic,
    recurrent_state_bytes,
    verify_cost_ratio,
    verify_state_traffic,
)

NO_THINKING = {"chat_template_kwargs": {"enable_thinking": False}}
# The Mac estimate's inputs: the full-size graphs' levels (`full_size_levels`; issue 39's review
# counted 253 for the decode step and 408 for a verify pass before the verify pass was folded;
# the head's draft pass is 16 levels per draft, `ModelGraph.mtp_draft_graph` counted on the
# demo, whose head has the real one's layer walk),
# a 4-bit weight with its bf16 scale and bias per 64, the GPU idle once per verify pass while
# the host reads the accepted tokens and encodes the next pass (the review's ~0.7 ms of
# encoding and Python per pass; the head's drafts are taken on the device in the pass's own
# submission, so no round trip per draft) where the next pass is submitted after that read
# (prompt lookup, a prediction, a constraint); with the head, the next pass is queued before
# the read, so that time is hidden under the pass in flight (a verify pass runs 5 ms or more
# against the host's 0.7 ms) and what remains is the levels the head's following adds
# (`mtp_follow_graph` against `mtp_draft_graph`, counted on the loaded model),
# per-draft acceptance rates (published first-draft
# rates for Qwen3.5/3.6 MTP heads are 0.72-0.83: vLLM, vllm-mlx, mlx-lm PR 990, per issue 39).
MTP_LEVELS_PER_DRAFT = 16
BYTES_PER_WEIGHT = 4.5 / 8
PASS_HOST_S = 0.7e-3
ACCEPTANCE = (0.9, 0.7, 0.5)
# Mostly text the grammar forces (keys, separators, the rest of an enum value), repeated once per
# item: what prompt lookup finds in the answer so far and a grammar lets through.
ORDER_FORMAT = {
    "type": "json_schema",
    "json_schema": {
        "name": "order",
        "schema": {
            "type": "object",
            "properties": {
                "status": {"enum": ["pending", "shipped", "delivered"]},
                "items": {
                    "type": "array",
                    "items": {
                        "type": "object",
                        "properties": {
                            "sku": {"enum": ["A-100", "B-200", "C-300"]},
                            "quantity": {"type": "integer", "minimum": 1, "maximum": 9},
                        },
                        "required": ["sku", "quantity"],
                        "additionalProperties": False,
                    },
                    "minItems": 4,
                    "maxItems": 4,
                },
            },
            "required": ["status", "items"],
            "additionalProperties": False,
        },
    },
}


def print_state_traffic() -> None:
    c = parse_config(real_config())
    print("full-size graph, recurrent state per verify pass (k drafts, T = k + 1 tokens):")
    for k in range(1, MAX_DRAFT_TOKENS + 1):
        traffic = verify_state_traffic(c, k + 1, k + 1)
        print(
            f"  k = {k}: copied {traffic.copied / 1e6:.0f} MB, read {traffic.read / 1e6:.0f} MB, "
            f"written {traffic.written / 1e6:.0f} MB"
        )


def full_size_levels() -> tuple[int, dict[int, int]]:
    """The levels of the full-size graph's decode step and of its verify pass per k drafts (k + 1
    tokens and rows), at lily.load's default context: recorded, not run, on the real layout of
    zeros."""
    with tempfile.TemporaryDirectory() as directory:
        write_checkpoint(Path(directory), zeros=True)
        checkpoint = load_checkpoint(Path(directory))
        c = checkpoint.config
        device = open_device("sim", execute=False)
        model = ModelGraph(
            checkpoint, device, DEFAULT_MAX_SEQ, c.vocab_size, max_chunk=MAX_DRAFT_TOKENS + 1
        )
        decode = model.graph(1, predicts=True).barrier_count
        drafts = range(1, MAX_DRAFT_TOKENS + 1)
        return decode, {k: model.verify_graph(k + 1, k + 1).barrier_count for k in drafts}


def print_full_size_levels(decode: int, verify: dict[int, int]) -> None:
    shown = ", ".join(f"k = {k}: {n} ({n / decode:.2f}x)" for k, n in verify.items())
    print(f"full-size graph, levels: decode step {decode}, verify pass {shown}")


def print_levels(model: ModelGraph) -> int:
    """The levels (barriers) of the loaded model's decode step and verify passes: the demo's
    8 layers walk the real model's layer pattern, so per layer they are the real graph's (the
    few levels outside the layers weigh more in the ratio than at 40 layers). Returns the
    levels the head's drafts queued ahead add to those drafted after a read (0 without a
    head)."""
    decode = model.graph(1, predicts=True).barrier_count
    drafts = range(1, MAX_DRAFT_TOKENS + 1)
    verify = {model.verify_graph(k + 1, k + 1).barrier_count for k in drafts}
    shown = ", ".join(f"{levels} ({levels / decode:.2f}x)" for levels in sorted(verify))
    print(f"levels: decode step {decode}, verify pass (k = 1..{MAX_DRAFT_TOKENS}) {shown}")
    if model.mtp:
        per_draft = (
            model.mtp_draft_graph(1, 2).barrier_count - model.mtp_draft_graph(1, 1).barrier_count
        )
        print(
            f"levels: the MTP head's drafts, {per_draft} per draft, in the verify pass's submission"
        )
        # A pass of 3 drafts keeping 1: the catch-up over its 2 kept rows, or over all 4.
        after_read = model.mtp_draft_graph(2, 3).barrier_count
        ahead = model.mtp_follow_graph(4, 3).barrier_count
        print(
            f"levels: the head's catch-up and 3 drafts, {after_read} after a read, "
            f"{ahead} queued ahead of it (over all the unread pass's rows)"
        )
        return ahead - after_read
    return 0


def print_mac_estimate(
    decode_levels: int, verify_levels: dict[int, int], follow_levels: int
) -> None:
    """A MODEL of the delivered decode speed on a Mac, plain and with drafts, at per-draft
    acceptance a (each draft kept with probability a once those before it were): a pass of k
    drafts yields (1 - a^(k+1)) / (1 - a) tokens and costs its verify pass
    (`verify_cost_ratio` decode steps' bytes, plus the verify graph's extra levels), the
    host's turn between passes (none for the head, whose next pass is queued ahead: only the
    `follow_levels` its following adds), and, for the MTP head, k head steps (one MTP layer and
    the draft vocabulary's rows of the lm_head read, and their levels; the argmax on the
    device).

    The verify pass's experts are counted as its kernels read them, at the expert overlaps of
    verify_pass_model.py (uniform routing, and the published correlation of consecutive
    tokens' routing): "union" is what the verify pass runs (its gate/up over the union of its
    tokens' experts, one routing level per layer more than before: the verify graph's levels),
    "per pair" what it ran before (each (token, expert) pair reading its expert's weights, one
    level per layer fewer)."""
    c = parse_config(real_config())
    head = c.vocab_size * c.hidden_size * BYTES_PER_WEIGHT
    mtp_layer = (pass_traffic(c, 1).weight_bytes - head) / c.num_hidden_layers
    draft_head = min(c.vocab_size, MTP_DRAFT_VOCAB) * c.hidden_size * BYTES_PER_WEIGHT
    print(
        "delivered tok/s on a Mac (a MODEL: weights at 80% of the published bandwidth, "
        f"{decode_levels} / {max(verify_levels.values())} levels at "
        f"{LEVEL_SECONDS * 1e6:.0f} us, "
        f"{MTP_LEVELS_PER_DRAFT} per head draft, {PASS_HOST_S * 1e3:.2f} ms of host time "
        "per verify pass submitted after a read (ngram), hidden under the pass in flight for "
        f"the head, queued ahead, whose following adds {follow_levels} levels), "
        "per expert overlap: per pair -> union"
    )
    designs = {"per pair": (UNION_DESIGNS["per pair"], -c.num_hidden_layers)}
    designs["union"] = (UNION_DESIGNS["union gate/up"], 0)
    for gpu in GPUS[1:]:
        bandwidth = gpu.bandwidth * MEMORY_EFFICIENCY[CENTRAL]
        step_bytes = pass_traffic(c, 1).weight_bytes + 2 * recurrent_state_bytes(c)
        step = step_bytes / bandwidth + decode_levels * LEVEL_SECONDS
        print(f"  {gpu.name}: plain {1 / step:.0f}")
        for overlap_name, overlap in overlap_cases(c).items():
            for source, ks in (("mtp", (1, 2, 3)), ("ngram", (4,))):
                for k in ks:
                    drafting = PASS_HOST_S
                    if source == "mtp":
                        drafting = k * (
                            (mtp_layer + draft_head) / bandwidth
                            + MTP_LEVELS_PER_DRAFT * LEVEL_SECONDS
                        )
                        drafting += follow_levels * LEVEL_SECONDS
                    rates = {a: [] for a in ACCEPTANCE}
                    for matrices, level_change in designs.values():
                        verify = verify_cost_ratio(c, k) * (step_bytes / bandwidth)
                        verify += expert_bytes_beyond_traffic(c, k + 1, overlap, matrices) / (
                            bandwidth
                        )
                        verify += (verify_levels[k] + level_change) * LEVEL_SECONDS
                        for a in ACCEPTANCE:
                            tokens = (1 - a ** (k + 1)) / (1 - a)
                            rates[a].append(f"{tokens / (verify + drafting):.0f}")
                    shown = ", ".join(f"a={a}: {' -> '.join(r)}" for a, r in rates.items())
                    print(f"    {overlap_name:>22} {source} k={k}: {shown}")


def count_round_trips(counts: Counter) -> None:
    """Counts into `counts` the host's waits for the device ("runs": synchronous runs and waits
    for submitted work), verify graphs asked for ("verify passes", one per pass: the engine asks
    for the graph as it submits it) and passes read back ("passes": a verify pass's accepted
    tokens, or the token a prompt's last chunk, a plain pass or a decode step drew)."""
    run, wait, verify_graph = Device.run, Device.wait, ModelGraph.verify_graph
    pass_outcome, drawn = ModelGraph.pass_outcome, DeviceEngine._drawn

    def counted_run(self, graph):
        counts["runs"] += 1
        return run(self, graph)

    def counted_wait(self, ticket):
        counts["runs"] += 1
        return wait(self, ticket)

    def counted_verify_graph(self, tokens, rows):
        counts["verify passes"] += 1
        return verify_graph(self, tokens, rows)

    def counted_pass_outcome(self, position, drafts):
        counts["passes"] += 1
        return pass_outcome(self, position, drafts)

    def counted_drawn(self, end, sampling):
        counts["passes"] += 1
        return drawn(self, end, sampling)

    Device.run, Device.wait = counted_run, counted_wait
    ModelGraph.verify_graph = counted_verify_graph
    ModelGraph.pass_outcome = counted_pass_outcome
    DeviceEngine._drawn = counted_drawn


def count_queueing(counts: dict, before: SpeculativePipeline, after: SpeculativePipeline) -> None:
    """Adds to `counts` how the engine queued the request's passes (`speculative_pipeline`)."""
    counts["queued ahead"] = after.ahead - before.ahead
    counts["after a read"] = after.after_read - before.after_read


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="demo")
    parser.add_argument("--tokens", type=int, default=48, help="max_tokens of the request")
    parser.add_argument("--draft-tokens", type=int, default=8)
    parser.add_argument(
        "--json-schema", action="store_true", help="answer under a json_schema response_format"
    )
    parser.add_argument("--message", default="Hi", help="the user message")
    args = parser.parse_args()
    messages = [{"role": "user", "content": args.message}]
    decode_levels, verify_levels = full_size_levels()
    print_full_size_levels(decode_levels, verify_levels)
    print_state_traffic()
    # Loaded with the head when there is one ("auto"), so that its arm can run too.
    with lily.load(
        args.model, device="sim", max_seq=512, speculative="auto", draft_tokens=args.draft_tokens
    ) as llm:
        follow_levels = print_levels(llm.engine._model)
        print_mac_estimate(decode_levels, verify_levels, follow_levels)
        params = dict(messages=messages, max_tokens=args.tokens, temperature=0, **NO_THINKING)
        if args.json_schema:
            params["response_format"] = ORDER_FORMAT
        answer = llm.chat.completions.create(**params).choices[0].message.content
        prediction = {"type": "content", "content": answer}
        arms = {
            "no drafts": ("off", {}),
            "prompt lookup": ("ngram", {}),
            **({"MTP head": ("mtp", {})} if llm.mtp_head else {}),
            "prediction = answer": ("ngram", {"prediction": prediction}),
        }
        results = {}
        counts: Counter = Counter()
        count_round_trips(counts)
        for name, (mode, extra) in arms.items():
            llm.speculative = mode
            llm.chat.completions.create(**params, **extra)  # warm-up: records the graphs
            counts.clear()
            before = replace(llm.engine.speculative_pipeline)
            start = time.perf_counter()
            r = llm.chat.completions.create(**params, **extra)
            results[name] = (time.perf_counter() - start, r, dict(counts))
            count_queueing(results[name][2], before, llm.engine.speculative_pipeline)
    # The DFlash drafter needs an engine built with it (the demo's random drafter: its drafts
    # are almost never accepted, so this times the drafter's and the passes' overhead).
    with lily.load(
        args.model, device="sim", max_seq=512, speculative="dflash", draft_tokens=args.draft_tokens
    ) as llm:
        llm.chat.completions.create(**params)  # warm-up: records the graphs
        counts.clear()
        before = replace(llm.engine.speculative_pipeline)
        start = time.perf_counter()
        r = llm.chat.completions.create(**params)
        results["DFlash drafter"] = (time.perf_counter() - start, r, dict(counts))
        count_queueing(results["DFlash drafter"][2], before, llm.engine.speculative_pipeline)
    reference = results["no drafts"][1].choices[0].message
    grammar = ", json_schema" if args.json_schema else ""
    print(f"model {args.model} on the sim, {args.tokens} tokens{grammar}, k = {args.draft_tokens}")
    for name, (seconds, r, counted) in results.items():
        details = r.usage.completion_tokens_details
        accepted = details.accepted_prediction_tokens if details else None
        same = "same answer" if r.choices[0].message == reference else "DIFFERENT ANSWER"
        passes = counted.get("passes", 0)
        trips = f"{counted.get('runs', 0) / passes:.2f}" if passes else "-"
        ahead, after_read = counted["queued ahead"], counted["after a read"]
        print(
            f"  {name:22s} {seconds:7.2f} s  {r.usage.completion_tokens} tokens  "
            f"cached prompt {r.usage.prompt_tokens_details.cached_tokens}  "
            f"prediction tokens that appeared {accepted}  "
            f"{counted.get('verify passes', 0)} verify passes, {passes} passes read back, "
            f"{trips} host round trips per pass, {ahead} of {ahead + after_read} queued ahead "
            f"of the read of the pass before (those the device ran without waiting for the host)  "
            f"{same}"
        )


if __name__ == "__main__":
    main()
