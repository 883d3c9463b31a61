"""A lint for the MSL discipline of spec/devices.md, over `metal/*.metal` and `metal/*.h`.

The sim compiles the kernels as C++ with empty address-space macros, so code that Apple's compiler
rejects (an unqualified pointer, a C-style vector cast, ...) would pass every sim test. This lint
catches what a token pass can see; the clang address-space pass in test_msl_lint.py catches
mismatches that need real types.

Usage: ``python tests/msl_lint.py metal/`` prints ``file:line: MSLn: message`` per violation and
exits 1 if there is any.

Rules checked (numbers follow devices.md):

- MSL1: a pointer or reference (parameter, local, cast, return type) without an address space,
  at every level (`device float** p` leaves the outer pointer bare; `auto&` needs one too).
- MSL2: a C-style, ``static_cast`` or ``reinterpret_cast`` conversion to a vector type.
- MSL3: a ``boolN`` type, or a comparison of vector variables outside ``select``/``any``/``all``.
- MSL4: a metal math function called on a bfloat value; a float/half value stored into a bfloat
  variable or element without an explicit ``bfloat(...)`` conversion.
- MSL5: in a kernel, or in a helper as called from a kernel (with the variation of the
  arguments it is passed), a barrier or SIMD collective (or a call that reaches one) under a
  condition, or after an early ``return``, that depends on the thread's position. Conditions
  varying per lane are divergent for every collective; conditions varying only per simdgroup
  (`simdgroup_index_in_threadgroup`) are divergent for threadgroup barriers only, so a
  whole-simdgroup early exit is fine. A call after `&&`, `||` or `?` is conditional on what
  precedes it. Variation is followed through assignments, scope-aware, and through the results
  of helpers; a SIMD reduction is simdgroup-uniform, and shared memory read back at a uniform
  index is uniform (see FunctionVariation).
- MSL6: an initializer on threadgroup memory (it is never zeroed; Metal rejects initializers).
- MSL7: ``double``, the C++ standard library (``std::``, non-metal ``#include <...>``),
  exceptions, ``new``/``delete``, ``virtual``, ``__metal_*`` intrinsics.
- MSL8: an explicit instantiation of a kernel template without ``[[host_name("...")]]``, or one
  kernel name (host name, or function name of a plain kernel) used twice across all files.

Rule 9 (ulp-tolerance tests) is about tests, not kernel text. Limits, by design of a token pass:

- Types are known only by name: built-in scalar, vector and matrix types, and the structs,
  typedefs, aliases and template type parameters declared in the linted files. Values whose
  type comes from a template parameter or a macro argument are out of reach of MSL2-MSL4, and
  `T*` with `T` a macro parameter is not seen by MSL1 (the address-space pass sees it once the
  macro is used).
- MSL5 does not know launch shapes: `thread_position_in_threadgroup.y` counts as lane-varying
  even when the threadgroup is one simdgroup wide, and `if (tid < 32)` is divergent to it even
  though it selects whole simdgroups; write such conditions on the simdgroup index. A helper is
  followed only when its name and argument count pick one definition, and ``break``/``continue``,
  ``do``-``while`` conditions and ``?:`` are not followed.
"""

from __future__ import annotations

import re
import sys
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path


def _names(words: str) -> frozenset[str]:
    return frozenset(words.split())


ADDRESS_SPACES = frozenset(
    {"device", "constant", "threadgroup", "thread", "threadgroup_imageblock", "ray_data"}
)
_SCALARS = ("bool", "char", "uchar", "short", "ushort", "int", "uint", "long", "ulong")
_FLOATS = ("half", "float", "bfloat")
SCALAR_TYPES = frozenset(
    {
        *_SCALARS,
        *_FLOATS,
        "void",
        "auto",
        "signed",
        "unsigned",
        "size_t",
        "ptrdiff_t",
        "atomic_int",
        "atomic_uint",
        "atomic_float",
        "int8_t",
        "int16_t",
        "int32_t",
        "int64_t",
        "uint8_t",
        "uint16_t",
        "uint32_t",
        "uint64_t",
    }
)
VECTOR_TYPE = re.compile(r"^(?:packed_)?(?:" + "|".join(_SCALARS + _FLOATS) + r")[234]$")
MATRIX_TYPE = re.compile(r"^(?:half|float|bfloat)[234]x[234]$|^simdgroup_(?:half|float|bfloat)8x8$")
BOOL_VECTOR_TYPE = re.compile(r"^(?:packed_)?bool[234]$")
BFLOAT_TYPE = re.compile(r"^bfloat[234]?$")
FLOAT_OR_HALF_TYPE = re.compile(r"^(?:half|float)[234]?$")
FLOAT_LITERAL = re.compile(r"^(?:\d*\.\d*|\d+[eE])[\w+-]*$|^\d+[fh]$")
SWIZZLE = re.compile(r"^(?:[xyzw]{2,4}|[rgba]{2,4})$")
BUILTIN_TEMPLATE_TYPES = frozenset(
    {"vec", "packed_vec", "simdgroup_matrix", "array", "atomic", "matrix", "_atomic"}
)

