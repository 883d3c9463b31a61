"""The Hub probe that lets `lily.load` fail fast without a network: any HTTP answer counts as
reachable, a closed port or an unresolvable host does not (quickly), and proxies are honoured.
And the real model's MTP head, fetched from the shards of the original release that hold it,
against a fake Hub."""

from __future__ import annotations

import http.server
import json
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import huggingface_hub
import numpy as np
import pytest
from huggingface_hub.errors import LocalEntryNotFoundError
from tiny_models import TINY_SPECS, _hf_config, tiny_checkpoint

from lily.checkpoint import hub
from lily.checkpoint.demo import random_hf_mtp_head, write_safetensors
from lily.checkpoint.loader import ensure_mtp_head, load_checkpoint
from lily.checkpoint.quant import bf16_to_float32, dequantize, float32_to_bf16
from lily.checkpoint.safetensors_mmap import CheckpointError, Shard


def load_shard_arrays(path: Path) -> dict[str, np.ndarray]:
    shard = Shard(path, alignment=1)
    return {name: shard.array(name) for name in shard.tensors}


class _AnswersEverything(http.server.BaseHTTPRequestHandler):
    def do_HEAD(self) -> None:
        self.send_response(404)  # an answer all the same
        self.end_headers()

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def local_endpoint() -> Iterator[str]:
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _AnswersEverything)
    thread = threading.Thread(target=server.serve_forever)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        thread.join()
        server.server_close()


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(autouse=True)
def no_proxies(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("HTTPS_PROXY", "HTTP_PROXY", "ALL_PROXY", "https_proxy", "http_proxy",
                 "all_proxy", "NO_PROXY", "no_proxy"):  # fmt: skip
        monkeypatch.delenv(name, raising=False)


def test_an_endpoint_that_answers_is_reachable(
    local_endpoint: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(hub, "hub_endpoint", lambda: local_endpoint)
    assert hub.hub_reachable()


def test_a_closed_port_is_unreachable_at_once(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(hub, "hub_endpoint", lambda: f"http://127.0.0.1:{_closed_port()}")
    started = time.monotonic()
    assert not hub.hub_reachable()
    assert time.monotonic() - started < hub.PROBE_TIMEOUT_SECONDS


def test_the_probe_goes_through_the_proxy(
    local_endpoint: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    unreachable_directly = f"http://127.0.0.1:{_closed_port()}"
    monkeypatch.setattr(hub, "hub_endpoint", lambda: unreachable_directly)
    monkeypatch.setenv("HTTP_PROXY", local_endpoint)  # the proxy answers for it
    assert hub.hub_reachable()
    monkeypatch.setattr(hub, "hub_endpoint", lambda: local_endpoint)
    monkeypatch.setenv("HTTP_PROXY", unreachable_directly)
    assert not hub.hub_reachable()


def test_the_download_hint_names_the_command_and_the_alternatives() -> None:
    hint = hub.download_hint("owner/name", "abc123")
    assert "`hf download owner/name --revision abc123`" in hint
    assert "--model DIR" in hint and "--model demo" in hint


# ---- the real model's MTP head, from a fake Hub ------------------------------------------------


@pytest.fixture
def fake_release(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[Path, list[str]]:
    """The original release as a Hub repo in miniature: bf16 tensors, the head's experts one
    tensor each (as the real release stores them), split over two of three shards. Downloads
    are served from the directory and recorded."""
    repo = tmp_path / "release"
    repo.mkdir()
    spec = TINY_SPECS["small"]
    head = random_hf_mtp_head(_hf_config(spec)["text_config"], np.random.default_rng(7))
    experts = "mtp.layers.0.mlp.experts."
    fused, down = head.pop(experts + "gate_up_proj"), head.pop(experts + "down_proj")
    half = fused.shape[-2] // 2
    for e in range(spec.num_experts):
        head[f"{experts}{e}.gate_proj.weight"] = fused[e, :half]
        head[f"{experts}{e}.up_proj.weight"] = fused[e, half:]
        head[f"{experts}{e}.down_proj.weight"] = down[e]
    bf16 = {name: float32_to_bf16(value) for name, value in head.items()}
    names = sorted(bf16)
    shards = {
        "model-1.safetensors": {"model.language_model.norm.weight": float32_to_bf16(np.ones(8))},
        "model-2.safetensors": {n: bf16[n] for n in names[: len(names) // 2]},
        "model-3.safetensors": {n: bf16[n] for n in names[len(names) // 2 :]},
    }
    weight_map = {}
    for shard, tensors in shards.items():
        write_safetensors(repo / shard, tensors, {"format": "pt"})
        weight_map.update(dict.fromkeys(tensors, shard))
    (repo / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    downloads: list[str] = []

    def hf_hub_download(repo_id, filename, revision=None, local_files_only=False):
        assert repo_id == hub.MTP_SOURCE_REPO
        if local_files_only:
            raise LocalEntryNotFoundError(filename)
        downloads.append(filename)
        return str(repo / filename)

    monkeypatch.setattr(huggingface_hub, "hf_hub_download", hf_hub_download)
    monkeypatch.setattr(hub, "hub_reachable", lambda: True)
    monkeypatch.setenv("LILY_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    return repo, downloads


def test_the_mtp_head_is_fetched_from_its_shards_quantized_and_served_beside_the_checkpoint(
    fake_release: tuple[Path, list[str]],
) -> None:
    repo, downloads = fake_release
    plain = tiny_checkpoint("small")
    checkpoint = load_checkpoint(plain)
    path, headed = ensure_mtp_head(plain, checkpoint, required=True)
    # Only the index and the two shards holding mtp.* were downloaded.
    assert sorted(downloads) == ["model-2.safetensors", "model-3.safetensors",
                                 "model.safetensors.index.json"]  # fmt: skip
    assert headed.has_mtp_head and path != plain
    # The main model's tensors are the same files (linked), the head the release's, quantized:
    # each expert within a quantization step of its original, the norms stored as 1 + w.
    for name in checkpoint.locations:
        np.testing.assert_array_equal(headed.tensors[name], checkpoint.tensors[name])
    original = {}
    for shard in ("model-2.safetensors", "model-3.safetensors"):
        original.update({n: np.array(a) for n, a in load_shard_arrays(repo / shard).items()})
    experts = "mtp.layers.0.mlp.switch_mlp.up_proj"
    up = dequantize(*(headed.tensors[f"{experts}.{p}"] for p in ("weight", "scales", "biases")),
                    4, 64, np.float32)  # fmt: skip
    # Within a quantization step (MLX makes one end of each group exact and may clip the other
    # a little; scales are signed). A wrong expert or projection would be off by the weights.
    step = np.abs(bf16_to_float32(headed.tensors[f"{experts}.scales"])).max()
    for e in (0, 9):
        expected = bf16_to_float32(original[f"mtp.layers.0.mlp.experts.{e}.up_proj.weight"])
        assert np.abs(up[e] - expected).max() <= step
    norm = bf16_to_float32(headed.tensors["mtp.pre_fc_norm_hidden.weight"])
    w = bf16_to_float32(original["mtp.pre_fc_norm_hidden.weight"])
    np.testing.assert_allclose(norm, 1 + w, atol=1e-2)
    # Once: a second load downloads nothing.
    downloads.clear()
    again, _ = ensure_mtp_head(plain, checkpoint, required=True)
    assert again == path and downloads == []


def test_without_the_hub_the_head_is_an_error_only_when_required(
    fake_release: tuple[Path, list[str]],
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    monkeypatch.setattr(hub, "hub_reachable", lambda: False)
    plain = tiny_checkpoint("small")
    checkpoint = load_checkpoint(plain)
    hint = r"cannot be reached: download it once with `hf download Qwen/Qwen3\.6-35B-A3B model"
    with pytest.raises(CheckpointError, match=hint):
        ensure_mtp_head(plain, checkpoint, required=True)
    path, same = ensure_mtp_head(plain, checkpoint, required=False)
    assert path == plain and not same.has_mtp_head
    assert "drafting without the MTP head" in capsys.readouterr().err


def test_a_release_without_a_head_says_so(
    fake_release: tuple[Path, list[str]],
) -> None:
    repo, _ = fake_release
    index = json.loads((repo / "model.safetensors.index.json").read_text())
    index["weight_map"] = {n: s for n, s in index["weight_map"].items() if not n.startswith("mtp.")}
    (repo / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match="has no multi-token-prediction head"):
        hub.fetch_mtp_head(16)
