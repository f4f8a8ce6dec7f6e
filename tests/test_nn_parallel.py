"""Tensor-parallel styles against the plain layer: outputs, parameter and input gradients.

Each case builds a layer from a fresh seed in fp64 on every rank (the same values), runs it
plain as the reference, then parallelizes a copy on 2 and 4 gloo ranks and checks
``full_tensor()`` of the output and of every gradient against the reference. Shapes are
uneven on purpose (10 output features on 4 ranks: 3, 3, 3, 1), and every style is also given
as torch's own style object and with axedist Layouts instead of placements.
"""

import copy
import random

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import Partial, Replicate, Shard
from torch.distributed.tensor import parallel as torch_tp

from axedist.dtensor import DTensor, distribute
from axedist.layout import Layout, LayoutError
from axedist.mesh import DeviceMesh
from axedist.nn import (ColwiseParallel, PrepareModuleInput, PrepareModuleOutput, RowwiseParallel, SequenceParallel,
                        VocabParallelEmbedding, describe, from_torch_style, parallelize, parallelize_module,
                        vocab_parallel_cross_entropy)
from axedist.nn.llama import RMSNorm
from axedist.runtime import count_collectives
from axedist.testing import run_on_ranks

WORLDS = (2, 4)
TOL = dict(rtol=1e-10, atol=1e-10)


def seed() -> int:
    return random.randrange(2**31)


