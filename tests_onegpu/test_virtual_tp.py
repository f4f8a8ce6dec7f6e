"""The fused all-gather + GEMM and GEMM + all-reduce kernels with W = 1, 2, 4, 8 virtual ranks on
one GPU, and every collective and fused kernel captured in a CUDA graph and replayed.

The real per-rank path (fused_tp.AllGatherGemmCall / GemmAllReduceCall: workspace, compiled
launch, device call state) against an fp32 reference: tails in every dimension, both B
orientations (row-major [K, N] and nn.Linear's weight.t()), the TMA and the masked-pointer
paths, one-shot / two-shot, push / pull, calls back to back, a rank that never arrives.
Outputs are poisoned with NaN before every call; inputs are fresh random values.
"""
import itertools
import time

import pytest
import torch

from axedist.testing import VirtualRanks

# rows per rank, N, K: tails everywhere on the TMA path; strides TMA cannot describe (K * 2 and
# N * 2 bytes not multiples of 16: masked pointer loads and stores)
AG_TAILS = (257, 1000, 520)
AG_POINTER = (100, 300, 100)
DECODE_ROWS = (1, 7, 64, 200, 256)


def _operands(count, rows, n, k, transposed, dtype=torch.bfloat16):
    as_, bs = [], []
    for _ in range(count):
        as_.append((torch.randn(rows, k, device="cuda") / k ** 0.25).to(dtype))
        b = (torch.randn((n, k) if transposed else (k, n), device="cuda") / k ** 0.25).to(dtype)
        bs.append(b.t() if transposed else b)
    return as_, bs


def _relative(out, ref):
    if torch.isnan(out).any():
        return float("nan")
    return ((out.float() - ref).norm() / ref.norm()).item()


def _ag_failures(as_, bs, outs, label):
    gathered = torch.cat([a.float() for a in as_])
    failures = []
    for rank, (b, out) in enumerate(zip(bs, outs)):
        error = _relative(out, gathered @ b.float())
        if not error <= 1e-2:
            failures.append(f"{label} rank {rank}: rel error {error:.2e} (nan: unwritten)")
    return failures


def _ar_failures(as_, bs, outs, label):
    total = sum(a.float() @ b.float() for a, b in zip(as_, bs))
    failures = []
    for rank, out in enumerate(outs):
        error = _relative(out, total)
        if not error <= 1e-2:
            failures.append(f"{label} rank {rank}: rel error {error:.2e} (nan: unwritten)")
    if not failures and not all(torch.equal(outs[0], out) for out in outs):
        failures.append(f"{label}: ranks' results differ (they must be bit-identical)")
    return failures


def _poison(rows, n, count, dtype=torch.bfloat16):
    return [torch.full((rows, n), float("nan"), dtype=dtype, device="cuda") for _ in range(count)]


def _all_gather_gemm(ranks, shape, transposed, label, dtype=torch.bfloat16):
    world = ranks.world
    rows, n, k = shape
    as_, bs = _operands(world, rows, n, k, transposed, dtype)
    outs = ranks.all_gather_gemm(as_, bs, _poison(world * rows, n, world, dtype))
    ranks.check()
    return _ag_failures(as_, bs, outs, label)


def _gemm_all_reduce(ranks, m, n, k, transposed, algorithm, push, label):
    world = ranks.world
    as_, bs = _operands(world, m, n, k, transposed)
    outs = ranks.gemm_all_reduce(as_, bs, _poison(m, n, world), algorithm=algorithm, push=push)
    ranks.check()
    return _ar_failures(as_, bs, outs, label)


@pytest.mark.parametrize("world", [1, 2, 4, 8])
def test_all_gather_gemm_every_world_size_both_orientations(world, seed):
    ranks = VirtualRanks(world, 16 << 20)
    failures = []
    for transposed in (False, True):
        failures += _all_gather_gemm(ranks, AG_TAILS, transposed, f"W={world} B^T={transposed} seed={seed}")
    assert not failures, failures


