"""Long passes are split into several command buffers by estimated work, so that none runs long
enough for macOS's GPU watchdog: the graph's boundaries (a barrier the metal device turns into a
new command buffer), how the layer walk is grouped at the real model's dims, that a split graph
computes what an unsplit one does, and the default prefill chunk the memory allows."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
from device_testing import open_test_device
from tiny_models import tiny_checkpoint

from lily import api
from lily.checkpoint.config import FULL_ATTENTION, LINEAR_ATTENTION
from lily.checkpoint.loader import load_checkpoint
from lily.device import Graph
from lily.engine import model_graph
from lily.engine.command_buffer_budget import command_buffer_flops
from lily.engine.engine import DeviceEngine
from lily.engine.model_graph import (
    COMMAND_BUFFER_FLOPS,
    PREFILL_CHUNKS,
    SIM_COMMAND_BUFFER_FLOPS,
    command_buffer_starts,
    device_bytes,
    layer_flops,
    longest_chunk,
)


@pytest.fixture(scope="module")
def checkpoint():
    return load_checkpoint(tiny_checkpoint("small"))


def real_dims(config):
    """The tiny config with the real model's sizes (model.md), for the work estimates."""
    layers = tuple(FULL_ATTENTION if (i + 1) % 4 == 0 else LINEAR_ATTENTION for i in range(40))
    return replace(
        config,
        hidden_size=2048,
        num_hidden_layers=40,
        layer_types=layers,
        num_attention_heads=16,
        num_key_value_heads=2,
        head_dim=256,
        linear_num_key_heads=16,
        linear_num_value_heads=32,
        linear_key_head_dim=128,
        linear_value_head_dim=128,
        num_experts=256,
        num_experts_per_tok=8,
        moe_intermediate_size=512,
        shared_expert_intermediate_size=512,
    )


def test_a_command_buffer_boundary_is_a_barrier_between_dispatches():
    kernel = open_test_device().kernel("rms_norm_float")
    graph = Graph()
    assert graph.command_buffer_count == 0
    graph.end_command_buffer()  # nothing before it: no boundary
    for _ in range(2):
        graph.dispatch(kernel, threadgroups=1, threads=32)
    assert graph.command_buffer_count == 1
    graph.end_command_buffer()
    graph.end_command_buffer()  # twice in a row is one boundary
    graph.barrier()
    graph.dispatch(kernel, threadgroups=1, threads=32)
    assert (graph.command_buffer_count, graph.barrier_count) == (2, 1)
    graph.end_command_buffer()  # a trailing boundary starts nothing
    assert graph.command_buffer_count == 2


def test_the_real_models_passes_are_grouped_within_the_budget(checkpoint):
    c = real_dims(checkpoint.config)
    capacity = 32768
    # A decode step and a verify pass are one command buffer even at the longest context.
    assert command_buffer_starts(c, 262144, 1) == set()
    assert command_buffer_starts(c, 262144, 9) == set()
    for tokens in (512, 2048, 4096):
        starts = command_buffer_starts(c, capacity, tokens)
        flops = layer_flops(c, capacity - tokens, tokens)
        bounds = [0, *sorted(starts), len(flops)]
        groups = [sum(flops[a:b]) for a, b in zip(bounds, bounds[1:], strict=False)]
        # Every group fits, or is a single layer over budget on its own.
        assert all(
            g <= COMMAND_BUFFER_FLOPS or b - a == 1
            for g, a, b in zip(groups, bounds, bounds[1:], strict=False)
        )
        # Greedy grouping: a group and the next layer together would not have fit.
        assert all(
            groups[k] + flops[bounds[k + 1]] > COMMAND_BUFFER_FLOPS for k in range(len(groups) - 1)
        )
    # 4,096 tokens at 32k context are about 40 TFLOP: at least 40 command buffers at the
    # slowest GPU's budget (0.9 TFLOP).
    assert len(command_buffer_starts(c, capacity, 4096)) + 1 >= 40


def test_a_split_pass_computes_what_one_command_buffer_does(checkpoint, monkeypatch):
    c = checkpoint.config
    prompt = np.random.default_rng(3).integers(0, c.vocab_size, 300).tolist()

    def run() -> tuple[list[int], np.ndarray, int]:
        engine = DeviceEngine(checkpoint, open_test_device(), 512, c.vocab_size, 512)
        tokens = [t.id for t in engine.generate(prompt, 3)]
        graph = engine._model.graph(300, predicts=True)
        return tokens, engine._model.logits_view().copy(), graph.command_buffer_count

    whole_tokens, whole_logits, whole_buffers = run()
    # A budget of about three layers of this chunk splits its walk into several buffers.
    monkeypatch.setattr(model_graph, "COMMAND_BUFFER_FLOPS", 3 * max(layer_flops(c, 212, 300)))
    split_tokens, split_logits, split_buffers = run()
    assert whole_buffers == 1
    assert split_buffers >= c.num_hidden_layers // 3
    assert split_tokens == whole_tokens
    np.testing.assert_array_equal(split_logits, whole_logits)


