"""Greedy decoding with the tensor-parallel Llama trained by ``launch/train_tp.py``.

    torchrun --nproc-per-node 4 launch/train_tp.py                    # writes runs/train_tp/checkpoint
    torchrun --nproc-per-node 2 launch/infer_tp.py                    # loads it at TP=2 (resharded by DCP)
    torchrun --nproc-per-node 4 launch/infer_tp.py --cuda
    torchrun --nproc-per-node 1 launch/infer_tp.py --cuda --cuda-graphs   # one GPU, TP=1

The checkpoint may have been written at another TP degree: ``torch.distributed.checkpoint``
reads each rank's shards through torch DTensors (``axedist.nn.checkpoint.load``). Decoding runs
under ``torch.inference_mode()`` on the same parallel layers as training (no sequence
parallelism: any prompt length works), and rank 0 prints the continuation, whether it follows
the counting pattern the model was trained on, and the milliseconds per generated token.

``--cuda-graphs`` captures the decode step once (the forward over a fixed window of
``min(max_seq_len, prompt + new tokens)`` positions and the argmax over the vocabulary shards,
collectives and fused kernels included) and replays it for every token: the tokens so far are
copied into the window, and causal attention makes the logits at the last filled position the
same as an eager forward over just those tokens.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

from axedist.env import keep_multicast_off

keep_multicast_off()  # before torch: NCCL and symmetric memory read the switches when they start

import torch
import torch.distributed as dist

import axedist as ax
from axedist.nn import checkpoint, parallelize, to_inference
from axedist.nn.llama import Llama, LlamaConfig, llama_tp_plan


def say(*args) -> None:
    if dist.get_rank() == 0:
        print(*args, flush=True)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--train-dir", default="runs/train_tp", help="train_tp.py's output dir (config.json, checkpoint/)")
    p.add_argument("--cuda", action="store_true", help="GPUs and NCCL (default: CPU and gloo)")
    p.add_argument("--start", type=int, default=7, help="the prompt counts from here ...")
    p.add_argument("--stride", type=int, default=3, help="... in steps of this (1, 2, 3 or 5 were trained)")
    p.add_argument("--prompt-len", type=int, default=6)
    p.add_argument("--new-tokens", type=int, default=20)
    p.add_argument("--cuda-graphs", action="store_true",
                   help="capture the decode step in a CUDA graph once and replay it (with --cuda)")
    p.add_argument("--non-strict", dest="strict", action="store_false",
                   help="load a checkpoint holding tensors the model of config.json has no place for (e.g. more "
                        "layers): drop them and list them, instead of refusing it")
    args = p.parse_args(argv)
    if args.cuda_graphs and not args.cuda:
        p.error("--cuda-graphs needs --cuda")

    mesh = ax.init_mesh(device_type="cuda" if args.cuda else "cpu")
    if not args.cuda:
        torch.set_num_threads(1)
    with open(os.path.join(args.train_dir, "config.json")) as f:
        saved = json.load(f)
    cfg = LlamaConfig(**saved["config"])
    dtype = getattr(torch, saved["dtype"])
    model = Llama(cfg).to(device=mesh.device, dtype=dtype)
    parallelize(model, mesh, llama_tp_plan(cfg, sequence_parallel=False))
    try:
        loaded = checkpoint.load(model, os.path.join(args.train_dir, "checkpoint"), strict=args.strict)
    except checkpoint.CheckpointError as error:  # the same on every rank: say it once, exit
        say(f"error: {error}")
        dist.barrier()
        dist.destroy_process_group()
        raise SystemExit(1) from None
    if loaded.dropped:
        say(f"dropped {len(loaded.dropped)} checkpoint tensors the model has no place for (--non-strict): "
            f"{', '.join(loaded.dropped)}")
    model.eval()
    to_inference(model)  # DTensors made outside inference mode cannot be viewed inside it (as torch's)
    say(f"loaded {args.train_dir}/checkpoint on {mesh} ({dtype}, TP={mesh.size()})")

    v = cfg.vocab_size
    total = args.prompt_len + args.new_tokens
    expected = [(args.start + args.stride * i) % v for i in range(total)]
    tokens = torch.tensor([expected[:args.prompt_len]], device=mesh.device)
    times = []
    with torch.inference_mode():
        step = GraphedStep(model, cfg, total, mesh) if args.cuda_graphs else None
        for _ in range(args.new_tokens):
            if mesh.device_type == "cuda":
                torch.cuda.synchronize()
            begin = time.perf_counter()
            if step is not None:
                token = step(tokens)
            else:
                window = tokens[:, -cfg.max_seq_len:]      # no KV cache: the model sees the last window
                logits = model(window)                     # [S, 1, V], vocab-sharded
                token = logits[-1].argmax(dim=-1)          # argmax across the vocabulary shards
                token = token.full_tensor() if isinstance(token, ax.DTensor) else token
            tokens = torch.cat([tokens, token.reshape(1, 1).to(tokens.dtype)], dim=1)
            if mesh.device_type == "cuda":
                torch.cuda.synchronize()
            times.append((time.perf_counter() - begin) * 1e3)
    if step is not None:
        step.release()  # before the process group goes (see GraphedStep)
    got = tokens[0].tolist()
    right = sum(a == b for a, b in zip(got[args.prompt_len:], expected[args.prompt_len:]))
    say(f"prompt     {got[:args.prompt_len]}")
    say(f"generated  {got[args.prompt_len:]}")
    say(f"expected   {expected[args.prompt_len:]}  ({right}/{args.new_tokens} tokens follow the pattern)")
    how = "CUDA graph replays" if args.cuda_graphs else "eager"
    say(f"{statistics.median(times):.2f} ms per token, {how} (median of {len(times)}; first {times[0]:.2f} ms)")
    # every rank past its last collective before any tears its groups down; then the job ends
    # (axedist drops the groups it held at exit, while the interpreter still runs)
    dist.barrier()
    dist.destroy_process_group()


class GraphedStep:
    """tokens [1, n] -> the next token [1], from one CUDA graph captured here: the forward over
    a fixed window of `length` positions plus the argmax at every position (every collective
    inside, on the capture stream); a call copies the last tokens into the window, replays the
    graph and picks the argmax at the last filled position. ``release()`` frees the graph: a graph
    holding NCCL collectives keeps NCCL's resources, and ``destroy_process_group`` waits for them
    forever while it lives (2x H200, 2026-11-30: decoding done, the ranks never exited)."""

    def __init__(self, model, cfg, total: int, mesh):
        self.length = min(cfg.max_seq_len, total)
        self.window = torch.zeros(1, self.length, dtype=torch.long, device=mesh.device)

        def forward():
            choices = model(self.window).argmax(dim=-1)    # [length, 1], over the vocab shards
            return choices.full_tensor() if isinstance(choices, ax.DTensor) else choices

        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):                      # warm-up: plans, kernels, workspaces
            for _ in range(2):
                forward()
        torch.cuda.current_stream().wait_stream(side)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            self.choices = forward()

    def __call__(self, tokens: torch.Tensor) -> torch.Tensor:
        filled = min(tokens.shape[1], self.length)
        self.window[:, :filled].copy_(tokens[:, -filled:])  # later positions cannot reach these (causal)
        self.graph.replay()
        return self.choices[filled - 1].clone()

    def release(self) -> None:
        torch.cuda.synchronize()
        self.graph.reset()


if __name__ == "__main__":
    main()
