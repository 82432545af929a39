"""The model dtype names of the config (:data:`warmcap.config.DTYPES`) as torch dtypes.

Kept out of ``config.py`` so that reading and validating a config never imports torch; every module
that builds or runs a model (the runner, the engine, the tensor-parallel workers, the KV layout's meta
model) takes the table from here.
"""

from __future__ import annotations

import torch

from warmcap.config import DTYPES

#: config dtype name -> torch dtype; one entry per name the config accepts, by construction
TORCH_DTYPES: dict[str, torch.dtype] = {name: getattr(torch, name) for name in DTYPES}
