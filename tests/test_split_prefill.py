"""A prompt fed in two chunks cut at a snapshot mark (every multi-message chat: the chat facade
marks message boundaries) against the same prompt fed in one chunk.

What a cut changes, and only that (docs/architecture.md, "A prefill cut at a snapshot mark"):
gdn_chunk scans a chunk in sub-chunks of CHUNK_SUB_CHUNK tokens counted from the chunk's first
position, so a cut that is not a multiple of CHUNK_SUB_CHUNK moves the sub-chunk boundaries after
it, and with them where the chunkwise form rounds its half operands. Every other kernel computes
each row alike whatever the pass's size, and the snapshot, the KV rows, the conv windows and the
GDN state are handed across the cut unchanged. So:

- a cut at a sub-chunk boundary changes nothing, bit for bit, for the 64 decode steps after it,
  in either KV format, with drafts or without; and a later request that restores the snapshot
  continues exactly as the one that made it;
- a cut anywhere else rounds differently, and stays within rounding of the unsplit prompt for 64
  decode steps. That is measured on a checkpoint whose tokens use every expert: on the others,
  where a token's k-th and next expert are a near-tie (tiny random checkpoints have one every
  few hundred routing decisions) the two feeds may route differently, either choice right, and
  their continuations part later.
"""

from __future__ import annotations

import numpy as np
import pytest
from device_testing import open_test_device
from tiny_models import tiny_checkpoint

from lily.checkpoint.loader import load_checkpoint
from lily.engine.engine import DeviceEngine
from lily.engine.sampling import SamplingParams
from lily.engine.speculative import PredictedTokens, Speculation
from lily.kernels.gdn import CHUNK_SUB_CHUNK

MAX_SEQ = 400
STEPS = 64
LOGPROBS = SamplingParams(temperature=0, top_logprobs=1)
# A cut inside a sub-chunk moves each step's logprob by up to 2e-3 here (measured on the
# unaligned pairs below and (90, 77), (200, 133), bf16 and int8).
TOLERANCE = 1e-2
# (KV cache, drafts, prompt length, cut): cuts at sub-chunk boundaries, early and late in
# prompts of a few to several sub-chunks.
ALIGNED = [("bf16", False, 40, 16), ("int8", True, 130, 112)]
# Cuts inside a sub-chunk, the ones a review first saw parting among them.
UNALIGNED = [("bf16", False, 30, 20), ("int8", False, 60, 30), ("bf16", True, 100, 50)]


@pytest.fixture(scope="module")
def routed():
    return load_checkpoint(tiny_checkpoint("small"))


@pytest.fixture(scope="module")
def unrouted():
    return load_checkpoint(tiny_checkpoint("unrouted"))


def _prompt(checkpoint, length: int, seed: int) -> list[int]:
    # Below the special tokens, as a chat's text would be.
    vocab = checkpoint.config.vocab_size
    return np.random.default_rng(seed).integers(0, vocab - 64, length).tolist()


def _engine(checkpoint, kv_cache: str) -> DeviceEngine:
    vocab = checkpoint.config.vocab_size
    return DeviceEngine(checkpoint, open_test_device(), MAX_SEQ, vocab, kv_cache=kv_cache)


def _run(engine, prompt, cut, drafter=None) -> tuple[list[int], list[float]]:
    generation = engine.generate(prompt, STEPS, sampling=LOGPROBS, snapshot_at=cut, drafter=drafter)
    tokens = list(generation)
    return [t.id for t in tokens], [t.logprobs.logprob for t in tokens]


def _prediction(answer: list[int] | None, prompt: list[int]) -> Speculation | None:
    """The plain answer as a prediction: verify passes that accept most drafts, and reject
    where the drafts run past the answer."""
    if answer is None:
        return None
    return Speculation(draft_tokens=4, prediction=PredictedTokens(answer, prompt[-2:]))


def _unsplit_and_split(checkpoint, kv_cache, drafts, length, cut, restore=True):
    """The generations after the prompt fed whole and cut at `cut` (each on a new engine), and
    (with `restore`) the cut one again on its engine, which restores the snapshot at `cut`."""
    prompt = _prompt(checkpoint, length, seed=length + cut)
    unsplit_engine, split_engine = _engine(checkpoint, kv_cache), _engine(checkpoint, kv_cache)
    answer = _run(unsplit_engine, prompt, None)[0] if drafts else None
    unsplit = _run(unsplit_engine, prompt, None, _prediction(answer, prompt))
    split = _run(split_engine, prompt, cut, _prediction(answer, prompt))
    assert split_engine.cached_prefix_length(prompt) == cut
    if not restore:
        return unsplit, split, None
    restored = _run(split_engine, prompt, cut, _prediction(answer, prompt))
    return unsplit, split, restored


def test_the_aligned_cuts_are_sub_chunk_boundaries_and_the_others_are_not():
    assert all(cut % CHUNK_SUB_CHUNK == 0 for *_, cut in ALIGNED)
    assert all(cut % CHUNK_SUB_CHUNK for *_, cut in UNALIGNED)


@pytest.mark.parametrize(("kv_cache", "drafts", "length", "cut"), ALIGNED)
def test_a_cut_at_a_sub_chunk_boundary_changes_no_decode_step(
    routed, kv_cache, drafts, length, cut
):
    unsplit, split, restored = _unsplit_and_split(routed, kv_cache, drafts, length, cut)
    assert split == unsplit
    assert restored == unsplit


def _assert_within_rounding(split, unsplit) -> None:
    assert split[0] == unsplit[0], "the greedy tokens parted"
    worst = np.abs(np.subtract(split[1], unsplit[1])).max()
    assert worst < TOLERANCE, f"a step's logprob is {worst:.2e} off"


@pytest.mark.parametrize(("kv_cache", "drafts", "length", "cut"), UNALIGNED)
def test_a_cut_inside_a_sub_chunk_stays_within_rounding(unrouted, kv_cache, drafts, length, cut):
    unsplit, split, restored = _unsplit_and_split(unrouted, kv_cache, drafts, length, cut)
    assert len(unsplit[0]) == STEPS
    _assert_within_rounding(split, unsplit)
    assert restored == split


def _lose_conv_windows(engine: DeviceEngine, cut: int) -> None:
    for buffer in engine._model.state.conv_windows.values():
        buffer.numpy()[:] = 0


def _lose_the_last_key_row(engine: DeviceEngine, cut: int) -> None:
    c = engine.config
    for buffer in engine._model.state.k_cache.values():
        rows = buffer.numpy().view(np.uint16).reshape(c.num_key_value_heads, -1, c.head_dim)
        rows[:, cut - 1] = 0


def test_a_state_handed_across_the_cut_wrong_is_seen(unrouted, monkeypatch):
    """The comparison above has the power to see the faults a cut could make: the conv windows
    not handed across, a KV row before the cut lost."""
    kv_cache, drafts, length, cut = UNALIGNED[0]
    unsplit, split, _ = _unsplit_and_split(unrouted, kv_cache, drafts, length, cut, restore=False)
    _assert_within_rounding(split, unsplit)
    take_snapshot = DeviceEngine._take_snapshot
    for fault in (_lose_conv_windows, _lose_the_last_key_row):

        def faulty_snapshot(engine, tokens, fault=fault):
            take_snapshot(engine, tokens)
            fault(engine, len(tokens))

        monkeypatch.setattr(DeviceEngine, "_take_snapshot", faulty_snapshot)
        prompt = _prompt(unrouted, length, seed=length + cut)
        split = _run(_engine(unrouted, kv_cache), prompt, cut)
        with pytest.raises(AssertionError):
            _assert_within_rounding(split, unsplit)
