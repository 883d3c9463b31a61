"""The DFlash drafter on the device (docs/dflash.md): its weights, its KV cache, and its two
passes recorded as graphs, which lily.engine.dflash_reference computes in numpy.

- *Catch-up* over up to MAX_ROWS context rows at a time: `fc` over the target's layer outputs,
  `hidden_norm`, then per layer `k_proj`/`v_proj` and dflash_prepare without queries, which
  norms and rotates the keys and writes them with the values at the rows' positions. It reads
  the target's rows where a target pass left them (`ModelGraph(kept_layers=...)`).
- *Block* of the newest token and n <= MAX_DRAFTS mask tokens at the position after the
  cache's rows: the target's embedding, per layer the input norm folded into q/k/v,
  dflash_prepare (the block's keys written after the context's, overwritten by the next
  catch-up), dflash_attention, `o_proj` added to the residual, the post-attention norm folded
  into gate/up, SwiGLU, `down_proj` added to the residual; then the final norm and the target's
  lm_head over rows 1..n.

`fc` reads the concatenation of the target layers' outputs; its columns split at those layers'
boundaries into one [hidden, hidden] matrix per layer (the boundaries are whole quantization
groups, so the split is exact), and fc(features) is their sum: the features stay one block of
rows per target layer [len(target_layer_ids), rows, hidden], as a pass of the target copies its
residual rows.

The drafter's tensors are copied once into device buffers (about 0.5 GB for the real drafter at
8 bits); the embedding and lm_head are the target's, bound where the target's lie.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from lily.checkpoint.dflash import DRAFTER_QUANT, DFlashDrafter, norm_names, projection_names
from lily.device import Graph
from lily.engine.dflash_reference import yarn_attention_factor, yarn_ramp
from lily.kernels.dflash_attention import (
    HEAD_DIM,
    DraftRope,
    cache_bytes,
    record_dflash_attention,
    record_dflash_prepare,
)
from lily.kernels.embedding import record_embedding
from lily.kernels.moe_chunk import record_moe_chunk_swiglu
from lily.kernels.norm import FoldedNorm, record_rms_norm
from lily.kernels.quant_weight import QuantWeight, copy_quant_weight
from lily.kernels.quantized import MAX_TOKENS, record_qgemv

if TYPE_CHECKING:
    from lily.device import Buffer, Device

# Rows one catch-up pass takes (the few-token GEMV's most), and drafts one block pass makes.
MAX_ROWS = MAX_TOKENS
MAX_DRAFTS = MAX_TOKENS - 1


def drafter_device_bytes(
    drafter: DFlashDrafter, capacity: int, max_chunk: int, vocab_rows: int
) -> int:
    """What running `drafter` adds on the device for sequences of up to `capacity` tokens:
    its tensors (copied), its KV cache, the target's kept layer outputs (`max_chunk` rows of
    each target layer it reads, in the target's graph) and its activations and logits."""
    c = drafter.config
    h, q = c.hidden_size, c.num_attention_heads * HEAD_DIM
    kv_width = c.num_key_value_heads * HEAD_DIM
    tensors = sum(t.nbytes for t in drafter.tensors.values())
    cache = 2 * c.num_hidden_layers * cache_bytes(c.num_key_value_heads, capacity)
    kept = 4 * len(c.target_layer_ids) * max_chunk * h
    rows = 4 * MAX_ROWS * (2 * h + 3 * q + 2 * kv_width + 2 * c.intermediate_size)
    outputs = 4 * MAX_DRAFTS * (h + vocab_rows)
    return tensors + cache + kept + rows + outputs