def piece(t: torch.Tensor, world: int, dim: int, rank: int) -> torch.Tensor:
    """``rank``'s Shard(dim) piece, as torch.chunk splits (ceil(n/W) each; the last ones short or empty)."""
    n = t.shape[dim]
    size = -(-n // world)
    start = min(rank * size, n)
    return t.narrow(dim, start, min(size, n - start))


def full(x):
    return x.full_tensor() if isinstance(x, DTensor) else x


def check_grads(ref: nn.Module, par: nn.Module, what: str):
    ref_params = dict(ref.named_parameters())
    for name, p in par.named_parameters():
        assert isinstance(p, DTensor), f"{what}: {name} is not a DTensor"
        assert p.grad is not None, f"{what}: {name} got no gradient"
        torch.testing.assert_close(full(p.grad), ref_params[name].grad, **TOL,
                                   msg=lambda m: f"{what}: grad of {name}: {m}")


def run_and_compare(ref, par, x_ref, x_par, weight, what, out_to_full=full):
    """Forward both, check outputs; backward ``(out * weight).sum()`` both, check grads."""
    y_ref = ref(x_ref)
    y_par = par(x_par)
    torch.testing.assert_close(out_to_full(y_par), y_ref, **TOL, msg=lambda m: f"{what}: output: {m}")
    (y_ref * weight).sum().backward()
    (out_to_full(y_par) * weight).sum().backward()
    check_grads(ref, par, what)
    return y_par


# --------------------------------------------------------------------------- column / row


def _colwise(rank, world, s, kind):
    torch.manual_seed(s)
    mesh = DeviceMesh("cpu", (world,))
    ref = nn.Linear(6, 10, dtype=torch.float64)
    x = torch.randn(3, 5, 6, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(3, 5, 10, dtype=torch.float64)
    par = copy.deepcopy(ref)
    style = {"ours": ColwiseParallel(), "torch": torch_tp.ColwiseParallel(use_local_output=False),
             "cyclic_weight": ColwiseParallel(weight_layout=lambda shape: Layout.parse(
                 f"S[({shape[0] // 2},2,{shape[1]}):({shape[1]},1@gpuid,1)]") if world == 2 else Shard(0))}[kind]
    parallelize(par, mesh, {"": style})
    assert par.weight.shape == (10, 6)
    if kind != "cyclic_weight":
        assert par.weight.placements == (Shard(0),) and par.bias.placements == (Shard(0),)
        assert par.weight.to_local().shape == piece(torch.empty(10, 6), world, 0, rank).shape
    x_par = x.detach().clone().requires_grad_(True)
    y = run_and_compare(ref, par, x, x_par, weight, f"colwise {kind}")
    assert y.placements == (Shard(2),), y
    if kind != "cyclic_weight":  # the GEMM itself gave Shard(-1): the output hook moved nothing
        assert "Shard(dim=2),) -> (Shard(dim=2),): nothing to move" in describe(par), describe(par)
    torch.testing.assert_close(x_par.grad, x.grad, **TOL)
    return True


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("kind", ["ours", "torch", "cyclic_weight"])
def test_colwise_linear(world, kind):
    assert run_on_ranks(_colwise, world, args=(seed(), kind)) == [True] * world


def _colwise_dealt(rank, world, s):
    """Output features dealt round-robin in pairs (``weight_layout``), output kept dealt the same
    way: the bias follows the weight's rows, the forward moves nothing; backward from a gradient
    in that layout never moves the weight and leaves its gradient in the weight's layout; values
    and gradients equal the one-process Linear's."""
    torch.manual_seed(s)
    mesh = DeviceMesh("cpu", (world,))
    n = 4 * world
    ref = nn.Linear(6, n, dtype=torch.float64)
    par = copy.deepcopy(ref)
    dealt = Layout.parse(f"S[(2,{world},2,6):(12,1@gpuid,6,1)]")
    out_layout = Layout.parse(f"S[(3,2,{world},2):(4,2,1@gpuid,1)]")
    parallelize(par, mesh, {"": ColwiseParallel(weight_layout=dealt, output_layouts=out_layout)})
    assert par.bias.axe_layout == Layout.parse(f"S[(2,{world},2):(2,1@gpuid,1)]"), par.bias.axe_layout
    x = torch.randn(3, 6, dtype=torch.float64, generator=torch.Generator().manual_seed(s + 1))
    with count_collectives() as seen:
        y = par(x)
    assert seen.calls == 0, str(seen)
    assert y.axe_layout == out_layout, y.axe_layout
    up = torch.randn(3, n, dtype=torch.float64, generator=torch.Generator().manual_seed(s + 2))
    torch.testing.assert_close(y.full_tensor(), ref(x), **TOL)
    x_ref, x_par = x.clone().requires_grad_(True), x.clone().requires_grad_(True)
    y, dup = par(x_par), distribute(up, mesh, out_layout)
    with count_collectives() as seen:
        y.backward(dup)
    with torch.no_grad():
        weight_views = {par.weight._spec, par.weight.t()._spec}
    assert weight_views.isdisjoint(r.src for r in seen.routes), str(seen)  # the weight never moved
    assert par.weight.grad.axe_layout == par.weight.axe_layout, par.weight.grad.axe_layout
    ref(x_ref).backward(up)
    check_grads(ref, par, "colwise dealt")
    torch.testing.assert_close(x_par.grad, x_ref.grad, **TOL)
    return True


@pytest.mark.parametrize("world", WORLDS)
def test_colwise_dealt_weight_moves_nothing_forward(world):
    assert run_on_ranks(_colwise_dealt, world, args=(seed(),)) == [True] * world


def _attention_heads_dealt(rank, world, s, repeat):
    """A Llama attention whose heads are dealt round-robin (key / value head j on device j % W, its
    ``repeat`` query heads with it: no placement says it): wq / wk / wv deal head-sized blocks of
    output features, wo the query heads' blocks of input features. The forward runs one collective,
    wo's all-reduce, as with heads in blocks (RoPE's tables broadcast over each device's own heads,
    grouped-query ``repeat_kv`` and attention run on them); no weight ever moves, forward or
    backward; output, input gradient and every weight gradient equal the one-process module's."""
    from axedist.nn.llama import Attention, LlamaConfig, rope_tables

    torch.manual_seed(s)
    mesh = DeviceMesh("cpu", (world,))
    kv_heads, d, length, batch = 2 * world, 4, 5, 2
    heads = kv_heads * repeat
    dim = heads * d
    cfg = LlamaConfig(vocab_size=16, dim=dim, n_layers=1, n_heads=heads, n_kv_heads=kv_heads, ffn_hidden=16,
                      max_seq_len=length)
    ref = Attention(cfg).double()
    par = copy.deepcopy(ref)
    q_rows = Layout.parse(f"S[(2,{world},{repeat},{d},{dim}):({repeat * d * dim},1@gpuid,{d * dim},{dim},1)]")
    kv_rows = Layout.parse(f"S[(2,{world},{d},{dim}):({d * dim},1@gpuid,{dim},1)]")
    q_out = Layout.parse(f"S[({length},{batch},2,{world},{repeat},{d}):"
                         f"({batch * 2 * repeat * d},{2 * repeat * d},{repeat * d},1@gpuid,{d},1)]")
    kv_out = Layout.parse(f"S[({length},{batch},2,{world},{d}):({batch * 2 * d},{2 * d},{d},1@gpuid,1)]")
    columns = Layout.parse(f"S[({dim},2,{world},{repeat},{d}):({2 * repeat * d},{repeat * d},1@gpuid,{d},1)]")
    plan = {"wq": ColwiseParallel(weight_layout=q_rows, output_layouts=q_out),
            "wk": ColwiseParallel(weight_layout=kv_rows, output_layouts=kv_out),
            "wv": ColwiseParallel(weight_layout=kv_rows, output_layouts=kv_out),
            "wo": RowwiseParallel(weight_layout=columns, input_layouts=q_out, desired_input_layouts=q_out,
                                  output_layouts=Replicate())}
    parallelize(par, mesh, plan)
    cos, sin = (t.double() for t in rope_tables(d, length, 10000.0))
    g = torch.Generator().manual_seed(s + 1)
    x = torch.randn(length, batch, dim, dtype=torch.float64, generator=g)
    up = torch.randn(length, batch, dim, dtype=torch.float64, generator=g)
    x_ref, x_par = x.clone().requires_grad_(True), x.clone().requires_grad_(True)
    tables = [distribute(t, mesh, [Replicate()]) for t in (cos, sin)]
    with count_collectives() as seen:
        y = par(x_par, *tables)
    # one collective: wo's all-reduce
    assert seen.calls == 1 and str(seen).startswith("reduce_scatter over gpuid + all_gather"), str(seen)
    y_ref = ref(x_ref, cos, sin)
    torch.testing.assert_close(y.full_tensor(), y_ref, **TOL)
    weights = set()
    with torch.no_grad():
        for p in par.parameters():
            weights |= {p._spec, p.t()._spec}
    with count_collectives() as seen:
        (y.full_tensor() * up).sum().backward()
    assert weights.isdisjoint(r.src for r in seen.routes), str(seen)  # no weight moved
    (y_ref * up).sum().backward()
    check_grads(ref, par, f"attention, heads dealt round-robin, {repeat} query heads per key head")
    torch.testing.assert_close(x_par.grad, x_ref.grad, **TOL)
    return True


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("repeat", [1, 2])
def test_attention_with_heads_dealt_round_robin_moves_only_its_output(world, repeat):
    assert run_on_ranks(_attention_heads_dealt, world, args=(seed(), repeat)) == [True] * world


def _rowwise(rank, world, s, output, seq, kind):
    torch.manual_seed(s)
    mesh = DeviceMesh("cpu", (world,))
    ref = nn.Linear(12, 7, dtype=torch.float64)            # a plain input is an even piece (torch's convention)
    x = torch.randn(seq, 3, 12, dtype=torch.float64)     # sequence-first [S, B, in]
    weight = torch.randn(seq, 3, 7, dtype=torch.float64)
    par = copy.deepcopy(ref)
    # "cyclic": sequence positions dealt round-robin to the ranks, a layout no placement expresses
    out_layout = {"replicate": Replicate(), "seq": Shard(0),
                  "cyclic": Layout.parse(f"S[({seq // world},{world},3,7):(21,1@gpuid,7,1)]")}[output]
    if kind == "torch":
        style = torch_tp.RowwiseParallel(output_layouts=out_layout, use_local_output=False)
    else:
        style = RowwiseParallel(output_layouts=out_layout)
    parallelize(par, mesh, {"": style})
    assert par.weight.placements == (Shard(1),) and par.bias.placements == (Replicate(),)
    # the input arrives as this rank's slice of the features (torch's convention for Shard(-1))
    x_local = piece(x, world, 2, rank).clone().requires_grad_(True)
    x.requires_grad_(True)
    y = run_and_compare(ref, par, x, x_local, weight, f"rowwise {output} S={seq}")
    if isinstance(out_layout, Layout):
        assert y.axe_layout == out_layout, y
    else:
        assert y.placements == (out_layout,), y
    torch.testing.assert_close(x_local.grad, piece(x.grad, world, 2, rank), **TOL)
    if output == "seq" and seq % world == 0:
        assert "reduce_scatter" in describe(par), describe(par)   # never an all-reduce, then a slice
    return True


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("output,seq", [("replicate", 5), ("seq", 8), ("seq", 6), ("cyclic", 8)])
def test_rowwise_linear(world, output, seq):
    assert run_on_ranks(_rowwise, world, args=(seed(), output, seq, "ours")) == [True] * world


def test_rowwise_linear_torch_style():
    assert run_on_ranks(_rowwise, 4, args=(seed(), "seq", 8, "torch")) == [True] * 4


def _mlp(rank, world, s, use_torch):
    torch.manual_seed(s)
    mesh = DeviceMesh("cpu", (world,))
    # 10 hidden features: uneven on 4 ranks, which DTensors carry; torch's local outputs in
    # between cannot (a plain local piece is read as an even shard, as in torch), so 12 there
    hidden = 12 if use_torch else 10
    ref = nn.Sequential(nn.Linear(6, hidden), nn.GELU(), nn.Linear(hidden, 6)).double()
    par = copy.deepcopy(ref)
    if use_torch:  # torch's defaults: local outputs in between, exactly as torch's TP
        plan = {"0": torch_tp.ColwiseParallel(), "2": torch_tp.RowwiseParallel()}
    else:
        plan = {"0": ColwiseParallel(), "2": RowwiseParallel()}
    parallelize(par, mesh, plan)
    x = torch.randn(4, 6, dtype=torch.float64)
    weight = torch.randn(4, 6, dtype=torch.float64)
    y = run_and_compare(ref, par, x, x, weight, f"mlp torch={use_torch}")
    if use_torch:
        assert not isinstance(y, DTensor)   # torch's RowwiseParallel returns the local (replicated) tensor
    else:
        assert y.placements == (Replicate(),)
    return True


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("use_torch", [False, True])
def test_colwise_then_rowwise_mlp(world, use_torch):
    assert run_on_ranks(_mlp, world, args=(seed(), use_torch)) == [True] * world


# --------------------------------------------------------------------------- embeddings and loss


def _embedding(rank, world, s, kind):
    torch.manual_seed(s)
    mesh = DeviceMesh("cpu", (world,))
    ref = nn.Embedding(10, 6, dtype=torch.float64)     # 10 rows: uneven on 4 ranks
    ids = torch.randint(0, 10, (8, 3))
    weight = torch.randn(8, 3, 6, dtype=torch.float64)
    par = copy.deepcopy(ref)
    style, placement = {
        "vocab": (VocabParallelEmbedding(), Replicate()),
        "vocab_seq": (VocabParallelEmbedding(output_layouts=Shard(0)), Shard(0)),
        "torch_rowwise": (torch_tp.RowwiseParallel(input_layouts=Replicate(), use_local_output=False), Replicate()),
        "colwise": (ColwiseParallel(), Shard(2)),
    }[kind]
    parallelize(par, mesh, {"": style})
    assert par.weight.placements == ((Shard(1),) if kind == "colwise" else (Shard(0),))
    y = run_and_compare(ref, par, ids, ids, weight, f"embedding {kind}")
    assert y.placements == (placement,)
    return True


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("kind", ["vocab", "vocab_seq", "torch_rowwise", "colwise"])
def test_embedding(world, kind):
    assert run_on_ranks(_embedding, world, args=(seed(), kind)) == [True] * world


def _loss(rank, world, s):
    torch.manual_seed(s)
    mesh = DeviceMesh("cpu", (world,))
    logits = torch.randn(5, 3, 10, dtype=torch.float64, requires_grad=True)   # 10 classes: uneven on 4
    targets = torch.randint(0, 10, (5, 3))
    want = F.cross_entropy(logits.reshape(-1, 10), targets.reshape(-1))
    want.backward()
    sharded = distribute(logits.detach(), mesh, [Shard(2)]).requires_grad_(True)
    got = vocab_parallel_cross_entropy(sharded, targets)
    torch.testing.assert_close(full(got), want, **TOL)
    full(got).backward()
    torch.testing.assert_close(full(sharded.grad), logits.grad, **TOL)
    assert sharded.grad.placements == (Shard(2),)   # the gradient stays sharded on the classes
    return True


@pytest.mark.parametrize("world", WORLDS)
def test_vocab_parallel_cross_entropy(world):
    assert run_on_ranks(_loss, world, args=(seed(),)) == [True] * world


# --------------------------------------------------------------------------- sequence parallel, prepare


def _sequence_parallel(rank, world, s, kind):
    torch.manual_seed(s)
    mesh = DeviceMesh("cpu", (world,))
    norm = RMSNorm(6) if kind != "layer_norm" else nn.LayerNorm(6)
    ref = norm.double()
    with torch.no_grad():
        for p in ref.parameters():
            p.add_(torch.randn_like(p))
    par = copy.deepcopy(ref)
    style = torch_tp.SequenceParallel(sequence_dim=0) if kind == "torch" else SequenceParallel(sequence_dim=0)
    parallelize(par, mesh, {"": style})
    x = torch.randn(8, 3, 6, dtype=torch.float64)
    weight = torch.randn(8, 3, 6, dtype=torch.float64)
    x_local = piece(x, world, 0, rank)   # a plain input is this rank's sequence slice
    y = run_and_compare(ref, par, x, x_local, weight, f"sequence parallel {kind}")
    assert y.placements == (Shard(0),)
    assert all(p.placements == (Replicate(),) for p in par.parameters())
    return True


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("kind", ["rms_norm", "layer_norm", "torch"])
def test_sequence_parallel_norm(world, kind):
    assert run_on_ranks(_sequence_parallel, world, args=(seed(), kind)) == [True] * world


class _Two(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(6, 6, dtype=torch.float64)

    def forward(self, x, scale, *, shift):
        return self.proj(x) * scale + shift, x


def _prepare(rank, world, s):
    torch.manual_seed(s)
    mesh = DeviceMesh("cpu", (world,))
    ref = _Two()
    par = copy.deepcopy(ref)
    cyclic = Layout.parse(f"S[({8 // world},{world},3,6):(18,1@gpuid,6,1)]")   # rows dealt round-robin
    parallelize(par, mesh, {
        "": PrepareModuleInput(input_layouts=(Shard(0), Replicate()), desired_input_layouts=(Replicate(), None),
                               input_kwarg_layouts={"shift": Replicate()},
                               desired_input_kwarg_layouts={"shift": Shard(1)}),
        "proj": ColwiseParallel(output_layouts=Replicate()),
    })
    par.register_forward_hook(lambda mod, args, out: (out[0].redistribute(cyclic), out[1]))
    x = torch.randn(8, 3, 6, dtype=torch.float64)
    scale, shift = torch.randn(6, dtype=torch.float64), torch.randn(3, 6, dtype=torch.float64)
    y_ref, _ = ref(x, scale, shift=shift)
    y, x_seen = par(piece(x, world, 0, rank), scale, shift=shift)
    assert isinstance(x_seen, DTensor) and x_seen.placements == (Replicate(),)
    assert y.axe_layout == cyclic
    torch.testing.assert_close(y.full_tensor(), y_ref, **TOL)
    # PrepareModuleOutput: a Replicate DTensor output brought to Shard(1), then handed out as local
    out_par = nn.Sequential(copy.deepcopy(ref.proj))
    parallelize(out_par, mesh, {"": PrepareModuleOutput(output_layouts=Replicate(), desired_output_layouts=Shard(1)),
                                "0": ColwiseParallel(output_layouts=Replicate())})
    local = out_par(x)
    assert not isinstance(local, DTensor)
    torch.testing.assert_close(local, piece(ref.proj(x), world, 1, rank), **TOL)
    return True


@pytest.mark.parametrize("world", WORLDS)
def test_prepare_module_input_output_with_layouts(world):
    assert run_on_ranks(_prepare, world, args=(seed(),)) == [True] * world


def _sub_mesh(rank, world, s):
    """A (dp, tp) = (2, 2) mesh: each dp row parallelizes over its own tp pair, on its own data."""
    torch.manual_seed(s)
    mesh = DeviceMesh("cpu", (2, 2), ("dp", "tp"))
    ref = nn.Sequential(nn.Linear(6, 10), nn.SiLU(), nn.Linear(10, 6)).double()
    par = copy.deepcopy(ref)
    with pytest.raises(ValueError, match="1-D"):
        parallelize(copy.deepcopy(ref), mesh, {"0": ColwiseParallel()})
    parallelize(par, mesh["tp"], {"0": ColwiseParallel(), "2": RowwiseParallel()})
    g = torch.Generator().manual_seed(s + mesh.coordinates()["dp"])
    x = torch.randn(5, 6, dtype=torch.float64, generator=g)
    weight = torch.randn(5, 6, dtype=torch.float64, generator=g)
    run_and_compare(ref, par, x, x, weight, "dp x tp sub-mesh")
    return True


def test_tp_on_a_sub_mesh_of_a_2x2_mesh():
    assert run_on_ranks(_sub_mesh, 4, args=(seed(),)) == [True] * 4


# --------------------------------------------------------------------------- errors and printing


def _errors(rank, world):
    mesh = DeviceMesh("cpu", (world,))
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 4))
    with pytest.raises(ValueError, match=r"\['layers\.\*'\] match no module"):
        parallelize(copy.deepcopy(model), mesh, {"layers.*": ColwiseParallel()})
    # torch's spelling warns as torch does, and lays out what the plan does name (torchtitan's Llama-3 plan
    # names attention.q_norm, which Llama-3's attention lacks)
    with pytest.warns(UserWarning, match=r"\['q_norm'\] match no module"):
        laid_out = parallelize_module(copy.deepcopy(model), mesh, {"0": torch_tp.ColwiseParallel(),
                                                                   "q_norm": torch_tp.SequenceParallel()})
    assert isinstance(laid_out[0].weight, DTensor) and not isinstance(laid_out[2].weight, DTensor)
    with pytest.raises(TypeError, match="ColwiseParallel applies to Linear or Embedding modules, got ReLU"):
        parallelize(copy.deepcopy(model), mesh, {"1": ColwiseParallel()})
    with pytest.raises(TypeError, match="plan's values must be axedist styles"):
        parallelize(copy.deepcopy(model), mesh, {"0": "colwise"})
    tied = nn.Sequential(nn.Embedding(8, 4), nn.Linear(4, 8, bias=False))
    tied[1].weight = tied[0].weight
    with pytest.raises(LayoutError, match="tied parameter"):
        parallelize(copy.deepcopy(tied), mesh, {"0": ColwiseParallel(), "1": ColwiseParallel()})
    both = parallelize(copy.deepcopy(tied), mesh, {"0": VocabParallelEmbedding(), "1": ColwiseParallel()})
    assert both[0].weight is both[1].weight and len(list(both.parameters())) == 1
    with pytest.raises(LayoutError, match="cannot be read as the layout"):
        bad = parallelize(copy.deepcopy(model), mesh, {"0": ColwiseParallel(
            input_layouts=Layout.parse(f"S[(2,{world},4):(4,1@gpuid,1)]"))})
        bad(torch.randn(2, 4))
    translated = from_torch_style(torch_tp.PrepareModuleInput(input_layouts=(Shard(0), None),
                                                               desired_input_layouts=(Replicate(), None)))
    assert isinstance(translated, PrepareModuleInput)
    assert (translated.input_layouts, translated.desired_input_layouts) == ((Shard(0), None), (Replicate(), None))
    translated = from_torch_style(torch_tp.RowwiseParallel(output_layouts=Shard(0)))
    assert translated.output_layouts == Shard(0) and translated.use_local_output is True
    text = repr(ColwiseParallel(output_layouts=Shard(0)))
    assert text.startswith("ColwiseParallel(") and "Shard(dim=0)" in text
    par = parallelize(copy.deepcopy(model), mesh, {"0": ColwiseParallel(), "2": RowwiseParallel()})
    par(torch.randn(3, 4))
    report = describe(par)
    assert "0  ColwiseParallel" in report and "weight  float32[8, 4]  (Shard(dim=0),)" in report
    assert "output [3, 4] (Partial(sum),) -> (Replicate(),): " in report, report
    assert "forward ran: no collectives" in report and "all_gather over gpuid: 1 call" in report, report
    # every collective of a layer's first forward is listed, the ops' own included. A weight whose
    # rows are dealt round-robin (no placement says that) times a replicated input keeps its
    # column map (the bias is laid out the same way): only the output moves
    torch.manual_seed(5)   # the same values on every rank (model's differ: parallelize sends rank 0's)
    ref = nn.Linear(4, 8)
    dealt = Layout.parse(f"S[({8 // world},{world},4):(4,1@gpuid,1)]")
    cyclic = nn.Sequential(copy.deepcopy(ref))
    parallelize(cyclic, mesh, {"0": ColwiseParallel(weight_layout=dealt, output_layouts=Replicate())})
    x = torch.randn(3, 4, generator=torch.Generator().manual_seed(7))
    with count_collectives() as seen:
        y = cyclic(x)
    torch.testing.assert_close(y.full_tensor(), ref(x))
    line = f"forward ran: {'; '.join(str(seen).splitlines())}"
    assert seen.calls == 1 and line in describe(cyclic), (line, describe(cyclic))
    assert "moves parameter" not in report + describe(cyclic), describe(cyclic)
    # an output of the same shape and layout as the weight's transpose (M = K) is not the weight
    square = nn.Sequential(copy.deepcopy(ref))
    parallelize(square, mesh, {"0": ColwiseParallel(weight_layout=dealt, output_layouts=Replicate())})
    square(torch.randn(4, 4))
    assert "forward ran: all_gather" in describe(square) and "moves parameter" not in describe(square), \
        describe(square)
    # with rows-sharded input its product cannot take that weight: it moves on every forward
    rows_in = nn.Sequential(copy.deepcopy(ref))
    parallelize(rows_in, mesh, {"0": ColwiseParallel(weight_layout=dealt, input_layouts=Shard(0),
                                                      desired_input_layouts=Shard(0), output_layouts=Replicate())})
    x = torch.randn(2 * world, 4, generator=torch.Generator().manual_seed(8))
    y = rows_in(x[rank * 2:rank * 2 + 2])
    torch.testing.assert_close(y.full_tensor(), ref(x))
    assert "moves parameters weight, bias on every forward" in describe(rows_in), describe(rows_in)
    assert "not counted" not in report + describe(cyclic) + describe(rows_in)
    cyclic(x[:3])
    assert describe(cyclic).count("forward ran") == 1   # the first forward's, once
    return True


@pytest.mark.parametrize("world", WORLDS)
def test_errors_and_describe(world):
    assert run_on_ranks(_errors, world) == [True] * world
