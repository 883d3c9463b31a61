"""The checkpoint's tokenizer: `tokenizer.json` run by the `tokenizers` library.

Qwen's vocabulary is byte-level BPE: every token stands for a byte string, written in
`tokenizer.json` with GPT-2's printable stand-in alphabet (one character per byte). The streaming
detokenizer needs those raw bytes, so this module also owns that alphabet.

Stop ids are the union of `tokenizer_config.json`'s `eos_token` and the model config's
`eos_token_id`; no BOS is ever added (the chat template writes every marker itself).
"""

from __future__ import annotations

import bisect
import json
import unicodedata
from collections.abc import Iterable, Sequence
from functools import cached_property, lru_cache
from pathlib import Path
from typing import Any

import tokenizers
import tokenizers.normalizers

from lily.checkpoint.files import read_json_file
from lily.errors import CheckpointError

# The tokenizers' Unicode normalizers, by the form `unicodedata.normalize` computes alike.
_UNICODE_FORMS = {
    "NFC": tokenizers.normalizers.NFC,
    "NFD": tokenizers.normalizers.NFD,
    "NFKC": tokenizers.normalizers.NFKC,
    "NFKD": tokenizers.normalizers.NFKD,
}

# The size bound on tokenizer.json (`Tokenizer.from_dir`): Qwen's, 248k ids with their merges
# and added tokens, takes under 60 bytes per id.
MIN_TOKENIZER_BYTES = 1 << 20
MAX_BYTES_PER_TOKEN = 512


class TokenizerError(ValueError):
    """The tokenizer files are missing, malformed, or not the byte-level BPE Lily expects."""


@lru_cache(maxsize=1)
def byte_to_char() -> tuple[str, ...]:
    """GPT-2's byte-level alphabet: byte value -> the printable character that stands for it.

    Bytes that are already visible, non-space Latin-1 characters stand for themselves; the
    remaining 68 (controls, space, NBSP, soft hyphen) are moved to code points 256, 257, ... in
    byte order, so no token string ever contains whitespace or a control character.
    """
    visible = {*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)}
    table = []
    next_free = 256
    for byte in range(256):
        if byte in visible:
            table.append(chr(byte))
        else:
            table.append(chr(next_free))
            next_free += 1
    return tuple(table)


@lru_cache(maxsize=1)
def char_to_byte() -> dict[str, int]:
    """Inverse of `byte_to_char`."""
    return {char: byte for byte, char in enumerate(byte_to_char())}


def bytes_to_token_string(data: bytes) -> str:
    """A byte string as it is spelled in a byte-level `tokenizer.json`."""
    table = byte_to_char()
    return "".join(table[b] for b in data)


def token_string_to_bytes(token: str) -> bytes:
    """The bytes a byte-level vocabulary entry stands for."""
    table = char_to_byte()
    try:
        return bytes(table[c] for c in token)
    except KeyError:
        raise TokenizerError(f"token {token!r} is not in the byte-level alphabet") from None


def _token_content(value: Any) -> str | None:
    """`eos_token` and friends are either a string or an AddedToken dict with a `content`."""
    if isinstance(value, dict):
        return value.get("content")
    return value


