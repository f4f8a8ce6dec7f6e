"""Value checks on GPUs (axedist/runtime/checks.py): a TP Llama's training step reads nothing back
to the host (torch's sync debug mode turned to errors around forward, loss and backward), and a
target out of range still ends in an IndexError on every rank, raised by ``loss.backward()``.

W = torch.cuda.device_count() (CUDA_VISIBLE_DEVICES=0,1 for W=2).
"""

import random

import pytest
import torch

from axedist.mesh import DeviceMesh
from axedist.nn import parallelize, replicate
from axedist.nn.llama import Llama, LlamaConfig, llama_tp_plan, next_token_loss
from axedist.runtime import checks
from axedist.testing import run_on_ranks

WORLD = torch.cuda.device_count() if torch.cuda.is_available() else 0
pytestmark = pytest.mark.skipif(WORLD < 2, reason="needs >= 2 CUDA GPUs")
CFG = LlamaConfig(vocab_size=128, dim=64, n_layers=2, n_heads=8, ffn_hidden=96, max_seq_len=16)


def _model(world, s):
    torch.manual_seed(s)
    mesh = DeviceMesh("cuda", (world,))
    model = parallelize(Llama(CFG).cuda(), mesh, llama_tp_plan(CFG, sequence_parallel=True))
    return model, mesh


def _tokens(s, bad: bool = False):
    tokens = torch.randint(0, CFG.vocab_size, (4, CFG.max_seq_len + 1), generator=torch.Generator().manual_seed(s))
    if bad:
        tokens[1, -1] = CFG.vocab_size + 3   # a target (and no input) out of range
    return tokens.cuda()


def _step_without_sync(rank, world, s):
    model, mesh = _model(world, s)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    found = []
    for step in range(3):   # the first plans and compiles; the later ones must not read back
        tokens = _tokens(s + step)
        torch.cuda.synchronize()
        if step:
            torch.cuda.set_sync_debug_mode("error")
        try:
            loss = next_token_loss(model(tokens[:, :-1]), replicate(tokens[:, 1:], mesh))
            loss.backward()
        except RuntimeError as error:
            found.append(f"step {step}: {error}"[:600])
        finally:
            torch.cuda.set_sync_debug_mode(0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return found, checks.pending(), float(loss.full_tensor())


def test_a_training_step_reads_nothing_back():
    reports = run_on_ranks(_step_without_sync, WORLD, backend="nccl", args=(random.randrange(2**31),))
    for found, pending, loss in reports:
        assert found == [] and pending == 0 and loss == loss, reports


def _late_error(rank, world, s):
    model, mesh = _model(world, s)
    tokens = _tokens(s, bad=True)
    loss = next_token_loss(model(tokens[:, :-1]), replicate(tokens[:, 1:], mesh))   # no error yet
    waiting = checks.pending()
    try:
        loss.backward()
    except IndexError as error:
        return waiting, str(error), checks.pending()
    return waiting, "no error", checks.pending()


def test_a_target_out_of_range_raises_from_backward_on_every_rank():
    reports = run_on_ranks(_late_error, WORLD, backend="nccl", args=(random.randrange(2**31),))
    message = f"nll_loss: target {CFG.vocab_size + 3} is out of bounds for {CFG.vocab_size} classes"
    assert all(waiting >= 1 and text == message and pending == 0 for waiting, text, pending in reports), reports
