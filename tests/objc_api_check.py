"""Checks the Objective-C++ Metal device against Apple's public API, without a Mac.

No machine here can compile `csrc/metal/metal_device.mm`, so this reads it as text and checks:

* every Objective-C message send's selector (`[device newBufferWithLength:n options:o]` is
  `newBufferWithLength:options:`), every `@selector(...)`, and every property used with dot
  syntax on a recognisable Objective-C object (`buffer.length` is the getter `length`,
  `options.languageVersion = v` the setter `setLanguageVersion:`) is a selector of Apple's
  Metal/Foundation API;
* every `MTL*`/`NS*`/`CA*` name used as a class or protocol (`id<MTLDevice>`, `NSString*`,
  `[NSURL fileURLWithPath:...]`) is one of Apple's classes or protocols;
* the file stays a device: it includes only device headers and system headers, and names no
  model concepts (layers, experts, tokens...).

The API list is `metal_api.txt` (selectors and classes of Apple's metal-cpp headers); the short
allow-list `objc_api_allowlist.txt` adds Foundation basics that metal-cpp does not wrap.

Objective-C objects are recognised by their declarations (`id<...> name`, `NSFoo* name`,
`id name`) and by being the result of a message send (`[...].property`). Dot syntax on other
expressions (casts, C++ calls returning Objective-C objects) is not recognised: write those as
message sends. C functions, structs and enum constants (`MTLCreateSystemDefaultDevice`,
`MTLSizeMake`, `MTLResourceStorageModeShared`) are not in the API list and are not checked here;
compiling on macOS checks them.

Usage: python tests/objc_api_check.py [--api metal_api.txt] [--list] [file.mm]
"""

from __future__ import annotations

import argparse
import os
import re
import sys
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
DEFAULT_SOURCE = REPO / "csrc" / "metal" / "metal_device.mm"
DEFAULT_ALLOWLIST = Path(__file__).resolve().parent / "objc_api_allowlist.txt"
# The API list: a copy kept beside the tests, else the project's shared data next to the
# repository; --api or the LILY_METAL_API environment variable name another.
API_CANDIDATES = (
    Path(__file__).resolve().parent / "metal_api.txt",
    REPO.parent / "shared" / "data" / "metal_api.txt",
)

APPLE_PREFIX = re.compile(r"^(?:NS|MTL|MTL4|CA)[A-Z]")
# Headers a device may include with quotes; everything else must be a system header.
DEVICE_HEADERS = {"device.h", "host_mirror.h", "metal_device.h", "metal/metal_device.h"}
# Model concepts: their presence means engine logic leaked into the device.
ENGINE_WORDS = {
    "attention", "attn", "checkpoint", "decode", "deltanet", "embed", "embedding", "expert",
    "gdn", "kv", "layer", "lm", "logit", "mlp", "model", "moe", "prefill", "qwen", "rope",
    "router", "sampler", "sampling", "softmax", "token", "tokenizer", "vocab", "weight",
}  # fmt: skip
# A device file that grows past this is doing more than replaying graphs (and wrapping or
# mirroring host memory, csrc/host_mirror.h).
MAX_LINES = 830


@dataclass(frozen=True)
class Use:
    """One use of an API name, with the line it is on."""

    kind: str  # "selector" or "class"
    name: str
    line: int


@dataclass(frozen=True)
class Problem:
    line: int
    message: str

    def __str__(self) -> str:
        return f"line {self.line}: {self.message}"


def strip_comments_and_strings(source: str) -> str:
    """Blanks out comments and the contents of string and character literals.

    Newlines and lengths are kept, so offsets and line numbers still match the source.
    """
    out = []
    i, n = 0, len(source)
    while i < n:
        two = source[i : i + 2]
        if two == "//":
            end = source.find("\n", i)
            end = n if end < 0 else end
        elif two == "/*":
            end = source.find("*/", i + 2)
            end = n if end < 0 else end + 2
        elif source[i] in "\"'":
            quote, end = source[i], i + 1
            while end < n and source[end] != quote and source[end] != "\n":
                end += 2 if source[end] == "\\" else 1
            out.append(quote + " " * (min(end, n) - i - 1) + quote)
            i = end + 1
            continue
        else:
            out.append(source[i])
            i += 1
            continue
        out.append(re.sub(r"[^\n]", " ", source[i:end]))
        i = end
    return "".join(out)


