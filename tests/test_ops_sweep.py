"""A sweep over the op table: random shapes, random placements of every input AND of the
incoming gradient, forward and backward equal to the single-process result, on 2 and 4 ranks.

The family tests (test_ops_*.py) back-propagate a replicated gradient; a sharded or pending
one reaches other backward rules (``select_backward`` once gave the local op the global
``input_sizes``: wrong-shaped local results). Every output and gradient is also checked for
what the wrapper reports against its local tensor and the plain result: dtype,
``requires_grad``, the conjugate / negative bits (a wrapper never carries them, so the local
tensor must not: a collective reads raw memory), and contiguity. fp64 and complex128; sizes
from 1 to 7, so uneven on both meshes.
"""

import random

import pytest
import torch
import torch.nn.functional as F

from axedist.dtensor import DTensor
from axedist.testing import run_on_ranks
from tests.ops_cases import TOL, Partial, Replicate, Shard, make, mesh_of, placement_sets, rand, randint


def _complex(g, *shape):
    return torch.complex(rand(g, *shape), rand(g, *shape))


def _rope(x, theta):
    """RoPE as torchtitan writes it: pairs of x as complex numbers times unit rotations."""
    z = torch.view_as_complex(x.reshape(*x.shape[:-1], -1, 2))
    return torch.view_as_real(z * torch.polar(torch.ones_like(theta), theta)).flatten(-2)


# name -> (function, inputs): an input is (dims over the sizes a, b, c, d, kind); kind "f" real,
# "c" complex, "t" class targets in [0, b), "i" indices in [0, a); size "e" is even (2 * h)
CASES = {
    "add": (lambda x, y: x + y, [("ab", "f"), ("ab", "f")]),
    "mul_broadcast": (lambda x, y: x * y, [("ab", "f"), ("b", "f")]),
    "rsub_scalar": (lambda x: 2.5 - x * 3, [("ab", "f")]),
    "div": (lambda x, y: x / (y * y + 1), [("ab", "f"), ("ab", "f")]),
    "exp_tanh_sigmoid": (lambda x: x.exp() + x.tanh() * x.sigmoid(), [("abc", "f")]),
    "gelu_silu": (lambda x: F.gelu(x) + F.silu(x), [("ab", "f")]),
    "where": (lambda x, y: torch.where(x > 0, x, y), [("ab", "f"), ("ab", "f")]),
    "masked_fill": (lambda x: x.masked_fill(x > 0.5, 0.25), [("ab", "f")]),
    "pow_clamp": (lambda x: x.clamp(-1, 1).pow(2), [("ab", "f")]),
    "sum_dim": (lambda x: x.sum(1), [("abc", "f")]),
    "sum_all": (lambda x: x.sum(), [("ab", "f")]),
    "mean_keepdim": (lambda x: x.mean(-1, keepdim=True), [("abc", "f")]),
    "amax": (lambda x: x.amax(0), [("ab", "f")]),
    "var": (lambda x: x.var(1), [("ab", "f")]),
    "softmax": (lambda x: F.softmax(x, -1), [("ab", "f")]),
    "log_softmax_0": (lambda x: F.log_softmax(x, 0), [("ab", "f")]),
    "rms_norm": (lambda x, w: F.rms_norm(x, (x.shape[-1],), w), [("abc", "f"), ("c", "f")]),
    "layer_norm": (lambda x, w, b: F.layer_norm(x, (x.shape[-1],), w, b), [("ab", "f"), ("b", "f"), ("b", "f")]),
    "mm": (lambda x, y: x @ y, [("ab", "f"), ("bc", "f")]),
    "bmm": (lambda x, y: torch.bmm(x, y), [("abc", "f"), ("acd", "f")]),
    "matmul_3d_2d": (lambda x, y: x @ y, [("abc", "f"), ("cd", "f")]),
    "linear": (lambda x, w, b: F.linear(x, w, b), [("abc", "f"), ("dc", "f"), ("d", "f")]),
    "flatten": (lambda x: x.flatten(0, 1), [("abc", "f")]),
    "reshape_split": (lambda x: x.reshape(x.shape[0], -1, 2), [("ae", "f")]),
    "transpose": (lambda x: x.transpose(0, 1), [("abc", "f")]),
    "permute_contiguous": (lambda x: x.permute(2, 0, 1).contiguous(), [("abc", "f")]),
    "channels_last": (lambda x: x.contiguous(memory_format=torch.channels_last) * 2, [("abcd", "f")]),
    "unsqueeze_expand": (lambda x: x.unsqueeze(1).expand(-1, 3, -1), [("ab", "f")]),
    "select": (lambda x: x.select(1, -1), [("abc", "f")]),
    "select_0": (lambda x: x[0], [("ab", "f")]),
    "slice": (lambda x: x[:, 1:], [("abc", "f")]),
    "narrow_0": (lambda x: x.narrow(0, 0, 1), [("ab", "f")]),
    "cat": (lambda x, y: torch.cat([x, y], 1), [("ab", "f"), ("ab", "f")]),
    "stack": (lambda x, y: torch.stack([x, y], 0), [("ab", "f"), ("ab", "f")]),
    "chunk": (lambda x: x.chunk(2, -1)[-1], [("ab", "f")]),
    "index_select": (lambda x, i: x.index_select(0, i), [("ab", "f"), ("c", "i")]),
    "embedding": (lambda i, w: F.embedding(i, w), [("c", "i"), ("ab", "f")]),
    "cross_entropy": (lambda x, t: F.cross_entropy(x, t), [("ab", "f"), ("a", "t")]),
    "to_float": (lambda x: x.float() * 2, [("ab", "f")]),  # a cast of a pending sum rounds each summand
    "complex_mul_conj": (lambda z, w: z.conj() * w, [("ab", "c"), ("ab", "c")]),
    "complex_abs": (lambda z: z.abs(), [("ab", "c")]),
    "real_imag": (lambda z: z.real * 2 + z.conj().imag, [("ab", "c")]),
    "view_as_complex": (lambda x: torch.view_as_complex(x.reshape(*x.shape[:-1], -1, 2)), [("ae", "f")]),
    "view_as_real": (lambda z: torch.view_as_real(z) * 1.5, [("ab", "c")]),
    "rope": (_rope, [("abe", "f"), ("bh", "f")]),
}


