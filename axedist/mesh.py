"""A device mesh: named axes over the ranks of a ``torch.distributed`` job.

The mesh's axis names are the device axes of Axe layouts: a 1-D mesh is ``gpuid``,
and a layout's coordinate on axis ``a`` is a device's index along mesh axis ``a``.
Example, 4 ranks listed in a permuted order::

    >>> mesh = DeviceMesh("cpu", (2, 2), ("dp", "tp"), ranks=[3, 2, 1, 0])
    >>> mesh                           # on every rank
    DeviceMesh('cpu', [[3, 2], [1, 0]], axes=('dp', 'tp'))
    >>> mesh.coordinates()             # on rank 1
    {'dp': 1, 'tp': 0}
    >>> mesh["tp"].ranks               # on rank 1: its row
    (1, 0)

Every rank of the default process group constructs every mesh (as with
``torch.distributed.new_group``): the constructor creates, in one fixed order, a
process group for every set of axes (NCCL on CUDA, gloo on CPU) and caches it by
its ranks, so rebuilding an equal mesh or taking a sub-mesh creates nothing.
"""

from __future__ import annotations

import itertools
import math
import os
from datetime import timedelta
from typing import Sequence

import torch
import torch.distributed as dist

__all__ = ["DeviceMesh", "MeshError", "init_mesh"]

_DEFAULT_NAMES = {1: ("gpuid",), 2: ("gpuid_x", "gpuid_y"), 3: ("gpuid_x", "gpuid_y", "gpuid_z")}
# Process groups by (backend, ranks in mesh order); new_group is collective, so this
# cache fills in the same order on every rank.
_GROUPS: dict[tuple[str, tuple[int, ...]], object] = {}


class MeshError(ValueError):
    """A mesh that cannot exist in this job, or a rank asking a mesh it is not part of."""


def _backend_for(device_type: str) -> str:
    return "gloo" if device_type == "cpu" else "nccl"


def _process_group(device_type: str, ranks: tuple[int, ...]):
    """The process group over ``ranks`` (created once per job, by every rank)."""
    backend = _backend_for(device_type)
    key = (backend, tuple(sorted(ranks)))
    if key not in _GROUPS:
        world = dist.get_world_size()
        if key[1] == tuple(range(world)) and dist.get_backend() == backend:
            _GROUPS[key] = dist.group.WORLD
        else:
            _GROUPS[key] = dist.new_group(list(key[1]), backend=backend)
    return _GROUPS[key]