MATH_FUNCTIONS = _names(
    """abs acos acosh asin asinh atan atan2 atanh cbrt ceil clamp copysign cos cosh cospi divide
    exp exp10 exp2 fabs fdim floor fma fmax fmax3 fmin fmin3 fmod fract frexp ilogb ldexp log log10
    log2 max max3 median3 min min3 mix modf nextafter pow powr rint round rsqrt saturate sign sin
    sincos sinh sinpi smoothstep sqrt step tan tanh tanpi trunc dot length normalize distance"""
)
SIMD_COLLECTIVES = _names(
    """simd_sum simd_product simd_max simd_min simd_and simd_or simd_xor simd_all simd_any
    simd_ballot simd_broadcast simd_broadcast_first simd_shuffle simd_shuffle_up simd_shuffle_down
    simd_shuffle_xor simd_shuffle_rotate_up simd_shuffle_rotate_down simd_shuffle_and_fill_up
    simd_shuffle_and_fill_down simd_prefix_inclusive_sum simd_prefix_exclusive_sum
    simd_prefix_inclusive_product simd_prefix_exclusive_product simd_is_first
    simd_active_threads_mask quad_sum quad_max quad_min quad_broadcast quad_shuffle
    quad_shuffle_xor quad_shuffle_up
    quad_shuffle_down quad_ballot quad_all quad_any simdgroup_barrier simdgroup_load
    simdgroup_store simdgroup_multiply_accumulate simdgroup_multiply"""
)
THREADGROUP_BARRIERS = frozenset({"threadgroup_barrier"})
# Collectives whose result is the same in every lane of the simdgroup.
SIMD_REDUCTIONS = _names(
    """simd_sum simd_product simd_max simd_min simd_and simd_or simd_xor simd_all simd_any
    simd_ballot simd_broadcast simd_broadcast_first"""
)

# How much a built-in kernel argument varies: per lane, or only per simdgroup.
LANE, SIMDGROUP, UNIFORM = 2, 1, 0
VARYING_ATTRIBUTES = {
    "thread_position_in_grid": LANE,
    "thread_position_in_threadgroup": LANE,
    "thread_index_in_threadgroup": LANE,
    "thread_index_in_simdgroup": LANE,
    "thread_index_in_quadgroup": LANE,
    "thread_execution_width": UNIFORM,
    "simdgroup_index_in_threadgroup": SIMDGROUP,
    "quadgroup_index_in_threadgroup": LANE,
}
CONTROL_KEYWORDS = frozenset({"if", "for", "while", "switch"})


@dataclass(frozen=True)
class Violation:
    path: str
    line: int
    rule: str
    message: str

    def __str__(self) -> str:
        return f"{self.path}:{self.line}: {self.rule}: {self.message}"


@dataclass(frozen=True)
class Token:
    kind: str  # "id", "num", "str", "punct", "directive"
    text: str
    line: int


_TOKEN = re.compile(
    r"""
    (?P<directive>^[ \t]*\#(?:[^\n\\]|\\.)*)
  | (?P<ws>[ \t\r\f\v]+)
  | (?P<nl>\n)
  | (?P<comment>//[^\n]*|/\*.*?\*/)
  | (?P<str>"(?:[^"\\\n]|\\.)*"|'(?:[^'\\\n]|\\.)*')
  | (?P<num>\.?\d(?:[eEpP][+-]|[\w.])*)
  | (?P<id>[A-Za-z_]\w*)
  | (?P<punct>::|->|\+\+|--|<<=|>>=|<<|<=|>=|==|!=|&&|\|\||[-+*/%&|^!=<>]=|\.\.\.|.)
    """,
    re.VERBOSE | re.DOTALL | re.MULTILINE,
)
_DEFINE = re.compile(r"#\s*define\s+\w+(?:\([^)]*\))?")


def tokenize(text: str) -> list[Token]:
    """Tokens with their line numbers; comments are dropped, macro bodies are tokenized as code."""
    tokens: list[Token] = []
    line = 1
    for match in _TOKEN.finditer(text):
        kind, value = match.lastgroup, match.group()
        if kind == "directive":
            tokens.append(Token("directive", value.strip(), line))
            define = _DEFINE.match(value.strip())
            if define:
                body = value.strip()[define.end() :]
                body_line = line + value.strip()[: define.end()].count("\n")
                tokens.extend(
                    Token(t.kind, t.text, t.line + body_line - 1)
                    for t in tokenize(body.replace("\\\n", " \n"))
                )
        elif kind in ("id", "num", "str", "punct"):
            tokens.append(Token(kind, value, line))
        line += value.count("\n")
    return tokens


def _matching(tokens: list[Token], start: int, open_: str, close: str, step: int = 1) -> int:
    """Index of the bracket matching tokens[start], searching forward (step 1) or backward (-1)."""
    depth = 0
    i = start
    while 0 <= i < len(tokens):
        text = tokens[i].text
        if text == open_:
            depth += 1
        elif text == close:
            depth -= 1
            if depth == 0:
                return i
        i += step
    return -1


class SourceFile:
    """One file's tokens plus the type names the whole lint run knows."""

    def __init__(self, path: str, text: str, type_names: set[str], template_types: set[str]):
        self.path = path
        self.tokens = tokenize(text)
        self.type_names = type_names
        self.template_types = template_types
        self.violations: list[Violation] = []

    def report(self, token: Token, rule: str, message: str) -> None:
        self.violations.append(Violation(self.path, token.line, rule, message))

    def text(self, i: int) -> str:
        return self.tokens[i].text if 0 <= i < len(self.tokens) else ""

    def kind(self, i: int) -> str:
        return self.tokens[i].kind if 0 <= i < len(self.tokens) else ""

    def is_attribute(self, i: int) -> bool:
        """Whether tokens[i] opens a `[[...]]` attribute."""
        return self.text(i) == "[" and self.text(i + 1) == "["

    def is_type_name(self, name: str) -> bool:
        return (
            name in SCALAR_TYPES
            or name in self.type_names
            or bool(VECTOR_TYPE.match(name) or MATRIX_TYPE.match(name))
        )

    def is_vector_type(self, name: str) -> bool:
        return bool(VECTOR_TYPE.match(name))

    def template_start(self, close: int) -> int:
        """For a `>` at `close` ending a template type (`vec<float, 4>`), the index of its name."""
        if self.text(close) != ">":
            return -1
        open_ = _matching(self.tokens, close, ">", "<", step=-1)
        if open_ > 0 and self.text(open_ - 1) in (BUILTIN_TEMPLATE_TYPES | self.template_types):
            return open_ - 1
        return -1

    def type_ends_at(self, i: int) -> bool:
        """Whether tokens[i] can end the type part of a declaration or cast."""
        text = self.text(i)
        if text in ("const", "volatile"):
            return True
        if text == "*":  # `T**`: the inner star ends a type if it is a declarator itself
            return self.type_ends_at(i - 1)
        if self.kind(i) == "id":
            return self.is_type_name(text)
        return self.template_start(i) >= 0


