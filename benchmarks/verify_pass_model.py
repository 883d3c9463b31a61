"""A verify pass of speculative decoding at the real model's dims: the weight bytes it reads and
the matrix FLOPs it executes, with the GEMMs' tiles a prefill chunk uses (dense token tiles of
8 or 16 rows at these sizes, an 8-row tile per chosen expert; how verify passes would run without
`qgemv_tokens` and the MoE's few-token path) and with the GEMV-shaped kernels they run, and a
time estimate on Apple GPUs from the figures and efficiencies `prefill_model.py`
assumes (a model, not a measurement; attention and the norms are left out, small beside these
at short context).

The experts: each of the k + 1 tokens chooses 8 of 256 per layer; the expected number of
distinct experts is 256 (1 - (1 - 8/256)^(k+1)). A GEMV reads each chosen expert once per token
that chose it (almost the same bytes: the tokens' experts barely overlap); the grouped GEMM
reads it once but runs an 8-row tile per expert for its one or two tokens. The bytes and the
GEMVs' ALU work are `model_graph.pass_traffic`'s; "break-even" is `verify_cost_ratio`, the
tokens per pass at which a verify pass pays (what speculative="auto" compares a draft source's
tokens per pass with), on a roofline at the M5 Max's ridge, with the pass's copy of the
recurrent state into its backup.

    python benchmarks/verify_pass_model.py
"""

from __future__ import annotations

from make_synthetic_checkpoint import real_config
from prefill_model import FP32_TILES, GPUS, MEMORY_EFFICIENCY

from lily.checkpoint.config import FULL_ATTENTION, parse_config
from lily.engine.model_graph import pass_traffic, token_macs, verify_cost_ratio
from lily.kernels.quantized_gemm import dense_tile_tokens, grouped_tile_tokens


def main() -> None:
    c = parse_config(real_config())
    d, layers = c.hidden_size, c.num_hidden_layers
    attention_layers = sum(1 for kind in c.layer_types if kind == FULL_ATTENTION)
    macs = token_macs(c)
    dense = (layers - attention_layers) * macs.gdn + attention_layers * macs.attention
    # The router and shared-expert gate are 8-bit: counted apart from the 4-bit shared expert.
    router = layers * d * (c.num_experts + 1)
    dense += layers * macs.shared - router
    head = d * c.vocab_size
    expert = macs.experts // c.num_experts_per_tok
    print("verify pass at the real dims: weights read and matrix work executed (a model)")
    print(f"{'drafts':>6} {'tokens':>6} {'GB read':>8} {'GEMM tiles GFLOP':>17} "
          f"{'GEMV GFLOP':>11} {'break-even':>10}   estimated ms, GEMM tiles -> GEMVs")  # fmt: skip
    for drafts in (0, 1, 2, 4, 8):
        tokens = drafts + 1
        distinct = c.num_experts * (1 - (1 - c.num_experts_per_tok / c.num_experts) ** tokens)
        traffic = pass_traffic(c, tokens)
        gb = traffic.weight_bytes
        # A decode step (one token) runs GEMVs either way.
        dense_rows = dense_tile_tokens(tokens) if tokens > 1 else 1
        expert_rows = sum(grouped_tile_tokens(1)) if tokens > 1 else 1
        tiles = 2.0 * dense_rows * (dense + router + head)
        tiles += 2.0 * expert_rows * layers * distinct * expert
        useful = 2.0 * tokens * (dense + router + head + layers * c.num_experts_per_tok * expert)
        gemv_ops = traffic.gemv_ops
        times = []
        for gpu in GPUS:
            bandwidth = gpu.bandwidth * MEMORY_EFFICIENCY
            rate = gpu.fp32_rate * FP32_TILES.efficiency
            before = max(gb / bandwidth, tiles / rate)
            after = max(gb / bandwidth, gemv_ops / gpu.fp32_rate)
            times.append(f"{gpu.name.split(' (')[0]} {before * 1e3:6.1f} -> {after * 1e3:5.1f}")
        print(
            f"{drafts:>6} {tokens:>6} {gb / 1e9:8.2f} {tiles / 1e9:17.0f} {useful / 1e9:11.1f} "
            f"{verify_cost_ratio(c, drafts):10.2f}   " + ", ".join(times)
        )


if __name__ == "__main__":
    main()
