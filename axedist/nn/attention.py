"""Context parallelism: the attention of one sequence whose positions are spread over ranks.

torch's ``context_parallel`` (``torch.distributed.tensor.experimental``), the same arguments::

    with context_parallel(cp_mesh, buffers=[tokens, labels, model.rope_cos, model.rope_sin],
                          buffer_seq_dims=[1, 1, 0, 0]):
        loss = next_token_loss(model(tokens), labels)   # each rank: its positions only
        loss.backward()

On entry each buffer is cut in place along its sequence dim into the ranks' pieces, in torch's
head-tail order when the length divides into ``2 W`` chunks (so every rank gets as much of a causal
mask's work): length 8 on 2 ranks gives rank 0 positions 0, 1, 6, 7 and rank 1 positions 2, 3, 4, 5.
While the block is open ``F.scaled_dot_product_attention(q, k, v)`` of those pieces (sequence dim
2) is the attention of the whole sequence: every rank gathers the keys and values over the mesh
(their gradients are reduce-scattered back) and attends its own queries to all of them, causal by
global position: per run of its positions one square causal call and one unmasked call over the
keys before the run, merged by log-sum-exp (``causal_runs``), the calls the fused kernels run fastest. Everything else in the model is per position and runs on the pieces as it is; the
parameters' gradients are each rank's share (sum them over the mesh, as data parallelism does). On
exit the buffers are whole again (``no_restore_buffers``: left as this rank's piece).

Where torch rotates keys and values around a ring, this gathers them once (torch's ``allgather``
rotate method): memory for the whole sequence's keys and values on every rank, one collective each.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Iterator, Sequence

import torch
import torch.nn.functional as F
from torch.distributed.tensor import Partial, Replicate, Shard
from torch.overrides import TorchFunctionMode

from ..dtensor import DTensor
from ..mesh import DeviceMesh, as_mesh
from ..peers import agree

__all__ = ["SequenceShards", "context_parallel", "causal_runs"]

# the sequence dim of SDPA's (batch, heads, sequence, head_dim) query, key and value
_SEQUENCE_DIM = 2
# torch's SDPA itself (``F.scaled_dot_product_attention`` is replaced while a context is open)
_SDPA = torch._C._nn.scaled_dot_product_attention


@dataclass(frozen=True)
class SequenceShards:
    """Which positions of a ``length``-long sequence each of ``ranks`` ranks holds. Head-tail
    (``balanced``): ``2 * ranks`` equal chunks, rank ``r`` holding chunks ``r`` and
    ``2 * ranks - 1 - r``; else ``ranks`` contiguous ones. ``SequenceShards(8, 2, True)``
    prints ``seq[8 @ 2 ranks: 0:2+6:8 | 2:4+4:6]``."""

    length: int
    ranks: int
    balanced: bool

    @staticmethod
    def of(length: int, ranks: int) -> "SequenceShards":
        """torch's choice: head-tail where ``2 * ranks`` divides the length, else contiguous."""
        return SequenceShards(length, ranks, length % (2 * ranks) == 0)

    def __post_init__(self):
        if self.ranks < 1 or self.length % (2 * self.ranks if self.balanced else self.ranks):
            raise ValueError(f"context_parallel: a sequence of {self.length} positions does not split evenly over "
                             f"{self.ranks} ranks; pad it to a multiple of {self.ranks}")

    @property
    def local_length(self) -> int:
        return self.length // self.ranks

    def spans(self, position: int) -> list[tuple[int, int]]:
        """The ``[start, stop)`` runs of positions held at mesh position ``position``."""
        if not self.balanced:
            return [(position * self.local_length, (position + 1) * self.local_length)]
        chunk = self.length // (2 * self.ranks)
        tail = 2 * self.ranks - 1 - position
        return [(position * chunk, (position + 1) * chunk), (tail * chunk, (tail + 1) * chunk)]

    def positions(self, position: int, device=None) -> torch.Tensor:
        """The global positions held at mesh position ``position``, in the order held."""
        return torch.cat([torch.arange(start, stop, device=device) for start, stop in self.spans(position)])

    def order(self, device=None) -> torch.Tensor:
        """Every rank's positions, rank after rank: the positions of a tensor gathered over the
        mesh (torch's load-balance indices; ``[0, 1, 6, 7, 2, 3, 4, 5]`` for 8 on 2 ranks)."""
        return torch.cat([self.positions(p, device) for p in range(self.ranks)])

    def __repr__(self) -> str:
        pieces = " | ".join("+".join(f"{a}:{b}" for a, b in self.spans(p)) for p in range(self.ranks))
        return f"seq[{self.length} @ {self.ranks} ranks: {pieces}]"


