"""Symmetric workspaces: one buffer per process group, mapped into every peer's address space.

Built on torch.distributed._symmetric_memory (`empty` + `rendezvous`): every rank allocates the
same number of bytes and gets the peers' base addresses, usable inside kernels. Virtual ranks
(W ranks in one process on one GPU, axedist.testing.virtual_ranks) carve W copies from one
allocation instead; the layout and the address tables are the same code. Layout:

    [ flags: FLAG_SLOTS int32 | barrier: BARRIER_SLOTS int32 | data half 0 | data half 1 ]

The last ENGINE_FLAGS flags are the copy-engine flags (kernels/schedule.py: the chunks a peer's
copy engine brings in for the "/ce" fused kernels, rows of an all-gather + GEMM or partials of
a GEMM + reduce-scatter, each followed by a copy of the peer's last finished epoch); they start
at -1, the others at 0. Kernels index their own flags below `tile_flags`.

Flags are written by their owner (the fused kernel's tile flags); barrier words are written by
the peers (the collectives' block barriers store into the peer's area and spin locally). Keeping
the two apart means a word only ever receives writes of one discipline, whose values grow.
The barrier area has two regions, used by calls of odd and even epoch: a peer's word is written
again only two calls later, when that peer has provably read the previous value (it finished
that call before signalling the call in between). In consecutive calls, two relaxed remote
stores to one word from different SMs would have no order that the peer observed in between.

Epochs. Every call on a workspace takes the next epoch e = 1, 2, 3, ...; it writes e into flags
(system-scope release) and waits until the peers' flags are >= e. The data half used by call e is
e % 2. The epoch lives in device memory (`state`, a few int32 words of this rank): each kernel
reads it, and the last of its programs to finish advances it (kernels/primitives.py), so a call
captured in a CUDA graph takes a fresh epoch and the other half on every replay. The host counts
the calls it issued (`epoch`) only for messages and for `next_half` outside graphs. A rank is in call e only after its call e-1 finished, and call e-1 finished only after
every peer had entered call e-1 (every kernel waits on every peer), i.e. after every peer
finished call e-2 -- the last call that used the same half. So a half is never overwritten while
a peer may still read it, and flags never need resetting: no memset, no host sync between calls.

Errors. Kernels that time out write a record into a word of pinned host memory that the GPU
writes directly (UVA); `check()` reads it without synchronizing, `check(synchronize=True)` after.
A workspace that saw an error is retired: the next call on the group allocates a fresh one.
"""
from __future__ import annotations

import warnings

import torch
import torch.distributed as dist

from ..env import read as read_environment
from ..kernels.launch import multiprocessors
from ..kernels.schedule import COPY_STREAMS, ENGINE_FLAGS
from .backend import group_name
from .errors import CollectiveTimeoutError, SymmetricMemoryUnavailable

STATE_WORDS = 4  # int32 words of a rank's call state (kernels/primitives.py names them)

FLAG_SLOTS = 1 << 16  # enough for 2 flags per program of a 2 * 132-program grid and 64k tiles
FLAG_BYTES = FLAG_SLOTS * 4
ENGINE_FLAG0 = FLAG_SLOTS - ENGINE_FLAGS  # the first copy-engine flag
MAX_BARRIER_PROGRAMS = 512
BARRIER_REGION_SLOTS = 2 * MAX_BARRIER_PROGRAMS * 8  # 2 barriers x programs x a word per peer
BARRIER_BYTES = 2 * BARRIER_REGION_SLOTS * 4  # one region per epoch parity
MIN_DATA_BYTES = 1 << 22
ALIGN_BYTES = 1 << 12

_workspaces: dict[tuple[str, int], "SymmetricWorkspace"] = {}
_retired: list["SymmetricWorkspace"] = []  # kept alive: peers may still read them asynchronously


def default_timeout_s() -> float:
    """Spin-wait timeout of every kernel; AXEDIST_TIMEOUT_S overrides (default 30 s)."""
    return read_environment("AXEDIST_TIMEOUT_S")


def _round_up(value: int, multiple: int) -> int:
    return (value + multiple - 1) // multiple * multiple


def _data_class(nbytes: int) -> int:
    # size classes are powers of two so that growing workloads reallocate O(log) times
    size = MIN_DATA_BYTES
    while size < nbytes:
        size *= 2
    return size


def workspace_bytes(data_bytes: int) -> int:
    """Bytes of one rank's workspace with two data halves of `data_bytes` (flags and barrier
    areas first)."""
    return FLAG_BYTES + BARRIER_BYTES + 2 * data_bytes


