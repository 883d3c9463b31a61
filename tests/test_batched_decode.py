"""Batched decode (`lily.engine.batch`): several sequences in one pass over the weights, each
stream's tokens the same as the single-sequence engine's for the same request, across joins
and leaves. On the sim unless LILY_DEVICE names another device."""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest
from device_testing import open_test_device
from kernel_testing import LANE_ORDERS, sim_device
from tiny_models import tiny_checkpoint

from lily.checkpoint.config import FULL_ATTENTION
from lily.checkpoint.loader import load_checkpoint
from lily.device import open_device
from lily.engine.batch import BatchedDecoder
from lily.engine.constraint import mask_from_tokens
from lily.engine.engine import GREEDY, DeviceEngine
from lily.engine.model_graph import ModelGraph
from lily.engine.sampling import GeneratedToken, SamplingParams

MAX_SEQ = 48
MAX_CHUNK = 16
NEW_TOKENS = 8


def _engine(name: str, device) -> DeviceEngine:
    checkpoint = load_checkpoint(tiny_checkpoint(name))
    return DeviceEngine(
        checkpoint, device, MAX_SEQ, checkpoint.config.vocab_size, max_chunk=MAX_CHUNK
    )


@pytest.fixture(scope="module", params=["small", "wide"])
def engine(request):
    engine = _engine(request.param, open_test_device())
    yield engine
    engine.close()


def _prompts(engine: DeviceEngine, lengths: list[int], seed: int) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, engine.config.vocab_size, n).tolist() for n in lengths]


def _alone(engine, prompt, tokens, stops=(), sampling=None, constraint=None) -> list[int]:
    kwargs = {} if sampling is None else {"sampling": sampling}
    generated = engine.generate(prompt, tokens, stops, constraint=constraint, **kwargs)
    return [t.id for t in generated]


class FiveTokens:
    """Allows five random tokens at each draw (a new five each time), and records the draws."""

    def __init__(self, vocab: int, seed: int) -> None:
        self.vocab, self.rng = vocab, np.random.default_rng(seed)
        self.consumed: list[int] = []

    def allowed_tokens(self) -> np.ndarray:
        return mask_from_tokens(sorted(self.rng.choice(self.vocab, 5, replace=False)), self.vocab)

    def consume(self, token: int) -> None:
        self.consumed.append(token)


def _drain(batch: BatchedDecoder, streams: list[int]) -> None:
    while not all(batch.finished(s) for s in streams):
        batch.step()


def _assert_batched_as_alone(engine: DeviceEngine, prompts: list[list[int]], tokens: int) -> None:
    """Greedy streams of `prompts` decoded together give each the tokens it gives alone."""
    expected = [_alone(engine, p, tokens) for p in prompts]
    batch = BatchedDecoder(engine, slots=len(prompts))
    ids = [batch.join(p, tokens) for p in prompts]
    _drain(batch, ids)
    assert [batch.tokens(s) for s in ids] == expected


@pytest.mark.parametrize("streams", [1, 2, 3, 4])
def test_each_stream_decodes_as_it_would_alone(engine, streams):
    _assert_batched_as_alone(
        engine, _prompts(engine, [5, 11, 3, 14][:streams], streams), NEW_TOKENS
    )


def test_streams_join_and_leave_between_passes(engine):
    """One stream ends early (budget), one at a stop token, one joins after two passes into
    the slot the first one freed; the others are unaffected."""
    short, stopped, long, late = _prompts(engine, [6, 9, 12, 4], seed=7)
    stop_at = _alone(engine, stopped, NEW_TOKENS)
    stop_token = stop_at[3]
    expected = {
        "short": _alone(engine, short, 2),
        "stopped": _alone(engine, stopped, NEW_TOKENS, [stop_token]),
        "long": _alone(engine, long, NEW_TOKENS),
        "late": _alone(engine, late, 5),
    }
    assert expected["stopped"][-1] == stop_token and len(expected["stopped"]) < NEW_TOKENS
    batch = BatchedDecoder(engine, slots=3)
    ids = {
        "short": batch.join(short, 2),
        "stopped": batch.join(stopped, NEW_TOKENS, [stop_token]),
        "long": batch.join(long, NEW_TOKENS),
    }
    assert batch.free_slots == 0
    batch.step()
    assert batch.finished(ids["short"]) and batch.free_slots == 1
    one = batch.join(late, 1)  # done at its first token: it keeps no slot
    assert batch.finished(one) and batch.tokens(one) == expected["late"][:1]
    assert batch.free_slots == 1
    batch.step()
    ids["late"] = batch.join(late, 5)
    _drain(batch, list(ids.values()))
    assert {name: batch.tokens(s) for name, s in ids.items()} == expected


