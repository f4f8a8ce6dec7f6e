"""In-place ops that change their tensor's shape (``squeeze_``, ``unsqueeze_``, ``t_``,
``transpose_``, ``swapdims_``, ``as_strided_``, ``resize_``, ``resize_as_``), directly and inside
the torch kernels that call them on their own results (``matmul`` / ``linear`` of a 1-D input,
``quantile`` / ``nanquantile``, ``stft``, ``group_norm``'s backward): the DTensor takes the new
shape (issue 29: it kept its old one, a silently wrong result). Values, gradients, shapes and
each rank's local shape against the plain op, every input in Replicate, Shard(0), Shard(-1)
and mixes, on 2 ranks and a 2x2 mesh; and ``dt.layout`` is torch's (``torch.strided``), so
``torch.masked`` runs.
"""

import itertools
import warnings

import pytest
import torch
import torch.nn.functional as F

import axedist as ax
from axedist.dtensor import distribute, DTensor
from axedist.ops.specs import expected_local_shape
from axedist.spec import without_summands
from axedist.runtime import count_collectives
from axedist.testing import run_on_ranks
from tests.ops_cases import Replicate, Shard, mesh_of

R, S0, S1 = Replicate(), Shard(0), Shard(-1)


def _inplace(method, *args):
    """``method`` applied in place to a fresh non-leaf copy (autograd records the in-place op)."""
    def fn(x):
        y = x * 1.0
        result = getattr(y, method)(*args)
        assert result is y, f"{method} returned another tensor"
        return y
    return fn


def _resize_as(x, other):
    y = x * 1.0
    with torch.no_grad():  # resize_ is not differentiable in torch either
        y.resize_as_(other)
    return y


# name -> (function, input shapes, whether gradients are compared)
CASES = {
    "matmul 1-D @ 2-D": (lambda a, b: a @ b, [(12,), (12, 4)], True),
    "matmul 2-D @ 1-D": (lambda a, b: a @ b, [(4, 12), (12,)], True),
    "linear of a 1-D input": (lambda x, w, b: F.linear(x, w, b), [(12,), (5, 12), (5,)], True),
    "quantile": (lambda x, q: torch.quantile(x, q.detach().sigmoid(), dim=1), [(2, 6), (2,)], True),
    "quantile of all": (lambda x: torch.quantile(x, 0.3), [(4, 6)], True),
    "nanquantile": (lambda x: torch.nanquantile(x, 0.7, dim=0, keepdim=True), [(4, 6)], True),
    # stft's gradient is not compared: as_strided's backward index_adds plain index tensors (a clear error)
    "stft": (lambda x: torch.view_as_real(torch.stft(x, 8, window=torch.ones(8, dtype=x.dtype),
                                                     return_complex=True)), [(2, 32)], False),
    "group_norm": (lambda x, w, b: F.group_norm(x, 2, w, b), [(2, 4, 6), (4,), (4,)], True),
    "squeeze_": (_inplace("squeeze_"), [(4, 1, 6)], True),
    "squeeze_ dim": (_inplace("squeeze_", 1), [(4, 1, 6)], True),
    "squeeze_ dims": (_inplace("squeeze_", (0, 2)), [(1, 4, 1)], True),
    "unsqueeze_": (_inplace("unsqueeze_", 1), [(4, 6)], True),
    "unsqueeze_ last": (_inplace("unsqueeze_", -1), [(4, 6)], True),
    "t_": (_inplace("t_"), [(4, 6)], True),
    "transpose_": (_inplace("transpose_", 0, 2), [(2, 4, 6)], True),
    "swapdims_": (_inplace("swapdims_", 0, 1), [(4, 6)], True),
    "swapaxes_": (_inplace("swapaxes_", 1, 0), [(4, 6)], True),
    "as_strided_": (_inplace("as_strided_", (3, 4), (1, 3)), [(4, 6)], True),
    "resize_ same count": (_inplace("resize_", 6, 4), [(4, 6)], False),
    "resize_ smaller": (_inplace("resize_", 2, 5), [(4, 6)], False),
    "resize_ same shape": (_inplace("resize_", 4, 6), [(4, 6)], False),
    "resize_as_": (_resize_as, [(4, 6), (8, 3)], False),
}


def _options(shape) -> list:
    return [R] if not shape else [R, S0, S1]


def _run(fn, fulls, placements, mesh, grad, what):
    refs = [t.clone().requires_grad_(grad) for t in fulls]
    dts = [distribute(t, mesh, list(p)).requires_grad_(grad) for t, p in zip(fulls, placements)]
    want, got = fn(*refs), fn(*dts)
    assert isinstance(got, DTensor), f"{what}: got {type(got)}"
    assert got.shape == want.shape, f"{what}: shape {tuple(got.shape)}, plain {tuple(want.shape)}"
    assert got.dtype == want.dtype, f"{what}: dtype {got.dtype}, plain {want.dtype}"
    assert got.stride() == want.stride() or not want.is_contiguous(), \
        f"{what}: strides {got.stride()}, plain {want.stride()}"
    local = got.to_local()  # a pending reduction's: this rank's summand (torch's shape)
    assert tuple(local.shape) == expected_local_shape(without_summands(got._spec), None), \
        f"{what}: local shape {tuple(local.shape)} under {got._spec}"
    torch.testing.assert_close(got.full_tensor(), want, rtol=1e-9, atol=1e-9, msg=lambda m: f"{what}: {m}")
    if grad:
        up = torch.randn(want.shape, dtype=want.dtype, generator=torch.Generator().manual_seed(5))
        (want * up).sum().backward()
        (got * distribute(up, mesh, [R] * mesh.ndim)).sum().backward()
        for i, (d, r) in enumerate(zip(dts, refs)):
            if r.grad is None:  # an input the result does not depend on (quantile's q)
                assert d.grad is None, f"{what}: gradient {i}"
                continue
            assert d.grad is not None and d.grad.shape == r.grad.shape, f"{what}: gradient {i}"
            torch.testing.assert_close(d.grad.full_tensor(), r.grad, rtol=1e-9, atol=1e-9,
                                       msg=lambda m: f"{what}: gradient {i}: {m}")


