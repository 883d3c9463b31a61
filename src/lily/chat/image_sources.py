"""Where a request's images come from: the URL of an image part, read into the image's bytes.

Every API carries an image as a URL (OpenAI's `image_url`, the Responses API's `input_image`) or
as base64 data that the server's translation turns into a data URL (Anthropic's `image` blocks).
Three kinds are read:

- `data:` URLs (base64 or percent-encoded), always;
- `file://` URLs and plain local paths, only where `ImageAccess.files` allows it: the Python API
  (a notebook's own files), never a server, whose clients must not read the server's disk;
- `http://` and `https://` URLs, only where `ImageAccess.fetch` allows it (`lily.load(...,
  fetch_images=True)`, `lily serve --fetch-images`): Lily makes no network request the user did
  not turn on, and a server that fetches lets its clients make it fetch any address.

Every read is bounded by `ImageLimits.max_bytes`; every failure is a named `ImageError` (400)
whose `param` names the part.
"""

from __future__ import annotations

import base64
import binascii
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass, replace
from pathlib import Path

from lily.chat.images import ImageLimits
from lily.errors import ImageError, ImageFetchError, ImageTooLargeError, ImageURLError

# How long a fetch may take to connect and between reads.
FETCH_TIMEOUT_S = 20.0


@dataclass(frozen=True)
class ImageAccess:
    """What an image URL may point at besides a data URL."""

    files: bool = False  # file:// URLs and local paths
    fetch: bool = False  # http(s) URLs

    def without_files(self) -> ImageAccess:
        """What a server's requests may read: never its own files."""
        return replace(self, files=False)


# What a server reads unless it fetches: data URLs only.
DATA_URLS_ONLY = ImageAccess()


@dataclass(frozen=True)
class ImageSource:
    """An image part of a request: its URL, and the request field it came from."""

    url: str
    param: str


def read_image_source(source: ImageSource, access: ImageAccess, limits: ImageLimits) -> bytes:
    """The encoded image `source` points at; errors name `source.param`."""
    try:
        return _read(source.url, access, limits.max_bytes)
    except ImageError as error:
        error.param = source.param
        raise


def _read(url: str, access: ImageAccess, max_bytes: int) -> bytes:
    scheme = url.split(":", 1)[0].lower() if ":" in url else ""
    if scheme == "data":
        return _data_url(url, max_bytes)
    if scheme in ("http", "https"):
        if not access.fetch:
            raise ImageURLError(
                "image URLs are not fetched: send the image as a data URL "
                "(data:image/png;base64,...), or start Lily with fetching on "
                "(lily.load(fetch_images=True), lily serve --fetch-images)"
            )
        return _fetch(url, max_bytes)
    if scheme == "file" or (not scheme and url.startswith(("/", "~", "."))):
        if not access.files:
            raise ImageURLError(
                "local files are read only through the Python API: send the image as a data "
                "URL (data:image/png;base64,...)"
            )
        return _file(url, max_bytes)
    raise ImageURLError(
        f"an image URL must be a data: URL{', a file:// URL' if access.files else ''}"
        f"{' or an http(s) URL' if access.fetch else ''}; got {_shown(url)}"
    )


def _data_url(url: str, max_bytes: int) -> bytes:
    header, comma, payload = url.partition(",")
    if not comma:
        raise ImageURLError("a data URL needs a comma before its data")
    media_type, *params = header[len("data:") :].split(";")
    if media_type and not media_type.lower().startswith("image/"):
        raise ImageURLError(f"the data URL's media type is {media_type!r}, not an image")
    # base64 is 4 characters per 3 bytes (plus line breaks): a payload over twice the limit is
    # refused before anything is decoded; the decoded size is checked exactly below.
    if len(payload) > 2 * max_bytes:
        raise _too_large(max_bytes)
    if "base64" in (p.lower() for p in params):
        try:
            data = base64.b64decode("".join(payload.split()), validate=True)
        except (binascii.Error, ValueError) as error:
            raise ImageURLError(f"the data URL's base64 does not decode: {error}") from None
    else:
        data = urllib.parse.unquote_to_bytes(payload)
    if len(data) > max_bytes:
        raise _too_large(max_bytes)
    return data


def _file(url: str, max_bytes: int) -> bytes:
    if url.lower().startswith("file:"):
        parsed = urllib.parse.urlparse(url)
        if parsed.netloc not in ("", "localhost"):
            raise ImageURLError(f"a file URL must name a local file, got host {parsed.netloc!r}")
        path = Path(urllib.request.url2pathname(parsed.path))
    else:
        path = Path(url).expanduser()
    try:
        with path.open("rb") as file:
            data = file.read(max_bytes + 1)
    except OSError as error:
        raise ImageURLError(f"cannot read the image file {str(path)!r}: {error.strerror}") from None
    if len(data) > max_bytes:
        raise _too_large(max_bytes)
    return data


def _fetch(url: str, max_bytes: int) -> bytes:
    request = urllib.request.Request(url, headers={"User-Agent": "lily"})
    try:
        with urllib.request.urlopen(request, timeout=FETCH_TIMEOUT_S) as response:
            data = response.read(max_bytes + 1)
    except urllib.error.HTTPError as error:
        raise ImageFetchError(f"fetching {_shown(url)} failed: HTTP {error.code}") from None
    except (urllib.error.URLError, OSError, ValueError) as error:
        reason = getattr(error, "reason", error)
        raise ImageFetchError(f"fetching {_shown(url)} failed: {reason}") from None
    if len(data) > max_bytes:
        raise _too_large(max_bytes)
    return data


def _too_large(max_bytes: int) -> ImageTooLargeError:
    return ImageTooLargeError(f"the image is over {max_bytes} bytes; at most that is accepted")


def _shown(url: str) -> str:
    """A URL in an error message: its start only (a data URL can be megabytes)."""
    return repr(url if len(url) <= 80 else url[:77] + "...")
