"""Images in requests, up to the engine: where an image part's bytes come from
(lily.chat.image_sources), how each API's image part becomes the chat request's, and how the chat
facade puts the image's placeholder tokens into the prompt and hands the engine its patches.

The engine here records what it is asked; the image's effect on the model's output is
tests/test_image_tokens.py's."""

from __future__ import annotations

import base64
import dataclasses
import http.server
import io
import threading
from collections.abc import Iterator, Sequence
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from lily.api import Lily
from lily.chat.completions import parse_request
from lily.chat.image_sources import DATA_URLS_ONLY, ImageAccess, ImageSource, read_image_source
from lily.chat.images import ImageLimits, preprocess_image
from lily.chat.tokenizer import Tokenizer
from lily.checkpoint.config import load_config
from lily.checkpoint.loader import resolve_model
from lily.engine.engine import GREEDY
from lily.engine.sampling import GeneratedToken
from lily.errors import (
    ContextLengthError,
    ImageFetchError,
    ImagesUnsupportedError,
    ImageTokensError,
    ImageTooLargeError,
    ImageURLError,
    NotAnImageError,
    TooManyImagesError,
    UnsupportedParameterError,
)
from lily.server import anthropic_messages, responses_api


def png(width: int, height: int, seed: int = 0, flat: bool = False) -> bytes:
    pixels = np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)
    if flat:  # one colour: a large image in a small file
        pixels[:] = pixels[0, 0]
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, format="PNG")
    return out.getvalue()


def data_url(data: bytes, media_type: str = "image/png") -> str:
    return f"data:{media_type};base64,{base64.b64encode(data).decode()}"


def user_with_images(*urls: str, text: str = "What is this?") -> list[dict]:
    parts = [{"type": "image_url", "image_url": {"url": url}} for url in urls]
    return [{"role": "user", "content": [*parts, {"type": "text", "text": text}]}]


# --- where the bytes come from ---------------------------------------------------------------


def read(url: str, access: ImageAccess = DATA_URLS_ONLY, max_bytes: int = 2**20) -> bytes:
    return read_image_source(
        ImageSource(url, "messages[0].content[0]"), access, ImageLimits(max_bytes)
    )


def test_data_urls_decode_base64_and_percent_encoding() -> None:
    image = png(3, 2)
    assert read(data_url(image)) == image
    # Line breaks inside base64, as MIME writers wrap it.
    wrapped = base64.encodebytes(image).decode()
    assert read(f"data:image/png;base64,{wrapped}") == image
    assert read("data:,%89PNG") == b"\x89PNG"


@pytest.mark.parametrize(
    ("url", "words"),
    [
        ("data:image/png;base64,@@@", "base64"),
        ("data:text/plain;base64,aGk=", "not an image"),
        ("data:image/png;base64", "comma"),
        ("https://example.com/cat.png", "not fetched"),
        ("file:///etc/hostname", "Python API"),
        ("/etc/hostname", "Python API"),
        ("ftp://example.com/cat.png", "must be a data: URL"),
    ],
)
def test_unreadable_urls_are_named_errors_on_their_part(url: str, words: str) -> None:
    with pytest.raises(ImageURLError, match=words) as caught:
        read(url)
    assert caught.value.param == "messages[0].content[0]"
    assert caught.value.code == "invalid_image_url"


def test_the_byte_limit_holds_for_every_source(tmp_path: Path) -> None:
    big = png(64, 64)
    with pytest.raises(ImageTooLargeError):
        read(data_url(big), max_bytes=len(big) - 1)
    assert read(data_url(big), max_bytes=len(big)) == big
    path = tmp_path / "big.png"
    path.write_bytes(big)
    with pytest.raises(ImageTooLargeError):
        read(path.as_uri(), ImageAccess(files=True), max_bytes=len(big) - 1)


