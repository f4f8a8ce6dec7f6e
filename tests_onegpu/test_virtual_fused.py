"""The fused GEMM + reduce-scatter kernel with W = 2, 4, 8 virtual ranks on one GPU.

The real per-rank path (fused.FusedCall: tuned or pinned tile config, workspace halves, epochs,
prepared replays from the third call of a shape on) against an fp32 reference: every mode (pull,
push, deferred release, TMA push), both B orientations (row-major [K, N] and nn.Linear's
weight.t()), the TMA and the masked-pointer paths, tails in every dimension, calls back to back,
and a rank that never arrives.
"""
import time

import pytest
import torch

from axedist.testing import VirtualRanks

# rows per rank, N, K: tails in every dim on the TMA path; strides TMA cannot describe (N * 2
# bytes not a multiple of 16: masked pointer loads); whole 128-row tiles (the TMA push path)
TAILS = (257, 1000, 520)
POINTER = (100, 300, 200)
WHOLE_TILES = (256, 768, 384)


def _configs():
    from axedist.kernels.gemm_rs import GemmConfig
    return {"pull": GemmConfig(),
            "push": GemmConfig(push=True),
            "defer_push": GemmConfig(push=True, defer_release=True),
            "tma_push": GemmConfig(push=True, defer_release=True, tma_push=True),
            "pipelined": GemmConfig(pipelined=True)}


def _inputs(world, rows, n, k, transposed, dtype=torch.bfloat16):
    as_, bs = [], []
    for _ in range(world):
        a = torch.randn(rows * world, k, device="cuda") / k ** 0.25
        b = torch.randn((n, k) if transposed else (k, n), device="cuda") / k ** 0.25
        as_.append(a.to(dtype))
        bs.append(b.to(dtype).t() if transposed else b.to(dtype))
    return as_, bs


def _failures(as_, bs, outs, label):
    world = len(as_)
    total = sum(a.float() @ b.float() for a, b in zip(as_, bs))
    rows = total.shape[0] // world
    failures = []
    for rank, out in enumerate(outs):
        ref = total[rank * rows:(rank + 1) * rows]
        if torch.isnan(out).any():
            failures.append(f"{label} rank {rank}: NaN (unwritten output)")
            continue
        error = ((out.float() - ref).norm() / ref.norm()).item()
        if not error <= 1e-2:
            failures.append(f"{label} rank {rank}: rel error {error:.2e}")
    return failures


