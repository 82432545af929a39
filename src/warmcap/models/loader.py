"""Load a local HF model directory: config, safetensors weights (single or sharded), tokenizer.

transformers is imported inside the functions that need it: importing it costs seconds, and
``warmcap.models`` must stay cheap to import.
"""

from __future__ import annotations

import inspect
import json
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from warmcap.errors import ModelLoadError
from warmcap.models.registry import model_class

if TYPE_CHECKING:
    from torch import nn

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"


def _model_dir(path: str | Path) -> Path:
    p = Path(path).expanduser()
    if not p.is_dir():
        raise ModelLoadError(
            f"model directory {str(p)!r} does not exist; pass a preset name or a local HF model directory"
        )
    return p


def load_hf_config(path: str | Path) -> Any:
    """The transformers config of the model directory ``path``."""
    p = _model_dir(path)
    config_file = p / "config.json"
    if not config_file.is_file():
        raise ModelLoadError(f"{str(p)!r} has no config.json; point at a Hugging Face model directory")
    try:
        raw = json.loads(config_file.read_text())
    except json.JSONDecodeError as e:
        raise ModelLoadError(f"{str(config_file)!r} is not valid JSON ({e}); re-export the model") from None
    if not raw.get("architectures"):
        raise ModelLoadError(
            f"{str(config_file)!r} has no 'architectures' entry; add e.g. "
            '"architectures": ["LlamaForCausalLM"] naming the model class'
        )
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(str(p), local_files_only=True)
    except (ValueError, KeyError, OSError) as e:
        raise ModelLoadError(f"transformers cannot read {str(config_file)!r}: {e}") from None


def weight_files(path: str | Path) -> list[Path]:
    """The safetensors files of a model directory, in shard order."""
    p = _model_dir(path)
    index = p / INDEX_FILE
    if index.is_file():
        weight_map = json.loads(index.read_text()).get("weight_map", {})
        names = sorted(set(weight_map.values()))
        missing = [n for n in names if not (p / n).is_file()]
        if missing:
            raise ModelLoadError(f"{str(index)!r} names shard(s) {missing} that are not in {str(p)!r}")
        return [p / n for n in names]
    if (p / SINGLE_FILE).is_file():
        return [p / SINGLE_FILE]
    raise ModelLoadError(
        f"{str(p)!r} has neither {SINGLE_FILE} nor {INDEX_FILE}; save the model as safetensors"
    )


def load_model(
    path: str | Path,
    *,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    batch_invariant: bool = False,
) -> nn.Module:
    """Build warmcap's implementation of the directory's architecture and load its weights
    (with batch-invariant linear layers when asked, :mod:`warmcap.models.batch_invariant`)."""
    from safetensors import safe_open

    hf_config = load_hf_config(path)
    cls = model_class(hf_config.architectures[0])
    files = weight_files(path)
    # Parameters are allocated without initialisation: every one is overwritten by the checkpoint.
    with torch.device("meta"):
        model = cls(hf_config, dtype=dtype)
    model.to_empty(device=device)
    model.tie_weights()

    where: dict[str, Path | None] = {"file": None}

    def stream() -> Iterator[tuple[str, torch.Tensor]]:
        for f in files:
            where["file"] = f
            with safe_open(str(f), framework="pt", device="cpu") as handle:
                for name in handle.keys():  # noqa: SIM118 - safe_open is not iterable
                    yield name, handle.get_tensor(name)
        where["file"] = None

    # safe_open's tensors are private copy-on-write maps of the file that only this function holds:
    # a model that can adopt them skips a full copy of the weights (and touching every page twice).
    adopt = {"assign": True} if "assign" in inspect.signature(model.load_weights).parameters else {}
    try:
        model.load_weights(stream(), **adopt)
    except ModelLoadError as e:
        origin = where["file"] if where["file"] is not None else Path(path)
        raise ModelLoadError(f"{origin}: {e}") from None
    if batch_invariant:
        from warmcap.models.batch_invariant import make_batch_invariant

        make_batch_invariant(model)
    return model.eval()


def load_tokenizer(path: str | Path) -> Any:
    """The directory's tokenizer via ``AutoTokenizer`` (local files only)."""
    p = _model_dir(path)
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(p), local_files_only=True)
    except (ValueError, OSError) as e:
        raise ModelLoadError(f"cannot load a tokenizer from {str(p)!r}: {e}") from None
