"""Select/join/split ops on DTensors (ops/tensor_ops.py) against the same ops on whole tensors.

On 2 and 4 ranks and a 2x2 mesh, fp64 inputs of random (often uneven) shapes in every
assignment of Shard(0)/Shard(1)/Replicate/Partial to the mesh axes (a second input in a
different one, so inputs get redistributed): outputs and gradients (slice_backward,
select_backward, index_add, scatter_add, cat/stack in split's backward ...) must equal the
single-device ones, and dims an op does not touch keep their shards (no needless gather).
"""

import pytest
import torch

from axedist.testing import run_on_ranks
from tests.ops_cases import (MESHES, WORLD, Partial, Replicate, Shard, check, make, mesh_of, placement_sets,
                       rand, randint, sample_sets, shards)

OPTIONS = [Shard(0), Shard(1), Replicate(), Partial()]


def _kept_shards(placements_in, dims_gone, out_dim):
    """The placements an op that leaves dims (other than ``dims_gone``) in place must give,
    for the shards of the input: ``out_dim(d)`` is where input dim ``d`` lands."""
    want = {}
    for axis, p in enumerate(placements_in):
        if isinstance(p, Shard) and p.dim not in dims_gone:
            want[axis] = Shard(out_dim(p.dim))
        if isinstance(p, Partial):
            want[axis] = p
    return want


def _expect(want, what):
    def run(outs):
        for o in outs:
            for axis, p in want.items():
                assert o.placements[axis] == p, f"{what}: output placements {o.placements}, axis {axis} should be {p}"
    return run


def _joins_and_splits(rank, world_size, mesh_name, seed):
    mesh = mesh_of(mesh_name)
    g = torch.Generator().manual_seed(seed)
    a, b, c = randint(g, 1, 7), randint(g, 1, 7), randint(g, 1, 5)
    X = rand(g, a, b)
    sets = placement_sets(mesh, OPTIONS)
    for xp in sample_sets(mesh, OPTIONS, g):
        # y: the same placements (shards must survive) or another set (forces a redistribute)
        yp = xp if randint(g, 0, 2) else sets[randint(g, 0, len(sets))]
        what = f"seed {seed}, mesh {mesh_name}, shape {(a, b)}, x {xp}, y {yp}"
        dim = randint(g, -2, 2)
        for dim, Y in ((dim, rand(g, c, b) if dim % 2 == 0 else rand(g, a, c)),):
            want = _kept_shards(xp, {dim % 2}, lambda d: d) if xp == yp else {}
            out = check(lambda x, y: torch.cat([x, y], dim), [(X, xp), (Y, yp)], mesh, seed, g, f"cat {dim} {what}",
                        _expect(want, f"cat {dim} {what}"))[0]
            assert not shards(out.placements, dim % 2), f"cat {dim} {what}: {out.placements}"
        for dim in (randint(g, 0, 3),):
            want = _kept_shards(xp, set(), lambda d: d if d < dim else d + 1) if xp == yp else {}
            check(lambda x, y: torch.stack([x, y], dim), [(X, xp), (rand(g, a, b), yp)], mesh, seed, g,
                  f"stack {dim} {what}", _expect(want, f"stack {dim} {what}"))
        for dim in (randint(g, 0, 2),):
            n = X.shape[dim]
            size = randint(g, 1, n + 1)
            keep = _kept_shards(xp, {dim}, lambda d: d)
            check(lambda x: x.split(size, dim), [(X, xp)], mesh, seed, g, f"split {size} {dim} {what}",
                  _expect(keep, f"split {dim} {what}"))
            chunks = randint(g, 1, 4)
            check(lambda x: x.chunk(chunks, dim), [(X, xp)], mesh, seed, g,
                  f"chunk {chunks} {dim} {what}", _expect(keep, f"chunk {dim} {what}"))
            cut = randint(g, 0, n)
            sizes = [cut, n - cut] if 0 < cut < n else [n]
            check(lambda x: x.split(sizes, dim), [(X, xp)], mesh, seed, g, f"split {sizes} {dim} {what}",
                  _expect(keep, f"split sizes {dim} {what}"))
            check(lambda x: x.unbind(dim), [(X, xp)], mesh, seed, g, f"unbind {dim} {what}",
                  _expect(_kept_shards(xp, {dim}, lambda d: d - 1 if d > dim else d), f"unbind {dim} {what}"))
    return True


