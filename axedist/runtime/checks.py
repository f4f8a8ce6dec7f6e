"""Checks of device values that do not stop the host: an embedding index or a loss target out of range.

Reading a CUDA value on the host (``.item()``, ``.tolist()``, ``if t.any():``) waits for every
kernel queued before the read. In a training step whose host runs ahead of its GPU, each such read
throws the lead away: the queue drains, then the GPU waits for the host's next launches. A TP=2
Llama step traced on 2x H200 (2026-11-28) waited 20 ms at the loss's target check alone; torch
checks these values with device-side asserts, which end the CUDA context rather than raise.

``check(answer, verdict)`` keeps the clear error without the wait. Where the wait would be paid,
a tensor on a CUDA device while autograd records (grad mode on) or runs a backward, it copies the
small ``answer`` into pinned host memory behind the kernels that computed it, records an event
and returns. The check is *settled* (its answer read,
``verdict``'s error raised) at a point every rank reaches alike, so that ranks running the same
program raise at the same place (a settling chosen by what one rank's device had finished would
let that rank raise while the others wait in a collective):

- the end of the backward pass running when it was made, or of the next backward that makes a
  check or runs ``settle_after_backward()`` (autograd's final callback): ``loss.backward()`` raises
  before an optimizer can use the gradients;
- a DTensor's value read on the host (``x.item()``, ``bool(x)``, ``torch.equal``: ``ops/pointwise.py``)
  or gathered whole (``x.full_tensor()``);
- ``settle()``;
- the oldest of more than ``LIMIT`` pending checks, when another is made (a loop that never runs
  a backward nor reads a value).

Anywhere else (CPU tensors, no grad) the answer is read at once and the error raised from the call,
as before. Under CUDA-graph capture nothing can be read on the host (an event recorded for later
would never fire on replay, and a read now is refused by the capture): ``check_range`` asserts on
the device there, as under torch.compile and as torch's CUDA embedding does, so a captured decode
step with a vocabulary-sharded embedding replays with its range checked on every replay; ``check``
itself is read at once, which the capture refuses with torch's error.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Callable

import torch

from ..tracing import compiling

__all__ = ["assert_on_device", "capturing", "check", "check_range", "defers", "settle", "settle_after_backward",
           "pending", "LIMIT", "ASSERT_MESSAGE_LIMIT"]


@dataclass
class _Pending:
    answer: torch.Tensor            # the host copy, valid once ``done`` has completed
    done: "torch.cuda.Event | None"  # None: complete (a CPU answer)
    verdict: Callable[[list], Exception | None]


# State, not a memo: the checks made and not yet settled, shared by the threads that make them (the
# forward's) and settle them (a CUDA backward runs on autograd's device thread).
PENDING: list[_Pending] = []
_LOCK = threading.Lock()
_QUEUED_FOR: list[int] = [-1]       # the backward whose final callback already settles
LIMIT = 256


def defers(answer: torch.Tensor) -> bool:
    """Whether a check of ``answer`` waits to be settled: where reading it now would make the host
    wait for the device's queue, a CUDA tensor while autograd records or runs a backward, in eager
    (a trace cannot keep a host copy for later). (A test may set this to ``lambda answer: True`` to
    see the deferred path on CPU.)"""
    return answer.is_cuda and (torch.is_grad_enabled() or torch._C._current_graph_task_id() != -1) \
        and not compiling() and not capturing(answer)


def capturing(values: torch.Tensor) -> bool:
    """Whether ``values`` live on a CUDA device whose current stream is capturing a CUDA graph
    (no host read possible: ``check_range`` asserts on the device then)."""
    return values.is_cuda and torch.cuda.is_current_stream_capturing()


ASSERT_MESSAGE_LIMIT = 254  # characters of a CUDA device-assert message


def assert_on_device(condition: torch.Tensor, message: str) -> None:
    """``torch._assert_async(condition, message)``: a device-side assert, no host read. CUDA takes a
    message of at most ``ASSERT_MESSAGE_LIMIT`` characters (longer ones are refused at the call):
    a longer one is cut there, with "..." at its end."""
    if len(message) > ASSERT_MESSAGE_LIMIT:
        message = message[:ASSERT_MESSAGE_LIMIT - 3] + "..."
    torch._assert_async(condition, message)


def check(answer: torch.Tensor, verdict: Callable[[list], Exception | None]) -> None:
    """Raise ``verdict(answer.tolist())`` if it is an error: now, or, where ``defers(answer)``, when
    the check is settled (the module's docstring says when)."""
    if not defers(answer):
        error = verdict(answer.tolist())
        if error is not None:
            raise error
        return
    if len(PENDING) >= LIMIT:
        _settle(len(PENDING) - LIMIT + 1)
    if answer.is_cuda:
        host = torch.empty(answer.shape, dtype=answer.dtype, pin_memory=True)
        host.copy_(answer, non_blocking=True)
        done = torch.cuda.Event()
        done.record()
    else:
        host, done = answer.detach().clone(), None
    with _LOCK:
        PENDING.append(_Pending(host, done, verdict))
    settle_after_backward()


def check_range(values: torch.Tensor, size: int, message: str) -> None:
    """``check`` that every value (an integer tensor) lies in ``[0, size)``, reading only their min
    and max; the error is ``IndexError(message.format(value=<the min or max outside>))``. While
    torch.compile traces or a CUDA graph is captured (``capturing``): a device-side assert
    (``torch._assert_async``, as torch's CUDA embedding has), so the graph holds no host read and
    is the same on every rank; its message cannot name the value."""
    if not values.numel():
        return
    if compiling() or capturing(values):
        inside = ((values >= 0) & (values < size)).all()
        assert_on_device(inside, message.format(value="(a value the graph does not read on the host)"))
        return

    def verdict(bounds):
        low, high = bounds
        return None if 0 <= low and high < size else IndexError(message.format(value=low if low < 0 else high))

    check(torch.stack(torch.aminmax(values)), verdict)


def settle() -> None:
    """Read every pending check (waiting for its kernels) and raise the first error found."""
    if PENDING:
        _settle(None)


def settle_after_backward() -> None:
    """Inside a backward with checks pending: settle them once this backward ends (nothing otherwise)."""
    task = torch._C._current_graph_task_id()
    if task == -1 or not PENDING:
        return
    with _LOCK:
        if _QUEUED_FOR[0] == task:
            return
        _QUEUED_FOR[0] = task
    torch.autograd.Variable._execution_engine.queue_callback(settle)


def pending() -> int:
    """How many checks wait to be settled."""
    return len(PENDING)


def _settle(oldest: int | None) -> None:
    """Read the ``oldest`` pending checks (None: all), waiting for their kernels; raise the first error."""
    with _LOCK:
        taken = PENDING[:oldest] if oldest is not None else list(PENDING)
        del PENDING[:len(taken)]
    for p in taken:  # all are read, even after an error: none is left pending for a later call
        if p.done is not None:
            p.done.synchronize()
    errors = [e for e in (p.verdict(p.answer.tolist()) for p in taken) if e is not None]
    if errors:
        raise errors[0]
