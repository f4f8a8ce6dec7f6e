"""Deferred mm/addmm with a pending sum, and its fused GEMM + reduce-scatter wiring (CPU side).

On CPU the fused kernel never runs (it is CUDA-only); these tests check what the CUDA path
relies on: the product waits (deferred), a reduce-scatter of its rows goes through the fused
decision (here: GEMM, then the planned collective, with the reason), every other use computes
it exactly once, and values and gradients equal torch on the full tensors.
"""

import copy
import dataclasses
import random

import pytest
import torch
import torch.nn.functional as F
from torch.distributed.tensor import Partial, Replicate, Shard

from axedist.dtensor import DTensor, distribute, fused_gemm_stats, plan
from axedist.layout import LayoutError
from axedist.mesh import DeviceMesh
from axedist.testing import run_on_ranks

R, P = Replicate(), Partial()


def _deferring(fn):
    """Run ``fn`` with mm/addmm deferring on CPU too (by default only CUDA bf16/fp16 defers)."""
    def run(rank, world, *args):
        old = DTensor.dispatcher.defer_gemm
        DTensor.dispatcher.defer_gemm = "always"
        try:
            return fn(rank, world, *args)
        finally:
            DTensor.dispatcher.defer_gemm = old
    run.__name__ = run.__qualname__ = fn.__name__
    return run


def _delta(before, after):
    return {k: after[k] - before[k] for k in ("deferred", "fused", "unfused", "materialized")}


@_deferring
def _row_parallel(rank, world, seed):
    """x [M, K] Shard(1) @ w [K, N] Shard(0) -> pending sum -> Shard(0): values, counters, plan, grads."""
    mesh = DeviceMesh("cpu", (world,))
    g = torch.Generator().manual_seed(seed)
    m = world * random.Random(seed).randint(2, 4)
    a = torch.randn(m, 3 * world + 1, generator=g, dtype=torch.float64, requires_grad=True)
    b = torch.randn(3 * world + 1, 5, generator=g, dtype=torch.float64, requires_grad=True)
    da, db = distribute(a, mesh, [Shard(1)]), distribute(b, mesh, [Shard(0)])
    before = fused_gemm_stats()
    c = da @ db
    assert c.placements == (P,)
    assert _delta(before, fused_gemm_stats()) == {"deferred": 1, "fused": 0, "unfused": 0, "materialized": 0}
    p = plan(c, [Shard(0)])
    assert p.fused is not None and not p.fused.fused and "CUDA-only" in p.fused.reason
    assert "fused GEMM + reduce-scatter not used" in str(p) and "reduce_scatter" in p.kinds  # the route's
    y = c.redistribute([Shard(0)])
    d = _delta(before, fused_gemm_stats())
    assert d == {"deferred": 1, "fused": 0, "unfused": 1, "materialized": 1}, d
    assert "CUDA-only" in fused_gemm_stats()["reason"]
    ref = a @ b
    assert y.placements == (Shard(0),) and torch.allclose(y.full_tensor(), ref)
    w = torch.randn(ref.shape, generator=g, dtype=torch.float64)
    loss = (y.full_tensor() * w).sum()
    ga, gb = torch.autograd.grad(loss, (a, b))
    wa, wb = torch.autograd.grad((ref * w).sum(), (a, b))
    assert torch.allclose(ga, wa) and torch.allclose(gb, wb)
    # the pending sum itself still reads right afterwards (computed once, not again)
    assert torch.allclose(c.full_tensor(), ref)
    assert _delta(before, fused_gemm_stats())["materialized"] == 1
    return True