def test_the_default_chunk_is_the_longest_the_memory_allows(checkpoint, monkeypatch):
    limit = device_bytes(checkpoint, 8192, 1024)

    def check_memory(device: str, nbytes: int) -> None:
        if nbytes > limit:
            raise MemoryError(f"{nbytes} bytes")

    monkeypatch.setattr("lily.device.check_memory", check_memory)
    assert api.default_prefill_chunk(checkpoint, "metal", 8192) == 1024
    # Never longer than the context.
    assert api.default_prefill_chunk(checkpoint, "metal", 700) == 700
    # Nothing fits: the shortest, for the preflight to refuse with its advice.
    limit = 0
    assert api.default_prefill_chunk(checkpoint, "metal", 8192) == PREFILL_CHUNKS[-1]
    # The MTP head's cache and buffers count too: 1,024 no longer fits beside them.
    with_head = load_checkpoint(tiny_checkpoint("small", mtp_head=True))
    limit = device_bytes(with_head, 8192, 1024)
    assert api.default_prefill_chunk(with_head, "metal", 8192) == 1024
    assert api.default_prefill_chunk(with_head, "metal", 8192, mtp=True) == 512
    monkeypatch.undo()
    assert api.default_prefill_chunk(checkpoint, "sim", 8192) == PREFILL_CHUNKS[0]


# The real model's work per token and layer, written out from its dims (model.md) rather than
# taken from token_macs: d = 2048, 16 query heads and 2 KV heads of 256 dims, 256 experts of
# 512 rows (8 chosen), a shared expert of 512 rows.
_D, _Q, _KV = 2048, 16 * 256, 2 * 256
_ATTENTION_LAYER_MACS = _D * (2 * _Q + 2 * _KV) + _Q * _D  # q with its gate, k, v, o
_MOE_MACS = _D * (256 + 1) + 3 * _D * 512 + 8 * 3 * _D * 512  # router, shared, chosen experts


def chunk_by_hand(budget: float, start: int) -> int:
    """The longest chunk starting at `start` whose attention layer (the costliest) fits
    `budget`: 2 x (T (attention + MoE) + 2 q (T start + T (T + 1) / 2)) <= budget solved for
    T, in whole 16-token GDN sub-chunks, at most 4,096."""
    a = 2.0 * _Q  # of T^2
    b = 2.0 * (_ATTENTION_LAYER_MACS + _MOE_MACS) + 4.0 * _Q * start + 2.0 * _Q  # of T
    tokens = int((-b + (b * b + 4 * a * budget) ** 0.5) / (2 * a))
    return min(4096, tokens - tokens % 16)


@pytest.mark.parametrize(
    ("name", "cores", "clock"),
    [("Apple M1", 8, 2.6e12 / (8 * 256)), ("Apple M5 Max", 40, 18.4e12 / (40 * 256))],
)
def test_each_mac_gets_a_second_of_its_own_gpu_per_command_buffer(checkpoint, name, cores, clock):
    """The budget is a second at 40% of the GPU's fp32 peak (cores x 128 lanes x 2 x clock),
    and the engine's chunks at 4k, 32k and 128k of context are the longest it fits: short on
    an 8-core M1 late in a long prompt, 4,096 tokens on an M5 Max until well past 32k."""
    c = real_dims(checkpoint.config)
    budget = 1.0 * 0.4 * cores * 128 * 2 * clock
    assert command_buffer_flops(name, cores) == pytest.approx(budget)
    chunks = [longest_chunk(c, start, 4096, budget) for start in (4096, 32768, 131072)]
    assert chunks == [chunk_by_hand(budget, start) for start in (4096, 32768, 131072)]
    if cores == 8:
        assert chunks[0] == 4096 and chunks[2] < 500
    else:
        assert chunks[:2] == [4096, 4096] and 3000 < chunks[2] < 4096
    # No layer of those chunks is over budget, and one more sub-chunk would put one over.
    for start, tokens in zip((4096, 32768, 131072), chunks, strict=True):
        assert max(layer_flops(c, start, tokens)) <= budget
        if tokens < 4096:
            assert max(layer_flops(c, start, tokens + 16)) > budget


def test_a_mac_the_budget_cannot_place_gets_the_slowest_gpus_budget():
    seven_core_m1 = 1.0 * 0.4 * 7 * 256 * 2.6e12 / (8 * 256)
    assert command_buffer_flops("", 0) == pytest.approx(seven_core_m1)
    assert pytest.approx(seven_core_m1) == model_graph.COMMAND_BUFFER_FLOPS
    # A generation without a published clock takes the one before it (an M3 an M2's).
    m2_clock = 3.6e12 / (10 * 256)
    assert command_buffer_flops("Apple M3 Pro", 18) == pytest.approx(0.4 * 18 * 256 * m2_clock)
    assert command_buffer_flops("Apple M9 Ultra", 80) == pytest.approx(
        0.4 * 80 * 256 * 18.4e12 / (40 * 256)
    )


def test_the_sims_budget_is_unchanged():
    # A thousand times smaller: a command buffer of the demo well under a second on the sim.
    assert SIM_COMMAND_BUFFER_FLOPS == 5.0e8


def test_the_metal_device_gets_the_budget_of_the_gpu_it_reports(monkeypatch):
    monkeypatch.setattr(
        "lily.device.metal_info", lambda: {"name": "Apple M5 Max", "gpu_core_count": 40}
    )
    assert api._metal_budget() == pytest.approx(1.0 * 0.4 * 18.4e12)
    # A native module built before the core count was reported: as few cores as any supported
    # GPU has (7) at the generation's clock.
    monkeypatch.setattr("lily.device.metal_info", lambda: {"name": "Apple M5 Max"})
    assert api._metal_budget() == pytest.approx(0.4 * 7 * 256 * 18.4e12 / (40 * 256))
    # No metal device info at all: the slowest supported GPU's budget.
    monkeypatch.setattr("lily.device.metal_info", lambda: None)
    assert api._metal_budget() == pytest.approx(COMMAND_BUFFER_FLOPS)
