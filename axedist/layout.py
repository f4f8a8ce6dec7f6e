"""The Axe layout algebra: where each element of a tensor lives.

Read top to bottom, this file follows the AXE paper (arXiv 2601.19092) §2-3:

1. ``Iter`` ``(e, s, a)``: ``x in [0, e)`` goes to ``x*s`` on the named axis ``a``.
2. ``Layout`` ``(D, R, O)``: the shard iters ``D`` (ordered; they take the logical
   index apart, last iter fastest), the replica iters ``R`` (a multiset, enumerated
   independently of the index) and an offset ``O`` per axis::

       L(x) = { D(x) + r + O  |  r in R }

   a set of coordinates in the space of named axes (``m`` for memory, ``gpuid``
   for devices, ``lane``, ``warp``, ...).
3. The printed notation, parsed and printed with an exact round trip:
   ``S[(8,2,4,2):(4@lane,1@warp,1@lane,1)] + R[2:4@warp] + 5@warp``.
4. Canonical form, and equality meaning "same map".
5. Operations: ``group`` (D into per-dimension blocks), ``tile`` (Kronecker
   product) and its inverse, ``slice`` (a box of the tensor), ``direct_sum``.
6. Injectivity: no two elements in one slot (used to validate DTensor layouts).

Everything here is pure Python over immutable values: no torch, no I/O, no state.
Functions that evaluate the map work on plain ints and also on integer arrays
(``//``, ``%``, ``*``, ``+`` are all they use), so callers holding torch tensors
evaluate a whole layout at once through the same code.
"""

from __future__ import annotations

import itertools
import math
import operator
from collections import Counter
import re
from dataclasses import dataclass
from functools import cached_property
from typing import Iterable, Mapping, Sequence

__all__ = [
    "Iter",
    "Layout",
    "LayoutError",
    "tile",
    "tile_quotient",
    "direct_sum",
    "row_major_memory",
    "one_dim_iters",
    "without_inner_dims",
    "with_inner_dims",
]

MEMORY_AXIS = "m"
_AXIS_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*\Z")
# Brute-force fallbacks (equality of replica sets, injectivity, slicing) stop here.
_ENUMERATION_LIMIT = 1 << 20


class LayoutError(ValueError):
    """A layout, or an operation on one, that has no valid meaning."""


def _check_int(value, what: str) -> int:
    """``value`` as a Python int: ints and integer scalars (numpy's, 0-d integer tensors) pass,
    floats and bools are refused (``2.0`` as an index would silently truncate)."""
    if isinstance(value, bool) or isinstance(value, float):
        raise LayoutError(f"{what} must be an int, got {value!r}")
    try:
        return operator.index(value)
    except TypeError:
        raise LayoutError(f"{what} must be an int, got {value!r}") from None


def _check_axis(axis) -> str:
    if not isinstance(axis, str) or not _AXIS_NAME.match(axis):
        raise LayoutError(f"axis must be a non-empty name like 'm' or 'gpuid', got {axis!r}")
    return axis


# ---------------------------------------------------------------------------
# 1. Iter
# ---------------------------------------------------------------------------


@dataclass(frozen=True)
class Iter:
    """``(extent, stride, axis)``: maps ``x in [0, extent)`` to ``x*stride`` on ``axis``.

    ``Iter(4, 1, "gpuid")`` prints as ``4:1@gpuid``; ``Iter(8, 6)`` (axis ``m``) as ``8:6``.
    """

    extent: int
    stride: int
    axis: str = MEMORY_AXIS

    def __post_init__(self):
        object.__setattr__(self, "extent", _check_int(self.extent, "Iter extent"))
        object.__setattr__(self, "stride", _check_int(self.stride, "Iter stride"))
        if self.extent <= 0:
            raise LayoutError(f"Iter extent must be > 0, got {self.extent}")
        if self.stride == 0:
            raise LayoutError(f"Iter stride must be != 0 (extent {self.extent}, axis {self.axis!r})")
        _check_axis(self.axis)

    @property
    def reach(self) -> int:
        """``|s|*(e-1)``: how far this iter's values spread on its axis."""
        return abs(self.stride) * (self.extent - 1)

    def scaled(self, factor: int) -> "Iter":
        return Iter(self.extent, self.stride * factor, self.axis)

    def __str__(self) -> str:
        return f"{self.extent}:{_stride_text(self.stride, self.axis)}"

    def __repr__(self) -> str:
        return f"Iter({self.extent}, {self.stride}, {self.axis!r})"


def _stride_text(stride: int, axis: str) -> str:
    return str(stride) if axis == MEMORY_AXIS else f"{stride}@{axis}"


def _digits(index, extents: Sequence[int]):
    """Mixed-radix digits of ``index`` over ``extents``, last digit fastest.

    ``_digits(13, (3, 5)) == [2, 3]``. Works elementwise on integer arrays.
    """
    digits = []
    for extent in reversed(extents):
        digits.append(index % extent)
        index = index // extent
    return digits[::-1]


def _accumulate(iters: Sequence[Iter], digits, into: dict) -> dict:
    """Add ``sum_k digit_k * stride_k`` onto each iter's axis in ``into``."""
    for it, d in zip(iters, digits):
        into[it.axis] = into.get(it.axis, 0) + d * it.stride
    return into


# ---------------------------------------------------------------------------
# 2. Layout (D, R, O)
# ---------------------------------------------------------------------------