class DeviceMesh:
    """Named axes over ranks: ``DeviceMesh(device_type, shape, axis_names, ranks=None)``.

    ``ranks`` lists global ranks row-major over ``shape`` (default ``0..W-1``); a nested
    list is flattened. Axis names default to ``gpuid`` (1-D) or ``gpuid_x, gpuid_y[, gpuid_z]``.
    """

    def __init__(self, device_type: str, shape: Sequence[int] | int, axis_names: Sequence[str] | str | None = None,
                 ranks=None, *, _groups: dict | None = None):
        if not dist.is_initialized():
            raise MeshError("DeviceMesh needs an initialized torch.distributed process group (see axedist.init_mesh)")
        if device_type not in ("cpu", "cuda"):
            raise MeshError(f"device_type must be 'cpu' or 'cuda', got {device_type!r}")
        shape = (shape,) if isinstance(shape, int) else tuple(shape)
        if not shape or any(not isinstance(s, int) or s <= 0 for s in shape):
            raise MeshError(f"mesh shape must be positive ints, got {shape}")
        if axis_names is None:
            if len(shape) not in _DEFAULT_NAMES:
                raise MeshError(f"a {len(shape)}-D mesh needs axis_names")
            axis_names = _DEFAULT_NAMES[len(shape)]
        axis_names = (axis_names,) if isinstance(axis_names, str) else tuple(axis_names)
        if len(axis_names) != len(shape):
            raise MeshError(f"mesh shape {shape} has {len(shape)} axes but {len(axis_names)} names {axis_names}")
        if len(set(axis_names)) != len(axis_names):
            raise MeshError(f"mesh axis names must be distinct, got {axis_names}")
        for name in axis_names:
            if not isinstance(name, str) or not name.isidentifier() or name == "m":
                raise MeshError(f"mesh axis name must be an identifier other than 'm' (the memory axis), got {name!r}")
        world = dist.get_world_size()
        if ranks is None:
            if math.prod(shape) != world:
                raise MeshError(f"mesh shape {shape} has {math.prod(shape)} devices but the world has {world} ranks; "
                                f"pass ranks=[...] to use a subset")
            ranks = tuple(range(world))
        else:
            ranks = tuple(int(r) for r in torch.as_tensor(ranks).flatten().tolist())
        if len(ranks) != math.prod(shape):
            raise MeshError(f"mesh shape {shape} needs {math.prod(shape)} ranks, got {len(ranks)}: {list(ranks)}")
        if len(set(ranks)) != len(ranks):
            raise MeshError(f"mesh ranks must be distinct, got {list(ranks)}")
        outside = [r for r in ranks if not 0 <= r < world]
        if outside:
            raise MeshError(f"mesh ranks {outside} are not in the world of {world} ranks")
        self.device_type = device_type
        self.shape = shape
        self.axis_names = axis_names
        self.ranks = ranks
        self._position = {r: p for p, r in enumerate(ranks)}
        self._groups = self._create_groups() if _groups is None else _groups
        self._torch_mesh = None

    # -- geometry ---------------------------------------------------------------

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def size(self) -> int:
        """Number of devices in the mesh."""
        return len(self.ranks)

    def axis_size(self, axis: str) -> int:
        return self.shape[self._axis_index(axis)]

    def _axis_index(self, axis: str) -> int:
        if axis not in self.axis_names:
            raise MeshError(f"mesh {self} has no axis {axis!r} (axes: {self.axis_names})")
        return self.axis_names.index(axis)

    @property
    def device(self) -> torch.device:
        """This rank's device for local tensors (``cuda:<current>`` or ``cpu``)."""
        if self.device_type == "cuda":
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")

    def contains(self, rank: int | None = None) -> bool:
        return (dist.get_rank() if rank is None else rank) in self._position

    def position(self, rank: int | None = None) -> int:
        """Row-major index of ``rank`` (default: this rank) in the mesh."""
        rank = dist.get_rank() if rank is None else rank
        if rank not in self._position:
            raise MeshError(f"rank {rank} is not in mesh {self}")
        return self._position[rank]

    def coordinates(self, rank: int | None = None) -> dict[str, int]:
        """``{axis: index}`` of ``rank`` (default: this rank); MeshError if it is not in the mesh."""
        position = self.position(rank)
        coords = {}
        for name, extent in zip(reversed(self.axis_names), reversed(self.shape)):
            coords[name] = position % extent
            position //= extent
        return {name: coords[name] for name in self.axis_names}

    def rank_at(self, coordinates: dict[str, int]) -> int:
        """The global rank at ``{axis: index}`` (every axis given)."""
        if set(coordinates) != set(self.axis_names):
            raise MeshError(f"rank_at needs a coordinate for each of {self.axis_names}, got {coordinates}")
        position = 0
        for name, extent in zip(self.axis_names, self.shape):
            value = coordinates[name]
            if not 0 <= value < extent:
                raise MeshError(f"coordinate {name}={value} is outside mesh axis of size {extent}")
            position = position * extent + value
        return self.ranks[position]

    def strides(self) -> dict[str, int]:
        """Row-major stride of each axis in the mesh's position order."""
        out, stride = {}, 1
        for name, extent in zip(reversed(self.axis_names), reversed(self.shape)):
            out[name] = stride
            stride *= extent
        return {name: out[name] for name in self.axis_names}

    # -- groups -------------------------------------------------------------------

    def group_ranks(self, axes: Sequence[str] | str | None = None, rank: int | None = None) -> tuple[int, ...]:
        """Ranks that share ``rank``'s coordinates off ``axes``, in mesh order."""
        axes = self._axes_tuple(axes)
        here = self.coordinates(rank)
        out = []
        for values in itertools.product(*(range(self.axis_size(a)) for a in axes)):
            coords = dict(here)
            coords.update(zip(axes, values))
            out.append(self.rank_at(coords))
        return tuple(out)

    def group(self, axes: Sequence[str] | str | None = None):
        """This rank's process group over ``axes`` (default: all axes)."""
        key = self._axes_tuple(axes)
        self.position()  # a clear error for a rank outside the mesh
        return self._groups[key]

    def _axes_tuple(self, axes) -> tuple[str, ...]:
        if axes is None:
            return self.axis_names
        axes = (axes,) if isinstance(axes, str) else tuple(axes)
        if len(set(axes)) != len(axes):
            raise MeshError(f"axes {axes} repeat a name")
        for a in axes:
            self._axis_index(a)
        return tuple(a for a in self.axis_names if a in axes)  # mesh order

    def _create_groups(self) -> dict:
        """Every rank creates every group (new_group is collective); keeps this rank's."""
        mine = {}
        me = dist.get_rank()
        for count in range(1, self.ndim + 1):
            for axes in itertools.combinations(self.axis_names, count):
                others = [a for a in self.axis_names if a not in axes]
                for fixed in itertools.product(*(range(self.axis_size(a)) for a in others)):
                    coords = dict(zip(others, fixed))
                    members = []
                    for values in itertools.product(*(range(self.axis_size(a)) for a in axes)):
                        coords.update(zip(axes, values))
                        members.append(self.rank_at(dict(coords)))
                    group = _process_group(self.device_type, tuple(members))
                    if me in members:
                        mine[axes] = group
        return mine

    def __getitem__(self, axes) -> "DeviceMesh":
        """The sub-mesh over ``axes`` that contains this rank (no new groups)."""
        asked = (axes,) if isinstance(axes, str) else tuple(axes)
        axes = self._axes_tuple(asked)
        if not axes:
            raise MeshError("a sub-mesh needs at least one axis")
        if axes != asked:
            raise MeshError(f"sub-mesh axes must be listed in mesh order {self.axis_names}, got {asked}")
        ranks = self.group_ranks(axes)
        groups = {k: g for k, g in self._groups.items() if set(k) <= set(axes)}
        return DeviceMesh(self.device_type, tuple(self.axis_size(a) for a in axes), axes, ranks, _groups=groups)

    # -- interop ---------------------------------------------------------------------

    def to_torch(self):
        """The equal ``torch.distributed.device_mesh.DeviceMesh``, built on this mesh's groups."""
        if self._torch_mesh is None:
            from torch.distributed.device_mesh import DeviceMesh as TorchMesh

            groups = [self.group(a) for a in self.axis_names]
            grid = torch.tensor(self.ranks, dtype=torch.int64).reshape(self.shape)
            self._torch_mesh = TorchMesh.from_group(
                groups if self.ndim > 1 else groups[0], self.device_type, grid, mesh_dim_names=self.axis_names)
        return self._torch_mesh

    @classmethod
    def from_torch(cls, torch_mesh) -> "DeviceMesh":
        """The equal axedist mesh (unnamed torch axes get the default names)."""
        shape = tuple(torch_mesh.mesh.shape)
        names = torch_mesh.mesh_dim_names or _DEFAULT_NAMES.get(len(shape))
        return cls(torch_mesh.device_type, shape, names, torch_mesh.mesh.flatten().tolist())

    # -- value semantics -----------------------------------------------------------------

    def _key(self):
        return (self.device_type, self.shape, self.axis_names, self.ranks)

    def __eq__(self, other) -> bool:
        return isinstance(other, DeviceMesh) and self._key() == other._key()

    def __hash__(self) -> int:
        return hash(self._key())

    def __repr__(self) -> str:
        grid = torch.tensor(self.ranks).reshape(self.shape).tolist()
        return f"DeviceMesh({self.device_type!r}, {grid}, axes={self.axis_names})"


