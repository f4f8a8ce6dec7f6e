"""torch's ``torch.distributed.checkpoint.state_dict`` functions for models whose tensors are axedist
DTensors: the same names, arguments and ``StateDictOptions`` (torch's class), so a training script's
checkpoint and export code (torchtitan's among them) runs with its import changed.

    >>> from axedist.nn.state_dict import get_model_state_dict, set_model_state_dict, StateDictOptions
    >>> full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    >>> set_model_state_dict(model, full, options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))

torch's own functions take an axedist model as far as they treat its DTensors as opaque tensors: the
sharded state dicts (the default, what ``torch.distributed.checkpoint.save`` / ``load`` take) are
torch's, unchanged. What they cannot do is what needs the layout, so it is done here:

- ``full_state_dict=True`` (get): each DTensor becomes its whole global tensor, a plain tensor
  (a collective over the DTensor's mesh; every rank runs them in the state dict's order); with
  ``cpu_offload=True`` on the CPU, rank 0 only (the other ranks get ``{}``), as torch does;
- ``cpu_offload=True`` alone (get): each DTensor's local piece moves to the CPU (same layout);
- ``full_state_dict=True`` (set): a whole tensor given for a DTensor is placed in that DTensor's
  layout, rank 0's values as torch's ``distribute_tensor`` takes them; with
  ``broadcast_from_rank0=True`` only rank 0 passes values (the others pass ``{}``), which are
  broadcast first. Optimizer state (moments) is placed in its parameter's layout.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint import state_dict as torch_state_dict
from torch.distributed.checkpoint.state_dict import StateDictOptions
from torch.distributed.tensor import DTensor as TorchDTensor
from torch.utils._pytree import tree_leaves, tree_map_only

from ..dtensor import DTensor, distribute
from ..placements import Partial

__all__ = ["StateDictOptions", "get_model_state_dict", "get_optimizer_state_dict", "get_state_dict",
           "set_model_state_dict", "set_optimizer_state_dict", "set_state_dict"]


def get_model_state_dict(model: nn.Module, *, submodules=None, options: StateDictOptions | None = None) -> dict:
    """torch's ``get_model_state_dict``; ``full_state_dict`` / ``cpu_offload`` also for axedist DTensors."""
    options = options or StateDictOptions()
    state = torch_state_dict.get_model_state_dict(model, submodules=submodules, options=_sharded(options))
    return _full_or_offloaded(state, options)


def get_optimizer_state_dict(model: nn.Module, optimizers, *, submodules=None,
                             options: StateDictOptions | None = None) -> dict:
    """torch's ``get_optimizer_state_dict``; ``full_state_dict`` / ``cpu_offload`` also for axedist
    DTensors (the moments of a sharded parameter are gathered like it)."""
    options = options or StateDictOptions()
    state = torch_state_dict.get_optimizer_state_dict(model, optimizers, submodules=submodules,
                                                      options=_sharded(options))
    return _full_or_offloaded(state, options)


def get_state_dict(model: nn.Module, optimizers, *, submodules=None,
                   options: StateDictOptions | None = None) -> tuple[dict, dict]:
    """torch's ``get_state_dict``: ``(model state dict, optimizer state dict)``."""
    return (get_model_state_dict(model, submodules=submodules, options=options),
            get_optimizer_state_dict(model, optimizers, submodules=submodules, options=options))


def set_model_state_dict(model: nn.Module, model_state_dict: dict, *, options: StateDictOptions | None = None):
    """torch's ``set_model_state_dict``: a sharded state dict as torch loads it; a full one
    (``full_state_dict``, ``broadcast_from_rank0``) placed in each axedist DTensor's layout first.
    Returns torch's ``(missing_keys, unexpected_keys)``."""
    options = options or StateDictOptions()
    if options.full_state_dict or options.broadcast_from_rank0:
        targets = torch_state_dict.get_model_state_dict(model, options=_sharded(options))
        full = _from_rank0(model_state_dict, _device(targets)) if options.broadcast_from_rank0 else model_state_dict
        model_state_dict = {key: _placed(value, targets.get(key)) for key, value in full.items()}
    return torch_state_dict.set_model_state_dict(model, model_state_dict, options=_sharded(options))


def set_optimizer_state_dict(model: nn.Module, optimizers, optim_state_dict: dict, *,
                             options: StateDictOptions | None = None) -> None:
    """torch's ``set_optimizer_state_dict``: a full state dict's moments placed in their parameter's
    layout (``full_state_dict``; ``broadcast_from_rank0``: rank 0's, broadcast), then loaded as torch
    loads a sharded one."""
    options = options or StateDictOptions()
    if options.full_state_dict or options.broadcast_from_rank0:
        targets = torch_state_dict.get_model_state_dict(model, options=_sharded(options))
        full = _from_rank0(optim_state_dict, _device(targets)) if options.broadcast_from_rank0 else optim_state_dict
        optim_state_dict = _placed_optimizer_state(full, targets, options.flatten_optimizer_state_dict)
    torch_state_dict.set_optimizer_state_dict(model, optimizers, optim_state_dict, options=_sharded(options))


