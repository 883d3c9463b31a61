"""Predicted Outputs lined up on text (`lily.chat.prediction.PredictedText`), with the demo's
tokenizer: drafts follow where the answer has got to in the prediction's text however the reply
spells it in tokens, and OpenAI's counts are of the prediction's tokens that appeared."""

from __future__ import annotations

from importlib import resources

import pytest

from lily.chat.prediction import PredictedText
from lily.chat.tokenizer import Tokenizer

PROMPT = [1, 2, 3]  # stands for the prompt the reply follows


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return Tokenizer.from_dir(str(resources.files("lily").joinpath("data/demo")))


def _ids(tokenizer: Tokenizer, *pieces: str) -> list[int]:
    """The reply spelled piece by piece: each piece tokenized on its own."""
    return [t for piece in pieces for t in tokenizer.encode(piece)]


def _predicted(tokenizer: Tokenizer, text: str, thinking: bool = False) -> PredictedText:
    return PredictedText(
        tokenizer, text, tokenizer.token_spans(text), reply_start=len(PROMPT), thinking=thinking
    )


def _spelled(tokenizer: Tokenizer, ids: list[int]) -> str:
    return b"".join(tokenizer.token_bytes(t) for t in ids).decode()


def test_a_reply_spelled_in_other_tokens_still_gets_the_rest_of_the_text(tokenizer):
    text = "Hello world, how are you?"
    predicted = _predicted(tokenizer, text)
    # The prediction tokenizes as "H" "el" "lo" " world"...; the reply wrote "Hel" + "lo w" +
    # "or" first, which no token-id lookup of the prediction finds.
    reply = _ids(tokenizer, "Hel", "lo w", "or")
    assert not set(reply[-2:]) <= set(tokenizer.encode(text))
    drafts = predicted.draft(PROMPT + reply, 3)
    assert drafts == tokenizer.encode("ld, how")[:3]
    assert _spelled(tokenizer, drafts) == "ld, how"


def test_drafts_end_where_the_limit_or_the_prediction_does(tokenizer):
    text = "def add(a, b):\n    return a + b\n"
    predicted = _predicted(tokenizer, text)
    reply = _ids(tokenizer, "def")
    assert predicted.draft(PROMPT + reply, 2) == tokenizer.encode(" add(a")
    reply += _ids(tokenizer, " add(a, b):\n    return a + ")
    assert predicted.draft(PROMPT + reply, 8) == tokenizer.encode("b\n")


def test_control_tokens_and_the_think_block_are_not_part_of_the_answer(tokenizer):
    text = "Paris is the capital."
    predicted = _predicted(tokenizer, text, thinking=True)
    assert not predicted.from_reply_start and _predicted(tokenizer, text).from_reply_start
    reasoning = _ids(tokenizer, "The user asks about Paris is the capital")
    # Inside the think block nothing is drafted, even where the reasoning matches the text.
    assert predicted.draft(PROMPT + reasoning, 4) == []
    closed = reasoning + _ids(tokenizer, "</think>", "\n\n")
    assert predicted.draft(PROMPT + closed, 2) == tokenizer.encode(text)[:2]
    # A control token the answer leaves out (the demo writes such tokens) changes nothing.
    audio = tokenizer.encode("<|audio_start|>")
    assert audio[0] in tokenizer.special_token_ids
    reply = closed + _ids(tokenizer, "Paris") + audio + _ids(tokenizer, " is")
    assert predicted.draft(PROMPT + reply, 2) == tokenizer.encode(" the capital.")[:2]


def _byte(tokenizer: Tokenizer, value: int) -> int:
    """The token of one byte (not a whole character unless ASCII)."""
    (token,) = tokenizer.spell_bytes(bytes([value]))
    return token


def test_a_character_the_reply_began_is_drafted_from_its_next_byte(tokenizer):
    text = "na\u00efve \u00e9t\u00e9"
    # The prediction spells "ï" as two byte tokens, "é" as one token of both bytes.
    assert [tokenizer.token_bytes(t) for t in tokenizer.encode(text)][1:3] == [b"\xc3", b"\xaf"]
    assert tokenizer.token_bytes(tokenizer.encode("\u00e9")[0]) == "\u00e9".encode()
    predicted = _predicted(tokenizer, text)
    reply = _ids(tokenizer, "na") + [_byte(tokenizer, 0xC3)]
    # The prediction's own tokens from there.
    assert predicted.draft(PROMPT + reply, 3) == tokenizer.encode(text)[2:5]
    # The reply writes "é" byte by byte where the prediction's token holds both: the draft
    # is the token of the byte still to come, then the text after the character.
    reply += _ids(tokenizer, "\u00efve ")[1:] + [_byte(tokenizer, 0xC3)]
    assert tokenizer.decode(reply).startswith("na\u00efve ")
    drafts = predicted.draft(PROMPT + reply, 4)
    assert drafts == [_byte(tokenizer, 0xA9), *tokenizer.encode("t\u00e9")]
    # Bytes that begin another character than the prediction's: nothing to draft.
    other = _predicted(tokenizer, text)
    assert other.draft(PROMPT + _ids(tokenizer, "na") + [_byte(tokenizer, 0xE4)], 3) == []


