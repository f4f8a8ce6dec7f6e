"""What of the GPU communication layer can be checked without a GPU.

- the fused kernel's task schedule: a permutation of the work, deadlock-free (checked by a
  simulation of programs claiming tasks and waiting on flags), identical on the device (the
  kernel's own decode run under TRITON_INTERPRET=1);
- the kernels compile for Hopper (sm_90a, through ptxas), with the multimem PTX present in the
  multimem variants and the acquire/release flags, bounded waits and 16-byte peer loads in p2p;
- backend gating: multimem only with device multicast support AND AXEDIST_ENABLE_MULTICAST=1;
- input validation of gemm_reduce_scatter, and that `import axedist.collectives` needs no Triton.

Triton 3.6 is required (CI installs it). Without it the compile tests FAIL with a message, unless
AXEDIST_SKIP_TRITON_TESTS=1 asks for a visible skip.
"""
import collections
import itertools
import json
import os
import random
import re
import subprocess
import sys
import textwrap

import pytest
import torch

from axedist.kernels import schedule

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _need_triton():
    try:
        import triton  # noqa: F401
    except ImportError:
        if os.environ.get("AXEDIST_SKIP_TRITON_TESTS") == "1":
            pytest.skip("AXEDIST_SKIP_TRITON_TESTS=1 and triton is not installed")
        pytest.fail("triton==3.6.0 is required for the kernel tests: pip install triton==3.6.0")


# -- schedule ---------------------------------------------------------------------------------

@pytest.mark.parametrize("tiles_m,tiles_n,group_m", [(1, 1, 8), (3, 2, 2), (5, 7, 4), (16, 32, 8), (9, 4, 8)])
def test_grouped_tile_is_a_bijection(tiles_m, tiles_n, group_m):
    tiles = [schedule.grouped_tile(i, tiles_m, tiles_n, group_m) for i in range(tiles_m * tiles_n)]
    assert sorted(tiles) == [(m, n) for m in range(tiles_m) for n in range(tiles_n)]


@pytest.mark.parametrize("world,rounds,lag", [(2, 3, 1), (4, 1, 0), (4, 7, 7), (8, 10, 3), (4, 512, 40), (3, 5, 2)])
def test_every_rank_runs_each_gemm_tile_once_and_reduces_its_chunk(world, rounds, lag):
    for rank in range(world):
        tasks = schedule.task_list(rank, world, rounds, lag)
        gemm = [(chunk, r) for kind, chunk, r in tasks if kind == "gemm"]
        reduce = [(chunk, r) for kind, chunk, r in tasks if kind == "reduce"]
        assert sorted(gemm) == [(c, r) for c in range(world) for r in range(rounds)]
        assert reduce == [(rank, r) for r in range(rounds)]


@pytest.mark.parametrize("world,rounds,lag", [(2, 3, 1), (4, 6, 0), (4, 6, 6), (8, 9, 2)])
def test_reduce_tasks_come_after_the_gemm_tiles_they_wait_for_on_every_rank(world, rounds, lag):
    lists = [schedule.task_list(rank, world, rounds, lag) for rank in range(world)]
    position = [{(kind, chunk, r): i for i, (kind, chunk, r) in enumerate(tasks)} for tasks in lists]
    for rank in range(world):
        for r in range(rounds):
            reduce_index = position[rank][("reduce", rank, r)]
            for peer in range(world):
                assert position[peer][("gemm", rank, r)] < reduce_index


def test_gemm_slots_are_staggered_across_ranks():
    world = 4
    firsts = [schedule.task_list(rank, world, 4, 1)[0][1] for rank in range(world)]
    assert sorted(firsts) == list(range(world))  # at the start every rank writes another chunk


def _simulate_grid(lists, programs, seed, ready, done):
    """A persistent grid of `programs` programs per rank: each claims its rank's next task in
    order (with probability 0.7 per sweep), and runs it for 1-3 sweeps once ``ready(rank, task)``
    (until then it spins), then calls ``done(rank, task)``. Returns the sweeps taken until every
    task finished, or None when every program is stuck (deadlock)."""
    rng = random.Random(seed)
    world = len(lists)
    counters = [0] * world
    running = [[None] * programs for _ in range(world)]  # (task, remaining sweeps)
    for sweep in range(100_000):
        if all(counters[r] == len(lists[r]) and not any(running[r]) for r in range(world)):
            return sweep
        if all((slot is None and counters[r] == len(lists[r])) or (slot is not None and not ready(r, slot[0]))
               for r in range(world) for slot in running[r]):
            return None
        order = [(r, p) for r in range(world) for p in range(programs)]
        rng.shuffle(order)
        for rank, program in order:
            slot = running[rank][program]
            if slot is None:
                if counters[rank] < len(lists[rank]) and rng.random() < 0.7:
                    running[rank][program] = (counters[rank], rng.randint(1, 3))
                    counters[rank] += 1
            elif ready(rank, slot[0]):
                task, remaining = slot
                if remaining > 1:
                    running[rank][program] = (task, remaining - 1)
                else:
                    done(rank, task)
                    running[rank][program] = None
    return None


def _simulate(world, rounds, lag, programs, seed):
    """The GEMM + RS schedule on a simulated grid: a reduce task spins until its tile's GEMM
    finished on every rank."""
    lists = [schedule.task_list(rank, world, rounds, lag) for rank in range(world)]
    flags = [set() for _ in range(world)]          # (chunk, round) tiles finished per rank

    def ready(rank, task):
        kind, _, r = lists[rank][task]
        return kind != "reduce" or all((rank, r) in flags[peer] for peer in range(world))

    def done(rank, task):
        kind, chunk, r = lists[rank][task]
        if kind == "gemm":
            flags[rank].add((chunk, r))
    return _simulate_grid(lists, programs, seed, ready, done)


@pytest.mark.parametrize("world,rounds,programs", [(2, 5, 1), (2, 5, 2), (4, 6, 1), (4, 6, 3), (8, 3, 2), (3, 7, 4)])
def test_simulated_persistent_grid_never_deadlocks(world, rounds, programs):
    for lag, seed in itertools.product(range(0, rounds + 1, 2), range(3)):
        assert _simulate(world, rounds, lag, programs, seed) is not None, (lag, seed)


def _simulate_static(lists, programs, seed, ready, done):
    """The Gluon kernels' grid: program p of a rank runs that rank's tasks p, p + P, p + 2P, ...
    in order (no claiming); each sweep, in random order, a program whose current task is
    ``ready(rank, task)`` advances it (1-3 sweeps each), then ``done(rank, task)``. Returns the
    sweeps taken, or None when no program can move while tasks remain (deadlock)."""
    rng = random.Random(seed)
    world = len(lists)
    position = [[p for p in range(programs)] for _ in range(world)]  # each program's current task
    left = [[rng.randint(1, 3) for _ in range(programs)] for _ in range(world)]
    for sweep in range(100_000):
        live = [(r, p) for r in range(world) for p in range(programs) if position[r][p] < len(lists[r])]
        if not live:
            return sweep
        movable = [(r, p) for r, p in live if ready(r, position[r][p])]
        if not movable:
            return None
        rng.shuffle(movable)
        for rank, program in movable:
            left[rank][program] -= 1
            if left[rank][program] == 0:
                done(rank, position[rank][program])
                position[rank][program] += programs
                left[rank][program] = rng.randint(1, 3)
    return None