class Tokenizer:
    """Text <-> token ids for one checkpoint.

    `encode` never adds a BOS and recognizes the added tokens (`<|im_start|>`, `<think>`, ...)
    written in the text, as the rendered chat template needs. `token_bytes` gives the raw bytes
    of any id, which is what incremental detokenization works on.
    """

    def __init__(
        self,
        backend: tokenizers.Tokenizer,
        *,
        stop_token_ids: Iterable[int] = (),
        special_tokens: dict[str, str] | None = None,
    ) -> None:
        self._backend = backend
        self._check_byte_level(backend)
        self.stop_token_ids: frozenset[int] = frozenset(int(i) for i in stop_token_ids)
        # bos_token, eos_token, pad_token, ... by name, as the chat template expects them.
        self.special_tokens: dict[str, str] = dict(special_tokens or {})
        added = backend.get_added_tokens_decoder()
        self._added_text: dict[int, str] = {i: t.content for i, t in added.items()}
        # Control tokens (`<|im_end|>`, ...) are dropped from generated text; added tokens that
        # are not special (`<think>`, `<tool_call>`) stay, since the output parsers read them.
        self.special_token_ids: frozenset[int] = frozenset(i for i, t in added.items() if t.special)
        self._bytes_cache: dict[int, bytes] = {}
        self._plain_backend: tokenizers.Tokenizer | None = None

    @staticmethod
    def _check_byte_level(backend: tokenizers.Tokenizer) -> None:
        decoder = json.loads(backend.decoder.__getstate__()) if backend.decoder else {}
        kinds = {decoder.get("type")} | {d.get("type") for d in decoder.get("decoders", [])}
        if "ByteLevel" not in kinds:
            raise TokenizerError(
                f"expected a byte-level BPE tokenizer, the decoder is {decoder.get('type')!r}"
            )

    @classmethod
    def from_dir(
        cls,
        model_dir: str | Path,
        *,
        config_eos_ids: Sequence[int] = (),
        max_vocab: int | None = None,
    ) -> Tokenizer:
        """Load `tokenizer.json` and `tokenizer_config.json` from a checkpoint directory.

        `config_eos_ids` are the model config's `eos_token_id` values; they join the
        tokenizer config's `eos_token` as stop ids. `max_vocab`: the most ids the model has
        (its config's `vocab_size`); a tokenizer with more is refused, a file far too large to
        hold only that many before it is parsed (parsing takes seconds per million entries).
        """
        model_dir = Path(model_dir)
        path = model_dir / "tokenizer.json"
        if not path.is_file():
            raise TokenizerError(f"no tokenizer.json in {model_dir}")
        if max_vocab is not None:
            largest = MIN_TOKENIZER_BYTES + max_vocab * MAX_BYTES_PER_TOKEN
            if path.stat().st_size > largest:
                raise TokenizerError(
                    f"{path} is {path.stat().st_size} bytes, more than a tokenizer of the "
                    f"model's {max_vocab} ids can take ({largest}): they do not belong together"
                )
        try:
            backend = tokenizers.Tokenizer.from_file(str(path))
        except Exception as e:  # tokenizers raises a bare Exception on bad JSON
            raise TokenizerError(f"{path} could not be loaded: {e}") from None
        vocab_size = backend.get_vocab_size(with_added_tokens=True)
        if max_vocab is not None and vocab_size > max_vocab:
            raise TokenizerError(
                f"the tokenizer has {vocab_size} ids but the model only {max_vocab}: they do "
                "not belong together"
            )
        tok_config = _read_json(model_dir / "tokenizer_config.json")
        special = {
            name: content
            for name in ("bos_token", "eos_token", "pad_token", "unk_token")
            if (content := _token_content(tok_config.get(name))) is not None
        }
        stop_ids = set(config_eos_ids)
        if "eos_token" in special:
            eos_id = backend.token_to_id(special["eos_token"])
            if eos_id is None:
                raise TokenizerError(f"eos_token {special['eos_token']!r} is not in the vocabulary")
            stop_ids.add(eos_id)
        if not stop_ids:
            raise TokenizerError(f"{model_dir} defines no eos token: generation could never stop")
        return cls(backend, stop_token_ids=stop_ids, special_tokens=special)

    @property
    def vocab_size(self) -> int:
        """Number of ids the tokenizer can produce (BPE ranks plus added tokens)."""
        return self._backend.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str) -> list[int]:
        """Token ids of `text`; added tokens written in the text become their ids; no BOS."""
        return self._encoding(text).ids

    def token_spans(self, text: str) -> list[tuple[int, int]]:
        """The character span of `text` each of its tokens spells (a character split across
        tokens gives each of them its span)."""
        return list(self._encoding(text).offsets)

    def encode_split(self, text: str, at: int) -> tuple[list[int], int | None]:
        """Token ids of `text`, and how many of them spell exactly `text[:at]` (None when a
        token straddles that character offset): one tokenization for a prompt and a prefix."""
        ids, (split,) = self.encode_splits(text, [at])
        return ids, split

    def encode_splits(
        self, text: str, offsets: Sequence[int]
    ) -> tuple[list[int], list[int | None]]:
        """`encode_split` at several character offsets, from one tokenization."""
        encoding = self._encoding(text)
        ends = [end for _, end in encoding.offsets]
        splits: list[int | None] = []
        for at in offsets:
            split = bisect.bisect_right(ends, at)
            clean = split == len(ends) or encoding.offsets[split][0] >= at
            splits.append(split if clean and (split == 0 or ends[split - 1] == at) else None)
        return encoding.ids, splits

    def _encoding(self, text: str) -> tokenizers.Encoding:
        # `encode_batch` releases the GIL while it works (`encode` holds it), so that a long
        # text tokenized on a worker thread does not freeze the server's event loop.
        return self._backend.encode_batch([text], add_special_tokens=False)[0]

    @cached_property
    def max_token_bytes(self) -> int:
        """The most bytes any one token stands for."""
        # A byte-level spelling has one character per byte; added tokens are their UTF-8 text.
        ranked = max(map(len, self._backend.get_vocab(with_added_tokens=False)), default=1)
        added = max((len(text.encode()) for text in self._added_text.values()), default=1)
        return max(ranked, added)

    def surely_longer_than(self, text: str, tokens: int) -> bool:
        """Whether `encode(text)` certainly has more than `tokens` ids, decided without
        tokenizing: the ids spell the normalized text's bytes, each at most `max_token_bytes`
        of them. False means "perhaps not"; tokenize to know."""

        def fewest_tokens(spelled: str) -> int:
            return -(-len(spelled.encode("utf-8", "surrogatepass")) // self.max_token_bytes)

        if fewest_tokens(text) <= tokens:
            return False
        # Normalization (NFC) can shrink the text a little: it is linear, far cheaper than
        # tokenizing, and only a text already too long by its raw size pays for it. The Unicode
        # forms are computed by Python's own, in the memory of one copy of the text: the
        # tokenizer's keeps an alignment per byte (7 MB of text took 280 MiB for a while).
        normalizer = self._backend.normalizer
        if normalizer is None:
            return fewest_tokens(text) > tokens
        form = next((f for f, kind in _UNICODE_FORMS.items() if isinstance(normalizer, kind)), None)
        if form is not None:
            return fewest_tokens(unicodedata.normalize(form, text)) > tokens
        return fewest_tokens(normalizer.normalize_str(text)) > tokens

    @property
    def special_token_texts(self) -> frozenset[str]:
        """The text of each control token (`<|im_start|>`, `<|im_end|>`, ...)."""
        return frozenset(self._added_text[i] for i in self.special_token_ids)

    def encode_as_text(self, text: str) -> list[int]:
        """Token ids of `text` with control tokens written in it read as ordinary text
        (`<|im_end|>` becomes `<`, `|`, `im`, ... rather than the control token)."""
        if self._plain_backend is None:
            # A private copy, so that the flag never changes what `encode` does.
            self._plain_backend = tokenizers.Tokenizer.from_str(self._backend.to_str())
            self._plain_backend.encode_special_tokens = True
        # `encode_batch` for the GIL's sake, as in `_encoding`.
        encoding = self._plain_backend.encode_batch([text], add_special_tokens=False)[0]
        return encoding.ids

    def decode(self, ids: Sequence[int], *, skip_special_tokens: bool = False) -> str:
        """Text of a whole id sequence (invalid UTF-8 becomes U+FFFD)."""
        return self._backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def token_to_id(self, token: str) -> int | None:
        return self._backend.token_to_id(token)

    def spell_bytes(self, data: bytes) -> list[int]:
        """Vocabulary tokens whose bytes are exactly `data`, each the longest entry that
        starts the rest: bytes that need not be whole characters (the end of one whose
        beginning another token wrote), which `encode` cannot take."""
        ids: list[int] = []
        while data:
            for size in range(min(len(data), self.max_token_bytes), 0, -1):
                token = self._backend.token_to_id(bytes_to_token_string(data[:size]))
                if token is not None and token not in self._added_text:
                    break
            else:  # byte-level BPE vocabularies hold every single byte; this one does not
                raise TokenizerError(f"no token spells the byte {data[0]:#04x}")
            ids.append(token)
            data = data[size:]
        return ids

    def id_to_token(self, token_id: int) -> str | None:
        """The vocabulary spelling of an id (byte-level alphabet for BPE tokens)."""
        return self._backend.id_to_token(token_id)

    def token_bytes(self, token_id: int) -> bytes:
        """The raw bytes one token stands for; added tokens are their UTF-8 text."""
        cached = self._bytes_cache.get(token_id)
        if cached is not None:
            return cached
        if token_id in self._added_text:
            data = self._added_text[token_id].encode()
        else:
            token = self._backend.id_to_token(token_id)
            if token is None:
                raise TokenizerError(f"token id {token_id} is outside the vocabulary")
            data = token_string_to_bytes(token)
        self._bytes_cache[token_id] = data
        return data

    def token_text(self, token_id: int) -> str:
        """A token as the `token` field of OpenAI logprobs: its text, or, when its bytes are not
        valid UTF-8 on their own (part of a character), OpenAI's `bytes:\\xe4\\xb8` spelling.
        The exact bytes always go in the logprob's `bytes` field."""
        data = self.token_bytes(token_id)
        try:
            return data.decode("utf-8")
        except UnicodeDecodeError:
            return "bytes:" + "".join(f"\\x{b:02x}" for b in data)


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    try:
        value = read_json_file(path)
    except CheckpointError as e:  # not UTF-8, not JSON, nested too deeply, too large
        raise TokenizerError(str(e)) from None
    if not isinstance(value, dict):
        raise TokenizerError(f"{path} is not a JSON object")
    return value
