"""Triton kernels of axedist: flag primitives, p2p/multimem collectives, fused GEMM + reduce-scatter.

Nothing here is imported by `import axedist`; the modules that need Triton import it themselves,
so the package works on machines without Triton. `schedule` (pure Python) holds the index math
that the kernels implement and that the CPU tests check.
"""
