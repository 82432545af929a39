"""The Mamba2 backend in plain torch over paged per-request states (no mamba_ssm / causal_conv1d kernels).

Per row of the step: the conv window and SSM state are read from ``read_blocks`` (or start at zero),
the row's tokens run through the causal depthwise conv and the SSD recurrence, and the states
reached after the tokens named in ``write_blocks`` are stored there (the runner's Mamba state
handler, :mod:`warmcap.runner_v2.mamba_state`, plans both into
:class:`~warmcap.contracts.metadata.MambaMetadata`). Every row reads its state before any row's
state is stored.

Two paths compute the same thing:

- uniform (every row has the same ``q <= MAX_UNIFORM_QUERY_LEN`` queries, known from the host-side
  sizes alone: decode and spec-verify steps, uniform graphs): all rows at once, ``q`` one-token
  recurrence steps, states gathered and scattered by tensor indexing (-1 reads start from zero,
  -1 writes go to the sink row). No host read of device data: it runs inside a CUDA graph.
- ragged (anything else): per row over host lists. Long spans use the chunked SSD form; the span is
  cut at every token whose state is written, so single-token spans take the one-step update. It
  reads ``query_start_loc`` and the blocks on the host, so it can never be captured in a graph.

State shapes per layer: conv ``(conv_dim, d_conv - 1)`` (the last inputs, oldest first) and SSM
``(num_heads, head_dim, d_state)``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from warmcap.contracts.backends import MAX_UNIFORM_QUERY_LEN, MambaBackend, MambaWeights
from warmcap.contracts.mamba_layout import state_views
from warmcap.contracts.metadata import MambaMetadata


def ssm_step(
    state: torch.Tensor, x: torch.Tensor, dt: torch.Tensor, a: torch.Tensor, b: torch.Tensor, c: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """One token: state [..., H, P, N], x [..., H, P], dt [..., H], a [H], b/c [..., H, N]
    -> (y [..., H, P], new state); leading dims are rows."""
    state = state * torch.exp(dt * a)[..., None, None] + (dt[..., None] * x)[..., None] * b[..., None, :]
    return torch.einsum("...hpn,...hn->...hp", state, c), state


def uniform_query_len(meta: MambaMetadata) -> int | None:
    """``q`` when every row of ``meta`` has exactly ``q <= MAX_UNIFORM_QUERY_LEN`` tokens, from the
    host-side sizes only: ``num_tokens == num_reqs * max_query_len`` forces every row to the
    maximum (their lengths sum to ``num_tokens`` and none exceeds ``max_query_len``)."""
    q = meta.max_query_len
    if meta.num_reqs > 0 and 0 < q <= MAX_UNIFORM_QUERY_LEN and meta.num_tokens == meta.num_reqs * q:
        return q
    return None


def ssd_scan(
    state: torch.Tensor,
    x: torch.Tensor,
    dt: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    c: torch.Tensor,
    chunk_size: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """L tokens in chunks: state [H, P, N], x [L, H, P], dt [L, H], a [H], b/c [L, H, N]
    -> (y [L, H, P], final state). Within a chunk the output is the masked quadratic (attention-like)
    form; between chunks the state carries over, decayed by the chunk's total ``exp(sum dt * a)``."""
    outputs = []
    for start in range(0, x.shape[0], chunk_size):
        xs, dts = x[start : start + chunk_size], dt[start : start + chunk_size]
        bs, cs = b[start : start + chunk_size], c[start : start + chunk_size]
        log_decay = torch.cumsum(dts * a, dim=0)  # [l, H]: log decay from the chunk start to token t
        diff = log_decay[:, None, :] - log_decay[None, :, :]  # [t, s, H]
        causal = torch.ones(diff.shape[:2], dtype=torch.bool, device=x.device).tril()
        weights = torch.exp(diff.masked_fill(~causal[:, :, None], float("-inf")))
        scores = torch.einsum("thn,shn->tsh", cs, bs) * weights
        y = torch.einsum("tsh,sh,shp->thp", scores, dts, xs)
        y = y + torch.einsum("thn,hpn->thp", cs, state) * torch.exp(log_decay)[:, :, None]
        to_end = torch.exp(log_decay[-1:] - log_decay)  # [l, H]: decay from token s to the chunk end
        state = state * torch.exp(log_decay[-1])[:, None, None] + torch.einsum(
            "sh,shp,shn->hpn", to_end * dts, xs, bs
        )
        outputs.append(y)
    return torch.cat(outputs), state