class Layout:
    """``(D, R, O)``: shard iters, replica iters and an offset over named axes.

    Example (DESIGN §1, checked by hand)::

        >>> L = Layout.parse("S[(8,2,4,2):(4@lane,1@warp,1@lane,1)] + R[2:4@warp] + 5@warp")
        >>> L.apply((7, 15), shape=(8, 16))
        [{'lane': 31, 'warp': 6, 'm': 1}, {'lane': 31, 'warp': 10, 'm': 1}]

    ``==`` and ``hash`` mean "same map"; ``str`` prints the notation as written,
    ``canonicalize()`` gives the normal form.
    """

    __slots__ = ("shard", "replica", "_offset", "__dict__")

    def __init__(
        self,
        shard: Iterable[Iter] = (),
        replica: Iterable[Iter] = (),
        offset: Mapping[str, int] | Iterable[tuple[str, int]] | None = None,
    ):
        shard = tuple(_as_iter(it) for it in shard)
        replica = tuple(_as_iter(it) for it in replica)
        items = offset.items() if isinstance(offset, Mapping) else (offset or ())
        pairs: dict[str, int] = {}
        for axis, value in items:
            if _check_axis(axis) in pairs:
                raise LayoutError(f"offset names axis {axis!r} twice")
            pairs[axis] = _check_int(value, f"offset on axis {axis!r}")
        object.__setattr__(self, "shard", shard)
        object.__setattr__(self, "replica", replica)
        object.__setattr__(self, "_offset", tuple(pairs.items()))

    def __setattr__(self, name, value):
        raise AttributeError("Layout is immutable")

    # -- basic quantities -------------------------------------------------

    @property
    def offset(self) -> dict[str, int]:
        return dict(self._offset)

    @cached_property
    def size(self) -> int:
        """``E_D``: the number of logical elements (product of shard extents)."""
        return math.prod(it.extent for it in self.shard)

    @cached_property
    def replica_count(self) -> int:
        return math.prod(it.extent for it in self.replica)

    @cached_property
    def axes(self) -> tuple[str, ...]:
        """Every axis the layout names, in order of first appearance (D, then R, then O)."""
        seen = dict.fromkeys(it.axis for it in self.shard + self.replica)
        seen.update(dict.fromkeys(axis for axis, _ in self._offset))
        return tuple(seen)

    def span(self, axis: str) -> int:
        """``1 + sum |s|*(e-1)`` over the D and R iters on ``axis``; 1 if unused."""
        return 1 + sum(it.reach for it in self.shard + self.replica if it.axis == axis)

    def bounds(self, axis: str) -> tuple[int, int]:
        """Smallest and largest coordinate the layout reaches on ``axis`` (inclusive)."""
        return _reach_on(self.shard + self.replica, axis, self.offset.get(axis, 0))

    def admits(self, shape: Sequence[int]) -> bool:
        """A layout admits a shape whose element count is ``E_D``."""
        return math.prod(shape) == self.size

    # -- the map ------------------------------------------------------------

    def shard_coordinates(self, index) -> dict:
        """``D(index) + O``: per-axis coordinates of a flat index (int, or integer array)."""
        coords = dict(self._offset)
        return _accumulate(self.shard, _digits(index, [it.extent for it in self.shard]), coords)

    @cached_property
    def replica_offsets(self) -> tuple[dict[str, int], ...]:
        """The distinct points ``r`` of ``R`` (without ``O``), first digit slowest."""
        if self.replica_count > _ENUMERATION_LIMIT:
            raise LayoutError(f"layout {self}: its replica part has {self.replica_count} points, more than "
                              f"{_ENUMERATION_LIMIT} can be listed one by one")
        points = {}
        extents = [it.extent for it in self.replica]
        for digits in itertools.product(*(range(e) for e in extents)):
            point = _accumulate(self.replica, digits, {it.axis: 0 for it in self.replica})
            points.setdefault(tuple(sorted(point.items())), point)
        return tuple(points.values())

    def apply(self, index, shape: Sequence[int] | None = None) -> list[dict[str, int]]:
        """``L(index)``: the coordinates of one element, one dict per replica.

        ``index`` is a flat int in ``[0, size)``, or a tuple over ``shape`` (row-major).
        Every axis the layout names appears in each dict.
        """
        flat = self._flat_index(index, shape)
        base = {axis: 0 for axis in self.axes}
        base.update(self.shard_coordinates(flat))
        points = []
        for r in self.replica_offsets:
            point = dict(base)
            for axis, value in r.items():
                point[axis] += value
            if point not in points:
                points.append(point)
        return points

    def _flat_index(self, index, shape) -> int:
        if shape is not None:
            shape = tuple(_check_int(s, "shape entry") for s in shape)
            if not self.admits(shape):
                raise LayoutError(f"layout {self} of size {self.size} does not admit shape {shape}")
        if not isinstance(index, (tuple, list)):
            index = _check_int(index, "index")
            if not 0 <= index < self.size:
                raise LayoutError(f"index {index} is out of range [0, {self.size}) for {self}")
            return index
        index = tuple(_check_int(i, "index entry") for i in index)
        if shape is None:
            raise LayoutError(f"a tuple index {index} needs the shape it is taken over")
        if len(index) != len(shape) or any(not 0 <= i < s for i, s in zip(index, shape)):
            raise LayoutError(f"index {index} is out of range for shape {shape}")
        flat = 0
        for i, s in zip(index, shape):
            flat = flat * s + i
        return flat

    def points(self) -> list[tuple[int, list[dict[str, int]]]]:
        """Brute-force enumeration ``[(x, L(x)) for every x]`` (for tests and small layouts)."""
        return [(x, self.apply(x)) for x in range(self.size)]

    # -- notation -------------------------------------------------------------

    @staticmethod
    def parse(text: str) -> "Layout":
        """Parse the paper's notation; ``ValueError`` names the position and what was expected."""
        return _Parser(text).layout()

    def __str__(self) -> str:
        parts = [f"S[{_part_text(self.shard)}]"]
        if self.replica:
            parts.append(f"R[{_part_text(self.replica)}]")
        text = " + ".join(parts)
        for axis, value in self._offset:
            sign = "-" if value < 0 else "+"
            text += f" {sign} {abs(value)}@{axis}"
        return text

    def __repr__(self) -> str:
        return f"Layout({str(self)!r})"

    # -- canonical form and equality --------------------------------------------

    def canonicalize(self) -> "Layout":
        """The normal form: equal maps give equal canonical forms (DESIGN §1).

        ``S[(8,4):(4@lane,1@lane)]`` -> ``S[32:1@lane]``;
        ``S[(8,2,3,6):(6,18,6,1)]`` -> ``S[(8,36):(6,1)]``.
        """
        return self._canonical

    @cached_property
    def _canonical(self) -> "Layout":
        offset = dict(self._offset)
        replica = []
        for it in self.replica:
            if it.extent == 1:
                continue
            if it.stride < 0:  # R is a set: walk it upward from its lowest point
                offset[it.axis] = offset.get(it.axis, 0) + it.stride * (it.extent - 1)
                it = Iter(it.extent, -it.stride, it.axis)
            replica.append(it)
        offset = sorted((axis, value) for axis, value in offset.items() if value != 0)
        layout = Layout(_merge_shard(self.shard), _merge_replica(replica), offset)
        layout.__dict__["_canonical"] = layout
        return layout

    @cached_property
    def _replica_box(self) -> tuple:
        """Per-axis bounds of ``R + O``: a cheap invariant of the map, used in the hash."""
        canon = self._canonical
        axes = sorted({it.axis for it in canon.replica} | {a for a, _ in canon._offset})
        return tuple((axis, _reach_on(canon.replica, axis, canon.offset.get(axis, 0))) for axis in axes)

    def __eq__(self, other) -> bool:
        # Two layouts have the same map iff their canonical shard parts are equal
        # (D is recovered from the map digit by digit) and their sets R + O are equal.
        if not isinstance(other, Layout):
            return NotImplemented
        a, b = self._canonical, other._canonical
        if a.shard != b.shard:
            return False
        if a.replica == b.replica and a._offset == b._offset:
            return True
        if self._replica_box != other._replica_box:
            return False
        if max(a.replica_count, b.replica_count) > _ENUMERATION_LIMIT:
            return False  # beyond the canonical form's reach; never claims equality wrongly
        return a._replica_set() == b._replica_set()

    def _replica_set(self) -> frozenset:
        axes = sorted(set(self.axes))
        return frozenset(
            tuple(r.get(axis, 0) + self.offset.get(axis, 0) for axis in axes) for r in self.replica_offsets
        )

    def __hash__(self) -> int:
        return hash((self._canonical.shard, self._replica_box))

    def __fx_repr__(self):
        """How a torch.compile graph writes this layout as a constant: ``Layout.parse('S[8:1]')``."""
        return f"Layout.parse({str(self)!r})", {"Layout": Layout}

    def same_notation(self, other: "Layout") -> bool:
        """Structural identity (same iters in the same order, same offsets), not map equality."""
        return (self.shard, self.replica, self._offset) == (other.shard, other.replica, other._offset)

    # -- operations (defined below as free functions) ------------------------------

    def group(self, shape: Sequence[int]) -> "Layout":
        """Same map, D split/fused into consecutive blocks whose extents multiply to ``shape[i]``.

        ``S[32:1@lane]`` grouped by ``(8, 4)`` -> ``S[(8,4):(4@lane,1@lane)]``.
        """
        return Layout(itertools.chain.from_iterable(self.blocks(shape)), self.replica, self._offset)

    def blocks(self, shape: Sequence[int]) -> tuple[tuple[Iter, ...], ...]:
        """D as one block of iters per dimension of ``shape`` (the work behind ``group``)."""
        return _blocks(self, shape)

    def slice(self, shape: Sequence[int], begin: Sequence[int], end: Sequence[int]) -> "Layout":
        """The layout of the box ``[begin, end)``: ``f_slice(u) = f_L(u + begin)``."""
        return _slice(self, shape, begin, end)

    def is_injective(self, axes: Iterable[str] | None = None) -> bool:
        """No two distinct elements share a point, looking only at ``axes`` (default: all)."""
        return _is_injective(self, None if axes is None else frozenset(axes))

    def scaled(self, factors: Mapping[str, int]) -> "Layout":
        """Every stride and offset on axis ``a`` multiplied by ``factors[a]`` (1 if absent)."""
        return Layout(
            (it.scaled(factors.get(it.axis, 1)) for it in self.shard),
            (it.scaled(factors.get(it.axis, 1)) for it in self.replica),
            {axis: value * factors.get(axis, 1) for axis, value in self._offset},
        )

    def spans(self) -> dict[str, int]:
        """``span(a)`` for every axis the layout's iters use."""
        return {axis: self.span(axis) for axis in self.axes}


