"""Incremental detokenization: token ids in, text out, never half a UTF-8 character.

A byte-level BPE token is a byte string, and one character may be split across several tokens
(a 4-byte emoji can arrive as four single-byte tokens). Bytes are therefore decoded with an
incremental UTF-8 decoder that holds back an incomplete sequence until the rest arrives; bytes
that can never become valid UTF-8 turn into U+FFFD exactly as a whole-sequence decode would.
"""

from __future__ import annotations

import codecs

from lily.chat.tokenizer import Tokenizer


class IncrementalDecoder:
    """Feeds one generated token at a time; each call returns the text that became complete.

    Special control tokens (`<|im_end|>`, ...) decode to nothing, as with
    `skip_special_tokens`; text-like added tokens (`<think>`, `<tool_call>`) are kept because the
    reasoning and tool-call parsers read them. Call `flush` once at the end of the stream.
    """

    def __init__(self, tokenizer: Tokenizer, *, skip_special_tokens: bool = True) -> None:
        self._tokenizer = tokenizer
        self._skipped = tokenizer.special_token_ids if skip_special_tokens else frozenset()
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def add(self, token_id: int) -> str:
        """The text completed by this token ("" while a character is still partial)."""
        if token_id in self._skipped:
            return ""
        return self._utf8.decode(self._tokenizer.token_bytes(token_id))

    @property
    def pending(self) -> bytes:
        """The bytes of an incomplete character held back (b"" when none)."""
        return self._utf8.getstate()[0]

    def flush(self) -> str:
        """End of stream: bytes of a character that never completed become U+FFFD."""
        return self._utf8.decode(b"", final=True)
