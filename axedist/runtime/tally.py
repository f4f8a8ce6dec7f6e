"""Count the collectives this rank runs in a block of code: calls and bytes per kind and mesh axes.

    >>> with count_collectives() as seen:
    ...     loss = model(tokens).sum(); loss.backward()
    >>> print(seen)               # e.g. on (dp, tp) = (2, 2):
    all_gather over dp: 22 calls, 9,728 B sent
    reduce_scatter over dp: 22 calls, 4,864 B sent
    ...
    >>> seen.bytes_sent           # every route's bytes (``execution_bytes``), summed

Every DTensor move runs a route (``redistribute_local``); the count reads the routes that ran
and their bytes as NCCL moves them (``execution_bytes``: gloo's substitutes are not counted).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

from .executor import execution_bytes, record

__all__ = ["CollectiveCount", "count_collectives"]


@dataclass
class CollectiveCount:
    """Routes run by this rank, grouped by what they do: ``{"all_gather over dp": [calls, bytes]}``."""

    by_kind: dict[str, list[int]] = field(default_factory=dict)
    routes: list = field(default_factory=list)  # the routes that sent something, in the order they ran
    storages: list = field(default_factory=list)  # each route's source storage address (``Ran.storages``)

    @property
    def bytes_sent(self) -> int:
        return sum(b for _, b in self.by_kind.values())

    @property
    def calls(self) -> int:
        return sum(c for c, _ in self.by_kind.values())

    def add(self, route, storage: int | None = None) -> None:
        steps = [s for s in route.steps if s.kind != "local" and s.messages]
        if not steps:
            return
        self.routes.append(route)
        self.storages.append(storage)
        kinds = " + ".join(dict.fromkeys(f"{s.kind} over {','.join(s.axes)}" for s in steps))
        entry = self.by_kind.setdefault(kinds, [0, 0])
        entry[0] += 1
        entry[1] += execution_bytes(route, route.src.mesh)

    def __str__(self) -> str:
        lines = [f"{kind}: {calls} call{'s' if calls != 1 else ''}, {sent:,} B sent" for kind, (calls, sent) in sorted(self.by_kind.items())]
        return "\n".join(lines) if lines else "no collectives"

    def __repr__(self) -> str:
        return f"CollectiveCount({self.calls} calls, {self.bytes_sent:,} B sent)"


@contextlib.contextmanager
def count_collectives():
    """Yield a ``CollectiveCount`` that holds, after the block, every route this rank ran in it."""
    count = CollectiveCount()
    with record() as ran:
        yield count
    for route, storage in zip(ran, ran.storages):
        count.add(route, storage)
