"""out= of the fused GEMM + collective calls on the torch path (CPU, gloo ranks): the product is
written into the given tensor, given in the product's shape or with its rows flattened
([rows, N], as the fused kernels take it), and the call returns that tensor in the product's
shape, equal bit for bit to the product of every rank's operands (bf16 small integers: exact);
an out whose rows are a slice of a wider buffer (unit column stride) is written in place.
An out of another shape (even with as many elements) or dtype is refused on the rank given it,
after the call's collective: where only rank 0 is given a bad one, it raises and its peers get
their products (nobody is left waiting in a collective). At W = 1 gemm_reduce_scatter used to
return a fresh product and leave out unwritten.
"""

import pytest
import torch

from axedist.testing import run_on_ranks


def _ints(g, *shape):
    return torch.randint(-2, 3, shape, generator=g).to(torch.bfloat16)


def out_body(rank, world):
    """Each call with out in both accepted forms, then with bad ones. Returns the cases run."""
    from axedist.collectives import all_gather_gemm, gemm_all_reduce, gemm_reduce_scatter

    g = torch.Generator().manual_seed(11)
    k, n = 8, 8
    cases = []

    def check(name, call, expected, shapes):
        for shape in shapes:
            out = torch.full(shape, float("nan"), dtype=torch.bfloat16)
            result = call(out)
            assert result.data_ptr() == out.data_ptr(), (name, shape)
            assert result.shape == expected.shape, (name, shape, result.shape)
            torch.testing.assert_close(result.float(), expected, rtol=0, atol=0)
            torch.testing.assert_close(out.reshape(expected.shape).float(), expected, rtol=0, atol=0)
            cases.append((name, tuple(shape)))
        rows = expected.numel() // expected.shape[-1]
        # rows not contiguous (a slice of a wider buffer): unit column stride is all out needs
        wide = torch.full((rows, 2 * expected.shape[-1]), float("nan"), dtype=torch.bfloat16)
        strided = wide[:, :expected.shape[-1]]
        result = call(strided)
        assert result.data_ptr() == wide.data_ptr() and result.shape == expected.shape, name
        torch.testing.assert_close(result.float(), expected, rtol=0, atol=0)
        assert wide[:, expected.shape[-1]:].isnan().all(), name
        cases.append((name, "rows strided"))
        for bad in (torch.empty(expected.shape[-1], rows, dtype=torch.bfloat16),
                    torch.empty(expected.shape, dtype=torch.float32)):
            with pytest.raises(ValueError, match=f"{name.split()[0]}: out must be"):
                call(bad)
        # ranks that disagree: only rank 0's out is bad
        if rank == 0:
            with pytest.raises(ValueError, match=f"{name.split()[0]}: out must be"):
                call(torch.empty(expected.shape, dtype=torch.float32))
        else:
            result = call(torch.empty(expected.shape, dtype=torch.bfloat16))
            torch.testing.assert_close(result.float(), expected, rtol=0, atol=0)

    # gemm_reduce_scatter: rank r gets the rows (of dim scatter_dim) r of sum_q a_q @ b_q
    for scatter_dim in (0, 1):
        lead = [2, 3]
        lead[scatter_dim] *= world
        a_all = [_ints(g, *lead, k) for _ in range(world)]
        b_all = [_ints(g, k, n) for _ in range(world)]
        whole = sum(a.float() @ b.float() for a, b in zip(a_all, b_all))
        mine = whole.narrow(scatter_dim, rank * whole.shape[scatter_dim] // world,
                            whole.shape[scatter_dim] // world)
        check(f"gemm_reduce_scatter dim {scatter_dim}",
              lambda out: gemm_reduce_scatter(a_all[rank], b_all[rank], None,
                                              scatter_dim=scatter_dim, out=out),
              mine, [(2, 3, n), (6, n)])

    # all_gather_gemm: rows of x dealt to the ranks along dim 0, w's columns split over them
    x = _ints(g, 2 * world, 3, k)
    w = _ints(g, k, n * world)
    cols = slice(rank * n, (rank + 1) * n)
    check("all_gather_gemm", lambda out: all_gather_gemm(x[2 * rank:2 * rank + 2], w[:, cols], None,
                                                         out=out),
          (x.float() @ w.float())[..., cols], [(2 * world, 3, n), (6 * world, n)])

    # gemm_all_reduce: every rank the whole sum
    a_all = [_ints(g, 2, 3, k) for _ in range(world)]
    b_all = [_ints(g, k, n) for _ in range(world)]
    check("gemm_all_reduce", lambda out: gemm_all_reduce(a_all[rank], b_all[rank], None, out=out),
          sum(a.float() @ b.float() for a, b in zip(a_all, b_all)), [(2, 3, n), (6, n)])
    return cases


@pytest.mark.parametrize("world", [1, 2, 4])
def test_fused_calls_write_out_on_the_torch_path(world):
    results = run_on_ranks(out_body, world)
    assert len(results) == world and all(len(cases) == 12 for cases in results), results
