"""Checkpoints that are damaged or do not fit the model: a clear error on every rank, naming the
checkpoint, the file and the tensor; resuming training from one gives the same losses.

2 pooled gloo ranks save a tiny Llama; the test process damages the files; the ranks load.
``launch/infer_tp.py`` runs on 2 fresh ranks against a config with fewer layers.
"""

import contextlib
import io
import json
import os
import sys
from pathlib import Path

import pytest
import torch

from axedist.mesh import DeviceMesh
from axedist.nn import checkpoint, parallelize, replicate
from axedist.nn.llama import Llama, LlamaConfig, llama_tp_plan, next_token_loss
from axedist.testing import run_on_ranks
from axedist.testing.ranks import run_fresh_ranks

ROOT = Path(__file__).resolve().parents[1]


def _cfg(layers: int = 2) -> LlamaConfig:
    return LlamaConfig(vocab_size=30, dim=16, n_layers=layers, n_heads=4, ffn_hidden=24, max_seq_len=8)


def _model(world: int, layers: int = 2, seed: int = 0):
    torch.manual_seed(seed)
    model = Llama(_cfg(layers)).double()
    return parallelize(model, DeviceMesh("cpu", (world,)), llama_tp_plan(model.cfg))


def _train(model, optimizer, steps):
    losses = []
    mesh = next(model.parameters()).mesh
    for step in steps:
        tokens = torch.randint(0, 30, (2, 9), generator=torch.Generator().manual_seed(step))
        loss = next_token_loss(model(tokens[:, :-1]), replicate(tokens[:, 1:], mesh))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(float(loss.detach().full_tensor()))
    return losses


def _save_and_resume(rank, world, path):
    model = _model(world)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=False)
    _train(model, optimizer, range(2))
    checkpoint.save(model, path, optimizer=optimizer, extra={"step": 2})
    torch.manual_seed(1234 + rank)  # what the RNG state holds after the save is saved too
    expected = _train(model, optimizer, range(2, 4)), torch.rand(3).tolist()
    other = _model(world, seed=7)
    other_optimizer = torch.optim.AdamW(other.parameters(), lr=1e-2, foreach=False)
    loaded = checkpoint.load(other, path, optimizer=other_optimizer)
    torch.manual_seed(1234 + rank)
    got = _train(other, other_optimizer, range(2, 4)), torch.rand(3).tolist()
    return loaded.extra, expected, got


def _load(rank, world, path, layers, strict):
    try:
        return repr(checkpoint.load(_model(world, layers, seed=5), path, strict=strict))
    except checkpoint.CheckpointError as error:
        return f"CheckpointError: {error}"


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("ckpt") / "checkpoint")
    results = run_on_ranks(_save_and_resume, 2, args=(path,))
    return path, results


def test_resume_gives_the_same_losses(saved):
    path, results = saved
    for extra, expected, got in results:
        assert extra == {"step": 2} and got == expected
    assert {"axedist_checksums.json", "axedist_extra.json", "axedist_rng_0.pt"} <= set(os.listdir(path))


def _copy(path: str, tmp_path) -> str:
    import shutil

    target = str(tmp_path / "copy")
    shutil.copytree(path, target)
    return target


def _load_everywhere(path, layers=2, strict=True) -> str:
    messages = run_on_ranks(_load, 2, args=(path, layers, strict))
    assert messages[0] == messages[1]  # every rank says the same
    return messages[0]


def test_overwritten_bytes_are_named(saved, tmp_path):
    path = _copy(saved[0], tmp_path)
    sums = json.loads(Path(path, checkpoint.CHECKSUMS).read_text())["chunks"]
    chunk = next(c for c in sums if c["tensor"] == "layers.1.feed_forward.w2.weight")
    file = Path(path, chunk["file"])
    data = bytearray(file.read_bytes())
    data[chunk["offset"] + chunk["length"] - 9] ^= 0x40  # a byte of the tensor's data
    file.write_bytes(bytes(data))
    message = _load_everywhere(path)
    assert message.startswith(f"CheckpointError: checkpoint {path}:"), message
    assert f"{file}: checksum mismatch in tensor 'layers.1.feed_forward.w2.weight'" in message, message


def test_truncated_files_and_garbage_metadata_are_named(saved, tmp_path):
    path = _copy(saved[0], tmp_path)
    file = Path(path, "__1_0.distcp")
    file.write_bytes(file.read_bytes()[:1000])
    message = _load_everywhere(path)
    assert f"checkpoint {path}:" in message and f"{file} is truncated: 1000 bytes" in message, message
    Path(path, ".metadata").write_bytes(b"\x80\x04garbage")
    message = _load_everywhere(path)
    assert f"{path}/.metadata cannot be read (UnpicklingError" in message and "not DCP metadata" in message, message
    message = _load_everywhere(str(tmp_path / "nowhere"))
    assert "there is no checkpoint directory at" in message