@_deferring
def _other_uses(rank, world, seed):
    """Any use computes the product (once) and is right; a row reduce-scatter or an all-reduce
    (full_tensor, to Replicate) first asks the fused GEMM + collective (CPU: not fused)."""
    mesh = DeviceMesh("cpu", (world,))
    g = torch.Generator().manual_seed(seed)
    a = torch.randn(2 * world, 2 * world + 1, generator=g, dtype=torch.float64)
    b = torch.randn(2 * world + 1, 3, generator=g, dtype=torch.float64)
    ref = a @ b
    da, db = distribute(a, mesh, [Shard(1)]), distribute(b, mesh, [Shard(0)])
    uses = [
        ("to_local", lambda c: c.to_local(), None),
        ("full_tensor", lambda c: c.full_tensor(), ref),
        ("to Replicate", lambda c: c.redistribute([R]).full_tensor(), ref),
        ("to Shard(1)", lambda c: c.redistribute([Shard(1)]).full_tensor(), ref),
        ("an op", lambda c: (c * 2).full_tensor(), 2 * ref),
        ("a view", lambda c: c.t().full_tensor(), ref.t()),
        ("in place", lambda c: c.mul_(3).full_tensor(), 3 * ref),
    ]
    for name, use, want in uses:
        before = fused_gemm_stats()
        c = torch.mm(da, db)
        got = use(c)
        d = _delta(before, fused_gemm_stats())
        all_reduce = name in ("full_tensor", "to Replicate")
        assert d["deferred"] == 1 and d["materialized"] == 1 and d["unfused"] == all_reduce, (name, d)
        if want is not None:
            assert torch.allclose(got, want), name
    # plan() of an all-reduce names the fused GEMM + all-reduce (not used on CPU); of a move
    # that is neither a row reduce-scatter nor an all-reduce, it is the ordinary route
    c = torch.mm(da, db)
    step = plan(c, [R]).fused
    assert step.collective == "all-reduce" and not step.fused and "CUDA-only" in step.reason
    assert "fused GEMM + all-reduce not used" in str(plan(c, [R]))
    assert plan(c, [Shard(1)]).fused is None
    # an op on anything flushes outstanding products first: an in-place change of an operand
    # afterwards cannot reach the product
    c = torch.mm(da, db)
    da.add_(1.0)
    assert torch.allclose(c.full_tensor(), ref)
    # changing an operand's local tensor behind axedist's back (no op dispatched) is caught,
    # not silently wrong
    db2 = distribute(b, mesh, [Shard(0)])
    c = torch.mm(distribute(a, mesh, [Shard(1)]), db2)
    db2.to_local().add_(1.0)
    assert c._pending is not None, fused_gemm_stats()
    with pytest.raises(LayoutError, match="changed in place"):
        c.to_local()
    return True


@_deferring
def _addmm_and_linear(rank, world, seed):
    """addmm (bias counted once), F.linear with and without bias as RowwiseParallel calls it."""
    mesh = DeviceMesh("cpu", (world,))
    g = torch.Generator().manual_seed(seed)
    m, k, n = 2 * world, 2 * world + 3, 6
    x = torch.randn(m, k, generator=g, dtype=torch.float64, requires_grad=True)
    w = torch.randn(n, k, generator=g, dtype=torch.float64, requires_grad=True)
    bias = torch.randn(n, generator=g, dtype=torch.float64, requires_grad=True)
    bias2 = torch.randn(m, n, generator=g, dtype=torch.float64)
    dx, dw = distribute(x, mesh, [Shard(1)]), distribute(w, mesh, [Shard(1)])
    dbias = distribute(bias, mesh, [R])
    cases = [
        (lambda: F.linear(dx, dw), lambda: F.linear(x, w), (x, w)),
        (lambda: F.linear(dx, dw, dbias), lambda: F.linear(x, w, bias), (x, w, bias)),
        (lambda: torch.addmm(distribute(bias2, mesh, [R]), dx, dw.t(), beta=0.5, alpha=-2.0),
         lambda: torch.addmm(bias2, x, w.t(), beta=0.5, alpha=-2.0), (x, w)),
    ]
    for ours, theirs, leaves in cases:
        before = fused_gemm_stats()
        partial = ours()
        assert partial.placements == (P,)
        y = partial.redistribute((Shard(0),))
        d = _delta(before, fused_gemm_stats())
        assert d == {"deferred": 1, "fused": 0, "unfused": 1, "materialized": 1}, d
        ref = theirs()
        assert torch.allclose(y.full_tensor(), ref)
        up = torch.randn(ref.shape, generator=g, dtype=torch.float64)
        got = torch.autograd.grad((y.full_tensor() * up).sum(), leaves)
        want = torch.autograd.grad((ref * up).sum(), leaves)
        for a, b in zip(got, want):
            assert torch.allclose(a, b)
    return True


@_deferring
def _not_row_scatter(rank, world, seed):
    """2x2 mesh: a pending sum on one axis, rows of the other kept; uneven rows; two partial axes."""
    mesh = DeviceMesh("cpu", (2, 2), ("dp", "tp"))
    g = torch.Generator().manual_seed(seed)
    a = torch.randn(8, 6, generator=g, dtype=torch.float64)
    b = torch.randn(6, 4, generator=g, dtype=torch.float64)
    ref = a @ b
    # columns on dp, contraction on tp: (Shard(1), Partial) -> (Shard(1), Shard(0)) is a row RS on tp
    c = torch.mm(distribute(a, mesh, [R, Shard(1)]), distribute(b, mesh, [Shard(1), Shard(0)]))
    assert c.placements == (Shard(1), P)
    p = plan(c, [Shard(1), Shard(0)])
    assert p.fused is not None and "CUDA-only" in p.fused.reason
    assert torch.allclose(c.redistribute([Shard(1), Shard(0)]).full_tensor(), ref)
    # rows already split on dp: the row blocks differ from the kernel's, so no fused choice
    c = torch.mm(distribute(a, mesh, [Shard(0), Shard(1)]), distribute(b, mesh, [R, Shard(0)]))
    assert c.placements == (Shard(0), P)
    assert plan(c, [Shard(0), Shard(0)]).fused is None
    assert torch.allclose(c.redistribute([Shard(0), Shard(0)]).full_tensor(), ref)
    # a pending sum over both axes is not deferred (the kernel reduces over one group)
    before = fused_gemm_stats()
    c = torch.mm(distribute(a, mesh, [Shard(1), Shard(1)]), distribute(b, mesh, [Shard(0), Shard(0)]))
    assert c.placements == (P, P) and _delta(before, fused_gemm_stats())["deferred"] == 0
    assert torch.allclose(c.full_tensor(), ref)
    # uneven rows (7 on 2 ranks): deferred, but a row RS of it is not the kernel's equal blocks
    a7 = torch.randn(7, 6, generator=g, dtype=torch.float64)
    c = torch.mm(distribute(a7, mesh, [R, Shard(1)]), distribute(b, mesh, [R, Shard(0)]))
    assert plan(c, [R, Shard(0)]).fused is None
    assert torch.allclose(c.redistribute([R, Shard(0)]).full_tensor(), a7 @ b)
    return True


