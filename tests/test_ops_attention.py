"""Scaled dot-product attention over DTensors (ops/attention.py) against F.scaled_dot_product_attention.

q, k, v sharded on heads, on the batch, on the query sequence (k, v whole: each rank its
query rows) and on the sequence of all three (moved to heads, or replicated when the heads
do not split), with causal masks, additive and boolean masks, a custom scale and grouped-query
attention; on 2 and 4 ranks and a 2x2 mesh. Output and q/k/v grads must equal the
single-device ones, and head/batch sharding must run locally (output in the same placements).
"""

import itertools

import pytest
import torch
import torch.nn.functional as F
from torch.distributed.tensor import Partial, Replicate, Shard

from axedist.dtensor import DTensor, distribute
from axedist.mesh import DeviceMesh
from axedist.testing import run_on_ranks
from tests.ops_cases import MESHES, gathered

aten = torch.ops.aten


def _inputs(g, gqa: bool):
    batch = int(torch.randint(1, 4, (1,), generator=g))
    kv_heads = int(torch.randint(1, 5, (1,), generator=g))
    heads = kv_heads * (2 if gqa else 1)
    length, source = (int(v) for v in torch.randint(1, 7, (2,), generator=g))
    dim = int(torch.randint(2, 6, (1,), generator=g))
    q = torch.randn(batch, heads, length, dim, dtype=torch.float64, generator=g)
    k = torch.randn(batch, kv_heads, source, dim, dtype=torch.float64, generator=g)
    v = torch.randn(batch, kv_heads, source, dim, dtype=torch.float64, generator=g)
    return q, k, v


def _mask(g, kind, q, k):
    batch, heads, length, source = q.shape[0], q.shape[1], q.shape[2], k.shape[2]
    if kind == "bool":  # (L, S), every row keeps column 0 (a row with nothing to attend to is nan)
        keep = torch.rand(length, source, generator=g) < 0.6
        keep[:, 0] = True
        return keep
    if kind == "additive":  # (B, H, L, S)
        return torch.randn(batch, heads, length, source, dtype=torch.float64, generator=g)
    return None


def _attention_case(rank, world_size, mesh_name, seed, gqa):
    mesh = DeviceMesh("cpu", *MESHES[mesh_name])
    g = torch.Generator().manual_seed(seed)
    q, k, v = _inputs(g, gqa)
    checked = 0
    layouts = [("heads", [Shard(1)], [Shard(1)]), ("batch", [Shard(0)], [Shard(0)]),
               ("query rows", [Shard(2)], [Replicate()]), ("sequence", [Shard(2)], [Shard(2)]),
               ("replicated", [Replicate()], [Replicate()])]
    for (name, qp, kvp), kind, causal in itertools.product(layouts, ["none", "bool", "additive"], [False, True]):
        if causal and kind != "none":
            continue  # torch takes a mask or is_causal, not both
        scale = None if torch.rand(1, generator=g) < 0.5 else float(torch.rand(1, generator=g)) + 0.1
        mask = _mask(g, kind, q, k)
        grad = torch.randn(q.shape[:3] + (v.shape[3],), dtype=torch.float64, generator=g)
        ref = [t.clone().requires_grad_() for t in (q, k, v)]
        want = F.scaled_dot_product_attention(*ref, attn_mask=mask, is_causal=causal, scale=scale, enable_gqa=gqa)
        want.backward(grad)
        qp, kvp = qp * mesh.ndim, kvp * mesh.ndim
        dq = distribute(q, mesh, qp).requires_grad_()
        dk = distribute(k, mesh, kvp).requires_grad_()
        dv = distribute(v, mesh, kvp).requires_grad_()
        dmask = None if mask is None else distribute(mask, mesh, [Replicate()] * mesh.ndim)
        out = F.scaled_dot_product_attention(dq, dk, dv, attn_mask=dmask, is_causal=causal, scale=scale,
                                             enable_gqa=gqa)
        what = f"seed {seed}, {name}, q {tuple(q.shape)}, k {tuple(k.shape)}, mask {kind}, causal {causal}"
        torch.testing.assert_close(out.full_tensor(), want, msg=what)
        if name in ("heads", "batch") and (name == "batch" or not gqa or k.shape[1] % world_size == 0):
            assert out.placements == tuple(qp), f"{what}: output {out.placements}"
        if name == "query rows" and not causal:
            assert out.placements == tuple(qp), f"{what}: output {out.placements}"
        out.backward(distribute(grad, mesh, list(out.placements)))
        for d, r, label in zip((dq, dk, dv), ref, "qkv"):
            torch.testing.assert_close(d.grad.full_tensor(), r.grad, msg=f"{what}: grad of {label}")
        checked += 1
    return checked