def set_state_dict(model: nn.Module, optimizers, *, model_state_dict: dict, optim_state_dict: dict,
                   options: StateDictOptions | None = None):
    """torch's ``set_state_dict``: the model's then the optimizer's; returns the model's
    ``(missing_keys, unexpected_keys)``."""
    keys = set_model_state_dict(model, model_state_dict, options=options)
    set_optimizer_state_dict(model, optimizers, optim_state_dict, options=options)
    return keys


def _sharded(options: StateDictOptions) -> StateDictOptions:
    """The options torch's functions get: what needs the layouts is done here."""
    return dataclasses.replace(options, full_state_dict=False, cpu_offload=False, broadcast_from_rank0=False)


def _full_or_offloaded(state, options: StateDictOptions):
    if not options.full_state_dict and not options.cpu_offload:
        return state
    rank0_only = options.full_state_dict and options.cpu_offload
    keep = not rank0_only or dist.get_rank() == 0
    # (every tensor in the same order on every rank: the gathers in it match up)
    result = tree_map_only(torch.Tensor, lambda value: _full_or_offloaded_tensor(value, options, keep), state)
    return result if keep else {}


def _full_or_offloaded_tensor(value: torch.Tensor, options: StateDictOptions, keep: bool):
    if options.full_state_dict and isinstance(value, (DTensor, TorchDTensor)):
        value = value.detach().full_tensor()  # collective: every rank, also those that drop it
    if not keep:
        return None
    if options.cpu_offload:
        return value.cpu()  # an axedist DTensor: its piece on the CPU, the same layout
    return value.detach() if options.full_state_dict else value


@dataclasses.dataclass(frozen=True)
class _Announced:
    """What rank 0 tells the others of a tensor it broadcasts next: its shape and dtype."""

    shape: tuple
    dtype: torch.dtype


def _device(targets: dict) -> torch.device:
    """Where the broadcast of a full state dict runs: the model's device (the default group's on a
    model with no tensors)."""
    for value in targets.values():
        if isinstance(value, torch.Tensor) and value.device.type != "meta":
            return value.device
    return torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")


def _from_rank0(state: dict, device: torch.device) -> dict:
    """Rank 0's ``state`` on every rank (the others pass ``{}``): its structure, scalars and
    non-tensors as one object, every other tensor broadcast on ``device``."""
    rank0 = dist.get_rank() == 0
    announced = lambda t: t.detach().cpu() if t.dim() == 0 else _Announced(tuple(t.shape), t.dtype)  # noqa: E731
    shells = [tree_map_only(torch.Tensor, announced, state) if rank0 else None]
    dist.broadcast_object_list(shells, src=0)
    if rank0:
        full = tree_map_only(torch.Tensor, lambda t: t.detach().to(device) if t.dim() > 0 else t.detach().cpu(), state)
    else:
        full = tree_map_only(_Announced, lambda a: torch.empty(a.shape, dtype=a.dtype, device=device), shells[0])
    for t in tree_leaves(full):
        if isinstance(t, torch.Tensor) and t.dim() > 0:
            dist.broadcast(t, src=0)
    return full


def _placed(value, target):
    """A whole tensor ``value`` in the layout of ``target`` (the model's tensor it loads into),
    rank 0's values as torch's ``distribute_tensor`` takes them; other values as they are."""
    if not isinstance(target, DTensor) or not isinstance(value, torch.Tensor) or isinstance(value, DTensor):
        return value
    if tuple(value.shape) != tuple(target.shape):
        raise ValueError(f"a full state dict's tensor of shape {list(value.shape)} for a model tensor of shape "
                         f"{list(target.shape)}")
    if any(isinstance(p, Partial) for p in target.placements):
        raise ValueError(f"a full tensor cannot load into a DTensor with a pending reduction ({target.placements})")
    mesh = target.device_mesh
    return distribute(value.detach().to(target.device), mesh, target.axe_layout, src_rank=mesh.ranks[0],
                      padded_shape=target.padded_shape)


def _placed_optimizer_state(state: dict, parameters: dict, flattened: bool) -> dict:
    """A full optimizer state dict (torch's form, keyed by parameter names; ``flattened``:
    ``"state.<name>.<key>"``) with each moment shaped like its parameter placed in its layout."""
    if flattened:
        placed = {}
        for key, value in state.items():
            name = _parameter_of(key, parameters)
            placed[key] = _moment(value, parameters.get(name))
        return placed
    moments = {name: {key: _moment(value, parameters.get(name)) for key, value in values.items()}
               for name, values in state.get("state", {}).items()}
    return dict(state, state=moments)


def _parameter_of(flat_key: str, parameters: dict) -> str | None:
    """The parameter name in a flattened optimizer key ``"state.<name>.<moment>"`` (the longest
    name that fits: names hold dots)."""
    if not flat_key.startswith("state."):
        return None
    rest = flat_key[len("state."):]
    fits = [name for name in parameters if rest.startswith(name + ".")]
    return max(fits, key=len) if fits else None


def _moment(value, parameter):
    """A moment placed like ``parameter`` when it has the parameter's shape (``step`` and other
    scalars stay as they are)."""
    if (isinstance(value, torch.Tensor) and isinstance(parameter, DTensor)
            and tuple(value.shape) == tuple(parameter.shape)):
        return _placed(value, parameter)
    return value
