"""Engines turn token ids into next-token predictions. Two implement one small interface:

- `DeviceEngine` replays recorded graphs of the model on a device (sim or metal): prefill chunks,
  then one decode step per token, one native call each, keeping up to two passes in flight: pass
  N+1 is queued before pass N's token is read, which works because the graphs themselves
  advance the step buffer. A generation under a `TokenConstraint` keeps one pass in flight,
  since the mask of draw N+1 depends on token N.
- `ReferenceEngine` runs the numpy reference model: the oracle, and a device-free fallback that a
  user must ask for by name (`device="reference"`).

**Batched prefill.** A prompt is fed in chunks of up to `max_chunk` tokens, each one pass of the
model graph (`model_graph.py`) at T tokens and one submitted command buffer; only the chunk
holding the last prompt token runs the lm_head and the sampler, and decode steps (T = 1) follow it
in the same pipeline. Chunks are cut at a requested snapshot position, so the snapshot is the
state after exactly that prefix.

**Prefix reuse.** The Gated DeltaNet state cannot be trimmed back like a KV cache, so an engine
keeps snapshots of the recurrent state (conv windows and GDN state) at the positions the caller
marks with `snapshot_at` (the chat facade marks message boundaries) and at regular positions of
long prompts. A later prompt that starts with a snapshot's tokens restores it, with the KV rows
before it, and only feeds the rest. Which snapshots and rows are kept, for how many sequences,
within what memory, is `prefix_cache.PrefixCache`'s policy.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Collection, Iterator, Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Protocol

import numpy as np

from lily.engine.constraint import (
    NoAllowedTokenError,
    TokenConstraint,
    allowed_flags,
    ban_mask,
    draw_mask,
)
from lily.engine.dflash_graph import DrafterGraph
from lily.engine.image_input import ImagePatches
from lily.engine.image_tokens import EncodedImages, PromptImages, cache_tokens, image_runs
from lily.engine.lock import (
    EngineLock,
    holds_engine,
    holds_engine_while_generating,
    shares_engine,
)
from lily.engine.model_graph import (
    DEFAULT_MAX_CHUNK,
    EMBED_TOKENS,
    LM_HEAD,
    LOGPROB_RING_SLOTS,
    MAX_DRAFT_TOKENS,
    ModelGraph,
    device_bytes,
    kv_cache_bytes_per_token,
    longest_chunk,
    verify_cost_ratio,
)
from lily.engine.prefix_cache import Arrays, PrefixCache, PrefixMatch, default_cache_memory
from lily.engine.reference import ReferenceModel, ReferenceState
from lily.engine.sampling import (
    GeneratedToken,
    SamplingParams,
    TokenLogprobs,
    adjusted_logits,
    sampling_distribution,
    top_logprobs,
)
from lily.engine.speculative import Drafter, HeadDrafts, Speculation
from lily.engine.vision_encoder import DEFAULT_COMMAND_BUFFER_FLOPS, VisionEncoder
from lily.errors import ContextLengthError, GenerationCancelled, NonFiniteLogitsError
from lily.kernels.attention import row_bytes
from lily.kernels.sampling import (
    NO_TOKEN,
    read_logprobs,
    write_logit_adjustments,
    write_sampling_params,
    write_token_mask,
    write_token_masks,
)
from lily.kernels.step import POSITION, PROMPT_END, TOKEN

GREEDY = SamplingParams(temperature=0.0)

if TYPE_CHECKING:
    from lily.checkpoint.config import ModelConfig
    from lily.checkpoint.dflash import DFlashDrafter
    from lily.checkpoint.loader import Checkpoint
    from lily.device import CommandBuffer, Device

PIPELINE_DEPTH = 2
# Encoded images kept across requests (EncodedImages): a 1024 x 1024 image is 1024 rows, 8 MiB
# at the real model's hidden size.
ENCODED_IMAGES_BYTES = 256 << 20


class Engine(Protocol):
    config: ModelConfig
    max_seq: int

    def generate(
        self,
        prompt: Sequence[int],
        max_new_tokens: int,
        stop_token_ids: Collection[int] = (),
        sampling: SamplingParams = GREEDY,
        snapshot_at: int | Collection[int] | None = None,
        should_stop: Callable[[], bool] | None = None,
        constraint: TokenConstraint | None = None,
        cache_key: str | None = None,
        reply_so_far: int = 0,
        progress: Callable[[int, int], None] | None = None,
        drafter: Drafter | None = None,
        images: Sequence[ImagePatches] = (),
    ) -> Iterator[GeneratedToken]:
        """Yields the tokens generated after `prompt`, stopping after a stop token; with
        `sampling.top_logprobs` set, each carries its logprob and that many alternatives.
        Closing the iterator stops the generation. The longest cached prefix that `prompt`
        starts with is reused (preferring the sequence last used with `cache_key` among equal
        ones); `snapshot_at` asks for new snapshots after the first that many tokens.
        `should_stop` is asked before every command buffer of a prefill chunk and every token
        (also while the caller is not reading); once it returns True the generation raises
        GenerationCancelled. `constraint`, if given, is asked for the allowed tokens before
        every draw and told every drawn token (before it is yielded); a mask allowing none of
        the tokens raises NoAllowedTokenError. With drafts it is also asked and told along them,
        and takes back (`TokenConstraint.rollback`) those not accepted and the tokens never
        yielded, so that it ends up told exactly the yielded tokens. Log-probabilities ignore
        the mask. The last
        `reply_so_far` tokens of `prompt` are the reply so far, when a generation resumes after
        the caller appended to it: the frequency and presence penalties count them as
        generated, so a reply's penalties do not restart. `progress`, if given, is told
        (prompt tokens fed so far, prompt length) as the prompt is fed, after every command
        buffer of a chunk (a chunk's tokens count as fed in proportion to its command buffers
        run), the cached prefix counting as fed; the last call has the two equal. `drafter`,
        if given, proposes tokens that verify passes check several at a time (speculative
        decoding, `lily.engine.speculative`); what is generated is the same with or without
        it. `images`: the prompt holds one run of `config.image_token_id` per image, exactly
        `image.num_tokens` long, in the images' order, whose embeddings become the image's
        encoded rows (ImageTokensError if the runs do not match, ImagesUnsupportedError for a
        model without a vision tower; docs/vision.md)."""
        ...

    def cached_prefix_length(
        self,
        prompt: Sequence[int],
        cache_key: str | None = None,
        images: Sequence[ImagePatches] = (),
    ) -> int:
        """How many leading tokens of `prompt` (with `images`, as `generate` takes them) the
        prefix cache would spare `generate` feeding."""
        ...

    def teacher_forced_logits(
        self, tokens: Sequence[int], reuse: bool = False, images: Sequence[ImagePatches] = ()
    ) -> np.ndarray:
        """Logits [len(tokens), vocab] of a fresh sequence fed `tokens`: row i predicts i + 1.
        With `reuse`, the longest cached prefix of `tokens` is resumed instead of fed, and only
        the rows of the tokens after it are returned."""
        ...

    def prompt_logits(
        self, prompt: Sequence[int], images: Sequence[ImagePatches] = ()
    ) -> np.ndarray:
        """Logits [vocab] predicting the token after `prompt` in a fresh sequence, computed the
        way `generate` computes its first token (batched prefill on a device)."""
        ...

    def close(self) -> None: ...


def check_fits(prompt_length: int, max_new_tokens: int, max_seq: int) -> None:
    """Refuses an empty prompt, a negative budget, and a request longer than the context."""
    if prompt_length == 0:
        raise ValueError("the prompt is empty: give at least one token")
    if max_new_tokens < 0:
        raise ValueError(f"max_new_tokens must be >= 0, got {max_new_tokens}")
    if prompt_length + max_new_tokens > max_seq:
        raise ContextLengthError(
            f"prompt ({prompt_length} tokens) + max_new_tokens ({max_new_tokens}) exceeds the "
            f"context of {max_seq} tokens; load with a larger max_seq or ask for fewer tokens"
        )


def _reply(prompt: list[int], reply_so_far: int) -> list[int]:
    """The last `reply_so_far` tokens of `prompt`: a resumed reply's tokens so far."""
    if not 0 <= reply_so_far <= len(prompt):
        raise ValueError(
            f"reply_so_far must be 0 to {len(prompt)} (the prompt), got {reply_so_far}"
        )
    return prompt[len(prompt) - reply_so_far :]


