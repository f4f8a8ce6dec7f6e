"""2-D training step: axedist fully_shard x parallelize vs torch's fully_shard x parallelize_module.

    torchrun --nproc-per-node 4 benchmarks/bench_train_2d.py --out benchmarks/results          # CPU, gloo
    torchrun --nproc-per-node 4 benchmarks/bench_train_2d.py --cuda --out benchmarks/results   # 4 GPUs, NCCL

Both sides build the same ``Llama`` from the same seed on the mesh ``(dp, tp)`` (default
``(2, 2)``): tensor + sequence parallel on ``tp`` (axedist: ``llama_tp_plan``; torch: the equal
plan of torch styles), every block and then the root fully sharded over ``dp``, AdamW, each dp
rank training on its slice of the same batches. On CUDA parameters are fp32 and blocks compute
in bf16 (``MixedPrecisionPolicy(param_dtype=bfloat16, reduce_dtype=float32)`` on both sides).
A step is forward + backward + optimizer step; its time is the slowest rank's; the table gives
the median of ``--steps`` steps after ``--warmup``. One more step per side counts the bytes each
rank sends (axedist: its routes' ``count_collectives``; torch: ``CommDebugMode``) and the
collective calls. Also: each side's parameter + gradient + optimizer bytes per rank (the sharded
pieces) and axedist's peak of gathered parameter bytes. Writes ``bench_train_2d_<device>_w<W>``
``.json`` and ``.md`` to ``--out`` and a line to its history.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import subprocess

from axedist.env import keep_multicast_off

keep_multicast_off()  # before torch: NCCL and symmetric memory read the switches when they start

import torch
import torch.distributed as dist

import axedist as ax
from axedist.nn import MixedPrecisionPolicy, fsdp_units, fully_shard, parallelize, replicate
from axedist.nn.llama import Llama, LlamaConfig, llama_tp_plan, next_token_loss
from axedist.testing import torch_comm_bytes, torch_fully_shard_llama, torch_llama_loss

from history import timed_step  # benchmarks/history.py, beside this script


def say(*args) -> None:
    if dist.get_rank() == 0:
        print(*args, flush=True)


def state_bytes(model, optimizer) -> int:
    """This rank's bytes of parameters, gradients and optimizer state (their sharded pieces)."""
    total = 0
    for p in model.parameters():
        for t in [p, p.grad, *optimizer.state.get(p, {}).values()]:
            if isinstance(t, torch.Tensor) and t.dim():
                local = t.to_local() if hasattr(t, "to_local") else t
                total += local.numel() * local.element_size()
    return total


def build(kind: str, cfg: LlamaConfig, mesh: ax.DeviceMesh, policy, seed: int):
    torch.manual_seed(seed)
    model = Llama(cfg).to(mesh.device)
    if kind == "axedist":
        parallelize(model, mesh["tp"], llama_tp_plan(cfg, sequence_parallel=True))
        for layer in model.layers:
            fully_shard(layer, mesh, mp_policy=policy)
        fully_shard(model, mesh, mp_policy=policy)
    else:
        torch_fully_shard_llama(model, mesh.to_torch(), policy)
    return model


def forward_backward(kind: str, model, mesh: ax.DeviceMesh, inputs, targets):
    logits = model(inputs)
    if kind == "axedist":
        loss = next_token_loss(logits, replicate(targets, mesh["tp"]))
        loss.backward()
        return loss
    return torch_llama_loss(logits, targets, mesh.to_torch()["tp"])  # backward inside loss_parallel


