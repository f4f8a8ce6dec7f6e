"""axedist's main demo: Axe layouts parsed, printed, evaluated and transformed.

    bash launch/main.sh          # installs what a fresh machine needs, then runs this

Later stages of the project grow this into a torchrun job (DTensors on gloo/NCCL,
inferred collectives, a tensor-parallel training step).
"""

from __future__ import annotations

import axedist as ax


def show(title: str, layout: ax.Layout) -> None:
    print(f"  {title:<44} {layout}")


def main() -> None:
    print("1. The paper's notation, parsed and printed (exact round trip)")
    L = ax.Layout.parse("S[(8,2,4,2):(4@lane,1@warp,1@lane,1)] + R[2:4@warp] + 5@warp")
    show("a warp-level layout of an 8x16 tile:", L)
    print(f"  it admits shape (8,16): {L.admits((8, 16))}; element (7,15) lives at {L.apply((7, 15), (8, 16))}")

    print("\n2. Canonical form: equal maps, equal layouts")
    for text in ["S[(8,4):(4@lane,1@lane)]", "S[(8,2,3,6):(6,18,6,1)]", "S[8:1] + R[(2,2):(1@gpuid,2@gpuid)]"]:
        show(text, ax.Layout.parse(text).canonicalize())
    a, b = ax.Layout.parse("S[32:1@lane]"), ax.Layout.parse("S[(4,8):(8@lane,1@lane)]")
    print(f"  {a} == {b}: {a == b}")

    print("\n3. DTensor placements are layouts (global shape (8,6))")
    show("Shard(0) on 4 GPUs, local (2,6):", ax.Layout.parse("S[(4,2,6):(1@gpuid,6,1)]"))
    show("Replicate() on 4 GPUs:", ax.Layout.parse("S[(8,6):(6,1)] + R[4:1@gpuid]"))
    show("[Shard(0), Shard(1)] on a 2x2 mesh (x, y):", ax.Layout.parse("S[(2,4,2,3):(1@x,3,1@y,1)]"))
    show("block-cyclic rows over 4 GPUs (no placement):", ax.Layout.parse("S[(2,4,6):(6,1@gpuid,1)]"))
    show("Shard(0) on GPUs 4..7 of 8 (no placement):", ax.Layout.parse("S[(4,2,6):(1@gpuid,6,1)] + 4@gpuid"))

    print("\n4. Tile, slice, group")
    A, B = ax.Layout.parse("(2,3):(3,1)"), ax.Layout.parse("(8,8):(8,1)")
    T = ax.tile(A, B, (2, 3), (8, 8))
    show("2x3 grid of 8x8 tiles (16x24):", T)
    show("... its outer grid, recovered:", ax.tile_quotient(T, B, (16, 24), (8, 8)))
    show("... rows [0,8), cols [8,24):", T.slice((16, 24), (0, 8), (8, 24)))
    show("S[32:1@lane] grouped as (8,4):", ax.Layout.parse("S[32:1@lane]").group((8, 4)))

    print("\n5. Bad input is a clear error")
    for text in ["S[(8,2):(1)]", "S[4:0@gpuid]"]:
        try:
            ax.Layout.parse(text)
        except ax.LayoutError as e:
            print(f"  {text!r}: {e}")


if __name__ == "__main__":
    main()
