"""The per-pass scratch of model_graph: what a decode-only graph (max_chunk 1) allocates.

The decode step folds the norms and residual adds, the GDN's conv and attention's prepare into
the kernels around them, so the activations only a chunk passes between its dispatches are not
allocated when no chunk graph can be recorded; a decode-only engine still decodes as one that
can also take chunks (test_prefill.py runs a whole prompt through it).
"""

from __future__ import annotations

import numpy as np
import pytest
from tiny_models import tiny_checkpoint

from lily.checkpoint.loader import load_checkpoint
from lily.device import open_device
from lily.engine.model_graph import ModelGraph
from lily.kernels.attention import packed_queries_bytes

CHUNK_ONLY = ("normed", "mixer_out", "moe_out", "qkv_projected", "queries")


def test_a_decode_only_graph_allocates_no_chunk_activations() -> None:
    checkpoint = load_checkpoint(tiny_checkpoint("small"))
    c, device = checkpoint.config, open_device("sim")
    decode_only = ModelGraph(checkpoint, device, 16, c.vocab_size, max_chunk=1)
    chunked = ModelGraph(checkpoint, device, 16, c.vocab_size, max_chunk=2)

    assert all(getattr(decode_only._scratch, name) is None for name in CHUNK_ONLY)
    assert all(getattr(chunked._scratch, name) is not None for name in CHUNK_ONLY)
    # The same prompt token decoded by both: the same logits, bit for bit.
    for model in (decode_only, chunked):
        model.history_view()[0] = 7
        model.step_view()[:3] = (0, 1, 0)
        device.run(model.decode)
    np.testing.assert_array_equal(decode_only.logits_view(), chunked.logits_view())


def test_device_bytes_covers_what_the_mtp_head_allocates(monkeypatch) -> None:
    """The memory preflight's figure grows by at least what a graph with the MTP head
    allocates beyond one without it (its KV cache, hidden states, logits, fc halves), in
    either KV format."""
    from lily.device import Device
    from lily.engine.model_graph import device_bytes

    checkpoint = load_checkpoint(tiny_checkpoint("small", mtp_head=True))
    c, device = checkpoint.config, open_device("sim", execute=False)
    allocated: list[int] = []
    for method in ("alloc", "scratch"):
        original = getattr(Device, method)

        def counting(self, nbytes, original=original):
            allocated.append(nbytes)
            return original(self, nbytes)

        monkeypatch.setattr(Device, method, counting)
    for kv_cache in ("bf16", "int8"):
        totals = []
        for mtp in (False, True):
            allocated.clear()
            ModelGraph(checkpoint, device, 64, c.vocab_size, 16, kv_cache, mtp=mtp)
            totals.append(sum(allocated))
        estimate = [device_bytes(checkpoint, 64, 16, kv_cache, mtp) for mtp in (False, True)]
        assert estimate[1] - estimate[0] >= totals[1] - totals[0] > 0


def test_device_bytes_covers_what_verify_passes_allocate(monkeypatch) -> None:
    """Verify passes allocate their logits rows, the sampler's partials for one draw per row,
    the draws, the acceptance and each GDN layer's record of the candidate positions at the
    first one recorded (less than a copy of the recurrent state, which it no longer takes):
    `verify_bytes` covers that, and the preflight's figure covers it beside everything else."""
    from lily.device import Device
    from lily.engine.model_graph import device_bytes, recurrent_state_bytes, verify_bytes

    checkpoint = load_checkpoint(tiny_checkpoint("small"))
    c, device = checkpoint.config, open_device("sim", execute=False)
    allocated: list[int] = []
    for method in ("alloc", "scratch"):
        original = getattr(Device, method)

        def counting(self, nbytes, original=original):
            allocated.append(nbytes)
            return original(self, nbytes)

        monkeypatch.setattr(Device, method, counting)
    model = ModelGraph(checkpoint, device, 64, c.vocab_size, 16)
    before = sum(allocated)
    model.verify_graph(5, 5)
    added = sum(allocated) - before
    assert recurrent_state_bytes(c) == sum(b.size for b in model.state.recurrent_buffers())
    assert verify_bytes(c, c.vocab_size) >= added
    assert added < recurrent_state_bytes(c)
    model.verify_graph(9, 3)
    assert sum(allocated) == before + added  # allocated once, for every verify pass
    weights = sum(shard.size for shard in checkpoint.shards.values())
    assert device_bytes(checkpoint, 64, 16) - weights >= sum(allocated)