def _reach_on(iters: Iterable[Iter], axis: str, start: int) -> tuple[int, int]:
    """Lowest and highest value of ``start + sum of the iters on axis`` over all their digits."""
    low = high = start
    for it in iters:
        if it.axis == axis:
            low += min(0, it.stride * (it.extent - 1))
            high += max(0, it.stride * (it.extent - 1))
    return low, high


def _as_iter(it) -> Iter:
    if isinstance(it, Iter):
        return it
    if isinstance(it, tuple) and len(it) in (2, 3):
        return Iter(*it)
    raise LayoutError(f"expected an Iter or an (extent, stride[, axis]) tuple, got {it!r}")


def _part_text(iters: Sequence[Iter]) -> str:
    if len(iters) == 1:
        return str(iters[0])
    extents = ",".join(str(it.extent) for it in iters)
    strides = ",".join(_stride_text(it.stride, it.axis) for it in iters)
    return f"({extents}):({strides})"


# ---------------------------------------------------------------------------
# 3. The notation's parser
# ---------------------------------------------------------------------------


class _Parser:
    """Recursive descent over ``S[...] [+ R[...]] {(+|-) int[@axis]}``; whitespace is free.

    The ``S[ ]`` wrapper may be left off (``(8,2,8):(8,64,1) + 64@m``).
    """

    def __init__(self, text: str):
        if not isinstance(text, str):
            raise LayoutError(f"Layout.parse takes a string, got {type(text).__name__}")
        self.text = text
        self.pos = 0

    def fail(self, expected: str):
        found = repr(self.text[self.pos]) if self.pos < len(self.text) else "end of text"
        raise LayoutError(f"bad layout text at position {self.pos}: expected {expected}, found {found} in {self.text!r}")

    def skip(self):
        while self.pos < len(self.text) and self.text[self.pos].isspace():
            self.pos += 1

    def peek(self, token: str) -> bool:
        self.skip()
        return self.text.startswith(token, self.pos)

    def eat(self, token: str) -> bool:
        if self.peek(token):
            self.pos += len(token)
            return True
        return False

    def expect(self, token: str):
        if not self.eat(token):
            self.fail(repr(token))

    def integer(self) -> int:
        self.skip()
        m = _INTEGER.match(self.text, self.pos)
        if not m:
            self.fail("an integer")
        self.pos = m.end()
        return int(m.group())

    def axis(self) -> str:
        self.skip()
        m = _AXIS_NAME_PREFIX.match(self.text, self.pos)
        if not m:
            self.fail("an axis name")
        self.pos = m.end()
        return m.group()

    def stride(self) -> tuple[int, str]:
        value = self.integer()
        return value, (self.axis() if self.eat("@") else MEMORY_AXIS)

    def tuple_of(self, item):
        if self.eat("("):
            if self.eat(")"):
                return []
            values = [item()]
            while self.eat(","):
                values.append(item())
            self.expect(")")
            return values
        return [item()]

    def iters(self) -> tuple[Iter, ...]:
        start = self.pos
        extents = self.tuple_of(self.integer)
        self.expect(":")
        strides = self.tuple_of(self.stride)
        if len(extents) != len(strides):
            self.pos = start
            self.fail(f"as many strides as extents ({len(extents)} extents, {len(strides)} strides)")
        try:
            return tuple(Iter(e, s, a) for e, (s, a) in zip(extents, strides))
        except LayoutError as e:
            raise LayoutError(f"bad layout text at position {start}: {e} in {self.text!r}") from None

    def bracketed(self, tag: str) -> tuple[Iter, ...]:
        self.expect(tag + "[")
        iters = self.iters()
        self.expect("]")
        return iters

    def layout(self) -> Layout:
        shard = self.bracketed("S") if self.peek("S[") else self.iters()
        replica = ()
        offset: dict[str, int] = {}
        while True:
            self.skip()
            if self.pos == len(self.text):
                break
            if self.eat("+"):
                sign = 1
            elif self.eat("-"):
                sign = -1
            else:
                self.fail("'+', '-' or the end")
            if self.peek("R["):
                if replica or offset:
                    self.fail("R[...] once, right after S[...]")
                replica = self.bracketed("R")
                if sign < 0:
                    self.fail("'+' before R[...]")
                continue
            start = self.pos
            value, axis = self.stride()
            if axis in offset:
                self.pos = start
                self.fail(f"each axis in the offset once ({axis!r} repeats)")
            offset[axis] = sign * value
        return Layout(shard, replica, offset)


