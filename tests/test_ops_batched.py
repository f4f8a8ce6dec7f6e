"""Rules instead of the gather fallback (issue 29) for ops that act per batch position and mix
only a trailing core (``ops/batched.py``: linalg, tril/triu, diagonals, pools, upsampling,
padding, convolution, grid_sample, pixel_shuffle), and the ops given rules beside them: pointwise
(special functions, frexp, logsigmoid), the ``*_copy`` views, an FFT, vector products
(``ops/vector_products.py``), reductions, scatter/index ops, roll, repeat, glu, unfold, group norm
and the elementwise losses.

Each case runs forward and backward against the plain op on fresh random fp64 inputs, with every
tensor argument sharded on its first dim (a batch dim: kept), its last dim (a core dim: gathered
on that axis only) or replicated, on 2 ranks and on a 2x2 mesh, uneven batches included; the aten
ops each case names must not have run through the gather fallback, and where only batch dims
are sharded the forward of a local case moves no data (batches of 5: on 2x2 every rank holds some;
a batch that would leave a rank none is gathered instead). Where a layout with no placement form
deals whole matrices, the vectors of ``diag_embed``, or the samples of images and signals, those
ops run on each device's own where they are and the outputs keep the layout.
"""

import warnings

import pytest
import torch
import torch.nn.functional as F

from axedist.dtensor import DTensor
from axedist.runtime import count_collectives
from axedist.testing import run_on_ranks
from tests.ops_cases import Replicate, Shard, gathered, make, mesh_of

aten = torch.ops.aten


def _spd(g, *shape):
    a = torch.randn(*shape, dtype=torch.float64, generator=g)
    return a @ a.transpose(-1, -2) + shape[-1] * torch.eye(shape[-1], dtype=torch.float64)


def _well(g, *shape):
    return torch.randn(*shape, dtype=torch.float64, generator=g) + 4 * torch.eye(*shape[-2:], dtype=torch.float64)


def _randn(g, *shape):
    return torch.randn(*shape, dtype=torch.float64, generator=g)


def _positive(g, *shape):
    return torch.rand(*shape, dtype=torch.float64, generator=g) + 1.5


def _first(value):
    return value[0] if isinstance(value, (tuple, list)) else value


