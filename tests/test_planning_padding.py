"""The per-dim route for padding (uneven shapes) against the element-wise one it replaces.

A redistribute of an uneven tensor asks, once per spec pair, which buffer slots of each
device hold real elements, each device's true local box, and which transfers of a plan
carry padding. ``axedist.planning.holdings`` answers from each dim's own indices where a layout's
memory is per-dim row-major (O(sum of dims x mesh size)), and element by element otherwise
(``ELEMENTWISE = True`` forces that route everywhere: the reference). These tests hold the
two routes to each other on random layouts, true rows, meshes and plans, check the pruned
plans with the simulator, and run uneven redistributes on gloo ranks against torch
DTensor's result from the full tensor.
"""

import math
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from axedist.layout import LayoutError
from axedist.planning import holdings, padding, plan_alternatives, simulate
from axedist.planning.held_rows import held_rows
from axedist.planning.holdings import Holdings, dim_placements, holdings_of, holdings_per_dim
from axedist.planning.padding import drop_padding, expand, pieces
from axedist.testing import run_on_ranks
from tests.planning_cases import MESHES as ALL_MESHES
from tests.planning_cases import REDUCE, StubMesh, brute_slots, random_layout, random_shape, scatter
from tests.test_runtime_executor import torch_case

MESHES = [(("gpuid", 2),), (("gpuid", 3),), (("gpuid", 4),), (("x", 2), ("y", 2)), (("x", 2), ("y", 4))]
SETTINGS = settings(max_examples=120, deadline=None)