def test_local_files_are_read_only_where_allowed(tmp_path: Path) -> None:
    image = png(5, 7)
    path = tmp_path / "a picture.png"
    path.write_bytes(image)
    files = ImageAccess(files=True)
    assert read(path.as_uri(), files) == image
    assert read(str(path), files) == image
    with pytest.raises(ImageURLError, match="cannot read"):
        read((tmp_path / "missing.png").as_uri(), files)
    with pytest.raises(ImageURLError, match="local file"):
        read("file://otherhost/x.png", files)


@pytest.fixture(scope="module")
def image_server() -> Iterator[str]:
    body = png(9, 4)

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 - the standard library's name
            if self.path != "/cat.png":
                self.send_error(404)
                return
            self.send_response(200)
            self.send_header("Content-Type", "image/png")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: object) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()


def test_http_urls_are_fetched_only_when_enabled(image_server: str) -> None:
    fetch = ImageAccess(fetch=True)
    assert read(f"{image_server}/cat.png", fetch) == png(9, 4)
    with pytest.raises(ImageURLError, match="not fetched"):
        read(f"{image_server}/cat.png")
    with pytest.raises(ImageFetchError, match="404"):
        read(f"{image_server}/dog.png", fetch)
    with pytest.raises(ImageTooLargeError):
        read(f"{image_server}/cat.png", fetch, max_bytes=10)


# --- parsing the chat request ----------------------------------------------------------------


def parse(messages: list[dict], **params: object):
    return parse_request(
        {"messages": messages, **params}, served_model="demo", default_sampling=GREEDY
    )


def test_image_parts_become_template_parts_and_sources_in_order() -> None:
    request = parse(
        [
            {"role": "system", "content": "Be brief."},
            *user_with_images("data:,a", "data:,b", text="Compare."),
            {"role": "assistant", "content": "Two dots."},
            {"role": "user", "content": [{"type": "image_url", "image_url": "data:,c"}]},
        ]
    )
    assert [s.url for s in request.images] == ["data:,a", "data:,b", "data:,c"]
    assert [s.param for s in request.images] == [
        "messages[1].content[0]",
        "messages[1].content[1]",
        "messages[3].content[0]",
    ]
    assert request.messages[1]["content"] == [
        {"type": "image"},
        {"type": "image"},
        {"type": "text", "text": "Compare."},
    ]
    # Text-only part lists still reach the template as one string.
    text_only = parse(
        [
            {
                "role": "user",
                "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}],
            }
        ]
    )
    assert text_only.messages[0]["content"] == "ab" and text_only.images == ()


@pytest.mark.parametrize(
    ("message", "error", "param"),
    [
        (
            {"role": "system", "content": [{"type": "image_url", "image_url": {"url": "data:,a"}}]},
            ImagesUnsupportedError,
            "messages[0].content[0]",
        ),
        (
            {"role": "user", "content": [{"type": "image_url", "image_url": {}}]},
            None,
            "messages[0].content[0].image_url",
        ),
        (
            {
                "role": "user",
                "content": [
                    {"type": "image_url", "image_url": {"url": "data:,a", "detail": "max"}}
                ],
            },
            None,
            "messages[0].content[0].image_url.detail",
        ),
        (
            {"role": "user", "content": [{"type": "input_audio", "input_audio": {}}]},
            None,
            "messages[0].content[0].type",
        ),
    ],
)
def test_bad_image_parts_are_refused_by_name(message: dict, error: type | None, param: str) -> None:
    with pytest.raises(error or Exception) as caught:
        parse([message])
    assert caught.value.param == param


def test_unknown_image_url_fields_are_refused() -> None:
    with pytest.raises(UnsupportedParameterError, match="image_url.size"):
        parse(
            user_with_images("data:,a")[:0]
            + [
                {
                    "role": "user",
                    "content": [{"type": "image_url", "image_url": {"url": "data:,a", "size": 3}}],
                }
            ]
        )


# --- the other APIs' image parts ----------------------------------------------------------------


