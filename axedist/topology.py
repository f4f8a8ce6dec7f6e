"""Hosts and links: which ranks share a host, and how fast each mesh axis moves bytes.

``Topology((0, 0, 1, 1))`` puts global ranks 0, 1 on host 0 and ranks 2, 3 on host 1. On a
2x2 mesh ``(dp, tp)`` over ranks ``[[0, 1], [2, 3]]``, moving along ``tp`` stays on a host and
moving along ``dp`` leaves it, so the planner costs ``tp`` with ``INTRA_NODE`` (NVLink) and
``dp`` with ``INTER_NODE`` (the network)::

    >>> network = Network((AxisLink("dp", 2, INTER_NODE, True), AxisLink("tp", 2, INTRA_NODE, False)), "cuda")
    >>> str(network)
    'dp=2 (inter-node, 25 GB/s, 20 us) x tp=2 (intra-node, 150 GB/s, 5 us)'
    >>> network.link_between((0, 1), (1, 1)).axis          # devices differing on dp
    'dp'

Pure data (no torch): the mesh builds these, the planner reads them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple, Sequence

__all__ = ["HOST_SIZE_ENV", "Link", "INTRA_NODE", "INTER_NODE", "Topology", "AxisLink", "Network"]

# Declares a simulated host size for every mesh of the job (e.g. 2: ranks 0-1, 2-3, ... share a
# "host"), so a one-machine job plans and picks backends as a multi-node one would.
HOST_SIZE_ENV = "AXEDIST_HOST_SIZE"


class Link(NamedTuple):
    """How one device sends over a mesh axis: ``bandwidth_gbps`` GB/s (1e9 bytes a second) after
    ``latency_us`` microseconds a message. ``Link(25.0, 20.0).time_us(1_000_000)`` is 60.0."""

    bandwidth_gbps: float
    latency_us: float

    def time_us(self, nbytes: float, messages: int = 1) -> float:
        """Microseconds to send ``nbytes`` as ``messages`` messages, one after the other."""
        return messages * self.latency_us + nbytes / (self.bandwidth_gbps * 1e3)

    def __str__(self) -> str:
        return f"{self.bandwidth_gbps:g} GB/s, {self.latency_us:g} us"


# Defaults, per device and direction. NVLink 4 (H100/H200): 18 links x 26.6 GB/s = 478 GB/s; NCCL
# reaches about 280 GB/s bus bandwidth there, and a smaller or older NVLink domain less: 150.
# The network: one 200 Gb/s InfiniBand or RoCE port per GPU is 25 GB/s; a message across it
# waits about 20 us (NCCL's inter-node latency), against about 5 us over NVLink.
INTRA_NODE = Link(150.0, 5.0)
INTER_NODE = Link(25.0, 20.0)


@dataclass(frozen=True)
class Topology:
    """The host of every global rank (hosts numbered by their first rank), and whether it is
    simulated (declared by a host size) or found (from torchrun's node rank and hostnames)."""

    hosts: tuple[int, ...]
    simulated: bool = False

    @classmethod
    def from_keys(cls, keys: Sequence, simulated: bool = False) -> "Topology":
        """Ranks with equal keys share a host: ``from_keys(["a", "a", "b", "b"]).hosts == (0, 0, 1, 1)``."""
        numbers: dict = {}
        return cls(tuple(numbers.setdefault(k, len(numbers)) for k in keys), simulated)

    @classmethod
    def of_host_size(cls, world: int, host_size: int, simulated: bool = True) -> "Topology":
        """Consecutive ranks, ``host_size`` a host: ``of_host_size(4, 2).hosts == (0, 0, 1, 1)``."""
        return cls(tuple(r // host_size for r in range(world)), simulated)

    @property
    def host_count(self) -> int:
        return len(set(self.hosts))

    def hosts_of(self, ranks: Sequence[int]) -> tuple[int, ...]:
        return tuple(self.hosts[r] for r in ranks)

    def __str__(self) -> str:
        sizes = sorted({self.hosts.count(h) for h in set(self.hosts)})
        per = "/".join(map(str, sizes))
        return f"{self.host_count} host{'s' if self.host_count > 1 else ''} of {per} rank(s)" + \
            (" (simulated)" if self.simulated else "")


@dataclass(frozen=True)
class AxisLink:
    """One mesh axis as the planner costs it: its name, size, link, and whether it leaves a host."""

    axis: str
    size: int
    link: Link
    inter_node: bool

    def __str__(self) -> str:
        return f"{self.axis}={self.size} ({'inter' if self.inter_node else 'intra'}-node, {self.link})"


@dataclass(frozen=True)
class Network:
    """Every mesh axis's ``AxisLink`` (mesh order) and the device type, which names the backends."""

    axes: tuple[AxisLink, ...]
    device_type: str

    def axis(self, name: str) -> AxisLink:
        return next(a for a in self.axes if a.axis == name)

    @property
    def inter_node_axes(self) -> tuple[str, ...]:
        return tuple(a.axis for a in self.axes if a.inter_node)

    def link_between(self, a: Sequence[int], b: Sequence[int]) -> AxisLink | None:
        """The slowest axis on which devices ``a`` and ``b`` (mesh coordinates) differ: a message
        between them moves at that axis's speed. None for the same device."""
        differ = [link for link, x, y in zip(self.axes, a, b) if x != y]
        return min(differ, key=lambda l: (l.link.bandwidth_gbps, -l.link.latency_us), default=None)

    def slowest(self, axes: Sequence[str]) -> AxisLink | None:
        """The slowest of ``axes`` (what a group varying along all of them is limited by)."""
        links = [a for a in self.axes if a.axis in axes]
        return min(links, key=lambda l: (l.link.bandwidth_gbps, -l.link.latency_us), default=None)

    def crosses_hosts(self, axes: Sequence[str]) -> bool:
        return any(a.inter_node for a in self.axes if a.axis in axes)

    def backend(self, axes: Sequence[str]) -> str:
        """What carries a step over ``axes``: on CPU gloo; on CUDA NCCL across hosts, and inside one
        host NCCL or the symmetric-memory p2p kernels (picked per call by size)."""
        if self.device_type != "cuda":
            return "gloo"
        return "nccl" if self.crosses_hosts(axes) else "nccl or p2p kernels"

    def __str__(self) -> str:
        return " x ".join(map(str, self.axes))