@pytest.mark.parametrize("gqa", [False, True], ids=["mha", "gqa"])
@pytest.mark.parametrize("mesh_name,world_size", [("2", 2), ("4", 4), ("2x2", 4)])
def test_attention(mesh_name, world_size, gqa, seed):
    counts = run_on_ranks(_attention_case, world_size, args=(mesh_name, seed, gqa))
    assert counts[0] == 20


class _Seen(torch.utils._python_dispatch.TorchDispatchMode):
    """Records the aten ops that run (on DTensors and below)."""

    def __init__(self):
        super().__init__()
        self.ops = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.add(str(func))
        return func(*args, **(kwargs or {}))


def _fused_kernel_case(rank, world_size):
    mesh = DeviceMesh("cpu", (world_size,))
    q, k, v = (distribute(torch.randn(2, 4, 6, 8, dtype=torch.float64), mesh, [Shard(1)]).requires_grad_()
               for _ in range(3))
    with _Seen() as seen:
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        out.backward(distribute(torch.ones(2, 4, 6, 8, dtype=torch.float64), mesh, [Shard(1)]))
    return sorted(op for op in seen.ops if "attention" in op or op.startswith(("aten.bmm", "aten.mm", "aten._softmax")))


def test_attention_runs_the_fused_cpu_kernel_on_local_heads():
    seen = run_on_ranks(_fused_kernel_case, 2)[0]
    assert seen == ["aten._scaled_dot_product_flash_attention_for_cpu.default",
                    "aten._scaled_dot_product_flash_attention_for_cpu_backward.default"], seen


def _cuda_rules_case(rank, world_size):
    """The CUDA overloads' rules, read on CPU (the kernels themselves run in
    tests_multigpu/test_ops_nn_nccl.py): every output gets the right placements."""
    from axedist.dtensor import layout_from_placements
    from axedist.ops.attention import attention_rule
    from axedist.ops.registry import ArgSpec, OpCall

    mesh = DeviceMesh("cpu", (world_size,))

    def spec(shape, placements, dtype=torch.bfloat16):
        return ArgSpec(tuple(shape), dtype, mesh, layout_from_placements(shape, mesh, placements), tuple(placements))

    q = spec((2, 8, 16, 64), [Shard(1)])
    lse = spec((2, 8, 16), [Shard(1)], torch.float32)
    seed = spec((2,), [Replicate()], torch.int64)
    found = {}
    flash = OpCall(aten._scaled_dot_product_flash_attention.default, (q, q, q, 0.0, True), {}, mesh)
    found["flash"] = attention_rule(flash)
    flash_back = OpCall(aten._scaled_dot_product_flash_attention_backward.default,
                        (q, q, q, q, q, lse, None, None, 16, 16, 0.0, True, seed, seed), {}, mesh)
    found["flash_backward"] = attention_rule(flash_back)
    qb = spec((2, 8, 16, 64), [Shard(0)])
    bias = spec((1, 8, 16, 16), [Replicate()])
    efficient_back = OpCall(aten._scaled_dot_product_efficient_attention_backward.default,
                            (qb, qb, qb, qb, bias, qb, spec((2, 8, 32), [Shard(0)], torch.float32), seed, seed, 0.0,
                             [True, True, True, True], False), {}, mesh)
    found["efficient_backward"] = attention_rule(efficient_back)
    cudnn = OpCall(aten._scaled_dot_product_cudnn_attention.default, (q, q, q, None, True), {}, mesh)
    found["cudnn"] = attention_rule(cudnn)
    dropout = OpCall(aten._scaled_dot_product_efficient_attention.default, (q, q, q, None, True, 0.1), {}, mesh)
    found["dropout"] = attention_rule(dropout)
    return {name: (tuple(s.inputs), s.outputs) for name, s in found.items()}


