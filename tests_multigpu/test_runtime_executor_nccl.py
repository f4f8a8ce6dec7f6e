"""The CPU suite's executor bodies, run on CUDA with NCCL (one process per GPU).

Run on a machine with 2 or more GPUs: ``pytest tests_multigpu/test_runtime_executor_nccl.py -q``.
W is every GPU of the machine (and 2 when there are more); the cases whose mesh has
W devices run: random layout pairs and partial sums with every reduce op (meshes
listing ranks in random orders), the named transitions, async, the reference
point-to-point path, and the differential against torch DTensor (values and bytes), on
the listed transitions and on seeded random placements.
"""

import math
import random
import pytest
import torch

from axedist.testing import run_on_ranks
from tests.test_runtime_executor import (
    KEEP_PARTIAL, MESHES, MOVES_MORE_THAN_TORCH, NAMED, OPS, RANDOM_MESHES, TORCH_TRANSITIONS, async_case, digit_swap,
    in_place_case, keep_partial, named_case, random_cases, random_transitions, torch_cases, torch_differential,
)

GPUS = torch.cuda.device_count()
WORLDS = sorted({2, GPUS} & set(MESHES)) if GPUS >= 2 else []
pytestmark = pytest.mark.skipif(GPUS < 2, reason="needs 2 or more CUDA GPUs")


@pytest.mark.parametrize("world", WORLDS)
def test_random_layouts_nccl(world):
    for index in range(len(MESHES[world])):
        kinds = run_on_ranks(random_cases, world, backend="nccl",
                             args=(index, 5000 * world + index, 24, [], "cuda"), timeout_s=300)
        assert all(k == kinds[0] for k in kinds)


@pytest.mark.parametrize("world", WORLDS)
def test_random_partial_sums_every_op_nccl(world):
    for index in range(len(MESHES[world])):
        run_on_ranks(random_cases, world, backend="nccl",
                     args=(index, 6000 * world + index, 16, OPS, "cuda"), timeout_s=300)


@pytest.mark.parametrize("world", WORLDS)
def test_point_to_point_path_nccl(world):
    run_on_ranks(random_cases, world, backend="nccl", args=(0, 7000 + world, 12, OPS, "cuda", True), timeout_s=300)


@pytest.mark.skipif(4 not in WORLDS, reason="the named transitions use 4 ranks")
@pytest.mark.parametrize("name", sorted(NAMED))
def test_named_transitions_nccl(name):
    text = run_on_ranks(named_case, 4, backend="nccl", args=(name, "cuda"), timeout_s=300)[0]
    assert "executed on nccl" in text
    # NCCL runs the reduce-scatter natively (gloo substitutes an all-reduce), through
    # axedist.collectives.api's backend="auto" choice, which the explanation names
    if name == "reduce_scatter":
        assert "reduce_scatter: reduce_scatter_tensor" in text, text
    if name in ("all_gather", "reduce_scatter", "all_reduce"):
        assert "last call ran on torch.distributed" in text or "last call ran on axedist.collectives.api" in text, text


@pytest.mark.skipif(4 not in WORLDS, reason="uses 4 ranks")
def test_collectives_in_place_nccl():
    """NCCL's all-to-all carries a rank's own piece to itself, and the all-reduce (the p2p kernels
    or NCCL) gives the output buffer itself: the in-place outputs are checked slot by slot."""
    found = run_on_ranks(in_place_case, 4, backend="nccl", args=("cuda",), timeout_s=300)[0]
    assert found[("ordered", (8, 8), "S0")] and not found[("shuffled", (8, 8), "S0")], found
    assert found[("ordered", "sum")] and found[("ordered", "avg")] and not found[("shuffled", "sum")], found


@pytest.mark.skipif(4 not in WORLDS, reason="uses 4 ranks")
def test_async_nccl():
    assert run_on_ranks(async_case, 4, backend="nccl", args=("cuda",), timeout_s=300) == [True] * 4


