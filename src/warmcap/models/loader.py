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
from safetensors import SafetensorError

from warmcap.config import KernelConfig
from warmcap.contracts.parallel import parallel_state
from warmcap.errors import ConfigError, ModelLoadError
from warmcap.models.decoder import check_tensor_parallel
from warmcap.models.layers import Shard, checkpoint_aliases, checkpoint_shards
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
    """The transformers config of the model directory ``path``, as plain values
    (:class:`~warmcap.models.hf_config.HFConfig`, cached across starts) wherever it has only those."""
    p = _model_dir(path)
    config_file = p / "config.json"
    if not config_file.is_file():
        raise ModelLoadError(f"{str(p)!r} has no config.json; point at a Hugging Face model directory")
    config_bytes = config_file.read_bytes()
    try:
        raw = json.loads(config_bytes.decode("utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ModelLoadError(
            f"{str(config_file)!r} is not valid JSON ({e}); re-export the model{_rebuild_hint(p)}"
        ) from None
    if not isinstance(raw, dict):
        raise ModelLoadError(
            f"{str(config_file)!r} holds a JSON {type(raw).__name__}, not an object of config fields; "
            f"re-export the model{_rebuild_hint(p)}"
        )
    if not raw.get("architectures"):
        raise ModelLoadError(
            f"{str(config_file)!r} has no 'architectures' entry; add e.g. "
            '"architectures": ["LlamaForCausalLM"] naming the model class'
        )
    from warmcap.models import hf_config

    # The directory is part of the key: the config records where it was read from.
    key = str(p.resolve()).encode() + b"\0" + config_bytes
    cached = hf_config.cached_config(key)
    if cached is not None:
        return cached
    from transformers import AutoConfig

    try:
        config = AutoConfig.from_pretrained(str(p), local_files_only=True)
    except (ValueError, KeyError, OSError) as e:
        raise ModelLoadError(f"transformers cannot read {str(config_file)!r}: {e}") from None
    values = hf_config.plain_values(config)
    if values is None:
        return config
    hf_config.store_config(key, values)
    return hf_config.from_values(values)


def weight_files(path: str | Path) -> list[Path]:
    """The safetensors files of a model directory, in shard order."""
    p = _model_dir(path)
    index = p / INDEX_FILE
    if index.is_file():
        try:
            data = json.loads(index.read_bytes().decode("utf-8"))
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise ModelLoadError(
                f"{str(index)!r} is not valid JSON ({e}); re-save the sharded checkpoint{_rebuild_hint(p)}"
            ) from None
        weight_map = data.get("weight_map") if isinstance(data, dict) else None
        if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
            raise ModelLoadError(
                f"{str(index)!r} has no 'weight_map' object of weight name -> shard file; "
                f"re-save the sharded checkpoint{_rebuild_hint(p)}"
            )
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
    kernels: KernelConfig | None = None,
) -> nn.Module:
    """Build warmcap's implementation of the directory's architecture and load its weights
    (with batch-invariant linear layers when asked, :mod:`warmcap.models.batch_invariant`; else
    float32 CPU linears are prepacked for oneDNN, :mod:`warmcap.models.packed_linear`).
    ``kernels``: the engine config's kernel switches (None: their defaults) — the compiled CPU
    GEMM and layer ops, or the fused Triton ops on CUDA.

    Under tensor parallelism (:mod:`warmcap.contracts.parallel`) the model is this rank's shard and
    only this rank's slice of each sharded tensor is read from the files (``get_slice``).
    """
    from safetensors import safe_open

    hf_config = load_hf_config(path)
    cls = model_class(hf_config.architectures[0])
    # Refused before any layer is built, so the error names the family, not a layer's arithmetic.
    check_tensor_parallel(cls)
    if batch_invariant and parallel_state().is_parallel:
        raise ConfigError(
            "batch_invariant is not supported with tensor parallelism (the sharded linears are not "
            "tiled and the all-reduce order is fixed per shape, not per row); turn one of them off"
        )
    files = weight_files(path)
    # Parameters are allocated without initialisation: every one is overwritten by the checkpoint.
    with torch.device("meta"):
        model = cls(hf_config, dtype=dtype)
    model.to_empty(device=device)
    model.tie_weights()
    shards = checkpoint_shards(model)
    aliases = checkpoint_aliases(model)

    where: dict[str, Path | None] = {"file": None}

    def stream() -> Iterator[tuple[str, torch.Tensor]]:
        for f in files:
            where["file"] = f
            with safe_open(str(f), framework="pt", device="cpu") as handle:
                for name in handle.keys():  # noqa: SIM118 - safe_open is not iterable
                    shard = shards.get(name)
                    if shard is None:
                        yield name, handle.get_tensor(name)
                    else:
                        yield name, _read_shard(handle.get_slice(name), shard)
                    for alias in aliases.get(name, ()):
                        yield alias, _read_shard(handle.get_slice(name), shards[alias])
        where["file"] = None

    # safe_open's tensors are private copy-on-write maps of the file that only this function holds:
    # a model that can adopt them skips a full copy of the weights (and touching every page twice).
    # Every built-in family can (DecoderForCausalLM.load_weights); a plugin's class may not.
    adopt = {"assign": True} if "assign" in inspect.signature(model.load_weights).parameters else {}
    try:
        model.load_weights(stream(), **adopt)
    except ModelLoadError as e:
        origin = where["file"] if where["file"] is not None else Path(path)
        raise ModelLoadError(f"{origin}: {e}") from None
    except SafetensorError as e:
        # A truncated or garbage file fails in safe_open or when a tensor is read.
        raise ModelLoadError(
            f"{where['file']} is not a readable safetensors file ({e}); "
            f"re-download or re-save the weights{_rebuild_hint(Path(path))}"
        ) from None
    if batch_invariant:
        from warmcap.models.batch_invariant import make_batch_invariant

        make_batch_invariant(model)
    else:
        from warmcap.models.layers import attach_cpu_layer_ops
        from warmcap.models.packed_linear import prepack_linears

        kernels = kernels or KernelConfig()
        prepack_linears(model, gemm_mode=kernels.cpu_gemm)
        for module in model.modules():
            # models/llama.py KVOffload: on once the packed GEMM it needs is there
            settle = getattr(module, "settle_kv_offload", None)
            if settle is not None:
                settle(kernels.tp_balance)
        if torch.device(device).type == "cpu":
            # Compiled for and checked against CPU tensors only: a GPU model never builds them.
            attach_cpu_layer_ops(model, kernels.cpu_layer_ops)
        else:
            from warmcap.models.fused_ops import attach_fused_ops, fused_ops_for

            # The capability check: the fused Triton ops on CUDA (models/fused_ops.py).
            fused = fused_ops_for(device, kernels.fused_ops)
            if fused is not None:
                attach_fused_ops(model, fused)
    return model.eval()


