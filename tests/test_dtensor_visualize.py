"""visualize: the table names exactly the ranks that hold each block; the PNG is written."""

import os

import torch

from axedist.dtensor import distribute
from axedist.layout import Layout, LayoutError
from axedist.mesh import DeviceMesh
from axedist.testing import run_on_ranks
from axedist.visualize import visualize


def _tables(rank, world_size, png_dir):
    mesh = DeviceMesh("cpu", (4,))
    out = {
        "shard0": visualize(Layout.parse("S[(4,2,6):(1@gpuid,6,1)]"), mesh, (8, 6)),
        "cyclic": visualize(Layout.parse("S[(2,4,6):(6,1@gpuid,1)]"), mesh, (8, 6)),
        "vector": visualize(Layout.parse("S[(8,6):(6,1)] + R[2:1@gpuid]"), mesh, (48,)),
    }
    mesh2 = DeviceMesh("cpu", (2, 2), ("x", "y"), ranks=[3, 2, 1, 0])
    dt = distribute(torch.arange(24.).reshape(4, 6), mesh2, Layout.parse("S[(2,2,2,3):(1@x,3,1@y,1)]"))
    out["dtensor"] = visualize(dt, path=os.path.join(png_dir, f"grid{rank}.png"))
    partial = distribute(torch.ones(4, 4, 4), mesh, Layout.parse("S[(4,4,4):(1@gpuid,4,1)]")).to_partial()
    out["partial"] = visualize(partial)
    try:
        visualize(Layout.parse("S[(2,2,2):(1@gpuid,2,1)]"), DeviceMesh("cpu", (4,)), (2, 2, 2))
    except LayoutError as e:
        out["3d"] = str(e)
    return out


def test_visualize_tables_and_png(tmp_path):
    out = run_on_ranks(_tables, 4, args=(str(tmp_path),))[0]
    assert out["shard0"].splitlines()[1:] == [
        "rows\\cols | 0:6",
        "----------+----",
        "0:2       | 0",
        "2:4       | 1",
        "4:6       | 2",
        "6:8       | 3",
    ]
    assert [line.split("|")[1].strip() for line in out["cyclic"].splitlines()[3:]] == ["0", "1", "2", "3"] * 2
    assert out["vector"].splitlines()[1:] == ["index | 0:48", "------+-----", "ranks | 0,1"]
    # mesh ranks listed in reverse: (x=0,y=0) is rank 3
    assert out["dtensor"].splitlines()[3:] == ["0:2       | 3   | 2", "2:4       | 1   | 0"]
    assert "pending sum over 4 summands" in out["partial"] and out["partial"].splitlines()[3].endswith("0,1,2,3")
    assert "1-D and 2-D" in out["3d"]
    with open(tmp_path / "grid0.png", "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"
