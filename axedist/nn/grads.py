"""Gradients that arrive as pending sums, reduced once per backward, many in one collective.

A replicated parameter used on sharded activations (a sequence-parallel RMSNorm's weight, a
bias) gets its gradient as a pending sum over the mesh axes that split the activations: each
rank holds the sum over its own rows. Left pending, every later use reduces it again (AdamW
reads a gradient three times: three all-reduces per parameter per step), and each reduction
of a small vector is latency-bound. Instead, at the end of each backward the pending
gradients of a module's parameters are reduced together: one flat all-reduce per (mesh,
placements, dtype), and each parameter's gradient becomes the replicated sum.

Example: a TP + SP Llama of 2 layers has 5 RMSNorm weights of ``dim`` elements; after
``loss.backward()`` their gradients are replicated, reduced by ONE all-reduce of
``5 * dim`` elements (before: 15 all-reduces of ``dim`` inside ``optimizer.step()``).

Gradients accumulated over several backward calls stay correct (a later backward's pending
sum is added to the replicated one, and that addition reduces it); FSDP's parameters are left
to FSDP, which reduces their gradients in its own route.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.tensor import Partial, Replicate

from ..dtensor import DTensor
from ..layout import LayoutError

__all__ = ["reduce_pending_grads"]


class _Bucket:
    """The parameters whose gradient is a pending sum in the running backward."""

    def __init__(self):
        self.params: list[nn.Parameter] = []
        self.queued = False

    def add(self, param: nn.Parameter) -> None:
        grad = param.grad
        if not isinstance(grad, DTensor) or not _pending_only(_placements(grad)):
            return
        self.params.append(param)
        if not self.queued:
            self.queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self.flush)

    def flush(self) -> None:
        params, self.params, self.queued = self.params, [], False
        groups: dict[tuple, list[nn.Parameter]] = {}
        for p in params:
            grad = p.grad
            placements = _placements(grad) if isinstance(grad, DTensor) else None
            if _pending_only(placements):  # not reduced by someone else since
                groups.setdefault((grad.mesh, placements, grad.dtype, grad.device, p.placements), []).append(p)
        for (mesh, placements, _, _, target), members in groups.items():
            _reduce_together(members, mesh, placements, target)


def _placements(t: DTensor):
    """``t``'s placements, or None for a layout no placements express (left alone here)."""
    try:
        return t.placements
    except LayoutError:
        return None


def _pending_only(placements) -> bool:
    """A pending sum (some axis Partial) with nothing sharded: what a flat concatenation can carry."""
    return placements is not None and any(isinstance(p, Partial) for p in placements) and all(
        isinstance(p, (Partial, Replicate)) for p in placements)


def _reduce_together(params: list[nn.Parameter], mesh, placements, target) -> None:
    """One collective for all of ``params``' pending gradients; each becomes ``target`` (its
    parameter's placements: replicated, so its piece is the whole gradient)."""
    flat = torch.cat([p.grad.to_local().reshape(-1) for p in params])
    reduced = DTensor.from_local(flat, mesh, list(placements)).redistribute(mesh, list(target)).to_local()
    offset = 0
    for p in params:
        n = p.numel()
        p.grad = DTensor.from_local(reduced[offset:offset + n].view(p.shape), mesh, list(target), shape=p.shape)
        offset += n


def reduce_pending_grads(module: nn.Module) -> nn.Module:
    """Reduce ``module``'s pending-sum gradients once per backward, coalesced (see the module
    docstring). Idempotent; ``parallelize`` calls it. Returns ``module``."""
    bucket = _Bucket()
    for param in module.parameters():
        placements = _placements(param) if isinstance(param, DTensor) else None
        if param.requires_grad and placements is not None and all(isinstance(p, Replicate) for p in placements) \
                and not getattr(param, "_axedist_grads_hooked", False):
            param.register_post_accumulate_grad_hook(bucket.add)
            param._axedist_grads_hooked = True
    return module