def _case(rng: random.Random, partial: bool = False):
    """A mesh, a shape, a source layout over it (``(P, *shape)`` with ``partial``), and true rows
    per dim (a random nonempty subset of each dim: padding anywhere, as torch's nested chunks)."""
    mesh_spec = rng.choice(MESHES)
    shape = random_shape(rng, mesh_spec)
    layout = random_layout(rng, mesh_spec, shape, partial=partial)
    full = (layout.size // math.prod(shape),) + tuple(shape) if partial else tuple(shape)
    rows = tuple(tuple(sorted(rng.sample(range(n), rng.randint(1, n)))) for n in shape)
    if partial:
        rows = (tuple(range(full[0])),) + rows
    return mesh_spec, shape, layout, full, rows


def _both(layout, full, rows, mesh):
    """(per-dim holdings or None, element-wise holdings); None, None for a layout without per-dim blocks."""
    try:
        reference = holdings_of(layout, full, rows, mesh, everywhere=True)
    except LayoutError:
        return None, None
    return holdings_per_dim(layout, full, rows, mesh), reference


@SETTINGS
@given(seed=st.integers(0, 2**31 - 1))
def test_per_dim_holdings_equal_the_elementwise_ones(seed):
    """Masks (real slots per device) and true boxes, per dim vs from every element."""
    rng = random.Random(seed)
    mesh_spec, _, layout, full, rows = _case(rng, partial=rng.random() < 0.3)
    fast, reference = _both(layout, full, rows, StubMesh(mesh_spec))
    if fast is None:
        return  # no per-dim route for this layout: the element-wise one is all there is
    assert fast.boxes == reference.boxes, (layout, full, rows)
    assert fast.masks().equal(reference.masks()), (layout, full, rows)
    assert fast.all_real == reference.all_real


def test_per_dim_route_covers_dtensor_layouts():
    """Layouts made from placements (row-major local tensors, nested uneven chunks) always factor:
    the per-dim route is the one that runs for DTensor, whatever the padding."""
    from tests.planning_cases import placements

    rng = random.Random(7)
    for mesh_spec in MESHES:
        for _ in range(20):
            n = math.prod(size for _, size in mesh_spec)  # padded dims: every placement divides them
            shape = (rng.randint(1, 4) * n, rng.randint(1, 3) * n)
            spec = [rng.choice(["S0", "S1", "R"]) for _ in mesh_spec]
            layout = placements(mesh_spec, shape, spec)
            rows = tuple(tuple(sorted(rng.sample(range(n), rng.randint(1, n)))) for n in shape)
            fast, reference = _both(layout, shape, rows, StubMesh(mesh_spec))
            assert fast is not None, (layout, spec)
            assert fast.boxes == reference.boxes and fast.masks().equal(reference.masks())


def test_positions_reached_two_ways_take_the_elementwise_route():
    """``S[(2,2,2,2):(1@x,2,1@x,1)]`` over ``(4, 4)`` on x=3: both dims step along x, so x = 1 holds
    rows {0,1} x cols {2,3} and rows {2,3} x cols {0,1}, no product of per-dim sets. The per-dim
    route declines (its masks would be the product), and ``holdings_of`` answers element by element."""
    from axedist.layout import Layout

    mesh = StubMesh((("x", 3),))
    layout = Layout.parse("S[(2,2,2,2):(1@x,2,1@x,1)]")
    rows = ((0, 1, 3), (0, 2, 3))
    assert dim_placements(layout, (4, 4), mesh) is not None  # memory per dim: not why
    assert holdings_per_dim(layout, (4, 4), rows, mesh) is None
    held, reference = holdings_of(layout, (4, 4), rows, mesh), _both(layout, (4, 4), rows, mesh)[1]
    assert held.masks().equal(reference.masks()) and held.boxes == reference.boxes


def _moves(plan) -> list[list]:
    """Per step, every (source device, target device, source slot, target slot) it moves, sorted."""
    return [sorted((t.source, t.target, s, m) for t in step.transfers for s, m in t.pairs()) for step in plan.steps]


@SETTINGS
@given(seed=st.integers(0, 2**31 - 1), partial=st.sampled_from([None, None, "sum", "max"]))
def test_dropped_padding_equals_the_elementwise_route(seed, partial):
    """Every alternative plan between two random layouts, its padding left out per dim and element
    by element: the same element moves in every step, the same bytes; and the pruned plan still
    delivers every real element to every slot the target holds it in (the simulator)."""
    rng = random.Random(seed)
    mesh_spec, shape, src, full, rows = _case(rng, partial=partial is not None)
    dst = random_layout(rng, mesh_spec, shape)
    mesh = StubMesh(mesh_spec)
    fast, reference = _both(src, full, rows, mesh)
    if reference is None:
        return
    if fast is None:
        fast = reference  # the per-dim route still runs for the later steps' layouts
    size = math.prod(shape)
    summands = full[0] if partial else 1
    values = [(x % size) * 16 + x // size + 1 for x in range(summands * size)]
    buffers = scatter(src, mesh_spec, values)
    real = [all(i in r for i, r in zip(index, rows[len(full) - len(shape):]))
            for index in _indices(shape)]
    for plan in plan_alternatives(src, dst, mesh_spec, shape, partial=partial):
        ours = drop_padding(plan, fast, mesh)
        theirs = drop_padding(plan, reference, mesh, everywhere=True)
        assert _moves(ours) == _moves(theirs), (str(plan), rows)
        assert ours.cost == theirs.cost and ours.note == theirs.note
        out = simulate(ours, buffers)
        for x, slots in enumerate(brute_slots(dst, mesh_spec)):
            if real[x]:
                column = [values[p * size + x] for p in range(summands)]
                want = REDUCE[partial](column) if partial else column[0]
                for d, m in slots:
                    assert out[d][m] == pytest.approx(want), (str(ours), x, d, m)


def _indices(shape):
    """Every index tuple of ``shape``, row-major."""
    out = [()]
    for n in shape:
        out = [i + (k,) for i in out for k in range(n)]
    return out


def test_cut_box_walks_over_a_dims_end():
    """A coalesced box (24 slots at stride 7 over local rows of 14: two rows of a (12, 14) local
    tensor, 7 columns apart) is cut into (12, 2) at strides (14, 7), so its realness stays per dim."""
    from axedist.layout import Layout
    from axedist.planning import Transfer

    mesh = StubMesh((("x", 2),))
    layout = Layout.parse("S[(12,2,2,7):(14,1@x,7,1)]")  # (12, 28) Shard(1) over x, local (12, 14)
    rows = (tuple(range(11)), tuple(r for r in range(28) if r % 7 != 6))  # last row and every 7th column padding
    held = holdings_per_dim(layout, (12, 28), rows, mesh)
    box, groups = held.keep(0, Transfer((0,), (1,), (24, 7), 0, (7, 1), 0, (7, 1)))
    assert box.extents == (12, 2, 7) and box.source_strides == (14, 7, 1) and box.target_strides == (14, 7, 1)
    assert sorted(dims for dims, _ in groups) == [(0,), (1, 2)]  # one group per tensor dim walked
    reference = holdings_of(layout, (12, 28), rows, mesh, everywhere=True)
    _, dense = reference.keep(0, Transfer((0,), (1,), (24, 7), 0, (7, 1), 0, (7, 1)))
    assert expand(groups, box.extents).reshape(-1).equal(dense[0][1].reshape(-1))


def test_pieces_cut_a_grid_into_boxes():
    """``pieces``: the product of runs when the grid is one, else runs of equal slices; each cell once."""
    import torch

    rng = random.Random(3)
    for _ in range(200):
        shape = tuple(rng.randint(1, 5) for _ in range(rng.randint(0, 3)))
        grid = torch.rand(shape, generator=torch.Generator().manual_seed(rng.randrange(10**6))) < rng.random()
        covered = torch.zeros(shape, dtype=torch.int64)
        for piece in pieces(grid):
            covered[tuple(slice(s, s + n) for s, n in piece)] += 1
        assert covered.equal(grid.to(torch.int64)), (grid, pieces(grid))
    product = torch.tensor([[1, 1, 0, 1], [0, 0, 0, 0], [1, 1, 0, 1]], dtype=torch.bool)
    assert pieces(product) == [((0, 1), (0, 2)), ((0, 1), (3, 1)), ((2, 1), (0, 2)), ((2, 1), (3, 1))]


# -- uneven redistributes on gloo ranks: both routes against torch DTensor ----------------

PLACED = ["S0", "S1", "R"]


def _routes(rank, world, cases):
    """Each case run with the per-dim route and with the element-wise one: (values equal torch's
    both times, the same bytes both times, element-wise evaluations the per-dim route needed:
    holdings from every element, masks built for a box, or realness followed slot by slot)."""
    dense = [0]
    everywhere, masks, step_holdings = holdings.holdings_everywhere, Holdings.masks, padding.step_holdings

    def counted(function, dense_when=lambda result: True):
        def wrapper(*args):
            result = function(*args)
            dense[0] += bool(dense_when(result))
            return result
        return wrapper

    out = []
    for i, case in enumerate(cases):
        dense[0] = 0
        holdings.holdings_everywhere = counted(everywhere)
        Holdings.masks = counted(masks)
        padding.step_holdings = counted(step_holdings, lambda result: result is None)
        try:
            fast = torch_case(*case, seed=i)
        finally:
            holdings.holdings_everywhere, Holdings.masks = everywhere, masks
            padding.step_holdings = step_holdings
        per_dim_dense = dense[0]
        holdings.ELEMENTWISE = True
        try:
            slow = torch_case(*case, seed=i)
        finally:
            holdings.ELEMENTWISE = False
        out.append((fast[0], slow[0], fast[1], slow[1], per_dim_dense, fast[3]))
    return out


@st.composite
def _uneven(draw, mesh_shape):
    """Uneven shapes (dims 1..23, one of them often a multiple of the mesh plus or minus 1)."""
    n = math.prod(mesh_shape)
    shape = [draw(st.integers(1, 23)), draw(st.integers(1, 23))]
    k = draw(st.integers(0, 2))
    if k < 2:
        shape[k] = max(1, draw(st.integers(1, 5)) * n + draw(st.sampled_from([-1, 1])))
    op = draw(st.sampled_from(["", "", "max", "avg"]))
    src = [draw(st.sampled_from(PLACED + ["P" + op])) for _ in mesh_shape]
    dst = [draw(st.sampled_from(PLACED)) for _ in mesh_shape]
    return (tuple(mesh_shape), tuple(shape), " ".join(src), " ".join(dst))


@pytest.mark.parametrize("mesh_shape", [(3,), (4,), (2, 2)], ids=lambda m: "x".join(map(str, m)))
@settings(max_examples=1, deadline=None)
@given(data=st.data())
def test_uneven_redistribute_both_routes_match_torch(mesh_shape, data):
    """Fresh uneven transitions: the per-dim route's result equals torch DTensor's (from the full
    tensor) and the element-wise route's, with the same bytes, without one dense evaluation."""
    cases = data.draw(st.lists(_uneven(mesh_shape), min_size=6, max_size=6), label="transitions")
    cases.append((tuple(mesh_shape), (9, 11), " ".join(["S1"] * len(mesh_shape)), " ".join(["S0"] * len(mesh_shape))))
    results = run_on_ranks(_routes, math.prod(mesh_shape), args=(cases,), timeout_s=180)
    for i, case in enumerate(cases):
        per_rank = [r[i] for r in results]
        assert all(r[0] and r[1] for r in per_rank), (case, per_rank[0][5])
        assert [r[2] for r in per_rank] == [r[3] for r in per_rank], (case, per_rank[0][5])
        assert all(r[4] == 0 for r in per_rank), (case, "the per-dim route fell back to every element")


@settings(max_examples=150, deadline=None)
@given(seed=st.integers(0, 2**31 - 1))
def test_held_rows_per_dim_equals_the_elementwise_evaluation(seed):
    """The per-dim evaluation of which true rows each device holds (O(sum of dims)) gives what
    evaluating the layout on every element gives, on random layouts (cyclic, reversed, subsets,
    replicas, memory gaps and offsets) with random padding and true rows."""
    rng = random.Random(seed)
    mesh_spec = rng.choice(ALL_MESHES)
    shape = random_shape(rng, mesh_spec)
    layout = random_layout(rng, mesh_spec, shape)
    rows = [sorted(rng.sample(range(n), rng.randint(1, n))) for n in shape]   # true rows (rest: padding)
    mesh = StubMesh(mesh_spec)
    try:
        reference = held_rows(layout, shape, rows, mesh, everywhere=True)
    except LayoutError:
        return  # no per-dim blocks: held_rows is never asked about such a layout
    assert held_rows(layout, shape, rows, mesh) == reference


def _brute_local_rows(layout, mesh_spec, shape, spec):
    """Per position: {dim: {local row: {global indices}}} and the number of elements it holds,
    from the definition (``scatter``) alone."""
    import itertools

    values = list(range(math.prod(shape)))
    buffers = scatter(layout, mesh_spec, values)
    local = spec.local_padded
    out = {}
    for p, device in enumerate(itertools.product(*(range(n) for _, n in mesh_spec))):
        rows, count = {d: {} for d in range(len(shape))}, 0
        for m, x in enumerate(buffers[device]):
            if x is None:
                continue
            count += 1
            for d in range(len(shape)):
                g = (x // math.prod(shape[d + 1:])) % shape[d]
                lr = (m // math.prod(local[d + 1:])) % local[d]
                rows[d].setdefault(lr, set()).add(g)
        out[p] = rows, count
    return out


@SETTINGS
@given(seed=st.integers(0, 2**31 - 1))
def test_held_indices_are_each_positions_rows(seed):
    """``held_indices``, where it answers, names for every position the global index of each of
    its local rows per dim, and the position holds exactly their grid (brute force from the
    definition); it answers for every layout of placements and for block-cyclic ones."""
    from axedist.layout import LayoutError
    from axedist.planning.boxes import global_box, held_indices
    from axedist.spec import make_spec

    rng = random.Random(seed)
    mesh_spec = rng.choice(MESHES)
    shape = random_shape(rng, mesh_spec)
    layout = random_layout(rng, mesh_spec, shape)
    mesh = StubMesh(mesh_spec)
    try:
        spec = make_spec(mesh, layout, tuple(shape))
    except LayoutError:
        return  # not a DTensor layout (a local tensor that is not row-major, ...)
    brute = _brute_local_rows(layout, mesh_spec, shape, spec)
    for p, (rows, count) in brute.items():
        held = held_indices(spec, p)
        if held is None:
            continue
        assert count == math.prod(len(index) for index in held), (p, held, count)
        for d, index in enumerate(held):
            assert {lr: {g} for lr, g in enumerate(index)} == rows[d] or count == 0, (p, d, index, rows[d])
        box = global_box(spec, p)
        if box is not None and count:
            assert all(index == range(o, o + s) for index, o, s in zip(held, *box)), (p, held, box)


def test_held_indices_of_dealt_rows():
    """Rows dealt round-robin in pairs to 2 devices, and ``[Shard(0)]`` of 10 rows on 4."""
    from axedist.layout import Layout
    from axedist.planning.boxes import held_indices
    from axedist.spec import make_spec, spec_from_placements
    from torch.distributed.tensor import Shard

    mesh = StubMesh((("gpuid", 2),))
    spec = make_spec(mesh, Layout.parse("S[(2,2,2,6):(12,1@gpuid,6,1)]"), (8, 6))
    assert held_indices(spec, 1) == ((2, 3, 6, 7), range(0, 6))
    assert held_indices(spec, 0) == ((0, 1, 4, 5), range(0, 6))
    line = StubMesh((("gpuid", 4),))
    line.ndim = 1
    chunks = spec_from_placements((10, 3), line, (Shard(0),))
    assert [held_indices(chunks, p)[0] for p in range(4)] == [range(0, 3), range(3, 6), range(6, 9), range(9, 10)]
