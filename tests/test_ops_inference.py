"""Under ``torch.inference_mode`` composite ops (linear, rms_norm, chunk, sdpa) reach the
dispatcher undecomposed; they must run through their decompositions, never the gather fallback."""

import torch
import torch.nn.functional as F
from torch.distributed.tensor import Replicate, Shard

from axedist.dtensor import DTensor, distribute
from axedist.mesh import DeviceMesh
from axedist.testing import run_on_ranks

fallback_ops = DTensor.dispatcher.fallback_ops


def _body(rank, world, seed):
    mesh = DeviceMesh("cpu", (world,))
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(6, 8, generator=g, dtype=torch.float64)
    w = torch.randn(4 * world, 8, generator=g, dtype=torch.float64)
    q = torch.randn(1, 2 * world, 5, 4, generator=g, dtype=torch.float64)
    k, v = (torch.randn(q.shape, generator=g, dtype=torch.float64) for _ in range(2))
    before = set(fallback_ops())
    with torch.inference_mode():
        xd = distribute(x, mesh, [Replicate()])
        wd = distribute(w, mesh, [Shard(0)])
        y = F.linear(xd, wd)                                 # column-parallel: Shard(1) out
        z = F.rms_norm(xd, (8,), eps=1e-6)
        a, b = torch.chunk(y, 2, dim=0)
        heads = [distribute(t, mesh, [Shard(1)]) for t in (q, k, v)]
        o = F.scaled_dot_product_attention(*heads, is_causal=True)
        got = [y.full_tensor(), z.full_tensor(), a.full_tensor(), b.full_tensor(), o.full_tensor()]
        want = [x @ w.T, F.rms_norm(x, (8,), eps=1e-6), *torch.chunk(x @ w.T, 2, dim=0),
                F.scaled_dot_product_attention(q, k, v, is_causal=True)]
        placements = (tuple(y.placements), tuple(o.placements))
    ok = [bool(torch.allclose(g_, w_)) for g_, w_ in zip(got, want)]
    return ok, sorted(map(str, set(fallback_ops()) - before)), placements


def test_composite_ops_under_inference_mode_decompose():
    for world in (2, 4):
        for ok, fallbacks, placements in run_on_ranks(_body, world, args=(world,)):
            assert all(ok), ok
            assert fallbacks == [], fallbacks
            assert placements == ((Shard(1),), (Shard(1),)), placements


def _decomposition_body(rank, world, seed):
    """A linear / matmul of a 3-D input under inference_mode runs torch's C++ decomposition (the ops it
    calls come back through the dispatcher), never the Python ``matmul`` torch registers for tracing
    (several times slower a call on the host: the eager decode step's hot spot)."""
    dk = torch._C.DispatchKey.CompositeImplicitAutograd
    python_matmul = torch.ops.aten.matmul.default.py_kernels[dk]
    calls = []

    def counted(*args, **kwargs):
        calls.append(1)
        return python_matmul(*args, **kwargs)

    mesh = DeviceMesh("cpu", (world,))
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(3, 2, 8, generator=g, dtype=torch.float64)
    w = torch.randn(4 * world, 8, generator=g, dtype=torch.float64)
    torch.ops.aten.matmul.default.py_kernels[dk] = counted
    try:
        with torch.inference_mode():
            xd, wd = distribute(x, mesh, [Replicate()]), distribute(w, mesh, [Shard(0)])
            got = [F.linear(xd, wd).full_tensor(), torch.matmul(xd, wd.t()).full_tensor()]
    finally:
        torch.ops.aten.matmul.default.py_kernels[dk] = python_matmul
    return [bool(torch.allclose(t, x @ w.T)) for t in got], len(calls)


def test_inference_mode_decomposes_in_cpp():
    seed = int(torch.randint(0, 2**31 - 1, (1,)))
    for ok, python_calls in run_on_ranks(_decomposition_body, 2, args=(seed,)):
        assert ok == [True, True], seed
        assert python_calls == 0
