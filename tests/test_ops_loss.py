"""Cross-entropy and nll_loss over DTensors (ops/loss.py) against F.cross_entropy on whole tensors.

Logits sharded on the class dim (uneven class counts, down to ranks that hold no class),
on the batch dim, on a spatial dim (``nll_loss2d``), and replicated; every reduction,
``ignore_index``, per-class weights and label smoothing; on 2 and 4 ranks and a 2x2 mesh.
The loss and the logits' grad must equal the single-device ones, and class-sharded logits
must give a partial-sum loss (computed where the classes live, never gathered).
"""

import itertools

import pytest
import torch
import torch.nn.functional as F
from torch.distributed.tensor import Partial, Replicate, Shard

from axedist.dtensor import DTensor, distribute
from axedist.mesh import DeviceMesh
from axedist.testing import run_on_ranks

fallback_ops = DTensor.dispatcher.fallback_ops
from tests.ops_cases import MESHES, gathered

REDUCTIONS = ("none", "mean", "sum")


def _case(generator, spatial: bool, smoothing: float):
    g = generator
    classes = int(torch.randint(2, 12, (1,), generator=g))   # 2 or 3 classes leave some of 4 ranks none
    batch = int(torch.randint(1, 7, (1,), generator=g))
    shape = (batch, classes) + ((int(torch.randint(1, 5, (1,), generator=g)),) if spatial else ())
    logits = torch.randn(shape, dtype=torch.float64, generator=g)
    target = torch.randint(0, classes, shape[:1] + shape[2:], generator=g)
    ignore = torch.rand(target.shape, generator=g) < 0.2
    target = target.masked_fill(ignore, -100)
    weight = torch.rand(classes, dtype=torch.float64, generator=g) + 0.5 if torch.rand(1, generator=g) < 0.5 else None
    return logits, target, weight


def _loss_case(rank, world_size, mesh_name, seed, spatial, smoothing=0.0):
    mesh = DeviceMesh("cpu", *MESHES[mesh_name])
    g = torch.Generator().manual_seed(seed)
    logits, target, weight = _case(g, spatial, smoothing)
    options = [[Shard(1)] * mesh.ndim, [Replicate()] * mesh.ndim] + \
        [list(p) for p in itertools.product([Shard(d) for d in range(logits.dim())] + [Replicate()],
                                            repeat=mesh.ndim)]
    picks = [options[0], options[1]] + [options[2 + j] for j in torch.randperm(len(options) - 2, generator=g)[:3]]
    checked = 0
    for reduction in REDUCTIONS:
        kwargs = dict(weight=weight, reduction=reduction, label_smoothing=smoothing)
        reference = logits.clone().requires_grad_()
        want = F.cross_entropy(reference, target, **kwargs)
        grad = torch.randn(want.shape, dtype=torch.float64, generator=g)
        want.backward(grad)
        for lp in picks:
            tp = [Shard(0) if p == Shard(0) else Replicate() for p in lp]
            x = distribute(logits, mesh, lp).requires_grad_()
            t = distribute(target, mesh, tp)
            w = None if weight is None else distribute(weight, mesh, [Replicate()] * mesh.ndim)
            loss = F.cross_entropy(x, t, weight=w, reduction=reduction, label_smoothing=smoothing)
            what = f"seed {seed}, shape {tuple(logits.shape)}, logits {lp}, {kwargs}"
            torch.testing.assert_close(loss.full_tensor(), want, msg=what, equal_nan=True)
            for axis, p in enumerate(lp):
                if p == Shard(1):  # the loss is computed where the classes live
                    assert loss.placements[axis] == Partial("sum"), f"{what}: loss {loss.placements}"
            loss.backward(distribute(grad, mesh, [Replicate()] * mesh.ndim))
            torch.testing.assert_close(x.grad.full_tensor(), reference.grad, msg=what, equal_nan=True)
            assert x.grad.placements == x.placements, f"{what}: grad {x.grad.placements}"
            checked += 1
    ran_gathered = {str(op) for op in fallback_ops()} & {"aten.nll_loss_forward.default", "aten._log_softmax.default",
                                                        "aten.nll_loss_backward.default", "aten.nll_loss2d_forward.default"}
    assert not ran_gathered, ran_gathered
    return checked


