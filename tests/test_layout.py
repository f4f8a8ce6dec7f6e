"""The layout algebra against brute-force enumeration of the map, plus DESIGN §1's worked examples.

The reference ``brute`` below is written from the definition alone
(``L(x) = {D(x) + r + O}``, digits of x last-fastest), independently of
``axedist.layout``'s own evaluation code.
"""

import itertools
import math

import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

import axedist as ax
from tests.reference import brute_points
from axedist.layout import Iter, Layout, LayoutError, direct_sum, tile, tile_quotient

AXES = ("m", "gpuid", "lane")


def point(coords: dict) -> tuple:
    """A coordinate, with zero entries dropped, so layouts naming different axes compare."""
    return tuple(sorted((a, v) for a, v in coords.items() if v != 0))


def brute(layout: Layout) -> list[frozenset]:
    """``[L(x) for x]`` from the definition, as sets of points."""
    return [frozenset(point(p) for p in points) for points in brute_points(layout)]


def same_map(a: Layout, b: Layout) -> bool:
    return brute(a) == brute(b)


# -- strategies -----------------------------------------------------------------

iters = st.builds(
    Iter,
    extent=st.integers(1, 4),
    stride=st.integers(-6, 6).filter(bool),
    axis=st.sampled_from(AXES),
)
positive_iters = st.builds(Iter, extent=st.integers(1, 4), stride=st.integers(1, 8), axis=st.sampled_from(AXES))


@st.composite
def layouts(draw, max_shard=4, max_replica=2, shard=iters):
    d = draw(st.lists(shard, max_size=max_shard))
    r = draw(st.lists(iters, max_size=max_replica))
    o = draw(st.dictionaries(st.sampled_from(AXES), st.integers(-5, 5), max_size=2))
    return Layout(d, r, o)


def factorizations(n: int) -> st.SearchStrategy:
    """Shapes (tuples of ints >= 1) whose product is n."""
    divisors = [d for d in range(1, n + 1) if n % d == 0]

    @st.composite
    def build(draw):
        shape, rest = [], n
        for _ in range(draw(st.integers(0, 3))):
            d = draw(st.sampled_from([d for d in divisors if rest % d == 0]))
            shape.append(d)
            rest //= d
        shape.append(rest)
        return tuple(draw(st.permutations(shape)))

    return build()


