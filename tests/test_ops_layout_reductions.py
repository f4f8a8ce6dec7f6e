"""Reductions, softmax and norms of tensors whose layout has no placement form, run where they are.

The rows of ``h.view(B*S, H)`` for ``h`` (B, S, H) in ``[Shard(1)]`` (blocks of rows per batch),
rows dealt round-robin in pairs, and the same rows replicated over a second mesh axis: the op
reduces the whole, innermost dims of each piece, so each device reduces its own rows and the
output keeps their map (``specs.reduced_in_place``); a reduction of every element leaves a
pending reduction over the dealing axes (``specs.pending_in_place``). Every op against torch on
the full tensor, forward and backward (input, weight and bias gradients), on fresh random inputs;
the forward runs no collective. A layout whose reduced dim is split over devices still gives
torch's values (by the placement path).
"""

import random

import pytest
import torch
import torch.nn.functional as F
from torch.distributed.tensor import Partial, Replicate, Shard

from axedist.dtensor import distribute
from axedist.layout import Layout, LayoutError
from axedist.mesh import DeviceMesh
from axedist.testing import run_on_ranks
from tests.ops_cases import gathered

H = 6

# name -> (f(x, weight, bias), keeps a layout (False: every element reduced, a pending op))
OPS = {
    "sum": (lambda t, w, b: t.sum(-1), True),
    "mean keepdim": (lambda t, w, b: t.mean(-1, keepdim=True), True),
    "amax": (lambda t, w, b: t.amax(-1), True),
    "var": (lambda t, w, b: t.var(-1), True),
    "logsumexp": (lambda t, w, b: torch.logsumexp(t, -1), True),
    "max values": (lambda t, w, b: t.max(-1).values, True),
    "softmax": (lambda t, w, b: torch.softmax(t, -1), True),
    "log_softmax": (lambda t, w, b: torch.log_softmax(t, -1), True),
    "layer_norm": (lambda t, w, b: F.layer_norm(t, (H,), w, b), True),
    "rms_norm": (lambda t, w, b: F.rms_norm(t, (H,), w, 1e-6), True),
    "rms by hand": (lambda t, w, b: t * torch.rsqrt(t.pow(2).mean(-1, keepdim=True) + 1e-6) * w, True),
    "sum of all": (lambda t, w, b: t.sum(), False),
    "mean of all": (lambda t, w, b: t.mean(), False),
    "amax of all": (lambda t, w, b: t.amax(), False),
}


def _layouts(world):
    """(label, mesh, make(x) -> DTensor of the [M, H] rows, M) of each row layout."""
    mesh = DeviceMesh("cpu", (world,))
    seq = 2 * world

    def flattened(x, mesh=mesh):  # (3, seq, H) in [Shard(1)], viewed as rows
        return distribute(x.view(3, seq, H), mesh, [Shard(1)]).view(3 * seq, H)

    pairs = 3
    dealt = Layout.parse(f"S[({pairs},{world},2,{H}):({2 * H},1@gpuid,{H},1)]")

    def round_robin(x, mesh=mesh):  # rows round-robin in pairs
        return distribute(x, mesh, dealt)

    out = [("flattened sequence shards", mesh, flattened, 3 * seq),
           ("rows round-robin in pairs", mesh, round_robin, pairs * world * 2)]
    if world == 4:
        grid = DeviceMesh("cpu", (2, 2), ("dp", "tp"))

        def replicated_over_dp(x, grid=grid):  # sequence shards over tp, the same rows on both dp
            return distribute(x.view(3, 4, H), grid, [Replicate(), Shard(1)]).view(12, H)

        out.append(("replicated over a second axis", grid, replicated_over_dp, 12))
    return out


def test_a_dim_inserted_or_taken_matches_each_pieces_stack_by_brute_force():
    """with_dim_inserted / without_dim against every element: the stacked layout puts element
    (.., j, ..) on the devices of the unstacked element, at the offset that stacking the
    row-major local pieces at the same dim gives; without_dim undoes it."""
    import itertools
    import math
    from axedist.layout import MEMORY_AXIS, row_major_memory, with_dim_inserted, without_dim
    cases = [("S[(3,2,2,6):(12,1@gpuid,6,1)]", (12, 6)), ("S[(4,2,6):(1@gpuid,6,1)]", (8, 6)),
             ("S[(2,2,3):(1@gpuid,3,1)] + R[2:1@dp]", (4, 3)), ("S[(2,3,2,2):(6,2,1@gpuid,1)]", (2, 3, 4))]
    for text, shape in cases:
        layout = Layout.parse(text)
        local = row_major_memory(layout.blocks(shape))[0]
        for dim, extent in itertools.product(range(len(shape) + 1), (1, 3)):
            stacked = with_dim_inserted(layout, shape, dim, extent)
            new_shape = shape[:dim] + (extent,) + shape[dim:]
            new_local = local[:dim] + (extent,) + local[dim:]
            for index in itertools.product(*map(range, new_shape)):
                j, old = index[dim], index[:dim] + index[dim + 1:]
                want = []
                for point in layout.apply(old, shape):
                    at = list(_unflatten(point[MEMORY_AXIS], local))
                    point = dict(point, **{MEMORY_AXIS: _flatten(at[:dim] + [j] + at[dim:], new_local)})
                    want.append(point)
                assert sorted(map(sorted, (p.items() for p in stacked.apply(index, new_shape)))) == \
                    sorted(map(sorted, (p.items() for p in want))), (text, dim, index)
            assert without_dim(stacked, new_shape, dim) == layout or extent == 1, (text, dim)
            assert math.prod(new_local) == math.prod(local) * extent
    # a dim split over devices, or memory not row-major: neither helper applies
    assert without_dim(Layout.parse("S[(4,2,6):(1@gpuid,6,1)]"), (8, 6), 0) is None
    assert with_dim_inserted(Layout.parse("S[(6,8):(1,6)]"), (6, 8), 0, 2) is None