def _poisoned(as_, bs):
    world = len(as_)
    return [torch.full((as_[0].shape[0] // world, bs[0].shape[1]), float("nan"),
                       dtype=as_[0].dtype, device="cuda") for _ in range(world)]


def _call(ranks, as_, bs, config, label, **kwargs):
    outs = ranks.gemm_reduce_scatter(as_, bs, _poisoned(as_, bs), config=config, **kwargs)
    ranks.check()
    return _failures(as_, bs, outs, label)


@pytest.mark.parametrize("world", [2, 4, 8])
def test_every_world_size_both_orientations(world, seed):
    ranks = VirtualRanks(world, 16 << 20)
    failures = []
    for transposed in (False, True):
        as_, bs = _inputs(world, *TAILS, transposed)
        failures += _call(ranks, as_, bs, _configs()["pull"], f"W={world} B^T={transposed} seed={seed}")
    assert not failures, failures


@pytest.mark.parametrize("mode", ["push", "defer_push", "tma_push"])
def test_every_mode_both_orientations(mode, seed):
    ranks = VirtualRanks(4, 16 << 20)
    shape = WHOLE_TILES if mode == "tma_push" else TAILS
    failures = []
    for transposed in (False, True):
        as_, bs = _inputs(4, *shape, transposed)
        failures += _call(ranks, as_, bs, _configs()[mode], f"{mode} B^T={transposed} seed={seed}")
    assert not failures, failures


@pytest.mark.parametrize("world", [2, 4, 8])
def test_pipelined_kernel_every_world_size(world, seed):
    """The Gluon kernel (pull, tiles assigned statically, loads one GEMM tile ahead): whole row
    tiles in both orientations, more tiles than programs (each program runs many GEMM and
    reduce tasks), fp16; and a shape it cannot take (a chunk of 257 rows) on the Triton kernel
    with the same config."""
    ranks = VirtualRanks(world, 64 << 20)
    config = _configs()["pipelined"]
    failures = []
    for shape in (WHOLE_TILES, (512, 2048, 1024)):
        for transposed in (False, True):
            as_, bs = _inputs(world, *shape, transposed)
            failures += _call(ranks, as_, bs, config, f"pipelined W={world} {shape} B^T={transposed} seed={seed}")
    as_, bs = _inputs(world, *WHOLE_TILES, False, torch.float16)
    failures += _call(ranks, as_, bs, config, f"pipelined fp16 W={world} seed={seed}")
    from axedist.kernels import gemm_rs
    assert "pipelined_gemm_reduce_scatter_kernel" in gemm_rs.cached_kernel_names()
    as_, bs = _inputs(world, *TAILS, True)
    failures += _call(ranks, as_, bs, config, f"pipelined config on the Triton kernel W={world} seed={seed}")
    assert not failures, failures


@pytest.mark.parametrize("world", [2, 4, 8])
def test_copy_engine_partials_every_world_size(world, seed):
    """/ce: the peers' partials move by copy engine, each comm chunk after a stream wait on its
    tiles' flag, then its flag copied. Tails and whole tiles (several groups and bands), both
    orientations, the pointer path; back to back without a sync mixed with push calls, three
    calls of a shape (the prepared launch); captured in a CUDA graph the call pushes, and
    replays and eager calls after the capture stay right."""
    from axedist.kernels.gemm_rs import GemmConfig
    config = GemmConfig(push=True, defer_release=True, engine=True)
    shapes = [(TAILS, (False, True)), (WHOLE_TILES, (False, True)), ((1024, 2048, 512), (False, True)),
              (POINTER, (False,))]
    _check_copy_engine(world, seed, config, shapes, TAILS, gluon=set())


@pytest.mark.parametrize("world", [2, 4, 8])
def test_gluon_copy_engine_partials_every_world_size(world, seed):
    """/gl/ce: the copy-engine kernel on the Gluon tile loop (tiles assigned statically, loads
    one tile ahead, TMA stores into the staging buffer and the output, a peer tile counted after
    the next tile's first wgmma, the peers' partials loaded by TMA): whole row tiles in both
    orientations with several groups and bands and more tiles than programs, a tail of tile
    columns and of K, fp16 too; a tail of rows (257 a chunk) on the Triton kernel with the same
    config; back to back, the prepared launch and the CUDA graph as the Triton kernel."""
    from axedist.kernels.gemm_rs import GemmConfig
    config = GemmConfig(stages=4, push=True, defer_release=True, pipelined=True, engine=True)
    shapes = [(WHOLE_TILES, (False, True)), ((1024, 2048, 512), (False, True)),
              ((512, 2048, 1024), (True,)), ((256, 1000, 520), (False,)), (TAILS, (True,))]
    _check_copy_engine(world, seed, config, shapes, WHOLE_TILES,
                       gluon={WHOLE_TILES, (1024, 2048, 512), (512, 2048, 1024), (256, 1000, 520)})
    ranks = VirtualRanks(world, 64 << 20, processors=_engine_processors(world))
    as_, bs = _inputs(world, *WHOLE_TILES, False, torch.float16)
    assert not _call(ranks, as_, bs, config, f"/gl/ce fp16 W={world} seed={seed}")
    assert all(call.replay.pipelined for call in ranks.last_plans)


@pytest.mark.parametrize("world", [2, 4])
def test_copy_engine_copies_as_one_cuda_graph_per_call(world, monkeypatch, seed):
    """AXEDIST_CE_GRAPHS=1: the /ce copies and stream waits captured once per epoch parity and
    launched as one graph a call (each wait takes its out flag down again): the Gluon and the
    Triton kernel, every check of the /gl/ce test (back to back mixed with push calls, the caller's
    CUDA graph capture, replays and eager calls after it)."""
    from axedist.kernels.gemm_rs import GemmConfig
    monkeypatch.setenv("AXEDIST_CE_GRAPHS", "1")
    config = GemmConfig(stages=4, push=True, defer_release=True, pipelined=True, engine=True)
    shapes = [(WHOLE_TILES, (False, True)), ((1024, 2048, 512), (True,)), (TAILS, (False, True))]
    _check_copy_engine(world, seed, config, shapes, WHOLE_TILES,
                       gluon={WHOLE_TILES, (1024, 2048, 512)}, graphs=True)


@pytest.mark.parametrize("world", [2, 4])
def test_copy_engine_copies_issued_one_by_one_where_no_graph_is_made(world, monkeypatch, seed):
    """With AXEDIST_CE_GRAPHS=1 where the driver cannot capture the /ce copies as a CUDA graph, a
    call issues them one by one: right results for both kernels back to back without a sync,
    mixed with push calls, both halves, and the reason kept."""
    from axedist.kernels import gemm_rs
    monkeypatch.setenv("AXEDIST_CE_GRAPHS", "1")

    def refuse(*args, **kwargs):
        raise RuntimeError("cudaStreamBeginCapture failed: refused by the test")
    monkeypatch.setattr(gemm_rs, "StreamGraph", refuse)
    ranks = VirtualRanks(world, 64 << 20, processors=_engine_processors(world))
    configs = [gemm_rs.GemmConfig(stages=4, push=True, defer_release=True, pipelined=True, engine=True),
               gemm_rs.GemmConfig(push=True, defer_release=True, engine=True), _configs()["defer_push"]]
    pending = []
    for call in range(9):
        as_, bs = _inputs(world, *WHOLE_TILES, transposed=call % 2 == 1)
        outs = ranks.gemm_reduce_scatter(as_, bs, _poisoned(as_, bs), config=configs[call % 3])
        pending.append((as_, bs, outs, f"call {call} ({configs[call % 3]}) W={world} seed={seed}"))
        if call % 3 != 2:
            assert all(c.replay.graphs == [] and "refused by the test" in c.replay.graph_error
                       for c in ranks.last_plans)
    ranks.check()
    assert not [f for as_, bs, outs, label in pending for f in _failures(as_, bs, outs, label)]


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("ahead", [-1, 0, 8])
def test_gluon_copy_engine_partial_loaded_at_any_step(world, ahead, monkeypatch, seed):
    """/gl/ce with an own tile's first partial half loaded after its main loop (-1), at its last
    K step (0), or as early as the count step allows (8 > the K steps of every shape here: the
    count step bounds it): whole tiles, a tail of K, three K steps (the fewest at 4 stages)."""
    from axedist.kernels import gemm_rs
    monkeypatch.setattr(gemm_rs, "ENGINE_PARTIAL_AHEAD", ahead)
    config = gemm_rs.GemmConfig(stages=4, push=True, defer_release=True, pipelined=True, engine=True)
    ranks = VirtualRanks(world, 64 << 20, processors=_engine_processors(world))
    failures = []
    for shape in ((1024, 2048, 512), (256, 1000, 520), (512, 2048, 192)):
        as_, bs = _inputs(world, *shape, False)
        failures += _call(ranks, as_, bs, config, f"/gl/ce ahead={ahead} W={world} {shape} seed={seed}")
        assert all(call.replay.pipelined for call in ranks.last_plans), shape
    assert not failures, failures


def _engine_processors(world):
    """Half the SMs left free (the driver may copy between two buffers of one GPU on SMs)."""
    from axedist.kernels.launch import multiprocessors
    return multiprocessors(0) // (2 * world)


def _check_copy_engine(world, seed, config, shapes, sequence_shape, gluon, graphs=False):
    """The /ce checks of one config: every shape in its orientations (the Gluon kernel ran for
    exactly the shapes in `gluon`; the copies as CUDA graphs exactly when `graphs`), calls back to
    back, replays and a CUDA graph capture."""
    from axedist.kernels.gemm_rs import EngineReduceScatter
    ranks = VirtualRanks(world, 64 << 20, processors=_engine_processors(world))
    label = f"{config} W={world} seed={seed}"
    failures = []
    for shape, orientations in shapes:
        for transposed in orientations:
            as_, bs = _inputs(world, *shape, transposed)
            failures += _call(ranks, as_, bs, config, f"{label} {shape} B^T={transposed}")
            assert all(isinstance(call.replay, EngineReduceScatter)
                       and call.replay.pipelined == (shape in gluon) for call in ranks.last_plans), shape
            # the copies and stream waits as one CUDA graph per parity (AXEDIST_CE_GRAPHS), else issued
            assert all((len(call.replay.graphs) == 2 and call.replay.graph_error is None) if graphs
                       else (call.replay.graphs == [] and "is off" in call.replay.graph_error)
                       for call in ranks.last_plans), [c.replay.graph_error for c in ranks.last_plans]
    pending = []
    for call in range(6):
        as_, bs = _inputs(world, *sequence_shape, transposed=call % 2 == 1)
        mode = config if call != 3 else _configs()["defer_push"]
        outs = ranks.gemm_reduce_scatter(as_, bs, _poisoned(as_, bs), config=mode)
        pending.append((as_, bs, outs, f"back to back call {call} ({mode}) {label}"))
    ranks.check()
    failures += [f for as_, bs, outs, label in pending for f in _failures(as_, bs, outs, label)]
    assert all(isinstance(call.replay, EngineReduceScatter) for call in ranks.last_plans)
    as_, bs = _inputs(world, *sequence_shape, True)
    outs = ranks.gemm_reduce_scatter(as_, bs, _poisoned(as_, bs), config=config)
    ranks.check()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        ranks.gemm_reduce_scatter(as_, bs, outs, config=config)
    for replay in range(3):
        fresh_as, fresh_bs = _inputs(world, *sequence_shape, True)
        for target, value in zip(as_ + bs, fresh_as + fresh_bs):
            target.copy_(value)
        for out in outs:
            out.fill_(float("nan"))
        graph.replay()
        ranks.check()
        failures += _failures(as_, bs, outs, f"replay {replay} {label}")
        eager_as, eager_bs = _inputs(world, *sequence_shape, False)
        failures += _call(ranks, eager_as, eager_bs, config, f"eager after replay {replay} {label}")
    assert not failures, failures


@pytest.mark.parametrize("mode", ["pull", "push"])
def test_masked_pointer_path(mode, seed):
    ranks = VirtualRanks(4, 16 << 20)
    as_, bs = _inputs(4, *POINTER, False)
    assert not _call(ranks, as_, bs, _configs()[mode], f"pointer {mode} seed={seed}")


def test_fp16(seed):
    ranks = VirtualRanks(2, 16 << 20)
    as_, bs = _inputs(2, *TAILS, False, torch.float16)
    assert not _call(ranks, as_, bs, _configs()["pull"], f"fp16 seed={seed}")


@pytest.mark.parametrize("mode", ["pull", "defer_push", "pipelined"])
def test_back_to_back_calls_alternate_halves_and_replay(mode, seed):
    """Twelve calls of three shapes, both orientations, queued with no host sync: epochs 1..12
    on the device, both workspace halves, and from the second call of a shape on the prepared
    replay (only operands and output refilled). Checked after the last call."""
    world = 4
    ranks = VirtualRanks(world, 16 << 20)
    shapes = [TAILS, (64, 512, 256), (128, 1024, 1024)]
    pending = []
    for call in range(12):
        as_, bs = _inputs(world, *shapes[call % 3], transposed=(call // 3) % 2 == 1)
        outs = ranks.gemm_reduce_scatter(as_, bs, _poisoned(as_, bs), config=_configs()[mode])
        pending.append((as_, bs, outs, f"call {call} {mode} seed={seed}"))
    ranks.check()
    assert [w.device_epoch() for w in ranks.workspaces] == [12] * world
    assert all(call.replay is not None for call in ranks.last_plans)
    failures = [f for as_, bs, outs, label in pending for f in _failures(as_, bs, outs, label)]
    assert not failures, failures


@pytest.mark.parametrize("mode", ["pull", "push", "pipelined"])
def test_a_rank_that_never_arrives_is_named_by_the_others(mode):
    world, missing, timeout_s = 4, 0, 1.0
    ranks = VirtualRanks(world, 16 << 20)
    as_, bs = _inputs(world, 128, 512, 256, False)
    config = _configs()[mode]
    ranks.gemm_reduce_scatter(as_, bs, config=config)
    ranks.check()
    start = time.perf_counter()
    ranks.gemm_reduce_scatter(as_, bs, config=config, absent=(missing,), timeout_s=timeout_s)
    messages = ranks.errors()
    elapsed = time.perf_counter() - start
    assert messages[missing] == ""
    for rank in range(world):
        if rank != missing:
            assert f"of rank {missing} " in messages[rank] and "gave up" in messages[rank], messages
    assert elapsed < timeout_s + 5.0, elapsed
