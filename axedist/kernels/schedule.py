"""Task schedules of the fused kernels, in pure Python: GEMM + reduce-scatter (gemm_rs.py) and,
at the end, all-gather + GEMM (ag_gemm.py). Each kernel computes the same functions on the
device; the CPU tests check the two against each other and simulate the schedules for deadlock.

GEMM + reduce-scatter.

The partial C = A @ B ([M, N]) is cut into W row chunks of M / W rows; chunk c belongs to rank c.
Each chunk is tiled into `rounds` = tiles_m * tiles_n tiles of BM x BN. Every rank runs the same
global task order, claimed in order through an atomic counter:

    round q:  GEMM tile q of every chunk (W tasks; slot s computes chunk (rank + 1 + s) % W,
              so ranks write different chunks at once and every owner gets its tile q early),
              then the reduce task of round q - lag (this rank's chunk, tile q - lag)
    finally:  the reduce tasks of the last `lag` rounds.

Deadlock freedom: the reduce task of round j waits for GEMM tile j of this rank's chunk on every
rank, and every rank lists all GEMM tasks of round j before that reduce task. Take the waiting
reduce task with the lowest index k anywhere; it waits for a GEMM task g < k on some rank p. If
p's counter is <= g, all of p's busy programs wait on reduce tasks < g < k, which contradicts
minimality, so p has a free program that will claim g; otherwise g is claimed by a program that
never blocks. Either way the lowest waiting task makes progress, for any grid size and lag.

Example (W = 2, rounds = 3, lag = 1) on rank 0:
    G(c1,0) G(c0,0) | G(c1,1) G(c0,1) R(0) | G(c1,2) G(c0,2) R(1) | R(2)
"""
from __future__ import annotations

import math


def grouped_tile(index: int, tiles_m: int, tiles_n: int, group_m: int) -> tuple[int, int]:
    """(tile row, tile column) of tile `index` when rows are walked in groups of group_m
    (column-major inside a group, for L2 reuse of the B columns).

    >>> [grouped_tile(i, 3, 2, 2) for i in range(6)]
    [(0, 0), (1, 0), (0, 1), (1, 1), (2, 0), (2, 1)]
    """
    per_group = group_m * tiles_n
    group = index // per_group
    first_m = group * group_m
    size_m = min(tiles_m - first_m, group_m)
    within = index % per_group
    return first_m + within % size_m, within // size_m


def task_count(rounds: int, world: int, gemm_only: bool = False) -> int:
    return rounds * world if gemm_only else rounds * (world + 1)


def decode_task(task: int, rounds: int, lag: int, world: int) -> tuple[bool, int, int]:
    """(is_gemm, round, slot) of global task id `task` (see the module docstring)."""
    head = lag * world
    body = (rounds - lag) * (world + 1)
    if task < head:
        return True, task // world, task % world
    if task - head < body:
        step, slot = divmod(task - head, world + 1)
        if slot < world:
            return True, lag + step, slot
        return False, step, 0
    return False, rounds - lag + (task - head - body), 0


def gemm_chunk(rank: int, slot: int, world: int) -> int:
    """Chunk computed by GEMM slot `slot` of a round on `rank` (staggered across ranks)."""
    return (rank + 1 + slot) % world


def choose_lag(rounds: int, world: int, programs: int, waves: float = 1.5) -> int:
    """Rounds between a GEMM tile and its reduce task: about 1.5 waves of the grid (2.5 when
    flags are released one tile late), so that the tile is usually finished and released on
    every rank when its reduce task is claimed."""
    return min(rounds, math.ceil(waves * programs / (world + 1)))


def task_list(rank: int, world: int, rounds: int, lag: int) -> list[tuple[str, int, int]]:
    """The whole ordered task list of one rank: ("gemm", chunk, round) / ("reduce", chunk, round)."""
    tasks = []
    for task in range(task_count(rounds, world)):
        is_gemm, round_, slot = decode_task(task, rounds, lag, world)
        chunk = gemm_chunk(rank, slot, world) if is_gemm else rank
        tasks.append(("gemm" if is_gemm else "reduce", chunk, round_))
    return tasks


# -- all-gather + GEMM (ag_gemm.py's module docstring has the order and its deadlock argument) --

PUSH, TILE, COPY = 0, 1, 2  # the kinds of an all-gather + GEMM task


def ag_steps(world: int, multimem: bool) -> int:
    """Push steps of one rank's rows: one per peer, or one multimem store to every rank."""
    return 1 if multimem and world > 1 else world - 1


def ag_task_count(world: int, tiles_m: int, tiles_n: int, pieces: int, multimem: bool,
                  copy_out: bool) -> int:
    return (ag_steps(world, multimem) * tiles_m * pieces + world * tiles_m * tiles_n
            + (world * tiles_m * pieces if copy_out else 0))


def interleaved(task: int, pushes: int, others: int) -> tuple[bool, int]:
    """(is a push, index among its kind) of task `task` < pushes + others, the pushes spread
    evenly among the others (push i at about i * (pushes + others) / pushes)."""
    total = pushes + others
    before, through = task * pushes // total, (task + 1) * pushes // total
    return through > before, before if through > before else task - before


def ag_decode_task(task: int, rank: int, world: int, tiles_m: int, tiles_n: int, pieces: int,
                   multimem: bool, group_m: int) -> tuple[int, int, int, int]:
    """(kind, who, x, y) of task `task` on `rank`: (PUSH, peer, row block, piece) with peer -1
    for a multimem store to every rank; (TILE, source, tile row, tile column); (COPY, source,
    row block, piece)."""
    steps = ag_steps(world, multimem)
    per_source, step_pushes = tiles_m * tiles_n, tiles_m * pieces
    with_pushes = steps * (per_source + step_pushes)
    gemm_end = with_pushes + (world - steps) * per_source
    if task >= gemm_end:
        copy = task - gemm_end
        return COPY, (rank - copy // (pieces * tiles_m)) % world, copy // pieces % tiles_m, copy % pieces
    if task < with_pushes:
        segment, within = divmod(task, per_source + step_pushes)
        is_push, index = interleaved(within, step_pushes, per_source)
    else:
        segment, index = divmod(task - with_pushes, per_source)
        segment, is_push = segment + steps, False
    if is_push:
        return PUSH, -1 if multimem else (rank + 1 + segment) % world, index // pieces, index % pieces
    return (TILE, (rank - segment) % world, *grouped_tile(index, tiles_m, tiles_n, group_m))


def ag_task_list(rank: int, world: int, tiles_m: int, tiles_n: int, pieces: int, multimem: bool,
                 copy_out: bool, group_m: int = 8) -> list[tuple[int, int, int, int]]:
    """Every task of one rank in claim order, as ag_decode_task gives them."""
    return [ag_decode_task(task, rank, world, tiles_m, tiles_n, pieces, multimem, group_m)
            for task in range(ag_task_count(world, tiles_m, tiles_n, pieces, multimem, copy_out))]