@_deferring
def _rowwise_module(rank, world, seed):
    """axedist.nn.RowwiseParallel(output_layouts=Shard(0)) reaches the fused decision (CPU: the
    GEMM then the reduce-scatter, reason named) and its output and grads equal the plain Linear's."""
    from axedist.nn import RowwiseParallel, parallelize

    mesh = DeviceMesh("cpu", (world,))
    torch.manual_seed(seed)
    s, b, k, n = 2 * world, 3, 2 * world + 1, 5
    lin = torch.nn.Linear(k, n, dtype=torch.float64)
    ref = torch.nn.Linear(k, n, dtype=torch.float64)
    ref.load_state_dict(lin.state_dict())
    parallelize(lin, mesh, {"": RowwiseParallel(output_layouts=Shard(0))})
    x = torch.randn(s, b, k, dtype=torch.float64)
    before = fused_gemm_stats()
    y = lin(distribute(x, mesh, [Shard(2)]))
    d = _delta(before, fused_gemm_stats())
    assert d == {"deferred": 1, "fused": 0, "unfused": 1, "materialized": 1}, d
    assert "CUDA-only" in fused_gemm_stats()["reason"]
    want = ref(x)
    assert y.placements == (Shard(0),) and torch.allclose(y.full_tensor(), want)
    up = torch.randn(want.shape, dtype=torch.float64)
    (y.full_tensor() * up).sum().backward()
    (want * up).sum().backward()
    assert torch.allclose(lin.weight.grad.full_tensor(), ref.weight.grad)
    assert torch.allclose(lin.bias.grad.full_tensor(), ref.bias.grad)
    return True


@_deferring
def _rowwise_module_inference(rank, world, seed):
    """The same layer under torch.inference_mode (what infer_tp.py runs): the deferred product's
    operands are inference tensors, which keep no version counter."""
    from axedist.nn import RowwiseParallel, describe, parallelize

    mesh = DeviceMesh("cpu", (world,))
    torch.manual_seed(seed)
    lin = torch.nn.Linear(2 * world + 1, 5, dtype=torch.float64)
    ref = torch.nn.Linear(2 * world + 1, 5, dtype=torch.float64)
    ref.load_state_dict(lin.state_dict())
    parallelize(lin, mesh, {"": RowwiseParallel(output_layouts=Shard(0))})
    x = torch.randn(2 * world, 3, 2 * world + 1, dtype=torch.float64)
    with torch.inference_mode():
        before = fused_gemm_stats()
        y = lin(distribute(x, mesh, [Shard(2)]))
        assert _delta(before, fused_gemm_stats())["deferred"] == 1
        assert y.placements == (Shard(0),) and torch.allclose(y.full_tensor(), ref(x))
    return describe(lin)


@pytest.mark.parametrize("world", [2, 4])
def test_rowwise_parallel_under_inference_mode(world):
    text = run_on_ranks(_rowwise_module_inference, world, args=(random.randrange(10**6),))[0]
    assert "forward ran: reduce_scatter over gpuid: 1 call" in text, text   # counted under inference_mode too


def _auto_on_cpu(rank, world, seed):
    """By default a CPU (or fp32/fp64) product runs at once: nothing is deferred, values right."""
    mesh = DeviceMesh("cpu", (world,))
    g = torch.Generator().manual_seed(seed)
    a = torch.randn(2 * world, 3 * world, generator=g, dtype=torch.float64)
    b = torch.randn(3 * world, 4, generator=g, dtype=torch.float64)
    assert DTensor.dispatcher.defer_gemm == "auto"
    before = fused_gemm_stats()
    c = torch.mm(distribute(a, mesh, [Shard(1)]), distribute(b, mesh, [Shard(0)]))
    assert c._pending is None and _delta(before, fused_gemm_stats())["deferred"] == 0
    assert plan(c, [Shard(0)]).fused is None
    assert torch.allclose(c.redistribute([Shard(0)]).full_tensor(), a @ b)
    return True


