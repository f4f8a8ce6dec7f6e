"""DTensors on Axe layouts under torchrun: gloo on CPU (default), NCCL on GPUs.

    torchrun --nproc-per-node 4 launch/demo_dtensor.py            # CPU, gloo
    torchrun --nproc-per-node 4 launch/demo_dtensor.py --cuda     # GPUs, NCCL (+ fused GEMM + RS)
    torchrun --nnodes 2 --nproc-per-node 2 --rdzv-backend c10d --rdzv-endpoint HOST:PORT \
        launch/demo_dtensor.py --mesh 2x2                         # also a (dp, tp) mesh over the nodes

Each step moves one global tensor between layouts (placements and layouts that
placements cannot express), checks every rank's local tensor against the global
tensor, and rank 0 prints the layout, the inferred plan and a holder table. With
``--mesh DPxTP`` it then moves tensors over both axes of a (dp, tp) mesh (dp across nodes
when the job spans several): the plans reduce and gather on tp inside a node first.
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist
from torch.distributed.tensor import Partial, Replicate, Shard

import axedist as ax
from axedist.dtensor import distribute
from axedist.layout_inference import plan_layouts

from axedist.env import keep_multicast_off

keep_multicast_off()  # before torch: NCCL and symmetric memory read the switches when they start


def say(*args) -> None:
    if dist.get_rank() == 0:
        print(*args, flush=True)


def check(dt: "ax.DTensor", reference: torch.Tensor, what: str) -> None:
    """Every rank's view must equal the reference; rank 0 reports once all agree."""
    ok = torch.equal(dt.full_tensor().cpu(), reference.cpu())
    flag = torch.tensor([int(ok)], device=reference.device)
    dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    if not flag.item():
        raise SystemExit(f"demo check failed: {what}")
    say(f"   ok: full_tensor() on every rank equals the global tensor ({what})")


def show_move(dt: "ax.DTensor", target, shape, mesh_spec, itemsize, title: str) -> "ax.DTensor":
    moved = dt.redistribute(target)
    say(f"\n-- {title}")
    say(f"   from {dt.axe_layout}\n   to   {moved.axe_layout}")
    plan = plan_layouts(dt.axe_layout, moved.axe_layout, mesh_spec, shape, itemsize, partial=dt.reduce_op)
    # The plan redistribute just ran (cached: asking again costs microseconds).
    say("   " + str(plan).replace("\n", "\n   "))
    return moved


