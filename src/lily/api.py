"""The user-facing entry point: `lily.load()` returns a `Lily`, which generates text.

import lily
with lily.load("demo") as llm:
    print(llm.generate("Once upon a time", max_tokens=16))
"""

from __future__ import annotations

import json
import platform
import sys
from collections.abc import Iterator
from pathlib import Path

from lily.chat import Chat
from lily.chat_template import ChatTemplate
from lily.checkpoint import DEFAULT_REPO, Checkpoint, load_checkpoint, resolve_model
from lily.detokenize import IncrementalDecoder
from lily.engine import GREEDY, DeviceEngine, Engine, ReferenceEngine
from lily.errors import CheckpointError
from lily.model_graph import DEFAULT_MAX_CHUNK, device_bytes
from lily.sampling import SamplingParams
from lily.tokenizer import Tokenizer

DEVICES = ("auto", "sim", "metal", "reference")
# Context length when the caller does not choose one: long enough for real conversations, and
# only 0.65 GB of bf16 KV cache on the real model.
DEFAULT_MAX_SEQ = 32768


def _metal_supported() -> bool:
    """A macOS build on a GPU the kernels can run on (see docs/apple-silicon.md)."""
    if sys.platform != "darwin" or platform.machine() != "arm64":
        return False
    from lily.device import metal_info

    info = metal_info()
    return info is not None and bool(info["supported"])


def resolve_device(device: str) -> str:
    """`auto` is metal where this build and the GPU support it, else the sim (which says so)."""
    if device not in DEVICES:
        raise ValueError(f"device must be one of {', '.join(DEVICES)}; got {device!r}")
    if device != "auto":
        return device
    if _metal_supported():
        return "metal"
    if sys.platform == "darwin":
        print("lily: no supported Metal GPU; running on the CPU simulator", file=sys.stderr)
    return "sim"


# Each prefill chunk is one Metal command buffer, and one that runs for seconds can trip macOS's
# GPU watchdog on a Mac driving a display (`ImpactingInteractivity`). A chunk's estimated work
# is bounded to about a second on the slowest supported GPU (an 8-core M1: 2.6 TFLOPS fp32 peak,
# taken as 2e12 for our kernels). An estimate, not a measurement: no Mac has run it yet.
METAL_CHUNK_FLOPS = 2.0e12


def _make_engine(
    checkpoint: Checkpoint, device: str, max_seq: int, token_count: int, prefill_chunk: int
) -> Engine:
    if device == "reference":
        return ReferenceEngine(checkpoint, max_seq, token_count)
    from lily.device import check_memory, open_device

    check_memory(device, device_bytes(checkpoint, max_seq, prefill_chunk))
    chunk_flops = METAL_CHUNK_FLOPS if device == "metal" else None
    return DeviceEngine(
        checkpoint, open_device(device), max_seq, token_count, prefill_chunk, chunk_flops
    )


def default_sampling(model_dir: Path) -> SamplingParams:
    """The checkpoint's recommended sampling (`generation_config.json`, as transformers reads
    it), else OpenAI's default of temperature 1."""
    path = model_dir / "generation_config.json"
    # A value a request could not ask for (a top_k of 2^32, a negative temperature) is the
    # checkpoint's fault: refused when the model is loaded, naming the file and the field.
    try:
        config = json.loads(path.read_text()) if path.is_file() else {}
        if not isinstance(config, dict):
            raise ValueError("it is not a JSON object")
        if config.get("do_sample") is False:
            return GREEDY
        return SamplingParams(
            temperature=float(config.get("temperature", 1.0)),
            top_k=int(config.get("top_k", 0)),
            top_p=float(config.get("top_p", 1.0)),
            min_p=float(config.get("min_p", 0.0)),
        )
    except (TypeError, ValueError, OverflowError) as e:
        raise CheckpointError(f"{path}: {e}") from None


