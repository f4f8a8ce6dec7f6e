"""Train a small Llama with tensor (and sequence) parallelism on axedist DTensors.

    torchrun --nproc-per-node 4 launch/train_tp.py                 # CPU, gloo (about a minute)
    torchrun --nproc-per-node 4 launch/train_tp.py --cuda          # GPUs, NCCL, bf16, fused GEMM + RS
    torchrun --nproc-per-node 4 launch/train_tp.py --no-sequence-parallel --steps 40
    torchrun --nproc-per-node 4 launch/train_tp.py --compile       # each block torch.compile'd (Inductor)

Every rank builds the same model from the same seed; ``parallelize`` lays it out with the
Llama plan (``axedist.nn.llama.llama_tp_plan``): attention heads and the MLP hidden dim split,
vocab-parallel embedding and loss, and with sequence parallelism (default) the residual stream
sharded on the sequence, so each row-parallel output is a reduce-scatter (on CUDA the fused
GEMM + reduce-scatter kernel). The data are synthetic and learnable: every sequence counts
modulo the vocabulary from a random start with a random stride (1, 2, 3 or 5), so after the
first two tokens the next one is determined and the loss falls from ln(vocab) towards zero.

Rank 0 prints each layer's layouts and the collectives inferred for it (once, at the start),
a progress bar and periodic loss lines; it writes ``losses.json`` and ``loss.png`` to
``--out`` (default ``runs/train_tp``), and every rank writes its shards of a
``torch.distributed.checkpoint`` to ``--out/checkpoint`` (read by ``launch/infer_tp.py``).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time

# Multicast stays off on shared GPU hosts (project policy), also for processes we start.
for _key, _value in {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
                     "NVSHMEM_DISABLE_NVLS": "1"}.items():
    os.environ.setdefault(_key, _value)

import torch
import torch.distributed as dist

import axedist as ax
from axedist.nn import checkpoint, describe, parallelize, replicate
from axedist.nn.llama import Llama, LlamaConfig, llama_tp_plan, next_token_loss

STRIDES = (1, 2, 3, 5)


def say(*args, end="\n") -> None:
    if dist.get_rank() == 0:
        print(*args, end=end, flush=True)


def counting_batch(step: int, batch: int, seq: int, vocab: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Inputs and next-token targets, ``[batch, seq]`` each, the same on every rank.

    Row r counts ``start, start + stride, ...`` modulo ``vocab``; e.g. vocab 10, start 7,
    stride 3: ``7 0 3 6 9 2 ...``.
    """
    g = torch.Generator().manual_seed(seed * 1_000_003 + step)
    start = torch.randint(0, vocab, (batch, 1), generator=g)
    stride = torch.tensor(STRIDES)[torch.randint(0, len(STRIDES), (batch, 1), generator=g)]
    tokens = (start + stride * torch.arange(seq + 1)) % vocab
    return tokens[:, :-1], tokens[:, 1:]


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--cuda", action="store_true", help="GPUs and NCCL (default: CPU and gloo)")
    p.add_argument("--steps", type=int, default=None, help="optimizer steps (default: 60 on CPU, 200 on CUDA)")
    p.add_argument("--batch", type=int, default=None, help="sequences per step (default: 16)")
    p.add_argument("--seq", type=int, default=None, help="sequence length (default: 32 CPU, 512 CUDA)")
    p.add_argument("--dim", type=int, default=None, help="model width (default: 64 CPU, 1024 CUDA)")
    p.add_argument("--layers", type=int, default=None, help="transformer blocks (default: 2 CPU, 4 CUDA)")
    p.add_argument("--heads", type=int, default=None, help="attention heads (default: 4 CPU, 16 CUDA)")
    p.add_argument("--kv-heads", type=int, default=None, help="key/value heads (default: = heads)")
    p.add_argument("--ffn", type=int, default=None, help="MLP hidden size (default: 2 * dim rounded)")
    p.add_argument("--vocab", type=int, default=None, help="vocabulary (default: 64 CPU, 4096 CUDA)")
    p.add_argument("--tie-embeddings", action="store_true", help="share the embedding and output weights")
    p.add_argument("--no-sequence-parallel", dest="sequence_parallel", action="store_false",
                   help="replicate activations between blocks (all-reduce) instead of sharding the sequence")
    p.add_argument("--dtype", default=None, choices=["float32", "bfloat16", "float64"],
                   help="parameter dtype (default: float32 on CPU, bfloat16 on CUDA, which the fused kernel takes)")
    p.add_argument("--lr", type=float, default=6e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--log-every", type=int, default=10)
    p.add_argument("--out", default="runs/train_tp", help="output directory (losses.json, loss.png, checkpoint/)")
    p.add_argument("--no-checkpoint", dest="checkpoint", action="store_false")
    p.add_argument("--compile", nargs="?", const="inductor", default=None, metavar="BACKEND",
                   help="torch.compile each transformer block, whole (fullgraph); BACKEND: inductor (default), "
                        "aot_eager, ...")
    return p.parse_args(argv)


def config_from(args, world: int) -> tuple[LlamaConfig, dict]:
    cuda = args.cuda
    pick = lambda value, cpu, gpu: value if value is not None else (gpu if cuda else cpu)  # noqa: E731
    dim = pick(args.dim, 64, 1024)
    cfg = LlamaConfig(vocab_size=pick(args.vocab, 64, 4096), dim=dim, n_layers=pick(args.layers, 2, 4),
                      n_heads=pick(args.heads, 4, 16), n_kv_heads=args.kv_heads,
                      ffn_hidden=args.ffn or 64 * math.ceil(8 * dim / 3 / 64),
                      max_seq_len=pick(args.seq, 32, 512), tie_embeddings=args.tie_embeddings)
    run = dict(steps=pick(args.steps, 60, 200), batch=pick(args.batch, 16, 16), seq=cfg.max_seq_len,
               dtype=getattr(torch, args.dtype or ("bfloat16" if cuda else "float32")))
    if cfg.kv_heads % world or cfg.n_heads % world or cfg.ffn_hidden % world:
        raise SystemExit(f"heads ({cfg.n_heads}), kv heads ({cfg.kv_heads}) and ffn ({cfg.ffn_hidden}) must be "
                         f"divisible by the {world} tensor-parallel ranks")
    if args.sequence_parallel and run["seq"] % world:
        raise SystemExit(f"sequence parallelism needs the sequence length ({run['seq']}) divisible by {world}")
    return cfg, run


def progress(step: int, total: int, loss: float, started: float, width: int = 30) -> str:
    done = int(width * step / total)
    rate = step / max(time.perf_counter() - started, 1e-9)
    return f"[{'#' * done}{'.' * (width - done)}] {step}/{total} loss {loss:.4f} {rate:.1f} step/s"


def write_outputs(out: str, record: dict) -> None:
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "losses.json"), "w") as f:
        json.dump(record, f, indent=1)
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("(matplotlib missing: no loss.png)")
        return
    fig, ax_ = plt.subplots(figsize=(6, 3.5))
    ax_.plot(range(1, len(record["loss"]) + 1), record["loss"], lw=1.5)
    ax_.axhline(math.log(record["config"]["vocab_size"]), color="grey", ls="--", lw=0.8, label="ln(vocab)")
    ax_.set_xlabel("step")
    ax_.set_ylabel("cross-entropy")
    sp = "TP + SP" if record["sequence_parallel"] else "TP"
    ax_.set_title(f"axedist {sp}, {record['world']} ranks ({record['device']})")
    ax_.legend()
    fig.tight_layout()
    fig.savefig(os.path.join(out, "loss.png"), dpi=120)
    plt.close(fig)