def _unflatten(offset, shape):
    out = []
    for size in reversed(shape):
        out.append(offset % size)
        offset //= size
    return tuple(reversed(out))


def _flatten(index, shape):
    flat = 0
    for i, size in zip(index, shape):
        flat = flat * size + i
    return flat


def _reductions_in_place(rank, world, seed):
    from axedist.runtime import count_collectives

    g = torch.Generator().manual_seed(seed)
    failures = []
    for label, mesh, make, rows in _layouts(world):
        for name, (f, keeps_layout) in OPS.items():
            x = torch.randn(rows, H, generator=g, dtype=torch.float64, requires_grad=True)
            w = torch.randn(H, generator=g, dtype=torch.float64, requires_grad=True)
            b = torch.randn(H, generator=g, dtype=torch.float64, requires_grad=True)
            dx = make(x)
            with pytest.raises(LayoutError):
                dx.placements  # the rows have no placement form
            replicated = [Replicate()] * mesh.ndim
            dw, db = distribute(w, mesh, replicated), distribute(b, mesh, replicated)
            with count_collectives() as seen:
                y = f(dx, dw, db)
            want = f(x, w, b)
            if seen.calls:
                failures.append(f"{label} {name}: {seen.calls} collectives in the forward")
            if keeps_layout:
                failures += gathered(f"{label} {name}", y)
            else:
                dealt = {axis for axis, p in zip(mesh.axis_names, y.placements) if isinstance(p, Partial)}
                if not dealt or not all(isinstance(p, (Partial, Replicate)) for p in y.placements):
                    failures.append(f"{label} {name}: {y.placements}, not a pending reduction")
            if not torch.allclose(y.full_tensor(), want):
                failures.append(f"{label} {name}: values differ from torch")
            up = torch.randn(want.shape, generator=g, dtype=torch.float64)
            whole = y.full_tensor()
            with count_collectives() as seen:  # from y's gradient to dx's (not distribute's own backward)
                torch.autograd.grad((whole * up).sum(), dx, retain_graph=True)
            # a reduction of every element reads its reduced value (and amax its count of maxima) back:
            # all-reduces of single values; nothing else moves
            moved = seen.calls if keeps_layout else seen.bytes_sent > 2 * 8 * mesh.size() or any(
                not kind.startswith("all_reduce") for kind in seen.by_kind)
            if moved:
                failures.append(f"{label} {name}: collectives in the backward ({seen})")
            (whole * up).sum().backward()
            got = [t.grad.clone() if t.grad is not None else None for t in (x, w, b)]
            for t in (x, w, b):
                t.grad = None
            (want * up).sum().backward()
            for which, mine, theirs in zip(("x", "weight", "bias"), got, (x.grad, w.grad, b.grad)):
                if (mine is None) != (theirs is None) or (mine is not None and not torch.allclose(mine, theirs)):
                    failures.append(f"{label} {name}: the {which} gradient differs from torch's")
    return failures


@pytest.mark.parametrize("world", [2, 4])
def test_reductions_and_norms_run_where_a_layout_without_placements_is(world):
    results = run_on_ranks(_reductions_in_place, world, args=(random.randrange(10**6),), timeout_s=600)
    assert results == [[]] * world, results[0]


def _split_reduced_dim(rank, world, seed):
    """Columns dealt round-robin (the reduced dim split over devices): not reduced in place, but
    torch's values and gradients all the same."""
    mesh = DeviceMesh("cpu", (world,))
    g = torch.Generator().manual_seed(seed)
    cols = 2 * world * 2
    x = torch.randn(5, cols, generator=g, dtype=torch.float64, requires_grad=True)
    dealt = Layout.parse(f"S[(5,2,{world},2):({cols // world},2,1@gpuid,1)]")
    for f in (lambda t: t.sum(-1), lambda t: torch.softmax(t, -1), lambda t: F.layer_norm(t, (cols,))):
        y = f(distribute(x, mesh, dealt))
        want = f(x)
        assert torch.allclose(y.full_tensor(), want)
        up = torch.randn(want.shape, generator=g, dtype=torch.float64)
        (y.full_tensor() * up).sum().backward()
        mine, x.grad = x.grad.clone(), None
        (want * up).sum().backward()
        assert torch.allclose(mine, x.grad)
        x.grad = None
    return True


def test_a_split_reduced_dim_still_matches_torch():
    assert run_on_ranks(_split_reduced_dim, 2, args=(random.randrange(10**6),)) == [True, True]


def test_the_layout_helpers_invert_each_other():
    from axedist.layout import with_inner_dims, without_inner_dims
    rows = Layout.parse("S[(2,2,2):(2,1@gpuid,1)]")
    full = with_inner_dims(rows, (8,), (6,))
    assert full == Layout.parse("S[(2,2,2,6):(12,1@gpuid,6,1)]")
    assert without_inner_dims(full, (8, 6), 1) == rows
    assert without_inner_dims(with_inner_dims(rows, (8,), (2, 3)), (8, 2, 3), 2) == rows
    # the reduced dim split over devices, or not innermost: no in-place reduction
    assert without_inner_dims(Layout.parse("S[(8,2,3):(3,1@gpuid,1)]"), (8, 6), 1) is None
    assert without_inner_dims(Layout.parse("S[(6,8):(1,6)]"), (6, 8), 1) is None