# name -> (function of the inputs, [(maker, shape)], aten ops that must not fall back,
#          forward local when only dim 0 is sharded, differentiable)
CASES = {
    "tril": (lambda x: x.tril(1), [(_randn, (5, 4, 4))], ("aten.tril",), True, True),
    "triu": (lambda x: x.triu(-1), [(_randn, (5, 4, 5))], ("aten.triu",), True, True),
    "inv": (torch.linalg.inv, [(_well, (5, 3, 3))], ("aten.linalg_inv_ex",), False, True),
    "solve": (torch.linalg.solve, [(_well, (5, 3, 3)), (_randn, (5, 3, 2))],
              ("aten._linalg_solve_ex", "aten.linalg_lu_solve"), False, True),
    "solve vector": (torch.linalg.solve, [(_well, (5, 3, 3)), (_randn, (5, 3))],
                     ("aten._linalg_solve_ex", "aten.linalg_lu_solve"), False, True),
    "cholesky": (torch.linalg.cholesky, [(_spd, (5, 3, 3))],
                 ("aten.linalg_cholesky_ex", "aten.linalg_solve_triangular", "aten.tril"), False, True),
    "solve_triangular": (lambda a, b: torch.linalg.solve_triangular(a.triu(), b, upper=True),
                         [(_well, (5, 4, 4)), (_randn, (5, 4, 2))], ("aten.linalg_solve_triangular", "aten.triu"),
                         True, True),
    "svdvals": (torch.linalg.svdvals, [(_randn, (5, 4, 3))], ("aten._linalg_svd",), True, True),
    "eigvalsh": (torch.linalg.eigvalsh, [(_spd, (5, 4, 4))], ("aten._linalg_eigh",), True, True),
    "qr": (torch.linalg.qr, [(_well, (5, 4, 3))], ("aten.linalg_qr",), True, True),
    "slogdet": (lambda a: torch.linalg.slogdet(a)[1], [(_well, (5, 3, 3))], ("aten._linalg_slogdet",), True, True),
    "det": (torch.linalg.det, [(_well, (5, 3, 3))], ("aten._linalg_det",), True, True),
    "lu_factor + lu_solve": (lambda a, b: torch.linalg.lu_solve(*torch.linalg.lu_factor(a), b),
                             [(_well, (5, 3, 3)), (_randn, (5, 3, 2))],
                             ("aten.linalg_lu_factor_ex", "aten.linalg_lu_solve", "aten.lu_unpack"), False, True),
    "pinv": (torch.linalg.pinv, [(_well, (5, 4, 3))], ("aten.linalg_pinv",), True, True),
    "diagonal": (lambda x: x.diagonal(1, 1, 2), [(_randn, (5, 4, 6))], ("aten.diagonal",), True, True),
    "diagonal dims 0 2": (lambda x: torch.diagonal(x, -1, 0, 2), [(_randn, (4, 5, 4))], ("aten.diagonal",),
                          False, True),
    "diag_embed": (lambda x: torch.diag_embed(x, 1), [(_randn, (5, 3))], ("aten.diag_embed",), True, True),
    "diagonal_scatter": (lambda x, s: x.diagonal_scatter(s, 0, 1, 2), [(_randn, (5, 3, 3)), (_randn, (5, 3))],
                         ("aten.diagonal_scatter",), True, True),
    "avg_pool2d": (lambda x: F.avg_pool2d(x, 2), [(_randn, (5, 2, 4, 4))], ("aten.avg_pool2d",), True, True),
    "max_pool2d": (lambda x: F.max_pool2d(x, 2), [(_randn, (5, 2, 4, 6))], ("aten.max_pool2d_with_indices",),
                   True, True),
    "adaptive_avg_pool2d": (lambda x: F.adaptive_avg_pool2d(x, 3), [(_randn, (5, 2, 5, 4))],
                            ("aten._adaptive_avg_pool2d",), True, True),
    "interpolate nearest": (lambda x: F.interpolate(x, scale_factor=2), [(_randn, (5, 2, 3, 3))],
                            ("aten.upsample_nearest2d",), True, True),
    "interpolate bilinear": (lambda x: F.interpolate(x, size=(5, 4), mode="bilinear"), [(_randn, (5, 2, 3, 3))],
                             ("aten.upsample_bilinear2d",), True, True),
    "pad reflect": (lambda x: F.pad(x, (2, 1), mode="reflect"), [(_randn, (5, 3, 6))],
                    ("aten.reflection_pad1d",), True, True),
    # 2 channels over 2x2 leave two ranks none, which reflection_pad1d refuses: gathered on that dim
    "pad reflect 2 channels": (lambda x: F.pad(x, (2, 1), mode="reflect"), [(_randn, (2, 6))],
                            ("aten.reflection_pad1d",), False, True),
    "conv2d": (lambda x, w, b: F.conv2d(x, w, b, padding=1), [(_randn, (5, 3, 5, 5)), (_randn, (4, 3, 3, 3)),
                                                               (_randn, (4,))],
               ("aten.convolution",), False, True),
    "grid_sample": (lambda x, grid: F.grid_sample(x, grid.tanh(), align_corners=False),
                    [(_randn, (5, 2, 4, 4)), (_randn, (5, 3, 3, 2))], ("aten.grid_sampler_2d",), False, True),
    "pixel_shuffle": (lambda x: F.pixel_shuffle(x, 2), [(_randn, (5, 8, 2, 3))], ("aten.pixel_shuffle",),
                      True, True),
    "irfft": (lambda x: torch.fft.irfft(x, n=8), [(_randn, (5, 5))], ("aten._fft_c2r",), False, True),
    "polygamma": (lambda x: torch.polygamma(2, x), [(_positive, (5, 4))], ("aten.polygamma",), True, True),
    "special.i1": (torch.special.i1, [(_randn, (5, 4))], ("aten.special_i1",), True, True),
    "xlog1py": (torch.special.xlog1py, [(_randn, (5, 4)), (_positive, (5, 4))], ("aten.special_xlog1py",),
                True, True),
    "logsigmoid": (F.logsigmoid, [(_randn, (5, 4))], ("aten.log_sigmoid",), True, True),
    "frexp": (lambda x: torch.frexp(x), [(_randn, (5, 4))], ("aten.frexp",), True, False),
    "t_copy": (torch.t_copy, [(_randn, (5, 4))], ("aten.t_copy",), True, True),
    "permute_copy": (lambda x: torch.permute_copy(x, (2, 0, 1)), [(_randn, (5, 3, 4))], ("aten.permute_copy",),
                     True, True),
    # the other rules added beside the batched family
    "dot": (torch.dot, [(_randn, (7,)), (_randn, (7,))], ("aten.dot",), False, True),
    "mv": (torch.mv, [(_randn, (5, 3)), (_randn, (3,))], ("aten.mv",), False, True),
    "addmv": (lambda s, a, v: torch.addmv(s, a, v, beta=0.5, alpha=2.0), [(_randn, (5,)), (_randn, (5, 3)),
                                                                         (_randn, (3,))],
              ("aten.addmv", "aten.mv"), False, True),
    "addr": (torch.addr, [(_randn, (5, 4)), (_randn, (5,)), (_randn, (4,))], ("aten.addr",), False, True),
    "nansum": (lambda x: x.masked_fill(x > 1, float("nan")).nansum(0), [(_randn, (5, 4))], ("aten.nansum",),
               False, True),
    "norm p=3": (lambda x: torch.norm(x, 3, dim=1), [(_randn, (5, 4))], ("aten.norm",), False, True),
    "count_nonzero": (lambda x: (x > 0).count_nonzero(1), [(_randn, (5, 4))], ("aten.count_nonzero",), True,
                      False),
    "scatter_reduce amax": (lambda x, s: x.scatter_reduce(1, _index_like(x, s), s, "amax"),
                            [(_randn, (5, 4)), (_randn, (5, 3))], ("aten.scatter_reduce",), False, True),
    "index_reduce prod": (lambda x, s: x.index_reduce(1, _indices(x, [0, 2, 0]), s, "prod"),
                          [(_randn, (5, 4)), (_randn, (5, 3))], ("aten.index_reduce",), False, True),
    "index_fill": (lambda x: x.index_fill(1, _indices(x, [0, 2]), 1.5), [(_randn, (5, 4))], ("aten.index_fill",),
                   False, True),
    "roll": (lambda x: x.roll(2, 1), [(_randn, (5, 4))], ("aten.roll",), False, True),
    "repeat": (lambda x: x.repeat(2, 1, 3), [(_randn, (5, 4))], ("aten.repeat",), False, True),
    "glu": (lambda x: F.glu(x, 1), [(_randn, (5, 4))], ("aten.glu",), False, True),
    "unfold": (lambda x: x.unfold(1, 3, 2), [(_randn, (5, 7))], ("aten.unfold",), False, True),
    "slice_scatter": (lambda x, s: x.slice_scatter(s, 1, 1, 3), [(_randn, (5, 4)), (_randn, (5, 2))],
                      ("aten.slice_scatter",), False, True),
    "select_scatter": (lambda x, s: x.select_scatter(s, 1, 2), [(_randn, (5, 4)), (_randn, (5,))],
                       ("aten.select_scatter",), False, True),
    "group_norm": (lambda x, w, b: F.group_norm(x, 2, w, b), [(_randn, (5, 4, 3)), (_randn, (4,)), (_randn, (4,))],
                   ("aten.native_group_norm",), False, True),
    "mse_loss mean": (F.mse_loss, [(_randn, (5, 4)), (_randn, (5, 4))], ("aten.mse_loss",), False, True),
    "huber_loss sum": (lambda x, y: F.huber_loss(x, y, reduction="sum", delta=0.5), [(_randn, (5, 4)),
                                                                                   (_randn, (5, 4))],
                       ("aten.huber_loss",), False, True),
    "soft_margin none": (lambda x, y: F.soft_margin_loss(x, y.detach().sign(), reduction="none"),
                         [(_randn, (5, 4)), (_randn, (5, 4))], ("aten.soft_margin_loss",), True, True),
    "bce_with_logits mean": (lambda x, y: F.binary_cross_entropy_with_logits(x, y.sigmoid()),
                             [(_randn, (5, 4)), (_randn, (5, 4))], ("aten.binary_cross_entropy_with_logits",),
                             False, True),
}


