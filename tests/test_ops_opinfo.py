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
