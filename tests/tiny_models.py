"""Tiny random Qwen3.6-MoE checkpoints in the real MLX format, and mlx-lm's outputs on them.

A checkpoint is made the way spec/testing.md describes: a random model in the original Hugging
Face layout (nested `text_config`, fused expert tensors, zero-centred norms stored as w), then
`mlx_lm convert -q --q-group-size 64 --q-bits 4`, which renames the tensors, bakes 1+w into the
norms, stores conv1d as [C, K, 1] and makes the router and shared-expert gates 8-bit, exactly as
in the real file. mlx-lm drops the vision tower, so a small random one is then added to the same
shard as mlx-vlm's converter writes the real one (`vision_tower.*`, bf16, not quantized, the
patch embedding's kernel channels-last; docs/vision.md), with its `vision_config`. The weights
are deliberately not "nice": norms are non-identity so that a (1+w)-versus-w mistake shows, and
GDN decay parameters span a realistic range.

Everything is cached under `LILY_TEST_CACHE` (default `~/.cache/lily-tests`), keyed by a hash of
the generator parameters and the mlx / mlx-lm versions. Builds happen in a temporary directory
that is renamed into place, so concurrent test processes never see a half-written checkpoint.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from importlib import metadata
from pathlib import Path

import numpy as np

from lily.checkpoint import demo, dflash, mtp
from lily.checkpoint.cache import build_once
from lily.checkpoint.demo import random_hf_mtp_head, random_hf_vision_tower, write_safetensors
from lily.checkpoint.loader import load_checkpoint, write_aligned_checkpoint
from lily.checkpoint.mtp import (
    MTP_FC,
    MTP_FINAL_NORM,
    MTP_NORM_EMBEDDING,
    MTP_SHARD,
    quantize_mtp_head,
    write_mtp_index,
)
from lily.checkpoint.quant import dequantize, float32_to_bf16, pack_codes

# Bump when the generator changes in a way its parameters do not capture.
GENERATOR_VERSION = 3


@dataclass(frozen=True)
class TinySpec:
    seed: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    linear_num_key_heads: int
    linear_num_value_heads: int
    num_experts: int
    num_experts_per_tok: int
    moe_intermediate_size: int
    shared_expert_intermediate_size: int
    vocab_size: int
    # The real model's head dims; the family validator requires them.
    head_dim: int = 256
    linear_key_head_dim: int = 128
    linear_value_head_dim: int = 128
    linear_conv_kernel_dim: int = 4


TINY_SPECS = {
    # spec/testing.md's example: 8 layers (L L L F L L L F), expert and shared-expert sizes differ.
    "small": TinySpec(
        seed=1,
        hidden_size=128,
        num_hidden_layers=8,
        num_attention_heads=4,
        num_key_value_heads=2,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        num_experts=16,
        num_experts_per_tok=4,
        moe_intermediate_size=64,
        shared_expert_intermediate_size=128,
        vocab_size=1024,
    ),
    # Different seed and sizes: wider hidden, 4 query heads per KV head and 4 value heads per key
    # head (the real model has 8 and 2), more and larger experts, a smaller shared expert.
    "wide": TinySpec(
        seed=2,
        hidden_size=256,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=2,
        linear_num_key_heads=2,
        linear_num_value_heads=8,
        num_experts=32,
        num_experts_per_tok=8,
        moe_intermediate_size=128,
        shared_expert_intermediate_size=64,
        vocab_size=1536,
    ),
}

# "small" where every token uses every expert: no routing decision a rounding could flip, so two
# feeds of one prompt that round differently stay within rounding of each other token after
# token (tests/test_split_prefill.py).
TINY_SPECS["unrouted"] = replace(TINY_SPECS["small"], seed=3, num_experts=4, num_experts_per_tok=4)


@dataclass(frozen=True)
class TinyVision:
    """The tiny vision tower every tiny checkpoint carries (its output size is the checkpoint's
    hidden size). Patch, frame and merge sizes are the real model's, so the preprocessor's
    output feeds it; an 8 x 8 position grid still makes every image interpolate it."""

    depth: int = 2
    hidden_size: int = 64
    num_heads: int = 4
    intermediate_size: int = 96
    patch_size: int = 16
    temporal_patch_size: int = 2
    spatial_merge_size: int = 2
    num_position_embeddings: int = 64
    in_channels: int = 3


TINY_VISION = TinyVision()

# Prompt length and decode steps of the cached mlx-lm reference run.
REFERENCE_PROMPT_TOKENS = 40
REFERENCE_DECODE_STEPS = 16


def cache_root() -> Path:
    root = os.environ.get("LILY_TEST_CACHE") or Path.home() / ".cache" / "lily-tests"
    return Path(root)


def tiny_checkpoint(name: str, aligned: bool = True, mtp_head: bool = False) -> Path:
    """The directory of the converted 4-bit MLX checkpoint `name` (a key of TINY_SPECS).

    mlx writes safetensors without padding, so tensors in mlx-lm's output start at arbitrary
    byte offsets, which Lily's loader refuses. By default the files are rewritten with every
    tensor 16-byte aligned (same tensors, same bytes); `aligned=False` gives mlx-lm's output as
    it wrote it. `mtp_head`: the aligned checkpoint plus a multi-token-prediction head (mlx-lm
    drops `mtp.*`, so Lily quantizes the random original-layout head into its sidecar shard,
    as it does for the real model); the main model's tensors are the same bytes either way.
    """
    spec = TINY_SPECS[name]
    key = f"{name}-{_key(spec)}"
    converted = _cached(f"{key}-mlx", lambda out: _build_checkpoint(spec, out))
    if not aligned:
        return converted
    plain = _cached(key, lambda out: write_aligned_checkpoint(converted, out))
    if not mtp_head:
        return plain
    # Keyed by the code that makes the head too (it lives in Lily: the demo generates its own).
    code = hashlib.sha256(b"".join(Path(m.__file__).read_bytes() for m in (demo, mtp)))
    return _cached(f"{key}-mtp-{code.hexdigest()[:8]}", lambda out: _add_mtp_head(spec, plain, out))


def _add_mtp_head(spec: TinySpec, checkpoint: Path, out: Path) -> None:
    shutil.copytree(checkpoint, out, copy_function=os.link)
    # Its own generator: the head changes none of the main model's random draws.
    hf_head = random_hf_mtp_head(
        _hf_config(spec)["text_config"], np.random.default_rng(spec.seed + 500)
    )
    head = quantize_mtp_head(hf_head, spec.num_experts)
    write_safetensors(out / MTP_SHARD, head, {"format": "mlx"})
    write_mtp_index(out, head)


def tiny_drafter(name: str) -> Path:
    """A random DFlash drafter's sidecar directory (lily.checkpoint.dflash) that fits the tiny
    checkpoint `name`, drawn from its own generator (the checkpoint is unchanged) and
    quantized as Lily quantizes the real drafter."""
    spec = TINY_SPECS[name]
    code = hashlib.sha256(b"".join(Path(m.__file__).read_bytes() for m in (dflash,)))
    key = f"{name}-{_key(spec)}-dflash-{code.hexdigest()[:8]}"
    return _cached(key, lambda out: _write_drafter(spec, out))


def _write_drafter(spec: TinySpec, out: Path) -> None:
    raw = dflash.random_drafter_config(_hf_config(spec)["text_config"])
    config = dflash.parse_dflash_config(raw)
    hf = dflash.random_hf_drafter(config, np.random.default_rng(spec.seed + 600))
    dflash.write_dflash(out, raw, dflash.quantize_dflash(hf, config), "tests.tiny_models")


def eos_token_ids(spec: TinySpec) -> list[int]:
    # <|im_end|> and <|endoftext|>, laid out as in the real vocabulary: the added special tokens
    # follow the BPE ranks, <|endoftext|> first and <|im_end|> two after it.
    end_of_text = spec.vocab_size - 64
    return [end_of_text + 2, end_of_text]


def reference_prompt(name: str) -> list[int]:
    """A fixed pseudo-random prompt for `name`, avoiding the EOS ids."""
    spec = TINY_SPECS[name]
    rng = np.random.default_rng(spec.seed + 1000)
    tokens = rng.integers(0, spec.vocab_size - 64, REFERENCE_PROMPT_TOKENS)
    return [int(t) for t in tokens]


def mlx_reference(name: str) -> dict[str, np.ndarray]:
    """mlx-lm (float32) on the tiny checkpoint: cached npz with

    `prompt` [P], `prompt_logits` [P, V] (teacher-forced over the prompt), `decode_tokens` [S]
    (greedy), `decode_logits` [S, V] (logits after feeding decode_tokens[i] to the cache).
    """
    checkpoint = tiny_checkpoint(name, aligned=False)
    key = f"mlx-reference-{checkpoint.name}-{REFERENCE_PROMPT_TOKENS}-{REFERENCE_DECODE_STEPS}"
    path = _cached(key, lambda out: _run_mlx_lm(checkpoint, reference_prompt(name), out))
    with np.load(path / "outputs.npz") as data:
        return {k: data[k] for k in data.files}


# ---------------------------------------------------------------------------------------------
# Cache plumbing
# ---------------------------------------------------------------------------------------------


def _key(spec: TinySpec) -> str:
    versions = {pkg: metadata.version(pkg) for pkg in ("mlx", "mlx-lm")}
    blob = json.dumps([GENERATOR_VERSION, asdict(spec), versions], sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def _cached(key: str, build: Callable[[Path], None]) -> Path:
    """cache_root()/key, built first if absent (see lily.checkpoint.cache.build_once)."""
    return build_once(cache_root() / key, build)


# ---------------------------------------------------------------------------------------------
# Building a checkpoint
# ---------------------------------------------------------------------------------------------


def _build_checkpoint(spec: TinySpec, out: Path) -> None:
    hf_dir = out.parent / "hf"
    hf_dir.mkdir()
    _write_hf_model(spec, hf_dir)
    subprocess.run(
        [
            sys.executable, "-m", "mlx_lm", "convert",
            "--hf-path", str(hf_dir), "--mlx-path", str(out),
            "-q", "--q-group-size", "64", "--q-bits", "4",
        ],
        check=True,
        capture_output=True,
    )  # fmt: skip
    _add_vision_tower(spec, out)


def _add_vision_tower(spec: TinySpec, out: Path) -> None:
    """Adds the converted random tower to mlx-lm's shard, written by mlx as mlx-vlm writes the
    real checkpoint's (the language model's tensors stay the same bytes)."""
    import mlx.core as mx

    shard = out / "model.safetensors"
    tensors, metadata = mx.load(str(shard), return_metadata=True)
    vision = converted_vision_tensors(_hf_vision_tensors(spec))
    tensors.update({name: mx.array(value).astype(mx.bfloat16) for name, value in vision.items()})
    mx.save_safetensors(str(shard), tensors, metadata)
    index_path = out / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    index["weight_map"].update({name: shard.name for name in vision})
    index["weight_map"] = dict(sorted(index["weight_map"].items()))
    index_path.write_text(json.dumps(index, indent=4))
    config = json.loads((out / "config.json").read_text())
    config.update(_hf_vision_fields(spec))
    (out / "config.json").write_text(json.dumps(config, indent=4))


def converted_vision_tensors(hf: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Original-layout `model.visual.*` tensors as mlx-vlm's converter stores them: renamed to
    `vision_tower.*`, the patch embedding's 3-D convolution kernel moved from [D, C, T, P, P] to
    channels-last [D, T, P, P, C]."""
    out = {}
    for name, value in hf.items():
        converted = name.replace("model.visual.", "vision_tower.", 1)
        if converted == "vision_tower.patch_embed.proj.weight":
            value = value.transpose(0, 2, 3, 4, 1)
        out[converted] = np.ascontiguousarray(value)
    return out