def two_axes(shape_text: str, device_type: str) -> None:
    """Moves over both axes of a (dp, tp) mesh; each plan names the link and backend of its steps."""
    dp, tp = (int(n) for n in shape_text.lower().split("x"))
    mesh = ax.init_mesh((dp, tp), ("dp", "tp"), device_type=device_type)
    say(f"\n== 2-D mesh {mesh.describe()}: {mesh}")
    world, device = mesh.size(), mesh.device
    shape = (4 * world, 6)
    torch.manual_seed(1)
    reference = torch.randint(-8, 8, shape, device=device).float()  # integers: sums are exact in any order
    # every rank holds reference * (rank + 1); the pending sum over both axes is reference * W (W + 1) / 2
    partial = ax.DTensor.from_local(reference * (dist.get_rank() + 1), mesh, [Partial(), Partial()], shape=shape)
    total = reference * (world * (world + 1) // 2)
    for target, title in (([Replicate(), Replicate()], "reduce over (dp, tp): an all-reduce in three stages"),
                          ([Shard(0), Shard(0)], "reduce-scatter over (dp, tp)")):
        say(f"\n-- [Partial(), Partial()] -> {target}: {title}")
        say("   " + str(ax.plan(partial, target)).replace("\n", "\n   "))
        check(partial.redistribute(target), total, f"{target}")
    rows = distribute(reference, mesh, [Shard(0), Shard(0)])
    say("\n-- [Shard(0), Shard(0)] -> [Replicate(), Replicate()]: all-gather across nodes first (the smaller piece)")
    say("   " + str(ax.plan(rows, [Replicate(), Replicate()])).replace("\n", "\n   "))
    check(rows.redistribute([Replicate(), Replicate()]), reference, "[Replicate(), Replicate()]")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cuda", action="store_true", help="use GPUs and NCCL (default: CPU and gloo)")
    parser.add_argument("--png", default="out/demo_layout.png", help="where rank 0 draws the holder picture")
    parser.add_argument("--mesh", default=None, metavar="DPxTP",
                        help="also move tensors over a 2-D (dp, tp) mesh of that shape, e.g. 2x2")
    args = parser.parse_args()

    device_type = "cuda" if args.cuda else "cpu"
    mesh = ax.init_mesh(device_type=device_type)
    world = mesh.size()
    device = mesh.device
    torch.manual_seed(0)
    shape = (4 * world, 6)
    reference = torch.randn(shape, device=device)  # same on every rank (same seed)
    mesh_spec = (("gpuid", world),)
    itemsize = reference.element_size()
    say(f"mesh: {mesh}; global tensor {tuple(shape)} {reference.dtype} on {device_type}")

    rows = distribute(reference, mesh, [Shard(0)])
    say(f"\n-- Shard(0) is the layout {rows.axe_layout}; this rank holds local {tuple(rows.to_local().shape)}")
    check(rows, reference, "Shard(0)")
    if dist.get_rank() == 0:
        os.makedirs(os.path.dirname(args.png) or ".", exist_ok=True)
        print(ax.visualize(rows, path=args.png))
        print(f"   (picture: {args.png})")

    everywhere = show_move(rows, [Replicate()], shape, mesh_spec, itemsize, "Shard(0) -> Replicate(): all-gather")
    check(everywhere, reference, "Replicate")

    cyclic = ax.Layout.parse(f"S[({shape[0] // world},{world},6):(6,1@gpuid,1)]")
    cyc = show_move(rows, cyclic, shape, mesh_spec, itemsize, "Shard(0) -> row-cyclic (no placement expresses it)")
    check(cyc, reference, "row-cyclic")

    order = list(reversed(range(world)))
    reversed_rows = ax.Layout.parse(f"S[({world},4,6):(-1@gpuid,6,1)] + {world - 1}@gpuid")
    rev = show_move(rows, reversed_rows, shape, mesh_spec, itemsize, f"Shard(0) on devices in order {order}: a permutation")
    check(rev, reference, "reversed device order")

    # A row-parallel matmul leaves partial sums; the planner reduce-scatters them.
    k = 8 * world
    a = torch.randn(shape[0], k, device=device)
    b = torch.randn(k, shape[1], device=device)
    a_cols = distribute(a, mesh, [Shard(1)])
    b_rows = distribute(b, mesh, [Shard(0)])
    partial = ax.DTensor.from_local(a_cols.to_local() @ b_rows.to_local(), mesh, [Partial()], shape=shape)
    say(f"\n-- A[:, k-shard] @ B[k-shard, :] is a partial sum: {partial.axe_layout} (pending {partial.reduce_op})")
    out = show_move(partial, [Shard(0)], shape, mesh_spec, itemsize, "Partial() -> Shard(0): reduce-scatter")
    torch.testing.assert_close(out.full_tensor(), a @ b, rtol=1e-4, atol=1e-4)
    say("   ok: equals A @ B")

    if args.cuda and world >= 2:
        m, kl, n = 256 * world, 1024, 512
        a_local = torch.randn(m, kl, device=device, dtype=torch.bfloat16)
        b_local = torch.randn(kl, n, device=device, dtype=torch.bfloat16)
        fused = ax.gemm_reduce_scatter(a_local, b_local, dist.group.WORLD)
        want = (a_local.float() @ b_local.float())
        dist.all_reduce(want)
        rank = dist.get_rank()
        want = want[rank * m // world:(rank + 1) * m // world]
        error = ((fused.float() - want).norm() / want.norm()).item()
        say(f"\n-- fused GEMM + reduce-scatter, one persistent kernel: [{m}x{kl}] @ [{kl}x{n}] x {world} ranks, "
            f"rel. error {error:.2e}")

    if args.mesh:
        two_axes(args.mesh, device_type)

    say("\ndemo finished")
    # every rank past its last collective before any tears its groups down; then the job ends
    # (axedist drops the groups it held at exit, while the interpreter still runs)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
