"""Stop strings: cut before the first occurrence, even when split across pieces, holding back no
more than could still become a stop string."""

from __future__ import annotations

import random
from importlib import resources

from lily.chat.detokenize import IncrementalDecoder
from lily.chat.stop import StopStringMatcher, partial_marker_length
from lily.chat.tokenizer import Tokenizer


def reference_cut(text: str, stops: list[str]) -> str:
    """Non-streaming definition: everything before the earliest occurrence of any stop."""
    hits = [text.find(s) for s in stops if s and s in text]
    return text[: min(hits)] if hits else text


def could_still_stop(text: str, stops: list[str]) -> int:
    """Brute force: the longest suffix of text that some stop string starts with."""
    return max(
        (
            n
            for n in range(1, len(text) + 1)
            for s in stops
            if len(s) > n and s.startswith(text[-n:])
        ),
        default=0,
    )


def random_pieces(text: str, rng: random.Random) -> list[str]:
    cuts = sorted(rng.sample(range(1, len(text)), k=min(len(text) - 1, rng.randint(0, 8))))
    return [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)]


def test_stop_split_across_pieces_never_leaks():
    matcher = StopStringMatcher(["STOP"])
    out = [matcher.feed(p) for p in ["Hello S", "T", "O", "P and more"]]
    assert out == ["Hello ", "", "", ""]
    assert matcher.stopped and matcher.matched == "STOP"
    assert matcher.feed("later") == "" and matcher.flush() == ""


def test_hold_back_is_minimal():
    matcher = StopStringMatcher(["abcd", "xy"])
    assert matcher.feed("zzab") == "zz"  # "ab" may become "abcd"
    assert matcher.feed("x") == "ab"  # "abx" cannot; "x" may become "xy"
    assert matcher.feed("z") == "xz"
    assert matcher.flush() == ""
    assert not matcher.stopped


def test_the_earliest_stop_wins_and_flush_releases_the_tail():
    matcher = StopStringMatcher(["world", "o w"])
    assert matcher.feed("hello world") == "hell" and matcher.matched == "o w"
    tail = StopStringMatcher(["###"])
    assert tail.feed("a #") == "a " and tail.feed("#") == "" and tail.flush() == "##"


def test_no_stops_passes_everything_through():
    matcher = StopStringMatcher(["", ""])
    assert matcher.feed("abc") == "abc" and matcher.flush() == ""


def test_random_streams_match_the_whole_text_definition():
    rng = random.Random(0)
    alphabet = "ab\nc"
    for _ in range(500):
        stops = ["".join(rng.choice(alphabet) for _ in range(rng.randint(1, 4))) for _ in range(2)]
        text = "".join(rng.choice(alphabet) for _ in range(rng.randint(2, 24)))
        matcher = StopStringMatcher(stops)
        emitted, fed = "", ""
        for piece in random_pieces(text, rng):
            fed += piece
            emitted += matcher.feed(piece)
            if matcher.stopped:
                break
            # Nothing is held back that could not still become a stop string.
            assert emitted == fed[: len(fed) - could_still_stop(fed, stops)]
        emitted += matcher.flush()
        assert emitted == reference_cut(text, stops), (text, stops)
        assert matcher.stopped == any(s in text for s in stops)


def test_partial_marker_length():
    assert partial_marker_length("abc</th", ["</think>"]) == 4
    assert partial_marker_length("abc</think>", ["</think>"]) == 0  # whole markers are not partial
    assert partial_marker_length("<", ["<a", "<b>"]) == 1
    assert partial_marker_length("", ["x"]) == 0


def test_stop_string_split_across_tokens():
    tokenizer = Tokenizer.from_dir(str(resources.files("lily").joinpath("data/demo")))
    text = "The answer is 42. Observation: the end"
    stop = "Observation:"
    ids = tokenizer.encode(text)
    decoder = IncrementalDecoder(tokenizer)
    pieces = [decoder.add(i) for i in ids]
    assert stop not in pieces and any(p and stop.startswith(p.strip()) for p in pieces)
    matcher = StopStringMatcher([stop])
    out, consumed = "", 0
    while not matcher.stopped:
        out += matcher.feed(pieces[consumed])
        consumed += 1
    assert out == "The answer is 42. "
    assert consumed < len(pieces)  # generation can stop as soon as the stop string completes
