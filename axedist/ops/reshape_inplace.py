"""In-place ops that change their tensor's shape: ``squeeze_``, ``unsqueeze_``, ``t_``,
``transpose_`` (``swapdims_`` / ``swapaxes_``), ``as_strided_``, ``resize_``, ``resize_as_``.

Every other in-place op keeps its tensor's shape, and the dispatcher keeps its layout. These
change the shape, so the DTensor must change too: its out-of-place form runs through the
dispatcher (the view rules: nothing moves where the layout regroups for the new shape) and the
DTensor is rebound to that result: its spec, its local tensor (a view of the old one where the
rule moved nothing) and the wrapper's own sizes and strides. torch's CPU kernels call these
on their own outputs (``matmul`` of a 1-D input ``squeeze_``s the product of the unsqueezed
vector, ``quantile`` ``transpose_``s and ``squeeze_``s its result): without the rebinding the
DTensor kept its old shape, a silently wrong result.

    >>> x = distribute(torch.randn(4, 1, 3), mesh, [Shard(0)])   # 2 ranks: local (2, 1, 3)
    >>> x.squeeze_(1).shape, x.placements, x.to_local().shape
    (torch.Size([4, 3]), (Shard(dim=0),), torch.Size([2, 3]))
"""

from __future__ import annotations

import math

import torch

from ..runtime import redistribute_local
from ..spec import make_spec, replicated_layout
from .call_plan import DispatchError

__all__ = ["RESHAPING_INPLACE", "dispatch_reshaping_inplace", "rebind"]

aten = torch.ops.aten


def _overloads(name: str) -> list:
    packet = getattr(aten, name, None)
    return [getattr(packet, o) for o in packet.overloads()] if packet is not None else []


# in-place view op -> its out-of-place form (same arguments)
_VIEW_FORMS = {
    aten.squeeze_.default: aten.squeeze.default,
    aten.squeeze_.dim: aten.squeeze.dim,
    aten.squeeze_.dims: aten.squeeze.dims,
    aten.unsqueeze_.default: aten.unsqueeze.default,
    aten.t_.default: aten.t.default,
    aten.transpose_.default: aten.transpose.int,
    aten.as_strided_.default: aten.as_strided.default,
    # composite: they reach the dispatcher only undecomposed (inference mode)
    **{op: aten.transpose.int for op in _overloads("swapdims_") + _overloads("swapaxes_")},
}
_RESIZES = (aten.resize_.default, aten.resize_as_.default)
RESHAPING_INPLACE = frozenset(_VIEW_FORMS) | frozenset(_RESIZES)


def dispatch_reshaping_inplace(d, func, args, kwargs):
    """Run an in-place op of ``RESHAPING_INPLACE`` on DTensor ``args[0]``: the result is ``args[0]``
    with its new shape (``d``: the dispatcher, whose ``dispatch`` runs the out-of-place form)."""
    dt = args[0]
    if not isinstance(dt, d.cls):
        raise DispatchError(f"{func}: self is a plain tensor among DTensor arguments")
    if func in _RESIZES:
        return _resize(d, func, args, kwargs)
    if func is aten.as_strided_.default and not _plain_storage(dt):
        raise DispatchError(f"{func} on a DTensor of strides {tuple(dt.stride())} over its shape "
                            f"{tuple(dt.shape)}: as_strided reads a storage order, and a DTensor's only storage "
                            f"order is its contiguous one; call .contiguous() first")
    result = d.dispatch(_VIEW_FORMS[func], args, kwargs)
    rebind(dt, result)
    return dt


def _plain_storage(dt) -> bool:
    """Is ``dt``'s element order its storage order (contiguous, no offset)?"""
    return dt.is_contiguous() and dt.storage_offset() == 0


def _resize(d, func, args, kwargs):
    """``resize_`` / ``resize_as_``: same size, nothing; the same element count on a contiguous
    tensor, a view (the layout regrouped where it can be); else the whole tensor's elements,
    cut short or grown with zeros (torch leaves grown elements uninitialized), replicated."""
    dt = args[0]
    if func is aten.resize_as_.default:
        other = args[1]
        shape = tuple(other.shape)
        memory_format = kwargs.get("memory_format", args[2] if len(args) > 2 else None)
    else:
        shape = tuple(args[1])
        memory_format = kwargs.get("memory_format", args[2] if len(args) > 2 else None)
    if memory_format not in (None, torch.contiguous_format, torch.preserve_format):
        raise DispatchError(f"{func}(memory_format={memory_format}) on a DTensor: only the contiguous format is "
                            f"supported")
    if shape == tuple(dt.shape):
        return dt  # torch: same sizes keep the tensor as it is, strides included
    if not _plain_storage(dt):
        raise DispatchError(f"{func} of a DTensor of strides {tuple(dt.stride())} over its shape "
                            f"{tuple(dt.shape)}: resize_ keeps the storage order, and a DTensor's only storage "
                            f"order is its contiguous one; call .contiguous() first")
    if math.prod(shape) == dt.numel():
        rebind(dt, d.dispatch(aten.view.default, (dt, list(shape)), {}))
        return dt
    spec = dt._spec
    whole_spec = make_spec(spec.mesh, replicated_layout(spec.shape, spec.mesh), spec.shape)
    whole = redistribute_local(dt._local, spec, whole_spec).reshape(-1)
    grown = whole.new_zeros(math.prod(shape))
    kept = min(whole.numel(), grown.numel())
    grown[:kept] = whole[:kept]
    new_spec = make_spec(spec.mesh, replicated_layout(shape, spec.mesh), shape)
    rebind(dt, d.cls(grown.view(shape), new_spec))
    return dt


def rebind(dt, result) -> None:
    """Make the DTensor ``dt`` the tensor ``result`` is: its spec, local tensor, sizes, strides.

    The wrapper's own sizes and strides change as torch changes a wrapper subclass's in an
    in-place view op: the op runs on the wrapper's metadata alone (meta kernels, nothing
    dispatched to the subclass)."""
    local = result._local
    dt._value, dt._spec, dt._tag, dt._pending, dt._traced_as = local, result._spec, None, None, None
    shape, stride = tuple(result.shape), tuple(result.stride())
    if tuple(dt.shape) == shape and tuple(dt.stride()) == stride:
        return
    with torch.utils._mode_utils.no_dispatch():
        meta = torch._C._meta_in_tls_dispatch_include()
        torch._C._set_meta_in_tls_dispatch_include(True)
        try:
            with torch._C._AutoDispatchBelowAutograd():
                aten.resize_.default(dt, shape)  # grows the wrapper's (dataless) storage if needed
                aten.as_strided_.default(dt, shape, stride, 0)
        finally:
            torch._C._set_meta_in_tls_dispatch_include(meta)