def _layer_types(spec: TinySpec) -> list[str]:
    return [
        "full_attention" if (i + 1) % 4 == 0 else "linear_attention"
        for i in range(spec.num_hidden_layers)
    ]


def _hf_config(spec: TinySpec) -> dict:
    eos = eos_token_ids(spec)
    text = {
        "model_type": "qwen3_5_moe_text",
        "dtype": "bfloat16",
        "hidden_size": spec.hidden_size,
        "num_hidden_layers": spec.num_hidden_layers,
        "layer_types": _layer_types(spec),
        "full_attention_interval": 4,
        "num_attention_heads": spec.num_attention_heads,
        "num_key_value_heads": spec.num_key_value_heads,
        "head_dim": spec.head_dim,
        "attn_output_gate": True,
        "linear_num_key_heads": spec.linear_num_key_heads,
        "linear_num_value_heads": spec.linear_num_value_heads,
        "linear_key_head_dim": spec.linear_key_head_dim,
        "linear_value_head_dim": spec.linear_value_head_dim,
        "linear_conv_kernel_dim": spec.linear_conv_kernel_dim,
        "num_experts": spec.num_experts,
        "num_experts_per_tok": spec.num_experts_per_tok,
        "moe_intermediate_size": spec.moe_intermediate_size,
        "shared_expert_intermediate_size": spec.shared_expert_intermediate_size,
        "norm_topk_prob": True,
        "rms_norm_eps": 1e-6,
        "vocab_size": spec.vocab_size,
        "max_position_embeddings": 262144,
        "tie_word_embeddings": False,
        "mtp_num_hidden_layers": 1,
        "rope_parameters": {
            "rope_type": "default",
            "rope_theta": 10_000_000,
            "partial_rotary_factor": 0.25,
            "mrope_section": [11, 11, 10],
            "mrope_interleaved": True,
        },
        "eos_token_id": eos,
    }
    return {
        "architectures": ["Qwen3_5MoeForConditionalGeneration"],
        "model_type": "qwen3_5_moe",
        "text_config": text,
        "tie_word_embeddings": False,
        "eos_token_id": eos,
    }