def _indices(like, values):
    """A replicated index DTensor (a plain tensor for the plain op)."""
    index = torch.tensor(values)
    if isinstance(like, DTensor):
        return make(index, like.mesh, [Replicate()] * like.mesh.ndim, 3)
    return index


def _index_like(x, s):
    """scatter's index: the shape of ``s``, values in ``x``'s dim 1, laid out as ``s``."""
    index = (torch.arange(s.numel()).reshape(s.shape) * 7 % x.shape[1])
    if isinstance(s, DTensor):
        return make(index, s.mesh, s.placements, 3)
    return index


def _outputs(value) -> list:
    return list(value) if isinstance(value, (tuple, list)) else [value]


def _shardings(mesh_name):
    if mesh_name == "2":
        return [[Replicate()], [Shard(0)], [Shard(-1)]]
    return [[Shard(0), Shard(0)], [Shard(0), Shard(-1)], [Shard(-1), Replicate()]]


def _case(rank, world, mesh_name, names):
    warnings.simplefilter("ignore")
    mesh = mesh_of(mesh_name)
    g = torch.Generator().manual_seed(29)
    ran = 0
    for name in names:
        fn, inputs, ops, local, differentiable = CASES[name]
        for placements in _shardings(mesh_name):
            DTensor.dispatcher.forget_fallbacks()
            what = f"{name} {placements} on {mesh_name}"
            fulls = [maker(g, *shape) for maker, shape in inputs]
            xs = [make(f, mesh, placements, 5, requires_grad=differentiable) for f in fulls]
            refs = [f.clone().requires_grad_(differentiable) for f in fulls]
            with count_collectives() as seen:
                got = fn(*xs)
            want = fn(*refs)
            if local and all(p == Shard(0) or p == Replicate() for p in placements):
                assert seen.calls == 0, f"{what}: moved data: {seen}"
            for k, (o, w) in enumerate(zip(_outputs(got), _outputs(want))):
                assert o.shape == w.shape and o.dtype == w.dtype, f"{what}: output {k}: {o.shape} {w.shape}"
                torch.testing.assert_close(o.full_tensor(), w, rtol=1e-7, atol=1e-9,
                                           msg=lambda m: f"{what}: output {k}: {m}")
            if differentiable:
                ups = [torch.randn(w.shape, dtype=w.dtype, generator=g) for w in _outputs(want)]
                sum((w * u).sum() for w, u in zip(_outputs(want), ups)).backward()
                sum((o * make(u, mesh, [Replicate()] * mesh.ndim, 1)).sum()
                    for o, u in zip(_outputs(got), ups)).backward()
                for i, (x, ref) in enumerate(zip(xs, refs)):
                    if ref.grad is None:  # (an input the op does not differentiate: a loss's target)
                        assert x.grad is None, f"{what}: gradient {i}: a tensor, plain None"
                        continue
                    torch.testing.assert_close(x.grad.full_tensor(), ref.grad, rtol=1e-7, atol=1e-9,
                                               msg=lambda m: f"{what}: gradient {i}: {m}")
            fell = [str(f) for f in DTensor.dispatcher.fallback_ops() if str(f).startswith(ops)]
            assert not fell, f"{what}: gathered through the fallback: {fell}"
            ran += 1
    return ran