def collect_type_names(tokens: list[Token]) -> tuple[set[str], set[str]]:
    """User type names (structs, typedefs, aliases, template type parameters) and template names."""
    types: set[str] = set()
    templates: set[str] = set()
    for i, tok in enumerate(tokens):
        nxt = tokens[i + 1].text if i + 1 < len(tokens) else ""
        if tok.text == "enum" and nxt in ("class", "struct") and i + 2 < len(tokens):
            types.add(tokens[i + 2].text)
        elif tok.text in ("struct", "class", "enum", "union") and tokens[i + 1].kind == "id":
            types.add(nxt)  # a type, or in `template <class T>` a type parameter
            if tokens[i - 1].text == ">" and not _in_template_head(tokens, i):
                templates.add(nxt)
        elif tok.text == "typename" and tokens[i + 1].kind == "id" and nxt != "metal":
            types.add(nxt)  # a template type parameter (or a dependent type, harmless)
        elif tok.text == "using" and i + 2 < len(tokens) and tokens[i + 2].text == "=":
            types.add(nxt)
        elif tok.text == "typedef":
            j = i
            while j < len(tokens) and tokens[j].text != ";":
                j += 1
            if tokens[j - 1].kind == "id":
                types.add(tokens[j - 1].text)
    return types, templates


def _in_template_head(tokens: list[Token], i: int) -> bool:
    depth = 0
    for j in range(i - 1, max(i - 40, -1), -1):
        text = tokens[j].text
        if text in (";", "{", "}"):
            return False
        if text == ">":
            depth += 1
        elif text == "<":
            if depth == 0:
                return j > 0 and tokens[j - 1].text == "template"
            depth -= 1
    return False


# ---------------------------------------------------------------------------------------------
# MSL1: address spaces on pointers and references.


def check_address_spaces(src: SourceFile) -> None:
    toks = src.tokens
    for i, tok in enumerate(toks):
        if tok.text not in ("*", "&", "&&") or not src.type_ends_at(i - 1):
            continue
        after = toks[i + 1] if i + 1 < len(toks) else None
        if after is None or not (
            after.kind == "id" or after.text in (")", ",", ">", "*", "&", "&&", "[", "...")
        ):
            continue
        if tok.text == "&&" and after.kind != "id":
            continue
        if not _qualified(src, i):
            kind = "pointer" if tok.text == "*" else "reference"
            src.report(tok, "MSL1", f"{kind} without an address space (device/constant/...)")


def _qualified(src: SourceFile, star: int) -> bool:
    """Whether the pointee type left of tokens[star] names an address space at its own level."""
    j = star - 1
    while j >= 0:
        text = src.text(j)
        if text in ADDRESS_SPACES:
            return True
        start = src.template_start(j)
        if start >= 0:
            j = start - 1
            continue
        if text in ("*", "&", "&&"):
            return False  # the next level out: `device float** p` leaves the outer one bare
        if src.tokens[j].kind == "id" or text == "::":
            j -= 1
            continue
        return False
    return False


# ---------------------------------------------------------------------------------------------
# MSL2: vector conversions.

_OPERAND_START = {"(", "-", "+", "!", "~", "*", "&"}


def check_vector_casts(src: SourceFile) -> None:
    toks = src.tokens
    for i, tok in enumerate(toks):
        if tok.text in ("static_cast", "reinterpret_cast") and src.text(i + 1) == "<":
            close = _matching(toks, i + 1, "<", ">")
            target = [t.text for t in toks[i + 2 : close]]
            if target and "*" not in target and "&" not in target and _names_vector(src, target):
                src.report(
                    tok, "MSL2", f"{tok.text} to a vector type; use a constructor or as_type<T>"
                )
        elif tok.text == "(":
            close = _matching(toks, i, "(", ")")
            inner = [t.text for t in toks[i + 1 : close]]
            before = toks[i - 1] if i else None
            after = toks[close + 1] if 0 < close < len(toks) - 1 else None
            if (
                inner
                and _names_vector(src, inner)
                and (before is None or _starts_expression_after(before))
                and after is not None
                and (after.kind in ("id", "num") or after.text in _OPERAND_START)
            ):
                src.report(tok, "MSL2", "C-style cast to a vector type; use a constructor")


def _names_vector(src: SourceFile, words: list[str]) -> bool:
    words = [w for w in words if w not in ("const", "metal", "::")]
    if len(words) == 1:
        return src.is_vector_type(words[0])
    return words[0] in ("vec", "packed_vec") and words[1] == "<" and words[-1] == ">"


def _starts_expression_after(tok: Token) -> bool:
    """Whether an expression may begin right after `tok` (so `(T)x` there is a cast)."""
    if tok.kind in ("id", "num", "str"):
        return tok.text in ("return", "case")
    return tok.text not in (")", "]", ">")


# ---------------------------------------------------------------------------------------------
# Scopes: the functions of a file, and the typed names they declare.


@dataclass
class Function:
    params: tuple[int, int]  # token span of `( ... )`
    body: tuple[int, int]  # token span of `{ ... }`
    is_kernel: bool
    is_template: bool


