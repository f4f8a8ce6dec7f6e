"""In-place ops on pending values, prod's backward and fused optimizer steps on CUDA with NCCL.

Run on 2+ GPUs: ``pytest tests_multigpu/test_ops_pending_nccl.py -q`` (W = every GPU, and 2).
On CPU, tests/test_ops_{pointwise,reduction,core}.py cover the same code; here the local
tensors are CUDA tensors, the pending reductions NCCL all-reduces, the constant that prod's
backward makes a CUDA tensor, and AdamW(fused=True) the CUDA fused kernel. Every result is
compared with the same code on the whole tensors (fp64 where the kernel allows, else fp32).
"""

import pytest
import torch
from torch.distributed.tensor import Partial, Replicate, Shard

from axedist.dtensor import DTensor, distribute
from axedist.mesh import DeviceMesh
from axedist.testing import run_on_ranks

GPUS = torch.cuda.device_count()
WORLDS = sorted({2, GPUS}) if GPUS >= 2 else []
pytestmark = pytest.mark.skipif(GPUS < 2, reason="needs 2 or more CUDA GPUs")


def _pending_sum(full, mesh, rank, world, seed):
    """``full`` as a Partial sum: random summands on every rank, the rest on rank 0."""
    g = torch.Generator().manual_seed(seed)
    noise = torch.randn((world,) + tuple(full.shape), generator=g, dtype=full.dtype)
    local = noise[rank] + (full.cpu() - noise.sum(0) if rank == 0 else 0)
    return DTensor.from_local(local.to("cuda").contiguous(), mesh, [Partial()])


def _inplace_and_prod(rank, world, seed):
    mesh = DeviceMesh("cuda", (world,))
    g = torch.Generator().manual_seed(seed)
    X = torch.randn(5, 2 * world + 1, generator=g, dtype=torch.float64)
    M = torch.rand(X.shape, generator=g) > 0.5
    mask = distribute(M.cuda(), mesh, [Replicate()])
    cases = [("add_", lambda t, m: t.add_(0.5), (Partial(),)), ("masked_fill_", lambda t, m: t.masked_fill_(m, 2.0),
                                                                 (Partial(),)),
             ("exp_", lambda t, m: t.exp_(), (Replicate(),))]
    for name, fn, placements in cases:
        p = _pending_sum(X, mesh, rank, world, seed)
        fn(p, mask)
        assert p.placements == placements, (name, p.placements)
        torch.testing.assert_close(p.full_tensor().cpu(), fn(X.clone(), M), msg=name)
    # rms_norm's CPU decomposition over a sharded hidden dim (here forced: CUDA picks the fused op)
    x = distribute(X.cuda(), mesh, [Shard(1)]).requires_grad_()
    ref = X.clone().requires_grad_()
    for t in (x, ref):
        (t * t.pow(2).mean(-1, keepdim=True).add_(1e-6).rsqrt()).sum().backward()
    torch.testing.assert_close(x.grad.full_tensor().cpu(), ref.grad)
    # prod over a sharded dim, zeros included, forward and backward
    Z = X.masked_fill(torch.rand(X.shape, generator=g) < 0.2, 0.0)
    for dim in (0, 1):
        z = distribute(Z.cuda(), mesh, [Shard(1)]).requires_grad_()
        ref = Z.clone().requires_grad_()
        G = torch.randn(ref.prod(dim).shape, generator=g, dtype=torch.float64)
        out = z.prod(dim)
        out.backward(distribute(G.cuda(), mesh, [Replicate()]))
        ref.prod(dim).backward(G)
        torch.testing.assert_close(out.full_tensor().cpu(), Z.prod(dim))
        torch.testing.assert_close(z.grad.full_tensor().cpu(), ref.grad)
    return True


@pytest.mark.parametrize("world", WORLDS)
def test_inplace_on_pending_and_prod_backward_cuda(world):
    assert run_on_ranks(_inplace_and_prod, world, args=(7,), backend="nccl") == [True] * world


def _fused_adamw(rank, world, seed):
    fallback_ops = DTensor.dispatcher.fallback_ops
    mesh = DeviceMesh("cuda", (world,))
    g = torch.Generator().manual_seed(seed)
    shapes, places = [(4 * world + 2, 8), (8,)], [[Shard(0)], [Replicate()]]
    fulls = [torch.randn(s, generator=g) for s in shapes]
    grads = [torch.randn(s, generator=g) for s in shapes]
    params = [distribute(f.cuda(), mesh, p).requires_grad_() for f, p in zip(fulls, places)]
    plain = [f.cuda().requires_grad_() for f in fulls]
    opt = torch.optim.AdamW(params, lr=0.1, weight_decay=0.1, fused=True)
    ref = torch.optim.AdamW(plain, lr=0.1, weight_decay=0.1, fused=True)
    for _ in range(2):
        params[0].grad = distribute(grads[0].cuda(), mesh, [Shard(0)])
        params[1].grad = _pending_sum(grads[1], mesh, rank, world, seed)  # a sequence-parallel norm weight's
        for p, q in zip(plain, grads):
            p.grad = q.cuda()
        opt.step()
        ref.step()
    for p, q in zip(params, plain):
        torch.testing.assert_close(p.detach().full_tensor(), q.detach())
    return sorted(str(op) for op in fallback_ops() if "fused" in str(op))


@pytest.mark.parametrize("world", WORLDS)
def test_fused_adamw_cuda(world):
    assert run_on_ranks(_fused_adamw, world, args=(3,), backend="nccl") == [[]] * world
