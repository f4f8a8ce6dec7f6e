"""Context parallelism (``axedist.nn.context_parallel``), on gloo ranks.

The buffers' pieces are torch's own (``torch.distributed.tensor.experimental.context_parallel``
entered on the same buffers), head-tail where the length splits into ``2 W`` chunks and contiguous
where not, and whole again on exit. Attention of the pieces is checked against one process's
attention of the whole sequence, values and the gradients of query, key and value, causal or not,
with grouped-query heads; a small Llama's training step against one process's step on the whole
batch (loss and every parameter's gradient, summed over the ranks); ``torch.compile``; and the
refusals, raised on every rank with the buffers restored.
"""

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.tensor.experimental import context_parallel as torch_context_parallel

import axedist as ax
from axedist.nn import SequenceShards, context_parallel
from axedist.nn.llama import Llama, LlamaConfig, next_token_loss
from axedist.peers import RankDisagreementError
from axedist.testing import run_on_ranks

TOL = dict(rtol=1e-10, atol=1e-10)


def _drawn(seed: int, *shape) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def test_sequence_shards_head_tail_and_contiguous():
    assert SequenceShards.of(8, 2).order().tolist() == [0, 1, 6, 7, 2, 3, 4, 5]
    assert repr(SequenceShards.of(8, 2)) == "seq[8 @ 2 ranks: 0:2+6:8 | 2:4+4:6]"
    assert SequenceShards.of(10, 2).order().tolist() == list(range(10))   # 10 = 2 x 5: no 4 equal chunks
    for length, ranks in ((12, 3), (24, 4), (9, 3), (16, 1)):
        shards = SequenceShards.of(length, ranks)
        assert sorted(shards.order().tolist()) == list(range(length))      # every position once
        assert all(len(shards.positions(p)) == length // ranks for p in range(ranks))
    with pytest.raises(ValueError, match="does not split evenly over 2 ranks"):
        SequenceShards.of(7, 2)


@pytest.mark.parametrize("ranks,position", [(2, 0), (2, 1), (4, 3), (3, 1)])
def test_causal_runs_as_the_masked_attention(ranks, position):
    """One rank's runs (square causal + unmasked calls merged by log-sum-exp), values and gradients,
    against attention with the lower-right mask written out, on one process."""
    from axedist.nn.attention import causal_runs

    length = 24
    spans = SequenceShards.of(length, ranks).spans(position)
    held = torch.cat([torch.arange(start, stop) for start, stop in spans])
    query, key, value = (_drawn(40 + i, 2, 3, n, 4) for i, n in enumerate((len(held), length, length)))
    grad = _drawn(43, 2, 3, len(held), 4)
    mine = [t.clone().requires_grad_() for t in (query, key, value)]
    out = causal_runs(*mine, spans, scale=0.3)
    out.backward(grad)
    theirs = [t.clone().requires_grad_() for t in (query, key, value)]
    mask = torch.arange(length)[None, :] <= held[:, None]
    reference = F.scaled_dot_product_attention(*theirs, attn_mask=mask, scale=0.3)
    reference.backward(grad)
    torch.testing.assert_close(out, reference, **TOL)
    for a, b in zip(mine, theirs):
        torch.testing.assert_close(a.grad, b.grad, **TOL)


def _buffers_as_torch(rank, world, length):
    from torch.distributed.device_mesh import init_device_mesh

    mesh, tmesh = ax.DeviceMesh("cpu", (world,)), init_device_mesh("cpu", (world,))
    tokens = torch.arange(2 * length).reshape(2, length)
    table = _drawn(3, length, 3)
    pieces = {}
    for name, enter in (("ours", context_parallel), ("torch", torch_context_parallel)):
        mine = [tokens.clone(), table.clone(), table.clone()]
        with enter(mesh if name == "ours" else tmesh, buffers=mine, buffer_seq_dims=[1, 0, 0],
                   no_restore_buffers={mine[2]}):
            pieces[name] = [b.clone() for b in mine]
        assert torch.equal(mine[0], tokens) and torch.equal(mine[1], table)   # restored
        assert torch.equal(mine[2], pieces[name][2])                          # not restored: still the piece
    for ours, theirs in zip(pieces["ours"], pieces["torch"]):
        assert torch.equal(ours, theirs)
    positions = SequenceShards.of(length, world).positions(rank)
    assert torch.equal(pieces["ours"][0], tokens[:, positions])
    return pieces["ours"][0].shape[1]


@pytest.mark.parametrize("world,length", [(2, 12), (2, 10), (3, 12), (3, 9)])
def test_buffers_cut_as_torch_and_restored(world, length):
    assert run_on_ranks(_buffers_as_torch, world, args=(length,)) == [length // world] * world


def _attention(rank, world, length, causal, kv_heads, seed):
    mesh = ax.DeviceMesh("cpu", (world,))
    q, k, v, g = (_drawn(seed + i, 2, heads, length, 8) for i, heads in enumerate((4, kv_heads, kv_heads, 4)))
    gqa = kv_heads != 4
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    reference = F.scaled_dot_product_attention(*leaves, is_causal=causal, enable_gqa=gqa)
    (reference * g).sum().backward()

    pieces = [t.clone() for t in (q, k, v, g)]
    with context_parallel(mesh, buffers=pieces, buffer_seq_dims=[2] * 4, no_restore_buffers=set(pieces)):
        q_, k_, v_ = (t.requires_grad_() for t in pieces[:3])
        out = F.scaled_dot_product_attention(q_, k_, v_, is_causal=causal, enable_gqa=gqa)
        (out * pieces[3]).sum().backward()
    here = SequenceShards.of(length, world).positions(rank)
    torch.testing.assert_close(out, reference[:, :, here], **TOL)
    for piece, leaf in zip((q_, k_, v_), leaves):
        torch.testing.assert_close(piece.grad, leaf.grad[:, :, here], **TOL)


@pytest.mark.parametrize("world,length,causal,kv_heads", [
    (2, 12, True, 4), (2, 12, False, 2), (2, 10, True, 2), (3, 12, True, 1), (3, 9, False, 4)])
def test_attention_and_gradients_as_one_process(world, length, causal, kv_heads):
    run_on_ranks(_attention, world, args=(length, causal, kv_heads, 11 * world + length))


def _llama_step(rank, world, seed):
    cfg = LlamaConfig(vocab_size=64, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_hidden=48, max_seq_len=16)
    torch.manual_seed(seed)
    model = Llama(cfg).double()
    gen = torch.Generator().manual_seed(seed + 1)
    tokens = torch.randint(0, cfg.vocab_size, (2, 16), generator=gen)
    labels = torch.randint(0, cfg.vocab_size, (2, 16), generator=gen)
    reference = next_token_loss(model(tokens), labels)
    reference.backward()
    expected = {name: p.grad.clone() for name, p in model.named_parameters()}
    model.zero_grad()

    mesh = ax.DeviceMesh("cpu", (world,))
    with context_parallel(mesh, buffers=[tokens, labels, model.rope_cos, model.rope_sin],
                          buffer_seq_dims=[1, 1, 0, 0], no_restore_buffers={tokens, labels}):
        assert tokens.shape == (2, 16 // world)
        loss = next_token_loss(model(tokens), labels)   # the mean over this rank's positions
        loss.backward()
    assert model.rope_cos.shape[0] == cfg.max_seq_len   # the model's tables are whole again
    dist.all_reduce(loss.detach(), op=dist.ReduceOp.AVG)
    torch.testing.assert_close(loss, reference, **TOL)
    for name, p in model.named_parameters():
        grad = p.grad.clone()
        dist.all_reduce(grad, op=dist.ReduceOp.AVG)   # each rank's mean over as many positions
        torch.testing.assert_close(grad, expected[name], **TOL, msg=name)


@pytest.mark.parametrize("world", [2, 4])
def test_llama_training_step_as_one_process(world):
    run_on_ranks(_llama_step, world, args=(5 + world,))


def _other_names_and_checkpoints(rank, world):
    """SDPA under another name (caught as a torch-function mode) and in an activation checkpoint
    (its recomputation in backward, where no mode is on, reaches it through F's name)."""
    from torch.nn.functional import scaled_dot_product_attention as imported
    from torch.utils.checkpoint import checkpoint

    mesh = ax.DeviceMesh("cpu", (world,))
    q, k, v, g = (_drawn(30 + i, 1, 2, 8, 4) for i in range(4))
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    (torch.sin(F.scaled_dot_product_attention(*leaves, is_causal=True)) * g).sum().backward()
    here = SequenceShards.of(8, world).positions(rank)
    for attend in (lambda *t: torch.sin(imported(*t, is_causal=True)),
                   lambda *t: checkpoint(lambda *u: torch.sin(F.scaled_dot_product_attention(*u, is_causal=True)),
                                         *t, use_reentrant=False)):
        pieces = [t.clone() for t in (q, k, v, g)]
        with context_parallel(mesh, buffers=pieces, buffer_seq_dims=[2] * 4, no_restore_buffers=set(pieces)):
            mine = [t.requires_grad_() for t in pieces[:3]]
            (attend(*mine) * pieces[3]).sum().backward()
        for piece, leaf in zip(mine, leaves):
            torch.testing.assert_close(piece.grad, leaf.grad[:, :, here], **TOL)
    assert F.scaled_dot_product_attention is imported   # torch's own again
    # under another name in a checkpoint, the recomputation is torch's SDPA of the pieces alone:
    # torch's checkpoint sees other saved tensors and raises (never a silent local attention)
    pieces = [t.clone() for t in (q, k, v)]
    with context_parallel(mesh, buffers=pieces, buffer_seq_dims=[2] * 3, no_restore_buffers=set(pieces)):
        out = checkpoint(lambda *u: torch.sin(imported(*u, is_causal=True)), *[t.requires_grad_() for t in pieces],
                         use_reentrant=False)
        with pytest.raises(torch.utils.checkpoint.CheckpointError):
            out.sum().backward()


def test_sdpa_under_other_names_and_in_checkpoints():
    run_on_ranks(_other_names_and_checkpoints, 2)


def _compiled(rank, world):
    mesh = ax.DeviceMesh("cpu", (world,))
    q, k, v = (_drawn(20 + i, 1, 2, 8, 4) for i in range(3))
    reference = F.scaled_dot_product_attention(q, k, v, is_causal=True)

    def attend(q, k, v):
        return torch.tanh(F.scaled_dot_product_attention(q, k, v, is_causal=True))

    pieces = [q.clone(), k.clone(), v.clone()]
    with context_parallel(mesh, buffers=pieces, buffer_seq_dims=[2, 2, 2]):
        out = torch.compile(attend, backend="aot_eager", fullgraph=False)(*pieces)
    here = SequenceShards.of(8, world).positions(rank)
    torch.testing.assert_close(out, torch.tanh(reference)[:, :, here], **TOL)


def test_compiled_attention():
    run_on_ranks(_compiled, 2)


def _refusals(rank, world):
    mesh = ax.DeviceMesh("cpu", (world,))
    q = _drawn(1, 1, 2, 8, 4)
    pieces = [q.clone()]
    with pytest.raises(NotImplementedError, match="attn_mask"):
        with context_parallel(mesh, buffers=pieces, buffer_seq_dims=[2]):
            F.scaled_dot_product_attention(pieces[0], pieces[0], pieces[0], attn_mask=torch.ones(4, 4, dtype=bool))
    assert torch.equal(pieces[0], q)   # restored after the error
    with pytest.raises(ValueError, match="lengths"):
        with context_parallel(mesh, buffers=pieces, buffer_seq_dims=[2]):
            F.scaled_dot_product_attention(q, q, q)   # the whole sequence, not this rank's piece
    with pytest.raises(ValueError, match="sequence lengths differ"):
        with context_parallel(mesh, buffers=[q.clone(), torch.zeros(2, 6)], buffer_seq_dims=[2, 1]):
            pass
    with pytest.raises(RankDisagreementError):   # rank 1 alone has 10 positions
        with context_parallel(mesh, buffers=[torch.zeros(2, 10 if rank == 1 else 8)], buffer_seq_dims=[1]):
            pass
    with pytest.raises(ValueError, match="does not split evenly"):
        with context_parallel(mesh, buffers=[torch.zeros(2, 7)], buffer_seq_dims=[1]):
            pass
    with pytest.raises(ValueError, match="subset"):
        with context_parallel(mesh, buffers=[q.clone()], buffer_seq_dims=[2], no_restore_buffers={q}):
            pass
    with pytest.raises(ValueError, match="1-D mesh"):
        with context_parallel(ax.DeviceMesh("cpu", (1, world), ("dp", "cp")), buffers=[q.clone()],
                              buffer_seq_dims=[2]):
            pass
    with pytest.raises(TypeError, match="not parameters"):
        with context_parallel(mesh, buffers=[torch.nn.Parameter(q.clone())], buffer_seq_dims=[2]):
            pass
    with pytest.raises(RuntimeError, match="do not nest"):
        with context_parallel(mesh, buffers=[q.clone()], buffer_seq_dims=[2]):
            with context_parallel(mesh, buffers=[q.clone()], buffer_seq_dims=[2]):
                pass
    assert F.scaled_dot_product_attention is torch._C._nn.scaled_dot_product_attention   # torch's again
    # the mesh works on after every refusal
    pieces = [q.clone()]
    with context_parallel(mesh, buffers=pieces, buffer_seq_dims=[2]):
        out = F.scaled_dot_product_attention(pieces[0], pieces[0], pieces[0], is_causal=True)
    here = SequenceShards.of(8, world).positions(rank)
    torch.testing.assert_close(out, F.scaled_dot_product_attention(q, q, q, is_causal=True)[:, :, here], **TOL)


def test_refusals_on_every_rank():
    run_on_ranks(_refusals, 2)