TOKEN = re.compile(
    r"(?P<ident>[A-Za-z_]\w*)|(?P<number>\d[\w.]*)|(?P<punct>::|->|\+\+|--|[-+*/%&|^!=<>]=?"
    r"|&&|\|\||[()\[\]{}.,;:?~@#])"
)
CLOSING = {"(": ")", "[": "]", "{": "}"}


@dataclass
class Token:
    kind: str  # "ident", "number", "punct"
    text: str
    start: int
    end: int


@dataclass
class Group:
    """A bracketed group: `(...)`, `[...]` or `{...}`, with its tokens and groups inside."""

    open: str
    items: list
    start: int
    end: int  # offset just after the closing bracket


def tokenize(code: str) -> list[Token]:
    return [
        Token(m.lastgroup or "punct", m.group(), m.start(), m.end()) for m in TOKEN.finditer(code)
    ]


def group(tokens: list[Token], i: int = 0, closing: str | None = None) -> tuple[list, int]:
    """Nests tokens into Groups; returns the items up to `closing` and the index after it."""
    items: list = []
    while i < len(tokens):
        token = tokens[i]
        if token.text == closing:
            return items, i + 1
        if token.kind == "punct" and token.text in CLOSING:
            inner, after = group(tokens, i + 1, CLOSING[token.text])
            end = tokens[after - 1].end if after <= len(tokens) else token.end
            items.append(Group(token.text, inner, token.start, end))
            i = after
        else:
            items.append(token)
            i += 1
    return items, i


def is_ident(item, text: str | None = None) -> bool:
    return isinstance(item, Token) and item.kind == "ident" and (text is None or item.text == text)


def is_punct(item, text: str) -> bool:
    return isinstance(item, Token) and item.kind == "punct" and item.text == text


@dataclass
class MessageSend:
    receiver: list
    selector: str
    start: int
    end: int


def parse_receiver(items: list) -> int:
    """Length of the receiver expression at the start of a bracket's items (0 if none)."""
    i = 0
    # A C-style cast: (id<MTLResidencySet>)set_
    cast = len(items) > 1 and isinstance(items[0], Group) and items[0].open == "("
    if cast and (is_ident(items[1]) or isinstance(items[1], Group)):
        i = 1
    if i >= len(items):
        return 0
    if is_ident(items[i]):
        i += 1
        while i + 1 < len(items) and is_punct(items[i], "::") and is_ident(items[i + 1]):
            i += 2
    elif isinstance(items[i], Group) and items[i].open in "([":
        i += 1
    else:
        return 0
    while i < len(items):  # postfix: .member ->member (call) [subscript]
        item = items[i]
        if (is_punct(item, ".") or is_punct(item, "->")) and i + 1 < len(items):
            i += 2
        elif isinstance(item, Group) and item.open in "([":
            i += 1
        else:
            break
    return i


def parse_selector(items: list) -> str | None:
    """The selector of the items after a receiver, or None if they are not a message's."""
    if not items or not is_ident(items[0]):
        return None
    if len(items) == 1:
        return items[0].text
    parts: list[str] = []
    pending_ternaries = 0
    i = 0
    while i < len(items):
        item = items[i]
        next_item = items[i + 1] if i + 1 < len(items) else None
        if is_punct(item, "?"):
            pending_ternaries += 1
        elif is_punct(item, ":"):
            if pending_ternaries == 0:
                return None  # a colon that is neither a keyword's nor a ternary's
            pending_ternaries -= 1
        elif is_ident(item) and is_punct(next_item, ":") and pending_ternaries == 0:
            parts.append(item.text + ":")
            i += 2
            continue
        elif not parts:
            return None  # `[receiver name other...]`: not a message send
        i += 1
    return "".join(parts) if parts else None


