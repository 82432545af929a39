"""Headless Chromium (Debian's ``chromium``) as a test instrument: load a page from disk, let its
script run, keep the DOM it ends with, every console message and a screenshot."""

from __future__ import annotations

import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

import pytest

CHROMIUM = Path("/usr/bin/chromium")
FLAGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--hide-scrollbars",
    "--enable-logging=stderr",
    "--v=0",
    # the page's script runs before the DOM is dumped and the screenshot taken
    "--virtual-time-budget=5000",
]


@dataclass(frozen=True)
class Loaded:
    dom: str
    console: list[str]
    screenshot: Path


def require_chromium() -> None:
    """Fail (never skip) where the browser is missing: the page tests are part of the suite."""
    if not CHROMIUM.is_file():
        pytest.fail(
            f"{CHROMIUM} is missing: the browser tests need Debian's chromium package "
            "(`bash scripts/install.sh --test` installs it, or `apt-get install chromium`)"
        )


def load(page: Path, screenshot: Path, *, width: int = 1400, height: int = 1800) -> Loaded:
    require_chromium()
    with tempfile.TemporaryDirectory(prefix="chromium-profile-") as profile:
        run = subprocess.run(
            [
                str(CHROMIUM),
                *FLAGS,
                f"--user-data-dir={profile}",
                f"--window-size={width},{height}",
                f"--screenshot={screenshot}",
                "--dump-dom",
                page.resolve().as_uri(),
            ],
            capture_output=True,
            text=True,
            timeout=120,
        )
    assert run.returncode == 0, run.stderr[-2000:]
    console = [line for line in run.stderr.splitlines() if ":CONSOLE" in line]
    return Loaded(run.stdout, console, screenshot)
