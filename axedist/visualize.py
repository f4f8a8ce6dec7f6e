"""Which device holds which block of a 1-D or 2-D tensor: a terminal table and a PNG.

    >>> print(visualize(Layout.parse("S[(2,4,6):(6,1@gpuid,1)]"), DeviceMesh("cpu", (4,)), (8, 6)))
    S[(2,4,6):(6,1@gpuid,1)] over (8, 6) on DeviceMesh('cpu', [0, 1, 2, 3], axes=('gpuid',))
    rows\\cols | 0:6
    ----------+----
    0         | 0
    1         | 1
    2         | 2
    3         | 3
    4         | 0
    ...

Cells name the global ranks that hold the block; consecutive rows (columns) that
hold the same ranks merge into one range.
"""

from __future__ import annotations

from typing import Sequence

from .dtensor import DTensor
from .layout import Layout, LayoutError
from .mesh import DeviceMesh
from .spec import element_table, make_spec

__all__ = ["visualize"]


def _holder_grid(spec) -> list[list[str]]:
    """Ranks holding each element (summands merged), as a rows x cols grid of labels."""
    table = element_table(spec)
    elements = table.offsets.numel() // spec.summands
    holders = table.holders.reshape(spec.summands, elements, -1).permute(1, 0, 2).reshape(elements, -1).tolist()
    labels = [",".join(str(spec.mesh.ranks[p]) for p in sorted(set(row))) for row in holders]
    cols = spec.shape[-1] if spec.shape else 1
    return [labels[i:i + cols] for i in range(0, len(labels), cols)]


def _runs(items: list) -> list[tuple[int, int]]:
    """``[start, end)`` ranges of consecutive equal items."""
    runs, start = [], 0
    for i in range(1, len(items) + 1):
        if i == len(items) or items[i] != items[start]:
            runs.append((start, i))
            start = i
    return runs


def _range_text(lo: int, hi: int) -> str:
    return str(lo) if hi == lo + 1 else f"{lo}:{hi}"


def visualize(dt_or_layout, mesh: DeviceMesh | None = None, shape: Sequence[int] | None = None, *,
              path: str | None = None) -> str:
    """The table of which rank holds which block; also a PNG at ``path`` when given.

    Takes an axedist DTensor, or a layout with its mesh and the shape it admits.
    """
    if isinstance(dt_or_layout, DTensor):
        spec = dt_or_layout._spec
    elif isinstance(dt_or_layout, Layout):
        if mesh is None or shape is None:
            raise LayoutError("visualize(layout, mesh, shape) needs the mesh and the tensor's shape")
        spec = make_spec(mesh, dt_or_layout, tuple(shape))
    else:
        raise LayoutError(f"visualize takes an axedist DTensor or a Layout, got {type(dt_or_layout).__name__}")
    if len(spec.shape) not in (1, 2):
        raise LayoutError(f"visualize draws 1-D and 2-D tensors, got shape {spec.shape}")
    grid = _holder_grid(spec)
    row_runs = _runs(grid)
    col_runs = _runs(list(zip(*grid)))
    title = f"{spec.layout} over {tuple(spec.shape)} on {spec.mesh}"
    if spec.reduce_op:
        title += f", pending {spec.reduce_op} over {spec.summands} summands (cells list every summand's holders)"
    header = ["rows\\cols" if len(spec.shape) == 2 else "index"] + [_range_text(a, b) for a, b in col_runs]
    body = [[_range_text(a, b) if len(spec.shape) == 2 else "ranks"] + [grid[a][c] for c, _ in col_runs]
            for a, b in row_runs]
    widths = [max(len(row[i]) for row in [header] + body) for i in range(len(header))]
    line = lambda row: " | ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip()  # noqa: E731
    rule = "-+-".join("-" * w for w in widths)
    text = "\n".join([title, line(header), rule] + [line(row) for row in body])
    if path is not None:
        _draw(grid, row_runs, col_runs, title, path)
    return text


def _draw(grid, row_runs, col_runs, title: str, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Rectangle

    rows, cols = len(grid), len(grid[0])
    labels = sorted({cell for row in grid for cell in row})
    colors = plt.get_cmap("tab20")
    fig, ax = plt.subplots(figsize=(min(12, 2 + 0.5 * cols), min(12, 1.5 + 0.5 * rows)))
    for r0, r1 in row_runs:
        for c0, c1 in col_runs:
            label = grid[r0][c0]
            color = colors(labels.index(label) % 20) if label else (1, 1, 1)
            ax.add_patch(Rectangle((c0, r0), c1 - c0, r1 - r0, facecolor=color, edgecolor="black"))
            ax.text((c0 + c1) / 2, (r0 + r1) / 2, label or "-", ha="center", va="center", fontsize=8)
    ax.set_xlim(0, cols)
    ax.set_ylim(rows, 0)
    ax.set_xlabel("column")
    ax.set_ylabel("row")
    ax.set_title(title, fontsize=8, wrap=True)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