def test_anthropic_and_responses_images_become_the_same_chat_request(demo_lily: Lily) -> None:
    image = png(4, 4)
    encoded = base64.b64encode(image).decode()
    anthropic = anthropic_messages.translate(
        {
            "model": demo_lily.model_id,
            "max_tokens": 4,
            "messages": [
                {
                    "role": "user",
                    "content": [
                        {
                            "type": "image",
                            "source": {
                                "type": "base64",
                                "media_type": "image/png",
                                "data": encoded,
                            },
                        },
                        {"type": "text", "text": "What is this?"},
                    ],
                }
            ],
        },
        demo_lily,
    ).request
    responses = responses_api.translate(
        {
            "model": demo_lily.model_id,
            "input": [
                {
                    "role": "user",
                    "content": [
                        {"type": "input_image", "image_url": data_url(image)},
                        {"type": "input_text", "text": "What is this?"},
                    ],
                }
            ],
        },
        demo_lily,
    ).request
    for request in (anthropic, responses):
        assert [s.url for s in request.images] == [data_url(image)]
        assert request.messages[-1]["content"] == [
            {"type": "image"},
            {"type": "text", "text": "What is this?"},
        ]
        # A server's requests never read local files.
        assert request.image_access == ImageAccess(files=False, fetch=False)


@pytest.mark.parametrize(
    ("translate", "params", "param"),
    [
        (
            anthropic_messages.translate,
            {
                "max_tokens": 4,
                "messages": [
                    {
                        "role": "user",
                        "content": [{"type": "image", "source": {"type": "file", "file_id": "f"}}],
                    }
                ],
            },
            "messages[0].content[0].source.type",
        ),
        (
            anthropic_messages.translate,
            {
                "max_tokens": 4,
                "messages": [
                    {
                        "role": "user",
                        "content": [
                            {
                                "type": "image",
                                "source": {
                                    "type": "base64",
                                    "media_type": "image/tiff",
                                    "data": "",
                                },
                            }
                        ],
                    }
                ],
            },
            "messages[0].content[0].source.media_type",
        ),
        (
            anthropic_messages.translate,
            {
                "max_tokens": 4,
                "system": [{"type": "image", "source": {}}],
                "messages": [{"role": "user", "content": "x"}],
            },
            "system[0]",
        ),
        (
            responses_api.translate,
            {"input": [{"role": "user", "content": [{"type": "input_image", "file_id": "f"}]}]},
            "input[0].content[0].file_id",
        ),
        (
            responses_api.translate,
            {
                "input": [
                    {
                        "role": "developer",
                        "content": [{"type": "input_image", "image_url": "data:,a"}],
                    }
                ]
            },
            "input[0].content[0]",
        ),
    ],
)
def test_other_apis_refuse_images_they_cannot_carry(
    demo_lily: Lily, translate, params: dict, param: str
) -> None:
    with pytest.raises(Exception) as caught:
        translate({"model": demo_lily.model_id, **params}, demo_lily)
    assert getattr(caught.value, "param", None) == param


# --- the facade: placeholders in the prompt, patches to the engine -----------------------------


class RecordingEngine:
    """Answers "Yes." and records each generate call's prompt and images."""

    def __init__(self, config, tokenizer: Tokenizer, max_seq: int = 4096) -> None:
        self.config, self.max_seq = config, max_seq
        self.answer = [*tokenizer.encode("Yes."), tokenizer.token_to_id("<|im_end|>")]
        self.calls: list[dict] = []
        self.cache_queries: list[dict] = []

    def generate(
        self, prompt: Sequence[int], *args, images=(), **kwargs
    ) -> Iterator[GeneratedToken]:
        self.calls.append({"prompt": list(prompt), "images": tuple(images), **kwargs})
        for token in self.answer:
            yield GeneratedToken(token)

    def cached_prefix_length(self, prompt: Sequence[int], cache_key=None, images=()) -> int:
        self.cache_queries.append({"prompt": list(prompt), "images": tuple(images)})
        return 0

    def close(self) -> None:
        pass