def message_sends(items: list) -> list[MessageSend]:
    """Every message send in `items`, outermost first, searching nested groups too.

    No context is needed to tell a message send from C++ brackets: a receiver followed by a
    selector (`[a b]`, `[a b:c]`) is never a valid subscript, lambda capture or attribute.
    """
    sends = []
    for item in items:
        if not isinstance(item, Group):
            continue
        if item.open == "[":
            length = parse_receiver(item.items)
            selector = parse_selector(item.items[length:]) if length else None
            if selector is not None:
                sends.append(MessageSend(item.items[:length], selector, item.start, item.end))
        sends.extend(message_sends(item.items))
    return sends


def line_of(source: str, offset: int) -> int:
    return source.count("\n", 0, offset) + 1


GENERIC = r"(?:\s*<[^;(){}]*?>)?"
OBJC_DECLARATIONS = (
    re.compile(r"\bid\s*<[\w\s,]+>\s*(?:const\s+)?([A-Za-z_]\w*)"),
    re.compile(rf"\b(?:NS|MTL|CA)\w*{GENERIC}\s*\*\s*(?:const\s+|_Nullable\s+|_Nonnull\s+)?(\w+)"),
    re.compile(r"\bid\s+([A-Za-z_]\w*)"),
)
CLASS_USES = (
    re.compile(r"\bid\s*<([\w\s,]+)>"),  # protocols
    re.compile(rf"\b((?:NS|MTL|CA)[A-Z]\w*){GENERIC}\s*\*"),  # pointers to classes
    re.compile(r"@(?:protocol|class)\s*\(?\s*(\w+)"),
)


def objc_names(code: str) -> set[str]:
    """Names declared with an Objective-C object type (variables, parameters, members)."""
    return {m.group(1) for pattern in OBJC_DECLARATIONS for m in pattern.finditer(code)}


def property_uses(code: str, sends: list[MessageSend]) -> list[tuple[str, int]]:
    """(selector, offset) of each dot-syntax property access on a recognised object."""
    objects = objc_names(code)
    send_ends = {send.end for send in sends}
    uses = []
    for m in re.finditer(r"(?<!\.)\.(?!\.)\s*([A-Za-z_]\w*)", code):
        before = code[: m.start()].rstrip()
        owner = re.search(r"(\w+)$", before)
        on_object = (owner is not None and owner.group(1) in objects) or (
            before.endswith("]") and len(before) in send_ends
        )
        if not on_object:
            continue
        name = m.group(1)
        after = code[m.end() :].lstrip()
        if after.startswith("("):
            continue  # a C++ member function call on a namesake C++ object
        is_assignment = after.startswith("=") and not after.startswith("==")
        uses.append(
            ("set" + name[0].upper() + name[1:] + ":" if is_assignment else name, m.start())
        )
    return uses


def api_uses(source: str) -> list[Use]:
    """Every selector and Apple class/protocol name the Objective-C++ source uses."""
    code = strip_comments_and_strings(source)
    items, _ = group(tokenize(code))
    sends = message_sends(items)
    uses = [Use("selector", send.selector, line_of(code, send.start)) for send in sends]
    for m in re.finditer(r"@selector\s*\(\s*([\w:]+)\s*\)", code):
        uses.append(Use("selector", m.group(1), line_of(code, m.start())))
    for selector, offset in property_uses(code, sends):
        uses.append(Use("property", selector, line_of(code, offset)))
    for send in sends:
        receiver = send.receiver
        if len(receiver) == 1 and is_ident(receiver[0]) and APPLE_PREFIX.match(receiver[0].text):
            uses.append(Use("class", receiver[0].text, line_of(code, send.start)))
    for pattern in CLASS_USES:
        for m in pattern.finditer(code):
            for name in re.split(r"[\s,]+", m.group(1).strip()):
                if APPLE_PREFIX.match(name):
                    uses.append(Use("class", name, line_of(code, m.start())))
    return uses


