"""Under ``torch.inference_mode`` composite ops (linear, rms_norm, chunk, sdpa) reach the
dispatcher undecomposed; they must run through their decompositions, never the gather fallback."""

import torch
import torch.nn.functional as F
from torch.distributed.tensor import Replicate, Shard

from axedist.dtensor import DTensor, distribute
from axedist.mesh import DeviceMesh
from axedist.testing import run_on_ranks

fallback_ops = DTensor.dispatcher.fallback_ops


def _body(rank, world, seed):
    mesh = DeviceMesh("cpu", (world,))
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(6, 8, generator=g, dtype=torch.float64)
    w = torch.randn(4 * world, 8, generator=g, dtype=torch.float64)
    q = torch.randn(1, 2 * world, 5, 4, generator=g, dtype=torch.float64)
    k, v = (torch.randn(q.shape, generator=g, dtype=torch.float64) for _ in range(2))
    before = set(fallback_ops())
    with torch.inference_mode():
        xd = distribute(x, mesh, [Replicate()])
        wd = distribute(w, mesh, [Shard(0)])
        y = F.linear(xd, wd)                                 # column-parallel: Shard(1) out
        z = F.rms_norm(xd, (8,), eps=1e-6)
        a, b = torch.chunk(y, 2, dim=0)
        heads = [distribute(t, mesh, [Shard(1)]) for t in (q, k, v)]
        o = F.scaled_dot_product_attention(*heads, is_causal=True)
        got = [y.full_tensor(), z.full_tensor(), a.full_tensor(), b.full_tensor(), o.full_tensor()]
        want = [x @ w.T, F.rms_norm(x, (8,), eps=1e-6), *torch.chunk(x @ w.T, 2, dim=0),
                F.scaled_dot_product_attention(q, k, v, is_causal=True)]
        placements = (tuple(y.placements), tuple(o.placements))
    ok = [bool(torch.allclose(g_, w_)) for g_, w_ in zip(got, want)]
    return ok, sorted(map(str, set(fallback_ops()) - before)), placements


def test_composite_ops_under_inference_mode_decompose():
    for world in (2, 4):
        for ok, fallbacks, placements in run_on_ranks(_body, world, args=(world,)):
            assert all(ok), ok
            assert fallbacks == [], fallbacks
            assert placements == ((Shard(1),), (Shard(1),)), placements


def _decomposition_body(rank, world, seed):
    """A linear / matmul of a 3-D input under inference_mode runs torch's C++ decomposition (the ops it
    calls come back through the dispatcher), never the Python ``matmul`` torch registers for tracing
    (several times slower a call on the host: the eager decode step's hot spot)."""
    dk = torch._C.DispatchKey.CompositeImplicitAutograd
    python_matmul = torch.ops.aten.matmul.default.py_kernels[dk]
    calls = []

    def counted(*args, **kwargs):
        calls.append(1)
        return python_matmul(*args, **kwargs)

    mesh = DeviceMesh("cpu", (world,))
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(3, 2, 8, generator=g, dtype=torch.float64)
    w = torch.randn(4 * world, 8, generator=g, dtype=torch.float64)
    torch.ops.aten.matmul.default.py_kernels[dk] = counted
    try:
        with torch.inference_mode():
            xd, wd = distribute(x, mesh, [Replicate()]), distribute(w, mesh, [Shard(0)])
            got = [F.linear(xd, wd).full_tensor(), torch.matmul(xd, wd.t()).full_tensor()]
    finally:
        torch.ops.aten.matmul.default.py_kernels[dk] = python_matmul
    return [bool(torch.allclose(t, x @ w.T)) for t in got], len(calls)


def test_inference_mode_decomposes_in_cpp():
    seed = int(torch.randint(0, 2**31 - 1, (1,)))
    for ok, python_calls in run_on_ranks(_decomposition_body, 2, args=(seed,)):
        assert ok == [True, True], seed
        assert python_calls == 0


