"""Train a small Llama with fully sharded data parallel x tensor (and sequence) parallelism on axedist DTensors.

    torchrun --nproc-per-node 4 launch/train_tp.py                 # CPU, gloo, dp=2 x tp=2 (about a minute)
    torchrun --nproc-per-node 4 launch/train_tp.py --dp 1          # tensor parallel only, TP=4 (a 1-D mesh)
    torchrun --nproc-per-node 4 launch/train_tp.py --cuda          # GPUs, NCCL, bf16 compute, fused GEMM + RS
    torchrun --nproc-per-node 4 launch/train_tp.py --no-sequence-parallel --steps 40
    torchrun --nproc-per-node 4 launch/train_tp.py --compile       # each block torch.compile'd (Inductor)

Every rank builds the same model from the same seed; ``parallelize`` lays it out on the mesh's
``tp`` axis with the Llama plan (``axedist.nn.llama.llama_tp_plan``): attention heads and the
MLP hidden dim split, vocab-parallel embedding and loss, and with sequence parallelism (default)
the residual stream sharded on the sequence, so each row-parallel output is a reduce-scatter
(on CUDA the fused GEMM + reduce-scatter kernel). With ``--dp`` > 1 (default 2 on 4 or more
ranks) the mesh is ``(dp, tp)`` and ``fully_shard`` shards every block's parameters (and the
rest at the root) over ``dp`` too: each parameter is one DTensor on the 2-D mesh, gathered over
``dp`` before its block runs, its gradient reduce-scattered over ``dp``; each dp rank trains on
its own slice of the batch. On CUDA the parameters stay fp32 (optimizer state too) and blocks
compute in bf16 (``MixedPrecisionPolicy``). The data are synthetic and learnable: every sequence counts
modulo the vocabulary from a random start with a random stride (1, 2, 3 or 5), so after the
first two tokens the next one is determined and the loss falls from ln(vocab) towards zero.

Rank 0 prints each layer's layouts and the collectives inferred for it (once, at the start),
the collectives of one training step, a progress bar and periodic loss lines; it writes ``losses.json`` and ``loss.png`` to
``--out`` (default ``runs/train_tp``), and every rank writes its shards of a
``torch.distributed.checkpoint`` to ``--out/checkpoint`` (read by ``launch/infer_tp.py``).

Ctrl-C (SIGINT, or SIGTERM) stops after the step in progress: every rank finishes the same step,
the model, the optimizer, the step, the losses and the RNG states go to ``--out/checkpoint``, and
the run says so (or that it could not save) and exits; ``--resume`` continues from there with
the same losses as a run never stopped (the data of step s is a function of s and ``--seed``).
torchrun waits 30 s (``--shutdown-timeout``) for the ranks to exit after a Ctrl-C.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import signal
import sys
import time

from axedist.env import keep_multicast_off

keep_multicast_off()  # before torch: NCCL and symmetric memory read the switches when they start

import torch
import torch.distributed as dist

import axedist as ax
from axedist.nn import MixedPrecisionPolicy, checkpoint, describe, fsdp_units, fully_shard, parallelize, replicate
from axedist.nn.llama import Llama, LlamaConfig, llama_tp_plan, next_token_loss
from axedist.runtime import count_collectives

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
    p.add_argument("--dp", type=int, default=None,
                   help="data-parallel degree: fully shard over a dp axis of a (dp, tp) mesh (default: 2 on 4 or "
                        "more ranks, else 1); --dp 1: tensor parallel only, on a 1-D mesh")
    p.add_argument("--steps", type=int, default=None, help="optimizer steps (default: 60 on CPU, 200 on CUDA)")
    p.add_argument("--batch", type=int, default=None, help="sequences per step (default: 16)")
    p.add_argument("--seq", type=int, default=None, help="sequence length (default: 32 CPU, 512 CUDA)")
    p.add_argument("--dim", type=int, default=None, help="model width (default: 64 CPU, 1024 CUDA)")
    p.add_argument("--layers", type=int, default=None, help="transformer blocks (default: 2 CPU, 4 CUDA)")
    p.add_argument("--heads", type=int, default=None, help="attention heads (default: 4 CPU, 16 CUDA)")
    p.add_argument("--kv-heads", type=int, default=None, help="key/value heads (default: = heads)")
    p.add_argument("--ffn", type=int, default=None, help="MLP hidden size (default: 2 * dim rounded)")
    p.add_argument("--vocab", type=int, default=None, help="vocabulary (default: 64 CPU, 512 CUDA)")
    p.add_argument("--tie-embeddings", action="store_true", help="share the embedding and output weights")
    p.add_argument("--no-sequence-parallel", dest="sequence_parallel", action="store_false",
                   help="replicate activations between blocks (all-reduce) instead of sharding the sequence")
    p.add_argument("--dtype", default=None, choices=["float32", "bfloat16", "float64"],
                   help="parameter dtype (default: float32 on CPU, bfloat16 on CUDA, which the fused kernel takes)")
    p.add_argument("--lr", type=float, default=None,
                   help="AdamW's learning rate (default: 6e-3 CPU; 1e-3 CUDA: at the CUDA size 6e-3 did not learn the "
                        "sequences in 200 steps, fused or not, TP=2 or 1: loss 2.8-4.4; 1e-3: 0.009, 2e-3: 0.02)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--log-every", type=int, default=10)
    p.add_argument("--out", default="runs/train_tp", help="output directory (losses.json, loss.png, checkpoint/)")
    p.add_argument("--no-checkpoint", dest="checkpoint", action="store_false")
    p.add_argument("--resume", action="store_true",
                   help="continue from --out/checkpoint (saved at the end, or when stopped with Ctrl-C)")
    p.add_argument("--compile", nargs="?", const="inductor", default=None, metavar="BACKEND",
                   help="torch.compile each transformer block, whole (fullgraph); BACKEND: inductor (default), "
                        "aot_eager, ...")
    return p.parse_args(argv)


def config_from(args, world: int, dp: int = 1) -> tuple[LlamaConfig, dict]:
    cuda = args.cuda
    pick = lambda value, cpu, gpu: value if value is not None else (gpu if cuda else cpu)  # noqa: E731
    dim = pick(args.dim, 64, 1024)
    cfg = LlamaConfig(vocab_size=pick(args.vocab, 64, 512), dim=dim, n_layers=pick(args.layers, 2, 4),
                      n_heads=pick(args.heads, 4, 16), n_kv_heads=args.kv_heads,
                      ffn_hidden=args.ffn or 64 * math.ceil(8 * dim / 3 / 64),
                      max_seq_len=pick(args.seq, 32, 512), tie_embeddings=args.tie_embeddings)
    run = dict(steps=pick(args.steps, 60, 200), batch=pick(args.batch, 16, 16), seq=cfg.max_seq_len,
               dtype=getattr(torch, args.dtype or ("bfloat16" if cuda else "float32")), lr=pick(args.lr, 6e-3, 1e-3))
    if cfg.kv_heads % world or cfg.n_heads % world or cfg.ffn_hidden % world:
        raise SystemExit(f"heads ({cfg.n_heads}), kv heads ({cfg.kv_heads}) and ffn ({cfg.ffn_hidden}) must be "
                         f"divisible by the {world} tensor-parallel ranks")
    if args.sequence_parallel and run["seq"] % world:
        raise SystemExit(f"sequence parallelism needs the sequence length ({run['seq']}) divisible by {world}")
    if run["batch"] % dp:
        raise SystemExit(f"the batch ({run['batch']}) must be divisible by the {dp} data-parallel ranks")
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
    grid = f"dp={record['dp']} x tp={record['world'] // record['dp']}" if record.get("dp", 1) > 1 else \
        f"{record['world']} ranks"
    ax_.set_title(f"axedist {'FSDP x ' if record.get('dp', 1) > 1 else ''}{sp}, {grid} ({record['device']})")
    ax_.legend()
    fig.tight_layout()
    fig.savefig(os.path.join(out, "loss.png"), dpi=120)
    plt.close(fig)


class Interrupt:
    """SIGINT / SIGTERM ask for a stop after the step in progress. A rank may get the signal a
    step later than another, so ``agreed()`` (once a step: a MAX all-reduce of one flag) tells
    every rank the same answer. A third signal (a terminal's Ctrl-C and torchrun's copy of it
    make two) stops at once, without the checkpoint."""

    def __init__(self):
        self.count = 0
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, self._handle)

    def _handle(self, signum, frame) -> None:
        self.count += 1
        if self.count >= 3:
            raise KeyboardInterrupt

    def agreed(self, device) -> bool:
        flag = torch.tensor([min(self.count, 1)], device=device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return bool(flag.item())


def save_state(args, model, optimizer, cfg, step: int, losses: list) -> str:
    """The resumable checkpoint: model, optimizer, RNG states, and step / losses / config."""
    path = os.path.join(args.out, "checkpoint")
    checkpoint.save(model, path, optimizer=optimizer,
                    extra={"step": step, "losses": losses, "seed": args.seed, "config": cfg.__dict__})
    if dist.get_rank() == 0:
        with open(os.path.join(args.out, "config.json"), "w") as f:
            json.dump({"config": cfg.__dict__, "dtype": args.dtype or str(next(model.parameters()).dtype).replace(
                "torch.", ""), "seed": args.seed}, f, indent=1)
    return path


def resume(args, model, optimizer, cfg) -> tuple[int, list]:
    """(the first step to run, the losses so far): from ``--out/checkpoint`` with ``--resume``."""
    if not args.resume:
        return 1, []
    path = os.path.join(args.out, "checkpoint")
    extra = checkpoint.load(model, path, optimizer=optimizer).extra
    if extra.get("seed") != args.seed or extra.get("config") != cfg.__dict__:
        raise SystemExit(f"--resume: {path} was trained with seed {extra.get('seed')} and config "
                         f"{extra.get('config')}; this run has seed {args.seed} and {cfg.__dict__}")
    say(f"resumed from {path} after step {extra['step']}")
    return extra["step"] + 1, list(extra["losses"])


def stop_interrupted(args, model, optimizer, cfg, step: int, losses: list) -> None:
    """After an agreed interrupt: save the resumable checkpoint, say what happened, exit."""
    try:
        path = save_state(args, model, optimizer, cfg, step, losses)
        say(f"\ninterrupted after step {step}: saved a resumable checkpoint to {path} "
            f"(continue with --resume)")
        code = 0
    except Exception as error:  # noqa: BLE001 -- say it, whatever it was
        say(f"\ninterrupted after step {step}: could NOT save a checkpoint ({type(error).__name__}: {error})")
        code = 1
    dist.barrier()
    dist.destroy_process_group()
    raise SystemExit(code)


def data_and_tensor_mesh(args) -> tuple[ax.DeviceMesh, ax.DeviceMesh, int]:
    """``(mesh, its tp axis, dp)``: a ``(dp, tp)`` mesh for ``--dp`` > 1, else one 1-D mesh."""
    device_type = "cuda" if args.cuda else "cpu"
    world = int(os.environ.get("WORLD_SIZE", "1"))
    dp = args.dp if args.dp is not None else (2 if world >= 4 and world % 2 == 0 else 1)
    if dp < 1 or world % dp:
        raise SystemExit(f"--dp {dp} must divide the {world} ranks")
    if dp == 1:
        mesh = ax.init_mesh(device_type=device_type)
        return mesh, mesh, 1
    mesh = ax.init_mesh((dp, world // dp), ("dp", "tp"), device_type=device_type)
    return mesh, mesh["tp"], dp


def main(argv=None) -> None:
    args = parse_args(argv)
    mesh, tp_mesh, dp = data_and_tensor_mesh(args)
    world, device = mesh.size(), mesh.device
    if not args.cuda:
        torch.set_num_threads(1)  # the ranks share the machine's cores
    cfg, run = config_from(args, tp_mesh.size(), dp)
    kind = f"{'sequence + tensor' if args.sequence_parallel else 'tensor'} parallel"
    say(f"mesh {mesh}, {run['dtype']}, {'fully sharded data x ' if dp > 1 else ''}{kind}")
    say(f"model {cfg}")

    torch.manual_seed(args.seed)
    # fully sharded: fp32 parameters (and optimizer state), blocks compute in run["dtype"]
    model = Llama(cfg).to(device=device, dtype=torch.float32 if dp > 1 else run["dtype"])
    n_params = sum(p.numel() for p in model.parameters())
    parallelize(model, tp_mesh, llama_tp_plan(cfg, sequence_parallel=args.sequence_parallel))
    if dp > 1:
        policy = MixedPrecisionPolicy(param_dtype=None if run["dtype"] == torch.float32 else run["dtype"])
        for layer in model.layers:
            fully_shard(layer, mesh, mp_policy=policy)
        fully_shard(model, mesh, mp_policy=policy)
    optimizer = torch.optim.AdamW(model.parameters(), lr=run["lr"], weight_decay=0.0, foreach=False)
    rows = slice(mesh.coordinates()["dp"] * (run["batch"] // dp), (mesh.coordinates()["dp"] + 1) * (run["batch"] // dp)) \
        if dp > 1 else slice(None)  # this dp rank's sequences of each batch

    # One forward to record the collectives each layer runs, then the printout.
    inputs, _ = counting_batch(0, run["batch"], run["seq"], cfg.vocab_size, args.seed)
    with torch.no_grad():
        model(inputs[rows].to(device))
    say(f"\n{n_params:,} parameters; layers, their layouts{' on the (dp, tp) mesh' if dp > 1 else ''} and the "
        f"collectives inferred for them:")
    say(describe(model))
    if dp > 1:
        say("fully sharded units: " + "; ".join(f"{u.name or '<root>'} ({len(u.params)} parameters)"
                                                for u in fsdp_units(model)))
    say("")
    if args.compile:
        # each block's forward is one graph, its TP collectives included (the blocks share it);
        # the hooks fully_shard puts on the block (gather before, free and reduce-scatter after)
        # stay outside it, as torch's FSDP2 hooks stay outside a compiled block
        for block in model.layers:
            block.forward = torch.compile(block.forward, backend=args.compile, fullgraph=True)
        say(f"each transformer block compiled (torch.compile, backend {args.compile}, fullgraph=True)")

    first, losses = resume(args, model, optimizer, cfg)
    interrupt, started = Interrupt(), time.perf_counter()
    tty = sys.stdout.isatty()
    for step in range(first, run["steps"] + 1):
        inputs, targets = counting_batch(step, run["batch"], run["seq"], cfg.vocab_size, args.seed)
        with count_collectives() as seen:
            logits = model(inputs[rows].to(device))
            loss = next_token_loss(logits, replicate(targets[rows].to(device), tp_mesh))
            loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        value = loss.detach().full_tensor().float()
        if dp > 1:  # the batch's loss: the mean of the dp ranks' (equal slices)
            dist.all_reduce(value, group=mesh.group("dp"))
            value = value / dp
        value = float(value)
        losses.append(value)
        if step == 1:
            say(f"collectives of one training step (forward + backward, per rank):\n{seen}\n")
        if tty:
            say("\r" + progress(step, run["steps"], value, started), end="")
        if step % args.log_every == 0 or step == run["steps"]:
            say(("\r" if tty else "") + f"step {step:4d}  loss {value:.4f}  " + progress(step, run["steps"], value,
                                                                                       started))
        if interrupt.agreed(device):
            stop_interrupted(args, model, optimizer, cfg, step, losses)
    seconds = time.perf_counter() - started
    say(f"\ntrained {run['steps']} steps in {seconds:.1f} s: loss {losses[0]:.4f} -> {losses[-1]:.4f} "
        f"(ln(vocab) = {math.log(cfg.vocab_size):.4f})")

    record = {"loss": losses, "world": world, "dp": dp, "device": mesh.device_type,
              "sequence_parallel": args.sequence_parallel,
              "seconds": seconds, "dtype": str(run["dtype"]), "batch": run["batch"], "seq": run["seq"],
              "lr": run["lr"], "seed": args.seed, "config": cfg.__dict__}
    if dist.get_rank() == 0:
        write_outputs(args.out, record)
        say(f"wrote {args.out}/losses.json and {args.out}/loss.png")
    if args.checkpoint:
        path = save_state(args, model, optimizer, cfg, run["steps"], losses)
        say(f"saved the parameters with torch.distributed.checkpoint to {path} (load: launch/infer_tp.py)")
    say("training finished")
    # every rank past its last collective before any tears its groups down; then the job ends
    # (axedist drops the groups it held at exit, while the interpreter still runs)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
