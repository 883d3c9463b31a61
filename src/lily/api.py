"""The user-facing entry point: `lily.load()` returns a `Lily`, which generates text.

import lily
with lily.load("demo") as llm:
    print(llm.generate("Once upon a time", max_tokens=16))
"""

from __future__ import annotations

import hashlib
import platform
import sys
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from lily.chat.chat_template import ChatTemplate
from lily.chat.completions import Chat
from lily.chat.detokenize import IncrementalDecoder
from lily.chat.image_sources import ImageAccess
from lily.chat.images import processor_config
from lily.chat.stop import StopStringMatcher
from lily.chat.tokenizer import Tokenizer
from lily.checkpoint.dflash import DFLASH_DIR, DFlashDrafter, demo_drafter_dir, load_dflash
from lily.checkpoint.files import read_json_file
from lily.checkpoint.hub import fetch_dflash
from lily.checkpoint.loader import (
    DEFAULT_REPO,
    Checkpoint,
    ensure_mtp_head,
    load_checkpoint,
    resolve_model,
)
from lily.checkpoint.validate import claims_real_model
from lily.engine.command_buffer_budget import command_buffer_flops
from lily.engine.dflash_graph import drafter_device_bytes
from lily.engine.engine import GREEDY, DeviceEngine, Engine, ReferenceEngine, kv_bytes_per_token
from lily.engine.model_graph import (
    PREFILL_CHUNKS,
    SIM_COMMAND_BUFFER_FLOPS,
    device_bytes,
    kv_cache_bytes_per_token,
    slot_bytes,
    verify_cost_ratio,
)
from lily.engine.prefix_cache import CacheOptions
from lily.engine.prefix_disk import DEFAULT_DISK_BYTES, DEFAULT_MIN_TOKENS
from lily.engine.sampling import SamplingParams
from lily.engine.scheduler import BatchScheduler
from lily.engine.speculative import (
    DEFAULT_DRAFT_TOKENS,
    DraftingHistory,
    Prediction,
    Speculation,
    check_speculative,
)
from lily.errors import CheckpointError, ContextLengthError, RequestError
from lily.kernels.attention import check_kv_cache
from lily.version import __version__

if TYPE_CHECKING:
    from lily.device import Device

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
    if device == "metal" and not _metal_supported():
        raise ValueError(
            "the metal device is not available here: it needs a macOS build of Lily on a "
            "supported Apple silicon GPU (`lily info` says which); use device 'sim' (the kernels "
            "on the CPU) or 'auto'"
        )
    if device != "auto":
        return device
    if _metal_supported():
        return "metal"
    if sys.platform == "darwin":
        print("lily: no supported Metal GPU; running on the CPU simulator", file=sys.stderr)
    return "sim"


def _open_device(device: str, fall_back: bool) -> tuple[str, Device]:
    """The device the engine will run on, and its kind. The metal device is kept only if the
    lane-layout self-test passes on it (lily.kernels.lane_layout); otherwise the GPU is refused
    (UnsupportedGPUError), or with `fall_back` (device "auto") the sim is opened instead, which
    stderr says with the reason."""
    from lily.device import UnsupportedGPUError, metal_info, open_device
    from lily.kernels.lane_layout import run_lane_layout_self_test

    opened = open_device(device)
    if device != "metal":
        return device, opened
    mismatch = run_lane_layout_self_test(opened).mismatch()
    if mismatch is None:
        return device, opened
    reason = f'the GPU "{metal_info()["name"]}" {mismatch}'
    if not fall_back:
        raise UnsupportedGPUError(f"the metal device cannot run here: {reason}")
    print(f"lily: {reason}; running on the CPU simulator", file=sys.stderr)
    return "sim", open_device("sim")


def _metal_budget() -> float:
    """The most estimated work of one command buffer on this Mac's GPU, by its name and core
    count (`command_buffer_budget`; a native module that does not report the count gets the
    fewest cores of a supported GPU)."""
    from lily.device import metal_info

    info = metal_info() or {}
    return command_buffer_flops(info.get("name", ""), info.get("gpu_core_count", 0))


