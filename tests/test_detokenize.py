"""Incremental detokenization with the demo tokenizer, whose 4,000-rank vocabulary splits most
non-ASCII characters into several byte tokens."""

from __future__ import annotations

import random
from importlib import resources

import pytest

from lily.chat.detokenize import IncrementalDecoder
from lily.chat.tokenizer import Tokenizer

TEXTS = [
    "plain ascii text",
    "naïve café — “quoted”",
    "中文字符和日本語のテキスト",
    "emoji 😀👍🏽 family 👩‍👩‍👧 flag 🇯🇵",
    "मात्राओं के साथ हिन्दी",
    "<think>\nreasoning\n</think>\n\n<tool_call>x</tool_call>",
]


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return Tokenizer.from_dir(str(resources.files("lily").joinpath("data/demo")))


def stream(tokenizer: Tokenizer, ids: list[int]) -> list[str]:
    decoder = IncrementalDecoder(tokenizer)
    pieces = [decoder.add(i) for i in ids]
    pieces.append(decoder.flush())
    return pieces


@pytest.mark.parametrize("text", TEXTS)
def test_pieces_are_whole_characters_and_add_up_to_the_text(tokenizer, text):
    ids = tokenizer.encode(text)
    pieces = stream(tokenizer, ids)
    assert "".join(pieces) == text
    assert all("\ufffd" not in piece for piece in pieces)


def test_a_character_split_over_tokens_appears_with_its_last_byte(tokenizer):
    ids = tokenizer.encode("😀")
    assert len(ids) > 1  # the demo vocabulary has no token for it
    pieces = stream(tokenizer, ids)
    assert pieces[:-2] == [""] * (len(ids) - 1)
    assert pieces[-2] == "😀" and pieces[-1] == ""


def test_random_text_streams_like_a_whole_decode(tokenizer):
    rng = random.Random(0)
    pool = "ab \n1.éß中文😀👍🏽\u0301\u200dह"
    for _ in range(200):
        text = "".join(rng.choice(pool) for _ in range(rng.randint(1, 30)))
        ids = tokenizer.encode(text)
        assert "".join(stream(tokenizer, ids)) == tokenizer.decode(ids)


def test_invalid_bytes_become_replacement_characters_like_a_whole_decode(tokenizer):
    # A continuation byte with no lead, then a lead byte the stream never completes.
    cont = [i for i in range(256) if tokenizer.token_bytes(i) == b"\x80"][0]
    lead = [i for i in range(256) if tokenizer.token_bytes(i) == b"\xe4"][0]
    ids = [tokenizer.encode("a")[0], cont, tokenizer.encode("b")[0], lead]
    pieces = stream(tokenizer, ids)
    assert pieces == ["a", "\ufffd", "b", "", "\ufffd"]
    assert "".join(pieces) == tokenizer.decode(ids)


def test_control_tokens_are_skipped_text_markers_kept(tokenizer):
    ids = tokenizer.encode("<|im_start|>hi<|im_end|><think>")
    assert "".join(stream(tokenizer, ids)) == "hi<think>"
    decoder = IncrementalDecoder(tokenizer, skip_special_tokens=False)
    assert "".join(decoder.add(i) for i in ids) == "<|im_start|>hi<|im_end|><think>"
