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
global position. Everything else in the model is per position and runs on the pieces as it is; the
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

__all__ = ["SequenceShards", "context_parallel"]

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
        if func is _SDPA and not self.busy:
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
            return _SDPA(query, key, value, dropout_p=dropout_p, scale=scale,
                                                  enable_gqa=enable_gqa)
        return self.causal(query, key, value, dropout_p, scale, enable_gqa)

    def gather(self, piece: torch.Tensor) -> torch.Tensor:
        """Every rank's piece, rank after rank, along the sequence dim; each rank's gradient of
        it is a summand of the pieces' gradients (a reduce-scatter on the way back)."""
        whole = DTensor.from_local(piece, self.mesh, [Shard(_SEQUENCE_DIM)], run_check=False)
        return whole.redistribute(self.mesh, [Replicate()]).to_local(grad_placements=[Partial()])

    def causal(self, query, key, value, dropout_p, scale, enable_gqa):
        """Causal attention of this rank's queries to the gathered keys: the keys put in position
        order, each run of this rank's positions ``[start, stop)`` attends to keys ``[0, stop)``
        with the causal mask aligned to its lower right (query ``stop - 1`` sees every key), so
        the fused kernels skip the masked half as they do for ``is_causal`` (a boolean mask
        would not). Rank 0 of 8 positions on 2 ranks: queries 0-1 over keys 0-1, 6-7 over 0-7."""
        from torch.nn.attention.bias import CausalBias, causal_lower_right  # (imports triton: here, not at import)

        if self.shards.balanced:
            order = self.inverse_orders.get(key.device)
            if order is None:
                order = self.inverse_orders[key.device] = torch.argsort(self.shards.order(key.device))
            key, value = key.index_select(_SEQUENCE_DIM, order), value.index_select(_SEQUENCE_DIM, order)
        heads, kv_heads = query.shape[1], key.shape[1]
        if enable_gqa and heads != kv_heads:  # (a lower-right causal bias takes no enable_gqa on every kernel)
            if heads % kv_heads:
                raise ValueError(f"scaled_dot_product_attention(enable_gqa=True): {heads} query heads are not a "
                                 f"multiple of {kv_heads} key heads")
            key, value = (t.repeat_interleave(heads // kv_heads, dim=1) for t in (key, value))
        runs, offset = [], 0
        for start, stop in self.shards.spans(self.mesh.position()):
            rows = query.narrow(_SEQUENCE_DIM, offset, stop - start)
            offset += stop - start
            # the bias's own dispatch, called as such: under a DTensor loss's backward (an activation
            # checkpoint's recomputation) torch-function subclasses are off and the bias would be a plain mask
            runs.append(CausalBias._dispatch(
                rows, key.narrow(_SEQUENCE_DIM, 0, stop), value.narrow(_SEQUENCE_DIM, 0, stop),
                attn_mask=causal_lower_right(stop - start, stop), dropout_p=dropout_p, scale=scale))
        return runs[0] if len(runs) == 1 else torch.cat(runs, dim=_SEQUENCE_DIM)


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