def test_drafts_end_before_a_replacement_character_and_resume_after_it(tokenizer):
    """U+FFFD in the prediction stands for bytes that were not UTF-8 (the model wrote a stray
    byte), which its text no longer holds: the drafts stop before it, and once the reply has
    written a byte there, they continue after it."""
    text = "ok\ufffd4 block\ufffd\ufffd end"
    predicted = _predicted(tokenizer, text)
    reply = _ids(tokenizer, "o")
    assert predicted.draft(PROMPT + reply, 4) == tokenizer.encode("k")
    reply += _ids(tokenizer, "k")
    assert predicted.draft(PROMPT + reply, 4) == []  # the byte there cannot be known
    # A byte that starts no character is U+FFFD at once.
    stray = reply + [_byte(tokenizer, 0xB5)]
    assert predicted.draft(PROMPT + stray, 2) == tokenizer.encode("4 block")[:2]
    # A byte that starts a character is held back until the next token: that it becomes
    # U+FFFD is the prediction's guess, and the text after it is drafted.
    held = _predicted(tokenizer, text)
    reply += [_byte(tokenizer, 0xEA)]
    assert held.draft(PROMPT + reply, 2) == tokenizer.encode("4 block")[:2]
    reply += _ids(tokenizer, "4 block") + [_byte(tokenizer, 0xEA)]
    assert held.draft(PROMPT + reply, 2) == []  # the second U+FFFD: unknown bytes again
    reply += [_byte(tokenizer, 0xFF)]  # ends the held byte's U+FFFD and is the second
    assert held.draft(PROMPT + reply, 2) == tokenizer.encode(" end")[:2]
    held.read(reply + _ids(tokenizer, " end"))
    assert held.appeared_tokens == held.token_count


def test_after_an_edit_drafting_resumes_where_the_answer_rejoins_the_prediction(tokenizer):
    text = "first line of the file\nsecond line of the file\nthird line of the file\n"
    predicted = _predicted(tokenizer, text)
    edited = _ids(tokenizer, "first line of the file\nSECOND LINE, edited")
    assert predicted.draft(PROMPT + edited, 4) == []  # the answer left the prediction
    rejoined = edited + _ids(tokenizer, " of the file\nthird")
    assert predicted.draft(PROMPT + rejoined, 3) == tokenizer.encode(" line of the")
    # Text that occurs twice: the place after where the answer last lined up is taken.
    assert text.count(" of the file\n") == 3


def test_counts_are_the_prediction_tokens_that_appeared_in_the_answer(tokenizer):
    text = "alpha beta gamma delta epsilon"
    spans = tokenizer.token_spans(text)
    assert len(spans) == len(tokenizer.encode(text))
    whole = _predicted(tokenizer, text)
    whole.read(_ids(tokenizer, "al", "pha beta gam", "ma delta epsilon"))
    assert whole.appeared_tokens == whole.token_count == len(spans)
    # "gamma" edited: the answer rejoins the prediction at " delta e" (8 characters in
    # common); only the tokens spelling " gamma" did not appear.
    edited = _predicted(tokenizer, text)
    edited.read(_ids(tokenizer, "alpha beta GAMMA delta epsilon"))
    gamma = (text.index(" gamma"), text.index(" delta"))
    missing = [(s, e) for s, e in spans if s < gamma[1] and e > gamma[0]]
    assert missing and edited.appeared_tokens == len(spans) - len(missing)
    # Read in pieces or at once, drafting or not: the same counts.
    pieces = _predicted(tokenizer, text)
    reply = _ids(tokenizer, "alpha beta GAMMA delta epsilon")
    for end in range(1, len(reply) + 1):
        pieces.draft(PROMPT + reply[:end], 2)
    assert pieces.appeared_tokens == edited.appeared_tokens
    assert _predicted(tokenizer, text).appeared_tokens == 0