def test_all_gather_gemm_copies_the_gathered_rows_out(seed):
    """With gathered=, the kernel also writes the gathered A (what a linear layer's backward
    needs): exactly the concatenation, next to a right product, back to back."""
    world = 4
    ranks = VirtualRanks(world, 16 << 20)
    failures = []
    for call, transposed in enumerate((False, True, False)):
        as_, bs = _operands(world, *AG_TAILS, transposed)
        gathered = _poison(world * AG_TAILS[0], AG_TAILS[2], world)
        outs = ranks.all_gather_gemm(as_, bs, _poison(world * AG_TAILS[0], AG_TAILS[1], world),
                                     gathered=gathered)
        ranks.check()
        failures += _ag_failures(as_, bs, outs, f"call {call} seed={seed}")
        failures += [f"call {call} rank {r}: gathered A differs" for r, g in enumerate(gathered)
                     if not torch.equal(g, torch.cat(as_))]
    assert not failures, failures


def test_all_gather_gemm_pointer_path_fp16_and_small_tiles(seed):
    from axedist.kernels.ag_gemm import AllGatherGemmConfig
    ranks = VirtualRanks(4, 16 << 20)
    failures = _all_gather_gemm(ranks, AG_POINTER, False, f"pointer seed={seed}")
    failures += _all_gather_gemm(ranks, AG_TAILS, True, f"fp16 seed={seed}", torch.float16)
    world, (rows, n, k) = 4, (64, 512, 256)
    as_, bs = _operands(world, rows, n, k, True)
    config = AllGatherGemmConfig.parse("64x256x64/g8/s4/w4/c16x512/p3")
    outs = ranks.all_gather_gemm(as_, bs, _poison(world * rows, n, world), config=config)
    ranks.check()
    failures += _ag_failures(as_, bs, outs, f"{config} seed={seed}")
    assert not failures, failures


@pytest.mark.parametrize("world", [1, 2, 4, 8])
def test_pipelined_all_gather_gemm(world, seed):
    """The Gluon kernel (/gl: tasks assigned statically, a tile's loads issued during the last
    tile when its rows have arrived): tails and whole tiles, more tiles than programs, both
    orientations, the gathered rows copied out, and back to back with the Triton kernel."""
    from axedist.kernels.ag_gemm import AllGatherGemmConfig
    config = AllGatherGemmConfig(pipelined=True)
    ranks = VirtualRanks(world, 64 << 20)
    failures = []
    for shape in (AG_TAILS, (512, 2048, 1024)):
        for transposed in (False, True):
            as_, bs = _operands(world, *shape, transposed)
            outs = ranks.all_gather_gemm(as_, bs, _poison(world * shape[0], shape[1], world),
                                         config=config)
            ranks.check()
            failures += _ag_failures(as_, bs, outs, f"W={world} {shape} B^T={transposed} seed={seed}")
    # (the last shape's launches: whole row tiles, so the output leaves by TMA stores)
    assert all(launch.pipelined and launch.out_tma
               and launch.kernel.name == "pipelined_all_gather_gemm_kernel"
               for call in ranks.last_plans for launch in call.launches.values())
    as_, bs = _operands(world, *AG_TAILS, False)
    gathered = _poison(world * AG_TAILS[0], AG_TAILS[2], world)
    outs = ranks.all_gather_gemm(as_, bs, _poison(world * AG_TAILS[0], AG_TAILS[1], world),
                                 config=config, gathered=gathered)
    triton_as, triton_bs = _operands(world, *AG_TAILS, True)
    triton_outs = ranks.all_gather_gemm(triton_as, triton_bs,
                                        _poison(world * AG_TAILS[0], AG_TAILS[1], world))
    ranks.check()
    failures += _ag_failures(as_, bs, outs, f"copy-out W={world} seed={seed}")
    failures += [f"rank {r}: gathered A differs" for r, g in enumerate(gathered)
                 if not torch.equal(g, torch.cat(as_))]
    failures += _ag_failures(triton_as, triton_bs, triton_outs, f"Triton kernel after W={world} seed={seed}")
    assert not failures, failures


@pytest.mark.parametrize("gluon", [False, True])
@pytest.mark.parametrize("world", [2, 4, 8])
def test_copy_engine_all_gather_gemm(world, gluon, seed):
    """/ce: the rows move by copy engine beside the kernel (no push tasks), in chunks that each
    announce themselves by a flag; on the Triton kernel and on the Gluon one (/gl/ce: a peer
    tile waits for its chunk's flag, or its loads are issued during the tile before once the
    flag shows it arrived). Tails and whole tiles, 1 / 3 / 4 chunks, both orientations,
    the gathered rows copied out, calls back to back without a sync (both parities) and between
    calls of the push kernel on the same workspaces; captured in a CUDA graph the launch pushes
    instead, and replays and eager calls after the capture stay right. Half the SMs are left
    free: the driver may run a copy between two buffers of one GPU on SMs."""
    _check_copy_engine_all_gather_gemm(world, gluon, seed, graphs=False)