def _split(xbc: torch.Tensor, w: MambaWeights) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Activated conv output [..., conv_dim] -> x [..., H, P], B and C [..., H, N] (groups
    repeated over their heads)."""
    lead = xbc.shape[:-1]
    group_dim = w.n_groups * w.d_state
    xs, b, c = xbc.split([w.num_heads * w.head_dim, group_dim, group_dim], dim=-1)
    per_group = w.num_heads // w.n_groups
    xs = xs.reshape(*lead, w.num_heads, w.head_dim)
    b = b.reshape(*lead, w.n_groups, w.d_state).repeat_interleave(per_group, dim=-2)
    c = c.reshape(*lead, w.n_groups, w.d_state).repeat_interleave(per_group, dim=-2)
    return xs, b, c


def _conv(window: torch.Tensor, w: MambaWeights) -> torch.Tensor:
    """Causal depthwise conv over ``window`` [..., C, width + L] -> activated [..., L, C] (float32)."""
    bias = None if w.conv_bias is None else w.conv_bias.float()
    conv = F.conv1d(window, w.conv_weight.float(), bias, groups=w.conv_weight.shape[0])
    return w.activation(conv.transpose(-1, -2))


class TorchMambaBackend(MambaBackend):
    """Mamba2 conv + SSD in torch: the uniform path for graph-safe batches, the ragged one otherwise."""

    name = "torch"

    def forward(
        self,
        xbc: torch.Tensor,
        dt: torch.Tensor,
        state: torch.Tensor,
        meta: MambaMetadata,
        weights: MambaWeights,
    ) -> torch.Tensor:
        if meta.read_blocks is None or meta.write_blocks is None:
            raise TypeError("the Mamba backend needs MambaMetadata with read/write blocks for its group")
        states = state_views(state, weights.state_shapes)
        q = uniform_query_len(meta)
        if q is not None:
            return self._run_uniform(xbc, dt, states, meta.read_blocks, meta.write_blocks, q, weights)
        return self._run_ragged(xbc, dt, states, (meta.read_blocks, meta.write_blocks), meta, weights)

    def _run_uniform(
        self,
        xbc: torch.Tensor,
        dt: torch.Tensor,
        states: list[torch.Tensor],
        reads: torch.Tensor,
        writes: torch.Tensor,
        q: int,
        w: MambaWeights,
    ) -> torch.Tensor:
        """All ``R`` rows of ``q`` tokens at once (row r: tokens ``r * q .. r * q + q - 1``);
        ``reads`` [R] and ``writes`` [R * q] blocks."""
        conv_states, ssm_states = states
        r, width = reads.shape[0], conv_states.shape[-1]
        # NOTE: a -1 read gathers block 0 (the null block) and masks it to zero: indexing and
        # ``where`` keep shapes static, and ``where`` drops whatever block 0 holds, NaN included.
        has_state = reads >= 0
        source = reads.clamp(min=0)
        conv0 = torch.where(has_state[:, None, None], conv_states[source].float(), 0.0)
        ssm0 = torch.where(has_state[:, None, None, None], ssm_states[source].float(), 0.0)
        # Gathering copied every read state, so the stores below cannot leak into another row's read.
        window = torch.cat((conv0.transpose(1, 2), xbc.float().reshape(r, q, -1)), dim=1)  # [R, width + q, C]
        xs, b, c = _split(_conv(window.transpose(1, 2), w), w)  # [R, q, H, P], [R, q, H, N] x 2
        dt = dt.reshape(r, q, w.num_heads)
        sink = conv_states.shape[0] - 1
        targets = torch.where(writes >= 0, writes, sink).reshape(r, q)
        state, outs = ssm0, []
        for j in range(q):
            y, state = ssm_step(state, xs[:, j], dt[:, j], w.a, b[:, j], c[:, j])
            outs.append(y)
            # Rows that keep no state after token j store into the sink row, which nothing reads.
            conv_states[targets[:, j]] = (
                window[:, j + 1 : j + 1 + width].transpose(1, 2).to(conv_states.dtype)
            )
            ssm_states[targets[:, j]] = state.to(ssm_states.dtype)
        y = torch.stack(outs, dim=1) + xs * w.d.float()[:, None]
        return y.reshape(r * q, w.num_heads, w.head_dim)

    def _run_ragged(
        self,
        xbc: torch.Tensor,
        dt: torch.Tensor,
        states: list[torch.Tensor],
        blocks: tuple[torch.Tensor, torch.Tensor],
        meta: MambaMetadata,
        w: MambaWeights,
    ) -> torch.Tensor:
        """Row by row over host lists (any row lengths); ``blocks``: read [R] and write [T]."""
        conv_states, ssm_states = states
        qsl = (
            meta.query_start_loc_cpu if meta.query_start_loc_cpu is not None else meta.query_start_loc
        ).tolist()
        reads, writes = blocks[0].tolist(), blocks[1].tolist()
        y = torch.zeros(xbc.shape[0], w.num_heads, w.head_dim, dtype=torch.float32, device=xbc.device)
        stores: list[tuple[int, torch.Tensor, torch.Tensor]] = []
        # NOTE: every row reads its state before any row's state is stored: a row may write the very
        # block it read (mode none), and stores must not leak into another row's read.
        for row in range(meta.num_reqs):
            lo, hi = qsl[row], qsl[row + 1]
            if hi == lo:
                continue
            if reads[row] >= 0:
                conv0, ssm0 = conv_states[reads[row]].float(), ssm_states[reads[row]].float()
            else:
                conv0 = xbc.new_zeros(conv_states.shape[1:], dtype=torch.float32)
                ssm0 = xbc.new_zeros(ssm_states.shape[1:], dtype=torch.float32)
            out, row_stores = self._run_row(xbc[lo:hi], dt[lo:hi], conv0, ssm0, writes[lo:hi], w)
            y[lo:hi] = out
            stores.extend(row_stores)
        for block, conv, ssm in stores:
            conv_states[block] = conv.to(conv_states.dtype)
            ssm_states[block] = ssm.to(ssm_states.dtype)
        return y

    def _run_row(
        self,
        xbc: torch.Tensor,
        dt: torch.Tensor,
        conv0: torch.Tensor,
        ssm0: torch.Tensor,
        writes: list[int],
        w: MambaWeights,
    ) -> tuple[torch.Tensor, list[tuple[int, torch.Tensor, torch.Tensor]]]:
        length, width = xbc.shape[0], conv0.shape[-1]
        window = torch.cat((conv0.T, xbc.float()), dim=0)  # [width + L, conv_dim]
        xs, b, c = _split(_conv(window.T[None], w)[0], w)  # [L, H, P], [L, H, N] x 2
        cuts = sorted({i + 1 for i, block in enumerate(writes) if block >= 0} | {length})
        state, start, outs, stores = ssm0, 0, [], []
        for end in cuts:
            if end - start == 1:
                y, state = ssm_step(state, xs[start], dt[start], w.a, b[start], c[start])
                y = y[None]
            else:
                y, state = ssd_scan(
                    state, xs[start:end], dt[start:end], w.a, b[start:end], c[start:end], w.chunk_size
                )
            outs.append(y)
            if writes[end - 1] >= 0:
                stores.append((writes[end - 1], window[end : end + width].T.clone(), state))
            start = end
        y = torch.cat(outs) + xs * w.d.float()[:, None]
        return y, stores
