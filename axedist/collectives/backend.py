"""Which implementation runs a collective: `p2p` kernels, `multimem` kernels, or `torch`.

multimem (NVLink SHARP through a multicast mapping) is selected only when BOTH the device reports
multicast support (CUDA driver attribute CU_DEVICE_ATTRIBUTE_MULTICAST_SUPPORTED, asked through
cuda-python) AND the user opted in with AXEDIST_ENABLE_MULTICAST=1, AND the workspace got a
multicast mapping from PyTorch. Our GPU machines keep multicast off by policy; there it is never
chosen, and asking for it explicitly raises.

p2p versus torch for "auto" is decided per size from a measured table, not guessed: the file
axedist/kernels/collectives_tuned.json, which `launch/bench_collectives.py --tables-from
<collectives_w4.json>` derives from a benchmark run (benchmarks/results/). It also holds the
p2p variant (push / pull) per size and the one-shot / two-shot all-reduce switch (p2p.py).
Without a measurement that beats NCCL, "auto" keeps torch (NCCL).
"""
from __future__ import annotations

import json
import os

import torch
import torch.distributed as dist

from torch.distributed.distributed_c10d import _resolve_process_group as resolve_process_group

from ..caches import cached, memo
from ..env import read as read_environment
from ..mesh import group_hosts
from ..tracing import compiling

MULTICAST_ENV = "AXEDIST_ENABLE_MULTICAST"
BACKENDS = ("auto", "p2p", "multimem", "torch")
TUNED_PATH = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "kernels",
                          "collectives_tuned.json")


def load_tuned(path: str = TUNED_PATH) -> dict:
    """The measured tables: {"backend": {op: [[max input bytes, "p2p" | "torch"], ...]},
    "variant": {kernel op: [[max input bytes, "push" | "pull"], ...]},
    "one_shot_all_reduce_max_bytes": int, "source": where the numbers come from}."""
    with open(path) as handle:
        tuned = json.load(handle)
    for table in (tuned["backend"], tuned["variant"]):
        for op, rows in table.items():
            table[op] = [(int(limit), str(choice)) for limit, choice in rows]
    return tuned


TUNED = load_tuned()


def load_auto_table(path: str) -> dict:
    """A fused op's shipped ``auto`` table (``kernels/*_auto.json``), its shape lists as sets:
    {"fused_loses": {(M, N, K, W), ...} (the unfused pair measured faster than the fused kernel),
    "symm_wins": {...} (torch's symmetric-memory op measured the fastest of the three, both in
    device time), "source": [...], and the op's own fields (e.g. "min_rows_per_rank")}."""
    with open(path) as handle:
        table = json.load(handle)
    for key in ("fused_loses", "symm_wins"):
        table[key] = {tuple(int(v) for v in shape) for shape in table.get(key, [])}
    return table
# op -> list of (max bytes of the full input, backend) in increasing size; the last entry also
# covers everything larger.
MEASURED_CHOICE: dict[str, list[tuple[int, str]]] = TUNED["backend"]


def query_multicast_attribute(device_index: int) -> bool:
    """CU_DEVICE_ATTRIBUTE_MULTICAST_SUPPORTED via cuda-python; False if it cannot be asked."""
    try:
        from cuda.bindings import driver
    except ImportError:
        try:
            from cuda import cuda as driver  # older cuda-python layout
        except ImportError:
            return False
    (error,) = driver.cuInit(0)
    if int(error) != 0:
        return False
    error, device = driver.cuDeviceGet(device_index)
    if int(error) != 0:
        return False
    error, value = driver.cuDeviceGetAttribute(
        driver.CUdevice_attribute.CU_DEVICE_ATTRIBUTE_MULTICAST_SUPPORTED, device)
    return int(error) == 0 and int(value) == 1


@cached(maxsize=None)
def device_supports_multicast(device_index: int) -> bool:
    return query_multicast_attribute(device_index)


def multicast_opted_in() -> bool:
    return read_environment(MULTICAST_ENV)


def multimem_allowed(device_index: int, multicast_address: int = 1) -> tuple[bool, str]:
    """(allowed, reason). Opt-in is checked first so that without it nothing touches the driver."""
    if not multicast_opted_in():
        return False, f"{MULTICAST_ENV}=1 is not set"
    if not device_supports_multicast(device_index):
        return False, f"cuda:{device_index} does not report multicast support"
    if not multicast_address:
        return False, "the symmetric workspace has no multicast mapping"
    return True, "multicast supported and opted in"


def group_name(group) -> str:
    """The name torch gives a process group (the default group for None): what our custom ops take."""
    group = group if group is not None else dist.group.WORLD
    return group.group_name


def resolve_group(name: str):
    """The process group of ``group_name``."""
    return resolve_process_group(name)


