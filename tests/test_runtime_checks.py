"""Value checks that wait to be settled (axedist/runtime/checks.py), on CPU with the GPU's policy
(``checks.defers`` set to always), and the ops that use them (embedding's indices, nll_loss's
targets) on 2 ranks: the error comes at the settling points every rank reaches alike, values
and gradients of good input are those of the checks read at once."""

import contextlib

import pytest
import torch
import torch.nn.functional as F
from torch.distributed.tensor import Replicate, Shard

from axedist.dtensor import distribute
from axedist.mesh import DeviceMesh
from axedist.runtime import checks
from axedist.testing import run_on_ranks


@contextlib.contextmanager
def deferring():
    """The CUDA policy (every check waits to be settled) on CPU, for the block."""
    before = checks.defers
    checks.defers = lambda answer: True
    try:
        yield
    finally:
        checks.defers = before
        with contextlib.suppress(Exception):
            checks.settle()


def _negative(values):
    bad = [v for v in values if v < 0]
    return ValueError(f"negative: {bad[0]}") if bad else None


class _CheckedInBackward(torch.autograd.Function):
    """Doubles ``x``; its backward checks ``value`` (as nll_loss's backward checks the targets)."""

    @staticmethod
    def forward(ctx, x, value):
        ctx.value = value
        return x * 2

    @staticmethod
    def backward(ctx, grad):
        checks.check(ctx.value, _negative)
        return grad * 2, None


def test_read_at_once_where_it_does_not_defer():
    assert not checks.defers(torch.tensor([1]))  # a CPU tensor: reading it waits for nothing
    checks.check(torch.tensor([3, 1]), _negative)
    with pytest.raises(ValueError, match="negative: -2"):
        checks.check(torch.tensor([3, -2]), _negative)
    assert checks.pending() == 0


def test_a_deferred_check_raises_when_settled():
    with deferring():
        checks.check(torch.tensor([4, -5]), _negative)   # no error yet
        checks.check(torch.tensor([1, 2]), _negative)
        assert checks.pending() == 2
        with pytest.raises(ValueError, match="negative: -5"):
            checks.settle()
        assert checks.pending() == 0   # every check read, the good one too
        checks.settle()                # nothing left to raise


def test_the_backward_raises_at_its_end_with_the_gradients_computed():
    x = torch.randn(3, requires_grad=True)
    with deferring():
        for value, fails in ((torch.tensor([2]), False), (torch.tensor([-7]), True), (torch.tensor([1]), False)):
            x.grad = None
            y = _CheckedInBackward.apply(x, value).sum()
            if fails:
                with pytest.raises(ValueError, match="negative: -7"):
                    y.backward()
            else:
                y.backward()
            torch.testing.assert_close(x.grad, torch.full((3,), 2.0))
            assert checks.pending() == 0


def test_a_forward_check_settles_at_the_end_of_the_next_backward_that_asks():
    x = torch.randn(3, requires_grad=True)
    with deferring():
        checks.check(torch.tensor([-1]), _negative)      # the forward's
        checks.settle_after_backward()                   # outside a backward: does nothing
        assert checks.pending() == 1
        with pytest.raises(ValueError, match="negative: -1"):
            _CheckedInBackward.apply(x, torch.tensor([5])).sum().backward()
        assert checks.pending() == 0


def test_at_most_limit_checks_wait():
    with deferring():
        checks.check(torch.tensor([-3]), _negative)
        for _ in range(checks.LIMIT - 1):
            checks.check(torch.tensor([0]), _negative)
        with pytest.raises(ValueError, match="negative: -3"):   # the oldest is settled to make room
            checks.check(torch.tensor([0]), _negative)
        assert checks.pending() == checks.LIMIT - 1


