"""Speculative decoding with the checkpoint's multi-token-prediction head (`speculative="mtp"`):
the head's pass against the float64 reference, its drafts through a whole generation (its KV
cache kept on the accepted tokens across verify passes, rejections, prefill chunks and a
prefix-cache restore), and greedy output equal to plain decoding's.

The heads are random, so their drafts are nearly always rejected: these tests are about the
drafts being the head's (checked against the reference at every pass) and the output being the
model's whatever they are. "Equal to plain decoding" is meant as tests/test_speculative.py
explains: up to the first position where plain decoding's top-2 margin is within rounding.
"""

from __future__ import annotations

import os
import shutil
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
from device_testing import open_test_device
from test_kernel_sampling import P_VALUE_THRESHOLD, chi_square_p_value
from test_speculative import (
    ANSWER,
    MARGIN,
    Recording,
    _prompt,
    _same_as_plain,
    plain_decoding,
)
from tiny_models import echo_head_checkpoint, tiny_checkpoint

import lily
from lily.chat.prediction import PredictedText
from lily.checkpoint.demo import demo_checkpoint_dir
from lily.checkpoint.loader import load_checkpoint
from lily.device import Device, Graph
from lily.engine.engine import DeviceEngine
from lily.engine.model_graph import ModelGraph
from lily.engine.reference import ReferenceModel
from lily.engine.sampling import SamplingParams
from lily.engine.speculative import PredictedTokens, Speculation
from lily.kernels.step import POSITION

MAX_SEQ = 256
# The prompt (43 tokens) is cut into chunks of 16: drafting starts after three chunks.
MAX_CHUNK = 16
# The head's logits against the float64 reference (the engine's KV caches hold bf16, as the
# reference's do with bf16_kv_cache). The prompt's chunk and the head's pass over its rows run
# the chunk kernels, whose 2-byte operands (the GEMMs' half, attention's bfloat P, the GDN
# chunk's half) hold prefill to the engine tests' 1e-2 of the reference (tests/test_prefill.py);
# observed up to 4.5e-3 here with the GEMMs' alone, 2.9e-3 with the attention and GDN's alone
# (about 1e-4 with fp32 operands).
LOGIT_TOLERANCE = 1e-2


def _reference(checkpoint) -> ReferenceModel:
    return ReferenceModel(checkpoint.config, checkpoint.tensors, np.float64, bf16_kv_cache=True)


def _reference_drafts(
    reference: ReferenceModel, hidden: np.ndarray, context: list[int], drafts: list[int]
) -> list[np.ndarray]:
    """The head's logits for each of `drafts` after `context`, as the reference computes them:
    over the context's rows (hidden states of the whole sequence, teacher-forced), then
    chained on the given drafts."""
    state = reference.new_state()
    newest = len(context) - 1
    logits, out = reference.mtp(hidden[:newest], context[1:], 0, state)
    rows = [logits[-1]]
    for i, draft in enumerate(drafts[:-1]):
        logits, out = reference.mtp(out[-1:], [draft], newest + i, state)
        rows.append(logits[-1])
    return rows


def _assert_drafts_are_the_heads(checkpoint, sequence: list[int], calls) -> None:
    """Each recorded (context, drafts) call drafted what the reference head drafts: the same
    token wherever the reference's top-2 margin is clear of rounding."""
    reference = _reference(checkpoint)
    hidden = reference.hidden_states(sequence, reference.new_state())
    checked = 0
    for context, drafts in calls:
        assert context == sequence[: len(context)]
        rows = _reference_drafts(reference, hidden, context, drafts)
        for draft, row in zip(drafts, rows, strict=True):
            top2 = np.sort(row)[-2:]
            if top2[1] - top2[0] > MARGIN:
                assert draft == int(np.argmax(row))
                checked += 1
    assert checked >= len(calls)


