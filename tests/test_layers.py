"""The package's layering, read from the source's AST (function-local imports included).

The layers, lowest first: ``errors``/``config``/``sampling_params``/``paths`` -> ``core`` -> ``contracts``
-> ``cpu_kernels`` -> ``models`` and ``runner_v2`` -> ``drafters`` -> ``warmup``/``graphs`` -> ``pages`` ->
``engine`` -> ``serve``/``cli``.
A module may import its own layer or lower ones. Imports under ``if TYPE_CHECKING:`` are type-only:
they may not point upwards either, and they may not close a cycle either: a type-only cycle is a
knot of modules that cannot be read, tested or split one at a time.

Inside ``graphs/``: ``graphs.capture`` (sizes, planning, capture, dispatch) -> ``graphs.proof``
(verification, CUDA safety, the start-up cache, the report) -> ``graphs.startup``/``graphs.hook``,
which compose the two.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src"
PACKAGE = SRC / "warmcap"

#: For each package: the top-level names of ``warmcap`` it must never import.
_ABOVE_RUNNER = frozenset(
    {"drafters", "warmup", "graphs", "pages", "engine", "cli", "serve", "kv_transfer", "distributed"}
)
#: above the pages: what starts an engine (the pages draw its results, handed to them as data)
_ABOVE_PAGES = frozenset({"engine", "llm", "startup", "cli", "serve"})
FORBIDDEN: dict[str, frozenset[str]] = {
    # core is held tighter still by CORE_ALLOWED below.
    "core": _ABOVE_RUNNER | {"contracts", "cpu_kernels", "models", "runner_v2"},
    "contracts": _ABOVE_RUNNER | {"models", "runner_v2", "cpu_kernels"},
    # The compiled CPU kernels serve both models (layer ops) and runner_v2 (attention).
    "cpu_kernels": _ABOVE_RUNNER | {"models", "runner_v2"},
    # Models read the tensor-parallel facts from contracts.parallel, never the package that starts ranks.
    "models": _ABOVE_RUNNER | {"runner_v2"},
    "runner_v2": _ABOVE_RUNNER,
    # KV connectors sit above core and runner_v2, which see them only through core/kv_connector.py.
    "kv_transfer": _ABOVE_RUNNER - {"kv_transfer"},
    # The HTML pages draw warmup plans and capture reports; neither knows they exist.
    "warmup": frozenset({"pages"}),
    "graphs": frozenset({"pages"}),
    "pages": _ABOVE_PAGES,
}
#: ``core`` may import only these (besides itself and the standard library / third parties).
CORE_ALLOWED = frozenset({"core", "config", "errors", "sampling_params", "spec_methods"})
#: Inside ``graphs/``: for each part, the parts above it it must never import (type-only included).
GRAPHS_FORBIDDEN: dict[str, frozenset[str]] = {
    "capture": frozenset({"proof", "startup", "hook"}),
    "proof": frozenset({"startup", "hook"}),
}


@dataclass(frozen=True, slots=True)
class Import:
    importer: str
    target: str
    line: int
    type_only: bool


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(SRC).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _modules() -> dict[str, Path]:
    return {_module_name(p): p for p in PACKAGE.rglob("*.py")}


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _imports(name: str, path: Path, modules: dict[str, Path]) -> Iterator[Import]:
    is_package = path.name == "__init__.py"
    package = name if is_package else name.rpartition(".")[0]

    def visit(node: ast.AST, type_only: bool) -> Iterator[Import]:
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            for child in node.body:
                yield from visit(child, True)
            for child in node.orelse:
                yield from visit(child, type_only)
            return
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.startswith("warmcap"):
                    yield Import(name, alias.name, node.lineno, type_only)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                module = ".".join([*base, node.module] if node.module else base)
            else:
                module = node.module or ""
            if module.startswith("warmcap"):
                for alias in node.names:
                    sub = f"{module}.{alias.name}"
                    yield Import(name, sub if sub in modules else module, node.lineno, type_only)
        for child in ast.iter_child_nodes(node):
            yield from visit(child, type_only)

    yield from visit(ast.parse(path.read_text(), str(path)), False)


def _all_imports() -> list[Import]:
    modules = _modules()
    return [imp for name, path in sorted(modules.items()) for imp in _imports(name, path, modules)]


def _layer(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


def test_no_upward_imports() -> None:
    bad: dict[str, None] = {}
    for imp in _all_imports():
        src, dst = _layer(imp.importer), _layer(imp.target)
        if dst in FORBIDDEN.get(src, ()) or (src == "core" and dst not in CORE_ALLOWED):
            kind = "type-only " if imp.type_only else ""
            bad[f"{imp.importer}:{imp.line} {kind}imports {imp.target}"] = None
    assert not bad, "imports against the layering:\n" + "\n".join(bad)


def _find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}
    stack: list[str] = []

    def dfs(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return [*stack[stack.index(nxt) :], nxt]
            if nxt not in state and (found := dfs(nxt)):
                return found
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (found := dfs(node)):
            return found
    return None


def _graphs_part(module: str) -> str:
    parts = module.split(".")
    return parts[2] if len(parts) > 2 and parts[1] == "graphs" else ""


def test_graphs_capture_never_reads_its_proof() -> None:
    bad = [
        f"{imp.importer}:{imp.line} {'type-only ' if imp.type_only else ''}imports {imp.target}"
        for imp in _all_imports()
        if _graphs_part(imp.target) in GRAPHS_FORBIDDEN.get(_graphs_part(imp.importer), ())
    ]
    assert not bad, "graphs/ parts importing upwards:\n" + "\n".join(bad)


def _import_graph(
    *, type_only: bool, leave_out: frozenset[tuple[str, str]] = frozenset()
) -> dict[str, set[str]]:
    graph: dict[str, set[str]] = {}
    for imp in _all_imports():
        if imp.type_only and (not type_only or (imp.importer, imp.target) in leave_out):
            continue
        if imp.target != imp.importer:
            graph.setdefault(imp.importer, set()).add(imp.target)
    return graph


def test_no_type_only_import_cycle() -> None:
    graph = _import_graph(type_only=True)
    cycle = _find_cycle(graph)
    assert cycle is None, "import cycle (type-only imports included): " + " -> ".join(cycle or [])


def test_no_runtime_import_cycle() -> None:
    graph: dict[str, set[str]] = {}
    for imp in _all_imports():
        if not imp.type_only and imp.target != imp.importer:
            graph.setdefault(imp.importer, set()).add(imp.target)
    cycle = _find_cycle(graph)
    assert cycle is None, "runtime import cycle: " + " -> ".join(cycle or [])


@pytest.mark.parametrize(
    ("graph", "has_cycle"),
    [
        ({"a": {"b"}, "b": {"c"}}, False),
        ({"a": {"b"}, "b": {"c"}, "c": {"a"}}, True),
        ({"a": {"a.x"}, "a.x": {"b"}, "b": set()}, False),
    ],
)
def test_cycle_finder_sees_cycles(graph: dict[str, set[str]], has_cycle: bool) -> None:
    # The checker itself must be able to fail: a planted cycle is found, a chain is not.
    assert (_find_cycle(graph) is not None) is has_cycle


def test_a_planted_type_only_cycle_is_found(tmp_path: Path) -> None:
    """The knot graphs/ had: capture imports a proof module for a type, the proof module imports
    capture at run time. Neither edge alone is a runtime cycle; together they are a type-only one,
    and capture reading proof breaks the graphs/ rule as well."""
    capture = tmp_path / "capturer.py"
    capture.write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
        "    from warmcap.graphs.proof.safety import GraphSafety\n"
    )
    proof = tmp_path / "safety.py"
    proof.write_text("from warmcap.graphs.capture.capturer import GraphCapturer\n")
    modules = {"warmcap.graphs.capture.capturer": capture, "warmcap.graphs.proof.safety": proof}
    imports = [imp for name, path in modules.items() for imp in _imports(name, path, modules)]
    runtime = {i.importer: {i.target} for i in imports if not i.type_only}
    every = {i.importer: {i.target} for i in imports}
    assert _find_cycle(runtime) is None
    assert set(_find_cycle(every) or []) == set(modules)
    assert any(
        _graphs_part(i.target) in GRAPHS_FORBIDDEN[_graphs_part(i.importer)]
        for i in imports
        if _graphs_part(i.importer) in GRAPHS_FORBIDDEN
    )


def test_checker_reads_function_local_and_type_only_imports(tmp_path: Path) -> None:
    source = (
        "from typing import TYPE_CHECKING\n"
        "if TYPE_CHECKING:\n    from warmcap.engine import LLMEngine\n"
        "def f():\n    from warmcap.graphs import capture\n"
    )
    path = tmp_path / "mod.py"
    path.write_text(source)
    found = {(i.target, i.type_only) for i in _imports("warmcap.models.mod", path, {})}
    assert found == {("warmcap.engine", True), ("warmcap.graphs", False)}