def test_cuda_attention_rules():
    got = run_on_ranks(_cuda_rules_case, 2)[0]
    heads, batch, whole = (Shard(1),), (Shard(0),), (Replicate(),)
    assert got["flash"] == ((heads, heads, heads), (heads, heads, whole, whole, None, None, whole, whole, None))
    assert got["flash_backward"] == ((heads,) * 6 + (whole, whole), (heads, heads, heads))
    # a bias broadcast over the batch: each rank's batch rows add into its grad
    assert got["efficient_backward"] == ((batch, batch, batch, batch, whole, batch, batch, whole, whole),
                                         (batch, batch, batch, (Partial("sum"),)))
    assert got["cudnn"] == ((heads, heads, heads), (heads, heads, whole, whole, None, None, whole, whole, None))
    # dropout inside attention: every rank runs the whole kernel with the same random state
    assert got["dropout"] == ((whole, whole, whole), (whole, whole, whole, whole))


# -- the CUDA attention kernels, run on CPU through the dispatcher ---------------------------------
# F.scaled_dot_product_attention on CUDA reaches DTensors as _efficient_attention / _flash_attention /
# _cudnn_attention. Those aten ops have no CPU kernel; the cases below register a plain fp64 one (the
# math of attention, with the CUDA kernels' output shapes: efficient attention's logsumexp is
# (B, H, 0) when not asked for, as in inference, and padded to 32 rows otherwise) and call the ops on
# DTensors, so the rules, the output specs and the dispatcher's plumbing run as they do on CUDA.

_CPU_KERNELS = []


def _probabilities(q, k, bias, causal, scale):
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    scores = (q @ k.transpose(-2, -1)) * scale
    if bias is not None:
        scores = scores + bias
    if causal:  # top-left aligned, as the CUDA kernels (query row i sees keys 0..i)
        keep = torch.ones(q.shape[-2], k.shape[-2], dtype=torch.bool).tril()
        scores = scores.masked_fill(~keep, float("-inf"))
    return torch.softmax(scores, -1), torch.logsumexp(scores, -1), scale


