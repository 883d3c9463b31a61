"""OpenAI's Predicted Outputs, lined up on text: a prediction drafts the tokens of its text that
follow where the reply's answer has got to.

A client's prediction is text (usually the previous version of a file being edited), and the
same text can be spelled by different tokens: the model writes " wor" + "ld" where the
prediction tokenizes as " world", writes a control token the answer leaves out, or an invalid
byte the answer shows as U+FFFD. Token ids line up with the prediction's only until the first
such difference. Here the reply is turned into the answer's text as the client sees it (the
incremental detokenizer, then the reasoning parser: control tokens and the think block left
out), that text is followed through the prediction character by character, and each pass's
drafts are the tokenization of the prediction's text from that point. Where the reply has
written the first bytes of a character, the drafts start with the token of the bytes still to
come. A U+FFFD in the prediction stands for bytes that were not UTF-8, which its text no longer
holds: the drafts end before it (the pass's own token supplies the byte), and once the reply
holds a byte there they continue after it. Where the answer leaves the prediction (an edit),
nothing is drafted until its last few characters occur in the prediction again, and drafting
resumes after them.

Drafts are only proposals: the verify pass keeps those the model itself would generate, so
none of this changes the reply, only how many tokens a pass yields.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from lily.chat.detokenize import IncrementalDecoder
from lily.chat.reasoning import ReasoningParser
from lily.chat.tokenizer import Tokenizer

# The answer's last characters looked up in the prediction to find where it rejoins it after
# an edit, longest first; fewer than 8 characters (about two tokens) match too often by chance.
REJOIN_LENGTHS = (32, 16, 8)
# Characters of the prediction tokenized per draft token asked for: tokens of code and prose
# average 3 to 4 characters; a window that ends inside a token drops that token.
WINDOW_CHARS_PER_TOKEN = 16
# How the answer's text and the prediction show bytes that are not UTF-8.
REPLACEMENT = "\ufffd"


class PredictedText:
    """The prediction `text`, whose tokens spell `spans` of it, for a reply whose tokens start
    at index `reply_start` of those the engine drafts after, inside a think block when
    `thinking` (the generation prompt opened one): the answer starts after it.

    It also keeps OpenAI's counts, which are about the text, not about drafting: the
    prediction's tokens that appeared in the answer (every character of the token lined up
    with the answer's) and those that did not."""

    def __init__(
        self,
        tokenizer: Tokenizer,
        text: str,
        spans: Sequence[tuple[int, int]],
        reply_start: int,
        thinking: bool,
    ) -> None:
        self._tokenizer = tokenizer
        self._text = text
        self._spans = spans
        self._reply_start = reply_start
        self._decoder = IncrementalDecoder(tokenizer)
        self._thinking = thinking
        self._parser = ReasoningParser(thinking=thinking)
        self._read = 0  # reply tokens turned into answer text so far
        self._answer: list[str] = []  # the answer's text since it last lined up
        # Where in the prediction the answer continues; None while it does not line up.
        self._at: int | None = 0
        self._last_at = 0  # where it last lined up: a rejoin is looked for from there on
        # +1 where a lined-up run of the prediction starts, -1 after it ends.
        self._matched = np.zeros(len(text) + 1, np.int32)

    @property
    def token_count(self) -> int:
        return len(self._spans)

    @property
    def from_reply_start(self) -> bool:
        return not self._thinking  # else nothing is drafted inside the think block

    @property
    def appeared_tokens(self) -> int:
        """The prediction's tokens every character of which lined up with the answer so far."""
        covered = np.concatenate([[0], np.cumsum(np.cumsum(self._matched)[:-1] > 0)])
        if not self._spans:
            return 0
        starts, ends = np.asarray(self._spans, np.int64).T
        whole = (ends > starts) & (covered[ends] - covered[starts] == ends - starts)
        return int(whole.sum())

    def read(self, reply: Sequence[int]) -> None:
        """Follows the reply's tokens past those read already through the prediction."""
        for token in reply[self._read :]:
            self._add(token)

    def draft(self, tokens: Sequence[int], limit: int) -> list[int]:
        for token in tokens[self._reply_start + self._read :]:
            self._add(token)
        if self._at is None or self._parser.in_reasoning:
            return []  # off the prediction, or no answer yet
        at, written = self._at, self._decoder.pending
        if written and self._text.startswith(REPLACEMENT, at):
            # The bytes held back begin a character the prediction shows as U+FFFD: they
            # become it as soon as the next token does not continue them, and the first byte
            # of any text does not.
            at, written = at + 1, b""
        return self._tokenize_from(at, written, limit)

    def verified(self, accepted: int) -> None:
        """Nothing to do: the next `draft` reads the accepted tokens from the reply."""

    def _add(self, token: int) -> None:
        """One more reply token: its text, as the answer shows it, followed."""
        self._follow(self._parser.feed(self._decoder.add(int(token))).content)
        self._read += 1

    def _follow(self, piece: str) -> None:
        if not piece:
            return
        if self._at is not None and self._text.startswith(piece, self._at):
            self._mark(self._at, self._at + len(piece))
            self._at += len(piece)
            self._last_at, self._answer = self._at, []
            return
        self._at = None
        self._answer.append(piece)
        self._rejoin()

    def _rejoin(self) -> None:
        """Lines the answer up again where its last characters occur in the prediction: the
        first such place after where it last lined up, else the last before."""
        answer = "".join(self._answer)[-REJOIN_LENGTHS[0] :]
        self._answer = [answer]
        for length in REJOIN_LENGTHS:
            if len(answer) < length:
                continue
            tail = answer[-length:]
            start = self._text.find(tail, self._last_at)
            if start < 0:
                start = self._text.rfind(tail, 0, self._last_at + length - 1)
            if start >= 0:
                self._mark(start, start + length)
                self._at = self._last_at = start + length
                self._answer = []
                return

    def _mark(self, start: int, end: int) -> None:
        self._matched[start] += 1
        self._matched[end] -= 1

    def _tokenize_from(self, at: int, written: bytes, limit: int) -> list[int]:
        """Up to `limit` tokens that spell the prediction from character `at` on, less its
        first bytes `written` (a character's beginning the reply has written), and end before
        the next U+FFFD: that stands for bytes the text no longer holds (the model wrote an
        invalid sequence), which only the model's own token of the pass can supply."""
        end = at + WINDOW_CHARS_PER_TOKEN * (limit + 1)
        unknown = self._text.find(REPLACEMENT, at, end)
        drafts = self._tokenizer.encode(self._text[at : end if unknown < 0 else unknown])
        if unknown < 0 and end < len(self._text):
            drafts = drafts[:-1]  # may be the start of a longer token
        if written:
            drafts = self._after(written, drafts)
        return drafts[:limit]

    def _after(self, written: bytes, drafts: list[int]) -> list[int]:
        """`drafts` less the bytes `written` they start with (none when they do not): the
        token that spells the last of those bytes and more is spelled again from there."""
        spelled = b""
        for index, token in enumerate(drafts):
            spelled += self._tokenizer.token_bytes(token)
            if len(spelled) >= len(written):
                if not spelled.startswith(written):
                    return []
                return [*self._tokenizer.spell_bytes(spelled[len(written) :]), *drafts[index + 1 :]]
        return []