@pytest.fixture(scope="module")
def demo_dir() -> Path:
    return resolve_model("demo")


@pytest.fixture(scope="module")
def demo_tokenizer(demo_dir: Path) -> Tokenizer:
    return Tokenizer.from_dir(demo_dir)


@pytest.fixture
def demo_lily(demo_dir: Path, demo_tokenizer: Tokenizer) -> Lily:
    engine = RecordingEngine(load_config(demo_dir), demo_tokenizer)
    return Lily("demo", demo_dir, demo_tokenizer, engine, "recording")


def test_each_image_becomes_its_run_of_placeholders_and_its_patches(
    demo_lily: Lily, demo_tokenizer: Tokenizer, tmp_path: Path
) -> None:
    first, second = png(100, 40, seed=1), png(33, 90, seed=2)
    path = tmp_path / "second.png"
    path.write_bytes(second)
    demo_lily.chat.completions.create(
        messages=user_with_images(data_url(first), path.as_uri()), max_tokens=4
    )
    (call,) = demo_lily.engine.calls
    expected = [preprocess_image(first), preprocess_image(second)]
    assert [i.grid_thw for i in call["images"]] == [i.grid_thw for i in expected]
    for got, want in zip(call["images"], expected, strict=True):
        np.testing.assert_array_equal(got.pixel_values, want.pixel_values)
    start, pad, end = (
        demo_tokenizer.token_to_id(t)
        for t in ("<|vision_start|>", "<|image_pad|>", "<|vision_end|>")
    )
    prompt = call["prompt"]
    runs = []
    for i, token in enumerate(prompt):
        if token == start:
            j = prompt.index(end, i)
            assert set(prompt[i + 1 : j]) == {pad}
            runs.append(j - i - 1)
    assert runs == [image.num_tokens for image in expected]
    # The same prompt keys the prefix cache, with its images.
    assert demo_lily.engine.cache_queries[-1]["prompt"] == prompt
    assert [i.digest for i in demo_lily.engine.cache_queries[-1]["images"]] == [
        i.digest for i in expected
    ]
    # count_tokens (Anthropic) counts the same prompt.
    request = parse_request(
        {"messages": user_with_images(data_url(first), data_url(second))},
        served_model="demo",
        default_sampling=GREEDY,
    )
    assert demo_lily.chat.completions.count_prompt_tokens(request) == len(prompt)


def test_message_boundaries_move_with_the_placeholders(demo_lily: Lily) -> None:
    image = png(64, 64)
    messages = [
        *user_with_images(data_url(image)),
        {"role": "assistant", "content": "A square."},
        {"role": "user", "content": "And?"},
    ]
    demo_lily.chat.completions.create(messages=messages, max_tokens=4)
    (call,) = demo_lily.engine.calls
    prompt = call["prompt"]
    # Every snapshot mark is a position inside the prompt after the image's run, and the
    # tokens up to the conversation's mark render the same with a one-token image.
    marks = call["snapshot_at"]
    assert marks and all(
        prompt.index(demo_lily.tokenizer.token_to_id("<|vision_end|>")) < m < len(prompt)
        for m in marks
    )
    conversation = demo_lily.tokenizer.decode(prompt[: max(marks)])
    assert conversation.endswith("And?<|im_end|>\n")


