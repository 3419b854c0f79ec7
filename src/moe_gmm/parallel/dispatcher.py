"""Expert-parallel token dispatch and combine over all-to-all (plain classes, no parameters).

Legend: T local tokens, k top-k, H hidden, E global experts, ep EP group size, L = E / ep local
experts, C chunks, R = T * k rows this rank sends, S rows it receives. Rank r owns the global
experts ``[r * L, (r + 1) * L)``.

Data flow of one call (forward; autograd runs the mirror image)::

    ids [T, k] --bincount--> counts [C, ep, L] --all-to-all (even, int64)--> recv counts [ep, C, L]
                 ==> HOST SYNC: split sizes as Python ints (the only one) <==
    hidden [T, H] --permute by (chunk, expert)--> X1 [R, H]   (grouped by destination rank, then
                                                              local expert, inside each chunk)
    per chunk:  X1_c --all-to-all--> X2_c [S_c, H]            (source rank, local expert) order
                X2_c --regroup--> X3_c                        (local expert, source rank) order
                expert_fn(X3_c, group_list_c [L]) -> Y3_c     GMM -> SwiGLU -> GMM on local weights
                Y3_c --inverse regroup--> Y2_c --all-to-all back--> Y1_c
    cat(Y1_c) --unpermute with probs--> out [T, H]

:class:`AllToAllDispatcher` runs one chunk with blocking exchanges. :class:`OverlappedAllToAllDispatcher`
splits the local tokens into C chunks and keeps one exchange in flight while the expert matmuls of
another chunk run, in forward and in backward (see :mod:`moe_gmm.parallel.comm`).

Every rank takes part in every exchange, also when it sends or receives zero rows; a rank whose
experts receive nothing runs the expert MLP on zero rows, so its weights get exact zero gradients.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist

from moe_gmm.ops.eager_path import label
from moe_gmm.ops.permute import permute, unpermute
from moe_gmm.parallel.comm import all_to_all, all_to_all_async, exchange_counts

__all__ = ["AllToAllDispatcher", "ExpertFn", "OverlappedAllToAllDispatcher", "Route"]

# expert_fn(x_local [S, H] grouped by local expert, group_list [L] int64) -> y_local [S, H]
ExpertFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


@dataclass(frozen=True)
class ChunkRoute:
    """Where one chunk's rows go; host ints for the exchange, device tensors for the regroup."""

    input_splits: list[int]  # rows sent to each rank
    output_splits: list[int]  # rows received from each rank
    order_S: torch.Tensor  # received row feeding local row i: (source, expert) -> (expert, source)
    inverse_order_S: torch.Tensor  # the inverse permutation
    group_list_L: torch.Tensor  # rows per local expert (the GMM group_list), int64

    @property
    def num_sent(self) -> int:
        return sum(self.input_splits)


@dataclass(frozen=True)
class Route:
    """The frozen metadata of one dispatch: permutation state plus one :class:`ChunkRoute` per chunk."""

    row_id_map_R: torch.Tensor
    chunks: tuple[ChunkRoute, ...]


