"""torch's OpInfo database through axedist DTensors, the CPU suite's subset: ``FAST_OPS`` of
``tests/opinfo_sweep.py`` (pointwise, reductions, norms, matmuls, views, joins, indexing, the
in-place shape changers, attention, losses, masked ops), every tensor argument Replicate,
Shard(0), Shard(-1) and mixes, on 2 gloo ranks and a 2x2 mesh; forward values and gradients
against the plain op. Every op must pass (or end in the clear error ``EXPECTED`` names): no silent
wrong result, no internal error.
The whole database: ``python benchmarks/sweep_opinfo.py`` (results/opinfo_sweep.md).
"""

import pytest

pytest.importorskip("expecttest")  # torch's op database imports it (launch/install.sh installs it)

from axedist.testing import run_on_ranks  # noqa: E402
from tests.opinfo_sweep import FAST_OPS, sweep_ops  # noqa: E402

# (mesh, float64 samples, float32 samples): the 2x2 mesh's 4 ranks share the 2 cores, fewer samples
RUNS = {"2": (3, 1), "2x2": (2, 0)}
# clear errors kept on purpose: torch's math attention builds its causal mask as a plain tensor
EXPECTED = {"nn.functional.scaled_dot_product_attention": "clear error"}


@pytest.mark.parametrize("mesh_name", sorted(RUNS))
def test_fast_opinfo_subset_passes(mesh_name):
    float64, float32 = RUNS[mesh_name]
    results = run_on_ranks(sweep_ops, 2 if mesh_name == "2" else 4, timeout_s=600,
                           args=(mesh_name, FAST_OPS, ("float64", "float32"), (float64, float32)))
    mine = results[0]
    failed = [f"{r['op']}: {r['outcome']}: {r['details']}" for r in mine
              if r["outcome"] not in ("pass", EXPECTED.get(r["op"], "pass"))]
    assert not failed, "\n".join(failed)
    assert all(r["runs"] > 0 for r in mine), [r["op"] for r in mine if not r["runs"]]
    assert [r["outcome"] for r in results[1]] == [r["outcome"] for r in mine]


def _meshgrid_in_rank_order(rank, world, key):
    """``sweep_op`` of a meshgrid variant whose samples each rank lists in its own order, as two
    string hash seeds do (torch's ``sample_inputs_meshgrid`` iterates the set ``{'xy', 'ij'}``):
    rank 0 lists ``indexing='ij'`` first in each pair, rank 1 ``'xy'``. Then the samples the
    harness agreed on, through ``torch.meshgrid`` on DTensors and on plain tensors."""
    import torch

    from axedist.dtensor import distribute
    from axedist.mesh import DeviceMesh
    from axedist.placements import Replicate
    from tests.opinfo_sweep import op_entries, same_samples, sweep_op

    op = op_entries()[key]
    listed = op.sample_inputs_func

    def in_rank_order(*args, **kwargs):
        for i, sample in enumerate(listed(*args, **kwargs)):
            sample.kwargs["indexing"] = ("ij", "xy")[(i + rank) % 2]
            yield sample

    op.sample_inputs_func = in_rank_order
    try:
        result = sweep_op(rank, world, "2", key, ("float64",), (10, 0))
        mesh = DeviceMesh("cpu", (2,), ("gpuid",))
        samples = same_samples(list(op.sample_inputs("cpu", torch.float64)), 10)
    finally:
        op.sample_inputs_func = listed
    differences = []
    for sample in samples:
        tensors = (list(sample.input) if isinstance(sample.input, (list, tuple)) else [sample.input]) + \
            list(sample.args)
        plain = torch.meshgrid(*tensors, **sample.kwargs)
        placed = [distribute(t, mesh, [Replicate()], src_rank=None) for t in tensors]
        got = torch.meshgrid(*placed, **sample.kwargs)
        differences += [(tuple(p.shape), sample.kwargs["indexing"]) for p, g in zip(plain, got)
                        if not torch.equal(g.full_tensor(), p)]
    return result["outcome"], result["details"], [s.kwargs["indexing"] for s in samples], differences


@pytest.mark.parametrize("key", ["meshgrid.variadic_tensors", "meshgrid.list_of_tensors"])
def test_samples_listed_in_another_order_per_rank_run_the_same_on_every_rank(key):
    """A rank disagreement on redistribute (variadic) and a hang (list) in the full sweep: each
    rank ran the samples in its own hash order, so the ranks ran different meshgrids."""
    results = run_on_ranks(_meshgrid_in_rank_order, 2, args=(key,), timeout_s=120)
    for outcome, details, indexing, differences in results:
        assert outcome == "pass", details
        assert indexing == results[0][2]
        assert not differences


# ops a TP step uses, through torch's DTensor beside axedist's (the sweep's --torch, in small)
SIDE_BY_SIDE = ("add", "mul", "sum", "softmax", "mm", "nn.functional.linear", "cat", "tril", "topk",
                "nn.functional.embedding", "transpose", "reshape")


def test_axedist_passes_every_op_torchs_dtensor_passes():
    """The same samples and placements on torch's DTensor and on axedist's: every op torch's
    passes, axedist's passes too (the whole database: ``sweep_opinfo.py --torch``)."""
    results = run_on_ranks(sweep_ops, 2, timeout_s=600, args=("2", SIDE_BY_SIDE, ("float64",), (2, 0), True))[0]
    behind = [f"{r['op']}: {r['outcome']}: {r['details']}" for r in results
              if r["torch_outcome"] == "pass" and r["outcome"] != "pass"]
    assert not behind, "\n".join(behind)
    # torch's side ran (an op it cannot run counts as its fail, so its passes are a floor)
    assert sum(r["torch_outcome"] == "pass" for r in results) >= len(SIDE_BY_SIDE) - 3, results
