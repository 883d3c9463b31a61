"""Image tokens in the language model, on the tiny checkpoints' random tower: the prompt's image
runs checked against the images, the multimodal rotary positions (M-RoPE), the reference and the
device engine (sim) against mlx-vlm (the pinned oracle, CPU MLX, float32) on an image + text
prompt built as the reference processor builds it, and the prefix cache keyed by image content.
"""

from __future__ import annotations

import dataclasses
import functools
import io

import numpy as np
import pytest
from device_testing import open_test_device
from PIL import Image
from tiny_models import tiny_checkpoint

from lily.chat.images import ProcessorConfig, preprocess_image
from lily.checkpoint.loader import load_checkpoint
from lily.engine.engine import DeviceEngine, ReferenceEngine
from lily.engine.image_input import ImagePatches
from lily.engine.image_tokens import (
    IMAGE_KEY_BASE,
    PromptImages,
    cache_tokens,
    image_runs,
    rope_positions,
)
from lily.engine.prefix_disk import DiskPrefixCache, StateLayout
from lily.engine.reference import ChunkRounding, ReferenceModel
from lily.engine.speculative import PredictedTokens, Speculation
from lily.errors import ImagesUnsupportedError, ImageTokensError

# test_reference.py's bound for the reference against mlx-lm, test_engine.py's and
# test_prefill.py's for the device engine against the reference.
REFERENCE_TOLERANCE = 1e-3
DEVICE_TOLERANCE = 1e-2
MAX_SEQ = 256
CONTINUATION = 8


def image(width: int, height: int, seed: int) -> ImagePatches:
    pixels = np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, "PNG")
    return preprocess_image(out.getvalue(), ProcessorConfig())


@pytest.fixture(scope="module")
def checkpoint():
    return load_checkpoint(tiny_checkpoint("small"))


@pytest.fixture(scope="module")
def reference(checkpoint) -> ReferenceEngine:
    return ReferenceEngine(checkpoint, MAX_SEQ, checkpoint.config.vocab_size)


# A wide image (14 x 20 patches: 70 tokens) and a tall one (30 x 10 patches: 75 tokens).
WIDE, TALL = image(300, 200, seed=1), image(160, 480, seed=2)


def vision_block(config, patches: ImagePatches) -> list[int]:
    """What the processor makes of one image part: start, the image's tokens, end."""
    start = config.vision_start_token_id
    return [start, *[config.image_token_id] * patches.num_tokens, start + 1]


def two_image_prompt(config) -> list[int]:
    return [5, 6, 7, *vision_block(config, WIDE), 40, 41, *vision_block(config, TALL), 9, 10, 11]


@functools.cache
def mlx_vlm_model():
    import mlx.core as mx
    from mlx_vlm.utils import load_model

    model = load_model(tiny_checkpoint("small", aligned=False))
    model.set_dtype(mx.float32)
    return model


def mlx_vlm_run(prompt: list[int], images: list[ImagePatches], steps: int):
    """mlx-vlm's logits over the prompt [P, V], its greedy tokens after it, and the logits
    each decode step gave [steps, V]."""
    import mlx.core as mx
    from mlx_vlm.models.cache import make_prompt_cache

    model = mlx_vlm_model()
    cache = make_prompt_cache(model.language_model)
    out = model(
        mx.array([prompt]),
        cache=cache,
        pixel_values=mx.array(np.concatenate([i.pixel_values for i in images])),
        image_grid_thw=mx.array([list(i.grid_thw) for i in images]),
    )
    prompt_logits = np.array(out.logits[0])
    tokens, step_logits = [int(np.argmax(prompt_logits[-1]))], []
    while len(tokens) < steps:
        step = model.language_model(mx.array([[tokens[-1]]]), cache=cache)
        step_logits.append(np.array(step.logits[0, -1]))
        tokens.append(int(np.argmax(step_logits[-1])))
    return prompt_logits, tokens, np.array(step_logits)


