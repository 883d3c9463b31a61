"""The DFlash drafter as a draft source of the device engine (`DeviceEngine(dflash=...)`,
`Speculation(dflash=True)`): the engine catches the drafter up on the rows each pass kept, asks
it for a block after the newest token, and verifies it. As in tests/test_speculative.py, greedy
output equals plain decoding's up to its first near-tie (`decided`) whatever the drafts: the
random drafter's, and crafted ones all kept, all rejected or partly kept."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import numpy as np
import pytest
from device_testing import open_test_device
from tiny_models import tiny_checkpoint, tiny_drafter

import lily
from lily.checkpoint.dflash import load_dflash
from lily.checkpoint.loader import load_checkpoint
from lily.engine.engine import DeviceEngine
from lily.engine.sampling import SamplingParams
from lily.engine.speculative import Speculation

MAX_SEQ = 128
ANSWER = 16
MARGIN = 1e-2


@pytest.fixture(scope="module")
def engine():
    checkpoint = load_checkpoint(tiny_checkpoint("small"))
    drafter = load_dflash(tiny_drafter("small"), checkpoint.config)
    vocab = checkpoint.config.vocab_size
    return DeviceEngine(checkpoint, open_test_device(), MAX_SEQ, vocab, 16, dflash=drafter)


PROMPT = [int(t) for t in np.random.default_rng(4).integers(0, 900, 21)]


@pytest.fixture(scope="module")
def plain(engine):
    answer = [t.id for t in engine.generate(PROMPT, ANSWER)]
    logits = engine.teacher_forced_logits(PROMPT + answer[:-1])[len(PROMPT) - 1 :]
    top2 = np.sort(logits, axis=-1)[:, -2:]
    near = np.flatnonzero(top2[:, 1] - top2[:, 0] <= MARGIN)
    decided = int(near[0]) if near.size else ANSWER
    assert decided >= ANSWER // 2, "the fixture's answer is undecided too early to test"
    return answer, decided


def test_greedy_output_with_the_random_drafter_is_plain_decoding(engine, plain):
    answer, decided = plain
    calls = []
    draft = engine._dflash.draft

    def recorded(newest, n, position):
        calls.append((newest, n, position))
        return draft(newest, n, position)

    engine._dflash.draft = recorded
    try:
        spec = Speculation(draft_tokens=4, dflash=True)
        tokens = [t.id for t in engine.generate(PROMPT, ANSWER, drafter=spec)]
    finally:
        del engine._dflash.draft
    assert tokens[:decided] == answer[:decided] and len(tokens) == ANSWER
    assert spec.counts["dflash"].passes > 0
    # Each block starts at the newest token, after exactly the context the drafter caught up on.
    context = PROMPT + tokens
    for newest, _, position in calls:
        assert newest == context[position]
    assert engine._dflash_rows == len(context) - 1


@pytest.mark.parametrize(
    ("wrong", "kept"),
    [((), 4), ((1, 2, 3, 4), 0), ((3,), 2)],
    ids=["all kept", "all rejected", "partly"],
)
def test_greedy_output_with_crafted_blocks_is_plain_decoding(engine, plain, wrong, kept):
    answer, decided = plain

    def crafted(newest, n, position):
        done = position - len(PROMPT) + 1  # the newest is generated token done - 1
        right = answer[done : done + n]
        return [t + 1 if row + 1 in wrong else t for row, t in enumerate(right)]

    engine._dflash.draft = crafted
    spec = Speculation(draft_tokens=4, dflash=True)
    outcomes = []
    verified = spec.verified

    def record(drafted, accepted):
        outcomes.append((len(drafted), accepted))
        verified(drafted, accepted)

    spec.verified = record
    try:
        tokens = [t.id for t in engine.generate(PROMPT, ANSWER, drafter=spec)]
    finally:
        del engine._dflash.draft
    assert tokens[:decided] == answer[:decided] and len(tokens) == ANSWER
    # Each pass inside the decided part kept exactly the drafts that were right.
    assert outcomes and spec.counts["dflash"].passes == len(outcomes)
    done = 1
    for drafted, accepted in outcomes:
        if done + drafted < decided:
            assert accepted == min(kept, drafted)
        done += accepted + 1


def test_seeded_sampling_with_the_drafter_is_reproducible(engine):
    sampling = SamplingParams(temperature=1.0, seed=3)
    runs = [
        [
            t.id
            for t in engine.generate(
                PROMPT, 12, sampling=sampling, drafter=Speculation(draft_tokens=3, dflash=True)
            )
        ]
        for _ in range(2)
    ]
    plain = [t.id for t in engine.generate(PROMPT, 12, sampling=sampling)]
    assert runs[0] == runs[1] == plain


def test_a_stop_token_ends_the_drafted_generation_where_plain_decoding_ends(engine, plain):
    answer, decided = plain
    stop = answer[decided // 2]
    spec = Speculation(draft_tokens=4, dflash=True)
    tokens = [t.id for t in engine.generate(PROMPT, ANSWER, stop_token_ids={stop}, drafter=spec)]
    assert tokens == answer[: answer.index(stop) + 1]


# ---- lily.load(speculative="dflash") -------------------------------------------------------------

USER = [{"role": "user", "content": "Tell me a short story about a cat."}]


@pytest.fixture(scope="module")
def demo_pair():
    with (
        lily.load("demo", device="sim", max_seq=MAX_SEQ, speculative="off") as plain_llm,
        lily.load("demo", device="sim", max_seq=MAX_SEQ, speculative="dflash") as dflash_llm,
    ):
        yield plain_llm, dflash_llm


def _answer(llm, **params):
    params = {
        "messages": USER,
        "max_tokens": 16,
        "temperature": 0,
        "reasoning_effort": "none",
        **params,
    }
    return llm.chat.completions.create(**params)


def test_the_demo_answers_the_same_with_its_random_drafter(demo_pair):
    plain_llm, dflash_llm = demo_pair
    speculation = dflash_llm.speculation()
    assert speculation.dflash and not speculation.mtp and not speculation.ngram
    want = _answer(plain_llm)
    assert _answer(dflash_llm).choices[0].message == want.choices[0].message
    content = want.choices[0].message.content
    stop = content[len(content) // 2 : len(content) // 2 + 3]
    got = _answer(dflash_llm, stop=stop)
    assert got.choices[0].message == _answer(plain_llm, stop=stop).choices[0].message
    assert got.choices[0].finish_reason == "stop"
    schema = {
        "type": "json_schema",
        "json_schema": {
            "name": "poem",
            "schema": {"type": "object", "properties": {"title": {"type": "string"}}},
        },
    }
    want_json = _answer(plain_llm, response_format=schema, max_tokens=12)
    got_json = _answer(dflash_llm, response_format=schema, max_tokens=12)
    assert got_json.choices[0].message == want_json.choices[0].message
    assert dflash_llm.engine._dflash_rows > 0  # the drafter followed the generation


def test_dflash_is_refused_where_drafting_cannot_run(tmp_path):
    with pytest.raises(ValueError, match="needs a verify pass of several tokens"):
        lily.load("demo", device="reference", speculative="dflash")
    with pytest.raises(ValueError, match="needs a verify pass of several tokens"):
        lily.load("demo", device="sim", max_seq=64, prefill_chunk=1, speculative="dflash")
    with pytest.raises(ValueError, match="speculative='dflash' drafts for one sequence"):
        lily.load("demo", device="sim", speculative="dflash", parallel=2)
    # A checkpoint that is neither the demo nor the real model needs a dflash/ directory.
    without = tmp_path / "small"
    shutil.copytree(tiny_checkpoint("small"), without, copy_function=os.link)
    shutil.copy(Path(__file__).parent / "chat_template_qwen.jinja", without / "chat_template.jinja")
    with pytest.raises(ValueError, match="has no dflash/ directory"):
        lily.load(str(without), device="sim", max_seq=64, speculative="dflash")
    # With the tiny drafter beside its files, it loads and drafts.
    shutil.copytree(tiny_drafter("small"), without / "dflash")
    with lily.load(str(without), device="sim", max_seq=64, speculative="dflash") as llm:
        assert llm.speculation().dflash and llm.engine._dflash is not None
    # "auto" never chooses it.
    with lily.load("demo", device="sim", max_seq=64) as llm:
        assert not llm.speculation().dflash and llm.engine._dflash is None


def test_the_memory_preflight_counts_the_drafter(monkeypatch):
    """`lily.load` asks the device for the drafter's tensors and its KV cache (K and V rows of
    every drafter layer for each of max_seq positions, bf16) beside the model's own bytes."""
    import lily.device
    from lily.checkpoint.dflash import demo_drafter_dir
    from lily.checkpoint.loader import resolve_model

    asked: list[int] = []
    monkeypatch.setattr(lily.device, "check_memory", lambda kind, nbytes: asked.append(nbytes))
    sizes = dict(max_seq=256, prefill_chunk=64)
    with lily.load("demo", device="sim", speculative="off", **sizes):
        pass
    with lily.load("demo", device="sim", speculative="dflash", **sizes):
        pass
    without, with_drafter = asked
    target = load_checkpoint(resolve_model("demo", None)).config
    drafter = load_dflash(demo_drafter_dir(), target)
    c = drafter.config
    tensors = sum(t.nbytes for t in drafter.tensors.values())
    cache = 2 * c.num_hidden_layers * c.num_key_value_heads * c.head_dim * 2 * 256
    assert with_drafter - without >= tensors + cache
