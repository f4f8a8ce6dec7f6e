"""The nn op rules on CUDA with NCCL: the fused attention kernels, dropout and random fills.

Run on 2+ GPUs: ``pytest tests_multigpu/test_ops_nn_nccl.py -q`` (W = every GPU, and 2).
On CPU, tests/test_ops_{attention,random,embedding,loss}.py cover the rules; here the CUDA
overloads (``_scaled_dot_product_flash_attention``, ``_efficient_attention``,
``_cudnn_attention`` and their backwards, ``native_dropout``) run on head-sharded DTensors (and
heads dealt round-robin by a layout: the flash kernels where the heads are) and must match the
same kernel on the whole tensors, and CUDA random draws must equal the unsharded ones exactly (Philox: the whole tensor is drawn on every rank).
"""

import pytest
import torch
import torch.nn.functional as F
from torch.distributed.tensor import Replicate, Shard

from axedist.dtensor import distribute
from axedist.layout import Layout
from axedist.mesh import DeviceMesh
from axedist.runtime import count_collectives
from axedist.testing import capture, run_on_ranks

GPUS = torch.cuda.device_count()
WORLDS = sorted({2, GPUS}) if GPUS >= 2 else []
pytestmark = pytest.mark.skipif(GPUS < 2, reason="needs 2 or more CUDA GPUs")

BACKENDS = {"flash": "FLASH_ATTENTION", "efficient": "EFFICIENT_ATTENTION", "cudnn": "CUDNN_ATTENTION"}
KERNELS = {"flash": "aten._scaled_dot_product_flash_attention", "efficient": "aten._scaled_dot_product_efficient_attention",
           "cudnn": "aten._scaled_dot_product_cudnn_attention"}


