"""The NIXL connector's worker side: a NIXL agent (UCX) over this engine's KV tensors.

- **P** registers its tensors and answers the side channel with its agent metadata, layout and
  speculative setup. It learns that D has read a request's blocks from the NIXL notification D
  sends once all its READs are done (P's request id), or from a side-channel ``release``; either,
  or the deadline, reports it in ``finished_sending`` so the scheduler frees the blocks.
- **D** fetches P's metadata once per peer, then per request posts READs of P's blocks into its
  own, ``read_chunk_blocks`` blocks each, and reports the request in ``finished_recving`` once every
  READ is done. A failed read (one READ failing, P gone, the timeout) is reported by
  :meth:`get_load_errors` once NIXL has let go of every READ into the request's blocks; the engine
  ends the request with that message.
"""

from __future__ import annotations

import base64
import contextlib
import logging
import threading
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from warmcap import env
from warmcap.core.reservation import blocks_covering
from warmcap.errors import ConfigError
from warmcap.kv_transfer.base import KVConnectorWorker
from warmcap.kv_transfer.layout import (
    LayerRegion,
    check_compatible,
    layer_regions,
    regions_from_json,
    regions_to_json,
)
from warmcap.kv_transfer.nixl_metadata import NixlMetadata, ReadJob
from warmcap.kv_transfer.params import KVTransferError, RemotePrefill
from warmcap.kv_transfer.side_channel import SideChannelServer, ask
from warmcap.kv_transfer.speculation import TransferSpeculation, check_same_speculation

if TYPE_CHECKING:
    import torch

    from warmcap.config import EngineConfig
    from warmcap.core.kv_spec import KVCacheGroup

log = logging.getLogger("warmcap.kv_transfer")


@dataclass(frozen=True, slots=True)
class _Peer:
    engine_id: str
    agent_name: str
    mem_type: str
    regions: dict[str, LayerRegion]


#: test-only fault injection: seconds D sleeps after posting a request's first READ, before the
#: rest (read once at start-up; ``tests/kv_transfer/test_pd_faults.py`` kills P meanwhile)
FAULT_PAUSE_ENV = "WARMCAP_PD_FAULT_PAUSE_AFTER_POST"

#: one remote block of one group (every layer and plane): (local descriptors, remote descriptors)
_Piece = tuple[list[tuple[int, int, int]], list[tuple[int, int, int]]]


def _fault_pause() -> float:
    text = env.read(FAULT_PAUSE_ENV)
    try:
        return max(float(text), 0.0) if text else 0.0
    except ValueError:
        raise ConfigError(
            f"{FAULT_PAUSE_ENV}={text!r} is not a number of seconds: unset it (test-only)"
        ) from None


@dataclass(slots=True)
class _Read:
    """One request's read: its READ transfers (``handles``, those NIXL still holds) and, once one
    failed, why (its blocks are freed only when NIXL has let go of every transfer)."""

    job: ReadJob
    peer: _Peer
    handles: list[Any]
    started: float
    num_bytes: int
    error: str | None = None


@dataclass(slots=True)
class TransferStats:
    """D's completed reads, for benchmarks: how many, their bytes and seconds in flight."""

    num_reads: int = 0
    num_bytes: int = 0
    seconds: float = 0.0


