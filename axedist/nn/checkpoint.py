"""Save and load a parallelized model (and its optimizer) with ``torch.distributed.checkpoint``.

DCP stores each rank's piece of a tensor by its box in the global tensor; an axedist DTensor
gives DCP that box from its layout (``DTensor.__create_chunk_list__``), so a checkpoint written
under any layouts (tensor parallel at TP=4, fully sharded over ``(dp, tp) = (2, 2)``) loads under
any others (TP=2, ``(4, 1)``, a plain model), and checkpoints of torch's own DTensors (torch's
``fully_shard`` + ``parallelize_module``) load here and the other way round: the files hold
global offsets only.

    >>> save(model, "runs/train_tp/checkpoint")      # every rank of the job calls it
    >>> load(other_model, "runs/train_tp/checkpoint") # other_model laid out another way
    >>> save(model, path, optimizer=opt, extra={"step": 40})   # resumable: optimizer state, RNG, extra
    >>> load(model, path, optimizer=opt).extra["step"]
    40

Checked, so that a damaged checkpoint is an error and not a silently wrong model:

- every rank agrees on the path and the tensors before DCP runs (else every rank raises);
- ``save`` writes a CRC-32 of every stored chunk (``axedist_checksums.json``) and replaces an
  older checkpoint at ``path`` only once the new one is complete;
- ``load`` reads ``.metadata`` (a truncated or foreign file is a ``CheckpointError`` naming it),
  checks each file's size against the chunks it must hold and each chunk's checksum (the error
  names the file and the tensor), and compares the checkpoint's tensors with the model's:
  tensors the model lacks are an error, or with ``strict=False`` dropped and listed.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import warnings
import zlib
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn

from ..dtensor import DTensor
from ..peers import agree, together

__all__ = ["CheckpointError", "Loaded", "torch_state_dict", "save", "load", "CHECKSUMS", "EXTRA"]

CHECKSUMS = "axedist_checksums.json"
EXTRA = "axedist_extra.json"
_OPTIMIZER = "optimizer."   # keys of optimizer state: "optimizer.<parameter name>.<state name>"
_RNG = "axedist_rng_{}.pt"  # each rank's random number generator states


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be used as saved (missing, truncated, damaged, or not this
    model's): the message names the checkpoint, the file and the tensor."""


@dataclass
class Loaded:
    """What ``load`` found: ``extra`` (the dict ``save`` was given) and ``dropped`` (tensors of
    the checkpoint the model has no place for, with ``strict=False``)."""

    extra: dict = field(default_factory=dict)
    dropped: tuple[str, ...] = ()

    def __repr__(self) -> str:
        return f"Loaded(extra keys {sorted(self.extra)}, dropped {list(self.dropped)})"


def torch_state_dict(module: nn.Module) -> dict[str, torch.Tensor]:
    """``module.state_dict()`` with every axedist DTensor as the equal torch DTensor."""
    return {key: value.to_torch() if isinstance(value, DTensor) else value
            for key, value in module.state_dict().items()}


def _optimizer_state(module: nn.Module, optimizer) -> tuple[dict, list]:
    """``({"optimizer.<param>.<name>": tensor}, param_groups)`` of ``optimizer``'s state, keyed by
    parameter names rather than positions (so it loads at another TP degree)."""
    names = {id(p): n for n, p in module.named_parameters()}
    order = [p for group in optimizer.param_groups for p in group["params"]]
    state = optimizer.state_dict()
    tensors = {}
    for index, values in state["state"].items():
        name = names[id(order[index])]
        for key, value in values.items():
            if isinstance(value, torch.Tensor):
                tensors[f"{_OPTIMIZER}{name}.{key}"] = value
    return tensors, state["param_groups"]


def _optimizer_text(module: nn.Module, optimizer) -> str:
    """What load's agreement says of ``optimizer``: ``none``, or ``AdamW, parameters [['0.weight',
    '0.bias']]`` (its groups' parameters by name: the state ``load`` fills)."""
    if optimizer is None:
        return "none"
    names = {id(p): n for n, p in module.named_parameters()}
    groups = [[names.get(id(p), "(not the model's)") for p in group["params"]] for group in optimizer.param_groups]
    digest = hashlib.blake2b(repr(groups).encode(), digest_size=6).hexdigest()
    return f"{type(optimizer).__name__}, {sum(map(len, groups))} parameters in {len(groups)} groups, digest {digest}"