def _fused_rms_norm_in_place(rank, world, seed):
    """The aten ops ``F.rms_norm`` reaches on CUDA (``_fused_rms_norm`` and its backward), handed
    to the dispatcher as CUDA would hand them, on rows with no placement form: no collective, the
    output and the input gradient keep the rows' map, the weight gradient is a pending sum over
    the dealing axis; values as torch's on whole tensors."""
    from axedist.dtensor import DTensor
    from axedist.runtime import count_collectives

    aten = torch.ops.aten
    g = torch.Generator().manual_seed(seed)
    failures = []
    for label, mesh, make, rows in _layouts(world):
        x_full = torch.randn(rows, H, generator=g, dtype=torch.float64)
        w_full = torch.randn(H, generator=g, dtype=torch.float64)
        up = torch.randn(rows, H, generator=g, dtype=torch.float64)
        x_ref, w_ref = x_full.clone().requires_grad_(), w_full.clone().requires_grad_()
        F.rms_norm(x_ref, (H,), w_ref, 1e-6).backward(up)
        x, w = make(x_full), distribute(w_full, mesh, [Replicate()] * mesh.ndim)
        replicated_up = distribute(up, mesh, [Replicate()] * mesh.ndim)
        with count_collectives() as seen:
            y, rstd = DTensor.dispatcher.dispatch(aten._fused_rms_norm.default, (x, [H], w, 1e-6), {})
            # the output gradient laid out as the output (the replicated one sliced: no data moves)
            grad = DTensor.dispatcher.dispatch(aten.mul.Tensor, (replicated_up, torch.ones_like(y)), {})
            gx, gw = DTensor.dispatcher.dispatch(aten._fused_rms_norm_backward.default,
                                                 (grad, x, [H], rstd, w, [True, True]), {})
        if seen.calls:
            failures.append(f"{label}: {seen.calls} collectives")
        if y.axe_layout != x.axe_layout or gx.axe_layout != x.axe_layout:
            failures.append(f"{label}: output {y.axe_layout} / input gradient {gx.axe_layout}, rows {x.axe_layout}")
        if not any(isinstance(p, Partial) for p in gw.placements):
            failures.append(f"{label}: weight gradient {gw.placements}, not a pending sum")
        for name, mine, want in (("out", y, F.rms_norm(x_full, (H,), w_full, 1e-6)), ("grad input", gx, x_ref.grad),
                                 ("grad weight", gw, w_ref.grad)):
            if not torch.allclose(mine.full_tensor(), want):
                failures.append(f"{label}: {name} differs from torch")
    return failures


@pytest.mark.parametrize("world", [2, 4])
def test_fused_rms_norm_runs_where_a_layout_without_placements_is(world):
    results = run_on_ranks(_fused_rms_norm_in_place, world, args=(random.randrange(10**6),))
    assert results == [[]] * world, results[0]


def _part_of_the_mesh(rank, world, seed):
    """Rows dealt in pairs over tp on the dp = 1 devices only: the dp = 0 devices hold nothing, so
    a reduction of every element is not a pending one over tp replicated over dp (those devices
    would claim a copy they lack). Every rank reads torch's value; rows keep their map."""
    mesh = DeviceMesh("cpu", (2, 2), ("dp", "tp"))
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(8, H, generator=g, dtype=torch.float64)
    weight = torch.randn(8, H, generator=g, dtype=torch.float64)
    indices = torch.randint(0, 8, (2, 5), generator=g)
    layout = Layout.parse(f"S[(2,2,2,{H}):({2 * H},1@tp,{H},1)] + 1@dp")
    dx, dw = distribute(x, mesh, layout), distribute(weight, mesh, layout)
    failures = []
    for name, f in (("sum", torch.sum), ("mean", torch.mean), ("amax", torch.amax),
                    ("row sums", lambda t: t.sum(-1)), ("softmax", lambda t: torch.softmax(t, -1))):
        if not torch.allclose(f(dx).full_tensor(), f(x)):
            failures.append(f"{name}: differs from torch on rank {rank}")
    looked_up = F.embedding(distribute(indices, mesh, [Replicate(), Replicate()]), dw)
    if not torch.allclose(looked_up.full_tensor(), F.embedding(indices, weight)):
        failures.append(f"embedding: differs from torch on rank {rank}")
    return failures


def test_a_layout_on_part_of_the_mesh_reduces_to_torchs_values():
    seed = random.randrange(10**6)
    results = run_on_ranks(_part_of_the_mesh, 4, args=(seed,))
    assert results == [[]] * 4, (seed, results)