class NixlConnectorWorker(KVConnectorWorker):
    def __init__(
        self,
        config: EngineConfig,
        groups: list[KVCacheGroup],
        *,
        engine_id: str,
        side_channel_timeout: float,
        read_timeout: float,
        read_chunk_blocks: int = 64,
    ) -> None:
        super().__init__(config)
        self.engine_id = engine_id
        self.groups = list(groups)
        self.speculation = TransferSpeculation.of(config, self.groups)
        self.side_channel_timeout = side_channel_timeout
        self.read_timeout = read_timeout
        self.read_chunk_blocks = read_chunk_blocks
        self._fault_pause = _fault_pause()
        self.stats = TransferStats()
        #: P: where D asks for this engine's metadata (set by ``kv_transfer/nixl.py``)
        self.side_channel: SideChannelServer | None = None
        self._agent: Any = None
        self._regions: dict[str, LayerRegion] = {}
        self._mem_type = "DRAM"
        self._described: dict[str, Any] | None = None
        self._peers: dict[tuple[str, int], _Peer] = {}
        self._reads: dict[str, _Read] = {}
        self._errors: dict[str, str] = {}
        # P: kept requests by id -> deadline; confirmations that arrived before their request did
        self._kept: dict[str, float] = {}
        self._confirmed: set[str] = set()
        # NOTE: filled from the side-channel thread, drained by the engine thread.
        self._released: set[str] = set()
        self._lock = threading.Lock()

    # ---- registration and the side channel ----------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        from nixl_cu12._api import nixl_agent, nixl_agent_config

        layer_groups = {layer: g.name for g in self.groups for layer in g.layer_names}
        self._regions = layer_regions(kv_caches, layer_groups, self.groups)
        tensors = list(kv_caches.values())
        self._mem_type = "DRAM" if tensors[0].get_device() < 0 else "VRAM"
        # NOTE: no progress thread: NIXL's spins without pause and would take a core from the model;
        # the engine thread drives transfers when it polls them each step.
        self._agent = nixl_agent(
            self.engine_id, nixl_agent_config(enable_prog_thread=False, backends=["UCX"])
        )
        self._agent.register_memory(tensors)
        self._described = {
            "engine_id": self.engine_id,
            "agent_metadata": base64.b64encode(self._agent.get_agent_metadata()).decode(),
            "mem_type": self._mem_type,
            "layers": regions_to_json(self._regions),
            "speculation": self.speculation.to_json(),
        }

    def answer(self, request: dict[str, Any]) -> dict[str, Any]:
        """The side channel's handler (called from its thread)."""
        op = request.get("op")
        if op == "metadata":
            if self._described is None:
                return {"error": "this engine's KV cache is not registered yet (still starting)"}
            return self._described
        if op == "release":
            # NOTE: by request id alone: a reader with a wrong engine id still lets the holder go.
            with self._lock:
                self._released.add(str(request.get("request_id")))
            return {"ok": True}
        return {"error": f"unknown side-channel op {op!r}: known are 'metadata' and 'release'"}

    # ---- the step -----------------------------------------------------------------------------

    def start_load_kv(self, metadata: NixlMetadata | None) -> None:
        if metadata is None:
            return
        for req_id in metadata.stopped & set(self._reads):
            self._stop_read(self._reads.pop(req_id))
        self._kept.update(metadata.sends)
        for remote in metadata.releases:
            self._release(remote)
        for job in metadata.reads:
            try:
                self._start_read(job)
            except KVTransferError as exc:
                self._fail(job, str(exc))
            except Exception as exc:  # NIXL's own exception types: this read fails, not the step
                remote = job.remote
                self._peers.pop((remote.host, remote.port), None)
                self._fail(
                    job,
                    f"NIXL could not read the prompt KV from {remote.host}:{remote.port} "
                    f"({type(exc).__name__}: {exc}); the prefill instance may have stopped",
                )

    def wait_for_save(self) -> None:
        """Nothing to wait for: P's KV is written by the forward itself, and D reads it later."""

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str], set[str]]:
        return self._finished_sending(), self._finished_recving()

    def get_load_errors(self) -> dict[str, str]:
        errors, self._errors = self._errors, {}
        return errors

    # ---- D: reads -----------------------------------------------------------------------------

    def _peer(self, job: ReadJob) -> _Peer:
        remote = job.remote
        key = (remote.host, remote.port)
        peer = self._peers.get(key)
        if peer is None:
            answer = ask(remote.host, remote.port, {"op": "metadata"}, timeout=self.side_channel_timeout)
            where = f"the prefill instance at {remote.host}:{remote.port}"
            try:
                agent_metadata = base64.b64decode(answer["agent_metadata"])
                regions = regions_from_json(answer["layers"], where)
                theirs = TransferSpeculation.from_json(answer.get("speculation"), where)
                peer = _Peer(str(answer["engine_id"]), "", str(answer["mem_type"]), regions)
            except (KeyError, ValueError) as exc:
                raise KVTransferError(
                    f"{where} sent incomplete metadata ({exc!r}): is it a warmcap server?"
                ) from None
            check_same_speculation(self.speculation, theirs, where)
            check_compatible(self._regions, peer.regions, where)
            if peer.engine_id != remote.engine_id:
                raise KVTransferError(
                    f"remote_engine_id {remote.engine_id!r} does not match the engine at {remote.host}:"
                    f"{remote.port} ({peer.engine_id!r}): pass on the kv_transfer_params the prefill server "
                    "returned, unchanged"
                )
            name = self._agent.add_remote_agent(agent_metadata)
            peer = _Peer(
                peer.engine_id,
                name.decode() if isinstance(name, bytes) else str(name),
                peer.mem_type,
                peer.regions,
            )
            self._peers[key] = peer
        elif peer.engine_id != remote.engine_id:
            raise KVTransferError(
                f"remote_engine_id {remote.engine_id!r} does not match the engine at {remote.host}:"
                f"{remote.port} ({peer.engine_id!r}): pass on the kv_transfer_params the prefill server "
                "returned, unchanged"
            )
        return peer

    def _start_read(self, job: ReadJob) -> None:
        remote = job.remote
        if remote.num_tokens is not None and remote.num_tokens != job.num_prompt_tokens:
            raise KVTransferError(
                f"the prefill instance computed {remote.num_tokens} prompt tokens but this prompt has "
                f"{job.num_prompt_tokens}: send both the same prompt (a chat template applied twice, or a "
                "second BOS, changes it)"
            )
        peer = self._peer(job)
        pieces = self._descriptors(job, peer)
        where = f"{remote.host}:{remote.port}"
        step = self.read_chunk_blocks
        read = _Read(job, peer, [], time.perf_counter(), sum(d[1] for local, _ in pieces for d in local))
        try:
            for first in range(0, len(pieces), step):
                chunk = pieces[first : first + step]
                local = [d for c in chunk for d in c[0]]
                read.handles.append(self._post(peer, local, [d for c in chunk for d in c[1]], where))
                if first == 0 and self._fault_pause and len(pieces) > step:
                    log.warning(
                        "warmcap: %s set: pausing %g s mid-read (test only)",
                        FAULT_PAUSE_ENV,
                        self._fault_pause,
                    )
                    time.sleep(self._fault_pause)
        except KVTransferError as exc:
            self._peers.pop((remote.host, remote.port), None)
            if not read.handles:
                raise
            # NOTE: earlier chunks may still be writing into this request's blocks: the request
            # fails once NIXL lets go of them (``_finished_recving``).
            read.error = str(exc)
        self._reads[job.request_id] = read

    def _post(
        self, peer: _Peer, local: list[tuple[int, int, int]], far: list[tuple[int, int, int]], where: str
    ) -> Any:
        """Start one READ of ``far`` (P's blocks at ``where``) into ``local``; its handle."""
        agent = self._agent
        try:
            handle = agent.initialize_xfer(
                "READ",
                agent.get_xfer_descs(local, self._mem_type),
                agent.get_xfer_descs(far, peer.mem_type),
                peer.agent_name,
            )
            state = agent.transfer(handle)
        except Exception as exc:  # NIXL raises its own exception types per status
            raise KVTransferError(
                f"NIXL could not start reading the prompt KV from {where} ({type(exc).__name__}: {exc}); "
                "the prefill instance may have stopped"
            ) from None
        if state == "ERR":
            agent.release_xfer_handle(handle)
            raise KVTransferError(
                f"NIXL failed to read the prompt KV from {where}: the prefill instance may have stopped"
            )
        return handle

    def _descriptors(self, job: ReadJob, peer: _Peer) -> list[_Piece]:
        """(local, remote) descriptors, paired by position, per block to read of every group."""
        remote_ids = job.remote.block_ids
        if set(remote_ids) == {""}:
            targets = [g.name for g in self.groups if not g.is_drafter]
            if len(targets) != 1:
                raise KVTransferError(
                    f"remote_block_ids is one flat list but this model has KV groups {targets}: send "
                    "{group: [ids]} as a warmcap prefill server returns it"
                )
            remote_ids = {targets[0]: remote_ids[""]}
        missing = [g.name for g in self.groups if g.name not in remote_ids]
        if missing:
            # NOTE: P's setup matched at the handshake (``kv_transfer/speculation.py``), so its
            # answer names every group; a group left out means the parameters were changed.
            raise KVTransferError(
                f"kv_transfer_params name no blocks for this engine's KV groups {missing} (they name "
                f"{sorted(remote_ids)}): pass on the kv_transfer_params the prefill server returned, unchanged"
            )
        pieces: list[_Piece] = []
        for group in self.groups:
            theirs = remote_ids[group.name]
            bs = group.spec.block_size
            mine = job.block_ids.get(group.name, [])
            num_loaded = job.num_local_tokens + job.num_external_tokens
            need = blocks_covering(num_loaded, bs)
            if len(theirs) < need or len(theirs) > blocks_covering(job.num_prompt_tokens, bs) + len(mine):
                raise KVTransferError(
                    f"remote_block_ids[{group.name!r}] has {len(theirs)} blocks, but a {job.num_prompt_tokens}-token "
                    f"prompt needs {blocks_covering(job.num_prompt_tokens, bs)} of {bs} tokens: the block ids do not belong "
                    "to this prompt; send both servers the same prompt and P's kv_transfer_params unchanged"
                )
            layers = [layer for layer in group.layer_names if layer in self._regions]
            for j in range(job.num_local_tokens // bs, need):
                if mine[j] == 0:
                    continue  # a sliding window's block this request no longer needs
                local, far = [], []
                for layer in layers:
                    region, theirs_region = self._regions[layer], peer.regions.get(layer)
                    if theirs_region is None or not 0 < theirs[j] < theirs_region.num_blocks:
                        raise KVTransferError(
                            f"the prefill instance has no block {theirs[j]} of layer {layer}: its "
                            "remote_block_ids do not match its KV cache"
                        )
                    local += region.block_descs(mine[j])
                    far += theirs_region.block_descs(theirs[j])
                if local:
                    pieces.append((local, far))
        if not pieces:
            raise KVTransferError(
                f"kv_transfer_params name no KV group of this model (sent {sorted(remote_ids)}, here "
                f"{[g.name for g in self.groups]}): the prefill server serves another model"
            )
        return pieces

    def _finished_recving(self) -> set[str]:
        done = set()
        for req_id, read in list(self._reads.items()):
            remote = read.job.remote
            where = f"{remote.host}:{remote.port}"
            if read.error is None:
                states = self._states(read)
                if isinstance(states, str):
                    read.error = f"NIXL failed to read the prompt KV from {where} ({states}): the prefill instance may have stopped"
                elif "ERR" in states:
                    read.error = f"NIXL failed to read the prompt KV from {where}: the prefill instance may have stopped"
                elif all(state == "DONE" for state in states):
                    self._release_handles(read)
                    del self._reads[req_id]
                    self._confirm(read)
                    done.add(req_id)
                    continue
                elif time.perf_counter() - read.started >= self.read_timeout:
                    read.error = f"reading the prompt KV from {where} took over {self.read_timeout:g} s"
                else:
                    continue
                self._peers.pop((remote.host, remote.port), None)
            # A failed read: its blocks are freed once NIXL has let go of every transfer into them.
            if self._release_handles(read):
                del self._reads[req_id]
                self._fail(read.job, read.error)
        return done

    def _states(self, read: _Read) -> list[str] | str:
        """Each READ's state ("DONE", "PROC", "ERR"), or why NIXL could not say.

        NOTE: NIXL reports most failures as "ERR", but its transfer-state call may also raise (a
        peer gone mid-transfer): that fails this read, never the engine step and its neighbours.
        """
        try:
            return [self._agent.check_xfer_state(h) for h in read.handles]
        except Exception as exc:  # NIXL raises its own exception types per status
            return f"{type(exc).__name__}: {exc}"

    def _confirm(self, read: _Read) -> None:
        """Every chunk arrived: tell P it may free the blocks (a NIXL notification carrying P's
        request id; the side channel's ``release`` when that cannot be sent)."""
        self.stats.num_reads += 1
        self.stats.num_bytes += read.num_bytes
        self.stats.seconds += time.perf_counter() - read.started
        remote = read.job.remote
        try:
            self._agent.send_notif(read.peer.agent_name, remote.request_id.encode())
        except Exception:  # NIXL raises its own exception types per status; P's deadline is the last resort
            self._release(remote)

    def _release_handles(self, read: _Read) -> bool:
        """Release every transfer NIXL lets go of; True when none is left.

        NOTE: a transfer still in flight cannot be released; it stays in ``read.handles`` and is
        tried again next step, so the blocks it writes are never handed to another request early.
        """
        kept = []
        for handle in read.handles:
            try:
                self._agent.release_xfer_handle(handle)
            except Exception:  # still in flight
                kept.append(handle)
        read.handles = kept
        return not kept

    def _stop_read(self, read: _Read) -> None:
        """A request aborted mid-read: wait for NIXL to finish with its blocks before they are reused."""
        deadline = time.perf_counter() + self.read_timeout
        while not self._release_handles(read) and time.perf_counter() < deadline:
            time.sleep(0.001)
        self._release(read.job.remote)

    def _fail(self, job: ReadJob, message: str) -> None:
        self._errors[job.request_id] = message
        log.warning("warmcap: request %s: %s", job.request_id, message)
        self._release(job.remote)

    def _release(self, remote: RemotePrefill) -> None:
        """Tell P that its blocks for ``remote`` will not be read (best effort: else its deadline frees them)."""
        with contextlib.suppress(KVTransferError):
            ask(
                remote.host,
                remote.port,
                {"op": "release", "request_id": remote.request_id},
                timeout=self.side_channel_timeout,
            )

    # ---- P: confirmations ---------------------------------------------------------------------

    def _finished_sending(self) -> set[str]:
        if self._agent is None:
            return set()
        confirmed = self._confirmed
        try:
            notifs = self._agent.get_new_notifs()
        except Exception as exc:  # NIXL's own types; the side channel's releases and deadlines remain
            log.warning("warmcap: NIXL notifications unreadable this step (%s: %s)", type(exc).__name__, exc)
            notifs = {}
        for messages in notifs.values():
            confirmed.update(m.decode(errors="replace") for m in messages)
        with self._lock:
            confirmed |= self._released
            self._released = set()
        done = confirmed & set(self._kept)
        now = time.monotonic()
        expired = {r for r, deadline in self._kept.items() if deadline <= now} - done
        for req_id in expired:
            log.warning(
                "warmcap: request %s: no decode instance read its KV in time; its blocks are freed", req_id
            )
        done |= expired
        for req_id in done:
            del self._kept[req_id]
        # NOTE: a confirmation may arrive before the step that tells this side about the request.
        self._confirmed = confirmed - done
        return done