def read_name_list(path: Path) -> dict[str, set[str]]:
    """Sections of a name list: `[selectors]` and `[classes]`, one name per line, # comments."""
    sections: dict[str, set[str]] = {"selectors": set(), "classes": set()}
    current = None
    for raw in path.read_text().splitlines():
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        if line.startswith("[") and line.endswith("]"):
            current = sections.setdefault(line[1:-1], set())
        elif current is not None:
            current.add(line.split()[0])
    return sections


def interface_problems(source: str) -> list[Problem]:
    """Problems that show the file reaching beyond the device interface."""
    problems = []
    for number, line in enumerate(source.splitlines(), 1):
        include = re.match(r'\s*#\s*(?:include|import)\s*([<"])([^>"]+)[>"]', line)
        if include is None:
            continue
        quote, header = include.groups()
        if quote == '"' and header not in DEVICE_HEADERS:
            problems.append(Problem(number, f'includes "{header}": only device headers allowed'))
        if quote == "<" and re.match(r"(lily|nanobind|Python)\b", header):
            problems.append(Problem(number, f"includes <{header}>: not a system header"))
    for m in re.finditer(r"[A-Za-z_]\w*", source):
        words = re.findall(r"[A-Z]+(?![a-z])|[A-Z]?[a-z]+|\d+", m.group())
        for word in words:
            singular = word.lower().removesuffix("s")
            if word.lower() in ENGINE_WORDS or singular in ENGINE_WORDS:
                problems.append(
                    Problem(line_of(source, m.start()), f"engine word {m.group()!r} in the device")
                )
    line_count = source.count("\n") + 1
    if line_count > MAX_LINES:
        problems.append(Problem(line_count, f"{line_count} lines: a device has no business being "
                                            f"longer than {MAX_LINES}"))  # fmt: skip
    return problems


def boolean_getter(name: str) -> str:
    """`enabled` -> `isEnabled`: Objective-C BOOL properties often rename their getter so."""
    return "is" + name[:1].upper() + name[1:]


def check(source: str, api: Path, allowlist: Path = DEFAULT_ALLOWLIST) -> list[Problem]:
    """Every problem found in an Objective-C++ source, in line order."""
    known = read_name_list(api)
    allowed = read_name_list(allowlist)
    selectors = known["selectors"] | allowed["selectors"]
    classes = known["classes"] | allowed["classes"]
    problems = interface_problems(source)
    for use in api_uses(source):
        if use.kind == "class" and use.name not in classes:
            problems.append(Problem(use.line, f"unknown class or protocol {use.name}"))
        elif use.kind == "selector" and use.name not in selectors:
            problems.append(Problem(use.line, f"unknown selector {use.name}"))
        elif use.kind == "property" and not {use.name, boolean_getter(use.name)} & selectors:
            problems.append(Problem(use.line, f"unknown property selector {use.name}"))
    return sorted(set(problems), key=lambda p: (p.line, p.message))


def find_api_list(explicit: str | None = None) -> Path | None:
    for candidate in (explicit, os.environ.get("LILY_METAL_API"), *API_CANDIDATES):
        if candidate and Path(candidate).is_file():
            return Path(candidate)
    return None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("source", nargs="?", default=str(DEFAULT_SOURCE))
    parser.add_argument("--api", help="metal_api.txt (default: the shared data copy)")
    parser.add_argument("--list", action="store_true", help="print every API name the file uses")
    args = parser.parse_args(argv)
    api = find_api_list(args.api)
    if api is None:
        print("metal_api.txt not found: pass --api or set LILY_METAL_API", file=sys.stderr)
        return 2
    source = Path(args.source).read_text()
    if args.list:
        for kind, name in sorted({(u.kind, u.name) for u in api_uses(source)}):
            print(f"{kind:9} {name}")
    problems = check(source, api)
    for problem in problems:
        print(f"{args.source}:{problem}")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
