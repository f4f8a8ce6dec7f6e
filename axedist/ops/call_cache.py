"""The dispatcher's one cache of call records.

A call on DTensors is planned once per key and served from here afterwards. One object per
dispatcher (``OpDispatcher.cache``) holds every table, each an index into the same records
(``ops/call_plan.py``): a ``CallPlan`` per aten call, whose ``plain`` route is a ``LocalRoute``,
and a ``LocalRoute`` per torch call the fast path proved (``ops/fastpath.py``)::

    plans       the aten call's full key (op, specs, scalars, kwargs)  -> CallPlan (or "no rule")
    positional  the key of a call with positional DTensors and scalars -> the same CallPlan
    torch_calls the fast path's key of a torch call                     -> LocalRoute (or "slow")
    arg_specs   (spec, dtype)                                           -> what a rule sees of a DTensor

``x + y`` twice: the first call plans ``aten.add.Tensor`` (``plans``, ``positional``) while the
fast path records it (``torch_calls``); the second is one lookup in ``torch_calls``. A table past
its limit starts again empty (rules and routes are re-derived on next use); ``clear()`` (and so
``axedist.reset()``) empties them all.
"""

from __future__ import annotations

__all__ = ["CallCache"]

_LIMITS = {"plans": 16384, "positional": 16384, "torch_calls": 16384, "arg_specs": 4096}


class CallCache:
    """The tables of one dispatcher's call records (module docstring); ``put`` keeps each within
    its limit, ``clear`` empties them."""

    __slots__ = ("plans", "positional", "torch_calls", "arg_specs")

    def __init__(self):
        self.plans: dict = {}
        self.positional: dict = {}
        self.torch_calls: dict = {}
        self.arg_specs: dict = {}

    def put(self, table: str, key, record) -> None:
        """``self.<table>[key] = record``, the table emptied first when past its limit."""
        entries = getattr(self, table)
        if len(entries) > _LIMITS[table]:
            entries.clear()
        entries[key] = record

    def clear(self, *tables: str) -> None:
        """Empty ``tables`` (all of them when none is named)."""
        for table in tables or self.__slots__:
            getattr(self, table).clear()

    def __repr__(self) -> str:
        return "CallCache(" + ", ".join(f"{table}={len(getattr(self, table))}" for table in self.__slots__) + ")"