def _read_shard(tensor_slice: Any, shard: Shard) -> torch.Tensor:
    """Read only ``shard``'s rows/columns of a safetensors tensor (``safe_open(...).get_slice``)."""
    index = (slice(None),) * shard.dim + (slice(shard.start, shard.start + shard.size),)
    return tensor_slice[index]


def _rebuild_hint(model_dir: Path) -> str:
    """For a preset's cache entry: which folder to delete, or how to rebuild it."""
    from warmcap.models.presets import rebuild_hint

    return rebuild_hint(model_dir)


def load_tokenizer(path: str | Path, config: Any = None) -> Any:
    """The directory's tokenizer via ``AutoTokenizer`` (local files only).

    ``config``: the model's config as :func:`load_hf_config` gave it, which saves ``AutoTokenizer``
    reading it again (and importing its class: over a second). It is passed only where
    ``AutoTokenizer`` decides by ``tokenizer_config.json`` alone: that file names a
    ``tokenizer_class`` and no ``auto_map``; then the config is read for its ``model_type``,
    ``model_name``, ``_name_or_path`` and ``tokenizer_class`` values, which an
    :class:`~warmcap.models.hf_config.HFConfig` carries, never for its class.
    """
    p = _model_dir(path)
    from transformers import AutoTokenizer

    extra = {"config": config} if config is not None and _names_its_class(p) else {}
    try:
        return AutoTokenizer.from_pretrained(str(p), local_files_only=True, **extra)
    except (ValueError, OSError) as e:
        raise ModelLoadError(f"cannot load a tokenizer from {str(p)!r}: {e}") from None


def _names_its_class(model_dir: Path) -> bool:
    """``tokenizer_config.json`` names a ``tokenizer_class`` and has no ``auto_map`` (remote code)."""
    try:
        data = json.loads((model_dir / "tokenizer_config.json").read_bytes().decode("utf-8"))
    except (OSError, ValueError):
        return False
    return isinstance(data, dict) and isinstance(data.get("tokenizer_class"), str) and "auto_map" not in data
