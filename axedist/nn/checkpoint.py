"""Save and load a parallelized model with ``torch.distributed.checkpoint`` (DCP).

Parameters go through ``to_torch`` (torch DTensors with the same local tensors), so DCP
writes each rank's shards with their global offsets and can read them back under any
other sharding: a checkpoint saved at TP=4 loads at TP=2 (or into a plain model).

    >>> save(model, "runs/train_tp/checkpoint")      # every rank of the mesh calls it
    >>> load(other_model, "runs/train_tp/checkpoint") # other_model parallelized at another TP degree
"""

from __future__ import annotations

import torch
import torch.distributed.checkpoint as dcp
from torch import nn

from ..dtensor import DTensor

__all__ = ["torch_state_dict", "save", "load"]


def torch_state_dict(module: nn.Module) -> dict[str, torch.Tensor]:
    """``module.state_dict()`` with every axedist DTensor as the equal torch DTensor."""
    return {key: value.to_torch() if isinstance(value, DTensor) else value
            for key, value in module.state_dict().items()}


def save(module: nn.Module, path: str) -> None:
    """Write ``module``'s state dict to the directory ``path`` (collective over the job)."""
    dcp.save(torch_state_dict(module), checkpoint_id=path)


def load(module: nn.Module, path: str) -> None:
    """Read the state dict at ``path`` into ``module``'s tensors in place, resharding as needed."""
    targets = torch_state_dict(module)
    dcp.load(targets, checkpoint_id=path)
    own = module.state_dict()
    with torch.no_grad():
        for key, loaded in targets.items():
            local = own[key].to_local() if isinstance(own[key], DTensor) else own[key]
            piece = loaded.to_local() if hasattr(loaded, "to_local") else loaded
            if piece.data_ptr() != local.data_ptr():  # to_torch usually shares the storage already
                local.copy_(piece)