def find_functions(src: SourceFile) -> list[Function]:
    toks = src.tokens
    functions = []
    i = 0
    while i < len(toks):
        if toks[i].text == "{" and src.text(i - 1) in (")", "const"):
            close_paren = i - 1 if src.text(i - 1) == ")" else i - 2
            open_paren = _matching(toks, close_paren, ")", "(", step=-1)
            if open_paren > 0 and src.text(open_paren - 1) not in CONTROL_KEYWORDS:
                end = _matching(toks, i, "{", "}")
                head_start = open_paren
                while head_start > 0 and toks[head_start - 1].text not in (";", "{", "}"):
                    head_start -= 1
                head = {t.text for t in toks[head_start:open_paren]}
                functions.append(
                    Function(
                        (open_paren, close_paren), (i, end), "kernel" in head, "template" in head
                    )
                )
                i = end if end > 0 else len(toks)
        i += 1
    return functions


def declared_types(src: SourceFile, start: int, end: int) -> dict[str, tuple[str, bool]]:
    """Names declared in tokens[start:end] -> (base type, is pointer/array) for built-in types."""
    names: dict[str, tuple[str, bool]] = {}
    toks = src.tokens
    for i in range(start, end):
        tok = toks[i]
        if not (src.is_type_name(tok.text) or src.template_start(i) >= 0):
            continue
        base = tok.text if tok.kind == "id" else src.text(src.template_start(i))
        j = i + 1
        indirect = False
        while src.text(j) in ("*", "&", "const", "volatile") or src.text(j) in ADDRESS_SPACES:
            indirect |= src.text(j) == "*"
            j += 1
        if src.kind(j) == "id" and j < end and src.text(j + 1) in ("=", ";", ",", ")", "[", ":"):
            indirect |= src.text(j + 1) == "[" and not src.is_attribute(j + 1)
            names[toks[j].text] = (base, indirect)
    return names


# ---------------------------------------------------------------------------------------------
# MSL3: boolean vectors.

_COMPARISONS = frozenset({"<", ">", "<=", ">=", "==", "!="})
_BOOL_VECTOR_CONSUMERS = frozenset({"select", "any", "all"})


def check_bool_vectors(src: SourceFile) -> None:
    toks = src.tokens
    for i, tok in enumerate(toks):
        is_vec_bool = tok.text == "vec" and src.text(i + 1) == "<" and src.text(i + 2) == "bool"
        if BOOL_VECTOR_TYPE.match(tok.text) or is_vec_bool:
            name = "vec<bool>" if is_vec_bool else tok.text
            src.report(tok, "MSL3", f"{name} value; use select/any/all on the comparison")
    for fn in find_functions(src):
        names = declared_types(src, fn.params[0], fn.body[1])
        vectors = {
            name
            for name, (base, indirect) in names.items()
            if not indirect and (src.is_vector_type(base) or base in ("vec", "packed_vec"))
        }
        for i in range(fn.body[0], fn.body[1]):
            if toks[i].text not in _COMPARISONS or _is_template_bracket(src, i, vectors):
                continue
            if toks[i].text == ">" and ">" in (src.text(i - 1), src.text(i + 1)):
                continue  # a right shift (`>>` stays two tokens for nested templates)
            if not (
                _vector_operand(src, i - 1, vectors, -1) or _vector_operand(src, i + 1, vectors, 1)
            ):
                continue
            if not _inside_call_to(src, i, _BOOL_VECTOR_CONSUMERS, fn.body[0]):
                src.report(toks[i], "MSL3", "vector comparison outside select/any/all")


def _is_template_bracket(src: SourceFile, i: int, vectors: set[str]) -> bool:
    """Whether the `<` or `>` at tokens[i] delimits template arguments (`as_type<float4>(v)`)."""
    if src.text(i) == "<":
        name = i - 1
    elif src.text(i) == ">":
        name = _matching(src.tokens, i, ">", "<", step=-1) - 1
    else:
        return False
    return name >= 0 and src.kind(name) == "id" and src.text(name) not in vectors


def _vector_operand(src: SourceFile, i: int, vectors: set[str], step: int) -> bool:
    """Whether the operand next to a comparison (at tokens[i]) is a whole vector variable."""
    tok = src.tokens[i]
    if tok.kind != "id":
        return False
    if step < 0:
        if src.text(i - 1) in (".", "->"):
            return bool(SWIZZLE.match(tok.text)) and src.text(i - 2) in vectors
        return tok.text in vectors
    if src.text(i + 1) in (".", "->"):
        return tok.text in vectors and bool(SWIZZLE.match(src.text(i + 2)))
    return tok.text in vectors and src.text(i + 1) not in ("[", "(")


def _inside_call_to(src: SourceFile, i: int, callees: frozenset[str], stop: int) -> bool:
    """Whether tokens[i] is within the arguments of a call to one of `callees`."""
    depth = 0  # parentheses closed between tokens[j] and tokens[i]
    for j in range(i - 1, stop, -1):
        text = src.text(j)
        if text == ")":
            depth += 1
        elif text == "(" and depth:
            depth -= 1
        elif text == "(" and src.text(j - 1) in callees:
            return True
        elif text in (";", "{", "}") and depth == 0:
            return False
    return False


# ---------------------------------------------------------------------------------------------
# MSL4: bfloat values.


def check_bfloat(src: SourceFile) -> None:
    toks = src.tokens
    for fn in find_functions(src):
        names = declared_types(src, fn.params[0], fn.body[1])
        bfloats = {n: ind for n, (base, ind) in names.items() if BFLOAT_TYPE.match(base)}
        others = {n: ind for n, (base, ind) in names.items() if FLOAT_OR_HALF_TYPE.match(base)}
        for i in range(fn.body[0], fn.body[1]):
            tok = toks[i]
            if tok.text in MATH_FUNCTIONS and src.text(i + 1) == "(" and src.text(i - 1) != ".":
                close = _matching(toks, i + 1, "(", ")")
                for arg in _split_args(src, i + 2, close):
                    if _is_bfloat_value(src, arg, bfloats):
                        src.report(tok, "MSL4", f"{tok.text}() on a bfloat value; convert to float")
                        break
            elif tok.text in ("=", "+=", "-=", "*=", "/="):
                target_index = _assignment_target(src, i, fn.body[0])
                target = None if target_index is None else src.text(target_index)
                if target is None or target not in bfloats:
                    continue
                indexed = src.text(i - 1) == "]"
                if bfloats[target] and not indexed:
                    continue  # reseating a pointer, not storing a value
                end = i + 1
                while src.text(end) not in (";", "") and end < fn.body[1]:
                    end += 1
                if _implicitly_non_bfloat(src, i + 1, end, bfloats, others):
                    src.report(tok, "MSL4", "implicit conversion to bfloat; write bfloat(...)")


