"""The tensor-parallel Llama against the same model in one process.

Same seed, fp64: the TP loss, every parameter's gradient and the parameters after two
AdamW steps must match the single-process run, on 2 and 4 gloo ranks, with and without
sequence parallelism (vocabulary 30: uneven on 4 ranks). A DCP checkpoint written at TP=4
loads at TP=2 with the same full parameters and decodes under inference_mode. And ``launch/train_tp.py`` runs under torchrun,
stops cleanly on Ctrl-C with a resumable checkpoint, and ``--resume`` continues with the same losses.
"""

import contextlib
import copy
import io
import json
import os
import random
import re
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from axedist.dtensor import DTensor
from axedist.mesh import DeviceMesh
from axedist.nn import checkpoint, parallelize, replicate, to_inference
from axedist.nn.llama import Llama, LlamaConfig, llama_tp_plan, next_token_loss
from axedist.testing import run_on_ranks, run_torchrun
from axedist.testing.ranks import run_fresh_ranks

ROOT = Path(__file__).resolve().parents[1]
TOL = dict(rtol=1e-9, atol=1e-11)


def tiny(gqa: bool = False, tie: bool = False) -> LlamaConfig:
    if gqa:
        return LlamaConfig(vocab_size=30, dim=32, n_layers=2, n_heads=8, n_kv_heads=4, ffn_hidden=24, max_seq_len=8,
                           tie_embeddings=tie)
    return LlamaConfig(vocab_size=30, dim=16, n_layers=2, n_heads=4, ffn_hidden=24, max_seq_len=8, tie_embeddings=tie)


def _train_step(rank, world, s, sequence_parallel, gqa, tie):
    cfg = tiny(gqa, tie)
    torch.manual_seed(s)
    ref = Llama(cfg).double()
    par = copy.deepcopy(ref)
    mesh = DeviceMesh("cpu", (world,))
    parallelize(par, mesh, llama_tp_plan(cfg, sequence_parallel=sequence_parallel))
    g = torch.Generator().manual_seed(s + 1)
    opt_ref = torch.optim.AdamW(ref.parameters(), lr=1e-2, foreach=False)
    opt_par = torch.optim.AdamW(par.parameters(), lr=1e-2, foreach=False)
    names = [n for n, _ in ref.named_parameters()]
    assert names == [n for n, _ in par.named_parameters()]
    for step in range(2):
        tokens = torch.randint(0, cfg.vocab_size, (2, cfg.max_seq_len + 1), generator=g)
        inputs, targets = tokens[:, :-1], tokens[:, 1:]
        loss_ref = next_token_loss(ref(inputs), targets)
        logits = par(inputs)
        assert isinstance(logits, DTensor) and logits.placements == (torch.distributed.tensor.Shard(2),)
        loss = next_token_loss(logits, replicate(targets, mesh))
        torch.testing.assert_close(loss.full_tensor(), loss_ref, **TOL)
        loss_ref.backward()
        loss.backward()
        for (name, p_ref), p in zip(ref.named_parameters(), par.parameters()):
            assert p.grad is not None, f"step {step}: {name} got no gradient"
            torch.testing.assert_close(p.grad.full_tensor(), p_ref.grad, **TOL,
                                       msg=lambda m: f"step {step}: grad of {name}: {m}")
        opt_ref.step()
        opt_par.step()
        opt_ref.zero_grad()
        opt_par.zero_grad()
        for (name, p_ref), p in zip(ref.named_parameters(), par.parameters()):
            torch.testing.assert_close(p.full_tensor(), p_ref, **TOL, msg=lambda m: f"after step {step}: {name}: {m}")
    return True


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("sequence_parallel", [True, False])
def test_tp_training_matches_one_process(world, sequence_parallel):
    s = random.randrange(2**31)
    assert run_on_ranks(_train_step, world, args=(s, sequence_parallel, False, False)) == [True] * world, s


@pytest.mark.parametrize("world", [2, 4])
def test_tp_training_gqa_tied_embeddings(world):
    s = random.randrange(2**31)
    assert run_on_ranks(_train_step, world, args=(s, True, True, True)) == [True] * world, s


def _no_fallback(rank, world, s):
    cache_info, fallback_ops = DTensor.dispatcher.cache_info, DTensor.dispatcher.fallback_ops
    before = cache_info()["fallbacks"]
    _train_step(rank, world, s, True, False, False)
    _train_step(rank, world, s, False, True, True)
    return cache_info()["fallbacks"] - before, sorted(str(op) for op in fallback_ops())


def test_training_step_hits_no_fallback():
    count, ops = run_on_ranks(_no_fallback, 2, args=(random.randrange(2**31),))[0]
    assert count == 0, f"{count} op calls ran through the gather fallback (ops seen in this process: {ops})"