class SymmetricWorkspace:
    """Flags + two data halves of one rank, and the addresses of every rank's copy.

    The memory comes from torch's symmetric memory (`allocate_workspace`, one process per GPU)
    or from one allocation carved into W copies (`carve_workspaces`, W virtual ranks on one
    GPU); either way the layout and the peer address tables are computed here.

    >>> ws = get_workspace(group, 64 << 20)        # collective: every rank calls it
    >>> ws.begin_call("reduce_scatter")             # raises an earlier call's pending error
    >>> ws.data_addresses(0)                        # 8 ints: each rank's half base (0 padded)
    >>> ws.state_address()                          # the kernels' epoch and counters
    """

    def __init__(self, memory: torch.Tensor, bases: list[int], rank: int, data_bytes: int,
                 peer_buffer, processors: int, group=None, name: str = "",
                 multicast_base: int = 0, handle=None):
        """memory: this rank's uint8 workspace; bases: every rank's base address as seen by this
        process; peer_buffer(peer, shape, dtype, element offset): a tensor over a rank's
        workspace (what host-built TMA descriptors of remote stores are made from);
        processors: SMs this rank's kernels may fill (the persistent grids' bound); handle:
        what keeps the peers' mappings alive (torch's symmetric-memory handle)."""
        if len(bases) > 8:
            raise SymmetricMemoryUnavailable(
                f"symmetric-memory kernels support up to 8 ranks (one NVLink node), "
                f"group has {len(bases)}")
        self.tensor, self.group, self.name = memory, group, name
        self.world_size, self.rank = len(bases), rank
        self.device = memory.device
        self.multicast_base, self.handle = multicast_base, handle
        self.processors = processors
        self._peer_buffer = peer_buffer
        self.tensor[:FLAG_BYTES + BARRIER_BYTES].zero_()
        self.tensor[ENGINE_FLAG0 * 4:FLAG_BYTES].view(torch.int32).fill_(-1)
        self.tile_flags = self.engine_flag0 = ENGINE_FLAG0  # flags kernels index / copy engines'
        self._copy_streams = ()
        self._staging = None  # the copy-engine calls' staging buffer (staging())
        self.epoch = 0  # calls issued from the host (the device's epoch is in `state`)
        self.captured = False  # a call was captured in a CUDA graph: replays advance `state`
        # the stream of the previous call (raw handle and object) and whether it was captured
        self._stream, self._previous, self._previous_captured = None, None, False
        self.state = torch.zeros(STATE_WORDS, dtype=torch.int32, device=self.device)
        self.abort = torch.zeros(1, dtype=torch.int32, device=self.device)
        self.error = torch.zeros(1, dtype=torch.int64, pin_memory=self.device.type == "cuda")
        self._error_view = self.error.numpy()  # reading it costs no tensor op and no sync
        self._set_layout(bases, data_bytes)
        self._peer_views: dict[tuple, torch.Tensor] = {}
        self._scratch: list[torch.Tensor] = []
        self.broken = ""
        self.retired = False  # set when replaced: plans holding it rebuild (p2p.CallPlan)
        self.last_op = ""
        self.timeout_s = default_timeout_s()

    # -- per call --------------------------------------------------------------------------
    def begin_call(self, op: str, timeout_s: float | None = None) -> None:
        """A call is about to be launched: raises a pending error of an earlier call first.
        (The kernel takes its epoch and half from `state` on the device.)"""
        if self.broken or self._error_view[0]:
            self.check()
        self.epoch += 1
        if self.epoch >= (1 << 31) - 2:  # int32 epochs: a fresh workspace starts again at 1
            raise RuntimeError("workspace epoch exhausted; call collectives.reset(group)")
        if self.device.type == "cuda":
            self._after_previous_call()
        self.last_op = op
        self.set_timeout(timeout_s)

    def _after_previous_call(self) -> None:
        """Calls on a workspace run in the order they were issued, also from several streams
        (FSDP issues its gathers and its reduce-scatters on two side streams): the epochs need
        call e-1 finished before call e starts, and two calls running at once would take the
        same epoch and data half. A call from another stream than the previous call's first
        waits for what that stream has queued (one event, only when the stream changes). Inside
        a CUDA graph capture no such wait is added: torch.cuda.graph synchronizes before it
        captures, and a graph's calls are issued on its capture stream."""
        stream = torch._C._cuda_getCurrentRawStream(self.device.index)
        capturing = torch.cuda.is_current_stream_capturing()
        if capturing:
            self.captured = True  # graph replays advance `state`
        if stream != self._stream:
            current = torch.cuda.current_stream(self.device)
            if not capturing and self._previous is not None and not self._previous_captured:
                queued = torch.cuda.Event()
                queued.record(self._previous)
                current.wait_event(queued)
            self._stream, self._previous = stream, current
        self._previous_captured = capturing

    def call_epoch(self) -> int:
        """The epoch of the call begun last (`begin_call`): the host's count, or, once a call
        was captured in a CUDA graph (replays advance the device's epoch unseen), read from the
        device (synchronizes the current stream; not possible while capturing)."""
        if self.captured:
            if torch.cuda.is_current_stream_capturing():
                raise RuntimeError("the epoch of a call on a workspace used in a CUDA graph is "
                                   "unknown while capturing")
            self.epoch = self.device_epoch() + 1
        return self.epoch

    def copy_streams(self) -> tuple:
        """The COPY_STREAMS side streams this rank's copy-engine transfers run on (made once per
        workspace): a call deals its chunks over them in turn, so that one chunk's copy runs
        while the stream of the one before waits and copies its flag (on one stream about 7 us
        passed between the end of a copy and the start of the next, already ready, one:
        2x H200, results/probe_gemm_rs_ce.md)."""
        if not self._copy_streams:
            self._copy_streams = tuple(torch.cuda.Stream(self.device) for _ in range(COPY_STREAMS))
        return self._copy_streams

    def staging(self, nbytes: int) -> torch.Tensor:
        """A uint8 buffer of at least `nbytes` on this rank's GPU, where a copy-engine call
        stages what its side streams then copy out (a /ce GEMM + RS keeps its W - 1 peer chunks
        there). One per workspace, shared by every such call, grown when one needs more (a call
        prepared before keeps the smaller one). No two calls use it at once: a call's stream
        waits for its side streams' copies, and begin_call orders calls from other streams.
        """
        if self._staging is None or self._staging.numel() < nbytes:
            self._staging = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
        return self._staging[:nbytes]

    def set_timeout(self, timeout_s: float | None) -> None:
        """The spin-wait timeout of the coming call (None: default_timeout_s())."""
        self.timeout_s = default_timeout_s() if timeout_s is None else timeout_s

    def state_address(self) -> int:
        return self.state.data_ptr()

    def device_epoch(self) -> int:
        """The epoch of the last finished call, read from the device (synchronizes)."""
        return int(self.state[0].item())

    def next_half(self) -> int:
        """The data half the next call will use. Outside CUDA graphs the host knows it; once a
        call was captured, graph replays advance the epoch unseen, so it is read from the device
        (a synchronization, and not possible while capturing)."""
        if self.captured:
            if torch.cuda.is_current_stream_capturing():
                raise RuntimeError("the next data half of a workspace used in a CUDA graph is "
                                   "unknown while capturing")
            self.epoch = self.device_epoch()
        return (self.epoch + 1) % 2

    def data_offset(self, half: int) -> int:
        return FLAG_BYTES + BARRIER_BYTES + half * self.data_bytes

    def _set_layout(self, bases: list[int], data_bytes: int) -> None:
        """Every rank's address of each region (flags, the two barrier regions, the two data
        halves), computed once from the ranks' base addresses: the kernels' arguments."""
        self.bases, self.data_bytes = list(bases), data_bytes
        self._flag_addresses = self._addresses(0)
        self._barrier_addresses = [self._addresses(FLAG_BYTES + parity * BARRIER_BYTES // 2)
                                   for parity in (0, 1)]
        self._data_addresses = [self._addresses(self.data_offset(half)) for half in (0, 1)]

    def _addresses(self, offset: int) -> list[int]:
        return _pad8([base + offset for base in self.bases])

    def data_addresses(self, half: int) -> list[int]:
        return self._data_addresses[half]

    def flag_addresses(self) -> list[int]:
        return self._flag_addresses

    def parity_strides(self) -> tuple[int, int]:
        """(bytes from data half 0 to half 1, bytes from barrier region 0 to region 1): what a
        kernel adds to the half-0 / region-0 addresses for a call of odd epoch."""
        return self.data_bytes, BARRIER_BYTES // 2

    def barrier_addresses(self, parity: int) -> list[int]:
        """Each rank's barrier region for calls of epoch parity `parity` (8 addresses, padded):
        word (slot * 8 + peer) is written by `peer`."""
        return self._barrier_addresses[parity]

    def multicast_address(self, half: int) -> int:
        return self.multicast_base + self.data_offset(half) if self.multicast_base else 0

    def local_data(self, half: int, dtype: torch.dtype, numel: int,
                   both_halves: bool = False) -> torch.Tensor:
        """This rank's data half (both_halves: both, from half 0) as a flat tensor of `numel`
        elements of `dtype`."""
        offset = self.data_offset(half)
        size = numel * dtype.itemsize
        if size > self.data_bytes * (2 if both_halves else 1):
            raise ValueError(f"{size} bytes do not fit the workspace half of {self.data_bytes}")
        return self.tensor[offset:offset + size].view(dtype)

    def peer_data(self, peer: int, half: int, dtype: torch.dtype, numel: int,
                  both_halves: bool = False) -> torch.Tensor:
        """Rank `peer`'s data half (both_halves: both, from half 0) as a flat tensor of this
        process (its memory is mapped here): what host-built TMA descriptors of the peers'
        buffers are made from."""
        key = (peer, half, dtype, numel, both_halves)
        cached = self._peer_views.get(key)
        if cached is None:
            offset = self.data_offset(half)
            room = self.data_bytes * (2 if both_halves else 1)
            if numel * dtype.itemsize > room or offset % dtype.itemsize:
                raise ValueError(f"{numel} {dtype} elements do not fit the workspace half")
            cached = self._peer_views[key] = self._peer_buffer(
                peer, (numel,), dtype, offset // dtype.itemsize)
        return cached

    def scratch(self, nbytes: int) -> torch.Tensor:
        """At least nbytes of this rank's own device memory (uint8, zeroed when allocated), for
        what only its own kernels exchange across programs: the all-gather + GEMM's stream-K
        partials and their flags (epoch-tagged, like the workspace's). A larger request
        allocates anew; the smaller buffers stay alive with the workspace, as a queued kernel
        may still use them."""
        if not self._scratch or self._scratch[-1].numel() < nbytes:
            self._scratch.append(torch.zeros(nbytes, dtype=torch.uint8, device=self.device))
        return self._scratch[-1]

    def error_address(self) -> int:
        return self.error.data_ptr()

    def timeout_ns(self) -> int:
        return int(self.timeout_s * 1e9)

    # -- errors ----------------------------------------------------------------------------
    def check(self, synchronize: bool = False) -> None:
        """Raise CollectiveTimeoutError if a finished kernel on this workspace timed out."""
        if synchronize:
            torch.cuda.synchronize(self.device)
        if self.broken:
            raise CollectiveTimeoutError(self.broken)
        record = int(self._error_view[0])
        if record == 0:
            return
        code, peer, flag, epoch_low = decode_error_record(record)
        timeout = self.timeout_s
        global_peer = (dist.get_global_rank(self.group, peer)
                       if self.group is not None and peer < self.world_size else peer)
        self.broken = (
            f"rank {self.rank} of group {self.name!r}: {self.last_op or 'kernel'} "
            f"waited {timeout:g} s for flag {flag} of rank {peer} (global rank {global_peer}) "
            f"to reach epoch {epoch_low} (mod 65536) and gave up (error code {code}). The peer "
            f"never signalled: it crashed, skipped the call, or called a different collective. "
            f"This workspace is retired; the next call allocates a fresh one.")
        _retire(self)
        raise CollectiveTimeoutError(self.broken)


def decode_error_record(record: int) -> tuple[int, int, int, int]:
    """(code, peer, flag index, epoch mod 65536) of the word primitives.wait_flag writes:
    code << 56 | peer << 40 | (epoch & 0xFFFF) << 24 | flag (flag < 2**24)."""
    return record >> 56, (record >> 40) & 0xFFFF, record & 0xFFFFFF, (record >> 24) & 0xFFFF


def _pad8(addresses: list[int]) -> list[int]:
    # kernels take eight address arguments; unused ones repeat a real one (never dereferenced)
    # so that every argument is typed int64 (Triton types a Python int by its value)
    return addresses + [addresses[0]] * (8 - len(addresses))


def _retire(workspace: SymmetricWorkspace) -> None:
    workspace.retired = True
    for key, value in list(_workspaces.items()):
        if value is workspace:
            del _workspaces[key]
    _retired.append(workspace)


def allocate_workspace(group, data_bytes: int, device: torch.device) -> SymmetricWorkspace:
    """This rank's workspace in torch's symmetric memory, mapped into every peer of `group`
    (collective: every rank of the group calls it with the same size)."""
    try:
        import torch.distributed._symmetric_memory as symm_mem
    except ImportError as error:  # pragma: no cover - torch without distributed
        raise SymmetricMemoryUnavailable(f"torch.distributed._symmetric_memory: {error}")
    group = group if group is not None else dist.group.WORLD
    world = dist.get_world_size(group)
    if world > 8:
        raise SymmetricMemoryUnavailable(
            f"symmetric-memory kernels support up to 8 ranks (one NVLink node), group has {world}")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)
            if hasattr(symm_mem, "enable_symm_mem_for_group"):
                symm_mem.enable_symm_mem_for_group(group.group_name)
        tensor = symm_mem.empty(workspace_bytes(data_bytes), dtype=torch.uint8, device=device)
        handle = symm_mem.rendezvous(tensor, group)
    except Exception as error:
        raise SymmetricMemoryUnavailable(
            f"could not set up symmetric memory for group {group.group_name!r} "
            f"(world size {world}) on {device}: {error}. The fused kernels need "
            f"GPUs of one node with NVLink peer access; use backend='torch' otherwise."
        ) from error
    workspace = SymmetricWorkspace(
        tensor, [int(address) for address in handle.buffer_ptrs], dist.get_rank(group),
        data_bytes, handle.get_buffer, multiprocessors(device.index), group, group.group_name,
        int(getattr(handle, "multicast_ptr", 0) or 0), handle)
    torch.cuda.synchronize(device)
    dist.barrier(group=group)  # every rank's flags are zero before anyone signals
    return workspace


def carve_workspaces(world: int, data_bytes: int, device: torch.device,
                     processors: int = 1) -> list[SymmetricWorkspace]:
    """W ranks' workspaces carved from one allocation of this process (virtual ranks on one
    GPU, or CPU memory under the interpreter): the same layout and peer tables as
    `allocate_workspace`, the peers' copies at 4 KB-aligned offsets of that allocation.

    >>> spaces = carve_workspaces(4, 1 << 20, torch.device("cuda"), processors=33)
    >>> spaces[2].flag_addresses()[:4] == spaces[0].flag_addresses()[:4]   # one table for all
    True
    """
    stride = _round_up(workspace_bytes(data_bytes), ALIGN_BYTES)
    memory = torch.empty(world * stride + ALIGN_BYTES, dtype=torch.uint8, device=device)
    start = (-memory.data_ptr()) % ALIGN_BYTES
    copies = [memory[start + r * stride:start + r * stride + workspace_bytes(data_bytes)]
              for r in range(world)]

    def peer_buffer(peer: int, shape, dtype: torch.dtype, offset: int) -> torch.Tensor:
        numel = 1
        for size in shape:
            numel *= size
        flat = copies[peer][:(offset + numel) * dtype.itemsize].view(dtype)
        return flat[offset:offset + numel].view(shape)

    bases = [copy.data_ptr() for copy in copies]
    return [SymmetricWorkspace(copies[r], bases, r, data_bytes, peer_buffer, processors,
                               name=f"virtual-{world}") for r in range(world)]


def get_workspace(group, data_bytes: int, device: torch.device | None = None,
                  fresh: bool = False) -> SymmetricWorkspace:
    """The group's workspace with at least `data_bytes` per half (collective on first use and
    whenever it grows; every rank asks for the same sizes, so they all grow together)."""
    device = torch.device("cuda", torch.cuda.current_device()) if device is None else device
    key = (group_name(group), device.index)
    workspace = _workspaces.get(key)
    if fresh or workspace is None or workspace.data_bytes < data_bytes:
        if workspace is not None:
            _retire(workspace)
        workspace = allocate_workspace(group, _data_class(_round_up(data_bytes, ALIGN_BYTES)),
                                       device)
        _workspaces[key] = workspace
    return workspace


def check(group=None, synchronize: bool = True) -> None:
    """Raise the timeout error of any finished axedist kernel of `group` on this GPU.

    >>> out = reduce_scatter(x, group); check(group)   # synchronizes, then raises or returns
    """
    device_index = torch.cuda.current_device()
    name = group_name(group)
    if synchronize:
        torch.cuda.synchronize()
    for workspace in list(_workspaces.values()) + list(_retired):
        if workspace.name == name and workspace.device.index == device_index:
            if workspace.broken and workspace in _retired:
                continue
            workspace.check()


def reset(group=None) -> None:
    """Drop the group's workspaces (the next call allocates fresh ones; collective then)."""
    name = group_name(group)
    for key in [key for key in _workspaces if key[0] == name]:
        _retire(_workspaces.pop(key))