def _make_engine(
    checkpoint: Checkpoint,
    device: str,
    opened: Device | None,
    max_seq: int,
    token_count: int,
    prefill_chunk: int,
    cache: CacheOptions,
    kv_cache: str = "bf16",
    mtp: bool = False,
    parallel: int = 1,
    dflash: DFlashDrafter | None = None,
) -> Engine:
    config = checkpoint.config
    if device == "reference":
        prefix_cache = cache.build(checkpoint, "reference-f32", kv_bytes_per_token(config, 4), 0)
        return ReferenceEngine(checkpoint, max_seq, token_count, prefix_cache)
    from lily.device import check_memory

    working = device_bytes(checkpoint, max_seq, prefill_chunk, kv_cache, mtp)
    if dflash is not None:
        working += drafter_device_bytes(dflash, max_seq, prefill_chunk, config.vocab_size)
    check_memory(device, working)
    per_slot = slot_bytes(config, max_seq, token_count, kv_cache)
    slots = _parallel_slots(device, working, per_slot, parallel)
    if slots < parallel:
        print(
            f"lily: the memory holds {slots} sequences decoding at once, not {parallel}",
            file=sys.stderr,
        )
    if slots > 1:
        working += slots * per_slot
    # Metal: the GPU watchdog, at this Mac's estimated speed; the sim: a stop and a progress
    # report within a second.
    command_buffer_flops = _metal_budget() if device == "metal" else SIM_COMMAND_BUFFER_FLOPS
    # With the MTP head the saved states hold its KV rows too: another layout on disk.
    layout = f"device-{kv_cache}" + ("-mtp" if mtp else "")
    prefix_cache = cache.build(
        checkpoint, layout, kv_cache_bytes_per_token(config, kv_cache, mtp), working
    )
    engine = DeviceEngine(
        checkpoint,
        opened,
        max_seq,
        token_count,
        prefill_chunk,
        command_buffer_flops,
        prefix_cache,
        kv_cache,
        mtp=mtp,
        dflash=dflash,
    )
    return BatchScheduler(engine, slots) if slots > 1 else engine


def _dflash_drafter(model_dir: Path, checkpoint: Checkpoint) -> DFlashDrafter:
    """The DFlash drafter `speculative="dflash"` runs (docs/dflash.md): a `dflash/` sidecar
    directory in the checkpoint's, the demo's random one, or for the real model z-lab's,
    fetched and quantized once (hub.fetch_dflash)."""
    sidecar = model_dir / DFLASH_DIR
    if sidecar.is_dir():
        return load_dflash(sidecar, checkpoint.config)
    if checkpoint.config.raw.get("lily_demo"):
        return load_dflash(demo_drafter_dir(), checkpoint.config)
    if claims_real_model(checkpoint.config):
        return load_dflash(fetch_dflash(checkpoint.config), checkpoint.config)
    raise ValueError(
        f"speculative='dflash' needs a DFlash drafter: {model_dir} has no {DFLASH_DIR}/ "
        "directory (lily.checkpoint.dflash's sidecar) and is not the real model, whose "
        "drafter Lily fetches"
    )


def _parallel_slots(device: str, working: int, per_slot: int, parallel: int) -> int:
    """How many of `parallel` sequences the memory preflight lets decode at once, each slot
    costing `per_slot` bytes beside the engine's `working` bytes (1: no batching)."""
    from lily.device import check_memory

    for count in range(parallel, 1, -1):
        try:
            check_memory(device, working + count * per_slot)
        except MemoryError:
            continue
        return count
    return 1


def default_prefill_chunk(
    checkpoint: Checkpoint, device: str, max_seq: int, kv_cache: str = "bf16", mtp: bool = False
) -> int:
    """The longest of PREFILL_CHUNKS whose scratch, beside the weights and the KV cache of
    `max_seq` tokens in the format `kv_cache` (and the MTP head's weights, cache and buffers,
    with `mtp`), the device's memory takes (the memory preflight decides; the sim has no
    limit), and no longer than the context. When none fits, the shortest: loading then fails
    with the preflight's advice."""
    from lily.device import check_memory

    for chunk in PREFILL_CHUNKS:
        try:
            check_memory(device, device_bytes(checkpoint, max_seq, chunk, kv_cache, mtp))
        except MemoryError:
            continue
        return max(min(chunk, max_seq), 1)
    return min(PREFILL_CHUNKS[-1], max_seq)


def default_sampling(model_dir: Path) -> SamplingParams:
    """The checkpoint's recommended sampling (`generation_config.json`, as transformers reads
    it), else OpenAI's default of temperature 1."""
    path = model_dir / "generation_config.json"
    # A value a request could not ask for (a top_k of 2^32, a negative temperature) is the
    # checkpoint's fault: refused when the model is loaded, naming the file and the field.
    config = read_json_file(path) if path.is_file() else {}
    try:
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


