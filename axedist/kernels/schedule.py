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

# Copy-engine rows (ag_gemm's "/ce" configs). The rows of a source arrive in `pieces` chunks of
# whole row blocks, each moved by the source's copy engine and followed by a copy of a flag word.
# Those flags sit in a region of their own at the end of the workspace's flag array: per epoch
# parity, per source, ENGINE_CHUNKS words (a fixed stride, so calls of different shapes never
# share a word across parities).
ENGINE_CHUNKS = 64
ENGINE_FLAGS = 2 * 8 * ENGINE_CHUNKS
COPY_STREAMS = 2  # side streams a workspace keeps for the copy-engine transfers (copy_streams)


def engine_flag(parity: int, source: int, chunk: int) -> int:
    """Index, within the copy-engine flag region, of the flag of `chunk` of `source`'s rows in
    calls of epoch parity `parity`.

    >>> engine_flag(1, 2, 3)
    643
    """
    return (parity * 8 + source) * ENGINE_CHUNKS + chunk


def engine_chunks(tiles_m: int, pieces: int) -> tuple[int, int]:
    """(row blocks per chunk, chunks) of one source's rows copied in about `pieces` chunks.

    >>> engine_chunks(10, 4)     # chunks of 3, 3, 3 and 1 row blocks
    (3, 4)
    """
    per_chunk = -(-tiles_m // min(max(pieces, 1), tiles_m))
    return per_chunk, -(-tiles_m // per_chunk)


def ag_steps(world: int, multimem: bool) -> int:
    """Push steps of one rank's rows: one per peer, or one multimem store to every rank."""
    return 1 if multimem and world > 1 else world - 1


def ag_task_count(world: int, tiles_m: int, tiles_n: int, pieces: int, multimem: bool,
                  copy_out: bool, engine: bool = False) -> int:
    """engine: the rows move by copy engine, outside the kernel (no push tasks)."""
    pushes = 0 if engine else ag_steps(world, multimem) * tiles_m * pieces
    return pushes + world * tiles_m * tiles_n + (world * tiles_m * pieces if copy_out else 0)


def interleaved(task: int, pushes: int, others: int) -> tuple[bool, int]:
    """(is a push, index among its kind) of task `task` < pushes + others, the pushes spread
    evenly among the others (push i at about i * (pushes + others) / pushes)."""
    total = pushes + others
    before, through = task * pushes // total, (task + 1) * pushes // total
    return through > before, before if through > before else task - before


def ag_decode_task(task: int, rank: int, world: int, tiles_m: int, tiles_n: int, pieces: int,
                   multimem: bool, group_m: int, engine: bool = False) -> tuple[int, int, int, int]:
    """(kind, who, x, y) of task `task` on `rank`: (PUSH, peer, row block, piece) with peer -1
    for a multimem store to every rank; (TILE, source, tile row, tile column); (COPY, source,
    row block, piece). engine: no push tasks, the tiles in the same segments."""
    steps = ag_steps(world, multimem)
    per_source, step_pushes = tiles_m * tiles_n, 0 if engine else tiles_m * pieces
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
                 copy_out: bool, group_m: int = 8,
                 engine: bool = False) -> list[tuple[int, int, int, int]]:
    """Every task of one rank in claim order, as ag_decode_task gives them."""
    count = ag_task_count(world, tiles_m, tiles_n, pieces, multimem, copy_out, engine)
    return [ag_decode_task(task, rank, world, tiles_m, tiles_n, pieces, multimem, group_m, engine)
            for task in range(count)]


# The stream-K tail of the statically assigned all-gather + GEMM (ag_gemm's Gluon kernel).
#
# Programs run tasks p, p + P, ...; when the task count is not a multiple of P, the last round
# has r = tasks % P tasks, and P - r programs idle through it: 448 tiles of 128 x 256 on 132 SMs
# take 4 tile times where 3.39 would do (2048 x 7168 x 8192: 0.86 of cuBLAS). Instead the last r
# tasks (tiles of the last source) are cut into their r * k_tiles K steps, spread evenly over all
# P programs: program p runs steps [p * U // P, (p + 1) * U // P) of U = r * k_tiles, at most two
# segments (a share is at most one tile's K steps). A segment that starts inside a tile is the
# program's FIRST segment: it leaves its fp32 sum in the program's partial slot and releases the
# program's flag. A segment that starts at a tile's K step 0 makes its program the tile's owner:
# it adds the partials of the later programs that cover the rest of the tile, then stores the
# tile. Owners wait only for other programs' first segments, which wait for nothing but their
# rows, so the tail cannot deadlock. Example (r = 2 tiles, k_tiles = 4, P = 3: U = 8):
#     program 0: tile 0 steps 0..1 (owner: adds program 1's partial)
#     program 1: tile 0 steps 2..3 (partial), tile 1 step 0 (owner: adds program 2's partial)
#     program 2: tile 1 steps 1..3 (partial)


def stream_k_tiles(tasks: int, programs: int, last_source_tiles: int, k_tiles: int,
                   stages: int) -> int:
    """The tasks of the last round that run as the stream-K tail, 0 for none: where the round
    is partial, holds only tiles of the last source, leaves at least a quarter of the grid
    idle, and gives every program at least `stages` K steps.

    >>> stream_k_tiles(448, 132, 448, 128, 4)   # 2048 x 7168 x 8192 in 128 x 256 tiles
    52
    >>> stream_k_tiles(512, 132, 512, 128, 4)   # 116 of 132 busy in the last round: kept whole
    0
    """
    r = tasks % programs
    if r == 0 or r > last_source_tiles or 4 * r > 3 * programs or r * k_tiles < programs * stages:
        return 0
    return r


def stream_k_segments(program: int, programs: int, tiles: int,
                      k_tiles: int) -> list[tuple[int, int, int, bool, int]]:
    """Program `program`'s segments of a stream-K tail of `tiles` tiles, in the order it runs
    them: (tail tile, first K step, end K step, owner, end of the programs whose partials the
    owner adds: programs + 1 .. that end - 1). Every program must have a step: an owner waits
    for the flag of every later program that starts inside its tile."""
    units = tiles * k_tiles
    if units < programs:
        raise ValueError(f"a stream-K tail of {units} K steps leaves some of {programs} programs "
                         f"without one")
    begin, end = program * units // programs, (program + 1) * units // programs
    segments = []
    while begin < end:
        tile = begin // k_tiles
        first, last = begin - tile * k_tiles, min(end - tile * k_tiles, k_tiles)
        owner = first == 0
        helpers_end = min(programs, -(-(tile + 1) * k_tiles * programs // units)) if owner else 0
        segments.append((tile, first, last, owner, helpers_end))
        begin = tile * k_tiles + last
    return segments
