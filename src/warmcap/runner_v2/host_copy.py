"""The one device-to-host copy of a step: what the scheduler needs back (sampled tokens, accepted
draft counts, the non-finite flag) packed into one pinned buffer, copied without blocking, and
waited for once.

On CUDA each ``.tolist()`` / ``.item()`` / ``bool()`` of a device tensor is a copy that stalls the
host until the GPU has drained its queue; a verify step used to make four. Here the parts are
flattened into one int64 tensor on the device, copied into page-locked memory with
``non_blocking=True``, and an event recorded after the copy is the only wait. On CPU the parts are
host tensors already and come back as they are.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


class PendingCopy:
    """A device-to-host copy started by :meth:`HostCopy.start`; :meth:`wait` returns the host
    tensors (waiting for the copy on CUDA, once)."""

    __slots__ = ("_done", "_parts", "_pinned", "_result")

    def __init__(
        self,
        parts: Sequence[torch.Tensor],
        pinned: torch.Tensor | None = None,
        done: torch.cuda.Event | None = None,
    ) -> None:
        self._parts = parts
        self._pinned = pinned
        self._done = done
        self._result: list[torch.Tensor] | None = None

    @classmethod
    def done(cls, host: list[torch.Tensor]) -> PendingCopy:
        """A copy already made (``host``: what :meth:`HostCopy.fetch` returned)."""
        copy = cls(host)
        copy._result = host
        return copy

    def wait(self) -> list[torch.Tensor]:
        if self._result is not None:
            return self._result
        if self._done is None:
            self._result = list(self._parts)
            return self._result
        self._done.synchronize()
        out, start = [], 0
        assert self._pinned is not None
        for p in self._parts:
            n = p.numel()
            host = self._pinned[start : start + n].view(p.shape)
            out.append(host.to(torch.bool) if p.dtype == torch.bool else host)
            start += n
        self._result = out
        return out


class HostCopy:
    """Device-to-host fetches of small integer outputs through one reusable pinned buffer."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        # Two buffers, used in turn: with one step in flight a step's copy is started before the
        # previous one is read.
        self._pinned: list[torch.Tensor | None] = [None, None]
        self._turn = 0

    def fetch(self, parts: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """Host copies of ``parts`` (integer or bool tensors, any shapes), with one wait.

        NOTE: on CUDA the results are views of the pinned buffer, valid until the next fetch: turn
        them into Python values (``tolist``) before fetching again.
        """
        if self.device.type == "cpu":
            # Host tensors already (``.to("cpu")`` would return each as it is, at a dispatch each).
            return list(parts)
        if self.device.type != "cuda":
            return [p.to("cpu") for p in parts]
        return self.start(parts).wait()

    def start(self, parts: Sequence[torch.Tensor]) -> PendingCopy:
        """Start copying ``parts`` to the host and return at once (async scheduling reads them a
        step later). On CPU the parts are copied now (host tensors a later step may overwrite).

        NOTE: two copies may be in flight (the buffers alternate): a copy must be read before the
        second :meth:`start` or :meth:`fetch` after it reuses its buffer.
        """
        if self.device.type != "cuda":
            return PendingCopy([p.to("cpu", copy=True) for p in parts])
        flat = torch.cat([p.reshape(-1).to(torch.int64) for p in parts])
        pinned = self._buffer(flat.numel())[: flat.numel()]
        pinned.copy_(flat, non_blocking=True)
        done = torch.cuda.Event()
        done.record()
        return PendingCopy(parts, pinned, done)

    def _buffer(self, numel: int) -> torch.Tensor:
        self._turn ^= 1
        buf = self._pinned[self._turn]
        if buf is None or buf.numel() < numel:
            buf = torch.empty(max(numel, 1024), dtype=torch.int64, pin_memory=True)
            self._pinned[self._turn] = buf
        return buf


def to_device(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``host`` on ``device`` without blocking the host: staged through page-locked memory on CUDA
    (a copy from pageable memory waits for the stream)."""
    if device.type != "cuda":
        return host
    return host.pin_memory().to(device, non_blocking=True)
