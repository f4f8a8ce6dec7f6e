"""Every memo the package keeps, in one registry, so that ``axedist.reset()`` clears them all.

A memo remembers what a pure function of immutable inputs gave (a spec, a plan, a compiled
launch); forgetting it costs only recomputation. Modules make theirs here instead of with
``functools.lru_cache`` or a bare module-level dict (``tests/test_architecture.py`` enforces it)::

    >>> @cached(maxsize=256)
    ... def plan_of(src, dst): ...          # functools.lru_cache, registered under its name
    >>> _launches = memo("kernels.gemm launches")   # a dict, registered
    >>> reset()                               # both are empty again

State that is not a memo stays out: the agreement counters every rank keeps in step (peers.py),
symmetric workspaces (freed collectively: ``axedist.collectives.reset(group)``), the op rules'
registry, and settings (the backend pins of runtime/pins.py, the deferral policies): a user's
choice, not something recomputed. ``reset()`` is called on every rank at the same point, as ``torch._dynamo.reset()``.
"""

from __future__ import annotations

import functools
from typing import Callable

__all__ = ["cached", "memo", "register", "reset", "names"]

_CLEARERS: dict[str, Callable[[], None]] = {}


def register(name: str, clear: Callable[[], None]) -> None:
    """Have ``reset()`` call ``clear`` (a memo kept elsewhere, e.g. a dispatcher's caches)."""
    _CLEARERS[name] = clear


def cached(maxsize: int | None = 128):
    """``functools.lru_cache(maxsize)``, registered under the function's qualified name."""
    def wrap(fn):
        remembered = functools.lru_cache(maxsize=maxsize)(fn)
        register(f"{fn.__module__}.{fn.__qualname__}", remembered.cache_clear)
        return remembered
    return wrap


def memo(name: str) -> dict:
    """A new dict that ``reset()`` empties."""
    table: dict = {}
    register(name, table.clear)
    return table


def reset() -> None:
    """Forget every memo: plans, specs, op plans and fast-path entries, compiled launches."""
    for clear in list(_CLEARERS.values()):
        clear()


def names() -> list[str]:
    """What ``reset()`` clears, by name."""
    return sorted(_CLEARERS)
