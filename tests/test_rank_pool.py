"""The pooled rank processes of ``run_on_ranks``: a task never sees a process-wide choice that an
earlier task on the same pool left behind."""
from axedist.testing import run_on_ranks
from axedist.testing.ranks import process_policies

LEFT = {"defer_gemm": "always", "defer_gathers": "always", "defer_tails": "never",
        "plan_backend": "p2p", "fused_backend": "torch"}


def _read(rank, world_size):
    return {name: get() for name, get, _ in process_policies()}


def _leave_changed(rank, world_size):
    """Sets every policy and returns without putting any back (what a careless test does)."""
    for name, _, put in process_policies():
        put(LEFT[name])
    return _read(rank, world_size)


def test_a_task_starts_with_the_policies_the_pool_started_with():
    before = run_on_ranks(_read, 2)
    assert set(before[0]) == set(LEFT), "process_policies names changed: update LEFT"
    assert all(before[0][name] != LEFT[name] for name in LEFT), "LEFT must differ from the defaults"
    assert run_on_ranks(_leave_changed, 2) == [LEFT, LEFT]
    assert run_on_ranks(_read, 2) == before