_INTEGER = re.compile(r"-?[0-9]+")  # ASCII digits only: int() would read other scripts' digits too
_AXIS_NAME_PREFIX = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


# ---------------------------------------------------------------------------
# 4. Canonical form
# ---------------------------------------------------------------------------


def _merge_shard(iters: Iterable[Iter]) -> tuple[Iter, ...]:
    """Drop extent-1 iters; merge neighbours on one axis when ``s_i == e_{i+1} * s_{i+1}``."""
    merged: list[Iter] = []
    for it in iters:
        if it.extent == 1:
            continue
        merged.append(it)
        while len(merged) >= 2:
            outer, inner = merged[-2], merged[-1]
            if outer.axis != inner.axis or outer.stride != inner.extent * inner.stride:
                break
            merged[-2:] = [Iter(outer.extent * inner.extent, inner.stride, inner.axis)]
    return tuple(merged)


def _merge_replica(iters: list[Iter]) -> tuple[Iter, ...]:
    """Merge replica iters on one axis that overlap or abut, then sort.

    With positive strides and ``s_j = q*s_i``, ``1 <= q <= e_i``, the sum of the two
    progressions is the single progression ``(e_i + q*(e_j - 1), s_i)``.
    """
    iters = list(iters)
    changed = True
    while changed:
        changed = False
        for i, j in itertools.permutations(range(len(iters)), 2):
            a, b = iters[i], iters[j]
            if a.axis != b.axis or b.stride % a.stride:
                continue
            q = b.stride // a.stride
            if 1 <= q <= a.extent:
                iters[i] = Iter(a.extent + q * (b.extent - 1), a.stride, a.axis)
                del iters[j]
                changed = True
                break
    return tuple(sorted(iters, key=lambda it: (it.axis, it.stride, it.extent)))