def test_a_model_with_fewer_layers_is_refused_or_told_what_is_dropped(saved):
    path = saved[0]
    message = _load_everywhere(path, layers=1)
    assert "layers.1.attention.wq.weight" in message and "no place in the model" in message, message
    assert "strict=False" in message
    loaded = _load_everywhere(path, layers=1, strict=False)
    assert loaded.startswith("Loaded(") and "'layers.1.feed_forward.w1.weight'" in loaded and "layers.0" not in loaded
    message = _load_everywhere(path, layers=3)  # more layers than saved: never silently left random
    assert "the model's tensors layers.2." in message and "are not in the checkpoint" in message, message


def _infer(rank, world, train_dir, strict):
    sys.path.insert(0, str(ROOT / "launch"))
    import infer_tp

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        try:
            infer_tp.main(["--train-dir", train_dir, "--new-tokens", "2"] + ([] if strict else ["--non-strict"]))
            code = 0
        except SystemExit as exit_:
            code = exit_.code
    return code, out.getvalue()


def test_infer_tp_with_fewer_layers_in_its_config(saved, tmp_path):
    train_dir = tmp_path / "run"
    train_dir.mkdir()
    os.symlink(saved[0], train_dir / "checkpoint")
    (train_dir / "config.json").write_text(json.dumps({"config": _cfg(layers=1).__dict__, "dtype": "float64"}))
    refused, dropped = (run_fresh_ranks(_infer, 2, args=(str(train_dir), strict), collective_timeout_s=30)
                        for strict in (True, False))
    assert [o.status for o in refused + dropped] == ["ok"] * 4, refused + dropped
    code, text = refused[0].value
    assert code == 1 and "error: checkpoint" in text and "layers.1.attention.wq.weight" in text, text
    code, text = dropped[0].value
    assert code == 0 and "dropped 9 checkpoint tensors the model has no place for" in text, text
    assert "generated" in text


def _edit_metadata(path: str, edit) -> None:
    """``edit(metadata)`` on DCP's ``.metadata`` of the checkpoint at ``path``, written back."""
    import pickle

    import torch.distributed.checkpoint as dcp

    metadata = dcp.FileSystemReader(path).read_metadata()
    edit(metadata)
    with open(os.path.join(path, ".metadata"), "wb") as f:
        pickle.dump(metadata, f)


def _swap_storage(metadata, first: str, second: str, same_file: bool) -> None:
    """Swap where two stored chunks of one length (of tensors ``first`` and ``second``) point."""
    storage = metadata.storage_data
    a = next(k for k in storage if k.fqn == first)
    b = next(k for k in storage if k.fqn == second and k != a and storage[k].length == storage[a].length
             and (storage[k].relative_path == storage[a].relative_path) == same_file)
    storage[a], storage[b] = storage[b], storage[a]


def test_metadata_pointing_at_another_chunks_bytes_is_refused(saved, tmp_path):
    """An edited ``.metadata`` whose entries point at another chunk of the same length: every
    byte's checksum still matches, so the check is what the save wrote at each place."""
    wq, wk = "layers.0.attention.wq.weight", "layers.0.attention.wk.weight"
    edits = {
        "two tensors swapped": lambda m: _swap_storage(m, wq, wk, same_file=True),
        "two chunks of one tensor swapped": lambda m: _swap_storage(m, wq, wq, same_file=False),
        "a chunk's sizes changed": lambda m: setattr(m.state_dict_metadata[wq].chunks[0], "sizes",
                                                     torch.Size([4, 32])),
    }
    for what, edit in edits.items():
        path = _copy(saved[0], tmp_path / what.replace(" ", "_").replace("'", ""))
        _edit_metadata(path, edit)
        message = _load_everywhere(path)
        assert message.startswith(f"CheckpointError: checkpoint {path}:"), (what, message)
        assert f"{path}/.metadata points tensor '{wq}' (its chunk at" in message, (what, message)
        assert "where the save wrote" in message and "was edited or belongs to another save" in message, (what, message)


def _load_resuming(rank, world, path):
    """load with an optimizer (the RNG states too): the error or the result, and whether the
    model kept its own values (nothing loaded before the error)."""
    model = _model(world, seed=5)
    before = [p.detach().to_local().clone() for p in model.parameters()]
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=False)
    try:
        result = repr(checkpoint.load(model, path, optimizer=optimizer))
    except checkpoint.CheckpointError as error:
        result = f"CheckpointError: {error}"
    kept = all(torch.equal(b, p.detach().to_local()) for b, p in zip(before, model.parameters()))
    return result, kept


def test_one_ranks_missing_or_damaged_rng_file_is_an_error_on_every_rank(saved, tmp_path):
    path = _copy(saved[0], tmp_path)
    rng = Path(path, "axedist_rng_1.pt")
    for damage, said in ((rng.unlink, f"{rng} is missing"),
                         (lambda: rng.write_bytes(b"garbage"), f"{rng} cannot be read (UnpicklingError"),
                         (lambda: torch.save({"cpu": torch.zeros(3)}, rng), f"{rng} holds no random number generator")):
        damage()
        results = run_on_ranks(_load_resuming, 2, args=(path,))
        for message, kept in results:
            assert message == results[0][0] and message.startswith(f"CheckpointError: checkpoint {path}:"), results
            assert said in message and kept, results


