"""The fused GEMM + collective calls under autograd: gradients equal one process's.

``gemm_reduce_scatter``, ``all_gather_gemm`` and ``gemm_all_reduce`` on operands that require
grad, against the same products of every rank's operands on whole tensors. bf16 operands
hold small integers, so every product and sum is exact and results compare bit for bit. The
body runs here on gloo ranks (``backend="auto"``: the torch path on CPU) and,
from ``tests_multigpu/test_gemm_rs.py``, on GPUs with the fused kernels (``backend="p2p"``).
"""

import pytest
import torch

from axedist.testing import run_on_ranks


def _ints(g, *shape, device):
    return torch.randint(-2, 3, shape, generator=g).to(torch.bfloat16).to(device)


def grads_body(rank, world, device="cpu", backend="auto", seed=0):
    """Every rank's operands from one seed; each fused call's output and gradients against the
    whole product. Returns the names checked."""
    from axedist.collectives import all_gather_gemm, gemm_all_reduce, gemm_reduce_scatter

    g = torch.Generator().manual_seed(seed)
    m, k, n = 4 * world, 8, 8   # 16-byte rows: the GPU kernels' aligned paths
    a_all = [_ints(g, m, k, device=device) for _ in range(world)]
    b_all = [_ints(g, k, n, device=device) for _ in range(world)]
    checked = []

    def run(name, call, a, b, out_grad):
        a, b = a.clone().requires_grad_(), b.clone().requires_grad_()
        out = call(a, b)
        out.backward(out_grad)
        checked.append(name)
        return out, a.grad, b.grad

    def leaves(tensors):
        return [t.float().requires_grad_() for t in tensors]

    # gemm_reduce_scatter: rank r gets rows r of sum_q a_q @ b_q
    grad = _ints(g, m, n, device=device)
    a_ref, b_ref = leaves(a_all), leaves(b_all)
    whole = sum(a @ b for a, b in zip(a_ref, b_ref))
    whole.backward(grad.float())
    rows = slice(rank * (m // world), (rank + 1) * (m // world))
    out, ga, gb = run("gemm_reduce_scatter", lambda a, b: gemm_reduce_scatter(a, b, None, backend=backend),
                      a_all[rank], b_all[rank], grad[rows])
    torch.testing.assert_close(out.float(), whole[rows].detach(), rtol=0, atol=0)
    torch.testing.assert_close(ga.float(), a_ref[rank].grad, rtol=0, atol=0)
    torch.testing.assert_close(gb.float(), b_ref[rank].grad, rtol=0, atol=0)

    # gemm_all_reduce: every rank the whole sum; its gradient (the same on every rank) is each product's
    a_ref, b_ref = leaves(a_all), leaves(b_all)
    whole = sum(a @ b for a, b in zip(a_ref, b_ref))
    whole.backward(grad.float())
    out, ga, gb = run("gemm_all_reduce", lambda a, b: gemm_all_reduce(a, b, None, backend=backend),
                      a_all[rank], b_all[rank], grad)
    torch.testing.assert_close(out.float(), whole.detach(), rtol=0, atol=0)
    torch.testing.assert_close(ga.float(), a_ref[rank].grad, rtol=0, atol=0)
    torch.testing.assert_close(gb.float(), b_ref[rank].grad, rtol=0, atol=0)

    # all_gather_gemm: rows of x dealt to the ranks, columns of w split over them
    x = _ints(g, m, k, device=device)
    w = _ints(g, k, n * world, device=device)
    grad = _ints(g, m, n * world, device=device)
    x_ref, w_ref = x.float().requires_grad_(), w.float().requires_grad_()
    (x_ref @ w_ref).backward(grad.float())
    cols = slice(rank * n, (rank + 1) * n)
    out, ga, gb = run("all_gather_gemm", lambda a, b: all_gather_gemm(a, b, None, backend=backend),
                      x[rows], w[:, cols], grad[:, cols])
    torch.testing.assert_close(out.float(), (x.float() @ w.float())[:, cols], rtol=0, atol=0)
    torch.testing.assert_close(ga.float(), x_ref.grad[rows], rtol=0, atol=0)
    torch.testing.assert_close(gb.float(), w_ref.grad[:, cols], rtol=0, atol=0)

    # out=, timeout_s= and check= do not take part in autograd: refused rather than left without a gradient
    a = a_all[rank].clone().requires_grad_()
    with pytest.raises(ValueError, match="out=, timeout_s= and check= take no part in autograd"):
        gemm_reduce_scatter(a, b_all[rank], None, backend=backend, out=torch.empty(m // world, n, device=device,
                                                                                     dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="take no part in autograd"):
        all_gather_gemm(a, w[:, cols], None, backend=backend, check=True)
    return checked


@pytest.mark.parametrize("world", [2, 4])
def test_fused_calls_have_gradients(world):
    names = ["gemm_reduce_scatter", "gemm_all_reduce", "all_gather_gemm"]
    assert run_on_ranks(grads_body, world, args=("cpu", "auto", world)) == [names] * world