class AllToAllDispatcher:
    """Dispatch tokens to the ranks owning their experts, run the local experts, combine back.

    Args:
        num_experts: global E; must be divisible by the group size.
        group: the expert-parallel process group (``None``: the default group).
        validate_routing: check ``0 <= ids < E`` (one extra host sync); callers whose ids come from a
            top-k over E logits may turn it off.
    """

    num_chunks = 1

    def __init__(self, num_experts: int, group: dist.ProcessGroup | None = None, *, validate_routing: bool = True):
        self.group = group
        self.ep_size = dist.get_world_size(group)
        self.ep_rank = dist.get_rank(group)
        if isinstance(num_experts, bool) or not isinstance(num_experts, int) or num_experts < 1:
            raise ValueError(f"num_experts must be a positive int, got {num_experts!r}")
        if num_experts % self.ep_size:
            raise ValueError(
                f"num_experts={num_experts} must be divisible by the expert-parallel group size {self.ep_size}"
            )
        self.num_experts = num_experts
        self.num_local_experts = num_experts // self.ep_size
        self.validate_routing = validate_routing

    # ------------------------------------------------------------------------------------------
    # routing metadata
    # ------------------------------------------------------------------------------------------

    def _check(self, hidden_TH: torch.Tensor, ids_Tk: torch.Tensor, probs_Tk: torch.Tensor) -> None:
        if hidden_TH.dim() != 2:
            raise ValueError(f"hidden_TH must be 2-D [T, H], got shape {tuple(hidden_TH.shape)}")
        if ids_Tk.dim() != 2 or ids_Tk.shape[0] != hidden_TH.shape[0]:
            raise ValueError(f"ids_Tk must be [T={hidden_TH.shape[0]}, k], got shape {tuple(ids_Tk.shape)}")
        if ids_Tk.dtype not in (torch.int32, torch.int64):
            raise TypeError(f"ids_Tk must be int32 or int64, got {ids_Tk.dtype}")
        if probs_Tk.shape != ids_Tk.shape:
            raise ValueError(f"probs_Tk shape {tuple(probs_Tk.shape)} must equal ids_Tk shape {tuple(ids_Tk.shape)}")
        if self.validate_routing and ids_Tk.numel():
            lo, hi = torch.aminmax(ids_Tk)  # HOST SYNC (optional, validate_routing=True)
            if int(lo) < 0 or int(hi) >= self.num_experts:
                raise ValueError(f"ids_Tk must lie in [0, {self.num_experts}), got values in [{int(lo)}, {int(hi)}]")

    def _chunk_keys(self, ids_Tk: torch.Tensor) -> torch.Tensor:
        """Sort keys ``chunk * E + expert``: rows grouped by chunk, then by global expert."""
        ids_Tk = ids_Tk.long()
        if self.num_chunks == 1:
            return ids_Tk
        num_tokens = ids_Tk.shape[0]
        chunk_T = torch.arange(num_tokens, device=ids_Tk.device) * self.num_chunks // max(num_tokens, 1)
        return ids_Tk + chunk_T[:, None] * self.num_experts

    def _routes(self, counts_CE: torch.Tensor) -> tuple[ChunkRoute, ...]:
        ep, num_local, num_chunks = self.ep_size, self.num_local_experts, self.num_chunks
        # Rank d needs, for every chunk, how many rows arrive for each of its local experts.
        send_dCL = counts_CE.view(num_chunks, ep, num_local).transpose(0, 1).contiguous()
        recv_sCL = exchange_counts(send_dCL, self.group)
        # HOST SYNC (the only one of the dispatch): all_to_all_single takes its split sizes as
        # Python ints, so the per-(chunk, peer) row totals come to the host here, in one transfer.
        flat = torch.cat([send_dCL.sum(2).T.flatten(), recv_sCL.sum(2).T.flatten()]).tolist()
        sent, received = flat[: ep * num_chunks], flat[ep * num_chunks :]
        local_expert_SL = torch.arange(num_local, device=counts_CE.device).repeat(ep)  # (source, expert) blocks
        routes = []
        for c in range(num_chunks):
            output_splits = received[c * ep : (c + 1) * ep]
            recv_sL = recv_sCL[:, c]
            # Received rows arrive as [src 0: e0.., e1.., src 1: e0.., ...]; a stable sort by local
            # expert turns that into [e0: src 0.., src 1.., e1: ...], what the grouped matmul needs.
            local_ids_S = torch.repeat_interleave(local_expert_SL, recv_sL.flatten(), output_size=sum(output_splits))
            order_S = torch.argsort(local_ids_S, stable=True)
            inverse_S = torch.empty_like(order_S)
            inverse_S[order_S] = torch.arange(order_S.numel(), device=order_S.device)
            routes.append(
                ChunkRoute(
                    input_splits=sent[c * ep : (c + 1) * ep],
                    output_splits=output_splits,
                    order_S=order_S,
                    inverse_order_S=inverse_S,
                    group_list_L=recv_sL.sum(0),
                )
            )
        return tuple(routes)

    def _permute(self, hidden_TH: torch.Tensor, ids_Tk: torch.Tensor, probs_Tk: torch.Tensor):
        self._check(hidden_TH, ids_Tk, probs_Tk)
        keys_Tk = self._chunk_keys(ids_Tk)
        with label("moe::permute"):
            x1_RH, row_id_map_R, counts_CE = permute(
                hidden_TH, keys_Tk, self.num_chunks * self.num_experts, validate=False
            )
        with label("moe::ep_route"):
            chunks = self._routes(counts_CE)
        return x1_RH, Route(row_id_map_R, chunks)

    # ------------------------------------------------------------------------------------------
    # dispatch / combine
    # ------------------------------------------------------------------------------------------

    def dispatch(
        self, hidden_TH: torch.Tensor, ids_Tk: torch.Tensor, probs_Tk: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, Route]:
        """``(x_local [S, H] grouped by local expert, group_list [L], route)`` for :meth:`combine`."""
        x1_RH, route = self._permute(hidden_TH, ids_Tk, probs_Tk)
        (chunk,) = route.chunks
        with label("moe::ep_dispatch"):
            x2_SH = all_to_all(x1_RH, chunk.output_splits, chunk.input_splits, self.group)
            x3_SH = x2_SH.index_select(0, chunk.order_S)
        return x3_SH, chunk.group_list_L, route

    def combine(self, y3_SH: torch.Tensor, route: Route, probs_Tk: torch.Tensor) -> torch.Tensor:
        """Send the local experts' rows back and sum each token's k rows weighted by ``probs_Tk``."""
        (chunk,) = route.chunks
        with label("moe::ep_combine"):
            y2_SH = y3_SH.index_select(0, chunk.inverse_order_S)
            y1_RH = all_to_all(y2_SH, chunk.input_splits, chunk.output_splits, self.group)
        with label("moe::unpermute"):
            return unpermute(y1_RH, route.row_id_map_R, probs_Tk, validate=False)  # permute's own map

    def __call__(
        self, hidden_TH: torch.Tensor, ids_Tk: torch.Tensor, probs_Tk: torch.Tensor, expert_fn: ExpertFn
    ) -> torch.Tensor:
        """``out [T, H] = sum_j probs[t, j] * expert_{ids[t, j]}(hidden[t])`` with experts spread over the group."""
        x3_SH, group_list_L, route = self.dispatch(hidden_TH, ids_Tk, probs_Tk)
        return self.combine(expert_fn(x3_SH, group_list_L), route, probs_Tk)