_NAMES = list(CASES)
_HALVES = [_NAMES[: len(_NAMES) // 3], _NAMES[len(_NAMES) // 3: 2 * len(_NAMES) // 3], _NAMES[2 * len(_NAMES) // 3:]]


@pytest.mark.parametrize("half", [0, 1, 2])
@pytest.mark.parametrize("mesh_name", ["2", "2x2"])
def test_batched_ops_match_the_plain_ops_without_the_fallback(mesh_name, half):
    names = _HALVES[half]
    counts = run_on_ranks(_case, 2 if mesh_name == "2" else 4, args=(mesh_name, names))
    assert counts == [3 * len(names)] * len(counts)


def _non_finite(rank, world, op, seed):
    mesh = mesh_of("2")
    generator = torch.Generator().manual_seed(seed)
    full = torch.randn(4, 3, 3, dtype=torch.float64, generator=generator)
    full = full + full.transpose(-1, -2)          # symmetric: eigh's input too
    full[3, 1, 1] = float("nan")                  # a matrix of rank 1's batch half
    x = DTensor.from_local(full.chunk(world)[rank], mesh, [Shard(0)])
    fn = {"svd": torch.linalg.svd, "eigh": torch.linalg.eigh, "eig": torch.linalg.eig}[op]
    try:
        fn(x)
    except Exception as error:  # noqa: BLE001 - every rank reports what it raised
        return type(error).__name__, str(error)
    return None


@pytest.mark.parametrize("op", ["svd", "eigh", "eig"])
def test_a_matrix_that_does_not_converge_raises_on_every_rank(op):
    """Sharded by batch, only rank 1 holds the matrix with a NaN; torch raises for it there. Every
    rank raises a clear error naming rank 1 (not: rank 1 alone, the others going on)."""
    if op != "svd" and not _raises_on_nan(op):
        pytest.skip(f"this torch's {op} does not raise for a NaN matrix")
    outcomes = run_on_ranks(_non_finite, 2, args=(op, torch.randint(0, 1 << 30, ()).item()))
    for outcome in outcomes:
        assert outcome is not None and outcome[0] == "DispatchError", outcomes
        assert "mesh rank(s) [1]" in outcome[1], outcomes
    assert "here:" in outcomes[1][1] and "not here" in outcomes[0][1], outcomes


def _raises_on_nan(op) -> bool:
    nan = torch.full((3, 3), float("nan"), dtype=torch.float64)
    try:
        {"eigh": torch.linalg.eigh, "eig": torch.linalg.eig}[op](nan)
    except RuntimeError:
        return True
    return False


def _dealt_matrices(world):
    """(label, mesh, batch, layout(core shape)) of whole matrices dealt by layouts with no
    placement form: round-robin, round-robin in pairs, round-robin over tp replicated over dp."""
    from axedist.layout import Layout
    from axedist.mesh import DeviceMesh

    def laid(text):
        def layout(core):
            inner = ",".join(str(c) for c in core)
            strides = [1] * len(core)
            for i in range(len(core) - 2, -1, -1):
                strides[i] = strides[i + 1] * core[i + 1]
            size = strides[0] * core[0] if core else 1
            return Layout.parse(text.format(core=("," + inner) if core else "", size=size,
                                            pair=2 * size, strides="".join(f",{s}" for s in strides)))
        return layout

    mesh = DeviceMesh("cpu", (world,))
    out = [("round-robin", mesh, 2 * world, laid(f"S[(2,{world}{{core}}):({{size}},1@gpuid{{strides}})]")),
           ("round-robin in pairs", mesh, 4 * world,
            laid(f"S[(2,{world},2{{core}}):({{pair}},1@gpuid,{{size}}{{strides}})]"))]
    if world == 4:
        grid = DeviceMesh("cpu", (2, 2), ("dp", "tp"))
        out.append(("round-robin over tp, replicated over dp", grid, 4,
                    laid("S[(2,2{core}):({size},1@tp{strides})] + R[2:1@dp]")))
    return out


# name -> (function, [(maker, core shape, dealt: else replicated)], data moves in the forward: the one
# gather of a failure flag per matrix where torch raises for a failed matrix, which every rank must see;
# svd's agreement on matrices that do not converge is an all-reduce in its local step, not a move)
_IN_PLACE_CASES = {
    "inv": (torch.linalg.inv, [(_well, (3, 3), True)], 1),
    "det": (torch.linalg.det, [(_well, (3, 3), True)], 0),
    "solve": (torch.linalg.solve, [(_well, (3, 3), True), (_randn, (3, 2), True)], 1),
    "solve, replicated right-hand sides": (torch.linalg.solve, [(_well, (3, 3), True), (_randn, (3, 2), False)], 1),
    "solve vector": (torch.linalg.solve, [(_well, (3, 3), True), (_randn, (3,), True)], 1),
    "cholesky": (torch.linalg.cholesky, [(_spd, (4, 4), True)], 1),
    "qr": (lambda a: torch.linalg.qr(a).R, [(_well, (4, 3), True)], 0),
    "tril": (lambda a: a.tril(-1), [(_randn, (3, 4), True)], 0),
    "svdvals": (torch.linalg.svdvals, [(_randn, (4, 3), True)], 0),
}


def _matrices_in_place_case(rank, world, seed):
    """Each op on batches of matrices whose layout deals them whole: values and every input's
    gradient equal torch's on the whole batch; the forward moves no matrix (its only move is the
    agreement on failed matrices where torch raises for one) and the output keeps the
    layout (no placement form). qr's backward halves a diagonal in place: a view of each
    device's own matrices."""
    from axedist.dtensor import distribute

    g = torch.Generator().manual_seed(seed)
    failures = []
    for label, mesh, batch, layout in _dealt_matrices(world):
        for name, (fn, args, collectives) in _IN_PLACE_CASES.items():
            what = f"{name}, {label}"
            plain = [maker(g, batch, *core).requires_grad_() for maker, core, _ in args]
            dist_args = [distribute(p.detach(), mesh, layout(core) if dealt else [Replicate()] * mesh.ndim)
                         .requires_grad_() for p, (_, core, dealt) in zip(plain, args)]
            with count_collectives() as seen:
                got = fn(*dist_args)
            want = fn(*plain)
            if seen.calls != collectives:
                failures.append(f"{what}: {seen.calls} moves in the forward, not {collectives}")
            failures += _kept_values_and_gradients(what, got, want, dist_args, plain, g, moves_back=False)
    return failures


def _kept_values_and_gradients(what, got, want, dist_args, plain, g, moves_back: bool = True) -> list[str]:
    """The failures of a layout way's output against torch's: gathered into placement form,
    other values, a move in the backward (where ``moves_back`` counts them), another gradient of
    any argument."""
    failures = gathered(what, got)
    if not torch.allclose(got.full_tensor(), want):
        failures.append(f"{what}: values differ from torch's")
    up = torch.randn(want.shape, dtype=torch.float64, generator=g)
    loss = (got.full_tensor() * up).sum()
    with count_collectives() as seen:
        loss.backward()
    (want * up).sum().backward()
    if moves_back and seen.calls:
        failures.append(f"{what}: {seen.calls} moves in the backward")
    for i, (d, p) in enumerate(zip(dist_args, plain)):
        if d.grad is None or not torch.allclose(d.grad.full_tensor(), p.grad):
            failures.append(f"{what}: the gradient of argument {i} differs from torch's")
    return failures


@pytest.mark.parametrize("world", [2, 4])
def test_matrix_functions_run_where_a_layout_without_placements_deals_the_matrices(world, seed):
    results = run_on_ranks(_matrices_in_place_case, world, args=(seed,), timeout_s=600)
    assert results == [[]] * world, results[0]


# name -> f(v) of vectors v (batch, 3) dealt whole: the diagonal in the output's last two dims
_EMBEDDED = {
    "diag_embed": torch.diag_embed,
    "diag_embed above the diagonal": lambda v: torch.diag_embed(v, 1),
    "diag_embed below the diagonal, its dims swapped": lambda v: torch.diag_embed(v, -2, dim1=-1, dim2=-2),
}
# name -> f(v) of vectors v (batch, batch) dealt whole, the diagonal elsewhere: the placement way (the first
# case's output (batch, batch, batch) leads with the batch's size, but not with the batch)
_EMBEDDED_ELSEWHERE = {
    "diag_embed into the first two dims": lambda v: torch.diag_embed(v, 0, 0, 1),
    "diag_embed around the batch": lambda v: torch.diag_embed(v, 1, 0, 2),
}


def _vectors_embedded_in_place(rank, world, seed):
    """``torch.diag_embed`` of vectors whose layout deals them whole (each vector whole and
    innermost in every piece), the diagonal in the output's last two dims: each device embeds its
    own vectors, the matrices keep the vectors' map and the backward (``diagonal``) takes the
    gradient back where it is, the vectors' map; no move forward or backward; values and the
    gradient equal torch's. A diagonal elsewhere, and vectors split over devices (each one's
    entries round-robin), take the placement way with torch's values and gradient."""
    from axedist.dtensor import distribute
    from axedist.layout import Layout

    g = torch.Generator().manual_seed(seed)
    failures = []
    for label, mesh, batch, layout in _dealt_matrices(world):
        for name, fn in _EMBEDDED.items():
            what = f"{name}, {label}"
            v = _randn(g, batch, 3).requires_grad_()
            dv = distribute(v.detach(), mesh, layout((3,))).requires_grad_()
            with count_collectives() as seen:
                got = fn(dv)
            want = fn(v)
            if seen.calls:
                failures.append(f"{what}: {seen.calls} moves in the forward")
            if got._spec.layout != layout(tuple(want.shape[1:])):
                failures.append(f"{what}: the output laid out as {got._spec.layout}, not in the vectors' map")
            failures += _kept_values_and_gradients(what, got, want, [dv], [v], g)
            if dv.grad is not None and dv.grad._spec.layout != layout((3,)):
                failures.append(f"{what}: the gradient laid out as {dv.grad._spec.layout}, not as the vectors")
        others = [(name, fn, layout((batch,)), (batch, batch)) for name, fn in _EMBEDDED_ELSEWHERE.items()]
        if mesh.ndim == 1:
            split = Layout.parse(f"S[({batch},2,{world}):(2,1,1@gpuid)]")
            others.append(("diag_embed of vectors split over devices", torch.diag_embed, split, (batch, 2 * world)))
        for name, fn, laid, shape in others:
            what = f"{name}, {label}"
            v = _randn(g, *shape).requires_grad_()
            dv = distribute(v.detach(), mesh, laid).requires_grad_()
            got, want = fn(dv), fn(v)
            up = _randn(g, *want.shape)
            (got.full_tensor() * up).sum().backward()
            (want * up).sum().backward()
            if not torch.allclose(got.full_tensor(), want):
                failures.append(f"{what}: values differ from torch's")
            if dv.grad is None or not torch.allclose(dv.grad.full_tensor(), v.grad):
                failures.append(f"{what}: the gradient differs from torch's")
    return failures


@pytest.mark.parametrize("world", [2, 4])
def test_diag_embed_runs_where_a_layout_without_placements_deals_the_vectors(world, seed):
    results = run_on_ranks(_vectors_embedded_in_place, world, args=(seed,), timeout_s=600)
    assert results == [[]] * world, results[0]


# name -> (function, [(maker, shape, dealt)]): a dealt argument is (samples, *shape) laid out as the
# matrices above, its samples whole on a device; the others (weights, biases) replicated DTensors
_SAMPLE_CASES = {
    "max_pool1d": (lambda x: F.max_pool1d(x, 2), [(_randn, (3, 8), True)]),
    "max_pool2d": (lambda x: F.max_pool2d(x, 2, stride=1), [(_randn, (3, 5, 5), True)]),
    "max_pool2d unbatched, the channels dealt": (lambda x: F.max_pool2d(x, 2), [(_randn, (4, 6), True)]),
    "avg_pool2d": (lambda x: F.avg_pool2d(x, 2, padding=1), [(_randn, (3, 5, 4), True)]),
    "adaptive_avg_pool2d": (lambda x: F.adaptive_avg_pool2d(x, (2, 3)), [(_randn, (3, 5, 6), True)]),
    "interpolate nearest": (lambda x: F.interpolate(x, scale_factor=2, mode="nearest"), [(_randn, (2, 3, 4), True)]),
    "interpolate bilinear": (lambda x: F.interpolate(x, size=(5, 4), mode="bilinear"), [(_randn, (2, 3, 3), True)]),
    "pad reflect": (lambda x: F.pad(x, (2, 1, 1, 2), mode="reflect"), [(_randn, (2, 4, 5), True)]),
    "grid_sample": (lambda x, grid: F.grid_sample(x, grid.tanh(), align_corners=False),
                    [(_randn, (2, 4, 4), True), (_randn, (3, 3, 2), True)]),
    "pixel_shuffle": (lambda x: F.pixel_shuffle(x, 2), [(_randn, (8, 2, 3), True)]),
    "conv1d": (lambda x, w, b: F.conv1d(x, w, b, padding=1),
               [(_randn, (3, 7), True), (_randn, (4, 3, 3), False), (_randn, (4,), False)]),
    "conv2d": (lambda x, w, b: F.conv2d(x, w, b, stride=2, padding=1),
               [(_randn, (3, 5, 5), True), (_randn, (4, 3, 3, 3), False), (_randn, (4,), False)]),
    "group_norm": (lambda x, w, b: F.group_norm(x, 2, w, b),
                   [(_randn, (4, 3, 3), True), (_randn, (4,), False), (_randn, (4,), False)]),
}


def _samples_in_place_case(rank, world, seed):
    """Each op on samples whose layout deals them whole (as the matrices above): values and the
    gradient of every input, weights and biases included, equal torch's on the whole batch; the
    forward and the backward move no data (a weight's gradient is each device's pending sum,
    reduced only where it is read) and the output keeps the layout (no placement form)."""
    from axedist.dtensor import distribute

    g = torch.Generator().manual_seed(seed)
    failures = []
    for label, mesh, batch, layout in _dealt_matrices(world):
        for name, (fn, args) in _SAMPLE_CASES.items():
            what = f"{name}, {label}"
            plain = [maker(g, *((batch, *shape) if dealt else shape)).requires_grad_() for maker, shape, dealt in args]
            dist_args = [distribute(p.detach(), mesh, layout(shape) if dealt else [Replicate()] * mesh.ndim)
                         .requires_grad_() for p, (_, shape, dealt) in zip(plain, args)]
            with count_collectives() as seen:
                got = fn(*dist_args)
            want = fn(*plain)
            if seen.calls:
                failures.append(f"{what}: {seen.calls} moves in the forward")
            failures += _kept_values_and_gradients(what, got, want, dist_args, plain, g)
    return failures


@pytest.mark.parametrize("world", [2, 4])
def test_image_ops_run_where_a_layout_without_placements_deals_the_samples(world, seed):
    results = run_on_ranks(_samples_in_place_case, world, args=(seed,), timeout_s=600)
    assert results == [[]] * world, results[0]