# The files whose content changes what the model answers, beside the weights (whose names and
# sizes alone enter the fingerprint: hashing 19.5 GB at every load is not affordable).
_FINGERPRINTED_FILES = ("config.json", "generation_config.json", "chat_template.jinja")


def system_fingerprint(model_dir: Path) -> str:
    """OpenAI's `system_fingerprint`: Lily's version and the checkpoint's identity (the content
    of its config, generation config and chat template, and the names and sizes of its files),
    so that a client can tell when the same request may be answered differently."""
    digest = hashlib.sha256(f"lily {__version__}".encode())
    for path in sorted(model_dir.iterdir()):
        if not path.is_file():
            continue
        digest.update(f"{path.name}\0{path.stat().st_size}\0".encode())
        if path.name in _FINGERPRINTED_FILES:
            digest.update(path.read_bytes())
    return f"fp_{digest.hexdigest()[:12]}"


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
        speculative: str = "off",
        draft_tokens: int = DEFAULT_DRAFT_TOKENS,
        mtp_head: bool = False,
        fetch_images: bool = False,
    ):
        check_speculative(speculative, draft_tokens)
        self.model_id = model_id
        self.model_dir = model_dir
        self.tokenizer = tokenizer
        self.chat_template = ChatTemplate.from_dir(
            model_dir, special_tokens=tokenizer.special_tokens
        )
        self.default_sampling = default_sampling(model_dir)
        self.system_fingerprint = system_fingerprint(model_dir)
        # Control tokens written in a request's text are read as plain text
        # (lily.chat.special_tokens).
        self.escape_special_tokens = escape_special_tokens
        # How images are cut into patches (None: the checkpoint has no vision tower), and what
        # an image URL may point at in this process's own requests: local files, and http(s)
        # URLs if `fetch_images` (a server never reads local files; lily.chat.image_sources).
        self.image_processor = processor_config(model_dir)
        self.image_access = ImageAccess(files=True, fetch=fetch_images)
        # Speculative decoding (lily.engine.speculative): the mode, the most tokens a pass drafts.
        self.speculative = speculative
        self.draft_tokens = draft_tokens
        # Whether the engine runs the checkpoint's MTP head, which then drafts instead of
        # prompt lookup ("mtp", or "auto" on a checkpoint with a head).
        self.mtp_head = mtp_head
        # What "auto" learned of the head and prompt lookup over this model's generations.
        self._drafting = DraftingHistory()
        self._last_speculation: Speculation | None = None
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

    @property
    def parallel(self) -> int:
        """How many generations decode at once (`lily.load`'s `parallel`, as memory allows)."""
        engine = self.engine
        return engine.slots if isinstance(engine, BatchScheduler) else 1

    def speculation(self, prediction: Prediction | None = None) -> Speculation:
        """The drafting of one generation under this model's `speculative` mode: the MTP head
        or prompt lookup (unless "off"), and the client's `prediction`. Under "auto", a source
        that did not pay in the generations before may sit this one out (`DraftingHistory`),
        and the head sits out a generation whose prediction drafts from the reply's start:
        it would run over every pass's rows (and the prompt's) to draft only where the
        prediction has nothing to. It stays for a reply that opens with a think block, which
        a prediction of the answer does not draft."""
        auto = self.speculative == "auto"
        resting = self._drafting.next_generation(self._last_speculation) if auto else frozenset()
        predicted = prediction is not None and prediction.from_reply_start
        head_rests = "mtp" in resting or (auto and predicted)
        speculation = Speculation(
            draft_tokens=self.draft_tokens,
            mtp=self.mtp_head and self.speculative in ("auto", "mtp") and not head_rests,
            dflash=self.speculative == "dflash",
            ngram=(self.speculative == "ngram" or (auto and not self.mtp_head))
            and "ngram" not in resting,
            prediction=prediction,
            auto=auto,
            pass_cost=self._pass_cost,
        )
        self._last_speculation = speculation
        return speculation

    def _pass_cost(self, drafts: int) -> float:
        """What "auto" charges a verify pass of `drafts` drafts, in decode steps: measured on
        a device engine (`DeviceEngine.pass_cost`), else the model's estimate."""
        if isinstance(self.engine, (DeviceEngine, BatchScheduler)):
            return self.engine.pass_cost(drafts)
        return verify_cost_ratio(self.config, drafts)

    def drafter(self, speculation: Speculation) -> Speculation | None:
        """What the engine drafts from: nothing when speculative decoding is off (a
        prediction then only has its tokens counted as rejected) or nothing can draft."""
        if self.speculative == "off" or not speculation.has_sources:
            return None
        return speculation

    def stream(
        self,
        prompt: str,
        max_tokens: int = 256,
        *,
        temperature: float = 0.0,
        top_p: float = 1.0,
        top_k: int = 0,
        min_p: float = 0.0,
        seed: int | None = None,
        stop: str | Sequence[str] | None = None,
        progress: Callable[[int, int], None] | None = None,
    ) -> Iterator[str]:
        """Raw completion of `prompt` (no chat template), yielded as text pieces that never
        split a UTF-8 character. Greedy unless `temperature` > 0; `seed` makes sampling
        reproducible; generation ends before the first of the `stop` strings (not yielded);
        `progress(fed, total)` is told how far the prompt has been fed (the last call with
        fed == total). Bad arguments raise `lily.errors.RequestError` here, before anything
        runs."""
        if not isinstance(prompt, str):
            raise RequestError(
                f"prompt must be a string, got {type(prompt).__name__}", param="prompt"
            )
        if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1:
            raise RequestError(
                f"max_tokens must be an integer >= 1, got {max_tokens!r}", param="max_tokens"
            )
        stops = [stop] if isinstance(stop, str) else list(stop or ())
        if not all(isinstance(s, str) and s for s in stops):
            raise RequestError("stop must be a non-empty string or a list of them", param="stop")
        sampling = SamplingParams(
            temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p, seed=seed
        )
        prompt_ids = self.tokenizer.encode(prompt)
        if not prompt_ids:
            raise RequestError("prompt is empty: give at least one character", param="prompt")
        if len(prompt_ids) + max_tokens > self.max_seq:
            raise ContextLengthError(
                f"the prompt ({len(prompt_ids)} tokens) + max_tokens ({max_tokens}) exceeds the "
                f"context of {self.max_seq} tokens; load with a larger max_seq or ask for fewer "
                "tokens",
                param="max_tokens",
            )
        return self._stream(prompt_ids, max_tokens, sampling, stops, progress)

    def _stream(
        self,
        prompt_ids: list[int],
        max_tokens: int,
        sampling: SamplingParams,
        stops: list[str],
        progress: Callable[[int, int], None] | None = None,
    ) -> Iterator[str]:
        decoder = IncrementalDecoder(self.tokenizer)
        matcher = StopStringMatcher(stops)
        self.last_token_counts = (len(prompt_ids), 0)
        tokens = self.engine.generate(
            prompt_ids,
            max_tokens,
            self.tokenizer.stop_token_ids,
            sampling,
            **({"progress": progress} if progress else {}),
            **({"drafter": drafter} if (drafter := self.drafter(self.speculation())) else {}),
        )
        try:
            for token in tokens:
                self.last_token_counts = (len(prompt_ids), self.last_token_counts[1] + 1)
                if piece := matcher.feed(decoder.add(token.id)):
                    yield piece
                if matcher.stopped:
                    return
        finally:
            tokens.close()
        if tail := matcher.feed(decoder.flush()) + matcher.flush():
            yield tail

    def generate(
        self,
        prompt: str,
        max_tokens: int = 256,
        *,
        temperature: float = 0.0,
        top_p: float = 1.0,
        top_k: int = 0,
        min_p: float = 0.0,
        seed: int | None = None,
        stop: str | Sequence[str] | None = None,
        progress: Callable[[int, int], None] | None = None,
    ) -> str:
        """Raw completion of `prompt` as one string; the parameters are `stream`'s."""
        pieces = self.stream(
            prompt,
            max_tokens,
            temperature=temperature,
            top_p=top_p,
            top_k=top_k,
            min_p=min_p,
            seed=seed,
            stop=stop,
            progress=progress,
        )
        return "".join(pieces)

    def close(self) -> None:
        if self._engine is not None:
            self._engine.close()
            self._engine = None

    def __enter__(self) -> Lily:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"Lily(model={self.model_id!r}, device={self.device!r})"


