"""The contract package sits below models and the runner: models never import the runner, and the
contracts import nothing above them. Read from the AST, so function-local and ``TYPE_CHECKING``
imports count too."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import warmcap

SRC = Path(warmcap.__file__).parent
ABOVE_CONTRACTS = ("models", "runner_v2", "drafters", "graphs", "warmup", "engine", "cli", "startup")
ABOVE_MODELS = ("runner_v2", "drafters", "graphs", "warmup", "engine", "cli", "startup")


def imported_modules(path: Path, src: Path = SRC) -> set[str]:
    """Every module ``path`` (a file under ``src``) imports anywhere in its body, relative imports
    resolved."""
    tree = ast.parse(path.read_text(), filename=str(path))
    package = ".".join(("warmcap", *path.relative_to(src).with_suffix("").parts[:-1]))
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[: len(parts) - node.level + 1] + ([base] if base else []))
            found.add(base)
            found.update(f"{base}.{alias.name}" for alias in node.names)
    return found


def forbidden(package: str, above: tuple[str, ...], src: Path = SRC) -> list[str]:
    bad = []
    for path in sorted((src / package).rglob("*.py")):
        for module in sorted(imported_modules(path, src)):
            parts = module.split(".")
            if parts[0] == "warmcap" and len(parts) > 1 and parts[1] in above:
                bad.append(f"{path.relative_to(src)} imports {module}")
    return bad


def test_contracts_import_nothing_above_them() -> None:
    assert forbidden("contracts", ABOVE_CONTRACTS) == []


def test_models_never_import_the_runner() -> None:
    assert forbidden("models", ABOVE_MODELS) == []


@pytest.mark.parametrize(
    ("source", "module"),
    [
        (
            "def f():\n    from warmcap.runner_v2.mamba_state import MambaStates\n",
            "warmcap.runner_v2.mamba_state",
        ),
        (
            "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from ..runner_v2 import model_runner\n",
            "warmcap.runner_v2.model_runner",
        ),
    ],
    ids=["function_local", "type_checking_relative"],
)
def test_the_check_sees_hidden_imports(tmp_path: Path, source: str, module: str) -> None:
    """Negative control: imports a look at module tops would miss are found and flagged."""
    src = tmp_path / "warmcap"
    (src / "models").mkdir(parents=True)
    (src / "models" / "layer.py").write_text(source)
    assert module in imported_modules(src / "models" / "layer.py", src)
    assert f"models/layer.py imports {module}" in forbidden("models", ABOVE_MODELS, src)
