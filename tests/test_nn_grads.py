"""Pending-sum gradients of replicated parameters (axedist/nn/grads.py): reduced once at the end
of backward, all of a model's in one collective, equal to the one-process gradients.

The TP + SP Llama's RMSNorm weights are replicated and used on sequence-sharded activations, so
their gradients arrive as pending sums. After ``backward`` they must be replicated and equal
the single-process model's (fp64), the backward must have run exactly one all-reduce for all of
them, and ``optimizer.step()`` must communicate nothing (before: one all-reduce per use, three
per weight in AdamW). Gradient accumulation over two backward calls stays exact.
"""

import copy

import pytest
import torch
from torch.distributed.tensor import Replicate

from axedist.mesh import DeviceMesh
from axedist.nn import parallelize, replicate
from axedist.nn.llama import Llama, LlamaConfig, llama_tp_plan, next_token_loss
from axedist.runtime import count_collectives
from axedist.testing import run_on_ranks

TOL = dict(rtol=1e-9, atol=1e-11)
CFG = LlamaConfig(vocab_size=30, dim=16, n_layers=2, n_heads=4, ffn_hidden=24, max_seq_len=8)


def _norms(model):
    return [(n, p) for n, p in model.named_parameters() if "norm" in n]


def _grads_case(rank, world, seed, micro_batches):
    torch.manual_seed(seed)
    ref = Llama(CFG).double()
    par = copy.deepcopy(ref)
    mesh = DeviceMesh("cpu", (world,))
    parallelize(par, mesh, llama_tp_plan(CFG, sequence_parallel=True))
    g = torch.Generator().manual_seed(seed + 1)
    seen = []
    for _ in range(micro_batches):
        tokens = torch.randint(0, CFG.vocab_size, (2, CFG.max_seq_len + 1), generator=g)
        next_token_loss(ref(tokens[:, :-1]), tokens[:, 1:]).backward()
        loss = next_token_loss(par(tokens[:, :-1]), replicate(tokens[:, 1:], mesh))
        with count_collectives() as moved:
            loss.backward()
        seen.append(moved)
    for (name, p), q in zip(ref.named_parameters(), par.parameters()):
        torch.testing.assert_close(q.grad.full_tensor(), p.grad, **TOL, msg=lambda m: f"grad of {name}: {m}")
    norms = _norms(par)
    assert len(norms) == 2 * CFG.n_layers + 1
    for name, p in norms:
        assert p.grad.placements == (Replicate(),), f"{name}: grad {p.grad.placements}"
    # the first backward's norm gradients: one all-reduce of all of them (5 weights x 16 values)
    flat = [r for r in seen[0].routes if r.src.shape == (len(norms) * CFG.dim,)]
    assert len(flat) == 1, [str(r.src) for r in seen[0].routes]
    optimizer = torch.optim.AdamW(par.parameters(), lr=1e-2, foreach=False)
    with count_collectives() as stepped:
        optimizer.step()
    return stepped.calls


@pytest.mark.parametrize("world,micro_batches", [(2, 1), (4, 1), (2, 2)])
def test_pending_norm_gradients_reduced_once_together(world, micro_batches, seed):
    assert run_on_ranks(_grads_case, world, args=(seed, micro_batches)) == [0] * world
