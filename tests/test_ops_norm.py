"""Softmax, layer norm and RMS norm on DTensors (ops/norm.py) against whole-tensor references.

On 2 and 4 ranks and a 2x2 mesh, fp64 inputs of random (often uneven) shapes in random
placements: outputs and gradients (input, weight, bias) must equal the single-device ones.
Softmax over a sharded dim keeps the dim sharded (all-reduced max and sum, no gather); norms
keep their batch/sequence shards, and with a sequence-sharded input the weight and bias
gradients are pending sums over the sequence axis (sequence parallelism), equal after
``full_tensor`` to the single-device gradients. RMS norm is checked both as CPU torch
dispatches it (a decomposition into pointwise ops, mean and sum) and through the fused aten
ops CUDA dispatches (``_fused_rms_norm`` and its backward, called directly).
"""

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from axedist.dtensor import DTensor
from axedist.testing import run_on_ranks
from tests.ops_cases import (MESHES, WORLD, Partial, Replicate, Shard, check, close, make, mesh_of, rand,
                       randint, sample_sets)

aten = torch.ops.aten
OPTIONS = [Shard(0), Shard(1), Shard(2), Replicate(), Partial()]


def _same_shards(xp, what, normalized=()):
    """Outputs keep the input's shards (but on normalized dims) and carry nothing pending."""
    def run(outs):
        for axis, p in enumerate(xp):
            o = outs[0].placements[axis]
            if isinstance(p, Shard) and p.dim not in normalized:
                assert o == p, f"{what}: {outs[0].placements}"
            else:
                assert o == Replicate(), f"{what}: {outs[0].placements}"
    return run


def _softmax(rank, world_size, mesh_name, seed, piece_elements=None):
    if piece_elements:   # the sharded (log-)softmax and its backward then run piece by piece
        from axedist.ops import norm
        norm.PIECE_ELEMENTS = piece_elements
    mesh = mesh_of(mesh_name)
    g = torch.Generator().manual_seed(seed)
    shape = tuple(randint(g, 1, 7) for _ in range(3))
    X = rand(g, *shape) * 3
    for xp in sample_sets(mesh, OPTIONS, g, 4):
        d = randint(g, -3, 3)
        what = f"seed {seed}, mesh {mesh_name}, shape {shape}, x {xp}, dim {d}"
        check(lambda x: x.softmax(d), [(X, xp)], mesh, seed, g, f"softmax {what}", _same_shards(xp, what))
        check(lambda x: F.log_softmax(x, d), [(X, xp)], mesh, seed, g, f"log_softmax {what}", _same_shards(xp, what))
        # the backward ops directly, with a gradient that is a pending sum
        Y = X.softmax(d)
        gp = [Partial() if isinstance(p, Replicate) else p for p in xp]
        yp = [Replicate() if isinstance(p, Partial) else p for p in xp]
        check(lambda gr, y: torch.ops.aten._softmax_backward_data(gr, y, d, torch.float64),
              [(rand(g, *shape), gp), (Y, yp)], mesh, seed, g, f"softmax backward {what}", backward=False)
        check(lambda gr, y: torch.ops.aten._log_softmax_backward_data(gr, y, d, torch.float64),
              [(rand(g, *shape), gp), (Y.log(), yp)], mesh, seed, g, f"log_softmax backward {what}", backward=False)
    return True


def _layer_norm(rank, world_size, mesh_name, seed):
    mesh = mesh_of(mesh_name)
    g = torch.Generator().manual_seed(seed)
    shape = tuple(randint(g, 1, 6) for _ in range(2)) + (randint(g, 2, 6),)
    X = rand(g, *shape) * 2 + 1
    for xp in sample_sets(mesh, OPTIONS, g, 4):
        k = randint(g, 1, 3)                           # normalize the last 1 or 2 dims
        normalized = shape[3 - k:]
        affine = randint(g, 0, 3)                      # 0: no weight, 1: weight, 2: weight and bias
        W, B = rand(g, *normalized), rand(g, *normalized)
        wp = [Replicate()] * mesh.ndim if randint(g, 0, 2) else [Shard(0)] + [Replicate()] * (mesh.ndim - 1)
        what = f"seed {seed}, mesh {mesh_name}, shape {shape}, normalized {normalized}, x {xp}, w {wp}, affine {affine}"
        inputs = [(X, xp)] + [(W, wp)] * (affine >= 1) + [(B, wp)] * (affine == 2)

        def layer_norm(x, w=None, b=None):
            return F.layer_norm(x, normalized, w, b, eps=1e-5)

        check(layer_norm, inputs, mesh, seed, g, f"layer_norm {what}",
              _same_shards(xp, what, normalized=tuple(range(3 - k, 3))))

        def rms_norm(x, w=None, b=None):
            return F.rms_norm(x, normalized, w, eps=1e-6)

        # on CPU F.rms_norm decomposes; its in-place add_ of eps cannot run on the pending
        # mean of a sharded hidden dim (test_rms_norm_decomposition_over_a_sharded_hidden_dim)
        rp = [Replicate() if isinstance(p, Shard) and p.dim >= 3 - k else p for p in xp]
        check(rms_norm, [(X, rp)] + inputs[1:2], mesh, seed, g, f"rms_norm {what}")
    return True


