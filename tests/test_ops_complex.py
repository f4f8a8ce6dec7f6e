"""Complex DTensors: the conjugate / negative bits and the complex <-> real views (ops/complex.py).

``zd.conj()`` once gave a DTensor whose wrapper said ``is_conj() == False`` over a local tensor
marked conjugate; the next op that moved data read raw memory and dropped the bit, so RoPE's
backward (``grad * freqs.conj()``) came out with the wrong sign. Now no local tensor of a
DTensor carries a bit (values are computed), the views have rules (no gather), and the fast
routes never serve such an op. Checked on 2 and 4 ranks against one process, calls repeated
so cached routes run too.
"""

import random

import pytest
import torch
from torch.distributed.tensor import Partial, Replicate, Shard

from axedist.dtensor import DTensor, distribute
from axedist.mesh import DeviceMesh
from axedist.testing import run_on_ranks
from tests.ops_cases import make

TOL = dict(rtol=1e-12, atol=1e-12)


def _bits(rank, world, seed):
    mesh = DeviceMesh("cpu", (world,))
    g = torch.Generator().manual_seed(seed)
    z = torch.randn(6, 3, dtype=torch.complex128, generator=g)
    w = torch.randn(6, 3, dtype=torch.complex128, generator=g)
    zd, wd = distribute(z, mesh, [Shard(0)]), distribute(w, mesh, [Replicate()])
    DTensor.dispatcher.forget_fallbacks()
    for _ in range(3):  # the first call plans; later ones take the cached routes
        c = zd.conj()
        assert not c.is_conj() and not c.to_local().is_conj() and c.placements == (Shard(0),)
        torch.testing.assert_close(c.full_tensor(), z.conj(), **TOL)
        torch.testing.assert_close((zd.conj() * wd).full_tensor(), z.conj() * w, **TOL)
        torch.testing.assert_close((zd.conj() * 2.0).redistribute([Shard(1)]).full_tensor(), z.conj() * 2, **TOL)
        imag = zd.conj().imag       # a negative view in torch
        assert not imag.is_neg() and not imag.to_local().is_neg()
        torch.testing.assert_close(imag.full_tensor(), -z.imag, **TOL)
        # torch refuses view_as_real of an unresolved conjugate; a DTensor's values are resolved
        torch.testing.assert_close(torch.view_as_real(zd.conj()).full_tensor(), torch.view_as_real(z.conj().resolve_conj()),
                                   **TOL)
    # a local tensor that arrives marked is materialized: the wrapper never says otherwise
    piece = z.chunk(world)[rank] if rank < len(z.chunk(world)) else z[:0]
    made = DTensor.from_local(piece.conj(), mesh, [Shard(0)], shape=z.shape)
    assert not made.to_local().is_conj()
    torch.testing.assert_close(made.full_tensor(), z.conj(), **TOL)
    assert not {str(op) for op in DTensor.dispatcher.fallback_ops()} & {"aten._conj.default", "aten._neg_view.default",
                                                                        "aten.view_as_real.default",
                                                                        "aten.view_as_complex.default"}
    return True


def _views(rank, world, seed):
    mesh = DeviceMesh("cpu", (world,))
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(5, 4, 2, dtype=torch.float64, generator=g)     # 5 rows: uneven on 2 and 4 ranks
    for placements, out in (([Shard(0)], (Shard(0),)), ([Shard(1)], (Shard(1),)), ([Shard(2)], (Replicate(),)),
                            ([Partial()], (Partial(),))):
        xd = make(x, mesh, placements, seed)
        z = torch.view_as_complex(xd)
        assert z.placements == out, (placements, z.placements)
        torch.testing.assert_close(z.full_tensor(), torch.view_as_complex(x), **TOL)
        back = torch.view_as_real(z)
        assert back.placements == out
        torch.testing.assert_close(back.full_tensor(), x, **TOL)
    return True


def _rope_backward(rank, world, seed):
    """torchtitan's RoPE on a head-sharded DTensor: forward and the gradient of x."""
    mesh = DeviceMesh("cpu", (world,))
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(2, 4, 8, 6, dtype=torch.float64, generator=g)       # [B, S, heads, head_dim]
    freqs = torch.polar(torch.ones(4, 3, dtype=torch.float64), torch.randn(4, 3, dtype=torch.float64, generator=g))
    grad = torch.randn(2, 4, 8, 6, dtype=torch.float64, generator=g)

    def rope(t, f):
        tc = torch.view_as_complex(t.reshape(*t.shape[:-1], -1, 2))
        return torch.view_as_real(tc * f.view(1, 4, 1, 3)).flatten(3)

    ref = x.clone().requires_grad_()
    rope(ref, freqs).backward(grad)
    for _ in range(2):
        xd = distribute(x, mesh, [Shard(2)]).requires_grad_()
        y = rope(xd, distribute(freqs, mesh, [Replicate()]))
        assert y.placements == (Shard(2),)
        y.backward(distribute(grad, mesh, [Shard(2)]))
        torch.testing.assert_close(y.full_tensor(), rope(x, freqs), **TOL)
        torch.testing.assert_close(xd.grad.full_tensor(), ref.grad, **TOL)
    return True


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("body", [_bits, _views, _rope_backward], ids=["bits", "views", "rope_backward"])
def test_complex(world, body):
    assert run_on_ranks(body, world, args=(random.randrange(2**31),)) == [True] * world