@pytest.mark.parametrize("world,rounds,programs", [(2, 5, 1), (2, 5, 2), (4, 6, 1), (4, 6, 3), (8, 3, 2), (3, 7, 4), (4, 32, 33)])
def test_statically_assigned_grid_never_deadlocks(world, rounds, programs):
    """The deadlock argument of pipelined_gemm_reduce_scatter_kernel's docstring, run: tasks of
    the global order assigned round robin, any lag, random progress; and of the all-gather +
    GEMM one (a tile waits only for its own rows: its look-ahead never waits). The simulation
    catches an order that deadlocks under static assignment (every push after every tile)."""
    for lag, seed in itertools.product(range(0, rounds + 1, max(1, rounds // 4)), range(3)):
        lists = [schedule.task_list(rank, world, rounds, lag) for rank in range(world)]
        flags = [set() for _ in range(world)]

        def ready(rank, task, lists=lists, flags=flags):
            kind, _, r = lists[rank][task]
            return kind != "reduce" or all((rank, r) in flags[peer] for peer in range(world))

        def done(rank, task, lists=lists, flags=flags):
            kind, chunk, r = lists[rank][task]
            if kind == "gemm":
                flags[rank].add((chunk, r))
        assert _simulate_static(lists, programs, seed, ready, done) is not None, (lag, seed)
    for tiles_m, tiles_n, pieces in ((2, 3, 2), (3, 4, 4)):
        lists = [schedule.ag_task_list(rank, world, tiles_m, tiles_n, pieces, False, True)
                 for rank in range(world)]
        for seed in range(3):
            ready, done = _ag_flags(lists, world, pieces)
            assert _simulate_static(lists, programs, seed, ready, done) is not None, (tiles_m, seed)
        late = [[t for t in tasks if t[0] != schedule.PUSH] + [t for t in tasks if t[0] == schedule.PUSH]
                for tasks in lists]
        ready, done = _ag_flags(late, world, pieces)
        assert _simulate_static(late, 1, 0, ready, done) is None


@pytest.mark.parametrize("programs", [1, 3, 16, 33, 132])
def test_stream_k_tail_covers_every_step_once_and_owners_wait_only_on_first_segments(programs):
    """schedule.stream_k_segments (the Gluon all-gather + GEMM's tail, computed the same way on
    the device): every K step of every tail tile runs exactly once; a tile's owner starts at its
    step 0 and adds exactly the programs whose partial (their first segment, at most one each)
    is of that tile; an owner waits only for later programs, whose first segments wait for
    nothing, so the tail cannot deadlock; and a program's share differs by at most one step."""
    for tiles, k_tiles in itertools.product((1, 2, 5, programs - 1, 2 * programs), (1, 3, 16, 128)):
        if tiles < 1 or tiles * k_tiles < programs:
            with pytest.raises(ValueError, match="without one"):
                schedule.stream_k_segments(0, programs, max(tiles, 0), k_tiles)
            continue
        covered = collections.Counter()
        partials, owners, shares = {}, {}, []
        for program in range(programs):
            segments = schedule.stream_k_segments(program, programs, tiles, k_tiles)
            shares.append(sum(last - first for _, first, last, _, _ in segments))
            for index, (tile, first, last, owner, helpers_end) in enumerate(segments):
                assert 0 <= first < last <= k_tiles and owner == (first == 0)
                covered.update((tile, k) for k in range(first, last))
                if owner:
                    owners[tile] = (program, helpers_end)
                else:
                    assert index == 0 and program not in partials  # a partial is a first segment
                    partials[program] = tile
        assert covered == collections.Counter(itertools.product(range(tiles), range(k_tiles)))
        assert max(shares) - min(shares) <= 1
        for tile, (owner, helpers_end) in owners.items():
            helpers = {p for p, t in partials.items() if t == tile}
            assert helpers == set(range(owner + 1, helpers_end)), (tiles, k_tiles, tile)
        assert set(owners) == set(range(tiles))


def test_stream_k_tail_runs_only_where_it_saves_a_round():
    assert schedule.stream_k_tiles(448, 132, 448, 128, 3) == 52      # 2048 x 7168 x 8192
    assert schedule.stream_k_tiles(1600, 132, 1600, 80, 3) == 16     # 8192 x 6400 x 5120
    assert schedule.stream_k_tiles(528, 132, 528, 128, 3) == 0       # whole rounds
    assert schedule.stream_k_tiles(512, 132, 512, 128, 3) == 0       # 116 of 132 busy
    assert schedule.stream_k_tiles(448, 132, 40, 128, 3) == 0        # the round spans two sources
    assert schedule.stream_k_tiles(160, 132, 160, 4, 3) == 0         # 28 x 4 steps < 3 per program


def test_lag_is_about_one_and_a_half_waves_and_capped():
    assert schedule.choose_lag(512, 4, 132) == 40
    assert schedule.choose_lag(8, 4, 132) == 8


def test_device_decode_matches_schedule_under_the_interpreter():
    _need_triton()
    script = textwrap.dedent("""
        import torch
        from axedist.kernels import gemm_rs, schedule
        world, tiles_m, tiles_n, group_m = 4, 3, 5, 2
        rounds = tiles_m * tiles_n
        for rank in range(world):
            for lag in (0, 4, rounds):
                tasks = schedule.task_count(rounds, world)
                out = torch.zeros(tasks * 4, dtype=torch.int32)
                gemm_rs.schedule_probe_kernel[(tasks,)](out, rounds, lag, tiles_m, tiles_n, rank,
                                                    WORLD=world, GROUP_M=group_m)
                got = out.view(-1, 4).tolist()
                for task, (is_gemm, chunk, tm, tn) in enumerate(got):
                    g, r, slot = schedule.decode_task(task, rounds, lag, world)
                    expect_chunk = schedule.gemm_chunk(rank, slot, world) if g else rank
                    assert (bool(is_gemm), chunk, (tm, tn)) == (
                        g, expect_chunk, schedule.grouped_tile(r, tiles_m, tiles_n, group_m)), (rank, lag, task)
        print("OK")
    """)
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=ROOT)
    result = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0 and "OK" in result.stdout, result.stdout + result.stderr


# -- the all-gather + GEMM's schedule ----------------------------------------------------------

_AG_CASES = [(2, 3, 2, 1), (3, 2, 3, 2), (4, 3, 1, 3), (4, 1, 5, 1), (8, 2, 2, 2), (1, 2, 3, 2)]


@pytest.mark.parametrize("world,tiles_m,tiles_n,pieces", _AG_CASES)
@pytest.mark.parametrize("multimem,copy_out,engine", [(False, False, False), (False, True, False),
                                                      (True, True, False), (False, True, True)])
def test_ag_schedule_runs_each_push_tile_and_copy_once(world, tiles_m, tiles_n, pieces, multimem,
                                                       copy_out, engine):
    """Every rank pushes each (row block, piece) of its rows to every peer once (multimem: once to
    all; copy engine: no push task), computes each tile of every source once, own rows first,
    and copies out every source's rows once; in each push step every rank sends to a different
    peer."""
    pushes_to = {}
    for rank in range(world):
        tasks = schedule.ag_task_list(rank, world, tiles_m, tiles_n, pieces, multimem, copy_out,
                                      engine=engine)
        pushes = [(who, x, y) for kind, who, x, y in tasks if kind == schedule.PUSH]
        tiles = [(who, x, y) for kind, who, x, y in tasks if kind == schedule.TILE]
        copies = [(who, x, y) for kind, who, x, y in tasks if kind == schedule.COPY]
        peers = ([] if engine else [-1] if multimem and world > 1
                 else [p for p in range(world) if p != rank])
        assert sorted(pushes) == sorted((p, b, c) for p in peers for b in range(tiles_m) for c in range(pieces))
        assert sorted(tiles) == sorted((s, m, n) for s in range(world) for m in range(tiles_m) for n in range(tiles_n))
        assert {who for who, _, _ in tiles[:tiles_m * tiles_n]} == {rank}
        assert sorted(copies) == (sorted((s, b, c) for s in range(world) for b in range(tiles_m) for c in range(pieces))
                                  if copy_out else [])
        pushes_to[rank] = [who for who, _, _ in pushes]
    if not multimem and not engine and world > 2:
        for step in range(len(pushes_to[0])):
            assert len({pushes_to[rank][step] for rank in range(world)}) == world


def _ag_flags(lists, world, pieces):
    """(ready, done) of the all-gather + GEMM schedule: a push lands its flag on its peer (every
    rank: multimem) when done; a tile or copy of a peer's rows waits until its flags arrived."""
    arrived = [set() for _ in range(world)]

    def ready(rank, task):
        kind, who, x, y = lists[rank][task]
        if kind == schedule.PUSH or who == rank:
            return True
        needed = [(who, x, c) for c in range(pieces)] if kind == schedule.TILE else [(who, x, y)]
        return all(flag in arrived[rank] for flag in needed)

    def done(rank, task):
        kind, who, x, y = lists[rank][task]
        if kind == schedule.PUSH:
            for peer in (range(world) if who == -1 else [who]):
                arrived[peer].add((rank, x, y))
    return ready, done


def _simulate_ag(lists, world, pieces, programs, seed):
    """The all-gather + GEMM schedule on a simulated grid of claiming programs (_ag_flags)."""
    ready, done = _ag_flags(lists, world, pieces)
    return _simulate_grid(lists, programs, seed, ready, done)


@pytest.mark.parametrize("world,tiles_m,tiles_n,pieces", _AG_CASES)
@pytest.mark.parametrize("multimem", [False, True])
def test_ag_simulated_persistent_grid_never_deadlocks(world, tiles_m, tiles_n, pieces, multimem):
    """The deadlock argument of ag_gemm.py's docstring, run: any number of programs per rank,
    random claim and finish times; and the simulation does catch an order that can deadlock
    (every push after every tile)."""
    lists = [schedule.ag_task_list(rank, world, tiles_m, tiles_n, pieces, multimem, True) for rank in range(world)]
    for programs, seed in itertools.product((1, 2, 5), range(3)):
        assert _simulate_ag(lists, world, pieces, programs, seed) is not None, (programs, seed)
    if world > 1:
        late = [[t for t in tasks if t[0] != schedule.PUSH] + [t for t in tasks if t[0] == schedule.PUSH]
                for tasks in lists]
        assert _simulate_ag(late, world, pieces, 1, 0) is None


def test_ag_device_decode_matches_schedule_under_the_interpreter():
    _need_triton()
    script = textwrap.dedent("""
        import itertools
        import torch
        from axedist.kernels import ag_gemm, schedule
        tiles_m, tiles_n, group_m = 3, 5, 2
        cases = [c for c in itertools.product((1, 2, 3, 4), (1, 2), (False, True), (False, True), (False, True))
                 if not (c[2] and c[4])]   # copy engine: unicast only
        for world, pieces, multimem, copy_out, engine in cases:
            for rank in range(world):
                tasks = schedule.ag_task_count(world, tiles_m, tiles_n, pieces, multimem, copy_out, engine)
                out = torch.full((tasks * 4,), -7, dtype=torch.int32)
                count = torch.zeros(1, dtype=torch.int32)
                ag_gemm.schedule_probe_kernel[(tasks,)](out, count, tiles_m, tiles_n, rank, WORLD=world,
                                                        MULTIMEM=multimem, PIECES=pieces, GROUP_M=group_m,
                                                        COPY_OUT=copy_out, ENGINE=engine)
                assert count.item() == tasks, (world, pieces, multimem, copy_out, engine, count.item(), tasks)
                expect = schedule.ag_task_list(rank, world, tiles_m, tiles_n, pieces, multimem, copy_out, group_m,
                                               engine)
                got = [tuple(row) for row in out.view(-1, 4).tolist()]
                assert got == expect, (world, pieces, multimem, copy_out, engine, rank, got, expect)
        print("OK")
    """)
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=ROOT)
    result = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0 and "OK" in result.stdout, result.stdout + result.stderr


# -- compilation for sm_90a --------------------------------------------------------------------

COLLECTIVE_OPS = ("reduce_scatter", "all_gather", "all_reduce_one_shot", "all_reduce_two_shot")
_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def _compile_collective(op, dtype="bf16", world=4, rows=8, push=False, copy_in=True,
                        multimem=False, chunk=1 << 20, rounds=1):
    """Compile `op`'s kernel exactly as p2p.CallPlan does on a GPU, for sm_90a."""
    from axedist.collectives import p2p
    return p2p.compile_collective(op, _DTYPES[dtype], world, rows, push, copy_in, multimem,
                                  chunk, aligned=True, capability=90, rounds=rounds)


@pytest.mark.parametrize("push", [False, True])
@pytest.mark.parametrize("op", ["reduce_scatter", "all_gather"])
def test_pipelined_kernels_signal_once_per_round(op, push):
    """ROUNDS = 4: four signals (a fence, then a relaxed store to each of the 3 peers) and four
    bounded waits, instead of one barrier."""
    _need_triton()
    ptx = _compile_collective(op, "bf16", push=push, rounds=4).asm["ptx"]
    assert ptx.count("fence.acq_rel.sys") == 4
    assert ptx.count("st.relaxed.sys.global.b32") == 4 * 3
    assert ptx.count("%globaltimer") >= 4 * 3           # each of 3 peers waited on, per round
    assert ptx.count("ld.global.v4") >= 4 and ptx.count("st.global.v4") >= 4


def test_rounds_for_forces_clamps_and_skips_other_ops(monkeypatch):
    from axedist.collectives import p2p
    from axedist.collectives.symmetric import MAX_BARRIER_PROGRAMS
    monkeypatch.delenv("AXEDIST_P2P_ROUNDS", raising=False)
    monkeypatch.setattr(p2p, "PIPELINE", ((1 << 20, 4), (1 << 22, 8)))
    assert p2p.rounds_for("reduce_scatter", 1 << 20, 132) == 4
    assert p2p.rounds_for("reduce_scatter", 1 << 22, 132) == 7          # 8 x 132 slots do not fit
    assert p2p.rounds_for("all_gather", 1 << 22, 64) == 8
    assert p2p.rounds_for("all_gather", (1 << 20) - 1, 132) == 1        # below the threshold
    assert p2p.rounds_for("all_reduce_two_shot", 1 << 30, 132) == 1
    monkeypatch.setenv("AXEDIST_P2P_ROUNDS", "16")
    # the barrier area holds 2 * MAX_BARRIER_PROGRAMS slots per parity: rounds * programs fit
    assert p2p.rounds_for("all_gather", 10, 132) == 2 * MAX_BARRIER_PROGRAMS // 132
    assert p2p.rounds_for("all_gather", 10, 16) == 16
    monkeypatch.setenv("AXEDIST_P2P_ROUNDS", "0")
    with pytest.raises(ValueError, match="AXEDIST_P2P_ROUNDS"):
        p2p.rounds_for("reduce_scatter", 10, 8)


@pytest.mark.parametrize("dtype,ptx_op", [("bf16", "add.acc::f32.v4.bf16x2"), ("fp16", "add.acc::f32.v4.f16x2"), ("fp32", "add.v4.f32")])
@pytest.mark.parametrize("op", ["reduce_scatter", "all_reduce_one_shot", "all_reduce_two_shot"])
def test_multimem_collectives_ptx_for_sm90a(op, dtype, ptx_op):
    _need_triton()
    kernel = _compile_collective(op, dtype, multimem=True)
    ptx = kernel.asm["ptx"]
    assert ".target sm_90a" in ptx
    assert f"multimem.ld_reduce.relaxed.sys.global.{ptx_op}" in ptx
    assert len(kernel.asm["cubin"]) > 0  # ptxas accepted it for sm_90a


@pytest.mark.parametrize("push", [False, True])
@pytest.mark.parametrize("op", COLLECTIVE_OPS)
def test_p2p_collectives_signal_with_one_fence_wait_bounded_and_move_16_byte_vectors(op, push):
    _need_triton()
    ptx = _compile_collective(op, "bf16", push=push).asm["ptx"]
    barriers = 2 if op == "all_reduce_two_shot" else 1
    assert "multimem" not in ptx
    # per barrier: one system-scope fence, then a relaxed flag store to each of the 3 peers
    assert ptx.count("fence.acq_rel.sys") == barriers
    assert ptx.count("st.relaxed.sys.global.b32") == 3 * barriers
    assert "ld.acquire.sys.global.b32" in ptx and "%globaltimer" in ptx  # bounded local waits
    assert ptx.count("ld.global.v4") >= 4 and ptx.count("st.global.v4") >= 4


def test_unaligned_sizes_compile_too():
    _need_triton()
    for op in COLLECTIVE_OPS:
        assert "ld.acquire.sys" in _compile_collective(op, "fp16", world=8, rows=2, chunk=1001).asm["ptx"]


@pytest.mark.parametrize("push", [False, True])
def test_layer_tail_kernel_compiles_with_one_barrier_and_vector_loads(push):
    """The fused all-reduce + residual add + RMSNorm (collectives/layer_tail.py) for sm_90a at
    Llama-8B's hidden 4096, W = 4: one program barrier (a fence, a relaxed store to each of the
    3 peers, bounded waits), 16-byte loads and stores where the host says rows are aligned."""
    _need_triton()
    from axedist.collectives.layer_tail import compile_tail
    ptx = compile_tail(4096, torch.bfloat16, 4, push, aligned=True).asm["ptx"]
    assert ptx.count("fence.acq_rel.sys") == 1
    assert ptx.count("st.relaxed.sys.global.b32") == 3
    assert ptx.count("%globaltimer") >= 3
    assert ptx.count("ld.global.v4") >= 1 and "st.global.v4" in ptx
    assert "rsqrt" in ptx


def test_collective_phases_match_a_float64_reference_under_the_interpreter():
    """Every op and the fused layer tail, push / pull / zero-copy, W = 2, 3, 4, odd sizes and tails, run phase by phase
    rank by rank (tests/collectives_interpreter.py): indexing and workspace layout on CPU."""
    _need_triton()
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=ROOT)
    script = os.path.join(ROOT, "tests", "collectives_interpreter.py")
    result = subprocess.run([sys.executable, script], env=env, capture_output=True, text=True,
                            timeout=600)
    assert result.returncode == 0 and result.stdout.strip().endswith("OK"), \
        result.stdout[-3000:] + result.stderr[-3000:]


def _fused_signature(tma, transposed, config, dtype="bf16"):
    signature = {}
    if tma:
        signature["a_desc"] = f"tensordesc<{dtype}[{config.block_m}, {config.block_k}]>"
        signature["b_desc"] = (f"tensordesc<{dtype}[{config.block_n}, {config.block_k}]>" if transposed
                               else f"tensordesc<{dtype}[{config.block_k}, {config.block_n}]>")
    signature.update(a_ptr=f"*{dtype}", b_ptr=f"*{dtype}", part_ptr=f"*{dtype}", out_ptr=f"*{dtype}")
    if config.tma_push and tma:
        signature.update({f"P{i}": f"tensordesc<{dtype}[{config.block_m}, {config.block_n}]>" for i in range(8)})
    for name in [f"D{i}" for i in range(8)] + ["multicast_base"] + [f"F{i}" for i in range(8)]:
        signature[name] = "i64"
    signature.update(state_ptr="*i32", abort_ptr="*i32", error_address="i64",
                     timeout_ns="i64", M="i32", N="i32", K="i32", M_CHUNK="i32", stride_am="i32",
                     stride_ak="i32", stride_bk="i32", stride_bn="i32", rank="i32", lag="i32",
                     half_bytes="i64", push_rows="i32")
    return signature


def _compile_fused(tma=True, transposed=False, multimem=False, gemm_only=False, dtype="bf16", config=None):
    from axedist.kernels import gemm_rs
    from axedist.kernels.compile_check import compile_for_target
    config = config or gemm_rs.GemmConfig()
    constexprs = dict(WORLD=4, BM=config.block_m, BN=config.block_n, BK=config.block_k,
                      GROUP_M=config.group_m, STAGES=config.stages, USE_TMA=tma,
                      B_TRANSPOSED=transposed, MODE=1 if gemm_only else 0, MULTIMEM=multimem,
                      ALIGNED=True, REDUCE_ROWS=min(config.reduce_rows, config.block_m),
                      DEFER=config.defer_release, SCOPE="sys", PUSH=config.push and not multimem,
                      TMA_PUSH=config.tma_push and tma)
    if not tma:
        constexprs.update(a_desc=None, b_desc=None)
    signature = _fused_signature(tma, transposed, config, dtype)
    if not constexprs["TMA_PUSH"]:
        constexprs.update({f"P{i}": None for i in range(8)})
    return compile_for_target(
        gemm_rs.gemm_reduce_scatter_kernel, signature, constexprs,
        divisible_by_16=["a_ptr", "b_ptr", "part_ptr", "out_ptr", "N", "K", "stride_am", "stride_bk"],
        num_warps=config.warps, num_stages=config.stages)