def _split_args(src: SourceFile, start: int, end: int) -> Iterator[tuple[int, int]]:
    depth, arg_start = 0, start
    for j in range(start, end):
        text = src.text(j)
        if text in ("(", "["):
            depth += 1
        elif text in (")", "]"):
            depth -= 1
        elif text == "," and depth == 0:
            yield arg_start, j
            arg_start = j + 1
    yield arg_start, end


def _is_bfloat_value(src: SourceFile, arg: tuple[int, int], bfloats: dict[str, bool]) -> bool:
    start, end = arg
    words = [src.text(j) for j in range(start, end)]
    if not words:
        return False
    if BFLOAT_TYPE.match(words[0]) and len(words) > 1 and words[1] == "(":
        return _matching(src.tokens, start + 1, "(", ")") == end - 1
    if words[0] == "*" and len(words) == 2:
        return bfloats.get(words[1], False)
    if words[0] in bfloats:
        if len(words) == 1:
            return not bfloats[words[0]]
        if words[1] == "[":
            return _matching(src.tokens, start + 1, "[", "]") == end - 1 and bfloats[words[0]]
    return False


def _assignment_target(src: SourceFile, eq: int, stop: int) -> int | None:
    """The token naming the variable the assignment at tokens[eq] writes (`x[i] = ` -> x)."""
    j = eq - 1
    if src.text(j) == "]":
        j = _matching(src.tokens, j, "]", "[", step=-1) - 1
    if j <= stop or src.tokens[j].kind != "id" or src.text(j - 1) in (".", "->"):
        return None
    return j


def _after_condition(src: SourceFile, start: int, end: int) -> int:
    """Where the values of `cond ? a : b` in tokens[start:end] begin (`start` if no `?`)."""
    depth = 0
    for j in range(start, end):
        text = src.text(j)
        depth += text in ("(", "[")
        depth -= text in (")", "]")
        if text == "?" and depth == 0:
            return j + 1
    return start


def _implicitly_non_bfloat(
    src: SourceFile, start: int, end: int, bfloats: dict[str, bool], others: dict[str, bool]
) -> bool:
    """Whether the expression tokens[start:end] visibly has a float/half type at its top level."""
    if src.text(start) == "{":
        return False
    j = _after_condition(src, start, end)
    while j < end:
        tok = src.tokens[j]
        if tok.text == "(":
            j = _matching(src.tokens, j, "(", ")") + 1  # inside a call or a parenthesis
            continue
        if tok.kind == "id" and src.text(j + 1) == "(":
            if FLOAT_OR_HALF_TYPE.match(tok.text):
                return True
            j = _matching(src.tokens, j + 1, "(", ")") + 1
            continue
        if tok.kind == "num" and FLOAT_LITERAL.match(tok.text):
            return True
        if tok.kind == "id" and tok.text in others and src.text(j - 1) not in (".", "->"):
            indexed = src.text(j + 1) == "["
            if others[tok.text] == indexed:
                return True
        if tok.text == "[":
            j = _matching(src.tokens, j, "[", "]") + 1
            continue
        j += 1
    return False


# ---------------------------------------------------------------------------------------------
# MSL5: collectives in uniform control flow.


def collective_helpers(files: list[SourceFile]) -> dict[str, bool]:
    """Functions that (through any helper) reach a collective -> whether one is a barrier."""
    helpers: dict[str, bool] = {}
    bodies = [(src, fn) for src in files for fn in find_functions(src) if not fn.is_kernel]
    changed = True
    while changed:
        changed = False
        for src, fn in bodies:
            name = src.text(fn.params[0] - 1)
            calls = {src.text(i) for i in range(*fn.body) if src.text(i + 1) == "("}
            reached = calls & (SIMD_COLLECTIVES | THREADGROUP_BARRIERS | helpers.keys())
            if not reached:
                continue
            barrier = bool(calls & THREADGROUP_BARRIERS) or any(helpers.get(c) for c in calls)
            if name not in helpers or (barrier and not helpers[name]):
                helpers[name] = barrier
                changed = True
    return helpers


def check_uniform_collectives(files: list[SourceFile]) -> None:
    """MSL5 over every kernel, and over every helper in the context of each kernel's call."""
    CollectiveCheck(files).run()


# A variable is known by the index of the token that declares it; names declared outside the
# function (constants, globals) are known by their text.
VariableKey = int | str


def _is_declaration(src: SourceFile, j: int) -> bool:
    """Whether the identifier at tokens[j] is a declared name (`device float* x = ...`)."""
    if src.kind(j) != "id" or src.is_type_name(src.text(j)):
        return False
    if src.text(j + 1) not in ("=", ";", ",", "[", ")", ":", "{"):
        return False
    k = j - 1
    while src.text(k) in ("*", "&", "&&", "const") or src.text(k) in ADDRESS_SPACES:
        k -= 1
    return src.type_ends_at(k)