def _save(rank, world, s, path):
    torch.manual_seed(s)
    model = Llama(tiny(tie=False)).double()
    parallelize(model, DeviceMesh("cpu", (world,)), llama_tp_plan(model.cfg))
    checkpoint.save(model, path)
    return True


def _load(rank, world, s, path):
    torch.manual_seed(s)
    want = Llama(tiny(tie=False)).double()
    torch.manual_seed(s + 1)                      # different values, overwritten by the load
    model = Llama(tiny(tie=False)).double()
    parallelize(model, DeviceMesh("cpu", (world,)), llama_tp_plan(model.cfg, sequence_parallel=False))
    checkpoint.load(model, path)
    for (name, p_want), p in zip(want.named_parameters(), model.parameters()):
        assert torch.equal(p.full_tensor(), p_want), name
    # the loaded layers decode under inference_mode
    to_inference(model)
    tokens = torch.randint(0, model.cfg.vocab_size, (2, 8), generator=torch.Generator().manual_seed(s))
    with torch.inference_mode():
        logits = model(tokens)
        torch.testing.assert_close(logits.full_tensor(), want(tokens), **TOL)
        assert torch.equal(logits[-1].argmax(-1).full_tensor(), want(tokens)[-1].argmax(-1))
    return True


def test_checkpoint_saved_at_tp4_loads_at_tp2(tmp_path):
    s = random.randrange(2**31)
    path = str(tmp_path / "ckpt")
    assert run_on_ranks(_save, 4, args=(s, path)) == [True] * 4
    assert run_on_ranks(_load, 2, args=(s, path)) == [True] * 2


def test_train_script_runs_under_torchrun(tmp_path):
    returncode, stdout, stderr = run_torchrun(
        ["launch/train_tp.py", "--steps", "6", "--log-every", "3", "--seq", "8", "--batch", "2", "--dim", "16",
         "--vocab", "32", "--layers", "1", "--out", str(tmp_path)], 2, cwd=ROOT, env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert returncode == 0, stdout[-3000:] + stderr[-3000:]
    assert "training finished" in stdout and "step    6" in stdout
    assert "RowwiseParallel" in stdout and "reduce_scatter" in stdout    # the layouts/collectives printout
    record = json.loads((tmp_path / "losses.json").read_text())
    assert len(record["loss"]) == 6 and all(v == v for v in record["loss"])
    assert (tmp_path / "loss.png").stat().st_size > 0
    assert (tmp_path / "checkpoint" / ".metadata").exists()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _train_main(rank, world, argv):
    sys.path.insert(0, str(ROOT / "launch"))
    import train_tp

    with contextlib.redirect_stdout(io.StringIO()):
        train_tp.main(argv)
    return True


def test_ctrl_c_saves_a_resumable_checkpoint_and_resume_gives_the_same_losses(tmp_path):
    """SIGINT to torchrun and its ranks (a terminal's Ctrl-C) mid-run: every rank stops after the
    same step and saves; ``--resume`` (on fresh ranks) finishes with the losses of a run never stopped."""
    run = ["--steps", "30", "--log-every", "1", "--seq", "8", "--batch", "2", "--dim", "16", "--vocab", "32",
           "--layers", "1", "--no-sequence-parallel"]
    full, stopped = tmp_path / "full", tmp_path / "stopped"
    outcomes = run_fresh_ranks(_train_main, 2, args=(run + ["--out", str(full)],), collective_timeout_s=60)
    assert [o.status for o in outcomes] == ["ok", "ok"], outcomes
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port", str(_free_port()),
           "launch/train_tp.py", *run, "--out", str(stopped)]
    proc = subprocess.Popen(cmd, cwd=ROOT, env=dict(os.environ, OMP_NUM_THREADS="1"), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        for line in proc.stdout:
            if line.startswith("step    3"):
                os.killpg(proc.pid, signal.SIGINT)  # what Ctrl-C does: torchrun and every rank get it
                break
        stdout, stderr = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    with pytest.raises(ProcessLookupError):  # no rank left behind in the job's session
        os.killpg(proc.pid, 0)
    said = re.search(r"interrupted after step (\d+): saved a resumable checkpoint to (\S+)", stdout)
    assert said, stdout[-3000:] + stderr[-3000:]
    step = int(said.group(1))
    assert 3 <= step < 30 and said.group(2) == str(stopped / "checkpoint")
    outcomes = run_fresh_ranks(_train_main, 2, args=(run + ["--out", str(stopped), "--resume"],),
                               collective_timeout_s=60)
    assert [o.status for o in outcomes] == ["ok", "ok"], outcomes
    expected = json.loads((full / "losses.json").read_text())["loss"]
    resumed = json.loads((stopped / "losses.json").read_text())["loss"]
    assert len(expected) == len(resumed) == 30 and resumed == expected, (step, expected, resumed)
