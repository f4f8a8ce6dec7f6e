"""Random ops over DTensors (ops/random.py): the same values as the unsharded op, same seed.

For each op and layout (sharded on either dim, uneven, nested on a 2x2 mesh, replicated, a
pending sum, a block-cyclic layout with no placement form): seed, run the op on the DTensor;
seed again, run it on a plain tensor of the global shape. The DTensor's ``full_tensor()``
must equal the plain result exactly, and the generator must be left in the same state (the
next draw agrees), on every rank.
"""

import itertools

import pytest
import torch
import torch.nn.functional as F
from torch.distributed.tensor import Partial, Replicate, Shard

from axedist.dtensor import DTensor, distribute
from axedist.layout import Layout
from axedist.mesh import DeviceMesh
from axedist.testing import run_on_ranks

fallback_ops = DTensor.dispatcher.fallback_ops
from tests.ops_cases import MESHES

aten = torch.ops.aten

# name -> (op on a tensor x of the global shape, whether it writes x in place)
OPS = {
    "uniform_": lambda x: x.uniform_(-2, 3),
    "normal_": lambda x: x.normal_(1.5, 0.5),
    "bernoulli_": lambda x: x.bernoulli_(0.3),
    "random_": lambda x: x.random_(0, 10),
    "exponential_": lambda x: x.exponential_(2.0),
    "rand_like": torch.rand_like,
    "randn_like": torch.randn_like,
    "randint_like": lambda x: torch.randint_like(x, 3, 9),
    "bernoulli_p": lambda x: torch.bernoulli(x, 0.4),
}


def _no_gathered_random_ops():
    """The random ops ran through their rules, not the gather fallback (which would also give
    the right values, by moving whole tensors)."""
    words = ("uniform", "normal", "bernoulli", "random_", "exponential", "rand", "dropout")
    gathered = [str(op) for op in fallback_ops() if any(w in str(op) for w in words)]
    assert not gathered, gathered


def _same_seed(seed, fn, *args):
    torch.manual_seed(seed)
    out = fn(*args)
    return out, torch.rand(3, dtype=torch.float64)  # the generator's next draw


def _random_case(rank, world_size, mesh_name, seed):
    mesh = DeviceMesh("cpu", *MESHES[mesh_name])
    g = torch.Generator().manual_seed(seed)
    shape = tuple(int(v) for v in torch.randint(1, 8, (2,), generator=g))  # uneven on 2 and 4 ranks
    layouts = [list(p) for p in itertools.product([Shard(0), Shard(1), Replicate()], repeat=mesh.ndim)]
    checked = 0
    for (name, op), placements in itertools.product(OPS.items(), layouts):
        what = f"seed {seed}, {name}, shape {shape}, {placements}"
        want, after = _same_seed(seed, op, torch.zeros(shape, dtype=torch.float64))
        x = distribute(torch.zeros(shape, dtype=torch.float64), mesh, placements)
        got, after_here = _same_seed(seed, op, x)
        assert torch.equal(got.full_tensor(), want), what
        assert torch.equal(after_here, after), f"{what}: generators advanced differently"
        assert got.placements == tuple(placements), f"{what}: {got.placements}"
        checked += 1
    _no_gathered_random_ops()
    return checked


@pytest.mark.parametrize("mesh_name,world_size", [("2", 2), ("4", 4), ("2x2", 4)])
def test_random_ops_match_unsharded(mesh_name, world_size, seed):
    counts = run_on_ranks(_random_case, world_size, args=(mesh_name, seed))
    assert counts[0] == len(OPS) * 3 ** len(MESHES[mesh_name][0])


