"""The graph of one decoded token: every dispatch from the embedding to the next token id,
recorded once from the config and the loaded weights, then replayed by the device every step.

Per step the graph reads the token to consume from the step buffer, runs the 40 (or, for a tiny
model, fewer) layers, writes the logits and the sampled next token, and advances the step buffer
itself (`metal/step.metal`). The host therefore only submits; it never writes between steps.

Activations stay fp32 between kernels (decode is bound by reading weights, so this costs nothing
and keeps the engine close to the reference); the KV cache is bf16 and the GDN state fp32.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from lily.config import FULL_ATTENTION, ModelConfig
from lily.device import Graph
from lily.device_weights import DeviceWeights
from lily.kernels import attention
from lily.kernels.conv1d import record_conv1d_step, window_bytes
from lily.kernels.embedding import record_embedding
from lily.kernels.gdn import record_gdn_step, state_bytes
from lily.kernels.moe import MoeScratch, MoeWeights, record_moe
from lily.kernels.norm import record_add_rms_norm, record_rms_norm
from lily.kernels.quantized import record_qgemv
from lily.kernels.sampling import SAMPLING_PARAMS_BYTES, logprob_ring_bytes, record_sample
from lily.kernels.step import STEP_FIELDS, record_step_advance

if TYPE_CHECKING:
    from lily.checkpoint import Checkpoint
    from lily.device import Buffer, Device

MODEL = "language_model.model."
# Log-probability slots the sampler cycles through; the engine reads a step's slot after waiting
# for it with at most one more step in flight, so anything above 2 is margin.
LOGPROB_RING_SLOTS = 8
LM_HEAD = "language_model.lm_head"


@dataclass
class DecodeState:
    """Device buffers a decode step reads and writes, besides the weights."""

    step: Buffer  # uint32 [position, prompt_end, token]
    history: Buffer  # uint32 [capacity]: prompt then generated ids
    logits: Buffer  # fp32 [vocab]
    predicted: Buffer  # uint32 [1]: the token the last step sampled
    sampling_params: Buffer  # the sampler's settings, written by the host between generations
    logprob_ring: Buffer  # per-step log-probabilities, LOGPROB_RING_SLOTS slots
    conv_windows: dict[int, Buffer] = field(default_factory=dict)  # GDN layer -> fp32 [K-1, C]
    recurrent: dict[int, Buffer] = field(default_factory=dict)  # GDN layer -> fp32 [Hv, Dv, Dk]
    k_cache: dict[int, Buffer] = field(default_factory=dict)  # attention layer -> bf16 cache
    v_cache: dict[int, Buffer] = field(default_factory=dict)

    def recurrent_buffers(self) -> list[Buffer]:
        """Everything that must start from zero for a new sequence (the KV cache needs no
        clearing: attention reads only positions already written)."""
        return [*self.conv_windows.values(), *self.recurrent.values()]


class _Scratch:
    """Activations passed between the dispatches of one step, reused by every layer."""

    def __init__(self, c: ModelConfig, device: Device) -> None:
        def f32(n: int) -> Buffer:
            return device.alloc(4 * n)

        self.residual = f32(c.hidden_size)
        self.normed = f32(c.hidden_size)
        self.mixer_out = f32(c.hidden_size)
        self.moe_out = f32(c.hidden_size)
        # Gated DeltaNet
        self.qkv_projected = f32(c.linear_conv_dim)
        self.qkv = f32(c.linear_conv_dim)
        self.z = f32(c.linear_value_dim)
        self.a = f32(c.linear_num_value_heads)
        self.b = f32(c.linear_num_value_heads)
        self.gdn_out = f32(c.linear_value_dim)
        # Gated attention
        q_heads, kv_heads = c.num_attention_heads, c.num_key_value_heads
        self.q = f32(q_heads * 2 * c.head_dim)
        self.k = f32(kv_heads * c.head_dim)
        self.v = f32(kv_heads * c.head_dim)
        self.queries = f32(q_heads * c.head_dim)
        self.attn_out = f32(q_heads * c.head_dim)
        self.partial_out = device.alloc(attention.partial_out_bytes(q_heads))
        self.partial_stats = device.alloc(attention.partial_stats_bytes(q_heads))
        self.moe = MoeScratch.allocate(
            device,
            c.num_experts,
            c.num_experts_per_tok,
            c.moe_intermediate_size,
            c.shared_expert_intermediate_size,
        )


def device_bytes(checkpoint: Checkpoint, capacity: int) -> int:
    """What a DecodeGraph keeps on the device: the wrapped shards, the KV cache for `capacity`
    tokens, the recurrent state, and (bounded above) the per-step scratch."""
    c = checkpoint.config
    weights = sum(shard.size for shard in checkpoint.shards.values())
    kv = 2 * len(c.full_attention_layers) * attention.cache_bytes(c.num_key_value_heads, capacity)
    gdn_layers = c.num_hidden_layers - len(c.full_attention_layers)
    recurrent = state_bytes(c.linear_num_value_heads) + window_bytes(c.linear_conv_dim)
    scratch = 4 * (c.vocab_size + 16 * c.linear_conv_dim) + 4 * capacity
    return weights + kv + gdn_layers * recurrent + scratch


class DecodeGraph:
    """The recorded step graph and the buffers it runs on."""

    def __init__(
        self, checkpoint: Checkpoint, device: Device, capacity: int, token_count: int
    ) -> None:
        """`token_count`: ids the tokenizer can produce. The lm_head has padding rows past it
        (248320 vs 248077 on the real model) that must never be chosen."""
        self.config = checkpoint.config
        self.device = device
        self.capacity = capacity
        self.token_count = token_count
        self.weights = DeviceWeights(checkpoint, device)
        self.state = self._allocate_state()
        self._scratch = _Scratch(self.config, device)
        self.graph = Graph()
        self._record()

    # -- buffers ----------------------------------------------------------------------------

    def _allocate_state(self) -> DecodeState:
        c, dev = self.config, self.device
        state = DecodeState(
            step=dev.alloc(4 * STEP_FIELDS),
            history=dev.alloc(4 * self.capacity),
            logits=dev.alloc(4 * c.vocab_size),
            predicted=dev.alloc(4),
            sampling_params=dev.alloc(SAMPLING_PARAMS_BYTES),
            logprob_ring=dev.alloc(logprob_ring_bytes(LOGPROB_RING_SLOTS)),
        )
        for i, kind in enumerate(c.layer_types):
            if kind == FULL_ATTENTION:
                nbytes = attention.cache_bytes(c.num_key_value_heads, self.capacity)
                state.k_cache[i] = dev.alloc(nbytes)
                state.v_cache[i] = dev.alloc(nbytes)
            else:
                state.conv_windows[i] = dev.alloc(window_bytes(c.linear_conv_dim))
                state.recurrent[i] = dev.alloc(state_bytes(c.linear_num_value_heads))
        return state

    def step_view(self) -> np.ndarray:
        return self.state.step.numpy().view(np.uint32)

    def history_view(self) -> np.ndarray:
        return self.state.history.numpy().view(np.uint32)

    def logits_view(self) -> np.ndarray:
        return self.state.logits.numpy().view(np.float32)

    # -- recording ----------------------------------------------------------------------------

    def _record(self) -> None:
        c, g, dev, s, w = self.config, self.graph, self.device, self._scratch, self.weights
        record_embedding(
            g,
            dev,
            (self.state.step, 4 * 2),  # the token field of the step buffer
            w.quantized(MODEL + "embed_tokens"),
            s.residual,
        )
        g.barrier()
        record_rms_norm(
            g,
            dev,
            s.residual,
            w.tensor(MODEL + "layers.0.input_layernorm.weight"),
            s.normed,
            rows=1,
            dim=c.hidden_size,
            eps=c.rms_norm_eps,
        )
        g.barrier()
        for i, kind in enumerate(c.layer_types):
            layer = f"{MODEL}layers.{i}."
            if kind == FULL_ATTENTION:
                self._record_attention(i, layer + "self_attn.")
            else:
                self._record_gated_deltanet(i, layer + "linear_attn.")
            g.barrier()
            # h = x + mixer(x); normed = post_attention_layernorm(h)
            record_add_rms_norm(
                g,
                dev,
                s.residual,
                s.mixer_out,
                w.tensor(layer + "post_attention_layernorm.weight"),
                s.residual,
                s.normed,
                rows=1,
                dim=c.hidden_size,
                eps=c.rms_norm_eps,
            )
            g.barrier()
            record_moe(
                g,
                dev,
                s.normed,
                self._moe_weights(layer + "mlp."),
                c.num_experts_per_tok,
                s.moe,
                s.moe_out,
                normalize=c.norm_topk_prob,
            )
            g.barrier()
            # x = h + moe(h); normed = the next layer's input norm, or the final norm
            is_last = i == c.num_hidden_layers - 1
            next_norm = MODEL + (
                "norm.weight" if is_last else f"layers.{i + 1}.input_layernorm.weight"
            )
            record_add_rms_norm(
                g,
                dev,
                s.residual,
                s.moe_out,
                w.tensor(next_norm),
                s.residual,
                s.normed,
                rows=1,
                dim=c.hidden_size,
                eps=c.rms_norm_eps,
            )
            g.barrier()
        head = MODEL + "embed_tokens" if c.tie_word_embeddings else LM_HEAD
        record_qgemv(g, dev, s.normed, [(w.quantized(head), self.state.logits)])
        g.barrier()
        record_sample(
            g,
            dev,
            logits=self.state.logits,
            vocab=self.token_count,
            params=self.state.sampling_params,
            position=(self.state.step, 0),
            predicted=self.state.predicted,
            logprob_ring=self.state.logprob_ring,
            ring_slots=LOGPROB_RING_SLOTS,
        )
        g.barrier()
        record_step_advance(
            g, dev, self.state.step, self.state.history, self.state.predicted, self.capacity
        )

    def _record_gated_deltanet(self, i: int, prefix: str) -> None:
        c, g, dev, s, w = self.config, self.graph, self.device, self._scratch, self.weights
        record_qgemv(
            g,
            dev,
            s.normed,
            [
                (w.quantized(prefix + "in_proj_qkv"), s.qkv_projected),
                (w.quantized(prefix + "in_proj_z"), s.z),
                (w.quantized(prefix + "in_proj_a"), s.a),
                (w.quantized(prefix + "in_proj_b"), s.b),
            ],
        )
        g.barrier()
        record_conv1d_step(
            g,
            dev,
            x=s.qkv_projected,
            weight=w.tensor(prefix + "conv1d.weight"),
            window=self.state.conv_windows[i],
            out=s.qkv,
            channels=c.linear_conv_dim,
        )
        g.barrier()
        record_gdn_step(
            g,
            dev,
            qkv=s.qkv,
            z=s.z,
            a=s.a,
            b=s.b,
            a_log=w.tensor(prefix + "A_log"),
            dt_bias=w.tensor(prefix + "dt_bias"),
            norm_weight=w.tensor(prefix + "norm.weight"),
            state=self.state.recurrent[i],
            out=s.gdn_out,
            num_key_heads=c.linear_num_key_heads,
            num_value_heads=c.linear_num_value_heads,
            key_head_dim=c.linear_key_head_dim,
            value_head_dim=c.linear_value_head_dim,
            norm_eps=c.rms_norm_eps,
        )
        g.barrier()
        record_qgemv(g, dev, s.gdn_out, [(w.quantized(prefix + "out_proj"), s.mixer_out)])

    def _record_attention(self, i: int, prefix: str) -> None:
        c, g, dev, s, w = self.config, self.graph, self.device, self._scratch, self.weights
        heads = dict(num_q_heads=c.num_attention_heads, num_kv_heads=c.num_key_value_heads)
        record_qgemv(
            g,
            dev,
            s.normed,
            [
                (w.quantized(prefix + "q_proj"), s.q),
                (w.quantized(prefix + "k_proj"), s.k),
                (w.quantized(prefix + "v_proj"), s.v),
            ],
        )
        g.barrier()
        caches = dict(k_cache=self.state.k_cache[i], v_cache=self.state.v_cache[i])
        attention.record_attention_prepare(
            g,
            dev,
            q_proj=s.q,
            k_proj=s.k,
            v_proj=s.v,
            q_norm=w.tensor(prefix + "q_norm.weight"),
            k_norm=w.tensor(prefix + "k_norm.weight"),
            step=self.state.step,
            queries=s.queries,
            capacity=self.capacity,
            rotary_dim=c.rotary_dim,
            rope_theta=c.rope_theta,
            norm_eps=c.rms_norm_eps,
            head_dim=c.head_dim,
            **caches,
            **heads,
        )
        g.barrier()
        attention.record_attention_decode(
            g,
            dev,
            queries=s.queries,
            step=self.state.step,
            partial_out=s.partial_out,
            partial_stats=s.partial_stats,
            capacity=self.capacity,
            head_dim=c.head_dim,
            **caches,
            **heads,
        )
        g.barrier()
        attention.record_attention_combine(
            g,
            dev,
            partial_out=s.partial_out,
            partial_stats=s.partial_stats,
            q_proj=s.q,
            out=s.attn_out,
            num_q_heads=c.num_attention_heads,
        )
        g.barrier()
        record_qgemv(g, dev, s.attn_out, [(w.quantized(prefix + "o_proj"), s.mixer_out)])

    def _moe_weights(self, prefix: str) -> MoeWeights:
        w = self.weights
        return MoeWeights(
            router=w.quantized(prefix + "gate"),
            shared_expert_gate=w.quantized(prefix + "shared_expert_gate"),
            expert_gate=w.quantized(prefix + "switch_mlp.gate_proj"),
            expert_up=w.quantized(prefix + "switch_mlp.up_proj"),
            expert_down=w.quantized(prefix + "switch_mlp.down_proj"),
            shared_gate=w.quantized(prefix + "shared_expert.gate_proj"),
            shared_up=w.quantized(prefix + "shared_expert.up_proj"),
            shared_down=w.quantized(prefix + "shared_expert.down_proj"),
        )