@pytest.mark.parametrize("world", WORLDS)
def test_matches_torch_dtensor_nccl(world):
    indices = [i for i, t in enumerate(TORCH_TRANSITIONS) if math.prod(t[0]) == world]
    known_excess = []
    for index in indices:
        results = run_on_ranks(torch_differential, world, backend="nccl", args=(index, "cuda"), timeout_s=300)
        assert all(r[0] for r in results), (index, results[0][3])
        ours, theirs = [r[1] for r in results], [r[2] for r in results]
        moves_more = max(ours) > max(theirs) or sum(ours) > sum(theirs)
        # as on CPU: a transition listed in MOVES_MORE_THAN_TORCH (with its reason) is a known planner limit
        if moves_more and index in MOVES_MORE_THAN_TORCH:
            known_excess.append((index, ours, theirs))
        else:
            assert not moves_more, (index, ours, theirs, results[0][3])
    if known_excess:  # every other transition was checked first; this one stays visible
        pytest.xfail(f"known planner cost limit (issue 4): (index, axedist B, torch B) {known_excess}")


@pytest.mark.parametrize("world", WORLDS)
def test_random_placements_match_torch_nccl(world):
    """Seeded random placements (even, uneven, empty shards; every reduce op) on each mesh of W devices:
    values equal torch DTensor's on NCCL, bytes never above what it issues."""
    for mesh_shape in [m for m in RANDOM_MESHES if math.prod(m) == world]:
        cases = random_transitions(random.Random(8000 + world + len(mesh_shape)), mesh_shape, 24)
        results = run_on_ranks(torch_cases, world, backend="nccl", args=(cases, "cuda"), timeout_s=300)
        for i, case in enumerate(cases):
            per_rank = [r[i] for r in results]
            assert all(r[0] for r in per_rank), (case, per_rank[0][3])
            ours, theirs = [r[1] for r in per_rank], [r[2] for r in per_rank]
            assert max(ours) <= max(theirs) and sum(ours) <= sum(theirs), (case, ours, theirs, per_rank[0][3])


@pytest.mark.skipif(4 not in WORLDS, reason="uses a 2x2 mesh")
def test_uneven_digit_swap_nccl():
    """(3, 6) [S1, S1] -> [S1, S0] on 2x2: one all_to_all_single per y pair moving the true
    elements only (8 B a rank; torch DTensor's NCCL all_to_all of padded pieces: 16 B)."""
    results = run_on_ranks(digit_swap, 4, backend="nccl", args=("cuda",), timeout_s=300)
    assert all(r[0] for r in results), results[0][3]
    assert [r[1] for r in results] == [8] * 4 and [r[2] for r in results] == [16] * 4, results[0][3]
    assert "all_to_all_single on the mesh's ('y',) group" in results[0][3], results[0][3]


@pytest.mark.parametrize("world", WORLDS)
def test_partial_reduced_on_some_axes_nccl(world):
    """[Partial, Partial] -> [R | Shard(d), Partial] and back-to-front, seeded uneven shapes, every op."""
    rng = random.Random(9000 + world)
    cases = [(m, d, (rng.randint(1, 9), rng.randint(1, 9)), rng.choice(OPS), rng.randrange(2**31))
             for m, d in KEEP_PARTIAL if math.prod(m) == world]
    if not cases:
        pytest.skip(f"no 2-D mesh of {world} devices")
    results = run_on_ranks(keep_partial, world, backend="nccl", args=(cases, "cuda"), timeout_s=300)
    for i, case in enumerate(cases):
        per_rank = [r[i] for r in results]
        assert all(r[0] and r[1] and r[2] for r in per_rank), (case, [r[:3] for r in per_rank], per_rank[0][5])
        ours, theirs = [r[3] for r in per_rank], [r[4] for r in per_rank]
        assert max(ours) <= max(theirs) and sum(ours) <= sum(theirs), (case, ours, theirs, per_rank[0][5])
