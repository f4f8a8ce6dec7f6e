"""What the dispatcher's handlers share across modules: per-thread state, facts about torch, and
``wrap``, the one place a DTensor is made around a local tensor (its constructor, the dispatcher's
routes and the fast path all call it).

``READY.value`` is a :class:`ReadyOutput` while the fast path has computed a grad-mode call's
output ahead (``__torch_dispatch__`` serves it to that op only), ``None`` when idle, ``False``
once dropped. ``RECORDING`` holds the fast path's recorders of the torch calls now running
(innermost last); while it is not empty, ``__torch_dispatch__`` hands aten ops to the last one.
"""

from __future__ import annotations

import threading

import torch

from ..tracing import eager_only

__all__ = ["READY", "RECORDING", "ReadyOutput", "WRAPPER_POSITIONAL", "wrap"]


class ReadyOutput:
    """An output computed ahead for the aten ``op`` called on ``args`` (the DTensors at
    ``positions`` are checked by identity): ``ReadyOutput(aten.add.Tensor, (0, 1), (x, y), z)``."""

    __slots__ = ("op", "positions", "args", "out")

    def __init__(self, op, positions: tuple[int, ...], args: tuple, out):
        self.op, self.positions, self.args, self.out = op, positions, args, out

    def __repr__(self) -> str:
        return f"ReadyOutput({self.op}, positions {self.positions})"


class _Ready(threading.local):
    value = None


READY = _Ready()
RECORDING: list = []


class _Probe(torch.Tensor):
    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        raise NotImplementedError  # only constructed, never dispatched to


def _wrapper_takes_positions() -> bool:
    """Does ``_make_wrapper_subclass`` take (size, strides, storage_offset, memory_format, dtype,
    layout, device, pin_memory, requires_grad) by position? Its keywords cost ~1 us per call in
    torch's argument parser, a tenth of an op's whole overhead; checked here once."""
    try:
        probe = torch.Tensor._make_wrapper_subclass(_Probe, (2, 3), (1, 2), None, None, torch.float64,
                                                    torch.strided, torch.device("meta"), False, True)
        with torch._C.DisableTorchFunctionSubclass():
            return (probe.dtype, probe.device.type, probe.stride(), tuple(probe.shape), probe.requires_grad) == \
                (torch.float64, "meta", (1, 2), (2, 3), True)
    except (TypeError, RuntimeError):
        return False


WRAPPER_POSITIONAL = _wrapper_takes_positions()


_make_wrapper = torch.Tensor._make_wrapper_subclass
_STRIDED = torch.strided


@eager_only
def _wrap_positional(cls, value, spec, stride, dtype, device, requires_grad=False, _make=_make_wrapper,
                     _strided=_STRIDED):
    if requires_grad:
        out = _make(cls, spec.shape, stride, None, None, dtype, _strided, device, False, True)
    else:
        out = _make(cls, spec.shape, stride, None, None, dtype, _strided, device)
    out._value = value
    out._spec = spec
    return out


@eager_only
def _wrap_by_keyword(cls, value, spec, stride, dtype, device, requires_grad=False):
    strides = {} if stride is None else {"strides": stride}
    out = _make_wrapper(cls, spec.shape, dtype=dtype, device=device, requires_grad=requires_grad, **strides)
    out._value = value
    out._spec = spec
    return out


# wrap(cls, value, spec, stride, dtype, device, requires_grad=False): a ``cls`` of global shape
# ``spec.shape`` (global ``stride``; None: contiguous) whose local tensor is ``value`` (of ``dtype``
# on ``device``, which a caller that knows them passes without asking the tensor), as it is: a
# conjugate or negative bit is the caller's to resolve first (DTensor's constructor does). By
# position where torch takes it so (a tenth of a cached op's overhead less), chosen once here.
wrap = _wrap_positional if WRAPPER_POSITIONAL else _wrap_by_keyword
