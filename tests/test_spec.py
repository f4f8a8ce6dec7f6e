"""The DTensor spec: torch.chunk's arithmetic against torch itself, and placements <-> layouts
where placements cannot become a layout."""

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from torch.distributed.tensor import Shard

import axedist as ax
from axedist.dtensor import distribute
from axedist.spec import chunk, chunk_ranges, nested_chunk, spec_from_placements
from axedist.testing import run_on_ranks


@given(st.integers(1, 40), st.lists(st.integers(1, 5), min_size=1, max_size=3))
def test_chunk_arithmetic_is_torch_chunk_nested(n, ks):
    # reference: torch.chunk applied to an arange, then again inside each piece
    pieces = {(): torch.arange(n)}
    for k in ks:
        pieces = {c + (i,): (p.chunk(k)[i] if i < len(p.chunk(k)) else p[:0]) for c, p in pieces.items()
                  for i in range(k)}
    ranges = chunk_ranges(n, ks)
    assert set(ranges) == set(pieces)
    for c, piece in pieces.items():
        start, size = ranges[c]
        assert size == len(piece) and (size == 0 or start == int(piece[0]))
        assert nested_chunk(n, zip(ks, c)) == (start, size)
    assert chunk(10, 4, 3) == (9, 1) and chunk(5, 4, 3) == (5, 0)


def _nested_uneven(rank, world_size):
    mesh = ax.DeviceMesh("cpu", (2, 2), ("x", "y"))
    full = torch.arange(5.0)
    with pytest.raises(ax.LayoutError, match="chunk dim"):
        ax.layout_from_placements((5,), mesh, [Shard(0), Shard(0)])
    expected = {0: [0.0, 1.0], 1: [2.0], 2: [3.0], 3: [4.0]}[rank]   # torch.chunk: 3 + 2, then 2 + 1, 1 + 1
    assert distribute(full, mesh, [Shard(0), Shard(0)]).to_local().tolist() == expected
    # an even split of the same dim still has its layout; a padded layout asks for its padded shape
    assert str(ax.layout_from_placements((8,), mesh, [Shard(0), Shard(0)])) == "S[(2,2,2):(1@x,1@y,1)]"
    line = ax.DeviceMesh("cpu", (4,))
    layout = ax.layout_from_placements((5,), line, [Shard(0)])
    with pytest.raises(ax.LayoutError, match=r"pass padded_shape=, the shape the layout admits \(here \(8,\)\)"):
        distribute(full, line, layout)
    assert distribute(full, line, layout, padded_shape=(8,)).to_local().tolist() == \
        distribute(full, line, [Shard(0)]).to_local().tolist()
    return spec_from_placements((5,), mesh, [Shard(0), Shard(0)]).true_index  # carries where real rows are


def test_nested_uneven_placements_have_no_layout_and_padded_layouts_ask_for_their_shape():
    assert run_on_ranks(_nested_uneven, 4)[0] == ((0, 1, 2, -1, 3, -1, 4, -1),)
