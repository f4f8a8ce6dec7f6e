"""Save and load a parallelized model with ``torch.distributed.checkpoint`` (DCP).

DCP stores each rank's piece of a tensor by its box in the global tensor; an axedist DTensor
gives DCP that box from its layout (``DTensor.__create_chunk_list__``), so a checkpoint written
under any layouts (tensor parallel at TP=4, fully sharded over ``(dp, tp) = (2, 2)``) loads under
any others (TP=2, ``(4, 1)``, a plain model), and checkpoints of torch's own DTensors (torch's
``fully_shard`` + ``parallelize_module``) load here and the other way round: the files hold
global offsets only.

    >>> save(model, "runs/train_tp/checkpoint")      # every rank of the mesh calls it
    >>> load(other_model, "runs/train_tp/checkpoint") # other_model laid out another way
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
    dcp.save(module.state_dict(), checkpoint_id=path)


def load(module: nn.Module, path: str) -> None:
    """Read the state dict at ``path`` into ``module``'s tensors in place, resharding as needed."""
    targets = module.state_dict()
    dcp.load(targets, checkpoint_id=path)
    own = module.state_dict()
    with torch.no_grad():
        for key, loaded in targets.items():
            local = own[key].to_local() if isinstance(own[key], DTensor) else own[key]
            piece = loaded.to_local() if isinstance(loaded, DTensor) else loaded
            if piece.data_ptr() != local.data_ptr():  # state_dict() usually shares the storage already
                local.copy_(piece)