def decided(logits: np.ndarray, tolerance: float) -> int:
    """How many of the greedy draws from these rows are not near-ties."""
    top_two = np.sort(logits, axis=-1)[:, -2:]
    undecided = np.flatnonzero(top_two[:, 1] - top_two[:, 0] <= tolerance)
    return int(undecided[0]) if undecided.size else len(logits)


# ---- the prompt's runs and positions ---------------------------------------------------------


def test_rope_positions_equal_mlx_vlm_get_rope_index(checkpoint) -> None:
    import mlx.core as mx

    config = checkpoint.config
    prompt = two_image_prompt(config)
    runs = image_runs(prompt, [WIDE, TALL], config)
    assert [r.start for r in runs] == [4, 4 + WIDE.num_tokens + 4]
    positions, offset = rope_positions(len(prompt), runs)
    grids = mx.array([list(WIDE.grid_thw), list(TALL.grid_thw)])
    expected, deltas = mlx_vlm_model().language_model.get_rope_index(mx.array([prompt]), grids)
    np.testing.assert_array_equal(positions, np.array(expected)[:, 0])
    assert offset == int(np.array(deltas)[0, 0]) < 0


def test_runs_that_do_not_match_the_images_are_refused(checkpoint) -> None:
    config = checkpoint.config
    prompt = two_image_prompt(config)
    with pytest.raises(ImageTokensError, match="2 run"):
        image_runs(prompt, [WIDE], config)
    with pytest.raises(ImageTokensError, match="image 0 has 75 tokens"):
        image_runs(prompt, [TALL, WIDE], config)
    # Without images a prompt is text, whatever ids it holds (fed as before images existed).
    assert image_runs(prompt, [], config) == []
    text_only = dataclasses.replace(config, image_token_id=None)
    with pytest.raises(ImagesUnsupportedError):
        image_runs(prompt, [WIDE, TALL], text_only)


def test_engines_refuse_mismatched_runs_before_running(checkpoint, reference) -> None:
    prompt = two_image_prompt(checkpoint.config)
    with pytest.raises(ImageTokensError) as raised:
        next(reference.generate(prompt, 2, images=[WIDE]))
    assert raised.value.status == 400 and raised.value.code == "image_tokens_mismatch"
    with pytest.raises(ImageTokensError):
        reference.prompt_logits(prompt, images=[WIDE, WIDE])


def test_cache_tokens_stand_for_the_image_content(checkpoint) -> None:
    config = checkpoint.config
    prompt = [1, *vision_block(config, WIDE), 2]
    other = image(300, 200, seed=3)  # same grid, other pixels
    same = cache_tokens(prompt, image_runs(prompt, [WIDE], config))
    again = cache_tokens(prompt, image_runs(prompt, [image(300, 200, seed=1)], config))
    different = cache_tokens(prompt, image_runs(prompt, [other], config))
    assert same == again
    run = slice(2, 2 + WIDE.num_tokens)
    assert all(IMAGE_KEY_BASE <= t < 1 << 32 for t in same[run])
    assert len(set(same[run])) == WIDE.num_tokens
    assert same[:2] == different[:2] == prompt[:2] and same[2] != different[2]
    assert same[run.stop :] == prompt[run.stop :]


# ---- against mlx-vlm ---------------------------------------------------------------------------


def test_reference_logits_match_mlx_vlm(checkpoint, reference) -> None:
    prompt = two_image_prompt(checkpoint.config)
    expected, tokens, step_logits = mlx_vlm_run(prompt, [WIDE, TALL], CONTINUATION)
    logits = reference.teacher_forced_logits(prompt + tokens[:-1], images=[WIDE, TALL])
    np.testing.assert_allclose(logits[: len(prompt)], expected, rtol=0, atol=REFERENCE_TOLERANCE)
    np.testing.assert_allclose(logits[len(prompt) :], step_logits, atol=REFERENCE_TOLERANCE)
    # Without M-RoPE (each token rotated by its index) the bound fails: the test can tell.
    model = ReferenceModel(checkpoint.config, checkpoint.tensors)
    images = PromptImages(prompt, [WIDE, TALL], checkpoint.config, reference._encode_image)
    plain, _ = model.prefill(prompt, image_rows=images.rows_in(0, len(prompt)))
    assert np.abs(plain - expected).max() > 10 * REFERENCE_TOLERANCE