def test_cpu_products_are_not_deferred_by_default():
    run_on_ranks(_auto_on_cpu, 2, args=(random.randrange(10**6),))


@pytest.mark.parametrize("world", [2, 4])
def test_rowwise_parallel_pattern_reaches_fused_path(world):
    run_on_ranks(_rowwise_module, world, args=(random.randrange(10**6),))


@pytest.mark.parametrize("world", [2, 4])
def test_row_parallel_mm_then_reduce_scatter(world):
    run_on_ranks(_row_parallel, world, args=(random.randrange(10**6),))


@pytest.mark.parametrize("world", [2, 4])
def test_other_uses_materialize_once(world):
    run_on_ranks(_other_uses, world, args=(random.randrange(10**6),))


@pytest.mark.parametrize("world", [2, 4])
def test_addmm_and_linear_fuse_path(world):
    run_on_ranks(_addmm_and_linear, world, args=(random.randrange(10**6),))


def test_2d_mesh_and_non_row_moves():
    run_on_ranks(_not_row_scatter, 4, args=(random.randrange(10**6),))


def _gathering(fn):
    """Run ``fn`` with row all-gathers deferred on CPU too (by default only CUDA bf16/fp16)."""
    def run(rank, world, *args):
        from axedist.runtime.deferred import defer_gathers
        old = defer_gathers()
        defer_gathers("always")
        try:
            return fn(rank, world, *args)
        finally:
            defer_gathers(old)
    run.__name__ = run.__qualname__ = fn.__name__
    return run


def _gather_delta(before, after):
    return {k: after[k] - before[k] for k in ("gathers_deferred", "gathers_fused", "gathers_materialized")}


@_gathering
def _colwise_sequence_parallel(rank, world, seed):
    """ColwiseParallel with sequence-parallel input: the all-gather of x's rows is deferred and
    reaches the fused decision through linear's view and mm (CPU: not fused, the reason
    named, gathered once); two layers share the gathered x (one gather); values and grads
    equal the plain Linears'; an in-place change of the rows first runs the gather."""
    from axedist.nn import ColwiseParallel, parallelize
    from axedist.runtime.deferred import fused_gemm_stats as stats

    mesh = DeviceMesh("cpu", (world,))
    torch.manual_seed(seed)
    s, b, k, n = 2 * world, 3, 5, 2 * world
    pair = torch.nn.ModuleDict({"q": torch.nn.Linear(k, n, dtype=torch.float64),
                                "k": torch.nn.Linear(k, n, bias=False, dtype=torch.float64)})
    ref = torch.nn.ModuleDict({"q": torch.nn.Linear(k, n, dtype=torch.float64),
                               "k": torch.nn.Linear(k, n, bias=False, dtype=torch.float64)})
    ref.load_state_dict(pair.state_dict())
    parallelize(pair, mesh, {"q": ColwiseParallel(), "k": ColwiseParallel()})
    x = torch.randn(s, b, k, dtype=torch.float64, requires_grad=True)
    dx = distribute(x, mesh, [Shard(0)])
    before = stats()
    gathered = dx.redistribute([R])                    # what PrepareModuleInput does
    assert _gather_delta(before, stats()) == {"gathers_deferred": 1, "gathers_fused": 0, "gathers_materialized": 0}
    yq, yk = pair["q"](gathered), pair["k"](gathered)
    d = _gather_delta(before, stats())
    assert d == {"gathers_deferred": 1, "gathers_fused": 0, "gathers_materialized": 1}, d
    assert "CUDA" in stats()["gather_reason"], stats()["gather_reason"]
    want_q, want_k = ref["q"](x), ref["k"](x)
    assert yq.placements == (Shard(2),) and torch.allclose(yq.full_tensor(), want_q)
    assert torch.allclose(yk.full_tensor(), want_k)
    up = torch.randn(want_q.shape, dtype=torch.float64)
    (yq.full_tensor() * up + yk.full_tensor() * up).sum().backward()
    (want_q * up + want_k * up).sum().backward()
    assert torch.allclose(pair["q"].weight.grad.full_tensor(), ref["q"].weight.grad)
    assert torch.allclose(pair["q"].bias.grad.full_tensor(), ref["q"].bias.grad)
    assert torch.allclose(pair["k"].weight.grad.full_tensor(), ref["k"].weight.grad)
    # an in-place op on the source rows runs the pending gather first: it sees the old rows
    rows = distribute(x.detach(), mesh, [Shard(0)])
    gathered = rows.redistribute([R])
    rows.add_(1.0)
    assert torch.allclose(gathered.full_tensor(), x.detach())
    # a plain DTensor matmul: rows Shard(0) on the way to column-sharded weights
    w = torch.randn(k, 4 * world, dtype=torch.float64)
    before = stats()
    rows = x.detach().reshape(s * b, k)
    y = torch.mm(distribute(rows, mesh, [Shard(0)]).redistribute([R]), distribute(w, mesh, [Shard(1)]))
    assert _gather_delta(before, stats()) == {"gathers_deferred": 1, "gathers_fused": 0, "gathers_materialized": 1}
    assert y.placements == (Shard(1),) and torch.allclose(y.full_tensor(), rows @ w)
    return True