def _ranks() -> tuple[int, ...]:
    return tuple(range(dist.get_world_size()))


def _together(what: str, call):
    """``call()``, a collective over the job; a peer's failure in it is a ``PeerError`` naming it."""
    return together(f"checkpoint {what}", _ranks(), call)


def save(module: nn.Module, path: str, *, optimizer=None, extra: dict | None = None) -> None:
    """Write ``module``'s state dict to the directory ``path`` (collective over the job); with
    ``optimizer``, its state too, and where any rank gave that or ``extra`` (a JSON-able dict,
    rank 0's is written) each rank's random number generator states: what ``load`` needs to
    resume training. A ``path`` that is a file, and a failure to put the new checkpoint in
    place, are a ``CheckpointError`` on every rank."""
    state = module.state_dict()  # DCP takes axedist DTensors as they are (their boxes)
    groups = None
    if optimizer is not None:
        optimizer_tensors, groups = _optimizer_state(module, optimizer)
        state.update(optimizer_tensors)
    agree(_ranks(), "checkpoint.save", f"{path}: {_names_digest(state)}")
    rank = dist.get_rank()
    partial = path.rstrip("/") + ".partial"
    problems = []
    if os.path.exists(path) and not os.path.isdir(path):
        problems.append(f"{path} exists and is not a directory (a checkpoint is one): remove it or choose another path")
    elif rank == 0 and os.path.lexists(partial):
        try:
            shutil.rmtree(partial)
        except OSError as error:
            problems.append(f"the unfinished save at {partial} cannot be removed ({_first_line(error)})")
    # (extra is rank 0's: a job that passes it on rank 0 only still writes every rank's RNG states)
    gathered = _gathered("save (before writing)", (problems, optimizer is not None or extra is not None))
    _raise_any([p for rank_problems, _ in gathered for p in rank_problems], f"checkpoint {path}: cannot save")
    resumable = any(given for _, given in gathered)
    try:
        dcp.save(state, checkpoint_id=partial)
    except (Exception, dcp.CheckpointException) as error:  # DCP's own is a BaseException
        raise CheckpointError(f"checkpoint {path}: saving failed: {_failure_text(error)}") from error
    _write_checksums(partial)
    if resumable:
        torch.save(_rng_states(), os.path.join(partial, _RNG.format(rank)))
        if rank == 0:
            with open(os.path.join(partial, EXTRA), "w") as f:
                json.dump({"extra": extra or {}, "optimizer_param_groups": groups, "world": dist.get_world_size()},
                          f, indent=1)
    _together("save (written)", dist.barrier)
    problems = _put_in_place(path, partial) if rank == 0 else []
    _raise_any(_everyone(problems, "save (renamed)"), f"checkpoint {path}: the new checkpoint was written but not put "
                                                      f"in place")


def _put_in_place(path: str, partial: str) -> list[str]:
    """Rank 0 renames the complete checkpoint ``partial`` to ``path``, the old one going only once
    the new one is there; returns what failed (shared with every rank), and where each one is."""
    old = path.rstrip("/") + ".old"
    step = f"renaming {partial} to {path}"
    try:
        if os.path.exists(path):
            step = f"renaming the old checkpoint {path} to {old}"
            shutil.rmtree(old, ignore_errors=True)
            os.rename(path, old)
            step = f"renaming {partial} to {path} (the old checkpoint is at {old})"
            os.rename(partial, path)
            step = f"removing the old checkpoint {old} (the new one is at {path})"
            shutil.rmtree(old)
        else:
            os.rename(partial, path)
    except OSError as error:
        return [f"rank 0 failed {step}: {_first_line(error)}"]
    return []


