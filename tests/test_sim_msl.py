"""MSL features on the sim, each checked against numpy under every lane order, and once more on
the checking sim (every access checked: none of these kernels may trip it)."""

import numpy as np
import pytest

from lily.device import Graph, open_device

ORDERS = ("forward", "reverse", "random")


@pytest.fixture(scope="module", params=[*ORDERS, "random-checked"])
def dev(request):
    order, _, checked = request.param.partition("-")
    return open_device("sim", lane_order=order, seed=11, workers=2, check=bool(checked))


def run(dev, name, threadgroups, threads, buffers, threadgroup_memory=None):
    g = Graph()
    g.dispatch(
        dev.kernel(name),
        threadgroups=threadgroups,
        threads=threads,
        buffers={i: dev.wrap(a) for i, a in buffers.items()},
        threadgroup_memory=threadgroup_memory,
    )
    dev.run(g)


def round_bf16(x):
    """float32 -> nearest-even bfloat16, kept as float32."""
    u = np.asarray(x, dtype=np.float32).view(np.uint32).astype(np.uint64)
    u = (u + 0x7FFF + ((u >> 16) & 1)) & 0xFFFF0000
    return u.astype(np.uint32).view(np.float32)


def bf16_bits(x):
    return (round_bf16(x).view(np.uint32) >> 16).astype(np.uint16)


def from_bf16_bits(b):
    return (b.astype(np.uint32) << 16).view(np.float32)


def shuffled(v, src):
    """v[src] per lane, keeping a lane's own value where src is out of range."""
    ok = (src >= 0) & (src < 32)
    return np.where(ok, v[np.clip(src, 0, v.size - 1)], v)


def reference_simd_ops(x):
    """What each SIMD-group function of test_simd_ops returns, for full simdgroups."""
    out = np.zeros((16, x.size), dtype=np.float64)
    for base in range(0, x.size, 32):
        v = x[base : base + 32].astype(np.float64)
        lanes = np.arange(32)
        out[0, base : base + 32] = v.sum()
        out[1, base : base + 32] = v.max()
        out[2, base : base + 32] = v.min()
        out[3, base : base + 32] = np.cumsum(v)
        out[4, base : base + 32] = np.cumsum(v) - v
        out[5, base : base + 32] = v[31 - lanes]
        out[6, base : base + 32] = shuffled(v, lanes ^ 5)
        out[7, base : base + 32] = shuffled(v, lanes + 3)
        out[8, base : base + 32] = shuffled(v, lanes - 2)
        out[9, base : base + 32] = v[7]
        out[10, base : base + 32] = v[0]
        bits = sum(1 << int(i) for i in np.flatnonzero(v > 0))
        out[11, base : base + 32] = bits & 0xFFFF
        out[12, base : base + 32] = bits >> 16
        out[13, base : base + 32] = float((v > 1.5).any())
        out[14, base : base + 32] = float((v > -1.5).all())
        out[15, base : base + 32] = np.trunc(v * 4).sum()
    return out


def test_simd_functions(dev):
    rng = np.random.default_rng(1)
    x = rng.integers(-8, 9, 128).astype(np.float32) / 4  # exact sums in any order
    out = np.full((16, x.size), -99, dtype=np.float32)
    run(dev, "test_simd_ops", 2, 64, {0: x, 1: out})
    np.testing.assert_array_equal(out, reference_simd_ops(x))


def test_simd_functions_float_sum_rounds_like_float32(dev):
    x = np.random.default_rng(2).standard_normal(64).astype(np.float32)
    out = np.zeros((16, x.size), dtype=np.float32)
    run(dev, "test_simd_ops", 1, 64, {0: x, 1: out})
    exact = x.astype(np.float64).reshape(2, 32).sum(axis=1).repeat(32)
    np.testing.assert_allclose(out[0], exact, rtol=0, atol=32 * np.finfo(np.float32).eps * 8)


def test_simd_functions_over_a_partial_simdgroup(dev):
    # 40 threads: the second simdgroup has 8 active lanes; reductions cover only those.
    x = np.arange(1, 41, dtype=np.float32)
    out = np.zeros((16, 40), dtype=np.float32)
    run(dev, "test_simd_ops", 1, 40, {0: x, 1: out})
    assert (out[0, 32:] == x[32:].sum()).all() and (out[1, 32:] == 40).all()
    np.testing.assert_array_equal(out[3, 32:], np.cumsum(x[32:]))
    assert np.isnan(out[5, 32:]).all()  # reads of inactive lanes are poison