def _row_wise_index_ops(rank, world, seed):
    """gather / scatter / scatter_add along the last dim of rows with no placement form, with an
    index laid out as the rows (and a replicated tensor to scatter into, as max's backward has):
    each device works on its own rows, no collective; values and gradients equal torch's."""
    from axedist.runtime import count_collectives

    g = torch.Generator().manual_seed(seed)
    failures = []
    for label, mesh, make, rows in _layouts(world):
        x = torch.randn(rows, H, generator=g, dtype=torch.float64, requires_grad=True)
        dx = make(x)
        index = torch.randint(0, H, (rows, H), generator=g)
        # the index laid out as the rows: computed from dx by pointwise ops, which keep its layout
        didx = (dx.detach() * 0).long() + distribute(index, mesh, [Replicate()] * mesh.ndim)
        base = torch.randn(rows, H, generator=g, dtype=torch.float64)
        dbase = distribute(base, mesh, [Replicate()] * mesh.ndim)
        cases = {
            "gather": (lambda t, i, b: t.gather(-1, i)),
            "scatter into a replicated tensor": (lambda t, i, b: b.scatter(-1, i, t)),
            "scatter_add": (lambda t, i, b: b.scatter_add(-1, i, t)),
        }
        for name, f in cases.items():
            with count_collectives() as seen:
                y = f(dx, didx, dbase)
            if seen.calls:
                failures.append(f"{label} {name}: collectives in the forward ({seen})")
            want = f(x, index, base)
            if not torch.allclose(y.full_tensor(), want):
                failures.append(f"{label} {name}: values differ from torch")
            up = torch.randn(want.shape, generator=g, dtype=torch.float64)
            (y.full_tensor() * up).sum().backward()
            mine = x.grad.clone()
            x.grad = None
            (want * up).sum().backward()
            if not torch.allclose(mine, x.grad):
                failures.append(f"{label} {name}: the gradient differs from torch's")
            x.grad = None
    return failures


@pytest.mark.parametrize("world", [2, 4])
def test_gather_and_scatter_along_rows_without_placements(world):
    seed = random.randrange(10**6)
    results = run_on_ranks(_row_wise_index_ops, world, args=(seed,), timeout_s=600)
    assert results == [[]] * world, (seed, results[0])


def _new_of_the_same_size(rank, world):
    """``x.new_zeros(x.shape)`` (and the other ``new_*``) is laid out as ``x``, as torch's DTensor
    does for a sharded ``x``, for placements and for a layout with no placement form; another
    size, or a pending ``x``, gives a replicated tensor. Values as torch's."""
    from axedist.dtensor import DTensor

    mesh = DeviceMesh("cpu", (world,))
    x = torch.randn(4 * world, H, dtype=torch.float64, generator=torch.Generator().manual_seed(7))
    dealt = Layout.parse(f"S[(2,{world},2,{H}):({2 * H},1@gpuid,{H},1)]")
    failures = []
    for label, dx in (("Shard(0)", distribute(x, mesh, [Shard(0)])), ("dealt rows", distribute(x, mesh, dealt))):
        made = {"new_zeros": (dx.new_zeros(dx.shape), torch.zeros_like(x)),
                "new_ones": (dx.new_ones(tuple(dx.shape)), torch.ones_like(x)),
                "new_full": (dx.new_full(dx.shape, 3.5), torch.full_like(x, 3.5)),
                "new_empty_strided + copy_": (dx.new_empty_strided(dx.shape, (H, 1)).copy_(dx), x)}
        for name, (y, want) in made.items():
            if y._spec.layout != dx._spec.layout:
                failures.append(f"{label} {name}: laid out as {y._spec.layout}, not as x ({dx._spec.layout})")
            if y.to_local().shape != dx.to_local().shape or not torch.equal(y.full_tensor(), want):
                failures.append(f"{label} {name}: local shape {tuple(y.to_local().shape)} or values differ")
        other = dx.new_zeros((3, H))
        if other.placements != (Replicate(),) or not torch.equal(other.full_tensor(), torch.zeros(3, H, dtype=x.dtype)):
            failures.append(f"{label}: new_zeros of another size is {other.placements}")
    pending = DTensor.from_local(torch.ones(2, 3), mesh, [Partial("sum")])
    if pending.new_zeros((2, 3)).placements != (Replicate(),):
        failures.append("a pending x gives a pending new tensor")
    return failures


def test_new_tensor_of_the_same_size_is_laid_out_as_its_input():
    results = run_on_ranks(_new_of_the_same_size, 2)
    assert results == [[]] * 2, results[0]


