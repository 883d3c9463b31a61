"""Threadgroup sizes that launchers choose from what the compiled pipeline allows."""

from types import SimpleNamespace

import pytest

from lily.kernels import threads_within


def pipeline(limit: int) -> SimpleNamespace:
    return SimpleNamespace(max_threads_per_threadgroup=limit)


@pytest.mark.parametrize(
    ("limit", "preferred", "expected"),
    [(1024, 256, 256), (1024, 1024, 1024), (896, 1024, 896), (100, 1024, 96), (32, 64, 32)],
)
def test_threads_are_whole_simdgroups_within_the_pipeline_limit(limit, preferred, expected):
    assert threads_within(pipeline(limit), preferred) == expected


def test_a_pipeline_below_one_simdgroup_is_refused():
    with pytest.raises(ValueError, match="less than one SIMD-group"):
        threads_within(pipeline(16), 256)
