"""Layout inference: the collectives that move a tensor from one layout to another, as data.

This is the front door of the design's section 3; the machinery lives in ``axedist/planning/``
(one file per concern: ``derive`` reads the plan off the two layouts, ``direct`` is the general
per-rank block-intersection fallback that is correct for any pair of valid layouts,
``alternatives`` costs other orders of the same steps, ``redistribution`` wraps a DTensor move's
whole route with its padding and uneven shapes, ``simulation`` runs a plan on Python lists).
Nothing here communicates: a plan is built, printed, costed, and then executed by
``axedist.runtime``.

Shard(0) -> Replicate of an (8, 6) fp32 tensor on 4 ranks is one all-gather::

    >>> from axedist.layout_inference import plan_layouts
    >>> src = Layout.parse("S[(4,2,6):(1@gpuid,6,1)]")           # Shard(0)
    >>> dst = Layout.parse("S[(8,6):(6,1)] + R[4:1@gpuid]")       # Replicate
    >>> print(plan_layouts(src, dst, (("gpuid", 4),), (8, 6)))
    plan S[(4,2,6):(1@gpuid,6,1)] -> S[(8,6):(6,1)] + R[4:1@gpuid], ...
      1. all-gather over gpuid (1 group of 4): each member sends 144 B, receives 144 B

The same inference drives the ops (``axedist/ops``: an op's output layout from its inputs', a
pending sum where a matmul contracts a sharded dim) and, between DTensors, ``axedist.plan(x,
target)`` gives the route ``redistribute`` will run.
"""

from __future__ import annotations

from .planning import Plan, Step, Transfer
from .planning.alternatives import plan_alternatives
from .planning.derive import plan_layouts
from .planning.direct import plan_direct
from .planning.redistribution import Redistribution, plan_redistribute
from .planning.simulation import simulate

__all__ = ["Plan", "Step", "Transfer", "Redistribution", "plan_layouts", "plan_direct", "plan_alternatives",
           "plan_redistribute", "simulate"]
