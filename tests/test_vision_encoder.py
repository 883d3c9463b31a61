"""The vision tower on the device (lily.engine.vision_encoder) against the numpy tower
(lily.engine.vision_reference.VisionTower) on the tiny checkpoint's random tower.

Bound: the device holds the checkpoint's bf16 weights and the reference their exact float32
widening, so both compute with the same values and differ by float32 rounding alone: no bf16
term enters. Every step of the tower is a float32 sum (a dot product, a mean, a softmax's
weighted values) of k terms, then a few roundings (bias, activation, residual add). The
worst-case bound of such a sum, k ulps of its magnitude, is reached only when every rounding
errs the same way; rounding errors of random sign grow like sqrt(k) (Higham and Mary's
probabilistic error analysis: within lambda sqrt(k) ulps except with probability below
2 exp(-lambda^2 / 2), negligible at lambda = 4). The LayerNorms keep every step's magnitude at the
scale of the output, and the residual stream carries each step's error forward without growing
it, so the bound is the sum over every step an output depends on of 4 sqrt(k) + 8 ulps, of the
output's largest value (1,100 to 1,300 ulps for the tiny tower, 1.5e-4 relative; measured: under
10).
The float32 reference carries a bound of the same size, so the two are within twice it.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
from kernel_testing import FLOAT32_EPS, LANE_ORDERS, sim_device
from tiny_models import TINY_VISION, tiny_checkpoint

from lily.checkpoint.loader import load_checkpoint
from lily.checkpoint.vision import parse_vision_config, vision_weights
from lily.engine.image_input import ImagePatches
from lily.engine.vision_encoder import VisionEncoder
from lily.engine.vision_reference import VisionTower


def reduction_lengths(config, frame: int) -> list[int]:
    """The length of every float32 sum an output value depends on, in order."""
    d, merged = config.hidden_size, config.hidden_size * config.spatial_merge_size**2
    # norm1 (mean, variance), qkv, scores, weighted values, proj, norm2 (mean, variance), fc1,
    # fc2
    block = [d, d, d, config.head_dim, frame, d, d, d, d, config.intermediate_size]
    return [config.patch_values, *block * config.depth, d, d, merged, merged]


def bound_ulps(config, frame: int) -> float:
    return sum(4 * math.sqrt(k) + 8 for k in reduction_lengths(config, frame))


@pytest.fixture(scope="module")
def checkpoint():
    return load_checkpoint(tiny_checkpoint("small"))


@pytest.fixture(scope="module")
def tower(checkpoint) -> VisionTower:
    config = parse_vision_config(checkpoint.config.raw)
    return VisionTower(config, vision_weights(checkpoint.tensors, checkpoint.config))


def random_image(grid: tuple[int, int, int], seed: int) -> ImagePatches:
    """Patch rows of values in [-1, 1], the preprocessor's range."""
    rows = np.random.default_rng(seed).uniform(-1, 1, (int(np.prod(grid)), 1536))
    return ImagePatches(rows.astype(np.float32), grid, 2)


def assert_matches_tower(actual: np.ndarray, tower: VisionTower, image: ImagePatches) -> None:
    expected = tower(image.pixel_values.astype(np.float64), image.grid_thw)
    float32_reference = tower(image.pixel_values, image.grid_thw)
    assert actual.shape == expected.shape == (image.num_tokens, tower.config.out_hidden_size)
    frame = image.grid_thw[1] * image.grid_thw[2]
    bound = bound_ulps(tower.config, frame) * FLOAT32_EPS * np.abs(expected).max()
    np.testing.assert_allclose(actual, expected, rtol=0, atol=bound)
    np.testing.assert_allclose(actual, float32_reference, rtol=0, atol=2 * bound)


@pytest.mark.parametrize("grid", [(1, 2, 2), (1, 4, 6), (1, 6, 4), (1, 16, 22), (2, 4, 6)], ids=str)
def test_encoder_equals_the_reference_tower(checkpoint, tower, grid) -> None:
    encoder = VisionEncoder.from_checkpoint(sim_device("forward"), checkpoint)
    image = random_image(grid, seed=sum(grid))
    assert_matches_tower(encoder.encode(image), tower, image)


@pytest.mark.parametrize("lane_order", LANE_ORDERS)
def test_encoder_under_every_lane_order(checkpoint, tower, lane_order) -> None:
    # The random order runs on the checking sim: every access of the whole pass is checked.
    encoder = VisionEncoder.from_checkpoint(sim_device(lane_order), checkpoint)
    image = random_image((1, 6, 10), seed=7)
    assert_matches_tower(encoder.encode(image), tower, image)


def test_float32_weights_give_the_stored_bits(checkpoint, tower) -> None:
    # vision_weights' float32 arrays round back to the stored bf16 exactly.
    device = sim_device("forward")
    image = random_image((1, 4, 4), seed=3)
    from_float32 = VisionEncoder(device, tower.config, tower.weights).encode(image)
    from_stored = VisionEncoder.from_checkpoint(device, checkpoint).encode(image)
    np.testing.assert_array_equal(from_float32, from_stored)


def test_one_encoder_encodes_images_of_several_sizes(checkpoint, tower) -> None:
    encoder = VisionEncoder.from_checkpoint(sim_device("forward"), checkpoint)
    small, large = random_image((1, 2, 4), seed=1), random_image((1, 8, 6), seed=2)
    first = encoder.encode(small)
    encoder.encode(large)
    np.testing.assert_array_equal(encoder.encode(small), first)
    assert_matches_tower(encoder.encode(large), tower, large)


def test_a_grid_not_of_merge_blocks_is_refused(checkpoint) -> None:
    encoder = VisionEncoder.from_checkpoint(sim_device("forward"), checkpoint)
    with pytest.raises(ValueError, match="2 x 2 blocks"):
        encoder.encode(random_image((1, 3, 4), seed=0))
    rows = np.zeros((16, 1536), np.float32)
    with pytest.raises(ValueError, match="do not match"):
        encoder.encode(ImagePatches(rows, (1, 2, 4), 2))


def test_a_small_budget_splits_the_pass_without_changing_it(checkpoint) -> None:
    device = sim_device("forward")
    image = random_image((1, 6, 10), seed=11)  # 60 patches: 2 row tiles, 2 query blocks
    whole = VisionEncoder.from_checkpoint(device, checkpoint)
    split = VisionEncoder.from_checkpoint(device, checkpoint, command_buffer_flops=1.0)
    assert whole.record(image).graph.command_buffer_count == 1
    # Every piece of work alone: per block, 2 row tiles of each of the 4 linear maps and
    # 2 query blocks of attention; 2 for the patch embedding, 1 for each of the merger's maps
    # (15 tokens, one tile).
    pieces = 2 + TINY_VISION.depth * (4 * 2 + 2) + 2
    assert split.record(image).graph.command_buffer_count == pieces
    np.testing.assert_array_equal(split.encode(image), whole.encode(image))


def test_an_unaligned_checkpoint_gives_the_same_embeddings(checkpoint) -> None:
    # mlx's own file puts tensors off 16-byte boundaries: DeviceWeights copies those instead of
    # binding them in place, and the encoder computes the same.
    device = sim_device("random")  # checked: every binding holds to its tensor
    unaligned = load_checkpoint(tiny_checkpoint("small", aligned=False))
    assert any(name.startswith("vision_tower.") for name in unaligned.unaligned)
    image = random_image((1, 4, 6), seed=5)
    np.testing.assert_array_equal(
        VisionEncoder.from_checkpoint(device, unaligned).encode(image),
        VisionEncoder.from_checkpoint(device, checkpoint).encode(image),
    )