def _hf_vision_fields(spec: TinySpec) -> dict:
    """`vision_config` and the vision token ids, laid out after <|endoftext|> as in the real
    vocabulary (docs/vision.md)."""
    v = TINY_VISION
    end_of_text = spec.vocab_size - 64
    return {
        "vision_config": {
            "model_type": "qwen3_5_moe",
            "deepstack_visual_indexes": [],
            "depth": v.depth,
            "hidden_act": "gelu_pytorch_tanh",
            "hidden_size": v.hidden_size,
            "in_channels": v.in_channels,
            "intermediate_size": v.intermediate_size,
            "num_heads": v.num_heads,
            "num_position_embeddings": v.num_position_embeddings,
            "out_hidden_size": spec.hidden_size,
            "patch_size": v.patch_size,
            "spatial_merge_size": v.spatial_merge_size,
            "temporal_patch_size": v.temporal_patch_size,
        },
        "vision_start_token_id": end_of_text + 9,
        "vision_end_token_id": end_of_text + 10,
        "image_token_id": end_of_text + 12,
        "video_token_id": end_of_text + 13,
    }


def _hf_vision_tensors(spec: TinySpec) -> dict[str, np.ndarray]:
    """The random tower under the original names and layouts (`model.visual.*`), from its own
    generator so that the language model's weights are the draws they always were."""
    vision = {**asdict(TINY_VISION), "out_hidden_size": spec.hidden_size}
    tower = random_hf_vision_tower(vision, np.random.default_rng(spec.seed + 700))
    return {f"model.visual.{name}": value for name, value in tower.items()}