@pytest.mark.parametrize("spatial", [False, True], ids=["2d", "spatial"])
@pytest.mark.parametrize("mesh_name,world_size", [("2", 2), ("4", 4), ("2x2", 4)])
def test_cross_entropy(mesh_name, world_size, spatial, seed):
    smoothing = (0.0, 0.0, 0.1)[seed % 3]
    counts = run_on_ranks(_loss_case, world_size, args=(mesh_name, seed, spatial, smoothing))
    assert counts[0] >= 9  # 3 reductions x at least 3 placements


def _smoothing_class_sharded_case(rank, world_size, seed):
    """Label smoothing over class-sharded logits: the class sum of log-probabilities is a
    pending sum that ``masked_fill_(ignored, 0)`` keeps pending (in place, on every rank)."""
    mesh = DeviceMesh("cpu", (world_size,))
    g = torch.Generator().manual_seed(seed)
    classes = int(torch.randint(world_size + 1, 3 * world_size, (1,), generator=g))
    logits = torch.randn(5, classes, dtype=torch.float64, generator=g)
    target = torch.randint(0, classes, (5,), generator=g)
    target[int(torch.randint(0, 5, (1,), generator=g))] = -100
    reference = logits.clone().requires_grad_()
    want = F.cross_entropy(reference, target, label_smoothing=0.1)
    want.backward()
    x = distribute(logits, mesh, [Shard(1)]).requires_grad_()
    loss = F.cross_entropy(x, distribute(target, mesh, [Replicate()]), label_smoothing=0.1)
    assert loss.placements == (Partial("sum"),), loss.placements
    loss.backward()
    torch.testing.assert_close(loss.full_tensor(), want)
    torch.testing.assert_close(x.grad.full_tensor(), reference.grad)
    return x.grad.placements


@pytest.mark.parametrize("world_size", [2, 4])
def test_label_smoothing_class_sharded(world_size):
    seed = int(torch.randint(0, 2**31 - 1, (1,)))
    assert run_on_ranks(_smoothing_class_sharded_case, world_size, args=(seed,)) == [(Shard(1),)] * world_size


def _vocab_parallel_case(rank, world_size, seed):
    """The LM-head pattern: (batch*seq, vocab) logits sharded on the vocab, mean loss: only
    per-row scalars cross ranks (the loss is partial, its grad stays vocab-sharded)."""
    mesh = DeviceMesh("cpu", (world_size,))
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(12, 37, dtype=torch.float64, generator=g)
    target = torch.randint(0, 37, (12,), generator=g)
    reference = logits.clone().requires_grad_()
    want = F.cross_entropy(reference, target)
    want.backward()
    x = distribute(logits, mesh, [Shard(1)]).requires_grad_()
    loss = F.cross_entropy(x, distribute(target, mesh, [Replicate()]))
    assert loss.placements == (Partial("sum"),)
    loss.backward()
    torch.testing.assert_close(loss.full_tensor(), want)
    torch.testing.assert_close(x.grad.full_tensor(), reference.grad)
    return x.grad.placements, tuple(x.grad.to_local().shape)