def test_a_verify_pass_moves_the_state_without_copying_it() -> None:
    """A verify pass copies no state: each GDN layer runs gdn_tokens and its conv leaves a
    tail, and after the acceptance one gdn_commit and one conv1d_commit per layer take the
    state to the accepted position; the state-traffic model says the same (nothing copied,
    the state read twice and written once when the pass feeds one waiting token)."""
    from lily.engine.model_graph import recurrent_state_bytes, verify_state_traffic

    checkpoint = load_checkpoint(tiny_checkpoint("small"))
    c = checkpoint.config
    model = ModelGraph(checkpoint, open_device("sim", execute=False), 64, c.vocab_size, 16)
    gdn_layers = c.num_hidden_layers - len(c.full_attention_layers)
    for tokens, rows in ((5, 5), (9, 3)):
        dispatches = model.verify_graph(tokens, rows).dispatches
        kernels = [d.kernel for d in dispatches]
        assert "copy_words" not in kernels and "gdn_chunk" not in kernels
        for kernel in ("gdn_tokens", "gdn_commit", "conv1d_commit"):
            assert kernels.count(kernel) == gdn_layers
        # The commits come after the acceptance, all in one level.
        accept = kernels.index("accept_drafts")
        commits = [d for d in dispatches if d.kernel.endswith("_commit")]
        assert all(kernels.index(d.kernel) > accept for d in commits)
        assert len({d.level for d in commits}) == 1
    traffic = verify_state_traffic(c, 5, 5)
    assert traffic.copied == 0
    state = recurrent_state_bytes(c)
    assert 2 * state < traffic.read + traffic.written < 3.5 * state


@pytest.mark.parametrize("kv_cache", ["bf16", "int8"])
def test_slot_bytes_is_what_each_batched_decode_slot_allocates(monkeypatch, kv_cache) -> None:
    from lily.device import Device
    from lily.engine.model_graph import slot_bytes

    checkpoint = load_checkpoint(tiny_checkpoint("small"))
    c, device = checkpoint.config, open_device("sim", execute=False)
    graph = ModelGraph(checkpoint, device, 64, c.vocab_size - 3, 16, kv_cache)
    allocated: list[int] = []
    original = Device.alloc

    def counting(self, nbytes):
        allocated.append(nbytes)
        return original(self, nbytes)

    monkeypatch.setattr(Device, "alloc", counting)
    graph.allocate_slots(3)
    assert sum(allocated) == 3 * slot_bytes(c, 64, c.vocab_size - 3, kv_cache)


def test_packed_queries_exist_where_chunk_attention_runs_on_tensor_ops() -> None:
    """The half queries the tensor-op chunk attention packs: allocated for a tensor-op device
    with a bf16 cache whose passes may take chunks past a verify pass's 9 tokens, sized for the
    longest chunk; nowhere else (an int8 cache keeps the simdgroup kernel)."""
    checkpoint = load_checkpoint(tiny_checkpoint("small"))
    c = checkpoint.config

    def packed(tensor_ops: bool, max_chunk: int, kv_cache: str = "bf16"):
        device = open_device("sim", tensor_ops=tensor_ops)
        model = ModelGraph(
            checkpoint, device, 64, c.vocab_size, max_chunk=max_chunk, kv_cache=kv_cache
        )
        return model._scratch.packed_queries

    heads = (c.num_attention_heads, c.num_key_value_heads)
    assert packed(True, 16).size == packed_queries_bytes(*heads, 16)
    assert packed(False, 16) is None
    assert packed(True, 16, "int8") is None
    assert packed(True, 9) is None


def test_a_verify_pass_is_folded_as_the_decode_step() -> None:
    """A verify pass of 2 to 9 tokens runs no norm, residual add, conv or gated-norm dispatch of
    its own (the GEMVs around them fold them per token, as the decode step's do), and has the
    decode step's levels but for the few it keeps apart: the embedding lookup, attention's
    prepare in each attention layer, the MoE's routing in each layer (its gate/up runs over the
    union of the tokens' experts), the acceptance and the commit."""
    checkpoint = load_checkpoint(tiny_checkpoint("small"))
    c = checkpoint.config
    model = ModelGraph(checkpoint, open_device("sim", execute=False), 64, c.vocab_size, 16)
    decode = model.graph(1, predicts=True).barrier_count
    apart = 1 + len(c.full_attention_layers) + c.num_hidden_layers + 2
    for tokens, rows in ((2, 2), (5, 5), (9, 3)):
        graph = model.verify_graph(tokens, rows)
        kernels = {d.kernel for d in graph.dispatches}
        unfolded = {"rms_norm_float", "add_rms_norm", "conv1d_chunk", "gdn_gated_norm"}
        assert not kernels & unfolded
        assert graph.barrier_count == decode + apart
    # Past the GEMV-shaped kernels' tokens, the prefill chunk's unfolded walk.
    assert "add_rms_norm" in {d.kernel for d in model.verify_graph(10, 9).dispatches}