def _inputs(g, dims: dict, spec):
    shape_of = lambda text: tuple(dims[ch] for ch in text)   # noqa: E731
    out = []
    for text, kind in spec:
        shape = shape_of(text)
        if kind == "f":
            out.append(rand(g, *shape))
        elif kind == "c":
            out.append(_complex(g, *shape))
        elif kind == "t":
            out.append(torch.randint(0, dims["b"], shape, generator=g))
        else:  # "i"
            out.append(torch.randint(0, dims["a"], shape, generator=g))
    return out


def _tol(ref) -> dict:
    return TOL if ref.dtype in (torch.float64, torch.complex128) else dict(rtol=1e-5, atol=1e-6)


def _check_attributes(o, ref, what: str) -> None:
    """What the wrapper reports against its local tensor and the plain result."""
    local = o.to_local()
    assert o.dtype == ref.dtype == local.dtype, f"{what}: dtype {o.dtype} / local {local.dtype} / plain {ref.dtype}"
    assert o.requires_grad == ref.requires_grad, f"{what}: requires_grad {o.requires_grad}, plain {ref.requires_grad}"
    assert not o.is_conj() and not o.is_neg(), f"{what}: the wrapper carries a conjugate / negative bit"
    assert not local.is_conj() and not local.is_neg(), \
        f"{what}: the local tensor is marked conjugate={local.is_conj()} negative={local.is_neg()}, the wrapper is not"
    for form in (torch.contiguous_format, torch.channels_last) if o.dim() == 4 else (torch.contiguous_format,):
        assert o.is_contiguous(memory_format=form) == ref.is_contiguous(memory_format=form), \
            f"{what}: {form} {o.is_contiguous(memory_format=form)}, plain {ref.is_contiguous(memory_format=form)}"
        if o.is_contiguous(memory_format=form) and local.numel():
            assert local.is_contiguous(memory_format=form), \
                f"{what}: a {form} wrapper over a local tensor with strides {local.stride()}"