def main(argv=None) -> None:
    args = parse_args(argv)
    mesh = ax.init_mesh(device_type="cuda" if args.cuda else "cpu")
    world, device = mesh.size, mesh.device
    if not args.cuda:
        torch.set_num_threads(1)  # the ranks share the machine's cores
    cfg, run = config_from(args, world)
    say(f"mesh {mesh}, {run['dtype']}, {'sequence + tensor' if args.sequence_parallel else 'tensor'} parallel")
    say(f"model {cfg}")

    torch.manual_seed(args.seed)
    model = Llama(cfg).to(device=device, dtype=run["dtype"])
    n_params = sum(p.numel() for p in model.parameters())
    parallelize(model, mesh, llama_tp_plan(cfg, sequence_parallel=args.sequence_parallel))
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0, foreach=False)

    # One forward to record the collectives each layer runs, then the printout.
    inputs, _ = counting_batch(0, run["batch"], run["seq"], cfg.vocab_size, args.seed)
    with torch.no_grad():
        model(inputs.to(device))
    say(f"\n{n_params:,} parameters; layers, their layouts and the collectives inferred for them:")
    say(describe(model))
    say("")
    if args.compile:
        for block in model.layers:  # one graph each, collectives included; the blocks share it
            block.compile(backend=args.compile, fullgraph=True)
        say(f"each transformer block compiled (torch.compile, backend {args.compile}, fullgraph=True)")

    losses, started = [], time.perf_counter()
    tty = sys.stdout.isatty()
    for step in range(1, run["steps"] + 1):
        inputs, targets = counting_batch(step, run["batch"], run["seq"], cfg.vocab_size, args.seed)
        logits = model(inputs.to(device))
        loss = next_token_loss(logits, replicate(targets, mesh))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        value = float(loss.detach().full_tensor().float())
        losses.append(value)
        if tty:
            say("\r" + progress(step, run["steps"], value, started), end="")
        if step % args.log_every == 0 or step == run["steps"]:
            say(("\r" if tty else "") + f"step {step:4d}  loss {value:.4f}  " + progress(step, run["steps"], value,
                                                                                       started))
    seconds = time.perf_counter() - started
    say(f"\ntrained {run['steps']} steps in {seconds:.1f} s: loss {losses[0]:.4f} -> {losses[-1]:.4f} "
        f"(ln(vocab) = {math.log(cfg.vocab_size):.4f})")

    record = {"loss": losses, "world": world, "device": mesh.device_type, "sequence_parallel": args.sequence_parallel,
              "seconds": seconds, "dtype": str(run["dtype"]), "batch": run["batch"], "seq": run["seq"],
              "lr": args.lr, "seed": args.seed, "config": cfg.__dict__}
    if dist.get_rank() == 0:
        write_outputs(args.out, record)
        say(f"wrote {args.out}/losses.json and {args.out}/loss.png")
    if args.checkpoint:
        path = os.path.join(args.out, "checkpoint")
        checkpoint.save(model, path)
        if dist.get_rank() == 0:
            with open(os.path.join(args.out, "config.json"), "w") as f:
                json.dump({"config": cfg.__dict__, "dtype": args.dtype or str(run["dtype"]).replace("torch.", ""),
                           "seed": args.seed}, f, indent=1)
        say(f"saved the parameters with torch.distributed.checkpoint to {path} (load: launch/infer_tp.py)")
    say("training finished")
    # every rank past its last collective before any tears gloo down (a rank that left early
    # once made its peer's gloo thread abort with "terminate called without an active exception")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
