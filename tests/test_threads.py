"""One `Lily` object shared by threads (a web app's worker pool, `asyncio.to_thread`): each
call gets its own answer, as if the calls had run one after another; a thread that starts a
second generation while its own first is still open gets a clear error instead of a deadlock."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import pytest

import lily
from lily.api import Lily
from lily.errors import EngineBusyError

PROMPTS = ["Once upon a time", "The capital of France is", "def fibonacci(n):", "1, 2, 3,"]


@pytest.fixture(scope="module")
def demo() -> Iterator[Lily]:
    with lily.load("demo", device="sim", max_seq=64) as llm:
        yield llm


def slow_stream(llm: Lily, prompt: str) -> str:
    """Reads a stream piece by piece, pausing between pieces so that other threads run."""
    pieces = []
    for piece in llm.stream(prompt, 8):
        pieces.append(piece)
        time.sleep(0.005)
    return "".join(pieces)


def test_threads_sharing_a_model_each_get_their_own_answer(demo: Lily) -> None:
    alone = {prompt: demo.generate(prompt, 8) for prompt in PROMPTS}
    assert len(set(alone.values())) == len(PROMPTS), "the prompts must give different answers"
    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        answers = pool.map(lambda p: slow_stream(demo, p), PROMPTS)
        together = dict(zip(PROMPTS, answers, strict=True))
    assert together == alone


def test_chat_completions_from_threads_match_one_at_a_time(demo: Lily) -> None:
    def ask(prompt: str) -> str:
        reply = demo.chat.completions.create(
            messages=[{"role": "user", "content": prompt}],
            max_tokens=6,
            temperature=0,
            chat_template_kwargs={"enable_thinking": False},
        )
        return reply.choices[0].message.content

    alone = [ask(p) for p in PROMPTS]
    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        assert list(pool.map(ask, PROMPTS)) == alone


def test_a_second_generation_in_the_same_thread_is_refused_while_the_first_is_open(
    demo: Lily,
) -> None:
    stream = demo.stream(PROMPTS[0], 8)
    first = next(stream)
    with pytest.raises(EngineBusyError, match="still open in the same thread"):
        demo.generate(PROMPTS[1], 4)
    # The open stream is unharmed, and once it is closed the model is free again.
    rest = "".join(stream)
    assert first + rest == demo.generate(PROMPTS[0], 8)


def test_a_waiting_thread_runs_once_the_holder_closes_its_stream(demo: Lily) -> None:
    stream = demo.stream(PROMPTS[0], 8)
    next(stream)
    result: list[str] = []
    waiter = threading.Thread(target=lambda: result.append(demo.generate(PROMPTS[1], 4)))
    waiter.start()
    waiter.join(timeout=0.5)
    assert waiter.is_alive(), "the other thread must wait while the stream holds the model"
    stream.close()
    waiter.join(timeout=120)
    assert result == [demo.generate(PROMPTS[1], 4)]
