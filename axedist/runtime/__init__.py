"""Runtime: run planned routes with ``torch.distributed`` and ``axedist.collectives``; the
deferred GEMM (``deferred.py``) that a row reduce-scatter may run fused.

    y_local = redistribute_local(x_local, src_spec, dst_spec)   # plan_redistribute (cached), then run it
    with pinned_backends(plan="torch", fused="torch"):          # this block on NCCL, never fused (pins.py)
        y_local = redistribute_local(x_local, src_spec, dst_spec)
"""

from .executor import (PendingBuffer, agree_on_move, backend_notes, execute_plan, execution_bytes, explain_execution,
                       record, redistribute_local, run_route, true_local_shape)
from .pins import fused_backend, pinned_backends, plan_backend
from .tally import CollectiveCount, count_collectives

__all__ = ["redistribute_local", "run_route", "execute_plan", "execution_bytes", "explain_execution", "backend_notes",
           "PendingBuffer", "record", "agree_on_move", "CollectiveCount", "count_collectives", "plan_backend",
           "fused_backend", "pinned_backends", "true_local_shape"]
