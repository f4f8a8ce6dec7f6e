"""Random valid layouts (beyond placements) against brute force: distribute, redistribute, full_tensor.

A layout is drawn digit by digit: each dim of the shape is a list of digits; some go to
a mesh axis (in a random stride order, so axes interleave and permute devices, sometimes
with a negative stride), the rest stay in memory (row-major per dim). Each axis may also
carry a replica and an offset, so tensors can sit on part of the mesh.
"""

import math

import pytest
import torch
from hypothesis import Phase, given, settings
from hypothesis import strategies as st

from axedist.dtensor import distribute
from axedist.layout import Iter, Layout
from axedist.mesh import DeviceMesh
from axedist.testing import run_on_ranks

from tests.test_dtensor import expected_local, global_tensor

MESHES = {"2": ((2,), ("gpuid",)), "4": ((4,), ("gpuid",)), "2x2": ((2, 2), ("x", "y")), "2x4": ((2, 4), ("x", "y"))}


@st.composite
def digit_lists(draw):
    """Per dim, its digits (outer to inner); the dim's size is their product."""
    ndim = draw(st.integers(1, 2))
    return [draw(st.lists(st.sampled_from([2, 2, 3]), min_size=1, max_size=3)) for _ in range(ndim)]


@st.composite
def layouts(draw, digits, mesh_shape, names):
    slots = [(d, i) for d, dim in enumerate(digits) for i in range(len(dim))]
    owner = {}
    product = dict.fromkeys(names, 1)
    for slot in draw(st.permutations(slots)):
        axis = draw(st.sampled_from([None, *names]))
        e = digits[slot[0]][slot[1]]
        if axis is not None and product[axis] * e <= dict(zip(names, mesh_shape))[axis]:
            owner[slot] = axis
            product[axis] *= e
    stride, replica, offset = {}, [], {}
    for axis, k in zip(names, mesh_shape):
        mine = [s for s in slots if owner.get(s) == axis]
        reps = draw(st.integers(1, k // product[axis]))
        replica_inside = draw(st.booleans())  # replica stride 1 under D, or D under the replica
        scale = reps if replica_inside else 1
        step = scale
        for s in draw(st.permutations(mine)):  # a random order of strides: interleaved / permuted
            stride[s] = step
            step *= digits[s[0]][s[1]]
        if reps > 1:
            replica.append(Iter(reps, 1 if replica_inside else product[axis], axis))
        offset[axis] = draw(st.integers(0, k - product[axis] * reps))
        if mine and draw(st.booleans()):  # one digit walks backwards
            s = draw(st.sampled_from(mine))
            offset[axis] += stride[s] * (digits[s[0]][s[1]] - 1)
            stride[s] = -stride[s]
    local = [math.prod(e for i, e in enumerate(dim) if (d, i) not in owner) for d, dim in enumerate(digits)]
    shard = []
    for d, dim in enumerate(digits):
        inner = math.prod(local[d + 1:]) * local[d]
        for i, e in enumerate(dim):
            if (d, i) in owner:
                shard.append(Iter(e, stride[(d, i)], owner[(d, i)]))
            else:
                inner //= e
                shard.append(Iter(e, inner))
    return str(Layout(shard, replica, {a: v for a, v in offset.items() if v}))


def _check(rank, world_size, mesh_key, shape, texts, src_rank, device_type="cpu"):
    mesh = DeviceMesh(device_type, *MESHES[mesh_key])
    full = global_tensor(shape, seed=len(texts[0]))
    sent = full if rank == src_rank else torch.zeros(shape, dtype=full.dtype)
    dt = distribute(sent.to(mesh.device), mesh, Layout.parse(texts[0]), src_rank=src_rank)
    for text in texts:
        layout = Layout.parse(text)
        dt = dt.redistribute(layout)
        assert torch.equal(dt.to_local().cpu(), expected_local(layout, mesh, full, rank)), text
    assert torch.equal(dt.full_tensor().cpu(), full)
    return True


def sweep(mesh_key, examples, backend="gloo"):
    """Draw ``examples`` random layout chains on the mesh and check each on real ranks."""
    mesh_shape, names = MESHES[mesh_key]
    world = math.prod(mesh_shape)
    device_type = "cpu" if backend == "gloo" else "cuda"

    @settings(max_examples=examples, database=None, phases=[Phase.generate], deadline=None)
    @given(st.data())
    def check(data):
        digits = data.draw(digit_lists())
        texts = data.draw(st.lists(layouts(digits, mesh_shape, names), min_size=2, max_size=3))
        shape = tuple(math.prod(dim) for dim in digits)
        src_rank = data.draw(st.integers(0, world - 1))
        results = run_on_ranks(_check, world, backend=backend, args=(mesh_key, shape, texts, src_rank, device_type))
        assert results == [True] * world

    check()


@pytest.mark.parametrize("mesh_key", ["4", "2x2", "2x4"])
def test_random_layouts_against_brute_force(mesh_key):
    sweep(mesh_key, 25 if mesh_key != "2x4" else 10)