def _efficient(q, k, v, bias, compute_log_sumexp, dropout_p=0.0, is_causal=False, *, scale=None):
    p, lse, _ = _probabilities(q, k, bias, is_causal, scale)
    rows = -(-q.shape[-2] // 32) * 32 if compute_log_sumexp else 0
    padded = lse.new_zeros(*lse.shape[:-1], rows)
    if rows:
        padded[..., :q.shape[-2]] = lse
    return p @ v, padded.float(), torch.tensor(0), torch.tensor(0)


def _efficient_backward(grad, q, k, v, bias, out, lse, seed, offset, dropout_p, mask, is_causal=False, *, scale=None):
    # runs below autograd: softmax's gradient written out (dS = P * (dP - rowsum(dP * P)))
    p, _, scale = _probabilities(q, k, bias, is_causal, scale)
    dp = grad @ v.transpose(-2, -1)
    ds = p * (dp - (dp * p).sum(-1, keepdim=True))
    return ds @ k * scale, ds.transpose(-2, -1) @ q * scale, p.transpose(-2, -1) @ grad, q.new_empty(0)


def _flash(q, k, v, dropout_p=0.0, is_causal=False, return_debug_mask=False, *, scale=None):
    p, lse, _ = _probabilities(q, k, None, is_causal, scale)
    # cum_seq_q / cum_seq_k are undefined tensors (None) outside the varlen kernel, as on CUDA
    return (p @ v, lse.float(), None, None, q.shape[-2], k.shape[-2], torch.zeros(2, dtype=torch.int64),
            torch.tensor(0), q.new_empty(0))


def _flash_backward(grad, q, k, v, out, lse, cum_q, cum_k, max_q, max_k, dropout_p, is_causal, seed, offset, *,
                    scale=None):
    return _efficient_backward(grad, q, k, v, None, out, lse, seed, offset, dropout_p, None, is_causal,
                               scale=scale)[:3]


def _register_cuda_attention_on_cpu() -> None:
    if _CPU_KERNELS:
        return
    library = torch.library.Library("aten", "IMPL")
    library.impl("_scaled_dot_product_efficient_attention", _efficient, "CPU")
    library.impl("_scaled_dot_product_efficient_attention_backward", _efficient_backward, "CPU")
    library.impl("_scaled_dot_product_flash_attention", _flash, "CPU")
    library.impl("_scaled_dot_product_flash_attention_backward", _flash_backward, "CPU")
    _CPU_KERNELS.append(library)


def _cuda_kernels_case(rank, world_size, seed):
    """Decode (one query row, batch 1, no grad: efficient attention's logsumexp is (1, H, 0)) and
    training shapes, heads and batch sharded, through the CUDA attention ops: outputs and
    gradients equal the kernels on the whole tensors."""
    _register_cuda_attention_on_cpu()
    mesh = DeviceMesh("cpu", (world_size,))
    g = torch.Generator().manual_seed(seed)
    checked = []
    for batch, heads, length, source, grad in [(1, 4, 1, 5, False), (1, 8, 1, 7, False), (2, 4, 5, 5, True),
                                              (3, 4, 6, 6, True)]:
        q = torch.randn(batch, heads, length, 8, dtype=torch.float64, generator=g)
        k, v = (torch.randn(batch, heads, source, 8, dtype=torch.float64, generator=g) for _ in range(2))
        causal = bool(grad)
        for name, placements in (("heads", [Shard(1)]), ("batch", [Shard(0)]), ("whole", [Replicate()])):
            for op in ("efficient", "flash"):
                what = f"seed {seed}, {op}, {name}, q {tuple(q.shape)}, k {tuple(k.shape)}, grad {grad}"
                plain = [t.clone().requires_grad_(grad) for t in (q, k, v)]
                dts = [distribute(t, mesh, placements).requires_grad_(grad) for t in (q, k, v)]
                with torch.set_grad_enabled(grad):
                    if op == "efficient":
                        want = aten._scaled_dot_product_efficient_attention(*plain, None, grad, 0.0, causal)
                        got = aten._scaled_dot_product_efficient_attention(*dts, None, grad, 0.0, causal)
                    else:
                        want = aten._scaled_dot_product_flash_attention(*plain, 0.0, causal)
                        got = aten._scaled_dot_product_flash_attention(*dts, 0.0, causal)
                torch.testing.assert_close(got[0].full_tensor(), want[0], msg=what)
                lse = got[1].full_tensor() if isinstance(got[1], DTensor) else got[1]
                assert lse.shape == want[1].shape, f"{what}: logsumexp {tuple(lse.shape)}"
                torch.testing.assert_close(lse[..., :length], want[1][..., :length], msg=what)
                if grad:
                    dout = torch.randn(want[0].shape, dtype=torch.float64, generator=g)
                    want[0].backward(dout)
                    got[0].backward(distribute(dout, mesh, list(got[0].placements)))
                    for d, p, label in zip(dts, plain, "qkv"):
                        torch.testing.assert_close(d.grad.full_tensor(), p.grad, msg=f"{what}: grad of {label}")
                checked.append(what)
    return len(checked)


@pytest.mark.parametrize("world_size", [2, 4])
def test_cuda_attention_kernels_through_the_dispatcher(world_size, seed):
    assert run_on_ranks(_cuda_kernels_case, world_size, args=(seed,)) == [24] * world_size


def _dealt_heads(world_size):
    """(label, mesh, layout of (B, H, L, E) for given L, E, B, H) of head maps with no placement form."""
    from axedist.layout import Layout

    mesh = DeviceMesh("cpu", (world_size,))
    w = world_size
    out = [("heads round-robin", mesh, 2 * w,
            lambda b, l, e: Layout.parse(f"S[({b},2,{w},{l},{e}):({2 * l * e},{l * e},1@gpuid,{e},1)]")),
           ("heads round-robin in pairs", mesh, 4 * w,
            lambda b, l, e: Layout.parse(f"S[({b},2,{w},2,{l},{e}):({4 * l * e},{2 * l * e},1@gpuid,{l * e},{e},1)]"))]
    if world_size == 4:
        grid = DeviceMesh("cpu", (2, 2), ("dp", "tp"))
        out.append(("heads round-robin over tp, replicated over dp", grid, 4,
                    lambda b, l, e: Layout.parse(f"S[({b},2,2,{l},{e}):({2 * l * e},{l * e},1@tp,{e},1)] + R[2:1@dp]")))
    return out


def _heads_in_place_case(rank, world_size, seed):
    """q, k, v whose heads a layout with no placement form deals (round-robin, in pairs, replicated
    over a second axis): the CPU kernel and the CUDA flash kernels (emulated on CPU) run on each
    device's own heads, with no collective forward or backward; the output keeps the heads' map
    (no placement form); values and q / k / v gradients equal the kernel on the whole tensors.
    Grouped-query heads take the placement way, with the same values."""
    from axedist.runtime import count_collectives

    _register_cuda_attention_on_cpu()
    g = torch.Generator().manual_seed(seed)
    failures = []
    runs = {"cpu": lambda q, k, v, causal: (F.scaled_dot_product_attention(q, k, v, is_causal=causal),),
            "flash": lambda q, k, v, causal: aten._scaled_dot_product_flash_attention(q, k, v, 0.0, causal)}
    for (label, mesh, heads, layout), (op, run), causal in itertools.product(
            _dealt_heads(world_size), runs.items(), (False, True)):
        batch, length, source, dim = 2, int(torch.randint(1, 6, (1,), generator=g)), 5, 4
        what = f"{label}, {op}, causal {causal}, L {length}"
        q = torch.randn(batch, heads, length, dim, dtype=torch.float64, generator=g, requires_grad=True)
        k, v = (torch.randn(batch, heads, source, dim, dtype=torch.float64, generator=g, requires_grad=True)
                for _ in range(2))
        dq, dk, dv = (distribute(t, mesh, layout(batch, t.shape[2], dim)) for t in (q, k, v))
        with count_collectives() as seen:
            got = run(dq, dk, dv, causal)
        want = run(q, k, v, causal)
        if seen.calls:
            failures.append(f"{what}: {seen.calls} collectives in the forward")
        failures += gathered(what, got[0])
        if not torch.allclose(got[0].full_tensor(), want[0]):
            failures.append(f"{what}: values differ from the whole kernel's")
        if op == "flash" and not torch.allclose(got[1].full_tensor(), want[1]):
            failures.append(f"{what}: logsumexp differs")
        up = torch.randn(want[0].shape, dtype=torch.float64, generator=g)
        whole = got[0].full_tensor()
        with count_collectives() as seen:
            torch.autograd.grad((whole * up).sum(), (dq, dk, dv), retain_graph=True)
        if seen.calls:
            failures.append(f"{what}: collectives in the backward ({seen})")
        replicated_up = distribute(up, mesh, [Replicate()] * mesh.ndim)  # (distribute broadcasts: outside the count)
        with count_collectives() as seen:  # the output gradient replicated, as (out * g).sum() gives it: cut where it is
            torch.autograd.grad((got[0] * replicated_up).sum(), (dq, dk, dv), retain_graph=True)
        if seen.calls:
            failures.append(f"{what}: collectives in the backward of a replicated output gradient ({seen})")
        (whole * up).sum().backward()
        mine = [t.grad.clone() for t in (q, k, v)]
        for t in (q, k, v):
            t.grad = None
        (want[0] * up).sum().backward()
        for name, a, b in zip("qkv", mine, (q.grad, k.grad, v.grad)):
            if not torch.allclose(a, b):
                failures.append(f"{what}: the {name} gradient differs")
    # grouped-query heads (2 query heads per key head): the placement way, torch's values
    label, mesh, heads, layout = _dealt_heads(world_size)[0]
    q = torch.randn(2, heads, 3, 4, dtype=torch.float64, generator=g)
    k, v = (torch.randn(2, heads // 2, 5, 4, dtype=torch.float64, generator=g) for _ in range(2))
    got = F.scaled_dot_product_attention(distribute(q, mesh, layout(2, 3, 4)), distribute(k, mesh, [Replicate()]),
                                         distribute(v, mesh, [Replicate()]), enable_gqa=True)
    if not torch.allclose(got.full_tensor(), F.scaled_dot_product_attention(q, k, v, enable_gqa=True)):
        failures.append("grouped-query heads: values differ")
    return failures


@pytest.mark.parametrize("world_size", [2, 4])
def test_attention_runs_where_a_layout_without_placements_deals_the_heads(world_size, seed):
    results = run_on_ranks(_heads_in_place_case, world_size, args=(seed,), timeout_s=600)
    assert results == [[]] * world_size, results[0]