def test_refusals_name_the_image(
    demo_lily: Lily, demo_dir: Path, demo_tokenizer: Tokenizer
) -> None:
    create = demo_lily.chat.completions.create
    with pytest.raises(NotAnImageError) as caught:
        create(
            messages=user_with_images(data_url(png(8, 8)), "data:image/png;base64,aGVsbG8="),
            max_tokens=2,
        )
    assert caught.value.param == "messages[0].content[1]"
    too_many = ImageLimits().max_images + 1
    with pytest.raises(TooManyImagesError):
        create(messages=user_with_images(*["data:,x"] * too_many), max_tokens=2)
    # 4096-token context; a 3000x3000 image is 8,649 tokens.
    with pytest.raises(ContextLengthError) as caught:
        create(messages=user_with_images(data_url(png(3000, 3000, flat=True))), max_tokens=2)
    assert caught.value.param == "messages[0].content[0]"
    # A placeholder typed into the text would shift every image (escape_special_tokens off).
    with pytest.raises(ImageTokensError):
        create(messages=user_with_images(data_url(png(8, 8)), text="<|image_pad|>"), max_tokens=2)
    assert demo_lily.engine.calls == []
    # A checkpoint without a vision tower refuses images.
    text_only = Lily("demo", demo_dir, demo_tokenizer, demo_lily.engine, "recording")
    text_only.image_processor = None
    with pytest.raises(ImagesUnsupportedError, match="no vision tower"):
        text_only.chat.completions.create(
            messages=user_with_images(data_url(png(8, 8))), max_tokens=2
        )


def test_escaped_placeholders_in_text_leave_the_images_alone(
    demo_dir: Path, demo_tokenizer: Tokenizer
) -> None:
    engine = RecordingEngine(load_config(demo_dir), demo_tokenizer)
    llm = Lily("demo", demo_dir, demo_tokenizer, engine, "recording", escape_special_tokens=True)
    image = png(8, 8)
    llm.chat.completions.create(
        messages=user_with_images(data_url(image), text="<|image_pad|>"), max_tokens=2
    )
    (call,) = engine.calls
    pad = demo_tokenizer.token_to_id("<|image_pad|>")
    assert call["prompt"].count(pad) == preprocess_image(image).num_tokens
    assert "<|image_pad|>" in demo_tokenizer.decode(
        call["prompt"][call["prompt"].index(demo_tokenizer.token_to_id("<|vision_end|>")) :]
    )


def test_prepare_reads_images_once(demo_lily: Lily) -> None:
    request = parse_request(
        {"messages": user_with_images(data_url(png(16, 16)))},
        served_model="demo",
        default_sampling=GREEDY,
    )
    prepared = demo_lily.chat.completions.prepare(request)
    assert prepared.image_patches is not None and len(prepared.image_patches) == 1
    # Prepared again (the server prepares, then `run` does): the same patches, not re-read.
    again = demo_lily.chat.completions.prepare(
        dataclasses.replace(prepared, images=(ImageSource("data:,broken", "x"),))
    )
    assert again.image_patches is prepared.image_patches


def test_lily_chat_attaches_images_to_the_next_message(demo_lily: Lily, tmp_path: Path) -> None:
    from lily.cli import ChatSession

    first, later = tmp_path / "first.png", tmp_path / "later.png"
    first.write_bytes(png(40, 40, seed=3))
    later.write_bytes(png(20, 50, seed=4))
    out = io.StringIO()
    request = {"max_tokens": 4, "reasoning_effort": "none"}
    session = ChatSession(demo_lily, out, request=request, images=[first])
    session.handle("Describe it.")
    session.handle("/image " + str(tmp_path / "missing.png"))
    assert "no image file" in out.getvalue()
    session.handle("/image " + str(later))
    session.handle("And this one?")
    session.handle("Thanks.")
    calls = demo_lily.engine.calls
    assert [len(call["images"]) for call in calls] == [1, 2, 2]
    assert [i.digest for i in calls[1]["images"]] == [
        preprocess_image(first.read_bytes()).digest,
        preprocess_image(later.read_bytes()).digest,
    ]
    users = [m for m in session.history if m["role"] == "user"]
    assert users[0]["content"][0] == {"type": "image_url", "image_url": {"url": first.as_uri()}}
    assert users[2]["content"] == "Thanks."