@pytest.mark.parametrize("kernel", ["test_threadgroup_sum", "test_threadgroup_arg_sum"])
def test_barrier_reduction_in_threadgroup_memory(dev, kernel):
    x = np.random.default_rng(3).integers(-100, 100, 4 * 256).astype(np.float32)
    sums = np.zeros(4, dtype=np.float32)
    run(dev, kernel, 4, 256, {0: x, 1: sums}, threadgroup_memory={0: 256 * 4})
    np.testing.assert_array_equal(sums, x.reshape(4, 256).sum(axis=1))


def test_missing_barrier_is_exposed_by_lane_order():
    x = np.arange(1, 129, dtype=np.float32)
    expected = np.where(np.arange(128) % 64 == 0, x, np.roll(x, 1))
    results = {}
    for order in ORDERS:
        out = np.zeros_like(x)
        run(
            open_device("sim", lane_order=order, seed=5, workers=1, check=False),
            "test_missing_barrier",
            2,
            64,
            {0: x, 1: out},
        )
        results[order] = out
    # Forward order hides the bug; reverse and random read unwritten (NaN-poisoned) memory.
    np.testing.assert_array_equal(results["forward"], expected)
    for order in ("reverse", "random"):
        assert np.isnan(results[order]).any(), order


def test_simdgroup_matrix_lane_layout(dev):
    out = np.zeros((8, 8), dtype=np.float32)
    run(dev, "test_simdgroup_layout", 1, 32, {0: out})
    expected = np.zeros((8, 8), dtype=np.float32)
    for lane in range(32):  # Apple's layout, as documented in devices.md
        row = ((lane // 4) & 4) + (lane // 2) % 4
        col = ((lane // 4) & 2) * 2 + (lane % 2) * 2
        expected[row, col], expected[row, col + 1] = lane, lane + 0.5
    np.testing.assert_array_equal(out, expected)


@pytest.mark.parametrize("dtype", ["float", "half", "bfloat"])
def test_simdgroup_multiply_accumulate(dev, dtype):
    rng = np.random.default_rng(4)
    a, b, c = (rng.standard_normal((8, 8)).astype(np.float32) for _ in range(3))
    if dtype == "bfloat":
        a, b, c = (round_bf16(m) for m in (a, b, c))
        ins = [bf16_bits(m) for m in (a, b, c)]
        d = np.zeros((8, 8), dtype=np.uint16)
    else:
        np_type = np.float32 if dtype == "float" else np.float16
        ins = [m.astype(np_type) for m in (a, b, c)]
        a, b, c = (m.astype(np.float32) for m in ins)
        d = np.zeros((8, 8), dtype=np_type)
    run(dev, f"test_simdgroup_mma_{dtype}", 1, 32, {0: ins[0], 1: ins[1], 2: ins[2], 3: d})
    exact = a.astype(np.float64) @ b + c
    got = from_bf16_bits(d) if dtype == "bfloat" else d.astype(np.float64)
    # Float accumulation then one rounding to the output type: within one output ulp (plus
    # float32 sum error, which is far smaller).
    ulp = {"float": 2.0**-23, "half": 2.0**-10, "bfloat": 2.0**-7}[dtype]
    tol = ulp * np.maximum(np.abs(exact), 2.0**-14) + 1e-5 * np.abs(a @ np.abs(b)).max()
    assert (np.abs(got - exact) <= tol).all()


def test_simdgroup_products_keep_program_order(dev):
    """The sim queues products and computes them together; every result must still be the one
    the program order gives, whoever reads it and whenever."""
    a = np.random.default_rng(9).uniform(-1, 1, (8, 8)).astype(np.float32)
    out = np.zeros(128 + 32, dtype=np.float32)
    run(dev, "test_simdgroup_products_in_order", 1, 32, {0: a, 1: out})
    a64 = a.astype(np.float64)
    p = a64 @ a64
    q = p @ a64
    np.testing.assert_allclose(out[:64].reshape(8, 8), q @ a64 + p, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(out[64:128].reshape(8, 8), q, rtol=1e-5, atol=1e-5)
    # Apple's layout: lane l holds row ((l / 4) & 4) + (l / 2) % 4, columns from
    # ((l / 4) & 2) * 2 + (l % 2) * 2; element 1 is the second of them.
    lanes = np.arange(32)
    rows = ((lanes // 4) & 4) + (lanes // 2) % 4
    cols = ((lanes // 4) & 2) * 2 + (lanes % 2) * 2 + 1
    expected = np.where(lanes % 2 == 0, q[rows, cols], -1.0)
    np.testing.assert_allclose(out[128:], expected, rtol=1e-5, atol=1e-5)


def test_simdgroup_tiles_with_origins_and_transpose(dev):
    rng = np.random.default_rng(6)
    a = rng.standard_normal((16, 16)).astype(np.float16)
    b = rng.standard_normal((16, 16)).astype(np.float16)
    bt = np.ascontiguousarray(b.T)
    d = np.zeros((16, 16), dtype=np.float32)
    run(dev, "test_simdgroup_tiles", 1, 64, {0: a, 1: bt, 2: d})
    exact = a.astype(np.float64) @ b.astype(np.float64)
    np.testing.assert_allclose(d, exact, rtol=1e-5, atol=1e-5)


def test_half_arithmetic_rounds_every_operation(dev):
    rng = np.random.default_rng(7)
    a, b, c = (rng.uniform(0.5, 4, 256).astype(np.float16) for _ in range(3))
    out = np.zeros(256, dtype=np.float16)
    run(dev, "test_half_ops", 8, 32, {0: a, 1: b, 2: c, 3: out})
    # numpy float16 arithmetic rounds each operation to half, as MSL half does.
    np.testing.assert_array_equal(out, ((a + b) * c - a) / b)


def test_bfloat_arithmetic_rounds_every_operation(dev):
    rng = np.random.default_rng(8)
    a, b, c = (round_bf16(rng.uniform(0.5, 4, 256)) for _ in range(3))
    out = np.zeros(256, dtype=np.uint16)
    from_float = np.zeros(256, dtype=np.uint16)
    run(
        dev,
        "test_bfloat_ops",
        8,
        32,
        {0: bf16_bits(a), 1: bf16_bits(b), 2: bf16_bits(c), 3: out, 4: from_float},
    )
    r = round_bf16
    expected = r(r(r(r(a + b) * c) - a) / b)
    np.testing.assert_array_equal(from_bf16_bits(out), expected)
    np.testing.assert_array_equal(from_float, bf16_bits(a * np.float32(1.001)))


def test_as_type_and_half_literals(dev):
    x = np.random.default_rng(9).standard_normal(64).astype(np.float32)
    bits = np.zeros(64, dtype=np.uint32)
    halves = np.zeros((64, 2), dtype=np.float16)
    back = np.zeros(64, dtype=np.float32)
    literal = np.zeros(64, dtype=np.float16)
    run(dev, "test_as_type", 2, 32, {0: x, 1: bits, 2: halves, 3: back, 4: literal})
    np.testing.assert_array_equal(bits, x.view(np.uint32))
    np.testing.assert_array_equal(halves.view(np.uint32).ravel(), x.view(np.uint32))
    np.testing.assert_array_equal(back, x)
    i = np.arange(64, dtype=np.float16)
    np.testing.assert_array_equal(literal, np.float16(1.5) * i + np.float16(0.25))


def test_atomics(dev):
    x = np.random.default_rng(10).integers(-50, 50, 8 * 64).astype(np.float32) / 4
    count = np.zeros(1, dtype=np.uint32)
    total = np.zeros(1, dtype=np.float32)
    largest = np.full(1, -(2**31), dtype=np.int32)
    groups = np.zeros(8, dtype=np.uint32)
    run(dev, "test_atomics", 8, 64, {0: count, 1: total, 2: largest, 3: groups, 4: x})
    assert count[0] == 512
    assert total[0] == x.sum()  # quarter-integers: exact in any order
    assert largest[0] == int((x * 100).max())
    assert (groups == 128).all()


def test_vectors_swizzles_and_conversions(dev):
    x = np.arange(32, dtype=np.float32) - 10.25
    out = np.zeros((32, 4, 4), dtype=np.float32)
    ints = np.zeros((32, 4), dtype=np.int32)
    run(dev, "test_vectors", 1, 32, {0: x, 1: out, 2: ints})
    v = x[:, None] + np.arange(4, dtype=np.float32)
    w = v[:, ::-1].copy()
    w[:, :2] = v[:, 2:]
    np.testing.assert_array_equal(out[:, 0], w)
    np.testing.assert_array_equal(
        out[:, 1], np.stack([v[:, 0], v[:, 1], np.full(32, 7), np.arange(32)], axis=1)
    )
    np.testing.assert_array_equal(out[:, 2], v.astype(np.float16).astype(np.float32) + 1)
    np.testing.assert_array_equal(
        out[:, 3], np.stack([np.full(32, 0.5), np.full(32, 0.5), v[:, 1], v[:, 0]], axis=1)
    )
    np.testing.assert_array_equal(ints, np.trunc(v * -1.5).astype(np.int32))


def test_math_functions(dev):
    rng = np.random.default_rng(12)
    n = 128
    a = rng.uniform(0.1, 10, n).astype(np.float32)
    b = rng.uniform(-5, 5, n).astype(np.float32)
    out = np.zeros((24, n), dtype=np.float32)
    hout = np.zeros(n, dtype=np.float16)
    run(dev, "test_math", 4, 32, {0: a, 1: b, 2: out, 3: hout})
    A, B = a.astype(np.float64), b.astype(np.float64)
    with np.errstate(invalid="ignore", divide="ignore"):
        expected = [
            np.exp(B), np.exp2(B), np.log(A), np.log2(A), np.sqrt(A), 1 / np.sqrt(A),
            np.tanh(B), A * B + 1, A + (B - A) * 0.25, np.clip(B, -0.5, 0.5), np.minimum(A, B),
            np.maximum(A, B), np.abs(B), np.floor(B), np.ceil(B),
            np.where(B < 0, -np.floor(-B + 0.5), np.floor(B + 0.5)), np.trunc(B),
            np.copysign(A, B), A / B, np.exp(B), np.where(B > 0, B, A),
            np.isnan(np.log(B)).astype(float), np.ones(n), 2 * A * B,
        ]  # fmt: skip
    exact_ops = {9, 10, 11, 12, 13, 14, 15, 16, 17, 20, 21, 22}  # no rounding involved
    for k, e in enumerate(expected):
        if k in exact_ops:
            np.testing.assert_array_equal(out[k], e, err_msg=f"op {k}")
            continue
        # libm float32 functions: within a few float32 ulp (mix and dot: of their inputs).
        scale = np.abs(e) if k not in (8, 23) else np.maximum(np.abs(e), np.abs(A) + np.abs(B))
        assert (np.abs(out[k] - e) <= 4 * 2.0**-23 * scale).all(), f"op {k}"
    # half math is float math rounded once to half.
    np.testing.assert_array_equal(
        hout, np.exp(b.astype(np.float16).astype(np.float32)).astype(np.float16)
    )


def test_more_simd_and_quad_functions(dev):
    x = np.random.default_rng(13).integers(0, 256, 64).astype(np.int32)
    out = np.zeros((12, 64), dtype=np.int64)
    out32 = np.zeros((12, 64), dtype=np.int32)
    run(dev, "test_simd_more", 1, 64, {0: x, 1: out32})
    lanes = np.arange(32)
    for base in (0, 32):
        v = x[base : base + 32].astype(np.int64)
        p = v % 3 + 2
        quads = v.reshape(8, 4)
        rows = [
            np.bitwise_and.reduce(v),
            np.bitwise_or.reduce(v),
            np.bitwise_xor.reduce(v),
            np.prod(p) % 2**32,
            np.cumprod(p) // p % 2**32,
            v[(lanes + 5) % 32],
            v[(lanes - 3) % 32],
            quads.sum(axis=1).repeat(4),
            quads.max(axis=1).repeat(4),
            v[lanes ^ 1],
            quads[:, 2].repeat(4),
            lanes == 0,
        ]
        for k, row in enumerate(rows):
            out[k, base : base + 32] = row
    np.testing.assert_array_equal(out32.view(np.uint32), out.astype(np.uint32))
