"""Reasoning separation: `<think>...</think>` becomes reasoning, the rest content, however the
text is split into pieces."""

from __future__ import annotations

import random

from lily.chat.reasoning import ReasoningDelta, ReasoningParser


def parse_whole(text: str, thinking: bool = True) -> tuple[str, str]:
    """Non-streaming definition, the inverse of the template's
    `<think>\\n` + reasoning + `\\n</think>\\n\\n` + content."""
    if not thinking:
        return "", text.lstrip("\n")
    text = text.lstrip("\n")
    if text.startswith("<think>"):
        text = text[len("<think>") :]
    reasoning, end, content = text.partition("</think>")
    return reasoning.strip("\n"), content.lstrip("\n") if end else ""


def stream(pieces: list[str], thinking: bool = True) -> tuple[str, str, list[ReasoningDelta]]:
    parser = ReasoningParser(thinking=thinking)
    deltas = [parser.feed(p) for p in pieces] + [parser.flush()]
    return "".join(d.reasoning for d in deltas), "".join(d.content for d in deltas), deltas


def test_generation_starts_inside_the_think_block():
    # The prompt ended with "<think>\n"; the model writes the rest.
    pieces = ["Let", " me think", ".\n", "</", "think", ">\n\n", "The answer", " is 4."]
    reasoning, content, deltas = stream(pieces)
    assert reasoning == "Let me think." and content == "The answer is 4."
    # Nothing of the closing marker or its newlines leaks into either stream.
    assert [d.reasoning for d in deltas[:3]] == ["Let", " me think", "."]
    assert all(d.content == "" for d in deltas[:6])


def test_a_think_tag_written_by_the_model_is_accepted():
    assert stream(["\n<th", "ink>\nhmm\n</think>\n\nok"])[:2] == ("hmm", "ok")


def test_thinking_off_is_all_content():
    assert stream(["Hello", " <think>x</think>"], thinking=False)[:2] == (
        "",
        "Hello <think>x</think>",
    )


def test_unfinished_reasoning_stays_reasoning():
    assert stream(["still thinking\n", "</thi"])[:2] == ("still thinking\n</thi", "")


def test_random_splits_match_the_whole_text_definition():
    rng = random.Random(0)
    fragments = ["a", "b c", "\n", "\n\n", "<think>", "</think>", "<", "</th", "ink>", ">"]
    for _ in range(1000):
        text = "".join(rng.choice(fragments) for _ in range(rng.randint(1, 12)))
        cuts = sorted(rng.sample(range(1, len(text) + 1), k=min(len(text), rng.randint(0, 6))))
        pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)]
        thinking = rng.random() < 0.8
        assert stream(pieces, thinking)[:2] == parse_whole(text, thinking), (pieces, thinking)
