"""The constraint hook (`lily.engine.constraint`) through both engines on the demo model: every
drawn
token is one the constraint allowed, the device and the reference agree under greedy decoding,
an empty mask is an error, and only a constrained generation gives up the two-pass pipeline."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pytest

import lily
from lily.api import Lily
from lily.engine.constraint import (
    NoAllowedTokenError,
    allowed_flags,
    checked_mask,
    mask_from_tokens,
)
from lily.engine.engine import PIPELINE_DEPTH
from lily.engine.sampling import SamplingParams

MAX_SEQ = 64
STEPS = 12


@pytest.fixture(scope="module")
def sim() -> Iterator[Lily]:
    with lily.load("demo", device="sim", max_seq=MAX_SEQ) as llm:
        yield llm


@pytest.fixture(scope="module")
def reference() -> Iterator[Lily]:
    with lily.load("demo", device="reference", max_seq=MAX_SEQ) as llm:
        yield llm


def prompt_ids(llm: Lily) -> list[int]:
    return llm.tokenizer.encode("The quick brown fox jumps over")


class ScriptedConstraint:
    """Allows a different small set of tokens at each step (None at the steps in `free`) and
    records what it was told."""

    def __init__(self, vocab: int, free: frozenset[int] = frozenset(), seed: int = 0) -> None:
        self.vocab = vocab
        self.free = free
        self.rng = np.random.default_rng(seed)
        self.offered: list[set[int] | None] = []
        self.consumed: list[int] = []

    def allowed_tokens(self) -> np.ndarray | None:
        if len(self.offered) in self.free:
            self.offered.append(None)
            return None
        tokens = set(self.rng.choice(self.vocab, 5, replace=False).tolist())
        self.offered.append(tokens)
        return mask_from_tokens(sorted(tokens), self.vocab)

    def consume(self, token: int) -> None:
        assert len(self.consumed) == len(self.offered) - 1, "consume without a draw before it"
        self.consumed.append(token)


def constrained(llm: Lily, constraint: ScriptedConstraint, sampling: SamplingParams) -> list[int]:
    tokens = llm.engine.generate(prompt_ids(llm), STEPS, sampling=sampling, constraint=constraint)
    return [t.id for t in tokens]


@pytest.mark.parametrize("engine", ["sim", "reference"])
@pytest.mark.parametrize(
    "sampling",
    [SamplingParams(temperature=0.0), SamplingParams(temperature=1.5, top_p=0.9, seed=7)],
    ids=["greedy", "sampled"],
)
def test_every_generated_token_is_one_the_constraint_allowed(engine, sampling, request):
    llm = request.getfixturevalue(engine)
    constraint = ScriptedConstraint(llm.tokenizer.vocab_size, free=frozenset({3}))
    tokens = constrained(llm, constraint, sampling)
    assert len(tokens) == STEPS
    assert constraint.consumed == tokens
    assert len(constraint.offered) == STEPS
    for token, offered in zip(tokens, constraint.offered, strict=True):
        assert offered is None or token in offered


def test_the_device_and_the_reference_agree_under_a_constraint(sim, reference):
    """Greedy, the masks change the choice at almost every step (the unconstrained argmax is
    rarely among five random tokens), so agreement means both apply the same mask."""
    vocab = sim.tokenizer.vocab_size
    on_sim = constrained(sim, ScriptedConstraint(vocab, seed=3), SamplingParams(temperature=0))
    on_reference = constrained(
        reference, ScriptedConstraint(vocab, seed=3), SamplingParams(temperature=0)
    )
    assert on_sim == on_reference
    free = [t.id for t in sim.engine.generate(prompt_ids(sim), STEPS)]
    assert sum(a != b for a, b in zip(on_sim, free, strict=True)) > STEPS // 2


class FixedConstraint:
    def __init__(self, mask: np.ndarray) -> None:
        self.mask = mask

    def allowed_tokens(self) -> np.ndarray | None:
        return self.mask

    def consume(self, token: int) -> None:
        pass


@pytest.mark.parametrize("engine", ["sim", "reference"])
def test_a_mask_allowing_no_token_is_an_error(engine, request):
    llm = request.getfixturevalue(engine)
    vocab = llm.tokenizer.vocab_size
    padding = llm.engine.config.vocab_size - 1  # an lm_head row past the tokenizer's ids
    assert padding >= vocab
    for mask in (
        np.zeros(-(-vocab // 32), np.uint32),
        mask_from_tokens([padding], llm.engine.config.vocab_size),
    ):
        with pytest.raises(NoAllowedTokenError):
            list(llm.engine.generate(prompt_ids(llm), 4, constraint=FixedConstraint(mask)))
    # The engine is still usable afterwards.
    assert len(list(llm.engine.generate(prompt_ids(llm), 2))) == 2


def test_checked_mask_clears_bits_past_the_vocabulary():
    mask = np.full(3, 0xFFFFFFFF, np.uint32)
    checked = checked_mask(mask, 70, position=0)
    assert checked.tolist() == [0xFFFFFFFF, 0xFFFFFFFF, 0b111111]
    assert allowed_flags(checked, 70).all()
    with pytest.raises(ValueError, match="at least 3"):
        checked_mask(mask[:2], 70, position=0)


class CountingDevice:
    """Wraps a device to record the most passes that were ever submitted and not yet waited
    for."""

    def __init__(self, device) -> None:
        self.device = device
        self.pending: set[int] = set()
        self.most_pending = 0

    def submit(self, graph) -> int:
        ticket = self.device.submit(graph)
        self.pending.add(ticket)
        self.most_pending = max(self.most_pending, len(self.pending))
        return ticket

    def wait(self, ticket: int) -> None:
        self.device.wait(ticket)
        self.pending.discard(ticket)

    def __getattr__(self, name: str):
        return getattr(self.device, name)


def test_only_a_constrained_generation_gives_up_the_pipeline(sim, monkeypatch):
    counting = CountingDevice(sim.engine.device)
    monkeypatch.setattr(sim.engine, "device", counting)
    list(sim.engine.generate(prompt_ids(sim), STEPS))
    assert counting.most_pending == PIPELINE_DEPTH
    counting.most_pending = 0
    constraint = ScriptedConstraint(sim.tokenizer.vocab_size)
    list(sim.engine.generate(prompt_ids(sim), STEPS, constraint=constraint))
    assert counting.most_pending == 1
    # A constraint that never limits a draw still waits: its next mask may depend on the token.
    counting.most_pending = 0
    free = ScriptedConstraint(sim.tokenizer.vocab_size, free=frozenset(range(STEPS)))
    list(sim.engine.generate(prompt_ids(sim), STEPS, constraint=free))
    assert counting.most_pending == 1