def _cases(rank, world, mesh_name, names):
    warnings.simplefilter("ignore")  # gather-fallback warnings of the ops without rules
    mesh = mesh_of(mesh_name)
    g = torch.Generator().manual_seed(29)
    ran = 0
    for name in names:
        fn, shapes, grad = CASES[name]
        fulls = [torch.randn(s, dtype=torch.float64, generator=g) for s in shapes]
        per_input = [list(itertools.product(_options(s), repeat=mesh.ndim)) for s in shapes]
        combos = list(itertools.product(*per_input))
        # every combination where few, else the uniform ones and a sample of mixes
        if len(combos) > 12:
            uniform = [c for c in combos if len({tuple(map(str, p)) for p in c if len(p)}) <= 1]
            mixes = [combos[i] for i in torch.randperm(len(combos), generator=g)[:8].tolist()]
            combos = list(dict.fromkeys(uniform[:6] + mixes))
        for placements in combos:
            _run(fn, fulls, placements, mesh, grad, f"{name} {placements} on {mesh_name}")
            ran += 1
    return ran


@pytest.mark.parametrize("mesh_name", ["2", "2x2"])
def test_inplace_shape_changes_match_the_plain_ops(mesh_name):
    world = 2 if mesh_name == "2" else 4
    counts = run_on_ranks(_cases, world, args=(mesh_name, sorted(CASES)))
    assert counts[0] > len(CASES) and len(set(counts)) == 1


def _keeps_shards(rank, world):
    mesh = mesh_of("2")
    x = distribute(torch.randn(4, 1, 6, dtype=torch.float64), mesh, [S0])
    y = x * 1.0
    before = y.to_local().data_ptr()
    with count_collectives() as seen:
        y.squeeze_(1)
        y.unsqueeze_(0)
        y.transpose_(0, 1)
    # the views regroup the layout: nothing moves, the local tensor is a view of the old one
    assert seen.calls == 0, str(seen)
    assert y.shape == (4, 1, 6) and y.placements == (S0,) and y.to_local().shape == (2, 1, 6)
    assert y.to_local().data_ptr() == before
    y.add_(1.0)  # an in-place op after the shape change writes the new local tensor
    torch.testing.assert_close(y.full_tensor(), x.full_tensor().squeeze(1).unsqueeze(0).transpose(0, 1) + 1)
    return True


def test_inplace_views_keep_shards_and_move_nothing():
    assert run_on_ranks(_keeps_shards, 2) == [True, True]


def _clear_errors(rank, world):
    mesh = mesh_of("2")
    x = distribute(torch.randn(4, 6), mesh, [S0]).t()  # strides (1, 6): not its storage order
    messages = []
    for call in (lambda: x.as_strided_((6, 4), (4, 1)), lambda: x.resize_(24)):
        with pytest.raises(RuntimeError) as error:
            call()
        messages.append(str(error.value))
    return messages


def test_storage_order_ops_on_transposed_dtensors_are_clear_errors():
    for text in run_on_ranks(_clear_errors, 2)[0]:
        assert "contiguous" in text and ("as_strided_" in text or "resize_" in text), text


def _torch_layout(rank, world):
    mesh = mesh_of("2")
    g = torch.Generator().manual_seed(3)
    x = torch.randn(4, 6, dtype=torch.float64, generator=g)
    mask = torch.rand(4, 6, generator=g) > 0.3
    dx = distribute(x, mesh, [S0])
    dmask = distribute(mask, mesh, [S0])
    assert dx.layout is torch.strided
    assert dx.axe_layout == dx.axe_layout.parse("S[(2,2,6):(1@gpuid,6,1)]"), dx.axe_layout
    ops = {
        "sum": lambda t, m: torch.masked.sum(t, 1, mask=m),
        "mean": lambda t, m: torch.masked.mean(t, 0, mask=m),
        "amax": lambda t, m: torch.masked.amax(t, 1, mask=m),
        "amin": lambda t, m: torch.masked.amin(t, 1, mask=m),
        "prod": lambda t, m: torch.masked.prod(t, 1, mask=m),
        "softmax": lambda t, m: torch.masked.softmax(t, 1, mask=m),
        "log_softmax": lambda t, m: torch.masked.log_softmax(t, 1, mask=m),
        "norm": lambda t, m: torch.masked.norm(t, 2.0, 1, mask=m),
        "var": lambda t, m: torch.masked.var(t, 1, unbiased=False, mask=m),
        "std": lambda t, m: torch.masked.std(t, 1, unbiased=False, mask=m),
        "logsumexp": lambda t, m: torch.masked.logsumexp(t, 1, mask=m),
    }
    for name, op in ops.items():
        got, want = op(dx, dmask), op(x, mask)
        assert got.shape == want.shape, name
        torch.testing.assert_close(got.full_tensor(), want, equal_nan=True, msg=lambda m: f"masked.{name}: {m}")
    return len(ops)


def test_layout_is_torchs_and_torch_masked_runs():
    assert run_on_ranks(_torch_layout, 2) == [11, 11]