def _vector_products_in_place(rank, world, seed):
    """``mv`` of rows dealt by a layout (with a replicated vector) and ``dot`` of two vectors laid
    out alike run where the data is: no collective in the forward; ``mv`` keeps the rows' map,
    ``dot`` is a pending sum over the dealing axes; values and both gradients equal torch's.
    Operands not laid out so (a replicated or a sharded vector) take the placement way, with
    torch's values."""
    from axedist.runtime import count_collectives

    g = torch.Generator().manual_seed(seed)
    failures = []
    for label, mesh, make, rows in _layouts(world):
        replicated = [Replicate()] * mesh.ndim
        x = torch.randn(rows, H, generator=g, dtype=torch.float64, requires_grad=True)
        v = torch.randn(H, generator=g, dtype=torch.float64, requires_grad=True)
        dx, dv = make(x), distribute(v, mesh, replicated)
        with count_collectives() as seen:
            y = dx.mv(dv)
        if seen.calls:
            failures.append(f"{label} mv: {seen.calls} collectives in the forward")
        failures += gathered(f"{label} mv", y)
        want = x.mv(v)
        if not torch.allclose(y.full_tensor(), want):
            failures.append(f"{label} mv: values differ from torch")
        up = torch.randn(want.shape, generator=g, dtype=torch.float64)
        (y.full_tensor() * up).sum().backward()
        mine = (x.grad.clone(), v.grad.clone())
        x.grad = v.grad = None
        (want * up).sum().backward()
        if not (torch.allclose(mine[0], x.grad) and torch.allclose(mine[1], v.grad)):
            failures.append(f"{label} mv: gradients differ from torch's")

        row_layout = make(x.detach()).sum(-1).axe_layout  # the rows' map of an [M] vector
        a = torch.randn(rows, generator=g, dtype=torch.float64, requires_grad=True)
        b = torch.randn(rows, generator=g, dtype=torch.float64, requires_grad=True)
        da, db = distribute(a, mesh, row_layout), distribute(b, mesh, row_layout)
        with count_collectives() as seen:
            d = da.dot(db)
        if seen.calls:
            failures.append(f"{label} dot: {seen.calls} collectives in the forward")
        dealt = {axis for axis, p in zip(mesh.axis_names, d.placements) if isinstance(p, Partial)}
        if not dealt or not all(isinstance(p, (Partial, Replicate)) for p in d.placements):
            failures.append(f"{label} dot: {d.placements}, not a pending sum")
        want = a.dot(b)
        if not torch.allclose(d.full_tensor(), want):
            failures.append(f"{label} dot: value differs from torch")
        up = torch.randn((), generator=g, dtype=torch.float64)
        (d.full_tensor() * up).backward()
        mine = (a.grad.clone(), b.grad.clone())
        a.grad = b.grad = None
        (want * up).backward()
        if not (torch.allclose(mine[0], a.grad) and torch.allclose(mine[1], b.grad)):
            failures.append(f"{label} dot: gradients differ from torch's")
        # not laid out alike: the placement way, torch's values all the same
        with torch.no_grad():
            mixed = da.dot(distribute(b.detach(), mesh, replicated)).full_tensor()
            sharded_vec = dx.mv(distribute(v.detach(), mesh, [Shard(0)] + [Replicate()] * (mesh.ndim - 1))).full_tensor()
        if not torch.allclose(mixed, want.detach()):
            failures.append(f"{label} dot with a replicated vector: value differs from torch")
        if not torch.allclose(sharded_vec, x.detach().mv(v.detach())):
            failures.append(f"{label} mv with a sharded vector: values differ from torch")
    return failures


@pytest.mark.parametrize("world", [2, 4])
def test_vector_products_run_where_a_layout_without_placements_is(world):
    results = run_on_ranks(_vector_products_in_place, world, args=(random.randrange(10**6),), timeout_s=600)
    assert results == [[]] * world, results[0]


# name -> f(x, y, w, b) on [M, H] rows x, y (laid out alike), a replicated [H, H] weight w and [H] bias b
ROW_WISE = {
    "addmm": lambda x, y, w, b: torch.addmm(b, x, w),
    "linear with bias": lambda x, y, w, b: F.linear(x, w, b),
    "cat along the rows": lambda x, y, w, b: torch.cat([x, y * 2], -1),
    "cat with a replicated tensor": lambda x, y, w, b: torch.cat([x, w[:2].sum(0).expand(x.shape[0], H)], -1),
    "slice": lambda x, y, w, b: x[:, 1:5:2],
    "index_select along the rows": lambda x, y, w, b: x.index_select(1, torch.tensor([4, 0, 4])),
    "chunk": lambda x, y, w, b: x.chunk(2, -1)[1],
    "split_with_sizes": lambda x, y, w, b: x.split([2, 4], -1)[1] * 3,
    "rotate_half": lambda x, y, w, b: torch.cat([-x.chunk(2, -1)[1], x.chunk(2, -1)[0]], -1),
    "cumsum": lambda x, y, w, b: x.cumsum(-1),
    "sort values": lambda x, y, w, b: x.sort(-1).values,
    "topk values": lambda x, y, w, b: x.topk(2, -1).values,
    "flip": lambda x, y, w, b: x.flip(-1),
    "roll": lambda x, y, w, b: x.roll(2, -1),
    "stack beside the last dim": lambda x, y, w, b: torch.stack([x, y], 1),
    "stack before the rows": lambda x, y, w, b: torch.stack([x, y * 2, x], 0),
    "outer product of rows": lambda x, y, w, b: x.unsqueeze(-1) * y.unsqueeze(-2),
    "stack with a replicated tensor": lambda x, y, w, b: torch.stack([x, w[:2].sum(0).expand(x.shape[0], H)], 0),
    "outer product with a replicated operand": lambda x, y, w, b: x.unsqueeze(-1) * b.expand(x.shape[0], H)[:, None],
    "sum over a middle dim": lambda x, y, w, b: x.view(-1, 2, 3).sum(1),
    "expand into a new leading dim": lambda x, y, w, b: x.expand(2, *x.shape) * 2,
    "repeat_kv's expand": lambda x, y, w, b: x.view(-1, 2, 3)[:, :, None].expand(-1, 2, 2, 3).reshape(-1, 4, 3),
    "softmax over a middle dim": lambda x, y, w, b: torch.softmax(x.view(-1, 2, 3), 1),
    "stack before, then a row of it": lambda x, y, w, b: torch.stack([x, y], 0)[1] * 3,
    "stack before, then unbind": lambda x, y, w, b: torch.stack([x, y], 0).unbind(0)[0] - y,
    "interleaved rotation": lambda x, y, w, b: torch.stack([-x[:, 1::2], x[:, ::2]], -1).flatten(-2),
    "bmm of dealt rows": lambda x, y, w, b: torch.bmm(x.view(-1, 2, 3), y.view(-1, 3, 2)),
    "einsum of dealt rows": lambda x, y, w, b: torch.einsum("rij,rkj->rik", x.view(-1, 2, 3), y.view(-1, 2, 3)),
    "bmm with a replicated batch": lambda x, y, w, b: torch.bmm(x.view(-1, 2, 3),
                                                                w[:3, :2].expand(x.shape[0], 3, 2)),
    "an operand broadcast over new leading dims": lambda x, y, w, b: x.expand(2, *x.shape) * y,
    "a view of it with fewer dims": lambda x, y, w, b: x.view(-1, 2, 3).expand(2, -1, 2, 3) - y.view(-1, 2, 3),
    "repeat along the rows": lambda x, y, w, b: x.repeat(1, 3),
    "repeat of the dealt dim": lambda x, y, w, b: x.repeat(3, 1) * 2,
    "repeat into new dims and both": lambda x, y, w, b: x.view(-1, 2, 3).repeat(2, 1, 2, 2),
    "pad": lambda x, y, w, b: F.pad(x, (1, 2), value=0.5),
    "crop": lambda x, y, w, b: F.pad(x, (-1, -2)),
}