def _selections(rank, world_size, mesh_name, seed):
    mesh = mesh_of(mesh_name)
    g = torch.Generator().manual_seed(seed)
    a, b, c = randint(g, 1, 7), randint(g, 2, 7), randint(g, 1, 4)
    X = rand(g, a, b, c)
    for xp in sample_sets(mesh, [Shard(0), Shard(1), Shard(2), Replicate(), Partial()], g):
        what = f"seed {seed}, mesh {mesh_name}, shape {(a, b, c)}, x {xp}"
        lo = randint(g, 0, b)
        hi = randint(g, lo + 1, b + 1)
        step = randint(g, 1, 3)
        check(lambda x: x[:, lo:hi:step], [(X, xp)], mesh, seed, g, f"slice [{lo}:{hi}:{step}] {what}",
              _expect(_kept_shards(xp, {1}, lambda d: d), f"slice {what}"))
        check(lambda x: x[:, 0:], [(X, xp)], mesh, seed, g, f"full slice {what}",
              _expect(_kept_shards(xp, set(), lambda d: d), f"full slice {what}"))
        check(lambda x: x.narrow(0, 0, max(1, a - 1)), [(X, xp)], mesh, seed, g, f"narrow {what}")
        index = randint(g, -b, b)
        check(lambda x: x[:, index], [(X, xp)], mesh, seed, g, f"select {index} {what}",
              _expect(_kept_shards(xp, {1}, lambda d: d if d < 1 else d - 1), f"select {what}"))
        check(lambda x: x[a - 1], [(X, xp)], mesh, seed, g, f"select row {what}")
        check(lambda x: x.flip(1), [(X, xp)], mesh, seed, g, f"flip {what}",
              _expect(_kept_shards(xp, {1}, lambda d: d), f"flip {what}"))
        # index_select with a replicated and a sharded index (indices repeat, in any order)
        idx = torch.randint(0, b, (randint(g, 1, 6),), generator=g)
        for ip in sample_sets(mesh, [Replicate(), Shard(0)], g, 2):
            check(lambda x, i: x.index_select(1, i), [(X, xp), (idx, ip)], mesh, seed, g,
                  f"index_select idx {ip} {what}", _expect(_kept_shards(xp, {1}, lambda d: d), f"index_select {what}"))
        # gather along dim 1 with an index of the same size off dim 1 (so shards can be kept)
        gidx = torch.randint(0, b, (a, randint(g, 1, 5), c), generator=g)
        m = randint(g, 1, b + 1)
        for ip in sample_sets(mesh, [Replicate(), Shard(0), Shard(1)], g, 2):
            out = check(lambda x, i: x.gather(1, i), [(X, xp), (gidx, ip)], mesh, seed, g, f"gather idx {ip} {what}")
            for axis, (p, q) in enumerate(zip(xp, ip)):
                if p == q == Shard(0):
                    assert out[0].placements[axis] == Shard(0), f"gather {what} idx {ip}: {out[0].placements}"
        # scatter_add / scatter / index_add (the backward ops of gather, max.dim, index_select) directly
        src = rand(g, *gidx.shape)
        sidx = torch.stack([torch.randperm(b, generator=g)[:m] for _ in range(a * c)]) \
            .reshape(a, c, m).permute(0, 2, 1).contiguous()  # no repeats along dim 1: scatter is exact
        ssrc = rand(g, a, m, c)
        yp = [Shard(0) if isinstance(p, Shard) and p.dim == 0 else Replicate() for p in xp]
        check(lambda x, i, s: x.scatter_add(1, i, s), [(X, xp), (gidx, yp), (src, yp)], mesh, seed, g,
              f"scatter_add {what}")
        check(lambda x, i, s: x.scatter(1, i, s), [(X, xp), (sidx, yp), (ssrc, yp)], mesh, seed, g,
              f"scatter {what}")
        check(lambda x, i: x.scatter(1, i, 2.5), [(X, xp), (sidx, yp)], mesh, seed, g, f"scatter value {what}")
        source = rand(g, a, idx.shape[0], c)
        check(lambda x, i, s: x.index_add(1, i, s, alpha=1.5), [(X, xp), (idx, [Replicate()] * mesh.ndim),
                                                                (source, yp)], mesh, seed, g, f"index_add {what}")
        mask = torch.rand(b, c, generator=g) > 0.5
        check(lambda x, m: x.masked_fill(m, -3.0), [(X, xp), (mask, [Replicate()] * mesh.ndim)], mesh, seed, g,
              f"masked_fill {what}")
        # advanced indexing with plain lists / index tensors (taken as replicated: the same on every
        # rank), indices repeating; un-indexed dims keep their shards (index_put in the backward)
        cols = torch.randint(0, b, (randint(g, 1, 5),), generator=g).tolist()
        check(lambda x: x[:, cols], [(X, xp)], mesh, seed, g, f"x[:, {cols}] {what}",
              _expect(_kept_shards(xp, {1}, lambda d: d), f"x[:, list] {what}"))
        grid = torch.randint(-b, b, (2, randint(g, 1, 4)), generator=g)
        check(lambda x: x[:, grid], [(X, xp)], mesh, seed, g, f"x[:, 2-d index] {what}",
              _expect(_kept_shards(xp, {1}, lambda d: d if d < 1 else d + 1), f"x[:, 2-d index] {what}"))
        rows, last = torch.randint(0, a, (3,), generator=g), torch.randint(0, c, (3,), generator=g)
        check(lambda x: x[rows, :, last], [(X, xp)], mesh, seed, g, f"x[rows, :, last] {what}",
              _expect(_kept_shards(xp, {0, 2}, lambda d: 1), f"x[rows, :, last] {what}"))
        check(lambda x: x[torch.arange(a) % 2 == 0], [(X, xp)], mesh, seed, g, f"x[bool mask] {what}")
        picked = torch.randint(0, a, (randint(g, 1, 5),), generator=g)
        check(lambda x, v: x.index_put((picked,), v, accumulate=True), [(X, xp), (rand(g, len(picked), b, c), yp)],
              mesh, seed, g, f"index_put accumulate {what}",
              _expect(_kept_shards([Replicate() if isinstance(p, Partial) else p for p in xp], {0}, lambda d: d),
                      f"index_put {what}"))
        distinct = torch.randperm(b, generator=g)[:randint(g, 1, b + 1)].tolist()  # no repeats: exact
        values = rand(g, a, len(distinct), c)

        def assign(x, v):
            y = x * 2.0
            y[:, distinct] = v
            return y
        check(assign, [(X, xp), (values, yp)], mesh, seed, g, f"y[:, {distinct}] = v {what}")
    return True


