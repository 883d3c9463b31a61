"""benchmarks/prefill_model.py, the prefill cost model, and bench_prefill.py's whole-prompt
report: the KV cache and activation traffic as the kernels move them (counted by hand here from
the real model's dims), prompts cut into the chunks each Mac's budget allows, and the report's
lines."""

from __future__ import annotations

import re
import sys
import types
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"
sys.path.insert(0, str(BENCHMARKS))
import bench_prefill  # noqa: E402
import make_synthetic_checkpoint  # noqa: E402
import prefill_model  # noqa: E402

from lily.checkpoint.config import parse_config  # noqa: E402


@pytest.fixture(scope="module")
def real():
    return parse_config(make_synthetic_checkpoint.real_config())


def test_chunk_attention_reads_the_cache_once_per_threadgroup(real):
    # 8 tokens from position 100: 32-row threadgroups hold 4 tokens (8 query heads share a KV
    # head), so two per KV head, whose last tokens see 104 and 108 positions: 112 keys each in
    # 16-key tiles. A key is K and V of 256 bf16 dims (1,024 B); 2 KV heads, 10 layers.
    assert prefill_model.kv_bytes(real, 100, 8, 32) == (112 + 112) * 1024 * 2 * 10
    # attention_chunk's 64-row tile (or a 128-row one) holds all 8 tokens: one read of 112 keys.
    assert prefill_model.kv_bytes(real, 100, 8, 64) == 112 * 1024 * 2 * 10
    assert prefill_model.kv_bytes(real, 100, 8, 128) == 112 * 1024 * 2 * 10
    # Late in a long prompt the cache is read an eighth as many times as there are tokens: 512
    # threadgroups per KV head for 4,096 tokens.
    reads = prefill_model.kv_bytes(real, 28672, 4096, 64) / (1024 * 2 * 10)
    assert 512 * 28672 < reads < 512 * 32768


def test_chunk_attention_executes_whole_tiles_per_simdgroup(real):
    # 8 tokens from position 100: a SIMD-group holds one token's 8 query heads, and token t
    # sees 101 + t positions, 112 keys in 16-key tiles for every t. Per key and row, 256
    # multiply-adds for S and 256 for P V; 2 KV heads, 10 layers.
    executed = 8 * 112 * 8 * 2 * 256 * 2 * 2 * 10
    assert prefill_model.attention_flops(real, 100, 8) == executed
    # The useful work, 836 (query token, key) pairs for each of the 16 query heads, is 7% less.
    useful = (8 * 100 + 36) * 16 * 2 * 256 * 2 * 10
    assert executed == pytest.approx(useful * 1.0718, rel=1e-4)


def test_tensor_op_attention_executes_whole_tiles_per_threadgroup(real):
    # 8 tokens from position 100: one threadgroup of 64 rows per KV head, whose last token sees
    # 108 positions, 128 keys in 32-key tiles.
    executed = 64 * 128 * 2 * 256 * 2 * 2 * 10
    assert prefill_model.attention_flops(real, 100, 8, tensor_ops=True) == executed
    # Its cache reads: 128 keys of K and V, as the tiles stream them.
    assert prefill_model.kv_bytes(real, 100, 8, 64, 32) == 128 * 1024 * 2 * 10


def test_tensor_op_attention_reads_its_queries_once_per_tile(real):
    # 8 tokens of 16 query heads: fp32 queries (8 x 16 x 256 x 4 B) read, packed as half, 64
    # rows per KV head (64 x 256 x 2 B each), written and read; per KV head 4 tiles of 32 keys
    # (128), each reading the 32 KiB tile, the first of which is that read back. 10 layers.
    memory, rereads = prefill_model.query_bytes(real, 100, 8)
    packed = 2 * 64 * 256 * 2
    assert memory == (8 * 16 * 256 * 4 + 2 * packed) * 10
    assert rereads == (2 * 4 * 64 * 256 * 2 - packed) * 10


def test_activations_are_written_and_read_once_per_layer(real):
    # fp32 floats per token: every layer's residual, normed, mixer and MoE outputs (4 x 2048)
    # and a guard exponent; a GDN layer's qkv twice (8192), z and its output (4096), a and b
    # (32); an attention layer's q with its gate (8192), k and v (512), queries and output
    # (4096).
    dense = (4 * 2048 + 1) * 40 + (2 * 8192 + 2 * 4096 + 2 * 32) * 30
    dense += (8192 + 2 * 512 + 2 * 4096) * 10
    # The MoE chunk scratch per token and layer: 256 + 2 + 5 x 8 index words, and 8 expert
    # rows of 512 + 2048 floats, 2 x 512 shared rows and the 2048-wide output.
    moe = (256 + 2 + 5 * 8 + 8 * (512 + 2048) + 2 * 512 + 2048) * 40
    assert prefill_model.activation_traffic(real, 10, 4) == (2 * 4 * dense * 10, 2 * 4 * moe * 10)
    assert prefill_model.activation_traffic(real, 10, 2) == (2 * 2 * dense * 10, 2 * 2 * moe * 10)
    # About 17.5 MB per token in fp32, the ~20 MB issue 40 counts.
    assert 17e6 < 8 * (dense + moe) < 18e6


