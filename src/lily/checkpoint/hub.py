"""Is the Hugging Face Hub reachable? One quick request, asked before a download.

Without a network, `huggingface_hub` retries for about 25 seconds and then fails with a long
chain of connection errors. One request with a short timeout (through the same proxies,
`HTTPS_PROXY` and friends, and to the same `HF_ENDPOINT`) tells Lily at once to look in the
local cache only, and to say how to get the checkpoint when it is not there.
"""

from __future__ import annotations

import urllib.error
import urllib.request

# Long enough for a slow link to answer a HEAD request, far shorter than the Hub client's retries.
PROBE_TIMEOUT_SECONDS = 5.0


def hub_endpoint() -> str:
    from huggingface_hub import constants

    return constants.ENDPOINT


def hub_reachable(timeout: float = PROBE_TIMEOUT_SECONDS) -> bool:
    """True when the Hub's endpoint answers at all (any HTTP status counts as an answer)."""
    request = urllib.request.Request(hub_endpoint(), method="HEAD")
    # A fresh opener reads the proxy variables now (`urlopen` caches the first ones it saw).
    opener = urllib.request.build_opener()
    try:
        with opener.open(request, timeout=timeout):
            return True
    except urllib.error.HTTPError:
        return True
    except (OSError, ValueError):  # no route, no name resolution, refused, timed out, bad URL
        return False


def download_hint(repo: str, revision: str | None) -> str:
    """How to get a checkpoint onto this machine without Lily downloading it."""
    pinned = f" --revision {revision}" if revision else ""
    return (
        f"download it once with `hf download {repo}{pinned}` where there is a network, or pass "
        "a local checkpoint directory as the model (`--model DIR`, `lily.load(DIR)`); the demo "
        "model (`--model demo`) needs no download"
    )