def test_seeded_sampling_matches_the_request_alone(engine):
    prompts = _prompts(engine, [7, 10], seed=11)
    params = [SamplingParams(temperature=1.0, seed=seed) for seed in (3, 4)]
    expected = [
        _alone(engine, p, NEW_TOKENS, sampling=s) for p, s in zip(prompts, params, strict=True)
    ]
    batch = BatchedDecoder(engine, slots=2)
    ids = [batch.join(p, NEW_TOKENS, sampling=s) for p, s in zip(prompts, params, strict=True)]
    _drain(batch, ids)
    assert [batch.tokens(s) for s in ids] == expected
    assert expected[0] != _alone(engine, prompts[0], NEW_TOKENS)  # the draws were not greedy


def assert_same_logprobs(batched: list[GeneratedToken], alone: list[GeneratedToken]) -> None:
    """The same tokens with their logprobs and alternatives, within float tolerance."""
    assert [t.id for t in batched] == [t.id for t in alone]
    for ours, theirs in zip(batched, alone, strict=True):
        assert ours.logprobs is not None and theirs.logprobs is not None
        assert [token for token, _ in ours.logprobs.top] == [t for t, _ in theirs.logprobs.top]
        np.testing.assert_allclose(
            [ours.logprobs.logprob, *(p for _, p in ours.logprobs.top)],
            [theirs.logprobs.logprob, *(p for _, p in theirs.logprobs.top)],
            rtol=1e-5,
            atol=1e-5,
        )


def test_a_logprobs_stream_reports_them_as_alone(engine):
    """A stream asking for log-probabilities, beside streams that do not (one of them sampled),
    gets each token's logprob and top alternatives as the single decode reports them; the
    others get none."""
    prompts = _prompts(engine, [6, 13, 9], seed=21)
    settings = [
        SamplingParams(top_logprobs=3, temperature=0.0),
        GREEDY,
        SamplingParams(temperature=1.0, seed=5),
    ]
    expected = [
        list(engine.generate(p, NEW_TOKENS, sampling=s))
        for p, s in zip(prompts, settings, strict=True)
    ]
    batch = BatchedDecoder(engine, slots=3)
    ids = [batch.join(p, NEW_TOKENS, sampling=s) for p, s in zip(prompts, settings, strict=True)]
    _drain(batch, ids)
    logged, greedy, sampled = (batch.generated(s) for s in ids)
    assert_same_logprobs(logged, expected[0])
    assert len({p for t in logged for _, p in t.logprobs.top}) > 3  # they change with the token
    assert greedy == expected[1] and sampled == expected[2]
    assert all(t.logprobs is None for t in (*greedy, *sampled))


def test_each_stream_keeps_its_own_constraint(engine):
    """Two constrained streams and a free one: the masks change the greedy choice at most
    steps, so equal tokens mean each row drew under its own stream's mask."""
    prompts = _prompts(engine, [8, 5, 12], seed=12)
    vocab = engine.config.vocab_size

    def constraints():
        return [FiveTokens(vocab, seed=1), None, FiveTokens(vocab, seed=2)]

    expected = [
        _alone(engine, p, NEW_TOKENS, constraint=c)
        for p, c in zip(prompts, constraints(), strict=True)
    ]
    batch = BatchedDecoder(engine, slots=3)
    used = constraints()
    ids = [batch.join(p, NEW_TOKENS, constraint=c) for p, c in zip(prompts, used, strict=True)]
    _drain(batch, ids)
    assert [batch.tokens(s) for s in ids] == expected
    assert used[0].consumed == expected[0] and used[2].consumed == expected[2]
    free = _alone(engine, prompts[0], NEW_TOKENS)
    assert sum(a != b for a, b in zip(free, expected[0], strict=True)) > NEW_TOKENS // 2


def test_eight_streams(engine):
    _assert_batched_as_alone(engine, _prompts(engine, [2 + 3 * i for i in range(8)], seed=8), 3)


def test_a_join_beyond_the_slots_is_refused(engine):
    batch = BatchedDecoder(engine, slots=1)
    batch.join([1, 2, 3], NEW_TOKENS)
    with pytest.raises(RuntimeError, match="slots are decoding"):
        batch.join([4, 5, 6], NEW_TOKENS)


@pytest.mark.parametrize("lane_order", LANE_ORDERS)
def test_rows_at_ragged_prompts_under_each_lane_order(lane_order):
    """The per-row dispatches under every lane order, and (random: the checking sim) within
    the bounds of each row's slice of the activations."""
    engine = _engine("small", sim_device(lane_order))
    try:
        _assert_batched_as_alone(engine, _prompts(engine, [1, 6, 17], seed=5), 4)
    finally:
        engine.close()


