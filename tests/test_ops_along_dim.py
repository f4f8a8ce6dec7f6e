"""Rules instead of the gather fallback for the ops a transformer step meets along one dim:
``_safe_softmax`` (attention's masked softmax), ``topk`` /
``max(dim)`` / ``min(dim)`` (sampling, routing), and the scans and sorts of ``ops/along_dim.py``.

Each runs against the plain op (values, gradients) with its input sharded on a dim the op does
not work along, and on the one it does; where the op's dim is not the sharded one nothing moves
forward (``count_collectives``: no route ran), and no op falls back.
"""

import warnings

import pytest
import torch

import axedist as ax
from axedist.dtensor import distribute, DTensor
from axedist.runtime import count_collectives
from axedist.testing import run_on_ranks
from tests.ops_cases import Partial, Replicate, Shard, make, mesh_of

aten = torch.ops.aten


def _masked(x):
    """A causal mask with a fully masked first row, as attention's masked softmax meets it."""
    mask = torch.ones(x.shape[-2], x.shape[-1], dtype=torch.bool).tril()
    mask[0] = False
    if isinstance(x, DTensor):
        mask = distribute(mask, x.mesh, [Replicate()] * x.mesh.ndim, src_rank=None)
    return x.masked_fill(~mask, float("-inf"))


# name -> (function of x, x's shape, the dims the op works along (sharding them may move data))
CASES = {
    "safe_softmax": (lambda x: aten._safe_softmax(_masked(x), -1), (2, 6, 6), ()),
    "topk": (lambda x: x.topk(2, dim=-1), (6, 5), (-1,)),
    "topk smallest": (lambda x: x.topk(3, dim=0, largest=False), (5, 6), (0,)),
    "max(dim)": (lambda x: x.max(dim=-1), (6, 5), ()),
    "min(dim) keepdim": (lambda x: x.min(dim=0, keepdim=True), (5, 6), ()),
    "sort": (lambda x: x.sort(dim=1, descending=True), (4, 6), (1,)),
    "cumsum": (lambda x: x.cumsum(-1), (4, 6), (-1,)),
    "cummax": (lambda x: x.cummax(1), (4, 6), (1,)),
    "logcumsumexp": (lambda x: x.logcumsumexp(0), (5, 4), (0,)),
    "kthvalue": (lambda x: x.kthvalue(2, dim=1), (4, 6), (1,)),
    "median(dim)": (lambda x: x.median(dim=1), (4, 5), (1,)),
    # renorm's norm runs over every dim but its own: those are the ones that move
    "renorm dim 0": (lambda x: x.renorm(2, 0, 1.0), (5, 6, 4), (1, 2)),
    "renorm dim 1": (lambda x: x.renorm(1, 1, 0.5), (4, 6), (0,)),
}
GATHERED_FALLBACKS = ("aten._safe_softmax", "aten.topk", "aten.max.dim", "aten.min.dim",
                      "aten.sort", "aten.cumsum", "aten.cummax", "aten.logcumsumexp", "aten.kthvalue", "aten.median", "aten.renorm")


def _outputs(value) -> list:
    return list(value) if isinstance(value, tuple) else [value]


def _case(rank, world, mesh_name):
    warnings.simplefilter("ignore")
    mesh = mesh_of(mesh_name)
    g = torch.Generator().manual_seed(17)
    DTensor.dispatcher.forget_fallbacks()
    ran = 0
    for name, (fn, shape, along) in CASES.items():
        full = torch.randn(shape, dtype=torch.float64, generator=g)
        along = {d % len(shape) for d in along}
        shardings = [[Replicate()] * mesh.ndim] + [[Shard(d)] * mesh.ndim for d in range(len(shape))]
        if mesh.ndim == 2:
            shardings.append([Shard(0), Shard(len(shape) - 1)])
        for placements in shardings:
            what = f"{name} {placements} on {mesh_name}"
            x = make(full, mesh, placements, 5, requires_grad=True)
            ref = full.clone().requires_grad_()
            sharded = {p.dim % len(shape) for p in placements if isinstance(p, Shard)}
            with count_collectives() as seen:
                got = fn(x)
            want = fn(ref)
            if not (sharded & along) and not any(isinstance(p, Partial) for p in placements):
                assert seen.calls == 0, f"{what}: moved data: {seen}"
            for k, (o, w) in enumerate(zip(_outputs(got), _outputs(want))):
                assert o.shape == w.shape and o.dtype == w.dtype, f"{what}: output {k}"
                torch.testing.assert_close(o.full_tensor(), w, rtol=1e-9, atol=1e-9,
                                           msg=lambda m: f"{what}: output {k}: {m}")
            values, wanted = _outputs(got)[0], _outputs(want)[0]
            up = torch.randn(wanted.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
            (wanted * up).sum().backward()
            (values * distribute(up, mesh, [Replicate()] * mesh.ndim)).sum().backward()
            torch.testing.assert_close(x.grad.full_tensor(), ref.grad, rtol=1e-9, atol=1e-9,
                                       msg=lambda m: f"{what}: gradient: {m}")
            ran += 1
    fell_back = [str(f) for f in DTensor.dispatcher.fallback_ops() if str(f).startswith(GATHERED_FALLBACKS)]
    assert not fell_back, f"gathered: {fell_back}"
    return ran


@pytest.mark.parametrize("mesh_name", ["2", "2x2"])
def test_along_dim_ops_keep_shards_and_match_the_plain_ops(mesh_name):
    counts = run_on_ranks(_case, 2 if mesh_name == "2" else 4, args=(mesh_name,))
    assert len(set(counts)) == 1 and counts[0] >= 3 * len(CASES)