def load(module: nn.Module, path: str, *, optimizer=None, strict: bool = True) -> Loaded:
    """Read the checkpoint at ``path`` into ``module``'s tensors in place, resharding as needed
    (collective over the job); with ``optimizer``, its state and the saved RNG states too.

    Refused with a ``CheckpointError`` on every rank: a missing, truncated or damaged
    checkpoint, a tensor whose shape differs from the model's, a model tensor the checkpoint
    lacks, and (``strict=True``) checkpoint tensors the model lacks; ``strict=False`` drops
    those and lists them in the result's ``dropped``.
    """
    targets = module.state_dict()
    # whether an optimizer was given, and its parameters: a load that restores it on some ranks only would
    # leave the job's optimizer state mixed
    agree(_ranks(), "checkpoint.load", f"{path}: {_names_digest(targets)}, strict={strict}, "
                                       f"optimizer: {_optimizer_text(module, optimizer)}")
    metadata, problems = _read_metadata(path)
    extra, rng = {}, None
    if metadata is not None:
        problems += _verify_chunks(path, metadata)
        if optimizer is not None or os.path.exists(os.path.join(path, EXTRA)):
            extra, unreadable = _read_extra(path)
            problems += unreadable
            if optimizer is not None and not unreadable:  # each rank reads its own file: its problem is shared
                rng, unreadable = _read_rng(path, extra.get("world"))
                problems += unreadable
    _raise_any(_everyone(problems), f"checkpoint {path}")
    stored = metadata.state_dict_metadata
    model_stored = {k for k in stored if not k.startswith(_OPTIMIZER)}
    missing = sorted(set(targets) - model_stored)
    unexpected = sorted(model_stored - set(targets))
    wrong = [f"{k}: checkpoint {list(stored[k].size)}, model {list(v.shape)}" for k, v in targets.items()
             if k in stored and hasattr(stored[k], "size") and list(stored[k].size) != list(v.shape)]
    if missing or wrong or (unexpected and strict):
        lines = ([f"the model's tensors {_some(missing)} are not in the checkpoint"] if missing else []) + wrong
        if unexpected and strict:
            lines.append(f"the checkpoint's tensors {_some(unexpected)} have no place in the model (a config with "
                         f"fewer layers or other names?); load(..., strict=False) drops them and lists them")
        raise CheckpointError(f"checkpoint {path} does not fit the model:\n  " + "\n  ".join(lines))
    values = {}  # optimizer state in the model's layouts, filled through DCP's targets
    if optimizer is not None:
        values = _optimizer_values(module, stored)
        if not values:
            raise CheckpointError(f"checkpoint {path} holds no optimizer state (saved without optimizer=)")
    loading = dict(targets, **values)
    try:
        dcp.load(loading, checkpoint_id=path)
    except (Exception, dcp.CheckpointException) as error:  # DCP's own is a BaseException (every rank raises it)
        raise CheckpointError(f"checkpoint {path}: DCP could not load it: {_failure_text(error)}") from error
    with torch.no_grad():
        for key, value in module.state_dict().items():
            _copy(value, loading[key])
        for key, value in values.items():
            _copy(value, loading[key])
    if optimizer is not None:
        _load_optimizer(module, optimizer, values, extra.get("optimizer_param_groups"), path)
        _restore_rng(rng)
    return Loaded(extra.get("extra", {}), tuple(unexpected))


# -- helpers ---------------------------------------------------------------------------------------


def _names_digest(state: dict) -> str:
    names = "\n".join(f"{k} {list(v.shape)}" for k, v in sorted(state.items()) if isinstance(v, torch.Tensor))
    return f"{len(state)} tensors, digest {hashlib.blake2b(names.encode(), digest_size=6).hexdigest()}"


def _first_line(error: BaseException) -> str:
    text = str(error).strip()
    return f"{type(error).__name__}: {text.splitlines()[0][:500] if text else ''}"


def _failure_text(error: BaseException) -> str:
    """``_first_line(error)``; for DCP's ``CheckpointException`` (whose first line names only the
    ranks), each failed rank's own error: ``rank 1: KeyError: ...``."""
    failures = error.failures if isinstance(error, dcp.CheckpointException) else None
    if not failures:
        return _first_line(error)
    ranks = sorted(failures)
    shown = "; ".join(f"rank {rank}: {_first_line(failures[rank][0])}" for rank in ranks[:4])
    return shown + (f"; ... ({len(ranks)} ranks in all)" if len(ranks) > 4 else "")


