"""Shared helpers of the op-family tests (test_ops_tensor, test_ops_reduction, test_ops_norm; the
meshes and hypothesis settings also of test_ops_{random,loss,attention,embedding}).

Every test builds fp64 global tensors from a fresh seed on every rank (same values on all
ranks), lays them out with placements on a 1-D or 2x2 mesh (``Partial`` included: each rank
then holds a random summand, or a value below the max, whose reduction is the tensor), runs
the op on DTensors and compares ``full_tensor()`` (and gradients) with the op on the plain
global tensors.
"""

from __future__ import annotations

import itertools
import math

import torch
from torch.distributed.tensor import Partial, Replicate, Shard

from axedist.dtensor import DTensor, distribute
from axedist.layout import LayoutError
from axedist.mesh import DeviceMesh

MESHES = {"2": ((2,), ("gpuid",)), "4": ((4,), ("gpuid",)), "2x2": ((2, 2), ("x", "y"))}
WORLD = {"2": 2, "4": 4, "2x2": 4}
TOL = dict(rtol=1e-9, atol=1e-9)


def gathered(what: str, out: DTensor) -> list[str]:
    """The failure of a layout way whose output went into placement form: [] when ``out`` keeps
    a layout that has none (its ``placements`` raise LayoutError), else "what: gathered to ..."."""
    try:
        return [f"{what}: gathered to {out.placements}"]
    except LayoutError:
        return []


def mesh_of(name: str) -> DeviceMesh:
    return DeviceMesh("cpu", *MESHES[name])


def placement_sets(mesh: DeviceMesh, options) -> list[list]:
    """Every assignment of ``options`` to the mesh axes (one pending op per tensor)."""
    out = []
    for combo in itertools.product(options, repeat=mesh.ndim):
        ops = {p.reduce_op for p in combo if isinstance(p, Partial)}
        if len(ops) <= 1:
            out.append(list(combo))
    return out


def sample_sets(mesh: DeviceMesh, options, g: torch.Generator, k: int = 5) -> list[list]:
    """``k`` of the placement sets, drawn with ``g`` (all of them when there are few)."""
    sets = placement_sets(mesh, options)
    if len(sets) <= k:
        return sets
    return [sets[i] for i in torch.randperm(len(sets), generator=g)[:k].tolist()]


def make(full: torch.Tensor, mesh: DeviceMesh, placements, seed: int, requires_grad: bool = False) -> DTensor:
    """``full`` laid out with ``placements`` as a leaf DTensor.

    With ``Partial("sum")`` axes each rank holds a random summand (the summands add up to
    ``full``); with ``Partial("max")``/``("min")`` every rank holds values at or below (above)
    ``full`` and a random one holds each element exactly."""
    placements = list(placements)
    partial = [i for i, p in enumerate(placements) if isinstance(p, Partial)]
    if not partial:
        dt = distribute(full, mesh, placements)
    else:
        op = placements[partial[0]].reduce_op
        k = math.prod(mesh.shape[i] for i in partial)
        coords = mesh.coordinates()
        mine = 0
        for i in partial:
            mine = mine * mesh.shape[i] + coords[mesh.axis_names[i]]
        g = torch.Generator().manual_seed(seed + 7)
        # quarter-integer summands: integer-valued tensors (ties) add back exactly
        noise = (torch.randn((k,) + tuple(full.shape), generator=g, dtype=torch.float64) * 4).round() / 4
        noise = noise.to(full.dtype)
        if op == "sum":
            local = noise[mine] if mine < k - 1 else full - noise[:-1].sum(0)
        else:
            exact = torch.randint(0, k, tuple(full.shape), generator=g)
            step = noise[mine].abs() if op == "max" else -noise[mine].abs()
            local = torch.where(exact == mine, full, full - step)
        base = [p if isinstance(p, Partial) else Replicate() for p in placements]
        dt = DTensor.from_local(local.contiguous(), mesh, base).redistribute(placements)
    dt = dt.detach()
    if requires_grad:
        dt.requires_grad_(True)
    return dt


def replicated(full: torch.Tensor, mesh: DeviceMesh) -> DTensor:
    return distribute(full, mesh, [Replicate()] * mesh.ndim)


def rand(g: torch.Generator, *shape) -> torch.Tensor:
    return torch.randn(tuple(shape), generator=g, dtype=torch.float64)


def randint(g: torch.Generator, low: int, high: int) -> int:
    return int(torch.randint(low, high, (1,), generator=g))


def close(actual, expected, what: str) -> None:
    if isinstance(actual, DTensor):
        actual = actual.full_tensor()
    torch.testing.assert_close(actual, expected, **TOL, msg=lambda m: f"{what}: {m}")


def shards(placements, dim) -> list[int]:
    """Mesh axes whose placement is ``Shard(dim)``."""
    return [i for i, p in enumerate(placements) if isinstance(p, Shard) and p.dim == dim]


def check(fn, inputs, mesh: DeviceMesh, seed: int, g: torch.Generator, what: str, expect=None, backward=True):
    """Run ``fn`` on DTensors and on the plain tensors; compare outputs and gradients.

    ``inputs``: ``(full, placements)`` pairs (a floating ``full`` gets a gradient). The
    DTensor outputs are returned (for placement checks: ``expect(outputs)`` runs too).
    Floating outputs are back-propagated with a random replicated gradient (unless
    ``backward`` is False).
    """
    dts, refs = [], []
    for i, (full, placements) in enumerate(inputs):
        grad = full.is_floating_point()
        dts.append(make(full, mesh, placements, seed + 101 * i, requires_grad=grad))
        refs.append(full.clone().requires_grad_(grad))
    out, ref = fn(*dts), fn(*refs)
    outs = list(out) if isinstance(out, (list, tuple)) else [out]
    ref_outs = list(ref) if isinstance(ref, (list, tuple)) else [ref]
    assert len(outs) == len(ref_outs), what
    for k, (o, r) in enumerate(zip(outs, ref_outs)):
        assert isinstance(o, DTensor), f"{what}: output {k} is {type(o)}"
        assert o.shape == r.shape and o.dtype == r.dtype, \
            f"{what}: output {k} {o.shape} {o.dtype} vs {r.shape} {r.dtype}"
        close(o, r, f"{what}: output {k}")
    if expect is not None:
        expect(outs)
    pairs = [(o, r) for o, r in zip(outs, ref_outs) if r.requires_grad and backward]
    if pairs:
        grads = [rand(g, *r.shape) for _, r in pairs]
        torch.autograd.backward([o for o, _ in pairs], [replicated(G, mesh) for G in grads])
        torch.autograd.backward([r for _, r in pairs], grads)
        for i, (d, r) in enumerate(zip(dts, refs)):
            if r.requires_grad:
                assert r.grad is not None and d.grad is not None, f"{what}: input {i} got no gradient"
                close(d.grad, r.grad, f"{what}: gradient of input {i}")
    return outs


__all__ = ["check", "sample_sets", "MESHES", "WORLD", "TOL", "mesh_of", "placement_sets",
           "make", "replicated", "rand", "randint", "close", "shards", "Partial", "Replicate", "Shard"]