# ---- the head's pass ---------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["small", "wide", "demo"])
def test_the_heads_pass_is_the_reference_head(name):
    """The prompt's chunk, then the head over its 21 rows (each with the token after it, the
    last one the drawn token), then two chained steps: logits and output as the reference's."""
    path = demo_checkpoint_dir() if name == "demo" else tiny_checkpoint(name, mtp_head=True)
    checkpoint = load_checkpoint(path)
    vocab = checkpoint.config.vocab_size
    model = ModelGraph(checkpoint, open_test_device(), 64, vocab, 32, mtp=True)
    prompt = np.random.default_rng(3).integers(0, vocab - 64, 21).tolist()
    history, step = model.history_view(), model.step_view()
    history[: len(prompt)] = prompt
    step[:3] = 0, len(prompt), prompt[0]
    model.device.run(model.graph(len(prompt), predicts=True))
    drawn = int(history[len(prompt)])
    model.mtp_step_view()[0] = 0
    model.device.run(model.mtp_graph(len(prompt), chained=False, head=True))

    reference = _reference(checkpoint)
    state = reference.new_state()
    hidden = reference.hidden_states(prompt, state)
    logits, out = reference.mtp(hidden, [*prompt[1:], drawn], 0, state)
    head_out = model.mtp_out.numpy().view(np.float32)
    assert np.abs(model.mtp_logits_view() - logits[-1]).max() < LOGIT_TOLERANCE
    assert np.abs(head_out - out[-1]).max() < LOGIT_TOLERANCE
    for position in (len(prompt), len(prompt) + 1):
        draft = int(np.argmax(model.mtp_logits_view()))
        history[position + 1] = draft
        model.mtp_step_view()[0] = position
        model.device.run(model.mtp_graph(1, chained=True, head=True))
        logits, out = reference.mtp(out[-1:], [draft], position, state)
        assert np.abs(model.mtp_logits_view() - logits[-1]).max() < LOGIT_TOLERANCE


@pytest.mark.parametrize("name", ["small", "demo"])
def test_drafts_chained_on_the_device_are_the_host_chained_drafts(name):
    """`mtp_draft_graph`: the head over the prompt's rows then three chained passes, each
    argmax taken on the device, in one run, drafts what the same passes run one at a time with
    the host's np.argmax draft, and leaves the head's step at the last draft's token."""
    path = demo_checkpoint_dir() if name == "demo" else tiny_checkpoint(name, mtp_head=True)
    checkpoint = load_checkpoint(path)
    vocab = checkpoint.config.vocab_size
    model = ModelGraph(checkpoint, open_test_device(), 64, vocab, 32, mtp=True)
    prompt = np.random.default_rng(5).integers(0, vocab - 64, 13).tolist()
    n = len(prompt)
    history, step = model.history_view(), model.step_view()
    history[:n] = prompt
    step[:3] = 0, n, prompt[0]
    model.device.run(model.graph(n, predicts=True))
    model.mtp_step_view()[0] = 0
    model.device.run(model.mtp_graph(n, chained=False, head=True))
    expected = []
    for position in range(n, n + 4):
        expected.append(int(np.argmax(model.mtp_logits_view()[: model.token_count])))
        history[position + 1] = expected[-1]
        model.mtp_step_view()[0] = position
        model.device.run(model.mtp_graph(1, chained=True, head=True))
    history[n + 1 :] = 0
    model.mtp_step_view()[0] = 0
    model.device.run(model.mtp_draft_graph(n, 4))
    assert history[n + 1 : n + 5].tolist() == expected
    assert model.mtp_step_view()[0] == n + 3


