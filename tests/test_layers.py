"""The package's layering, read from the source's AST (function-local imports included).

The layers, lowest first: ``errors``/``config``/``sampling_params``/``paths`` -> ``core`` -> ``contracts``
-> ``kernels`` (``kernels/cpu``, ``kernels/triton``) -> ``models`` and ``runner_v2`` -> ``drafters`` ->
``audit`` -> ``warmup``/``graphs`` -> ``pages`` -> ``engine`` -> ``llm`` -> ``accept``/``serve``/``cli``.
``devtools`` (the device checks, the op counter) stands beside the top and nothing else imports it.
A module may import its own layer or lower ones. Imports under ``if TYPE_CHECKING:`` are type-only:
they may not point upwards either, and they may not close a cycle either: a type-only cycle is a
knot of modules that cannot be read, tested or split one at a time.

Folders too: the graph of ``warmcap``'s top-level packages and modules (an import of
``warmcap.engine`` from ``warmcap.warmup.hook`` is the arrow ``warmup -> engine``) has no cycle,
so each folder sits on one floor.

Inside ``graphs/``: ``graphs.capture`` (sizes, planning, capture, dispatch) -> ``graphs.proof``
(verification, CUDA safety, the start-up cache, the report) -> ``graphs.startup``/``graphs.hook``,
which compose the two.
"""

from __future__ import annotations

import ast
import itertools
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src"
PACKAGE = SRC / "warmcap"

#: For each package: the top-level names of ``warmcap`` it must never import.
_ABOVE_RUNNER = frozenset(
    {"drafters", "audit", "warmup", "graphs", "pages", "engine", "llm", "startup", "cli", "serve"}
    | {"accept", "kv_transfer", "distributed", "devtools"}
)
#: above the pages: what starts an engine (the pages draw its results, handed to them as data)
_ABOVE_PAGES = frozenset({"engine", "llm", "startup", "cli", "serve", "accept", "devtools"})
FORBIDDEN: dict[str, frozenset[str]] = {
    # core is held tighter still by CORE_ALLOWED below.
    "core": _ABOVE_RUNNER | {"contracts", "kernels", "models", "runner_v2"},
    "contracts": _ABOVE_RUNNER | {"models", "runner_v2", "kernels"},
    # The kernels (compiled CPU, Triton) serve both models (layer ops) and runner_v2 (attention,
    # slot mapping); they see neither.
    "kernels": _ABOVE_RUNNER | {"models", "runner_v2"},
    # Models read the tensor-parallel facts from contracts.parallel, never the package that starts ranks.
    "models": _ABOVE_RUNNER | {"runner_v2"},
    "runner_v2": _ABOVE_RUNNER,
    # KV connectors sit above core and runner_v2, which see them only through core/kv_connector.py.
    "kv_transfer": _ABOVE_RUNNER - {"kv_transfer"},
    # The audits read the runner's write records and the KV manager's tables; warmup, the engine and
    # serve call them, so they never see those (nor the drafters whose writes they check).
    "audit": _ABOVE_RUNNER - {"audit"},
    # The HTML pages draw warmup plans and capture reports; neither knows they exist, nor what starts
    # an engine (warmup -> llm was the arrow that closed warmup -> llm -> engine -> warmup).
    "warmup": _ABOVE_PAGES | {"pages"},
    "graphs": _ABOVE_PAGES | {"pages"},
    "pages": _ABOVE_PAGES,
}
#: the only importers of the acceptance harness (an application of ``LLM``, like serve)
ACCEPT_IMPORTERS = frozenset({"accept", "cli"})
#: the dev instruments: imported by scripts, benchmarks and tests, never by a module outside them
DEVTOOLS = "devtools"
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


def _folder(module: str) -> str:
    """The folder (top-level package or module of ``warmcap``) a module lives in; the package's own
    ``__init__`` (the lazy ``LLM`` door) is the node ``warmcap``."""
    return _layer(module) or "warmcap"


def _folder_graph(imports: list[Import]) -> tuple[dict[str, set[str]], dict[tuple[str, str], str]]:
    """The folder-level import graph (type-only imports included) and, per arrow, one import that
    draws it (``importer:line -> target``), so a cycle names the lines to change."""
    graph: dict[str, set[str]] = {}
    witness: dict[tuple[str, str], str] = {}
    for imp in imports:
        src, dst = _folder(imp.importer), _folder(imp.target)
        if src != dst:
            graph.setdefault(src, set()).add(dst)
            witness.setdefault((src, dst), f"{imp.importer}:{imp.line} -> {imp.target}")
    return graph, witness


def _cycle_report(graph: dict[str, set[str]], witness: dict[tuple[str, str], str]) -> str:
    cycle = _find_cycle(graph) or []
    arrows = [f"  {a} -> {b}: {witness[a, b]}" for a, b in itertools.pairwise(cycle)]
    return " -> ".join(cycle) + "\n" + "\n".join(arrows)


def test_no_folder_level_cycle() -> None:
    """Each folder sits on one floor: no chain of imports leads from a folder back into itself
    (warmup -> llm -> engine -> warmup was one, while the acceptance harness lived in warmup/)."""
    graph, witness = _folder_graph(_all_imports())
    assert _find_cycle(graph) is None, "folder-level import cycle: " + _cycle_report(graph, witness)


def test_nothing_outside_devtools_imports_devtools() -> None:
    """The device checks patch runner attributes and set environment switches; the op counter wraps
    backends. Scripts, benchmarks and tests use them; the runtime never does."""
    bad = [
        f"{imp.importer}:{imp.line} imports {imp.target}"
        for imp in _all_imports()
        if _layer(imp.target) == DEVTOOLS and _layer(imp.importer) != DEVTOOLS
    ]
    assert not bad, "runtime modules importing devtools:\n" + "\n".join(bad)


def test_only_the_cli_imports_the_acceptance_harness() -> None:
    """accept/ runs ``LLM`` (or a server) over a prompt set: an application, like serve. Anything
    else importing it would pull the engine in under itself."""
    bad = [
        f"{imp.importer}:{imp.line} imports {imp.target}"
        for imp in _all_imports()
        if _layer(imp.target) == "accept" and _folder(imp.importer) not in ACCEPT_IMPORTERS
    ]
    assert not bad, "accept/ imported by more than the CLI:\n" + "\n".join(bad)


def test_a_planted_folder_cycle_is_found(tmp_path: Path) -> None:
    """The cycle the acceptance harness closed in warmup/: no module cycle (harness -> llm -> engine
    -> hook, and hook imports none of them), yet warmup -> llm -> engine -> warmup as folders. The
    folder test sees it and names each arrow's import; the layer table forbids warmup -> llm."""
    sources = {
        "warmcap.warmup.accept": "def run():\n    from warmcap.llm import LLM\n",
        "warmcap.llm": "from warmcap.engine import LLMEngine\n",
        "warmcap.engine": "from warmcap.warmup.hook import warmup_hook\n",
        "warmcap.warmup.hook": "import torch\n",
    }
    modules: dict[str, Path] = {}
    for name, text in sources.items():
        modules[name] = tmp_path / f"{name}.py"
        modules[name].write_text(text)
    imports = [imp for name, path in modules.items() for imp in _imports(name, path, modules)]
    runtime = {i.importer: {i.target} for i in imports}
    assert _find_cycle(runtime) is None
    graph, witness = _folder_graph(imports)
    assert set(_find_cycle(graph) or []) == {"warmup", "llm", "engine"}
    assert "warmcap.warmup.accept:2 -> warmcap.llm" in _cycle_report(graph, witness)
    assert "llm" in FORBIDDEN["warmup"]


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