class OverlappedAllToAllDispatcher(AllToAllDispatcher):
    """:class:`AllToAllDispatcher` with the exchanges overlapped with the expert matmuls.

    The local tokens are split into ``num_chunks`` contiguous chunks. While the experts run on chunk
    i, the dispatch of chunk i + 1 and the combine of chunk i - 1 are in flight; the backward runs
    the same pipeline in reverse (reverse exchanges started by autograd nodes that do not wait). On
    nccl the exchanges run on their own stream, so this hides up to min(exchange, compute) per
    chunk; the price is C smaller grouped matmuls instead of one. Results equal the one-chunk
    dispatcher's up to rounding: each row sees the same math, but a GEMM kernel may block its
    reduction differently for fewer rows, and expert-weight gradients are summed over chunks
    (measured: relative difference below 3e-7 in fp32).
    """

    def __init__(
        self,
        num_experts: int,
        group: dist.ProcessGroup | None = None,
        *,
        num_chunks: int = 2,
        validate_routing: bool = True,
    ):
        super().__init__(num_experts, group, validate_routing=validate_routing)
        if isinstance(num_chunks, bool) or not isinstance(num_chunks, int) or num_chunks < 1:
            raise ValueError(f"num_chunks must be a positive int, got {num_chunks!r}")
        self.num_chunks = num_chunks

    def dispatch(self, *args, **kwargs):
        raise NotImplementedError("the overlapped dispatcher interleaves dispatch and combine; call it directly")

    def combine(self, *args, **kwargs):
        raise NotImplementedError("the overlapped dispatcher interleaves dispatch and combine; call it directly")

    def __call__(
        self, hidden_TH: torch.Tensor, ids_Tk: torch.Tensor, probs_Tk: torch.Tensor, expert_fn: ExpertFn
    ) -> torch.Tensor:
        x1_RH, route = self._permute(hidden_TH, ids_Tk, probs_Tk)
        sends = x1_RH.split([c.num_sent for c in route.chunks])
        start = lambda c: all_to_all_async(
            sends[c], route.chunks[c].output_splits, route.chunks[c].input_splits, self.group
        )
        with label("moe::ep_dispatch"):
            in_flight = start(0)
        combines = []
        for c, chunk in enumerate(route.chunks):
            with label("moe::ep_dispatch"):
                next_in_flight = start(c + 1) if c + 1 < self.num_chunks else None
                x3_SH = in_flight.wait().index_select(0, chunk.order_S)
            y3_SH = expert_fn(x3_SH, chunk.group_list_L)
            with label("moe::ep_combine"):
                y2_SH = y3_SH.index_select(0, chunk.inverse_order_S)
                combines.append(all_to_all_async(y2_SH, chunk.input_splits, chunk.output_splits, self.group))
            in_flight = next_in_flight
        with label("moe::ep_combine"):
            y1_RH = torch.cat([h.wait() for h in combines])
        with label("moe::unpermute"):
            return unpermute(y1_RH, route.row_id_map_R, probs_Tk, validate=False)  # permute's own map