class _Seen(torch.utils._python_dispatch.TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.add(str(func))
        return func(*args, **(kwargs or {}))


def _attention_cuda(rank, world_size, backend, placements_name, causal):
    from torch.nn.attention import SDPBackend, sdpa_kernel

    mesh = DeviceMesh("cuda", (world_size,))
    torch.manual_seed(0)  # the same inputs on every rank
    shape = (3, 4 * world_size, 256, 64)  # batch 3: uneven over any W (W = 4: one rank holds none)
    q, k, v, grad = (torch.randn(shape, device="cuda", dtype=torch.bfloat16) for _ in range(4))
    kernel = getattr(SDPBackend, BACKENDS[backend])
    ref = [t.clone().requires_grad_() for t in (q, k, v)]
    try:
        with sdpa_kernel(kernel):
            want = F.scaled_dot_product_attention(*ref, is_causal=causal)
            want.backward(grad)
    except RuntimeError as e:  # this backend does not run here (GPU, build): nothing to compare
        return f"unavailable: {e}"
    # heads dealt round-robin (head h on device h % W): a layout with no placement form
    dealt = Layout.parse(f"S[(3,4,{world_size},256,64):({4 * 256 * 64},{256 * 64},1@gpuid,64,1)]")
    placements = {"heads": [Shard(1)], "batch": [Shard(0)], "sequence": [Shard(2)],
                  "heads dealt": dealt}[placements_name]
    dq, dk, dv = (distribute(t, mesh, placements).requires_grad_() for t in (q, k, v))
    with sdpa_kernel(kernel), _Seen() as seen:
        with count_collectives() as moved:
            out = F.scaled_dot_product_attention(dq, dk, dv, is_causal=causal)
        # distribute scatters (a collective of its own); the batch is uneven: the padded shape goes with the layout
        dgrad = distribute(grad, mesh, out.axe_layout, padded_shape=out.padded_shape)
        with count_collectives() as moved_back:
            out.backward(dgrad)
    assert any(op.startswith(KERNELS[backend]) for op in seen.ops), sorted(seen.ops)
    if placements_name == "heads dealt" and backend == "flash":  # run where the heads are (ops/attention.py)
        assert out.axe_layout == dealt and moved.calls == moved_back.calls == 0, (out.axe_layout, str(moved),
                                                                                 str(moved_back))
    elif placements_name not in ("sequence", "heads dealt"):
        assert out.placements == tuple(placements), out.placements
    torch.testing.assert_close(out.full_tensor(), want, atol=2e-2, rtol=2e-2)
    for d, r in zip((dq, dk, dv), ref):
        torch.testing.assert_close(d.grad.full_tensor(), r.grad, atol=5e-2, rtol=5e-2)
    return "ok"


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("placements_name", ["heads", "batch", "sequence", "heads dealt"])
@pytest.mark.parametrize("backend", list(BACKENDS))
@pytest.mark.parametrize("world_size", WORLDS)
def test_attention_cuda_kernels(world_size, backend, placements_name, causal):
    results = run_on_ranks(_attention_cuda, world_size, backend="nccl", args=(backend, placements_name, causal))
    if all(r.startswith("unavailable") for r in results):
        pytest.skip(results[0])
    assert results == ["ok"] * world_size


def _random_cuda(rank, world_size):
    mesh = DeviceMesh("cuda", (world_size,))
    shape = (37, 1000)  # uneven rows: Philox's element-to-counter map depends on the whole tensor
    checks = {}
    for name, placements in (("rows", [Shard(0)]), ("cols", [Shard(1)]), ("replicated", [Replicate()])):
        torch.manual_seed(5)
        want = torch.empty(shape, device="cuda").uniform_()
        want_next = torch.rand(4, device="cuda")
        torch.manual_seed(5)
        got = distribute(torch.empty(shape, device="cuda"), mesh, placements).uniform_()
        checks[f"uniform_ {name}"] = torch.equal(got.full_tensor(), want) and torch.equal(torch.rand(4, device="cuda"),
                                                                                          want_next)
        x = torch.randn(shape, device="cuda", generator=torch.Generator("cuda").manual_seed(1))
        torch.manual_seed(6)
        want = F.dropout(x, 0.3)
        torch.manual_seed(6)
        dx = distribute(x, mesh, placements)
        with _Seen() as seen:
            got = F.dropout(dx, 0.3)
        checks[f"dropout {name}"] = torch.equal(got.full_tensor(), want) and "aten.native_dropout.default" in seen.ops
    return checks


@pytest.mark.parametrize("world_size", WORLDS)
def test_random_cuda_matches_unsharded(world_size):
    for checks in run_on_ranks(_random_cuda, world_size, backend="nccl"):
        assert all(checks.values()), checks


def _embedding_captured(rank, world_size):
    """A vocabulary-sharded embedding (its range check included) captured in a CUDA graph, then
    replayed with new indices: each replay equals the lookup in the whole table."""
    mesh = DeviceMesh("cuda", (world_size,))
    torch.manual_seed(0)  # the same table and indices on every rank
    vocab, width = 64 * world_size + 3, 32  # uneven: the last rank holds fewer rows
    table = torch.randn(vocab, width, device="cuda")
    weight = distribute(table, mesh, [Shard(0)])
    indices = torch.randint(0, vocab, (4, 16), device="cuda")
    with torch.inference_mode():
        graph, out = capture(lambda: F.embedding(indices, weight).full_tensor())
        results = []
        for _ in range(3):
            indices.copy_(torch.randint(0, vocab, indices.shape, device="cuda"))
            graph.replay()
            results.append(torch.equal(out, F.embedding(indices, table)))
    torch.cuda.synchronize()
    return results


@pytest.mark.parametrize("world_size", WORLDS)
def test_vocab_sharded_embedding_captured_in_a_cuda_graph(world_size):
    """launch/infer_tp.py --cuda-graphs at TP=2 stopped here: the range check read the indices on
    the host during capture; it asserts on the device now (runtime/checks.py)."""
    for results in run_on_ranks(_embedding_captured, world_size, backend="nccl"):
        assert results == [True, True, True], results


def _batch_norm_cuda(rank, world_size):
    """``F.batch_norm`` of a batch-sharded (N, C, H, W) image batch on CUDA (where torch calls
    ``cudnn_batch_norm``, or the native kernel), train and eval, float32: values, input / weight /
    bias gradients and running statistics as torch's on the whole batch; no gather fallback."""
    from axedist.dtensor import DTensor

    mesh = DeviceMesh("cuda", (world_size,))
    torch.manual_seed(0)  # the same inputs on every rank
    shape = (2 * world_size + 1, 8, 6, 5)  # uneven over W
    failures = []
    for training in (True, False):
        x, up = torch.randn(shape, device="cuda") * 2 + 1, torch.randn(shape, device="cuda")
        w, b, rm = (torch.randn(8, device="cuda") for _ in range(3))
        rv = torch.rand(8, device="cuda") + 0.5
        ref = [t.clone().requires_grad_() for t in (x, w, b)]
        ref_stats = [rm.clone(), rv.clone()]
        with _Seen() as seen_plain:
            want = F.batch_norm(ref[0], *ref_stats, ref[1], ref[2], training=training, momentum=0.2)
        want.backward(up)
        dx = distribute(x, mesh, [Shard(0)]).requires_grad_()
        dw, db = (distribute(t, mesh, [Replicate()]).requires_grad_() for t in (w, b))
        drm, drv = (distribute(t.clone(), mesh, [Replicate()]) for t in (rm, rv))
        with count_collectives() as moved, _Seen() as seen:
            got = F.batch_norm(dx, drm, drv, dw, db, training=training, momentum=0.2)
        got.backward(distribute(up, mesh, [Shard(0)]))
        what = f"{'train' if training else 'eval'} ({sorted(o for o in seen.ops if 'batch_norm' in o)})"
        if moved.calls or got.placements != (Shard(0),):
            failures.append(f"{what}: {moved.calls} moves, output {got.placements}")
        checks = [("output", got, want), ("x grad", dx.grad, ref[0].grad), ("weight grad", dw.grad, ref[1].grad),
                  ("bias grad", db.grad, ref[2].grad), ("running mean", drm, ref_stats[0]), ("running var", drv, ref_stats[1])]
        for name, mine, theirs in checks:
            if not torch.allclose(mine.full_tensor(), theirs, rtol=1e-4, atol=1e-4):
                failures.append(f"{what}: {name} differs from torch's by {(mine.full_tensor() - theirs).abs().max():.2e}")
        if sorted(o for o in seen.ops if "batch_norm" in o) != sorted(o for o in seen_plain.ops if "batch_norm" in o):
            failures.append(f"{what}: other ops than torch's {sorted(seen_plain.ops)}")
    if any("batch_norm" in str(op) for op in DTensor.dispatcher.fallback_ops()):
        failures.append(f"batch norm went through the gather fallback: {DTensor.dispatcher.fallback_ops()}")
    return failures


@pytest.mark.parametrize("world_size", WORLDS)
def test_batch_norm_of_a_sharded_batch_on_cuda(world_size):
    results = run_on_ranks(_batch_norm_cuda, world_size, backend="nccl")
    assert results == [[]] * world_size, results[0]
