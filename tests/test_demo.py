"""The demo checkpoint: real MLX format, deterministic, loadable, runnable, labelled random."""

from __future__ import annotations

import json
import threading
from importlib import resources
from pathlib import Path

import numpy as np
import pytest
import tokenizers
from tiny_models import tiny_checkpoint

from lily.checkpoint.demo import TOKENIZER_FILES, demo_checkpoint_dir
from lily.checkpoint.loader import load_checkpoint
from lily.checkpoint.safetensors_mmap import open_safetensors_dir
from lily.checkpoint.vision import VISION_PREFIX
from lily.engine.reference import ReferenceModel


def build_demo(cache: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("LILY_CACHE", str(cache))
    return demo_checkpoint_dir()


@pytest.fixture(scope="module")
def demo_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    with pytest.MonkeyPatch.context() as monkeypatch:
        return build_demo(tmp_path_factory.mktemp("lily-cache"), monkeypatch)


def test_demo_is_created_in_lily_cache_and_reused(
    demo_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert demo_dir.parent.name.startswith("lily-cache")
    stamp = (demo_dir / "model.safetensors").stat().st_mtime_ns
    assert build_demo(demo_dir.parent, monkeypatch) == demo_dir
    assert (demo_dir / "model.safetensors").stat().st_mtime_ns == stamp


def test_demo_is_deterministic(
    demo_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    again = build_demo(tmp_path, monkeypatch)
    names = sorted(p.name for p in demo_dir.iterdir())
    assert names == sorted(p.name for p in again.iterdir())
    for name in names:
        assert (demo_dir / name).read_bytes() == (again / name).read_bytes(), name


def test_concurrent_first_use_yields_one_complete_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("LILY_CACHE", str(tmp_path))
    results: list[Path] = []
    threads = [threading.Thread(target=lambda: results.append(demo_checkpoint_dir()))
               for _ in range(3)]  # fmt: skip
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(set(results)) == 1 and len(results) == 3
    assert [p.name for p in tmp_path.iterdir()] == [results[0].name]  # no temp dirs left
    load_checkpoint(results[0], level="family")


def test_demo_loads_at_family_level(demo_dir: Path) -> None:
    checkpoint = load_checkpoint(demo_dir, level="family")
    c = checkpoint.config
    assert (c.hidden_size, c.num_hidden_layers, c.vocab_size) == (128, 8, 4096)
    assert c.quant_for("language_model.model.layers.5.mlp.gate").bits == 8
    assert c.quant_for("language_model.model.layers.5.mlp.shared_expert_gate").bits == 8
    assert c.quant_for("language_model.model.layers.5.mlp.switch_mlp.up_proj").bits == 4


def test_demo_has_exactly_the_layout_mlx_lm_writes(demo_dir: Path) -> None:
    """Same tensor names, dtypes and shapes as mlx-lm's conversion of the "small" tiny model,
    which has the demo's dimensions except the vocabulary (and the same config keys); the MTP
    head, which mlx-lm drops, as Lily's sidecar for that model holds it; the vision tower as
    mlx-vlm's converter writes the tiny model's (docs/vision.md)."""
    converted = tiny_checkpoint("small", aligned=False)
    theirs = open_safetensors_dir(converted, alignment=1).infos
    assert any(name.startswith(VISION_PREFIX) for name in theirs)
    ours = open_safetensors_dir(demo_dir).infos
    their_head = {
        name: info
        for name, info in open_safetensors_dir(
            tiny_checkpoint("small", mtp_head=True)
        ).infos.items()
        if name.startswith("mtp.")
    }
    assert their_head
    for name, info in their_head.items():
        assert (ours[name].dtype, ours[name].shape) == (info.dtype, info.shape), name
    ours = {name: info for name, info in ours.items() if name not in their_head}
    assert sorted(ours) == sorted(theirs)
    vocab_rows = ("language_model.lm_head.", "language_model.model.embed_tokens.")
    for name, info in theirs.items():
        rows = 4096 if name.startswith(vocab_rows) else info.shape[0]
        expected_shape = (rows, *info.shape[1:])
        assert (ours[name].dtype, ours[name].shape) == (info.dtype, expected_shape), name

    their_config = json.loads((converted / "config.json").read_text())
    our_config = json.loads((demo_dir / "config.json").read_text())
    assert our_config["quantization"] == their_config["quantization"]
    assert our_config["quantization_config"] == their_config["quantization_config"]
    differing = {"vocab_size", "eos_token_id"}
    for key, value in their_config["text_config"].items():
        if key not in differing:
            assert our_config["text_config"][key] == value, key


def test_norms_store_one_plus_w(demo_dir: Path) -> None:
    tensors = load_checkpoint(demo_dir, level="family").tensors
    as_float = (tensors["language_model.model.layers.0.input_layernorm.weight"].astype(np.uint32)
                << 16).view(np.float32)  # fmt: skip
    # Zero-centred weights w ~ N(0, 0.1) stored as 1+w: around 1, clearly not identity.
    assert abs(as_float.mean() - 1) < 0.05 and as_float.std() > 0.05


def test_demo_is_labelled_random_and_ships_the_demo_tokenizer(demo_dir: Path) -> None:
    config = json.loads((demo_dir / "config.json").read_text())
    assert config["lily_demo"]["random_weights"] is True
    assert "RANDOM WEIGHTS" in (demo_dir / "README.md").read_text()
    packaged = resources.files("lily") / "data" / "demo"
    for name in TOKENIZER_FILES:
        assert (demo_dir / name).read_bytes() == (packaged / name).read_bytes()
    tokenizer = tokenizers.Tokenizer.from_file(str(demo_dir / "tokenizer.json"))
    assert tokenizer.get_vocab_size(with_added_tokens=True) <= config["text_config"]["vocab_size"]
    eos = [tokenizer.token_to_id("<|im_end|>"), tokenizer.token_to_id("<|endoftext|>")]
    assert eos == config["eos_token_id"] == [4002, 4000]


def test_reference_model_runs_on_the_demo(demo_dir: Path) -> None:
    checkpoint = load_checkpoint(demo_dir, level="family")
    model = ReferenceModel(checkpoint.config, checkpoint.tensors)
    prompt = [4001, 872, 198, 3007, 4002, 198]
    logits, state = model.prefill(prompt)
    assert logits.shape == (len(prompt), 4096) and np.isfinite(logits).all()
    # Random weights, but not degenerate: the predictions depend on the input.
    assert logits.std(axis=-1).min() > 0.1
    assert len({int(np.argmax(row)) for row in logits}) > 1
    generated = model.generate_greedy(prompt, 5)
    assert generated[0] == int(np.argmax(logits[-1]))
    assert generated[1] == int(np.argmax(model.decode(generated[0], state)))
