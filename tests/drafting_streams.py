"""What the tests of drafting streams on a batching engine share (test_scheduler_drafting.py,
test_scheduler_redraft.py; their fixtures are conftest.py's `drafting_engine`,
`drafting_scheduler` and `moves`): the tiny model with an MTP head, prompts, drafters and a
constraint whose masks depend on every token."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np

from lily.engine.constraint import mask_from_tokens
from lily.engine.engine import DeviceEngine
from lily.engine.speculative import Speculation

MAX_SEQ = 64
NEW_TOKENS = 14
# Tokens the lone stream's caller takes before the second caller arrives.
BEFORE = 4


class Alternating:
    """A constraint whose mask depends on every token told before: it allows the tokens whose
    parity differs from the sum of those so far, and takes drafts back."""

    def __init__(self, vocab: int) -> None:
        self.vocab = vocab
        self.consumed: list[int] = []

    def allowed_tokens(self) -> np.ndarray:
        ids = np.arange(self.vocab)
        return mask_from_tokens(ids[(ids + sum(self.consumed)) % 2 == 1], self.vocab)

    def consume(self, token: int) -> None:
        assert (token + sum(self.consumed)) % 2 == 1, "told a token its mask rules out"
        self.consumed.append(token)

    def rollback(self, tokens: int) -> None:
        del self.consumed[len(self.consumed) - tokens :]


class GaveUp:
    """A drafter that has given up before the first pass: the engine decodes pipelined, two
    passes in flight, which the move must let finish."""

    exhausted = True

    def draft(self, tokens: Any, limit: int) -> list[int]:
        return []

    def verified(self, drafted: Any, accepted: int) -> None:
        raise AssertionError("nothing was drafted")


def prompts(engine: DeviceEngine, answer: int = NEW_TOKENS) -> tuple[list[int], list[int]]:
    """The first repeats itself, so that prompt lookup finds drafts. The second is longer than
    the first's answer of `answer` tokens reaches: generating it alone (last) leaves none of
    that answer in the engine's token history, where a stream moved with the wrong state could
    find it."""
    rng = np.random.default_rng(11)
    words = rng.integers(0, engine.config.vocab_size, 8).tolist()
    first = words + words + words[:5]
    return first, rng.integers(0, engine.config.vocab_size, len(first) + answer).tolist()


def token_ids(tokens: Iterator[Any]) -> list[int]:
    return [t.id for t in tokens]


def new_drafter(source: str) -> Any:
    """The drafter named `source`: "gave up", or a `Speculation` source ("mtp", "ngram")."""
    if source == "gave up":
        return GaveUp()
    return Speculation(draft_tokens=3, **{source: True})