def _load_giving_the_cause(rank, world, path):
    try:
        checkpoint.load(_model(world, seed=5), path)
    except checkpoint.CheckpointError as error:
        return f"CheckpointError: {error}", type(error.__cause__).__name__
    return "loaded", None


def test_what_dcp_itself_refuses_is_a_checkpoint_error_on_every_rank(saved, tmp_path):
    """DCP's own error (``CheckpointException``, a BaseException) is a ``CheckpointError`` on every
    rank, with DCP's as its cause: a checkpoint without checksums (as torch's DCP writes one) whose
    ``.metadata`` points a chunk one byte before its bytes, which DCP cannot unpickle."""
    import dataclasses

    path = _copy(saved[0], tmp_path)
    Path(path, checkpoint.CHECKSUMS).unlink()

    def shift(metadata):
        storage = metadata.storage_data
        key = next(k for k, info in storage.items() if k.fqn == "layers.0.attention.wq.weight" and info.offset > 0)
        storage[key] = dataclasses.replace(storage[key], offset=storage[key].offset - 1)

    _edit_metadata(path, shift)
    results = run_on_ranks(_load_giving_the_cause, 2, args=(path,))
    for message, cause in results:
        assert message.startswith(f"CheckpointError: checkpoint {path}: DCP could not load it: rank "), results
        assert cause == "CheckpointException", results


def _save_where_rank_0_cannot(rank, world, file, path):
    """save to a path that is a file, then (a checkpoint at ``path``, a file where its old copy goes)
    one whose rename fails on rank 0 alone: what each rank raised, and in how many seconds."""
    import time

    model, said = _model(world), []
    for target in (file, path, path):
        start = time.monotonic()
        try:
            checkpoint.save(model, target)
            said.append("saved")
        except checkpoint.CheckpointError as error:
            said.append((f"CheckpointError: {error}", time.monotonic() - start))
        if rank == 0 and target == path and said[-1] == "saved":
            Path(f"{path}.old").write_text("a file in the way of the old checkpoint")
        torch.distributed.barrier()
    return said


def test_a_path_that_is_a_file_or_a_failed_rename_is_an_error_on_every_rank_at_once(tmp_path):
    path, file = str(tmp_path / "checkpoint"), tmp_path / "afile"
    file.write_text("the user's file")
    outcomes = run_fresh_ranks(_save_where_rank_0_cannot, 2, args=(str(file), path), collective_timeout_s=20)
    assert [o.status for o in outcomes] == ["ok", "ok"], outcomes
    (file_error, took), saved, (rename_error, took_rename) = outcomes[0].value
    assert [o.value[0][0] for o in outcomes] == [file_error] * 2 and saved == "saved", outcomes
    assert f"{file} exists and is not a directory" in file_error and took < 10, outcomes
    assert file.read_text() == "the user's file" and not Path(f"{file}.partial").exists()
    assert [o.value[2][0] for o in outcomes] == [rename_error] * 2, outcomes
    assert rename_error.startswith(f"CheckpointError: checkpoint {path}: the new checkpoint was written but not put "
                                   f"in place:\n  rank 0 failed renaming the old checkpoint {path} to {path}.old: "
                                   f"NotADirectoryError"), rename_error
    assert max(o.value[2][1] for o in outcomes) < 10, outcomes   # not a peer's timeout
    assert Path(path, ".metadata").exists() and Path(f"{path}.partial", ".metadata").exists()


def _given_on_some_ranks(rank, world, path):
    """``extra`` on rank 0 only at save (it is rank 0's), an optimizer on rank 0 only at load."""
    from axedist.peers import RankDisagreementError

    model = _model(world)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=False)
    _train(model, optimizer, range(1))
    torch.manual_seed(99 + rank)
    state = torch.get_rng_state()
    checkpoint.save(model, f"{path}/extra", extra={"step": 1} if rank == 0 else None)
    rng = torch.load(f"{path}/extra/axedist_rng_{rank}.pt", weights_only=True)["cpu"]  # every rank's is written
    extra = checkpoint.load(model, f"{path}/extra").extra
    checkpoint.save(model, f"{path}/optimizer", optimizer=optimizer)
    other = _model(world, seed=3)
    other_optimizer = torch.optim.AdamW(other.parameters(), lr=1e-2, foreach=False)
    said = r"ranks disagree on checkpoint\.load:\n  rank 0: .*optimizer: AdamW, \d+ parameters in 1 groups.*\n  rank 1"
    with pytest.raises(RankDisagreementError, match=said + r": .*optimizer: none"):
        checkpoint.load(other, f"{path}/optimizer", optimizer=other_optimizer if rank == 0 else None)
    return extra, torch.equal(rng, state)


def test_extra_or_optimizer_given_on_some_ranks_only(tmp_path):
    """save: every rank's RNG states are written where any rank gave ``extra`` (or an optimizer), so
    the checkpoint resumes; load: an optimizer on some ranks only is a disagreement on every rank
    (not an optimizer state restored on those ranks alone)."""
    results = run_on_ranks(_given_on_some_ranks, 2, args=(str(tmp_path),))
    assert results == [({"step": 1}, True)] * 2, results