def _row_wise_in_place(rank, world, seed):
    """Ops that work row by row along the last dim (slices, splits, joins, scans, sort, topk,
    flip, roll, a product plus a bias) of rows dealt by a layout: no collective in the forward,
    the output keeps the rows' map, values and gradients equal torch's. Along dim 0 (not row by
    row), and with an empty row, they take the placement way, with torch's values."""
    from axedist.runtime import count_collectives

    g = torch.Generator().manual_seed(seed)
    failures = []
    for label, mesh, make, rows in _layouts(world):
        replicated = [Replicate()] * mesh.ndim
        for name, f in ROW_WISE.items():
            x, y = (torch.randn(rows, H, generator=g, dtype=torch.float64, requires_grad=True) for _ in range(2))
            w = torch.randn(H, H, generator=g, dtype=torch.float64, requires_grad=True)
            b = torch.randn(H, generator=g, dtype=torch.float64, requires_grad=True)
            dx, dy = make(x), make(y)
            dw, db = distribute(w, mesh, replicated), distribute(b, mesh, replicated)
            with count_collectives() as seen:
                out = f(dx, dy, dw, db)
            if seen.calls:
                failures.append(f"{label} {name}: {seen.calls} collectives in the forward")
            failures += gathered(f"{label} {name}", out)
            want = f(x, y, w, b)
            if not torch.allclose(out.full_tensor(), want):
                failures.append(f"{label} {name}: values differ from torch")
                continue
            up = torch.randn(want.shape, generator=g, dtype=torch.float64)
            (out.full_tensor() * up).sum().backward()
            mine = [t.grad.clone() if t.grad is not None else None for t in (x, y, w, b)]
            for t in (x, y, w, b):
                t.grad = None
            (want * up).sum().backward()
            for which, m, theirs in zip("xywb", mine, (x.grad, y.grad, w.grad, b.grad)):
                if (m is None) != (theirs is None) or (m is not None and not torch.allclose(m, theirs)):
                    failures.append(f"{label} {name}: the {which} gradient differs from torch's")
        x = torch.randn(rows, H, generator=g, dtype=torch.float64)
        dx = make(x)
        for name, f in (("cat along dim 0", lambda t: torch.cat([t, t * 2], 0)), ("slice along dim 0", lambda t: t[1:5]),
                        ("cumsum along dim 0", lambda t: t.cumsum(0)), ("flip dim 0", lambda t: t.flip(0)),
                        ("an empty slice of the rows", lambda t: t[:, 3:3]), ("split with an empty piece",
                                                                             lambda t: t.split([0, H], -1)[1]),
                        ("cat with an empty piece", lambda t: torch.cat([t, t[:, :0]], -1))):
            if not torch.allclose(f(dx).full_tensor(), f(x)):
                failures.append(f"{label} {name}: values differ from torch")
    return failures


@pytest.mark.parametrize("world", [2, 4])
def test_row_wise_ops_run_where_a_layout_without_placements_is(world):
    results = run_on_ranks(_row_wise_in_place, world, args=(random.randrange(10**6),), timeout_s=600)
    assert results == [[]] * world, results[0]


LOSSES = {
    "mse mean": lambda x, y: F.mse_loss(x, y),
    "mse sum": lambda x, y: F.mse_loss(x, y, reduction="sum"),
    "mse none": lambda x, y: F.mse_loss(x, y, reduction="none"),
    "huber mean": lambda x, y: F.huber_loss(x, y, delta=0.5),
    "smooth_l1 sum": lambda x, y: F.smooth_l1_loss(x, y, reduction="sum", beta=0.5),
    "bce with logits mean": lambda x, y: F.binary_cross_entropy_with_logits(x, y.sigmoid()),
    "bce with logits none": lambda x, y: F.binary_cross_entropy_with_logits(x, y.sigmoid(), reduction="none"),
}