def test_device_logits_and_greedy_tokens_match_mlx_vlm(checkpoint) -> None:
    """Chunks of 8 tokens: both images are split across chunks, and the passes multiply in
    float32 as the decode step does (GEMVs, decode-shaped attention)."""
    prompt = two_image_prompt(checkpoint.config)
    expected, tokens, step_logits = mlx_vlm_run(prompt, [WIDE, TALL], CONTINUATION)
    vocab = checkpoint.config.vocab_size
    engine = DeviceEngine(checkpoint, open_test_device(), MAX_SEQ, vocab, max_chunk=8)
    worst = np.abs(engine.prompt_logits(prompt, images=[WIDE, TALL]) - expected[-1]).max()
    assert worst < DEVICE_TOLERANCE, f"largest logit difference {worst:.2e}"
    horizon = decided(np.concatenate([expected[-1:], step_logits]), DEVICE_TOLERANCE)
    assert horizon >= 4, "too many near-ties to compare greedy tokens"
    generated = [t.id for t in engine.generate(prompt, CONTINUATION, images=[WIDE, TALL])]
    assert generated[:horizon] == tokens[:horizon]
    # A text prompt after it rotates by the slots again: the same logits as a fresh engine's.
    text = [5, 6, 7, 8, 9, 10, 11, 12, 13]
    fresh = DeviceEngine(checkpoint, open_test_device(), MAX_SEQ, vocab, max_chunk=8)
    np.testing.assert_array_equal(engine.prompt_logits(text), fresh.prompt_logits(text))


def test_device_chunks_of_gemms_match_the_reference_computing_as_they_do(checkpoint) -> None:
    """Chunks of 32 tokens go through the GEMMs' half operands and attention_chunk: against the
    reference fed the same chunks with the same rounding (ChunkRounding)."""
    config, chunk = checkpoint.config, 32
    prompt = two_image_prompt(config)
    model = ReferenceModel(
        config, checkpoint.tensors, chunks=ChunkRounding.of_the_engine(), bf16_kv_cache=True
    )
    engine = DeviceEngine(checkpoint, open_test_device(), MAX_SEQ, config.vocab_size, chunk)
    images = PromptImages(prompt, [WIDE, TALL], config, engine._encode_image)
    state = model.new_state()
    state.rope_offset = images.rope_offset
    for start in range(0, len(prompt), chunk):
        end = min(start + chunk, len(prompt))
        rows, positions = images.rows_in(start, end), images.positions_in(start, end)
        logits, _ = model.prefill(prompt[start:end], state, rows, positions)
    worst = np.abs(engine.prompt_logits(prompt, images=[WIDE, TALL]) - logits[-1]).max()
    assert worst < DEVICE_TOLERANCE, f"largest logit difference {worst:.2e}"


# ---- the prefix cache ---------------------------------------------------------------------------


