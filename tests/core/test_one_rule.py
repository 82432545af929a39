"""Invariant I1: block counts come only from core/reservation.py.

Scans the package's code (comments and strings removed) for ceiling-division block arithmetic.
"""

from __future__ import annotations

import io
import re
import tokenize
from pathlib import Path

import pytest

import warmcap

PACKAGE = Path(warmcap.__file__).parent
RULE_FILE = PACKAGE / "core" / "reservation.py"
_OPERAND = r"[\w.\[\]]+"

# Each pattern runs on one logical line: tokens joined by single spaces, except around ``.``, ``[``
# and ``]`` so that ``self.block_size`` and ``seq_lens[i]`` stay one operand.
# NOTE: Triton's own ``tl.cdiv`` / ``triton.cdiv`` count a kernel's tiles and launch grid, never KV
# blocks (the kernels read the block tables the runner built), so they are not block arithmetic.
PATTERNS: dict[str, re.Pattern[str]] = {
    "cdiv call": re.compile(r"(?<!\btl\.)(?<!\btriton\.)\bcdiv\s*\("),
    "(a + b - 1) // b": re.compile(rf"\+\s*{_OPERAND}\s*-\s*1\s*\)\s*//"),
    "(a - 1) // b + 1": re.compile(rf"\(\s*{_OPERAND}\s*-\s*1\s*\)\s*//\s*{_OPERAND}\s*\+\s*1\b"),
    "-(-a // b)": re.compile(r"-\s*\(\s*-[^/]*//"),
    "ceil of a division": re.compile(r"\bceil\s*\(.*/"),
}
_TIGHT = re.compile(r"\s*([.\[\]])\s*")
_SKIPPED_TOKENS = {tokenize.COMMENT, tokenize.NL, tokenize.INDENT, tokenize.DEDENT, tokenize.ENCODING}


def logical_lines(source: str) -> list[tuple[int, str]]:
    """(first line number, code) of every logical line, strings and comments blanked."""
    out: list[tuple[int, str]] = []
    parts: list[str] = []
    start = 0
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type in _SKIPPED_TOKENS:
            continue
        if tok.type in (tokenize.NEWLINE, tokenize.ENDMARKER):
            if parts:
                out.append((start, _TIGHT.sub(r"\1", " ".join(parts))))
            parts = []
            continue
        if not parts:
            start = tok.start[0]
        parts.append("''" if tok.type == tokenize.STRING else tok.string)
    return out


def violations(source: str, name: str) -> list[str]:
    found = []
    for line_no, code in logical_lines(source):
        if code.startswith(("import ", "from ")):
            continue
        found.extend(
            f"{name}:{line_no}: {label}: {code}" for label, pat in PATTERNS.items() if pat.search(code)
        )
    return found


@pytest.mark.parametrize(
    "snippet",
    [
        "n = cdiv(tokens, bs)",
        "n = reservation.cdiv(\n    tokens + lookahead, spec.block_size\n)",
        "def cdiv(a, b):\n    return a",
        "blocks = (num_tokens + block_size - 1) // block_size",
        "blocks = (seq_lens[i] + self.block_size - 1) // self.block_size",
        "blocks = (n - 1) // bs + 1",
        "blocks = -(-n // bs)",
        "blocks = -(-(n + k) // bs)",
        "blocks = math.ceil(n / block_size)",
        "blocks = int(math.ceil(tokens / spec.block_size))",
    ],
)
def test_scanner_catches_ceiling_division(snippet):
    assert violations(snippet, "bad.py"), snippet


@pytest.mark.parametrize(
    "snippet",
    [
        "from warmcap.core.reservation import cdiv, reserved_blocks",
        "column = pos // block_size",
        "slot = table[row, pos // bs] * bs + pos % bs",
        "half = (n - 1) // 2",
        "# blocks = cdiv(n, bs) is computed by the rule",
        'doc = "cdiv(min(c + s + L, M), bs)"',
        "x = -(n // bs)",
        "grid = (rows, triton.cdiv(n, BLOCK))",
        "chunk = tl.cdiv(span, SPLITS) * BLOCK_N",
    ],
)
def test_scanner_allows_floor_division_and_mentions(snippet):
    assert violations(snippet, "ok.py") == []


def test_violation_names_file_and_line():
    found = violations("a = 1\nb = cdiv(a, 4)\n", "src/x.py")
    assert found == ["src/x.py:2: cdiv call: b = cdiv ( a , 4 )"]


def test_no_block_arithmetic_outside_the_reservation_rule():
    found: list[str] = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if path == RULE_FILE:
            continue
        found += violations(path.read_text(), str(path.relative_to(PACKAGE.parent)))
    assert not found, "block counts must come from warmcap.core.reservation:\n" + "\n".join(found)