def test_the_head_drafts_from_its_draft_vocabulary():
    """With a draft vocabulary of the first 300 ids, the head's lm_head computes only their
    logits, the same as the whole head's, and drafts the largest of them."""
    checkpoint = load_checkpoint(tiny_checkpoint("small", mtp_head=True))
    vocab = checkpoint.config.vocab_size
    assert vocab > 300
    prompt = np.random.default_rng(9).integers(0, vocab - 64, 11).tolist()
    logits = []
    for draft_vocab in (vocab, 300):
        model = ModelGraph(
            checkpoint, open_test_device(), 64, vocab, 32, mtp=True, draft_vocab=draft_vocab
        )
        history, step = model.history_view(), model.step_view()
        history[: len(prompt)] = prompt
        step[:3] = 0, len(prompt), prompt[0]
        model.device.run(model.graph(len(prompt), predicts=True))
        model.mtp_step_view()[0] = 0
        model.device.run(model.mtp_draft_graph(len(prompt), 1))
        logits.append(model.mtp_logits_view()[:draft_vocab].copy())
        drafted = int(model.mtp_drafts_view()[0])
    np.testing.assert_array_equal(logits[1], logits[0][:300])
    assert drafted == int(np.argmax(logits[0][:300]))


def test_an_mtp_graph_needs_a_head_and_verify_passes():
    plain = load_checkpoint(tiny_checkpoint("small"))
    with pytest.raises(ValueError, match="no multi-token-prediction head"):
        ModelGraph(plain, open_test_device(), 64, 1024, 16, mtp=True)
    headed = load_checkpoint(tiny_checkpoint("small", mtp_head=True))
    with pytest.raises(ValueError, match="max_chunk >= 2"):
        ModelGraph(headed, open_test_device(), 64, 1024, 1, mtp=True)


# ---- generations -------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def checkpoint():
    return load_checkpoint(tiny_checkpoint("small", mtp_head=True))


def _engine(checkpoint) -> DeviceEngine:
    vocab = checkpoint.config.vocab_size
    return DeviceEngine(checkpoint, open_test_device(), MAX_SEQ, vocab, MAX_CHUNK, mtp=True)


@pytest.fixture(scope="module")
def engine(checkpoint):
    return _engine(checkpoint)


@pytest.fixture(scope="module")
def plain(checkpoint, engine):
    """Plain greedy decoding on the same engine, one pass at a time (see test_speculative)."""
    prompt = _prompt(checkpoint) + [3, 1, 4]  # 43 tokens: three chunks of at most 16
    return plain_decoding(engine, prompt)


@pytest.fixture
def head_calls(monkeypatch):
    """Every time the head drafts: (the context it drafts after, its drafts, the recurrent
    state and the step position then), whether the host takes the drafts (under a constraint)
    or the device does, in the verify pass's submission or queued behind the pass before
    (`_submit_ahead`, whose context and state are those that pass left)."""
    calls = []
    host_drafts, device_drafts = DeviceEngine._mtp_drafts, DeviceEngine._submit_head_drafts
    ahead = DeviceEngine._submit_ahead

    def before(engine) -> tuple[list[int], list[np.ndarray], int]:
        model = engine._model
        start, rows = engine._mtp_pending
        context = [int(t) for t in model.history_view()[: start + rows + 1]]
        state = [b.numpy().copy() for b in model.state.recurrent_buffers()]
        return context, state, int(model.step_view()[POSITION])

    def on_host(self, limit):
        context, state, position = before(self)
        out = host_drafts(self, limit)
        calls.append((context, out, state, position))
        return out

    def on_device(self, newest, count):
        context, state, position = before(self)
        device_drafts(self, newest, count)
        # Only the recording waits for the drafts before the verify pass is submitted.
        self.device.wait(self.device.submit(Graph()))
        drafts = [int(t) for t in self._model.mtp_drafts_view()[:count]]
        calls.append((context, drafts, state, position))

    def queued(self, request, pending, generated, drafter):
        if not pending.on_device:  # no verify pass of the head's drafts ahead: nothing queued
            return ahead(self, request, pending, generated, drafter)
        # Only the recording waits for the pass ahead, then for the drafts queued behind it.
        self.device.wait(self.device.submit(Graph()))
        model = self._model
        newest = int(model.verify_position_view()[0])
        context = [int(t) for t in model.history_view()[: newest + 1]]
        state = [b.numpy().copy() for b in model.state.recurrent_buffers()]
        position = int(model.step_view()[POSITION])
        submitted = ahead(self, request, pending, generated, drafter)
        if submitted is not None:
            self.device.wait(self.device.submit(Graph()))
            drafts = [int(t) for t in model.mtp_drafts_view()[: submitted.count]]
            calls.append((context, drafts, state, position))
        return submitted

    monkeypatch.setattr(DeviceEngine, "_mtp_drafts", on_host)
    monkeypatch.setattr(DeviceEngine, "_submit_head_drafts", on_device)
    monkeypatch.setattr(DeviceEngine, "_submit_ahead", queued)
    return calls