def test_a_follow_up_turn_reuses_the_image_and_a_different_one_does_not(checkpoint) -> None:
    config = checkpoint.config
    vocab = config.vocab_size
    first = [5, 6, *vision_block(config, WIDE), 20, 21, 22, 23]
    follow_up = [*first, 30, 31, 32, 33, 34]
    # Snapshots are taken inside a prompt (the chat facade marks message boundaries).
    boundary = len(first) - 2
    engine = DeviceEngine(checkpoint, open_test_device(), MAX_SEQ, vocab, max_chunk=8)
    list(engine.generate(first, 1, images=[WIDE], snapshot_at=boundary))
    assert engine.cached_prefix_length(follow_up, images=[WIDE]) == boundary
    fed = engine.prompt_tokens_fed
    reused = [t.id for t in engine.generate(follow_up, 4, images=[WIDE])]
    assert engine.prompt_tokens_fed - fed == len(follow_up) - boundary
    fresh = DeviceEngine(checkpoint, open_test_device(), MAX_SEQ, vocab, max_chunk=8)
    assert reused == [t.id for t in fresh.generate(follow_up, 4, images=[WIDE])]
    # Same token ids, other pixels: nothing past the image's first token is shared.
    other = image(300, 200, seed=3)
    assert other.num_tokens == WIDE.num_tokens
    assert engine.cached_prefix_length(follow_up, images=[other]) <= first.index(
        config.image_token_id
    )
    fed = engine.prompt_tokens_fed
    list(engine.generate(follow_up, 1, images=[other]))
    assert engine.prompt_tokens_fed - fed == len(follow_up)


def test_the_reference_resumes_inside_an_image_with_the_same_logits(checkpoint) -> None:
    """A snapshot in the middle of an image's run: the rest of the run is fed with its own rows
    and positions, and the rows equal a fresh feed's."""
    config = checkpoint.config
    engine = ReferenceEngine(checkpoint, MAX_SEQ, config.vocab_size)
    prompt = two_image_prompt(config)
    inside = 4 + WIDE.num_tokens // 2
    list(engine.generate(prompt, 1, images=[WIDE, TALL], snapshot_at=inside))
    resumed = engine.teacher_forced_logits(prompt, reuse=True, images=[WIDE, TALL])
    assert len(resumed) == len(prompt) - inside
    fresh = ReferenceEngine(checkpoint, MAX_SEQ, config.vocab_size)
    whole = fresh.teacher_forced_logits(prompt, images=[WIDE, TALL])
    np.testing.assert_allclose(resumed, whole[inside:], rtol=0, atol=1e-5)


def test_verify_passes_after_an_image_yield_the_plain_tokens(checkpoint) -> None:
    """Drafts checked several at a time after an image rotate by the positions after it too:
    a prediction of the plain reply is accepted and changes nothing."""
    config = checkpoint.config
    prompt = [5, 6, *vision_block(config, WIDE), 20, 21]
    engine = DeviceEngine(checkpoint, open_test_device(), MAX_SEQ, config.vocab_size, 8)
    plain = [t.id for t in engine.generate(prompt, 12, images=[WIDE])]
    drafter = Speculation(draft_tokens=4, prediction=PredictedTokens(plain))
    drafted = [t.id for t in engine.generate(prompt, 12, images=[WIDE], drafter=drafter)]
    assert drafted == plain
    assert drafter.counts["prediction"].accepted >= 6


def test_the_disk_tier_keeps_and_tells_apart_image_prefixes(checkpoint, tmp_path) -> None:
    """Image keys are uint32 like token ids: a saved prefix with an image answers a prompt with
    the same image and not one with other pixels."""
    config = checkpoint.config
    disk = DiskPrefixCache(tmp_path, "m", min_tokens=1)
    rows, state = [np.ones((2, 0, 4), np.uint16)], [np.zeros(8, np.float32)]
    disk.layout = StateLayout.of("bf16", rows, state)
    prompt = [5, *vision_block(config, WIDE), 20, 21]
    saved = cache_tokens(prompt, image_runs(prompt, [WIDE], config))[:-1]
    disk.save(saved, [np.ones((2, len(saved), 4), np.uint16)], state)
    same = cache_tokens(prompt, image_runs(prompt, [image(300, 200, seed=1)], config))
    entry = disk.load_longest(same)
    assert entry is not None and entry.tokens == saved
    other = cache_tokens(prompt, image_runs(prompt, [image(300, 200, seed=3)], config))
    assert disk.load_longest(other) is None