def _some(names: list[str], limit: int = 8) -> str:
    shown = ", ".join(names[:limit])
    return f"{shown}, ... ({len(names)} in all)" if len(names) > limit else shown


def _gathered(what: str, value) -> list:
    """Every rank's ``value``, by rank: one all_gather_object over the job."""
    gathered = [None] * dist.get_world_size()
    _together(what, lambda: dist.all_gather_object(gathered, value))
    return gathered


def _everyone(problems: list[str], what: str = "load (checking files)") -> list[str]:
    """Every rank's problems (each rank checked its share)."""
    return sorted({p for rank_problems in _gathered(what, problems) for p in rank_problems})


def _raise_any(problems: list[str], head: str) -> None:
    """A ``CheckpointError`` listing ``problems`` (the same on every rank), if there are any."""
    problems = sorted(set(problems))
    if problems:
        raise CheckpointError(f"{head}:\n  " + "\n  ".join(problems[:12])
                              + (f"\n  ... {len(problems) - 12} more" if len(problems) > 12 else ""))


def _read_metadata(path: str):
    """(DCP's metadata of ``path``, problems): a missing or unreadable ``.metadata`` is a problem."""
    file = os.path.join(path, ".metadata")
    if not os.path.isdir(path):
        return None, [f"there is no checkpoint directory at {path}"]
    if not os.path.exists(file):
        return None, [f"{file} is missing (an unfinished save, or not a DCP checkpoint)"]
    try:
        return dcp.FileSystemReader(path).read_metadata(), []
    except Exception as error:  # pickle's errors: EOFError, UnpicklingError, ValueError, ...
        return None, [f"{file} cannot be read ({_first_line(error)}): the file is truncated or not DCP metadata"]


def _chunk_list(metadata) -> list[tuple]:
    """``[(file, offset, length, tensor name, chunk offsets, chunk sizes)]`` of every stored chunk,
    in a fixed order: ``("__0_0.distcp", 2048, 512, "0.weight", [4, 0], [4, 8])``, sizes None where
    the tensor's metadata lists no chunk at those offsets."""
    chunks = []
    for index, info in metadata.storage_data.items():
        offsets = list(index.offset) if index.offset is not None else []
        chunks.append((info.relative_path, info.offset, info.length, index.fqn, offsets,
                       _chunk_sizes(metadata, index.fqn, offsets)))
    return sorted(chunks, key=lambda c: c[:5])


def _chunk_sizes(metadata, name: str, offsets: list[int]) -> list[int] | None:
    """The sizes of tensor ``name``'s chunk at ``offsets`` in ``metadata`` ([] for bytes, which have no chunks)."""
    stored = metadata.state_dict_metadata.get(name)
    if not hasattr(stored, "chunks"):
        return [] if stored is not None and not offsets else None
    return next((list(c.sizes) for c in stored.chunks if list(c.offsets) == offsets), None)


def _write_checksums(path: str) -> None:
    """Each rank hashes its share of the stored chunks (read back from the files); rank 0 writes them."""
    metadata = dcp.FileSystemReader(path).read_metadata()
    rank, world = dist.get_rank(), dist.get_world_size()
    mine = []
    for i, (file, offset, length, name, offsets, sizes) in enumerate(_chunk_list(metadata)):
        if i % world == rank:
            mine.append({"file": file, "offset": offset, "length": length, "tensor": name, "chunk": offsets,
                         "sizes": sizes, "crc32": _crc(os.path.join(path, file), offset, length)})
    gathered = [None] * world
    _together("save (checksums)", lambda: dist.all_gather_object(gathered, mine))
    if rank == 0:
        chunks = sorted((c for part in gathered for c in part), key=lambda c: (c["file"], c["offset"]))
        with open(os.path.join(path, CHECKSUMS), "w") as f:
            json.dump({"format": "axedist checksums 1", "algorithm": "crc32", "chunks": chunks}, f, indent=0)