def _compile_pipelined_fused(transposed, gemm_only):
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    from axedist.kernels import gemm_gluon, gemm_rs
    config = gemm_rs.GemmConfig(pipelined=True)
    constexprs = dict(WORLD=4, BM=config.block_m, BN=config.block_n, BK=config.block_k,
                      GROUP_M=config.group_m, STAGES=config.stages, USE_TMA=True,
                      B_TRANSPOSED=transposed, MODE=1 if gemm_only else 0, MULTIMEM=False,
                      ALIGNED=True, REDUCE_ROWS=config.reduce_rows, DEFER=False, SCOPE="sys",
                      PUSH=False, TMA_PUSH=False, **{f"P{i}": None for i in range(1, 8)})
    signature = _fused_signature(True, transposed, config)
    blocks = {"a_desc": [config.block_m, config.block_k],
              "b_desc": [config.block_n, config.block_k] if transposed else [config.block_k, config.block_n],
              "P0": [config.block_m, config.block_n // gemm_gluon.EPILOGUE_SPLIT]}
    for name, block in blocks.items():
        signature[name] = _gluon_descriptor(block)
    kernel = gemm_rs.pipelined_gemm_reduce_scatter_kernel
    signature.update({name: "constexpr" for name in constexprs})
    signature = {name: signature[name] for name in kernel.arg_names}
    divisible = ["a_ptr", "b_ptr", "part_ptr", "out_ptr", "N", "K", "stride_am", "stride_bk"]
    source = GluonASTSource(fn=kernel, signature=signature,
                            constexprs={(kernel.arg_names.index(k),): v for k, v in constexprs.items()},
                            attrs={(kernel.arg_names.index(n),): [["tt.divisibility", 16]] for n in divisible})
    return triton.compile(source, target=GPUTarget("cuda", 90, 32), options={"num_warps": config.warps})


@pytest.mark.parametrize("transposed", [False, True])
@pytest.mark.parametrize("gemm_only", [False, True])
def test_pipelined_fused_kernel_compiles_for_sm90a(transposed, gemm_only):
    """The Gluon GEMM + reduce-scatter kernel (/gl, pull): wgmma with one group in flight, TMA
    loads and stores, 16-byte peer loads in its reduce tasks, system-scope acquire / release,
    no spills, within 227 KB of shared memory."""
    _need_triton()
    kernel = _compile_pipelined_fused(transposed, gemm_only)
    ptx = kernel.asm["ptx"]
    assert "wgmma.wait_group.sync.aligned 1" in ptx and "cp.async.bulk.tensor.2d.global.shared" in ptx
    assert "ld.acquire.sys" in ptx and "cp.async.bulk.wait_group 0" in ptx
    assert ("st.release.sys" in ptx) != gemm_only     # GEMM_ONLY releases no flag
    assert re.search(r"ld\.global(\.\w+)*\.v4", ptx)
    assert ".local" not in ptx and kernel.metadata.shared <= 227 * 1024


@pytest.mark.parametrize("transposed", [False, True])
def test_fused_kernel_uses_tma_and_wgmma_on_sm90a(transposed):
    _need_triton()
    ptx = _compile_fused(transposed=transposed).asm["ptx"]
    assert "wgmma.mma_async" in ptx
    assert "cp.async.bulk.tensor" in ptx
    assert "ld.acquire.sys" in ptx and "st.release.sys" in ptx and "atom.global" in ptx
    assert "multimem" not in ptx


@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
def test_fused_kernel_multimem_variant_ptx_for_sm90a(dtype):
    _need_triton()
    kernel = _compile_fused(multimem=True, dtype=dtype)
    ptx = kernel.asm["ptx"]
    suffix = "bf16x2" if dtype == "bf16" else "f16x2"
    assert f"multimem.ld_reduce.relaxed.sys.global.add.acc::f32.v4.{suffix}" in ptx
    assert len(kernel.asm["cubin"]) > 0


def _compile_engine_rs(tma=True, transposed=False, trace=False):
    from axedist.kernels import gemm_rs
    from axedist.kernels.compile_check import compile_for_target
    c = gemm_rs.GemmConfig(engine=True)
    signature = {}
    if tma:
        signature["a_desc"] = f"tensordesc<bf16[{c.block_m}, {c.block_k}]>"
    signature["a_ptr"] = "*bf16"
    if tma:
        signature["b_desc"] = (f"tensordesc<bf16[{c.block_n}, {c.block_k}]>" if transposed
                               else f"tensordesc<bf16[{c.block_k}, {c.block_n}]>")
    signature.update(b_ptr="*bf16", staging_ptr="*bf16", out_ptr="*bf16", incoming_address="i64",
                     own_flags="i64", out_flags="i64", counts_ptr="*i32", state_ptr="*i32",
                     abort_ptr="*i32", error_address="i64", timeout_ns="i64", M="i32", N="i32",
                     K="i32", M_CHUNK="i32", stride_am="i32", stride_ak="i32", stride_bk="i32",
                     stride_bn="i32", engine_flag0="i32", band_tiles="i32", rank="i32",
                     half_bytes="i64", trace_ptr="*i64")
    constexprs = dict(WORLD=2, BM=c.block_m, BN=c.block_n, BK=c.block_k, GROUP_M=c.group_m,
                      STAGES=c.stages, USE_TMA=tma, B_TRANSPOSED=transposed,
                      ENGINE_CHUNKS=64, PHASES=3, TRACE=trace)
    if not tma:
        constexprs.update(a_desc=None, b_desc=None)
    return compile_for_target(gemm_rs.engine_gemm_reduce_scatter_kernel, signature, constexprs,
                              divisible_by_16=["a_ptr", "b_ptr", "staging_ptr", "out_ptr", "N", "K",
                                               "stride_am", "state_ptr"],
                              num_warps=c.warps, num_stages=c.stages)


@pytest.mark.parametrize("transposed", [False, True])
def test_copy_engine_gemm_reduce_scatter_compiles_for_sm90a(transposed):
    """/ce: TMA + wgmma tiles, no remote store and no remote load (the copy engine moves the
    partials), a system-scope fence and one release per finished comm chunk, bounded acquire
    waits for the peers' chunks, within Hopper's shared memory; the pointer path compiles too."""
    _need_triton()
    kernel = _compile_engine_rs(transposed=transposed)
    ptx = kernel.asm["ptx"]
    assert "wgmma.mma_async" in ptx and "cp.async.bulk.tensor.2d.shared" in ptx
    assert "fence.acq_rel.sys" in ptx and ptx.count("st.release.sys.global.b32") == 1
    assert "ld.acquire.sys.global.b32" in ptx and "%globaltimer" in ptx
    assert "atom.global.gpu.acq_rel.add" in ptx or "atom.acq_rel.gpu.global.add" in ptx, \
        [line for line in ptx.splitlines() if "atom" in line][:4]
    assert "multimem" not in ptx and ".local" not in ptx
    assert kernel.metadata.shared <= 227 * 1024
    assert "wgmma" in _compile_engine_rs(tma=False).asm["ptx"]
    assert "%clock64" not in ptx


def test_copy_engine_gemm_reduce_scatter_traces_and_does_not_spill():
    """TRACE: the timer, cycle counter and SM id (probes only). The shipped kernel and the
    traced one keep everything in registers: the own tile's epilogue once had the fp32 tile and
    a loaded partial live at once (352 bytes of spills at 255 registers, 1.2x GEMM-only time)."""
    _need_triton()
    shipped = _compile_engine_rs()
    assert "%clock64" not in shipped.asm["ptx"]
    traced = _compile_engine_rs(trace=True)
    assert "%clock64" in traced.asm["ptx"] and "%smid" in traced.asm["ptx"]
    for kernel in (shipped, traced, _compile_engine_rs(transposed=True)):
        assert _spill_bytes(kernel) == 0


def _compile_pipelined_engine_rs(transposed=False, stages=3, world=2, trace=False, count_step=0,
                                  partial_ahead=None):
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    from axedist.kernels import gemm_gluon, gemm_rs
    c = gemm_rs.GemmConfig(stages=stages, pipelined=True, engine=True)
    partial_ahead = gemm_rs.ENGINE_PARTIAL_AHEAD if partial_ahead is None else partial_ahead
    tile = [c.block_m, c.block_n // gemm_gluon.EPILOGUE_SPLIT]
    blocks = {"a_desc": [c.block_m, c.block_k],
              "b_desc": [c.block_n, c.block_k] if transposed else [c.block_k, c.block_n],
              "staging_desc": tile, "out_desc": tile, "incoming0_desc": tile, "incoming1_desc": tile}
    signature = {name: _gluon_descriptor(block) for name, block in blocks.items()}
    signature.update(a_ptr="*bf16", b_ptr="*bf16", incoming_address="i64", own_flags="i64",
                     out_flags="i64", counts_ptr="*i32", state_ptr="*i32", abort_ptr="*i32",
                     error_address="i64", timeout_ns="i64", M="i32", N="i32", K="i32",
                     M_CHUNK="i32", stride_am="i32", stride_ak="i32", stride_bk="i32",
                     stride_bn="i32", engine_flag0="i32", band_tiles="i32", rank="i32",
                     half_bytes="i64", trace_ptr="*i64")
    constexprs = dict(WORLD=world, BM=c.block_m, BN=c.block_n, BK=c.block_k, GROUP_M=c.group_m,
                      STAGES=c.stages, USE_TMA=True, B_TRANSPOSED=transposed, ENGINE_CHUNKS=64,
                      PHASES=3, TRACE=trace, COUNT_STEP=count_step, PARTIAL_AHEAD=partial_ahead)
    kernel = gemm_rs.pipelined_engine_gemm_reduce_scatter_kernel
    signature.update({name: "constexpr" for name in constexprs})
    signature = {name: signature[name] for name in kernel.arg_names}
    divisible = ["a_ptr", "b_ptr", "N", "K", "stride_am", "state_ptr"]
    source = GluonASTSource(fn=kernel, signature=signature,
                            constexprs={(kernel.arg_names.index(k),): v for k, v in constexprs.items()},
                            attrs={(kernel.arg_names.index(n),): [["tt.divisibility", 16]] for n in divisible})
    return triton.compile(source, target=GPUTarget("cuda", 90, 32), options={"num_warps": c.warps})


@pytest.mark.parametrize("transposed,stages,world", [(False, 3, 2), (True, 4, 2), (False, 4, 4)])
def test_gluon_copy_engine_gemm_reduce_scatter_compiles_for_sm90a(transposed, stages, world):
    """/gl/ce: wgmma with one group in flight, TMA loads and stores (staging and output), no
    remote access (the copy engine moves the partials), a completed-stores wait, system fence
    and release per finished comm chunk, bounded acquire waits for the peers' chunks, no
    spills, within Hopper's 227 KB of shared memory at 3 and 4 stages."""
    _need_triton()
    kernel = _compile_pipelined_engine_rs(transposed, stages, world)
    ptx = kernel.asm["ptx"]
    assert "wgmma.wait_group.sync.aligned 1" in ptx and "cp.async.bulk.tensor.2d.shared" in ptx
    assert "cp.async.bulk.tensor.2d.global.shared" in ptx and "cp.async.bulk.wait_group 0" in ptx
    assert "fence.acq_rel.sys" in ptx and "st.release.sys.global.b32" in ptx
    assert "ld.acquire.sys.global.b32" in ptx and "%globaltimer" in ptx
    assert "atom.global.gpu.acq_rel.add" in ptx or "atom.acq_rel.gpu.global.add" in ptx
    assert "cp.async.bulk.tensor.2d.shared::cluster.global" in ptx  # the peers' partials, by TMA
    assert "fence.proxy.async" in ptx and "ld.global.b32" not in ptx
    assert "multimem" not in ptx and ".local" not in ptx and "%clock64" not in ptx
    assert kernel.metadata.shared <= 227 * 1024 and _spill_bytes(kernel) == 0


def test_gluon_copy_engine_traces_without_spilling():
    """TRACE (probes only): the timer, cycle counter and SM id, everything still in registers;
    a later count step compiles alike. An own tile's first partial loaded in its main loop
    (PARTIAL_AHEAD >= 0) awaits a flag and issues a load there: at W = 4 one wait more (its
    first acquire load and its spin's) and one TMA load more than after the loop (-1) in each
    of the tile's two K loops (this tile's loads, then the next tile's), whose probe build also
    fits without spills."""
    _need_triton()
    traced = _compile_pipelined_engine_rs(world=4, trace=True, count_step=8)
    assert "%clock64" in traced.asm["ptx"] and "%smid" in traced.asm["ptx"]
    assert _spill_bytes(traced) == 0
    early, late = (_compile_pipelined_engine_rs(stages=4, world=4, partial_ahead=a) for a in (1, -1))
    for name, more in (("ld.acquire.sys", 4), ("cp.async.bulk.tensor.2d.shared::cluster.global", 2)):
        assert early.asm["ptx"].count(name) == late.asm["ptx"].count(name) + more, name
    assert _spill_bytes(late) == 0 and late.metadata.shared <= 227 * 1024


def test_gluon_copy_engine_runs_where_tma_and_whole_tiles_allow():
    """engine_pipelined_fits: whole row tiles, TMA-describable operands and output, stages - 1
    K blocks; a config without /gl never."""
    from axedist.kernels import gemm_rs
    config = gemm_rs.GemmConfig(stages=4, pipelined=True, engine=True)

    def fits(m, n, k, world=2, config=config, out=None):
        ops = gemm_rs.prepare_operands(torch.zeros(m, k, dtype=torch.bfloat16),
                                       torch.zeros(k, n, dtype=torch.bfloat16))
        out = torch.zeros(m // world, n, dtype=torch.bfloat16) if out is None else out
        return gemm_rs.engine_pipelined_fits(ops, config, world, out)

    assert fits(512, 768, 384) and fits(1024, 512, 192, world=4)
    assert not fits(514, 768, 384)                       # 257 rows a chunk
    assert not fits(512, 300, 384)                       # rows of 600 bytes
    assert fits(512, 1000, 384)                          # a tail of tile columns
    assert not fits(512, 768, 128)                       # 2 K blocks, 3 loads ahead
    assert not fits(512, 768, 384, config=gemm_rs.GemmConfig(engine=True))
    assert not fits(512, 768, 384, out=torch.zeros(256, 769, dtype=torch.bfloat16)[:, 1:])


def test_copy_engine_trace_of_the_wrong_type_or_size_is_refused():
    """A trace the kernel would write past (too few rows), in the wrong type or not contiguous
    raises before anything is allocated or compiled."""
    from axedist.kernels import gemm_rs

    class Workspace:
        data_bytes = 1 << 30

    ops = gemm_rs.prepare_operands(torch.zeros(256, 64, dtype=torch.bfloat16),
                                   torch.zeros(64, 512, dtype=torch.bfloat16))
    config = gemm_rs.GemmConfig(engine=True)  # 128 x 256 tiles: W = 2 x 1 x 2 = 4 tasks
    for trace in (torch.zeros(4, 6, dtype=torch.int32), torch.zeros(3, 6, dtype=torch.int64),
                  torch.zeros(6, 4, dtype=torch.int64).t()):
        with pytest.raises(ValueError, match=r"trace: a contiguous int64 tensor of at least \[4, 6\]"):
            gemm_rs.EngineReduceScatter(ops, None, config, 2, 0, Workspace(), trace=trace)


def _spill_bytes(kernel) -> int:
    """Bytes of spill stores ptxas reports for a compiled kernel's PTX (sm_90a)."""
    import re
    import subprocess
    import tempfile
    from triton.backends.nvidia.compiler import get_ptxas
    with tempfile.NamedTemporaryFile("w", suffix=".ptx") as handle:
        handle.write(kernel.asm["ptx"])
        handle.flush()
        report = subprocess.run([get_ptxas(90).path, "-v", "-arch=sm_90a", handle.name, "-o", "/dev/null"],
                                capture_output=True, text=True, check=True).stderr
    return sum(int(n) for n in re.findall(r"(\d+) bytes spill stores", report))


def _wgmma_loops(kernel) -> list[list[str]]:
    """The SASS instructions of the innermost loops of a compiled sm_90a kernel that issue
    wgmma (HGMMA), a loop being the range from a conditional backward branch's target to it
    (nvdisasm, bundled with Triton)."""
    import tempfile
    from triton import knobs
    with tempfile.NamedTemporaryFile(suffix=".cubin") as handle:
        handle.write(kernel.asm["cubin"])
        handle.flush()
        sass = subprocess.run([knobs.nvidia.nvdisasm.path, "-c", handle.name], capture_output=True,
                              text=True, check=True).stdout
    code, labels, pending = [], {}, []
    for line in sass.splitlines():
        label = re.match(r"\s*(\.L_x_\d+):", line)
        if label:
            pending.append(label.group(1))
        found = re.search(r"/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;", line)
        if found:
            for name in pending:
                labels[name] = len(code)
            pending = []
            code.append(found.group(2))
    spans = []
    for index, instruction in enumerate(code):
        # (a conditional branch: the unconditional ones back are the returns of the slow
        # paths of barrier waits, placed after the kernel's end)
        target = re.match(r"@!?U?P\d\s+BRA\s.*`\((\.L_x_\d+)\)", instruction)
        if target and labels.get(target.group(1), index + 1) <= index:
            if any("HGMMA" in op for op in code[labels[target.group(1)]:index + 1]):
                spans.append((labels[target.group(1)], index + 1))
    # the innermost ones: the K loops, not the task loops around them
    return [code[b:e] for b, e in spans
            if not any(b <= b2 and e2 <= e and (b2, e2) != (b, e) for b2, e2 in spans)]


def test_wgmma_loops_of_the_gluon_kernels_never_touch_local_memory():
    """ptxas may spill a few long-lived values of the Gluon fused kernels (the call's state,
    kept across the task loop), but nothing inside an innermost loop that issues wgmma (a K
    loop): a spill there costs every K step. Each kernel has such loops, and in each the step
    from the wgmma's wait(1) to the next TMA load has few instructions (4-5; 28 in the opt-in
    stream-K tail's). Before the two-loop tile (a tile's loads, then the next tile's) the
    all-gather + GEMM's K loop had about 330 in program order (70 on the path taken, the next
    tile decoded in it) and the GEMM + RS kernels' 120-140."""
    _need_triton()
    from axedist.kernels.gemm import GemmCoreConfig
    kernels = {"core": _compile_pipelined(GemmCoreConfig.parse("128x256x64/g8/s4/w8/gl/k1"), True),
               "ag /gl/ce W=2": _compile_pipelined_ag(False, world=2, engine=True),
               "ag /gl/ce W=4 copy-out": _compile_pipelined_ag(True, world=4, copy_out=True,
                                                               engine=True),
               "ag /gl W=1": _compile_pipelined_ag(True, world=1),
               "rs /gl/ce W=4": _compile_pipelined_engine_rs(transposed=True, stages=4, world=4),
               "rs /gl GEMM-only": _compile_pipelined_fused(True, True),
               "rs /gl": _compile_pipelined_fused(False, False)}
    for name, kernel in kernels.items():
        loops = _wgmma_loops(kernel)
        assert loops, name
        for body in loops:
            assert not [op for op in body if re.search(r"\b(LDL|STL)\b", op)], (name, body)
    for name, kernel in kernels.items():
        for body in _wgmma_loops(kernel):
            waits = [i for i, op in enumerate(body) if "DEPBAR.LE gsb0, 0x1" in op]
            loads = [i for i, op in enumerate(body) if "UTMALDG" in op]
            assert waits and loads and loads[0] - waits[0] <= 30, (name, body)


def test_every_candidate_config_compiles_with_pointer_fallback_too():
    _need_triton()
    from axedist.kernels import gemm_rs
    for config in gemm_rs.CANDIDATES:
        assert "wgmma" in _compile_fused(config=config).asm["ptx"], config
    assert "wgmma" in _compile_fused(tma=False).asm["ptx"]


# -- gating and host-side logic ----------------------------------------------------------------

def test_multimem_needs_opt_in_and_device_support(monkeypatch):
    from axedist.collectives import backend
    backend.device_supports_multicast.cache_clear()
    asked = []
    monkeypatch.setattr(backend, "query_multicast_attribute", lambda index: asked.append(index) or True)
    monkeypatch.delenv("AXEDIST_ENABLE_MULTICAST", raising=False)
    assert backend.multimem_allowed(0, 1) == (False, "AXEDIST_ENABLE_MULTICAST=1 is not set")
    assert asked == []  # without the opt-in the driver is not even asked
    monkeypatch.setenv("AXEDIST_ENABLE_MULTICAST", "0")
    assert not backend.multimem_allowed(0, 1)[0]
    monkeypatch.setenv("AXEDIST_ENABLE_MULTICAST", "1")
    assert backend.multimem_allowed(0, 1)[0]
    assert not backend.multimem_allowed(0, 0)[0]  # no multicast mapping in the workspace
    backend.device_supports_multicast.cache_clear()
    monkeypatch.setattr(backend, "query_multicast_attribute", lambda index: False)
    allowed, reason = backend.multimem_allowed(0, 1)
    assert not allowed and "does not report multicast support" in reason
    backend.device_supports_multicast.cache_clear()


def test_multicast_query_without_cuda_python_is_false(monkeypatch):
    from axedist.collectives import backend
    import builtins
    real_import = builtins.__import__

    def no_cuda(name, *args, **kwargs):
        if name == "cuda" or name.startswith("cuda."):
            raise ImportError("no cuda-python")
        return real_import(name, *args, **kwargs)
    monkeypatch.setattr(builtins, "__import__", no_cuda)
    assert backend.query_multicast_attribute(0) is False


def test_measured_table_and_backend_names():
    from axedist.collectives import backend
    assert backend.measured_choice("reduce_scatter", 1 << 20) in ("p2p", "torch")
    with pytest.raises(ValueError, match="backend must be one of"):
        backend.select_backend("reduce_scatter", torch.ones(4), None, "nccl")
    assert backend.select_backend("reduce_scatter", torch.ones(4), None, "torch") == "torch"


def test_p2p_geometry_variants_and_input_errors():
    from axedist.collectives import p2p
    # reduce-scatter of 4 x 1001 elements: chunks padded to 1008 in the workspace, no zero-copy
    rs = p2p.call_geometry("reduce_scatter", (4 * 1001,), 4)
    assert (rs["chunk"], rs["stride"], rs["elements"], rs["zero_copy_elements"]) == (1001, 1008, 4032, -1)
    # two-shot all-reduce of 10 elements on 4 ranks: chunks of 16, push slots + gathered chunks
    ar = p2p.call_geometry("all_reduce_two_shot", (10,), 4)
    assert (ar["stride"], ar["work"], ar["elements"]) == (16, 16, 128)
    assert p2p.choose_variant("all_gather", 1 << 20, "pull") == "pull"
    assert p2p.choose_variant("all_gather", 1 << 20, "auto") in ("push", "pull")
    with pytest.raises(ValueError, match="variant must be one of"):
        p2p.choose_variant("all_gather", 1, "multicast")
    with pytest.raises(ValueError, match="must be on a CUDA device"):
        p2p.reduce_scatter(torch.ones(8))
    with pytest.raises(ValueError, match="all_reduce: tensor must be on a CUDA device"):
        p2p.all_reduce(torch.ones(8, dtype=torch.int64), algorithm="two_shot")
    assert p2p.divisible_arguments("all_gather", 1001, aligned=False) == ["state_ptr", "abort_ptr", "chunk_stride"]


def _benchmark(name: str = "bench_collectives"):
    """benchmarks/<name>.py loaded as a module (the benchmarks are scripts, not a package)."""
    import importlib.util
    spec = importlib.util.spec_from_file_location(name, os.path.join(ROOT, "benchmarks", f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_auto_tables_follow_the_benchmark_rows(tmp_path):
    """Synthetic benchmark rows (ms) -> the tables backend.TUNED loads: p2p only where it beat
    NCCL, the faster variant per size, one-shot while it beats two-shot."""
    from axedist.collectives import backend
    bench = _benchmark()
    small, large = 64 << 10, 64 << 20
    rows = [dict(bytes=small, world=4, rs_nccl=0.030, rs_push=0.010, rs_pull=0.012,
                 ag_nccl=0.030, ag_push=0.040, ag_pull=0.035, ar_nccl=0.040, ar1_push=0.015,
                 ar1_pull=0.020, ar2_push=0.030, ar2_pull=0.025),
            dict(bytes=large, world=4, rs_nccl=0.20, rs_push=0.25, rs_pull=0.18,
                 ag_nccl=0.20, ag_push=0.19, ag_pull=0.21, ar_nccl=0.35, ar1_push=None,
                 ar1_pull=None, ar2_push=0.40, ar2_pull=0.36)]
    tables = bench.tuned_tables(rows, 4, "synthetic")
    assert tables["backend"]["reduce_scatter"] == [[1 << 40, "p2p"]]  # one run: merged
    assert tables["backend"]["all_gather"] == [[small // 4, "torch"], [1 << 40, "p2p"]]
    assert tables["backend"]["all_reduce"] == [[small, "p2p"], [1 << 40, "torch"]]
    assert tables["variant"]["reduce_scatter"] == [[small, "push"], [1 << 40, "pull"]]
    assert tables["variant"]["all_reduce_two_shot"] == [[1 << 40, "pull"]]
    assert tables["one_shot_all_reduce_max_bytes"] == small
    results = tmp_path / "collectives_w4.json"
    results.write_text(json.dumps(dict(meta=dict(machine="m", commit="c", date="d", command="x"),
                                       rows=rows)))
    target = tmp_path / "tuned.json"
    bench.write_tuned(str(results), str(target))
    loaded = backend.load_tuned(str(target))
    assert loaded["backend"]["all_gather"] == [(small // 4, "torch"), (1 << 40, "p2p")]
    assert "commit c" in loaded["source"]


def test_shipped_tables_are_well_formed():
    from axedist.collectives import backend, p2p
    for table, choices in ((backend.MEASURED_CHOICE, {"p2p", "torch"}),
                           (p2p.MEASURED_VARIANT, {"push", "pull"})):
        for rows in table.values():
            limits = [limit for limit, _ in rows]
            assert limits == sorted(limits) and limits[-1] >= 1 << 40
            assert {choice for _, choice in rows} <= choices
    assert set(p2p.MEASURED_VARIANT) == set(COLLECTIVE_OPS)


def test_workspace_regions_are_disjoint_and_kernels_address_local_data():
    """The layout every workspace gets (torch's symmetric memory or carved for virtual ranks):
    flags, two barrier regions and two data halves tile the rank's bytes without gaps; every
    rank's copy sees the same address tables; what the kernels address is local_data."""
    from axedist.collectives.symmetric import (BARRIER_BYTES, FLAG_BYTES, carve_workspaces,
                                               workspace_bytes)
    data_bytes = 1 << 12
    spaces = carve_workspaces(3, data_bytes, torch.device("cpu"))
    for rank, workspace in enumerate(spaces):
        base = workspace.tensor.data_ptr()
        assert workspace.tensor.numel() == workspace_bytes(data_bytes) and workspace.rank == rank
        regions = [(workspace.flag_addresses()[rank], FLAG_BYTES)]
        regions += [(workspace.barrier_addresses(parity)[rank], BARRIER_BYTES // 2) for parity in (0, 1)]
        regions += [(workspace.data_addresses(half)[rank], data_bytes) for half in (0, 1)]
        spans = sorted((start - base, start - base + size) for start, size in regions)
        assert spans[0][0] == 0 and spans[-1][1] == workspace.tensor.numel()
        assert all(a[1] == b[0] for a, b in zip(spans, spans[1:]))  # disjoint, no gaps
        for half in (0, 1):  # what the kernels address is what the host writes (zero-copy)
            assert workspace.data_addresses(half)[rank] == workspace.local_data(half, torch.bfloat16, 8).data_ptr()
            assert workspace.data_addresses(half) == spaces[0].data_addresses(half)
            view = spaces[0].peer_data(rank, half, torch.bfloat16, 8)
            assert view.data_ptr() == workspace.data_addresses(half)[rank]
        assert workspace.flag_addresses() == spaces[0].flag_addresses()
        assert len(workspace.flag_addresses()) == 8 and workspace.flag_addresses()[3:] == [spaces[0].flag_addresses()[0]] * 5
    starts = [w.tensor.data_ptr() for w in spaces]
    assert all(b - a >= workspace_bytes(data_bytes) and b % 4096 == 0 for a, b in zip(starts, starts[1:]))


def test_error_record_round_trip():
    from axedist.collectives.symmetric import decode_error_record
    record = (1 << 56) | (3 << 40) | ((70000 & 0xFFFF) << 24) | 12345
    assert decode_error_record(record) == (1, 3, 12345, 70000 & 0xFFFF)


def test_prepare_operands_detects_linear_weight_orientation():
    _need_triton()
    from axedist.kernels import gemm_rs
    a = torch.randn(64, 32)
    weight = torch.randn(48, 32)  # nn.Linear stores [N, K]
    ops = gemm_rs.prepare_operands(a, weight.t())
    assert ops.b_transposed and ops.b.shape == (48, 32) and (ops.m, ops.n, ops.k) == (64, 48, 32)
    ops = gemm_rs.prepare_operands(a, torch.randn(32, 48))
    assert not ops.b_transposed and ops.b.shape == (32, 48)
    strided = torch.randn(32, 96)[:, ::2]
    ops = gemm_rs.prepare_operands(a, strided)
    assert ops.b.is_contiguous() and not ops.b_transposed
    assert gemm_rs.default_config(8192, 8192, 2048, 4, torch.bfloat16) == gemm_rs.default_config(8192, 8192, 2048, 4, torch.bfloat16)


def _plan_body(rank, world):
    from axedist.collectives import plan_gemm_reduce_scatter
    a = torch.randn(world * 4, 16, dtype=torch.bfloat16)
    b = torch.randn(16, 8, dtype=torch.bfloat16)
    results = {"plan": str(plan_gemm_reduce_scatter(a, b, None))}
    for name, (x, y) in {"m": (a[:world * 4 - 1], b), "k": (a, b[:8]), "dtype": (a.float(), b.float()),
                         "mixed": (a, b.half())}.items():
        try:
            plan_gemm_reduce_scatter(x, y, None)
            results[name] = None
        except ValueError as error:
            results[name] = str(error)
    try:
        plan_gemm_reduce_scatter(a, b, None, backend="p2p")
        results["p2p_on_cpu"] = None
    except ValueError as error:
        results["p2p_on_cpu"] = str(error)
    return results


def test_plan_and_validation_on_cpu_ranks():
    from axedist.testing import run_on_ranks
    results = run_on_ranks(_plan_body, 2, "gloo", timeout_s=120)[0]
    assert "torch" in results["plan"] and "not on a CUDA device" in results["plan"]
    assert "not divisible by the group size 2" in results["m"] and "(7, 8)" in results["m"]
    assert "inner dimensions" in results["k"]
    assert "bf16 or fp16" in results["dtype"]
    assert "torch.bfloat16" in results["mixed"]
    assert "cannot run" in results["p2p_on_cpu"]


# -- layering ----------------------------------------------------------------------------------

def test_import_without_triton():
    script = textwrap.dedent("""
        import sys, importlib.abc
        class Block(importlib.abc.MetaPathFinder):
            def find_spec(self, name, path=None, target=None):
                if name == "triton" or name.startswith("triton."):
                    raise ModuleNotFoundError(f"No module named {name!r} (blocked)")
                return None
        sys.meta_path.insert(0, Block())
        import axedist, axedist.collectives, axedist.kernels, axedist.kernels.schedule
        from axedist.collectives import gemm_reduce_scatter, reduce_scatter
        assert not any(m == "triton" or m.startswith("triton.") for m in sys.modules)
        print("OK")
    """)
    env = dict(os.environ, PYTHONPATH=ROOT)
    result = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0 and "OK" in result.stdout, result.stdout + result.stderr


def test_kernels_never_import_dtensor():
    kernels = os.path.join(ROOT, "axedist", "kernels")
    for name in os.listdir(kernels):
        if name.endswith(".py"):
            with open(os.path.join(kernels, name)) as handle:
                source = handle.read()
            assert "dtensor" not in source.lower().replace("never import dtensor", ""), name


def test_deferred_release_variant_compiles_and_still_releases_system_scope():
    _need_triton()
    from axedist.kernels import gemm_rs
    ptx = _compile_fused(config=gemm_rs.GemmConfig(defer_release=True)).asm["ptx"]
    assert "st.release.sys.global.b32" in ptx and "st.release.gpu" not in ptx


def test_push_variant_compiles_with_remote_tile_stores_and_local_flag_waits():
    _need_triton()
    from axedist.kernels import gemm_rs
    ptx = _compile_fused(config=gemm_rs.GemmConfig(push=True)).asm["ptx"]
    assert "wgmma.mma_async" in ptx and "st.release.sys.global.b32" in ptx
    assert "ld.acquire.sys.global.b32" in ptx and "multimem" not in ptx
    assert ptx.count("st.global.v4") >= 8  # 16-byte stores of the tile into the owner's slot


def test_push_with_deferred_release_compiles_and_releases_system_scope():
    _need_triton()
    from axedist.kernels import gemm_rs
    ptx = _compile_fused(config=gemm_rs.GemmConfig(push=True, defer_release=True)).asm["ptx"]
    assert "st.release.sys.global.b32" in ptx and "ld.acquire.sys.global.b32" in ptx
    assert ptx.count("st.global.v4") >= 8


def test_tma_push_variant_stores_tiles_asynchronously_and_waits_before_each_release():
    _need_triton()
    from axedist.kernels import gemm_rs
    for config in gemm_rs.TMA_PUSH_CONFIGS:
        kernel = _compile_fused(config=config)
        ptx = kernel.asm["ptx"]
        assert "cp.async.bulk.tensor.2d.global.shared::cta" in ptx, config   # the TMA tile stores
        assert "cp.async.bulk.wait_group 0" in ptx and "st.release.sys.global.b32" in ptx
        assert kernel.metadata.shared <= 227 * 1024, (config, kernel.metadata.shared)


def test_launch_cache_key_separates_every_specialization():
    """The compiled-launcher cache must never reuse a kernel compiled for other sizes, strides,
    pointer alignment or timeout width (Triton would have compiled another one)."""
    from axedist.kernels import gemm_rs
    a = torch.zeros(64, 32, dtype=torch.bfloat16)
    b = torch.zeros(32, 48, dtype=torch.bfloat16)
    ops = gemm_rs.prepare_operands(a, b)
    part = torch.zeros(64 * 48 + 8, dtype=torch.bfloat16)

    def key(ops=ops, tensors=(part,), timeout=30 * 10**9, constexprs=(4,)):
        return gemm_rs.specialization_key(ops, gemm_rs.operand_strides(ops), tensors, timeout, constexprs, 8, 0)
    assert key() == key()
    assert key(tensors=(part[1:],)) != key()              # pointer no longer 16-byte aligned
    assert key(timeout=10**9) != key()                    # compiled as i32 instead of i64
    assert key(constexprs=(2,)) != key()
    assert key(ops=gemm_rs.prepare_operands(a, b.t().contiguous().t())) != key()  # B^T layout
    assert key(ops=gemm_rs.prepare_operands(a[:, :16], b[:16])) != key()        # K and strides


def test_cached_tma_descriptors_describe_the_same_memory_without_holding_it():
    _need_triton()
    import gc
    import weakref

    from axedist.kernels import gemm_rs
    a = torch.randn(256, 128).to(torch.bfloat16)
    fresh = gemm_rs.descriptor(a, [128, 64], cached=False)
    cached = gemm_rs.descriptor(a, [128, 64], cached=True)
    assert gemm_rs.descriptor(a, [128, 64], cached=True) is cached      # a hit
    assert cached.base.data_ptr() == fresh.base.data_ptr() == a.data_ptr()
    assert (list(cached.shape), list(cached.strides), list(cached.block_shape)) == \
        (list(fresh.shape), list(fresh.strides), list(fresh.block_shape))
    assert gemm_rs.descriptor(a, [64, 64], cached=True) is not cached   # block is in the key
    del fresh
    alive = weakref.ref(a)
    del a
    gc.collect()
    assert alive() is None   # the cache did not keep the tensor


def test_replay_slots_match_the_kernel_signature():
    """Replay fills operands and output by position: the positions must be those of the
    kernel's parameters (runtime ones come first, constexprs last)."""
    _need_triton()
    from axedist.kernels import gemm_rs
    names = gemm_rs.gemm_reduce_scatter_kernel.arg_names
    runtime = [name for name in names if name not in gemm_rs.gemm_reduce_scatter_kernel.constexprs_names] \
        if hasattr(gemm_rs.gemm_reduce_scatter_kernel, "constexprs_names") else names[:names.index("WORLD")]
    replay = gemm_rs.Replay
    assert runtime[replay._A_DESC] == "a_desc" and runtime[replay._A] == "a_ptr"
    assert runtime[replay._B_DESC] == "b_desc" and runtime[replay._B] == "b_ptr"
    assert runtime[replay._OUT] == "out_ptr"
    assert "epoch" not in runtime and "task_base" not in runtime   # both live on the device
    assert all(names.index(n) > names.index("push_rows") for n in ("WORLD", "PUSH", "TMA_PUSH"))


def test_replay_fills_only_the_per_call_slots(monkeypatch):
    _need_triton()
    from axedist.kernels import gemm_rs
    calls = []
    monkeypatch.setattr(torch._C, "_cuda_getCurrentRawStream", lambda index: 7, raising=False)
    a, b = torch.randn(64, 32).to(torch.bfloat16), torch.randn(32, 48).to(torch.bfloat16)
    ops = gemm_rs.prepare_operands(a, b)
    names = gemm_rs.gemm_reduce_scatter_kernel.arg_names
    template = tuple(range(names.index("push_rows") + 1))     # slot i holds i
    replay = gemm_rs.Replay(lambda grid, stream, args: calls.append((grid, stream, args)), 5,
                            template, True, gemm_rs.GemmConfig(), False, 30 * 10**9, 0)
    out = torch.empty(16, 48, dtype=torch.bfloat16)
    replay(ops, out)
    grid, stream, args = calls[0]
    assert (grid, stream) == (5, 7)
    changed = {i for i, value in enumerate(args) if value != template[i]}
    assert changed == {0, 1, 2, 3, 5}
    assert args[1] == ops.a.data_ptr() and args[3] == ops.b.data_ptr() and args[5] == out.data_ptr()
    assert args[0].base.data_ptr() == ops.a.data_ptr() and list(args[2].block_shape) == [64, 256]


def test_a_prepared_launch_keeps_no_operand_alive(monkeypatch):
    """The first call's TMA descriptors hold its operands: a Replay must not keep them (it did:
    each fused shape's first A, an activation gradient, stayed allocated for good, about 1.1 GiB
    per rank in the TP=4 Llama-3-8B step)."""
    _need_triton()
    import gc
    import weakref

    from triton.tools.tensor_descriptor import TensorDescriptor

    from axedist.kernels import gemm_rs
    monkeypatch.setattr(torch._C, "_cuda_getCurrentRawStream", lambda index: 7, raising=False)
    a, b = torch.randn(64, 32).to(torch.bfloat16), torch.randn(32, 48).to(torch.bfloat16)
    out = torch.empty(16, 48, dtype=torch.bfloat16)
    names = gemm_rs.gemm_reduce_scatter_kernel.arg_names
    first = [TensorDescriptor.from_tensor(a, [64, 32]), a, TensorDescriptor.from_tensor(b, [32, 32]), b, 0, out]
    args = first + list(range(len(first), names.index("push_rows") + 1))
    calls = []
    replay = gemm_rs.Replay(lambda grid, stream, launch: calls.append(launch), 5, tuple(args), True,
                            gemm_rs.GemmConfig(), False, 30 * 10**9, 0)
    alive = weakref.ref(a)
    del a, first, args
    gc.collect()
    assert alive() is None, "the prepared launch keeps the first call's A alive"
    fresh = torch.randn(64, 32).to(torch.bfloat16)
    replay(gemm_rs.prepare_operands(fresh, b), out)
    assert calls[0][0].base.data_ptr() == fresh.data_ptr() and calls[0][1] == fresh.data_ptr()
    assert gemm_rs.launch_template([b, 3], refilled=(1,)) == [b.data_ptr(), None]


def _same_table(derived: dict, shipped: dict) -> bool:
    """Two auto tables say the same: every field equal, the sources as a set (a device call that
    rewrites the table from one world size's results lists them in another order), none twice."""
    assert len(set(shipped["source"])) == len(shipped["source"]), shipped["source"]
    return {**derived, "source": sorted(derived["source"])} == {**shipped, "source": sorted(shipped["source"])}


def test_auto_table_is_what_the_recorded_benchmarks_say():
    """kernels/gemm_rs_auto.json (the shapes where "auto" does not fuse) and the tuned configs
    must be what `bench_gemm_rs.py --tables-from` derives from the recorded result files that
    the table names, so a new benchmark run cannot silently disagree with the shipped choice."""
    _need_triton()
    import json

    from axedist.collectives import fused
    from axedist.kernels import gemm_rs
    bench = _benchmark("bench_gemm_rs")
    results = []
    for name in ("gemm_rs_w4", "gemm_rs_w2", "gemm_rs_w2_llama8b", "gemm_rs_w4_llama8b",
                 "gemm_rs_w4_llama8b_b16"):  # the table's sources, in order
        with open(os.path.join(ROOT, "benchmarks", "results", f"{name}.json")) as handle:
            results.append(json.load(handle))
    auto, configs = bench.auto_tables(results)
    with open(fused.AUTO_TABLE_PATH) as handle:
        shipped = json.load(handle)
    assert _same_table(auto, shipped)
    assert fused.FUSED_LOSES == {tuple(shape) for shape in auto["fused_loses"]}
    assert fused.SYMM_WINS == {tuple(shape) for shape in auto["symm_wins"]}
    tuned = gemm_rs.tuned_table()
    for key, fields in configs.items():
        assert tuned[key] == fields, key


def test_ag_auto_table_is_what_the_recorded_benchmarks_say():
    """kernels/ag_gemm_auto.json (where "auto" takes torch's op or the unfused pair instead of the
    fused all-gather + GEMM) must be what `bench_ag_gemm.py --tables-from` derives from the current
    result files, the shapes they did not measure kept from the table: rewriting it from them
    changes nothing, so a new run recorded without its table (or a hand edit) fails here."""
    import json

    from axedist.collectives import fused_tp
    bench = _benchmark("bench_ag_gemm")
    results = []
    for name in ("ag_gemm_w4", "ag_gemm_w4_llama8b", "ag_gemm_w2", "ag_gemm_w2_llama8b",
                 "ag_gemm_w4_llama8b_b16"):  # the table's sources
        with open(os.path.join(ROOT, "benchmarks", "results", f"{name}.json")) as handle:
            results.append(json.load(handle))
    with open(fused_tp.AG_AUTO_TABLE_PATH) as handle:
        shipped = json.load(handle)
    assert _same_table(bench.auto_table(results), shipped)
    for result in results:
        assert any(result["meta"]["commit"] in source for source in shipped["source"]), result["meta"]


def test_ag_table_reads_the_column_that_ran_the_shipped_config():
    """bench_ag_gemm.as_shipped: a row's "fused" times become its /gl/ce column's where that column
    ran the config the fused path runs now and "fused" ran another (a W = 4 row of 902a153, on
    the pushes); a row whose "fused" ran the shipped config (recorded, or W = 2's default then)
    or whose /gl/ce column ran another config keeps its own times."""
    import dataclasses

    from axedist.kernels import ag_gemm
    bench = _benchmark("bench_ag_gemm")

    def row(m, n, world, **extra):  # as the bench writes it: the /gl/ce column runs the shape's tiles on /gl/ce
        tiles = ag_gemm.default_config(m // world, n, 8192, world, engines=True)
        glce = str(dataclasses.replace(tiles, engine=True, pipelined=True))
        return dict(M=m, N=n, K=8192, world=world, fused=1.0, fused_gl_ce=0.9, fused_gl_ce_config=glce,
                    queued=dict(fused=2.0, fused_gl_ce=1.8), **extra)

    pushes = row(8192, 7168, 4)             # 902a153's W = 4 row: "fused" ran the pushes
    assert ag_gemm.default_config(2048, 7168, 8192, 4, engines=True).engine
    shipped = bench.as_shipped(pushes)
    assert (shipped["fused"], shipped["queued"]["fused"]) == (0.9, 1.8)
    assert (pushes["fused"], pushes["queued"]["fused"]) == (1.0, 2.0)       # the recorded row untouched
    for kept in (row(8192, 7168, 2),                                         # W = 2 ran /gl/ce already
                 row(8192, 7168, 4, fused_config=pushes["fused_gl_ce_config"]),  # recorded: ran it
                 {**row(8192, 7168, 4), "fused_gl_ce_config": "128x256x64/g8/s4/w8/c32x512/p4/gl/ce"},
                 row(2048, 2048, 4)):                                        # shipped: the pushes (128 x 128)
        assert bench.as_shipped(kept)["fused"] == 1.0, kept
    assert not ag_gemm.default_config(512, 2048, 8192, 4, engines=True).engine


def test_config_strings_round_trip():
    _need_triton()
    from axedist.kernels import gemm_rs
    for config in gemm_rs.CANDIDATES + gemm_rs.TMA_PUSH_CONFIGS + gemm_rs.TWO_PER_SM_CONFIGS:
        assert gemm_rs.GemmConfig.parse(str(config)) == config
    assert str(gemm_rs.GemmConfig(ctas_per_sm=2)).endswith("/c2")
    with pytest.raises(ValueError, match="not a GemmConfig string"):
        gemm_rs.GemmConfig.parse("128x256x64/g8/s3/r64")      # no warps


@pytest.mark.parametrize("regs, shared, warps, expected", [
    (255, 0, 8, 1),            # 8160 registers per warp round up to 8192: one 8-warp program
    (64, 0, 4, 8),             # 2048 per warp: 8 by registers, 16 by threads
    (32, 0, 1, 32),            # 64 by registers and by threads: the 32-program limit
    (128, 114_000, 4, 2),      # two programs' shared memory + 1 KB each fit in 228 KB
    (128, 116_000, 4, 1),      # two do not
])
def test_programs_per_sm_counts_registers_shared_memory_and_threads(regs, shared, warps, expected):
    from axedist.kernels import gemm_rs
    assert gemm_rs.programs_per_sm(regs, shared, warps) == expected


def test_two_per_sm_candidates_fit_twice_in_shared_memory():
    """The candidates asking for two programs per SM must leave room for two in shared memory
    as compiled for sm_90a (registers are only known on the device; the launch checks them)."""
    _need_triton()
    from axedist.kernels import gemm_rs
    doubles = [c for c in gemm_rs.CANDIDATES + gemm_rs.TWO_PER_SM_CONFIGS if c.ctas_per_sm == 2]
    assert doubles
    for config in doubles:
        shared = _compile_fused(config=config).metadata.shared
        assert gemm_rs.programs_per_sm(0, shared, config.warps) >= 2, (config, shared)


# -- the GEMM core ------------------------------------------------------------------------------

def _compile_core(config, tma=True, transposed=False):
    from axedist.kernels import gemm
    from axedist.kernels.compile_check import compile_for_target
    signature = {}
    if tma:
        signature["a_desc"] = f"tensordesc<bf16[{config.block_m}, {config.block_k}]>"
        signature["b_desc"] = (f"tensordesc<bf16[{config.block_n}, {config.block_k}]>" if transposed
                               else f"tensordesc<bf16[{config.block_k}, {config.block_n}]>")
    signature.update(a_ptr="*bf16", b_ptr="*bf16", c_ptr="*fp32" if config.split_k > 1 else "*bf16",
                     M="i32", N="i32", K="i32", stride_am="i32", stride_ak="i32", stride_bk="i32",
                     stride_bn="i32", stride_cm="i32")
    constexprs = dict(BM=config.block_m, BN=config.block_n, BK=config.block_k, GROUP_M=config.group_m,
                      STAGES=config.stages, USE_TMA=tma, B_TRANSPOSED=transposed,
                      WS=config.warp_specialize and tma, SPLIT_K=config.split_k,
                      FLATTEN=config.flatten, DEVICE_DESC=config.device_descriptors and tma)
    if not tma or config.device_descriptors:
        constexprs.update(a_desc=None, b_desc=None)
        signature.pop("a_desc", None)
        signature.pop("b_desc", None)
    return compile_for_target(gemm.gemm_kernel, signature, constexprs,
                              ["a_ptr", "b_ptr", "c_ptr", "N", "K", "stride_am", "stride_bk", "stride_cm"],
                              num_warps=config.warps, num_stages=config.stages)


def test_gemm_core_candidates_compile_for_sm90a_and_fit_shared_memory():
    """Warp-specialized candidates: a producer and two consumer warpgroups (12 warps) with
    setmaxnreg, wgmma, TMA loads; every candidate within Hopper's 227 KB of shared memory."""
    _need_triton()
    from axedist.kernels import gemm
    for config in gemm.CORE_CANDIDATES:
        kernel = _compile_core(config)
        ptx = kernel.asm["ptx"]
        assert "wgmma.mma_async" in ptx and "cp.async.bulk.tensor.2d.shared" in ptx, config
        if config.device_descriptors:
            assert "tensormap.replace" in ptx and kernel.metadata.global_scratch_size > 0, config
        assert kernel.metadata.shared <= 227 * 1024, (config, kernel.metadata.shared)
        assert ".local" not in ptx, config   # no register spills
        if config.warp_specialize:
            assert "ttg.warp_specialize" in kernel.asm["ttgir"], config
            assert kernel.metadata.num_warps == 12 and "setmaxnreg.inc" in ptx, config
    assert "wgmma" in _compile_core(gemm.CORE_CANDIDATES[0], transposed=True).asm["ptx"]
    assert "wgmma" in _compile_core(gemm.CORE_CANDIDATES[0], tma=False).asm["ptx"]
    assert "ttg.warp_specialize" in _compile_core(gemm.CORE_CANDIDATES[-1], transposed=True).asm["ttgir"]


def _gluon_descriptor(block):
    """A Gluon TMA descriptor's signature type: bf16 block and its shared layout."""
    from axedist.kernels import gemm_gluon
    return f"tensordesc<bf16[{block[0]}, {block[1]}],{gemm_gluon.shared_layout(block, torch.bfloat16)!r}>"


def _compile_pipelined(config, transposed):
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    from axedist.kernels import gemm_gluon
    blocks = ([config.block_m, config.block_k],
              [config.block_n, config.block_k] if transposed else [config.block_k, config.block_n],
              [config.block_m, config.block_n // gemm_gluon.EPILOGUE_SPLIT])
    signature = {name: _gluon_descriptor(block)
                 for name, block in zip(("a_desc", "b_desc", "c_desc"), blocks)}
    signature.update(M="i32", N="i32", K="i32")
    constexprs = dict(GROUP_M=config.group_m, STAGES=config.stages, B_TRANSPOSED=transposed,
                      EPILOGUE_SPLIT=gemm_gluon.EPILOGUE_SPLIT, num_warps=config.warps)
    kernel = gemm_gluon.gemm_pipelined_kernel
    signature.update({name: "constexpr" for name in constexprs})
    source = GluonASTSource(fn=kernel, signature=signature,
                            constexprs={(kernel.arg_names.index(name),): value
                                        for name, value in constexprs.items()})
    return triton.compile(source, target=GPUTarget("cuda", 90, 32),
                          options={"num_warps": config.warps})


def test_pipelined_gemm_core_compiles_for_sm90a_with_no_division_in_the_load_path():
    """The Gluon tile loop (/gl candidates, both B orientations): wgmma with one group in flight,
    TMA loads and TMA stores, no spills, within 227 KB of shared memory, and no integer division
    between a wgmma's wait and the next TMA load: the probe measured 0.77-0.88 of cuBLAS with the
    load's tile recomputed by division every K step, 0.97-1.04 with it computed once per tile."""
    _need_triton()
    from axedist.kernels import gemm
    pipelined = [config for config in gemm.CORE_CANDIDATES if config.pipelined]
    assert pipelined and gemm.LARGE_TILE.pipelined
    for config in pipelined:
        for transposed in (False, True):
            kernel = _compile_pipelined(config, transposed)
            ptx = kernel.asm["ptx"]
            assert "wgmma.wait_group.sync.aligned 1" in ptx, config
            assert "cp.async.bulk.tensor.2d.global.shared" in ptx, config        # TMA store
            assert kernel.metadata.shared <= 227 * 1024, (config, kernel.metadata.shared)
            assert ".local" not in ptx, config
            after_wait = ptx.split("wgmma.wait_group.sync.aligned 1", 1)[1]
            load_path = after_wait.split("cp.async.bulk.tensor.2d.shared::cluster.global", 1)[0]
            assert "div." not in load_path and "rem." not in load_path, config


def test_gemm_core_matches_a_float64_reference_under_the_interpreter():
    """Tails in every dim, split-K 1 / 2 / 3, both B orientations, TMA and pointer paths."""
    _need_triton()
    script = textwrap.dedent("""
        import itertools
        import torch, triton
        import tests.triton_interpreter  # the interpreter's loop bounds
        from triton.tools.tensor_descriptor import TensorDescriptor
        from axedist.kernels import gemm
        failures = []
        for (m, n, k), (bm, bn, bk, split), bt, tma in itertools.product(
                [(100, 72, 200), (33, 16, 48)], [(32, 32, 16, 1), (64, 32, 32, 3), (32, 64, 16, 2)],
                [False, True], [True, False]):
            if bt and not tma:
                continue
            a = torch.randn(m, k).half()
            b = torch.randn(n, k).half() if bt else torch.randn(k, n).half()
            ref = a.double() @ (b.double().t() if bt else b.double())
            c = torch.full((m, n), float("nan"), dtype=torch.float16)
            target = torch.full((split, m, n), float("nan")) if split > 1 else c
            ad = TensorDescriptor.from_tensor(a, [bm, bk]) if tma else None
            bd = TensorDescriptor.from_tensor(b, [bn, bk] if bt else [bk, bn]) if tma else None
            strides = (a.stride(0), a.stride(1), b.stride(1), b.stride(0)) if bt else (a.stride(0), a.stride(1), b.stride(0), b.stride(1))
            gemm.gemm_kernel[(3,)](ad, a, bd, b, target, m, n, k, *strides, n if split > 1 else c.stride(0),
                                   BM=bm, BN=bn, BK=bk, GROUP_M=2, STAGES=2, USE_TMA=tma, B_TRANSPOSED=bt,
                                   WS=True, SPLIT_K=split)
            if split > 1:
                gemm.splitk_sum_kernel[(triton.cdiv(m * n, 64),)](target, c, m, n, c.stride(0), SPLIT_K=split, BLOCK=64)
            error = ((c.double() - ref).norm() / ref.norm()).item()
            if torch.isnan(c).any() or not error < 2e-3:
                failures.append((m, n, k, bm, bn, bk, split, bt, tma, error))
        print(failures or "OK")
    """)
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=ROOT)
    result = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0 and result.stdout.strip().endswith("OK"), result.stdout[-3000:] + result.stderr[-3000:]


def test_gemm_core_config_strings_and_heuristic():
    _need_triton()
    from axedist.kernels import gemm
    for config in gemm.CORE_CANDIDATES:
        assert gemm.GemmCoreConfig.parse(str(config)) == config
    with pytest.raises(ValueError, match="not a GemmCoreConfig string"):
        gemm.GemmCoreConfig.parse("128x256x64/g8/s4/ws")
    assert str(gemm.GemmCoreConfig()) == "128x256x64/g8/s3/w8/k1"
    # 32 tiles of 128 x 256 would leave most of 132 SMs idle at M = 128: 64 x 128 tiles (128)
    assert gemm.core_config(128, 8192, 7168).block_m == 64
    assert gemm.core_config(8192, 8192, 7168) == gemm.TUNED.get("8192x8192x7168", gemm.LARGE_TILE)
    tiny = gemm.core_config(64, 256, 8192)                  # 4 tiles even at 64 x 128: split K
    assert tiny.split_k > 1 and tiny.split_k <= 8


def test_collective_plan_over_carved_memory_validates_and_forces_rounds():
    """The plan the virtual ranks build (their own workspace, forced rounds) computes its
    geometry from the workspace's rank count and refuses what does not fit."""
    from axedist.collectives import p2p
    from axedist.collectives.symmetric import carve_workspaces
    spaces = carve_workspaces(4, 1 << 16, torch.device("cpu"), processors=33)
    plan = p2p.CallPlan("all_gather", (4096,), torch.bfloat16, None, 0, "push", False,
                        workspace=spaces[2], rounds=3)
    assert (plan.world, plan.rank, plan.rounds) == (4, 2, 3) and plan.programs <= 33
    assert p2p.CallPlan("all_reduce_one_shot", (64,), torch.bfloat16, None, 0, "push", False,
                        workspace=spaces[0], rounds=3).rounds == 1     # only RS / AG pipeline
    with pytest.raises(ValueError, match="not divisible by the group size 4"):
        p2p.CallPlan("reduce_scatter", (4098,), torch.bfloat16, None, 0, "push", False, workspace=spaces[0])
    with pytest.raises(ValueError, match="do not fit the workspace half"):
        p2p.CallPlan("all_gather", (1 << 16,), torch.bfloat16, None, 0, "push", False, workspace=spaces[0])


def test_workspace_staging_is_one_buffer_grown_on_demand():
    """The copy-engine calls' staging buffer: one per workspace, shared by every call that fits
    in it (the same memory, not a copy per call shape), replaced by a larger one when a call
    needs more, while a slice handed out before stays whole; each rank's its own."""
    from axedist.collectives.symmetric import carve_workspaces
    spaces = carve_workspaces(2, 1 << 16, torch.device("cpu"))
    first = spaces[0].staging(4096)
    first.fill_(7)
    smaller = spaces[0].staging(1000)
    assert smaller.numel() == 1000 and smaller.data_ptr() == first.data_ptr()
    larger = spaces[0].staging(8192)
    assert larger.numel() == 8192 and larger.data_ptr() != first.data_ptr()
    assert bool((first == 7).all()) and spaces[0].staging(100).data_ptr() == larger.data_ptr()
    assert spaces[1].staging(4096).data_ptr() not in (first.data_ptr(), larger.data_ptr())


def test_gemm_tuned_table_is_what_the_recorded_benchmark_says():
    """kernels/gemm_tuned.json ships, per shape, the fastest config of the recorded one-GPU
    benchmark (bench_gemm.py --tables-from), and only configs that are candidates (so the
    one-GPU tests check them)."""
    _need_triton()
    from axedist.kernels import gemm
    with open(os.path.join(ROOT, "benchmarks", "results", "gemm_onegpu.json")) as handle:
        rows = json.load(handle)["rows"]
    assert {f"{r['M']}x{r['N']}x{r['K']}": gemm.GemmCoreConfig.parse(r["best_config"]) for r in rows} == gemm.TUNED
    assert set(gemm.TUNED.values()) <= set(gemm.CORE_CANDIDATES)


# -- fused all-gather + GEMM, GEMM + all-reduce ---------------------------------------------------

def test_fused_tp_kernel_phases_match_a_float64_reference_under_the_interpreter():
    """Both kernels run phase by phase, rank by rank (tests/fused_interpreter.py): W = 2, 3, 4,
    tails, both B orientations, TMA and pointer paths, one-shot / two-shot, push / pull, both
    halves; each launch must leave the rank's call state advanced and its counters zeroed."""
    _need_triton()
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=ROOT)
    script = os.path.join(ROOT, "tests", "fused_interpreter.py")
    result = subprocess.run([sys.executable, script], env=env, capture_output=True, text=True,
                            timeout=600)
    assert result.returncode == 0 and result.stdout.strip().endswith("OK"), \
        result.stdout[-3000:] + result.stderr[-3000:]


_STATE_DIVISIBLE = ["a_ptr", "b_ptr", "out_ptr", "N", "K", "stride_am", "stride_bk", "state_ptr"]


def _pointer_and_flag_signature(signature, dtype, names_after):
    for name in [f"D{i}" for i in range(8)] + ["multicast_base"] + [f"F{i}" for i in range(8)]:
        signature[name] = "i64"
    signature.update(state_ptr="*i32", abort_ptr="*i32", error_address="i64", timeout_ns="i64")
    signature.update(names_after)
    return signature


def _compile_ag(multimem=False, transposed=False, tma=True, world=4, config=None, dtype="bf16",
                copy_out=False, engine=False):
    from axedist.kernels import ag_gemm
    from axedist.kernels.compile_check import compile_for_target
    c = config or ag_gemm.AllGatherGemmConfig()
    signature = {"a_ptr": f"*{dtype}"}
    if tma:
        signature["a_desc"] = f"tensordesc<{dtype}[{c.block_m}, {c.block_k}]>"
        signature["g_desc"] = f"tensordesc<{dtype}[{c.block_m}, {c.block_k}]>"
        signature["b_desc"] = (f"tensordesc<{dtype}[{c.block_n}, {c.block_k}]>" if transposed
                               else f"tensordesc<{dtype}[{c.block_k}, {c.block_n}]>")
    signature.update(b_ptr=f"*{dtype}", out_ptr=f"*{dtype}", gathered_address="i64")
    _pointer_and_flag_signature(signature, dtype, dict(
        M_LOCAL="i32", N="i32", K="i32", stride_am="i32", stride_bk="i32", stride_bn="i32",
        stride_om="i32", engine_flag0="i32", chunk_blocks="i32", rank="i32", half_rows="i32"))
    constexprs = dict(WORLD=world, BM=c.block_m, BN=c.block_n, BK=c.block_k, GROUP_M=c.group_m,
                      STAGES=c.stages, USE_TMA=tma, B_TRANSPOSED=transposed, MULTIMEM=multimem,
                      ALIGNED=True, COPY_ROWS=c.copy_rows, COPY_COLS=c.copy_cols,
                      PIECES=c.pieces, COPY_OUT=copy_out, PHASES=3, ENGINE=engine)
    if not tma:
        constexprs.update(a_desc=None, g_desc=None, b_desc=None)
    return compile_for_target(ag_gemm.all_gather_gemm_kernel, signature, constexprs,
                              _STATE_DIVISIBLE + ["stride_om"], num_warps=c.warps,
                              num_stages=c.stages)


def _compile_pipelined_ag(transposed=False, world=4, copy_out=False, out_tma=True, engine=False):
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    from axedist.kernels import ag_gemm, gemm_gluon
    c = ag_gemm.AllGatherGemmConfig(pipelined=True)
    signature = {"a_ptr": "*bf16"}
    blocks = {"a_desc": [c.block_m, c.block_k], "g_desc": [c.block_m, c.block_k],
              "b_desc": [c.block_n, c.block_k] if transposed else [c.block_k, c.block_n]}
    for name, block in blocks.items():
        signature[name] = _gluon_descriptor(block)
    signature.update(b_ptr="*bf16", out_ptr="*bf16", gathered_address="i64")
    _pointer_and_flag_signature(signature, "bf16", dict(
        M_LOCAL="i32", N="i32", K="i32", stride_am="i32", stride_bk="i32", stride_bn="i32",
        stride_om="i32", engine_flag0="i32", chunk_blocks="i32", rank="i32", half_rows="i32",
        tail_tiles="i32", partials="*fp32", partial_flags="i64"))
    constexprs = dict(WORLD=world, BM=c.block_m, BN=c.block_n, BK=c.block_k, GROUP_M=c.group_m,
                      STAGES=c.stages, USE_TMA=True, B_TRANSPOSED=transposed, MULTIMEM=False,
                      ALIGNED=True, COPY_ROWS=c.copy_rows, COPY_COLS=c.copy_cols,
                      PIECES=c.pieces, COPY_OUT=copy_out, PHASES=3, OUT_TMA=out_tma,
                      ENGINE=engine)
    if out_tma:
        block = [c.block_m, c.block_n // gemm_gluon.EPILOGUE_SPLIT]
        signature["o_desc"] = _gluon_descriptor(block)
    else:
        constexprs["o_desc"] = None
    kernel = ag_gemm.pipelined_all_gather_gemm_kernel
    signature.update({name: "constexpr" for name in constexprs})
    signature = {name: signature[name] for name in kernel.arg_names}
    divisible = _STATE_DIVISIBLE + ["stride_om"]
    source = GluonASTSource(fn=kernel, signature=signature,
                            constexprs={(kernel.arg_names.index(k),): v for k, v in constexprs.items()},
                            attrs={(kernel.arg_names.index(n),): [["tt.divisibility", 16]]
                                   for n in divisible if n in kernel.arg_names})
    return triton.compile(source, target=GPUTarget("cuda", 90, 32), options={"num_warps": c.warps})


@pytest.mark.parametrize("transposed", [False, True])
@pytest.mark.parametrize("copy_out,out_tma", [(False, True), (True, True), (False, False)])
def test_pipelined_all_gather_gemm_kernel_compiles_for_sm90a(transposed, copy_out, out_tma):
    """The Gluon all-gather + GEMM kernel (/gl): wgmma with one group in flight, TMA loads,
    16-byte pushes released at system scope, acquire loads of the flags, TMA stores of the
    output (masked stores where a source's rows are not whole tiles), no spills, within 227 KB
    of shared memory."""
    _need_triton()
    kernel = _compile_pipelined_ag(transposed, copy_out=copy_out, out_tma=out_tma)
    ptx = kernel.asm["ptx"]
    assert "wgmma.wait_group.sync.aligned 1" in ptx and "cp.async.bulk.tensor.2d.shared" in ptx
    assert "ld.acquire.sys" in ptx and "st.release.sys" in ptx and "fence.proxy.async" in ptx
    assert re.search(r"st\.global(\.\w+)*\.v4", ptx)
    assert ("cp.async.bulk.tensor.2d.global.shared" in ptx) == out_tma
    assert ".local" not in ptx and kernel.metadata.shared <= 227 * 1024


@pytest.mark.parametrize("transposed,copy_out,world", [(False, False, 2), (True, True, 4)])
def test_gluon_copy_engine_all_gather_gemm_compiles_for_sm90a(transposed, copy_out, world):
    """/gl/ce: the Gluon all-gather + GEMM kernel with the rows by copy engine compiles no push
    code (fewer 16-byte stores and system-scope releases: the copy engines
    announce the chunks; the stream-K tail's and the call's end remain), still acquires the
    chunks' flags with bounded waits and fences the async proxy before TMA reads the rows;
    within 227 KB of shared memory."""
    _need_triton()
    kernel = _compile_pipelined_ag(transposed, world=world, copy_out=copy_out, engine=True)
    pushing = _compile_pipelined_ag(transposed, world=world, copy_out=copy_out)
    ptx = kernel.asm["ptx"]
    assert "wgmma.wait_group.sync.aligned 1" in ptx and "cp.async.bulk.tensor.2d.shared" in ptx
    assert "ld.acquire.sys" in ptx and "%globaltimer" in ptx and "fence.proxy.async" in ptx
    assert ptx.count("st.release.sys") < pushing.asm["ptx"].count("st.release.sys")
    vector_stores = [len(re.findall(r"st\.global(\.\w+)*\.v4", k.asm["ptx"])) for k in (kernel, pushing)]
    assert vector_stores[0] < vector_stores[1]
    # ptxas spills 16 bytes at W = 2 with B row-major (the call's state, kept across the task
    # loop; none in a wgmma loop: test_wgmma_loops_of_the_gluon_kernels_never_touch_local_memory)
    assert _spill_bytes(kernel) <= 16 and kernel.metadata.shared <= 227 * 1024


def _compile_ar(two_shot, push, multimem=False, transposed=True, tma=True, config=None, dtype="bf16"):
    from axedist.kernels import gemm_ar
    from axedist.kernels.compile_check import compile_for_target
    c = config or gemm_ar.DecodeConfig()
    signature = {}
    if tma:
        signature["a_desc"] = f"tensordesc<{dtype}[{c.block_m}, {c.block_k}]>"
    signature["a_ptr"] = f"*{dtype}"
    if tma:
        signature["b_desc"] = (f"tensordesc<{dtype}[{c.block_n}, {c.block_k}]>" if transposed
                               else f"tensordesc<{dtype}[{c.block_k}, {c.block_n}]>")
    signature.update(b_ptr=f"*{dtype}", out_ptr=f"*{dtype}")
    _pointer_and_flag_signature(signature, dtype, dict(
        M="i32", N="i32", K="i32", stride_am="i32", stride_bk="i32", stride_bn="i32",
        rank="i32", half_bytes="i64"))
    constexprs = dict(WORLD=4, BM=c.block_m, BN=c.block_n, BK=c.block_k, STAGES=c.stages,
                      USE_TMA=tma, B_TRANSPOSED=transposed, TWO_SHOT=two_shot, PUSH=push,
                      MULTIMEM=multimem, ALIGNED=True, PHASES=7)
    if not tma:
        constexprs.update(a_desc=None, b_desc=None)
    return compile_for_target(gemm_ar.gemm_all_reduce_kernel, signature, constexprs,
                              _STATE_DIVISIBLE, num_warps=c.warps, num_stages=c.stages)


@pytest.mark.parametrize("transposed", [False, True])
def test_all_gather_gemm_compiles_to_tma_wgmma_with_releases_and_bounded_waits(transposed):
    """One tile loop (one set of pipeline buffers within Hopper's shared memory), TMA loads of
    the gathered rows after a proxy fence, remote pushes as 16-byte stores, one system-scope
    release per push task after a fence, bounded acquire waits; no multimem in p2p."""
    _need_triton()
    from axedist.kernels import ag_gemm
    for config in ag_gemm.CANDIDATES:
        kernel = _compile_ag(transposed=transposed, config=config)
        ptx = kernel.asm["ptx"]
        assert "wgmma.mma_async" in ptx and "cp.async.bulk.tensor.2d.shared" in ptx, config
        assert "fence.proxy.async" in ptx and "fence.acq_rel.sys" in ptx
        assert ptx.count("st.release.sys.global.b32") == 1 and "ld.acquire.sys.global.b32" in ptx
        assert "%globaltimer" in ptx and ptx.count("st.global.v4") >= 4
        assert "multimem" not in ptx and ".local" not in ptx
        assert kernel.metadata.shared <= 227 * 1024, (config, kernel.metadata.shared)
    assert "wgmma" in _compile_ag(tma=False).asm["ptx"]
    assert _compile_ag(copy_out=True).metadata.shared <= 227 * 1024
    # one rank (the benchmarks' GEMM half): no push task, so no release, only local tiles
    one = _compile_ag(world=1).asm["ptx"]
    assert "wgmma.mma_async" in one and "st.release.sys" not in one
    # rows by copy engine (/ce): no push code (no release, no 16-byte remote stores), the
    # peer tiles' bounded acquire waits and proxy fence before their TMA loads
    engine = _compile_ag(engine=True, copy_out=True)
    ptx = engine.asm["ptx"]
    assert "st.release.sys" not in ptx and "fence.acq_rel.sys" not in ptx
    assert "ld.acquire.sys.global.b32" in ptx and "%globaltimer" in ptx
    assert "fence.proxy.async" in ptx and "wgmma.mma_async" in ptx
    assert engine.metadata.shared <= 227 * 1024


@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
def test_all_gather_gemm_multimem_variant_ptx_for_sm90a(dtype):
    _need_triton()
    kernel = _compile_ag(multimem=True, dtype=dtype)
    ptx = kernel.asm["ptx"]
    assert "multimem.st.relaxed.sys.global.v4.f32" in ptx
    assert ptx.count("st.release.sys.global.b32") == 4     # the flag on each of the 4 ranks
    assert len(kernel.asm["cubin"]) > 0


@pytest.mark.parametrize("two_shot", [False, True])
@pytest.mark.parametrize("push", [False, True])
def test_gemm_all_reduce_compiles_for_sm90a(two_shot, push):
    _need_triton()
    ptx = _compile_ar(two_shot, push).asm["ptx"]
    assert "wgmma.mma_async" in ptx and "cp.async.bulk.tensor" in ptx
    assert "fence.acq_rel.sys" in ptx and "ld.acquire.sys.global.b32" in ptx
    releases = ptx.count("st.release.sys.global.b32")
    # push: the tile's flag on all 4 ranks (one-shot) or its owner (two-shot), then the
    # reduced tile's on all 4; pull: the rank's own flag, then the reduced tile's own flag
    assert releases == {(False, True): 4, (True, True): 5, (False, False): 1, (True, False): 2}[(two_shot, push)]
    assert "multimem" not in ptx and ".local" not in ptx
    assert "wgmma" in _compile_ar(two_shot, push, tma=False, transposed=False).asm["ptx"]


@pytest.mark.parametrize("dtype,suffix", [("bf16", "bf16x2"), ("fp16", "f16x2")])
def test_gemm_all_reduce_multimem_variant_ptx_for_sm90a(dtype, suffix):
    _need_triton()
    kernel = _compile_ar(False, False, multimem=True, dtype=dtype)
    assert f"multimem.ld_reduce.relaxed.sys.global.add.acc::f32.v4.{suffix}" in kernel.asm["ptx"]
    assert len(kernel.asm["cubin"]) > 0


def _runtime_names(kernel):
    names = kernel.arg_names
    return names[:names.index("WORLD")]


def test_fused_tp_launch_slots_match_the_kernel_signatures():
    """The prepared launches fill operands and output by position, and build their argument
    list in the kernels' order: both must be the kernels' parameters."""
    _need_triton()
    from axedist.kernels import ag_gemm, gemm_ar
    names = _runtime_names(ag_gemm.all_gather_gemm_kernel)
    launch = ag_gemm.AllGatherGemmLaunch
    assert (names[launch._A], names[launch._A_DESC], names[launch._B_DESC], names[launch._B], names[launch._OUT],
            names[launch._GATHERED]) == ("a_ptr", "a_desc", "b_desc", "b_ptr", "out_ptr", "gathered_address")
    assert names[-2:] == ["rank", "half_rows"] and "epoch" not in names
    assert ag_gemm.UNSET_ADDRESS >= 1 << 31   # typed i64 when the launch is compiled
    from axedist.kernels import gemm_rs
    names = _runtime_names(gemm_rs.engine_gemm_reduce_scatter_kernel)   # run through a Replay
    replay = gemm_rs.Replay
    assert (names[replay._A_DESC], names[replay._A], names[replay._B_DESC], names[replay._B],
            names[replay._OUT]) == ("a_desc", "a_ptr", "b_desc", "b_ptr", "out_ptr")
    names = _runtime_names(gemm_ar.gemm_all_reduce_kernel)
    launch = gemm_ar.GemmAllReduceLaunch
    assert (names[launch._A_DESC], names[launch._A], names[launch._B_DESC], names[launch._B],
            names[launch._OUT]) == ("a_desc", "a_ptr", "b_desc", "b_ptr", "out_ptr")
    assert names[-2:] == ["rank", "half_bytes"] and "epoch" not in names


def test_fused_tp_configs_tables_and_sizes(monkeypatch):
    _need_triton()
    from axedist.collectives import fused_tp
    from axedist.kernels import ag_gemm, gemm_ar
    for config in ag_gemm.CANDIDATES:
        assert ag_gemm.AllGatherGemmConfig.parse(str(config)) == config
    for text in ("128x256x64/g8/s3/w8/c32x512/p4/ce", "128x256x64/g8/s4/w8/c32x512/p4/gl/ce",
                 "128x256x64/g8/s4/w8/c32x512/p4/gl/sk"):
        assert str(ag_gemm.AllGatherGemmConfig.parse(text)) == text
    assert ag_gemm.AllGatherGemmConfig.parse("128x256x64/g8/s4/w8/c32x512/p4/gl/ce") == \
        ag_gemm.AllGatherGemmConfig(stages=4, pipelined=True, engine=True)
    with pytest.raises(ValueError, match="not an AllGatherGemmConfig string"):
        ag_gemm.AllGatherGemmConfig.parse("128x256x64/g8/s3")
    with pytest.raises(ValueError, match="stream-K tail"):
        ag_gemm.AllGatherGemmConfig(pipelined=True, stream_k=True, engine=True)
    assert ag_gemm.default_config(2048, 7168, 8192, 4) == ag_gemm.CANDIDATES[0]
    assert ag_gemm.default_config(512, 2048, 8192, 4).block_n == 128       # 128 tiles in all
    # W = 2: the copy engines move the rows and the Gluon loop runs the tiles where cuda-python
    # can issue the copies, else the pushes on the Triton loop (the Gluon loop's pushes are slower)
    for usable in (True, False):
        monkeypatch.setattr(ag_gemm, "copy_engines_usable", lambda: usable)
        for m_local, n in [(4096, 2048), (1024, 2048), (8192, 7168)]:
            config = ag_gemm.default_config(m_local, n, 8192, 2)
            assert (config.engine, config.pipelined, config.stream_k) == (usable, usable, False)
        # W = 4: the same where 128 x 256 tiles fill the GPU, the pushes with 128 x 128 tiles
        config = ag_gemm.default_config(4096, 2048, 8192, 4)
        assert (config.block_n, config.engine, config.pipelined) == (256, usable, usable)
        assert not ag_gemm.default_config(512, 2048, 8192, 4).engine
        assert not ag_gemm.default_config(4096, 2048, 8192, 8).engine    # not measured there
    # an odd call's buffer starts on the first whole row of half 1 and ends inside it
    for data_bytes, k in [(1 << 22, 5120), (1 << 22, 8192), (3 << 20, 1000)]:
        rows = ag_gemm.gathered_rows(data_bytes, k, 2)
        assert data_bytes <= rows * k * 2 < data_bytes + k * 2
        m_local = (data_bytes - k * 2) // (4 * k * 2)      # the most rows a half holds at W = 4
        assert ag_gemm.workspace_bytes_needed(4, m_local, k, 2) <= data_bytes
        assert (rows + 4 * m_local) * k * 2 <= 2 * data_bytes
    assert gemm_ar.default_config(1, 8192, 2048).block_m == 64
    assert gemm_ar.default_config(256, 8192, 2048).block_m == 128
    assert gemm_ar.default_config(1, 4096, 4096).block_n == 64      # 32 columns measured slower
    assert gemm_ar.workspace_bytes_needed(4, 8, 1024, 2) == 5 * 8 * 1024 * 2
    assert fused_tp.decode_algorithm(1, 8192, 2) == "one_shot"
    assert fused_tp.decode_algorithm(256, 8192, 2) == "two_shot"
    assert fused_tp.decode_algorithm(256, 8192, 2, "one_shot") == "one_shot"
    with pytest.raises(ValueError, match="algorithm must be"):
        fused_tp.decode_algorithm(1, 1, 2, "three_shot")
    for table in (fused_tp.AG_AUTO, fused_tp.AR_AUTO):
        assert isinstance(table["fused_loses"], set) and table["source"]


def _fused_tp_body(rank, world):
    """On gloo (CPU) ranks: the plans say why the kernels cannot run, bad input raises the same
    clear error on every rank, and the torch path computes the right values (leading dims,
    gather_dim 0 and 1, both B orientations)."""
    import axedist as ax
    from axedist.collectives import fused_tp
    torch.manual_seed(100 + rank)
    results = {}
    a = torch.randn(3, 2, 16)                  # [S/W, B, K] sequence-first
    w = torch.randn(12, 16)                    # nn.Linear weight [N_local, K]
    results["ag_plan"] = str(fused_tp.plan_all_gather_gemm(a.bfloat16(), w.bfloat16().t()))
    y = ax.all_gather_gemm(a, w.t(), backend="torch")
    gathered = [torch.empty_like(a) for _ in range(world)]
    torch.distributed.all_gather(gathered, a)
    results["ag_error"] = (y - torch.cat(gathered) @ w.t()).abs().max().item()
    results["ag_shape"] = tuple(y.shape)
    y1 = ax.all_gather_gemm(a.transpose(0, 1).contiguous(), w.t(), gather_dim=1, backend="torch")
    results["ag_dim1_error"] = (y1 - torch.cat(gathered).transpose(0, 1) @ w.t()).abs().max().item()
    h = torch.randn(4, 16)
    z = ax.gemm_all_reduce(h, w.t(), backend="torch")
    total = h @ w.t()
    torch.distributed.all_reduce(total)
    results["ar_error"] = (z - total).abs().max().item()
    results["ar_plan"] = str(fused_tp.plan_gemm_all_reduce(h.bfloat16(), w.bfloat16().t()))
    for name, call in {
            "inner": lambda: fused_tp.plan_all_gather_gemm(a, torch.randn(8, 4)),
            "dtype": lambda: fused_tp.plan_gemm_all_reduce(h, w.t().half()),
            "gather_dim": lambda: fused_tp.plan_all_gather_gemm(a, w.t(), gather_dim=2),
            "backend": lambda: fused_tp.plan_gemm_all_reduce(h, w.t(), backend="nccl"),
            "p2p_on_cpu": lambda: fused_tp.plan_all_gather_gemm(a.bfloat16(), w.bfloat16().t(), backend="p2p"),
            "rows": lambda: fused_tp.plan_gemm_all_reduce(torch.randn(300, 16).bfloat16(), w.bfloat16().t(), backend="p2p")}.items():
        try:
            call()
            results[name] = None
        except ValueError as error:
            results[name] = str(error)
    return results


def test_fused_tp_plans_validation_and_torch_path_on_cpu_ranks():
    from axedist.testing import run_on_ranks
    for results in run_on_ranks(_fused_tp_body, 2, "gloo", timeout_s=120):
        assert "torch" in results["ag_plan"] and "not on a CUDA device" in results["ag_plan"]
        assert "gathered to [12x16]" in results["ag_plan"]
        assert results["ag_shape"] == (6, 2, 12) and results["ag_error"] < 1e-4
        assert results["ag_dim1_error"] < 1e-4 and results["ar_error"] < 1e-4
        assert "gemm_all_reduce[4x16]" in results["ar_plan"] and "torch" in results["ar_plan"]
        assert "inner dimensions" in results["inner"]
        assert "torch.float32 but b is torch.float16" in results["dtype"]
        assert "gather_dim 2" in results["gather_dim"]
        assert "backend must be one of" in results["backend"]
        assert "cannot run" in results["p2p_on_cpu"] and "not on a CUDA device" in results["p2p_on_cpu"]
        assert "cannot run" in results["rows"]


def _symm_body(rank, world):
    """gloo ranks with the CUDA decisions forced (p2p possible, torch's symmetric-memory ops
    present) and torch's ops emulated by collectives + matmul: "auto" picks the "symm" backend
    exactly for the shapes the tables name, says so, and the symm path returns the right values
    and shapes (leading dims, ``out=``, the gathered rows)."""
    from axedist.collectives import fallback, fused, fused_tp, symm
    from axedist.mesh import DeviceMesh

    group = DeviceMesh("cpu", (world,)).group()
    forced = {"p2p_possible": lambda a, g: (True, "ok"), "symm_ops_available": lambda: (True, "ok")}
    saved = [(module, name, getattr(module, name)) for module in (fused, fused_tp) for name in forced]
    saved += [(symm, "matmul_reduce_scatter", symm.matmul_reduce_scatter), (symm, "all_gather_matmul", symm.all_gather_matmul),
              (fused, "SYMM_WINS", fused.SYMM_WINS)]
    symm_wins = fused_tp.AG_AUTO["symm_wins"]
    try:
        for module in (fused, fused_tp):
            for name, fn in forced.items():
                setattr(module, name, fn)
        symm.matmul_reduce_scatter = lambda a, b, g, dim: fallback.reduce_scatter(a @ b, g)
        symm.all_gather_matmul = lambda a, b, g, dim: (fallback.all_gather(a, g) @ b, fallback.all_gather(a, g))
        rows_here = 256  # a [256, 2, 16] on each rank: 512 rows, above both tables' row minimums
        fused.SYMM_WINS = {(2 * rows_here, 8, 16, world)}                      # (M, N, K_local, W)
        fused_tp.AG_AUTO["symm_wins"] = {(2 * rows_here * world, 12, 16, world)}  # (gathered M, N, K, W)
        torch.manual_seed(rank)
        a, b = torch.randn(rows_here, 2, 16, dtype=torch.bfloat16), torch.randn(16, 8, dtype=torch.bfloat16)
        w = torch.randn(12, 16, dtype=torch.bfloat16)
        plans = [fused.plan_gemm_reduce_scatter(a, b, group),
                 fused.plan_gemm_reduce_scatter(a, torch.randn(16, 24, dtype=torch.bfloat16), group),
                 fused_tp.plan_all_gather_gemm(a, w.t(), group),
                 fused_tp.plan_all_gather_gemm(a, torch.randn(16, 20, dtype=torch.bfloat16), group)]
        want = fallback.reduce_scatter((a @ b).reshape(-1, 8), group).view(rows_here // world, 2, 8)
        got = fused.run_gemm_reduce_scatter(a, b, group)
        rows = torch.empty(rows_here * world, 2, 16, dtype=torch.bfloat16)
        product = fused_tp.run_all_gather_gemm(a, w.t(), group, gathered=rows)
        whole = fallback.all_gather(a, group)
        errors = []
        for call in (lambda: fused_tp.plan_gemm_all_reduce(a[0], b, group, backend="symm"),
                     lambda: fused.plan_gemm_reduce_scatter(a, b, group, backend="symm")):
            fused.symm_ops_available = lambda: (False, "this torch has no torch.ops.symm_mem ops")
            try:
                call()
                errors.append(None)
            except ValueError as error:
                errors.append(str(error))
        return ([(p.backend, p.reason) for p in plans], torch.equal(got, want), got.shape,
                torch.equal(product, whole @ w.t()), torch.equal(rows, whole), errors)
    finally:
        for module, name, value in saved:
            setattr(module, name, value)
        fused_tp.AG_AUTO["symm_wins"] = symm_wins


def test_auto_runs_torchs_symmetric_memory_ops_where_the_tables_say():
    _need_triton()
    from axedist.testing import run_on_ranks

    for plans, rs_ok, rs_shape, ag_ok, rows_ok, errors in run_on_ranks(_symm_body, 2):
        assert [backend for backend, _ in plans] == ["symm", "p2p", "symm", "p2p"], plans
        assert "measured" in plans[0][1] and "symmetric-memory" in plans[0][1], plans
        assert rs_ok and rs_shape == (128, 2, 8) and ag_ok and rows_ok
        assert errors[0] and "symm" in errors[0], errors        # no torch op for gemm_all_reduce
        assert errors[1] and "'symm' cannot run: this torch has no" in errors[1], errors


def test_symm_wins_derived_from_both_timings():
    """A shape enters "symm_wins" only where torch's op beat both others in device time AND eagerly."""

    bench = _benchmark("bench_gemm_rs")
    fast = dict(symm=1.0, fused=1.1, seq=1.2)
    assert bench.symm_fastest(dict(fast, queued=dict(fast)))
    assert not bench.symm_fastest(dict(fast, queued=dict(fast, symm=1.15)))   # device time: fused faster
    assert not bench.symm_fastest(dict(fast, symm=None, queued=dict(fast)))   # not timed eagerly


def test_auto_table_sources_drop_the_runs_a_new_run_supersedes():
    """A rewritten auto table keeps an earlier source unless the new results re-ran its command
    on the same machine (``--out``, ``--configs``, ``--reps``, ``--tune`` aside: they do not
    change which shapes it measured); the new sources come last."""

    history = _benchmark("history")
    old_w4 = "vm: 4x H200, commit aaa, 2026-11-27, `torchrun --nproc_per_node=4 bench.py --reps 15 --out /a`"
    old_w2 = "vm: 2x H200, commit aaa, 2026-11-27, `torchrun --nproc_per_node=2 bench.py --reps 15 --out /a`"
    other = "vm: 4x H200, commit aaa, 2026-11-27, `torchrun --nproc_per_node=4 bench.py --shapes llama8b --out /a`"
    new_w4 = "vm: 4x H200, commit bbb, 2026-11-28, `torchrun --nproc_per_node=4 bench.py --reps 15 --out /b/results`"
    assert history.merged_sources([old_w4, old_w2, other], [new_w4]) == [old_w2, other, new_w4]
    assert history.merged_sources([new_w4], [new_w4]) == [new_w4]
    more_configs = "vm: 4x H200, commit ccc, 2026-11-29, `torchrun --nproc_per_node=4 bench.py --reps 10 --configs 1,3,14 --out /c`"
    assert history.merged_sources([old_w4, other], [more_configs]) == [other, more_configs]


def test_benchmark_tables_show_auto_against_the_best_alternative():
    """bench_gemm_rs / bench_ag_gemm time "auto" beside our fused kernel, torch's op and the unfused
    pair; the table's "best / auto" cell is the fastest of those three over auto (below 1: auto
    picked a slower one), and rows recorded before the column existed read n/a."""

    benches = {name: _benchmark(name) for name in ("bench_gemm_rs", "bench_ag_gemm")}
    times = dict(cublas=0.5, nccl_rs=0.4, nccl_ag=0.4, seq=1.2, symm=0.9, fused=1.0, auto=1.0, gemm_only=0.6,
                 p2p_rs=0.4, p2p_ag=0.4, kernel_w1=0.7, limit=0.5, speedup_vs_seq=1.2, speedup_vs_symm=0.9,
                 gemm_only_vs_cublas=0.8)
    times["auto_vs_best"] = benches["bench_gemm_rs"].auto_vs_best(times)
    assert times["auto_vs_best"] == pytest.approx(0.9)          # auto ran ours; torch's op was faster
    old = {k: v for k, v in times.items() if not k.startswith("auto")}
    rs = benches["bench_gemm_rs"]._table([dict(times, label="new", M=1, N=2, K_local=3, config="c"),
                                          dict(old, label="old", M=1, N=2, K_local=3, config="c")], lambda r: r)
    assert "| 1.200 | 0.900 | 1.000 | 1.000 | 0.90 |" in rs[2] and "| 1.000 | n/a | n/a |" in rs[3], rs
    ag = benches["bench_ag_gemm"]._table([dict(times, label="new", M=1, N=2, K=3)], lambda r: r, True)
    assert ag[0].count("|") == ag[2].count("|") and "| 1.000 | 0.90 |" in ag[2], ag


def test_gemm_reduce_scatter_refuses_an_out_it_cannot_write():
    """The fused kernels write [M / W, N] contiguous rows (the Gluon ones through a 2-D TMA
    descriptor): an ``out`` of another dtype, element count or memory order is refused with a
    clear error before the call begins (no epoch spent); one of the result's 3-D shape is taken."""
    from axedist.collectives.fused import FusedCall

    class Workspace:
        retired = False
        begun = 0

        def begin_call(self, op, timeout_s=None):
            self.begun += 1
            raise RuntimeError("stop here: the checks passed")

    workspace = Workspace()
    call = FusedCall(plan=None, world=2, rank=0, workspace_for=lambda nbytes: workspace)
    a = torch.zeros(2, 4, 16, dtype=torch.bfloat16)      # M = 8 rows, K = 16
    b = torch.zeros(16, 32, dtype=torch.bfloat16)
    for bad in (torch.zeros(4, 32), torch.zeros(4, 33, dtype=torch.bfloat16),
                torch.zeros(32, 4, dtype=torch.bfloat16).t(), torch.zeros(3, 32, dtype=torch.bfloat16)):
        with pytest.raises(ValueError, match=r"out must be a contiguous torch.bfloat16 tensor .* of \[4, 32\]"):
            call.run(a, b, out=bad)
    assert workspace.begun == 0
    for good in (torch.zeros(4, 32, dtype=torch.bfloat16), torch.zeros(1, 4, 32, dtype=torch.bfloat16)):
        with pytest.raises(RuntimeError, match="the checks passed"):
            call.run(a, b, out=good)
    assert workspace.begun == 2


# -- the skinny GEMM (decode products) ----------------------------------------------------------

def test_skinny_gemm_matches_a_float64_reference_under_the_interpreter():
    """kernels/skinny_gemm.py for 1, 3, 16 and 20 rows (the elementwise and the dot path), ragged and
    even N and K, contiguous and transposed weights, fp32 and a 16-bit type, against a float64
    product. The interpreter's tl.dot of bf16 returns garbage (Triton 3.6), so the dot path's
    16-bit case is fp16 here; bf16 runs on GPUs (tests_onegpu/test_skinny_gemm.py)."""
    _need_triton()
    script = textwrap.dedent("""
        import torch
        import tests.triton_interpreter  # the interpreter's loop bounds
        from axedist.kernels.skinny_gemm import SkinnyConfig, skinny_mm
        generator = torch.Generator().manual_seed(SEED)
        failures = []
        for rows, n, k in [(1, 40, 70), (1, 64, 1024), (3, 40, 70), (16, 64, 256), (20, 33, 129)]:
            half = torch.bfloat16 if rows == 1 else torch.float16
            for dtype, tolerance in ((torch.float32, 1e-5), (half, 2e-2)):
                for transposed in (True, False):
                    a = torch.randn(rows, k, generator=generator).to(dtype)
                    w = torch.randn(n, k, generator=generator).to(dtype)
                    b = w.t() if transposed else w.t().contiguous()
                    for config in (None, SkinnyConfig(16, 64, 4, 1), SkinnyConfig(8 if rows == 1 else 32, 32, 4, 2)):
                        out = skinny_mm(a, b, config=config)
                        reference = a.double() @ b.double()
                        error = ((out.double() - reference).norm() / reference.norm()).item()
                        if out.shape != (rows, n) or out.dtype != dtype or not error < tolerance:
                            failures.append((rows, n, k, dtype, transposed, config, error))
        print("FAILURES", failures) if failures else print("OK")
    """).replace("SEED", str(random.randrange(1 << 30)))
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=ROOT)
    result = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=600,
                            cwd=ROOT)
    assert result.returncode == 0 and "OK" in result.stdout, result.stdout + result.stderr


def test_skinny_gemm_compiles_for_hopper_with_vector_loads():
    """The decode tiles compile for sm_90a; with K innermost the weight's loads are 16-byte vectors
    (the kernel streams the weight: scalar loads would halve its bandwidth) and the dot path
    pipelines them (cp.async)."""
    _need_triton()
    from axedist.kernels.compile_check import compile_for_target
    from axedist.kernels.skinny_gemm import skinny_gemm_kernel
    signature = {name: "*bf16" for name in ("a_ptr", "b_ptr", "c_ptr")}
    signature.update({name: "i32" for name in ("M", "N", "K", "stride_am", "stride_ak", "stride_bk", "stride_bn",
                                               "stride_cm", "stride_cn")})
    for block_m, block_n, block_k, stages in [(1, 8, 512, 1), (16, 16, 128, 3), (64, 32, 256, 4)]:
        kernel = compile_for_target(skinny_gemm_kernel, signature,
                                    {"BLOCK_M": block_m, "BLOCK_N": block_n, "BLOCK_K": block_k,
                                     "DOT": block_m > 1, "EVEN": True, "K_INNER": True},
                                    ["a_ptr", "b_ptr", "c_ptr", "K", "stride_am", "stride_bn", "stride_cm"],
                                    90, num_warps=4, num_stages=stages)
        ptx = kernel.asm["ptx"]
        assert kernel.metadata.shared <= 227 * 1024
        if block_m == 1:
            assert "ld.global.v4" in ptx or "ld.global.nc.v4" in ptx, "scalar weight loads"
        else:
            assert "cp.async" in ptx and "mma" in ptx


def test_skinny_gemm_table_reads_as_written():
    """Every key of the shipped table is a table_key of its own sizes, every entry "cublas" or a
    config of four positive ints; skinny_config returns exactly the chosen ones (None for
    "cublas" and for shapes the table lacks), row counts in buckets 1 / 2-16 / 17-64; and
    smallest_chosen bounds every chosen entry of its bucket (infinite where it chose none)."""
    _need_triton()
    from axedist.kernels import skinny_gemm
    with open(os.path.join(ROOT, "axedist", "kernels", "skinny_tuned.json")) as f:
        table = json.load(f)
    assert table, "kernels/skinny_tuned.json is empty or missing"
    for key, entry in table.items():
        bucket, n, k = (int(part[1:]) for part in key.split("_"))
        least_n, least_k = skinny_gemm.smallest_chosen(bucket)
        assert key == skinny_gemm.table_key(bucket, n, k)
        for rows in {1: [1], 16: [2, 9, 16], 64: [17, 40, 64]}[bucket]:
            got = skinny_gemm.skinny_config(rows, n, k)
            if entry == "cublas":
                assert got is None, key
            else:
                assert len(entry) == 4 and all(isinstance(v, int) and v > 0 for v in entry), key
                assert tuple(got) == tuple(entry) and n >= least_n and k >= least_k, key
    assert skinny_gemm.skinny_config(1, 12345, 678) is None
    chose_64 = any(entry != "cublas" for key, entry in table.items() if key.startswith("M64_"))
    assert (skinny_gemm.smallest_chosen(64) == (float("inf"), float("inf"))) == (not chose_64)
