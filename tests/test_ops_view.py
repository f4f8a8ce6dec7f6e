"""View ops on DTensors: values, gradients, and that a view moves no data where the layout allows."""

import random

import pytest
import torch
from torch.distributed.tensor import Partial, Replicate, Shard

from axedist.dtensor import DTensor, distribute
from axedist.mesh import DeviceMesh
from axedist.testing import run_on_ranks


def _views(rank, world, seed):
    mesh = DeviceMesh("cpu", (world,))
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(2, 4 * world, 6, generator=g, dtype=torch.float64, requires_grad=True)
    dx = distribute(x, mesh, [Shard(1)])
    flat = dx.view(-1, 6)                 # (B*S, 6) of a sequence-sharded tensor: a layout, no data moved
    assert flat.to_local().data_ptr() == dx.to_local().data_ptr() and flat.to_local().shape == (8, 6)
    assert str(flat.axe_layout) == f"S[(2,{world},4,6):(24,1@gpuid,6,1)]", flat.axe_layout
    moved = torch.tanh(flat) * 2          # elementwise keeps the layout
    assert moved.axe_layout == flat.axe_layout
    back = moved.view(2, 4 * world, 6)
    assert back.placements == (Shard(1),)
    assert torch.allclose(back.full_tensor(), torch.tanh(x) * 2)
    gx, = torch.autograd.grad(back.full_tensor().pow(2).sum(), (x,))
    wx, = torch.autograd.grad((torch.tanh(x) * 2).pow(2).sum(), (x,))
    assert torch.allclose(gx, wx)
    # uneven dims, transposes, permutes, unsqueeze/squeeze, expand, flatten/unflatten
    y = torch.randn(5, 3, 7, generator=g, dtype=torch.float64)
    for p in ([Shard(0)], [Shard(1)], [Shard(2)], [Replicate()]):
        dy = distribute(y, mesh, p)
        cases = {
            "t": (dy.transpose(0, 2), y.transpose(0, 2)), "permute": (dy.permute(2, 0, 1), y.permute(2, 0, 1)),
            "unsqueeze": (dy.unsqueeze(1).squeeze(1), y), "flatten": (dy.flatten(1), y.flatten(1)),
            "reshape": (dy.reshape(15, 7), y.reshape(15, 7)), "expand": (dy.unsqueeze(0).expand(2, 5, 3, 7), y.unsqueeze(0).expand(2, 5, 3, 7)),
            "expand-row": (dy[:1].expand(4, 3, 7), y[:1].expand(4, 3, 7)),
            "unflatten": (dy.flatten(1).unflatten(1, (3, 7)), y),
        }
        for name, (got, want) in cases.items():
            assert torch.equal(got.full_tensor(), want), (name, p)
        if p == [Shard(0)]:
            assert dy.permute(2, 0, 1).placements == (Shard(1),)
    # a partial sum stays pending through views
    q = DTensor.from_local(torch.randn(4, 6, generator=torch.Generator().manual_seed(seed + rank),
                                       dtype=torch.float64), mesh, [Partial()])
    full_q = sum(torch.randn(4, 6, generator=torch.Generator().manual_seed(seed + r), dtype=torch.float64)
                 for r in range(world))
    assert q.view(24).placements == (Partial(),) and torch.allclose(q.t().full_tensor(), full_q.t())
    return True


@pytest.mark.parametrize("world", [2, 4])
def test_views(world):
    run_on_ranks(_views, world, args=(random.randrange(10**6),))


def _writes_through_views(rank, world, seed):
    """In-place writes through views: where the view op keeps the data where it is (a diagonal of
    whole matrices, by placements or by a layout with no placement form; a slice of a whole dim)
    the write reaches the base, as torch's; where it had to move its input first (the diagonal of
    a row-sharded matrix gathers it), the write is refused on every rank (it would change a copy:
    before, the base silently kept its old values), through a view of that view too, by mul_,
    copy_ and an out= op, and through a conjugate view (whose values are computed); reading
    such a view is fine."""
    from axedist.layout import Layout
    from axedist.ops import DispatchError

    mesh = DeviceMesh("cpu", (world,))
    g = torch.Generator().manual_seed(seed)
    a = torch.randn(2 * world, 3, 3, generator=g, dtype=torch.float64)
    dealt = Layout.parse(f"S[(2,{world},3,3):(9,1@gpuid,3,1)]")
    outcomes = {}
    for label, where in [("batch shards", [Shard(0)]), ("matrices dealt by a layout", dealt)]:
        x = distribute(a.clone(), mesh, where)
        x.diagonal(0, 1, 2).mul_(0.5)
        want = a.clone()
        want.diagonal(0, 1, 2).mul_(0.5)
        outcomes[label] = bool(torch.equal(x.full_tensor(), want))
    x = distribute(a.clone(), mesh, [Shard(1)])
    x[:, :, 1:].mul_(2.0)                  # a slice of a whole dim: no move, the base changes
    want = a.clone()
    want[:, :, 1:].mul_(2.0)
    outcomes["slice of a whole dim"] = bool(torch.equal(x.full_tensor(), want))
    writes = {"mul_": lambda v: v.mul_(0.5), "copy_": lambda v: v.copy_(v.detach() + 1),
              "out=": lambda v: torch.add(v, 1.0, out=v),
              "a view of the view": lambda v: v.unsqueeze(0).mul_(0.5)}
    for name, write in writes.items():
        x = distribute(a.clone(), mesh, [Shard(1)])
        view = x.diagonal(0, 1, 2)         # rows sharded: gathered first, a view of a copy
        assert torch.equal(view.full_tensor(), a.diagonal(0, 1, 2))
        try:
            write(view)
            outcomes[name] = "no error"
        except DispatchError as error:
            outcomes[name] = "refused" if "would change a copy" in str(error) else str(error)
        assert torch.equal(x.full_tensor(), a)
    z = torch.randn(2 * world, 3, generator=g, dtype=torch.complex128)
    zd = distribute(z, mesh, [Shard(0)])
    try:  # torch's conjugate view writes through; ours holds its own values (no conjugate bit)
        zd.conj().mul_(2.0)
        outcomes["conjugate view"] = "no error"
    except DispatchError as error:
        outcomes["conjugate view"] = "refused" if "would change a copy" in str(error) else str(error)
    assert torch.equal(zd.full_tensor(), z)
    return outcomes


