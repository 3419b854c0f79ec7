"""Differentiable all-to-all over an expert-parallel group, sync and async, with clear failures.

Every exchange uses ``dist.all_to_all_single`` with explicit split lists: it supports uneven and
zero-row splits on gloo, nccl and hccl alike (the list form ``dist.all_to_all`` rejects uneven
sizes on gloo). The backward of an exchange is the reverse exchange with the splits swapped.

A failed collective (a peer process died, or did not join within the process group's timeout)
surfaces as :class:`CollectiveError` naming the exchange, this rank and the group size.

Legend: R rows sent by this rank, S rows received by this rank, H hidden (any trailing shape).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager

import torch
import torch.distributed as dist

__all__ = [
    "AsyncAllToAll",
    "CollectiveError",
    "all_to_all",
    "all_to_all_async",
    "collective",
    "exchange_counts",
]

Group = dist.ProcessGroup | None


class CollectiveError(RuntimeError):
    """A collective of the expert-parallel group failed on this rank."""


@contextmanager
def collective(what: str, group: Group) -> Iterator[None]:
    """Re-raise a backend failure inside the block as :class:`CollectiveError` with context."""
    try:
        yield
    except CollectiveError:
        raise
    except RuntimeError as err:  # DistBackendError, gloo/nccl timeouts and closed connections
        rank, size = dist.get_rank(group), dist.get_world_size(group)
        raise CollectiveError(
            f"expert-parallel {what} failed on rank {rank} of {size}: a peer rank exited or did not join "
            f"within the process group's timeout ({type(err).__name__}: {err})"
        ) from err


def exchange_counts(send_counts: torch.Tensor, group: Group) -> torch.Tensor:
    """Even all-to-all of an int64 ``[ep, ...]`` tensor: row d goes to rank d; row s of the result came from rank s."""
    recv_counts = torch.empty_like(send_counts)
    with collective("count exchange", group):
        dist.all_to_all_single(recv_counts, send_counts.contiguous(), group=group)
    return recv_counts


def _exchange(
    x: torch.Tensor,
    output_splits: Sequence[int],
    input_splits: Sequence[int],
    group: Group,
    *,
    async_op: bool,
    what: str,
):
    out = x.new_empty((sum(output_splits), *x.shape[1:]))
    with collective(what, group):
        work = dist.all_to_all_single(
            out, x.contiguous(), list(output_splits), list(input_splits), group=group, async_op=async_op
        )
    return out, work


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x_RH: torch.Tensor, output_splits: list[int], input_splits: list[int], group: Group):
        ctx.splits, ctx.group = (output_splits, input_splits), group
        out_SH, _ = _exchange(x_RH, output_splits, input_splits, group, async_op=False, what="all-to-all")
        return out_SH

    @staticmethod
    def backward(ctx, grad_SH: torch.Tensor):
        output_splits, input_splits = ctx.splits
        grad_RH, _ = _exchange(
            grad_SH, input_splits, output_splits, ctx.group, async_op=False, what="all-to-all (backward)"
        )
        return grad_RH, None, None, None


def all_to_all(x_RH: torch.Tensor, output_splits: Sequence[int], input_splits: Sequence[int], group: Group = None):
    """Send ``x_RH[sum(input_splits[:d]) : ...]`` to rank d; return the ``[sum(output_splits), ...]`` rows received.

    Differentiable: the backward sends the gradient back along the same routes.
    """
    return _AllToAll.apply(x_RH, list(output_splits), list(input_splits), group)


class AsyncAllToAll:
    """An in-flight exchange: :func:`all_to_all_async` starts it, :meth:`wait` returns the rows.

    Both ends are autograd nodes, so the backward runs the same overlap in reverse: the node created
    by :meth:`wait` starts the reverse exchange of the gradient without waiting, and the node created
    by :func:`all_to_all_async` waits for it. Between the two, autograd runs whatever comes earlier in
    the backward order (the expert matmul backward of another chunk).
    """

    def __init__(self) -> None:
        self.work: dist.Work | None = None
        self.splits: tuple[list[int], list[int]] = ([], [])
        self.group: Group = None
        self._out: torch.Tensor | None = None
        self._send: torch.Tensor | None = None
        self.grad_RH: torch.Tensor | None = None

    def wait(self) -> torch.Tensor:
        return _WaitAllToAll.apply(self._out, self)

    def _wait_work(self, what: str) -> None:
        assert self.work is not None, "exchange waited on twice or never started"
        with collective(what, self.group):
            self.work.wait()
        self.work = None


class _StartAllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x_RH, handle: AsyncAllToAll, output_splits, input_splits, group):
        ctx.handle = handle
        handle.splits, handle.group = (list(output_splits), list(input_splits)), group
        out_SH, handle.work = _exchange(
            x_RH, output_splits, input_splits, group, async_op=True, what="all-to-all (async)"
        )
        return out_SH

    @staticmethod
    def backward(ctx, grad_SH):
        # grad_SH only orders this node after _WaitAllToAll.backward, which started the reverse
        # exchange; its result (the gradient of x_RH) lands in handle.grad_RH.
        handle = ctx.handle
        handle._wait_work("all-to-all (async backward)")
        grad_RH, handle.grad_RH, handle._send = handle.grad_RH, None, None
        return grad_RH, None, None, None, None


class _WaitAllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, out_SH, handle: AsyncAllToAll):
        ctx.handle = handle
        handle._wait_work("all-to-all (async)")
        return out_SH.view_as(out_SH)

    @staticmethod
    def backward(ctx, grad_SH):
        handle = ctx.handle
        output_splits, input_splits = handle.splits
        # Autograd requires this node's gradient to have the shape of its input, so the reverse
        # exchange's receive buffer travels in the handle; grad_SH stays referenced until the wait.
        handle._send = grad_SH
        handle.grad_RH, handle.work = _exchange(
            grad_SH, input_splits, output_splits, handle.group, async_op=True, what="all-to-all (async backward)"
        )
        return grad_SH, None


def all_to_all_async(
    x_RH: torch.Tensor, output_splits: Sequence[int], input_splits: Sequence[int], group: Group = None
) -> AsyncAllToAll:
    """Start :func:`all_to_all` without waiting; call ``.wait()`` on the result to get the rows."""
    handle = AsyncAllToAll()
    handle._out = _StartAllToAll.apply(x_RH, handle, list(output_splits), list(input_splits), group)
    return handle