@pytest.mark.parametrize("mesh_name", list(MESHES))
def test_joins_and_splits(mesh_name, seed):
    world = WORLD[mesh_name]
    assert run_on_ranks(_joins_and_splits, world, args=(mesh_name, seed)) == [True] * world


@pytest.mark.parametrize("mesh_name", list(MESHES))
def test_selections(mesh_name, seed):
    world = WORLD[mesh_name]
    assert run_on_ranks(_selections, world, args=(mesh_name, seed)) == [True] * world


def _lookups_and_rotations(rank, world_size, mesh_name, seed):
    """narrow_copy, rot90, linalg.cross, prelu, bucketize / searchsorted / isin against the plain op
    (forward and backward), each by its rule: no gather fallback."""
    import torch.nn.functional as F

    from axedist.dtensor import DTensor

    fallbacks = DTensor.dispatcher.cache_info()["fallbacks"]
    mesh = mesh_of(mesh_name)
    g = torch.Generator().manual_seed(seed)
    a, b, c = randint(g, 1, 7), 3, randint(g, 1, 6)
    X, Y = rand(g, a, b, c), rand(g, a, b, c)
    R = [Replicate()] * mesh.ndim
    for xp in sample_sets(mesh, [Shard(0), Shard(1), Shard(2), Replicate(), Partial()], g):
        what = f"seed {seed}, mesh {mesh_name}, shape {(a, b, c)}, x {xp}"
        start = randint(g, 0, c)
        length = randint(g, 0, c - start + 1)
        check(lambda x: x.narrow_copy(2, start, length), [(X, xp)], mesh, seed, g, f"narrow_copy {what}")
        check(lambda x: x.narrow_copy(0, 0, a), [(X, xp)], mesh, seed, g, f"narrow_copy whole {what}",
              _expect(_kept_shards(xp, set(), lambda d: d), f"narrow_copy whole {what}"))
        k = randint(g, -3, 5)
        check(lambda x: x.rot90(k, [0, 2]), [(X, xp)], mesh, seed, g, f"rot90 {k} {what}",
              _expect(_kept_shards(xp, {0, 2} if k % 4 else set(), lambda d: d), f"rot90 {what}"))
        check(lambda x, y: torch.linalg.cross(x, y, dim=1), [(X, xp), (Y, xp)], mesh, seed, g, f"cross {what}")
        for w in (rand(g, b), rand(g, 1)):
            check(lambda x, s: F.prelu(x, s), [(X, xp), (w, R)], mesh, seed, g, f"prelu {tuple(w.shape)} {what}")
        edges = torch.sort(rand(g, randint(g, 1, 8)))[0]
        check(lambda x, e: torch.bucketize(x, e, right=True), [(X, xp), (edges, R)], mesh, seed, g,
              f"bucketize {what}", backward=False)
        check(lambda e, x: torch.searchsorted(e, x), [(edges, R), (X, xp)], mesh, seed, g,
              f"searchsorted {what}", backward=False)
        ints = torch.randint(0, 5, (a, b, c), generator=g).double()
        check(lambda x, t: torch.isin(x, t), [(ints, xp), (torch.tensor([1.0, 3.0]), R)], mesh, seed, g,
              f"isin {what}", backward=False)
        # plain tables (the same on every rank) next to a DTensor, as a user writes them
        check(lambda x: torch.isin(x, torch.tensor([1.0, 3.0])), [(ints, xp)], mesh, seed, g,
              f"isin plain {what}", backward=False)
        check(lambda x: torch.bucketize(x, edges), [(X, xp)], mesh, seed, g, f"bucketize plain {what}",
              backward=False)
    assert DTensor.dispatcher.cache_info()["fallbacks"] == fallbacks, DTensor.dispatcher.fallback_ops()
    return True


