"""A model (not a measurement: nothing here runs on a GPU) of a prefill chunk's time on Apple
GPUs, per kernel group, for `bench_prefill.py --context`.

Each group takes the longer of its bytes at the memory bandwidth and its executed FLOPs at the
rate of its operand type, each at an assumed fraction of peak; the groups run one after another
(a layer's kernels depend on each other). On top: the Gated DeltaNet scan's serial latency
(`gdn_scan_model.py`), a drain per barrier level and a gap per command buffer. Every GPU figure
below is an assumption from public specifications, not a measurement:

- bandwidth and the fp32 rate (cores x 128 lanes x 2 x clock) as bench_prefill.py has used;
  Apple GPUs up to the M4 issue half-precision simdgroup-matrix FMAs at the fp32 rate, so half
  operands do not raise the peak: they halve threadgroup memory and register traffic, which is
  what lets the tiles reach a larger fraction of it;
- the M5's tensor units (Metal 4 tensor ops): Apple describes the M5 GPU's neural accelerators as
  over 4x the M4's peak GPU compute for AI; taken as 4x the fp32 rate for half operands;
- efficiencies: fp32 tiles 30% of peak (22.5 KiB of threadgroup memory, single-buffered: the
  kernels before they took 2-byte operands), half-precision double-buffered tiles 60% (today's
  GEMMs; MLX's steel GEMMs reach 60-70% on M-series GPUs by their authors' reports), tensor ops
  50% of their peak; chunk attention (its softmax sits between its two products) 20% of the
  fp32 rate with fp32 tiles, 40% of its peak with 2-byte operands (today's: half Q K^T, bfloat
  or half P V); memory 80% of peak bandwidth.
"""

from __future__ import annotations

from dataclasses import dataclass

from gdn_scan_model import Gpu as ScanGpu
from gdn_scan_model import chunkwise_kernel, per_token_seconds

from lily.checkpoint.config import FULL_ATTENTION, ModelConfig
from lily.engine.model_graph import token_macs

MEMORY_EFFICIENCY = 0.8
LEVEL_SECONDS = 2e-6  # a memory barrier in a concurrent encoder drains the GPU
COMMAND_BUFFER_SECONDS = 30e-6  # commit and schedule gap between command buffers


@dataclass(frozen=True)
class Gpu:
    name: str
    cores: int
    bandwidth: float  # bytes/s
    fp32_rate: float  # FLOP/s, simdgroup-matrix
    tensor_rate: float | None  # FLOP/s with half operands through tensor ops, if the GPU has them


GPUS = (
    Gpu("M1 Pro (16-core GPU)", 16, 200e9, 5.2e12, None),
    Gpu("M4 Max (40-core GPU)", 40, 546e9, 16.2e12, None),
    Gpu("M5 Max (40-core GPU)", 40, 614e9, 18.4e12, 4 * 18.4e12),
)


@dataclass(frozen=True)
class Path:
    """How the prefill matrix kernels run: operand type and what executes the products."""

    name: str
    efficiency: float  # of the GEMMs, against the rate of what runs them
    attention_efficiency: float  # of chunk attention, likewise
    tensor_ops: bool  # the GEMMs run on tensor units
    attention_tensor_ops: bool  # so does attention's two products


FP32_TILES = Path("fp32 simdgroup tiles", 0.3, 0.2, False, False)
HALF_TILES = Path("half simdgroup tiles (today)", 0.6, 0.4, False, False)
TENSOR_GEMMS = Path("tensor-op GEMMs", 0.5, 0.4, True, False)
TENSOR_ALL = Path("tensor-op GEMMs and attention", 0.5, 0.4, True, True)
PATHS = (FP32_TILES, HALF_TILES, TENSOR_GEMMS, TENSOR_ALL)


@dataclass(frozen=True)
class Group:
    name: str
    bytes: float
    flops: float  # executed, not only useful


def groups(
    c: ModelConfig,
    context: int,
    tokens: int,
    weight_bytes: dict[str, float],
    expert_executed_ratio: float,
) -> list[Group]:
    """The chunk's work per kernel group: a chunk of `tokens` ending at `context`, reading the
    weights `weight_bytes` names (bench_prefill.weight_bytes_per_chunk), the routed experts
    executing `expert_executed_ratio` times their useful matrix work (tile padding)."""
    macs = token_macs(c)
    attention_layers = len(c.full_attention_layers)
    gdn_layers = c.num_hidden_layers - attention_layers
    q, kv = c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim
    projections = gdn_layers * macs.gdn + attention_layers * macs.attention
    shared, experts = macs.shared, macs.experts
    start = context - tokens
    contexts = tokens * start + tokens * (tokens + 1) // 2
    kv_bytes = attention_layers * 2 * kv * 2 * context  # bf16 K and V, read once per layer
    return [
        Group(
            "dense projections",
            weight_bytes.get("projections", 0.0),
            2.0 * tokens * (projections + c.num_hidden_layers * shared),
        ),
        Group(
            "routed experts",
            weight_bytes.get("routed experts", 0.0),
            2.0 * tokens * c.num_hidden_layers * experts * expert_executed_ratio,
        ),
        Group("chunk attention", kv_bytes, 2.0 * attention_layers * 2 * q * contexts),
        Group(
            "lm_head (1 token)",
            weight_bytes.get("lm_head", 0.0),
            2.0 * c.hidden_size * c.vocab_size,
        ),
    ]


def seconds(
    c: ModelConfig,
    gpu: Gpu,
    path: Path,
    work: list[Group],
    levels: int,
    command_buffers: int,
    tokens: int,
) -> dict[str, float]:
    """Seconds per kernel group, plus the Gated DeltaNet scan (its products and solve, as
    `gdn_scan_model.py` counts them) and the barrier and command-buffer overheads, for one
    chunk of `tokens` on `gpu` along `path`."""
    if path.tensor_ops and gpu.tensor_rate is None:
        raise ValueError(f"{gpu.name} has no tensor units")
    bandwidth = gpu.bandwidth * MEMORY_EFFICIENCY
    matrix_rate = (gpu.tensor_rate if path.tensor_ops else gpu.fp32_rate) * path.efficiency
    attention_peak = gpu.tensor_rate if path.attention_tensor_ops else gpu.fp32_rate
    attention_rate = attention_peak * path.attention_efficiency
    out = {}
    for group in work:
        rate = attention_rate if group.name == "chunk attention" else matrix_rate
        out[group.name] = max(group.bytes / bandwidth, group.flops / rate)
    clock = gpu.fp32_rate / (gpu.cores * 256)
    scan_gpu = ScanGpu(gpu.name, gpu.cores, clock, 64 * 1024, 1024)
    per_token, _, _ = per_token_seconds(chunkwise_kernel(), scan_gpu)
    out["GDN scan"] = per_token * tokens * gdn_layer_count(c)
    out["barrier levels"] = levels * LEVEL_SECONDS
    out["command buffers"] = command_buffers * COMMAND_BUFFER_SECONDS
    return out


def gdn_layer_count(c: ModelConfig) -> int:
    return sum(1 for kind in c.layer_types if kind != FULL_ATTENTION)