# ---------------------------------------------------------------------------
# 5. Operations: group, direct sum, tile (and its inverse), slice
# ---------------------------------------------------------------------------


def _blocks(layout: Layout, shape: Sequence[int]) -> tuple[tuple[Iter, ...], ...]:
    shape = tuple(_check_int(s, "shape entry") for s in shape)
    if any(s <= 0 for s in shape) or not layout.admits(shape):
        raise LayoutError(f"layout {layout} of size {layout.size} does not admit shape {shape}")
    pending = [it for it in layout.shard if it.extent > 1]
    blocks = []
    for dim, want in enumerate(shape):
        block: list[Iter] = []
        while want > 1:
            it = pending.pop(0)
            if want % it.extent == 0:
                block.append(it)
                want //= it.extent
            elif it.extent % want == 0:
                # split (e, s) into (want, (e/want)*s) here and (e/want, s) for what follows
                rest = it.extent // want
                block.append(Iter(want, rest * it.stride, it.axis))
                pending.insert(0, Iter(rest, it.stride, it.axis))
                want = 1
            else:
                raise LayoutError(
                    f"cannot group {layout} by shape {shape}: dim {dim} needs {want} more "
                    f"but the next iter has extent {it.extent} (neither divides the other)"
                )
        blocks.append(_merge_shard(block))
    return tuple(blocks)


def _interleave(a: Layout, b: Layout, a_shape, b_shape) -> tuple[tuple[int, ...], list[Iter]]:
    if len(a_shape) != len(b_shape):
        raise LayoutError(f"shapes must have the same rank, got {tuple(a_shape)} and {tuple(b_shape)}")
    shard: list[Iter] = []
    for outer, inner in zip(a.blocks(a_shape), b.blocks(b_shape)):
        shard += outer + inner
    return tuple(x * y for x, y in zip(a_shape, b_shape)), shard


