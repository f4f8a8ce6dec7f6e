"""CUDA-graph capture as torch's recipe does it, for tests and benchmarks of captured steps."""
from __future__ import annotations

import torch

__all__ = ["capture"]


def capture(fn, warmups: int = 2):
    """``(graph, output)``: ``fn()`` run ``warmups`` times on a side stream (its plans, kernel
    compilation, workspaces and any host reads happen there, outside the capture), then once
    captured in a CUDA graph, whose ``output`` that call returned. ``graph.replay()`` reruns the
    captured kernels on the same memory: copy new inputs into the tensors ``fn`` reads first.

        >>> graph, out = capture(lambda: model(static_input))
        >>> static_input.copy_(next_input); graph.replay()   # out now holds the next result
    """
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(warmups):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        output = fn()
    return graph, output
