"""The CPU suite's DeviceMesh/DTensor bodies, run on CUDA with NCCL (one process per GPU).

Run on a machine with 2 or more GPUs: ``pytest tests_multigpu/test_dtensor_nccl.py -q``.
W is every GPU of the machine, and also 2 when there are more; the cases whose mesh
has W devices run (the CPU suite's test bodies, with ``device_type="cuda"``).
"""

import math
import pytest
import torch

from axedist.testing import run_on_ranks
from tests.test_dtensor import CASES, figure_8, roundtrip
from tests.test_dtensor_random import MESHES as RANDOM_MESHES
from tests.test_dtensor_random import sweep
from tests.test_dtensor_torch import EXPLICIT, MESHES, differential
from tests.test_mesh import coordinates_and_groups

GPUS = torch.cuda.device_count()
WORLDS = sorted({2, GPUS}) if GPUS >= 2 else []
pytestmark = pytest.mark.skipif(GPUS < 2, reason="needs 2 or more CUDA GPUs")


def _world(mesh_shape):
    return math.prod(mesh_shape)


@pytest.mark.parametrize("world_size", WORLDS)
def test_mesh_nccl(world_size):
    results = run_on_ranks(coordinates_and_groups, world_size, backend="nccl", args=("cuda",))
    half = world_size // 2
    for rank, (coords, _, _, _) in enumerate(results):
        position = world_size - 1 - rank  # ranks listed in reverse
        assert coords == {"dp": position // half, "tp": position % half}


@pytest.mark.parametrize("world_size", WORLDS)
def test_layouts_placements_cannot_express_nccl(world_size):
    names = [n for n, case in CASES.items() if _world(case[0]) == world_size]
    assert names
    for name in names:
        results = run_on_ranks(roundtrip, world_size, backend="nccl", args=(name, world_size - 1, "cuda"))
        assert results == [True] * world_size, name


@pytest.mark.parametrize("world_size", WORLDS)
def test_figure_8_nccl(world_size):
    assert run_on_ranks(figure_8, world_size, backend="nccl", args=("cuda",)) == [True] * world_size


@pytest.mark.parametrize("world_size", WORLDS)
def test_placements_match_torch_nccl(world_size):
    cases = [c for c in EXPLICIT if _world(MESHES[c[0]][0]) == world_size]
    # and a fixed sweep of single-axis transitions, including uneven and partial
    meshes = [k for k in MESHES if _world(MESHES[k][0]) == world_size]
    for key in meshes:
        if len(MESHES[key][0]) == 1:
            for shape in [(8, 6), (5, 3), (3,)]:
                for src in [(("S", 0),), (("R",),), (("P", "sum"),), (("P", "max"),)]:
                    for dst in [(("S", 0),), (("S", len(shape) - 1),), (("R",),)]:
                        cases.append((key, shape, src, dst))
    assert cases
    for key, shape, src, dst in cases:
        results = run_on_ranks(differential, world_size, backend="nccl", args=(key, shape, src, dst, 3, "cuda"))
        assert set(results) == {"ok"}, (key, shape, src, dst, results)


@pytest.mark.parametrize("world_size", WORLDS)
def test_random_layouts_nccl(world_size):
    keys = [k for k, (shape, _) in RANDOM_MESHES.items() if _world(shape) == world_size]
    assert keys
    for key in keys:
        sweep(key, 10, backend="nccl")
