"""The layout map written from the definition alone, shared by the tests as their oracle.

``L(x) = {D(x) + r + O}``: the digits of ``x`` over D's extents, last digit fastest,
times the strides, plus every replica combination, plus the offset. Independent of
``axedist.layout``'s own evaluation code on purpose.
"""

import itertools
import math


def brute_points(layout) -> list[list[dict]]:
    """For every logical index ``x``: the coordinates ``{axis: value}`` of each replica."""
    result = []
    for x in range(math.prod(it.extent for it in layout.shard)):
        base = dict(layout.offset)
        rest = x
        for it in reversed(layout.shard):
            base[it.axis] = base.get(it.axis, 0) + (rest % it.extent) * it.stride
            rest //= it.extent
        points = []
        for digits in itertools.product(*(range(it.extent) for it in layout.replica)):
            p = dict(base)
            for it, d in zip(layout.replica, digits):
                p[it.axis] = p.get(it.axis, 0) + d * it.stride
            points.append(p)
        result.append(points)
    return result
