"""The prefix cache (lily.engine.prefix_cache, lily.engine.prefix_disk) through the chat API on the
demo model:
several conversations at once, branches, the memory budget, and states on disk across
processes. Every answer is compared with an engine that reuses nothing (`cache_memory=0`: each
prompt is fed in full from a zero state, as a fresh engine does)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import lily
from lily.api import Lily
from lily.engine.prefix_cache import PrefixCache
from lily.engine.prefix_disk import DiskPrefixCache, StateLayout

MAX_SEQ = 512
PARAMS: dict[str, Any] = {
    "max_tokens": 2,
    "temperature": 0.8,
    "seed": 11,
    "chat_template_kwargs": {"enable_thinking": False},
}


def _load(**cache: Any) -> Lily:
    return lily.load("demo", device="sim", max_seq=MAX_SEQ, **cache)


@pytest.fixture(scope="module")
def uncached() -> Iterator[Lily]:
    with _load(cache_memory=0) as llm:
        yield llm


def _conversation_tokens(llm: Lily, messages: list[dict[str, Any]]) -> int:
    """Tokens of `messages` rendered without the generation prompt."""
    text = llm.chat_template.render(messages, add_generation_prompt=False, enable_thinking=False)
    return len(llm.tokenizer.encode(text))


class Turns:
    """Runs chat turns on `llm`, checking each answer against `uncached` and recording what the
    prefix cache spared: (cached_tokens, prompt tokens the engine fed, prompt tokens)."""

    def __init__(self, llm: Lily, uncached: Lily) -> None:
        self.llm, self.uncached = llm, uncached

    def ask(self, messages: list[dict[str, Any]], **extra: Any) -> tuple[str, int, int, int]:
        fed_before = self.llm.engine.prompt_tokens_fed
        params = {**PARAMS, **extra}
        reply = self.llm.chat.completions.create(messages=messages, **params)
        fed = self.llm.engine.prompt_tokens_fed - fed_before
        params.pop("prompt_cache_key", None)
        expected = self.uncached.chat.completions.create(messages=messages, **params)
        assert expected.usage.prompt_tokens_details.cached_tokens == 0
        assert reply.choices[0].message == expected.choices[0].message
        usage = reply.usage
        assert usage.prompt_tokens == expected.usage.prompt_tokens
        content = reply.choices[0].message.content
        return content, usage.prompt_tokens_details.cached_tokens, fed, usage.prompt_tokens


def _user(text: str) -> dict[str, str]:
    return {"role": "user", "content": text}


def _assistant(text: str) -> dict[str, str]:
    return {"role": "assistant", "content": text}


def test_two_alternating_conversations_each_feed_only_their_new_messages(uncached):
    with _load() as llm:
        turns = Turns(llm, uncached)
        conversations = {
            "agent": [{"role": "system", "content": "You write code."}],
            "helper": [{"role": "system", "content": "You review code, briefly."}],
        }
        for turn in range(4):
            for name, messages in conversations.items():
                messages.append(_user(f"{name} turn {turn}: what next?"))
                before = messages[:-2] if turn else []
                answer, cached, fed, prompt = turns.ask(messages, prompt_cache_key=name)
                if turn == 0:
                    assert cached == 0 and fed == prompt
                else:
                    # Everything up to the end of the previous turn's conversation is reused.
                    assert cached == _conversation_tokens(llm, before) > 0
                    assert fed == prompt - cached
                messages.append(_assistant(answer))


def test_a_regenerated_or_edited_last_turn_reuses_everything_before_it(uncached):
    with _load() as llm:
        turns = Turns(llm, uncached)
        history = [_user("Tell me about ducks."), _assistant("Ducks swim.")]
        asked = [*history, _user("And geese?")]
        turns.ask(asked)
        # Regenerated: the same messages, so the whole conversation before the answer is reused.
        _, cached, fed, prompt = turns.ask(asked, seed=12)
        assert cached == _conversation_tokens(llm, asked)
        assert fed == prompt - cached
        # Edited last user message: everything before that message is reused.
        edited = [*history, _user("And swans, then?")]
        _, cached, fed, prompt = turns.ask(edited)
        text = llm.chat_template.render(edited, add_generation_prompt=True, enable_thinking=False)
        before_message = text[: text.rindex("<|im_start|>user")]
        assert len(llm.tokenizer.encode(before_message)) <= cached < prompt
        assert fed == prompt - cached


def _snapshot_bytes(llm: Lily) -> int:
    """One recurrent-state snapshot: conv window and GDN state of every linear layer (fp32)."""
    c = llm.config
    linear_layers = c.num_hidden_layers - len(c.full_attention_layers)
    window = (c.linear_conv_kernel_dim - 1) * c.linear_conv_dim
    state = c.linear_num_value_heads * c.linear_value_head_dim * c.linear_key_head_dim
    return linear_layers * 4 * (window + state)


def _kv_bytes_per_token(llm: Lily) -> int:
    c = llm.config
    return 2 * len(c.full_attention_layers) * c.num_key_value_heads * c.head_dim * 2  # bf16


def test_a_budget_for_two_conversations_evicts_the_least_recently_used_of_three(uncached):
    # A conversation of a system and a user message keeps two snapshots (where the user
    # message starts and where it ends) and the KV rows of its < 64 tokens: two fit, not three.
    budget = 2 * (2 * _snapshot_bytes(uncached) + 64 * _kv_bytes_per_token(uncached))
    with _load(cache_memory=budget) as llm:
        turns = Turns(llm, uncached)
        cache = llm.engine.prefix_cache
        names = ("first", "second", "third")
        conversations = {
            name: [{"role": "system", "content": f"Answer the {name} user, in a few words."},
                   _user(f"The {name} question.")]
            for name in names
        }  # fmt: skip

        def reused(name: str) -> bool:
            """Asks the next turn of a conversation: whether it reused the previous turn."""
            messages = conversations[name]
            previous_turn = _conversation_tokens(llm, messages[:-2]) if len(messages) > 2 else 0
            answer, cached, fed, prompt = turns.ask(messages)
            assert cache.used_bytes <= budget
            assert fed == prompt - cached
            messages.extend([_assistant(answer), _user(f"More on the {name} one.")])
            assert cached in (0, previous_turn)
            return cached > 0

        assert not any(reused(name) for name in names)
        assert len(cache.sequences) == 2
        assert reused("second")
        assert not reused("first")  # the least recently used: evicted, computed again
        assert reused("first")  # and cached again
        assert not reused("third")  # the least recently used meanwhile


def test_long_prompts_are_snapshotted_at_regular_positions(uncached):
    """A long shared prefix is reusable when the messages after it differ."""
    with _load() as llm:
        engine = llm.engine
        engine.prefix_cache.snapshot_interval = 64
        tokens = np.random.default_rng(3).integers(0, 4000, 150).tolist()
        list(engine.generate(tokens, 2))
        other = tokens[:140] + [5, 6, 7]
        assert engine.cached_prefix_length(other) == 128
        reused = [t.id for t in engine.generate(other, 4)]
        assert [t.id for t in uncached.engine.generate(other, 4)] == reused


def _long_messages(words: int = 120) -> list[dict[str, str]]:
    text = " ".join(f"word{i}" for i in range(words))
    return [{"role": "system", "content": text}, _user("Summarize.")]


ANSWER_IN_NEW_PROCESS = """
import json, sys
import lily
with lily.load("demo", device="sim", max_seq=512, cache_dir=sys.argv[1],
               cache_disk_min_tokens=64) as llm:
    r = llm.chat.completions.create(messages=json.loads(sys.argv[2]), **json.loads(sys.argv[3]))
    print(json.dumps({"content": r.choices[0].message.content,
                      "cached": r.usage.prompt_tokens_details.cached_tokens}))