def test_an_int8_kv_cache_decodes_as_alone():
    """The per-row attention's int8 entry point, on each row's slot of the int8 caches."""
    checkpoint = load_checkpoint(tiny_checkpoint("small"))
    engine = DeviceEngine(
        checkpoint,
        open_test_device(),
        MAX_SEQ,
        checkpoint.config.vocab_size,
        max_chunk=MAX_CHUNK,
        kv_cache="int8",
    )
    try:
        _assert_batched_as_alone(engine, _prompts(engine, [9, 3, 14], seed=11), 6)
    finally:
        engine.close()


def test_each_per_row_stage_is_one_dispatch_over_all_rows():
    """The embedding lookup, the conv and GDN steps, attention and the draw run once per layer
    (the lookup and the draw once) for every row through the slot table, so a pass has as many
    levels at 4 rows as at 2; the norms and residual adds are folded into the GEMVs as in a
    verify pass (no norm dispatch of their own)."""
    checkpoint = load_checkpoint(tiny_checkpoint("small"))
    c = checkpoint.config
    model = ModelGraph(checkpoint, open_device("sim", execute=False), MAX_SEQ, c.vocab_size, 8)
    model.allocate_slots(4)
    two, four = model.batch_graph([0, 1]), model.batch_graph([3, 1, 0, 2])
    assert two.barrier_count == four.barrier_count
    kernels = Counter(d.kernel for d in four.dispatches)
    attention_layers = c.layer_types.count(FULL_ATTENTION)
    gdn_layers = len(c.layer_types) - attention_layers
    assert kernels["conv1d_step_rows"] == kernels["gdn_step_rows"] == gdn_layers
    assert kernels["attention_decode_fused_rows"] == attention_layers
    assert kernels["attention_combine_rows"] == attention_layers
    assert kernels["sample_slices_rows"] == kernels["sample_token_rows"] == 1
    assert kernels["embedding_rows_4"] == 1
    single = ("conv1d_step", "gdn_step", "attention_decode_fused", "attention_combine")
    assert not any(kernels[name] for name in (*single, "sample_slices", "sample_token"))
    unfolded = ("embedding_4", "rms_norm_float", "add_rms_norm", "gdn_gated_norm")
    assert not any(kernels[name] for name in unfolded)
    assert kernels["gdn_out_proj_tokens_4"] == gdn_layers


def _slot_regions(slot) -> list:
    return [
        slot.step,
        *slot.conv_windows.values(),
        *slot.recurrent.values(),
        *slot.k_cache.values(),
        *slot.v_cache.values(),
    ]


def test_more_slots_keep_the_state_of_those_allocated() -> None:
    """Allocating more slots moves the slots' steps, windows, GDN states and caches into larger
    buffers (one per kind, which the per-row kernels index by slot): what the first slots held
    is still theirs, and each slot's region of a kind lies at its index times one slot's size."""
    checkpoint = load_checkpoint(tiny_checkpoint("small"))
    c = checkpoint.config
    graph = ModelGraph(checkpoint, open_device("sim", execute=False), MAX_SEQ, c.vocab_size, 8)
    graph.allocate_slots(2)
    assert len(graph.slots) == 2
    rng = np.random.default_rng(3)
    before = []
    for slot in graph.slots:
        for region in _slot_regions(slot):
            region.numpy()[:] = rng.integers(0, 256, region.size, dtype=np.uint8)
        before.append([region.numpy().copy() for region in _slot_regions(slot)])
    graph.allocate_slots(4)
    assert len(graph.slots) == 4
    for index, slot in enumerate(graph.slots):
        for region, first in zip(_slot_regions(slot), _slot_regions(graph.slots[0]), strict=True):
            assert region[0] is first[0] and region[1] == index * region.size
    for slot, held in zip(graph.slots[:2], before, strict=True):
        for region, expected in zip(_slot_regions(slot), held, strict=True):
            np.testing.assert_array_equal(region.numpy(), expected)


def test_a_decode_only_engine_has_no_batched_pass():
    checkpoint = load_checkpoint(tiny_checkpoint("small"))
    engine = DeviceEngine(checkpoint, open_test_device(), MAX_SEQ, checkpoint.config.vocab_size, 1)
    try:
        with pytest.raises(ValueError, match="max_chunk >= 2"):
            BatchedDecoder(engine, slots=1)
    finally:
        engine.close()