def _numpy_tower_encoder(checkpoint: Checkpoint) -> Callable[[ImagePatches], np.ndarray]:
    """The numpy vision tower on the checkpoint's weights, as a function of an image (the
    weights are read on the first image)."""
    from lily.checkpoint.vision import parse_vision_config, vision_weights
    from lily.engine.vision_reference import VisionTower

    towers: list[VisionTower] = []

    def encode(image: ImagePatches) -> np.ndarray:
        if not towers:
            config = parse_vision_config(checkpoint.config.raw)
            towers.append(
                VisionTower(config, vision_weights(checkpoint.tensors, checkpoint.config))
            )
        return towers[0](image.pixel_values, image.grid_thw)

    return encode


def _check_stop(should_stop: Callable[[], bool] | None) -> None:
    if should_stop is not None and should_stop():
        raise GenerationCancelled("the generation was cancelled")


def banned_tokens_mask(sampling: SamplingParams, token_count: int) -> np.ndarray | None:
    """The mask without the tokens `sampling` bans, refusing a logit_bias for an id the
    tokenizer cannot produce."""
    sampling.check_token_ids(token_count)
    return ban_mask(sampling.banned_tokens(), token_count)


def _positions(snapshot_at: int | Collection[int] | None) -> list[int]:
    if snapshot_at is None:
        return []
    return [snapshot_at] if isinstance(snapshot_at, int) else list(snapshot_at)


@dataclass(frozen=True)
class _Request:
    """What a speculating generation drafts after and checks after each verify pass."""

    prompt: list[int]
    sampling: SamplingParams
    stop_token_ids: Collection[int]
    max_new_tokens: int
    constraint: TokenConstraint | None
    bans: np.ndarray | None  # the mask of the tokens the sampling parameters ban


@dataclass(frozen=True)
class _SubmittedPass:
    """A pass of speculative decoding in flight: it feeds the token waiting at position `last`
    and checks `count` drafts, the head's taken on the device when `on_device`; `started` is
    when its drafting began (for a pass queued behind another, when that one was read). A pass
    queued before the host read the one ahead of it learns `last` at that read (-1 until)."""

    ticket: int
    last: int
    count: int
    on_device: bool
    started: float


@dataclass
class SpeculativePipeline:
    """How a DeviceEngine queued its verify passes and speculative decode steps: `ahead`,
    behind a pass the host had not read yet (the device goes on to it without waiting for the
    host); `after_read`, with no pass in flight (the device waits while the host drafts and
    encodes it)."""

    ahead: int = 0
    after_read: int = 0


@dataclass
class _Piece:
    """One command buffer of a pass over positions [start, start + tokens): the `index`-th of
    `count`; `ticket` once submitted."""

    start: int
    tokens: int
    predicts: bool
    index: int
    count: int
    command_buffer: CommandBuffer
    images: bool = False  # the pass puts staged image rows over its tokens' embeddings
    ticket: int = 0

    @property
    def last(self) -> bool:
        return self.index + 1 == self.count

    @property
    def fed(self) -> int:
        """How many prompt tokens count as fed once this command buffer has run: its share of
        the pass (the layer groups are of about equal work)."""
        return self.start + self.tokens * (self.index + 1) // self.count


@dataclass(frozen=True)
class PrefillSlices:
    """How a prefill shares the device with other sequences' decoding (continuous batching,
    `lily.engine.scheduler`): chunks of at most `tokens`, and `before(chunk)` called before
    each chunk of the prompt is fed (`chunk` its tokens) with no pass of this generation in
    flight: it may run other sequences' passes, which touch none of this sequence's state."""

    tokens: int
    before: Callable[[int], None]