def _rms_norm_sharded_hidden(rank, world_size, mesh_name, seed):
    """F.rms_norm on CPU decomposes into ``x.pow(2).mean(-1, keepdim=True).add_(eps)``: over a
    sharded hidden dim the mean is a pending sum, and add_ keeps it pending (eps on one rank)."""
    mesh = mesh_of(mesh_name)
    g = torch.Generator().manual_seed(seed)
    rows, hidden = randint(g, 1, 6), randint(g, 2, 11)
    X, W = rand(g, rows, hidden), rand(g, hidden)
    R = [Replicate()] * mesh.ndim
    sets = [[Shard(1)]] if mesh.ndim == 1 else [[Shard(0), Shard(1)], [Shard(1), Shard(1)], [Replicate(), Shard(1)]]
    for xp in sets:
        check(lambda x, w: F.rms_norm(x, (hidden,), w, eps=1e-6), [(X, xp), (W, R)], mesh, seed, g,
              f"rms_norm over a sharded hidden dim, {xp}")
    return True


def _sequence_parallel(rank, world_size, mesh_name, seed, kind):
    """(B, S, H) activations sharded on the sequence dim (and on the batch dim over a second
    mesh axis), replicated weight: local forward, pending-sum weight grads."""
    mesh = mesh_of(mesh_name)
    g = torch.Generator().manual_seed(seed)
    B, S, H = randint(g, 1, 4), randint(g, 1, 11), randint(g, 2, 9)
    X, W, Bias, G = rand(g, B, S, H), rand(g, H), rand(g, H), rand(g, B, S, H)
    xp = [Shard(1)] if mesh.ndim == 1 else [Shard(0), Shard(1)]
    R = [Replicate()] * mesh.ndim
    if kind == "layer_norm":
        ref_mod = nn.LayerNorm(H, dtype=torch.float64)
    else:
        ref_mod = nn.RMSNorm(H, eps=1e-6, dtype=torch.float64)
    with torch.no_grad():
        ref_mod.weight.copy_(W)
        if kind == "layer_norm":
            ref_mod.bias.copy_(Bias)
    mod = nn.LayerNorm(H, dtype=torch.float64) if kind == "layer_norm" else nn.RMSNorm(H, eps=1e-6, dtype=torch.float64)
    mod.weight = nn.Parameter(make(W, mesh, R, seed))
    if kind == "layer_norm":
        mod.bias = nn.Parameter(make(Bias, mesh, R, seed))
    x = make(X, mesh, xp, seed, requires_grad=True)
    x_ref = X.clone().requires_grad_()
    y, y_ref = mod(x), ref_mod(x_ref)
    what = f"{kind} seed {seed} mesh {mesh_name} shape {(B, S, H)}"
    assert y.placements == tuple(xp), f"{what}: output {y.placements}"
    close(y, y_ref.detach(), what)
    y.backward(make(G, mesh, xp, seed))
    y_ref.backward(G)
    assert x.grad.placements == tuple(xp), f"{what}: input grad {x.grad.placements}"
    close(x.grad, x_ref.grad, f"{what}: input grad")
    params = [("weight", mod.weight, ref_mod.weight)]
    if kind == "layer_norm":
        params.append(("bias", mod.bias, ref_mod.bias))
    for name, p, ref in params:
        # each rank summed its own tokens: a pending sum over the mesh axes that split tokens
        assert p.grad.placements == (Partial("sum"),) * mesh.ndim, f"{what}: {name} grad {p.grad.placements}"
        close(p.grad, ref.grad, f"{what}: {name} grad")
    return True


