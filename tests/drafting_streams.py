"""What the tests of drafting streams on a batching engine share (test_scheduler_drafting.py,
test_scheduler_redraft.py; their fixtures are conftest.py's `drafting_engine`,
`drafting_scheduler` and `moves`): the tiny model with an MTP head, prompts, drafters, a
constraint whose masks depend on every token, and a demo chat request joined mid-stream."""

from __future__ import annotations

import itertools
import threading
from collections.abc import Iterator
from typing import Any

import numpy as np
from test_server import joined
from test_server_batching import REQUESTS, _answer

import lily
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


# The demo's greedy answer to it (its thinking) holds "least" about 12 tokens in.
LATE_STOP = {**REQUESTS["greedy"], "max_tokens": 20, "stop": ["least"]}


def chat_joined_mid_stream(
    lone: dict[str, Any], other: dict[str, Any], other_ends_first: bool
) -> tuple[dict[str, Any], dict[str, Any], tuple[str, str, str | None], list[Any]]:
    """Chat request `lone` streamed on the demo loaded with `parallel=2` and the MTP head, and
    `other` sent from another thread once 3 of its chunks arrived (waited for before the rest of
    the stream is read when `other_ends_first`, after it otherwise). Returns each request's
    answer on a model without drafting or batching, the stream's (content, reasoning,
    finish_reason) and the other's answers."""
    requests = [{"model": "demo", **r} for r in (lone, other)]
    with lily.load("demo", device="sim", max_seq=256, speculative="off") as plain:
        lone_alone, other_alone = (_answer(plain.chat.completions.create(**r)) for r in requests)
    with lily.load("demo", device="sim", max_seq=256, parallel=2, speculative="mtp") as llm:
        chunks = llm.chat.completions.create(stream=True, **requests[0])
        streamed = list(itertools.islice(chunks, 3))
        answers: list[Any] = []
        second = threading.Thread(
            target=lambda: answers.append(_answer(llm.chat.completions.create(**requests[1])))
        )
        second.start()
        if other_ends_first:
            second.join(120)
        streamed += list(chunks)
        second.join(120)
    return lone_alone, other_alone, joined(streamed), answers