def resolve_variables(src: SourceFile, fn: Function) -> dict[int, VariableKey]:
    """Each identifier token of a function mapped to the declaration it refers to, by C++ scope."""
    resolved: dict[int, VariableKey] = {}
    scopes: list[tuple[int, dict[str, int]]] = [(fn.body[1], {})]  # (last index, declarations)
    for j in range(fn.params[0], fn.body[1]):
        while len(scopes) > 1 and scopes[-1][0] < j:
            scopes.pop()
        text = src.text(j)
        if text == "{" and j > fn.body[0]:
            scopes.append((_matching(src.tokens, j, "{", "}"), {}))
        elif text == "for" and src.text(j + 1) == "(":
            scopes.append((_statement_end(src, j), {}))
        elif src.kind(j) == "id":
            if _is_declaration(src, j):
                scopes[-1][1][text] = j
            visible = (decls[text] for _, decls in reversed(scopes) if text in decls)
            resolved[j] = next(visible, text)
    return resolved


def _kernel_varying_params(src: SourceFile, fn: Function) -> dict[VariableKey, int]:
    varying: dict[VariableKey, int] = {}
    for i in range(fn.params[0], fn.params[1]):
        if src.is_attribute(i) and src.text(i + 2) in VARYING_ATTRIBUTES:
            level = VARYING_ATTRIBUTES[src.text(i + 2)]
            if level and src.kind(i - 1) == "id":
                varying[i - 1] = level
    return varying


def _parameter_names(src: SourceFile, fn: Function) -> list[int]:
    """The token index of each parameter's name, in order."""
    names = []
    for start, end in _split_args(src, fn.params[0] + 1, fn.params[1]):
        declared = [j for j in range(start, end) if _is_declaration(src, j)]
        if declared:
            names.append(declared[0])
    return names


# The callback through which a variation analysis asks how much a helper's result varies.
CallLevel = Callable[["SourceFile", int, "FunctionVariation"], "int | None"]
_ASSIGNMENTS = frozenset({"=", "+=", "-=", "*=", "/=", "|=", "&=", "^=", ">>=", "<<="})
_MEMORY_SPACES = frozenset({"device", "constant", "threadgroup"})


class FunctionVariation:
    """How much each variable of one function varies between the threads that run it, given how
    much its parameters vary: a local assigned from a varying value varies as much.

    Writes through a device/constant/threadgroup pointer or array (`scratch[s] = v`) do not make
    the pointer vary: reading shared memory back at a uniform index counts as uniform, which is
    what a reduction through threadgroup memory after a barrier relies on. Control dependence
    (`if (lane == 0) x = 1;`) is not followed."""

    def __init__(
        self, src: SourceFile, fn: Function, seed: dict[VariableKey, int], call_level: CallLevel
    ):
        self.src = src
        self.fn = fn
        self.names = resolve_variables(src, fn)
        self.varying = dict(seed)
        self.call_level = call_level
        self.memory = {
            self.names[j] for j in self.names if _is_declaration(src, j) and _in_memory(src, j)
        }
        self._propagate()

    def of(self, start: int, end: int) -> int:
        """How much tokens[start:end] varies; a SIMD reduction of anything is simdgroup-uniform."""
        src = self.src
        level = UNIFORM
        j = start
        while j < end:
            text = src.text(j)
            if src.kind(j) == "id" and src.text(j + 1) == "(":
                close = _matching(src.tokens, j + 1, "(", ")")
                if text in SIMD_REDUCTIONS:
                    level = max(level, min(self.of(j + 2, close), SIMDGROUP))
                    j = close + 1
                    continue
                result = self.call_level(src, j, self)
                if result is not None:
                    level = max(level, result)
                    j = close + 1
                    continue
            if src.text(j - 1) not in (".", "->"):
                level = max(level, self.varying.get(self.names.get(j, text), UNIFORM))
            j += 1
        return level

    def short_circuit(self, start: int, call: int) -> int:
        """How much the decision to evaluate the call at tokens[call] at all varies, when the
        call is an operand after `&&`, `||` or `?` in the statement starting at tokens[start]."""
        depth = 0  # groups closed between tokens[j] and the call: their operators do not guard it
        for j in range(call - 1, start - 1, -1):
            text = self.src.text(j)
            if text == ")":
                depth += 1
            elif text == "(":
                depth = max(depth - 1, 0)
            elif text in ("&&", "||", "?") and depth == 0:
                return self.of(start, call)
        return UNIFORM

    def returned(self) -> int:
        """How much the function's result varies (over all its return statements)."""
        return max(
            (
                self.of(j + 1, _statement_end(self.src, j))
                for j in range(*self.fn.body)
                if self.src.text(j) == "return"
            ),
            default=UNIFORM,
        )

    def _propagate(self) -> None:
        src, (body_start, body_end) = self.src, self.fn.body
        changed = True
        while changed:
            changed = False
            for i in range(body_start, body_end):
                if src.text(i) not in _ASSIGNMENTS:
                    continue
                target_index = _assignment_target(src, i, body_start)
                if target_index is None:
                    continue
                target = self.names[target_index]
                through_pointer = src.text(i - 1) == "]" or src.text(target_index - 1) == "*"
                if through_pointer and target in self.memory:
                    continue
                end = i + 1
                while end < body_end and src.text(end) not in (";", ")", "{"):
                    end += 1
                level = self.of(i + 1, end)
                if level > self.varying.get(target, UNIFORM):
                    self.varying[target] = level
                    changed = True


def _in_memory(src: SourceFile, name: int) -> bool:
    """Whether the name declared at tokens[name] is in device, constant or threadgroup memory."""
    j = name - 1
    while j >= 0 and src.text(j) not in ("(", ",", ";", "{", "}"):
        if src.text(j) in _MEMORY_SPACES:
            return True
        j -= 1
    return False