def _crc(file: str, offset: int, length: int) -> int:
    crc, left = 0, length
    with open(file, "rb") as f:
        f.seek(offset)
        while left > 0:
            block = f.read(min(left, 1 << 24))
            if not block:
                break
            crc = zlib.crc32(block, crc)
            left -= len(block)
    return crc


def _verify_chunks(path: str, metadata) -> list[str]:
    """Problems with the stored chunks: missing or short files, entries of ``.metadata`` that point
    at another chunk's bytes than the save wrote there, and (this rank's share) checksums."""
    rank, world = dist.get_rank(), dist.get_world_size()
    problems = []
    sums_file = os.path.join(path, CHECKSUMS)
    sums = {}  # (file, offset, length) -> (crc32, tensor, chunk offsets, chunk sizes or None if not recorded)
    if os.path.exists(sums_file):
        try:
            with open(sums_file) as f:
                sums = {(c["file"], c["offset"], c["length"]): (c["crc32"], c["tensor"], c["chunk"], c.get("sizes"))
                        for c in json.load(f)["chunks"]}
        except (ValueError, KeyError, TypeError) as error:
            return [f"{sums_file} cannot be read ({_first_line(error)}): the file is damaged"]
    elif rank == 0:
        warnings.warn(f"checkpoint {path} has no {CHECKSUMS} (not saved by axedist.nn.checkpoint.save): its chunks "
                      f"are checked for size only", stacklevel=3)
    sizes, short = {}, {}  # short: file -> the tensors it lacks bytes for (every rank sees the same)
    for i, (file, offset, length, name, offsets, chunk_sizes) in enumerate(_chunk_list(metadata)):
        full = os.path.join(path, file)
        saved = sums.get((file, offset, length))
        if sums and (saved is None or saved[1:3] != (name, offsets)
                     or (saved[3] is not None and saved[3] != chunk_sizes)):
            # the CRC of an edited .metadata's entry that points at another chunk of the same
            # length passes: compare what the save wrote there. Every rank checks every entry
            # (no I/O), so every rank sees the same problems
            wrote = "nothing the save recorded" if saved is None else _chunk_text(saved[1], saved[2], saved[3])
            problems.append(f"{os.path.join(path, '.metadata')} points {_chunk_text(name, offsets, chunk_sizes)} "
                            f"at {full} bytes {offset}..{offset + length}, where the save wrote {wrote} "
                            f"({CHECKSUMS}): .metadata was edited or belongs to another save")
            continue
        where = _chunk_text(name, offsets)
        if file not in sizes:
            sizes[file] = os.path.getsize(full) if os.path.exists(full) else -1
        if sizes[file] < offset + length:
            short.setdefault(file, []).append((name, offset + length))
        elif i % world == rank and saved is not None and _crc(full, offset, length) != saved[0]:
            problems.append(f"{full}: checksum mismatch in {where}: its bytes changed after the save")
    for file, lacking in short.items():
        names = sorted({name for name, _ in lacking})
        what = "is missing" if sizes[file] < 0 else (f"is truncated: {sizes[file]} bytes, its chunks need "
                                                      f"{max(end for _, end in lacking)}")
        problems.append(f"{os.path.join(path, file)} {what} (tensors {_some(names, 4)})")
    return problems


def _chunk_text(name: str, offsets: list[int], sizes: list[int] | None = None) -> str:
    """How an error names a stored chunk: ``tensor '0.weight' (its chunk at [4, 0], sizes [4, 8])``."""
    if not offsets:
        return f"tensor {name!r}"
    return f"tensor {name!r} (its chunk at {offsets}" + (f", sizes {sizes})" if sizes is not None else ")")


def _copy(own, loaded) -> None:
    """``loaded`` (what DCP filled) into ``own`` (the model's or the optimizer's tensor)."""
    local = own.to_local() if isinstance(own, DTensor) else own
    piece = loaded.to_local() if hasattr(loaded, "to_local") else loaded
    if piece.data_ptr() != local.data_ptr():  # DCP usually loaded into the storage already
        local.copy_(piece)


