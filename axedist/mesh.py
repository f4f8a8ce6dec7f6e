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

A mesh knows its hosts: which ranks share a node (torchrun's node rank and the hostnames,
gathered once per job; or a simulated host size), hence which axes leave a node. Under
``torchrun --nnodes 2 --nproc-per-node 4``, ``init_mesh((2, 4), ("dp", "tp"))`` prints
``dp=2 (inter-node) x tp=4 (intra-node)``; the planner costs each axis with its link.
"""

from __future__ import annotations

import atexit
import functools
import gc
import itertools
import math
import os
import socket
import warnings
import weakref
from datetime import timedelta
from typing import Mapping, Sequence

import torch
import torch.distributed as dist

from .caches import memo, reset as reset_caches
from .env import read as read_environment
from .peers import DEFAULT_TIMEOUT_S, choose_timeout, collective_timeout_s
from .tracing import keep_on_copy
from .topology import HOST_SIZE_ENV, INTER_NODE, INTRA_NODE, AxisLink, Link, Network, Topology

__all__ = ["DeviceMesh", "MeshError", "TopologyWarning", "as_mesh", "group_hosts", "group_topology", "init_mesh",
           "job_topology"]

_DEFAULT_NAMES = {1: ("gpuid",), 2: ("gpuid_x", "gpuid_y"), 3: ("gpuid_x", "gpuid_y", "gpuid_z")}
# Process groups by (backend, sorted ranks, simulated hosts or None); new_group is collective,
# so this cache fills in the same order on every rank. Both tables belong to one job: the world
# group they were made under (_JOB_WORLD, weak); a new world (destroy_process_group, then a new
# init) starts them again (_current_job).
_GROUPS: dict[tuple, object] = {}
# id(group) -> (group, the topology of the mesh that made it).
_GROUP_TOPOLOGY: dict[int, tuple] = {}
_JOB_WORLD: list = [None]  # [weakref to the world group _GROUPS was filled under]
# The job's found topology, gathered once: world group -> Topology (weak: a new world group, after
# destroy_process_group and a new init, finds its own, even at the old one's address).
_FOUND: "weakref.WeakKeyDictionary[dist.ProcessGroup, Topology]" = weakref.WeakKeyDictionary()
# torch meshes converted: (device type, ranks, shape, axis names) -> DeviceMesh.
_FROM_TORCH: dict[tuple, "DeviceMesh"] = memo("mesh from torch")
# (axis, mesh ranks, topology) already warned about: each once per process.
_WARNED: set = set()
# Every live mesh by its number (see DeviceMesh.number).
_NUMBERED: "weakref.WeakValueDictionary[int, DeviceMesh]" = weakref.WeakValueDictionary()
_NEXT_NUMBER = itertools.count()


class MeshError(ValueError):
    """A mesh that cannot exist in this job, or a rank asking a mesh it is not part of."""


class TopologyWarning(UserWarning):
    """A mesh axis meant to stay inside one host (tensor parallel) spans hosts."""


def _backend_for(device_type: str) -> str:
    return "gloo" if device_type == "cpu" else "nccl"


def _process_group(device_type: str, ranks: tuple[int, ...], topology: Topology):
    """The process group over ``ranks`` (created once per job, by every rank). A simulated
    topology gets groups of its own, so each group has one answer to "which hosts"."""
    backend = _backend_for(device_type)
    members = tuple(sorted(ranks))
    key = (backend, members, topology.hosts if topology.simulated else None)
    _current_job()
    if key not in _GROUPS:
        world = dist.get_world_size()
        if members == tuple(range(world)) and dist.get_backend() == backend and not topology.simulated:
            _GROUPS[key] = dist.group.WORLD
        else:
            # the job's collective timeout (new_group's own default is 30 min on gloo)
            _GROUPS[key] = dist.new_group(list(members), backend=backend,
                                          timeout=timedelta(seconds=collective_timeout_s()))
        if dist.get_rank() in members:  # others hold a placeholder, not a group
            _GROUP_TOPOLOGY[id(_GROUPS[key])] = (_GROUPS[key], topology)
    return _GROUPS[key]


def _current_job() -> None:
    """Forget the groups of an earlier job: after ``destroy_process_group()`` and a new
    ``init_process_group()`` the world group is a new one, and the old job's groups are
    destroyed (torch no longer knows them: ``get_process_group_ranks`` raises; NCCL's are
    aborted). Meshes made after the new init get groups of the new job."""
    world = dist.group.WORLD
    job = _JOB_WORLD[0]
    if job is None or job() is not world:
        _forget_groups()
        _JOB_WORLD[0] = weakref.ref(world)


def _forget_groups() -> None:
    """Empty the group tables: they belong to no job until the next group is made."""
    _GROUPS.clear()
    _GROUP_TOPOLOGY.clear()
    _JOB_WORLD[0] = None


def _release_an_ended_job() -> None:
    """At interpreter exit, while it still runs: when ``destroy_process_group()`` ended the job,
    drop every reference the package holds to its process groups (the group tables here; plans,
    specs and the dispatcher's tags through the memo registry) so that they are destroyed now.

    torch destroys a group it has forgotten as soon as nothing holds it, joining its worker
    threads. One kept by these tables lived on into interpreter finalization, where a gloo worker
    still releasing its last work (the barrier before ``destroy_process_group``, holding the
    all-reduce before it and that one's tensors) needs the GIL to drop a tensor's Python object;
    a thread asking for the GIL during finalization is ended, inside a C++ frame that may not
    unwind, and the rank aborted with "terminate called without an active exception" (the 2 x 2
    CPU demo on two torchrun agents, about 1 run in 100 on the 2-core machine). While the job
    runs (no ``destroy_process_group()``) torch itself holds its groups, and nothing is dropped."""
    if _JOB_WORLD[0] is None or dist.is_initialized():
        return
    _forget_groups()
    reset_caches()
    gc.collect()  # groups held only inside reference cycles


atexit.register(_release_an_ended_job)


def job_topology() -> Topology:
    """This job's hosts, found once (a collective on the world: call it on every rank).

    A node is a (hostname, torchrun node rank) pair: two torchrun agents on one machine are two
    nodes, as torchrun itself counts them. ``AXEDIST_HOST_SIZE=2`` declares a simulated one
    instead (ranks 0-1, 2-3, ... share a host). Example: ``torchrun --nnodes 2
    --nproc-per-node 2`` gives ``Topology((0, 0, 1, 1))``.
    """
    world = dist.get_world_size()
    size = read_environment(HOST_SIZE_ENV)
    if size is not None:
        return _simulated(world, size)
    found = _FOUND.get(dist.group.WORLD)
    if found is None:
        here = (socket.gethostname(), os.environ.get("GROUP_RANK", ""))
        keys = [None] * world
        dist.all_gather_object(keys, here)
        found = _FOUND[dist.group.WORLD] = Topology.from_keys(keys)
    return found


def _simulated(world: int, size) -> Topology:
    if isinstance(size, bool) or not isinstance(size, int):
        raise MeshError(f"host size must be an int, got {size!r} (from {HOST_SIZE_ENV} or host_size=)")
    if size <= 0 or world % size:
        raise MeshError(f"host size {size} must be positive and divide the world of {world} ranks")
    return Topology.of_host_size(world, size)


def group_topology(group) -> Topology | None:
    """The topology of the mesh that created ``group`` (None for a group no mesh made)."""
    known = _GROUP_TOPOLOGY.get(id(group))
    return known[1] if known is not None and known[0] is group else None


def group_hosts(group=None) -> tuple[int, ...]:
    """The host of each member of a process group (group-rank order), as the mesh that created it
    declares. For a group no mesh made: the job's found topology if a mesh found it, else
    torchrun's node size (``LOCAL_WORLD_SIZE`` consecutive ranks a node), else one host."""
    group = dist.group.WORLD if group is None else group
    ranks, world = dist.get_process_group_ranks(group), dist.get_world_size()
    known = group_topology(group)
    if known is not None:
        return known.hosts_of(ranks)
    size = read_environment(HOST_SIZE_ENV)
    if size is not None:
        return _simulated(world, size).hosts_of(ranks)
    found = _FOUND.get(dist.group.WORLD)
    if found is not None:
        return found.hosts_of(ranks)
    per_node = int(os.environ.get("LOCAL_WORLD_SIZE", 0) or 0)
    return tuple(r // per_node for r in ranks) if per_node > 0 else (0,) * len(ranks)


def _torch_form(mesh, axis_names, mesh_dim_names, world: int) -> bool:
    """Whether DeviceMesh's second argument is torch's mesh of rank ids rather than a shape (see
    DeviceMesh); a list that reads as both, without axis names to tell, raises."""
    if mesh_dim_names is not None or isinstance(mesh, torch.Tensor):
        return True
    if not isinstance(mesh, list):
        return False  # an int or a tuple: a shape
    if any(not isinstance(item, int) for item in mesh):
        return True  # nested: rows of rank ids
    if 0 in mesh:
        return True  # no mesh axis has extent 0
    if axis_names is None and len(set(mesh)) == len(mesh) and all(0 <= r < world for r in mesh) \
            and math.prod(mesh) == world:
        raise MeshError(f"DeviceMesh(device_type, {mesh}) is ambiguous: a {' x '.join(map(str, mesh))} mesh here, "
                        f"ranks {mesh} in torch's DeviceMesh. Pass a tuple for a shape, or torch.tensor({mesh}) "
                        f"(or mesh_dim_names=...) for rank ids")
    return False


class DeviceMesh:
    """Named axes over ranks: ``DeviceMesh(device_type, shape, axis_names, ranks=None)``.

    ``ranks`` lists global ranks row-major over ``shape`` (default ``0..W-1``); a nested
    list is flattened. Axis names default to ``gpuid`` (1-D) or ``gpuid_x, gpuid_y[, gpuid_z]``.

    torch's form, ``DeviceMesh(device_type, mesh, mesh_dim_names=None)`` with ``mesh`` the rank
    ids shaped as the mesh, means the same as ``DeviceMesh(device_type, mesh.shape,
    mesh_dim_names, ranks=mesh)``; it is taken as such when ``mesh`` is a tensor, nested, holds
    rank 0, or ``mesh_dim_names`` is given. An int or a tuple is a shape, and so is a list given
    with ``axis_names``; a list without them that could be either (``[2, 3]`` on 6 ranks: a
    2 x 3 mesh, or ranks 2 and 3 in torch) is an error.

    Hosts: ``host_size=2`` (or ``AXEDIST_HOST_SIZE=2``) simulates hosts of 2 consecutive ranks;
    else they are found (``job_topology``). An axis is inter-node when some group along it spans
    hosts. ``links={"dp": Link(12.5, 30.0)}`` overrides an axis's link (defaults ``INTRA_NODE`` /
    ``INTER_NODE``). ``intra_node_axes`` names the axes meant to stay inside a host (default: an
    axis named ``tp``); one that spans hosts works, with a ``TopologyWarning`` once.
    """

    def __init__(self, device_type: str, shape: Sequence[int] | int, axis_names: Sequence[str] | str | None = None,
                 ranks=None, *, host_size: int | None = None, links: Mapping[str, Link] | None = None,
                 intra_node_axes: Sequence[str] | None = None, mesh_dim_names: Sequence[str] | None = None,
                 _groups: dict | None = None, _topology: Topology | None = None):
        if not dist.is_initialized():
            raise MeshError("DeviceMesh needs an initialized torch.distributed process group (see axedist.init_mesh)")
        if device_type not in ("cpu", "cuda"):
            raise MeshError(f"device_type must be 'cpu' or 'cuda', got {device_type!r}")
        if _torch_form(shape, axis_names, mesh_dim_names, dist.get_world_size()):
            if ranks is not None or (axis_names is not None and mesh_dim_names is not None):
                raise MeshError(f"torch's form DeviceMesh({device_type!r}, mesh of rank ids) takes the ranks from the "
                                f"mesh: pass no ranks=, and name the axes once (axis_names or mesh_dim_names)")
            try:
                grid = torch.as_tensor(shape)
            except (TypeError, ValueError, RuntimeError) as error:
                raise MeshError(f"a mesh of rank ids must be a rectangular array of ints, got {shape!r}: {error}") from None
            if grid.dtype.is_floating_point or grid.dtype.is_complex or grid.dtype == torch.bool or grid.dim() == 0:
                raise MeshError(f"a mesh of rank ids must be integers in at least one dimension, got {shape!r}")
            shape, ranks = tuple(grid.shape), grid.flatten().tolist()
            axis_names = mesh_dim_names if mesh_dim_names is not None else axis_names
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
        self.links = self._check_links(links)
        if _topology is None:
            _topology = _simulated(world, host_size) if host_size is not None else job_topology()
        self.topology = _topology
        self.inter_node_axes = tuple(a for a in axis_names if self._spans_hosts(a))
        # what == and hash compare, built once: plans and programs are cached by mesh, so every
        # cached redistribute hashes and compares one
        self._identity = (device_type, shape, axis_names, ranks, self.hosts, self.topology.simulated,
                          tuple(sorted(self.links.items())))
        self._hash = hash(self._identity)
        # this rank's groups, weakly: torch holds a job's groups until destroy_process_group(),
        # and a mesh kept after it (a script's global) must not keep them alive into interpreter
        # exit (_release_an_ended_job)
        groups = self._create_groups() if _groups is None else _groups
        self._groups = {axes: weakref.ref(group) for axes, group in groups.items()}
        self._torch_mesh = None
        self.number = next(_NEXT_NUMBER)
        _NUMBERED[self.number] = self
        self._warn_spanning(intra_node_axes)

    # -- geometry ---------------------------------------------------------------

    @property
    def ndim(self) -> int:
        return len(self.shape)

    def size(self, mesh_dim: int | str | None = None) -> int:
        """Devices in the mesh, or along one axis (its index or name), as torch's ``size``."""
        return len(self.ranks) if mesh_dim is None else self.shape[self._axis_position(mesh_dim)]

    def _axis_index(self, axis: str) -> int:
        if axis not in self.axis_names:
            raise MeshError(f"mesh {self} has no axis {axis!r} (axes: {self.axis_names})")
        return self.axis_names.index(axis)

    def _axis_position(self, mesh_dim: int | str | None) -> int:
        """The index of the axis torch's ``mesh_dim`` argument names: an index, a name, or None on a 1-D mesh."""
        if mesh_dim is None:
            if self.ndim != 1:
                raise MeshError(f"mesh {self} has {self.ndim} axes: name one of {self.axis_names}")
            return 0
        if isinstance(mesh_dim, int) and not isinstance(mesh_dim, bool):
            if not -self.ndim <= mesh_dim < self.ndim:
                raise MeshError(f"mesh dim {mesh_dim} is out of range for a {self.ndim}-D mesh {self}")
            return mesh_dim % self.ndim
        return self._axis_index(mesh_dim)

    def _axis_name(self, mesh_dim: int | str | None) -> str:
        """The axis torch's ``mesh_dim`` argument names (see ``_axis_position``)."""
        return self.axis_names[self._axis_position(mesh_dim)]

    # -- torch's DeviceMesh surface ----------------------------------------------------

    @property
    def mesh(self) -> torch.Tensor:
        """The rank ids shaped as the mesh (torch's ``DeviceMesh.mesh``)."""
        return torch.tensor(self.ranks, dtype=torch.int64).reshape(self.shape)

    @property
    def mesh_dim_names(self) -> tuple[str, ...]:
        """The axis names: the defaults (``gpuid``, ...) on a mesh made without names, where torch's is None."""
        return self.axis_names

    def get_group(self, mesh_dim: int | str | None = None):
        """This rank's process group along one axis (index or name; None on a 1-D mesh)."""
        return self.group(self._axis_name(mesh_dim))

    def get_all_groups(self) -> list:
        """This rank's process group along each axis, in mesh order."""
        return [self.group(axis) for axis in self.axis_names]

    def get_local_rank(self, mesh_dim: int | str | None = None) -> int:
        """This rank's rank in its process group along one axis (index or name; None on a 1-D
        mesh), as torch's: the group orders its ranks by number, so this is the coordinate
        (``coordinates()``) where the axis lists ranks in ascending order, and not elsewhere."""
        return dist.get_rank(self.get_group(mesh_dim))

    def get_coordinate(self) -> tuple[int, ...] | None:
        """This rank's index along each axis, or None where the mesh does not hold this rank."""
        if not self.contains():
            return None
        return tuple(self.coordinates().values())

    @staticmethod
    def get_rank() -> int:
        """This process's global rank."""
        return dist.get_rank()

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

    # -- hosts ----------------------------------------------------------------------

    @property
    def hosts(self) -> tuple[int, ...]:
        """The host of each mesh position (row-major), hosts numbered as in ``topology``."""
        return self.topology.hosts_of(self.ranks)

    def _spans_hosts(self, axis: str) -> bool:
        """Whether some group along ``axis`` has ranks on two hosts."""
        i, hosts = self._axis_index(axis), self.hosts
        stride = self.strides()[axis]
        return any(hosts[p] != hosts[p + k * stride] for p in range(len(hosts))
                   if (p // stride) % self.shape[i] == 0 for k in range(1, self.shape[i]))

    def _check_links(self, links) -> dict[str, Link]:
        links = dict(links or {})
        for axis, link in links.items():
            if axis not in self.axis_names:
                raise MeshError(f"links names axis {axis!r}, not one of the mesh's axes {self.axis_names}")
            if not isinstance(link, Link) or not (link.bandwidth_gbps > 0 and link.latency_us >= 0):
                raise MeshError(f"links[{axis!r}] must be a Link(bandwidth_gbps > 0, latency_us >= 0), got {link!r}")
        return links

    def _warn_spanning(self, intra_node_axes: Sequence[str] | None) -> None:
        """A ``TopologyWarning`` (once, on the mesh's first rank) for each axis meant to stay inside
        a host that spans hosts: ``intra_node_axes``, by default an axis named ``tp``."""
        if intra_node_axes is None:
            intra_node_axes = [a for a in ("tp",) if a in self.axis_names]
        for axis in intra_node_axes:
            if axis not in self.axis_names:
                raise MeshError(f"intra_node_axes names {axis!r}, not an axis of {self.axis_names}")
            key = (axis, self.ranks, self.topology)
            if axis in self.inter_node_axes and key not in _WARNED:
                _WARNED.add(key)
                if dist.get_rank() == self.ranks[0]:
                    warnings.warn(f"mesh axis {axis!r} spans hosts ({self.describe()}): its collectives cross the "
                                  f"network and cannot use the symmetric-memory kernels; put the axes meant to stay "
                                  f"on a node last in the mesh (ranks of a node are consecutive)",
                                  TopologyWarning, stacklevel=3)

    @functools.cached_property
    def network(self) -> Network | None:
        """What the planner costs plans with: each axis's link, inter- or intra-node. None on one
        host with default links (plans are then chosen by bytes alone)."""
        if not self.inter_node_axes and not self.links:
            return None
        axes = tuple(AxisLink(a, n, self.links.get(a, INTER_NODE if a in self.inter_node_axes else INTRA_NODE),
                              a in self.inter_node_axes) for a, n in zip(self.axis_names, self.shape))
        return Network(axes, self.device_type)

    def describe(self) -> str:
        """``dp=2 (inter-node) x tp=2 (intra-node)``, or ``dp=2 x tp=2 (one host)``."""
        if len(set(self.hosts)) == 1:
            return " x ".join(f"{a}={n}" for a, n in zip(self.axis_names, self.shape)) + " (one host)"
        return " x ".join(f"{a}={n} ({'inter' if a in self.inter_node_axes else 'intra'}-node)"
                          for a, n in zip(self.axis_names, self.shape))

    # -- groups -------------------------------------------------------------------

    def group_ranks(self, axes: Sequence[str] | str | None = None, rank: int | None = None) -> tuple[int, ...]:
        """Ranks that share ``rank``'s coordinates off ``axes``, in mesh order."""
        axes = self._axes_tuple(axes)
        here = self.coordinates(rank)
        out = []
        for values in itertools.product(*(range(self.size(a)) for a in axes)):
            coords = dict(here)
            coords.update(zip(axes, values))
            out.append(self.rank_at(coords))
        return tuple(out)

    def group(self, axes: Sequence[str] | str | None = None):
        """This rank's process group over ``axes`` (default: all axes)."""
        key = self._axes_tuple(axes)
        if key not in self._groups:
            self.position()  # a rank outside the mesh (it holds no groups): a clear error
        group = self._groups[key]()
        if group is None:
            raise MeshError(f"{self}'s process groups were destroyed (destroy_process_group() ended their job); "
                            f"make the mesh again in the new job")
        return group

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
                for fixed in itertools.product(*(range(self.size(a)) for a in others)):
                    coords = dict(zip(others, fixed))
                    members = []
                    for values in itertools.product(*(range(self.size(a)) for a in axes)):
                        coords.update(zip(axes, values))
                        members.append(self.rank_at(dict(coords)))
                    group = _process_group(self.device_type, tuple(members), self.topology)
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
        groups = {k: self.group(k) for k in self._groups if set(k) <= set(axes)}
        links = {a: link for a, link in self.links.items() if a in axes}
        return DeviceMesh(self.device_type, tuple(self.size(a) for a in axes), axes, ranks, links=links,
                          intra_node_axes=(), _groups=groups, _topology=self.topology)

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
        """The equal axedist mesh, made once per torch mesh (unnamed torch axes get the default
        names; the hosts of the mesh that made its groups, if one did).

        A 1-D torch mesh, whole or a named sub-mesh (``world_mesh["tp"]`` of a ``("dp", "tp")``
        mesh), runs on torch's own process group for it: nothing is created, so ranks holding
        different sub-meshes each convert their own. A sub-mesh of several axes is taken from
        its root mesh, converted whole (every rank converts the root, as new groups need).

            >>> DeviceMesh.from_torch(init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))["tp"])
            DeviceMesh('cpu', [2, 3], axes=('tp',))          # on ranks 2 and 3
        """
        shape = tuple(torch_mesh.mesh.shape)
        names = tuple(torch_mesh.mesh_dim_names or _DEFAULT_NAMES.get(len(shape)) or ())
        ranks = tuple(torch_mesh.mesh.flatten().tolist())
        key = (torch_mesh.device_type, ranks, shape, names)
        found = _FROM_TORCH.get(key)
        if found is not None:
            return found
        here = torch_mesh.get_coordinate() is not None
        root = torch_mesh._get_root_mesh() if hasattr(torch_mesh, "_get_root_mesh") else torch_mesh
        if len(shape) == 1 and here:
            group = torch_mesh.get_group(0)
            topology = group_topology(group) or job_topology()
            found = cls(torch_mesh.device_type, shape, names, ranks, _groups={names: group}, _topology=topology)
        elif root is not torch_mesh:
            root_names = tuple(root.mesh_dim_names or ())
            if not names or not set(names) <= set(root_names):
                raise MeshError(f"torch sub-mesh {torch_mesh} has axes {names} that its root mesh {root} does not name; "
                                f"convert the root mesh (DeviceMesh.from_torch(root)) and take the sub-mesh of it")
            found = cls.from_torch(root)[names]
        else:
            known = group_topology(torch_mesh.get_group(0)) if here else None
            found = cls(torch_mesh.device_type, shape, names, ranks, _topology=known)
        found._torch_mesh = torch_mesh
        _FROM_TORCH[key] = found
        return found

    @classmethod
    def from_group(cls, group, device_type: str, mesh=None, *, mesh_dim_names=None) -> "DeviceMesh":
        """torch's ``DeviceMesh.from_group``: a mesh over existing process groups, one per axis
        (one group: a 1-D mesh over its ranks; several: ``mesh``, the rank ids shaped as the
        mesh, and ``mesh_dim_names`` required, as torch requires them). It is ``from_torch`` of
        torch's mesh from the same call: a 1-D mesh runs on the group given, or on the group of
        an equal mesh (same ranks and names) converted before; a mesh of several axes makes its
        groups over several axes, so every rank of the job calls it."""
        from torch.distributed.device_mesh import DeviceMesh as TorchMesh

        return cls.from_torch(TorchMesh.from_group(group, device_type, mesh, mesh_dim_names=mesh_dim_names))

    # -- naming a mesh inside compiled code --------------------------------------------

    @staticmethod
    def numbered(number: int) -> "DeviceMesh":
        """The live mesh whose ``number`` this is. A mesh's number (0, 1, 2, ... in the order this
        process made its meshes) is how a torch.compile graph names it: a graph node's arguments
        must be constants or tensors, and a mesh (process groups) is neither. Example: the Dynamo
        graph of ``DTensor.from_local(x, mesh, [Shard(0)])`` records
        ``dtensor_from_local(x, 3, [Shard(dim=0)], None)`` where ``mesh.number == 3``."""
        found = _NUMBERED.get(number)
        if found is None:
            raise MeshError(f"no live mesh has number {number} (the mesh a compiled graph named was freed)")
        return found

    # -- value semantics -----------------------------------------------------------------

    def __eq__(self, other) -> bool:
        return self is other or isinstance(other, DeviceMesh) and self._identity == other._identity

    def __hash__(self) -> int:
        return self._hash

    __copy__ = __deepcopy__ = keep_on_copy  # a mesh is its process groups: never copied

    def __reduce_ex__(self, protocol):
        # a pickled DTensor (torch.save of a state_dict) would need this job's process groups where it
        # is loaded: refused with the ways that work, not with pickle's "cannot pickle 'weakref'"
        raise TypeError(f"an axedist DeviceMesh ({self}) and the DTensors on it cannot be pickled (torch.save): save "
                        f"with torch.distributed.checkpoint / axedist.nn.checkpoint.save, or save plain tensors "
                        f"(dt.full_tensor(), dt.to_local(), dt.to_torch()); a full state dict on rank 0 comes from "
                        f"axedist.nn.state_dict's get_model_state_dict(model, options=StateDictOptions("
                        f"full_state_dict=True, cpu_offload=True)) (torch's own function leaves axedist "
                        f"DTensors as they are)")

    def __repr__(self) -> str:
        grid = list(self.ranks)  # nested by hand: a repr may run inside a trace, where a tensor is fake
        for n in reversed(self.shape[1:]):
            grid = [grid[i:i + n] for i in range(0, len(grid), n)]
        hosts = "" if self.network is None else f", {self.describe()}, {self.topology}"
        return f"DeviceMesh({self.device_type!r}, {grid}, axes={self.axis_names}{hosts})"


def init_mesh(shape: Sequence[int] | int | None = None, axis_names: Sequence[str] | str | None = None,
              device_type: str | None = None, ranks=None, timeout_s: float | None = None, *,
              host_size: int | None = None, links: Mapping[str, Link] | None = None,
              intra_node_axes: Sequence[str] | None = None) -> DeviceMesh:
    """A mesh for a ``torchrun`` job: joins the process group from torchrun's environment.

    ``init_mesh((2, 4), ("dp", "tp"))`` under ``torchrun --nproc-per-node 8`` gives a 2x4 mesh
    on CUDA (NCCL, rank r on GPU LOCAL_RANK) when GPUs are present, else on CPU (gloo); under
    ``torchrun --nnodes 2 --nproc-per-node 4`` its ``dp`` axis is inter-node. ``host_size``,
    ``links`` and ``intra_node_axes`` as for ``DeviceMesh``.

    ``timeout_s``: how long a collective (and an agreement check) waits for its peers before it
    raises ``PeerError`` naming the ranks that did not arrive; default ``AXEDIST_COLLECTIVE_TIMEOUT_S``,
    else 600 s. It is the process group's timeout when this call creates it, and every mesh
    group's (a default group made elsewhere keeps its own).
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
        timeout = choose_timeout(timeout_s if timeout_s is not None else
                                 read_environment("AXEDIST_COLLECTIVE_TIMEOUT_S") or DEFAULT_TIMEOUT_S)
        dist.init_process_group(_backend_for(device_type), timeout=timedelta(seconds=timeout), **kwargs)
    else:
        choose_timeout(timeout_s)
    if shape is None:
        shape = (dist.get_world_size(),)
    # init_mesh takes a shape only (a list too): torch's rank-id form is DeviceMesh's
    shape = (shape,) if isinstance(shape, int) else tuple(shape)
    return DeviceMesh(device_type, shape, axis_names, ranks, host_size=host_size, links=links,
                      intra_node_axes=intra_node_axes)


def as_mesh(mesh) -> DeviceMesh:
    """``mesh`` as an axedist mesh: an axedist mesh as it is, a torch ``DeviceMesh`` converted
    (``DeviceMesh.from_torch``: made once, sub-meshes included)."""
    if isinstance(mesh, DeviceMesh):
        return mesh
    from torch.distributed.device_mesh import DeviceMesh as TorchMesh

    if isinstance(mesh, TorchMesh):
        return DeviceMesh.from_torch(mesh)
    raise TypeError(f"expected an axedist or torch DeviceMesh, got {type(mesh).__name__}")