@st.composite
def rewrite(draw, layout: Layout) -> Layout:
    """A different way to write the same map: split iters, add unit iters, shuffle and flip replicas."""
    shard = []
    for it in layout.shard:
        if draw(st.booleans()):
            shard.append(Iter(1, draw(st.integers(1, 5)), draw(st.sampled_from(AXES))))
        factors = [f for f in range(1, it.extent + 1) if it.extent % f == 0]
        f = draw(st.sampled_from(factors))
        shard += [Iter(f, it.stride * (it.extent // f), it.axis), Iter(it.extent // f, it.stride, it.axis)]
    offset = layout.offset
    replica = []
    for it in layout.replica:
        if draw(st.booleans()):  # the same set, walked downward from its top
            offset[it.axis] = offset.get(it.axis, 0) + it.stride * (it.extent - 1)
            it = Iter(it.extent, -it.stride, it.axis)
        replica.append(it)
    replica = draw(st.permutations(replica)) if replica else []
    if draw(st.booleans()):  # a zero offset changes nothing
        offset.setdefault(draw(st.sampled_from(AXES)), 0)
    return Layout(shard, replica, offset)


# -- DESIGN §1 worked examples ------------------------------------------------------


def test_worked_example_apply():
    L = Layout.parse("S[(8,2,4,2):(4@lane,1@warp,1@lane,1)] + R[2:4@warp] + 5@warp")
    assert L.size == 128 and L.admits((8, 16))
    assert L.apply((7, 15), shape=(8, 16)) == [{"lane": 31, "warp": 6, "m": 1}, {"lane": 31, "warp": 10, "m": 1}]
    for i, j in itertools.product(range(8), range(16)):  # the closed form given in DESIGN
        want = [{"lane": 4 * i + (j // 2) % 4, "warp": j // 8 + 5 + 4 * r, "m": j % 2} for r in (0, 1)]
        assert L.apply((i, j), shape=(8, 16)) == want


def test_worked_example_canonicalize():
    assert str(Layout.parse("S[(8,4):(4@lane,1@lane)]").canonicalize()) == "S[32:1@lane]"
    assert str(Layout.parse("S[(8,2,3,6):(6,18,6,1)]").canonicalize()) == "S[(8,36):(6,1)]"


def test_worked_example_tile_and_inverse():
    A, B = Layout.parse("(2,3):(3,1)"), Layout.parse("(8,8):(8,1)")
    assert B.span("m") == 64
    T = tile(A, B, (2, 3), (8, 8))
    assert str(T) == "S[(2,8,3,8):(192,8,64,1)]"
    for i, j in itertools.product(range(16), range(24)):  # a 16x24 matrix as 2x3 tiles of 8x8
        tile_start = (i // 8) * 192 + (j // 8) * 64
        assert T.apply((i, j), shape=(16, 24)) == [{"m": tile_start + (i % 8) * 8 + j % 8}]
    assert tile_quotient(T, B, (16, 24), (8, 8)) == A


def test_worked_example_slice():
    L = Layout.parse("(2,8,3,8):(192,8,64,1)")
    S = L.slice((16, 24), (0, 8), (8, 24))
    assert str(S) == "S[(8,2,8):(8,64,1)] + 64@m"


def test_design_dtensor_examples_are_injective_layouts():
    assert Layout.parse("S[(4,2,6):(1@gpuid,6,1)]").is_injective()
    assert Layout.parse("S[(8,6):(6,1)] + R[4:1@gpuid]").is_injective()
    assert Layout.parse("S[(2,4,2,3):(1@x,3,1@y,1)]").is_injective()


# -- notation ---------------------------------------------------------------------------


@given(layouts())
def test_print_parse_round_trip(L):
    text = str(L)
    again = Layout.parse(text)
    assert again.same_notation(L)
    assert str(again) == text


@pytest.mark.parametrize(
    "text",
    [
        "S[(8,2,4,2):(4@lane,1@warp,1@lane,1)] + R[2:4@warp] + 5@warp",
        "S[32:1@lane]",
        "S[(4,2,6):(1@gpuid,6,1)]",
        "S[(8,6):(6,1)] + R[4:1@gpuid]",
        "S[(2,2):(-3,2)] + 4@m",
        "S[8:-1] + R[(2,3):(1@x,2@y)] - 3@x + 0@y",
        "S[():()]",
    ],
)
def test_round_trip_examples(text):
    assert str(Layout.parse(text)) == text


def test_parse_accepts_bare_shard_and_plain_memory_offsets():
    assert Layout.parse("(8,2,8):(8,64,1) + 64").same_notation(Layout([(8, 8), (2, 64), (8, 1)], (), {"m": 64}))
    assert Layout.parse(" S[ 4 : 2@gpuid ]+R[2:1]  -  1@gpuid ").same_notation(
        Layout([Iter(4, 2, "gpuid")], [Iter(2, 1)], {"gpuid": -1})
    )


@pytest.mark.parametrize(
    "text, position, expected",
    [
        ("S[(8,2):(1)]", 2, "as many strides as extents"),
        ("S[8:1@]", 6, "an axis name"),
        ("S[8:1] 3", 7, "'+', '-' or the end"),
        ("S[8:]", 4, "an integer"),
        ("S[(8,2:(1,1)]", 6, "')'"),
        ("S[8:1] + 2@x + 3@x", 15, "each axis in the offset once"),
        ("S[8:1] + 2@x + R[2:1]", 15, "R[...] once"),
        ("", 0, "an integer"),
    ],
)
def test_parse_errors_name_position_and_expectation(text, position, expected):
    with pytest.raises(ValueError) as err:
        Layout.parse(text)
    assert f"position {position}" in str(err.value) and expected in str(err.value)


@pytest.mark.parametrize(
    "make, message",
    [
        (lambda: Iter(0, 1), "extent must be > 0"),
        (lambda: Iter(-2, 1), "extent must be > 0"),
        (lambda: Iter(4, 0), "stride must be != 0"),
        (lambda: Iter(4, 1, ""), "axis must be a non-empty name"),
        (lambda: Iter(4.0, 1), "must be an int"),
        (lambda: Layout.parse("S[0:1]"), "extent must be > 0"),
        (lambda: Layout.parse("S[4:0@gpuid]"), "stride must be != 0"),
        (lambda: Layout([Iter(2, 1)], offset=[("m", 1), ("m", 2)]), "twice"),
    ],
)
def test_bad_iters_and_layouts(make, message):
    with pytest.raises(LayoutError, match=message):
        make()


def test_layout_is_immutable_and_hashable():
    L = Layout.parse("S[4:1@gpuid]")
    with pytest.raises(AttributeError):
        L.shard = ()
    with pytest.raises(Exception):
        L.shard[0].extent = 3
    assert len({L, Layout.parse("S[(2,2):(2@gpuid,1@gpuid)]")}) == 1


# -- the map --------------------------------------------------------------------------


@given(layouts())
def test_apply_matches_definition(L):
    want = brute(L)
    for x in range(L.size):
        got = L.apply(x)
        assert frozenset(point(p) for p in got) == want[x]
        assert len({point(p) for p in got}) == len(got)  # L(x) is a set: no repeats
        assert all(set(p) == set(L.axes) for p in got)


@given(layouts(), st.data())
def test_apply_tuple_index_is_row_major(L, data):
    shape = data.draw(factorizations(L.size))
    index = tuple(data.draw(st.integers(0, s - 1)) for s in shape)
    flat = 0
    for i, s in zip(index, shape):
        flat = flat * s + i
    assert L.apply(index, shape) == L.apply(flat)


def test_apply_errors():
    L = Layout.parse("S[(4,2,6):(1@gpuid,6,1)]")
    with pytest.raises(LayoutError, match="does not admit shape"):
        L.apply((0, 0), shape=(8, 5))
    with pytest.raises(LayoutError, match="out of range"):
        L.apply(48)
    with pytest.raises(LayoutError, match="out of range"):
        L.apply((8, 0), shape=(8, 6))
    with pytest.raises(LayoutError, match="needs the shape"):
        L.apply((1, 2))


@given(layouts())
def test_span_and_bounds(L):
    for axis in AXES:
        values = {dict(p).get(axis, 0) for pts in brute(L) for p in pts}
        low, high = L.bounds(axis)
        assert (min(values), max(values)) == (low, high)
        assert L.span(axis) == 1 + sum(abs(it.stride) * (it.extent - 1) for it in L.shard + L.replica if it.axis == axis)
    assert Layout.parse("S[4:1@gpuid]").span("warp") == 1


# -- canonical form and equality --------------------------------------------------------


@given(layouts())
def test_canonicalize_keeps_the_map_and_is_idempotent(L):
    C = L.canonicalize()
    assert same_map(L, C)
    assert C.canonicalize().same_notation(C)
    assert all(it.extent > 1 for it in C.shard + C.replica)
    assert all(it.stride > 0 for it in C.replica)
    assert all(v != 0 for v in C.offset.values())
    assert list(C.replica) == sorted(C.replica, key=lambda it: (it.axis, it.stride, it.extent))
    for a, b in zip(C.shard, C.shard[1:]):  # nothing left to merge
        assert not (a.axis == b.axis and a.stride == b.extent * b.stride)


@settings(max_examples=150)
@given(st.data())
def test_rewritten_layouts_are_equal(data):
    L = data.draw(layouts())
    R = data.draw(rewrite(L))
    assert same_map(L, R)
    assert L == R and hash(L) == hash(R)


@settings(max_examples=300)
@given(layouts(max_shard=3, max_replica=2), layouts(max_shard=3, max_replica=2))
def test_equality_is_exactly_same_map(a, b):
    assert (a == b) == same_map(a, b)
    if a == b:
        assert hash(a) == hash(b)


@settings(max_examples=200)
@given(layouts(max_shard=3), st.data())
def test_equality_same_map_on_near_misses(a, data):
    # Perturb one stride or extent: usually a different map, sometimes not; == must know which.
    shard = list(a.shard)
    assume(shard)
    k = data.draw(st.integers(0, len(shard) - 1))
    it = shard[k]
    shard[k] = data.draw(
        st.sampled_from([Iter(it.extent, it.stride + 1 or 2, it.axis), Iter(it.extent, it.stride, "lane" if it.axis != "lane" else "m")])
    )
    b = Layout(shard, a.replica, a.offset)
    assert (a == b) == same_map(a, b)


def test_replica_merges():
    assert str(Layout.parse("S[8:1] + R[(2,2):(1@g,1@g)]").canonicalize()) == "S[8:1] + R[3:1@g]"
    assert str(Layout.parse("S[8:1] + R[(2,2):(1@g,2@g)]").canonicalize()) == "S[8:1] + R[4:1@g]"
    assert str(Layout.parse("S[8:1] + R[(3,2):(1@g,2@g)]").canonicalize()) == "S[8:1] + R[5:1@g]"
    assert str(Layout.parse("S[8:1] + R[(2,3):(4@g,1@g)]").canonicalize()) == "S[8:1] + R[(3,2):(1@g,4@g)]"
    assert str(Layout.parse("S[8:1] + R[2:-1@g]").canonicalize()) == "S[8:1] + R[2:1@g] - 1@g"


# -- group --------------------------------------------------------------------------------


@given(layouts(), st.data())
def test_group_keeps_the_map_and_blocks_match_the_shape(L, data):
    shape = data.draw(factorizations(L.size))
    try:
        blocks = L.blocks(shape)
    except LayoutError as e:
        assert "cannot group" in str(e)
        return
    assert [math.prod(it.extent for it in b) for b in blocks] == list(shape)
    G = L.group(shape)
    assert same_map(G, L)


def test_group_splits_and_errors():
    assert str(Layout.parse("S[32:1@lane]").group((8, 4))) == "S[(8,4):(4@lane,1@lane)]"
    assert str(Layout.parse("S[(4,4):(4,1)]").group((16,))) == "S[16:1]"
    assert str(Layout.parse("S[(4,2,6):(1@gpuid,6,1)]").group((8, 6))) == "S[(4,2,6):(1@gpuid,6,1)]"
    with pytest.raises(LayoutError, match="cannot group"):
        Layout.parse("S[(3,2):(2,1)]").group((2, 3))
    with pytest.raises(LayoutError, match="does not admit"):
        Layout.parse("S[6:1]").group((4, 2))


def test_group_every_shape_of_a_power_of_two_layout():
    L = Layout.parse("S[(2,4,8):(1@gpuid,8,1)]")
    for shape in [(64,), (2, 32), (8, 8), (4, 16), (2, 4, 8), (2, 2, 2, 2, 2, 2), (1, 64, 1)]:
        assert same_map(L.group(shape), L)


# -- tile, its inverse, direct sum --------------------------------------------------------


def interleaved_index(x_multi, y_multi, outer_shape, inner_shape):
    coords = [x * s + y for x, y, s in zip(x_multi, y_multi, inner_shape)]
    flat = 0
    for c, s in zip(coords, (o * i for o, i in zip(outer_shape, inner_shape))):
        flat = flat * s + c
    return flat


def unflatten(x, shape):
    out = []
    for s in reversed(shape):
        out.append(x % s)
        x //= s
    return out[::-1]


@st.composite
def shaped_pair(draw):
    """Two layouts with shapes of one rank that each admits, and can be grouped by."""
    rank = draw(st.integers(1, 3))
    pair = []
    for _ in range(2):
        shape = tuple(draw(st.sampled_from([1, 2, 3, 4])) for _ in range(rank))
        shard = []
        for s in shape:  # build D dim by dim so the shape is groupable
            if s > 1:
                shard.append(draw(iters.filter(lambda it: True).map(lambda it, s=s: Iter(s, it.stride, it.axis))))
        replica = draw(st.lists(positive_iters, max_size=1))
        offset = draw(st.dictionaries(st.sampled_from(AXES), st.integers(-3, 3), max_size=1))
        pair.append((Layout(shard, replica, offset), shape))
    return pair


def _expected_combination(a, b, a_shape, b_shape, scale):
    """``{p (.) scale + q}`` over the interleaved shape, from brute force of both layouts."""
    fa, fb = brute(a), brute(b)
    shape = tuple(x * y for x, y in zip(a_shape, b_shape))
    want = [None] * math.prod(shape)
    for x in range(a.size):
        for y in range(b.size):
            idx = interleaved_index(unflatten(x, a_shape), unflatten(y, b_shape), a_shape, b_shape)
            pts = set()
            for p in fa[x]:
                for q in fb[y]:
                    c = {axis: v * scale.get(axis, 1) for axis, v in p}
                    for axis, v in q:
                        c[axis] = c.get(axis, 0) + v
                    pts.add(point(c))
            want[idx] = frozenset(pts)
    return want


@settings(max_examples=150)
@given(shaped_pair())
def test_tile_matches_definition(pair):
    (a, a_shape), (b, b_shape) = pair
    T = tile(a, b, a_shape, b_shape)
    assert T.size == a.size * b.size
    assert brute(T) == _expected_combination(a, b, a_shape, b_shape, b.spans())


@settings(max_examples=150)
@given(shaped_pair())
def test_direct_sum_matches_definition(pair):
    (a, a_shape), (b, b_shape) = pair
    S = direct_sum(a, b, a_shape, b_shape)
    assert brute(S) == _expected_combination(a, b, a_shape, b_shape, {})


@settings(max_examples=150)
@given(shaped_pair())
def test_tile_quotient_recovers_an_outer(pair):
    (a, a_shape), (b, b_shape) = pair
    T = tile(a, b, a_shape, b_shape)
    shape = tuple(x * y for x, y in zip(a_shape, b_shape))
    C = tile_quotient(T, b, shape, b_shape)
    assert C is not None
    assert tile(C, b, a_shape, b_shape) == T


def test_tile_quotient_rejects_non_tilings():
    B = Layout.parse("(8,8):(8,1)")
    L = Layout.parse("(16,24):(24,1)")  # row-major 16x24: not made of contiguous 8x8 tiles
    assert tile_quotient(L, B, (16, 24), (8, 8)) is None
    assert tile_quotient(L, B, (16, 24), (5, 8)) is None
    assert tile_quotient(L, B, (16, 24), (8, 8, 1)) is None


def test_direct_sum_places_a_shard_on_gpus():
    S = direct_sum(Layout.parse("S[4:1@gpuid]"), Layout.parse("S[(2,6):(6,1)]"), (4, 1), (2, 6))
    assert S == Layout.parse("S[(4,2,6):(1@gpuid,6,1)]")  # Shard(0) of (8,6) on 4 GPUs
    with pytest.raises(LayoutError, match="same rank"):
        direct_sum(Layout.parse("S[4:1]"), Layout.parse("S[4:1]"), (4,), (2, 2))


# -- slice ----------------------------------------------------------------------------------


@settings(max_examples=300)
@given(layouts(max_shard=4, max_replica=1), st.data())
def test_slice_matches_definition_or_says_why_not(L, data):
    shape = data.draw(factorizations(L.size))
    begin = tuple(data.draw(st.integers(0, s - 1)) for s in shape)
    end = tuple(data.draw(st.integers(b + 1, s)) for b, s in zip(begin, shape))
    region = tuple(e - b for b, e in zip(begin, end))
    try:
        S = L.slice(shape, begin, end)
    except LayoutError as e:
        assert "no layout" in str(e) or "cannot group" in str(e)
        return
    assert S.size == math.prod(region)
    full = brute(L)
    got = brute(S)
    for u in range(S.size):
        uu = unflatten(u, region)
        x = 0
        for c, b, s in zip(uu, begin, shape):
            x = x * s + c + b
        assert got[u] == full[x]


@settings(max_examples=200)
@given(layouts(max_shard=4, max_replica=1), st.data())
def test_slice_of_whole_tiles_always_exists(L, data):
    # A box made of whole blocks of one grouping of D is always expressible.
    shape = data.draw(factorizations(L.size))
    try:
        blocks = L.blocks(shape)
    except LayoutError:
        return
    begin, end = [], []
    for block, s in zip(blocks, shape):
        inner = math.prod(it.extent for it in block[1:]) if block else 1
        outer = s // inner
        lo = data.draw(st.integers(0, outer - 1))
        hi = data.draw(st.integers(lo + 1, outer))
        begin.append(lo * inner)
        end.append(hi * inner)
    L.slice(shape, begin, end)


def test_slice_errors():
    L = Layout.parse("S[(2,4):(1,2)]")
    assert str(L.slice((8,), (2,), (6,))) == "S[(2,2):(-3,2)] + 4@m"  # crosses a digit carry
    with pytest.raises(LayoutError, match="no layout"):
        L.slice((8,), (2,), (7,))
    with pytest.raises(LayoutError, match="empty or outside"):
        L.slice((8,), (3,), (3,))
    with pytest.raises(LayoutError, match="empty or outside"):
        L.slice((8,), (0,), (9,))
    with pytest.raises(LayoutError, match="rank"):
        L.slice((8,), (0, 0), (1, 1))


# -- injectivity ----------------------------------------------------------------------------


def brute_injective(L: Layout, axes=None) -> bool:
    owner = {}
    for x, pts in enumerate(brute(L)):
        for p in pts:
            key = tuple((a, v) for a, v in p if axes is None or a in axes)
            if owner.setdefault(key, x) != x:
                return False
    return True


@settings(max_examples=300)
@given(layouts(), st.sampled_from([None, ("m", "gpuid"), ("gpuid",), ("m",)]))
def test_injectivity_matches_brute_force(L, axes):
    assert L.is_injective(axes) == brute_injective(L, axes)


def test_injectivity_examples():
    assert not Layout.parse("S[4:1@gpuid] + R[2:1@gpuid]").is_injective()
    assert Layout.parse("S[4:2@gpuid] + R[2:1@gpuid]").is_injective()
    assert not Layout.parse("S[(4,4):(3,1)]").is_injective()
    assert not Layout.parse("S[(2,4):(1@gpuid,1)]").is_injective(axes=("m",))
    assert Layout.parse("S[(2,4):(1@gpuid,1)]").is_injective(axes=("m", "gpuid"))


def test_package_exports():
    assert ax.Layout is Layout and ax.Iter is Iter and ax.tile is tile


@given(layouts(max_shard=4, max_replica=0), st.data())
def test_row_major_memory_matches_a_row_major_local_tensor(L, data):
    from axedist.layout import row_major_memory

    shape = data.draw(factorizations(L.size))
    try:
        blocks = L.blocks(shape)
    except LayoutError:
        return
    local, strides = row_major_memory(blocks)
    # Rebuild the m iters with those strides: the m values must then be exactly row-major
    # positions in a tensor of shape `local` (every slot once).
    rebuilt = Layout([Iter(it.extent, s) if s is not None else it for b, row in zip(blocks, strides) for it, s in zip(b, row)])
    m_values = sorted({p.get("m", 0) for pts in brute_points(Layout([it for it in rebuilt.shard if it.axis == "m"])) for p in pts})
    assert m_values == list(range(math.prod(local)))
    assert all((s is None) == (it.axis != "m") for b, row in zip(blocks, strides) for it, s in zip(b, row))


# ---------------------------------------------------------------------------
# Index and number types: integers of any integer type, never floats or bools
# ---------------------------------------------------------------------------


def test_apply_takes_numpy_integers():
    import numpy as np

    L = Layout.parse("S[(4,2,6):(1@gpuid,6,1)]")
    assert L.apply(np.int64(5)) == L.apply(5)
    assert L.apply((np.int32(5), np.int64(3)), shape=(np.int64(8), 6)) == [{"gpuid": 2, "m": 9}]
    assert Iter(np.int64(4), np.int32(2)) == Iter(4, 2)
    assert type(Iter(np.int64(4), 2).extent) is int


@pytest.mark.parametrize("index, shape", [(2.0, None), ((5.0, 3), (8, 6)), (True, None), ((5, 3), (8.0, 6)),
                                          ("3", None)])
def test_apply_refuses_floats_and_bools(index, shape):
    L = Layout.parse("S[(4,2,6):(1@gpuid,6,1)]")
    with pytest.raises(LayoutError, match="must be an int"):
        L.apply(index, shape=shape)


@pytest.mark.parametrize("text", ["S[\u0663:1]", "S[(4,2):(1@gpuid,\u0661)]", "S[4:1] + \uff15@gpuid"])
def test_parse_refuses_non_ascii_digits(text):
    with pytest.raises(LayoutError):
        Layout.parse(text)


def test_huge_replica_part_is_a_layout_error_not_memory_error():
    big = Layout([Iter(4, 1)], [Iter(1 << 21, 1, "gpuid"), Iter(1 << 10, 1 << 21, "gpuid")])
    with pytest.raises(LayoutError, match="replica part has"):
        big.apply(0)
