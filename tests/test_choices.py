"""`n` choices on the demo model: each choice is the run its own seed gives, the prompt is fed
once (later choices restore the state before the last prompt token and feed that token alone),
streamed chunks carry their choice's index, and usage adds the choices up."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

import lily
from lily.api import Lily
from lily.chat.choices import choice_sampling
from lily.engine.sampling import SamplingParams

MAX_SEQ = 96
MESSAGES = [{"role": "user", "content": "Name three colours."}]
REQUEST = {
    "messages": MESSAGES,
    "max_tokens": 6,
    "temperature": 1.0,
    "seed": 11,
    "chat_template_kwargs": {"enable_thinking": False},
}


@pytest.fixture(scope="module", params=["sim", "reference"])
def llm(request) -> Iterator[Lily]:
    with lily.load("demo", device=request.param, max_seq=MAX_SEQ) as model:
        yield model


def fresh_starts(llm: Lily, monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Records, for every generation the engine runs, how many prompt tokens it did not feed
    (the snapshot it restored)."""
    starts: list[int] = []
    engine = llm.engine
    original = engine.cached_prefix_length

    def generate(prompt, *args, **kwargs):
        starts.append(original(prompt))
        return type(engine).generate(engine, prompt, *args, **kwargs)

    monkeypatch.setattr(engine, "generate", generate)
    return starts


def test_each_choice_is_the_run_of_its_own_seed(llm):
    several = llm.chat.completions.create(**REQUEST, n=3)
    assert [c.index for c in several.choices] == [0, 1, 2]
    texts = [c.message.content for c in several.choices]
    for index, text in enumerate(texts):
        seed = choice_sampling(SamplingParams(seed=11), index).seed
        alone = llm.chat.completions.create(**{**REQUEST, "seed": seed})
        assert alone.choices[0].message.content == text
    assert len(set(texts)) > 1  # different seeds, different samples (random weights)
    usage = several.usage
    assert usage.prompt_tokens == alone.usage.prompt_tokens
    assert usage.completion_tokens == 3 * REQUEST["max_tokens"]
    assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens


def test_the_stats_the_server_logs_add_up_the_choices(llm):
    answer = llm.chat.completions.create(**REQUEST, n=2)
    stats = llm.chat.completions.last_stats
    assert stats.generated_tokens == answer.usage.completion_tokens == 2 * REQUEST["max_tokens"]
    assert stats.prompt_tokens == answer.usage.prompt_tokens


def test_the_prompt_is_fed_once(llm, monkeypatch):
    starts = fresh_starts(llm, monkeypatch)
    unseen = [{"role": "user", "content": "A prompt no other test sends."}]
    answer = llm.chat.completions.create(**{**REQUEST, "messages": unseen}, n=4)
    # The first choice feeds the whole prompt (no snapshot holds any of it); each later one
    # restores the state before the prompt's last token.
    assert starts == [0] + [answer.usage.prompt_tokens - 1] * 3


def test_streamed_choices_carry_their_index_and_usage_adds_up(llm):
    whole = llm.chat.completions.create(**REQUEST, n=2)
    chunks = list(
        llm.chat.completions.create(
            **REQUEST, n=2, stream=True, stream_options={"include_usage": True}
        )
    )
    texts = {0: "", 1: ""}
    roles, finishes = [], []
    for chunk in chunks[:-1]:
        (choice,) = chunk.choices
        texts[choice.index] += choice.delta.content or ""
        if choice.delta.role:
            roles.append(choice.index)
        if choice.finish_reason:
            finishes.append(choice.index)
    assert roles == [0, 1] and finishes == [0, 1]
    assert [texts[0], texts[1]] == [c.message.content for c in whole.choices]
    assert chunks[-1].choices == []
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    assert chunks[-1].usage.prompt_tokens == whole.usage.prompt_tokens
