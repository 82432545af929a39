"""A model's transformers config as plain values, and a cache of it across starts.

warmcap reads a checkpoint's config through ``AutoConfig`` (its defaults, its renames, its
``rope_parameters`` standardisation), but importing a config class costs a start ~1.5 s: with
transformers 5 it pulls ``torch.distributed.tensor`` and sympy in through ``utils.type_validators``,
for a few dozen numbers. So the config warmcap hands around is an :class:`HFConfig`: every public,
non-callable attribute of what ``AutoConfig`` returned (properties and class attributes included,
``attribute_map`` renames honoured), as plain values. Cold and warm starts get the same type.

The values are cached as JSON in the warmcap cache (``configs/`` under
:func:`~warmcap.paths.cache_dir`, beside the converted models and the compiled kernels),
keyed by the model directory, the bytes of ``config.json``, the installed transformers version and
warmcap's own source digest: a later start reads them back without importing transformers for the
config. A config holding anything but JSON values, tuples
and torch dtypes (a nested sub-config, say) is returned as ``AutoConfig`` gave it, uncached.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import warnings
from importlib import metadata
from pathlib import Path
from typing import Any

import torch

from warmcap.paths import cache_dir
from warmcap.source import source_digest

log = logging.getLogger("warmcap.models")

#: bumped when the cached form changes; other versions are ignored and rewritten
CACHE_VERSION = 1
#: the entry naming attributes of the original config that are not plain values (not carried)
SKIPPED = "_warmcap_not_carried"


class HFConfig:
    """A transformers config as attributes (module docstring). Reads like the config it was taken
    from; ``attribute_map`` renames resolve as transformers resolves them."""

    def __init__(self, values: dict[str, Any]) -> None:
        self.__dict__.update(values)

    def __getattr__(self, name: str) -> Any:
        # Only reached for names not set: a transformers rename (``attribute_map``) or nothing.
        renames = self.__dict__.get("attribute_map") or {}
        if name in renames:
            return getattr(self, renames[name])
        if name in self.__dict__.get(SKIPPED, ()):
            raise AttributeError(
                f"the model config's {name!r} is not a plain value, so warmcap's HFConfig does not carry it"
            )
        raise AttributeError(f"{type(self).__name__} has no attribute {name!r}")

    def to_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, HFConfig) and other.__dict__ == self.__dict__

    def __repr__(self) -> str:
        return f"HFConfig({self.__dict__.get('model_type', '?')}, {len(self.__dict__)} values)"


def _encode(value: Any) -> Any:
    """JSON form of one config value; TypeError for what it cannot carry."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, torch.dtype):
        return {"__dtype__": str(value).removeprefix("torch.")}
    if isinstance(value, tuple):
        return {"__tuple__": [_encode(v) for v in value]}
    if isinstance(value, (set, frozenset)) and all(isinstance(v, (int, str)) for v in value):
        return {"__set__": [_encode(v) for v in sorted(value, key=repr)]}
    if isinstance(value, list):
        return [_encode(v) for v in value]
    if isinstance(value, dict) and all(isinstance(k, str) for k in value):
        return {k: _encode(v) for k, v in value.items()}
    if isinstance(value, dict) and all(isinstance(k, int) and not isinstance(k, bool) for k in value):
        return {"__intdict__": [[k, _encode(v)] for k, v in value.items()]}
    raise TypeError(f"{type(value).__name__} is not a plain config value")


def _decode(value: Any) -> Any:
    if isinstance(value, list):
        return [_decode(v) for v in value]
    if isinstance(value, dict):
        if set(value) == {"__dtype__"}:
            dtype = getattr(torch, value["__dtype__"])
            if not isinstance(dtype, torch.dtype):
                raise TypeError(f"{value['__dtype__']!r} is not a torch dtype")
            return dtype
        if set(value) == {"__tuple__"}:
            return tuple(_decode(v) for v in value["__tuple__"])
        if set(value) == {"__set__"}:
            return set(value["__set__"])
        if set(value) == {"__intdict__"}:
            return {int(k): _decode(v) for k, v in value["__intdict__"]}
        return {k: _decode(v) for k, v in value.items()}
    return value


def plain_values(config: Any) -> dict[str, Any] | None:
    """Every public, non-callable attribute of ``config`` in JSON form, or None when one holds a
    nested config (then the config is used as it is).

    Other values that are not plain data (transformers' own helper views, e.g. ``per_layer_config``)
    are left out and named in ``SKIPPED``: reading one from the :class:`HFConfig` raises an
    AttributeError that says so, never a silent default.
    """
    quiet = logging.getLogger("transformers")
    level = quiet.level
    with warnings.catch_warnings():
        # Reading deprecated aliases (``torch_dtype``) warns, through warnings or transformers' own
        # logger; they are read on purpose.
        warnings.simplefilter("ignore")
        quiet.setLevel(logging.ERROR)
        try:
            return _plain_values(config)
        finally:
            quiet.setLevel(level)


def _plain_values(config: Any) -> dict[str, Any] | None:
    values: dict[str, Any] = {}
    skipped: list[str] = []
    for name in dir(config):
        if name.startswith("__"):
            continue
        try:
            value = getattr(config, name)
        except Exception:  # a property that cannot answer is simply not copied
            continue
        if callable(value) and not isinstance(value, torch.dtype):
            continue
        if hasattr(value, "to_dict") and hasattr(value, "model_type"):
            return None
        try:
            values[name] = _encode(value)
        except TypeError:
            skipped.append(name)
    values[SKIPPED] = skipped
    return values


def _key(config_bytes: bytes) -> str:
    """``config_bytes``: the config's identity (its directory and ``config.json`` bytes)."""
    h = hashlib.sha256()
    for part in (config_bytes, metadata.version("transformers").encode(), source_digest().encode()):
        h.update(hashlib.sha256(part).digest())
    return h.hexdigest()[:32]


def _cache_file(config_bytes: bytes) -> Path:
    return cache_dir() / "configs" / f"{_key(config_bytes)}.json"


def cached_config(config_bytes: bytes) -> HFConfig | None:
    """The cached :class:`HFConfig` for this ``config.json`` content, or None (absent, another
    version, or unreadable: warned, and rewritten by the next :func:`store_config`)."""
    path = _cache_file(config_bytes)
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as e:
        log.warning("config cache entry %s cannot be read (%s): ignored, it will be rebuilt", path, e)
        return None
    try:
        if data["version"] != CACHE_VERSION:
            return None
        return from_values(data["values"])
    except (KeyError, TypeError, AttributeError, ValueError) as e:
        log.warning("config cache entry %s is corrupt (%s): ignored, it will be rebuilt", path, e)
        return None


def store_config(config_bytes: bytes, values: dict[str, Any]) -> None:
    """Write the cache entry atomically; a failure is warned about, never raised."""
    path = _cache_file(config_bytes)
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp.write_text(json.dumps({"version": CACHE_VERSION, "values": values}))
        os.replace(tmp, path)
    except OSError as e:
        log.warning(
            "config cache %s could not be written (%s): the next start reads config.json again", tmp, e
        )
        with contextlib.suppress(OSError):
            tmp.unlink(missing_ok=True)


def from_values(values: dict[str, Any]) -> HFConfig:
    """The :class:`HFConfig` of values in the JSON form :func:`plain_values` gives."""
    return HFConfig({k: _decode(v) for k, v in values.items()})