def load(
    model: str | None = None,
    *,
    revision: str | None = None,
    device: str = "auto",
    max_seq: int | None = None,
    prefill_chunk: int | None = None,
    escape_special_tokens: bool = False,
    cache_memory: int | None = None,
    cache_dir: str | Path | None = None,
    cache_disk_size: int = DEFAULT_DISK_BYTES,
    cache_disk_min_tokens: int = DEFAULT_MIN_TOKENS,
    speculative: str = "auto",
    draft_tokens: int = DEFAULT_DRAFT_TOKENS,
    kv_cache: str = "bf16",
    fetch_images: bool = False,
    parallel: int = 1,
) -> Lily:
    """Load a checkpoint and prepare it on a device.

    `model`: None (the default Hugging Face repo, pinned revision), a repo id, a local directory,
    or "demo" (a tiny model with random weights). `device`: "auto" (metal on Apple silicon, else
    sim), "sim", "metal" or "reference" (the numpy model). `max_seq`: the context length.
    `prefill_chunk`: the most prompt tokens processed in one pass (default: the longest of
    4096, 2048, 1024 and 512 that the memory allows; longer chunks read each weight fewer
    times; the scratch grows with it; on metal a chunk late in a long prompt is also kept short
    enough that each layer's command buffer stays within its time estimate).
    `escape_special_tokens`: read control tokens such as `<|im_end|>` written in a chat
    request's text as plain text, so that users cannot forge turns (off by default, as in
    transformers; see docs/python-api.md).

    The prefix cache (docs/architecture.md) keeps the states of recent conversations in at
    most `cache_memory` bytes of host memory (default: half the memory left after the weights
    and the KV cache, at most 8 GiB; 0 turns reuse off). With `cache_dir`, the states of
    prefixes of at least `cache_disk_min_tokens` tokens are also written there, within
    `cache_disk_size` bytes, and reused by later processes.

    Speculative decoding (docs/python-api.md) checks up to `draft_tokens` (1 to 8) guessed
    tokens in one pass and keeps those the model would have produced, so the output is the
    same: `speculative` is "auto" (the checkpoint's multi-token-prediction head if it has one,
    else prompt lookup, dropped for a request where it is accepted too rarely to pay, and any
    request's `prediction`), "mtp" (the head always; the checkpoint must have one), "ngram"
    (prompt lookup always), "dflash" (the DFlash block drafter always, never chosen by "auto":
    a `dflash/` directory beside the checkpoint's files, the demo's random one, or for the real
    model z-lab's, downloaded once; docs/dflash.md) or "off". A request's `prediction` drafts
    in every mode but "off". The numpy reference engine and a `prefill_chunk` of 1 cannot
    verify drafts: they take "auto" as "off".

    `kv_cache`: the KV cache's format, "bf16" (the default) or "int8" (symmetric int8 codes
    with an fp16 scale per 32 dims: 53% of the bytes, so longer contexts fit and long-context
    decode reads less; docs/python-api.md says what it costs in accuracy). The numpy reference
    engine keeps its cache in float32 and takes only "bf16" (its default).

    Images (docs/vision.md) arrive as `image_url` parts: data URLs and local files
    (`file://...`) always; http(s) URLs are fetched only with `fetch_images=True` (a server
    started with it fetches any address its clients name).

    `parallel`: how many generations decode at once when several threads share this model
    (continuous batching: one pass over the weights per step for all of them; docs/server.md).
    Each costs a sequence's state (`max_seq` tokens of KV cache); the memory preflight may
    allow fewer, which stderr says. Batched streams do not draft: a generation drafts (as
    with `parallel=1`) while it is the only one, and decodes batched from the first pass after
    another arrives. The MTP head is loaded as with `parallel=1`; under "auto", when the
    memory would then hold fewer sequences at once than without it, it is left out (stderr
    says so) and a lone generation drafts with prompt lookup; under "mtp" it stays, and the
    sequences are fewer. A request with a `prediction` drafts it the same way, and one with
    images is batched like any other.
    """
    if prefill_chunk is not None and (
        isinstance(prefill_chunk, bool) or not isinstance(prefill_chunk, int) or prefill_chunk < 1
    ):
        raise ValueError(f"prefill_chunk must be a positive int or None, got {prefill_chunk!r}")
    check_speculative(speculative, draft_tokens)
    check_kv_cache(kv_cache)
    if isinstance(parallel, bool) or not isinstance(parallel, int) or parallel < 1:
        raise ValueError(f"parallel must be a positive int, got {parallel!r}")
    requested, device = device, resolve_device(device)
    if device == "reference" and parallel > 1:
        raise ValueError("the reference engine decodes one sequence at a time: parallel=1")
    if device == "reference" and kv_cache != "bf16":
        raise ValueError("the reference engine keeps its KV cache in float32: kv_cache='bf16'")
    # Before any model work: on the metal device this runs the lane-layout self-test.
    opened = None
    if device != "reference":
        device, opened = _open_device(device, fall_back=requested == "auto")
    model_dir = resolve_model(model, revision)
    checkpoint = load_checkpoint(model_dir)
    if max_seq is None:
        max_seq = min(DEFAULT_MAX_SEQ, checkpoint.config.max_position_embeddings)
    if not 1 <= max_seq <= checkpoint.config.max_position_embeddings:
        raise ValueError(
            f"max_seq must be between 1 and {checkpoint.config.max_position_embeddings}, "
            f"got {max_seq}"
        )
    # The default chunk waits for the MTP head's decision (its memory counts), but whether a
    # pass can take several tokens is known now: the default is 1 only for a max_seq of 1.
    single_token_passes = (prefill_chunk if prefill_chunk is not None else max_seq) < 2
    if speculative in ("ngram", "mtp", "dflash") and (device == "reference" or single_token_passes):
        raise ValueError(
            f"speculative={speculative!r} needs a verify pass of several tokens, which the "
            "reference engine and a prefill_chunk of 1 do not have: use speculative='off' or "
            "'auto'"
        )
    if parallel > 1 and single_token_passes:
        raise ValueError("parallel decoding needs a prefill_chunk of at least 2: parallel=1")
    if parallel > 1 and speculative == "dflash":
        raise ValueError(
            "speculative='dflash' drafts for one sequence at a time and the scheduler's lone "
            "stream drafts only with the MTP head or prompt lookup: use parallel=1 "
            "(lily serve --parallel 1), or 'auto'"
        )
    if device == "reference" or single_token_passes:
        speculative = "off"
    if speculative in ("auto", "mtp") and claims_real_model(checkpoint.config):
        # The real model's 4-bit files lack the head: it is fetched and quantized once.
        model_dir, checkpoint = ensure_mtp_head(model_dir, checkpoint, speculative == "mtp")
    if speculative == "mtp" and not checkpoint.has_mtp_head:
        raise ValueError(
            f"speculative='mtp' needs the checkpoint's multi-token-prediction head (mtp.*), "
            f"which {model_dir} does not have: use speculative='auto' or 'ngram'"
        )
    dflash = _dflash_drafter(model_dir, checkpoint) if speculative == "dflash" else None
    # "auto" drafts with the head when the checkpoint has one.
    mtp_head = speculative in ("auto", "mtp") and checkpoint.has_mtp_head
    tokenizer = Tokenizer.from_dir(
        model_dir,
        config_eos_ids=checkpoint.config.eos_token_ids,
        max_vocab=checkpoint.config.vocab_size,
    )
    if mtp_head and speculative == "auto" and parallel > 1:
        # The head drafts for a lone stream only: it gives way to sequences decoding at once.
        chunk = prefill_chunk or default_prefill_chunk(checkpoint, device, max_seq, kv_cache)
        with_head, without = (
            _parallel_slots(
                device,
                device_bytes(checkpoint, max_seq, chunk, kv_cache, head),
                slot_bytes(checkpoint.config, max_seq, tokenizer.vocab_size, kv_cache),
                parallel,
            )
            for head in (True, False)
        )
        if with_head < without:
            print(
                f"lily: with the MTP head the memory holds {with_head} sequences decoding at "
                f"once, without it {without}: loaded without it (a lone request drafts with "
                "prompt lookup)",
                file=sys.stderr,
            )
            mtp_head = False
    if prefill_chunk is None:
        prefill_chunk = default_prefill_chunk(checkpoint, device, max_seq, kv_cache, mtp_head)
    cache = CacheOptions(cache_memory, cache_dir, cache_disk_size, cache_disk_min_tokens)
    engine = _make_engine(
        checkpoint,
        device,
        opened,
        max_seq,
        tokenizer.vocab_size,
        prefill_chunk,
        cache,
        kv_cache,
        mtp_head,
        parallel,
        dflash,
    )
    # The name clients pass as `model`: the repo id, "demo", or the directory's name.
    if model is None:
        model_id = DEFAULT_REPO
    elif Path(model).is_dir():
        model_id = model_dir.name
    else:
        model_id = model
    return Lily(
        model_id,
        model_dir,
        tokenizer,
        engine,
        device,
        escape_special_tokens=escape_special_tokens,
        speculative=speculative,
        draft_tokens=draft_tokens,
        mtp_head=mtp_head,
        fetch_images=fetch_images,
    )