def _hf_tensors(spec: TinySpec) -> dict[str, np.ndarray]:
    """Random weights under the original Hugging Face names and layouts."""
    rng = np.random.default_rng(spec.seed)
    h = spec.hidden_size

    def dense(out_dim: int, in_dim: int, *lead: int) -> np.ndarray:
        # Scaled so activations stay O(1) through the residual stream.
        return rng.normal(0, in_dim**-0.5, (*lead, out_dim, in_dim)).astype(np.float32)

    def zero_centred_norm(dim: int) -> np.ndarray:
        return rng.normal(0, 0.1, dim).astype(np.float32)

    key_dim = spec.linear_num_key_heads * spec.linear_key_head_dim
    value_dim = spec.linear_num_value_heads * spec.linear_value_head_dim
    conv_dim = 2 * key_dim + value_dim
    hv = spec.linear_num_value_heads
    q_rows = spec.num_attention_heads * spec.head_dim
    kv_rows = spec.num_key_value_heads * spec.head_dim

    prefix = "model.language_model."
    t = {
        prefix + "embed_tokens.weight": rng.normal(0, 1, (spec.vocab_size, h)).astype(np.float32),
        prefix + "norm.weight": zero_centred_norm(h),
        "lm_head.weight": dense(spec.vocab_size, h),
    }
    for i, kind in enumerate(_layer_types(spec)):
        layer = f"{prefix}layers.{i}."
        t[layer + "input_layernorm.weight"] = zero_centred_norm(h)
        t[layer + "post_attention_layernorm.weight"] = zero_centred_norm(h)
        if kind == "linear_attention":
            gdn = layer + "linear_attn."
            t[gdn + "in_proj_qkv.weight"] = dense(conv_dim, h)
            t[gdn + "in_proj_z.weight"] = dense(value_dim, h)
            t[gdn + "in_proj_b.weight"] = dense(hv, h)
            t[gdn + "in_proj_a.weight"] = dense(hv, h)
            t[gdn + "conv1d.weight"] = rng.normal(
                0, 0.5, (conv_dim, 1, spec.linear_conv_kernel_dim)
            ).astype(np.float32)
            t[gdn + "A_log"] = np.log(rng.uniform(0.1, 4.0, hv)).astype(np.float32)
            t[gdn + "dt_bias"] = rng.normal(0, 0.5, hv).astype(np.float32)
            # The gated norm is a plain gain (never +1): centre it on 1.
            t[gdn + "norm.weight"] = (1 + zero_centred_norm(spec.linear_value_head_dim)).astype(
                np.float32
            )
            t[gdn + "out_proj.weight"] = dense(h, value_dim)
        else:
            attn = layer + "self_attn."
            t[attn + "q_proj.weight"] = dense(2 * q_rows, h)  # per head: [query | gate]
            t[attn + "k_proj.weight"] = dense(kv_rows, h)
            t[attn + "v_proj.weight"] = dense(kv_rows, h)
            t[attn + "o_proj.weight"] = dense(h, q_rows)
            t[attn + "q_norm.weight"] = zero_centred_norm(spec.head_dim)
            t[attn + "k_norm.weight"] = zero_centred_norm(spec.head_dim)
        mlp = layer + "mlp."
        e, moe, shared = (
            spec.num_experts,
            spec.moe_intermediate_size,
            spec.shared_expert_intermediate_size,
        )
        t[mlp + "gate.weight"] = dense(e, h)
        t[mlp + "experts.gate_up_proj"] = dense(2 * moe, h, e)
        t[mlp + "experts.down_proj"] = dense(h, moe, e)
        t[mlp + "shared_expert.gate_proj.weight"] = dense(shared, h)
        t[mlp + "shared_expert.up_proj.weight"] = dense(shared, h)
        t[mlp + "shared_expert.down_proj.weight"] = dense(h, shared)
        t[mlp + "shared_expert_gate.weight"] = dense(1, h)
    return t