class DrafterGraph:
    """The drafter's device state for one sequence of up to `capacity` tokens, with the target's
    embedding table `embedding` and lm_head `lm_head` (vocab rows)."""

    def __init__(
        self,
        drafter: DFlashDrafter,
        device: Device,
        capacity: int,
        embedding: QuantWeight,
        lm_head: QuantWeight,
        features: Buffer | None = None,
        block_rows: int = MAX_ROWS,
    ) -> None:
        """`features`: where the catch-up reads the target layers' outputs, one block of
        `block_rows` rows per target layer (`ModelGraph.layer_outputs`, whose blocks are
        max_chunk rows); by default a buffer of the drafter's own that `catch_up` fills."""
        c = self.config = drafter.config
        if c.head_dim != HEAD_DIM:
            raise ValueError(f"the drafter's kernels take heads of {HEAD_DIM}, not {c.head_dim}")
        self.device = device
        self.capacity = capacity
        self.embedding = embedding
        self.lm_head = lm_head
        t = drafter.tensors
        self._weights = {
            name: copy_quant_weight(
                device, t[f"{name}.weight"], t[f"{name}.scales"], t[f"{name}.biases"]
            )
            for name in projection_names(c)
            if name != "fc"
        }
        h, per_word = c.hidden_size, 32 // DRAFTER_QUANT.bits
        groups = h // DRAFTER_QUANT.group_size
        self._fc = [
            copy_quant_weight(
                device,
                t["fc.weight"][:, i * h // per_word : (i + 1) * h // per_word],
                t["fc.scales"][:, i * groups : (i + 1) * groups],
                t["fc.biases"][:, i * groups : (i + 1) * groups],
            )
            for i in range(len(c.target_layer_ids))
        ]
        self._norms = {name: self._copy(t[name]) for name in norm_names(c)}
        layers, kv = c.num_hidden_layers, c.num_key_value_heads
        self.keys = [device.alloc(cache_bytes(kv, capacity)) for _ in range(layers)]
        self.values = [device.alloc(cache_bytes(kv, capacity)) for _ in range(layers)]
        # The position of a pass's first row: the cache's rows before it.
        self.first = device.alloc(4)
        self.block_rows = block_rows
        self.features = features or device.alloc(4 * len(c.target_layer_ids) * block_rows * h)
        self.tokens = device.alloc(4 * MAX_ROWS)
        self._first_token = device.alloc(4)  # the block's ids start at tokens[0]
        q, kv_width = c.num_attention_heads * HEAD_DIM, kv * HEAD_DIM
        self._x = device.alloc(4 * MAX_ROWS * h)
        self._ctx = device.alloc(4 * MAX_ROWS * h)
        self._q = device.alloc(4 * MAX_ROWS * q)
        self._k = device.alloc(4 * MAX_ROWS * kv_width)
        self._v = device.alloc(4 * MAX_ROWS * kv_width)
        self._queries = device.alloc(4 * MAX_ROWS * q)
        self._attended = device.alloc(4 * MAX_ROWS * q)
        self._gate = device.alloc(4 * MAX_ROWS * c.intermediate_size)
        self._up = device.alloc(4 * MAX_ROWS * c.intermediate_size)
        self._normed = device.alloc(4 * MAX_DRAFTS * h)
        self.logits = device.alloc(4 * MAX_DRAFTS * lm_head.rows)
        low, high = yarn_ramp(HEAD_DIM, c.rope)
        self._rope = DraftRope(
            c.rope.theta, c.rope.factor, low, high, yarn_attention_factor(c.rope.factor)
        )
        self._catch_up: dict[tuple[int, int], Graph] = {}
        self._block: dict[int, Graph] = {}

    def _copy(self, array: np.ndarray) -> Buffer:
        buffer = self.device.alloc(array.nbytes)
        buffer.numpy()[:] = np.ascontiguousarray(array).reshape(-1).view(np.uint8)
        return buffer

    # -- host entry points ------------------------------------------------------------------------

    def catch_up(self, features: np.ndarray, start: int) -> None:
        """Appends context rows at positions start.. from `features` [rows, len(ids), hidden]
        (the target layers' outputs of those tokens), MAX_ROWS at a time."""
        features = np.asarray(features, np.float32)
        view = self.features_view()
        for first in range(0, len(features), MAX_ROWS):
            rows = features[first : first + MAX_ROWS]
            view[:, : len(rows)] = rows.transpose(1, 0, 2)
            self.catch_up_rows(0, len(rows), start + first)

    def catch_up_rows(self, first_row: int, rows: int, start: int) -> None:
        """Appends context rows at positions start.. from rows first_row.. of `features`
        (written by the target's pass, or by `catch_up`), MAX_ROWS at a time."""
        for first in range(first_row, first_row + rows, MAX_ROWS):
            count = min(MAX_ROWS, first_row + rows - first)
            self.first.numpy().view(np.uint32)[0] = start + first - first_row
            self.device.run(self.catch_up_graph(count, first))

    def draft(self, newest: int, n: int, position: int) -> list[int]:
        """n greedy drafts after `newest`, the token at `position` (the cache's rows before it
        are the context)."""
        if position + n + 1 > self.capacity:
            raise ValueError(f"a block at {position} of {n + 1} rows passes the capacity")
        self.tokens.numpy().view(np.uint32)[: n + 1] = [newest] + [self.config.mask_token_id] * n
        self.first.numpy().view(np.uint32)[0] = position
        self.device.run(self.block_graph(n))
        return [int(i) for i in np.argmax(self.logits_view(n), axis=-1)]

    def features_view(self) -> np.ndarray:
        c = self.config
        shape = (len(c.target_layer_ids), self.block_rows, c.hidden_size)
        return self.features.numpy().view(np.float32).reshape(shape)

    def logits_view(self, n: int) -> np.ndarray:
        return self.logits.numpy().view(np.float32)[: n * self.lm_head.rows].reshape(n, -1)

    # -- recorded passes --------------------------------------------------------------------------

    def catch_up_graph(self, rows: int, first_row: int = 0) -> Graph:
        """The catch-up of `rows` rows (1 to MAX_ROWS) from row first_row of each block of
        `features`, at position first[0]."""
        if not 1 <= rows <= MAX_ROWS or not 0 <= first_row <= self.block_rows - rows:
            raise ValueError(
                f"a catch-up takes 1 to {MAX_ROWS} rows of a block, not {rows} from {first_row}"
            )
        key = (rows, first_row)
        if key not in self._catch_up:
            self._catch_up[key] = self._record_catch_up(rows, first_row)
        return self._catch_up[key]

    def block_graph(self, drafts: int) -> Graph:
        """The block pass of the newest token and `drafts` mask tokens (1 to MAX_DRAFTS)."""
        if not 1 <= drafts <= MAX_DRAFTS:
            raise ValueError(f"a block drafts 1 to {MAX_DRAFTS} tokens, not {drafts}")
        if drafts not in self._block:
            self._block[drafts] = self._record_block(drafts + 1)
        return self._block[drafts]

    def _record_catch_up(self, rows: int, first_row: int) -> Graph:
        c, graph, device = self.config, Graph(), self.device
        h = c.hidden_size
        for i, weight in enumerate(self._fc):
            block = (self.features, 4 * (i * self.block_rows + first_row) * h)
            record_qgemv(graph, device, block, [(weight, self._x)], accumulate=i > 0, tokens=rows)
            graph.barrier()
        record_rms_norm(
            graph,
            device,
            self._x,
            self._norms["hidden_norm.weight"],
            self._ctx,
            rows,
            h,
            c.rms_norm_eps,
        )
        graph.barrier()
        for layer in range(c.num_hidden_layers):
            prefix = f"layers.{layer}.self_attn."
            projections = [
                (self._weights[prefix + "k_proj"], self._k),
                (self._weights[prefix + "v_proj"], self._v),
            ]
            record_qgemv(graph, device, self._ctx, projections, tokens=rows)
            graph.barrier()
            self._prepare(graph, layer, rows, queries=False)
            graph.barrier()
        return graph

    def _record_block(self, rows: int) -> Graph:
        c, graph, device = self.config, Graph(), self.device
        h, eps = c.hidden_size, c.rms_norm_eps
        record_embedding(
            graph, device, self.tokens, self._first_token, self.embedding, self._x, rows
        )
        graph.barrier()
        for layer in range(c.num_hidden_layers):
            prefix = f"layers.{layer}."
            attn = prefix + "self_attn."
            norm = FoldedNorm(self._norms[prefix + "input_layernorm.weight"], eps)
            projections = [
                (self._weights[attn + name], out)
                for name, out in (("q_proj", self._q), ("k_proj", self._k), ("v_proj", self._v))
            ]
            record_qgemv(graph, device, self._x, projections, norm=norm, tokens=rows)
            graph.barrier()
            self._prepare(graph, layer, rows, queries=True)
            graph.barrier()
            record_dflash_attention(
                graph,
                device,
                queries=self._queries,
                k_cache=self.keys[layer],
                v_cache=self.values[layer],
                first=self.first,
                out=self._attended,
                num_q_heads=c.num_attention_heads,
                num_kv_heads=c.num_key_value_heads,
                capacity=self.capacity,
                block_rows=rows,
                causal=c.causal_in_block(layer),
                window=c.window(layer),
                scale=HEAD_DIM**-0.5,
            )
            graph.barrier()
            o_proj = self._weights[attn + "o_proj"]
            record_qgemv(
                graph, device, self._attended, [(o_proj, self._x)], accumulate=True, tokens=rows
            )
            graph.barrier()
            mlp = prefix + "mlp."
            norm = FoldedNorm(self._norms[prefix + "post_attention_layernorm.weight"], eps)
            projections = [
                (self._weights[mlp + "gate_proj"], self._gate),
                (self._weights[mlp + "up_proj"], self._up),
            ]
            record_qgemv(graph, device, self._x, projections, norm=norm, tokens=rows)
            graph.barrier()
            record_moe_chunk_swiglu(graph, device, self._gate, self._up, rows * c.intermediate_size)
            graph.barrier()
            down = self._weights[mlp + "down_proj"]
            record_qgemv(graph, device, self._gate, [(down, self._x)], accumulate=True, tokens=rows)
            graph.barrier()
        # Rows 1.. are the drafts' (row 0, the newest token's, predicts what the target has).
        drafts = rows - 1
        record_rms_norm(
            graph,
            device,
            (self._x, 4 * h),
            self._norms["norm.weight"],
            self._normed,
            drafts,
            h,
            eps,
        )
        graph.barrier()
        record_qgemv(graph, device, self._normed, [(self.lm_head, self.logits)], tokens=drafts)
        return graph

    def _prepare(self, graph: Graph, layer: int, rows: int, *, queries: bool) -> None:
        c, attn = self.config, f"layers.{layer}.self_attn."
        record_dflash_prepare(
            graph,
            self.device,
            q_proj=self._q if queries else None,
            k_proj=self._k,
            v_proj=self._v,
            q_norm=self._norms[attn + "q_norm.weight"],
            k_norm=self._norms[attn + "k_norm.weight"],
            first=self.first,
            queries=self._queries if queries else None,
            k_cache=self.keys[layer],
            v_cache=self.values[layer],
            num_q_heads=c.num_attention_heads if queries else 0,
            num_kv_heads=c.num_key_value_heads,
            capacity=self.capacity,
            rows=rows,
            rope=self._rope,
            norm_eps=c.rms_norm_eps,
        )