def _optimizer_values(module: nn.Module, stored: dict) -> dict:
    """Tensors to load the checkpoint's optimizer state into: laid out like their parameter when
    shaped like it (Adam's moments), else plain (Adam's step)."""
    params = dict(module.named_parameters())
    values = {}
    for key, meta in stored.items():
        name, _, _ = key[len(_OPTIMIZER):].rpartition(".")
        if not key.startswith(_OPTIMIZER) or name not in params:
            continue
        param, size = params[name], list(getattr(meta, "size", []))
        with torch.no_grad():
            values[key] = (torch.zeros_like(param, dtype=meta.properties.dtype) if size == list(param.shape)
                           else torch.zeros(size, dtype=meta.properties.dtype))
    return values


def _load_optimizer(module: nn.Module, optimizer, values: dict, groups, path: str) -> None:
    """``optimizer.load_state_dict`` from the loaded ``values`` and the saved parameter groups."""
    if groups is None:
        raise CheckpointError(f"checkpoint {path}: {EXTRA} has no optimizer_param_groups (saved without optimizer=)")
    params = dict(module.named_parameters())
    order = [p for group in optimizer.param_groups for p in group["params"]]
    index = {id(p): i for i, p in enumerate(order)}
    state: dict = {}
    for key, value in values.items():
        name, _, entry = key[len(_OPTIMIZER):].rpartition(".")
        state.setdefault(index[id(params[name])], {})[entry] = value
    if len(groups) != len(optimizer.param_groups) or any(
            len(g["params"]) != len(o["params"]) for g, o in zip(groups, optimizer.param_groups)):
        raise CheckpointError(f"checkpoint {path}: its optimizer had {[len(g['params']) for g in groups]} parameters "
                              f"per group, this one {[len(g['params']) for g in optimizer.param_groups]}")
    optimizer.load_state_dict({"state": state, "param_groups": groups})


def _rng_states() -> dict:
    states = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        states["cuda"] = torch.cuda.get_rng_state()
    return states


def _read_rng(path: str, world) -> tuple[dict | None, list[str]]:
    """(this rank's saved RNG states, problems), read before anything loads: a missing or damaged
    ``axedist_rng_3.pt`` is rank 3's alone, so it goes through the shared checks. None (nothing to
    restore) where the checkpoint's world size differs: the per-rank streams do not map, and
    training goes on with its own."""
    if world != dist.get_world_size():
        return None, []
    rank = dist.get_rank()
    file = os.path.join(path, _RNG.format(rank))
    try:
        states = torch.load(file, weights_only=True)
    except FileNotFoundError:
        return None, [f"{file} is missing (rank {rank}'s random number generator states)"]
    except Exception as error:  # (torch.load's text suggests weights_only=False: wrong for a damaged file)
        return None, [f"{file} cannot be read ({type(error).__name__}): rank {rank}'s random number generator "
                      f"states are damaged"]
    cpu = states.get("cpu") if isinstance(states, dict) else None
    cuda = states.get("cuda", cpu) if isinstance(states, dict) else None
    if not all(isinstance(s, torch.Tensor) and s.dtype == torch.uint8 for s in (cpu, cuda)) \
            or cpu.shape != torch.get_rng_state().shape:
        return None, [f"{file} holds no random number generator states as save writes them (rank {rank}'s "
                      f"are damaged)"]
    return states, []


def _restore_rng(states: dict | None) -> None:
    if states is None:
        return
    torch.set_rng_state(states["cpu"])
    if "cuda" in states and torch.cuda.is_available():
        torch.cuda.set_rng_state(states["cuda"])


def _read_extra(path: str) -> tuple[dict, list[str]]:
    """(``EXTRA``'s dict, problems): a missing or damaged file is a problem."""
    file = os.path.join(path, EXTRA)
    try:
        with open(file) as f:
            extra = json.load(f)
    except FileNotFoundError:
        return {}, [f"{file} is missing (saved without optimizer= or extra=)"]
    except ValueError as error:
        return {}, [f"{file} cannot be read ({_first_line(error)})"]
    if not isinstance(extra, dict):
        return {}, [f"{file} cannot be read (it holds a {type(extra).__name__}, not a dict)"]
    return extra, []