class _ContextParallelAttention(TorchFunctionMode):
    """While open, SDPA of sequence pieces held as ``shards`` says over ``mesh`` is the whole
    sequence's attention (keys and values gathered; causal by global position). It is reached two
    ways: ``F.scaled_dot_product_attention`` replaced by ``attention`` (torch's way; it is what an
    activation checkpoint's recomputation in backward calls, where no torch-function mode is on)
    and, as a mode, SDPA called under another name (``from torch.nn.functional import ...``)."""

    def __init__(self, mesh: DeviceMesh, shards: SequenceShards):
        super().__init__()
        self.mesh, self.shards = mesh, shards
        self.inverse_orders: dict[torch.device, torch.Tensor] = {}   # gathered index -> position order
        self.busy = False   # inside ``attention``: its own SDPA calls are torch's

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is _SDPA:  # (``attention`` hands its own SDPA calls to torch)
            return self.attention(*args, **kwargs)
        return func(*args, **kwargs)

    def attention(self, *args, **kwargs):
        """``F.scaled_dot_product_attention``'s arguments: the whole sequence's attention, this rank's queries."""
        if self.busy:
            return _SDPA(*args, **kwargs)
        self.busy = True
        try:
            return self.pieces(*args, **kwargs)
        finally:
            self.busy = False

    def pieces(self, query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
               enable_gqa=False):
        if any(isinstance(t, DTensor) for t in (query, key, value)):
            raise NotImplementedError("context_parallel: scaled_dot_product_attention of DTensors; pass the local "
                                      "pieces (e.g. parallelize's use_local_output=True)")
        if attn_mask is not None:
            raise NotImplementedError("context_parallel: scaled_dot_product_attention with an attn_mask (a mask of "
                                      "the whole sequence is not cut into the ranks' pieces); use is_causal=True")
        lengths = {query.shape[_SEQUENCE_DIM], key.shape[_SEQUENCE_DIM], value.shape[_SEQUENCE_DIM]}
        if lengths != {self.shards.local_length}:
            raise ValueError(f"context_parallel: scaled_dot_product_attention of sequence pieces of lengths "
                             f"{sorted(lengths)} (dim {_SEQUENCE_DIM}), but this rank holds "
                             f"{self.shards.local_length} positions of {self.shards}")
        if self.shards.ranks == 1:  # the whole sequence is here: torch's SDPA as it is
            return _SDPA(query, key, value, dropout_p=dropout_p, is_causal=is_causal, scale=scale,
                         enable_gqa=enable_gqa)
        key, value = self.gather(key), self.gather(value)
        if not is_causal:  # every query sees every key: their order does not matter
            return _SDPA(query, key, value, dropout_p=dropout_p, scale=scale, enable_gqa=enable_gqa)
        return self.causal(query, key, value, dropout_p, scale, enable_gqa)

    def gather(self, piece: torch.Tensor) -> torch.Tensor:
        """Every rank's piece, rank after rank, along the sequence dim; each rank's gradient of
        it is a summand of the pieces' gradients (a reduce-scatter on the way back)."""
        whole = DTensor.from_local(piece, self.mesh, [Shard(_SEQUENCE_DIM)], run_check=False)
        return whole.redistribute(self.mesh, [Replicate()]).to_local(grad_placements=[Partial()])

    def causal(self, query, key, value, dropout_p, scale, enable_gqa):
        """Causal attention of this rank's queries to the gathered keys, put in position order
        (``causal_runs``). Rank 0 of 8 positions on 2 ranks: queries 0-1 over keys 0-1, 6-7 over 0-7."""
        if dropout_p:
            raise NotImplementedError("context_parallel: causal scaled_dot_product_attention with dropout_p > 0")
        if self.shards.balanced:
            order = self.inverse_orders.get(key.device)
            if order is None:
                order = self.inverse_orders[key.device] = torch.argsort(self.shards.order(key.device))
            key, value = key.index_select(_SEQUENCE_DIM, order), value.index_select(_SEQUENCE_DIM, order)
        heads, kv_heads = query.shape[1], key.shape[1]
        if heads != kv_heads:  # the kernels below take as many key heads as query heads
            if not enable_gqa or heads % kv_heads:
                raise ValueError(f"scaled_dot_product_attention: {heads} query heads and {kv_heads} key heads "
                                 f"(enable_gqa={enable_gqa})")
            key, value = (t.repeat_interleave(heads // kv_heads, dim=1) for t in (key, value))
        return causal_runs(query, key, value, self.shards.spans(self.mesh.position()), scale)


def causal_runs(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, spans: Sequence[tuple[int, int]],
                scale: float | None = None) -> torch.Tensor:
    """Causal attention of queries held as runs of positions ``spans`` (``[start, stop)`` each,
    concatenated along dim 2) to keys and values in position order, ``[0, stop)`` of them for a
    run: per run one square causal call over its own keys ``[start, stop)`` and one call without a
    mask over the keys before them, merged by their log-sum-exp, so every call is one the fused
    kernels (cuDNN's on Hopper) run as they run ``is_causal`` and nothing is masked but the square's
    upper half. Queries of run ``[6, 8)`` (2 of them) over keys ``[0, 8)``: keys 6-7 causal, 0-5 whole.
    Differentiable (each call's backward from the merged output and log-sum-exp)."""
    return _CausalRuns.apply(query, key, value, tuple(spans), scale)


def _attention_op(device: torch.device):
    """The fused attention op that gives its log-sum-exp (and takes it back in backward) here."""
    if device.type == "cpu":
        return "cpu"
    if device.type == "cuda" and torch.backends.cuda.cudnn_sdp_enabled():
        return "cudnn"
    return "flash"


def _block_forward(op: str, query, key, value, causal: bool, scale):
    """(output, log-sum-exp shaped as the output less its last dim, what the backward needs)."""
    aten = torch.ops.aten
    if op == "cpu":
        out, lse = aten._scaled_dot_product_flash_attention_for_cpu(query, key, value, 0.0, causal, scale=scale)
        return out, lse, ()
    if op == "cudnn":
        out, lse, cum_q, cum_k, max_q, max_k, seed, offset, _ = aten._scaled_dot_product_cudnn_attention(
            query, key, value, None, True, 0.0, causal, False, scale=scale)
        return out, lse.reshape(out.shape[:-1]), (lse.shape, seed, offset, cum_q, cum_k, max_q, max_k)
    out, lse, cum_q, cum_k, max_q, max_k, seed, offset, _ = aten._scaled_dot_product_flash_attention(
        query, key, value, 0.0, causal, False, scale=scale)
    return out, lse, (cum_q, cum_k, max_q, max_k, seed, offset)


def _block_backward(op: str, grad, query, key, value, out, lse, extra, causal: bool, scale):
    aten = torch.ops.aten
    if op == "cpu":
        return aten._scaled_dot_product_flash_attention_for_cpu_backward(grad, query, key, value, out, lse, 0.0,
                                                                         causal, scale=scale)
    if op == "cudnn":
        shape, seed, offset, cum_q, cum_k, max_q, max_k = extra
        return aten._scaled_dot_product_cudnn_attention_backward(grad, query, key, value, out, lse.reshape(shape),
                                                                 seed, offset, None, cum_q, cum_k, max_q, max_k,
                                                                 0.0, causal, scale=scale)
    cum_q, cum_k, max_q, max_k, seed, offset = extra
    return aten._scaled_dot_product_flash_attention_backward(grad, query, key, value, out, lse, cum_q, cum_k,
                                                             max_q, max_k, 0.0, causal, seed, offset, scale=scale)


def _blocks(spans):
    """Per run: (its rows in the held order, then (key span, causal) of each call)."""
    offset = 0
    for start, stop in spans:
        rows = (offset, stop - start)
        offset += stop - start
        yield rows, [((start, stop), True)] + ([((0, start), False)] if start else [])


class _CausalRuns(torch.autograd.Function):
    @staticmethod
    def forward(ctx, query, key, value, spans, scale):
        op = _attention_op(query.device)
        outs, lses, saved = [], [], []
        for (first, count), calls in _blocks(spans):
            rows = query.narrow(_SEQUENCE_DIM, first, count)
            merged_out = merged_lse = None
            for (start, stop), causal in calls:
                out, lse, extra = _block_forward(op, rows, key.narrow(_SEQUENCE_DIM, start, stop - start),
                                                 value.narrow(_SEQUENCE_DIM, start, stop - start), causal, scale)
                saved.append(extra)
                lse_dtype = lse.dtype   # (the backward takes the log-sum-exp in the op's own dtype)
                wide = torch.promote_types(out.dtype, torch.float32)   # (bf16 parts merged in fp32)
                out, lse = out.to(wide), lse.to(wide)
                if merged_out is None:
                    merged_out, merged_lse = out, lse
                else:  # softmax over both key sets: each part weighted by its share of the normaliser
                    total = torch.logaddexp(merged_lse, lse)
                    merged_out = (merged_out * (merged_lse - total).exp().unsqueeze(-1)
                                  + out * (lse - total).exp().unsqueeze(-1))
                    merged_lse = total
            outs.append(merged_out.to(query.dtype))
            lses.append(merged_lse.to(lse_dtype))
        out = outs[0] if len(outs) == 1 else torch.cat(outs, dim=_SEQUENCE_DIM)
        ctx.save_for_backward(query, key, value, out, *lses)
        ctx.op, ctx.spans, ctx.scale, ctx.extras = op, spans, scale, saved
        return out

    @staticmethod
    def backward(ctx, grad):
        query, key, value, out, *lses = ctx.saved_tensors
        grad = grad.contiguous()
        grad_query, grad_key, grad_value = torch.zeros_like(query), torch.zeros_like(key), torch.zeros_like(value)
        extras = iter(ctx.extras)
        for ((first, count), calls), lse in zip(_blocks(ctx.spans), lses):
            rows, rows_out, rows_grad = (t.narrow(_SEQUENCE_DIM, first, count) for t in (query, out, grad))
            for (start, stop), causal in calls:
                keys = slice(start, stop)
                dq, dk, dv = _block_backward(ctx.op, rows_grad, rows, key[:, :, keys], value[:, :, keys],
                                             rows_out, lse, next(extras), causal, ctx.scale)
                grad_query.narrow(_SEQUENCE_DIM, first, count).add_(dq)
                grad_key[:, :, keys].add_(dk)
                grad_value[:, :, keys].add_(dv)
        return grad_query, grad_key, grad_value, None, None


@contextlib.contextmanager
def context_parallel(mesh, *, buffers: Sequence[torch.Tensor] | None = None,
                     buffer_seq_dims: Sequence[int] | None = None,
                     no_restore_buffers: set[torch.Tensor] | None = None) -> Iterator[None]:
    """torch's ``context_parallel`` on a 1-D mesh (axedist's or torch's): ``buffers`` cut in place
    along ``buffer_seq_dims`` into this rank's positions (``SequenceShards.of(length, ranks)``),
    SDPA the whole sequence's attention while open, the buffers restored on exit (except
    ``no_restore_buffers``). Every buffer has the same sequence length, on every rank (checked
    across the mesh on entry). With 12 positions on 2 ranks a ``[2, 12]`` token batch becomes
    ``[2, 6]``: positions 0-2 and 9-11 on rank 0, 3-8 on rank 1."""
    mesh = as_mesh(mesh)
    buffers = list(buffers or [])
    seq_dims = list(buffer_seq_dims or [])
    no_restore = list(no_restore_buffers or [])
    if isinstance(getattr(F.scaled_dot_product_attention, "__self__", None), _ContextParallelAttention):
        raise RuntimeError("context_parallel: a context_parallel block is open already; they do not nest")
    if mesh.ndim != 1:
        raise ValueError(f"context_parallel takes a 1-D mesh (the context-parallel axis, e.g. mesh['cp']), "
                         f"got {mesh}")
    if len(buffers) != len(seq_dims):
        raise ValueError(f"context_parallel: {len(buffers)} buffers but {len(seq_dims)} buffer_seq_dims")
    if any(not any(b is buffer for buffer in buffers) for b in no_restore):
        raise ValueError("context_parallel: no_restore_buffers must be a subset of buffers")
    if not buffers:
        raise ValueError("context_parallel needs at least one buffer: its sequence length says which positions "
                         "each rank holds")
    if any(isinstance(b, (torch.nn.Parameter, DTensor)) for b in buffers):
        raise TypeError("context_parallel: buffers are plain tensors (inputs, labels, position tables), "
                        "not parameters or DTensors")
    lengths = [b.shape[d] for b, d in zip(buffers, seq_dims)]
    described = ", ".join(f"{tuple(b.shape)} dim {d}" for b, d in zip(buffers, seq_dims))
    failure = None
    try:
        if len(set(lengths)) != 1:
            raise ValueError(f"context_parallel: the buffers' sequence lengths differ: {described}")
        shards = SequenceShards.of(lengths[0], mesh.size())
    except ValueError as error:
        failure = error
    agree(mesh.ranks, "context_parallel", f"{described} over {mesh.size()} ranks", failed=failure)
    if failure is not None:
        raise failure

    kept = [None if any(b is r for r in no_restore) else b.clone() for b in buffers]
    with torch.no_grad():
        for buffer, dim in zip(buffers, seq_dims):
            piece = buffer.index_select(dim, shards.positions(mesh.position(), buffer.device))
            buffer.resize_(piece.shape)
            buffer.copy_(piece)
    attention = _ContextParallelAttention(mesh, shards)
    replaced, F.scaled_dot_product_attention = F.scaled_dot_product_attention, attention.attention
    try:
        with attention:
            yield
    finally:
        F.scaled_dot_product_attention = replaced
        with torch.no_grad():
            for buffer, whole in zip(buffers, kept):
                if whole is not None:
                    buffer.resize_(whole.shape)
                    buffer.copy_(whole)