def as_custom_op(*tensors) -> bool:
    """Whether a collective call goes through its ``torch.ops.axedist`` custom op (``library.py``):
    while torch.compile traces, or when autograd must record it; otherwise it runs directly
    (no dispatcher round trip: the eager host time stays what the benchmarks measured)."""
    if compiling():
        return True
    if torch.is_grad_enabled():
        for t in tensors:  # a loop, not any(<generator>): this runs on every eager collective call
            if t is not None and t.requires_grad:
                return True
    return False


def through_custom_op(op: str, a: torch.Tensor, b: torch.Tensor, out, timeout_s, check) -> bool:
    """Whether a fused call goes through its custom op (``as_custom_op``); ``out=``,
    ``timeout_s=`` and ``check=`` take no part in autograd, so with operands that require grad
    they are refused rather than left without a gradient."""
    if torch.is_grad_enabled() and (a.requires_grad or b.requires_grad) and (
            out is not None or timeout_s is not None or check):
        raise ValueError(f"{op}: out=, timeout_s= and check= take no part in autograd; leave them out when a or b "
                         f"requires grad")
    return out is None and timeout_s is None and not check and as_custom_op(a, b)


def measured_choice(op: str, nbytes: int) -> str:
    for limit, backend in MEASURED_CHOICE[op]:
        if nbytes <= limit:
            return backend
    return MEASURED_CHOICE[op][-1][1]


_possible: dict[tuple, tuple[bool, str]] = memo("collectives.backend p2p possible")


def p2p_possible(tensor: torch.Tensor, group) -> tuple[bool, str]:
    """Can the symmetric-memory kernels run for this tensor and group at all? (Asked on every
    collective call: the answer is cached per device kind, dtype and group.)"""
    key = (tensor.is_cuda, tensor.dtype, group)
    answer = _possible.get(key)
    if answer is None:
        answer = _possible[key] = _p2p_possible(tensor, group)
    return answer


def _p2p_possible(tensor: torch.Tensor, group) -> tuple[bool, str]:
    inside, why = one_host(group)
    if not inside:
        return False, why
    if not tensor.is_cuda:
        return False, "tensor is not on a CUDA device"
    reachable, why = peers_reachable(tensor.get_device())
    if not reachable:
        return False, why
    if tensor.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        return False, f"dtype {tensor.dtype} is not bf16/fp16/fp32"
    world = dist.get_world_size(group)
    if world > 8:
        return False, f"group of {world} ranks is larger than one NVLink node (8)"
    try:
        import triton  # noqa: F401
    except ImportError:
        return False, "triton is not installed"
    return True, "ok"


# -- topology: the symmetric-memory kernels (collectives and fused GEMM + RS) need every rank of
# the group on one host with peer access; any other group runs on torch.distributed (NCCL).

def one_host(group) -> tuple[bool, str]:
    """(whether every rank of ``group`` sits on one host, why not): the hosts its mesh declares,
    simulated ones included (``axedist.mesh.group_hosts``)."""
    hosts = group_hosts(group)
    if len(set(hosts)) > 1:
        return False, f"group spans {len(set(hosts))} hosts (hosts {list(hosts)}): symmetric memory needs one host"
    return True, "one host"


def peers_reachable(device_index: int) -> tuple[bool, str]:
    """(whether ``cuda:device_index`` has peer access to every other visible GPU, why not)."""
    others = [d for d in range(torch.cuda.device_count()) if d != device_index]
    blocked = [d for d in others if not torch.cuda.can_device_access_peer(device_index, d)]
    if blocked:
        return False, f"cuda:{device_index} has no peer access to cuda:{blocked}"
    return True, "peer access"


def checked_choice(backend: str, allowed: tuple, caller: str) -> str:
    """``backend`` when it is one of ``allowed``; else the ValueError naming ``caller``'s choices
    (the pins of ``runtime/pins.py``: ``fused_backend``, ``plan_backend``, ``pinned_backends``)."""
    if backend not in allowed:
        raise ValueError(f"{caller} must be one of {allowed}, got {backend!r}")
    return backend


def select_backend(op: str, tensor: torch.Tensor, group, requested: str = "auto",
                   nbytes: int | None = None) -> str:
    """Resolve `requested` to "p2p", "multimem" or "torch" (raises if it cannot run)."""
    if requested not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {requested!r}")
    if requested == "torch":
        return "torch"
    possible, reason = p2p_possible(tensor, group)
    if requested in ("p2p", "multimem") and not possible:
        raise ValueError(f"backend {requested!r} cannot run: {reason}")
    if requested == "multimem":
        allowed, why = multimem_allowed(tensor.get_device())
        if not allowed:
            raise ValueError(f"backend 'multimem' is not available: {why}")
        return "multimem"
    if requested == "p2p":
        return "p2p"
    if not possible:
        return "torch"
    if multimem_allowed(tensor.get_device())[0]:
        return "multimem"
    nbytes = tensor.numel() * tensor.element_size() if nbytes is None else nbytes
    return measured_choice(op, nbytes)
