"""Fully sharded data parallel (FSDP, HSDP) on the same mesh as tensor parallelism, as layouts.

``fully_shard(module, mesh)`` shards every parameter of ``module`` (not already sharded by a
``fully_shard`` of a submodule) over the mesh's data-parallel axes. A parameter stays ONE
axedist DTensor on the whole mesh, and its layout says how both kinds of parallelism cut it.
Mesh ``("dp", "tp") = (2, 2)``, an ``(8, 6)`` weight that ``ColwiseParallel`` split on ``tp``
(``S[(2,4,6):(1@tp,6,1)]`` on ``mesh["tp"]``)::

    >>> mesh = ax.init_mesh((2, 2), ("dp", "tp"))
    >>> parallelize(model, mesh["tp"], llama_tp_plan(cfg))
    >>> for block in model.layers:
    ...     fully_shard(block, mesh)
    >>> fully_shard(model, mesh)
    >>> model.layers[0].attention.wq.weight.axe_layout      # rows tp-major, then dp, then 2 local rows
    S[(2,2,2,6):(1@tp,1@dp,6,1)]

Before a unit (a module given to ``fully_shard``) runs, its parameters are all-gathered over
``dp``: the redistribute from that layout to the one with the ``dp`` iter replaced by a replica
(``S[(2,4,6):(1@tp,6,1)] + R[2:1@dp]``), planned by layout inference like any other. The module
computes with the gathered value as the DTensor on ``mesh["tp"]`` it had before (same local
tensor, no copy), so the tensor-parallel styles run unchanged. After the unit the gathered
values are freed (``reshard_after_forward``), the next unit's gather having been started
ahead (on a side stream on CUDA); backward gathers again. A gradient arrives per dp rank (each
saw its own batch): it is read as a pending sum over ``dp`` (a summand dim on the dp axis, the
tensor-parallel layout inside) and moved to the sharded layout, which is a reduce-scatter over
``dp`` (plus, for a gradient pending over ``tp``, the ``tp`` reduction; for HSDP, the
all-reduce over the replicate axes), in ``reduce_dtype``. Optimizers, ``state_dict`` and DCP see
only the sharded parameters.

``fully_shard(model, mesh, traced=True)`` shards the same way with no hooks: each parameter's
gather and its gradient's reduce-scatter are a ``redistribute`` inside the forward of the module
that uses it (``GatheredView``), so ``torch.compile(model, fullgraph=True)`` compiles dp x tp as
one graph and the compiler schedules the gathers; or each block compiled alone
(``block.compile()``): one graph serves every alike block, each gathering its own parameters.

``fully_shard(block, mesh=world_mesh, dp_mesh_dims=DataParallelMeshDims(shard="dp"))`` is torch's
spelling of a model whose parameters are already DTensors on the whole mesh, replicated over the
data-parallel axes (``S[(2,4,6):(1@tp,6,1)] + R[2:1@dp]``): the same sharded layout, and the
modules compute with those whole-mesh DTensors, as they were.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import math
import re
import weakref
from dataclasses import dataclass, field
from typing import Sequence

import torch
from torch import nn
import torch.distributed.fsdp as torch_fsdp
from torch.distributed.fsdp import MixedPrecisionPolicy
from torch.distributed.tensor import Partial, Replicate
from torch.nn.utils import parametrize
from torch.utils._pytree import tree_flatten, tree_map, tree_unflatten

from ..caches import cached, memo
from ..dtensor import DTensor
from ..layout import MEMORY_AXIS, Iter, Layout, LayoutError, row_major_memory
from ..mesh import DeviceMesh, MeshError, as_mesh, init_mesh
from ..planning import plan_redistribute
from ..planning.holdings import true_boxes
from ..planning.repad import side_of
from ..runtime import redistribute_local
from ..runtime.deferred import flush
from ..spec import (DTensorSpec, chunk, make_spec, placements_of, replicated_layout, row_major_iters, target_spec,
                    without_summands)

try:  # torch >= 2.13 (the CPU machines' torch)
    from torch.distributed.fsdp import DataParallelMeshDims
except ImportError:  # an older torch (2.11 on the GPU machines) lacks the class: the same fields and names
    @dataclass(frozen=True)
    class DataParallelMeshDims:  # type: ignore[no-redef]
        """torch 2.13's ``DataParallelMeshDims(shard="dp", replicate=None)`` on an older torch:
        the mesh dims ``fully_shard(..., dp_mesh_dims=)`` shards and replicates over."""

        shard: str | tuple[str, ...] | None = None
        replicate: str | tuple[str, ...] | None = None

        @property
        def shard_names(self) -> tuple[str, ...]:
            return (self.shard,) if isinstance(self.shard, str) else tuple(self.shard or ())

        @property
        def replicate_names(self) -> tuple[str, ...]:
            return (self.replicate,) if isinstance(self.replicate, str) else tuple(self.replicate or ())

__all__ = ["MixedPrecisionPolicy", "DataParallelMeshDims", "FSDPUnit", "FSDPModule", "UnshardHandle",
           "ShardedParameter", "FlatLayout", "fully_shard", "fsdp_units", "register_fsdp_forward_method",
           "share_comm_ctx", "data_parallel_specs", "pending_gradient_spec", "GatheredView", "shard_traced"]


NO_CASTS = MixedPrecisionPolicy()  # compute in the parameters' dtype, reduce in it too

# ---------------------------------------------------------------------------
# Layouts: unsharded (replicated over the data axes) and sharded
# ---------------------------------------------------------------------------


def _replicas(mesh: DeviceMesh, axes) -> list[Iter]:
    return [Iter(mesh.size(a), 1, a) for a in mesh.axis_names if a in axes]


def _data_size(mesh: DeviceMesh, axes) -> int:
    return math.prod(mesh.size(a) for a in axes)


def data_parallel_specs(view: DTensorSpec | None, shape, mesh: DeviceMesh, shard_axes: Sequence[str],
                        replicate_axes: Sequence[str] = (), dim: int = 0) -> tuple[DTensorSpec, DTensorSpec]:
    """``(gathered, sharded)`` specs on ``mesh`` of a parameter that a module sees in spec ``view``
    (a DTensor on a sub-mesh of the other axes, or on ``mesh`` replicated over the data axes, as
    torch's ``dp_mesh_dims`` has it; ``None``: a plain tensor of ``shape``).

    ``gathered`` is ``view``'s layout replicated over every other axis of ``mesh``; ``sharded``
    cuts each (tensor-parallel) local tensor's dim ``dim`` (torch's ``Shard(dim)`` of
    ``shard_placement_fn``; default 0) over ``shard_axes`` as ``torch.chunk`` does, padding where
    it does not divide. ``(8, 6)`` as ``S[(2,4,6):(1@tp,6,1)]`` on ``tp``, mesh ``(dp, tp) = (2,
    2)``: gathered ``S[(2,4,6):(1@tp,6,1)] + R[2:1@dp]``, sharded ``S[(2,2,2,6):(1@tp,1@dp,6,1)]``;
    on dim 1, ``S[(2,4,2,3):(1@tp,3,1@dp,1)]`` (local ``(4, 3)``). A ``(10, 6)`` weight (5 rows per
    tp rank, 3 + 2 per dp rank) is padded to 12 rows, the padding in the middle: ``true_index``
    rows ``0..4, -, 5..9, -``.
    """
    if view is None:
        gathered = make_spec(mesh, replicated_layout(tuple(shape), mesh), tuple(shape))
    else:
        others = [a for a in mesh.axis_names if a not in view.mesh.axis_names]
        layout = Layout(view.layout.shard, view.layout.replica + tuple(_replicas(mesh, others)), view.layout.offset)
        gathered = make_spec(mesh, layout, view.shape, view.padded, true_index=view.true_index)
    if gathered.shape and not 0 <= dim < len(gathered.shape):
        raise ValueError(f"data_parallel_specs: dim {dim} is out of range for shape {gathered.shape}")
    return gathered, _sharded(gathered, shard_axes, replicate_axes, dim)


def _sharded(gathered: DTensorSpec, shard_axes, replicate_axes, dim: int) -> DTensorSpec:
    mesh = gathered.mesh
    parts = _data_size(mesh, shard_axes)
    if not gathered.shape or parts == 1:  # a scalar (or one shard): replicated, its gradient all-reduced
        return gathered
    blocks = [list(b) for b in gathered.layout.blocks(gathered.padded)]
    cut = blocks[dim]
    memory = [i for i, it in enumerate(cut) if it.axis == MEMORY_AXIS]
    if not memory:  # one local row: an m iter of extent 1 to split
        cut.append(Iter(1, 1))
        memory = [len(cut) - 1]
    local_rows, rows_of = _local_rows(gathered, dim, cut, memory)
    shard_iters = [Iter(mesh.size(a), 1, a) for a in mesh.axis_names if a in shard_axes]
    padded, true_index = gathered.padded, gathered.true_index
    outer = cut[memory[0]]
    if local_rows % parts == 0 and all(n == local_rows for n in rows_of.values()) and outer.extent % parts == 0:
        cut[memory[0]:memory[0] + 1] = shard_iters + [Iter(outer.extent // parts, 1)]
    elif len(memory) == 1:
        size = -(-local_rows // parts)
        rows = _uneven_rows(gathered, dim, cut, memory[0], parts, size, rows_of)
        cut[memory[0]:memory[0] + 1] = shard_iters + [Iter(size, 1)]
        padded = padded[:dim] + (padded[dim] // local_rows * parts * size,) + padded[dim + 1:]
        kept = gathered.true_index or (None,) * len(padded)
        true_index = kept[:dim] + (rows,) + kept[dim + 1:]
    else:
        raise LayoutError(f"fully_shard: dim {dim} of {gathered} holds its local rows in several pieces "
                          f"({[it for it in cut if it.axis == MEMORY_AXIS]}); they split over {parts} data-parallel "
                          f"ranks only when the outermost piece divides by {parts}")
    _, strides = row_major_memory(blocks)
    shard = [Iter(it.extent, stride, MEMORY_AXIS) if stride is not None else it
             for block, row in zip(blocks, strides) for it, stride in zip(block, row)]
    replica = [it for it in gathered.layout.replica if it.axis not in shard_axes]
    layout = Layout(shard, replica, gathered.layout.offset)
    return make_spec(mesh, layout, gathered.shape, padded, true_index=true_index)


def _digits_of(block, index: int) -> list[int]:
    out = []
    for it in reversed(block):
        out.append(index % it.extent)
        index //= it.extent
    return out[::-1]


def _index_of(block, digits) -> int:
    index = 0
    for it, d in zip(block, digits):
        index = index * it.extent + d
    return index


def _true_row(spec: DTensorSpec, dim: int, padded_row: int) -> int:
    """The true index along ``dim`` of padded index ``padded_row`` (-1: padding)."""
    if spec.true_index and spec.true_index[dim] is not None:
        return spec.true_index[dim][padded_row]
    return padded_row if padded_row < spec.shape[dim] else -1


def _local_rows(spec: DTensorSpec, dim: int, block, memory: list[int]) -> tuple[int, dict]:
    """The padded local rows of ``dim`` (its indices in each local tensor), and the true ones per
    choice of its device digits (the true rows are a leading range of each local tensor:
    DTensorSpec checks it)."""
    extent = math.prod(block[i].extent for i in memory)
    counts: dict[tuple, int] = {}
    for index in range(math.prod(it.extent for it in block)):
        digits = _digits_of(block, index)
        key = tuple(d for i, d in enumerate(digits) if i not in memory)
        counts[key] = counts.get(key, 0) + (_true_row(spec, dim, index) >= 0)
    return extent, counts


def _uneven_rows(spec: DTensorSpec, dim: int, block, at: int, parts: int, size: int, rows_of: dict):
    """True row of each padded row of ``dim`` once each local tensor's ``n`` true rows are chunked
    ``torch.chunk``-wise into ``parts`` pieces of ``size`` slots (as torch's fully_shard does);
    ``None`` where that is the true rows then padding at the end."""
    new_block = block[:at] + [Iter(parts, 1, "d"), Iter(size, 1)] + block[at + 1:]
    mapping = []
    for index in range(math.prod(it.extent for it in new_block)):
        digits = _digits_of(new_block, index)
        piece, slot = digits[at], digits[at + 1]
        rest = digits[:at] + digits[at + 2:]
        start, count = chunk(rows_of[tuple(rest)], parts, piece)
        if slot >= count:
            mapping.append(-1)
            continue
        old = rest[:at] + [start + slot] + rest[at:]
        mapping.append(_true_row(spec, dim, _index_of(block, old)))
    n = spec.shape[dim]
    if mapping[:n] == list(range(n)) and all(m < 0 for m in mapping[n:]):
        return None
    return tuple(mapping)


def pending_gradient_spec(grad: DTensorSpec | None, shape, mesh: DeviceMesh, data_axes: Sequence[str]) -> DTensorSpec:
    """A gradient each data-parallel rank computed on its own batch, read as a pending sum over
    ``data_axes`` on ``mesh``: a leading summand dim on those axes, then ``grad``'s layout (its own
    summands first where it is pending over tensor-parallel axes). ``grad`` ``None``: a plain
    tensor of ``shape``. ``(8, 6)`` in ``S[(2,4,6):(1@tp,6,1)]`` on ``tp``, mesh ``(dp, tp)``:
    ``S[(2,2,4,6):(1@dp,1@tp,6,1)]``, sum over 2 summands."""
    return _pending_gradient_spec(grad, tuple(shape), mesh, tuple(data_axes))


@cached(maxsize=4096)  # per parameter per backward on the alone path: one spec per (layout, shape, axes)
def _pending_gradient_spec(grad: DTensorSpec | None, shape: tuple, mesh: DeviceMesh, data_axes: tuple) -> DTensorSpec:
    lead = _replicas(mesh, data_axes)
    parts = _data_size(mesh, data_axes)
    if grad is None:
        others = [a for a in mesh.axis_names if a not in data_axes]
        layout = Layout(lead + row_major_iters(shape), _replicas(mesh, others))
        return make_spec(mesh, layout, shape, None, "sum", parts)
    if grad.reduce_op not in (None, "sum"):
        raise LayoutError(f"a gradient pending a {grad.reduce_op} cannot be summed over the data-parallel ranks")
    others = [a for a in mesh.axis_names if a not in grad.mesh.axis_names and a not in data_axes]
    kept = tuple(it for it in grad.layout.replica if it.axis not in data_axes)  # (a gradient on the whole mesh)
    layout = Layout(lead + list(grad.layout.shard), kept + tuple(_replicas(mesh, others)), grad.layout.offset)
    summands = parts * (grad.summands if grad.reduce_op else 1)
    return make_spec(mesh, layout, grad.shape, grad.padded, "sum", summands, grad.true_index)


# ---------------------------------------------------------------------------
# A unit's parameters as one flat tensor (one collective per unit, not per parameter)
# ---------------------------------------------------------------------------


@dataclass(frozen=True)
class FlatLayout:
    """Where each parameter sits in a unit's flat buffer, and the flat buffer's three specs.

    Each rank's buffer holds, at ``offsets[i]``, parameter ``i``'s shard padded to its padded
    local size. Over the mesh the buffers form a tensor of shape ``(*other axes, *shard axes,
    length)``, one buffer per device; ``sharded`` lays it out over every axis (``S[(2,2,L):(1@tp,
    1@dp,1)]`` on ``(dp, tp) = (2, 2)``), ``gathered`` keeps the other axes and makes the shard
    axes local (``S[(2,2,L):(1@tp,L,1)] + R[2:1@dp]``: the all-gather over ``dp``), and
    ``pending`` is the gradients' sum over the data axes before the reduce-scatter back to
    ``sharded``. A parameter's gathered local tensor is its ``dp`` pieces one after the other
    along the dim it is sharded on (``data_parallel_specs`` cuts that dim ``dp``-major), so no
    interleaving is needed.
    """

    records: tuple
    offsets: tuple[int, ...]
    length: int
    sharded: DTensorSpec
    gathered: DTensorSpec
    pending: DTensorSpec

    @property
    def parts(self) -> int:
        return math.prod(self.gathered.local_padded[:-1])

    def __repr__(self) -> str:
        return (f"FlatLayout({len(self.records)} parameters, {self.length} elements per rank: sharded "
                f"{self.sharded.layout}, gathered {self.gathered.layout})")


def _flat_layout(unit: "FSDPUnit", records, summed: tuple = ()) -> FlatLayout:
    """``summed``: tensor-parallel axes the gradients are also pending over (the parameters are
    replicated there: sequence-parallel norms), reduced in the same collective."""
    mesh = unit.mesh
    offsets, length = [], 0
    for r in records:
        offsets.append(length)
        length += r.slot
    others = [a for a in mesh.axis_names if a not in unit.data_axes and a not in summed]
    shard = [a for a in mesh.axis_names if a in unit.shard_axes]
    size = mesh.size
    shape = tuple(size(a) for a in others + shard) + (length,)
    devices = [Iter(size(a), 1, a) for a in others]
    local, inner = [], length
    for a in reversed(shard):  # the shard axes as local dims, row-major over (shard axes, length)
        local.insert(0, Iter(size(a), inner))
        inner *= size(a)
    rest = [Iter(length, 1)]
    replicate = _replicas(mesh, unit.replicate_axes + summed)
    sharded = make_spec(mesh, Layout(devices + [Iter(size(a), 1, a) for a in shard] + rest, replicate), shape)
    gathered = make_spec(mesh, Layout(devices + local + rest, replicate + _replicas(mesh, unit.shard_axes)), shape)
    pending = make_spec(mesh, Layout(_replicas(mesh, unit.data_axes + summed) + devices + local + rest), shape, None,
                        "sum", unit.data_parallel_size * _data_size(mesh, summed))
    return FlatLayout(tuple(records), tuple(offsets), length, sharded, gathered, pending)


def _box(t: torch.Tensor, shape) -> torch.Tensor:
    """The leading box ``shape`` of ``t`` (a true local tensor inside its padded one)."""
    for d, n in enumerate(shape):
        if n != t.shape[d]:
            t = t.narrow(d, 0, n)
    return t


# ---------------------------------------------------------------------------
# One parameter
# ---------------------------------------------------------------------------


def _own(local: torch.Tensor, other: torch.Tensor) -> torch.Tensor:
    """``local`` as a tensor that owns exactly its storage (it is freed by resizing that storage),
    sharing nothing with ``other`` (the shard)."""
    storage = local.untyped_storage()
    if (local.storage_offset() == 0 and local.is_contiguous()
            and storage.nbytes() == local.numel() * local.element_size()
            and storage.data_ptr() != other.untyped_storage().data_ptr()):
        return local
    return local.clone(memory_format=torch.contiguous_format)


@dataclass(eq=False)
class ShardedParameter:
    """One parameter of an FSDP unit: ``param`` (the sharded DTensor on the whole mesh, what the
    optimizer, ``state_dict`` and DCP see), the module slots that hold it, the spec the modules
    compute with (``view``: the tensor-parallel DTensor's; ``None``: a plain tensor), and ``dim``,
    the dim its data-parallel shards cut (``shard_placement_fn``'s ``Shard(dim)``; default 0)."""

    name: str
    param: nn.Parameter
    slots: list
    view: DTensorSpec | None
    gathered_spec: DTensorSpec
    unit: "FSDPUnit"
    gathered: torch.Tensor | None = None   # this rank's unsharded local tensor, while gathered
    dim: int = 0

    @property
    def sharded_spec(self) -> DTensorSpec:
        return self.param._spec

    @property
    def batched(self) -> bool:
        """Sharded over the data axes: it travels in the unit's flat buffer (else it is gathered
        and reduced alone: a scalar, or one data-parallel rank)."""
        return self.sharded_spec != self.gathered_spec

    @property
    def slot(self) -> int:
        return math.prod(self.sharded_spec.local_padded)

    @functools.cached_property
    def pieces(self) -> tuple[tuple[int, ...], ...]:
        """The true local shapes of the shards of this rank's data-parallel group, in order: the
        gathered local tensor is them one after the other along ``dim``."""
        mesh, unit = self.unit.mesh, self.unit
        side = side_of(self.sharded_spec)
        boxes = true_boxes(side.layout, side.full, side.rows, mesh)
        here = mesh.coordinates()
        shard = [a for a in mesh.axis_names if a in unit.shard_axes]
        out = []
        for digits in itertools.product(*(range(mesh.size(a)) for a in shard)):
            out.append(boxes[mesh.position(mesh.rank_at({**here, **dict(zip(shard, digits))}))])
        return tuple(out)

    @property
    def index(self) -> int:
        """This rank's place in its data-parallel group's shards."""
        here, mesh = self.unit.mesh.coordinates(), self.unit.mesh
        index = 0
        for a in mesh.axis_names:
            if a in self.unit.shard_axes:
                index = index * mesh.size(a) + here[a]
        return index

    def shard_for_gather(self) -> torch.Tensor:
        local = self.param.to_local()
        if self.unit.offload is not None:
            local = self.unit.offload.to_device(local)
        dtype = self.unit.mp_policy.param_dtype
        return local.to(dtype) if dtype is not None and local.is_floating_point() else local

    # -- through the flat buffer ------------------------------------------------------------

    def pack(self, row: torch.Tensor, offset: int, value: torch.Tensor) -> None:
        """Write a true local shard into its slot of a flat buffer row."""
        slot = row[offset:offset + self.slot].view(self.sharded_spec.local_padded)
        _box(slot, value.shape).copy_(value)

    def place_gathered(self, rows: torch.Tensor, offset: int) -> None:
        """Hold the gathered local tensor from the gathered flat buffer ``[parts, length]``."""
        padded = self.sharded_spec.local_padded
        pieces = [_box(rows[d, offset:offset + self.slot].view(padded), shape) for d, shape in enumerate(self.pieces)]
        if self.gathered is None:
            self.gathered = torch.cat(pieces, dim=self.dim)
        else:
            with self._refilling() as target:
                torch.cat(pieces, dim=self.dim, out=target)

    def pack_gradient(self, rows: torch.Tensor, offset: int, grad: torch.Tensor) -> None:
        """Cut this rank's gathered-layout gradient into the shards' rows of ``rows`` ``[parts, length]``."""
        sizes = [shape[self.dim] for shape in self.pieces]
        for d, piece in enumerate(torch.split(grad, sizes, dim=self.dim)):
            self.pack(rows[d], offset, piece)

    def unpack_shard(self, row: torch.Tensor, offset: int) -> torch.Tensor:
        slot = row[offset:offset + self.slot].view(self.sharded_spec.local_padded)
        return _box(slot, self.pieces[self.index]).clone()

    # -- alone ------------------------------------------------------------------------------

    def place_alone(self) -> None:
        """Hold the gathered local tensor, gathered alone: a parameter not sharded over the data
        axes (``batched`` False) has one spec sharded and gathered, so it is a copy of the shard."""
        local = self.shard_for_gather()
        if self.gathered is None:
            self.gathered = _own(local, self.param.to_local())
        else:
            with self._refilling() as target:
                target.copy_(local)

    def reduce_gradient(self, grad: torch.Tensor) -> DTensor:
        """The sharded gradient from this rank's gradient of the module value, alone (one route
        from the pending sum over the data axes): averaged over the data-parallel ranks (a sum of
        ``grad / n``), in ``reduce_dtype``."""
        unit = self.unit
        spec, local = (grad._spec, grad._local) if isinstance(grad, DTensor) else (None, grad)
        local = local.to(self.reduce_dtype) / unit.gradient_divisor
        if spec is None or not spec.reduce_op:
            local = local.unsqueeze(0)
        pending = pending_gradient_spec(spec, self.param.shape, unit.mesh, unit.data_axes)
        out = redistribute_local(local.contiguous(), pending, self.sharded_spec)
        return DTensor(out.to(self.param.dtype), self.sharded_spec)

    @property
    def reduce_dtype(self) -> torch.dtype:
        return self.unit.mp_policy.reduce_dtype or self.param.dtype

    def summed_axes(self, grad: torch.Tensor) -> tuple[str, ...] | None:
        """``()`` for a gradient in the layout the module saw, the axes it is pending over for one
        that is the pending sum of that layout over axes it replicates (a sequence-parallel norm's),
        else None (it is reduced alone). Such gradients join the unit's flat buffer."""
        if self.view is None:
            return None if isinstance(grad, DTensor) else ()
        if not isinstance(grad, DTensor):
            return None
        if grad._spec == self.view:
            return ()
        spec, view = grad._spec, self.view
        if spec.reduce_op != "sum" or spec.mesh != view.mesh:
            return None
        axes = tuple(a for a in view.mesh.axis_names if any(it.axis == a for it in view.layout.replica))
        summed = tuple(a for a in axes if any(it.axis == a for it in spec.layout.shard))
        if not summed:
            return None
        layout = Layout(_replicas(view.mesh, summed) + list(view.layout.shard),
                        [it for it in view.layout.replica if it.axis not in summed], view.layout.offset)
        expected = make_spec(view.mesh, layout, view.shape, view.padded, "sum", _data_size(view.mesh, summed),
                             view.true_index)
        return summed if expected == spec else None

    # -- the gathered value -------------------------------------------------------------------

    @contextlib.contextmanager
    def _refilling(self):
        """The gathered tensor, its freed storage allocated again, to be written in place: every
        gathered value of a step is one storage, so what autograd saved of it (in any forward of
        the step, a module called twice included) reads the values written here. Its version is
        kept (autograd checks saved tensors by it)."""
        target = self.gathered
        with torch.no_grad(), torch.autograd._unsafe_preserve_version_counter(target):
            storage = target.untyped_storage()
            if storage.nbytes() == 0:
                storage.resize_(target.numel() * target.element_size())
            yield target

    def free(self) -> int:
        """Release the gathered storage (views of it, saved by autograd, see the values the next gather refills in place)."""
        if self.gathered is None:
            return 0
        flush([self.gathered], releasing=True)  # deferred work that reads the gathered values runs before they go
        storage = self.gathered.untyped_storage()
        freed = storage.nbytes()
        storage.resize_(0)
        return freed

    def module_value(self) -> torch.Tensor:
        """What the modules compute with: the gathered tensor as the tensor-parallel DTensor (or
        plain tensor) they had, differentiable back to the sharded parameter."""
        return _Unshard.apply(self.param, self)

    def accumulate(self, grad: DTensor) -> None:
        if self.unit.offload is not None:
            (grad,) = self.unit.offload.to_host([grad])
        with torch.no_grad():
            if self.param.grad is None:
                self.param.grad = grad
            else:
                self.param.grad += grad

    def __repr__(self) -> str:
        dtype = str(self.param.dtype).replace("torch.", "")
        return f"ShardedParameter({self.name}: {dtype}{self.sharded_spec})"


class _Unshard(torch.autograd.Function):
    """Sharded parameter -> the gathered value as the modules see it. Backward hands the gradient
    to the unit, which reduce-scatters the unit's gradients together and sets ``param.grad``."""

    @staticmethod
    def forward(ctx, param, record: ShardedParameter):
        ctx.record = record
        if record.view is None:
            return record.gathered.detach()  # an alias: freeing the storage frees it too
        return DTensor(record.gathered, record.view)

    @staticmethod
    def backward(ctx, grad):
        ctx.record.unit.gradient_arrived(ctx.record, grad)
        return None, None


# ---------------------------------------------------------------------------
# A unit (one fully_shard call) and the order units run in
# ---------------------------------------------------------------------------

# Units whose forward is running, outermost first (the first is the root of this forward). Each module
# call of a unit pushes it (pre_forward) and pops it (leave_forward, which runs whether the call returned
# or raised).
_RUNNING: list = []

# How many steps (a root's forward starting a new one) this process has begun, over every model: what a
# unit gathered by hand (unshard()) serves only the step that begins next.
_STEPS = [0]


@dataclass(eq=False)
class _Schedule:
    """The root unit's record of one step: the order units ran forward (the next step prefetches
    by it), whether the end-of-backward callback is queued, gathered bytes now and at the peak."""

    order: list = field(default_factory=list)
    last_order: list = field(default_factory=list)
    callback_queued: bool = False
    live_bytes: int = 0
    peak_bytes: int = 0
    prefetches: int = 0

    def next_after(self, unit: "FSDPUnit", backward: bool):
        order = self.last_order if not backward else self._backward_order()
        if unit not in order:
            return None
        i = order.index(unit)
        return order[i + 1] if i + 1 < len(order) else None

    def _backward_order(self) -> list:
        order = self.order or self.last_order
        return order[:1] + order[1:][::-1]  # the root's outputs first, then the blocks in reverse

    def __repr__(self) -> str:
        names = [u.name or "<root>" for u in self.order or self.last_order]
        return (f"_Schedule(order={names}, {self.prefetches} prefetches, gathered now {self.live_bytes} B, "
                f"peak {self.peak_bytes} B)")


class FSDPUnit:
    """The state ``fully_shard`` attaches to a module (or to a group of modules, ``fully_shard([norm,
    output])``): its sharded parameters, the mesh and axes, and the hooks that gather before the
    first module of the group runs and free after the last one has."""

    def __init__(self, modules: Sequence[nn.Module], mesh: DeviceMesh, shard_axes: tuple, replicate_axes: tuple,
                 reshard_after_forward: bool, mp_policy: MixedPrecisionPolicy, name: str):
        self.modules, self.mesh, self.name = tuple(modules), mesh, name
        self.shard_axes, self.replicate_axes = shard_axes, replicate_axes
        self.data_axes = tuple(a for a in mesh.axis_names if a in shard_axes or a in replicate_axes)
        self.data_parallel_size = _data_size(mesh, self.data_axes)
        self.reshard_after_forward = reshard_after_forward
        self.reshard_after_backward = True
        self.requires_gradient_sync = True  # False: backward keeps the gradients here, unreduced (``_held``)
        self.mp_policy = mp_policy
        self.offload: _CPUOffload | None = None  # the shards on the CPU between uses (offload_policy)
        self.params: list[ShardedParameter] = []
        self.schedule = self.own_schedule = _Schedule()
        self._flat: dict = {}          # ("gather" | "reduce", dtype) -> FlatLayout
        self._started: dict = {}       # dtype -> (a started flat all-gather, its CUDA stream or None)
        self._grads: dict = {}         # ShardedParameter -> its gradient (gathered layout), until the flush
        self._held: dict = {}          # the same, summed over backwards that did not sync, in the reduce dtype
        self._reducing: list = []      # (started flat reduce-scatter, FlatLayout, records) until the end of backward
        self._awaited = 0              # gradients still to come this step
        self._input_hooks: list = []   # the multi-grad hooks on this step's inputs, removed at its end
        self._inputs_waiting = 0       # of those hooks, the ones whose inputs' gradients are still to come
        self._unhooked_calls = 0       # this step's calls with no input that needs a gradient (no hook)
        self._entered: set = set()     # the group's modules that ran since its gather (the group's forward)
        self._trained = False          # whether a module of the group's forward made outputs that need gradients
        self._in_step = False          # gathered by a forward whose step's backward has not ended
        self.gradient_divide_factor: float | None = None  # None: the data-parallel ranks' count (an average)
        self.forward_prefetch: list | None = None   # units to gather after this one's gather (None: the next in order)
        self.backward_prefetch: list | None = None  # the same in backward
        self._inside = weakref.WeakSet()  # units found to hold a module of this one's trees (``contains``)
        self._returned = False         # post_forward ran for the module call now ending (leave_forward)
        self._by_hand: int | None = None  # the step count when unshard() gathered for the next step
        self._started_at = 0           # the step count when the gathers in _started began

    def contains(self, other: "FSDPUnit") -> bool:
        """Whether a module of ``other`` is in this unit's module trees. pre_forward asks it of the
        running root at every nested unit's forward, so a unit once found inside is remembered (a
        walk of the root's tree costs ~0.4 us a module). The answer matters only for a root left in
        the running units by a forward that did not end (KeyboardInterrupt, or a compiled forward's
        error): a unit inside its tree then runs as part of the root's step."""
        if other in self._inside:
            return True
        mine = {id(m) for top in self.modules for m in top.modules()}
        if any(id(m) in mine for m in other.modules):
            self._inside.add(other)
            return True
        return False

    @property
    def gradient_divisor(self) -> float:
        """What each rank's gradient is divided by before the sum over the data-parallel ranks."""
        factor = self.gradient_divide_factor
        return self.data_parallel_size if factor is None else factor

    def flat_layout(self, kind: str, dtype: torch.dtype, records=None, summed: tuple = ()) -> FlatLayout:
        """The flat buffer of the unit's parameters that gather in ``dtype`` (``"gather"``), or of
        ``records``, whose gradients reduce in ``dtype``, also over ``summed`` (``"reduce"``)."""
        key = (kind, dtype, summed, None if records is None else tuple(records))  # (records hash by identity)
        if key not in self._flat:
            if kind == "gather":
                records = [p for p in self.params if p.batched and self._gather_dtype(p) == dtype]
            self._flat[key] = _flat_layout(self, records, summed)
        return self._flat[key]

    def _gather_dtype(self, p: ShardedParameter) -> torch.dtype:
        dtype = self.mp_policy.param_dtype
        return dtype if dtype is not None and p.param.is_floating_point() else p.param.dtype

    # -- gathering and freeing -------------------------------------------------------

    @property
    def is_gathered(self) -> bool:
        return any(p.gathered is not None and p.gathered.untyped_storage().nbytes() for p in self.params)

    def _start_gathers(self) -> dict:
        if self.offload is not None:
            self.offload.check(self)
        started = {}
        for dtype in dict.fromkeys(self._gather_dtype(p) for p in self.params if p.batched):
            flat = self.flat_layout("gather", dtype)
            row = torch.zeros(flat.length, dtype=dtype, device=self.mesh.device)
            for p, offset in zip(flat.records, flat.offsets):
                p.pack(row, offset, p.shard_for_gather())
            started[dtype] = _start(row.view(flat.sharded.local_padded), flat.sharded, flat.gathered)
        return started

    def prefetch(self) -> None:
        """Start this unit's all-gathers (on a side stream on CUDA, so they overlap compute)."""
        self.refresh()
        self._drop_stale_prefetch()
        if self.is_gathered or self._started or not any(p.batched for p in self.params):
            return
        self._started_at = _STEPS[0]
        self.schedule.prefetches += 1
        with torch.no_grad():
            if self.mesh.device_type == "cuda":
                stream = _side_stream("gather")
                stream.wait_stream(torch.cuda.current_stream())  # the shards' latest values
                with torch.cuda.stream(stream):
                    self._started = {k: (v, stream) for k, v in self._start_gathers().items()}
            else:
                self._started = {k: (v, None) for k, v in self._start_gathers().items()}

    def unshard(self) -> None:
        self.refresh()
        self._drop_stale_prefetch()
        if self.is_gathered:
            return
        with torch.no_grad():
            started = self._started or {k: (v, None) for k, v in self._start_gathers().items()}
            self._started = {}
            for dtype, (pending, stream) in started.items():
                if stream is not None:
                    torch.cuda.current_stream().wait_stream(stream)
                flat = self.flat_layout("gather", dtype)
                rows = pending.wait().reshape(flat.parts, flat.length)
                for p, offset in zip(flat.records, flat.offsets):
                    p.place_gathered(rows, offset)
            for p in self.params:
                if not p.batched:
                    p.place_alone()
        self._count(sum(p.gathered.untyped_storage().nbytes() for p in self.params))

    def reshard(self) -> None:
        self._by_hand = None  # (what unshard() gathered for the next step goes with it)
        self._count(-sum(p.free() for p in self.params))

    def _count(self, delta: int) -> None:
        s = self.schedule
        s.live_bytes += delta
        s.peak_bytes = max(s.peak_bytes, s.live_bytes)

    def refresh(self) -> None:
        """Take up parameters replaced in the modules (``adopt_assigned``); what was gathered or is
        being gathered of the old ones is dropped, so the next gather reads the new values."""
        if self.adopt_assigned():
            self.drop_prefetch()
            self.reshard()

    def _drop_stale_prefetch(self) -> None:
        """Drop started gathers of an earlier step (a prefetch of a unit that step never reached):
        the optimizer may have moved the shards since. unshard()'s for the step now beginning stay."""
        if self._started and self._started_at != _STEPS[0] and not self._gathered_for_this_step():
            self.drop_prefetch()

    def drop_prefetch(self) -> None:
        """Finish and drop the started gathers (a prefetch no forward or backward took up): their
        values may be stale by the next use."""
        with torch.no_grad():
            for pending, _ in self._started.values():
                pending.wait()
        self._started = {}

    def adopt_assigned(self) -> bool:
        """Sharded parameters put in the modules' slots since (``load_state_dict(..., assign=True)``,
        as torch's FSDP2 example loads a full state dict: ``nn.Parameter(distribute_tensor(full,
        p.device_mesh, p.placements))`` per parameter; or ``module.weight = ...``; with CPU offload a
        copy on the mesh's device is taken to the CPU, as torch's) become the unit's
        parameters, gathered from then on, as torch's FSDP2 re-reads them. Ignoring them would train
        the old values, so one that is not this parameter's sharded DTensor (same layout, shape,
        dtype and device) is an error. Whether any was replaced."""
        replaced = False
        for p in self.params:
            param = p.param
            for module, name in p.slots:
                if module._parameters[name] is not param:
                    break
            else:
                continue  # (the usual case, checked at every gather: a few identity tests)
            held = list(dict.fromkeys(module._parameters[name] for module, name in p.slots))
            named = f"{self.name}.{p.name}" if self.name else p.name
            new = [t for t in held if isinstance(t, nn.Parameter) and t is not p.param]
            if not new:
                continue
            if len(new) > 1 or len(held) > 1:
                raise ValueError(f"fully_shard: the modules that share {named} now hold {len(held)} different "
                                 f"tensors for it; assign one parameter to every place it is used")
            value = new[0]
            device = self.mesh.device if p.param.is_meta else p.param.device  # (a model built on meta gets values)
            allowed = (device, p.param.device) if self.offload is None else (torch.device("cpu"), self.mesh.device)
            if not isinstance(value, DTensor) or value._spec != p.sharded_spec or value.dtype != p.param.dtype \
                    or value.device not in allowed:
                got = (f"an axedist DTensor {value.dtype} on {value.device}, {value._spec}" if isinstance(value, DTensor)
                       else f"a {type(value).__name__} {getattr(value, 'dtype', '')} of shape {tuple(value.shape)}")
                raise ValueError(f"fully_shard: {named} was replaced by {got}; a sharded parameter must stay a "
                                 f"{p.param.dtype} axedist DTensor on {device} laid out as {p.sharded_spec} "
                                 f"(distribute_tensor(full, param.device_mesh, param.placements) of the parameter it "
                                 f"replaces, or load with load_state_dict's default assign=False)")
            if self.offload is not None and value.device.type != "cpu":  # offloaded: its copy on the CPU, as torch's
                value = _sharded_leaf(value._local.detach().cpu(), value._spec, value.requires_grad)
            value.__dict__["_axedist_sharded"] = True
            p.param, replaced = value, True
            for module, name in p.slots:
                module._parameters[name] = value
        return replaced

    def _install(self, values) -> None:
        for p, value in zip(self.params, values):
            for module, name in p.slots:
                module._parameters[name] = value

    def _install_sharded(self) -> None:
        """The modules hold the sharded parameters again (after a forward or a backward that gave
        them the gathered values). Parameters a script put there meanwhile are taken up, not undone."""
        self.refresh()
        if any(module._parameters[name] is not p.param for p in self.params for module, name in p.slots):
            self._install([p.param for p in self.params])

    # -- gradients --------------------------------------------------------------------------

    def gradient_arrived(self, record: ShardedParameter, grad: torch.Tensor) -> None:
        """A parameter's gradient (this rank's, in the layout the module saw): kept until the unit's
        last one arrives, then all reduce-scattered at once; one in another layout (pending over
        the tensor-parallel axes) is reduced alone."""
        self._awaited -= 1
        grad = _own_summand(grad, self.data_axes)
        summed = record.summed_axes(grad) if record.batched else None
        kept = self._grads.get(record)
        if summed is None or (kept is not None and kept[0] != summed):
            record.accumulate(record.reduce_gradient(grad))
        else:
            local = grad._local if isinstance(grad, DTensor) else grad
            local = local[0] if summed else local  # the summand this rank holds
            self._grads[record] = (summed, local if kept is None else kept[1] + local)
        if self._awaited <= 0:
            self.flush()

    def flush(self) -> None:
        """Start the reduce-scatter of the gradients kept so far (one per reduce dtype), with those
        held from backwards that did not sync; with gradient sync off, hold them instead (torch's
        ``set_requires_gradient_sync(False)``: accumulated unreduced, in the reduce dtype, no
        communication, the parameters' gradients untouched until a backward that syncs)."""
        grads, self._grads = self._grads, {}
        grads = _sum_kept(self._held, {r: (kept[0], kept[1].to(r.reduce_dtype)) for r, kept in grads.items()})
        if not self.requires_gradient_sync:
            self._held = grads
            return
        self._held = {}
        for dtype, summed in dict.fromkeys((r.reduce_dtype, kept[0]) for r, kept in grads.items()):
            records = [p for p in self.params if p in grads and (p.reduce_dtype, grads[p][0]) == (dtype, summed)]
            flat = self.flat_layout("reduce", dtype, records, summed)
            rows = torch.zeros(flat.parts, flat.length, dtype=dtype, device=self.mesh.device)
            for p, offset in zip(flat.records, flat.offsets):
                p.pack_gradient(rows, offset, grads[p][1] / self.gradient_divisor)  # (in the reduce dtype)
            local = rows.view(flat.pending.local_padded)
            if self.mesh.device_type == "cuda":  # on its own stream: the next unit's backward overlaps it
                stream = _side_stream("reduce")
                stream.wait_stream(torch.cuda.current_stream())
                rows.record_stream(stream)  # freed here, still read there
                with torch.cuda.stream(stream):
                    self._reducing.append((_start(local, flat.pending, flat.sharded), flat, stream))
            else:
                self._reducing.append((_start(local, flat.pending, flat.sharded), flat, None))

    def finish_reduce(self) -> None:
        """Wait for the started reduce-scatters and set each parameter's sharded gradient."""
        reducing, self._reducing = self._reducing, []
        with torch.no_grad():
            for started, flat, stream in reducing:
                if stream is not None:
                    torch.cuda.current_stream().wait_stream(stream)
                row = started.wait().reshape(flat.length)
                grads = [DTensor(p.unpack_shard(row, offset).to(p.param.dtype), p.sharded_spec)
                         for p, offset in zip(flat.records, flat.offsets)]
                if self.offload is not None:  # to the CPU together: one wait for the copies
                    grads = self.offload.to_host(grads)
                for p, grad in zip(flat.records, grads):
                    p.accumulate(grad)

    # -- hooks ----------------------------------------------------------------------------

    def pre_forward(self, module, args, kwargs):
        if _RUNNING and not _RUNNING[0].contains(self):
            _RUNNING.clear()  # left over from a forward that did not end (leave_forward did not run)
        if not self._entered:  # the group's first module: gather (a later one, even called apart, finds it so)
            self._open_forward()
        self._entered.add(module)
        _RUNNING.append(self)
        dtype = self.mp_policy.param_dtype
        if dtype is not None and self.mp_policy.cast_forward_inputs:
            args, kwargs = tree_map(lambda x: _cast(x, dtype), (args, kwargs))
        if torch.is_grad_enabled():
            leaves, tree = tree_flatten((args, kwargs))
            needing = [i for i, t in enumerate(leaves) if isinstance(t, torch.Tensor) and t.requires_grad]
            if needing:
                # an autograd leaf is seen as a view of itself: a multi-grad hook over a leaf raises under
                # torch.autograd.grad (what torch.distributed.pipelining runs a stage's backward with)
                viewed = [i for i in needing if leaves[i].grad_fn is None]
                for i in viewed:
                    leaves[i] = leaves[i].view_as(leaves[i])
                if viewed:
                    args, kwargs = tree_unflatten(leaves, tree)
                hook = torch.autograd.graph.register_multi_grad_hook(
                    [leaves[i] for i in needing], lambda grads: self._inputs_done(), mode="all")
                self._input_hooks.append(hook)
                self._inputs_waiting += 1
            else:  # no hook tells when this call's backward is over: the end of backward frees
                self._unhooked_calls += 1
        return args, kwargs

    def _open_forward(self) -> None:
        if _RUNNING:
            self.schedule = _RUNNING[0].schedule
        elif self._in_step and self.schedule is not self.own_schedule:
            pass  # called apart from its step's forward, before that step's backward (a chunked loss): that step
        else:  # the root of this forward: a new step
            s = self.schedule = self.own_schedule
            _STEPS[0] += 1  # (gathers started before now are stale where they are taken up: _drop_stale_prefetch)
            if s.order:
                s.last_order = s.order
            s.order = []
            for unit in s.last_order:  # a forward without backward, or a backward that raised, leaves these behind
                unit.reset(keep_by_hand=True)
        if not self._in_step and not self._gathered_for_this_step():  # an earlier step's values: stale
            self.reshard()
        self._in_step = True  # (again in the step, a module called twice: the gathered values still hold)
        self.unshard()
        self._by_hand = None
        values = [p.module_value() for p in self.params]
        self._awaited += sum(v.requires_grad for v in values)
        self._trained = False
        self._install(values)
        self.schedule.order.append(self)
        self._prefetch_following(backward=False)

    def post_forward(self, module, args, output):
        root = self.schedule is self.own_schedule
        outputs = [t for t in tree_flatten(output)[0] if isinstance(t, torch.Tensor) and t.requires_grad]
        if torch.is_grad_enabled() and outputs:
            self._trained = True
            torch.autograd.graph.register_multi_grad_hook(outputs, lambda grad: self.pre_backward(), mode="any")
        if all(m in self._entered for m in self.modules):  # the group's last module: free
            self.close_forward()
            # the root's parameters are needed first in backward: keep them (as torch does)
            if not self._trained or (self.reshard_after_forward and not root):
                self.reshard()
            if not self._trained:
                self._awaited = 0
        if self.mp_policy.output_dtype is not None:  # every unit's outputs, as torch's (each module of a group's)
            output = tree_map(lambda x: _cast(x, self.mp_policy.output_dtype), output)
        self._returned = True
        return output

    def leave_forward(self, module, args, output) -> None:
        """The end of one of the group's module calls, returned or raised (an always-called forward
        hook, after post_forward): the unit leaves the running units, with any entry an inner forward
        left above it. A forward that raised (post_forward did not run) also gives the modules their
        sharded parameters back and frees what it gathered (a script that catches the error and skips
        the batch sees its model as before, and the memory back); the model's next forward starts a
        new step, which drops the rest of the failed step's state. Not a call in backward: torch stops
        an activation-checkpointing recompute early by raising, and backward reads what it gathered."""
        returned, self._returned = self._returned, False
        for i in range(len(_RUNNING) - 1, -1, -1):
            if _RUNNING[i] is self:
                del _RUNNING[i:]
                break
        if not returned and not self.schedule.callback_queued:
            self.close_forward()
            self.reshard()

    def close_forward(self) -> None:
        """End the group's forward: the modules hold the sharded parameters again (a step whose
        forward ran only some of a group's modules ends it at the end of backward)."""
        self._entered.clear()
        self._install_sharded()

    def pre_backward(self) -> None:
        s = self.schedule
        if not s.callback_queued:
            s.callback_queued = True
            torch.autograd.Variable._execution_engine.queue_callback(lambda: _finish_backward(s))
        self.unshard()
        if not self._entered:
            # the modules hold the gathered values in backward too, as torch's do: activation checkpointing
            # inside the unit (torchtitan wraps each block, then shards it) recomputes the forward with
            # them, and their gradients arrive from that recompute
            with torch.enable_grad():
                self._install([p.module_value() for p in self.params])
        self._prefetch_following(backward=True)

    def _prefetch_following(self, backward: bool) -> None:
        """Start the gathers of the units set by ``set_modules_to_{forward,backward}_prefetch``, else
        of the next unit in the step's order."""
        following = self.backward_prefetch if backward else self.forward_prefetch
        if following is None:
            following = [u for u in [self.schedule.next_after(self, backward)] if u is not None]
        for unit in following:
            unit.prefetch()

    def _inputs_done(self) -> None:
        """The gradients of one module call's inputs are all computed: after the last call's, the
        group's backward is over and its gathered parameters go. Not when a call had no such input:
        its backward may still be to come (a module called twice on an input that needs no
        gradient, then on its own output), and the end of backward frees then."""
        self._inputs_waiting -= 1
        if self._inputs_waiting == 0 and not self._unhooked_calls:
            self.post_backward()

    def post_backward(self) -> None:
        if self.reshard_after_backward:
            self.reshard()
        self._install_sharded()

    def reset(self, keep_by_hand: bool = False) -> None:
        """Drop the state of a step an exception stopped: its started collectives are waited for
        and dropped, its gathered parameters freed, its gradients not yet set lost. ``keep_by_hand``
        (a new step's start): not what ``unshard()`` gathered for the next forward."""
        kept = keep_by_hand and self._gathered_for_this_step()
        if not kept:
            self.drop_prefetch()
        with torch.no_grad():
            for started, _, _ in self._reducing:
                started.wait()
        self._reducing, self._grads = [], {}  # (gradients held from completed backwards stay)
        self._awaited = 0
        self._in_step = False
        self.close_forward()
        self.remove_input_hooks()
        if not kept:
            self.reshard()
        self.schedule.callback_queued = False
        self.schedule.order = []

    def _gathered_for_this_step(self) -> bool:
        """Whether unshard() gathered this unit just before the step now beginning."""
        return self._by_hand is not None and self._by_hand == _STEPS[0] - 1

    def gather_by_hand(self, async_op: bool) -> None:
        """``FSDPModule.unshard``: gather now, for the next forward, which then gathers nothing
        (torch's manual prefetch: call it after the optimizer step, as the values are read now).
        Between steps what was gathered before is dropped first: the optimizer may have moved the
        shards since (a unit that kept its values after backward, a prefetch never taken up). It
        serves the next step only: a later one (the unit unused in between, the optimizer may have
        stepped) gathers anew."""
        if not self._in_step:
            self.drop_prefetch()
            self.reshard()
            self._by_hand = _STEPS[0]
        if async_op:
            self.prefetch()
        else:
            self.unshard()

    def remove_input_hooks(self) -> None:
        """Remove the step's multi-grad hooks: each holds its inputs' autograd nodes while a node
        holds it, a cycle through C++ that the garbage collector cannot see (a dropped model and
        its parameters stayed alive)."""
        for handle in self._input_hooks:
            handle.remove()
        self._input_hooks = []
        self._inputs_waiting = 0
        self._unhooked_calls = 0

    # -- description ----------------------------------------------------------------------

    def explain(self) -> str:
        """The routes layout inference planned for this unit's all-gather and reduce-scatter."""
        lines = [repr(self)]
        for (kind, dtype, summed, _), flat in sorted(self._flat.items(), key=lambda kv: kv[0][0]):
            src, dst = (flat.sharded, flat.gathered) if kind == "gather" else (flat.pending, flat.sharded)
            itemsize = torch.empty((), dtype=dtype).element_size()
            also = f", also summed over {summed}" if summed else ""
            lines.append(f"{kind} ({str(dtype).replace('torch.', '')}, {len(flat.records)} parameters, "
                         f"{flat.length} elements per rank{also}):")
            lines.append(str(plan_redistribute(src, dst, itemsize)))
        return "\n".join(lines)

    def __repr__(self) -> str:
        sharded = sum(p.param.to_local().numel() * p.param.element_size() for p in self.params)
        axes = f"shard over {self.shard_axes}" + (f", replicate over {self.replicate_axes}" if self.replicate_axes else "")
        offload = f", {self.offload}" if self.offload is not None else ""
        return (f"FSDPUnit({self.name or '<root>'}: {len(self.params)} parameters, {axes} of {self.mesh.axis_names}="
                f"{self.mesh.shape}, {sharded} B here{offload}, reshard_after_forward={self.reshard_after_forward})")


def _own_summand(grad: torch.Tensor, data_axes: tuple) -> torch.Tensor:
    """A gradient on the whole mesh (``dp_mesh_dims``) that is pending a sum over data axes (each
    data-parallel rank's batch gave a partial) as this rank's own gradient, replicated there: the
    same local tensor, the data axes moved from the summand dim to the replicas. torch's
    ``fully_shard`` reads the local tensor the same way, then averages over the ranks.
    ``S[(2,4,6):(1@dp,6,1)] + R[2:1@tp]``, 2 summands -> ``S[(4,6):(6,1)] + R[2:1@tp, 2:1@dp]``."""
    spec = grad._spec if isinstance(grad, DTensor) else None
    if spec is None or spec.reduce_op != "sum":
        return grad
    summand_dim = spec.layout.blocks(spec.full_shape)[0]
    mine = [it for it in summand_dim if it.axis in data_axes]
    if not mine:
        return grad
    whole = [Iter(spec.mesh.size(it.axis), 1, it.axis) for it in mine]
    if mine != whole or any(it.axis == MEMORY_AXIS and it.extent > 1 for it in summand_dim):
        raise LayoutError(f"fully_shard: gradient {spec} is pending over the data-parallel axes {data_axes} in another "
                          f"way than one summand per rank")
    own = without_summands(spec, data_axes)
    return DTensor(grad._local if own.reduce_op else grad._local[0], own)


def _sum_kept(held: dict, new: dict) -> dict:
    """Kept gradients (``{record: (summed axes, local)}``) of two backwards added up per parameter;
    the same parameter's must be pending over the same axes."""
    if not held:
        return new
    total = dict(held)
    for record, (summed, local) in new.items():
        kept = total.get(record)
        if kept is not None and kept[0] != summed:
            raise LayoutError(f"fully_shard: {record.name}'s gradient is pending over {summed} in this backward and "
                              f"over {kept[0]} in one that did not sync; sync before the layout changes")
        total[record] = (summed, local if kept is None else kept[1] + local)
    return total


def _finish_backward(schedule: _Schedule) -> None:
    """End of backward: every unit of the step reduces what is left, sets its gradients and frees
    what it gathered; started gathers are dropped."""
    for unit in schedule.order or schedule.last_order:
        unit.flush()
        unit.finish_reduce()
        unit._awaited = 0
        unit._in_step = False
        unit.close_forward()
        if unit.reshard_after_backward:
            unit.reshard()
        unit.drop_prefetch()
        unit.remove_input_hooks()
    schedule.callback_queued = False


_SIDE_STREAMS: dict = memo("nn.fsdp side streams")


def _side_stream(kind: str):
    """One stream per device for the gathers and one for the reduce-scatters (so a unit's backward
    waits for its gather, never for another unit's reduce-scatter)."""
    key = (torch.cuda.current_device(), kind)
    if key not in _SIDE_STREAMS:
        _SIDE_STREAMS[key] = torch.cuda.Stream()
    return _SIDE_STREAMS[key]


def _start(local: torch.Tensor, src: DTensorSpec, dst: DTensorSpec):
    """Start a flat buffer's move asynchronously on torch.distributed (NCCL on CUDA, gloo on CPU):
    ``wait()`` gives the result. On CUDA it is issued from a side stream, beside the compute and
    the tensor-parallel collectives of the current stream, so it must not run on axedist's p2p
    kernels: those keep all their programs resident and wait at a grid barrier, which holds only
    while no other waiting kernel shares the GPU. Two of them on two streams can each take part of
    the SMs and wait for the rest for ever. A dp2 x tp2 eager step on 4x H200 stopped so at
    260513e: ranks 0 and 3 timed out in the dp reduce-scatter of the side stream, waiting for
    ranks 2 and 1, which had not reached it. NCCL's kernels take a few SMs and do not wait for
    blocks of their own that are not resident."""
    return redistribute_local(local, src, dst, async_op=True)


def _cast(x, dtype):
    if isinstance(x, torch.Tensor) and x.is_floating_point() and x.dtype != dtype:
        return x.to(dtype)
    return x


# ---------------------------------------------------------------------------
# CPU offload (torch's CPUOffloadPolicy): the shards live on the CPU between uses
# ---------------------------------------------------------------------------


@dataclass(frozen=True)
class _CPUOffload:
    """Where a unit of ``fully_shard(..., offload_policy=CPUOffloadPolicy())`` keeps its shards:
    each sharded parameter's local tensor is on the CPU (so is its gradient, and the optimizer
    state made like it), pinned when the mesh's device is CUDA and ``pin_memory`` (torch's
    default), so the copies to and from the device do not block. A gather first copies the shards
    to the mesh's device, where the gathered parameters live while the unit computes; the sharded
    gradient the reduce-scatter leaves there is copied to the CPU at the end of backward, so
    ``optimizer.step()`` runs on the CPU. ``(8, 6)`` weight, ``dp = 2``, CUDA mesh:
    ``param.to_local()`` a pinned CPU ``(4, 6)``, the module's weight a CUDA ``(8, 6)`` while it
    runs, ``param.grad.to_local()`` a pinned CPU ``(4, 6)``."""

    device: torch.device  # the mesh's: where gathers, compute and the reduce-scatters run
    pin: bool             # shards and gradients in pinned memory

    def __repr__(self) -> str:
        return f"shards on the CPU{' (pinned)' if self.pin else ''}"

    def to_device(self, local: torch.Tensor) -> torch.Tensor:
        """A shard's copy on the mesh's device (on the current stream; from pinned memory the host
        goes on at once)."""
        return local.to(self.device, non_blocking=True)

    def to_host(self, grads: list) -> list:
        """Sharded gradients (DTensors) with their local tensors on the CPU; pinned ones copied
        without blocking, then one wait for the current stream (the optimizer reads them next)."""
        out, copying = [], False
        for grad in grads:
            local = grad._local
            if local.device.type != "cpu":
                if self.pin:
                    host = torch.empty(local.shape, dtype=local.dtype, pin_memory=True)
                    host.copy_(local, non_blocking=True)
                    copying = True
                else:
                    host = local.cpu()
                grad = DTensor(host, grad._spec)
            out.append(grad)
        if copying:
            torch.cuda.current_stream().synchronize()
        return out

    def to_mesh_device(self, modules, ignored_params) -> None:
        """A module built on the CPU: the plain parameters and buffers a unit is about to shard go
        to the mesh's device first (as torch's ``fully_shard`` moves them), sharded there, and the
        shards come back (``place``); ignored parameters stay."""
        ignored = {id(p) for p in ignored_params or ()}
        with torch.no_grad():
            for top in modules:
                for sub in top.modules():
                    for param in sub._parameters.values():
                        if (param is not None and not isinstance(param, DTensor) and param.device.type == "cpu"
                                and id(param) not in ignored and not param.__dict__.get("_axedist_fsdp_ignored")):
                            param.data = param.data.to(self.device)
                    for name, buffer in sub._buffers.items():
                        if buffer is not None and buffer.device.type == "cpu":
                            sub._buffers[name] = buffer.to(self.device)

    def place(self, unit: "FSDPUnit") -> None:
        """The unit's new shards (cut on the mesh's device) as new parameters on the CPU; shards on
        the meta device stay there (``model.to_empty(device="cpu")`` gives them the CPU)."""
        for p in unit.params:
            local = p.param._local
            if local.is_meta or local.device.type == "cpu":
                continue
            host = local.cpu()
            p.param = _sharded_leaf(host.pin_memory() if self.pin else host, p.sharded_spec, p.param.requires_grad)
            for module, name in p.slots:
                module._parameters[name] = p.param

    def check(self, unit: "FSDPUnit") -> None:
        """Before a gather: every shard on the CPU (on every rank alike: the same model), pinned
        where wanted; a shard that ``to_empty`` or a state dict left unpinned is pinned in place
        (the parameter object, and so the optimizer's hold on it, stays)."""
        elsewhere = [f"{p.name} ({p.param._local.device})" for p in unit.params if p.param._local.device.type != "cpu"]
        if elsewhere:
            raise ValueError(f"fully_shard(offload_policy=CPUOffloadPolicy()): the shards of {', '.join(elsewhere[:4])}"
                             f"{', ...' if len(elsewhere) > 4 else ''} are not on the CPU, where offloaded parameters "
                             f"live; a model sharded on the meta device takes its values after "
                             f"model.to_empty(device=\"cpu\") (torchtitan's flow with CPU offload), not the "
                             f"mesh's device ({self.device})")
        if self.pin:
            with torch.no_grad():
                for p in unit.params:
                    local = p.param._local
                    if not local.is_pinned():
                        pinned = local.pin_memory()
                        local.set_(pinned.untyped_storage(), pinned.storage_offset(), pinned.shape, pinned.stride())


def _offload_policy(offload_policy, traced: bool):
    """torch's ``offload_policy``: ``None`` or ``OffloadPolicy()`` (torch's default: no offload)
    gives None, ``CPUOffloadPolicy(pin_memory=...)`` itself."""
    from torch.distributed.fsdp import CPUOffloadPolicy, OffloadPolicy

    if offload_policy is None or type(offload_policy) is OffloadPolicy:
        return None
    if not isinstance(offload_policy, CPUOffloadPolicy):
        raise TypeError(f"fully_shard: offload_policy takes torch's OffloadPolicy() (no offload) or "
                        f"CPUOffloadPolicy(pin_memory=...), got {offload_policy!r}")
    if traced:
        raise NotImplementedError("fully_shard(traced=True): CPU offload is not supported in traced mode (the gathers "
                                  "are redistributes inside the graph); use the hooked mode (traced=False)")
    return offload_policy


# ---------------------------------------------------------------------------
# fully_shard
# ---------------------------------------------------------------------------


def _unit_of(module: nn.Module) -> FSDPUnit | None:
    return module.__dict__.get("_axedist_fsdp")


class FSDPModule:
    """What ``fully_shard`` adds to a module's class, as torch's ``fully_shard`` does
    (``Block`` becomes ``FSDPBlock``): the calls torch's FSDP2 scripts make on it. Gradients are
    reduce-scattered on every backward here, so turning gradient sync off for a micro-batch
    changes no result, only saves nothing (it warns once)."""

    def unshard(self, async_op: bool = False):
        """Gather this unit's parameters now (the next forward then finds them gathered).
        ``async_op=True``: start the gathers and return a handle whose ``wait()`` finishes them."""
        unit = _unit_of(self)
        unit.gather_by_hand(async_op)
        return UnshardHandle(unit) if async_op else None

    def reshard(self) -> None:
        """Free this unit's gathered parameters (only the shards stay)."""
        _unit_of(self).reshard()

    def set_reshard_after_forward(self, reshard_after_forward: bool, recurse: bool = True) -> None:
        for unit in fsdp_units(self) if recurse else [_unit_of(self)]:
            unit.reshard_after_forward = reshard_after_forward

    def set_requires_gradient_sync(self, requires_gradient_sync: bool, *, recurse: bool = True) -> None:
        """``False``: backwards accumulate each unit's gradients unreduced (gathered layout, reduce
        dtype: one parameter's worth of memory per parameter) and leave ``param.grad`` alone; the
        next backward with sync on reduce-scatters their sum with its own, once (torch's gradient
        accumulation without communication)."""
        for unit in fsdp_units(self) if recurse else [_unit_of(self)]:
            unit.requires_gradient_sync = bool(requires_gradient_sync)

    def set_requires_all_reduce(self, requires_all_reduce: bool, *, recurse: bool = True) -> None:
        if not requires_all_reduce:
            _warn_once("set_requires_all_reduce(False): axedist all-reduces HSDP gradients on every backward; "
                       "the accumulated gradients are the same, no communication is saved")

    def set_is_last_backward(self, is_last_backward: bool) -> None:
        """Accepted: every backward here ends with its gradients reduced."""

    def set_reshard_after_backward(self, reshard_after_backward: bool, *, recurse: bool = True) -> None:
        """``False``: keep the gathered parameters after backward (they are gathered again at the
        next forward all the same, since the optimizer may have changed the shards)."""
        for unit in fsdp_units(self) if recurse else [_unit_of(self)]:
            unit.reshard_after_backward = bool(reshard_after_backward)

    def reset_iter_state(self) -> None:
        """After an exception stopped a forward or backward: drop that step's state in every unit
        under this module (in-flight collectives waited for, gathered parameters freed, the step's
        gradients not yet reduced lost), so the next step runs as a new one."""
        _RUNNING.clear()
        for unit in fsdp_units(self):
            unit.reset()

    def set_reduce_scatter_divide_factor(self, factor: float) -> None:
        """torch's older name of ``set_gradient_divide_factor``."""
        self.set_gradient_divide_factor(factor)

    def set_force_sum_reduction_for_comms(self, enable: bool) -> None:
        """Accepted: the gradients are divided before a sum here already (the same values)."""

    def set_unshard_in_backward(self, unshard_in_backward: bool) -> None:
        """Accepted: the parameters are gathered for backward in every case (the same values)."""

    def set_post_optim_event(self, event) -> None:
        """Accepted: the next gathers wait for the current stream, where the optimizer ran."""

    def set_all_reduce_hook(self, hook, *, stream=None) -> None:
        raise NotImplementedError("set_all_reduce_hook: axedist runs no user hook on the reduced gradients")

    def set_custom_all_gather(self, comm) -> None:
        raise NotImplementedError("set_custom_all_gather: axedist plans its gathers from the layouts")

    def set_custom_reduce_scatter(self, comm) -> None:
        raise NotImplementedError("set_custom_reduce_scatter: axedist plans its reduce-scatters from the layouts")

    def set_reduce_scatter_max_input_buffers(self, max_input_buffers: int, *, recurse: bool = True) -> None:
        """Accepted (an int >= 1): each reduce-scatter here already has an input buffer of its own
        (no wait to reuse one), torch's behaviour for a large cap."""
        if isinstance(max_input_buffers, bool) or not isinstance(max_input_buffers, int):
            raise TypeError(f"set_reduce_scatter_max_input_buffers: max_input_buffers must be an int, got "
                            f"{max_input_buffers!r}")
        if max_input_buffers < 1:
            raise ValueError(f"set_reduce_scatter_max_input_buffers: max_input_buffers must be >= 1, got "
                             f"{max_input_buffers}")

    def set_reduce_scatter_unused_params(self, reduce_scatter_unused_params: bool, *, recurse: bool = True) -> None:
        if reduce_scatter_unused_params:
            raise NotImplementedError("set_reduce_scatter_unused_params(True): axedist reduces the gradients that "
                                      "arrived, so ranks must use the same parameters in a step; give unused "
                                      "parameters a zero gradient in the model (e.g. add 0 * p.sum() to the loss)")

    def set_separate_reduce_scatter_group(self, enable: bool = True, *, recurse: bool = True) -> None:
        if enable:
            _warn_once("set_separate_reduce_scatter_group(True): axedist's reduce-scatters use the mesh's process "
                       "groups, as its all-gathers do; the values are the same, no group is made")

    def set_allocate_memory_from_process_group_for_comm(self, enable: bool) -> None:
        if enable:
            _warn_once("set_allocate_memory_from_process_group_for_comm(True): axedist allocates its collectives' "
                       "buffers with torch's allocator; the values are the same")

    def set_symm_mem_for_comm(self, backend: str = "NCCL") -> None:
        if backend != "NCCL":
            raise ValueError(f"set_symm_mem_for_comm: backend {backend!r}; torch's supports only 'NCCL'")
        _warn_once("set_symm_mem_for_comm: axedist allocates its FSDP all-gathers' buffers with torch's allocator; "
                   "the values are the same")

    def set_gradient_divide_factor(self, factor: float) -> None:
        """Divide each rank's gradients of this unit by ``factor`` before summing them over the
        data-parallel ranks (default: their count, an average). ``1.0``: the sum, for scripts that
        scale the loss themselves (torchtitan divides by the global token count)."""
        factor = float(factor)
        if not factor > 0:
            raise ValueError(f"set_gradient_divide_factor: the factor must be positive, got {factor}")
        _unit_of(self).gradient_divide_factor = factor

    def set_modules_to_forward_prefetch(self, modules: list) -> None:
        """Start the all-gathers of ``modules`` (FSDP modules) when this one's forward gathers, in
        place of the next unit of the last step's order."""
        _unit_of(self).forward_prefetch = _prefetch_units(modules, "set_modules_to_forward_prefetch")

    def set_modules_to_backward_prefetch(self, modules: list) -> None:
        """Start the all-gathers of ``modules`` (FSDP modules) when this one's backward gathers, in
        place of the next unit in reverse order."""
        _unit_of(self).backward_prefetch = _prefetch_units(modules, "set_modules_to_backward_prefetch")


class UnshardHandle(getattr(torch_fsdp, "UnshardHandle", object)):  # torch's class where it has one
    """What ``unshard(async_op=True)`` returns (torch's class, so scripts that check it pass):
    ``wait()`` finishes the started gathers, after which the module holds the gathered values;
    a second ``wait()`` does nothing, as torch's.

        >>> handle = block.unshard(async_op=True)   # the all-gathers started
        >>> handle.wait()                           # done: block's next forward gathers nothing
    """

    def __init__(self, unit: FSDPUnit):
        self.unit = unit

    def wait(self) -> None:
        unit, self.unit = self.unit, None  # once (and no reference kept)
        if unit is not None:
            unit.unshard()

    def __repr__(self) -> str:
        return f"UnshardHandle({'waited' if self.unit is None else self.unit.name or '<root>'})"


def _prefetch_units(modules, what: str) -> list:
    units = []
    for m in modules:
        unit = _unit_of(m) if isinstance(m, nn.Module) else None
        if unit is None:
            raise ValueError(f"{what}: {type(m).__name__} is not a module fully_shard was applied to")
        units.append(unit)
    return list(dict.fromkeys(units))


@cached(maxsize=None)
def _warn_once(text: str) -> None:
    import warnings
    warnings.warn(text, stacklevel=3)


@cached(maxsize=None)
def _fsdp_class(cls: type) -> type:
    """``FSDP<cls>``: ``cls`` with ``FSDPModule``'s calls, made once per class (as torch's)."""
    return type(f"FSDP{cls.__name__}", (FSDPModule, cls), {"__module__": cls.__module__})


def fsdp_units(module: nn.Module) -> list[FSDPUnit]:
    """The FSDP units under ``module`` (itself included), in module order (a group's once)."""
    return list(dict.fromkeys(u for u in (_unit_of(m) for m in module.modules()) if u is not None))


def register_fsdp_forward_method(module: nn.Module, method_name: str) -> None:
    """Make ``module.<method_name>(...)`` gather the unit's parameters before it runs and free
    them after, as ``forward`` does (torch's: for a ``generate`` that calls submodules and uses
    the module's own parameters). A module ``fully_shard`` was not applied to: nothing happens
    (torch's too, so a script registers with or without FSDP).

        >>> fully_shard(model, mesh)
        >>> register_fsdp_forward_method(model, "generate")
        >>> model.generate(tokens)          # model's own parameters gathered, then freed
    """
    unit = _unit_of(module)
    if unit is None:
        return
    if not isinstance(method_name, str) or not callable(getattr(module, method_name, None)):
        raise ValueError(f"register_fsdp_forward_method: {type(module).__name__} has no method {method_name!r}")
    method = getattr(module, method_name)
    before, after, leave = _eager(unit.pre_forward), _eager(unit.post_forward), _eager(unit.leave_forward)

    @functools.wraps(method)
    def as_forward(*args, **kwargs):
        output = None
        try:
            args, kwargs = before(module, args, kwargs)
            output = after(module, args, method(*args, **kwargs))
            return output
        finally:
            leave(module, args, output)

    setattr(module, method_name, as_forward)


def share_comm_ctx(modules: Sequence[nn.Module]) -> None:
    """torch's: let FSDP roots (a pipeline's model chunks) share the CUDA streams their
    collectives run on. Here they always do: every unit of the process issues its all-gathers on
    one side stream per device and its reduce-scatters on another (``_side_stream``), so this
    only checks that ``modules`` is a list of modules ``fully_shard`` was applied to.

        >>> share_comm_ctx([stage0, stage1])   # each fully_shard-ed
    """
    if isinstance(modules, nn.Module) or not isinstance(modules, (list, tuple)):
        raise TypeError(f"share_comm_ctx takes a list of FSDP modules, got {type(modules).__name__}")
    for m in modules:
        if not isinstance(m, nn.Module) or _unit_of(m) is None:
            raise ValueError(f"share_comm_ctx: expected modules fully_shard was applied to, got {type(m).__name__}")


def _axes_arg(mesh: DeviceMesh, axes, what: str) -> tuple[str, ...]:
    axes = (axes,) if isinstance(axes, str) else tuple(axes)
    for a in axes:
        if a not in mesh.axis_names:
            raise MeshError(f"fully_shard: {what} names axis {a!r}, which mesh {mesh.axis_names}={mesh.shape} lacks")
    return axes


def fully_shard(module: nn.Module | Sequence[nn.Module], mesh=None, *, dp_axes: Sequence[str] | str | None = None,
                replicate_axes: Sequence[str] | str = (), reshard_after_forward: bool | int | None = True,
                mp_policy: MixedPrecisionPolicy = NO_CASTS, offload_policy=None, shard_placement_fn=None,
                ignored_params=None, dp_mesh_dims: DataParallelMeshDims | None = None,
                traced: bool = False) -> nn.Module:
    """Shard ``module``'s parameters over ``dp_axes`` of ``mesh`` (in place); returns ``module``.
    A list of modules (``fully_shard([model.norm, model.output])``, as torchtitan writes it) is one
    unit: gathered when the first of them runs, freed after the last, its gradients reduced together.

    Two spellings. axedist's: ``mesh`` the whole (dp, tp) mesh, ``dp_axes`` (default ``"dp"``)
    and ``replicate_axes`` name its data-parallel axes. torch's: ``fully_shard(block,
    mesh=world_mesh["dp"])`` with the torch (or axedist) mesh of the data-parallel axes only,
    a sub-mesh of the job's mesh when the model is also tensor parallel (its root mesh is used),
    two axes meaning HSDP (replicate over the first, shard over the second), no mesh meaning
    every rank on one axis; or ``fully_shard(block, mesh=world_mesh,
    dp_mesh_dims=DataParallelMeshDims(shard="dp", replicate=None))`` (torch's class) with the
    whole mesh, every parameter a DTensor on it replicated over the named axes (``shard``: the
    ``dp_axes``, ``replicate``: the ``replicate_axes``; a tuple of names shards over those axes
    together; ``replicate`` alone: DDP), which the modules then compute with. ``ignored_params``
    stay as they are (not sharded, their gradients not reduced; an outer ``fully_shard`` leaves
    them too).

    ``shard_placement_fn(param)`` (torch's) picks each parameter's dim: ``None`` is ``Shard(0)``,
    ``Shard(d)`` cuts dim ``d`` (negative counts from the end) of the parameter, or of its
    tensor-parallel local tensor, over the data-parallel axes; ``lambda p: Shard(1)`` on an ``(8,
    6)`` weight at ``dp = 2`` gives each rank an ``(8, 3)`` shard, layout ``S[(8,2,3):(3,1@dp,1)]``,
    torch placements ``[Shard(1)]``. A dim that does not divide is padded (``(8, 5)``: 3 + 2
    columns), where torch refuses dims > 0. A ``ShardPlacementResult`` (another mesh) is refused.

    Apply it to each block first, then to the whole model (the root gets what the blocks did not
    take), as with torch's ``fully_shard``; after ``parallelize`` on ``mesh["tp"]`` when the model
    is also tensor parallel. Each parameter becomes one DTensor on ``mesh`` sharded over the
    data-parallel and the tensor-parallel axes (``(8, 6)`` ColwiseParallel on ``("dp", "tp") =
    (2, 2)``: ``S[(2,2,2,6):(1@tp,1@dp,6,1)]``, local ``(2, 6)``). ``replicate_axes`` (HSDP):
    data-parallel axes the parameters are replicated over; gradients are all-reduced there.
    Every rank passes the same values for plain parameters (as for torch's ``fully_shard``).

    ``mp_policy`` (torch's ``MixedPrecisionPolicy``): modules compute in ``param_dtype`` (the
    gathers move it), gradients are reduced in ``reduce_dtype``, default the sharded parameter's
    own dtype (fp32 masters: fp32; torch's default is ``param_dtype``), optimizer state follows
    the sharded fp32 parameters. ``reshard_after_forward=False`` keeps a unit's gathered
    parameters from forward to backward (the root always keeps them, as torch does); ``None``
    is ``True``, and an int (torch: reshard to fewer ranks) reshards fully.

    ``offload_policy=CPUOffloadPolicy(pin_memory=True)`` (torch's): the unit's shards, and so their
    gradients and the optimizer state, live on the CPU (pinned on CUDA); each gather copies them to
    the mesh's device first, each sharded gradient comes back at the end of backward, and
    ``optimizer.step()`` runs on the CPU. A model built on the CPU is moved to the device unit by
    unit to be sharded (as torch's); one sharded on the meta device takes its values after
    ``model.to_empty(device="cpu")``. ``OffloadPolicy()`` is no offload.

    ``traced=True`` (for ``torch.compile(model, fullgraph=True)`` of dp x tp): no hooks; each
    parameter's gather is a ``redistribute`` inside the forward of the module that uses it and its
    gradient's reduce-scatter that redistribute's backward, so the whole model traces as one
    graph and the compiler schedules (and frees) the gathers. Apply it once, to the whole model;
    see ``shard_traced``.
    """
    offload = _offload_policy(offload_policy, traced)
    modules = _module_group(module)
    if dp_mesh_dims is not None:
        mesh, dp_axes, replicate_axes = _named_dims(mesh, dp_mesh_dims, dp_axes, replicate_axes,
                                                    reshard_after_forward, traced)
    elif dp_axes is None:
        if isinstance(mesh, DeviceMesh) and "dp" in mesh.axis_names and mesh.ndim > 1:
            dp_axes = ("dp",)  # axedist's spelling: the whole mesh, its "dp" axis
        else:
            mesh, replicate_axes, dp_axes = _torch_fsdp_mesh(mesh, replicate_axes, modules)
    elif not isinstance(mesh, DeviceMesh):
        raise TypeError(f"fully_shard(dp_axes=...) takes the whole axedist DeviceMesh, got {type(mesh).__name__}; "
                        f"with torch's spelling pass only mesh= (the data-parallel mesh)")
    shard_axes = _axes_arg(mesh, dp_axes, "dp_axes")
    replicate_axes = _axes_arg(mesh, replicate_axes, "replicate_axes")
    if set(shard_axes) & set(replicate_axes):
        raise MeshError(f"fully_shard: axes {sorted(set(shard_axes) & set(replicate_axes))} are in both dp_axes and "
                        f"replicate_axes")
    if not shard_axes and dp_mesh_dims is None:  # (torch's DataParallelMeshDims(replicate=...) alone: DDP)
        raise MeshError("fully_shard: dp_axes is empty (give at least one mesh axis to shard the parameters over)")
    if traced:
        if len(modules) > 1 or shard_placement_fn is not None or ignored_params:
            raise NotImplementedError("fully_shard(traced=True) takes one module, and no shard_placement_fn or "
                                      "ignored_params")
        return shard_traced(module, mesh, shard_axes, replicate_axes, mp_policy)
    if reshard_after_forward is None or not isinstance(reshard_after_forward, bool):
        # torch's None: True but for the root, which keeps its parameters here anyway. torch's int (reshard to a
        # smaller group of ranks): fully resharded here, the same values for less memory
        reshard_after_forward = True
    unit = FSDPUnit(modules, mesh, shard_axes, replicate_axes, reshard_after_forward, mp_policy, "")
    for top in modules:
        for prefix, sub in top.named_modules():  # inner units are named from here (the root's names win)
            inner = _unit_of(sub)
            if inner is not None and prefix:
                inner.name = prefix
    ignored = _ignored(ignored_params)
    if dp_mesh_dims is not None:
        _check_on_whole_mesh(modules, mesh, unit.data_axes, ignored)
    if offload is not None:
        unit.offload = _CPUOffload(mesh.device, offload.pin_memory and mesh.device_type == "cuda")
        unit.offload.to_mesh_device(modules, ignored_params)
    _shard_parameters(unit, mesh, ignored, shard_placement_fn)
    if unit.offload is not None:
        unit.offload.place(unit)
    for top in modules:
        top.__dict__["_axedist_fsdp"] = unit
        if not isinstance(top, FSDPModule):
            top.__class__ = _fsdp_class(type(top))
        # torch.compile runs the hooks eagerly around what it compiles (a graph break at each unit's
        # edges, as torch's FSDP2 hooks): they resize storages, register autograd hooks and keep the
        # step's schedule, none of which a graph can hold (README, torch.compile)
        top.register_forward_pre_hook(_eager(unit.pre_forward), prepend=True, with_kwargs=True)
        top.register_forward_hook(_eager(unit.post_forward))
        top.register_forward_hook(_eager(unit.leave_forward), always_call=True)
        top.register_load_state_dict_post_hook(lambda module, keys: unit.refresh())
    return module


def _module_group(module) -> tuple[nn.Module, ...]:
    """The modules of one ``fully_shard`` call: ``module``, or the modules of a list (torch's
    ``fully_shard([norm, output])``: one unit, gathered and reduced together)."""
    modules = tuple(module) if isinstance(module, (list, tuple)) else (module,)
    if not modules or not all(isinstance(m, nn.Module) for m in modules):
        raise TypeError(f"fully_shard takes a module or a non-empty list of modules, got {module!r}")
    if len({id(m) for m in modules}) < len(modules):
        raise ValueError("fully_shard: a module is listed twice")
    for m in modules:
        if _unit_of(m) is not None:
            raise ValueError(f"fully_shard was already applied to this {type(m).__name__} "
                             f"({len(_unit_of(m).params)} parameters sharded over {_unit_of(m).shard_axes}); "
                             f"apply it once per module")
    return modules


def _ignored(ignored_params) -> set[int]:
    """The ids of the parameters ``fully_shard`` leaves as they are (torch's ``ignored_params``),
    marked so that a later ``fully_shard`` of an outer module leaves them too."""
    ignored = set()
    for param in ignored_params or ():
        if not isinstance(param, torch.Tensor):
            raise TypeError(f"fully_shard: ignored_params holds parameters, got {type(param).__name__}")
        param.__dict__["_axedist_fsdp_ignored"] = True
        ignored.add(id(param))
    return ignored


def _eager(hook):
    """``hook`` as a function torch.compile does not trace (a graph break: it runs eagerly)."""
    def run(*args, **kwargs):
        return hook(*args, **kwargs)

    return torch._disable_dynamo(run)


def _placement_dim(shard_placement_fn, param, name: str) -> int:
    """The dim ``param`` is sharded on: torch's ``shard_placement_fn(param)`` gives ``None``
    (``Shard(0)``) or ``Shard(dim)``, a negative dim counted from the end (``Shard(-1)`` of an
    ``(8, 6)`` weight: dim 1)."""
    placement = None if shard_placement_fn is None else shard_placement_fn(param)
    if placement is None:
        return 0
    from torch.distributed.tensor import Shard

    if type(placement).__name__ == "ShardPlacementResult":  # torch's (placement, mesh_info): another mesh
        raise NotImplementedError(f"fully_shard: shard_placement_fn gave a ShardPlacementResult for {name}; sharding "
                                  f"a parameter over another mesh than fully_shard's (MoE experts on their own "
                                  f"group) is not supported; return None or Shard(dim) to shard it over this mesh")
    if not isinstance(placement, Shard):
        raise TypeError(f"fully_shard: shard_placement_fn gave {placement!r} for {name}; it returns None (Shard(0)) "
                        f"or Shard(dim)")
    ndim = param.dim()
    if not -ndim <= placement.dim < ndim:
        raise ValueError(f"fully_shard: shard_placement_fn gave {placement!r} for {name} of shape "
                         f"{tuple(param.shape)}; the dim must be in [{-ndim}, {ndim})"
                         + ("" if ndim else " (a scalar is not sharded: return None)"))
    return placement.dim % ndim


def _named_dims(mesh, dims, dp_axes, replicate_axes, reshard_after_forward, traced) -> tuple[DeviceMesh, tuple, tuple]:
    """torch's ``dp_mesh_dims`` -> axedist's ``(whole mesh, dp_axes, replicate_axes)``, refused
    where torch's ``fully_shard`` refuses it (and with axedist's own axes or traced mode)."""
    if not isinstance(dims, DataParallelMeshDims):
        raise TypeError(f"fully_shard: dp_mesh_dims takes torch.distributed.fsdp.DataParallelMeshDims (also "
                        f"axedist.nn.DataParallelMeshDims), got {type(dims).__name__}")
    if dp_axes is not None or replicate_axes:
        raise TypeError("fully_shard: dp_mesh_dims names the data-parallel axes; leave dp_axes and replicate_axes out")
    if traced:
        raise NotImplementedError("fully_shard(traced=True) takes dp_axes, not dp_mesh_dims (the parameters on the "
                                  "tensor-parallel sub-mesh)")
    if not dims.shard_names and not dims.replicate_names:
        raise ValueError("fully_shard: at least one of shard or replicate must be set in dp_mesh_dims")
    if mesh is None:
        raise ValueError("fully_shard: dp_mesh_dims names axes of mesh=, the whole mesh the parameters are DTensors "
                         "on; pass it")
    whole = as_mesh(mesh)
    names = dims.shard_names + dims.replicate_names
    for name in names:
        if name not in whole.axis_names:
            raise ValueError(f"fully_shard: dp_mesh_dims names {name!r}, which mesh {whole.axis_names}="
                             f"{whole.shape} lacks")
    both = sorted(set(dims.shard_names) & set(dims.replicate_names))
    if both or len(set(names)) < len(names):
        raise ValueError(f"fully_shard: dp_mesh_dims names {both or names} twice (shard {dims.shard_names}, "
                         f"replicate {dims.replicate_names}); each axis is sharded or replicated")
    if dims.shard_names and not isinstance(reshard_after_forward, bool) and isinstance(reshard_after_forward, int):
        raise NotImplementedError("fully_shard: reshard_after_forward as an int is not supported with dp_mesh_dims "
                                  "(torch's is not either); pass True or False")
    return whole, dims.shard_names, dims.replicate_names


def _check_on_whole_mesh(modules, mesh: DeviceMesh, data_axes: tuple, ignored: set[int]) -> None:
    """With ``dp_mesh_dims`` every parameter to shard is a DTensor on the whole mesh, replicated over
    the data axes (torch's rules), checked before any is sharded."""
    for top in modules:
        for name, param in top.named_parameters():
            if _is_sharded(param) or id(param) in ignored or param.__dict__.get("_axedist_fsdp_ignored"):
                continue
            if not isinstance(param, DTensor):
                raise ValueError(f"fully_shard: with dp_mesh_dims every parameter is a DTensor on the whole mesh "
                                 f"{mesh.axis_names} (e.g. by distribute_module); {name} is a plain "
                                 f"{type(param).__name__}. Without dp_mesh_dims, mesh= the data-parallel mesh takes "
                                 f"plain and tensor-parallel parameters")
            if param.mesh != mesh:
                raise ValueError(f"fully_shard: with dp_mesh_dims every parameter is a DTensor on the whole mesh "
                                 f"{mesh.axis_names}={mesh.shape}; {name} is on {param.mesh.axis_names}="
                                 f"{param.mesh.shape}. A parameter on the tensor-parallel sub-mesh goes with "
                                 f"mesh=world_mesh['dp'] and no dp_mesh_dims")
            laid = [a for a in data_axes if not _replicated_over(param._spec, a)]
            if laid:
                raise ValueError(f"fully_shard: with dp_mesh_dims every parameter is replicated over the data-parallel "
                                 f"dims (Replicate() there); {name} is laid out on {laid} ({param._spec.layout})")


def _torch_fsdp_mesh(mesh, replicate_axes, modules) -> tuple[DeviceMesh, tuple, tuple]:
    """torch's spelling -> axedist's: ``(whole mesh, replicate axes, shard axes)`` from the
    data-parallel mesh torch's ``fully_shard`` takes (1-D: shard; 2-D: replicate x shard).

    A torch sub-mesh (``world_mesh["dp"]``) is taken from its root mesh, over the data axes and
    the axes ``modules``' DTensor parameters live on (tensor parallel ones), as torch's FSDP2 lays
    a parameter out over the data mesh and the parameter's own. Not over the root's other axes: the
    ranks along those need not run these modules at all (a pipeline's ``pp`` axis, whose stages
    hold other layers), so no check or collective of this unit may wait for them. A flattened data
    axis (torchtitan's ``world_mesh["dp_shard_cp"]``, ``_flatten`` of ``dp_shard`` and ``cp``) is
    the root axes it merges, sharded over together (in the root's order, as flattening orders them)."""
    if replicate_axes:
        raise TypeError("fully_shard: replicate_axes goes with dp_axes (axedist's spelling); with torch's, pass a "
                        "2-D mesh (replicate, shard)")
    if mesh is None:  # every rank on one axis, as torch's default mesh
        return init_mesh(axis_names="dp"), (), ("dp",)
    if isinstance(mesh, DeviceMesh):
        data_axes = [(a,) for a in mesh.axis_names]
        whole = mesh
    else:
        root = mesh._get_root_mesh() if hasattr(mesh, "_get_root_mesh") else mesh
        if root is mesh:
            whole = as_mesh(mesh)
            data_axes = [(a,) for a in whole.axis_names]
        else:  # a sub-mesh: its root may hold tensor-parallel axes, and the data axes may be flattened ones
            whole = DeviceMesh.from_torch(root)
            data_axes = [_root_axes(mesh, root, dim, whole.axis_names) for dim in range(mesh.ndim)]
            used = {a for axes in data_axes for a in axes} | {
                axis for top in modules for p in top.parameters() if isinstance(p, DTensor)
                for axis in p.device_mesh.axis_names}
            axes = tuple(a for a in whole.axis_names if a in used)
            if axes != whole.axis_names:
                whole = _sub_mesh(whole, axes)
    if len(data_axes) == 1:
        return whole, (), data_axes[0]
    if len(data_axes) == 2:
        return whole, data_axes[0], data_axes[1]
    raise MeshError(f"fully_shard: a data-parallel mesh has 1 axis (shard) or 2 (replicate, shard), got {mesh}")


def _root_axes(sub, root, dim: int, root_names: tuple) -> tuple[str, ...]:
    """The axes of the root mesh that axis ``dim`` of torch sub-mesh ``sub`` runs over: its own
    name, or for a flattened axis the fewest root axes whose slice through this rank holds its
    ranks in its order (row-major over them, as torch's ``_flatten`` orders them)."""
    name = sub.mesh_dim_names[dim] if sub.mesh_dim_names else None
    if name in root_names:
        return (name,)
    grid = root.mesh
    along = sub.mesh.movedim(dim, -1).reshape(-1, sub.mesh.shape[dim])
    me = torch.distributed.get_rank()
    ranks = next(row.tolist() for row in along if me in row.tolist())
    here = [int(c) for c in (grid == me).nonzero()[0]]
    for count in range(1, grid.ndim + 1):
        for dims in itertools.combinations(range(grid.ndim), count):
            cut = grid[tuple(slice(None) if d in dims else here[d] for d in range(grid.ndim))]
            if cut.flatten().tolist() == ranks:
                return tuple(root_names[d] for d in dims)
    raise MeshError(f"fully_shard: axis {name!r} of {sub} runs over ranks {ranks}, which no axes of its root mesh "
                    f"{root} run over in that order; pass a sub-mesh of the root's own axes")


_SUB_MESHES: dict = memo("nn.fsdp sub-meshes of a root mesh")


def _sub_mesh(root: DeviceMesh, axes: tuple) -> DeviceMesh:
    """``root[axes]``, one object per root and axes (every unit of a model on one mesh object)."""
    key = (root, axes)
    if key not in _SUB_MESHES:
        _SUB_MESHES[key] = root[axes]
    return _SUB_MESHES[key]


def _shard_parameters(unit: FSDPUnit, mesh: DeviceMesh, ignored: set[int], shard_placement_fn=None) -> None:
    """Replace every parameter of the unit's modules that no inner unit owns and that is not
    ignored (``ignored``, or by an inner unit) by its sharded DTensor."""
    inner = list(dict.fromkeys(u for top in unit.modules for u in fsdp_units(top) if u is not unit))
    inner_modules = {id(m) for u in inner for top in u.modules for m in top.modules()}
    slots: dict[int, list] = {}
    names: dict[int, str] = {}
    originals: dict[int, nn.Parameter] = {}
    dims: dict[int, int] = {}
    seen: set = set()
    for top in unit.modules:
        for mod_name, sub in top.named_modules(remove_duplicate=False):
            for pname, param in sub._parameters.items():
                if param is None or (id(sub), pname) in seen:
                    continue
                seen.add((id(sub), pname))
                qualified = f"{mod_name}.{pname}" if mod_name else pname
                if id(param) in ignored or param.__dict__.get("_axedist_fsdp_ignored"):
                    continue  # left as it is: not sharded, its gradient not reduced (torch's ignored_params)
                owner = _owner(param)
                if id(sub) in inner_modules:
                    if owner is None and not _is_sharded(param):
                        raise ValueError(f"fully_shard: {qualified} sits inside an inner FSDP unit that did not "
                                         f"shard it")
                    continue
                if _is_sharded(param) or owner is not None:
                    other = f"the unit of {owner.name or 'a module'}" if owner is not None else "already sharded"
                    raise ValueError(f"fully_shard: {qualified} is shared with another FSDP unit ({other}); put the "
                                     f"modules that share a parameter in one unit")
                if id(param) not in dims:
                    dims[id(param)] = _placement_dim(shard_placement_fn, param, qualified)
                slots.setdefault(id(param), []).append((sub, pname))
                names.setdefault(id(param), qualified)
                originals[id(param)] = param
    for key, param in originals.items():
        view = _view_spec(param, mesh, unit.data_axes, names[key])
        gathered, sharded = data_parallel_specs(view, param.shape, mesh, unit.shard_axes, unit.replicate_axes,
                                                dims[key])
        new = _sharded_parameter(param, gathered, sharded)
        record = ShardedParameter(names[key], new, slots[key], view, gathered, unit, dim=dims[key])
        for sub, pname in slots[key]:
            sub._parameters[pname] = new
        unit.params.append(record)
        param.__dict__["_axedist_sharded_by"] = weakref.ref(unit)  # a slot still holding it is shared


def _sharded_parameter(param: nn.Parameter, gathered: DTensorSpec, sharded: DTensorSpec) -> nn.Parameter:
    """The parameter that replaces ``param`` (its value in ``gathered``): this rank's piece under
    ``sharded``, a new leaf marked as sharded."""
    with torch.no_grad():
        full_local = param.to_local() if isinstance(param, DTensor) else param.detach()
        local = redistribute_local(full_local, gathered, sharded).clone()
    return _sharded_leaf(local, sharded, param.requires_grad)


def _sharded_leaf(local: torch.Tensor, sharded: DTensorSpec, requires_grad: bool) -> nn.Parameter:
    """A sharded parameter: a new leaf holding this rank's piece ``local`` under ``sharded``, marked as sharded."""
    new = nn.Parameter(DTensor(local, sharded), requires_grad=requires_grad)
    new.__dict__["_axedist_sharded"] = True
    return new


def _owner(param) -> FSDPUnit | None:
    """The unit that sharded this (original) parameter, if one did."""
    ref = getattr(param, "__dict__", {}).get("_axedist_sharded_by")
    return ref() if ref is not None else None


def _is_sharded(param) -> bool:
    return bool(getattr(param, "__dict__", {}).get("_axedist_sharded"))


def _view_spec(param: nn.Parameter, mesh: DeviceMesh, data_axes: tuple, name: str) -> DTensorSpec | None:
    """The spec the modules compute with: a DTensor parameter's own (on a sub-mesh of ``mesh``
    away from the data axes), ``None`` for a plain one."""
    # the mesh's device, or meta (a model built there: ``to_empty(device=...)`` after fully_shard, as torchtitan does)
    if param.device != mesh.device and not param.is_meta:
        raise ValueError(f"fully_shard: parameter {name} is on {param.device}, the mesh's device here is "
                         f"{mesh.device}; move the module first (or build it on the meta device)")
    if not isinstance(param, DTensor):
        return None
    spec = param._spec
    sub = spec.mesh
    if spec.reduce_op:
        raise LayoutError(f"fully_shard: parameter {name} has a pending {spec.reduce_op} ({spec})")
    # on the whole mesh, replicated over the data axes (torch's dp_mesh_dims): the modules compute with it so
    clash = [a for a in sub.axis_names if a in data_axes and not (sub == mesh and _replicated_over(spec, a))]
    if clash:
        raise MeshError(f"fully_shard: data-parallel axes {clash} are axes parameter {name} is already laid out on "
                        f"(its mesh {sub.axis_names}, layout {spec.layout}), not replicated there; shard over other "
                        f"axes of {mesh.axis_names}")
    missing = [a for a in sub.axis_names if a not in mesh.axis_names]
    if missing:
        raise MeshError(f"fully_shard: parameter {name} lives on mesh axes {sub.axis_names}, and mesh "
                        f"{mesh.axis_names} lacks {missing}")
    ordered = tuple(a for a in mesh.axis_names if a in sub.axis_names)
    if ordered != sub.axis_names or mesh[ordered] != sub:
        raise MeshError(f"fully_shard: parameter {name} lives on {sub}, which is not this rank's sub-mesh "
                        f"{mesh[ordered] if ordered == sub.axis_names else ordered} of {mesh}")
    return spec


def _replicated_over(spec: DTensorSpec, axis: str) -> bool:
    """Every coordinate of ``axis`` holds the whole of ``spec``'s tensor (torch's ``Replicate()``)."""
    layout = spec.layout
    return (not any(it.axis == axis for it in layout.shard) and not layout.offset.get(axis, 0)
            and [it for it in layout.replica if it.axis == axis] == [Iter(spec.mesh.size(axis), 1, axis)])



# ---------------------------------------------------------------------------
# Traced mode: the gathers as redistributes inside the graph (torch.compile fullgraph of dp x tp)
# ---------------------------------------------------------------------------


class GatheredView(nn.Module):
    """The parametrization ``fully_shard(..., traced=True)`` puts on a parameter: from the sharded
    parameter (a DTensor on the whole mesh) to what the module computes with (the DTensor on the
    tensor-parallel sub-mesh it had, or a plain tensor), in two traceable steps: the
    ``redistribute`` to the layout replicated over the data axes (an all-gather over ``dp``, of
    the shard cast to ``param_dtype``; its gradient moves in ``reduce_dtype``), and ``to_local``
    whose gradient is read as a pending mean over ``dp``: the redistribute's backward is then the
    reduce-scatter of the mean gradient onto the shard (FSDP's gradient; a one-process run's
    gradient when each dp rank's loss is the mean over its equal share of the batch)."""

    def __init__(self, gathered: DTensorSpec, view: DTensorSpec | None, grad_placements: tuple,
                 param_dtype: torch.dtype | None, reduce_dtype: torch.dtype | None):
        super().__init__()
        self.gathered, self.view, self.grad_placements = gathered, view, grad_placements
        self.param_dtype, self.reduce_dtype = param_dtype, reduce_dtype

    def forward(self, sharded: DTensor):
        # called through the class: torch 2.11's dynamo takes ``x.redistribute(...)`` on any tensor
        # subclass as torch DTensor's and needs constant arguments, which a Layout is not
        whole = DTensor.redistribute(sharded, self.gathered.layout, padded_shape=self.gathered.padded,
                                     forward_dtype=self.param_dtype, backward_dtype=self.reduce_dtype)
        local = DTensor.to_local(whole, grad_placements=self.grad_placements)
        if self.view is None:
            return local
        return DTensor.from_local(local, self.view.mesh, self.view.layout, self.view.shape,
                                  padded_shape=self.view.padded)

    def extra_repr(self) -> str:
        return (f"gathered {self.gathered}" + (f", computes in {self.param_dtype}" if self.param_dtype else "")
                + (f", reduces in {self.reduce_dtype}" if self.reduce_dtype else ""))


def shard_traced(module: nn.Module, mesh: DeviceMesh, shard_axes: tuple, replicate_axes: tuple,
                 mp_policy: MixedPrecisionPolicy) -> nn.Module:
    """``fully_shard(module, mesh, traced=True)``: every parameter of ``module`` becomes its
    sharded DTensor (the layout of the hooked mode: ``S[(2,2,2,6):(1@tp,1@dp,6,1)]`` for a
    ColwiseParallel ``(8, 6)`` on ``(dp, tp) = (2, 2)``) under a ``GatheredView``
    parametrization. Optimizers and ``state_dict`` see the sharded parameters under their own
    names (``wq.weight``, not ``wq.parametrizations.weight.original``).

    Without torch.compile it runs too, each gathered parameter then kept by autograd until
    backward (as ``reshard_after_forward=False``); with it the compiler decides. ``mp_policy`` as
    in the hooked mode: compute (and gather) in ``param_dtype``, reduce in ``reduce_dtype``, by
    default the parameter's own dtype. Alike modules share one parametrized class, so each
    block compiled alone (``layer.compile()``, torchtitan's way) reuses one graph. Not in this
    mode: HSDP (``replicate_axes``), parameters shared by several modules, parameters on the
    whole mesh (``dp_mesh_dims``'), mixing with hooked units in one model, and
    ``remove_parametrizations``."""
    if replicate_axes:
        raise NotImplementedError(f"fully_shard(traced=True): HSDP (replicate_axes {replicate_axes}) is not supported "
                                  f"in traced mode; use the hooked mode (traced=False)")
    if fsdp_units(module):
        raise ValueError("fully_shard(traced=True): this model already has hooked FSDP units; use one mode per model")
    seen: dict[int, str] = {}
    slots = []
    for mod_name, sub in module.named_modules(remove_duplicate=False):
        for pname, param in sub._parameters.items():
            if param is None:
                continue
            qualified = f"{mod_name}.{pname}" if mod_name else pname
            if id(param) in seen or _is_sharded(param):
                raise ValueError(f"fully_shard(traced=True): {qualified} is shared with "
                                 f"{seen.get(id(param), 'another sharded module')} or already sharded; traced mode "
                                 f"shards each parameter once (untie it, or use the hooked mode)")
            seen[id(param)] = qualified
            slots.append((sub, pname, param, qualified))
    for sub, pname, param, qualified in slots:
        view = _view_spec(param, mesh, shard_axes, qualified)
        if view is not None and view.mesh == mesh:
            raise NotImplementedError(f"fully_shard(traced=True): parameter {qualified} is a DTensor on the whole mesh; "
                                      f"traced mode takes parameters on the tensor-parallel sub-mesh (or plain ones)")
        gathered, sharded = data_parallel_specs(view, param.shape, mesh, shard_axes)
        if target_spec(sharded, gathered.layout, gathered.padded, None) != gathered:
            raise LayoutError(f"fully_shard(traced=True): parameter {qualified}'s gathered layout {gathered.layout} "
                              f"pads inside a dim (rows {gathered.true_index}), which a redistribute to a layout "
                              f"cannot name; use the hooked mode")
        sub._parameters[pname] = _sharded_parameter(param, gathered, sharded)
        gather = GatheredView(gathered, view, _mean_over(mesh, shard_axes, view, qualified),
                              mp_policy.param_dtype, mp_policy.reduce_dtype)
        parametrize.register_parametrization(sub, pname, gather, unsafe=True)
    for sub in {id(sub): sub for sub, *_ in slots}.values():
        _share_parametrized_class(sub)
    module._register_state_dict_hook(_plain_names)
    module._register_load_state_dict_pre_hook(_parametrized_names, with_module=True)
    return module


_PARAMETRIZED_CLASSES: dict = memo("nn.fsdp parametrized classes")  # (class, parametrized names) -> shared class


def _share_parametrized_class(module: nn.Module) -> None:
    """Give ``module`` the parametrized class that every module of its class with the same
    parametrized names shares (as torch's ``fully_shard`` makes one ``FSDP<cls>`` per class).
    ``register_parametrization`` makes a class per module, and Dynamo guards each module it
    traces by its class's id (``___check_type_id(self._modules['ffn_norm'], ...)``, type
    ``ParametrizedRMSNorm``): with a class per module, ``layer.compile()`` compiled each block
    anew. The ``GatheredView`` specs are guarded by value, so with one class one graph serves
    every alike block. The shared class's properties read ``self``'s parametrizations (torch's
    read the module they were made for, inside ``parametrize.cached()``). Removing one module's
    parametrization (``remove_parametrizations``) would remove the property from every module of
    the class: traced mode does not support it."""
    names = tuple(module.parametrizations)
    made = type(module)
    base = made.__bases__[0]  # the module's class before parametrizations (type_before_parametrizations)
    key = (base, names)
    shared = _PARAMETRIZED_CLASSES.get(key)
    if shared is None:
        kept = {k: v for k, v in made.__dict__.items() if k in ("__getstate__", "__deepcopy__")}
        shared = type(made.__name__, (base,), {**kept, **{n: _parametrized_property(n) for n in names}})
        _PARAMETRIZED_CLASSES[key] = shared
    module.__class__ = shared


def _parametrized_property(name: str) -> property:
    """The property ``register_parametrization`` puts on a parametrized class for ``name``,
    reading ``self``'s parametrizations (once per module inside ``parametrize.cached()``)."""
    def get(self):
        if parametrize._cache_enabled:
            key = (id(self), name)
            value = parametrize._cache.get(key)
            if value is None:
                value = parametrize._cache[key] = self.parametrizations[name]()
            return value
        return self.parametrizations[name]()

    def set_original(self, value):
        self.parametrizations[name].right_inverse(value)

    return property(get, set_original)


def _mean_over(mesh: DeviceMesh, axes: tuple, view: DTensorSpec | None, name: str) -> tuple:
    """The placements on ``mesh`` of a gathered parameter's gradient: a pending mean over ``axes``
    and the view's own placements on the other axes (Replicate where the view has none)."""
    own = {}
    if view is not None:
        try:
            own = dict(zip(view.mesh.axis_names, placements_of(view)))
        except LayoutError as error:
            raise LayoutError(f"fully_shard(traced=True): parameter {name}'s layout {view.layout} has no placements "
                              f"form, which traced mode needs for its gradient; use the hooked mode") from error
    return tuple(Partial("avg") if a in axes else own.get(a, Replicate()) for a in mesh.axis_names)


_PARAMETRIZED = re.compile(r"(^|\.)parametrizations\.([^.]+)\.original$")


def _plain_names(module, state_dict, prefix, local_metadata):
    """state_dict hook: ``x.parametrizations.weight.original`` -> ``x.weight`` (the sharded value)."""
    for key in [k for k in state_dict if _PARAMETRIZED.search(k)]:
        state_dict[_PARAMETRIZED.sub(r"\1\2", key)] = state_dict.pop(key)
    return state_dict


def _parametrized_names(module, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs):
    """load_state_dict pre-hook: the plain names back to the parametrizations' ``original``."""
    for name, sub in module.named_modules():
        if not parametrize.is_parametrized(sub):
            continue
        for pname in sub.parametrizations:
            plain = f"{prefix}{name + '.' if name else ''}{pname}"
            if plain in state_dict:
                state_dict[f"{prefix}{name + '.' if name else ''}parametrizations.{pname}.original"] = \
                    state_dict.pop(plain)