def _deferred_loss_case(rank, world_size, bad_target: bool, bad_index: bool, read: str):
    """A vocab-parallel embedding and loss with the checks deferred: where the error comes, and the
    values of good input against the checks read at once."""
    mesh = DeviceMesh("cpu", (world_size,))
    torch.manual_seed(0)
    weight, logits = torch.randn(6, 4), torch.randn(5, 7)
    indices = torch.tensor([[0, 5, 2, 3, 1]]) if not bad_index else torch.tensor([[0, 6, 2, 3, 1]])
    target = torch.tensor([1, 6, 0, 3, 2]) if not bad_target else torch.tensor([1, 7, 0, 3, 2])

    def run(deferred: bool):
        w = distribute(weight, mesh, [Shard(0)]).requires_grad_()
        x = distribute(logits, mesh, [Shard(1)]).requires_grad_()
        rows = F.embedding(distribute(indices, mesh, [Replicate()]), w)
        loss = F.cross_entropy(x, distribute(target, mesh, [Replicate()])) + rows.sum()
        if deferred:
            assert checks.pending() == 2   # the index and the forward's targets, not read yet
        if read == "item":
            return loss.item(), None, None
        if read == "full_tensor":
            return loss.full_tensor(), None, None
        loss.backward()
        return loss.full_tensor(), x.grad.full_tensor(), w.grad.full_tensor()

    if bad_target or bad_index:
        with deferring():
            try:
                run(deferred=True)
            except IndexError as error:
                return str(error), checks.pending()
        return "no error", checks.pending()
    with deferring():
        got = run(deferred=True)
    want = run(deferred=False)
    for a, b in zip(got, want):
        if a is not None:
            torch.testing.assert_close(a, b, rtol=0, atol=0)
    return "same", checks.pending()


@pytest.mark.parametrize("read", ["backward", "item", "full_tensor"])
def test_deferred_range_checks_raise_on_every_rank(read):
    out = run_on_ranks(_deferred_loss_case, 2, args=(True, False, read))
    assert out == [("nll_loss: target 7 is out of bounds for 7 classes", 0)] * 2, out
    out = run_on_ranks(_deferred_loss_case, 2, args=(False, True, read))
    assert out == [("embedding: index 6 is out of range for a vocabulary of 6 rows", 0)] * 2, out
    out = run_on_ranks(_deferred_loss_case, 2, args=(False, False, read))
    assert out == [("same", 0)] * 2, out


def test_range_check_asserts_on_the_device_while_a_cuda_graph_is_captured(monkeypatch):
    """Under capture nothing can be read on the host: the range check becomes a device-side assert
    (torch._assert_async, which on CPU raises at once; on a GPU it is a kernel the graph replays)."""
    message = "embedding: index {value} is out of range for a vocabulary of 10 rows"
    assert not checks.capturing(torch.tensor([1]))  # a CPU tensor is never in a CUDA graph
    reads = []
    monkeypatch.setattr(checks, "check", lambda answer, verdict: reads.append(answer))
    monkeypatch.setattr(checks, "capturing", lambda values: True)
    checks.check_range(torch.tensor([0, 9, 3]), 10, message)
    with pytest.raises(RuntimeError, match="out of range for a vocabulary of 10 rows"):
        checks.check_range(torch.tensor([0, 10]), 10, message)
    with pytest.raises(RuntimeError, match="out of range"):
        checks.check_range(torch.tensor([-1, 3]), 10, message)
    assert reads == []  # no host read was asked for
    monkeypatch.setattr(checks, "capturing", lambda values: False)
    checks.check_range(torch.tensor([0, 10]), 10, message)
    assert len(reads) == 1  # not capturing: the host check


def test_a_device_assert_message_is_cut_to_what_cuda_takes():
    """CUDA refuses a device-assert message over 254 characters at the call (2x H200, 2026-11-30:
    "Message length must be smaller than 255"): a longer one is cut, its start kept."""
    checks.assert_on_device(torch.tensor(True), "x" * 1000)
    with pytest.raises(RuntimeError) as raised:
        checks.assert_on_device(torch.tensor(False), "the start names the op; " + "y" * 1000)
    text = str(raised.value)
    assert text.startswith("the start names the op; ") and text.endswith("...")
    assert len(text) == checks.ASSERT_MESSAGE_LIMIT
    with pytest.raises(RuntimeError, match="^short$"):
        checks.assert_on_device(torch.tensor(False), "short")