def _views_under_inference_mode(rank, world, seed):
    """Under inference_mode the fast path serves views (no autograd view tracking there): a served
    slice still writes to its base, a served index still reads the base's later writes, and a view
    of a view of a copy is one too (a write to it refused), as on the normal route."""
    from axedist.ops import DispatchError

    fast = DTensor.dispatcher.fastpath
    mesh = DeviceMesh("cpu", (world,))
    g = torch.Generator().manual_seed(seed)
    a = torch.randn(2 * world, 3, 3, generator=g, dtype=torch.float64)
    out = {}
    with torch.inference_mode():
        x = distribute(a.clone(), mesh, [Shard(1)])
        before = fast.stats()["hits"]
        for _ in range(3):  # recorded, then served
            x[:, :, 1:]
        x[:, :, 1:].mul_(2.0)
        want = a.clone()
        want[:, :, 1:].mul_(2.0)
        out["slice served"] = fast.stats()["hits"] - before >= 3
        out["slice writes to the base"] = bool(torch.equal(x.full_tensor(), want))
        y = distribute(a.clone(), mesh, [Shard(0)])
        for _ in range(3):
            v = y[:, 1]
        y.add_(1.0)
        out["the view reads the base's write"] = bool(torch.equal(v.full_tensor(), a[:, 1] + 1))
        for _ in range(2):  # the view of a copied view: recorded, then served
            distribute(a.clone(), mesh, [Shard(1)]).diagonal(0, 1, 2).unsqueeze(0)
        z = distribute(a.clone(), mesh, [Shard(1)])
        before = fast.stats()["hits"]
        twice = z.diagonal(0, 1, 2).unsqueeze(0)  # rows sharded: the diagonal gathers, a view of a copy
        out["view of the copy served"] = fast.stats()["hits"] - before == 1
        try:
            twice.mul_(0.5)
            out["write to it"] = "no error"
        except DispatchError as error:
            out["write to it"] = "refused" if "would change a copy" in str(error) else str(error)
        out["base kept"] = bool(torch.equal(z.full_tensor(), a))
        # a tuple of views (chunk): served; a write through a piece reaches the base, through a
        # piece of a copied view it is refused
        for _ in range(2):
            distribute(a.clone(), mesh, [Shard(0)]).chunk(3, dim=-1)
            distribute(a.clone(), mesh, [Shard(1)]).diagonal(0, 1, 2).chunk(3, dim=-1)
        w = distribute(a.clone(), mesh, [Shard(0)])
        before = fast.stats()["hits"]
        w.chunk(3, dim=-1)[1].mul_(2.0)
        want = a.clone()
        want[:, :, 1].mul_(2.0)
        out["chunk writes to the base"] = bool(torch.equal(w.full_tensor(), want))
        pieces = z.diagonal(0, 1, 2).chunk(3, dim=-1)
        out["chunks served"] = fast.stats()["hits"] - before == 2
        try:
            pieces[0].mul_(0.5)
            out["write to a chunk of the copy"] = "no error"
        except DispatchError as error:
            out["write to a chunk of the copy"] = "refused" if "would change a copy" in str(error) else str(error)
        out["base kept after the chunk"] = bool(torch.equal(z.full_tensor(), a))
    return out


def test_views_under_inference_mode_write_and_read_like_the_normal_route(seed):
    want = {"slice served": True, "slice writes to the base": True, "the view reads the base's write": True,
            "view of the copy served": True, "write to it": "refused", "base kept": True,
            "chunk writes to the base": True, "chunks served": True, "write to a chunk of the copy": "refused",
            "base kept after the chunk": True}
    assert run_on_ranks(_views_under_inference_mode, 2, args=(seed,)) == [want] * 2


def test_writes_through_a_view_reach_the_base_or_are_refused(seed):
    want = {"batch shards": True, "matrices dealt by a layout": True, "slice of a whole dim": True,
            "mul_": "refused", "copy_": "refused", "out=": "refused", "a view of the view": "refused",
            "conjugate view": "refused"}
    assert run_on_ranks(_writes_through_views, 2, args=(seed,)) == [want] * 2