"""


def _answer_in_new_process(cache_dir: Path, messages: list[dict[str, str]]) -> dict[str, Any]:
    # The lily under test: installed, or on the caller's PYTHONPATH.
    result = subprocess.run(
        [sys.executable, "-c", ANSWER_IN_NEW_PROCESS, str(cache_dir), json.dumps(messages),
         json.dumps(PARAMS)],
        env=dict(os.environ), capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout.strip().splitlines()[-1])


def test_a_new_process_reuses_a_long_prefix_saved_on_disk(tmp_path, uncached):
    messages = _long_messages()
    with _load(cache_dir=tmp_path, cache_disk_min_tokens=64) as llm:
        first = llm.chat.completions.create(messages=messages, **PARAMS)
    saved = sorted(tmp_path.glob("*.prefix"))
    assert saved, "nothing was written to the cache directory"
    # The longest saved prefix is the conversation before the generation prompt.
    conversation = _conversation_tokens(uncached, messages)
    assert max(int(p.name.split("-")[0]) for p in saved) == conversation
    again = _answer_in_new_process(tmp_path, messages)
    assert again == {"content": first.choices[0].message.content, "cached": conversation}
    expected = uncached.chat.completions.create(messages=messages, **PARAMS)
    assert again["content"] == expected.choices[0].message.content


@pytest.mark.parametrize("damage", ["truncated", "tampered"])
def test_a_damaged_cache_file_is_detected_deleted_and_replaced(tmp_path, uncached, damage):
    messages = _long_messages(100)
    conversation = _conversation_tokens(uncached, messages)
    with _load(cache_dir=tmp_path, cache_disk_min_tokens=64) as llm:
        llm.chat.completions.create(messages=messages, **PARAMS)
    path = max(tmp_path.glob("*.prefix"), key=lambda p: int(p.name.split("-")[0]))
    data = bytearray(path.read_bytes())
    if damage == "truncated":
        del data[len(data) // 2 :]
    else:
        data[len(data) - 1000] ^= 0x01  # one bit of the recurrent state
    path.write_bytes(bytes(data))
    with _load(cache_dir=tmp_path, cache_disk_min_tokens=64) as llm:
        disk = llm.engine.prefix_cache.disk
        reply = llm.chat.completions.create(messages=messages, **PARAMS)
        assert disk.rejected == 1
        # Not used: the shorter saved prefix (where the last message starts), if any, is.
        assert reply.usage.prompt_tokens_details.cached_tokens < conversation
    expected = uncached.chat.completions.create(messages=messages, **PARAMS)
    assert reply.choices[0].message == expected.choices[0].message
    # Replaced by an intact file, which a new process uses.
    assert path.exists() and path.read_bytes() != bytes(data)
    assert _answer_in_new_process(tmp_path, messages)["cached"] == conversation


# The state of the unit tests' DiskPrefixCache: KV rows of 2 heads of 4 values, 8 floats.
LAYOUT = StateLayout.of("bf16", [np.zeros((2, 0, 4), np.uint16)], [np.zeros(8, np.float32)])
KEY = bytes(32)


def _disk(directory: Path, identity: str = "m", **options: Any) -> DiskPrefixCache:
    return DiskPrefixCache(directory, identity, layout=LAYOUT, key=KEY, **options)


def _rows(tokens: int) -> list[np.ndarray]:
    return [np.ones((2, tokens, 4), np.uint16)]


def test_a_disk_entry_of_another_model_is_not_used(tmp_path):
    tokens = list(range(100))
    rows = _rows(100)
    state = [np.zeros(8, np.float32)]
    _disk(tmp_path, "model-a", min_tokens=10).save(tokens, rows, state)
    other = _disk(tmp_path, "model-b", min_tokens=10)
    assert other.load_longest([*tokens, 1]) is None
    same = _disk(tmp_path, "model-a", min_tokens=10)
    entry = same.load_longest([*tokens, 1])
    assert entry is not None and entry.tokens == tokens
    assert np.array_equal(entry.rows[0], rows[0]) and np.array_equal(entry.state[0], state[0])


def test_the_disk_cache_stays_within_its_size_dropping_the_least_recently_used(tmp_path):
    rows = [np.zeros((1, 50, 64), np.uint16)]  # 6400 bytes per entry, plus a small header
    layout = StateLayout.of("bf16", rows, [])
    disk = DiskPrefixCache(tmp_path, "m", max_bytes=20_000, min_tokens=1, layout=layout, key=KEY)
    prefixes = [[n] * 50 for n in range(3)]
    for tokens in prefixes[:2]:
        disk.save(tokens, rows, [])
    assert disk.load_longest([*prefixes[0], 9]) is not None  # now the most recently used
    os.utime(disk.path_of(prefixes[1]), ns=(1, 1))  # whatever the clock's resolution
    disk.save(prefixes[2], rows, [])
    kept = {p.name for p in tmp_path.glob("*.prefix")}
    assert kept == {disk.path_of(prefixes[0]).name, disk.path_of(prefixes[2]).name}
    assert sum(p.stat().st_size for p in tmp_path.glob("*.prefix")) <= 20_000


def test_an_answer_does_not_wait_for_its_prefix_to_be_written(tmp_path, uncached):
    messages = _long_messages()
    with _load(cache_dir=tmp_path, cache_disk_min_tokens=64) as llm:
        disk = llm.engine.prefix_cache.disk
        written = threading.Event()
        save = disk.save

        def slow_save(*args: Any) -> None:
            assert written.wait(timeout=120), "the test never let the write finish"
            save(*args)

        disk.save = slow_save  # type: ignore[method-assign]
        reply = llm.chat.completions.create(messages=messages, **PARAMS)
        # The answer is complete while its prefix's write is still held back.
        assert not list(tmp_path.glob("*.prefix"))
        written.set()
    # Leaving the block waited for the write.
    assert max(int(p.name.split("-")[0]) for p in tmp_path.glob("*.prefix")) == (
        _conversation_tokens(uncached, messages)
    )
    assert (
        reply.choices[0].message
        == uncached.chat.completions.create(messages=messages, **PARAMS).choices[0].message
    )


def test_a_failed_background_write_is_logged_not_raised(tmp_path, caplog):
    directory = tmp_path / "cache"
    disk = _disk(directory, min_tokens=1)
    directory.rmdir()
    directory.write_bytes(b"")  # a file where the directory was: every write now fails
    state = [np.zeros(8, np.float32)]
    disk.save_in_background([1, 2, 3], _rows(3), state)
    with caplog.at_level("WARNING", logger="lily.engine.prefix_cache"):
        disk.flush()
    assert "could not write" in caplog.text
    directory.unlink()
    disk.save_in_background([1, 2, 3], _rows(3), state)
    disk.flush()
    entry = disk.load_longest([1, 2, 3, 4])
    assert entry is not None and entry.tokens == [1, 2, 3]


def test_the_memory_budget_holds_when_one_sequence_outgrows_it():
    cache = PrefixCache(budget_bytes=1000, kv_bytes_per_token=1)

    class Rows:
        def copy_out(self, tokens):
            return [np.zeros((1, tokens), np.uint8)]

        def copy_in(self, rows, tokens):
            pass

    rows = Rows()
    prompt = list(range(600))
    cache.begin(prompt, rows)
    for length in (100, 200, 300):
        cache.add_snapshot(prompt, length, [np.zeros(300, np.uint8)])
        assert cache.used_bytes <= 1000
    # 300 rows and two 300-byte snapshots fit: the oldest snapshot went.
    assert [sorted(s.snapshots) for s in cache.sequences] == [[200, 300]]
    assert cache.used_bytes == 900
    assert cache.cached_length(prompt) == 300


class HostRows:
    """A KV cache of one array [1, capacity] whose row i holds token i, to watch the copies."""

    def __init__(self, capacity: int = 64) -> None:
        self.cache = np.full((1, capacity), -1)

    def fill(self, tokens: list[int]) -> None:
        self.cache[0, : len(tokens)] = tokens

    def copy_out(self, tokens: int) -> list[np.ndarray]:
        return [self.cache[:, :tokens].copy()]

    def copy_in(self, rows: list[np.ndarray], tokens: int) -> None:
        self.cache[:, :tokens] = rows[0][:, :tokens]


def _run(
    cache: PrefixCache, rows: HostRows, prompt: list[int], key: str | None = None, tag: int = 0
) -> tuple[int, int | None]:
    """A generation's dealings with the cache: resumes, 'feeds' the prompt, snapshots its end
    (a state holding `tag`). Returns where it resumed and the tag of the state it resumed."""
    match = cache.begin(prompt, rows, key)
    start = 0 if match is None else match.length
    assert rows.cache[0, :start].tolist() == prompt[:start]  # the rows before it are in place
    rows.fill(prompt)
    cache.add_snapshot(prompt, len(prompt) - 1, [np.full(1, tag)])
    cache.end(rows)
    return start, None if match is None else int(match.state[0][0])


def test_prompt_cache_key_prefers_its_sequence_among_equal_prefixes_only():
    cache, rows = PrefixCache(budget_bytes=10_000, kv_bytes_per_token=8), HostRows()
    shared = list(range(100, 110))
    for key, tag in (("a", 1), ("b", 2)):
        # Each conversation fed in full, snapshotted after `shared` and at its end.
        prompt = [*shared, *[tag] * 5]
        cache.begin(prompt, rows, key, reuse=False)
        rows.fill(prompt)
        cache.add_snapshot(prompt, len(shared), [np.full(1, tag)])
        cache.add_snapshot(prompt, len(prompt) - 1, [np.full(1, tag)])
    # Both sequences hold a snapshot after `shared`; the key decides which one is resumed.
    assert _run(cache, rows, [*shared, 3], key="a") == (len(shared), 1)
    assert _run(cache, rows, [*shared, 4], key="b") == (len(shared), 2)
    # A key never makes a prompt resume from tokens it does not start with.
    assert cache.cached_length([7, *shared[1:], 9], key="a") == 0


def test_switching_sequences_copies_the_rows_out_and_back_in():
    cache, rows = PrefixCache(budget_bytes=10_000, kv_bytes_per_token=8), HostRows()
    first, second = list(range(10, 30)), list(range(40, 60))
    _run(cache, rows, first)
    _run(cache, rows, second)  # overwrites the cache: the first's rows went to the host first
    assert _run(cache, rows, [*first[:-1], 99])[0] == len(first) - 1  # and came back (checked)
    assert _run(cache, rows, [*second[:-1], 98])[0] == len(second) - 1


def test_the_reference_engine_keeps_several_sequences_as_the_device_does():
    from lily.checkpoint.loader import load_checkpoint
    from lily.engine.engine import ReferenceEngine

    with lily.load("demo", device="reference", max_seq=MAX_SEQ) as llm:
        checkpoint = load_checkpoint(llm.model_dir)
        engine = llm.engine
        vocab = llm.tokenizer.vocab_size
        first = np.random.default_rng(1).integers(0, vocab, 30).tolist()
        second = np.random.default_rng(2).integers(0, vocab, 30).tolist()
        list(engine.generate(first, 2, snapshot_at=20))
        list(engine.generate(second, 2, snapshot_at=20))
        again = [*first[:20], 5, 6]
        assert engine.cached_prefix_length(again) == 20
        fed = engine.prompt_tokens_fed
        reused = [t.id for t in engine.generate(again, 4)]
        assert engine.prompt_tokens_fed - fed == 2
        fresh = ReferenceEngine(checkpoint, MAX_SEQ, vocab, PrefixCache(0, 0))
        assert [t.id for t in fresh.generate(again, 4)] == reused