def _repeated_calls_body(rank, world, seed):
    """A decode step's ops, called again with the same layouts, take the dispatcher's cached route
    (no unwrapping of the call, ``call_plan.scan``): composite ops with no rule go straight to their
    decomposition, ops with keyword arguments (``_to_copy``'s dtype, attention's scale) and ops of
    several outputs (``split``, ``_fused_rms_norm``, the attention kernel) straight to their plan; a
    reshape that must copy does so without a failed view first. Every result equals torch's."""
    import axedist.ops.dispatcher as dispatcher_module

    mesh = DeviceMesh("cpu", (world,))
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(3, 2, 8, generator=g, dtype=torch.float64)
    n = torch.randn(8, generator=g, dtype=torch.float64)
    q = torch.randn(1, 2 * world, 5, 4, generator=g, dtype=torch.float64)
    scans = []
    fast = DTensor.dispatcher.fastpath
    fast.enable(False)  # every call through torch's dispatcher to ours
    original = dispatcher_module.scan
    try:
        with torch.inference_mode():
            xd, nd = distribute(x, mesh, [Replicate()]), distribute(n, mesh, [Replicate()])
            qd = distribute(q, mesh, [Shard(1)])
            calls = [
                (lambda: F.rms_norm(xd, (8,), nd, 1e-6), lambda: F.rms_norm(x, (8,), n, 1e-6)),
                (lambda: xd.chunk(2, dim=-1)[1], lambda: x.chunk(2, dim=-1)[1]),
                (lambda: xd.to(torch.float32), lambda: x.to(torch.float32)),
                (lambda: F.scaled_dot_product_attention(qd, qd, qd, scale=0.5, is_causal=True),
                 lambda: F.scaled_dot_product_attention(q, q, q, scale=0.5, is_causal=True)),
                (lambda: xd.unsqueeze(2).expand(3, 2, 2, 8).reshape(3, 2, 16),
                 lambda: x.unsqueeze(2).expand(3, 2, 2, 8).reshape(3, 2, 16)),
            ]
            for ours, _ in calls:  # planned
                ours()

            def counted(*args, **kwargs):
                scans.append(args[1])
                return original(*args, **kwargs)

            dispatcher_module.scan = counted
            got = [ours() for ours, _ in calls]
            dispatcher_module.scan = original
            ok = [bool(torch.allclose(a.full_tensor(), want())) and a.dtype == want().dtype
                  for a, (_, want) in zip(got, calls)]
    finally:
        dispatcher_module.scan = original
        fast.enable(True)
    return ok, sorted({str(func) for func in scans})


def test_repeated_calls_take_the_cached_route():
    seed = int(torch.randint(0, 2**31 - 1, (1,)))
    for ok, scanned in run_on_ranks(_repeated_calls_body, 2, args=(seed,)):
        assert all(ok), (ok, seed)
        assert scanned == [], scanned


def _decode_block_body(rank, world, seed):
    """A TP Llama block decoding under inference_mode: the second forward's layer hooks hand on the
    inputs and outputs they left as they were in the first (no redistribute call that returns its
    input), and the block gives the one-process block's output both times."""
    import copy

    from axedist.nn import parallelize, to_inference
    from axedist.nn.llama import LlamaConfig, TransformerBlock, llama_tp_plan, rope_tables

    torch.manual_seed(seed)
    cfg = LlamaConfig(dim=32, n_layers=1, n_heads=4, n_kv_heads=2, ffn_hidden=64, max_seq_len=4)
    block = TransformerBlock(cfg).double().eval()
    ours = copy.deepcopy(block)
    mesh = DeviceMesh("cpu", (world,))
    plan = {k[len("layers.*."):]: v for k, v in llama_tp_plan(cfg, sequence_parallel=False).items()
            if k.startswith("layers.*.")}
    parallelize(ours, mesh, plan, src_rank=None)
    to_inference(ours)
    cos, sin = (t.double() for t in rope_tables(cfg.head_dim, 1, cfg.rope_theta))
    h = torch.randn(1, 2, cfg.dim, dtype=torch.float64)
    stayed = []
    original = DTensor.redistribute

    def counted(self, *args, **kwargs):
        out = original(self, *args, **kwargs)
        stayed.append(out is self)
        return out

    outs = []
    with torch.inference_mode():
        want = block(h, cos, sin)
        hd = DTensor.from_local(h, mesh, [Replicate()])
        cd, sd = (DTensor.from_local(t, mesh, [Replicate()]) for t in (cos, sin))
        outs.append(ours(hd, cd, sd))
        first = len(stayed)
        DTensor.redistribute = counted
        try:
            outs.append(ours(hd, cd, sd))
        finally:
            DTensor.redistribute = original
        ok = [bool(torch.allclose(o.full_tensor(), want, atol=1e-10)) for o in outs]
    return ok, first, stayed


def test_decode_block_hooks_hand_on_what_stays():
    seed = int(torch.randint(0, 2**31 - 1, (1,)))
    for ok, first, stayed in run_on_ranks(_decode_block_body, 2, args=(seed,)):
        assert ok == [True, True], seed
        assert first == 0 and True not in stayed, stayed
        assert len(stayed) == 2, stayed  # wo's and w2's outputs: pending sums all-reduced