def test_greedy_output_with_the_head_is_plain_decoding(checkpoint, engine, plain, head_calls):
    prompt, answer, states, decided = plain
    drafter = Recording(draft_tokens=4, mtp=True)
    tokens = [t.id for t in engine.generate(prompt, ANSWER, drafter=drafter)]
    _same_as_plain(tokens, plain)
    counts = drafter.counts["mtp"]
    assert counts.passes >= 4 and counts.drafted > counts.passes  # chained past one draft
    assert any(accepted < drafted for drafted, accepted in drafter.outcomes)
    # The drafts were the head's at every pass: its KV rows followed the accepted tokens
    # through the prompt's chunks, verify passes and rejections.
    _assert_drafts_are_the_heads(checkpoint, prompt + answer[:decided], [
        (context, drafts) for context, drafts, _, _ in head_calls
        if len(context) <= len(prompt) + decided
    ])  # fmt: skip
    # After a rejection the state is the one plain decoding had at that token: the chunk
    # kernels sum in another order than the decode step's, and gdn_chunk's half operands put
    # its state about 2^-11 of the largest entry from it (measured 1.5e-4 of it here;
    # tests/test_prefill.py's GDN_STATE_DRIFT), as in tests/test_speculative.py.
    caught_up = [
        (len(context), state)
        for context, _, state, position in head_calls
        if position == len(context) - 1 and len(context) - len(prompt) <= decided
    ]
    assert len(caught_up) >= 3
    for length, state in caught_up:
        expected = states[length - len(prompt) - 1]
        for a, b in zip(state, expected, strict=True):
            a, b = a.view(np.float32), b.view(np.float32)
            assert np.abs(a - b).max() <= 2.0**-9 * max(1.0, np.abs(b).max())


@pytest.fixture
def device_calls(monkeypatch) -> list[str]:
    """Every submission ("submit") and every time the host waits for the device ("run": a
    synchronous run, "wait": for submitted work; the waits are what
    `benchmarks/bench_speculative.py` counts as host round trips), in order."""
    calls: list[str] = []
    submit, run, wait = Device.submit, Device.run, Device.wait

    def counted_submit(self, graph):
        calls.append("submit")
        return submit(self, graph)

    def counted_run(self, graph):
        calls.append("run")
        return run(self, graph)

    def counted_wait(self, ticket):
        calls.append("wait")
        return wait(self, ticket)

    monkeypatch.setattr(Device, "submit", counted_submit)
    monkeypatch.setattr(Device, "run", counted_run)
    monkeypatch.setattr(Device, "wait", counted_wait)
    return calls


def _waits(calls: list[str]) -> int:
    return sum(call != "submit" for call in calls)


def _passes(engine, prompt: list[int], tokens: list[int], outcomes) -> int:
    """The device passes of a generation of `tokens` after `prompt` with verify passes of
    `outcomes` (drafted, accepted): the prompt's chunks' command buffers, the verify passes,
    and one plain pass for each token neither yielded (a verify pass yields its accepted drafts
    and the model's own token, the prompt's last chunk the first token)."""
    model = engine.model_graph
    chunks = [
        (start, min(MAX_CHUNK, len(prompt) - start)) for start in range(0, len(prompt), MAX_CHUNK)
    ]
    prompt_buffers = sum(
        model.graph(n, predicts=start + n == len(prompt)).command_buffer_count
        for start, n in chunks
    )
    from_verify = sum(accepted + 1 for _, accepted in outcomes)
    plain_passes = len(tokens) - 1 - from_verify
    assert plain_passes >= 0
    return prompt_buffers + len(outcomes) + plain_passes


