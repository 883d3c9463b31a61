"""The Python API as a user coming from mlx-lm or llama-cpp-python calls it: `generate` and
`stream` with `max_tokens` positional and the sampling parameters, `repr`, `lily.errors`
before any load; and the Python examples of the README and docs/python-api.md, run as written
on the demo model."""

from __future__ import annotations

import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

import lily
from lily.api import Lily
from lily.errors import RequestError

ROOT = Path(__file__).resolve().parents[1]
PROMPT = "Once upon a time"


@pytest.fixture(scope="module")
def demo() -> Iterator[Lily]:
    with lily.load("demo", device="sim", max_seq=64) as llm:
        yield llm


def run_python(code: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=600, cwd=ROOT
    )


def python_blocks(markdown: Path) -> list[str]:
    return re.findall(r"```python\n(.*?)```", markdown.read_text(), flags=re.DOTALL)


def test_lily_errors_is_there_before_any_load() -> None:
    done = run_python(
        "import sys, lily\n"
        "try:\n"
        "    raise lily.errors.ContextLengthError('too long')\n"
        "except lily.errors.RequestError as e:\n"
        "    print(type(e).__name__, e.param)\n"
        "assert 'numpy' not in sys.modules, 'import lily should stay light'\n"
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout == "ContextLengthError messages\n"


def test_generate_takes_max_tokens_positionally_and_is_greedy_by_default(demo: Lily) -> None:
    greedy = demo.generate(PROMPT, 6)
    assert demo.last_token_counts[1] == 6
    assert greedy == demo.generate(PROMPT, max_tokens=6, temperature=0)
    assert "".join(demo.stream(PROMPT, 6)) == greedy


def test_sampling_parameters_reach_the_sampler(demo: Lily) -> None:
    first = demo.generate(PROMPT, 8, temperature=1.0, seed=1)
    assert demo.generate(PROMPT, 8, temperature=1.0, seed=1) == first  # the seed reproduces
    assert demo.generate(PROMPT, 8, temperature=1.0, seed=2) != first
    assert demo.generate(PROMPT, 8, temperature=1.0, top_k=1, seed=3) == demo.generate(PROMPT, 8)
    pieces = list(demo.stream(PROMPT, 8, temperature=1.0, seed=1))
    assert "".join(pieces) == first


def test_stop_strings_end_the_text_before_them(demo: Lily) -> None:
    text = demo.generate(PROMPT, 12)
    stop = text[len(text) // 2 : len(text) // 2 + 2]
    cut = demo.generate(PROMPT, 12, stop=[stop, "never in this text \x00"])
    assert cut == text[: text.index(stop)]
    assert demo.last_token_counts[1] < 12  # the generation itself stopped
    assert demo.generate(PROMPT, 12, stop=stop) == cut


@pytest.mark.parametrize(
    "kwargs",
    [{"max_tokens": 0}, {"max_tokens": -3}, {"max_tokens": True}, {"temperature": 5},
     {"top_p": 0}, {"stop": [""]}, {"stop": [3]}],
)  # fmt: skip
def test_bad_arguments_raise_at_the_call(demo: Lily, kwargs: dict) -> None:
    with pytest.raises(RequestError):
        demo.stream(PROMPT, **kwargs)  # not iterated: refused before anything runs


@pytest.mark.parametrize(
    ("prompt", "max_tokens", "param", "words"),
    [
        (123, 4, "prompt", "must be a string, got int"),
        (None, 4, "prompt", "must be a string, got NoneType"),
        (b"bytes", 4, "prompt", "must be a string, got bytes"),
        ("", 4, "prompt", "empty"),
        (PROMPT, 64, "max_tokens", "+ max_tokens (64) exceeds the context of 64 tokens"),
    ],
)
def test_a_bad_prompt_raises_a_request_error_naming_it_at_the_call(
    demo: Lily, prompt: object, max_tokens: int, param: str, words: str
) -> None:
    for call in (demo.stream, demo.generate):
        with pytest.raises(RequestError, match=re.escape(words)) as raised:
            call(prompt, max_tokens)  # stream is not iterated: refused before anything runs
        assert raised.value.param == param


def test_repr_names_the_model_not_a_cache_path(demo: Lily) -> None:
    assert repr(demo) == "Lily(model='demo', device='sim')"


def test_the_readme_python_examples_run_and_print_an_answer() -> None:
    first, *rest = python_blocks(ROOT / "README.md")
    assert "reasoning_budget" in first
    # The first example's answer must not be empty: thinking alone used to fill max_tokens.
    check = "\nassert r.choices[0].message.content.strip(), 'the answer is empty'\n"
    done = run_python(first + check + "\n".join(rest))
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip()


def test_the_python_api_page_examples_run_as_written() -> None:
    done = run_python("\n".join(python_blocks(ROOT / "docs" / "python-api.md")))
    assert done.returncode == 0, done.stderr


def test_a_kv_cache_format_is_checked_before_loading() -> None:
    with pytest.raises(ValueError, match="kv_cache must be 'bf16' or 'int8', not 'int4'"):
        lily.load("no/such-dir/", kv_cache="int4")
    with pytest.raises(ValueError, match="reference engine keeps its KV cache in float32"):
        lily.load("no/such-dir/", device="reference", kv_cache="int8")


@pytest.mark.skipif(sys.platform == "darwin", reason="a Mac build may have a metal device")
def test_metal_where_there_is_none_is_a_clear_error_before_loading() -> None:
    with pytest.raises(ValueError, match="metal device is not available here.*'sim'"):
        lily.load("demo", device="metal")


@pytest.mark.parametrize("parallel", [0, -1, True, 2.0, "4"])
def test_parallel_is_checked_before_loading(parallel: object) -> None:
    with pytest.raises(ValueError, match="parallel must be a positive int"):
        lily.load("no/such-dir/", parallel=parallel)


def test_parallel_needs_an_engine_that_can_batch() -> None:
    with pytest.raises(ValueError, match="reference engine decodes one sequence"):
        lily.load("no/such-dir/", device="reference", parallel=2)
    with pytest.raises(ValueError, match="prefill_chunk of at least 2"):
        lily.load("demo", device="sim", prefill_chunk=1, parallel=2)


def test_parallel_slots_are_what_the_memory_preflight_allows(monkeypatch) -> None:
    """A Mac whose GPU takes the engine and two slots, not four, gets two; the sim has no limit."""
    import lily.device
    from lily.api import _parallel_slots

    def check_memory(kind: str, nbytes: int) -> None:
        if kind == "metal" and nbytes > 1000 + 2 * 300:
            raise MemoryError("more than Metal recommends")

    monkeypatch.setattr(lily.device, "check_memory", check_memory)
    assert _parallel_slots("metal", 1000, 300, 4) == 2
    assert _parallel_slots("metal", 1000, 700, 4) == 1
    assert _parallel_slots("sim", 1000, 700, 4) == 4
    with lily.load("demo", device="sim", parallel=3) as llm:
        assert llm.parallel == 3


@pytest.mark.parametrize("speculative", ["auto", "mtp"])
def test_the_mtp_head_beside_parallel_slots(monkeypatch, capsys, speculative: str) -> None:
    """With room for the head and the slots, both load; with room for the slots only if the
    head stays out, "auto" leaves it out (stderr says so) and "mtp" keeps it, with fewer slots."""
    import lily.device
    from lily.checkpoint.loader import load_checkpoint, resolve_model
    from lily.engine.model_graph import device_bytes, slot_bytes

    sizes = dict(max_seq=256, prefill_chunk=64)
    with lily.load("demo", device="sim", speculative=speculative, parallel=2, **sizes) as llm:
        assert (llm.mtp_head, llm.parallel) == (True, 2)
    checkpoint = load_checkpoint(resolve_model("demo", None))
    without_head = device_bytes(checkpoint, 256, 64, "bf16", mtp=False)
    per_slot = slot_bytes(checkpoint.config, 256, checkpoint.config.vocab_size)
    room = without_head + 2 * per_slot
    assert device_bytes(checkpoint, 256, 64, "bf16", mtp=True) + per_slot < room

    def check_memory(kind: str, nbytes: int) -> None:
        if nbytes > room:
            raise MemoryError("more than this Mac has")

    monkeypatch.setattr(lily.device, "check_memory", check_memory)
    with lily.load("demo", device="sim", speculative=speculative, parallel=2, **sizes) as llm:
        expected = (False, 2) if speculative == "auto" else (True, 1)
        assert (llm.mtp_head, llm.parallel) == expected
    said = capsys.readouterr().err
    if speculative == "auto":
        assert "loaded without it" in said
    else:
        assert "holds 1 sequences" in said