@pytest.mark.parametrize("mesh_name", list(MESHES))
def test_lookups_and_rotations(mesh_name, seed):
    world = WORLD[mesh_name]
    assert run_on_ranks(_lookups_and_rotations, world, args=(mesh_name, seed)) == [True] * world


def _no_needless_gather(rank, world_size):
    """Exact placements of the common cases (4 ranks, uneven shapes)."""
    mesh = mesh_of("4")
    g = torch.Generator().manual_seed(1)
    X = make(rand(g, 10, 6), mesh, [Shard(0)], 0)
    Y = make(rand(g, 10, 3), mesh, [Replicate()], 0)
    assert torch.cat([X, Y], 1).placements == (Shard(0),)
    assert torch.stack([X, X], 0).placements == (Shard(1),)
    assert [t.placements for t in X.split(4, 1)] == [(Shard(0),)] * 2
    assert X[:, 2].placements == (Shard(0),)
    assert X[:, 1:3].placements == (Shard(0),)
    assert X[1:3].placements == (Replicate(),)
    assert X.unbind(1)[0].placements == (Shard(0),)
    P = make(rand(g, 10, 6), mesh, [Partial()], 0)
    assert P[:, 1:3].placements == (Partial(),)
    assert P[3].placements == (Partial(),)
    assert torch.cat([P, P], 0).placements == (Partial(),)
    idx = make(torch.tensor([4, 0, 0, 5, 1]), mesh, [Shard(0)], 0)
    R = make(rand(g, 10, 6), mesh, [Replicate()], 0)
    assert R.index_select(1, idx).placements == (Shard(1),)
    assert X[:, [1, 3, 3]].placements == (Shard(0),)  # a plain list: no gather of X
    assert X[:, torch.tensor([[0, 5], [2, 2]])].placements == (Shard(0),)
    assert X[[1, 3]].placements == (Replicate(),)     # the sharded dim indexed: gathered first
    assert P[:, [0, 2]].placements == (Partial(),)
    return True


def test_no_needless_gather():
    assert run_on_ranks(_no_needless_gather, 4) == [True] * 4