def test_each_pass_with_the_head_waits_for_the_device_once(engine, plain, device_calls):
    """Issue 39: the head's drafts, its argmax, the verify pass and the acceptance are one
    submission and one wait; its catch-up over a prompt chunk's rows is queued behind the
    chunk, and none runs for a last pass after which nothing is drafted."""
    prompt, _, _, _ = plain
    drafter = Recording(draft_tokens=4, mtp=True)
    device_calls.clear()
    tokens = [t.id for t in engine.generate(prompt, ANSWER, drafter=drafter)]
    assert len(tokens) == ANSWER and drafter.counts["mtp"].passes >= 4
    assert _waits(device_calls) == _passes(engine, prompt, tokens, drafter.outcomes)


def test_a_prediction_drafting_beside_the_head_waits_once_per_pass(echo, device_calls):
    """Where the prediction drafts, the head still reads each pass's rows (it drafts after the
    prediction ends): that catch-up is queued ahead of the verify pass, with no wait of its
    own."""
    engine, prompt, answer = echo
    prediction = PredictedTokens(answer[:12], prompt[-2:])
    drafter = Recording(draft_tokens=4, mtp=True, prediction=prediction)
    device_calls.clear()
    tokens = [t.id for t in engine.generate(prompt, ANSWER, drafter=drafter)]
    assert tokens == answer
    assert drafter.counts["prediction"].passes >= 2 and drafter.counts["mtp"].passes >= 2
    assert _waits(device_calls) == _passes(engine, prompt, tokens, drafter.outcomes)


def test_the_next_pass_is_queued_before_the_pass_ahead_of_it_is_read(echo, device_calls):
    """With the head drafting on the device, each pass (the head's catch-up and drafts, then
    the verify pass) is queued behind the one before it before the host reads that one: the
    device goes from pass to pass without waiting for the host, two in flight as two decode
    steps are. Only the first is submitted after a read (of the prompt's token), and nothing
    is queued behind the pass that may yield the last token."""
    engine, prompt, answer = echo
    drafter = Recording(draft_tokens=4, mtp=True)
    before = replace(engine.speculative_pipeline)
    received = []
    for token in engine.generate(prompt, ANSWER, drafter=drafter):
        received.append((token.id, list(device_calls)))
    assert [token for token, _ in received] == answer
    # What the device was asked between a pass's first token and the token before it.
    pairs = zip(received, received[1:], strict=False)
    groups = [at[len(before) :] for (_, before), (_, at) in pairs]
    groups = [group for group in groups if group]
    passes = drafter.counts["mtp"].passes
    assert len(groups) == passes >= 4
    # The first pass (the head's drafts, the verify pass), the second queued, the first read.
    assert groups[0] == ["submit"] * 4 + ["wait"]
    for group in groups[1:-1]:  # the next pass queued, then this one read
        assert group == ["submit", "submit", "wait"]
    assert groups[-1] == ["wait"]  # the last pass: nothing behind it
    assert _waits(device_calls) == _passes(engine, prompt, answer, drafter.outcomes)
    pipeline = engine.speculative_pipeline
    assert pipeline.ahead - before.ahead == passes - 1
    assert pipeline.after_read - before.after_read == 1


def test_a_stop_token_ends_a_generation_drafting_with_the_head(engine, plain):
    prompt, answer, _, decided = plain
    stop = answer[min(decided, 10) - 1]
    drafter = Speculation(draft_tokens=4, mtp=True)
    tokens = [t.id for t in engine.generate(prompt, ANSWER, {stop}, drafter=drafter)]
    assert tokens == answer[: answer.index(stop) + 1]