def chunk_weights(tokens: int) -> tuple[dict[str, float], float]:
    return {"projections": 1e9, "routed experts": 1.8e10, "lm_head": 5e8}, 1.1


def test_a_whole_prompt_runs_in_the_chunks_its_macs_budget_allows(real):
    m1_pro, _, m5_max = prefill_model.GPUS
    short = prefill_model.whole_prompt(
        real, m1_pro, prefill_model.SIMDGROUP, 131072, chunk_weights, 600
    )
    long = prefill_model.whole_prompt(
        real, m5_max, prefill_model.SIMDGROUP, 131072, chunk_weights, 600
    )
    for estimate in (short, long):
        assert sum(estimate.chunks) == 131072
        assert max(estimate.chunks) == 4096
        slow, central, fast = estimate.tokens_per_second
        assert slow < central < fast
    # Late in the prompt a 16-core M1 Pro's budget (2.1 TFLOP) allows a few hundred tokens
    # a chunk, a 40-core M5 Max's (7.4) about 3,000.
    assert short.chunks[-1] < 500 < 2900 < long.chunks[-1]
    assert len(short.chunks) > len(long.chunks)

    # The tensor-op GEMMs speed a 4k prompt up more than a 128k one, whose time is mostly
    # chunk attention; tensor-op attention speeds the 128k one up more.
    def speed_up(prompt: int, path) -> float:
        rates = [
            prefill_model.whole_prompt(real, m5_max, p, prompt, chunk_weights, 600)
            for p in (prefill_model.SIMDGROUP, path)
        ]
        return rates[1].tokens_per_second[1] / rates[0].tokens_per_second[1]

    gemms, both = prefill_model.TENSOR_GEMMS, prefill_model.TENSOR_OPS
    assert speed_up(4096, gemms) > 2 > speed_up(131072, gemms) > 1
    assert speed_up(131072, both) > 3 * speed_up(131072, gemms)


def test_the_central_terms_make_up_the_central_time(real):
    """The breakdown bench_prefill prints: each kernel group took the longer of its memory and
    compute terms, and the parts sum to the prompt's tokens over its central rate."""
    m5_max = prefill_model.GPUS[2]
    estimate = prefill_model.whole_prompt(
        real, m5_max, prefill_model.TENSOR_OPS, 32768, chunk_weights, 600
    )
    total = sum(max(pair) for pair in estimate.central_terms.values())
    central = estimate.tokens_per_second[prefill_model.CENTRAL]
    assert total == pytest.approx(32768 / central, rel=1e-12)
    memory, compute = estimate.central_terms["chunk attention"]
    assert memory > 0
    assert compute > 0
    assert estimate.central_terms["GDN scan"][0] == 0


def test_the_report_has_a_line_per_mac_in_the_issues_form(real, capsys):
    bench_prefill.whole_prompt_report(types.SimpleNamespace(config=real), 4096, 600)
    out = capsys.readouterr().out
    lines = re.findall(
        r"^whole-prompt estimate at 4096 tokens: (.+?) (\d+) tok/s \((.+?)\)", out, re.M
    )
    assert [(mac, kernels) for mac, _, kernels in lines] == [
        ("M1 Pro", "simdgroup tiles"),
        ("M4 Max", "simdgroup tiles"),
        ("M5 Max", "simdgroup tiles"),
        ("M5 Max", "tensor ops"),
        ("M5 Max", "tensor-op GEMMs, simdgroup attention: an int8 cache"),
    ]
    assert "chunks of 4096..4096 tokens (1)" in out
    assert "not built (issue 40), estimate: M5 Max" in out
    assert "reference engine 5,724, mlx-lm 5,166 tok/s" in out


def test_tensor_op_attention_needs_64_row_tiles(real):
    # A 4,096-token chunk at 28k of context on an M5 Max: 32-row threadgroups would read 644 GB
    # of K and V (1.3 s at 80% of 614 GB/s), more than the 0.7 s of tensor-op products; the
    # 64-row ones read 322 GB (0.66 s; the packed queries 1.3 GB more), less. On simdgroup
    # matrices the products take 2.8 s.
    m5_max = prefill_model.GPUS[2]
    weights = chunk_weights(4096)[0]

    def attention_seconds(path) -> float:
        work = prefill_model.groups(real, 28672, 4096, weights, 1.1, path, False)
        return prefill_model.seconds(real, m5_max, path, work, 600, 1, 4096)["chunk attention"]

    def memory_seconds(rows: int) -> float:
        return prefill_model.kv_bytes(real, 28672, 4096, rows) / (0.8 * 614e9)

    assert 640e9 < prefill_model.kv_bytes(real, 28672, 4096, 32) < 650e9
    assert 320e9 < prefill_model.kv_bytes(real, 28672, 4096, 64) < 325e9
    tensor_op = attention_seconds(prefill_model.TENSOR_OPS)
    assert memory_seconds(64) < tensor_op < memory_seconds(32)
    # The tensor-op kernel's 32-key tiles execute a few more products than the 16-key ones.
    assert attention_seconds(prefill_model.SIMDGROUP) == pytest.approx(4 * tensor_op, rel=1e-3)