@pytest.mark.parametrize("world_size", [2, 4])
def test_vocab_parallel_loss_keeps_logits_sharded(world_size):
    seed = int(torch.randint(0, 2**31 - 1, (1,)))
    out = run_on_ranks(_vocab_parallel_case, world_size, args=(seed,))
    sizes = [len(range(37)[r * -(-37 // world_size):(r + 1) * -(-37 // world_size)]) for r in range(world_size)]
    assert out == [((Shard(1),), (12, n)) for n in sizes]


def _bad_target_case(rank, world_size):
    mesh = DeviceMesh("cpu", (world_size,))
    x = distribute(torch.randn(3, 5), mesh, [Shard(1)])
    t = distribute(torch.tensor([0, 7, 1]), mesh, [Replicate()])
    try:
        F.cross_entropy(x, t)
    except IndexError as e:
        return str(e)
    return "no error"


def test_target_out_of_range_is_a_clear_error():
    messages = run_on_ranks(_bad_target_case, 2)
    assert all("target 7 is out of bounds for 5 classes" in m for m in messages), messages


def _dealt_class_layouts(world_size, batch):
    """(label, mesh, layout of (batch, classes) logits, classes) whose classes are dealt by a layout
    with no placement form (each row whole on every device that holds any of it)."""
    from axedist.layout import Layout

    line = DeviceMesh("cpu", (world_size,))
    out = [("classes round-robin in pairs", line,
            Layout.parse(f"S[({batch},3,{world_size},2):(6,2,1@gpuid,1)]"), 3 * world_size * 2)]
    if world_size == 4:
        grid = DeviceMesh("cpu", (2, 2), ("dp", "tp"))
        out.append(("pairs round-robin over tp, replicated over dp", grid,
                    Layout.parse(f"S[({batch},3,2,2):(6,2,1@tp,1)] + R[2:1@dp]"), 12))
        out.append(("pairs round-robin over dp then tp", grid,
                    Layout.parse(f"S[({batch},2,2,2,2):(4,1@tp,2,1@dp,1)]"), 16))
    return out


def _dealt_classes_case(rank, world_size, seed):
    """Cross-entropy of logits whose classes a layout deals: the logits are never gathered (the
    forward and the backward run only all-reduces of one value per row), the loss is a pending
    sum over the dealing axes; loss and logits' gradient equal torch's for every reduction, with
    ignored targets and per-class weights."""
    from axedist.layout import LayoutError
    from axedist.runtime import count_collectives

    g = torch.Generator().manual_seed(seed)
    batch = 5
    failures = []
    for label, mesh, layout, classes in _dealt_class_layouts(world_size, batch):
        for reduction, weighted in itertools.product(REDUCTIONS, (False, True)):
            logits = torch.randn(batch, classes, dtype=torch.float64, generator=g, requires_grad=True)
            target = torch.randint(0, classes, (batch,), generator=g)
            target[int(torch.randint(0, batch, (1,), generator=g))] = -100
            weight = torch.rand(classes, dtype=torch.float64, generator=g) + 0.5 if weighted else None
            want = F.cross_entropy(logits, target, weight=weight, reduction=reduction)
            whole = [Replicate()] * mesh.ndim
            dl = distribute(logits.detach(), mesh, layout).requires_grad_()
            try:
                dl.placements
                failures.append(f"{label}: the logits have a placement form")
            except LayoutError:
                pass
            dt = distribute(target, mesh, whole)
            dw = None if weight is None else distribute(weight, mesh, whole)
            what = f"{label}, {reduction}, weight {weighted}"
            with count_collectives() as seen:
                loss = F.cross_entropy(dl, dt, weight=dw, reduction=reduction)
            moved = [kind for kind in seen.by_kind if not kind.startswith("all_reduce")]
            if moved or seen.bytes_sent > 4 * batch * 8 * mesh.size():
                failures.append(f"{what}: the forward moved more than row statistics ({seen})")
            if not torch.allclose(loss.full_tensor(), want.detach()):
                failures.append(f"{what}: loss differs from torch")
            up = torch.randn(want.shape, dtype=torch.float64, generator=g)
            with count_collectives() as seen:
                (grad,) = torch.autograd.grad((loss.full_tensor() * up).sum(), dl)
            moved = [kind for kind in seen.by_kind if not kind.startswith("all_reduce")]
            if moved or seen.bytes_sent > 4 * batch * 8 * mesh.size():
                failures.append(f"{what}: the backward moved more than row statistics ({seen})")
            (reference,) = torch.autograd.grad((want * up).sum(), logits)
            if not torch.allclose(grad.full_tensor(), reference):
                failures.append(f"{what}: the logits' gradient differs from torch's")
    return failures


@pytest.mark.parametrize("world_size", [2, 4])
def test_cross_entropy_of_classes_dealt_by_a_layout_without_placements(world_size):
    seed = int(torch.randint(0, 2**31 - 1, (1,)))
    results = run_on_ranks(_dealt_classes_case, world_size, args=(seed,), timeout_s=600)
    assert results == [[]] * world_size, (seed, results[0])


def _tied_dealt_vocab_case(rank, world_size, seed):
    """A tied embedding and output layer whose vocabulary rows are dealt round-robin in pairs (no
    placement form): lookup, logits ``h @ W.T`` and cross-entropy with all-reduces (the
    embedding's pending sum, the softmax's row statistics) and never a gather of the weight or
    the logits; the two weight gradients (the embedding's comes vocab-sharded) meet by a permute or an
    all-to-all of at most the weight's size.
    Loss and the weight's gradient equal torch's."""
    from axedist.layout import Layout
    from axedist.runtime import count_collectives

    g = torch.Generator().manual_seed(seed)
    mesh = DeviceMesh("cpu", (world_size,))
    dim, vocab = 4, 3 * world_size * 2
    layout = Layout.parse(f"S[(3,{world_size},2,{dim}):({2 * dim},1@gpuid,{dim},1)]")
    weight = torch.randn(vocab, dim, dtype=torch.float64, generator=g, requires_grad=True)
    tokens = torch.randint(0, vocab, (6,), generator=g)
    target = torch.randint(0, vocab, (6,), generator=g)
    want = F.cross_entropy(F.embedding(tokens, weight) @ weight.t(), target)
    (reference,) = torch.autograd.grad(want, weight)
    w = distribute(weight.detach(), mesh, layout).requires_grad_()
    dtokens, dtarget = distribute(tokens, mesh, [Replicate()]), distribute(target, mesh, [Replicate()])
    with count_collectives() as seen:
        h = F.embedding(dtokens, w)
        loss = F.cross_entropy(h @ w.t(), dtarget)
        (grad,) = torch.autograd.grad(loss, w, torch.ones_like(loss))
    failures = []
    # all-reduces (some as reduce-scatter + all-gather) of h and of row statistics; the weight
    # gradients of the two uses meet in one layout (a permute of at most the weight's size)
    reduces = ("all_reduce", "reduce_scatter over gpuid + all_gather")
    exchanges = ("permute", "all_to_all")
    gathered = [kind for kind in seen.by_kind if not kind.startswith(reduces + exchanges)]
    permuted = sum(sent for kind, (_, sent) in seen.by_kind.items() if kind.startswith(exchanges))
    if gathered or permuted > weight.numel() * 8:
        failures.append(f"moved: {seen}")
    if not torch.allclose(loss.full_tensor(), want.detach()):
        failures.append("loss differs from torch")
    if not torch.allclose(grad.full_tensor(), reference):
        failures.append("the weight's gradient differs from torch's")
    return failures


@pytest.mark.parametrize("world_size", [2, 4])
def test_tied_embedding_and_loss_over_a_dealt_vocabulary(world_size):
    seed = int(torch.randint(0, 2**31 - 1, (1,)))
    results = run_on_ranks(_tied_dealt_vocab_case, world_size, args=(seed,), timeout_s=600)
    assert results == [[]] * world_size, (seed, results[0])


def _dealt_row_layouts(world_size):
    """(label, mesh, make(logits [N, C], target [N]) -> the two DTensors, N) of row maps with no
    placement form, every class whole in each piece: the batch-first logits of sequence
    parallelism flattened (``[B, S, C]`` in ``[Shard(1)]``, ``.view(-1, C)``, the targets likewise),
    rows round-robin in pairs, and (W = 4) sequence shards over tp replicated over dp."""
    from axedist.layout import Layout

    line = DeviceMesh("cpu", (world_size,))
    seq = 2 * world_size

    def flattened(logits, target, mesh=line):
        c = logits.shape[-1]
        return (distribute(logits.view(3, seq, c), mesh, [Shard(1)]).view(-1, c),
                distribute(target.view(3, seq), mesh, [Shard(1)]).view(-1))

    def pairs(logits, target, mesh=line):
        c = logits.shape[-1]
        return (distribute(logits, mesh, Layout.parse(f"S[(3,{world_size},2,{c}):({2 * c},1@gpuid,{c},1)]")),
                distribute(target, mesh, Layout.parse(f"S[(3,{world_size},2):(2,1@gpuid,1)]")))

    out = [("flattened sequence shards", line, flattened, 3 * seq), ("rows round-robin in pairs", line, pairs, 3 * seq)]
    if world_size == 4:
        grid = DeviceMesh("cpu", (2, 2), ("dp", "tp"))

        def over_tp(logits, target, mesh=grid):
            c = logits.shape[-1]
            return (distribute(logits.view(3, 4, c), mesh, [Replicate(), Shard(1)]).view(-1, c),
                    distribute(target.view(3, 4), mesh, [Replicate(), Shard(1)]).view(-1))

        out.append(("sequence shards over tp, replicated over dp", grid, over_tp, 12))
    return out


def _dealt_rows_case(rank, world_size, seed):
    """Cross-entropy of logits whose rows (with their targets) a layout with no placement form
    deals: nothing is gathered, forward or backward (mean's total weight is one all-reduced
    number); 'none' keeps the rows' map, 'sum' / 'mean' are pending sums; loss and logits'
    gradient equal torch's for every reduction, with an ignored target and per-class weights."""
    from axedist.layout import LayoutError
    from axedist.runtime import count_collectives

    g = torch.Generator().manual_seed(seed)
    classes = 5
    failures = []
    for label, mesh, make, rows in _dealt_row_layouts(world_size):
        for reduction, weighted in itertools.product(REDUCTIONS, (False, True)):
            logits = torch.randn(rows, classes, dtype=torch.float64, generator=g, requires_grad=True)
            target = torch.randint(0, classes, (rows,), generator=g)
            target[int(torch.randint(0, rows, (1,), generator=g))] = -100
            weight = torch.rand(classes, dtype=torch.float64, generator=g) + 0.5 if weighted else None
            want = F.cross_entropy(logits, target, weight=weight, reduction=reduction)
            dl, dt = make(logits.detach(), target)
            dl.requires_grad_()
            try:
                dl.placements
                failures.append(f"{label}: the logits have a placement form")
            except LayoutError:
                pass
            dw = None if weight is None else distribute(weight, mesh, [Replicate()] * mesh.ndim)
            what = f"{label}, {reduction}, weight {weighted}"
            with count_collectives() as seen:
                loss = F.cross_entropy(dl, dt, weight=dw, reduction=reduction)
            if [kind for kind in seen.by_kind if not kind.startswith("all_reduce")] or seen.bytes_sent > 8 * mesh.size():
                failures.append(f"{what}: the forward moved data ({seen})")
            if reduction == "none":
                failures += gathered(what, loss)
            if not torch.allclose(loss.full_tensor(), want.detach()):
                failures.append(f"{what}: loss differs from torch")
            up = torch.randn(want.shape, dtype=torch.float64, generator=g)
            whole = loss.full_tensor()
            with count_collectives() as seen:  # from the loss's gradient to the logits' (not full_tensor's own)
                (grad,) = torch.autograd.grad((whole * up).sum(), dl)
            if seen.calls:
                failures.append(f"{what}: the backward moved data ({seen})")
            (reference,) = torch.autograd.grad((want * up).sum(), logits)
            if not torch.allclose(grad.full_tensor(), reference):
                failures.append(f"{what}: the logits' gradient differs from torch's")
    return failures


@pytest.mark.parametrize("world_size", [2, 4])
def test_cross_entropy_of_rows_dealt_by_a_layout_without_placements(world_size):
    seed = int(torch.randint(0, 2**31 - 1, (1,)))
    results = run_on_ranks(_dealt_rows_case, world_size, args=(seed,), timeout_s=600)
    assert results == [[]] * world_size, (seed, results[0])