def test_a_rejection_right_after_a_prefix_cache_restore(checkpoint, plain, head_calls):
    prompt, answer, _, decided = plain
    engine = _engine(checkpoint)
    list(engine.generate(prompt[:20], 2, snapshot_at=16, drafter=Speculation(mtp=True)))
    assert engine.cached_prefix_length(prompt) == 16
    head_calls.clear()
    drafter = Recording(draft_tokens=4, mtp=True)
    tokens = [t.id for t in engine.generate(prompt, ANSWER, drafter=drafter)]
    _same_as_plain(tokens, plain)
    assert drafter.outcomes[0][1] < drafter.outcomes[0][0]
    # The head's rows of the restored 16 tokens came back with the prefix: its drafts are
    # still the reference's.
    _assert_drafts_are_the_heads(checkpoint, prompt + answer[:decided], [
        (context, drafts) for context, drafts, _, _ in head_calls[:3]
    ])  # fmt: skip


# ---- through the API ---------------------------------------------------------------------------

NO_THINKING = {"chat_template_kwargs": {"enable_thinking": False}}
USER = [{"role": "user", "content": "Hi"}]


@pytest.fixture(scope="module")
def demo_pair():
    with (
        lily.load("demo", device="sim", max_seq=MAX_SEQ, speculative="off") as plain_llm,
        lily.load("demo", device="sim", max_seq=MAX_SEQ, speculative="mtp") as head_llm,
    ):
        yield plain_llm, head_llm


def _answer(llm, **params):
    params = {"messages": USER, "max_tokens": 16, "temperature": 0, **NO_THINKING, **params}
    return llm.chat.completions.create(**params)