class Lily:
    """One loaded model on one device. A context manager: `close()` frees the device.

    `llm.chat.completions.create(...)` is the OpenAI-shaped chat API; `generate` and `stream`
    complete raw text.
    """

    def __init__(
        self,
        model_id: str,
        model_dir: Path,
        tokenizer: Tokenizer,
        engine: Engine,
        device: str,
        *,
        escape_special_tokens: bool = False,
    ):
        self.model_id = model_id
        self.model_dir = model_dir
        self.tokenizer = tokenizer
        self.chat_template = ChatTemplate.from_dir(
            model_dir, special_tokens=tokenizer.special_tokens
        )
        self.default_sampling = default_sampling(model_dir)
        # Control tokens written in a request's text are read as plain text (lily.special_tokens).
        self.escape_special_tokens = escape_special_tokens
        self.config = engine.config
        self.device = device
        self.chat = Chat(self)
        self._engine: Engine | None = engine
        # Token counts of the last generation: (prompt tokens, generated tokens).
        self.last_token_counts = (0, 0)

    @property
    def engine(self) -> Engine:
        if self._engine is None:
            raise RuntimeError("this Lily has been closed")
        return self._engine

    @property
    def max_seq(self) -> int:
        return self.engine.max_seq

    def stream(self, prompt: str, *, max_tokens: int = 256) -> Iterator[str]:
        """Raw completion of `prompt` (no chat template), greedy, yielded as text pieces that
        never split a UTF-8 character."""
        prompt_ids = self.tokenizer.encode(prompt)
        decoder = IncrementalDecoder(self.tokenizer)
        self.last_token_counts = (len(prompt_ids), 0)
        for token in self.engine.generate(prompt_ids, max_tokens, self.tokenizer.stop_token_ids):
            self.last_token_counts = (len(prompt_ids), self.last_token_counts[1] + 1)
            if piece := decoder.add(token.id):
                yield piece
        if tail := decoder.flush():
            yield tail

    def generate(self, prompt: str, *, max_tokens: int = 256) -> str:
        """Raw completion of `prompt` as one string."""
        return "".join(self.stream(prompt, max_tokens=max_tokens))

    def close(self) -> None:
        if self._engine is not None:
            self._engine.close()
            self._engine = None

    def __enter__(self) -> Lily:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"Lily(model={str(self.model_dir)!r}, device={self.device!r})"


def load(
    model: str | None = None,
    *,
    revision: str | None = None,
    device: str = "auto",
    max_seq: int | None = None,
    prefill_chunk: int = DEFAULT_MAX_CHUNK,
    escape_special_tokens: bool = False,
) -> Lily:
    """Load a checkpoint and prepare it on a device.

    `model`: None (the default Hugging Face repo, pinned revision), a repo id, a local directory,
    or "demo" (a tiny model with random weights). `device`: "auto" (metal on Apple silicon, else
    sim), "sim", "metal" or "reference" (the numpy model). `max_seq`: the context length.
    `prefill_chunk`: the most prompt tokens processed in one pass (longer chunks read each
    weight fewer times; the scratch grows with it; on metal a chunk is also bounded by its
    estimated time). `escape_special_tokens`: read control tokens such as `<|im_end|>` written
    in a chat request's text as plain text, so that users cannot forge turns (off by default,
    as in transformers; see docs/python-api.md).
    """
    if isinstance(prefill_chunk, bool) or not isinstance(prefill_chunk, int) or prefill_chunk < 1:
        raise ValueError(f"prefill_chunk must be a positive int, got {prefill_chunk!r}")
    device = resolve_device(device)
    model_dir = resolve_model(model, revision)
    checkpoint = load_checkpoint(model_dir)
    tokenizer = Tokenizer.from_dir(model_dir, config_eos_ids=checkpoint.config.eos_token_ids)
    if max_seq is None:
        max_seq = min(DEFAULT_MAX_SEQ, checkpoint.config.max_position_embeddings)
    if not 1 <= max_seq <= checkpoint.config.max_position_embeddings:
        raise ValueError(
            f"max_seq must be between 1 and {checkpoint.config.max_position_embeddings}, "
            f"got {max_seq}"
        )
    if tokenizer.vocab_size > checkpoint.config.vocab_size:
        raise ValueError(
            f"the tokenizer has {tokenizer.vocab_size} ids but the model only "
            f"{checkpoint.config.vocab_size}: they do not belong together"
        )
    engine = _make_engine(checkpoint, device, max_seq, tokenizer.vocab_size, prefill_chunk)
    # The name clients pass as `model`: the repo id, "demo", or the directory's name.
    if model is None:
        model_id = DEFAULT_REPO
    elif Path(model).is_dir():
        model_id = model_dir.name
    else:
        model_id = model
    return Lily(
        model_id, model_dir, tokenizer, engine, device, escape_special_tokens=escape_special_tokens
    )