def _allows(mask: np.ndarray | None, token: int) -> bool:
    return mask is None or bool((mask[token // 32] >> np.uint32(token % 32)) & 1)


class _StepClock:
    """The wall time of pipelined decode steps, from the tokens they yield: the steady rate
    between the first and the last, once there are STEADY_STEPS of them (the first steps of a
    generation still share the pipeline with the prompt's last chunk)."""

    STEADY_STEPS = 8

    def __init__(self) -> None:
        self._first = self._last = 0.0
        self._steps = 0

    def tick(self) -> None:
        self._last = time.perf_counter()
        if self._steps == 0:
            self._first = self._last
        self._steps += 1

    def seconds_per_step(self) -> float | None:
        if self._steps < self.STEADY_STEPS:
            return None
        return (self._last - self._first) / (self._steps - 1)


class _DeviceRows:
    """The device's KV cache arrays through their host-visible views (the sim's and Metal's
    buffers are shared memory): [num_kv_heads, capacity, head_dim] bf16 bits each, or
    [num_kv_heads, capacity, 272] bytes of int8 rows (codes and scales)."""

    def __init__(self, model: ModelGraph) -> None:
        c = model.config
        dtype = np.uint16 if model.kv_cache == "bf16" else np.uint8
        width = row_bytes(model.kv_cache) // np.dtype(dtype).itemsize
        shape = (c.num_key_value_heads, model.capacity, width)
        state = model.state
        self._arrays = [
            buffer.numpy().view(dtype).reshape(shape)
            for layer in sorted(state.k_cache)
            for buffer in (state.k_cache[layer], state.v_cache[layer])
        ]

    def copy_out(self, tokens: int) -> Arrays:
        return [a[:, :tokens].copy() for a in self._arrays]

    def copy_in(self, rows: Arrays, tokens: int) -> None:
        for array, saved in zip(self._arrays, rows, strict=True):
            array[:, :tokens] = saved[:, :tokens]


def kv_bytes_per_token(config: ModelConfig, itemsize: int) -> int:
    """One position's keys and values over every attention layer."""
    heads = config.num_key_value_heads * config.head_dim
    return 2 * len(config.full_attention_layers) * heads * itemsize


class _PromptsWithImages:
    """What both engines do alike with a prompt's images: key the prefix cache by them, and
    find an image's rows among those kept before encoding it (`_encode_image`, each engine's)."""

    config: ModelConfig
    prefix_cache: PrefixCache
    _encoded_images: EncodedImages

    @shares_engine
    def cached_prefix_length(
        self,
        prompt: Sequence[int],
        cache_key: str | None = None,
        images: Sequence[ImagePatches] = (),
    ) -> int:
        keys = cache_tokens(prompt, image_runs(prompt, images, self.config))
        return self.prefix_cache.cached_length(keys, cache_key)

    def _image_rows(self, image: ImagePatches) -> np.ndarray:
        """The image's rows: kept by digest, else encoded."""
        return self._encoded_images.rows(image, self._encode_image)


class DeviceEngine(_PromptsWithImages):
    def __init__(
        self,
        checkpoint: Checkpoint,
        device: Device,
        max_seq: int,
        token_count: int,
        max_chunk: int = DEFAULT_MAX_CHUNK,
        command_buffer_flops: float | None = None,
        prefix_cache: PrefixCache | None = None,
        kv_cache: str = "bf16",
        mtp: bool = False,
        dflash: DFlashDrafter | None = None,
    ) -> None:
        """`token_count`: how many ids the tokenizer can produce; only those are generated.
        `max_chunk`: the most prompt tokens one prefill pass takes. A pass is split into
        command buffers by layers (`ModelGraph`, of at most `command_buffer_flops` when given),
        submitted one by one: cancellation and progress are checked between them.
        `command_buffer_flops`, if given, also keeps a chunk short enough that each layer's
        estimated work (`layer_flops`, which grows with the context) fits it, so that no
        command buffer runs long enough to trip the GPU watchdog, or, on the sim, to make a
        stop or a progress report wait long. `prefix_cache`: which prefixes are kept for
        reuse (default: in memory, with `default_cache_memory`'s budget). `kv_cache`: the KV
        cache's format, "bf16" or "int8" (kernels/attention.py). `mtp`: run the checkpoint's
        multi-token-prediction head, so that a drafter asking for it (`Speculation.mtp`) gets
        its drafts. `dflash`: run this DFlash drafter (lily.checkpoint.dflash, docs/dflash.md)
        for a drafter asking for it (`Speculation.dflash`): every pass keeps the rows it reads,
        and it catches up on them after each pass."""
        self.config = checkpoint.config
        self.device = device
        self.max_seq = max_seq
        self.max_chunk = max_chunk
        self.command_buffer_flops = command_buffer_flops
        self._model = ModelGraph(
            checkpoint,
            device,
            max_seq,
            token_count,
            max_chunk,
            kv_cache,
            mtp=mtp,
            command_buffer_flops=command_buffer_flops,
            kept_layers=() if dflash is None else dflash.config.target_layer_ids,
        )
        # The DFlash drafter, and the position its cache's rows reach in the generation that
        # drafts with it (the rows before it are the context of its next block; None in one
        # that does not).
        self._dflash: DrafterGraph | None = None
        self._dflash_rows: int | None = None
        if dflash is not None:
            if max_chunk < 2:
                raise ValueError("the DFlash drafter drafts for verify passes: max_chunk >= 2")
            head = EMBED_TOKENS if self.config.tie_word_embeddings else LM_HEAD
            self._dflash = DrafterGraph(
                dflash,
                device,
                max_seq,
                self._model.weights.quantized(EMBED_TOKENS),
                self._model.weights.quantized(head),
                self._model.layer_outputs,
                max_chunk,
            )
        # Hidden states of the last pass the MTP head has not read yet: (the pass's first
        # position, how many of its rows are right), the rows being `mtp_hidden`'s first; None
        # while the generation does not draft with the head.
        self._mtp_pending: tuple[int, int] | None = None
        self._rows = _DeviceRows(self._model)
        if prefix_cache is None:
            working = device_bytes(checkpoint, max_seq, max_chunk, kv_cache, mtp)
            prefix_cache = PrefixCache(
                default_cache_memory(working),
                kv_cache_bytes_per_token(self.config, kv_cache, mtp),
            )
        self.prefix_cache = prefix_cache
        recurrent = [b.numpy() for b in self._model.state.recurrent_buffers()]
        prefix_cache.set_layout(kv_cache, self._rows.copy_out(0), recurrent)
        self._checkpoint = checkpoint
        self._vision: VisionEncoder | None = None
        self._encoded_images = EncodedImages(ENCODED_IMAGES_BYTES)
        # Whether the rope-position table holds every slot's own index (text-only prompts).
        self._rope_table_is_identity = True
        # Prompt tokens fed through the model by `generate`, over the engine's life.
        self.prompt_tokens_fed = 0
        # Measured: a pipelined decode step's wall time (the latest generation's that decoded
        # plainly long enough), and the last verify pass's with its drafting (`pass_cost`).
        self._step_seconds: float | None = None
        self._pass_seconds: float | None = None
        self.speculative_pipeline = SpeculativePipeline()
        self.lock = EngineLock()  # one thread at a time (lock.py)

    @property
    def model_graph(self) -> ModelGraph:
        """The engine's state and recorded passes (`lily.engine.batch` adds slots to it)."""
        return self._model

    def pass_cost(self, drafts: int) -> float:
        """What the last verify pass (of `drafts` drafts) cost, in decode steps: its measured
        wall time, drafting included (from the read of the pass before, for a pass queued behind
        it), against a pipelined decode step's, once this engine has decoded plainly; until then
        the model's estimate (`model_graph.verify_cost_ratio`), which leaves the drafting out.
        What "auto" weighs a pass's tokens against."""
        if self._step_seconds is None or self._pass_seconds is None:
            return verify_cost_ratio(self.config, drafts)
        return self._pass_seconds / self._step_seconds

    def _encode_image(self, image: ImagePatches) -> np.ndarray:
        """The vision tower's rows [num_tokens, hidden] of an image, on the device
        (`VisionEncoder`, bound to the checkpoint's tower at the first image)."""
        if self._vision is None:
            self._vision = VisionEncoder.from_checkpoint(
                self.device,
                self._checkpoint,
                command_buffer_flops=self.command_buffer_flops or DEFAULT_COMMAND_BUFFER_FLOPS,
            )
        return self._vision.encode(image)

    def _prompt_images(self, prompt: Sequence[int], images: Sequence[ImagePatches]) -> PromptImages:
        return PromptImages(prompt, images, self.config, self._image_rows)

    def _write_rope_table(self, images: PromptImages) -> None:
        """Every slot's rotary positions for a generation with these images: the prompt's,
        then each later slot's index plus the offset after the last image (identity for text,
        rewritten only after a prompt with images changed it)."""
        model = self._model
        if model.rope_table is None or (images.positions is None and self._rope_table_is_identity):
            return
        table = model.rope_table_view()
        length = 0 if images.positions is None else images.positions.shape[1]
        if images.positions is not None:
            table[:length] = images.positions.T
        table[length:] = (np.arange(length, model.capacity) + images.rope_offset)[:, None]
        self._rope_table_is_identity = images.positions is None

    def _stage_images(self, images: PromptImages, start: int, tokens: int) -> bool:
        """Stages the image rows of the pass over [start, start + tokens), if it has image
        tokens (no pass may be in flight); returns whether it has."""
        if not images.touches(start, start + tokens):
            return False
        rows = images.rows_in(start, start + tokens)
        assert rows is not None
        self._model.stage_image_rows(rows, images.flags_in(start, start + tokens))
        return True

    def _start(
        self,
        tokens: Sequence[int],
        prompt_end: int,
        reuse: bool = False,
        cache_key: str | None = None,
        images: PromptImages | None = None,
    ) -> int:
        """Sets the recurrent state (a cached prefix's when `reuse` finds one, else zero), the
        rope-position table, and points the step buffer at the first token to feed; returns
        that token's position."""
        if images is None:
            images = self._prompt_images(tokens, ())
        match = self.prefix_cache.begin(images.cache_tokens, self._rows, cache_key, reuse)
        self._write_rope_table(images)
        start, saved = (0, None) if match is None else (match.length, match.state)
        for i, buffer in enumerate(self._model.state.recurrent_buffers()):
            buffer.numpy()[:] = 0 if saved is None else saved[i]
        history = self._model.history_view()
        history[: len(tokens)] = tokens
        step = self._model.step_view()
        step[POSITION], step[PROMPT_END], step[TOKEN] = start, prompt_end, tokens[start]
        write_token_mask(self._model.state.token_mask, None)
        return start

    def _take_snapshot(self, tokens: Sequence[int]) -> None:
        """Saves the recurrent state; call with no pass in flight."""
        buffers = self._model.state.recurrent_buffers()
        self.prefix_cache.add_snapshot(tokens, len(tokens), [b.numpy().copy() for b in buffers])

    def _passes(
        self,
        first: int,
        prompt_length: int,
        max_new_tokens: int,
        snapshot_at: int | Collection[int] | None,
        images: PromptImages | None = None,
        chunk_tokens: int | None = None,
    ) -> Iterator[tuple[int, int, bool]]:
        """(start, tokens, predicts) of each pass of a generation, in order: prefill chunks
        over positions [first, prompt_length) of at most `max_chunk` tokens, cut at the
        `snapshot_at` positions, the last predicting the first new token; then one decode step
        per further token. A chunk is cut one token short rather than leave a lone image token
        behind it (a one-token pass cannot take image rows). `chunk_tokens` caps the chunks
        further."""
        cuts = [first, *sorted(_positions(snapshot_at)), prompt_length]
        for low, high in zip(cuts, cuts[1:], strict=False):
            start = low
            while start < high:
                end = self._chunk_end(start, min(high, start + (chunk_tokens or high)))
                if images and high - end == 1 and end - start > 2 and images.touches(end, high):
                    end -= 1
                yield start, end - start, end == prompt_length
                start = end
        for position in range(prompt_length, prompt_length + max_new_tokens - 1):
            yield position, 1, True

    def _pieces(
        self, passes: Iterator[tuple[int, int, bool]], images: PromptImages
    ) -> Iterator[_Piece]:
        """The command buffers of the passes, in order."""
        for start, tokens, predicts in passes:
            with_images = images.touches(start, start + tokens)
            graph = self._model.graph(tokens, predicts=predicts, images=with_images)
            buffers = graph.command_buffers
            for index, command_buffer in enumerate(buffers):
                yield _Piece(
                    start, tokens, predicts, index, len(buffers), command_buffer, with_images
                )

    def _chunk_end(self, start: int, high: int) -> int:
        """Where the chunk starting at `start` ends: at most `max_chunk` tokens and `high`,
        within `command_buffer_flops` (`longest_chunk`)."""
        most = min(self.max_chunk, high - start)
        return start + longest_chunk(self.config, start, most, self.command_buffer_flops)

    @holds_engine_while_generating
    def generate(
        self,
        prompt: Sequence[int],
        max_new_tokens: int,
        stop_token_ids: Collection[int] = (),
        sampling: SamplingParams = GREEDY,
        snapshot_at: int | Collection[int] | None = None,
        should_stop: Callable[[], bool] | None = None,
        constraint: TokenConstraint | None = None,
        cache_key: str | None = None,
        reply_so_far: int = 0,
        progress: Callable[[int, int], None] | None = None,
        drafter: Drafter | None = None,
        images: Sequence[ImagePatches] = (),
        prefill_slices: PrefillSlices | None = None,
        pause: Callable[[], bool] | None = None,
    ) -> Iterator[GeneratedToken]:
        """`Engine.generate`; `prefill_slices`, if given, cuts the prompt's chunks and runs
        other work between them (`PrefillSlices`). `pause`, if given, is asked before each pass
        that follows the first token of a generation with a `drafter`: once it returns True,
        the generation ends at the first point where the sequence state holds exactly the
        tokens yielded, the newest one in the history and not yet consumed (the passes in
        flight are yielded first). The caller tells such an end from a finished generation by
        its last token and count; `BatchedDecoder.join_from_engine` goes on from there."""
        prompt = [int(t) for t in prompt]
        check_fits(len(prompt), max_new_tokens, self.max_seq)
        reply = _reply(prompt, reply_so_far)
        prompt_images = self._prompt_images(prompt, images)
        if max_new_tokens == 0:
            return
        state = self._model.state
        token_count = self._model.token_count
        bans = banned_tokens_mask(sampling, token_count)
        sampling = sampling.with_seed()
        write_sampling_params(state.sampling_params, sampling)
        write_logit_adjustments(state.adjustments, sampling, prompt, token_count, reply)
        # The DFlash drafter needs every prompt row's layer outputs: no prefix is reused.
        blocks = (
            self._dflash is not None
            and drafter is not None
            and self.max_chunk > 1
            and isinstance(drafter, Speculation)
            and drafter.dflash
        )
        first = self._start(
            prompt, len(prompt), reuse=not blocks, cache_key=cache_key, images=prompt_images
        )
        self._dflash_rows = 0 if blocks else None
        write_token_mask(state.token_mask, bans)
        self.prompt_tokens_fed += len(prompt) - first
        # Only positions inside what this call feeds: the others are saved already.
        snapshots = self.prefix_cache.snapshot_positions(
            first, len(prompt), _positions(snapshot_at)
        )
        speculating = drafter is not None and self.max_chunk > 1
        # The MTP head reads each pass's hidden states before the next pass overwrites them.
        head = speculating and self._model.mtp and isinstance(drafter, Speculation) and drafter.mtp
        self._mtp_pending = None
        # Speculating, the passes here stop at the prompt's (predicting the first token).
        plain_tokens = 1 if speculating else max_new_tokens
        passes = self._passes(
            first,
            len(prompt),
            plain_tokens,
            snapshots,
            prompt_images,
            None if prefill_slices is None else prefill_slices.tokens,
        )
        pieces = self._pieces(passes, prompt_images)
        generated: list[int] = []
        in_flight: deque[_Piece] = deque()
        depth = PIPELINE_DEPTH if constraint is None and not head and not blocks else 1
        reported = first  # the prompt tokens `progress` was last told are fed
        clock = _StepClock()
        upcoming = next(pieces, None)
        try:
            while True:
                while upcoming is not None and len(in_flight) < depth:
                    # Asked before every command buffer, so that a stop waits for at most the
                    # ones in flight, not for a whole chunk.
                    _check_stop(should_stop)
                    start, tokens = upcoming.start, upcoming.tokens
                    if prefill_slices and upcoming.index == 0 and start < len(prompt):
                        # A chunk of the prompt next: drain, then let the others run.
                        for pending in in_flight:
                            self.device.wait(pending.ticket)
                        prefill_slices.before(tokens)
                    if upcoming.index == 0 and snapshots and start == snapshots[0]:
                        # The state after consuming tokens [0, start): drain, then save.
                        for pending in in_flight:
                            self.device.wait(pending.ticket)
                        self._take_snapshot(prompt_images.cache_tokens[: snapshots.pop(0)])
                    if upcoming.index == 0 and upcoming.images:
                        # The staged rows are one buffer: the pass before may still read it.
                        for pending in in_flight:
                            self.device.wait(pending.ticket)
                        self._stage_images(prompt_images, start, tokens)
                    if upcoming.index == 0 and upcoming.predicts and constraint is not None:
                        mask = draw_mask(constraint, bans, token_count, start + tokens)
                        write_token_mask(state.token_mask, mask)
                    upcoming.ticket = self.device.submit(upcoming.command_buffer)
                    if head and upcoming.last and not upcoming.predicts:
                        # The head reads the chunk's rows before the next chunk overwrites
                        # them: queued behind the chunk and waited for with it.
                        upcoming.ticket = self._submit_mtp_catch_up(start, tokens)
                    in_flight.append(upcoming)
                    upcoming = next(pieces, None)
                if not in_flight:
                    break
                piece = in_flight.popleft()
                self.device.wait(piece.ticket)
                end = piece.start + piece.tokens
                fed = piece.fed
                if progress is not None and reported < fed <= len(prompt):
                    progress(fed, len(prompt))
                    reported = fed
                if not piece.last:
                    continue
                predicts = piece.predicts
                if blocks:
                    # One pass in flight: the drafter reads its rows before the next one.
                    self._dflash_catch_up(piece.start, piece.tokens)
                if not predicts:
                    continue
                if head:
                    # Each row's next token is in the history (the prompt's, or the one the
                    # chunk drew): the head reads the last chunk's rows when it first drafts.
                    self._mtp_pending = (piece.start, piece.tokens)
                drawn = self._drawn(end, sampling)
                if constraint is not None:
                    constraint.consume(drawn.id)
                generated.append(drawn.id)
                if depth == PIPELINE_DEPTH and piece.start >= len(prompt):
                    clock.tick()
                yield drawn
                if drawn.id in stop_token_ids:
                    return
            if speculating:
                assert drafter is not None
                request = _Request(
                    prompt, sampling, stop_token_ids, max_new_tokens, constraint, bans
                )
                yield from self._speculate_with(
                    request, generated, drafter, should_stop, pause, head, blocks
                )
        finally:
            # A speculative step may still be running (after a stop token, or when the caller
            # closed the iterator); it only writes state the next generation replaces.
            for pending in in_flight:
                self.device.wait(pending.ticket)
            self._step_seconds = clock.seconds_per_step() or self._step_seconds
            self.prefix_cache.end(self._rows)

    @holds_engine
    def adopt_sequence(self, rope_table: np.ndarray | None = None) -> None:
        """Makes way for a sequence state its caller writes into the engine's, rather than
        `generate` feeding it (`BatchedDecoder.leave_to_engine`, for `resume`): the prefix
        cache first copies out the rows of the cached sequence the KV cache holds. On a model
        that takes images, `rope_table` is the sequence's rotary positions (a batch slot's
        table, identity unless its prompt had images), which the engine's table takes."""
        self.prefix_cache.begin((), self._rows, reuse=False)
        if rope_table is not None:
            table = self._model.rope_table_view()
            table[:] = rope_table
            identity = np.arange(len(table), dtype=table.dtype)[:, None]
            self._rope_table_is_identity = bool((table == identity).all())

    @holds_engine_while_generating
    def resume(
        self,
        prompt_length: int,
        generated: int,
        max_new_tokens: int,
        drafter: Drafter,
        stop_token_ids: Collection[int] = (),
        sampling: SamplingParams = GREEDY,
        constraint: TokenConstraint | None = None,
        should_stop: Callable[[], bool] | None = None,
        pause: Callable[[], bool] | None = None,
    ) -> Iterator[GeneratedToken]:
        """Goes on with a generation whose state its caller wrote into the engine's (after
        `adopt_sequence`): a prompt of `prompt_length` tokens and `generated` of its
        `max_new_tokens` tokens, the newest in the history and not consumed, the sampler's
        settings (its seed), bans and penalty counts in their buffers; `constraint` has been
        told the `generated` tokens. Yields the tokens after them as `generate` does after its
        first token, drafting with `drafter`, `pause` included. The MTP head drafts from the
        second pass on, over its KV cache as it is: the rows of positions fed while the head did
        not follow (those decoded in a batch slot) are stale, which costs acceptance, never a
        token (drafts are verified). The DFlash drafter, whose rows of every position batched
        passes do not keep, does not draft."""
        model = self._model
        tokens = [int(t) for t in model.history_view()[: prompt_length + generated]]
        bans = banned_tokens_mask(sampling, model.token_count)
        request = _Request(
            tokens[:prompt_length], sampling, stop_token_ids, max_new_tokens, constraint, bans
        )
        self._dflash_rows = None
        head = model.mtp and isinstance(drafter, Speculation) and drafter.mtp
        # The head follows the passes from here: the first one's row is its first to read.
        self._mtp_pending = (len(tokens) - 1, 0) if head else None
        yield from self._speculate_with(
            request, tokens[prompt_length:], drafter, should_stop, pause, head, False
        )

    def _drawn(self, end: int, sampling: SamplingParams) -> GeneratedToken:
        """The token the device drew in the predicting pass that ends at position `end`."""
        token = int(self._model.history_view()[end])
        if token == NO_TOKEN:
            raise NonFiniteLogitsError(end)
        return GeneratedToken(token, self._logprobs(end - 1, sampling))

    def _logprobs(self, consumed: int, sampling: SamplingParams) -> TokenLogprobs | None:
        """The log-probabilities of the draw after the token at position `consumed` (the ring's
        slots are keyed by it), when the request asks for them."""
        if sampling.top_logprobs is None:
            return None
        (_, logprob), alternatives = read_logprobs(
            self._model.state.logprob_ring, LOGPROB_RING_SLOTS, consumed, sampling.top_logprobs
        )
        return TokenLogprobs(logprob, tuple(alternatives))

    def _speculate_with(
        self,
        request: _Request,
        generated: list[int],
        drafter: Drafter,
        should_stop: Callable[[], bool] | None,
        pause: Callable[[], bool] | None,
        head: bool,
        blocks: bool,
    ) -> Iterator[GeneratedToken]:
        """`_speculate` with the engine's own draft sources attached to `drafter` for its
        length: the MTP head when `head`, the DFlash drafter when `blocks`."""
        if head:
            assert isinstance(drafter, Speculation)
            # A constraint asks about each draft before the pass: the host takes them.
            drafter.head = (
                self._mtp_drafts if request.constraint is not None else self._head_drafts_on_device
            )
        if blocks:
            assert isinstance(drafter, Speculation)
            drafter.block = self._dflash_drafts
        try:
            yield from self._speculate(request, generated, drafter, should_stop, pause)
        finally:
            if head:
                drafter.head = None
            if blocks:
                drafter.block = None

    def _speculate(
        self,
        request: _Request,
        generated: list[int],
        drafter: Drafter,
        should_stop: Callable[[], bool] | None,
        pause: Callable[[], bool] | None = None,
    ) -> Iterator[GeneratedToken]:
        """Decodes after the first generated token with verify passes wherever `drafter` has
        drafts: two passes in flight when the MTP head drafts on the device, else one at a
        time (the next drafts or masks depend on what this pass accepts, on the host).

        The state (conv windows, GDN state) has consumed every token but the newest, which
        waits in the token history. A pass without drafts feeds it and samples the next on the
        device, as the decode step does. A verify pass feeds it and the drafts, and the device
        draws a token per row, accepts the drafts the draws agree with and takes the recurrent
        state to the last accepted one (`ModelGraph.verify_graph`), rejected draft or not; the
        host reads only the tokens, and the model's own token is the next to wait. The KV rows
        past it are simply rewritten by the next pass (attention reads only positions before
        its own).

        Without a constraint the next pass is submitted as soon as this one's tokens are read,
        before they are yielded: the device runs it while the caller handles them (unless they
        end the generation: a stop token, the last token; a caller that stops early leaves it
        to finish unread, as pipelined decode steps do). With the MTP head drafting on the
        device it is queued earlier still, before this pass is read (`_submit_ahead`), so that
        two passes are in flight as two decode steps are; one queued for tokens the caller
        does not take is waited for and dropped.

        Under a constraint each row draws under its own mask (`_row_masks`), and the
        constraint, told every draft, takes back those not accepted and is told the model's own
        token: it has then been asked and told exactly as plain decoding would have. Tokens a
        pass yields are told to it before the first is yielded; those the caller never gets
        (after a stop token, or when it closes the generation) are taken back."""
        constraint = request.constraint
        tokens = [*request.prompt, *generated]
        upcoming: _SubmittedPass | None = None  # submitted, to be read next
        queued: _SubmittedPass | None = None  # queued behind `upcoming` before it was read
        try:
            while len(generated) < request.max_new_tokens:
                _check_stop(should_stop)
                if upcoming is None:
                    if pause is not None and pause():
                        return  # between two passes: the newest token waits, as `pause` says
                    if drafter.exhausted and constraint is None:
                        # Nothing will be drafted again: decode the rest pipelined.
                        count = request.max_new_tokens - len(generated)
                        yield from self._decode(len(tokens) - 1, count, request, should_stop, pause)
                        return
                    upcoming = self._submit_pass(request, tokens, len(generated), drafter)
                # No pass is queued ahead of one at which `pause` ends the generation.
                if pause is None or not pause():
                    queued = self._submit_ahead(request, upcoming, len(generated), drafter)
                submitted, upcoming = upcoming, None
                produced, told = self._read_pass(submitted, request, drafter)
                ids = [token.id for token in produced]
                ends = any(t in request.stop_token_ids for t in ids) or (
                    len(generated) + len(ids) >= request.max_new_tokens
                )
                # No pass is submitted ahead of one at which `pause` ends the generation.
                ahead = pause is None or not pause()
                if queued is not None:
                    # It feeds the model's token this pass put after its kept drafts.
                    last = submitted.last + len(ids)
                    upcoming = replace(queued, last=last, started=time.perf_counter())
                    queued = None
                elif constraint is None and not ends and not drafter.exhausted and ahead:
                    upcoming = self._submit_pass(
                        request, [*tokens, *ids], len(generated) + len(ids), drafter
                    )
                yielded = 0
                try:
                    for token in produced:
                        tokens.append(token.id)
                        generated.append(token.id)
                        yielded += 1
                        yield token
                        if token.id in request.stop_token_ids:
                            return
                        if len(generated) == request.max_new_tokens:
                            return
                finally:
                    if constraint is not None and told > yielded:
                        constraint.rollback(told - yielded)
        finally:
            for pending in (upcoming, queued):
                if pending is not None:
                    # Submitted for tokens the caller did not take: it only writes state the
                    # next generation replaces (the KV rows past the last token, the recurrent
                    # state, the step, the head's rows), never the prefix cache's snapshots,
                    # which are taken while the prompt is fed.
                    self.device.wait(pending.ticket)

    def _submit_pass(
        self, request: _Request, tokens: list[int], generated: int, drafter: Drafter
    ) -> _SubmittedPass:
        """Drafts after `tokens` (the prompt and the `generated` tokens so far; the last waits
        in the history) and submits the pass that checks the drafts, or the decode step when
        there are none. No pass may be in flight: this writes the step and the pass's inputs."""
        model = self._model
        history, step = model.history_view(), model.step_view()
        last = len(tokens) - 1  # the waiting token's position
        limit = min(request.max_new_tokens - generated - 1, MAX_DRAFT_TOKENS, model.max_chunk - 1)
        started = time.perf_counter()
        self.speculative_pipeline.after_read += 1
        planned = drafter.draft(tokens, limit) if limit > 0 else []
        on_device = isinstance(planned, HeadDrafts)
        if on_device:
            # The head drafts in this pass's own submission: no constraint to ask, and each
            # row draws under the bans alone (a draft they rule out is simply not accepted),
            # here and in the passes queued behind this one (`_submit_ahead`), which write
            # nothing: every row's mask is written now, while none is in flight.
            count = min(len(planned), limit)
            masks = [draw_mask(None, request.bans, model.token_count, last + 1)]
            masks *= MAX_DRAFT_TOKENS + 1
        else:
            drafts, masks = self._row_masks(request, [int(t) for t in planned][:limit], last + 1)
            # The head reads the last pass's rows before this pass overwrites them, in the
            # pass's submission (no wait of its own), when it may draft after this pass.
            head_later = limit > 0 and isinstance(drafter, Speculation) and drafter.head_drafts
            self._mtp_catch_up(head_later)
            history[last + 1 : last + 1 + len(drafts)] = drafts
            count = len(drafts)
        # Everything the history holds counts as given: no advance overwrites it.
        step[POSITION], step[PROMPT_END], step[TOKEN] = last, last + 1 + count, tokens[last]
        if not count:
            if request.constraint is not None:
                write_token_mask(model.state.token_mask, masks[0])
            ticket = self.device.submit(model.decode)
        else:
            rows = count + 1
            graph = model.verify_graph(rows, rows)
            model.verify_position_view()[0] = last
            write_token_masks(model.verify_token_masks, masks, model.token_count)
            if on_device:
                # Queued behind the head's drafts, which it reads: one wait for both.
                self._submit_head_drafts(last, count)
            ticket = self.device.submit(graph)
        return _SubmittedPass(ticket, last, count, on_device, started)

    def _submit_ahead(
        self, request: _Request, pending: _SubmittedPass, generated: int, drafter: Drafter
    ) -> _SubmittedPass | None:
        """Queues the next pass behind `pending`, a verify pass of the head's drafts that the
        host has not read (`generated` tokens before it), when the next drafts would be the
        head's too and nothing needs the host between them: no constraint (its masks follow
        the tokens), no prediction, prompt lookup or DFlash drafter ahead of the head (they draft
        on the host, from the kept tokens). The pass reads only what the device writes: the
        acceptance moves the step and the verify position to the model's token, and the head
        catches up over all of `pending`'s rows and drafts from the row it kept
        (`ModelGraph.mtp_follow_graph`); the rows' masks (the bans) are written already. Its
        draft count is fixed now, from the passes read so far: as if `pending` kept all its
        drafts (so that it never drafts past `max_new_tokens` or the context), and under
        "auto" one pass late. Returns None when it is not queued."""
        if request.constraint is not None or not pending.on_device:
            return None
        if not isinstance(drafter, Speculation):
            return None
        model = self._model
        rows = pending.count + 1  # the most tokens `pending` yields
        newest = pending.last + rows  # the furthest its model's token can be
        limit = min(
            request.max_new_tokens - (generated + rows) - 1,
            MAX_DRAFT_TOKENS,
            model.max_chunk - 1,
            model.capacity - 1 - newest,
        )
        if request.sampling.top_logprobs is not None:
            # Both passes' rows sit in the log-probability ring while `pending`'s are read.
            limit = min(limit, LOGPROB_RING_SLOTS - rows - 1)
        count = drafter.head_drafts_ahead(limit) if limit > 0 else 0
        if count < 1:
            return None
        started = time.perf_counter()
        self.device.submit(model.mtp_follow_graph(rows, count))
        ticket = self.device.submit(model.verify_graph(count + 1, count + 1))
        self.speculative_pipeline.ahead += 1
        return _SubmittedPass(ticket, -1, count, True, started)

    def _read_pass(
        self, submitted: _SubmittedPass, request: _Request, drafter: Drafter
    ) -> tuple[list[GeneratedToken], int]:
        """Waits for `submitted` and returns its tokens, with how many of them the constraint
        has been told (the caller takes back those it does not yield); tells the drafter the
        outcome. The device has pointed the step buffer at the model's own token."""
        model, constraint = self._model, request.constraint
        last, count = submitted.last, submitted.count
        self.device.wait(submitted.ticket)
        if not count:
            self._dflash_catch_up(last, 1)
            self._mtp_pending = None if self._mtp_pending is None else (last, 1)
            produced = [self._drawn(last + 1, request.sampling)]
            if constraint is not None:
                constraint.consume(produced[0].id)
            return produced, 1
        outcome = model.pass_outcome(last, count)
        chosen, drafts = outcome.tokens, outcome.drafts
        if chosen[-1] == NO_TOKEN:
            raise NonFiniteLogitsError(last + len(chosen))
        told = len(chosen) - 1  # the accepted drafts, told already
        if constraint is not None:
            constraint.rollback(len(drafts) - told)
            # After an accepted stop token the model's own token is never yielded.
            if not any(t in request.stop_token_ids for t in chosen[:-1]):
                constraint.consume(chosen[-1])
                told += 1
        self._pass_seconds = time.perf_counter() - submitted.started
        drafter.verified(drafts, len(chosen) - 1)
        # The rows up to the last accepted draft's are right, rejected or not: the model's own
        # token follows them, and the state has consumed them.
        if self._mtp_pending is not None:
            self._mtp_pending = (last, len(chosen))
        self._dflash_catch_up(last, len(chosen))
        produced = [
            GeneratedToken(token, self._logprobs(last + i, request.sampling))
            for i, token in enumerate(chosen)
        ]
        return produced, told

    def _row_masks(
        self, request: _Request, drafts: list[int], position: int
    ) -> tuple[list[int], list[np.ndarray | None]]:
        """The drafts a verify pass checks, and each row's mask: row i draws the token at
        `position` + i, under the constraint's mask after the first i drafts, less the banned
        tokens. The constraint is told the drafts it is asked after; the caller takes back
        those not accepted. The drafts end before the first the mask before it rules out (the
        model can never draw it), before one after which the constraint allows nothing (plain
        decoding would fail only once it is drawn), and after a stop token (nothing after one
        is generated)."""
        constraint, bans, vocab = request.constraint, request.bans, self._model.token_count
        masks = [draw_mask(constraint, bans, vocab, position)]
        kept: list[int] = []
        for draft in drafts:
            if draft >= vocab or not _allows(masks[-1], draft):
                break
            if constraint is not None:
                constraint.consume(draft)
            kept.append(draft)
            if draft in request.stop_token_ids:
                masks.append(bans)  # the row after a stop token is never yielded
                break
            try:
                masks.append(draw_mask(constraint, bans, vocab, position + len(kept)))
            except NoAllowedTokenError:
                assert constraint is not None  # the bans alone always allow a token
                constraint.rollback(1)
                kept.pop()
                break
        return kept, masks

    def _dflash_catch_up(self, start: int, rows: int) -> None:
        """The DFlash drafter reads the first `rows` rows of the pass just run, the tokens at
        positions start.. (those the pass kept), when it drafts in this generation."""
        if self._dflash is None or self._dflash_rows != start:
            return  # not drafting with it in this generation
        self._dflash.catch_up_rows(0, rows, start)
        self._dflash_rows = start + rows

    def _dflash_drafts(self, limit: int) -> list[int]:
        """Up to `limit` greedy drafts of the DFlash drafter after the newest token, the one at
        the position its cache's rows reach (the token waiting in the history)."""
        assert self._dflash is not None and self._dflash_rows is not None
        position = self._dflash_rows
        limit = min(limit, self.max_seq - position - 1)
        if limit < 1:
            return []
        newest = int(self._model.history_view()[position])
        return self._dflash.draft(newest, limit, position)

    def _mtp_catch_up(self, head_later: bool) -> None:
        """Submits the MTP head over the rows of the last pass it has not read (their KV rows are
        then right for every later draft), for the next pass to queue behind: one wait covers
        both. Without `head_later` (the head drafts no more in this generation) it stops
        following the passes instead."""
        if self._mtp_pending is None:
            return
        if not head_later:
            self._mtp_pending = None
            return
        start, rows = self._mtp_pending
        self._mtp_pending = (start, 0)
        if rows:
            self._submit_mtp_catch_up(start, rows)

    def _submit_mtp_catch_up(self, start: int, rows: int) -> int:
        """Submits the head over `rows` rows of the last pass from position `start` (which must
        have no head pass in flight: it rewrites the head's step) and returns the ticket."""
        model = self._model
        model.mtp_step_view()[0] = start
        return self.device.submit(model.mtp_graph(rows, chained=False, head=False))

    def _mtp_drafts(self, limit: int) -> list[int]:
        """Up to `limit` greedy drafts of the MTP head after the newest token, in one command
        buffer (`ModelGraph.mtp_draft_graph`): the head over the last pass's rows predicts the
        token after the newest; each further draft feeds the head its own output and the draft
        before, the argmaxes taken on the device (the head's KV rows past the newest token are
        rewritten by the next catch-up, as the main cache's are). The host reads the drafts
        from the history once, after them all."""
        if self._mtp_pending is None:
            return []
        start, rows = self._mtp_pending
        if rows == 0:
            return []  # read already (only when nothing new was fed): nothing to draft from
        model = self._model
        newest = start + rows  # the first draft follows it
        limit = min(limit, model.capacity - 1 - newest)
        if limit < 1:
            return []
        self._mtp_pending = (start, 0)
        model.mtp_step_view()[0] = start
        self.device.run(model.mtp_draft_graph(rows, limit))
        return [int(t) for t in model.history_view()[newest + 1 : newest + 1 + limit]]

    def _head_drafts_on_device(self, limit: int) -> HeadDrafts | list[int]:
        """The head's next drafts, to be taken on the device in the verify pass's submission
        (`_submit_head_drafts`): what `Speculation.head` is when no constraint needs to see each
        draft before the pass."""
        if self._mtp_pending is None or self._mtp_pending[1] == 0:
            return []  # nothing new was fed: nothing to draft from
        start, rows = self._mtp_pending
        limit = min(limit, self._model.capacity - 1 - (start + rows))
        return HeadDrafts(limit) if limit > 0 else []

    def _submit_head_drafts(self, newest: int, count: int) -> None:
        """Submits the head's `count` drafts after the newest token (`ModelGraph.
        mtp_draft_graph`), ahead of the verify pass that checks them: the pass reads them from
        the history the draft pass writes, and nothing waits in between."""
        pending = self._mtp_pending
        assert pending is not None and sum(pending) == newest, "the head's rows end at the newest"
        start, rows = pending
        self._mtp_pending = (start, 0)
        self._model.mtp_step_view()[0] = start
        self.device.submit(self._model.mtp_draft_graph(rows, count))

    def _decode(
        self,
        position: int,
        count: int,
        request: _Request,
        should_stop: Callable[[], bool] | None,
        pause: Callable[[], bool] | None = None,
    ) -> Iterator[GeneratedToken]:
        """`count` decode steps from `position` (whose token the history holds and the state
        has not consumed), two in flight, as `generate` decodes without drafts; once `pause`
        says so, none is submitted after those in flight."""
        model, device = self._model, self.device
        step = model.step_view()
        step[POSITION], step[PROMPT_END] = position, position + 1
        step[TOKEN] = model.history_view()[position]
        in_flight: deque[tuple[int, int]] = deque()  # (position after the step, ticket)
        submitted = 0
        clock = _StepClock()
        try:
            while True:
                while submitted < count and len(in_flight) < PIPELINE_DEPTH:
                    _check_stop(should_stop)
                    if pause is not None and pause():
                        count = submitted
                        break
                    submitted += 1
                    in_flight.append((position + submitted, device.submit(model.decode)))
                if not in_flight:
                    return
                end, ticket = in_flight.popleft()
                device.wait(ticket)
                drawn = self._drawn(end, request.sampling)
                clock.tick()
                yield drawn
                if drawn.id in request.stop_token_ids:
                    return
        finally:
            for _, pending in in_flight:
                device.wait(pending)
            self._step_seconds = clock.seconds_per_step() or self._step_seconds

    @holds_engine
    def prompt_logits(
        self, prompt: Sequence[int], images: Sequence[ImagePatches] = ()
    ) -> np.ndarray:
        prompt = [int(t) for t in prompt]
        check_fits(len(prompt), 1, self.max_seq)
        prompt_images = self._prompt_images(prompt, images)
        write_sampling_params(self._model.state.sampling_params, GREEDY.with_seed())
        self._start(prompt, prompt_end=len(prompt), images=prompt_images)
        for start, tokens, predicts in self._passes(0, len(prompt), 1, None, prompt_images):
            with_images = self._stage_images(prompt_images, start, tokens)
            self.device.run(self._model.graph(tokens, predicts=predicts, images=with_images))
        return self._model.logits_view().copy()

    @holds_engine
    def teacher_forced_logits(
        self, tokens: Sequence[int], reuse: bool = False, images: Sequence[ImagePatches] = ()
    ) -> np.ndarray:
        tokens = [int(t) for t in tokens]
        check_fits(len(tokens), 0, self.max_seq)
        if images:
            # Its passes are decode steps, which read the embedding inside their first GEMV.
            raise ValueError(
                "teacher_forced_logits takes no images on a device: use prompt_logits, "
                "generate, or the reference engine"
            )
        start = self._start(tokens, prompt_end=len(tokens), reuse=reuse)
        logits = np.empty((len(tokens) - start, self.config.vocab_size), np.float32)
        for i in range(len(logits)):
            self.device.run(self._model.decode)
            logits[i] = self._model.logits_view()
        return logits

    @shares_engine
    def close(self) -> None:
        self.prefix_cache.close()
        self._model = None  # type: ignore[assignment]


class ReferenceEngine(_PromptsWithImages):
    def __init__(
        self,
        checkpoint: Checkpoint,
        max_seq: int,
        token_count: int,
        prefix_cache: PrefixCache | None = None,
    ) -> None:
        """`token_count`: how many ids the tokenizer can produce; only those are generated.
        `prefix_cache`: as DeviceEngine's (the rows it keeps are the reference's float32)."""
        self.config = checkpoint.config
        self.max_seq = max_seq
        self.token_count = token_count
        self._model = ReferenceModel(checkpoint.config, checkpoint.tensors)
        self._rows = _ReferenceRows(self._model)
        if prefix_cache is None:
            itemsize = self._model.dtype.itemsize
            prefix_cache = PrefixCache(
                default_cache_memory(0), kv_bytes_per_token(self.config, itemsize)
            )
        self.prefix_cache = prefix_cache
        prefix_cache.set_layout(
            self._model.dtype.name, self._rows.copy_out(0), self._rows.recurrent()
        )
        self._numpy_tower = _numpy_tower_encoder(checkpoint)
        self._encoded_images = EncodedImages(ENCODED_IMAGES_BYTES)
        self.prompt_tokens_fed = 0
        self.lock = EngineLock()  # one thread at a time (lock.py)

    def _encode_image(self, image: ImagePatches) -> np.ndarray:
        """The vision tower's rows [num_tokens, hidden] of an image: the numpy reference's."""
        return self._numpy_tower(image)

    @holds_engine_while_generating
    def generate(
        self,
        prompt: Sequence[int],
        max_new_tokens: int,
        stop_token_ids: Collection[int] = (),
        sampling: SamplingParams = GREEDY,
        snapshot_at: int | Collection[int] | None = None,
        should_stop: Callable[[], bool] | None = None,
        constraint: TokenConstraint | None = None,
        cache_key: str | None = None,
        reply_so_far: int = 0,
        progress: Callable[[int, int], None] | None = None,
        drafter: Drafter | None = None,
        images: Sequence[ImagePatches] = (),
    ) -> Iterator[GeneratedToken]:
        # The reference decodes plainly whatever the drafter: drafting only changes how many
        # tokens a device pass yields, never which.
        prompt = [int(t) for t in prompt]
        check_fits(len(prompt), max_new_tokens, self.max_seq)
        generated = _reply(prompt, reply_so_far)
        prompt_images = PromptImages(prompt, images, self.config, self._image_rows)
        if max_new_tokens == 0:
            return
        _check_stop(should_stop)
        sampling = sampling.with_seed()
        bans = banned_tokens_mask(sampling, self.token_count)
        keys = prompt_images.cache_tokens
        state = self._start(self.prefix_cache.begin(keys, self._rows, cache_key), prompt_images)
        start = state.position
        self.prompt_tokens_fed += len(prompt) - start
        for position in self.prefix_cache.snapshot_positions(
            start, len(prompt), _positions(snapshot_at)
        ):
            self._prefill(prompt, start, position, state, prompt_images)
            self.prefix_cache.add_snapshot(keys, position, self._rows.recurrent())
            start = position
            if progress is not None:
                progress(position, len(prompt))
            _check_stop(should_stop)
        logits = self._prefill(prompt, start, len(prompt), state, prompt_images)
        if progress is not None:
            progress(len(prompt), len(prompt))
        self.prefix_cache.end(self._rows)
        next_logits = logits[-1, : self.token_count]
        for produced in range(max_new_tokens):
            position = len(prompt) + produced
            if np.isnan(next_logits).any() or np.isposinf(next_logits).any():
                raise NonFiniteLogitsError(position)
            ranked = next_logits
            if sampling.adjusts_logits:
                ranked = adjusted_logits(next_logits, sampling, prompt, generated)
            mask = draw_mask(constraint, bans, self.token_count, position)
            if mask is not None:
                ranked = np.where(allowed_flags(mask, self.token_count), ranked, -np.inf)
            if sampling.greedy:
                token = int(np.argmax(ranked))
            else:
                # One generator per (seed, position): a seed reproduces a run, step by step.
                rng = np.random.default_rng([sampling.seed, position])
                p = sampling_distribution(ranked, sampling)
                token = int(rng.choice(p.size, p=p))
            if constraint is not None:
                constraint.consume(token)
            generated.append(token)
            logprobs = None
            if sampling.top_logprobs is not None:
                logprobs = top_logprobs(next_logits, token, sampling.top_logprobs)
            yield GeneratedToken(token, logprobs)
            if token in stop_token_ids or produced + 1 == max_new_tokens:
                return
            _check_stop(should_stop)
            next_logits = self._model.decode(token, state)[: self.token_count]

    def _start(self, match: PrefixMatch | None, images: PromptImages) -> ReferenceState:
        state = self._rows.start(match)
        state.rope_offset = images.rope_offset
        return state

    def _prefill(
        self,
        prompt: Sequence[int],
        start: int,
        end: int,
        state: ReferenceState,
        images: PromptImages,
    ) -> np.ndarray:
        """Feeds prompt tokens [start, end) with their image rows and rotary positions."""
        return self._model.prefill(
            prompt[start:end], state, images.rows_in(start, end), images.positions_in(start, end)
        )[0]

    @holds_engine
    def teacher_forced_logits(
        self, tokens: Sequence[int], reuse: bool = False, images: Sequence[ImagePatches] = ()
    ) -> np.ndarray:
        tokens = [int(t) for t in tokens]
        check_fits(len(tokens), 0, self.max_seq)
        prompt_images = PromptImages(tokens, images, self.config, self._image_rows)
        if reuse:
            keys = prompt_images.cache_tokens
            state = self._start(
                self.prefix_cache.begin(keys, self._rows, reuse=True), prompt_images
            )
        else:
            # A state of its own: the live one holds the rows of a cached sequence.
            state = self._model.new_state()
            state.rope_offset = prompt_images.rope_offset
        logits = self._prefill(tokens, state.position, len(tokens), state, prompt_images)
        return logits.astype(np.float32)

    def prompt_logits(
        self, prompt: Sequence[int], images: Sequence[ImagePatches] = ()
    ) -> np.ndarray:
        return self.teacher_forced_logits(prompt, images=images)[-1]

    @shares_engine
    def close(self) -> None:
        self.prefix_cache.close()
        self._model = None  # type: ignore[assignment]


class _ReferenceRows:
    """The reference model's state as an engine's KV cache: the live state's keys and values
    ([num_kv_heads, tokens, head_dim] per attention layer, in the model's dtype)."""

    def __init__(self, model: ReferenceModel) -> None:
        self._model = model
        self.live = model.new_state()

    def copy_out(self, tokens: int) -> Arrays:
        live = self.live
        return [
            cache[layer][:, :tokens].copy()
            for layer in sorted(live.keys)
            for cache in (live.keys, live.values)
        ]

    def copy_in(self, rows: Arrays, tokens: int) -> None:
        live = self.live
        for i, layer in enumerate(sorted(live.keys)):
            live.keys[layer] = rows[2 * i][:, :tokens].copy()
            live.values[layer] = rows[2 * i + 1][:, :tokens].copy()

    def start(self, match: PrefixMatch | None) -> ReferenceState:
        """The live state, made the one after the match's prefix (a fresh state without)."""
        if match is None:
            self.live = self._model.new_state()
            return self.live
        live, tokens = self.live, match.length
        for layer in live.keys:
            live.keys[layer] = live.keys[layer][:, :tokens]
            live.values[layer] = live.values[layer][:, :tokens]
        layers = [*sorted(live.conv_windows), *sorted(live.recurrent)]
        windows = len(live.conv_windows)
        for i, layer in enumerate(layers):
            target = live.conv_windows if i < windows else live.recurrent
            target[layer] = match.state[i].copy()
        live.position = tokens
        return live

    def recurrent(self) -> Arrays:
        """A copy of the live recurrent state (conv windows, then GDN states)."""
        live = self.live
        return [
            *(live.conv_windows[layer].copy() for layer in sorted(live.conv_windows)),
            *(live.recurrent[layer].copy() for layer in sorted(live.recurrent)),
        ]