def test_the_demo_answers_the_same_with_the_head(demo_pair):
    plain_llm, head_llm = demo_pair
    assert head_llm.mtp_head and head_llm.speculation().mtp
    want = _answer(plain_llm)
    assert _answer(head_llm).choices[0].message == want.choices[0].message
    content = want.choices[0].message.content
    stop = content[len(content) // 2 : len(content) // 2 + 3]
    want_stopped = _answer(plain_llm, stop=stop)
    got = _answer(head_llm, stop=stop)
    assert got.choices[0].message == want_stopped.choices[0].message
    assert got.choices[0].finish_reason == "stop"
    schema = {
        "type": "json_schema",
        "json_schema": {
            "name": "poem",
            "schema": {"type": "object", "properties": {"title": {"type": "string"}}},
        },
    }
    want_json = _answer(plain_llm, response_format=schema, max_tokens=12)
    got_json = _answer(head_llm, response_format=schema, max_tokens=12)
    assert got_json.choices[0].message == want_json.choices[0].message


def test_auto_drafts_with_the_head_when_the_checkpoint_has_one(tmp_path):
    with lily.load("demo", device="sim", max_seq=64) as llm:
        assert llm.speculative == "auto" and llm.mtp_head
        speculation = llm.speculation()
        assert speculation.mtp and not speculation.ngram and speculation.auto
        # With a prediction that drafts from the reply's start the head sits out: it would run
        # over every pass to draft only where the prediction has nothing to. It stays for a
        # reply that opens with a think block (the prediction drafts only the answer), and
        # "mtp" keeps it.
        prediction = PredictedTokens([1, 2, 3])
        speculation = llm.speculation(prediction)
        assert not speculation.mtp and speculation.prediction is prediction
        assert llm.speculation().mtp
        after_thinking = PredictedText(llm.tokenizer, "x", [(0, 1)], reply_start=3, thinking=True)
        assert llm.speculation(after_thinking).mtp
        llm.speculative = "mtp"
        assert llm.speculation(prediction).mtp
    # A tiny checkpoint without a head, with a chat template so that lily.load takes it.
    without = tmp_path / "small"
    shutil.copytree(tiny_checkpoint("small"), without, copy_function=os.link)
    shutil.copy(Path(__file__).parent / "chat_template_qwen.jinja", without / "chat_template.jinja")
    with lily.load(str(without), device="sim", max_seq=64) as llm:
        assert not llm.mtp_head and llm.speculation().ngram
    with pytest.raises(ValueError, match="needs the checkpoint's multi-token-prediction head"):
        lily.load(without, device="sim", max_seq=64, speculative="mtp")


def test_passes_of_one_token_turn_drafting_off():
    """A verify pass needs several tokens: a prefill_chunk of 1, or a context of one token
    (whose default chunk is 1), turns "auto" off and refuses "ngram"."""
    with lily.load("demo", device="sim", max_seq=1) as llm:
        assert llm.speculative == "off" and not llm.mtp_head
    for options in ({"max_seq": 1}, {"max_seq": 64, "prefill_chunk": 1}):
        with pytest.raises(ValueError, match="needs a verify pass of several tokens"):
            lily.load("demo", device="sim", speculative="ngram", **options)


def test_the_head_drafts_over_an_int8_kv_cache():
    """The head's own KV cache takes the engine's format: with an int8 cache the demo loads,
    and drafting with the head answers as plain int8 decoding does."""
    common = dict(device="sim", max_seq=MAX_SEQ, kv_cache="int8")
    with (
        lily.load("demo", **common, speculative="off") as plain_llm,
        lily.load("demo", **common, speculative="mtp") as head_llm,
    ):
        model = head_llm.engine._model
        rows = model.state.k_cache[model.mtp_layer].size // MAX_SEQ
        assert rows == model.state.k_cache[model.config.full_attention_layers[0]].size // MAX_SEQ
        assert head_llm.mtp_head and head_llm.speculation().mtp
        assert _answer(head_llm).choices[0].message == _answer(plain_llm).choices[0].message


# ---- a head that predicts what the model predicts ----------------------------------------------


@pytest.fixture(scope="module")
def echo(tmp_path_factory):
    """(engine, prompt, plain greedy answer) of the echo-head checkpoint."""
    checkpoint = load_checkpoint(echo_head_checkpoint(tmp_path_factory.mktemp("echo") / "ckpt"))
    engine = _engine(checkpoint)
    prompt = _prompt(checkpoint) + [3, 1, 4]
    answer = [t.id for t in engine.generate(prompt, ANSWER)]
    return engine, prompt, answer


def test_a_head_predicting_the_model_has_its_drafts_accepted(echo):
    """All-accepted passes with the head: k drafts and the model's token per pass, the head's KV
    rows and hidden states following along, and the answer the model's."""
    engine, prompt, answer = echo
    drafter = Recording(draft_tokens=4, mtp=True)
    tokens = [t.id for t in engine.generate(prompt, ANSWER, drafter=drafter)]
    assert tokens == answer
    counts = drafter.counts["mtp"]
    assert counts.accepted == counts.drafted
    assert all(accepted == drafted == 4 for drafted, accepted in drafter.outcomes[:-1])
    # 1 token from the prompt's pass, then 5 per pass.
    assert counts.passes == -(-(ANSWER - 1) // 5)


def test_a_pass_queued_behind_the_one_that_stops_is_dropped(echo):
    """A stop token in a pass that has the next one queued behind it: the generation ends
    there, the queued pass is waited for and its tokens dropped, and what it wrote (the state
    past the stop token, the step, the head's rows) changes nothing after: the same prompt,
    restored from the prefix cache, answers as before, with the head and without."""
    engine, prompt, answer = echo
    stop = answer[12]  # in the third pass, which has the fourth queued behind it
    cut = len(prompt) - 3
    drafter = Recording(draft_tokens=4, mtp=True)
    before = replace(engine.speculative_pipeline)
    tokens = [
        t.id for t in engine.generate(prompt, ANSWER, {stop}, snapshot_at=cut, drafter=drafter)
    ]
    assert tokens == answer[: answer.index(stop) + 1]
    pipeline = engine.speculative_pipeline
    submitted = pipeline.ahead - before.ahead + pipeline.after_read - before.after_read
    assert submitted == drafter.counts["mtp"].passes + 1  # one pass dropped unread
    assert engine.cached_prefix_length(prompt) == cut
    again = [t.id for t in engine.generate(prompt, ANSWER, drafter=Speculation(mtp=True))]
    assert again == answer
    assert [t.id for t in engine.generate(prompt, ANSWER)] == answer


def test_log_probabilities_with_two_passes_in_flight(echo):
    """Eight drafts a pass with log-probabilities asked: the queued pass drafts fewer, so that
    its rows never share a slot of the sampler's ring with the rows of the pass ahead of it
    that the host reads meanwhile; every token's log-probabilities are plain decoding's (to
    the verify rows' rounding). A negative frequency penalty makes the model repeat itself
    where the head echoes the unpenalised model, so that passes keep some or none of their
    drafts."""
    engine, prompt, _ = echo
    params = SamplingParams(temperature=0.0, frequency_penalty=-2.0, top_logprobs=3)
    expected = list(engine.generate(prompt, ANSWER, sampling=params))
    drafter = Recording(draft_tokens=8, mtp=True)
    before = replace(engine.speculative_pipeline)
    got = list(engine.generate(prompt, ANSWER, sampling=params, drafter=drafter))
    assert [t.id for t in got] == [t.id for t in expected]
    for a, b in zip(got, expected, strict=True):
        assert abs(a.logprobs.logprob - b.logprobs.logprob) < 1e-2
        assert [t for t, _ in a.logprobs.top] == [t for t, _ in b.logprobs.top]
    assert engine.speculative_pipeline.ahead - before.ahead >= 2
    assert any(0 < accepted < drafted for drafted, accepted in drafter.outcomes)
    drafted = [d for d, _ in drafter.outcomes]
    assert drafted[0] == 8 and all(a + b <= 14 for a, b in zip(drafted, drafted[1:], strict=False))


TEMPERATURE = 0.2


def test_sampled_output_with_the_head_is_reproducible_and_the_models_distribution(echo):
    """Sampling at temperature 0.2 (the model's most likely token then has about even odds), the
    head drafting greedily, so drafts are accepted and rejected: a seed gives the same answer
    twice, and the answers' tokens, pooled over seeds, follow the model's distribution: for a
    token y drawn after t (the bigram model's next-token distribution p_t = softmax(l(t) / T),
    l(t) its logits after t alone), u = P_t(< y) + V p_t(y) with V uniform is uniform on [0, 1]
    exactly when y ~ p_t (a randomised probability integral transform), so the u's pass a
    chi-square test against equal bins; drafts accepted with probability p(draft), not more."""
    engine, prompt, _ = echo
    params = [SamplingParams(temperature=TEMPERATURE, seed=seed) for seed in range(8)]
    runs, accepted, drafted = [], 0, 0
    for sampling in params:
        drafter = Speculation(draft_tokens=4, mtp=True)
        tokens = [t.id for t in engine.generate(prompt, ANSWER, sampling=sampling, drafter=drafter)]
        accepted += drafter.counts["mtp"].accepted
        drafted += drafter.counts["mtp"].drafted
        runs.append(tokens)
    assert 0.2 * drafted < accepted < 0.9 * drafted
    again = engine.generate(prompt, ANSWER, sampling=params[3], drafter=Speculation(mtp=True))
    assert [t.id for t in again] == runs[3]
    pairs = [
        (before, token)
        for tokens in runs
        for before, token in zip([prompt[-1], *tokens], tokens, strict=False)
    ]
    # The bigram model's logits after t alone (row i of a sequence is the same after anything).
    befores = sorted({before for before, _ in pairs})
    logits = {}
    for start in range(0, len(befores), 128):
        chunk = befores[start : start + 128]
        logits.update(zip(chunk, engine.teacher_forced_logits(chunk), strict=True))
    rng = np.random.default_rng(0)
    u = []
    for before, token in pairs:
        z = logits[before].astype(np.float64) / TEMPERATURE
        p = np.exp(z - z.max())
        p /= p.sum()
        u.append(p[:token].sum() + rng.random() * p[token])
    bins = np.bincount(np.minimum((np.array(u) * 10).astype(int), 9), minlength=10)
    assert chi_square_p_value(bins, np.full(10, 0.1)) > P_VALUE_THRESHOLD
