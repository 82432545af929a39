"""The digest of warmcap's own source: what caches of work an earlier start did are keyed on.

An edited file is a new digest, with or without a new version, so nothing cached by older code
(graph verdicts, ``graphs/proof/startup_cache.py``; config values, ``models/hf_config.py``) is reused.
"""

from __future__ import annotations

import hashlib
from functools import cache
from pathlib import Path

#: the files that make up the package's behaviour: Python, data, the C kernels' sources and headers
SOURCE_SUFFIXES = (".py", ".json", ".c", ".h")


@cache
def source_digest() -> str:
    """sha256 over the path and bytes of every source and data file of the ``warmcap`` package, the
    C kernels' sources included (``kernels/cpu``: their numbers are verdicts' inputs too)."""
    root = Path(__file__).resolve().parent
    h = hashlib.sha256()
    for path in sorted(p for p in root.rglob("*") if p.suffix in SOURCE_SUFFIXES and p.is_file()):
        h.update(str(path.relative_to(root)).encode())
        h.update(b"\0")
        h.update(path.read_bytes())
        h.update(b"\0")
    return h.hexdigest()
