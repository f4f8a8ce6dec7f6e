"""Where context-parallel causal attention's device time goes, against the whole sequence's SDPA
and torch's context_parallel: the CUDA kernels of one forward + backward per side (torch profiler),
at W = WORLD_SIZE (torchrun). Prints each side's top kernels; writes probe_context_parallel.json to
$OUT when set.

    torchrun --nproc-per-node 1 benchmarks/device/probe_context_parallel.py 8192
"""
import json
import os
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor.experimental import context_parallel as torch_context_parallel

import axedist as ax
from axedist.nn import SequenceShards, context_parallel


def main() -> None:
    length = int(sys.argv[1]) if len(sys.argv) > 1 else 8192
    dist.init_process_group("nccl")
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    world = dist.get_world_size()
    mesh, torch_mesh = ax.DeviceMesh("cuda", (world,)), init_device_mesh("cuda", (world,))
    q, k, v, g = (torch.randn(1, h, length, 128, device="cuda", dtype=torch.bfloat16) for h in (32, 8, 8, 32))
    here = SequenceShards.of(length, world).positions(mesh.position(), "cuda")
    pieces = [t[:, :, here].contiguous() for t in (q, k, v, g)]
    positions = torch.arange(length, device="cuda")

    def whole():
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        F.scaled_dot_product_attention(*leaves, is_causal=True, enable_gqa=True).backward(g)

    def side(enter, on):
        def call():
            leaves = [t.clone().requires_grad_() for t in pieces[:3]]
            with enter(on, buffers=[positions.clone()], buffer_seq_dims=[0]):
                F.scaled_dot_product_attention(*leaves, is_causal=True, enable_gqa=True).backward(pieces[3])
        return call

    report = {}
    for name, fn in (("whole", whole), ("axedist", side(context_parallel, mesh)),
                     ("torch", side(torch_context_parallel, torch_mesh))):
        for _ in range(3):
            fn()
        torch.cuda.synchronize()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA,
                                                torch.profiler.ProfilerActivity.CPU]) as prof:
            fn()
            torch.cuda.synchronize()
        kernels = sorted(((e.key, e.device_time_total / 1e3, e.count) for e in prof.key_averages()
                          if e.device_time_total > 0 and e.device_type == torch.autograd.DeviceType.CUDA),
                         key=lambda row: -row[1])
        ops = sorted(((e.key, e.device_time_total / 1e3, e.count) for e in prof.key_averages()
                      if e.key.startswith("aten::_") and "attention" in e.key), key=lambda row: -row[1])
        report[name] = dict(kernels=kernels[:12], attention_ops=ops, total_ms=sum(k[1] for k in kernels))
        if dist.get_rank() == 0:
            print(f"== {name}: {report[name]['total_ms']:.3f} ms of kernels")
            for key, ms, count in kernels[:12]:
                print(f"   {ms:8.3f} ms  x{count:<3} {key[:110]}")
            for key, ms, count in ops:
                print(f"   op {key} x{count} ({ms:.3f} ms)")
    if dist.get_rank() == 0 and os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], "probe_context_parallel.json"), "w") as handle:
            json.dump(dict(length=length, world=world, commit=os.environ.get("AXEDIST_COMMIT"), report=report), handle,
                      indent=1)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