class CollectiveCheck:
    """Walks each kernel, and each helper it calls with the variation of the arguments it passes,
    reporting collectives reached under thread-dependent control flow."""

    def __init__(self, files: list[SourceFile]):
        self.files = files
        self.helpers = collective_helpers(files)
        self.definitions: dict[str, list[tuple[SourceFile, Function]]] = {}
        for src in files:
            for fn in find_functions(src):
                if not fn.is_kernel:
                    name = src.text(fn.params[0] - 1)
                    self.definitions.setdefault(name, []).append((src, fn))
        self.checked: set[tuple[str, int, tuple[int, ...]]] = set()
        self.results: dict[tuple[str, int, tuple[int, ...]], int] = {}

    def run(self) -> None:
        for src in self.files:
            for fn in find_functions(src):
                if fn.is_kernel:
                    kernel = src.text(fn.params[0] - 1)
                    self.check(src, fn, _kernel_varying_params(src, fn), kernel)

    def check(
        self, src: SourceFile, fn: Function, seed: dict[VariableKey, int], kernel: str
    ) -> None:
        """Check one function body, given how much its parameters vary."""
        toks = src.tokens
        variation = FunctionVariation(src, fn, seed, self.result_level)
        context = "" if fn.is_kernel else f" (called from kernel {kernel})"

        # Statements run under a condition: (first index, last index, variation level).
        conditions: list[tuple[int, int, int]] = []
        exited = UNIFORM  # the most varying condition under which some threads have returned
        statement_start = fn.body[0] + 1
        for i in range(fn.body[0] + 1, fn.body[1]):
            conditions = [c for c in conditions if c[1] > i]
            tok = toks[i]
            if toks[i - 1].text in (";", "{", "}"):
                statement_start = i
            if tok.text in CONTROL_KEYWORDS and src.text(i + 1) == "(":
                close = _matching(toks, i + 1, "(", ")")
                level = variation.of(i + 2, close)
                scope_end = _statement_end(src, close + 1)
                if tok.text == "if":
                    scope_end = _else_end(src, scope_end)
                    if level and _returns(src, close + 1, scope_end):
                        exited = max(exited, level)
                conditions.append((close + 1, scope_end, level))
                continue
            is_collective = tok.text in SIMD_COLLECTIVES | THREADGROUP_BARRIERS
            if not (
                (is_collective or tok.text in self.helpers)
                and src.text(i + 1) == "("
                and src.text(i - 1) not in (".", "->")
            ):
                continue
            is_barrier = tok.text in THREADGROUP_BARRIERS or self.helpers.get(tok.text, False)
            level = max(
                [lvl for first, _, lvl in conditions if first <= i]
                + [variation.short_circuit(statement_start, i)]
            )
            what = tok.text
            if not is_collective:
                reached = "threadgroup barrier" if is_barrier else "SIMD collective"
                what = f"{tok.text} (which reaches a {reached})"
                self.enter_helper(src, i, variation, kernel)
            if level >= (SIMDGROUP if is_barrier else LANE):
                src.report(tok, "MSL5", f"{what} under a thread-dependent condition{context}")
            elif exited == LANE:
                src.report(tok, "MSL5", f"{what} after a lane-dependent early exit{context}")

    def callee(
        self, src: SourceFile, call: int, variation: FunctionVariation
    ) -> tuple[SourceFile, Function, dict[VariableKey, int], tuple[int, ...]] | None:
        """The helper called at tokens[call] and how much each of its parameters varies there.
        Overloads and same-named members are told apart only by their parameter count."""
        close = _matching(src.tokens, call + 1, "(", ")")
        levels = tuple(variation.of(a, b) for a, b in _split_args(src, call + 2, close))
        candidates = [
            (helper_src, helper, params)
            for helper_src, helper in self.definitions.get(src.text(call), [])
            if len(params := _parameter_names(helper_src, helper)) == len(levels)
        ]
        if len(candidates) != 1:
            return None
        helper_src, helper, params = candidates[0]
        return helper_src, helper, dict(zip(params, levels, strict=True)), levels

    def enter_helper(
        self, src: SourceFile, call: int, variation: FunctionVariation, kernel: str
    ) -> None:
        """Check the helper called at tokens[call] with the variation of the arguments passed."""
        callee = self.callee(src, call, variation)
        if callee is None:
            return
        helper_src, helper, seed, levels = callee
        key = (helper_src.path, helper.body[0], levels)
        if key not in self.checked:
            self.checked.add(key)
            self.check(helper_src, helper, seed, kernel)

    def result_level(self, src: SourceFile, call: int, variation: FunctionVariation) -> int | None:
        """How much the result of a call to a collective helper varies (None for other calls,
        whose result is taken to vary as much as their arguments)."""
        if src.text(call) not in self.helpers:
            return None
        callee = self.callee(src, call, variation)
        if callee is None:
            return None
        helper_src, helper, seed, levels = callee
        key = (helper_src.path, helper.body[0], levels)
        if key not in self.results:
            self.results[key] = max(levels, default=UNIFORM)  # while recursing into itself
            analysis = FunctionVariation(helper_src, helper, seed, self.result_level)
            self.results[key] = analysis.returned()
        return self.results[key]


def _statement_end(src: SourceFile, i: int) -> int:
    """The last token index of the statement starting at tokens[i] (a block or up to `;`)."""
    if src.text(i) == "{":
        return _matching(src.tokens, i, "{", "}")
    if src.text(i) in CONTROL_KEYWORDS:
        close = _matching(src.tokens, i + 1, "(", ")")
        end = _statement_end(src, close + 1)
        return _else_end(src, end) if src.text(i) == "if" else end
    depth = 0
    while i < len(src.tokens):
        text = src.text(i)
        depth += text in ("(", "{", "[")
        depth -= text in (")", "}", "]")
        if text == ";" and depth == 0:
            return i
        i += 1
    return i


def _else_end(src: SourceFile, end: int) -> int:
    if src.text(end + 1) == "else":
        return _statement_end(src, end + 2)
    return end


def _returns(src: SourceFile, start: int, end: int) -> bool:
    return any(src.text(j) == "return" for j in range(start, end + 1))


# ---------------------------------------------------------------------------------------------
# MSL6, MSL7, MSL8: simple token rules.