def _write_hf_model(spec: TinySpec, hf_dir: Path) -> None:
    from safetensors.numpy import save_file

    save_file(_hf_tensors(spec), str(hf_dir / "model.safetensors"), metadata={"format": "pt"})
    (hf_dir / "config.json").write_text(json.dumps(_hf_config(spec), indent=2))
    _write_byte_tokenizer(spec, hf_dir)


def _write_byte_tokenizer(spec: TinySpec, hf_dir: Path) -> None:
    """A minimal byte-level tokenizer: mlx-lm's converter insists on loading one."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {ch: i for i, ch in enumerate(sorted(alphabet))}
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.save(str(hf_dir / "tokenizer.json"))
    (hf_dir / "tokenizer_config.json").write_text(
        json.dumps({"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": 262144})
    )


# ---------------------------------------------------------------------------------------------
# mlx-lm reference outputs
# ---------------------------------------------------------------------------------------------


def _run_mlx_lm(checkpoint: Path, prompt: list[int], out: Path) -> None:
    import mlx.core as mx
    from mlx_lm import load

    model, _ = load(str(checkpoint))
    model.set_dtype(mx.float32)
    cache = model.make_cache()
    prompt_logits = model(mx.array([prompt]), cache=cache)[0]
    next_token = int(mx.argmax(prompt_logits[-1]).item())
    decode_tokens, decode_logits = [], []
    for _ in range(REFERENCE_DECODE_STEPS):
        decode_tokens.append(next_token)
        logits = model(mx.array([[next_token]]), cache=cache)[0, -1]
        decode_logits.append(np.array(logits))
        next_token = int(mx.argmax(logits).item())
    out.mkdir()
    np.savez(
        out / "outputs.npz",
        prompt=np.array(prompt),
        prompt_logits=np.array(prompt_logits),
        decode_tokens=np.array(decode_tokens),
        decode_logits=np.stack(decode_logits),
    )


def echo_head_checkpoint(out: Path) -> Path:
    """The small tiny checkpoint made into a bigram model with a head that drafts exactly its
    predictions, so that drafts are accepted (a random head's almost never are):

    - every layer's output projections (attention's o_proj, the GDN's out_proj, the experts'
      and the shared expert's down_proj) are zero, in the main model and in the head, so every
      residual stream stays the embedding it starts from: the model predicts the token after t
      as argmax lm_head(norm(embed(t))) =: f(t), whatever came before;
    - the head's fc is [identity | 0] (4-bit codes 1 and 0, scale 1, bias 0: exact), its
      embedding norm a unit gain and its final norm the model's: from the hidden state at
      position p and the embedding of token p + 1 it predicts lm_head(norm(norm(embed(t)))),
      f(t) up to the norm's epsilon, which is the model's next token; chained, f(f(t)).

    So greedy drafts of any length are the model's own tokens."""
    source = tiny_checkpoint("small", mtp_head=True)
    shutil.copytree(source, out)
    checkpoint = load_checkpoint(source)
    tensors = {name: np.array(array) for name, array in checkpoint.tensors.items()}
    for name in tensors:
        if name.endswith(("o_proj.weight", "out_proj.weight", "down_proj.weight")):
            for part in ("weight", "scales", "biases"):
                tensors[name.removesuffix("weight") + part][...] = 0
    hidden = checkpoint.config.hidden_size
    codes = np.zeros((hidden, 2 * hidden), np.uint32)
    codes[np.arange(hidden), np.arange(hidden)] = 1
    tensors[MTP_FC + ".weight"] = pack_codes(codes, 4)
    tensors[MTP_FC + ".scales"][...] = float32_to_bf16(np.float32(1.0))
    tensors[MTP_FC + ".biases"][...] = 0
    tensors[MTP_NORM_EMBEDDING][...] = float32_to_bf16(np.float32(1.0))
    tensors[MTP_FINAL_NORM] = tensors["language_model.model.norm.weight"].copy()
    fc = dequantize(*(tensors[f"{MTP_FC}.{part}"] for part in ("weight", "scales", "biases")), 4)
    assert np.array_equal(fc, np.eye(hidden, 2 * hidden))
    weight_map = json.loads((source / "model.safetensors.index.json").read_text())["weight_map"]
    for shard in set(weight_map.values()):
        names = [name for name, file in weight_map.items() if file == shard]
        write_safetensors(out / shard, {n: tensors[n] for n in names}, {"format": "mlx"})
    return out