def _index_differs(rank, world_size):
    from axedist.ops import DispatchError

    mesh = mesh_of("4")
    X = make(torch.arange(24.0).reshape(4, 6), mesh, [Shard(0)], 0)
    try:
        X[:, [rank % 2]]
    except DispatchError as e:
        return "same on every rank" in str(e) and "differs" in str(e)
    return False


def test_a_plain_index_that_differs_across_ranks_is_refused_on_every_rank():
    assert run_on_ranks(_index_differs, 4) == [True] * 4


def _random_summands(full, mesh, g):
    """``full`` as a pending sum over every mesh axis, each rank a summand of fresh random values
    (not exact in binary: reduced along different routes, the sums differ in the last bit)."""
    from axedist.dtensor import DTensor

    k = mesh.size()
    noise = torch.randn((k - 1,) + tuple(full.shape), generator=g, dtype=full.dtype) * 3
    summands = torch.cat([noise, (full - noise.sum(0)).unsqueeze(0)])
    mine = 0
    for name, n in zip(mesh.axis_names, mesh.shape):
        mine = mine * n + mesh.coordinates()[name]
    return DTensor.from_local(summands[mine].contiguous(), mesh, [Partial()] * mesh.ndim).detach().requires_grad_()


def _scatter_reduce_of_a_pending_sum(rank, world_size, mesh_name, seed):
    """scatter_reduce "amax"/"amin" of a pending sum (src or self) is refused with a clear error
    (its gradient would compare the pending value, reduced along another route, with the result:
    NaN); reduced first as the error says, values and gradients equal the plain op's (no NaN);
    the reductions whose gradient compares nothing ("sum", "mean", "prod") keep taking it."""
    from axedist.ops import DispatchError

    mesh = mesh_of(mesh_name)
    g = torch.Generator().manual_seed(seed)
    everywhere = [Replicate()] * mesh.ndim
    x_full, src_full = rand(g, 8, 6), rand(g, 64, 6)
    index_full = torch.randint(0, 8, (64, 6), generator=g)
    x_places = [Shard(1)] + [Replicate()] * (mesh.ndim - 1)
    index_places = [Shard(0)] + ([Shard(1)] if mesh.ndim > 1 else [])
    index = make(index_full, mesh, index_places, seed)
    for reduce in ("amax", "amin"):
        x = make(x_full, mesh, x_places, seed, requires_grad=True)
        src = _random_summands(src_full, mesh, g)
        for what, args in (("src", (x, src)), ("self", (_random_summands(x_full, mesh, g), make(src_full, mesh, everywhere, seed)))):
            with pytest.raises(DispatchError, match="reduce it first"):
                args[0].scatter_reduce(0, index, args[1], reduce)
        out = x.scatter_reduce(0, index, src.redistribute(placements=everywhere), reduce)
        x_ref, src_ref = x_full.clone().requires_grad_(), src.detach().full_tensor().requires_grad_()
        ref = x_ref.scatter_reduce(0, index_full, src_ref, reduce)
        grad = rand(g, *ref.shape)
        torch.autograd.backward(out, make(grad, mesh, everywhere, seed))
        ref.backward(grad)
        torch.testing.assert_close(out.full_tensor(), ref, msg=lambda m: f"{reduce}: {m}")
        for got, want in ((x.grad, x_ref.grad), (src.grad, src_ref.grad)):
            assert not got.full_tensor().isnan().any(), f"{reduce}: NaN gradient"
            torch.testing.assert_close(got.full_tensor(), want, msg=lambda m: f"{reduce} gradient: {m}")
    for reduce in ("sum", "mean", "prod"):
        check(lambda x, s: x.scatter_reduce(0, index_full, s, reduce),
              [(x_full, x_places), (src_full, [Partial()] * mesh.ndim)], mesh, seed, g, f"scatter_reduce {reduce}")
    return True


@pytest.mark.parametrize("mesh_name", ["4", "2x2"])
def test_scatter_reduce_amax_of_a_pending_sum_is_refused(mesh_name):
    world = WORLD[mesh_name]
    assert run_on_ranks(_scatter_reduce_of_a_pending_sum, world,
                        args=(mesh_name, int(torch.randint(0, 10**6, (1,))))) == [True] * world