def run(kind: str, cfg, mesh, policy, data, warmup: int, seed: int) -> dict:
    model = build(kind, cfg, mesh, policy, seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=False)
    cuda = mesh.device_type == "cuda"
    dp = mesh.axis_size("dp")
    rows = slice(mesh.coordinates()["dp"] * (data[0].shape[0] // dp), (mesh.coordinates()["dp"] + 1) *
                 (data[0].shape[0] // dp))
    times, losses = [], []
    for i, tokens in enumerate(data):
        tokens = tokens[rows].to(mesh.device)

        def step():
            loss = forward_backward(kind, model, mesh, tokens[:, :-1], tokens[:, 1:])
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            return loss

        loss, ms = timed_step(step, mesh.device, cuda)
        value = loss.detach().full_tensor().float()
        dist.all_reduce(value, group=mesh.group("dp"))
        losses.append(float(value) / dp)
        if i >= warmup:
            times.append(ms)
    # one counted step: bytes sent by this rank, then the sharded state after it
    tokens = data[0][rows].to(mesh.device)
    if kind == "axedist":
        with ax.count_collectives() as seen:
            forward_backward(kind, model, mesh, tokens[:, :-1], tokens[:, 1:])
        sent, calls = seen.bytes_sent, seen.calls
        peak = max(u.schedule.peak_bytes for u in fsdp_units(model))
    else:
        _, sent = torch_comm_bytes(lambda: forward_backward(kind, model, mesh, tokens[:, :-1], tokens[:, 1:]))
        calls, peak = None, None
    memory = state_bytes(model, optimizer)
    return {"median_ms": statistics.median(times), "losses": losses, "bytes_per_step": sent, "calls": calls,
            "state_bytes": memory, "peak_gathered_bytes": peak}


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--cuda", action="store_true")
    p.add_argument("--dp", type=int, default=2)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--batch", type=int, default=None, help="sequences per step over all dp ranks (default: 8)")
    p.add_argument("--seq", type=int, default=None, help="default: 64 CPU, 1024 CUDA")
    p.add_argument("--dim", type=int, default=None, help="default: 128 CPU, 2048 CUDA")
    p.add_argument("--layers", type=int, default=None, help="default: 2 CPU, 4 CUDA")
    p.add_argument("--vocab", type=int, default=None, help="default: 256 CPU, 8192 CUDA")
    p.add_argument("--out", default=None, help="write bench_train_2d_<device>_w<W>.json/.md here")
    args = p.parse_args(argv)
    cuda = args.cuda
    world = int(os.environ.get("WORLD_SIZE", "1"))
    mesh = ax.init_mesh((args.dp, world // args.dp), ("dp", "tp"), device_type="cuda" if cuda else "cpu")
    if not cuda:
        torch.set_num_threads(1)
    pick = lambda value, cpu, gpu: value if value is not None else (gpu if cuda else cpu)  # noqa: E731
    dim = pick(args.dim, 128, 2048)
    cfg = LlamaConfig(vocab_size=pick(args.vocab, 256, 8192), dim=dim, n_layers=pick(args.layers, 2, 4),
                      n_heads=pick(None, 4, 16), ffn_hidden=64 * -(-8 * dim // 3 // 64),
                      max_seq_len=pick(args.seq, 64, 1024))
    batch = args.batch or 8
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if cuda else \
        MixedPrecisionPolicy()
    g = torch.Generator().manual_seed(1234)
    data = [torch.randint(0, cfg.vocab_size, (batch, cfg.max_seq_len + 1), generator=g)
            for _ in range(args.warmup + args.steps)]
    say(f"mesh {mesh}; {cfg}; batch {batch} x seq {cfg.max_seq_len}; "
        f"{'bf16 compute, fp32 parameters' if cuda else 'fp32'}")
    results = {}
    for kind in ("axedist", "torch"):
        results[kind] = run(kind, cfg, mesh, policy, data, args.warmup, seed=0)
        r = results[kind]
        say(f"{kind:8s} median step {r['median_ms']:8.2f} ms  bytes/step {r['bytes_per_step']:>12,}  "
            f"state {r['state_bytes']:>12,} B  first losses {[round(v, 4) for v in r['losses'][:3]]}")
    ratio = results["torch"]["median_ms"] / results["axedist"]["median_ms"]
    bytes_ratio = results["axedist"]["bytes_per_step"] / results["torch"]["bytes_per_step"]
    say(f"torch / axedist step time: {ratio:.2f}x; axedist / torch bytes: {bytes_ratio:.3f}")
    if args.out and dist.get_rank() == 0:
        os.makedirs(args.out, exist_ok=True)
        try:
            commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                                    check=True).stdout.strip()
        except (OSError, subprocess.CalledProcessError):
            commit = ""
        device = torch.cuda.get_device_name() if cuda else "cpu"
        command = f"torchrun --nproc-per-node {world} benchmarks/bench_train_2d.py" + (" --cuda" if cuda else "")
        record = {"date": datetime.date.today().isoformat(), "commit": commit, "device": device, "world": world,
                  "mesh": {"dp": args.dp, "tp": world // args.dp}, "batch": batch, "config": cfg.__dict__,
                  "mixed_precision": cuda, "warmup": args.warmup, "steps": args.steps, "command": command,
                  "results": results, "torch_over_axedist_time": ratio, "axedist_over_torch_bytes": bytes_ratio}
        stem = os.path.join(args.out, f"bench_train_2d_{'cuda' if cuda else 'cpu'}_w{world}")
        with open(stem + ".json", "w") as f:
            json.dump(record, f, indent=1)
        from history import append_history  # benchmarks/history.py, beside this script
        append_history(args.out, os.path.basename(stem), dict(record, machine=f"{world}x {device}"),
                       dict(results=results, torch_over_axedist_time=ratio, axedist_over_torch_bytes=bytes_ratio))
        a, t = results["axedist"], results["torch"]
        with open(stem + ".md", "w") as f:
            f.write(f"# 2-D training step (FSDP x TP): axedist vs torch fully_shard + parallelize_module\n\n"
                    f"{record['date']}, commit {commit}, {device} x {world}, mesh (dp, tp) = ({args.dp}, "
                    f"{world // args.dp}), {'bf16 compute / fp32 parameters' if cuda else 'fp32'}, batch {batch} x "
                    f"seq {cfg.max_seq_len}, dim {cfg.dim}, {cfg.n_layers} layers, vocab {cfg.vocab_size}, TP + SP; "
                    f"median of {args.steps} steps after {args.warmup} warm-up, slowest rank. `{command}`\n\n"
                    f"| implementation | median step (ms) | bytes sent per rank per step | collective calls | "
                    f"param + grad + optimizer B per rank | first loss |\n|---|---|---|---|---|---|\n"
                    f"| axedist | {a['median_ms']:.2f} | {a['bytes_per_step']:,} | {a['calls']} | "
                    f"{a['state_bytes']:,} | {a['losses'][0]:.4f} |\n"
                    f"| torch | {t['median_ms']:.2f} | {t['bytes_per_step']:,} | - | {t['state_bytes']:,} | "
                    f"{t['losses'][0]:.4f} |\n\n"
                    f"torch / axedist step time: {ratio:.2f}x; axedist / torch bytes: {bytes_ratio:.3f}; axedist's "
                    f"peak of gathered parameters: {a['peak_gathered_bytes']:,} B per rank.\n")
        say(f"wrote {stem}.json and {stem}.md")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
