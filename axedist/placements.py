"""torch's placements, the same classes, importable from axedist: a script that imports
``Shard``, ``Replicate``, ``Partial`` and ``Placement`` from ``torch.distributed.tensor`` runs
with ``from axedist import ...`` instead (axedist reads them as layouts: ``axedist.spec``)."""

from torch.distributed.tensor.placement_types import Partial, Placement, Replicate, Shard

__all__ = ["Partial", "Placement", "Replicate", "Shard"]