@pytest.mark.parametrize("world", [2, 4])
def test_colwise_sequence_parallel_defers_its_gather(world):
    run_on_ranks(_colwise_sequence_parallel, world, args=(random.randrange(10**6),))


@_gathering
def _rowwise_backward_gather(rank, world, seed):
    """RowwiseParallel with a sequence-parallel output: in backward the output gradient's row
    all-gather (Shard(0) -> Replicate) is deferred, and torch's mm backward asks for its
    transpose first (the weight gradient, ``grad.t() @ x``). The transpose and that product stay
    pending, so the gather reaches the fused all-gather + GEMM decision through the input
    gradient's mm (CPU: not fused, the CUDA reason named) and runs once; the input and weight
    gradients equal the plain Linear's. Before this, ``t`` ran the gather on its own."""
    from axedist.nn import RowwiseParallel, parallelize
    from axedist.runtime.deferred import PENDING, fused_gemm_stats as stats

    mesh = DeviceMesh("cpu", (world,))
    torch.manual_seed(seed)
    s, b, k, n = 2 * world, 3, 3 * world, 5
    lin = torch.nn.Linear(k, n, bias=False, dtype=torch.float64)
    ref = copy.deepcopy(lin)
    parallelize(lin, mesh, {"": RowwiseParallel(output_layouts=Shard(0))})
    x = torch.randn(s, b, k, dtype=torch.float64, requires_grad=True)
    y = lin(distribute(x, mesh, [Shard(2)]))
    up = torch.randn(y.shape, dtype=torch.float64)
    PENDING.counts["gather_reason"] = ""
    before = stats()
    (y * distribute(up, mesh, [Shard(0)])).sum().backward()
    d = _gather_delta(before, stats())
    assert d == {"gathers_deferred": 1, "gathers_fused": 0, "gathers_materialized": 1}, d
    assert "CUDA" in stats()["gather_reason"], stats()["gather_reason"]
    x_ref = x.detach().clone().requires_grad_()
    (ref(x_ref) * up).sum().backward()
    assert torch.allclose(lin.weight.grad.full_tensor(), ref.weight.grad)
    assert torch.allclose(x.grad, x_ref.grad)
    return True


@pytest.mark.parametrize("world", [2, 4])
def test_rowwise_backward_gather_reaches_the_fused_decision_through_the_input_gradient(world):
    run_on_ranks(_rowwise_backward_gather, world, args=(random.randrange(10**6),))


@_gathering
def _transposed_gather(rank, world, seed):
    """The transpose of a deferred gather, and its product with replicated columns, stay pending
    and give the plain values when used: read directly, multiplied, transposed back, and after
    an in-place change of the product's operand through axedist (the product runs first, on the
    old values), a clear error after a change outside axedist ops; a transpose of rows that are not a 2-d matrix runs the gather."""
    from axedist.runtime.deferred import DeferredProduct, DeferredTranspose

    mesh = DeviceMesh("cpu", (world,))
    g = torch.Generator().manual_seed(seed)
    rows = torch.randn(2 * world, 3, generator=g, dtype=torch.float64)
    cols = torch.randn(2 * world, 4, generator=g, dtype=torch.float64)
    gathered = distribute(rows, mesh, [Shard(0)]).redistribute([R])
    t = gathered.t()
    assert type(t._pending) is DeferredTranspose and t.placements == (R,)
    assert torch.equal(t.full_tensor(), rows.t())
    w = distribute(cols, mesh, [R])
    product = distribute(rows, mesh, [Shard(0)]).redistribute([R]).t() @ w
    assert type(product._pending) is DeferredProduct
    back = product.t()
    assert type(back._pending) is DeferredTranspose and torch.allclose(back.t().full_tensor(), rows.t() @ cols)
    assert torch.allclose(back.full_tensor(), (rows.t() @ cols).t())
    later = distribute(rows, mesh, [Shard(0)]).redistribute([R]).t() @ w
    assert type(later._pending) is DeferredProduct
    w.add_(1.0)
    assert torch.allclose(later.full_tensor(), rows.t() @ cols)
    behind = distribute(rows, mesh, [Shard(0)]).redistribute([R]).t() @ w
    w.to_local().add_(1.0)   # outside axedist ops: the product cannot know, so it refuses
    with pytest.raises(LayoutError, match="changed in place"):
        behind.full_tensor()
    cube = distribute(rows.reshape(2 * world, 3, 1), mesh, [Shard(0)]).redistribute([R])
    assert cube.transpose(0, 2)._pending is None and torch.equal(cube.full_tensor(), rows.reshape(-1, 3, 1))
    return True


