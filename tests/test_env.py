"""The environment is read in one module (``warmcap/env.py``), every variable is in its table and on
``docs/configuration.md``, and every kernel setting is a config field with an option on every surface
and its variable only as a default."""

from __future__ import annotations

import re
from dataclasses import fields
from pathlib import Path

import pytest

from warmcap import env
from warmcap.config import KERNEL_CHOICES, KernelConfig
from warmcap.engine_args import ARGS_BY_NAME
from warmcap.errors import ConfigError
from warmcap.llm import LLM_KWARGS

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "src" / "warmcap"
DOC = (ROOT / "docs" / "configuration.md").read_text()


def _sources() -> list[tuple[Path, str]]:
    return [(p, p.read_text()) for p in sorted(PACKAGE.rglob("*.py"))]


def test_only_env_py_touches_the_environment() -> None:
    touching = [
        str(p.relative_to(PACKAGE))
        for p, text in _sources()
        if p.name != "env.py" or p.parent != PACKAGE
        if re.search(r"os\.(environ|getenv|putenv|unsetenv)", text)
    ]
    assert touching == []


def test_every_variable_named_in_the_source_is_in_the_table_and_the_docs() -> None:
    named: set[str] = set()
    for _, text in _sources():
        named |= set(re.findall(r'"((?:WARMCAP|VLLM)_[A-Z_]+)"', text))
    assert named <= set(env.VARIABLES), named - set(env.VARIABLES)
    for name in env.VARIABLES:
        assert f"`{name}`" in DOC, name


def test_reading_an_unlisted_variable_fails_loudly() -> None:
    with pytest.raises(KeyError, match="WARMCAP_NOT_A_SETTING"):
        env.read("WARMCAP_NOT_A_SETTING")


@pytest.mark.parametrize("name", [f.name for f in fields(KernelConfig)])
def test_each_kernel_setting_has_one_door(name: str) -> None:
    """A field of the config, an ``LLM`` keyword and a ``--flag`` of every engine command (the table),
    documented, with its environment variable registered as that field's default."""
    _, variable = KERNEL_CHOICES[name]
    arg = ARGS_BY_NAME[name]
    assert (arg.part, arg.attr) == ("kernel", name) and name in LLM_KWARGS and arg.cli
    assert env.VARIABLES[variable].kind == "default" and env.VARIABLES[variable].field == f"kernel.{name}"
    assert f"`--{name.replace('_', '-')}`" in DOC


@pytest.mark.parametrize("name", [f.name for f in fields(KernelConfig)])
def test_the_variable_is_only_the_default(monkeypatch: pytest.MonkeyPatch, name: str) -> None:
    allowed, variable = KERNEL_CHOICES[name]
    monkeypatch.setenv(variable, allowed[1])
    assert getattr(KernelConfig(), name) == allowed[1]
    assert getattr(KernelConfig(**{name: allowed[-1]}), name) == allowed[-1]
    monkeypatch.setenv(variable, "nonsense")
    with pytest.raises(ConfigError, match=rf"{name} 'nonsense' \(from \${variable}\) is not one of"):
        KernelConfig()
    # A value given directly is refused without blaming the variable.
    monkeypatch.delenv(variable)
    with pytest.raises(ConfigError, match=rf"^{name} 'nonsense' is not one of"):
        KernelConfig(**{name: "nonsense"})


def test_the_greedy_head_variable_keeps_its_old_spellings(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("WARMCAP_EXACT_GREEDY_HEAD", "0")
    assert KernelConfig().exact_greedy_head == "off"
    monkeypatch.setenv("WARMCAP_EXACT_GREEDY_HEAD", "1")
    assert KernelConfig().exact_greedy_head == "on"


def test_a_bad_variable_is_one_line_and_exit_2_from_every_command(monkeypatch: pytest.MonkeyPatch) -> None:
    """Refused when the command builds its config (the value, where it came from, the choices),
    never a traceback at import."""
    from typer.testing import CliRunner

    from warmcap.cli import app

    monkeypatch.setenv("WARMCAP_CPU_GEMM", "bogus")
    res = CliRunner().invoke(app, ["plan", "--model", "tiny-llama"])
    assert res.exit_code == 2, res.output
    assert "cpu_gemm 'bogus' (from $WARMCAP_CPU_GEMM) is not one of auto, torch, kernel" in res.output
    assert "Traceback" not in res.output