def _elementwise_losses_in_place(rank, world, seed):
    """Elementwise losses of a prediction and a target laid out alike by a layout with no placement
    form: each device on its own elements, no collective in the forward; ``"none"`` keeps the
    layout, ``"sum"`` / ``"mean"`` are pending sums over the dealing axes; values and gradients
    equal torch's."""
    from axedist.runtime import count_collectives

    g = torch.Generator().manual_seed(seed)
    failures = []
    for label, mesh, make, rows in _layouts(world):
        for name, f in LOSSES.items():
            x = torch.randn(rows, H, generator=g, dtype=torch.float64, requires_grad=True)
            y = torch.randn(rows, H, generator=g, dtype=torch.float64)
            dx, dy = make(x), make(y)
            with count_collectives() as seen:
                out = f(dx, dy)
            if seen.calls:
                failures.append(f"{label} {name}: {seen.calls} collectives in the forward")
            if name.endswith("none"):
                failures += gathered(f"{label} {name}", out)
            elif not any(isinstance(p, Partial) for p in out.placements):
                failures.append(f"{label} {name}: {out.placements}, not a pending sum")
            want = f(x, y)
            if not torch.allclose(out.full_tensor(), want):
                failures.append(f"{label} {name}: values differ from torch")
                continue
            up = torch.randn(want.shape, generator=g, dtype=torch.float64)
            (out.full_tensor() * up).sum().backward()
            mine, x.grad = x.grad.clone(), None
            (want * up).sum().backward()
            if not torch.allclose(mine, x.grad):
                failures.append(f"{label} {name}: the gradient differs from torch's")
    return failures


@pytest.mark.parametrize("world", [2, 4])
def test_elementwise_losses_run_where_a_layout_without_placements_is(world):
    results = run_on_ranks(_elementwise_losses_in_place, world, args=(random.randrange(10**6),), timeout_s=600)
    assert results == [[]] * world, results[0]


# name -> f(x (R, H) float, y (R, H) float, t (R,) int targets, idx (4,) int, r (H,) float replicated): each works on whole rows
INDEXED_ROWS = {
    "one_hot": lambda x, y, t, idx, r: F.one_hot(t, H).to(x.dtype) * x,
    "a column against a row": lambda x, y, t, idx, r: (x[:, :1] < r) * y,
    "embedding of dealt ids": lambda x, y, t, idx, r: F.embedding(t, r[:, None] * r) * 1,
    "cross_entropy none": lambda x, y, t, idx, r: F.cross_entropy(x, t, reduction="none"),
    "cross_entropy none smoothed": lambda x, y, t, idx, r: F.cross_entropy(x, t, reduction="none", label_smoothing=0.1),
    "columns by index": lambda x, y, t, idx, r: x[:, idx],
    "columns by a 2-D index": lambda x, y, t, idx, r: x[:, idx.view(2, 2)] * 2,
    "index_add": lambda x, y, t, idx, r: x.index_add(1, idx, y[:, :4]),
    "index_select": lambda x, y, t, idx, r: x.index_select(1, idx),
    "gather of a slice": lambda x, y, t, idx, r: x[:, :4].gather(1, idx.clamp(max=3).expand(x.shape[0], 4)),
    "windows": lambda x, y, t, idx, r: x.unfold(1, 2, 2) * 1,
    "overlapping windows": lambda x, y, t, idx, r: x.unfold(1, 3, 1) * y[:, :4, None],
    "columns set in place": lambda x, y, t, idx, r: _set_columns(x * 1, idx[:3].unique(), y[:, :3]),
    "columns added in place": lambda x, y, t, idx, r: (x * 1).index_add_(1, idx, y[:, 2:]),
    "scatter in place": lambda x, y, t, idx, r: (x * 1).scatter_(1, idx.expand(x.shape[0], 4), 0.5),
}


def _set_columns(z, columns, values):
    z[:, columns] = values[:, :len(columns)]
    return z


def _indexed_rows_in_place(rank, world, seed):
    """Indexing, one-hot, per-row losses, windows and in-place writes along the last dim of rows dealt
    by a layout with no placement form: no collective in the forward nor in the backward (whose
    output gradient arrives replicated, as ``(out * g).sum()`` gives), the output keeps the rows'
    map, values and gradients equal torch's on the whole tensor."""
    from axedist.runtime import count_collectives

    g = torch.Generator().manual_seed(seed)
    failures = []
    for label, mesh, make, rows in _layouts(world):
        replicated = [Replicate()] * mesh.ndim
        for name, f in INDEXED_ROWS.items():
            x, y = (torch.randn(rows, H, generator=g, dtype=torch.float64, requires_grad=True) for _ in range(2))
            t = torch.randint(0, H, (rows,), generator=g)
            idx = torch.randint(0, H, (4,), generator=g)
            r = torch.randn(H, generator=g, dtype=torch.float64, requires_grad=True)
            dx, dy = (make(v.detach()).detach().requires_grad_() for v in (x, y))
            dt = make(t[:, None].expand(rows, H).contiguous())[:, 0]  # the targets in the rows' map
            didx, dr = distribute(idx, mesh, replicated), distribute(r.detach(), mesh, replicated).requires_grad_()
            with count_collectives() as seen:
                out = f(dx, dy, dt, didx, dr)
            if seen.calls:
                failures.append(f"{label} {name}: {seen.calls} collectives in the forward")
            failures += gathered(f"{label} {name}", out)
            want = f(x, y, t, idx, r)
            if not torch.allclose(out.full_tensor(), want):
                failures.append(f"{label} {name}: values differ from torch")
                continue
            up = torch.randn(want.shape, generator=g, dtype=torch.float64)
            loss = (out * distribute(up, mesh, replicated)).sum()
            with count_collectives() as seen:
                loss.backward()
            if seen.calls:
                failures.append(f"{label} {name}: {seen.calls} collectives in the backward")
            mine = [d.grad.full_tensor() if d.grad is not None else None for d in (dx, dy, dr)]
            (want * up).sum().backward()
            for which, m, theirs in zip("xyr", mine, (x.grad, y.grad, r.grad)):
                if (m is None) != (theirs is None) or (m is not None and not torch.allclose(m, theirs)):
                    failures.append(f"{label} {name}: the {which} gradient differs from torch's")
    return failures


