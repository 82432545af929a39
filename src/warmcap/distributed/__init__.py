"""Tensor parallelism over torch.distributed: where the ranks meet (:mod:`.rendezvous`) and
running a function on every rank in its own process with failures named by rank (:mod:`.spawn`).

The facts model code reads (rank, world size) live below the models, in
:mod:`warmcap.contracts.parallel`; this package sits above them and starts the ranks.
"""

from __future__ import annotations

from warmcap.distributed.rendezvous import Rendezvous, free_port, join_group, leave_group, rendezvous_for
from warmcap.distributed.spawn import RankFailedError, run_on_ranks

__all__ = [
    "RankFailedError",
    "Rendezvous",
    "free_port",
    "join_group",
    "leave_group",
    "rendezvous_for",
    "run_on_ranks",
]
