"""The sim's MSL check: reject, in a pre-passed kernel file, what Apple's compiler rejects and the
sim's C++ compile would accept.

The sim's plain build erases MSL's address spaces (`device`, `threadgroup` and `thread` expand to
nothing, `constant` to `const`), so C++ would let a `device float*` become a `threadgroup float*`.
This check compiles the pre-pass output once more, syntax only, with the sim's header in its
LILY_ADDRESS_SPACE_CHECK mode: `device`, `constant` (also const) and `threadgroup` are clang
address spaces 1, 2 and 3, and `thread` is the default one. A pointer or reference bound to memory
of another address space is then a clang error, as it is for Apple's compiler. Two things need
more than clang's verdict:

- clang C++ has no copy constructor or assignment across address spaces, while MSL copies whole
  structs between them (`Params q = p;`, `out[i] = Entry{...};`): those errors are dropped (any
  other type error in such a statement still fails the sim's regular compile);
- clang C++ accepts a C-style cast from one address space to another, which Apple's compiler
  rejects: the check finds those casts in clang's AST dump.

The rest of the MSL rules the header enforces in every build (no `double`, collectives only over
MSL's types, simdgroup matrices of float, half or bfloat loaded from their own element type).
prepass.py runs this check on every kernel file it translates and fails when it finds anything,
so the sim's build cannot accept a kernel that Apple's compiler refuses for these reasons.
"""

from __future__ import annotations

import re
import subprocess
from dataclasses import dataclass

CHECK_FLAGS = [
    "-fsyntax-only",
    "-std=c++20",
    "-DLILY_ADDRESS_SPACE_CHECK",
    "-Wno-unknown-attributes",
    "-fno-color-diagnostics",
    "-ferror-limit=0",  # ignored struct-copy errors must not crowd out the rest
    "-Xclang",
    "-ast-dump",
]


@dataclass(frozen=True)
class Note:
    path: str
    line: int
    message: str


@dataclass(frozen=True)
class ClangError:
    path: str
    line: int
    message: str
    notes: tuple[Note, ...] = ()
    text: str = ""  # as clang printed it, with its source excerpts and notes

    def __str__(self) -> str:
        return self.text or f"{self.path}:{self.line}: error: {self.message}"


DIAGNOSTIC = re.compile(r"^(\S+?):(\d+):\d+: (fatal error|error|warning|note): (.*)$")
# How clang says that it cannot copy a struct across address spaces (see the module docstring).
STRUCT_COPY = re.compile(
    r"no viable conversion from '(?:const )?"
    r"(?:device|constant|threadgroup|__attribute__\(\(address_space\(\d\)\)\)) [^'*&]*'"
)
STRUCT_ASSIGNMENT_NOTE = re.compile(r"implicit (?:copy|move) assignment operator\) not viable")


def clang_errors(stderr: str) -> list[ClangError]:
    """The errors of a clang run, each with the notes and excerpt lines that follow it."""
    errors: list[ClangError] = []
    in_error = False  # whether the lines now printed belong to the last error
    for line in stderr.splitlines():
        match = DIAGNOSTIC.match(line)
        if match:
            path, number, kind, message = match.groups()
            if kind == "note":
                if not (in_error and errors):
                    continue
                last = errors[-1]
                errors[-1] = ClangError(
                    last.path,
                    last.line,
                    last.message,
                    (*last.notes, Note(path, int(number), message)),
                    last.text + "\n" + line,
                )
            elif kind == "warning":
                in_error = False
            else:
                errors.append(ClangError(path, int(number), message, (), line))
                in_error = True
        elif in_error and errors and not re.match(r"^\d+ errors? generated\.$", line):
            last = errors[-1]
            errors[-1] = ClangError(
                last.path, last.line, last.message, last.notes, last.text + "\n" + line
            )
    return errors


def is_struct_copy(error: ClangError) -> bool:
    if STRUCT_COPY.search(error.message):
        return True
    return (
        error.message == "no viable overloaded '='"
        and bool(error.notes)
        and all(STRUCT_ASSIGNMENT_NOTE.search(note.message) for note in error.notes)
    )


# clang's text AST dump prints each source location relative to the one printed before it: a
# file name when the file changes, `line:L:C` when the line does, else `col:C`.
DUMP_LOCATION = re.compile(
    r"line:(?P<line>\d+):(?P<line_col>\d+)|col:(?P<col>\d+)"
    r"|(?P<file><[^<>]*>|[^\s<>,]+):(?P<file_line>\d+):(?P<file_col>\d+)"
)
QUOTED = re.compile(r"'[^']*'|\"(?:[^\"\\]|\\.)*\"")
EXPLICIT_CAST = re.compile(r"^[\s|`-]*(CStyleCastExpr|CXXFunctionalCastExpr) ")


def address_space_casts(dump: str, trusted_dir: str) -> list[ClangError]:
    """The explicit casts in the AST dump that convert between address spaces, except those in
    files under trusted_dir (the sim's own header)."""
    found: list[ClangError] = []
    if "<AddressSpaceConversion>" not in dump:
        return found  # the usual case, and walking a dump of megabytes takes seconds
    file, line_number = "?", 0
    lines = dump.splitlines()
    for index, text in enumerate(lines):
        stripped = QUOTED.sub("''", text)
        is_cast = bool(EXPLICIT_CAST.match(text)) and "<AddressSpaceConversion>" in text
        first = True
        for match in DUMP_LOCATION.finditer(stripped):
            if match["file"]:
                file, line_number = match["file"], int(match["file_line"])
            elif match["line"]:
                line_number = int(match["line"])
            column = match["file_col"] or match["line_col"] or match["col"]
            if is_cast and first and not file.startswith(trusted_dir):
                types = re.findall(r"'([^']*)'", text)
                source = (
                    re.findall(r"'([^']*)'", lines[index + 1]) if index + 1 < len(lines) else []
                )
                what = f"from '{source[0]}' " if source else ""
                message = (
                    f"cast {what}to '{types[0] if types else '?'}' converts between address "
                    "spaces (MSL rejects it; C++ with clang's address spaces allows it)"
                )
                found.append(
                    ClangError(
                        file,
                        line_number,
                        message,
                        (),
                        f"{file}:{line_number}:{column}: error: {message}",
                    )
                )
            first = False
    return found


def check(translated: str, clang: str, include_dir: str) -> list[ClangError]:
    """The MSL errors in a pre-pass output (C++ source text; its line markers name the kernel
    files), or [] when it passes."""
    result = subprocess.run(
        [clang, *CHECK_FLAGS, "-I", include_dir, "-x", "c++", "-"],
        input=translated,
        capture_output=True,
        text=True,
        check=False,
    )
    errors = clang_errors(result.stderr)
    if result.returncode != 0 and not errors:
        raise RuntimeError(f"clang failed without a diagnostic:\n{result.stderr}")
    kept = [error for error in errors if not is_struct_copy(error)]
    return kept + address_space_casts(result.stdout, include_dir)