def _fused_rms_norm(rank, world_size, mesh_name, seed):
    """The aten ops F.rms_norm reaches on CUDA, handed to the dispatcher as CUDA would hand
    them (on a CPU build ``_fused_rms_norm`` decomposes before reaching a tensor subclass;
    the backward's CPU step is the formula; the reference is autograd through F.rms_norm on
    whole tensors)."""
    mesh = mesh_of(mesh_name)
    g = torch.Generator().manual_seed(seed)
    shape = (randint(g, 1, 5), randint(g, 1, 9), randint(g, 2, 7))
    X, W, G = rand(g, *shape), rand(g, shape[-1]), rand(g, *shape)
    x_ref, w_ref = X.clone().requires_grad_(), W.clone().requires_grad_()
    y_ref = F.rms_norm(x_ref, (shape[-1],), w_ref, eps=1e-6)
    y_ref.backward(G)
    rstd_ref = torch.ops.aten._fused_rms_norm(X, [shape[-1]], W, 1e-6)[1]
    for xp in sample_sets(mesh, OPTIONS, g, 4):
        what = f"seed {seed}, mesh {mesh_name}, shape {shape}, x {xp}"
        x, w = make(X, mesh, xp, seed), make(W, mesh, [Replicate()] * mesh.ndim, seed)
        y, rstd = DTensor.dispatcher.dispatch(aten._fused_rms_norm.default, (x, [shape[-1]], w, 1e-6), {})
        close(y, y_ref.detach(), f"{what}: out")
        close(rstd, rstd_ref, f"{what}: rstd")
        gp = [Partial() if isinstance(p, Replicate) else p for p in xp]
        grad = make(G, mesh, gp, seed + 1)
        gx, gw = DTensor.dispatcher.dispatch(aten._fused_rms_norm_backward.default, (grad, x, [shape[-1]], rstd, w, [True, True]), {})
        close(gx, x_ref.grad, f"{what}: grad input")
        close(gw, w_ref.grad, f"{what}: grad weight")
        for axis, p in enumerate(y.placements):
            if isinstance(p, Shard):
                assert gw.placements[axis] == Partial("sum"), f"{what}: grad weight {gw.placements}"
    return True


def _layer_norm_backward_pending_grad(rank, world_size):
    """native_layer_norm_backward with a gradient that is a pending sum on a replicated
    input: every output stays pending (the backward is linear in the gradient)."""
    mesh = mesh_of("4")
    g = torch.Generator().manual_seed(2)
    X, W, Bias, G = rand(g, 3, 5), rand(g, 5), rand(g, 5), rand(g, 3, 5)
    out, mean, rstd = torch.ops.aten.native_layer_norm(X, [5], W, Bias, 1e-5)
    want = torch.ops.aten.native_layer_norm_backward(G, X, [5], mean, rstd, W, Bias, [True, True, True])
    R = [Replicate()]
    args = [make(G, mesh, [Partial()], 0), make(X, mesh, R, 0), [5], make(mean, mesh, R, 0), make(rstd, mesh, R, 0),
            make(W, mesh, R, 0), make(Bias, mesh, R, 0), [True, True, True]]
    got = torch.ops.aten.native_layer_norm_backward(*args)
    for name, o, w in zip(("input", "weight", "bias"), got, want):
        assert o.placements == (Partial("sum"),), f"{name}: {o.placements}"
        close(o, w, f"grad {name}")
    return True


@pytest.mark.parametrize("mesh_name", list(MESHES))
def test_softmax(mesh_name, seed):
    world = WORLD[mesh_name]
    assert run_on_ranks(_softmax, world, args=(mesh_name, seed)) == [True] * world


@pytest.mark.parametrize("mesh_name", ["2", "2x2"])
def test_softmax_in_pieces(mesh_name, seed):
    """The sharded softmax's temporaries made piece by piece (3 elements a piece: every row its own)."""
    world = WORLD[mesh_name]
    assert run_on_ranks(_softmax, world, args=(mesh_name, seed, 3)) == [True] * world


@pytest.mark.parametrize("mesh_name", list(MESHES))
def test_layer_norm_and_rms_norm(mesh_name, seed):
    world = WORLD[mesh_name]
    assert run_on_ranks(_layer_norm, world, args=(mesh_name, seed)) == [True] * world


@pytest.mark.parametrize("kind", ["layer_norm", "rms_norm"])
@pytest.mark.parametrize("mesh_name", list(MESHES))
def test_sequence_parallel_norm(mesh_name, kind, seed):
    world = WORLD[mesh_name]
    assert run_on_ranks(_sequence_parallel, world, args=(mesh_name, seed, kind)) == [True] * world


@pytest.mark.parametrize("mesh_name", ["2", "2x2"])
def test_fused_rms_norm_ops(mesh_name, seed):
    world = WORLD[mesh_name]
    assert run_on_ranks(_fused_rms_norm, world, args=(mesh_name, seed)) == [True] * world


def test_layer_norm_backward_keeps_a_pending_gradient():
    assert run_on_ranks(_layer_norm_backward_pending_grad, 4) == [True] * 4


@pytest.mark.parametrize("mesh_name", list(MESHES))
def test_rms_norm_decomposition_over_a_sharded_hidden_dim(mesh_name, seed):
    world = WORLD[mesh_name]
    assert run_on_ranks(_rms_norm_sharded_hidden, world, args=(mesh_name, seed)) == [True] * world
