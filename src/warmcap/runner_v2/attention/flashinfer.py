"""FlashInfer paged attention (CUDA only; imported lazily by the selector, never on a CPU run).

Pure decode steps (``max_query_len`` 1, known from host sizes) go through a
``BatchDecodeWithPagedKVCacheWrapper``; every other step (mixed prefill / decode / spec-verify rows,
draft prefill) through a ``BatchPrefillWithPagedKVCacheWrapper``: one wrapper per (metadata, layer
shape, window). K/V are written by the Triton write kernel
(:func:`~warmcap.kernels.triton.paged_attention.write_kv_triton`, one launch; PAD slots write
nothing); the cache halves ``kv_cache[0]`` / ``kv_cache[1]`` are passed as an NHD ``(k, v)`` tuple.

Graphs: planning needs host syncs, so it cannot happen inside a capture. The runner's eager pass over
a shape plans its wrappers; :meth:`FlashInferAttention.prepare_for_capture` (same metadata objects)
remakes them in CUDA-graph mode (``use_cuda_graph=True`` over fixed index buffers sized from the
graph's rows and block-table width) and plans them; wrappers created afterwards are graph-ready from
the start. :meth:`prepare_for_replay` re-plans them from the refilled static metadata's host copies
(``query_start_loc_cpu`` / ``seq_lens_cpu``) before each replay, outside the graph.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from warmcap.contracts.backends import AttentionBackend
from warmcap.contracts.metadata import AttentionMetadata
from warmcap.core.reservation import blocks_covering
from warmcap.errors import ConfigError
from warmcap.kernels.triton.paged_attention import write_kv_triton
from warmcap.runner_v2.attention.torch_paged import MetaStamp, token_rows

WORKSPACE_BYTES = 128 * 1024 * 1024


def _import_flashinfer() -> Any:
    try:
        import flashinfer
    except ImportError as e:
        raise ConfigError(
            f"the flashinfer backend needs the flashinfer package ({e}); install warmcap[gpu] "
            "or use backend 'torch'"
        ) from None
    return flashinfer


@dataclass(slots=True)
class _Planned:
    wrapper: Any
    meta: AttentionMetadata
    stamp: MetaStamp | None
    token_valid: torch.Tensor
    shape: tuple[int, int, int, float, int, torch.dtype, torch.dtype]
    #: a decode wrapper (one query per row) rather than a prefill one
    decode: bool = False


def is_decode(meta: AttentionMetadata) -> bool:
    """Whether a step takes the decode wrapper: one query per row and one row per token, from
    host-static sizes (a uniform decode graph's ``max_query_len`` is 1; a mixed graph's is its token
    count)."""
    return meta.max_query_len == 1 and meta.num_tokens == meta.num_reqs


class FlashInferAttention(AttentionBackend):
    """Paged attention through FlashInfer's batch decode and prefill wrappers (NHD layout)."""

    name = "flashinfer"
    supports_full_graph = True
    accepts_written_kv = True

    def __init__(self, device: torch.device) -> None:
        if device.type != "cuda" or not torch.cuda.is_available():
            raise ConfigError(f"FlashInfer needs a CUDA device; got {device}")
        self._fi = _import_flashinfer()
        self.device = device
        self._workspace = torch.zeros(WORKSPACE_BYTES, dtype=torch.uint8, device=device)
        self._planned: dict[tuple[int, int | None, int, int, int], _Planned] = {}
        self._graph_mode = False

    def _page_table(
        self, meta: AttentionMetadata
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """qo_indptr, kv page indptr, kv page indices, last page lengths (int32)."""
        r, bs = meta.num_reqs, meta.block_size
        qsl = meta.query_start_loc_cpu if meta.query_start_loc_cpu is not None else meta.query_start_loc.cpu()
        seq = meta.seq_lens_cpu if meta.seq_lens_cpu is not None else meta.seq_lens.cpu()
        qsl, seq = qsl[: r + 1].to(torch.int32), seq[:r].to(torch.int32)
        pages = blocks_covering(seq, bs)
        kv_indptr = torch.zeros(r + 1, dtype=torch.int32)
        kv_indptr[1:] = torch.cumsum(pages, 0)
        cols = torch.arange(meta.block_table.shape[1])
        used = (cols[None, :] < pages[:, None]).to(meta.block_table.device)
        indices = meta.block_table[:r][used].to(torch.int32)
        last = torch.where(seq > 0, seq - (pages - 1) * bs, 0).to(torch.int32)
        return qsl, kv_indptr, indices, last

    def _new_wrapper(self, meta: AttentionMetadata, *, decode: bool, group: int) -> Any:
        r, width = meta.num_reqs, meta.block_table.shape[1]

        def buf(n: int) -> torch.Tensor:
            return torch.zeros(n, dtype=torch.int32, device=self.device)

        if decode:
            # Tensor cores pay for wide GQA groups (several query heads read each KV head).
            cores = group >= 4
            if not self._graph_mode:
                return self._fi.BatchDecodeWithPagedKVCacheWrapper(
                    self._workspace, "NHD", use_tensor_cores=cores
                )
            return self._fi.BatchDecodeWithPagedKVCacheWrapper(
                self._workspace,
                "NHD",
                use_cuda_graph=True,
                use_tensor_cores=cores,
                paged_kv_indptr_buffer=buf(r + 1),
                paged_kv_indices_buffer=buf(r * width),
                paged_kv_last_page_len_buffer=buf(r),
            )
        if not self._graph_mode:
            return self._fi.BatchPrefillWithPagedKVCacheWrapper(self._workspace, "NHD")
        return self._fi.BatchPrefillWithPagedKVCacheWrapper(
            self._workspace,
            "NHD",
            use_cuda_graph=True,
            qo_indptr_buf=buf(r + 1),
            paged_kv_indptr_buf=buf(r + 1),
            paged_kv_indices_buf=buf(r * width),
            paged_kv_last_page_len_buf=buf(r),
        )

    def _plan(self, planned: _Planned, meta: AttentionMetadata) -> None:
        hq, hkv, d, scale, window, q_dtype, kv_dtype = planned.shape
        qo, kv_indptr, indices, last = self._page_table(meta)
        # FlashInfer's window_left counts the keys left of the query: our window minus one.
        window_left = window - 1 if window else -1
        if planned.decode:
            planned.wrapper.plan(
                kv_indptr.to(self.device),
                indices.to(self.device),
                last.to(self.device),
                hq,
                hkv,
                d,
                meta.block_size,
                pos_encoding_mode="NONE",
                window_left=window_left,
                q_data_type=q_dtype,
                kv_data_type=kv_dtype,
                sm_scale=scale,
            )
        else:
            planned.wrapper.plan(
                qo.to(self.device),
                kv_indptr.to(self.device),
                indices.to(self.device),
                last.to(self.device),
                hq,
                hkv,
                d,
                meta.block_size,
                causal=True,
                sm_scale=scale,
                window_left=window_left,
                q_data_type=q_dtype,
                kv_data_type=kv_dtype,
            )
        planned.meta, planned.stamp = meta, MetaStamp.of(meta)
        planned.token_valid = token_rows(meta, meta.num_tokens)[2][:, None, None]

    def prepare_for_capture(self, metas: dict[str, AttentionMetadata]) -> None:
        # Wrappers planned by the eager pass over these metadata objects are remade over fixed
        # buffers (use_cuda_graph) and planned now: planning cannot happen inside the capture.
        self._graph_mode = True
        current = {id(m) for m in metas.values()}
        for planned in self._planned.values():
            if id(planned.meta) in current:
                group = planned.shape[0] // planned.shape[1]
                planned.wrapper = self._new_wrapper(planned.meta, decode=planned.decode, group=group)
                self._plan(planned, planned.meta)

    def prepare_for_replay(self, metas: dict[str, AttentionMetadata]) -> None:
        current = {id(m) for m in metas.values()}
        for planned in self._planned.values():
            if id(planned.meta) in current:
                self._plan(planned, planned.meta)

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
        *,
        scale: float,
        sliding_window: int | None = None,
        kv_written: bool = False,
    ) -> torch.Tensor:
        if not kv_written:
            write_kv_triton(kv_cache, k, v, meta.slot_mapping)
        hq, d, hkv = q.shape[1], q.shape[2], kv_cache.shape[3]
        key = (id(meta), sliding_window, hq, hkv, d)
        planned = self._planned.get(key)
        stale = (
            planned is None
            or planned.meta is not meta
            or planned.stamp is None
            or not planned.stamp.matches(meta)
        )
        if stale:
            if torch.cuda.is_current_stream_capturing():
                raise RuntimeError(
                    "FlashInfer must be planned before capture: run this shape eagerly once first"
                )
            shape = (hq, hkv, d, scale, sliding_window or 0, q.dtype, kv_cache.dtype)
            decode = is_decode(meta)
            wrapper = self._new_wrapper(meta, decode=decode, group=hq // hkv)
            planned = _Planned(wrapper, meta, None, torch.empty(0), shape, decode)
            self._plan(planned, meta)
            self._planned[key] = planned
        out = planned.wrapper.run(q, (kv_cache[0], kv_cache[1]))
        return torch.where(planned.token_valid, out, torch.zeros((), dtype=out.dtype, device=out.device))