@pytest.mark.parametrize("world", [2, 3])
def test_transposed_gather_and_its_product_stay_pending_and_give_plain_values(world):
    run_on_ranks(_transposed_gather, world, args=(random.randrange(10**6),))


def _moves_recognized(rank, world):
    from axedist.planning import all_reduce_axis, row_gather_axis
    from axedist.spec import spec_from_placements

    mesh = DeviceMesh("cpu", (2, 2), ("dp", "tp"))

    def spec(shape, *placements):
        return spec_from_placements(shape, mesh, placements)
    assert row_gather_axis(spec((8, 4), R, Shard(0)), spec((8, 4), R, R)) == "tp"
    assert row_gather_axis(spec((8, 3, 4), R, Shard(0)), spec((8, 3, 4), R, R)) == "tp"   # [S, B, H]
    assert row_gather_axis(spec((8, 4), R, Shard(1)), spec((8, 4), R, R)) is None        # columns
    assert row_gather_axis(spec((8, 4), Shard(0), Shard(0)), spec((8, 4), Shard(0), R)) is None
    assert row_gather_axis(spec((6, 4), R, Shard(0)), spec((6, 4), R, R)) == "tp"
    assert row_gather_axis(spec((7, 4), R, Shard(0)), spec((7, 4), R, R)) is None        # uneven
    assert all_reduce_axis(spec((4, 8), R, P), spec((4, 8), R, R)) == "tp"
    assert all_reduce_axis(spec((4, 8), R, P), spec((4, 8), R, Shard(0))) is None
    assert all_reduce_axis(spec((4, 8), Shard(1), P), spec((4, 8), R, R)) is None
    return True


def test_gather_and_all_reduce_moves_are_recognized():
    run_on_ranks(_moves_recognized, 4)


# -- backward: the input gradient of column-parallel linears reaches the fused GEMM + RS ------------

def _stats_delta(before, after):
    return {k: after[k] - before[k] for k in ("deferred", "summed", "fused", "unfused", "materialized")}


@_deferring
@_gathering
def _input_gradient(rank, world, seed):
    """Column-parallel linears fed by a row all-gather of [S, B, K]: in backward the input
    gradient is the product grad[S*B, N_local] @ W_local seen as [S, B, K], a pending sum that
    goes back to Shard(0). One consumer (an output head): that product reaches the fused GEMM +
    reduce-scatter decision (CPU: not fused, reason named); three consumers of one gathered
    input (wq, wk, wv): autograd's sum of their products stays pending and reaches it once,
    as 3 GEMMs (the printed plan says so). Values and gradients equal plain torch."""
    from axedist.nn import ColwiseParallel, parallelize

    mesh = DeviceMesh("cpu", (world,))
    torch.manual_seed(seed)
    s, b, k, n = 2 * world, 3, 5, 2 * world
    x = torch.randn(s, b, k, dtype=torch.float64, requires_grad=True)
    # one consumer: the input gathered by the style itself, as the Llama's output head does
    head = torch.nn.Linear(k, n, dtype=torch.float64)
    ref_head = copy.deepcopy(head)
    parallelize(head, mesh, ColwiseParallel(input_layouts=Shard(0)))
    y = head(distribute(x, mesh, [Shard(0)]))
    up = torch.randn(y.shape, dtype=torch.float64)
    before = fused_gemm_stats()
    (y.full_tensor() * up).sum().backward()
    d = _stats_delta(before, fused_gemm_stats())
    assert d == {"deferred": 1, "summed": 0, "fused": 0, "unfused": 1, "materialized": 1}, d
    assert "CUDA-only" in fused_gemm_stats()["reason"]
    x_ref = x.detach().clone().requires_grad_()
    want = ref_head(x_ref)
    (want * up).sum().backward()
    assert torch.allclose(y.full_tensor(), want)
    assert torch.allclose(x.grad, x_ref.grad)
    assert torch.allclose(head.weight.grad.full_tensor(), ref_head.weight.grad)
    assert torch.allclose(head.bias.grad.full_tensor(), ref_head.bias.grad)
    # three consumers of one gathered input
    x.grad = x_ref.grad = None
    qkv = torch.nn.ModuleDict({name: torch.nn.Linear(k, n, bias=name == "q", dtype=torch.float64) for name in "qkv"})
    ref = copy.deepcopy(qkv)
    parallelize(qkv, mesh, {name: ColwiseParallel() for name in "qkv"})
    gathered = distribute(x, mesh, [Shard(0)]).redistribute([R])   # what PrepareModuleInput does
    seen = []
    gathered.register_hook(lambda grad: seen.append(plan(grad, [Shard(0)])))   # the summed gradient, unrun
    ys = [qkv[name](gathered) for name in "qkv"]
    ups = [torch.randn(t.shape, dtype=torch.float64) for t in ys]
    before = fused_gemm_stats()
    sum((t.full_tensor() * u).sum() for t, u in zip(ys, ups)).backward()
    d = _stats_delta(before, fused_gemm_stats())
    assert d == {"deferred": 3, "summed": 2, "fused": 0, "unfused": 1, "materialized": 3}, d
    (route,) = seen
    # K of the three concatenated (3 x 2 local columns) outgrows the product's 5: never concatenated
    assert route.fused.products == 3 and not route.fused.fused and "would outgrow" in route.fused.reason
    assert str(route).startswith("3 GEMMs, summed, then ") and "reduce_scatter" in route.kinds
    wants = [ref[name](x_ref) for name in "qkv"]
    sum((w * u).sum() for w, u in zip(wants, ups)).backward()
    for t, w in zip(ys, wants):
        assert torch.allclose(t.full_tensor(), w)
    assert torch.allclose(x.grad, x_ref.grad)
    for name in "qkv":
        assert torch.allclose(qkv[name].weight.grad.full_tensor(), ref[name].weight.grad)
    return True