def one_dim_iters(layout: Layout, shape: Sequence[int], dim: int) -> tuple[Iter, ...] | None:
    """Dim ``dim`` (0 or 1) of a 2-D tensor of ``shape`` as the 1-D tensor of that dim alone
    would be laid out: its iters, memory strides counted in that dim's local elements. None
    unless the other dim is whole and local in every piece, in row-major order (one memory iter
    over all of it). ``S[(2,2,2,6):(12,1@gpuid,6,1)]`` over ``(8, 6)``, dim 0: ``(2:2, 2:1@gpuid,
    2:1)``, rows dealt round-robin in pairs to 2 devices; its transpose ``S[(6,2,2,2):(4,2,1@gpuid,1)]``
    over ``(6, 8)``, dim 1: the same."""
    try:
        blocks = layout.blocks(shape)
    except LayoutError:
        return None
    mine, other = blocks[dim], blocks[1 - dim]
    local = math.prod(it.extent for it in mine if it.axis == MEMORY_AXIS)
    # row-major: a dim-0 element is a whole row apart from the next; dim 1 is innermost
    unit, other_stride = (shape[1], 1) if dim == 0 else (1, local)
    if (len(other) != 1 or other[0].axis != MEMORY_AXIS or other[0].extent != shape[1 - dim]
            or other[0].stride != other_stride or any(it.axis == MEMORY_AXIS and it.stride % unit for it in mine)):
        return None
    return tuple(Iter(it.extent, it.stride // unit, it.axis) if it.axis == MEMORY_AXIS else it for it in mine)


def without_inner_dims(layout: Layout, shape: Sequence[int], count: int) -> Layout | None:
    """The layout of ``shape[:-count]`` that each piece leaves when it reduces its own elements
    over the last ``count`` dims: None unless those dims are whole and local in every piece and
    innermost in row-major order (then the other dims' memory strides, divided by their size,
    say where each reduced value sits in the piece's row-major result).

    ``without_inner_dims(S[(2,2,2,6):(12,1@gpuid,6,1)], (8, 6), 1)`` -> ``S[(2,2,2):(2,1@gpuid,1)]``:
    rows dealt round-robin in pairs to 2 devices keep that deal when each row is summed."""
    if count <= 0 or count > len(shape):
        return None
    try:
        blocks = layout.blocks(shape)
    except LayoutError:
        return None
    inner = 1
    for extent, block in zip(reversed(shape[len(shape) - count:]), reversed(blocks[len(shape) - count:])):
        if extent > 1 and (len(block) != 1 or block[0].axis != MEMORY_AXIS or block[0].extent != extent
                           or block[0].stride != inner):
            return None
        inner *= extent
    kept = [it for block in blocks[:len(shape) - count] for it in block]
    if any(it.axis == MEMORY_AXIS and it.stride % inner for it in kept):
        return None
    return Layout([Iter(it.extent, it.stride // inner, it.axis) if it.axis == MEMORY_AXIS else it for it in kept],
                  layout.replica, layout.offset)


def with_inner_dims(layout: Layout, shape: Sequence[int], inner: Sequence[int]) -> Layout | None:
    """The layout of ``shape + inner`` whose ``inner`` dims are whole and local in every piece,
    innermost in row-major order, and whose ``shape`` dims are laid out as ``layout`` lays out
    ``shape`` (what each piece's ``expand`` of its own trailing size-1 dims gives): the inverse of
    :func:`without_inner_dims`. None where ``layout`` does not group by ``shape``.

    ``with_inner_dims(S[(2,2,2):(2,1@gpuid,1)], (8,), (6,))`` -> ``S[(2,2,2,6):(12,1@gpuid,6,1)]``."""
    try:
        blocks = layout.blocks(shape)
    except LayoutError:
        return None
    size = math.prod(inner)
    iters = [Iter(it.extent, it.stride * size, it.axis) if it.axis == MEMORY_AXIS else it
             for block in blocks for it in block]
    stride = size
    for extent in inner:
        stride //= extent
        if extent > 1:
            iters.append(Iter(extent, stride))
    return Layout(iters, layout.replica, layout.offset)


def _row_major_blocks(layout: Layout, shape: Sequence[int]):
    """(blocks, local shape) of ``layout`` over ``shape`` where each piece's memory is row-major
    over its local shape (every ``m`` iter at the stride ``row_major_memory`` gives it); None
    where it is not, or where ``layout`` does not group by ``shape``."""
    try:
        blocks = layout.blocks(shape)
    except LayoutError:
        return None
    local, strides = row_major_memory(blocks)
    if any(it.axis == MEMORY_AXIS and it.stride != stride
           for block, row in zip(blocks, strides) for it, stride in zip(block, row)):
        return None
    return blocks, local


def with_dim_inserted(layout: Layout, shape: Sequence[int], dim: int, extent: int) -> Layout | None:
    """The layout of ``shape`` with a dim of ``extent`` inserted at ``dim``, the new dim whole and
    local in every piece, at position ``dim`` of the piece's row-major memory, the other dims laid
    out as ``layout`` lays out ``shape``: what each piece's ``torch.stack`` of ``extent`` pieces at
    ``dim`` gives. None unless each piece's memory is row-major over its local shape.

    ``with_dim_inserted(S[(4,2,6):(1@gpuid,6,1)], (8, 6), 0, 3)`` -> ``S[(3,4,2,6):(12,1@gpuid,6,1)]``."""
    found = _row_major_blocks(layout, shape)
    if found is None or not 0 <= dim <= len(shape) or extent < 1:
        return None
    blocks, local = found
    iters = []
    for e in range(len(blocks) + 1):
        if e == dim and extent > 1:
            iters.append(Iter(extent, math.prod(local[dim:])))
        if e < len(blocks):
            iters += [Iter(it.extent, it.stride * extent, it.axis) if it.axis == MEMORY_AXIS and e < dim else it
                      for it in blocks[e]]
    return Layout(iters, layout.replica, layout.offset)


def with_dims_inserted(layout: Layout, shape: Sequence[int],
                       inserted: Sequence[tuple[int, int]]) -> Layout | None:
    """:func:`with_dim_inserted` for each ``(position, extent)`` of ``inserted``, positions in the
    resulting shape (taken in ascending order); None where the pieces are not row-major."""
    shape = list(shape)
    for position, extent in sorted(inserted):
        layout = with_dim_inserted(layout, shape, position, extent)
        if layout is None:
            return None
        shape.insert(position, extent)
    return layout


def without_dim(layout: Layout, shape: Sequence[int], dim: int) -> Layout | None:
    """The layout of ``shape`` without dim ``dim`` that each piece leaves when it takes one index
    of that dim (``select`` / ``unbind``): None unless the dim is whole and local in every piece and
    each piece's memory is row-major over its local shape. The inverse of :func:`with_dim_inserted`.

    ``without_dim(S[(3,4,2,6):(12,1@gpuid,6,1)], (3, 8, 6), 0)`` -> ``S[(4,2,6):(1@gpuid,6,1)]``."""
    found = _row_major_blocks(layout, shape)
    if found is None or not 0 <= dim < len(shape):
        return None
    blocks, local = found
    extent = shape[dim]
    if extent > 1 and (len(blocks[dim]) != 1 or blocks[dim][0].axis != MEMORY_AXIS
                       or blocks[dim][0].extent != extent):
        return None
    iters = [Iter(it.extent, it.stride // extent, it.axis) if it.axis == MEMORY_AXIS and e < dim else it
             for e, block in enumerate(blocks) if e != dim for it in block]
    return Layout(iters, layout.replica, layout.offset)


def without_dims(layout: Layout, shape: Sequence[int], dims: Sequence[int]) -> Layout | None:
    """:func:`without_dim` for each of ``dims`` (distinct, in range), the innermost first: the
    layout of ``shape`` without them, or None where one is not whole and local in every piece.

    ``without_dims(S[(2,3,4,2,6):(36,12,1@gpuid,6,1)], (2, 3, 8, 6), [0, 1])`` -> ``S[(4,2,6):(1@gpuid,6,1)]``."""
    shape = list(shape)
    for dim in sorted(dims, reverse=True):
        layout = without_dim(layout, shape, dim)
        if layout is None:
            return None
        del shape[dim]
    return layout


def row_major_memory(blocks: Sequence[Sequence[Iter]]) -> tuple[tuple[int, ...], list[list[int | None]]]:
    """The local shape that a grouped layout's ``m`` iters span, and the stride each ``m`` iter has
    when local memory is row-major over that shape (``None`` for iters on other axes).

    ``row_major_memory(S[(4,2,6):(1@gpuid,6,1)].blocks((8,6)))`` -> ``((2, 6), [[None, 6], [1]])``.
    """
    local = tuple(math.prod(it.extent for it in block if it.axis == MEMORY_AXIS) for block in blocks)
    strides: list[list[int | None]] = []
    inner = math.prod(local)
    for extent, block in zip(local, blocks):
        inner //= extent
        stride = inner * extent
        row: list[int | None] = []
        for it in block:
            if it.axis == MEMORY_AXIS:
                stride //= it.extent
                row.append(stride)
            else:
                row.append(None)
        strides.append(row)
    return local, strides


def direct_sum(a: Layout, b: Layout, a_shape: Sequence[int], b_shape: Sequence[int]) -> Layout:
    """``f(x || y) = f_A(x) + f_B(y)`` over the shape ``(a0*b0, a1*b1, ...)``.

    ``direct_sum(S[2:1@gpuid], S[4:1], (2,), (4,))`` -> ``S[(2,4):(1@gpuid,1)]``.
    """
    _, shard = _interleave(a, b, a_shape, b_shape)
    offset = a.offset
    for axis, value in b.offset.items():
        offset[axis] = offset.get(axis, 0) + value
    return Layout(shard, a.replica + b.replica, offset)


def tile(outer: Layout, inner: Layout, outer_shape: Sequence[int], inner_shape: Sequence[int]) -> Layout:
    """Kronecker product: ``f(x || y) = f_outer(x) (.) span(inner) + f_inner(y)``.

    ``tile(S[(2,3):(3,1)], S[(8,8):(8,1)], (2,3), (8,8))`` -> ``S[(2,8,3,8):(192,8,64,1)]``:
    a 16x24 matrix as a 2x3 grid of 8x8 tiles.
    """
    return direct_sum(outer.scaled(inner.spans()), inner, outer_shape, inner_shape)


def tile_quotient(layout: Layout, inner: Layout, shape: Sequence[int], inner_shape: Sequence[int]) -> Layout | None:
    """The outer ``C`` with ``layout == tile(C, inner, shape/inner_shape, inner_shape)``, or None.

    ``tile_quotient(S[(2,8,3,8):(192,8,64,1)], S[(8,8):(8,1)], (16,24), (8,8))`` -> ``S[(2,3):(3,1)]``.
    """
    shape, inner_shape = tuple(shape), tuple(inner_shape)
    if len(shape) != len(inner_shape) or any(s % t for s, t in zip(shape, inner_shape)):
        return None
    outer_shape = tuple(s // t for s, t in zip(shape, inner_shape))
    interleaved = tuple(itertools.chain.from_iterable(zip(outer_shape, inner_shape)))
    try:
        blocks = layout.blocks(interleaved)
    except LayoutError:
        return None
    spans = inner.spans()
    outer_shard = []
    for it in itertools.chain.from_iterable(blocks[0::2]):
        factor = spans.get(it.axis, 1)
        if it.stride % factor:
            return None
        outer_shard.append(Iter(it.extent, it.stride // factor, it.axis))
    # Replicas and offset: R + O of the layout must be span (.) (R_C + O_C) + (R + O of the inner).
    quotient = _replica_quotient(layout.canonicalize(), inner.canonicalize(), spans)
    if quotient is None:
        return None
    outer_replica, outer_offset = quotient
    outer = Layout(outer_shard, outer_replica, outer_offset).canonicalize()
    if tile(outer, inner, outer_shape, inner_shape) != layout:
        return None
    return outer.group(outer_shape)  # same map, printed as the grid it is


def _replica_quotient(whole: Layout, inner: Layout, spans: Mapping[str, int]):
    """``(R_C, O_C)`` with ``R + O == span (.) (R_C + O_C) + R_inner + O_inner``, or None.

    First try removing the inner's iters from the whole's; when canonical merging has
    fused them (``R[2:2] + R[2:1]`` is ``R[4:1]``), solve per axis: a replica set is a
    product over axes, and the largest ``C`` with ``span*C + Z`` inside ``X`` is the
    answer whenever one exists.
    """
    remaining = Counter(whole.replica)
    remaining.subtract(inner.replica)
    if min(remaining.values(), default=0) >= 0:
        replica, offset = [], {}
        for it in remaining.elements():
            if it.stride % spans.get(it.axis, 1):
                break
            replica.append(Iter(it.extent, it.stride // spans.get(it.axis, 1), it.axis))
        else:
            for axis in set(whole.offset) | set(inner.offset):
                value = whole.offset.get(axis, 0) - inner.offset.get(axis, 0)
                if value % spans.get(axis, 1):
                    break
                offset[axis] = value // spans.get(axis, 1)
            else:
                return replica, offset
    replica, offset = [], {}
    for axis in {it.axis for it in whole.replica + inner.replica} | set(whole.offset) | set(inner.offset):
        have, take = _axis_values(whole, axis), _axis_values(inner, axis)
        factor, low = spans.get(axis, 1), min(take)
        outer = sorted(
            (x - low) // factor
            for x in have
            if (x - low) % factor == 0 and all((x - low) + z in have for z in take)
        )
        if not outer or {c * factor + z for c in outer for z in take} != have:
            return None
        offset[axis] = outer[0]
        if len(outer) > 1:
            step = outer[1] - outer[0]
            if outer != list(range(outer[0], outer[-1] + 1, step)):
                return None
            replica.append(Iter(len(outer), step, axis))
    return replica, offset


def _axis_values(layout: Layout, axis: str) -> set[int]:
    """The values of ``R + O`` on one axis."""
    iters = [it for it in layout.replica if it.axis == axis]
    base = layout.offset.get(axis, 0)
    return {
        base + sum(d * it.stride for d, it in zip(digits, iters))
        for digits in itertools.product(*(range(it.extent) for it in iters))
    }


def _slice(layout: Layout, shape, begin, end) -> Layout:
    shape, begin, end = tuple(shape), tuple(begin), tuple(end)
    if not (len(shape) == len(begin) == len(end)):
        raise LayoutError(f"slice needs begin and end of rank {len(shape)}, got {begin} and {end}")
    for dim, (s, b, e) in enumerate(zip(shape, begin, end)):
        if not 0 <= b < e <= s:
            raise LayoutError(f"slice [{begin}, {end}) is empty or outside shape {shape} in dim {dim}")
    offset = layout.offset
    shard: list[Iter] = []
    for dim, (block, b, e) in enumerate(zip(layout.blocks(shape), begin, end)):
        fitted = _fit_range(block, b, e - b)
        if fitted is None:
            raise LayoutError(
                f"slice [{begin}, {end}) of {layout} over shape {shape} has no layout: "
                f"dim {dim} range [{b}, {e}) of block {_part_text(block) if block else '()'} is not affine-separable"
            )
        shard += fitted
        _accumulate(block, _digits(b, [it.extent for it in block]), offset)
    return Layout(shard, layout.replica, offset)


def _fit_range(block: Sequence[Iter], begin: int, count: int) -> list[Iter] | None:
    """Iters ``F`` with ``F(u) == block(u + begin) - block(begin)`` for ``u in [0, count)``, or None.

    Fast path: the range covers whole inner digits and then a run of one digit.
    Otherwise recover the iters from the map itself, inner to outer, and verify.
    """
    fitted: list[Iter] = []
    pending = list(block)
    while pending and count > 1:
        it = pending.pop()
        cover = math.gcd(it.extent, count, begin)
        if cover == it.extent:  # whole iter inside the range
            fitted.insert(0, it)
            count //= cover
            begin //= cover
            continue
        if cover > 1:
            fitted.insert(0, Iter(cover, it.stride, it.axis))
            it = Iter(it.extent // cover, it.stride * cover, it.axis)
            count //= cover
            begin //= cover
        if begin % it.extent + count <= it.extent:
            fitted.insert(0, Iter(count, it.stride, it.axis))
            return fitted
        return _fit_by_evaluation(block, fitted, pending + [it], begin, count)
    return fitted


def _fit_by_evaluation(block, inner_fitted, outer_iters, begin, count) -> list[Iter] | None:
    """General case of ``_fit_range``: peel iters off ``g(u) = outer(begin+u) - outer(begin)``."""
    if count > _ENUMERATION_LIMIT:
        return None
    extents = [it.extent for it in outer_iters]

    def g(u):
        here = _accumulate(outer_iters, _digits(begin + u, extents), {})
        base = _accumulate(outer_iters, _digits(begin, extents), {})
        return {a: v - base.get(a, 0) for a, v in here.items() if v - base.get(a, 0) != 0}

    values = [g(u) for u in range(count)]
    fitted: list[Iter] = []
    step = 1  # values[j*step] is the outer function at j
    while count > 1:
        delta = values[step]
        if len(delta) != 1:
            return None
        (axis, stride), = delta.items()
        extent = 1
        while extent < count and values[extent * step] == {axis: stride * extent}:
            extent += 1
        if count % extent:
            return None
        for j in range(0, count, extent):  # every run of `extent` must repeat that progression
            base = values[j * step]
            for r in range(extent):
                expect = dict(base)
                expect[axis] = expect.get(axis, 0) + r * stride
                if {a: v for a, v in expect.items() if v} != values[(j + r) * step]:
                    return None
        fitted.insert(0, Iter(extent, stride, axis))
        count //= extent
        step *= extent
    return fitted + inner_fitted


# ---------------------------------------------------------------------------
# 6. Injectivity
# ---------------------------------------------------------------------------


def _is_injective(layout: Layout, axes: frozenset | None) -> bool:
    canon = layout.canonicalize()
    keep = (lambda a: True) if axes is None else (lambda a: a in axes)
    if any(not keep(it.axis) for it in canon.shard):
        return False  # a shard digit that no kept axis sees: its elements coincide
    replica = [it for it in canon.replica if keep(it.axis)]
    # Sufficient: per axis, sorted by |stride|, each stride clears the reach of the ones below it.
    by_axis: dict[str, list[Iter]] = {}
    for it in canon.shard + tuple(replica):
        by_axis.setdefault(it.axis, []).append(it)
    if all(_dominant(iters) for iters in by_axis.values()):
        return True
    # Otherwise enumerate: a slot must never hold two distinct elements.
    if canon.size * max(1, math.prod(it.extent for it in replica)) > _ENUMERATION_LIMIT:
        raise LayoutError(f"layout {layout} is too large to check injectivity by enumeration")
    restricted = Layout(canon.shard, replica, {a: v for a, v in canon.offset.items() if keep(a)})
    owner: dict[tuple, int] = {}
    for x, points in restricted.points():
        for point in points:
            key = tuple(sorted(point.items()))
            if owner.setdefault(key, x) != x:
                return False
    return True


def _dominant(iters: list[Iter]) -> bool:
    reach = 0
    for it in sorted(iters, key=lambda it: abs(it.stride)):
        if abs(it.stride) <= reach:
            return False
        reach += it.reach
    return True