@pytest.mark.parametrize("world", [2, 4])
def test_indexing_and_per_row_losses_run_where_a_layout_without_placements_is(world):
    seed = random.randrange(10**6)
    results = run_on_ranks(_indexed_rows_in_place, world, args=(seed,), timeout_s=600)
    assert results == [[]] * world, (seed, results[0])


# name -> f(x (R, H), w (H, H), b (H,)): reductions over the rows a layout deals (and linear's bias gradient)
OVER_DEALT_ROWS = {
    "sum over rows": lambda x, w, b: x.sum(0),
    "mean over rows keepdim": lambda x, w, b: x.mean(0, keepdim=True),
    "amax over rows": lambda x, w, b: x.amax(0),
    "sum of rows of a view": lambda x, w, b: x.view(-1, 2, H).sum((0, 1)),
    "a linear layer's output summed over rows": lambda x, w, b: F.linear(x, w, b).sum(0),
    "a linear layer's bias gradient from dealt rows": lambda x, w, b: (F.linear(x, w, b) * x).sum(0),
}
# name -> f(x (R, H), w, b): reductions over the dealt rows whose local function combines each device's
# statistics over the dealing axes (the result whole on every device)
COMBINED_OVER_DEALT_ROWS = {
    "var over rows": lambda x, w, b: x.var(0),
    "std over rows, no correction, keepdim": lambda x, w, b: x.std(0, correction=0, keepdim=True),
    "var_mean over rows (the mean)": lambda x, w, b: torch.var_mean(x, 0)[1],
    "std_mean over rows (the std)": lambda x, w, b: torch.std_mean(x, 0)[0],
    "var of rows of a view": lambda x, w, b: x.view(-1, 2, H).var((0, 1)),
    "logsumexp over rows": lambda x, w, b: torch.logsumexp(x, 0),
    "2-norm over rows": lambda x, w, b: torch.linalg.vector_norm(x, dim=0),
    "prod over rows": lambda x, w, b: (x * 0.5 + 1).prod(0),
    "any over rows (no gradient)": lambda x, w, b: (x > 1).any(0),
    "all over rows (no gradient)": lambda x, w, b: (x > -1).all(0),
}


def _reduced_over_dealt_rows(rank, world, seed):
    """A sum, mean or max over the rows a layout deals, every other dim whole in each piece: each
    device reduces its own rows, a pending reduction over the dealing axes, no collective in the
    forward (placements gathered the rows); values and gradients (a bias's too) equal torch's. A
    variance, std, logsumexp, 2-norm or product over them: each device's statistics of its own
    rows, combined by its local function over the dealing axes, the result replicated, no row
    moved (placements gathered them)."""
    from torch.distributed.tensor import Partial

    from axedist.runtime import count_collectives

    g = torch.Generator().manual_seed(seed)
    failures = []
    cases = [(name, f, True) for name, f in OVER_DEALT_ROWS.items()]
    cases += [(name, f, False) for name, f in COMBINED_OVER_DEALT_ROWS.items()]
    for label, mesh, make, rows in _layouts(world):
        replicated = [Replicate()] * mesh.ndim
        for name, f, pending in cases:
            x = torch.randn(rows, H, generator=g, dtype=torch.float64, requires_grad=True)
            w, b = (torch.randn(shape, generator=g, dtype=torch.float64, requires_grad=True) for shape in ((H, H), (H,)))
            dx = make(x.detach()).detach().requires_grad_()
            dw, db = (distribute(t.detach(), mesh, replicated).requires_grad_() for t in (w, b))
            with count_collectives() as seen:
                out = f(dx, dw, db)
            if seen.calls:
                failures.append(f"{label} {name}: {seen.calls} collectives in the forward")
            if pending and not any(isinstance(p, Partial) for p in out.placements):
                failures.append(f"{label} {name}: {out.placements}, not a pending reduction")
            if not pending and out.placements != tuple(replicated):
                failures.append(f"{label} {name}: {out.placements}, not replicated")
            want = f(x, w, b)
            if not torch.equal(out.full_tensor(), want) if want.dtype == torch.bool else \
                    not torch.allclose(out.full_tensor(), want):
                failures.append(f"{label} {name}: values differ from torch")
                continue
            if not want.requires_grad:
                continue
            up = torch.randn(want.shape, generator=g, dtype=torch.float64)
            (out * distribute(up, mesh, replicated)).sum().backward()
            (want * up).sum().backward()
            for which, mine, theirs in (("x", dx, x), ("w", dw, w), ("b", db, b)):
                got = None if mine.grad is None else mine.grad.full_tensor()
                if (got is None) != (theirs.grad is None) or (got is not None and not torch.allclose(got, theirs.grad)):
                    failures.append(f"{label} {name}: the {which} gradient differs from torch's")
    return failures


@pytest.mark.parametrize("world", [2, 4])
def test_reductions_over_the_dealt_rows_are_pending_where_they_are(world):
    seed = random.randrange(10**6)
    results = run_on_ranks(_reduced_over_dealt_rows, world, args=(seed,), timeout_s=600)
    assert results == [[]] * world, (seed, results[0])