def _special_layouts_case(rank, world_size, seed):
    """A pending sum filled in place, a block-cyclic layout, an explicit generator, and
    the ops that read tensor arguments (bernoulli(p), normal(mean, std))."""
    mesh = DeviceMesh("cpu", (world_size,))
    shape = (6, 5)
    want, after = _same_seed(seed, lambda: torch.empty(shape, dtype=torch.float64).normal_())
    partial = DTensor.from_local(torch.full(shape, 7.0, dtype=torch.float64), mesh, [Partial("sum")])
    got, after_here = _same_seed(seed, lambda: partial.normal_())
    assert got.placements == (Partial("sum"),)
    assert torch.equal(got.full_tensor(), want) and torch.equal(after_here, after), "pending sum"

    cyclic = Layout.parse(f"S[(3,{world_size},{8 // world_size},5):(40//{world_size},1@gpuid,5,1)]".replace(
        f"40//{world_size}", str(40 // world_size)))
    want, after = _same_seed(seed, lambda: torch.empty(24, 5, dtype=torch.float64).uniform_())
    x = distribute(torch.zeros(24, 5, dtype=torch.float64), mesh, cyclic)
    got, after_here = _same_seed(seed, lambda: x.uniform_())
    assert got.axe_layout == cyclic
    assert torch.equal(got.full_tensor(), want) and torch.equal(after_here, after), "block-cyclic"

    generator = torch.Generator().manual_seed(seed + 1)
    want = torch.empty(shape).uniform_(generator=torch.Generator().manual_seed(seed + 1))
    got = distribute(torch.zeros(shape), mesh, [Shard(1)]).uniform_(generator=generator)
    assert torch.equal(got.full_tensor(), want), "explicit generator"

    p = torch.rand(shape, dtype=torch.float64, generator=torch.Generator().manual_seed(seed))
    mean, std = torch.randn(shape, dtype=torch.float64), torch.rand(shape, dtype=torch.float64) + 0.1
    for name, fn, args, placements in (
            ("bernoulli", torch.bernoulli, (p,), [Shard(0)]),
            ("normal", torch.normal, (mean, std), [Shard(1)])):
        want, after = _same_seed(seed, fn, *args)
        got, after_here = _same_seed(seed, fn, *(distribute(a, mesh, placements) for a in args))
        assert got.placements == tuple(placements), f"{name}: {got.placements}"
        assert torch.equal(got.full_tensor(), want) and torch.equal(after_here, after), name
    _no_gathered_random_ops()
    return True


@pytest.mark.parametrize("world_size", [2, 4])
def test_random_special_layouts(world_size):
    seed = int(torch.randint(0, 2**31 - 1, (1,)))
    assert all(run_on_ranks(_special_layouts_case, world_size, args=(seed,)))


def _dropout_case(rank, world_size, mesh_name, seed):
    mesh = DeviceMesh("cpu", *MESHES[mesh_name])
    g = torch.Generator().manual_seed(seed)
    shape = tuple(int(v) for v in torch.randint(1, 8, (3,), generator=g))
    x = torch.randn(shape, dtype=torch.float64, generator=g)
    grad = torch.randn(shape, dtype=torch.float64, generator=g)
    p = float(torch.rand(1, generator=g)) * 0.8
    checked = 0
    for placements in itertools.product([Shard(0), Shard(2), Replicate()], repeat=mesh.ndim):
        for name, fn in (("F.dropout", lambda t: F.dropout(t, p, training=True)),
                         ("native_dropout", lambda t: aten.native_dropout(t, p, True)[0])):
            reference = x.clone().requires_grad_()
            want, after = _same_seed(seed, fn, reference)
            want.backward(grad)
            dx = distribute(x, mesh, list(placements)).requires_grad_()
            got, after_here = _same_seed(seed, fn, dx)
            what = f"seed {seed}, {name}, shape {shape}, p {p:.3f}, {placements}"
            assert torch.equal(got.full_tensor(), want), what
            assert torch.equal(after_here, after), f"{what}: generators advanced differently"
            assert got.placements == tuple(placements), f"{what}: {got.placements}"
            got.backward(distribute(grad, mesh, list(placements)))
            torch.testing.assert_close(dx.grad.full_tensor(), reference.grad, msg=what)
            checked += 1
    _no_gathered_random_ops()
    return checked


@pytest.mark.parametrize("mesh_name,world_size", [("2", 2), ("4", 4), ("2x2", 4)])
def test_dropout_matches_unsharded(mesh_name, world_size, seed):
    counts = run_on_ranks(_dropout_case, world_size, args=(mesh_name, seed))
    assert counts[0] == 2 * 3 ** len(MESHES[mesh_name][0])
