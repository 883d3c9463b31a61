"""The package's shape: a few modules at the top of `lily`, the rest in subpackages named for
their layer, and imports that run one way (no cycle, no layer importing a layer above it).

Every import counts: at module level, inside functions, and under `TYPE_CHECKING`.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "src" / "lily"
# Bottom to top: a layer may import those to its left, never those to its right.
LAYERS = ["checkpoint", "engine", "chat", "api", "server"]


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def modules() -> dict[str, Path | None]:
    found: dict[str, Path | None] = {module_name(p): p for p in PACKAGE.rglob("*.py")}
    found["lily._native"] = None  # the extension module: imports nothing of lily's
    return found


def imports_of(name: str, path: Path, known: set[str]) -> set[str]:
    """The lily modules `path` imports. `from package import name` is the submodule when there
    is one, else the package itself."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            for alias in node.names:
                submodule = f"{base}.{alias.name}"
                found.add(submodule if submodule in known else base)
    return {m for m in found if m in known and m != name}


def import_graph() -> dict[str, set[str]]:
    found = modules()
    return {
        name: set() if path is None else imports_of(name, path, set(found))
        for name, path in found.items()
    }


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in sorted(graph[node]):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def test_few_modules_at_the_top():
    top = sorted(p.name for p in PACKAGE.glob("*.py"))
    assert len(top) <= 12, top


def test_no_import_cycle():
    assert cycles(import_graph()) == []


def test_the_cycle_finder_sees_a_cycle_through_a_function_level_import(tmp_path):
    # The finder itself, on a cycle that only a deferred import closes.
    a = tmp_path / "a.py"
    a.write_text("import lily.b\n")
    b = tmp_path / "b.py"
    b.write_text("def f():\n    from lily import a\n")
    known = {"lily.a", "lily.b"}
    graph = {"lily.a": imports_of("lily.a", a, known), "lily.b": imports_of("lily.b", b, known)}
    assert cycles(graph) == [["lily.a", "lily.b"]]


@pytest.mark.parametrize("layer", LAYERS)
def test_a_layer_imports_nothing_above_it(layer):
    above = [*LAYERS[LAYERS.index(layer) + 1 :], "cli", "diagnostics"]
    wrong = {
        f"{name} -> {dep}"
        for name, deps in import_graph().items()
        if name.startswith(f"lily.{layer}")
        for dep in deps
        if any(dep == f"lily.{up}" or dep.startswith(f"lily.{up}.") for up in above)
    }
    assert not wrong


def test_kernels_and_device_import_no_layer_but_the_engine_s_sampling_types():
    # `lily.kernels.sampling` packs the engine's SamplingParams and token masks for its kernel:
    # those two modules import only `lily.errors`, so the dependency cannot close a cycle.
    allowed = {"lily.engine.sampling", "lily.engine.constraint", "lily.engine"}
    wrong = {
        f"{name} -> {dep}"
        for name, deps in import_graph().items()
        if name.startswith("lily.kernels") or name == "lily.device"
        for dep in deps
        if any(dep.startswith(f"lily.{layer}") for layer in [*LAYERS, "cli", "diagnostics"])
        and dep not in allowed
    }
    assert not wrong
    for module in ("lily.engine.sampling", "lily.engine.constraint"):
        assert import_graph()[module] <= {"lily.errors"}