@pytest.mark.parametrize("world", [2, 4])
def test_input_gradient_of_column_parallel_reaches_fused_rs(world):
    run_on_ranks(_input_gradient, world, args=(random.randrange(10**6),))


@_deferring
def _views_and_sums(rank, world, seed):
    """Views of a pending product and sums of pending products stay pending (nothing computed),
    plan and move as the product would (Shard(0) of [S, B, N] is the product's rows), and
    every other use computes them right: uneven rows, a product already used, x + x, an
    in-place change of an operand after the sum."""
    mesh = DeviceMesh("cpu", (world,))
    g = torch.Generator().manual_seed(seed)
    s, b, n = 2 * world, 3, 4
    ks = (world, 2 * world, 3 * world)
    a = [torch.randn(s * b, k, generator=g, dtype=torch.float64) for k in ks]
    w = [torch.randn(k, n, generator=g, dtype=torch.float64) for k in ks]
    refs = [x @ y for x, y in zip(a, w)]
    da = [distribute(x, mesh, [Shard(1)]) for x in a]
    dw = [distribute(y, mesh, [Shard(0)]) for y in w]

    def products():
        return [torch.mm(x, y) for x, y in zip(da, dw)]
    before = fused_gemm_stats()
    c = products()
    v = c[0].view(s, b, n)
    assert v.placements == (P,) and v._pending.value is None
    route = plan(v, [Shard(0)])
    assert route.fused.products == 1 and "CUDA-only" in route.fused.reason and str(route).startswith("GEMM, then")
    assert torch.allclose(v.redistribute([Shard(0)]).full_tensor(), refs[0].view(s, b, n))
    before = fused_gemm_stats()
    c = products()
    total = (c[0] + c[1] + c[2]).view(s, b, n)
    d = _stats_delta(before, fused_gemm_stats())
    assert d == {"deferred": 3, "summed": 2, "fused": 0, "unfused": 0, "materialized": 0}, d
    route = plan(total, [Shard(0)])
    assert route.fused.products == 3 and str(route).startswith("3 GEMMs, summed, then")
    assert torch.allclose(total.redistribute([Shard(0)]).full_tensor(), sum(refs).view(s, b, n))
    d = _stats_delta(before, fused_gemm_stats())
    assert d == {"deferred": 3, "summed": 2, "fused": 0, "unfused": 1, "materialized": 3}, d
    # a sum's value is accumulated in one buffer; its products, used alone afterwards, are still
    # their own (nothing accumulated into one of them); local K: 1, 2 and 3 of 4 columns
    c = products()
    wide, narrow = c[1] + c[2], c[0] + c[1]
    assert "would outgrow" in plan(wide, [Shard(0)]).fused.reason     # K 2 + 3 against 4 columns
    assert "CUDA-only" in plan(narrow, [Shard(0)]).fused.reason        # K 1 + 2: concatenated on CUDA
    assert torch.allclose(wide.full_tensor(), refs[1] + refs[2])
    assert torch.allclose(narrow.full_tensor(), refs[0] + refs[1])
    for product, ref in zip(c, refs):
        assert torch.allclose(product.full_tensor(), ref)
    # dim 0 of the view not divisible by the ranks: no fused choice, the ordinary (uneven) route
    odd = products()[0].view(3, s * b // 3, n)
    assert plan(odd, [Shard(0)]).fused is None
    assert torch.allclose(odd.redistribute([Shard(0)]).full_tensor(), refs[0].view(3, s * b // 3, n))
    # an operand written in place after the sum: the sum is computed first (old values)
    c = products()
    total = c[0] + c[1]
    da[1].add_(1.0)
    assert torch.allclose(total.full_tensor(), refs[0] + refs[1])
    da[1] = distribute(a[1], mesh, [Shard(1)])
    # a product already used on its own is added as a value; x + x is twice x
    c = products()
    c[0].to_local()
    before = fused_gemm_stats()
    assert torch.allclose((c[0] + c[1]).redistribute([Shard(0)]).full_tensor(), refs[0] + refs[1])
    assert _stats_delta(before, fused_gemm_stats())["summed"] == 0
    twice = c[2] + c[2]
    assert plan(twice, [Shard(0)]).fused.products == 2
    assert torch.allclose(twice.redistribute([Shard(0)]).full_tensor(), 2 * refs[2])
    # a sum inside a sum used on its own first: the outer one says so and adds the value
    c = products()
    inner = c[0] + c[1]
    outer = inner + c[2]
    assert repr(outer._pending) == f"DeferredSum({[1, s * b, n]}: 3 products, unrun)"
    inner.to_local()
    assert "already ran" in plan(outer, [Shard(0)]).fused.reason
    assert torch.allclose(outer.redistribute([Shard(0)]).full_tensor(), sum(refs))
    return True


def test_views_and_sums_of_deferred_products():
    run_on_ranks(_views_and_sums, 2, args=(random.randrange(10**6),))


def _forced_fused_backward(rank, world, seed):
    """The CUDA decision forced on CPU (fused_choice says fused; gemm_reduce_scatter then runs
    torch's matmul + reduce-scatter of the very operands the kernel would take, the summed
    products' concatenated along K): bf16 values and gradients equal the unforced run's and
    fp64 torch's to bf16 precision, and backward ran fused twice (the head, the qkv sum)."""
    from axedist.nn import ColwiseParallel, parallelize
    from axedist.runtime import deferred

    mesh = DeviceMesh("cpu", (world,))
    torch.manual_seed(seed)
    s, b, k, n = 4 * world, 3, 16, 8 * world
    model = torch.nn.ModuleDict({name: torch.nn.Linear(k, n, bias=name in "qo", dtype=torch.bfloat16)
                                 for name in "qkvo"})
    ref = copy.deepcopy(model).double()
    parallelize(model, mesh, {"q": ColwiseParallel(), "k": ColwiseParallel(), "v": ColwiseParallel(),
                              "o": ColwiseParallel(input_layouts=Shard(0))})
    x64 = torch.randn(s, b, k, dtype=torch.float64)
    ups = [torch.randn(s, b, n, dtype=torch.float64) for _ in range(4)]

    def run():
        x = x64.to(torch.bfloat16).requires_grad_()
        gathered = distribute(x, mesh, [Shard(0)]).redistribute([R])
        ys = [model[name](gathered) for name in "qkv"] + [model["o"](distribute(x, mesh, [Shard(0)]))]
        before = fused_gemm_stats()
        sum((t.full_tensor().double() * u).sum() for t, u in zip(ys, ups)).backward()
        grads = [x.grad.double()] + [p.grad.full_tensor().double() for p in model.parameters()]
        model.zero_grad()
        return [t.full_tensor().double() for t in ys], grads, _stats_delta(before, fused_gemm_stats())

    policies = (DTensor.dispatcher.defer_gemm, deferred.defer_gathers())
    DTensor.dispatcher.defer_gemm = "always"
    deferred.defer_gathers("always")
    choice = deferred.fused_choice

    def fused(spec, pending, dst):
        step = choice(spec, pending, dst)
        return None if step is None else dataclasses.replace(step, fused=True)
    try:
        unforced = run()
        deferred.fused_choice = fused
        forced = run()
    finally:
        deferred.fused_choice = choice
        DTensor.dispatcher.defer_gemm = policies[0]
        deferred.defer_gathers(policies[1])
    x_ref = x64.to(torch.bfloat16).double().requires_grad_()
    wants = [ref[name](x_ref) for name in "qkvo"]
    sum((t * u).sum() for t, u in zip(wants, ups)).backward()
    want_grads = [x_ref.grad] + [p.grad for p in ref.parameters()]

    def close(got, want):
        return all(((g - h).norm() / h.norm()).item() < 2e-2 for g, h in zip(got, want))
    return {"unforced fused": unforced[2]["fused"], "forced": forced[2],
            "values": close(forced[0], unforced[0]) and close(forced[0], wants),
            "grads": close(forced[1], unforced[1]) and close(forced[1], want_grads)}


def test_forced_fused_decision_in_backward_gives_the_same_values():
    for rank, out in enumerate(run_on_ranks(_forced_fused_backward, 2, args=(random.randrange(10**6),))):
        assert out["unforced fused"] == 0 and out["values"] and out["grads"], (rank, out)
        assert out["forced"] == {"deferred": 4, "summed": 2, "fused": 2, "unfused": 0, "materialized": 0}, (rank, out)