@pytest.mark.parametrize("gluon", [False, True])
@pytest.mark.parametrize("world", [2, 4])
def test_copy_engine_all_gather_gemm_copies_as_one_cuda_graph(world, gluon, monkeypatch, seed):
    """AXEDIST_CE_GRAPHS=1: a /ce call's copies captured once per epoch parity and launched as one
    graph a call, each row copy pointed at the call's A first (every call here has a fresh A):
    every check of the /ce test."""
    monkeypatch.setenv("AXEDIST_CE_GRAPHS", "1")
    _check_copy_engine_all_gather_gemm(world, gluon, seed, graphs=True)


def _check_copy_engine_all_gather_gemm(world, gluon, seed, graphs):
    """The /ce checks, with the copies as CUDA graphs exactly when `graphs`."""
    from axedist.kernels.ag_gemm import AllGatherGemmConfig
    import torch.cuda
    from axedist.kernels.launch import multiprocessors
    ranks = VirtualRanks(world, 64 << 20, processors=multiprocessors(0) // (2 * world))
    gl = "/gl" if gluon else ""
    configs = [AllGatherGemmConfig(engine=True, pipelined=gluon),
               AllGatherGemmConfig.parse(f"128x128x64/g8/s4/w8/c32x512/p3{gl}/ce"),
               AllGatherGemmConfig.parse(f"128x256x64/g8/s3/w8/c32x512/p1{gl}/ce")]
    failures = []
    for config, shape in itertools.product(configs, (AG_TAILS, (512, 2048, 1024))):
        for transposed in (False, True):
            as_, bs = _operands(world, *shape, transposed)
            outs = ranks.all_gather_gemm(as_, bs, _poison(world * shape[0], shape[1], world),
                                         config=config)
            failures += _ag_failures(as_, bs, outs, f"{config} W={world} {shape} B^T={transposed} seed={seed}")
        ranks.check()
    assert all(launch.engine and launch.pipelined == gluon
               for call in ranks.last_plans for launch in call.launches.values())
    assert all((len(launch.graphs) == 2) == graphs and (launch.graph_error is None) == graphs
               for call in ranks.last_plans for launch in call.launches.values()), \
        [launch.graph_error for call in ranks.last_plans for launch in call.launches.values()]
    # back to back, no sync: engine, push, engine with the rows copied out, engine
    pending = []
    for step, config in enumerate((configs[0], None, configs[1], configs[0])):
        as_, bs = _operands(world, *AG_TAILS, step % 2 == 0)
        gathered = _poison(world * AG_TAILS[0], AG_TAILS[2], world) if step == 2 else None
        outs = ranks.all_gather_gemm(as_, bs, _poison(world * AG_TAILS[0], AG_TAILS[1], world),
                                     config=config, gathered=gathered)
        pending.append((as_, bs, outs, gathered, f"back to back call {step} ({config})"))
    ranks.check()
    for as_, bs, outs, gathered, label in pending:
        failures += _ag_failures(as_, bs, outs, label)
        failures += [f"{label} rank {r}: gathered A differs" for r, g in enumerate(gathered or [])
                     if not torch.equal(g, torch.cat(as_))]
    # a CUDA graph: the captured call pushes; replays and later eager calls stay right
    as_, bs = _operands(world, *AG_TAILS, True)
    outs = ranks.all_gather_gemm(as_, bs, config=configs[0])
    ranks.check()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        ranks.all_gather_gemm(as_, bs, outs, config=configs[0])
    for replay in range(3):
        fresh_as, fresh_bs = _operands(world, *AG_TAILS, True)
        for target, value in zip(as_ + bs, fresh_as + fresh_bs):
            target.copy_(value)
        for out in outs:
            out.fill_(float("nan"))
        graph.replay()
        ranks.check()
        failures += _ag_failures(as_, bs, outs, f"replay {replay}")
        eager_as, eager_bs = _operands(world, *AG_TAILS, False)
        eager = ranks.all_gather_gemm(eager_as, eager_bs, config=configs[0])
        ranks.check()
        failures += _ag_failures(eager_as, eager_bs, eager, f"eager after replay {replay}")
    assert not failures, failures


def _stream_k_shapes(world, processors, config):
    """(M_LOCAL, N, K) whose last round runs as a stream-K tail on `processors` SMs per rank:
    one of whole tiles (TMA stores), one with row, column and K tails, and the one whose tail
    tiles take the most programs each (the owner adds the most partials)."""
    from axedist.kernels import schedule
    found = []
    for m, n, k in itertools.product((256, 300, 512, 2000, 2048), (1280, 2560, 3000, 4096),
                                     (1000, 2048)):
        tiles_m, tiles_n = -(-m // config.block_m), -(-n // config.block_n)
        tasks = schedule.ag_task_count(world, tiles_m, tiles_n, config.pieces, False, False)
        tail = schedule.stream_k_tiles(tasks, min(processors, tasks), tiles_m * tiles_n,
                                       -(-k // config.block_k), config.stages)
        if tail:
            found.append(((m, n, k), min(processors, tasks) / tail))
    whole = [shape for shape, _ in found if shape[0] % config.block_m == 0
             and shape[1] % config.block_n == 0]
    tails = [shape for shape, _ in found if shape[0] % config.block_m and shape[2] % config.block_k]
    most = max(found, key=lambda item: item[1])[0]
    return list(dict.fromkeys([whole[0], tails[0], most]))


@pytest.mark.parametrize("world", [1, 2, 4, 8])
def test_stream_k_tail_all_gather_gemm(world, seed):
    """The Gluon kernel's stream-K tail (the last round's tiles cut along K over every program,
    owners adding the others' fp32 partials): shapes that have one, at every world size, against
    the fp32 reference and the same kernel without the tail; then back to back, so the
    next call's epoch must not read the last call's partials."""
    from axedist.kernels.ag_gemm import AllGatherGemmConfig
    config = AllGatherGemmConfig(pipelined=True, stream_k=True)
    without = AllGatherGemmConfig(pipelined=True)
    ranks = VirtualRanks(world, 64 << 20)
    failures = []
    for shape in _stream_k_shapes(world, ranks.processors, config):
        for transposed in (False, True):
            as_, bs = _operands(world, *shape, transposed)
            outs = ranks.all_gather_gemm(as_, bs, _poison(world * shape[0], shape[1], world),
                                         config=config)
            tails = [launch.tail_tiles for call in ranks.last_plans
                     for launch in call.launches.values()]
            whole = ranks.all_gather_gemm(as_, bs, _poison(world * shape[0], shape[1], world),
                                          config=without)
            ranks.check()
            assert all(tails) and not any(launch.tail_tiles for call in ranks.last_plans
                                          for launch in call.launches.values()), (shape, tails)
            label = f"W={world} {shape} B^T={transposed} tail={tails[0]} seed={seed}"
            failures += _ag_failures(as_, bs, outs, label)
            failures += _ag_failures(as_, bs, whole, label + " without the tail")
            failures += [f"{label} rank {r}: the tail's result differs from the whole tiles' by {_relative(o, w):.1e}"
                         for r, (o, w) in enumerate(zip(outs, whole)) if not _relative(o, w) <= 1e-2]
    shape = _stream_k_shapes(world, ranks.processors, config)[0]
    operands = [_operands(world, *shape, False) for _ in range(3)]
    results = [ranks.all_gather_gemm(as_, bs, _poison(world * shape[0], shape[1], world),
                                     config=config) for as_, bs in operands]
    ranks.check()
    for index, ((as_, bs), outs) in enumerate(zip(operands, results)):
        failures += _ag_failures(as_, bs, outs, f"back to back call {index} W={world} {shape}")
    assert not failures, failures


@pytest.mark.parametrize("world", [1, 2, 4, 8])
def test_gemm_all_reduce_every_algorithm_and_decode_size(world, seed):
    ranks = VirtualRanks(world, 16 << 20)
    failures = []
    for index, m in enumerate(DECODE_ROWS):
        for algorithm, push in (("one_shot", True), ("two_shot", True), ("one_shot", False),
                                ("two_shot", False)):
            if world != 4 and (index + push) % 2:   # W = 4 takes every case, the others half
                continue
            transposed = (index + (algorithm == "two_shot")) % 2 == 0
            label = f"W={world} M={m} {algorithm} {'push' if push else 'pull'} B^T={transposed} seed={seed}"
            failures += _gemm_all_reduce(ranks, m, 1000, 520, transposed, algorithm, push, label)
    assert not failures, failures


def test_gemm_all_reduce_pointer_path(seed):
    ranks = VirtualRanks(2, 16 << 20)
    failures = []
    for algorithm in ("one_shot", "two_shot"):
        failures += _gemm_all_reduce(ranks, 5, 300, 100, False, algorithm, True, f"pointer {algorithm} seed={seed}")
    assert not failures, failures


def test_back_to_back_fused_calls_without_sync(seed):
    """Sixteen calls of both fused ops, shapes and orientations interleaved, queued with no host
    sync: the device epoch reaches 16 on every rank, halves alternate; every result checked
    after the last call."""
    world = 4
    ranks = VirtualRanks(world, 16 << 20)
    pending = []
    for call in range(16):
        transposed = call % 3 == 0
        if call % 2:
            as_, bs = _operands(world, *((64, 512, 256) if call % 4 == 1 else AG_TAILS), transposed)
            outs = ranks.all_gather_gemm(as_, bs, _poison(world * as_[0].shape[0], bs[0].shape[1], world))
            pending.append((_ag_failures, as_, bs, outs, f"call {call} all_gather_gemm seed={seed}"))
        else:
            m = DECODE_ROWS[call // 2 % len(DECODE_ROWS)]
            algorithm = ("one_shot", "two_shot")[call // 4 % 2]
            as_, bs = _operands(world, m, 1000, 520, transposed)
            outs = ranks.gemm_all_reduce(as_, bs, _poison(m, 1000, world), algorithm=algorithm)
            pending.append((_ar_failures, as_, bs, outs, f"call {call} gemm_all_reduce {algorithm} seed={seed}"))
    ranks.check()
    assert [w.device_epoch() for w in ranks.workspaces] == [16] * world
    failures = [f for check, as_, bs, outs, label in pending for f in check(as_, bs, outs, label)]
    assert not failures, failures


@pytest.mark.parametrize("op", ["all_gather_gemm", "gemm_all_reduce", "all_gather_gemm /gl"])
def test_a_rank_that_never_arrives_is_named_by_the_others(op):
    from axedist.kernels.ag_gemm import AllGatherGemmConfig
    world, missing, timeout_s = 4, 1, 1.0
    ranks = VirtualRanks(world, 16 << 20)
    as_, bs = _operands(world, 64, 512, 256, False)
    run = getattr(ranks, op.split()[0])
    if op.endswith("/gl"):
        run = (lambda run: lambda *args, **kwargs: run(
            *args, config=AllGatherGemmConfig(pipelined=True), **kwargs))(run)
    run(as_, bs)
    ranks.check()
    start = time.perf_counter()
    run(as_, bs, absent=(missing,), timeout_s=timeout_s)
    messages = ranks.errors()
    elapsed = time.perf_counter() - start
    assert messages[missing] == ""
    for rank in range(world):
        if rank != missing:
            assert f"of rank {missing} " in messages[rank] and "gave up" in messages[rank], messages
    assert elapsed < timeout_s + 5.0, elapsed


# -- CUDA graphs ------------------------------------------------------------------------------

def test_every_kernel_captured_in_a_cuda_graph_and_replayed(seed):
    """One graph holds a call of every collective and fused kernel of 4 virtual ranks (each
    rank's launches a branch). Replayed 12 times with fresh inputs copied into the captured
    buffers and poisoned outputs: every replay's results are right, so no replay reused an
    epoch or a half (a stale flag would let a rank read a half that is not yet written)."""
    from axedist.kernels.gemm_rs import GemmConfig
    world = 4
    ranks = VirtualRanks(world, 16 << 20)
    cases = {
        "gemm_all_reduce one_shot": lambda: _operands(world, 4, 1000, 520, True),
        "gemm_all_reduce two_shot pull": lambda: _operands(world, 200, 1000, 520, False),
        "all_gather_gemm": lambda: _operands(world, *AG_TAILS, True),
        "gemm_reduce_scatter": lambda: _operands(world, 4 * 257, 1000, 520, True),
    }
    inputs = {name: make() for name, make in cases.items()}
    xs = {op: [torch.randn(count, device="cuda").to(torch.bfloat16) for _ in range(world)]
          for op, count in (("reduce_scatter", world * 4097), ("all_gather", 4097),
                            ("all_reduce", 4097))}
    outs = {}

    def calls():
        a, b = inputs["gemm_all_reduce one_shot"]
        outs["gemm_all_reduce one_shot"] = ranks.gemm_all_reduce(a, b, outs.get("gemm_all_reduce one_shot"))
        a, b = inputs["gemm_all_reduce two_shot pull"]
        outs["gemm_all_reduce two_shot pull"] = ranks.gemm_all_reduce(
            a, b, outs.get("gemm_all_reduce two_shot pull"), algorithm="two_shot", push=False)
        a, b = inputs["all_gather_gemm"]
        outs["all_gather_gemm"] = ranks.all_gather_gemm(a, b, outs.get("all_gather_gemm"))
        a, b = inputs["gemm_reduce_scatter"]
        outs["gemm_reduce_scatter"] = ranks.gemm_reduce_scatter(
            a, b, outs.get("gemm_reduce_scatter"), config=GemmConfig(push=True, defer_release=True))
        outs["reduce_scatter"] = ranks.reduce_scatter(xs["reduce_scatter"], outs.get("reduce_scatter"))
        outs["all_gather"] = ranks.all_gather(xs["all_gather"], outs.get("all_gather"), variant="pull")
        outs["all_reduce"] = ranks.all_reduce(xs["all_reduce"], outs.get("all_reduce"), algorithm="two_shot")

    calls()            # eager: compiles and loads every kernel, allocates the outputs
    ranks.check()
    calls_per_replay = 7
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        calls()
    ranks.check()
    epochs = [w.device_epoch() for w in ranks.workspaces]
    failures = []
    for replay in range(12):
        for name, make in cases.items():
            fresh_as, fresh_bs = make()
            for target, value in zip(inputs[name][0] + inputs[name][1], fresh_as + fresh_bs):
                target.copy_(value)
        for values in xs.values():
            for x in values:
                x.copy_(torch.randn_like(x, dtype=torch.float32).to(x.dtype))
        for out_list in outs.values():
            for out in out_list:
                out.fill_(float("nan"))
        graph.replay()
        ranks.check()
        label = f"replay {replay} seed={seed}"
        failures += _ar_failures(*inputs["gemm_all_reduce one_shot"], outs["gemm_all_reduce one_shot"], f"{label} ar one_shot")
        failures += _ar_failures(*inputs["gemm_all_reduce two_shot pull"], outs["gemm_all_reduce two_shot pull"], f"{label} ar two_shot")
        failures += _ag_failures(*inputs["all_gather_gemm"], outs["all_gather_gemm"], f"{label} ag")
        a, b = inputs["gemm_reduce_scatter"]
        total = sum(x.float() @ y.float() for x, y in zip(a, b))
        for rank, out in enumerate(outs["gemm_reduce_scatter"]):
            error = _relative(out, total.chunk(world)[rank])
            if not error <= 1e-2:
                failures.append(f"{label} gemm_reduce_scatter rank {rank}: {error:.2e}")
        stacked = torch.stack([x.float() for x in xs["reduce_scatter"]]).sum(0)
        for rank, out in enumerate(outs["reduce_scatter"]):
            if not _relative(out, stacked.chunk(world)[rank]) <= 1e-2:
                failures.append(f"{label} reduce_scatter rank {rank}")
        gathered = torch.cat(xs["all_gather"])
        failures += [f"{label} all_gather rank {r}" for r, out in enumerate(outs["all_gather"])
                     if not torch.equal(out, gathered)]
        summed = torch.stack([x.float() for x in xs["all_reduce"]]).sum(0)
        failures += [f"{label} all_reduce rank {r}" for r, out in enumerate(outs["all_reduce"])
                     if not _relative(out, summed) <= 1e-2]
        if failures:
            break
    assert not failures, failures[:20]
    assert [w.device_epoch() for w in ranks.workspaces] == [e + 12 * calls_per_replay for e in epochs]
