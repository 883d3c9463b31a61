"""Requests with images on a batching engine (`lily.engine.scheduler`): each batch slot has its
own rotary-position table, so an image request joins the batch like a text one (prefilled in
slices while the others decode) and text requests join while it decodes; a slot an image's
sequence held rotates the next one by identity again, and a stream that moves back onto the
engine's state takes its table with it. Every answer is the one it gets alone. The demo model on
the sim; fixtures from conftest.py."""

from __future__ import annotations

import itertools
from typing import Any

import numpy as np
import pytest
from test_image_requests import data_url, png, user_with_images
from test_server import joined, user

import lily
from lily.engine import scheduler

MAX_SEQ = 256
IMAGE = dict(messages=user_with_images(data_url(png(64, 48, seed=1))), max_tokens=14)
TEXT = dict(messages=user("Hello there"), max_tokens=14)
OTHER_TEXT = dict(messages=user("Count"), max_tokens=10)


def _request(kind: dict[str, Any]) -> dict[str, Any]:
    return {"model": "demo", "temperature": 0, **kind}


def _alone(*kinds: dict[str, Any], **load: Any) -> list[tuple[str, str, str | None]]:
    """Each request's (content, reasoning, finish_reason) on a model without batching."""
    with lily.load("demo", device="sim", max_seq=MAX_SEQ, **load) as plain:
        return [_text(plain.chat.completions.create(**_request(kind))) for kind in kinds]


def _text(completion: Any) -> tuple[str, str, str | None]:
    choice = completion.choices[0]
    reasoning = getattr(choice.message, "reasoning_content", None) or ""
    return choice.message.content or "", reasoning, choice.finish_reason


def _identity() -> np.ndarray:
    return np.repeat(np.arange(MAX_SEQ, dtype=np.uint32)[:, None], 3, axis=1)


@pytest.fixture
def small_slices(monkeypatch: pytest.MonkeyPatch) -> None:
    """Prompts prefilled 16 tokens at a time: the image's tokens span several slices, with a
    batched pass of the others between two."""
    monkeypatch.setattr(scheduler, "SLICE_TOKENS", 16)


def test_image_and_text_requests_decode_together_as_alone(small_slices, deliveries):
    """parallel=3: a text request streams, an image request joins while it decodes, and a
    second text request joins while both do; the three answers are those they get alone, and
    the text streams got tokens while the image stream was decoding (it did not run alone)."""
    expected = _alone(TEXT, IMAGE, OTHER_TEXT, speculative="off")
    with lily.load("demo", device="sim", max_seq=MAX_SEQ, parallel=3, speculative="off") as llm:
        streams = [
            llm.chat.completions.create(stream=True, **_request(kind))
            for kind in (TEXT, IMAGE, OTHER_TEXT)
        ]
        chunks: list[list[Any]] = []
        for stream in streams:  # each starts while the ones before it decode
            chunks.append(list(itertools.islice(stream, 3)))
        for stream, got in zip(streams, chunks, strict=True):
            got += list(stream)
    assert [joined(got) for got in chunks] == expected
    image_prompt = max(length for length, _ in deliveries)  # its image tokens make it longest
    order = [length == image_prompt for length, _ in deliveries]
    first, last = order.index(True), len(order) - 1 - order[::-1].index(True)
    assert not all(order[first:last]), "the text streams waited while the image stream ran"


def test_a_text_request_after_an_image_request_rotates_by_identity_again():
    """parallel=2 without drafting: the image request decodes in slot 0 with its positions,
    and the text request after it takes slot 0 with identity positions."""
    expected = _alone(IMAGE, TEXT, speculative="off")
    with lily.load("demo", device="sim", max_seq=MAX_SEQ, parallel=2, speculative="off") as llm:
        model = llm.engine.engine.model_graph
        got = [_text(llm.chat.completions.create(**_request(IMAGE)))]
        assert not np.array_equal(model.slot_rope_table_view(0), _identity())
        got.append(_text(llm.chat.completions.create(**_request(TEXT))))
        np.testing.assert_array_equal(model.slot_rope_table_view(0), _identity())
    assert got == expected


def test_an_image_request_moves_into_a_slot_and_back_with_its_positions(
    moves, returns, redraft_soon
):
    """parallel=2 with the MTP head: the image request drafts alone, moves into a slot when a
    text request arrives (its table copied in), drafts alone again once that one ended (its
    table copied back onto the engine's), and a text request after it rotates by identity:
    every answer is the one it gets alone."""
    long_image = {**IMAGE, "max_tokens": 30}
    expected = _alone(long_image, OTHER_TEXT, TEXT, speculative="off")
    with lily.load("demo", device="sim", max_seq=MAX_SEQ, parallel=2, speculative="mtp") as llm:
        stream = llm.chat.completions.create(stream=True, **_request(long_image))
        got_image = list(itertools.islice(stream, 3))
        other = _text(llm.chat.completions.create(**_request(OTHER_TEXT)))
        got_image += list(stream)
        after = _text(llm.chat.completions.create(**_request(TEXT)))
    assert [joined(got_image), other, after] == expected
    assert len(moves) == 1 and len(returns) == 1
