"""The decode layer tail's public call (collectives/layer_tail.py) on CPU ranks: the unfused
sequence it falls back to off CUDA, against a single-process float64 reference, and its clear
errors. The fused kernel itself is checked under the Triton interpreter (tests/collectives_interpreter.py)
and on GPUs (tests_multigpu/test_collectives.py::test_layer_tail_matches_the_unfused_sequence)."""

import pytest
import torch

from axedist.collectives.layer_tail import all_reduce_rms_norm
from axedist.testing import run_on_ranks


def _inputs(world, rows, hidden, seed):
    generator = torch.Generator().manual_seed(seed)
    xs = [torch.randn(rows, hidden, generator=generator, dtype=torch.float64) for _ in range(world)]
    residual = torch.randn(rows, hidden, generator=generator, dtype=torch.float64)
    weight = 1 + 0.1 * torch.randn(hidden, generator=generator, dtype=torch.float64)
    return xs, residual, weight


def _body(rank, world, rows, hidden, seed):
    xs, residual, weight = _inputs(world, rows, hidden, seed)
    h, y = all_reduce_rms_norm(xs[rank], residual, weight, 1e-6)
    errors = []
    for bad in ({"backend": "nccl"}, {"backend": "p2p"}):
        try:
            all_reduce_rms_norm(xs[rank], residual, weight, 1e-6, **bad)
        except ValueError as error:
            errors.append(str(error))
    try:
        all_reduce_rms_norm(xs[rank], residual[:, :-1], weight, 1e-6)
    except ValueError as error:
        errors.append(str(error))
    return h, y, errors


@pytest.mark.parametrize("world,rows,hidden", [(2, 3, 40), (4, 1, 64)])
def test_layer_tail_off_cuda_is_the_unfused_sequence(world, rows, hidden):
    seed = torch.randint(0, 1 << 30, ()).item()  # fresh inputs every run
    results = run_on_ranks(_body, world, args=(rows, hidden, seed))
    xs, residual, weight = _inputs(world, rows, hidden, seed)
    h_ref = residual + torch.stack(xs).sum(0)
    y_ref = h_ref * torch.rsqrt(h_ref.pow(2).mean(-1, keepdim=True) + 1e-6) * weight
    for h, y, errors in results:
        torch.testing.assert_close(h, h_ref, rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(y, y_ref, rtol=1e-12, atol=1e-12)
        assert "backend must be auto, p2p or torch, got 'nccl'" in errors[0]
        assert "backend p2p needs CUDA tensors" in errors[1]
        assert "x and residual must be [rows, hidden] of one shape" in errors[2]