def init_mesh(shape: Sequence[int] | int | None = None, axis_names: Sequence[str] | str | None = None,
              device_type: str | None = None, ranks=None, timeout_s: float = 600.0) -> DeviceMesh:
    """A mesh for a ``torchrun`` job: joins the process group from torchrun's environment.

    ``init_mesh((2, 4), ("dp", "tp"))`` under ``torchrun --nproc-per-node 8`` gives a 2x4 mesh
    on CUDA (NCCL, rank r on GPU LOCAL_RANK) when GPUs are present, else on CPU (gloo).
    """
    if device_type is None:
        device_type = "cuda" if torch.cuda.is_available() else "cpu"
    if not dist.is_initialized():
        missing = [v for v in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT") if v not in os.environ]
        if missing:
            raise MeshError(f"init_mesh reads torchrun's environment, but {missing} are unset (run under torchrun)")
        kwargs = {}
        if device_type == "cuda":
            local_rank = int(os.environ.get("LOCAL_RANK", os.environ["RANK"]))
            torch.cuda.set_device(local_rank % torch.cuda.device_count())
            kwargs["device_id"] = torch.device("cuda", torch.cuda.current_device())
        dist.init_process_group(_backend_for(device_type), timeout=timedelta(seconds=timeout_s), **kwargs)
    if shape is None:
        shape = (dist.get_world_size(),)
    return DeviceMesh(device_type, shape, axis_names, ranks)