def check_threadgroup_initializers(src: SourceFile) -> None:
    toks = src.tokens
    for i, tok in enumerate(toks):
        if tok.text != "threadgroup" or src.text(i - 1) in ("(", ")", "const"):
            continue  # a cast, or a member function qualifier
        j = i + 1
        while j < len(toks) and toks[j].text not in (";", "=", "{", ")", ",", "*", "&"):
            if toks[j].text == "[":
                j = _matching(toks, j, "[", "]")
            j += 1
        if src.text(j) in ("=", "{"):
            src.report(tok, "MSL6", "threadgroup memory with an initializer; it is never zeroed")


# Apple's Metal headers, MetalPerformancePrimitives (Metal 4 tensor ops) included.
_METAL_INCLUDE = re.compile(
    r"#\s*include\s*(?:<metal_\w+>|<MetalPerformancePrimitives/MetalPerformancePrimitives\.h>"
    r'|"[^"]+")'
)


def check_forbidden(src: SourceFile) -> None:
    for i, tok in enumerate(src.tokens):
        text = tok.text
        if tok.kind == "directive":
            if re.match(r"#\s*include", text) and not _METAL_INCLUDE.match(text):
                header = re.sub(r"\s*(?://|/\*).*", "", text, flags=re.DOTALL)
                src.report(tok, "MSL7", f"standard-library include: {header}")
        elif tok.kind != "id":
            continue
        elif text == "double":
            src.report(tok, "MSL7", "double is not available on the GPU")
        elif text in ("throw", "try", "catch"):
            src.report(tok, "MSL7", f"exceptions ({text}) are not available in MSL")
        elif text in ("new", "delete"):
            src.report(tok, "MSL7", f"dynamic allocation ({text}) is not available in MSL")
        elif text == "virtual":
            src.report(tok, "MSL7", "virtual functions are not available in MSL")
        elif text.startswith("__metal_"):
            src.report(tok, "MSL7", f"Apple-internal intrinsic {text}")
        elif text == "std" and src.text(i + 1) == "::":
            src.report(tok, "MSL7", "the C++ standard library is not available in MSL")


def kernel_template_names(src: SourceFile) -> set[str]:
    """Names of the kernel templates a file defines (`template <...> [[kernel]] void name(`)."""
    names = set()
    toks = src.tokens
    for i, tok in enumerate(toks):
        if tok.text == "template" and src.text(i + 1) == "<":
            j = _matching(toks, i + 1, "<", ">") + 1
            head_end = j
            while head_end < len(toks) and toks[head_end].text not in ("(", ";", "{"):
                head_end += 1
            head = [t.text for t in toks[j:head_end]]
            if "kernel" in head:
                names.add(head[-1])
    return names


def check_host_names(src: SourceFile, kernel_templates: set[str], seen: dict[str, str]) -> None:
    """MSL8; `seen` maps each kernel name met so far (in any file) to where it was defined."""
    toks = src.tokens
    kernel_names = {
        fn.params[0] - 1: src.text(fn.params[0] - 1)  # a plain kernel is named by its function
        for fn in find_functions(src)
        if fn.is_kernel and not fn.is_template
    }
    for i, tok in enumerate(toks):
        name = kernel_names.get(i)
        if tok.text == "host_name" and src.text(i + 1) == "(" and src.kind(i + 2) == "str":
            name = toks[i + 2].text.strip('"')
        if name is not None:
            if name in seen:
                src.report(tok, "MSL8", f'kernel name "{name}" already used at {seen[name]}')
            else:
                seen[name] = f"{src.path}:{tok.line}"
        if tok.text != "template" or src.text(i + 1) == "<" or src.text(i - 1) in (".", "->", "::"):
            continue
        end = i
        while end < len(toks) and toks[end].text not in (";", "{"):
            end += 1
        words = {t.text for t in toks[i:end]}
        if ("kernel" in words or words & kernel_templates) and "host_name" not in words:
            src.report(tok, "MSL8", 'kernel instantiation without [[host_name("...")]]')


# ---------------------------------------------------------------------------------------------


def lint_sources(sources: dict[str, str]) -> list[Violation]:
    """Lint several files together (types declared in one are known in all)."""
    type_names: set[str] = set()
    template_types: set[str] = set()
    for text in sources.values():
        types, templates = collect_type_names(tokenize(text))
        type_names |= types
        template_types |= templates
    files = [SourceFile(p, t, type_names, template_types) for p, t in sources.items()]
    kernel_templates = set().union(*(kernel_template_names(f) for f in files)) if files else set()
    host_names: dict[str, str] = {}
    for src in files:
        check_address_spaces(src)
        check_vector_casts(src)
        check_bool_vectors(src)
        check_bfloat(src)
        check_threadgroup_initializers(src)
        check_forbidden(src)
        check_host_names(src, kernel_templates, host_names)
    check_uniform_collectives(files)  # reports into the files that define helpers, too
    violations: list[Violation] = []
    for src in files:
        violations += sorted(set(src.violations), key=lambda v: (v.line, v.rule, v.message))
    return violations


def metal_files(paths: Iterable[Path]) -> list[Path]:
    """The .metal and .h files named, or found directly inside the directories named."""
    found: list[Path] = []
    for path in paths:
        if path.is_dir():
            found += sorted(p for p in path.iterdir() if p.suffix in (".metal", ".h"))
        else:
            found.append(path)
    return found


def lint_paths(paths: Iterable[Path]) -> list[Violation]:
    files = metal_files(paths)
    return lint_sources({str(p): p.read_text() for p in files})


def main(argv: list[str]) -> int:
    if not argv:
        print("usage: python tests/msl_lint.py metal/ [more files or directories]", file=sys.stderr)
        return 2
    violations = lint_paths(Path(a) for a in argv)
    for violation in violations:
        print(violation)
    return 1 if violations else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
