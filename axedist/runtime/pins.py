"""The collectives backends the runtime asks for, pinned for the process: from now on, or while a
block runs.

Two choices: what planned CUDA collectives ask for (``plan_backend``: redistributes, FSDP's
gathers and reduce-scatters) and what the layout-driven fused GEMM kernels ask for
(``fused_backend``). Each is one value for the whole process (its ``AXEDIST_*`` variable the
default). The setter changes it from then on; :func:`pinned_backends` changes it while its block
runs and puts back what was there when the block ends::

    >>> fused_backend()                        # AXEDIST_FUSED_BACKEND unset
    'auto'
    >>> with pinned_backends(fused="torch"):   # never fused, while this block runs
    ...     fused_backend()
    'torch'
    >>> fused_backend()
    'auto'
    >>> fused_backend("p2p")                   # from now on
    'p2p'

The pin is process-wide while the block runs, as torch's ``sdpa_kernel`` and
``torch.backends.cudnn.flags`` are: every thread sees it, autograd's device threads included, so
the whole step, its backward too, runs on the pinned backend. Blocks nest (leaving the inner one
puts back the outer one's pin); blocks entered on two threads at once share the one value, so pin
from one thread. Pin alike on every rank: their choices must match. A graph compiled with
``torch.compile`` keeps the choice it was traced with, whatever is pinned when it runs.
"""

from __future__ import annotations

from contextlib import contextmanager

from ..collectives.backend import BACKENDS, checked_choice
from ..collectives.fused_tp import BACKENDS as FUSED_BACKENDS
from ..env import read as read_environment

__all__ = ["Pin", "PLAN", "FUSED", "plan_backend", "fused_backend", "pinned_backends"]


class Pin:
    """One backend choice of the process: ``value``, one of ``choices``, read from ``variable``
    at import (its default)::

        >>> FUSED
        Pin(fused_backend='auto')
        >>> with pinned_backends(fused="torch"):
        ...     FUSED
        Pin(fused_backend='torch')
    """

    __slots__ = ("name", "choices", "variable", "value")

    def __init__(self, name: str, choices: tuple, variable: str):
        self.name, self.choices, self.variable = name, choices, variable
        self.value = checked_choice(read_environment(variable), choices, variable)

    def checked(self, backend: str, caller: str) -> str:
        return checked_choice(backend, self.choices, caller)

    def __repr__(self) -> str:
        return f"Pin({self.name}={self.value!r})"


PLAN = Pin("plan_backend", BACKENDS, "AXEDIST_PLAN_BACKEND")
FUSED = Pin("fused_backend", FUSED_BACKENDS, "AXEDIST_FUSED_BACKEND")


def plan_backend(backend: str | None = None) -> str:
    """The backend planned CUDA collectives ask for (``AXEDIST_PLAN_BACKEND`` its default):
    ``"auto"`` (the measured table), ``"p2p"`` / ``"multimem"`` to pin the symmetric-memory kernels,
    ``"torch"`` to pin torch.distributed (NCCL). Given ``backend``, pins it for the process (every
    thread, from now on; inside :func:`pinned_backends`, until the block ends); returns the backend
    in force."""
    if backend is not None:
        PLAN.value = PLAN.checked(backend, "plan_backend")
    return PLAN.value


def fused_backend(backend: str | None = None) -> str:
    """The backend the layout-driven fused calls ask for (``AXEDIST_FUSED_BACKEND`` its default):
    ``"auto"`` (the measured tables), ``"p2p"`` / ``"symm"`` / ``"multimem"`` to pin one (one-GPU
    tests at TP = 1, where "auto" runs a plain matmul), ``"torch"`` to never fuse (cuBLAS + NCCL).
    Given ``backend``, pins it for the process (every thread, from now on; inside
    :func:`pinned_backends`, until the block ends); returns the backend in force."""
    if backend is not None:
        FUSED.value = FUSED.checked(backend, "fused_backend")
    return FUSED.value


@contextmanager
def pinned_backends(*, plan: str | None = None, fused: str | None = None):
    """Pin the planned collectives' backend (``plan``) and the fused kernels' (``fused``) for the
    process while the block runs; None leaves one as it is. Both are checked before either is set;
    on leaving (an exception too) each is what it was on entering::

        with pinned_backends(plan="torch", fused="torch"):   # this step on NCCL, never fused
            loss = step(tokens)
            loss.backward()          # on autograd's device threads too: the pin is process-wide
    """
    chosen = [(pin, pin.checked(backend, f"pinned_backends({pin.name.removesuffix('_backend')}=...)"))
              for pin, backend in ((PLAN, plan), (FUSED, fused)) if backend is not None]
    previous = [(pin, pin.value) for pin, _ in chosen]
    try:
        for pin, backend in chosen:
            pin.value = backend
        yield
    finally:
        for pin, value in previous:
            pin.value = value