def _grad_placements(mesh, g, ref):
    """Random placements of a gradient of ``ref``'s shape: shards of its dims, Replicate, a pending sum."""
    options = [Replicate(), Partial()] + [Shard(d) for d in range(ref.dim())]
    sets = placement_sets(mesh, options)
    return sets[randint(g, 0, len(sets))]


def _sweep(rank, world_size, seed, names):
    mesh = mesh_of(str(world_size))
    g = torch.Generator().manual_seed(seed)
    ran = 0
    for name in names:
        fn, spec = CASES[name]
        dims = {k: randint(g, 2, 8) for k in "abcd"}
        dims["h"] = randint(g, 1, 4)
        dims["e"] = 2 * dims["h"]
        fulls = _inputs(g, dims, spec)
        for trial in range(2):
            what = f"seed {seed}, {name} trial {trial}, sizes {dims}"
            dts, refs = [], []
            for i, full in enumerate(fulls):
                options = [Replicate()] + [Shard(d) for d in range(full.dim())]
                if full.is_floating_point() or full.is_complex():
                    options.append(Partial())
                sets = placement_sets(mesh, options)
                placements = sets[randint(g, 0, len(sets))]
                grad = full.is_floating_point() or full.is_complex()
                dts.append(make(full, mesh, placements, seed + 31 * i + trial, requires_grad=grad))
                refs.append(full.clone().requires_grad_(grad))
                what += f", input {i} {placements}"
            ref = fn(*refs)
            out = fn(*dts)
            assert isinstance(out, DTensor), f"{what}: output is {type(out)}"
            assert out.shape == ref.shape, f"{what}: shape {out.shape}, plain {ref.shape}"
            torch.testing.assert_close(out.full_tensor(), ref.resolve_conj().resolve_neg(), **_tol(ref),
                                       msg=lambda m: f"{what}: output: {m}")
            _check_attributes(out, ref, f"{what}: output")
            if not ref.requires_grad:
                continue
            G = (_complex(g, *ref.shape) if ref.is_complex() else rand(g, *ref.shape))
            gp = _grad_placements(mesh, g, ref)
            ref.backward(G)
            out.backward(make(G, mesh, gp, seed + 7 + trial))
            for i, (d, r) in enumerate(zip(dts, refs)):
                if r.grad is None:
                    continue
                assert d.grad is not None, f"{what}, grad {gp}: input {i} got no gradient"
                assert isinstance(d.grad, DTensor), f"{what}, grad {gp}: input {i}'s gradient is {type(d.grad)}"
                torch.testing.assert_close(d.grad.full_tensor(), r.grad, **_tol(ref),
                                           msg=lambda m: f"{what}, grad {gp}: gradient of input {i}: {m}")
                _check_attributes(d.grad, r.grad, f"{what}, grad {gp}: gradient of input {i}")
            ran += 1
    return ran


def _batches():
    names = sorted(CASES)
    return [names[i::2] for i in range(2)]


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("batch", range(2))
def test_op_table_sweep(world, batch):
    seed = random.randrange(2**31)  # a fresh draw each run; failures name it
    ran = run_on_ranks(_sweep, world, args=(seed, _batches()[batch]), timeout_s=300)
    assert ran[0] > 0, seed


def _sharded_backward_sizes(rank, world_size):
    """select_backward / slice_backward with a gradient sharded on a dim the op keeps."""
    mesh = mesh_of(str(world_size))
    g = torch.Generator().manual_seed(5)
    x = rand(g, 10, 6, 3)
    for fn, where in ((lambda t: t[:, 2], [Shard(0)]), (lambda t: t[:, 1:4], [Shard(0)]),
                      (lambda t: t[:, 2, :], [Shard(1)]), (lambda t: t[1], [Shard(0)])):
        ref = x.clone().requires_grad_()
        y_ref = fn(ref)
        G = rand(g, *y_ref.shape)
        y_ref.backward(G)
        d = make(x, mesh, [Replicate()], 1, requires_grad=True)
        y = fn(d)
        y.backward(make(G, mesh, where, 2))
        torch.testing.assert_close(d.grad.full_tensor(), ref.grad, **TOL)
    return True


@pytest.mark.parametrize("world", [2, 4])
def test_select_and_slice_backward_take_local_sizes(world):
    assert run_on_ranks(_sharded_backward_sizes, world) == [True] * world
