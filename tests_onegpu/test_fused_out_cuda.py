"""out= of the fused calls on CUDA (the session's one-rank NCCL group), on the torch path and on
the fused kernels (backend "p2p" at W = 1): out given in the product's shape or with its rows
flattened receives the product and comes back in the product's shape; bf16 small integers, so
every backend's product equals the fp32 one exactly (tests/test_fused_calls_out.py runs the
torch path at W = 1, 2 and 4 on CPU).

    pytest tests_onegpu/test_fused_out_cuda.py
"""
import pytest
import torch


def _ints(*shape):
    return torch.randint(-2, 3, shape, device="cuda").to(torch.bfloat16)


@pytest.mark.parametrize("backend", ["torch", "p2p"])
def test_fused_calls_write_out(group, backend, seed):
    from axedist.collectives import all_gather_gemm, gemm_all_reduce, gemm_reduce_scatter

    a, b = _ints(2, 64, 256), _ints(256, 128)   # a 3-D a: [2, 64, K]; 16-byte rows
    want = a.float() @ b.float()
    calls = {"gemm_reduce_scatter": gemm_reduce_scatter, "all_gather_gemm": all_gather_gemm,
             "gemm_all_reduce": gemm_all_reduce}
    for name, call in calls.items():
        for shape in ((2, 64, 128), (128, 128)):
            out = torch.full(shape, float("nan"), device="cuda", dtype=torch.bfloat16)
            got = call(a, b, group, backend=backend, out=out)
            torch.cuda.synchronize()
            assert got.data_ptr() == out.data_ptr() and got.shape == want.shape, (name, shape)
            torch.testing.assert_close(got.float(), want, rtol=0, atol=0, msg=f"{name} {shape}")
        with pytest.raises(ValueError, match=f"{name}: out must be"):
            call(a, b, group, backend=backend, out=torch.empty(128, 2, 64, device="cuda",
                                                                dtype=torch.bfloat16))
